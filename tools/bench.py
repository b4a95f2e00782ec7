# SPDX-License-Identifier: BSD-3-Clause
"""Throughput benchmark of the training scripts, measured in one run on the machine it is started on.

    bash run.sh bench [N] [--quick | --tiny] [--repeats R] [--output-dir DIR]   # N: processes of the DDP rows
    bash run.sh bench --gpu-only [--gpu-budget S]                               # the GPU rows alone (gpucheck)

Every training row, and every limit that bounds one, is timed the same way: the script runs as a plain subprocess
(python SCRIPT, or torchrun for the DDP rungs), with the same flags (resnet18, 64 px, batch 32 per process, 2 epochs
of the demo data), the threads as run.sh sets them (all the cores for one process, cores / N each for N), and its
figure is the second epoch's images over that epoch's training time, summed from its own progress lines (the first
epoch warms up; evaluation and checkpoints are left out). Rows:
  compute limit   train_single.py with its build_datasets() replaced (as docs/adapting.md tells a user to) by
                  random uint8 images already in memory, as many and as large: the same script and loop with
                  nothing to decode, so that single and dp cannot beat it by being timed differently
  single, dp      train_single.py and train_dp.py (unwrapped on a CPU), against the limit
  ddp N           train_ddp_torchrun.py under torchrun, against single on the same cores
  amp N           train_ddp_amp.py --amp-dtype bf16, against its own compute limit (its in-memory copy), and
                  beside ddp; skipped, with why, on a CPU without bf16 arithmetic
  accum 4         ddp N --accum-steps 4 (no_sync) against its ceiling: ddp N with one all-reduce per epoch
                  (--accum-steps = the epoch's micro-batches), the most that skipping all-reduces gives; beside ddp N
  loaders         the project's training data path (builtin.ImageFiles read through utils.SeededItems) against its
                  limit, the decode alone (the same files, each decoded at the same reduced scale, nothing else), and
                  beside the textbook ImageFolder + PIL + RandomResizedCrop + flip + ToTensor + Normalize; one
                  thread, timed in this process by torch.utils.benchmark (blocked_autorange): the demo data at
                  64 px, and generated 12 MP photo-like JPEGs at 224 px
  start-up        train_single.py's first progress line after its start, less its import of torch and torchvision
                  (Python's import profiler, PYTHONPROFILEIMPORTTIME, which every training row runs with) and less
                  the step that line follows (a batch at the single row's steady img/s): what the script does
                  before it trains
  drift check     the DDP rungs' comparison of the ranks' weights at each evaluation (dist_utils.check_replicas:
                  two sums a parameter, one all-reduce), on the bench's model in a group of this process alone,
                  timed as the data rows are, against the ddp row's epoch
The rows run --repeats times (3; 1 with --quick or --tiny), in alternating order; a figure is the median over the
repetitions, a ratio the median of the ratios within each. Each target is a fraction of a limit measured in the same
run; a target that the median misses but a repetition meets is "within noise" (the repetitions' range is shown).
"others": the cores that processes not started by the bench used during a row (/proc/stat): above ~0.1, others
slowed it. On a CUDA machine the GPU rows follow (resnet50 at 224 px on 2,000 generated ImageNet-sized JPEGs: amp 1
and train_single.py, each beside its in-memory limit, amp 1 with fewer loader workers), each within a time limit; a
row that no longer fits --gpu-budget is skipped and named, a row that crashes makes the exit status 1. Results: a
markdown table on stdout and <output-dir>/bench.json.
"""

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import re
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
sys.path.insert(0, str(REPO))  # utils and builtin, for the rows timed in this process
MODEL = "resnet18"
IMG_SIZE = 64  # --tiny sets 32
BATCH = 32  # --tiny sets 8
PHOTO_SIZE = (4032, 3024)  # a 12 MP phone photo
PHOTO_IMG = 224  # the default crop on such data
PROGRESS = re.compile(r"epoch (\d+)/\d+\s+step (\d+)/\d+\s+loss \S+\s+lr \S+\s+([\d.]+) img/s")
IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+(\d+) \| +(torch|torchvision)$")  # cumulative microseconds
# Each a fraction of a limit that the same run measures (start-up: seconds), so that a figure is judged against
# what this machine allows
TARGETS = {
    "single_ratio": 0.97,
    "ddp_ratio": 0.90,
    "amp_of_limit": 0.90,
    "accum_of_ceiling": 0.90,
    # 64 px: an 80 px JPEG decodes in ~0.17 ms, and the item's own work (its seeding, crop, resize, flip) and the
    # collate take ~0.12 ms more (measured: 0.60 of the decode alone); 12 MP: the decode is nearly all (1.01)
    "loader_of_decode": 0.50,
    "photo_loader_of_decode": 0.90,
    "startup_s": 1.0,
    "drift_check_of_epoch": 0.01,  # a hundredth of the demo's epoch at most; an ImageNet epoch is 1,600 times longer
}
LOWER_IS_BETTER = ("startup_s", "drift_check_of_epoch")
GPU_MODEL = "resnet50"
GPU_IMG = 224
GPU_BATCH = 96
GPU_WORKERS = (2, 4, 8, 14)
GPU_JPEGS = 2000  # 1,600 training images: 16 steps of 96


