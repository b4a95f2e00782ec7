"""Throughput benchmark of the training scripts, measured in one run on the machine it is started on.

    bash run.sh bench [N] [--quick] [--output-dir DIR]        # N: processes for ddp/amp (default: GPUs, or 2)

Every measurement runs in its own fresh process with its thread count set by this script (OMP_NUM_THREADS), with
the same model (resnet18), crop size (64) and batch per process (32), on the built-in demo data:
  compute limit   forward + backward + SGD step on in-memory tensors, no data loading, all the threads (or the GPU);
                  on a CPU also N such processes side by side with the threads split, no all-reduce (the most
                  that ddp N, and so --accum-steps with no_sync, can reach)
  single, dp      train_single.py and train_dp.py with all the threads
  ddp N, amp N    train_ddp_torchrun.py and train_ddp_amp.py under torchrun, the threads split between processes
  accumulation    ddp N with --accum-steps 4 (no_sync) against ddp N with --accum-steps 1 (all-reduce every micro-step)
  data pipeline   images/s of the project's loader (builtin.ImageFiles + default collate) and of the textbook
                  ImageFolder + PIL + RandomResizedCrop + flip + ToTensor + Normalize, one process, one thread
  start-up        process start -> torch and torchvision imported (import), and -> first progress line (first step),
                  in one train_single.py process
On a CUDA machine (skipped on a CPU, with a line saying so), and alone with --gpu-only (bash run.sh gpucheck):
  GPU rows        resnet50 at 224 px, by value: the compute limit at batch 256 in fp32, TF32, bf16 autocast, bf16
                  + channels_last, and bf16 without cudnn.benchmark; amp 1 end to end on ~2,000 generated
                  ImageNet-sized JPEGs with the default --workers, the project's and the textbook pipeline feeding
                  the same bf16 step, amp 1 at fewer workers (how many loader cores keep one GPU busy),
                  train_single.py, GPU JPEG decoding (decode_jpeg on cuda). Each row has a time limit; rows that no
                  longer fit --gpu-budget are skipped and named; a row that crashes makes the exit status 1.
With --fsdp, instead (alone, bash run.sh bench --fsdp):
  FSDP rows       train_fsdp.py on the demo data in fp32, bf16 (BatchNorm in fp32), ZeRO-2 and HSDP 2 x 2 (4
                  processes), and train_ddp_torchrun.py beside them: steps/s and the bytes rank 0 holds
With --photos, instead (alone, bash run.sh bench --photos):
  photo rows      decode + 224-pixel training crop of photo-like JPEGs (quality 90) at 500 x 375, 1600 x 1200 and
                  4032 x 3024, img/s on one core: the project's pipeline before (every image decoded in full) and
                  after (large JPEGs decoded at 1/2, 1/4 or 1/8 scale), the textbook pipeline, and the project's on a
                  copy made by tools/shrink.py; interleaved repetitions on the same files, medians
The scripts run as they are; throughput is parsed from their progress lines ("... R img/s ..."), the first steps
dropped as warm-up: steady-state images / training time, start-up, evaluation and checkpoints excluded. All runs are
repeated (--repeats, default 3) and interleaved, the runs compared by a ratio next to each other; every figure is
the median over the repetitions, and every ratio the median of the ratios within each repetition of this run. The
"other load" column says how many cores processes not started by the bench used meanwhile: on a shared machine,
figures taken beside other work are slowed (2 compute threads on 2 cores lose far more than the share taken).
Results: a markdown table on stdout and <output-dir>/bench.json.
"""
import argparse
import json
import math
import os
import platform
import queue
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL, IMG_SIZE, BATCH = "resnet18", 64, 32
PROGRESS = re.compile(r"epoch (\d+)/(\d+)\s+step (\d+)/(\d+)\s+loss \S+\s+lr \S+\s+([\d.]+) img/s")
RESULT_TAG = "BENCH-RESULT "
IMPORTED_TAG = "BENCH-IMPORTED"
# train_single.py started through this, so that its import time and its first step are timed in the same process
TIMED_IMPORT = (f"import runpy, sys; import torch, torchvision; print({IMPORTED_TAG!r}, flush=True); "
                "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
GPU_MODEL, GPU_IMG, GPU_BATCH = "resnet50", 224, 256  # the compute limit's batch: fills a GPU, not an H200's memory
GPU_E2E_BATCH, GPU_WORKERS, GPU_JPEGS = 96, (2, 4, 8, 14), 2000  # 1,600 training images: 16 steps of 96
GPU_LIMIT_MODES = ("fp32", "tf32", "bf16", "bf16_channels_last", "bf16_without_cudnn_benchmark")
GPU_LIMIT_STEPS = (5, 20)  # warm-up (cuDNN's search; the compilation) and measured steps, whatever --quick says
# width, height, noise: ImageNet's size, 2 MP and a 12 MP phone photo (4.2 MiB), then a smoother one (2.5 MiB)
PHOTO_SOURCES = ((500, 375, 0.05), (1600, 1200, 0.05), (4032, 3024, 0.05), (4032, 3024, 0.025))
PHOTO_FILES, PHOTO_QUICK_FILES = (48, 24, 12, 12), (4, 2, 2, 0)
PHOTO_IMG, PHOTO_PIPELINES = 224, ("before", "after", "textbook", "shrunk")
PHOTO_TARGETS = {"after_vs_textbook": 3.5, "shrunk_vs_before": 50.0}  # at 12 MP, on one core
TARGETS = {"single_ratio": 0.97, "ddp_ratio": 0.90, "accum_speedup": 1.2, "loader_speedup": 2.0, "startup_s": 1.0}


# ------------------------------------------------------------------------------------------ child: probe
def probe_child(opts):
    """One fresh process: machine facts, compute limit, then both data pipelines on one thread."""
    import torch
    import torchvision
    sys.path.insert(0, str(REPO))
    import builtin
    import utils

    cuda = torch.cuda.is_available()
    root = builtin.demo_data()
    if opts.child_data:  # --tiny: the first 40 images of each class, linked, so that a whole epoch takes seconds
        root, demo = Path(opts.child_data), root
        for folder in sorted(path for path in demo.iterdir() if path.is_dir()):
            (root / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:40]:
                (root / folder.name / image.name).symlink_to(image)
    classes, train, _ = builtin.find_images(root, 0.2)
    result = {"torch": torch.__version__, "torchvision": torchvision.__version__, "cuda": cuda,
              "gpus": torch.cuda.device_count() if cuda else 0,
              "gpu": torch.cuda.get_device_name(0) if cuda else "none",
              "train_images": len(train), "classes": len(classes)}
    warmup, steps = opts.limit[2:] if cuda else opts.limit[:2]  # a GPU step takes milliseconds: many more
    result["compute_limit_img_s"] = compute_limit(torch, utils, len(classes), cuda, warmup, steps)
    torch.set_num_threads(1)  # the data pipelines: one loader process, one thread
    result.update(loaders(torch, torchvision, utils, root, train, opts.loader_batches))
    print(RESULT_TAG + json.dumps(result), flush=True)


def training_step(torch, utils, num_classes, device):
    """The training step alone (forward, backward, SGD step) on one batch of tensors already on the device."""
    import torch.nn.functional as F
    import builtin
    torch.manual_seed(0)
    model = builtin.resnet(MODEL, num_classes).to(device)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * BATCH / 256, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(BATCH, 3, IMG_SIZE, IMG_SIZE, device=device)
    labels = torch.randint(0, num_classes, (BATCH,), device=device)

    def step():
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def compute_limit(torch, utils, num_classes, cuda, warmup, steps):
    """img/s of the training step alone on tensors already on the device."""
    step = training_step(torch, utils, num_classes, torch.device("cuda" if cuda else "cpu"))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return steps * BATCH / (time.perf_counter() - start)


# ------------------------------------------------------------------------------------------ child: split limit
def split_child(opts):
    """The compute limit of N processes side by side on the CPU, the threads split between them, with no
    communication and no data loading: what DDP could reach if its all-reduces cost nothing, so the most that
    skipping them (--accum-steps with no_sync) can give."""
    import multiprocessing
    nproc, threads, num_classes = opts.child_split
    context = multiprocessing.get_context("spawn")
    barrier, done, rates = context.Barrier(nproc), context.Event(), context.Queue()
    warmup, steps = opts.limit[0], max(2, opts.limit[1] // nproc)  # a step on 1/N of the threads takes ~N x longer
    workers = [context.Process(target=split_worker, args=(threads, num_classes, warmup, steps, barrier, done, rates))
               for _ in range(nproc)]
    for worker in workers:
        worker.start()
    measured = []
    try:
        while len(measured) < nproc:
            try:
                measured.append(rates.get(timeout=1))
            except queue.Empty:
                if any(worker.exitcode not in (None, 0) for worker in workers):
                    raise RuntimeError("a compute-limit process failed (its traceback is above)") from None
    finally:
        done.set()  # each process keeps stepping until then, so that every measurement had all of them running
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
    print(RESULT_TAG + json.dumps({"img_s": sum(measured)}), flush=True)


def split_worker(threads, num_classes, warmup, steps, barrier, done, rates):
    import torch
    sys.path.insert(0, str(REPO))
    import utils
    torch.set_num_threads(threads)
    step = training_step(torch, utils, num_classes, torch.device("cpu"))
    for _ in range(warmup):
        step()
    barrier.wait(timeout=300)  # all warmed up: measure side by side
    start = time.perf_counter()
    for _ in range(steps):
        step()
    rates.put(steps * BATCH / (time.perf_counter() - start))
    while not done.is_set():
        step()


# ------------------------------------------------------------------------------------------ children: GPU rows
def gpu_limit_child(opts):
    """resnet50's training step on tensors already on the GPU, in each mode asked for, one after the other."""
    import torch
    if not torch.cuda.is_available():
        print(RESULT_TAG + json.dumps({"cuda": False}), flush=True)
        return
    warmup, steps = GPU_LIMIT_STEPS
    result = {"cuda": True, "gpu": torch.cuda.get_device_name(0)}
    for mode in opts.child_gpu_limit:
        result[mode] = gpu_step_rate(torch, mode, warmup, steps)
        torch.cuda.empty_cache()
    print(RESULT_TAG + json.dumps(result), flush=True)


def gpu_step_rate(torch, mode, warmup, steps):
    import torch.nn.functional as F
    import torchvision
    # fp32 means fp32: cuDNN allows TF32 for convolutions by default (torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode != "fp32"
    # fixed shapes: let cuDNN time its algorithms once (the scripts do; the last mode shows what that buys)
    torch.backends.cudnn.benchmark = mode != "bf16_without_cudnn_benchmark"
    layout = torch.channels_last if mode == "bf16_channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    model = torchvision.models.get_model(GPU_MODEL, num_classes=1000).cuda().to(memory_format=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(GPU_BATCH, 3, GPU_IMG, GPU_IMG, device="cuda").to(memory_format=layout)
    labels = torch.randint(0, 1000, (GPU_BATCH,), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode not in ("fp32", "tf32")):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    started = time.perf_counter()
    for _ in range(warmup):  # cuDNN's algorithm search
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return {"img_s": steps * GPU_BATCH / (time.perf_counter() - start), "warmup_s": start - started,
            "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def gpu_jpegs_child(opts):
    """GPU_JPEGS ImageNet-sized JPEGs (500 x 375, quality 90) in 10 class folders, written by every core."""
    import multiprocessing
    folder = Path(opts.child_gpu_jpegs)
    for label in range(10):
        (folder / f"class{label}").mkdir(parents=True, exist_ok=True)
    with multiprocessing.get_context("fork").Pool() as pool:
        sizes = pool.map(write_jpeg, [(folder, i) for i in range(GPU_JPEGS)], chunksize=25)
    print(RESULT_TAG + json.dumps({"images": len(sizes), "mean_kb": statistics.mean(sizes) / 1024}), flush=True)


def write_jpeg(job):
    folder, i = job
    return photo_jpeg(folder / f"class{i % 10}" / f"{i:05d}.jpg", 500, 375, i, 0.08)


def photo_jpeg(path, width, height, seed, noise):
    """A smooth random picture with fine noise: compresses to roughly a photo's size, not to a flat colour's (noise
    0.05 at quality 90: 69 KiB at 500 x 375, 4.2 MiB at 4032 x 3024)."""
    import torch
    import torch.nn.functional as F
    from PIL import Image
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, 6, 8, generator=generator)
    picture = F.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)[0]
    picture = (picture + noise * torch.randn(3, height, width, generator=generator)).clamp(0, 1)
    Image.fromarray((picture * 255).byte().permute(1, 2, 0).numpy()).save(path, quality=90)
    return Path(path).stat().st_size


# ------------------------------------------------------------------------------------------ children: photo rows
def photo_jpegs_child(opts):
    """The photo-like JPEGs of the photo rows, <folder>/<W>x<H>-<noise>/c<0|1>/, written by every core."""
    import multiprocessing
    folder, counts = Path(opts.child_photo_jpegs[0]), [int(c) for c in opts.child_photo_jpegs[1:]]
    jobs = []
    for (width, height, noise), count in zip(PHOTO_SOURCES, counts):
        for i in range(count):
            (folder / f"{width}x{height}-{noise}" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            jobs.append((folder / f"{width}x{height}-{noise}" / f"c{i % 2}" / f"{i:03d}.jpg", width, height, i, noise))
    with multiprocessing.get_context("fork").Pool() as pool:
        sizes = pool.starmap(photo_jpeg, jobs, chunksize=1)
    print(RESULT_TAG + json.dumps({"bytes": sizes}), flush=True)


def photos_child(opts):
    """img/s of each pipeline on each size's files, on one thread: the decode and the 224-pixel training crop (the
    project's uint8 tensors, the textbook's normalised floats). Repetitions interleaved, each in another order."""
    import torch
    import torchvision
    import torchvision.transforms as T
    sys.path.insert(0, str(REPO))
    import builtin
    import utils
    torch.set_num_threads(1)
    folder, shrunk, repeats, seconds = opts.child_photos[0], opts.child_photos[1], int(opts.child_photos[2]), \
        float(opts.child_photos[3])
    decode = builtin.decode_image

    def pipeline(name, size):
        root = Path(shrunk if name == "shrunk" else folder) / size
        if name == "textbook":
            dataset = torchvision.datasets.ImageFolder(str(root), T.Compose([
                T.RandomResizedCrop(PHOTO_IMG), T.RandomHorizontalFlip(), T.ToTensor(),
                T.Normalize(utils.MEAN, utils.STD)]))
            return len(dataset), lambda epoch, i: dataset[i]
        samples = builtin.FileList([(str(path), 0) for path in sorted(root.rglob("*.jpg"))])
        dataset = utils.SeededItems(builtin.ImageFiles(samples, PHOTO_IMG, train=True), seed=0)
        # before: without the scale callback every image is decoded in full, and its box drawn from the decoded size
        builtin.decode_image = (lambda path, scale=None: decode(path)) if name == "before" else decode
        return len(dataset), lambda epoch, i: dataset[(epoch, i)]

    def rate(name, size, epoch):
        count, item = pipeline(name, size)
        item(epoch, 0)  # warm-up: the first call of each path
        images, start = 0, time.perf_counter()
        while images < count or time.perf_counter() - start < seconds:  # every file once, and at least `seconds`
            item(epoch + images // count, images % count)
            images += 1
        return images / (time.perf_counter() - start)

    sizes = [f"{w}x{h}-{noise}" for w, h, noise in PHOTO_SOURCES if (Path(folder) / f"{w}x{h}-{noise}").is_dir()]
    rates = {size: {name: [] for name in PHOTO_PIPELINES} for size in sizes}
    for rep in range(repeats):
        for size in sizes:
            order = PHOTO_PIPELINES[rep % 4:] + PHOTO_PIPELINES[:rep % 4]  # a drift of the machine hits each alike
            for name in order:
                rates[size][name].append(rate(name, size, 1000 * rep))
    print(RESULT_TAG + json.dumps(rates), flush=True)


def photo_rows(opts, cores, tmp):
    """The photo rows: the JPEGs, their copy by tools/shrink.py (timed), then the pipelines on one core."""
    counts = PHOTO_QUICK_FILES if opts.quick else PHOTO_FILES
    repeats = opts.repeats or (1 if opts.quick else 5)
    opts.limit = opts.limit or (2, 5, 5, 20)  # passed on to every child, which ignores it
    folder, shrunk = tmp / "photos", tmp / "photos-shrunk"
    made = run_child(opts, "photo-like JPEGs", cores, "--child-photo-jpegs", str(folder), *map(str, counts))[0]
    start = time.perf_counter()
    code, lines, stderr, _, _ = run_process([sys.executable, str(REPO / "tools" / "shrink.py"), str(folder),
                                             str(shrunk)], child_env(1), opts.timeout)
    if code != 0:
        raise RuntimeError(f"tools/shrink.py failed (exit {code}):\n{stderr[-2000:]}")
    shrink_s = time.perf_counter() - start
    measured = run_child(opts, "photo pipelines", 1, "--child-photos", str(folder), str(shrunk), str(repeats),
                         "0.2" if opts.quick else "1.0")[0]
    rows, offset = [], 0
    for (width, height, noise), count in zip(PHOTO_SOURCES, counts):
        if not count:
            continue
        runs = measured[f"{width}x{height}-{noise}"]
        kib = statistics.mean(made["bytes"][offset:offset + count]) / 1024
        offset += count
        row = {"source": f"{width} x {height}", "noise": noise, "files": count, "mean_kib": kib,
               **{f"{name}_img_s": median(runs[name]) for name in PHOTO_PIPELINES},
               **{f"{name}_each": runs[name] for name in PHOTO_PIPELINES}}
        for key, (a, b) in (("after_vs_textbook", ("after", "textbook")), ("after_vs_before", ("after", "before")),
                            ("shrunk_vs_before", ("shrunk", "before"))):
            row[key] = median([ratio(x, y) for x, y in zip(runs[a], runs[b])])  # within each repetition
        rows.append(row)
    twelve = rows[2]  # 4032 x 3024, 4.2 MiB
    targets = {key: {"target": target, "value": twelve[key], "met": twelve[key] >= target}
               for key, target in PHOTO_TARGETS.items()}
    return {"rows": rows, "targets": targets, "repeats": repeats, "img_size": PHOTO_IMG, "shrink_s": shrink_s,
            "shrink_images": sum(counts), "shrink_cores": cores, "other_cores": measured["other_cores"],
            "config": {"quick": opts.quick}}


FSDP_ROWS = (("FSDP fp32", 2, []), ("FSDP bf16 (BatchNorm fp32)", 2, ["--amp-dtype", "bf16"]),
             ("ZeRO-2 (--no-reshard-after-forward)", 2, ["--no-reshard-after-forward"]),
             ("HSDP 2 x 2 (--hsdp 2)", 4, ["--hsdp", "2"]), ("DDP (train_ddp_torchrun.py)", 2, None))


def fsdp_rows(opts, cores, tmp):
    """train_fsdp.py with each option, on the demo data, the cores split between the processes: steps/s (steady
    state, from the progress lines) and, from results.json, the bytes of parameters, gradients and optimizer state
    rank 0 holds. Repetitions interleaved, medians. On a CPU these show what the communication costs, no more."""
    repeats, epochs = opts.repeats or (1 if opts.quick else 3), 1
    runs = {name: [] for name, _, _ in FSDP_ROWS}
    for rep in range(repeats):
        for name, nproc, flags in FSDP_ROWS:
            out = tmp / f"fsdp-{len(runs[name])}-{rep}-{nproc}"
            script = "train_ddp_torchrun.py" if flags is None else "train_fsdp.py"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script,
                   "--epochs", str(epochs), "-b", "16", "--print-freq", "1", "--output-dir", str(out), *(flags or [])]
            global_batch = 16 * nproc
            steps = (800 // global_batch) * epochs  # the demo's 800 training images
            run = run_training(cmd, child_env(max(1, cores // nproc)), global_batch, 2, steps - 2, 1, True, out,
                               opts.timeout)
            result = json.loads((out / "results.json").read_text())
            runs[name].append({"steps_s": run["img_s"] / global_batch, "bytes_per_rank": result.get("bytes_per_rank"),
                               "other_cores": run["other_cores"]})
            shutil.rmtree(out, ignore_errors=True)
            print(f"bench: fsdp repetition {rep + 1}/{repeats}: {name}", file=sys.stderr, flush=True)
    return [{"row": name, "processes": nproc, "steps_s": median(r["steps_s"] for r in runs[name]),
             "bytes_per_rank": runs[name][-1]["bytes_per_rank"], "other_cores": median(r["other_cores"] for r in
                                                                                        runs[name])}
            for name, nproc, _ in FSDP_ROWS]


def fsdp_table(rows):
    def fmt(x, digits=1):
        return "-" if x is None else f"{x:.{digits}f}"
    lines = ["| run | processes | steps/s | params + grads + optimizer per rank, MiB | other load |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        held = row["bytes_per_rank"]
        mib = "-" if not held else " + ".join(f"{held[k] / 2**20:.1f}" for k in ("params", "grads", "optimizer"))
        lines.append(f"| {row['row']} | {row['processes']} | {fmt(row['steps_s'], 2)} | {mib} | "
                     f"{fmt(row['other_cores'], 2)} |")
    return "\n".join(lines)


def photo_table(photos):
    def fmt(x, digits=1):
        return "-" if x is None else f"{x:.{digits}f}"
    lines = [f"# Photos: decode + {photos['img_size']} px training crop, img/s on one core (1 process, 1 thread), "
             f"photo-like JPEGs at quality 90; {photos['repeats']} interleaved repetition(s), medians", "",
             "| source | files | ours before (full decode) | ours after (reduced decode) | textbook (PIL) | "
             "ours on the shrunk copy | after / textbook | after / before | shrunk / before |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in photos["rows"]:
        lines.append(f"| {row['source']} ({row['mean_kib']:.0f} KiB) | {row['files']} | " + " | ".join(
            fmt(row[f"{name}_img_s"]) for name in PHOTO_PIPELINES) + f" | {fmt(row['after_vs_textbook'], 2)} | "
            f"{fmt(row['after_vs_before'], 2)} | {fmt(row['shrunk_vs_before'], 1)} |")
    lines.append("")
    for key, target in photos["targets"].items():
        lines.append(f"- at 12 MP (4.2 MiB), {key.replace('_vs_', ' / ')}: {fmt(target['value'], 2)} "
                     f"({'met' if target['met'] else 'missed'}: >= {target['target']})")
    lines.append(f"- tools/shrink.py made the copy (longer side <= 512 px) of {photos['shrink_images']} files in "
                 f"{photos['shrink_s']:.1f} s on {photos['shrink_cores']} core(s), start-up included")
    lines.append(f"- other load: {fmt(photos['other_cores'], 2)} cores used by processes not ours while the "
                 f"pipelines were measured: above ~0.1 the figures are slowed by others")
    return "\n".join(lines)


def gpu_feed_child(opts):
    """The bf16 resnet50 step fed by one pipeline's DataLoader (project: builtin.ImageFiles, uint8 tensors
    normalised on the GPU; textbook: ImageFolder + PIL + RandomResizedCrop + flip + ToTensor + Normalize)."""
    import torch
    import torch.nn.functional as F
    import torchvision
    import torchvision.transforms as T
    from torch.utils.data import DataLoader
    sys.path.insert(0, str(REPO))
    import builtin
    import utils
    pipeline, workers, folder = opts.child_gpu_feed
    warmup, steps = 4, 12
    _, train, _ = builtin.find_images(folder, 0.2)
    if pipeline == "project":  # asked for (epoch, index), as the scripts' EpochSampler does
        dataset = utils.SeededItems(builtin.ImageFiles(train, GPU_IMG, train=True), seed=0)
        order = utils.EpochSampler(torch.utils.data.RandomSampler(dataset))
    else:
        dataset = torchvision.datasets.ImageFolder(folder, T.Compose([
            T.RandomResizedCrop(GPU_IMG), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(utils.MEAN, utils.STD)]))
        order = torch.utils.data.RandomSampler(dataset)
    loader = DataLoader(dataset, GPU_E2E_BATCH, sampler=order, num_workers=int(workers), pin_memory=True,
                        drop_last=True, persistent_workers=True)
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.get_model(GPU_MODEL, num_classes=10).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    done, start = 0, None
    while done < warmup + steps:
        for images, labels in loader:
            if done == warmup:
                torch.cuda.synchronize()
                start = time.perf_counter()
            images, labels = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
            if images.dtype == torch.uint8:
                images = utils.normalize(images)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == warmup + steps:
                break
    torch.cuda.synchronize()
    print(RESULT_TAG + json.dumps({"img_s": steps * GPU_E2E_BATCH / (time.perf_counter() - start)}), flush=True)


def gpu_decode_child(opts):
    """torchvision.io.decode_jpeg(device="cuda") on batches of the generated JPEGs' bytes (nvJPEG), img/s."""
    import torch
    import torchvision.io as io
    files = sorted(Path(opts.child_gpu_decode).rglob("*.jpg"))[:256]
    data = [io.read_file(str(path)) for path in files]
    batch = 64
    batches = [data[i:i + batch] for i in range(0, len(data) - batch + 1, batch)]
    for chunk in batches[:2]:  # warm-up: nvJPEG's handles and buffers
        io.decode_jpeg(chunk, device="cuda")
    torch.cuda.synchronize()
    start, images = time.perf_counter(), 0
    for _ in range(5):
        for chunk in batches:
            images += len(io.decode_jpeg(chunk, device="cuda"))
    torch.cuda.synchronize()
    print(RESULT_TAG + json.dumps({"img_s": images / (time.perf_counter() - start), "batch": batch}), flush=True)


def loaders(torch, torchvision, utils, root, train, batches):
    """Images/s of the project's training data path and of the textbook one, alternated, on the same files."""
    from torch.utils.data import DataLoader, Subset
    import torchvision.transforms as T
    import builtin
    project = utils.SeededItems(builtin.ImageFiles(train, IMG_SIZE, train=True), seed=0)
    shuffle = torch.Generator().manual_seed(0)
    project_loader = DataLoader(project, BATCH, sampler=utils.EpochSampler(
        torch.utils.data.RandomSampler(project, generator=shuffle)), num_workers=0, drop_last=True)
    textbook = torchvision.datasets.ImageFolder(str(root), T.Compose([
        T.RandomResizedCrop(IMG_SIZE), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(utils.MEAN, utils.STD)]))
    wanted = {(Path(path).parent.name, Path(path).name) for path, _ in train}
    textbook = Subset(textbook, [i for i, (path, _) in enumerate(textbook.samples)
                                 if (Path(path).parent.name, Path(path).name) in wanted])
    textbook_loader = DataLoader(textbook, BATCH, shuffle=True, num_workers=0, drop_last=True)

    def rate(loader):
        images, start = 0, None
        while True:
            for i, (batch, _) in enumerate(loader):
                if start is None and i == 1:  # the first batch warms up (file cache, first calls)
                    start, images = time.perf_counter(), 0
                images += len(batch)
                if start is not None and images >= batches * BATCH:
                    return images / (time.perf_counter() - start)

    rates = {"loader": [], "classic_loader": []}
    for _ in range(2):  # alternate, so that a burst of load elsewhere hits both
        rates["loader"].append(rate(project_loader))
        rates["classic_loader"].append(rate(textbook_loader))
    return {f"{name}_img_s": statistics.mean(values) for name, values in rates.items()}


# ------------------------------------------------------------------------------------------ parent: runs
class CpuMeter:
    """CPU seconds used on the whole machine and by our finished child processes: what the others took meanwhile."""

    def __init__(self):
        self.start = time.perf_counter(), self.machine(), self.ours()

    @staticmethod
    def machine():
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except (OSError, ValueError):
            return None
        return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    @staticmethod
    def ours():
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    def other_cores(self, ours_unreaped=0.0):
        """Average number of cores busy with processes not ours since the start (None where unknown).

        ours_unreaped: CPU seconds of our processes that no one of ours waits for (killed grandchildren)."""
        wall0, machine0, ours0 = self.start
        machine = self.machine()
        if machine is None or machine0 is None:
            return None
        ours = self.ours() - ours0 + ours_unreaped
        return max(0.0, (machine - machine0 - ours) / max(time.perf_counter() - wall0, 1e-9))


def process_tree(root):
    """The pids of root's descendants (from /proc; [] elsewhere) and the CPU seconds they and their reaped children
    have used so far."""
    children, cpu = {}, {}
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else []:
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
        cpu[int(entry.name)] = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found, sum(cpu[pid] for pid in found)


def kill_tree(proc):
    """SIGKILL a run at once, launcher and every descendant: torchrun starts its workers in sessions of their own,
    and the scripts answer SIGTERM by finishing the step and saving. Returns the CPU seconds of the descendants,
    which no process of ours will wait for."""
    pids, cpu = process_tree(proc.pid)
    UNREAPED[0] += cpu
    for pid in [proc.pid] + pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.perf_counter() + 10
    while pids and time.perf_counter() < deadline:  # gone (or a zombie) before the next measurement starts
        alive = []
        for pid in pids:
            try:
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
            except (OSError, IndexError):
                pass
        pids = alive
        time.sleep(0.02)
    return cpu


UNREAPED = [0.0]  # CPU seconds of killed descendants, which no process of ours waited for (see kill_tree)
WAIT_QUIET = [0.0]  # --wait-quiet: seconds to wait before each run for the other processes to calm down


def wait_until_quiet(max_wait, threshold=0.15):
    """Wait (at most max_wait seconds) until processes not ours use under `threshold` cores over a second."""
    deadline = time.perf_counter() + max_wait
    while time.perf_counter() < deadline:
        meter = CpuMeter()
        time.sleep(1)
        others = meter.other_cores()
        if others is None or others < threshold:
            return


def run_process(cmd, env, timeout, stop=None):
    """Run cmd in its own session; return (returncode, [(seconds since start, line)], stderr, other_cores, wall).

    stop(lines) -> True ends the run early (SIGKILL to the launcher and all its descendants).
    """
    if WAIT_QUIET[0]:
        wait_until_quiet(WAIT_QUIET[0])
    meter = CpuMeter()
    start = time.perf_counter()
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                            start_new_session=True)  # its own session: never our terminal's signals
    timed_out = threading.Event()
    timer = threading.Timer(timeout, lambda: (timed_out.set(), kill_tree(proc)))
    timer.start()
    lines, unreaped = [], 0.0
    try:
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))
            if stop and stop(lines):
                unreaped = kill_tree(proc)
                break
    except BaseException:  # Ctrl-C or SIGTERM: the run is in a session of its own, so end it here
        kill_tree(proc)
        raise
    finally:
        proc.stdout.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            proc.wait()
        timer.cancel()
    wall = time.perf_counter() - start
    err.seek(0)
    stderr = err.read()
    err.close()
    if timed_out.is_set():
        raise RuntimeError(f"timed out after {timeout}s: {' '.join(cmd)}\n{stderr[-2000:]}")
    return proc.returncode, lines, stderr, meter.other_cores(unreaped), wall


def child_env(threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env.pop("TORCHELASTIC_MAX_RESTARTS", None)
    return env


def run_child(opts, what, threads, *args, timeout=None):
    """Run this script as a measuring child; its result line as a dict, plus the lines it printed (timed)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args, "--limit", *map(str, opts.limit),
           "--timeout", str(opts.timeout), *(["--tiny"] if opts.tiny else [])]
    code, lines, stderr, others, wall = run_process(cmd, child_env(threads), timeout or opts.timeout)
    found = [line[len(RESULT_TAG):] for _, line in lines if line.startswith(RESULT_TAG)]
    if code != 0 or not found:
        raise RuntimeError(f"the {what} failed (exit {code}):\n{stderr[-3000:]}")
    return dict(json.loads(found[0]), other_cores=others, wall_s=wall), lines


def run_probe(opts, threads):
    data = ["--child-data", str(opts.data)] if opts.tiny and not opts.data.exists() else []
    return run_child(opts, "probe process", threads, "--child-probe", "--loader-batches", str(opts.loader_batches),
                     *data)[0]


def run_split(opts, nproc, per_proc, num_classes):
    return run_child(opts, "split compute-limit processes", per_proc, "--child-split", str(nproc), str(per_proc),
                     str(num_classes))[0]


def run_training(cmd, env, global_batch, warm_steps, measure_steps, print_freq, complete, output_dir, timeout):
    """Run a training script; its steady-state img/s from the progress lines after warm_steps optimizer steps.

    A line's img/s covers the optimizer steps since the previous line (of the same epoch): its images over that
    rate is its training time. complete: let the script finish (for results.json), else stop after enough steps.
    """
    def parse(lines):
        steps, prev = [], {}
        for t, line in lines:
            m = PROGRESS.search(line)
            if m:
                epoch, step, per_epoch, rate = int(m[1]), int(m[3]), int(m[4]), float(m[5])
                done_before = (epoch - 1) * per_epoch + prev.get(epoch, 0)
                steps.append({"t": t, "first": done_before, "steps": step - prev.get(epoch, 0), "rate": rate})
                prev[epoch] = step
        return steps

    def enough(lines):
        steps = parse(lines)
        return bool(steps) and steps[-1]["first"] + steps[-1]["steps"] >= warm_steps + measure_steps

    code, lines, stderr, others, wall = run_process(cmd, env, timeout, stop=None if complete else enough)
    steps = parse(lines)
    if (complete and code != 0) or not steps:
        tail = "\n".join(line for _, line in lines[-5:])
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {code}):\n{tail}\n{stderr[-3000:]}")
    measured = [s for s in steps if s["first"] >= warm_steps]
    if not measured:
        raise RuntimeError(f"{' '.join(cmd)}: no progress line after the {warm_steps} warm-up steps")
    images = sum(s["steps"] * global_batch for s in measured)
    seconds = sum(s["steps"] * global_batch / s["rate"] for s in measured)
    run = {"img_s": images / seconds, "first_line_s": steps[0]["t"], "measured_steps": sum(s["steps"] for s in measured),
           "other_cores": others, "wall_s": wall}
    if print_freq == 1:
        run["first_step_s"] = steps[0]["t"]
    run["import_s"] = next((t for t, line in lines if line == IMPORTED_TAG), None)  # started with TIMED_IMPORT
    return run


# ------------------------------------------------------------------------------------------ parent: plan
def plan(opts, info, threads, nproc, tmp):
    """The training runs of one repetition: name -> function(rep) returning a run record."""
    py = sys.executable
    per_proc = max(1, threads // nproc)
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    train = info["train_images"]
    pf = opts.print_freq

    def spec(name, launcher, script, procs, thread_count, accum=1, first_only=False):
        per_rank = train // procs if procs > 1 else train
        steps_per_epoch = (per_rank // BATCH) // accum
        if steps_per_epoch < 1:
            return None
        global_batch = BATCH * procs * accum if script.startswith("train_ddp") else BATCH
        if first_only:
            warm, measure = 0, 1
        elif accum > 1:
            warm, measure = 1, opts.accum_steps_measured
        else:
            warm = opts.warmup_steps
            measure = max(1, math.ceil(opts.images / global_batch))
        if pf > 1 and not first_only:  # whole progress lines: one line covers pf steps
            warm, measure = math.ceil(warm / pf) * pf, math.ceil(measure / pf) * pf
        epochs = max(1, math.ceil((warm + measure) / steps_per_epoch))
        args = ["--epochs", str(epochs), "--print-freq", "1" if first_only else str(pf)]
        if opts.tiny:  # (else the scripts' defaults on the demo data: IMG_SIZE and BATCH); bf16 asked for by name
            args += ["--img-size", str(IMG_SIZE), "-b", str(BATCH), "--data-path", str(opts.data)]
            args += ["--amp-dtype", "bf16"] if "amp" in script else []
        if accum > 1:
            args += ["--accum-steps", str(accum)]

        def go(rep):
            out = tmp / f"{name}-{rep}"
            cmd = launcher + [script, "--output-dir", str(out)] + args
            run = run_training(cmd, child_env(thread_count), global_batch, warm, measure, 1 if first_only else pf,
                               False, out, opts.timeout)
            run["cmd"] = " ".join([Path(c).name if c == py else "TIMED_IMPORT" if c == TIMED_IMPORT else c
                                   for c in cmd]).replace(str(out), "<tmp>")
            shutil.rmtree(out, ignore_errors=True)
            return run
        return go

    runs = {
        "single": spec("single", [py, "-c", TIMED_IMPORT], "train_single.py", 1, threads),
        "dp": spec("dp", [py], "train_dp.py", 1, threads),
        "ddp": spec("ddp", torchrun, "train_ddp_torchrun.py", nproc, per_proc),
        "amp": spec("amp", torchrun, "train_ddp_amp.py", nproc, per_proc),
        "accum": spec("accum", torchrun, "train_ddp_torchrun.py", nproc, per_proc, accum=4),
    }
    if pf != 1:  # time to first step needs a progress line after the first step
        runs["startup"] = spec("startup", [py, "-c", TIMED_IMPORT], "train_single.py", 1, threads, first_only=True)
    return {name: go for name, go in runs.items() if go is not None}


# ------------------------------------------------------------------------------------------ parent: GPU rows
def gpu_rows(opts, cores, threads, tmp):
    """The GPU rows, the most telling first, each within its own time limit; a row that no longer fits in
    --gpu-budget is skipped and named, so the whole part ends in time. {"skipped_all": why} without CUDA. A row that
    crashes (as opposed to not fitting) is listed under "crashed", and the bench then exits with status 1.

    By value: the compute limits (what the GPU can do), the amp rung end to end with the default loader workers (the
    share of that limit a user gets), the project's and the textbook pipeline feeding the same step, then the other
    worker counts, train_single.py, and GPU JPEG decoding. The limits are a few times each row's expected time on one
    H200 with 16 cores (a training run ~12 s, four precisions ~40 s). torch.compile is left out: a cold compile of
    resnet50 takes minutes, more than the whole budget."""
    deadline = time.perf_counter() + opts.gpu_budget
    opts.limit = opts.limit or (2, 5, 5, 20)  # --limit is passed on to every child; the GPU children set their own
    rows, skipped, crashed = [], [], []

    def fits(what, limit):
        left = deadline - time.perf_counter()
        if left < limit:
            skipped.append(f"{what}: {left:.0f} s of --gpu-budget left, and it may take {limit} s")
        return left >= limit

    def failed(what, error):  # a timeout did not fit; anything else crashed
        first = str(error).strip().splitlines()[0]
        (skipped if first.startswith("timed out") else crashed).append(f"{what}: {first}")

    def child(what, limit, *args):
        if not fits(what, limit):
            return None
        try:
            return run_child(opts, what, threads, *args, timeout=limit)[0]
        except RuntimeError as error:  # say so, and go on with the next row
            failed(what, error)
            return None

    def train(name, launcher, script, count):
        what, img_s = f"{name} --workers {count}", None
        if made and fits(what, 45):
            out = tmp / f"gpu-{script}-{count}"
            cmd = launcher + [script, "--data-path", str(jpegs), "--model", GPU_MODEL, "--img-size", str(GPU_IMG),
                              "-b", str(GPU_E2E_BATCH), "--workers", str(count), "--epochs", "1", "--print-freq",
                              "2", "--output-dir", str(out)]
            try:  # 16 steps of 96 per epoch: 4 of warm-up, 12 measured, then stopped
                img_s = run_training(cmd, child_env(threads), GPU_E2E_BATCH, 4, 12, 2, False, out, 45)["img_s"]
            except RuntimeError as error:
                failed(what, error)
            shutil.rmtree(out, ignore_errors=True)
        rows.append({"row": f"{what}, {GPU_IMG} px, batch {GPU_E2E_BATCH}", "img_s": img_s})

    limits = child("GPU compute limit", 90, "--child-gpu-limit", *GPU_LIMIT_MODES)
    if limits and not limits["cuda"]:
        return {"skipped_all": "no CUDA GPU on this machine"}
    for mode in GPU_LIMIT_MODES:
        rows.append({"row": f"compute limit {mode}, batch {GPU_BATCH}",
                     **(limits[mode] if limits else {"img_s": None})})
    jpegs = tmp / "jpegs"
    made = child("ImageNet-sized JPEGs", 45, "--child-gpu-jpegs", str(jpegs))
    py = sys.executable
    amp = ("amp 1 (bf16)", [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"],
           "train_ddp_amp.py")
    default = max(1, cores - 1)  # the scripts' default on one GPU: the cores less the one that trains
    train(*amp, default)
    for pipeline in ("project", "textbook"):
        fed = made and child(f"{pipeline} pipeline feeding the bf16 step", 45, "--child-gpu-feed", pipeline,
                             str(default), str(jpegs))
        rows.append({"row": f"{pipeline} pipeline, {default} workers, feeding the bf16 step",
                     "img_s": fed["img_s"] if fed else None})
    workers = [w for w in GPU_WORKERS if w < default]
    for count in workers:
        train(*amp, count)
    train("train_single.py", [py], "train_single.py", default)
    decoded = made and child("GPU JPEG decode", 30, "--child-gpu-decode", str(jpegs))
    rows.append({"row": "decode_jpeg(device=\"cuda\"), batches of 64 (500 x 375)",
                 "img_s": decoded["img_s"] if decoded else None})
    return {"model": GPU_MODEL, "img_size": GPU_IMG, "jpegs": made, "workers": [default, *workers], "rows": rows,
            "skipped": skipped, "crashed": crashed, "budget_s": opts.gpu_budget}


def gpu_table(gpu):
    if "skipped_all" in gpu:
        return (f"- GPU rows ({GPU_MODEL} at {GPU_IMG} px: precisions, loader cores, GPU JPEG "
                f"decode): skipped, {gpu['skipped_all']} (bash run.sh gpucheck runs them on a GPU machine)")
    lines = ["", f"# GPU rows: {gpu['model']}, {gpu['img_size']} px", "", "| run | img/s | warm-up s | max GiB |",
             "|---|---:|---:|---:|"]
    for row in gpu["rows"]:
        cells = [row.get(key) for key in ("img_s", "warmup_s", "max_memory_gib")]
        lines.append(f"| {row['row']} | " + " | ".join("-" if x is None else f"{x:.1f}" for x in cells) + " |")
    lines += [f"- not measured: {why}" for why in gpu["skipped"]]
    lines += [f"- CRASHED: {why}" for why in gpu.get("crashed", [])]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ parent: main
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--nproc", type=int, help="processes for ddp and amp (default: the GPUs, or 2 on a CPU)")
    parser.add_argument("--threads", type=int, help="compute threads of a one-process run; a run of N processes "
                        "gets threads/N each (default: the cores this process may use)")
    parser.add_argument("--quick", action="store_true", help="one repetition and fewer steps (a smoke test)")
    parser.add_argument("--tiny", action="store_true", help="--quick at a 32-pixel crop, batch 8 and the fewest steps: "
                        "every figure, none of them telling (the test suite's run)")
    parser.add_argument("--repeats", type=int, help="repetitions of every measurement (default 3, 1 with --quick)")
    parser.add_argument("--output-dir", default="runs/bench", help="where bench.json goes")
    parser.add_argument("--print-freq", type=int, help="--print-freq of the training runs (default: 1 on a CPU, "
                        "where a progress line costs nothing, 10 on a GPU, where loss.item() syncs; then separate "
                        "runs give the time to first step)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds any one run may take")
    parser.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS",
                        help="on a shared machine: before each run, wait up to SECONDS for other processes to use "
                        "under 0.15 cores (each run's 'other load' is reported either way)")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU rows (bash run.sh gpucheck)")
    parser.add_argument("--gpu-budget", type=int, default=420, help="seconds for all the GPU rows together")
    parser.add_argument("--fsdp", action="store_true", help="only the FSDP rows: fp32, bf16, ZeRO-2, HSDP 2 x 2 "
                        "and DDP, steps/s and bytes per rank")
    parser.add_argument("--photos", action="store_true", help="only the photo rows: our data pipeline before and "
                        "after reduced JPEG decoding, the textbook one and a shrunk copy, at 3 photo sizes")
    # the probe children (internal)
    parser.add_argument("--child-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-gpu-limit", nargs="+", help=argparse.SUPPRESS)  # modes
    parser.add_argument("--child-gpu-jpegs", help=argparse.SUPPRESS)  # folder
    parser.add_argument("--child-gpu-feed", nargs=3, help=argparse.SUPPRESS)  # pipeline, workers, folder
    parser.add_argument("--child-gpu-decode", help=argparse.SUPPRESS)  # folder
    parser.add_argument("--child-split", type=int, nargs=3, help=argparse.SUPPRESS)  # processes, threads, classes
    parser.add_argument("--child-photo-jpegs", nargs="+", help=argparse.SUPPRESS)  # folder, files of each source
    parser.add_argument("--child-photos", nargs=4, help=argparse.SUPPRESS)  # folder, shrunk, repeats, seconds
    parser.add_argument("--limit", type=int, nargs=4, help=argparse.SUPPRESS)  # warm-up, steps: CPU, then GPU
    parser.add_argument("--loader-batches", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-data", help=argparse.SUPPRESS)  # --tiny: where the probe links a few demo images
    opts = parser.parse_args()
    if opts.tiny:  # in the children too (run_child passes it on), so that they measure the same crop and batch
        global IMG_SIZE, BATCH
        IMG_SIZE, BATCH, opts.quick = 32, 8, True
    if opts.child_probe:
        return probe_child(opts)
    if opts.child_split:
        return split_child(opts)
    for name, run in (("child_gpu_limit", gpu_limit_child), ("child_gpu_jpegs", gpu_jpegs_child),
                      ("child_gpu_feed", gpu_feed_child), ("child_gpu_decode", gpu_decode_child),
                      ("child_photo_jpegs", photo_jpegs_child), ("child_photos", photos_child)):
        if getattr(opts, name):
            return run(opts)

    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # so that the run in progress is ended too
    WAIT_QUIET[0] = opts.wait_quiet
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = opts.threads or cores
    repeats = opts.repeats or (1 if opts.quick else 3)
    if min(threads, repeats, opts.nproc or 1) < 1:
        parser.error("--threads, --repeats and --nproc must be positive")
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    meter = CpuMeter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    try:
        if opts.photos:
            results = {"machine": {"cpu": cpu_model(), "cores": cores}, "photos": photo_rows(opts, cores, tmp)}
        elif opts.fsdp:
            utils_demo = subprocess.run([sys.executable, "-c", "import builtin; builtin.demo_data()"], cwd=REPO)
            if utils_demo.returncode:
                raise SystemExit("bench: the demo data could not be made")
            results = {"machine": {"cpu": cpu_model(), "cores": cores}, "fsdp": fsdp_rows(opts, cores, tmp)}
        else:
            results = {"machine": {}} if opts.gpu_only else measure(opts, cores, threads, repeats, tmp)
            # on a CPU the probe already said there is no GPU: no process started to find out again
            cuda = opts.gpu_only or results["config"]["device"] == "cuda"
            results["gpu"] = gpu_rows(opts, cores, threads, tmp) if cuda else {"skipped_all": "no CUDA GPU on this "
                                                                                               "machine"}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["machine"].update(load_before=load_before, other_cores_during=meter.other_cores(UNREAPED[0]),
                              load_after=os.getloadavg()[0] if hasattr(os, "getloadavg") else None)
    results["wall_s"] = time.perf_counter() - started
    output_dir = Path(opts.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    if opts.photos:
        print(photo_table(results["photos"]))
    elif opts.fsdp:
        print(fsdp_table(results["fsdp"]))
    elif not opts.gpu_only:
        print(table(results))
    if not (opts.photos or opts.fsdp):
        print(gpu_table(results["gpu"]))
    print(f"\nbench.json in {output_dir}; {results['wall_s']:.0f}s in all")
    if results.get("gpu", {}).get("crashed"):
        print(f"bench: {len(results['gpu']['crashed'])} GPU row(s) crashed (listed above)", file=sys.stderr)
        return 1
    return 0


def measure(opts, cores, threads, repeats, tmp):
    # The defaults on a CPU: about 640 measured images per training run after 3 warm-up steps.
    quick = opts.quick
    opts.limit = (2, 5, 5, 20) if quick else (3, 20, 20, 200)  # compute limit: warm-up and steps, CPU then GPU
    opts.loader_batches = 6 if quick else 20
    opts.warmup_steps, opts.images = (2, 96) if quick else (3, 640)
    opts.accum_steps_measured = 2 if quick else 5
    if opts.tiny:
        opts.limit, opts.loader_batches, opts.warmup_steps, opts.images = (1, 2, 5, 20), 2, 1, 2 * BATCH
        opts.accum_steps_measured = 1
        opts.data = tmp / "tiny-data"  # (made by the probe)

    info = run_probe(opts, threads)  # first: it also tells whether there is a GPU
    cuda = info["cuda"]
    nproc = opts.nproc or (info["gpus"] if cuda else 2)
    if cuda:  # a GPU step takes milliseconds: many more steps, and a progress line only every 10
        opts.warmup_steps, opts.images = (5, 320) if quick else (20, 6400)
        opts.accum_steps_measured = 2 if quick else 10
        if not opts.print_freq:
            opts.print_freq = 10
    opts.print_freq = opts.print_freq or 1
    runners = {"probe": lambda rep: run_probe(opts, threads), **plan(opts, info, threads, nproc, tmp)}
    if not cuda and nproc > 1:  # on GPUs each process has a GPU of its own: the ideal is N x the compute limit
        runners["split"] = lambda rep: run_split(opts, nproc, max(1, threads // nproc), info["classes"])
    # The runs compared by a ratio follow each other, and every other repetition goes in reverse order: a slow
    # drift of the machine's speed (seen here: +-10% over a minute) then hits both sides of each ratio alike.
    names = [name for name in ("probe", "single", "ddp", "split", "accum", "amp", "dp", "startup") if name in runners]
    runs = {"probe": [info]}
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            if rep == 0 and name == "probe":
                continue
            print(f"bench: repetition {rep + 1}/{repeats}: {name}", file=sys.stderr, flush=True)
            runs.setdefault(name, []).append(runners[name](rep))
    return summarize(opts, info, runs, cores, threads, nproc, repeats, cuda)


def median(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return statistics.median_low(values) if all(isinstance(v, int) for v in values) else statistics.median(values)


def ratio(a, b):
    return a / b if a is not None and b else None


def summarize(opts, info, runs, cores, threads, nproc, repeats, cuda):
    probes = runs["probe"]
    m = {name: median(x["img_s"] for x in rs) for name, rs in runs.items() if name != "probe"}
    limit = median(p["compute_limit_img_s"] for p in probes)
    started = runs.get("startup") or runs["single"]  # (their import and first step timed in one process each)
    first_step, import_s = (median(x.get(key) for x in started) for key in ("first_step_s", "import_s"))
    per_proc = max(1, threads // nproc)
    each = {}  # ratios within each repetition, between runs that followed each other

    def rep_ratio(name, a, a_key, b, b_key):
        each[name] = [ratio(x.get(a_key), y.get(b_key)) for x, y in zip(runs.get(a, []), runs.get(b, []))]
        return median(each[name])
    r = {
        "compute_limit_img_s": limit,
        "single_img_s": m["single"], "single_ratio": rep_ratio("single_ratio", "single", "img_s", "probe",
                                                                "compute_limit_img_s"),
        "dp_img_s": m["dp"], "dp_ratio": rep_ratio("dp_ratio", "dp", "img_s", "probe", "compute_limit_img_s"),
        "ddp_img_s": m["ddp"], "ddp_ratio": rep_ratio("ddp_ratio", "ddp", "img_s", "single", "img_s"),
        "amp_img_s": m["amp"], "amp_ratio": rep_ratio("amp_ratio", "amp", "img_s", "ddp", "img_s"),
        "compute_limit_split_img_s": m.get("split"),
        "accum_ceiling": rep_ratio("accum_ceiling", "split", "img_s", "ddp", "img_s"),
        "accum_img_s": m.get("accum"), "accum1_img_s": m["ddp"],
        "accum_speedup": rep_ratio("accum_speedup", "accum", "img_s", "ddp", "img_s"),
        "import_s": import_s, "first_step_s": first_step,
        "startup_s": first_step - import_s if first_step is not None and import_s is not None else None,
        "loader_img_s": median(p["loader_img_s"] for p in probes),
        "classic_loader_img_s": median(p["classic_loader_img_s"] for p in probes),
    }
    # the share of ideal scaling: on a CPU the N processes share the single run's cores (ideal: ddp = single);
    # on GPUs each process has a GPU of its own (ideal: N x single)
    r["ddp_scaling_efficiency"] = r["ddp_ratio"] / nproc if cuda and r["ddp_ratio"] else r["ddp_ratio"]
    r["loader_speedup"] = rep_ratio("loader_speedup", "probe", "loader_img_s", "probe", "classic_loader_img_s")
    r["ratios_each_repetition"] = each
    targets = dict(TARGETS)
    if cuda:  # a GPU each: the goal is N x single, 90% of it
        targets["ddp_scaling_efficiency"] = targets.pop("ddp_ratio")
    r["targets"] = {key: {"target": target, "value": r[key],
                          "met": None if r[key] is None else (r[key] <= target if key == "startup_s" else r[key] >= target)}
                    for key, target in targets.items()}
    r["machine"] = {"cpu": cpu_model(), "cores": cores, "gpu": info["gpu"], "gpus": info["gpus"],
                    "torch": info["torch"], "torchvision": info["torchvision"], "python": platform.python_version(),
                    "platform": platform.platform()}
    r["config"] = {"model": MODEL, "img_size": IMG_SIZE, "batch_per_process": BATCH, "nproc": nproc,
                   "device": "cuda" if cuda else "cpu", "threads_single": threads, "threads_per_process": per_proc,
                   "repeats": repeats, "quick": opts.quick, "tiny": opts.tiny, "print_freq": opts.print_freq,
                   "warmup_steps": opts.warmup_steps, "train_images": info["train_images"]}
    r["notes"] = [
        "img/s: steady-state images per second of training, from the scripts' progress lines after the warm-up "
        "steps (start-up, evaluation and checkpoints excluded); the median over the repetitions",
        "ratios: the median over the repetitions of the ratio between runs of the same repetition",
        "other_cores: cores used by processes not started by the bench while a run went on",
    ]
    if "accum" not in runs:
        r["notes"].append(f"accumulation not measured: {info['train_images']} training images over {nproc} "
                          f"processes are too few for a step of 4 x {BATCH} each")
    r["runs"] = runs
    return r


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table(r):
    c, mach, runs = r["config"], r["machine"], r["runs"]
    n, t1, tn = c["nproc"], c["threads_single"], c["threads_per_process"]
    gpu = c["device"] == "cuda"

    def where(procs):
        if gpu:
            return f"{procs} GPU" + "s" * (procs > 1)
        threads = t1 if procs == 1 else tn
        return f"{procs} x {threads} thread" + "s" * (threads > 1)

    def fmt(x, digits=1):
        return "-" if x is None else f"{x:.{digits}f}"

    def tgt(key):
        t = r["targets"].get(key)
        if not t or t["met"] is None:
            return ""
        bound = f" ({'<=' if key == 'startup_s' else '>='} {t['target']})" if isinstance(t["target"], float) else ""
        return ("met" if t["met"] else "missed") + bound

    def row(label, place, name, key, ratio_label="", ratio_key=None, digits=3):
        rs = runs.get(name, [])
        first = median(x.get("first_step_s") for x in runs.get("startup" if name == "single" else "", rs))
        return [label, place, fmt(median(x.get(key) for x in rs)), " ".join(fmt(x.get(key)) for x in rs) or "-",
                fmt(first, 2), ratio_label, fmt(r.get(ratio_key), digits) if ratio_key else "",
                tgt(ratio_key) if ratio_key else "", fmt(median(x.get("other_cores") for x in rs), 2)]

    rows = [
        row("compute limit: the step on in-memory tensors", where(1), "probe", "compute_limit_img_s"),
        row("train_single.py", where(1), "single", "img_s", "single / limit", "single_ratio"),
        row("train_dp.py", where(max(1, mach["gpus"])), "dp", "img_s", "dp / limit", "dp_ratio"),
        row(f"ddp {n}: train_ddp_torchrun.py", where(n), "ddp", "img_s",
            *(("ddp / (N x single)", "ddp_scaling_efficiency") if gpu else ("ddp / single", "ddp_ratio"))),
        row(f"amp {n}: train_ddp_amp.py (bf16)", where(n), "amp", "img_s", "amp / ddp", "amp_ratio"),
        row(f"ddp {n} --accum-steps 4 (no_sync)", where(n), "accum", "img_s", "accum 4 / accum 1", "accum_speedup"),
        row("data: project loader (ImageFiles)", "1 x 1 thread", "probe", "loader_img_s",
            "project / textbook", "loader_speedup", 2),
        row("data: textbook loader (ImageFolder, PIL)", "1 x 1 thread", "probe", "classic_loader_img_s"),
    ]
    if "split" in runs:
        rows.insert(1, row(f"compute limit: {n} processes side by side, no all-reduce", where(n), "split", "img_s",
                           "split / ddp: accum ceiling", "accum_ceiling"))
    for cells in rows:
        if cells[0].startswith(("compute limit", "data:")):
            cells[4] = "-"  # no training script: no first step
    others = mach.get("other_cores_during")
    lines = [f"# Benchmark: {MODEL}, {c['img_size']} px, batch {c['batch_per_process']} per process, demo data "
             f"({c['train_images']} training images)",
             f"{mach['cpu']}, {mach['cores']} cores, GPU: {mach['gpu']}, torch {mach['torch']}, "
             f"torchvision {mach['torchvision']}; {c['repeats']} repetition(s), medians"
             + (" (--quick)" if c["quick"] else ""), "",
             "| run | where | img/s | each run | first step s | ratio | value | target | other load |",
             "|---|---|---:|---|---:|---|---:|---|---:|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    lines += [""] + [f"- {note}" for note in r["notes"] if note.startswith("accumulation not measured")]
    lines += [
        *([f"- accumulation ceiling {fmt(r['accum_ceiling'], 3)}: {n} processes' compute limit side by side, with no "
           f"all-reduce and no data loading, over ddp {n}: skipping all-reduces cannot give more than that"]
          if r.get("accum_ceiling") else []),
        f"- start-up of train_single.py: first step {fmt(r['first_step_s'], 2)} s after process start, of which "
        f"{fmt(r['import_s'], 2)} s to import torch + torchvision: {fmt(r['startup_s'], 2)} s of its own "
        f"{tgt('startup_s')}",
        f"- ddp scaling efficiency {fmt(r['ddp_scaling_efficiency'], 3)} "
        f"({'ddp / (N x single): a GPU each' if gpu else 'ddp / single: the same cores, split between processes'})",
        f"- other load: cores used by processes not ours during each kind of run (median), "
        f"{fmt(others, 2)} on average over the whole bench (load average {fmt(mach.get('load_before'), 2)} before, "
        f"{fmt(mach.get('load_after'), 2)} after): above ~0.1 the figures are slowed by others",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