# ------------------------------------------------------------------------------------------ running a process
def cpu_sample():
    """(now, busy CPU seconds of the whole machine, CPU seconds of this process and its reaped descendants)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    times = os.times()
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    return time.perf_counter(), busy, times.user + times.system + times.children_user + times.children_system


def other_cores(before):
    """Cores that processes not started by the bench used since `before` (None where /proc/stat is missing)."""
    after = cpu_sample()
    if not (before and after):
        return None
    return max(0.0, (after[1] - before[1] - (after[2] - before[2])) / max(after[0] - before[0], 1e-9))


def run_process(cmd, threads, timeout, **env):
    """Run cmd in a session of its own (never our terminal's signals) to its end: ([(seconds, stdout line)], stderr,
    other cores). Its threads as run.sh would set them; a run that fails raises RuntimeError with its tail. Every
    process a run starts is reaped by its parent (the ranks' by torchrun), so their CPU time counts as ours."""
    # PYTHONPATH: the in-memory copies of the scripts import utils and builtin from here, as the scripts do
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **env)
    env.pop("TORCHELASTIC_MAX_RESTARTS", None)  # a measured run never restarts
    before = cpu_sample()
    start = time.perf_counter()
    expired = threading.Event()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )

        def kill():
            """The run's session; torchrun's ranks too: each has the parent-death signal set (require_launcher)."""
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        def expire():
            expired.set()
            kill()

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            lines = [(time.perf_counter() - start, line.rstrip("\n")) for line in proc.stdout]
            proc.wait()
        finally:  # also on Ctrl-C or SIGTERM of the bench: the run is in a session of its own
            timer.cancel()
            if proc.poll() is None:
                kill()
                proc.wait()
        err.seek(0)
        stderr = err.read()
    if proc.returncode:
        tail = [line for line in stderr.splitlines() if not line.startswith("import time:")][-30:]
        raise RuntimeError(
            f"{f'timed out after {timeout} s' if expired.is_set() else f'exit {proc.returncode}'}: "
            f"{' '.join(map(str, cmd))}\n" + "\n".join(tail)
        )
    return lines, stderr, other_cores(before)


def train(cmd, threads, timeout, output_dir):
    """One training row: the script's second epoch in img/s, the first step's and the imports' seconds after start."""
    lines, stderr, others = run_process(
        cmd + ["--output-dir", output_dir], threads, timeout, PYTHONPROFILEIMPORTTIME="1"
    )
    shutil.rmtree(output_dir, ignore_errors=True)
    batch = next(int(m[1]) for _, line in lines if (m := re.search(r"global batch (\d+)", line)))
    images = seconds = 0.0
    last = 0  # a line's img/s covers the steps since the epoch's previous line (the first: since its start)
    progress = [(t, PROGRESS.search(line)) for t, line in lines if PROGRESS.search(line)]
    for _, m in progress:
        if int(m[1]) == 2:
            images += (int(m[2]) - last) * batch
            seconds += (int(m[2]) - last) * batch / float(m[3])
            last = int(m[2])
    imported = {}  # the first (outermost) entry of each: its cumulative time
    for line in stderr.splitlines():
        if m := IMPORTED.match(line):
            imported.setdefault(m[2], int(m[1]) / 1e6)
    return {
        "img_s": images / seconds,
        "first_step_s": progress[0][0],
        "import_s": sum(imported.values()) or None,
        "others": others,
        "cmd": " ".join(str(c) for c in cmd[1:]).replace(str(REPO) + "/", ""),
    }


# ------------------------------------------------------------------------------------------ timed in this process
def timed(call, threads, seconds):
    """Seconds per call of call(): torch.utils.benchmark's blocked_autorange, its mean, the collector on."""
    import logging

    # torch.utils.benchmark imports cpp_extension, which warns "No CUDA runtime is found" where a CUDA toolkit is
    # installed without a GPU: nothing this bench uses
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    from torch.utils.benchmark import Timer

    call()  # the first: oneDNN's kernels chosen, files read into the cache
    timer = Timer("call()", setup="gc.enable()", globals={"call": call, "gc": gc}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=seconds).mean


def drift_check(seconds):
    """{"check_s": the seconds of dist_utils.check_replicas on the bench's model}, in a process group of this process
    alone (gloo), the model on the device the training rows use."""
    import torch
    import torch.distributed as dist
    import torchvision

    import dist_utils

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = torchvision.models.get_model(MODEL, num_classes=5).to("cuda" if torch.cuda.is_available() else "cpu")
    return {"check_s": timed(lambda: dist_utils.check_replicas(model), 1, seconds)}


class Decoded:
    """The project's decode alone: each file at the reduced scale its crop allows (builtin.ImageFiles.decode)."""

    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images.decode(index)[0]


def loaders(root, img_size, batch, seconds, epoch, order):
    """img/s of the project's training data path, of its decode alone and of the textbook path, one thread, on the
    same files."""
    import torchvision
    import torchvision.transforms as T
    from torch.utils.data import default_collate

    import builtin
    import utils

    textbook = torchvision.datasets.ImageFolder(
        str(root),
        T.Compose(
            [T.RandomResizedCrop(img_size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(utils.MEAN, utils.STD)]
        ),
    )
    images = builtin.ImageFiles(builtin.FileList(textbook.samples), img_size, train=True)
    project = utils.SeededItems(images, seed=0)
    decoded = utils.SeededItems(Decoded(images), seed=0)  # the same crops drawn: the same decode scales
    # a new crop every read, as the textbook's (an epoch a pass): 6 photos' 6 crops would fix their decode scales
    reads = {
        "project": lambda n: project[(epoch * (1 << 40) + n // len(project), 0, n % len(project))],
        "decode": lambda n: decoded[(epoch * (1 << 40) + n // len(project), 0, n % len(project))],
        "textbook": lambda n: textbook[n % len(project)],
    }
    before = cpu_sample()
    rates = {}
    for name in order:
        batches = (range(n, n + batch) for n in range(0, 1 << 40, batch))  # each call the next reads

        def read_batch(read=reads[name], batches=batches, collate=name != "decode"):
            items = [read(n) for n in next(batches)]
            return default_collate(items) if collate else items  # (decoded images differ in size)

        rates[name] = batch / timed(read_batch, 1, seconds)
    return {
        "img_s": rates["project"],
        "decode_img_s": rates["decode"],
        "textbook_img_s": rates["textbook"],
        "of_decode": rates["project"] / rates["decode"],
        "speedup": rates["project"] / rates["textbook"],
        "others": other_cores(before),
    }


def make_jpegs(folder, count, size, classes=1):
    """count photo-like JPEGs (smooth colours, fine noise, quality 90: 4.3 MiB at 12 MP) in class folders, by PIL."""
    import multiprocessing

    for label in range(classes):
        (Path(folder) / f"class{label}").mkdir(parents=True, exist_ok=True)
    jobs = [(Path(folder) / f"class{i % classes}" / f"{i:05d}.jpg", size, i) for i in range(count)]
    with multiprocessing.get_context("fork").Pool(min(len(jobs), os.cpu_count() or 1)) as pool:
        pool.starmap(write_jpeg, jobs)


def write_jpeg(path, size, seed):
    from PIL import Image, ImageChops

    colours = Image.frombytes("RGB", (8, 6), random.Random(seed).randbytes(8 * 6 * 3))
    noise = Image.merge("RGB", [Image.effect_noise(size, 13) for _ in range(3)])  # centred on 128
    ImageChops.add(colours.resize(size, Image.Resampling.BICUBIC), noise, offset=-128).save(path, quality=90)


IN_MEMORY = '''def build_datasets(args):
    """bench.py's compute limit: random uint8 images already in memory, as many and as large as the real ones."""
    import builtin
    classes, train_samples, val_samples = builtin.find_images(args.data_path or builtin.demo_data(), args.val_fraction)

    class InMemory(torch.utils.data.Dataset):
        def __init__(self, count):
            self.images = torch.randint(0, 256, (count, 3, args.img_size, args.img_size), dtype=torch.uint8)
            self.labels = torch.randint(0, len(classes), (count,)).tolist()

        def __len__(self):
            return len(self.labels)

        def __getitem__(self, index):
            return self.images[index], self.labels[index]
    return InMemory(len(train_samples)), InMemory(len(val_samples)), classes


'''


def in_memory(script, folder):
    """A copy of script whose build_datasets() gives images already in memory: the step with nothing to load."""
    source = (REPO / script).read_text()
    start = source.index("def build_datasets(")
    end = re.search(r"^(def|class) ", source[start + 1 :], re.M).start() + start + 1  # the next definition
    path = Path(folder) / f"in_memory_{script}"
    path.write_text(source[:start] + IN_MEMORY + source[end:])
    return path


# ------------------------------------------------------------------------------------------ the CPU (and everyday) rows
def measure(opts, cores, tmp):
    import torch

    import builtin
    import dist_utils

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    gpus = torch.cuda.device_count() if cuda else 0
    nproc = opts.nproc or (gpus if cuda else 2)
    threads = cores
    per_proc = 1 if cuda else max(1, threads // nproc)
    repeats = opts.repeats or (1 if opts.quick or opts.tiny else 3)
    # each loader row's
    if opts.tiny:
        seconds = 0.3
    elif opts.quick:
        seconds = 3.0
    else:
        seconds = 5.0
    data = builtin.demo_data()
    if opts.tiny:  # the first 20 images of each class, linked, so that an epoch takes a second
        demo = data
        data = tmp / "tiny-data"
        for folder in sorted(path for path in demo.iterdir() if path.is_dir()):
            (data / folder.name).mkdir(parents=True)
            for image in sorted(folder.iterdir())[:20]:
                (data / folder.name / image.name).symlink_to(image)
    _, train_samples, _ = builtin.find_images(data, 0.2)
    photos = tmp / "photos"
    make_jpegs(photos, 1 if opts.tiny else 6, PHOTO_SIZE)

    py = sys.executable
    flags = ["--data-path", data, "--img-size", IMG_SIZE, "-b", BATCH, "--epochs", 2, "--print-freq", 10 if cuda else 1]
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    micro_batches = len(train_samples) // nproc // BATCH  # per process and epoch
    scripts = {
        "limit": ([py, in_memory("train_single.py", tmp)], threads),
        "single": ([py, "train_single.py"], threads),
        "dp": ([py, "train_dp.py"], threads),
        "ddp": (torchrun + ["train_ddp_torchrun.py"], per_proc),
        "accum": (torchrun + ["train_ddp_torchrun.py", "--accum-steps", 4], per_proc),
        "ceiling": (torchrun + ["train_ddp_torchrun.py", "--accum-steps", micro_batches], per_proc),
        "amp": (torchrun + ["train_ddp_amp.py", "--amp-dtype", "bf16"], per_proc),
        "amp_limit": (torchrun + [in_memory("train_ddp_amp.py", tmp), "--amp-dtype", "bf16"], per_proc),
    }
    skipped = {}
    if opts.tiny:  # the same launch and parsing as single and accum: left out to keep the smoke test short
        skipped["dp"] = skipped["ceiling"] = skipped["amp_limit"] = "--tiny (timed as the row above it is)"
    if micro_batches < 4:
        skipped["accum"] = skipped["ceiling"] = (
            f"{len(train_samples)} training images are too few for {nproc} "
            f"processes x batch {BATCH} x 4 accumulation steps"
        )
    if not cuda and not dist_utils.cpu_computes_bf16():  # emulated bf16 is 10-30x slower than fp32: no figure
        skipped["amp"] = skipped["amp_limit"] = "this CPU has no bf16 arithmetic (AVX512-BF16/AMX)"
    runs = {name: [] for name in (*scripts, "loader", "photos", "drift") if name not in skipped}
    for rep in range(repeats):
        names = list(runs) if rep % 2 == 0 else list(runs)[::-1]  # a drift of the machine hits both sides
        for name in names:
            print(f"bench: repetition {rep + 1}/{repeats}: {name}", file=sys.stderr, flush=True)
            if name == "drift":
                runs[name].append(drift_check(seconds))
            elif name in ("loader", "photos"):
                order = ("project", "decode", "textbook")
                if rep % 2:
                    order = order[::-1]
                if name == "loader":
                    runs[name].append(loaders(data, IMG_SIZE, BATCH, seconds, rep, order))
                else:
                    runs[name].append(loaders(photos, PHOTO_IMG, 1, seconds, rep, order))
            else:
                cmd, count = scripts[name]
                runs[name].append(train(cmd + flags, count, opts.timeout, tmp / f"{name}-{rep}"))
    return summarize(
        runs,
        skipped,
        {
            "nproc": nproc,
            "device": device.type,
            "threads_single": threads,
            "threads_per_process": per_proc,
            "repeats": repeats,
            "quick": opts.quick,
            "tiny": opts.tiny,
            "img_size": IMG_SIZE,
            "batch_per_process": BATCH,
            "model": MODEL,
            "train_images": len(train_samples),
            "ceiling_accum_steps": micro_batches,
        },
        {"gpu": torch.cuda.get_device_name(0) if cuda else "none", "gpus": gpus, "torch": torch.__version__},
    )


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs, skipped, config, machine):
    def figure(name, key="img_s"):
        return median(run.get(key) for run in runs.get(name, []))

    each = {}

    def rep_ratio(name, a, b, scale=1):
        """The median of the ratios a / b / scale within each repetition: between rows that ran close together."""
        each[name] = [x["img_s"] / y["img_s"] / scale for x, y in zip(runs.get(a, []), runs.get(b, []))]
        return median(each[name])

    gpu = config["device"] == "cuda"
    r = {
        "compute_limit_img_s": figure("limit"),
        "single_img_s": figure("single"),
        "single_ratio": rep_ratio("single_ratio", "single", "limit"),
        "dp_img_s": figure("dp"),
        "dp_ratio": rep_ratio("dp_ratio", "dp", "limit"),
        "ddp_img_s": figure("ddp"),
        "ddp_ratio": rep_ratio("ddp_ratio", "ddp", "single", config["nproc"] if gpu else 1),
        "amp_img_s": figure("amp"),
        "amp_ratio": rep_ratio("amp_ratio", "amp", "ddp"),
        "amp_limit_img_s": figure("amp_limit"),
        "amp_of_limit": rep_ratio("amp_of_limit", "amp", "amp_limit"),
        "accum_img_s": figure("accum"),
        "accum_speedup": rep_ratio("accum_speedup", "accum", "ddp"),
        "ceiling_img_s": figure("ceiling"),
        "accum_ceiling": rep_ratio("accum_ceiling", "ceiling", "ddp"),
        "accum_of_ceiling": rep_ratio("accum_of_ceiling", "accum", "ceiling"),
        "loader_img_s": figure("loader"),
        "decode_loader_img_s": figure("loader", "decode_img_s"),
        "loader_of_decode": figure("loader", "of_decode"),
        "textbook_loader_img_s": figure("loader", "textbook_img_s"),
        "loader_speedup": figure("loader", "speedup"),
        "photo_loader_img_s": figure("photos"),
        "photo_decode_loader_img_s": figure("photos", "decode_img_s"),
        "photo_loader_of_decode": figure("photos", "of_decode"),
        "photo_textbook_loader_img_s": figure("photos", "textbook_img_s"),
        "photo_loader_speedup": figure("photos", "speedup"),
        "first_step_s": None if gpu else figure("single", "first_step_s"),
        "import_s": figure("single", "import_s"),
        "skipped": skipped,
    }
    # The first progress line comes after one step: its compute, at the row's steady speed, is training, not start-up
    r["step_s"] = config["batch_per_process"] / r["single_img_s"] if r["single_img_s"] else None
    figures = (r["first_step_s"], r["import_s"], r["step_s"])
    r["startup_s"] = figures[0] - figures[1] - figures[2] if all(figures) else None
    r["drift_check_s"] = figure("drift", "check_s")
    steps = config["train_images"] // config["nproc"] // config["batch_per_process"]  # the ddp row's epoch (drop_last)
    epoch_s = steps * config["nproc"] * config["batch_per_process"] / r["ddp_img_s"] if r["ddp_img_s"] else None
    r["drift_check_of_epoch"] = r["drift_check_s"] / epoch_s if r["drift_check_s"] and epoch_s else None
    each["loader_of_decode"] = [run["of_decode"] for run in runs.get("loader", [])]
    each["photo_loader_of_decode"] = [run["of_decode"] for run in runs.get("photos", [])]
    r["ratios_each_repetition"] = each

    def met(key, target):
        """Whether r[key] meets its target (None: no figure); start-up and the drift check: the lower the better."""
        if r[key] is None:
            return None
        if key in LOWER_IS_BETTER:
            return r[key] <= target
        return r[key] >= target

    def within_noise(key, target):
        """A missed ratio target that one of the repetitions meets: the machine's noise spans it."""
        return met(key, target) is False and any(value >= target for value in each.get(key, []))

    r["targets"] = {
        key: {"target": target, "value": r[key], "met": met(key, target), "within_noise": within_noise(key, target)}
        for key, target in TARGETS.items()
    }
    r["machine"] = {
        "cpu": cpu_model(),
        "cores": config["threads_single"],
        **machine,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    r["config"] = config
    r["runs"] = runs
    return r


def cpu_model():
    try:
        return next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def table(r):
    c = r["config"]
    runs = r["runs"]
    n = c["nproc"]

    def where(procs, threads):
        if c["device"] == "cuda":
            return f"{procs} GPU" + "s" * (procs > 1)
        return f"{procs} x {threads} thread" + "s" * (threads > 1)

    def verdict(key):
        t = r["targets"].get(key)
        if not t or t["met"] is None:
            return ""
        bound = f"({'<=' if key in LOWER_IS_BETTER else '>='} {t['target']})"
        if t["met"]:
            return f"met {bound}"
        if t["within_noise"]:
            values = r["ratios_each_repetition"][key]
            return f"within noise {bound}: repetitions {min(values):.2f}-{max(values):.2f}"
        return f"missed {bound}"

    def row(label, place, name, ratio_label="", ratio_key=None, key="img_s"):
        if name in r["skipped"]:  # the reason where the figure would be: a skipped row reads as one
            return [label, place, f"skipped: {r['skipped'][name]}", "-", ratio_label, "-", "", "-"]
        rs = runs.get(name, [])
        return [
            label,
            place,
            fmt(median(x.get(key) for x in rs)),
            " ".join(fmt(x.get(key)) for x in rs),
            ratio_label,
            fmt(r.get(ratio_key), 2) if ratio_key else "",
            verdict(ratio_key),
            fmt(median(x.get("others") for x in rs), 2),
        ]

    one = where(1, c["threads_single"])
    many = where(n, c["threads_per_process"])
    rows = [
        row("compute limit: train_single.py, data in memory", one, "limit"),
        row("train_single.py", one, "single", "single / limit", "single_ratio"),
        row("train_dp.py", one, "dp", "dp / limit", "dp_ratio"),
        row(
            f"ddp {n}: train_ddp_torchrun.py",
            many,
            "ddp",
            "ddp / (N x single)" if c["device"] == "cuda" else "ddp / single",
            "ddp_ratio",
        ),
        row("amp limit: train_ddp_amp.py --amp-dtype bf16, data in memory", many, "amp_limit"),
        row(f"amp {n}: train_ddp_amp.py --amp-dtype bf16", many, "amp", "amp / limit", "amp_of_limit"),
        row(f"ddp {n} --accum-steps 4 (no_sync)", many, "accum", "accum 4 / ceiling", "accum_of_ceiling"),
        row(
            f"ceiling: ddp {n} --accum-steps {c['ceiling_accum_steps']} (one all-reduce an epoch)",
            many,
            "ceiling",
            "ceiling / ddp",
            "accum_ceiling",
        ),
        row(f"data {c['img_size']} px: decode alone", "1 x 1 thread", "loader", key="decode_img_s"),
        row(
            f"data {c['img_size']} px: project (ImageFiles, SeededItems)",
            "1 x 1 thread",
            "loader",
            "project / decode",
            "loader_of_decode",
        ),
        row(f"data {c['img_size']} px: textbook (ImageFolder, PIL)", "1 x 1 thread", "loader", key="textbook_img_s"),
        row(f"data 12 MP JPEGs, {PHOTO_IMG} px: decode alone", "1 x 1 thread", "photos", key="decode_img_s"),
        row(
            f"data 12 MP JPEGs, {PHOTO_IMG} px: project",
            "1 x 1 thread",
            "photos",
            "project / decode",
            "photo_loader_of_decode",
        ),
        row(f"data 12 MP JPEGs, {PHOTO_IMG} px: textbook", "1 x 1 thread", "photos", key="textbook_img_s"),
        [
            "start-up of train_single.py, less its imports and its first step (s)",
            one,
            fmt(r["startup_s"], 2),
            "-",
            "",
            "",
            verdict("startup_s"),
            "-",
        ],
        [
            f"drift check: dist_utils.check_replicas, {c['model']} (s)",
            "1 x 1 thread",
            fmt(r["drift_check_s"], 4),
            " ".join(fmt(x.get("check_s"), 4) for x in runs.get("drift", [])),
            "check / ddp epoch",
            fmt(r["drift_check_of_epoch"], 4),
            verdict("drift_check_of_epoch"),
            fmt(median(x.get("others") for x in runs.get("drift", [])), 2),
        ],
    ]
    lines = [
        (
            f"# Benchmark: {c['model']}, {c['img_size']} px, batch {c['batch_per_process']} per process, demo "
            f"data ({c['train_images']} training images)" + (" (--tiny: no figure is telling)" if c["tiny"] else "")
        ),
        (
            f"{r['machine']['cpu']}, {r['machine']['cores']} cores, GPU: {r['machine']['gpu']}, torch "
            f"{r['machine']['torch']}; {c['repeats']} repetition(s), medians"
        ),
        "",
        "| run | where | img/s | each repetition | ratio | value | target | others |",
        "|---|---|---:|---|---|---:|---|---:|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows] + [""]
    lines.append(
        "- training rows and the limit: the second of 2 epochs, from the scripts' own progress lines; "
        "the data rows: torch.utils.benchmark in this process (the mean time per call)"
    )
    lines.append(
        f"- beside the targets: amp / ddp {fmt(r['amp_ratio'], 2)}, accum 4 / ddp {fmt(r['accum_speedup'], 2)}, "
        f"project / textbook {fmt(r['loader_speedup'], 2)} (data) and {fmt(r['photo_loader_speedup'], 2)} (12 MP)"
    )
    lines.append(
        f"- start-up: first step {fmt(r['first_step_s'], 2)} s after the process started, of which "
        f"{fmt(r['import_s'], 2)} s importing torch and torchvision and {fmt(r['step_s'], 2)} s the step itself (at "
        f"single's steady speed)"
    )
    lines.append(
        "- others: cores that processes not started by the bench used during the row (median): above ~0.1 "
        "they slowed its figures"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ GPU rows
def gpu_rows(opts, cores, tmp):
    """The GPU rows, the most telling first, each within its own time limit; a row that no longer fits in
    --gpu-budget is skipped and named, so the whole part ends in time. A row that crashes (as opposed to not
    fitting) is listed under "crashed", and the bench then exits with status 1. The limits are a few times each
    row's expected time on one H200 with 16 cores."""
    deadline = time.perf_counter() + opts.gpu_budget
    rows = []
    skipped = []
    crashed = []

    def attempt(what, limit, measure):
        left = deadline - time.perf_counter()
        if left < limit:
            skipped.append(f"{what}: {left:.0f} s of --gpu-budget left, and it may take {limit} s")
            return None
        try:
            return measure(limit)
        except RuntimeError as error:  # a timeout did not fit; anything else crashed: say so, go on with the next
            first = str(error).strip().splitlines()[0]
            if first.startswith("timed out"):
                skipped.append(f"{what}: {first}")
            else:
                crashed.append(f"{what}: {first}")
            return None

    jpegs = tmp / "jpegs"
    made = attempt("ImageNet-sized JPEGs", 45, lambda limit: make_jpegs(jpegs, GPU_JPEGS, (500, 375), 10) or True)
    default = max(1, cores - 1)  # the scripts' default on one GPU: the cores less the one that trains
    amp = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]

    def script(name, cmd, workers):
        args = [
            "--data-path",
            jpegs,
            "--model",
            GPU_MODEL,
            "--img-size",
            GPU_IMG,
            "-b",
            GPU_BATCH,
            "--workers",
            workers,
            "--epochs",
            2,
            "--print-freq",
            4,
        ]
        run = made and attempt(
            f"{name} --workers {workers}", 60, lambda limit: train(cmd + args, cores, limit, tmp / f"gpu-{len(rows)}")
        )
        rows.append({"row": f"{name} --workers {workers}", "img_s": run["img_s"] if run else None})

    script(
        "limit: amp 1 (bf16), data in memory",
        amp + [in_memory("train_ddp_amp.py", tmp), "--amp-dtype", "bf16"],
        default,
    )
    script("amp 1 (bf16)", amp + ["train_ddp_amp.py", "--amp-dtype", "bf16"], default)
    script("limit: train_single.py, data in memory", [sys.executable, in_memory("train_single.py", tmp)], default)
    script("train_single.py", [sys.executable, "train_single.py"], default)
    for workers in [w for w in GPU_WORKERS if w < default]:
        script("amp 1 (bf16)", amp + ["train_ddp_amp.py", "--amp-dtype", "bf16"], workers)
    return {
        "model": GPU_MODEL,
        "img_size": GPU_IMG,
        "batch": GPU_BATCH,
        "rows": rows,
        "skipped": skipped,
        "crashed": crashed,
        "budget_s": opts.gpu_budget,
    }


def gpu_table(gpu):
    if "skipped_all" in gpu:
        return (
            f"- GPU rows ({GPU_MODEL} at {GPU_IMG} px, each beside its in-memory limit): skipped, "
            f"{gpu['skipped_all']} (bash run.sh gpucheck runs them on a GPU machine)"
        )
    lines = [
        "",
        f"# GPU rows: {gpu['model']}, {gpu['img_size']} px, batch {gpu['batch']}",
        "",
        "| run | img/s |",
        "|---|---:|",
    ]
    lines += [f"| {row['row']} | {fmt(row['img_s'])} |" for row in gpu["rows"]]
    return "\n".join(
        lines + [f"- not measured: {why}" for why in gpu["skipped"]] + [f"- CRASHED: {why}" for why in gpu["crashed"]]
    )


# ------------------------------------------------------------------------------------------ main
def main():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--nproc", type=int, help="processes of the DDP rows (default: the GPUs, or 2 on a CPU)")
    parser.add_argument("--quick", action="store_true", help="one repetition, shorter timings (a smoke test)")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="one repetition at a 32-pixel crop, batch 8, 20 demo "
        "images a class and one 12 MP photo, without dp and the ceiling: no figure telling (the tests)",
    )
    parser.add_argument("--repeats", type=int, help="repetitions of every row (default 3, 1 with --quick or --tiny)")
    parser.add_argument("--output-dir", default="runs/bench", help="where bench.json goes")
    parser.add_argument("--timeout", type=int, default=600, help="seconds any one training run may take")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU rows (bash run.sh gpucheck)")
    parser.add_argument("--gpu-budget", type=int, default=420, help="seconds for all the GPU rows together")
    opts = parser.parse_args()
    if min(opts.repeats or 1, opts.nproc or 1) < 1:
        parser.error("--repeats and --nproc must be positive")
    if opts.tiny:
        global IMG_SIZE, BATCH
        IMG_SIZE = 32
        BATCH = 8
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # so that the run in progress is ended too
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        results = {"machine": {}} if opts.gpu_only else measure(opts, cores, Path(tmp))
        # on a CPU the everyday rows already said there is no GPU: no process started to find out again
        cuda = results["config"]["device"] == "cuda" if "config" in results else torch_sees_cuda()
        if cuda:
            results["gpu"] = gpu_rows(opts, cores, Path(tmp))
        else:
            results["gpu"] = {"skipped_all": "no CUDA GPU on this machine"}
    results["wall_s"] = time.perf_counter() - started
    output_dir = Path(opts.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    if not opts.gpu_only:
        print(table(results))
    print(gpu_table(results["gpu"]))
    print(f"\nbench.json in {output_dir}; {results['wall_s']:.0f}s in all")
    if results["gpu"].get("crashed"):
        print(f"bench: {len(results['gpu']['crashed'])} GPU row(s) crashed (listed above)", file=sys.stderr)
        return 1
    return 0


def torch_sees_cuda():
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
