"""Every rung on a CUDA GPU, as a user starts it: short runs with the default settings (loader workers, BatchNorm
training), nccl for the DDP and FSDP rungs, one process (a one-GPU machine runs them all). Skipped without CUDA.
The only test module that sees the GPUs: every other one hides them from what it starts (support.cpu_env).

Sane results: exit 0, the script says it trained on cuda, results.json holds an accuracy better than chance, and
last.pt loads (weights_only) into a plain torchvision model. No training step waits for the GPU (a host sync per
step drains its queue). Checkpoints move between GPU and CPU both ways, and a run SIGKILLed mid-epoch and resumed on
the GPU ends within TOL of an uninterrupted one, each resumed run from the step after its checkpoint. Where 2 GPUs
exist, train_dp.py really runs nn.DataParallel over them. The GPU-only lessons of docs/lessons.md: each runs a copy
of its script with the lesson's line broken (support.broken_copy) and finds what a user would meet. tools/gpucheck.py
sizes its time limits from the starts counted in LAUNCHES below.
"""

import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torchvision

import builtin
import utils
from support import (
    DEFAULTS,
    FP16_CLIP,
    REPO,
    assert_resumed_after,
    assert_same_weights,
    broken_copy,
    checkpoint_step,
    deliver,
    finish,
    gpu_env,
    lessons,
    load_model_state,
    ok,
    read_until,
    run_sh,
    start_sh,
    torchrun,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (bash run.sh gpucheck runs these on a GPU machine)"
)

# cuDNN picks its algorithms per run and some CUDA backward kernels add with atomics (adaptive average pooling:
# see torch.use_deterministic_algorithms), so on a GPU a resumed run is equal within rounding, not bitwise. The
# uninterrupted run's BatchNorm running statistics move by ~10 % of their value each step (momentum 0.1): a step
# lost or repeated on resume is far outside this.
TOL = 1e-3

# What each test starts, for tools/gpucheck.py's time limits (tests/tools/test_gpucheck.py checks that every test is
# here): {test: (script runs in one process, torchrun launches, GPUs it needs)}. Each start imports torch and
# torchvision and starts CUDA and 2 loader workers; a torchrun launch starts the launcher first, and NCCL. (0, 0): in
# this process.
LAUNCHES = {
    "test_training_steps_never_wait_for_the_gpu": (0, 0, 1),
    "test_each_script_trains_on_cuda": (2, 6, 1),
    "test_gpu_defaults_and_a_checkpoint_that_opens_without_a_gpu": (0, 1, 1),
    "test_a_checkpoint_moves_between_gpu_and_cpu": (4, 0, 1),
    "test_mid_epoch_resume_on_the_gpu_ends_near_the_uninterrupted_run": (0, 3, 1),
    "test_the_training_loop_reads_the_gpu_only_at_progress_lines": (0, 2, 1),
    "test_data_parallel_over_two_gpus_equals_one_gpu": (2, 0, 2),
    "test_lesson_no_set_device_leaves_every_process_on_gpu_0": (0, 1, 2),
    "test_lesson_no_sync_bn_no_longer_equals_one_gpu": (1, 2, 2),
    "test_lesson_no_unscale_clips_the_scaled_gradients": (0, 1, 1),
    "test_lesson_no_scaler_state_restarts_the_scaler_on_resume": (0, 2, 1),
}


def env():
    """The GPUs the suite was started with; run.sh sets the threads."""
    return gpu_env(PYTHONUNBUFFERED="1", PYTHON=sys.executable)


def args_for(tiny_data, output_dir, *extra):
    return [*DEFAULTS, "--data-path", tiny_data, "--output-dir", output_dir, *extra]


def check_run(proc, output_dir, device="cuda", trained=True):
    """The run trained on `device`, wrote a numeric accuracy (better than chance after a whole run) and a last.pt
    that a plain resnet18 loads."""
    ok(proc)
    assert f"ResNet (11,178,051 parameters) on {device}" in proc.stdout, proc.stdout[:2000]
    results = json.loads((output_dir / "results.json").read_text())
    for key in ("best_acc", "final_acc", "val_loss"):
        value = results[key]
        assert isinstance(value, float) and math.isfinite(value), (key, value)
    assert 0.0 <= results["final_acc"] <= 1.0 and results["val_count"] == 17, results
    if trained:  # 3 easy classes (6, 5, 6 images): guessing one class scores 6/17; on the CPU these runs beat 0.5
        assert results["best_acc"] > 0.5, results
    torchvision.models.resnet18(num_classes=3).load_state_dict(load_model_state(output_dir / "last.pt"))
    return results


def test_training_steps_never_wait_for_the_gpu():
    """The scripts' training step on CUDA, in this process, with the project's own model and normalisation
    (builtin.resnet, utils.normalize), in fp32 and under bf16 autocast: after warm-up, steps run under
    torch.cuda.set_sync_debug_mode("error"), which raises at any host-device synchronisation (an .item(), or a
    blocking copy such as torch.tensor(list, device="cuda")). One such sync per step drains the GPU's queue: the
    host waits for every step to end before it can queue the next."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = builtin.resnet("resnet18", 3).to(device)
    utils.train_except_frozen_batchnorm(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8).pin_memory()  # as the loaders give them
    labels = torch.randint(0, 3, (8,)).pin_memory()

    def step(autocast, lr):
        batch = utils.normalize(images.to(device, non_blocking=True))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(batch), labels.to(device, non_blocking=True))
        loss.backward()
        for group in optimizer.param_groups:  # as the scripts set it: a Python float from the step number
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for autocast in (False, True):
        for _ in range(3):  # warm-up: cuDNN chooses its algorithms, the caching allocator fills
            step(autocast, 0.01)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            losses = [step(autocast, 0.01 * (0.9**i)) for i in range(5)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(math.isfinite(loss.item()) for loss in losses), losses


@pytest.mark.parametrize(
    "mode,extra",
    [
        ("single", []),
        ("dp", []),
        ("ddp", [1]),  # N before the script's arguments: run.sh's own
        ("launch", [1]),
        ("amp", [1, "--amp-dtype", "bf16"]),
        ("amp", [1, "--amp-dtype", "fp16", "--clip-grad", FP16_CLIP]),
        ("ddp", [1, "--sync-bn"]),
        ("fsdp", [1]),
    ],
    ids=["single", "dp", "ddp", "launch", "amp-bf16", "amp-fp16-scaler-clip", "ddp-sync-bn-one-process-warns", "fsdp"],
)
def test_each_script_trains_on_cuda(tiny_data, tmp_path, mode, extra):
    nproc, flags = ([extra[0]], extra[1:]) if extra and isinstance(extra[0], int) else ([], extra)
    proc = run_sh(mode, *nproc, *args_for(tiny_data, tmp_path / "run", *flags), env=env())
    check_run(proc, tmp_path / "run")
    # SyncBatchNorm needs 2+ processes: at world size 1 it would be plain BatchNorm, and one line says so
    assert ("warning: --sync-bn needs GPUs and 2+ processes" in proc.stdout) == ("--sync-bn" in flags), proc.stdout
    if mode == "dp":  # nn.DataParallel where 2+ GPUs are visible, else the module unwrapped
        gpus = torch.cuda.device_count()
        assert (f"split over {gpus} device(s)" if gpus > 1 else "training unwrapped on cuda") in proc.stdout
    if "fp16" in flags:  # the GradScaler ran: it counted steps without inf/NaN since its scale last changed
        scaler = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["scaler"]
        assert scaler and scaler["scale"] > 0 and (scaler["_growth_tracker"] > 0 or scaler["scale"] != 2.0**16), scaler


def test_gpu_defaults_and_a_checkpoint_that_opens_without_a_gpu(tiny_data, tmp_path):
    """amp 1 on the GPU with the defaults: cudnn.benchmark is on (fixed shapes), the weights are channels_last (tensor
    cores), the loader workers follow the cores, and last.pt holds CPU tensors only: plain torch.load, with no
    map_location, opens it in a process that sees no GPU."""
    out = tmp_path / "run"
    check = (
        "import atexit, runpy, sys, torch\n"
        "atexit.register(lambda: print('cudnn.benchmark', torch.backends.cudnn.benchmark, flush=True))\n"
        "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    (tmp_path / "check.py").write_text(check)
    proc = ok(
        subprocess.run(
            [
                sys.executable,
                *"-m torch.distributed.run --standalone --nproc-per-node=1".split(),
                str(tmp_path / "check.py"),
                "train_ddp_amp.py",
                *args_for(tiny_data, out),
            ],
            cwd=REPO,
            env=env(),
            capture_output=True,
            text=True,
            timeout=180,
        )
    )
    assert "cudnn.benchmark True" in proc.stdout, proc.stdout[-2000:]
    cores = len(os.sched_getaffinity(0))
    assert f"loader workers per process: {max(1, cores - 1)};" in proc.stdout, proc.stdout[:2000]
    state = torch.load(out / "last.pt", map_location="cpu", weights_only=True)["model"]
    weight = state["conv1.weight"]
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous(), weight.stride()
    opened = subprocess.run(
        [sys.executable, "-c", "import sys, torch; torch.load(sys.argv[1], weights_only=True)", str(out / "last.pt")],
        env={**env(), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert opened.returncode == 0, opened.stderr[-2000:]


@pytest.mark.parametrize("first,then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_moves_between_gpu_and_cpu(tiny_data, tmp_path, first, then):
    """One epoch on one device, then --resume auto for the second on the other (checkpoints load to the CPU): the
    second run starts at the second epoch's first step."""
    out = tmp_path / "run"
    epoch1 = args_for(tiny_data, out, "--epochs", "1", "--device", first)
    check_run(run_sh("single", *epoch1, env=env()), out, first, trained=False)
    resumed = run_sh(
        "single", *args_for(tiny_data, out, "--epochs", "2", "--device", then, "--resume", "auto"), env=env()
    )
    assert check_run(resumed, out, then)["epochs"] == 2
    assert_resumed_after(resumed.stdout, step=6)  # 6 steps an epoch
    assert torch.load(out / "last.pt", weights_only=True)["epoch"] == 2


def test_mid_epoch_resume_on_the_gpu_ends_near_the_uninterrupted_run(tiny_data, tmp_path):
    """ddp 1 with nccl, --save-every 1, SIGKILLed (every process) at step 3 of 6, resumed with --resume auto."""
    check_run(run_sh("ddp", 1, *args_for(tiny_data, tmp_path / "whole"), env=env()), tmp_path / "whole")
    job, lines = start_sh("ddp", 1, *args_for(tiny_data, tmp_path / "killed", "--save-every", "1"), env=env()), []
    if read_until(job, lines, "epoch 1/2  step 3/6"):  # steps 1 and 2 are saved by now, step 3 may be too
        deliver(job, "every process", signal.SIGKILL)
    finish(job, lines, timeout=60)
    checkpoint = torch.load(tmp_path / "killed" / "last.pt", weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["samples"] in (16, 24), checkpoint["samples"]
    resumed = run_sh(
        "ddp", 1, *args_for(tiny_data, tmp_path / "killed", "--save-every", "1", "--resume", "auto"), env=env()
    )
    check_run(resumed, tmp_path / "killed")
    assert_resumed_after(resumed.stdout, step=checkpoint_step(checkpoint, 6))

    whole = load_model_state(tmp_path / "whole" / "last.pt")
    assert_same_weights(load_model_state(tmp_path / "killed" / "last.pt"), whole, atol=TOL)
    torch.manual_seed(0)  # what the scripts start from: training moved the weights far beyond the tolerance
    initial = torchvision.models.resnet18(num_classes=3).state_dict()
    moved = max((whole[k] - initial[k]).abs().max().item() for k in whole if whole[k].is_floating_point())
    assert moved > 20 * TOL, moved


@pytest.mark.parametrize("mode", ["ddp", "amp"])
def test_the_training_loop_reads_the_gpu_only_at_progress_lines(tiny_data, tmp_path, mode):
    """--profile over steps 4-13 of 25 (batch 2), the default --print-freq 10: the host waits for the GPU (an .item())
    only at step 10, for the progress line's loss and the ranks' stop vote: 0.20 reads per step, the GPU's queue of
    work never drained between the other steps. (fp16's GradScaler adds one read per step: bf16 here.) The CUDA
    runtime's own synchronize calls are DDP's runtime statistics, on its steps 1-10 only: at most one a step."""
    out = tmp_path / "run"
    proc = ok(
        run_sh(
            mode,
            1,
            *f"--img-size 32 -b 2 --epochs 1 --val-fraction 0.25 --data-path {tiny_data} --profile 10".split(),
            *f"--output-dir {out}".split(),
            env=env(),
        )
    )
    assert f"python tools/profile_report.py {out / 'trace.json'}" in proc.stdout, proc.stdout[-2000:]
    report = subprocess.run(
        [sys.executable, "tools/profile_report.py", str(out / "trace.json"), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )  # host-side events only
    figures = json.loads(report.stdout)
    print(mode, figures)  # the report shows what was measured
    assert figures["steps"] == 10 and figures["host_reads_per_step"] == pytest.approx(0.2), figures
    assert figures["cuda_syncs_per_step"] <= 1, figures


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="DataParallel needs 2 GPUs; with one, train_dp.py trains the module unwrapped"
)
def test_data_parallel_over_two_gpus_equals_one_gpu(tiny_data, tmp_path):
    """train_dp.py wraps the model in nn.DataParallel over every visible GPU: each step splits the batch of 16
    between them and gathers the outputs on the first. With --freeze (BatchNorm statistics fixed, only the head
    trains) a sample's forward pass ignores its batch, so the head ends where train_single.py's does on one GPU,
    within rounding (TF32 convolutions): far closer than the distance it moved. A lost replica's gradient, or one
    counted twice, would change the head's step by a third or more."""
    gpus = torch.cuda.device_count()
    common = [
        *f"--img-size 32 -b 16 --epochs 2 --print-freq 1 --val-fraction 0.25 --freeze --data-path {tiny_data}".split(),
    ]
    dp = ok(run_sh("dp", *common, "--output-dir", tmp_path / "dp", env=env()))
    assert f"global batch 16 split over {gpus} device(s)" in dp.stdout and "unwrapped" not in dp.stdout, dp.stdout
    ok(run_sh("single", *common, "--output-dir", tmp_path / "single", env=env()))
    trained = {name: load_model_state(tmp_path / name / "last.pt") for name in ("dp", "single")}
    torch.manual_seed(0)
    initial = builtin.resnet("resnet18", 3).state_dict()
    moved = (trained["single"]["fc.weight"] - initial["fc.weight"]).norm().item()
    apart = (trained["dp"]["fc.weight"] - trained["single"]["fc.weight"]).norm().item()
    assert apart < 0.1 * moved, (apart, moved)


# ---------------------------------------------------------------------- the GPU-only lessons of docs/lessons.md
# Not yet run on a GPU. Each test copies its script with the lesson's line broken (tests/proofs/test_lessons.py's
# LESSONS) and asserts the symptom; what the scripts do not print, a sitecustomize.py in the copy prints.
LESSONS = lessons()

CURRENT_DEVICE_AT_EXIT = """
import atexit, os, sys


def report():
    torch = sys.modules.get("torch")  # a training process's (importing torch while Python exits is not safe)
    if "RANK" in os.environ and torch is not None and torch.cuda.is_initialized():
        print(f"rank {os.environ['RANK']}: current device cuda:{torch.cuda.current_device()}", flush=True)


atexit.register(report)
"""

SCALER_AFTER_EACH_STEP = """
import torch

update = torch.amp.GradScaler.update


def printed(self, new_scale=None):
    update(self, new_scale)
    if self.is_enabled():
        print(f"GradScaler: scale {self.get_scale():g}, steps since it last changed {self._get_growth_tracker()}")


torch.amp.GradScaler.update = printed
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a process per GPU: needs 2 GPUs")
def test_lesson_no_set_device_leaves_every_process_on_gpu_0(bare, tiny_data, tmp_path):
    """no-set-device: train_ddp_launch.py without torch.accelerator.set_device_index(local rank), 2 processes on 2
    GPUs, one epoch. The script still puts its tensors on cuda:<local rank>, but each process's current device stays
    GPU 0, and what uses the current device (the loaders' pinned-memory thread, the CUDA context it opens) lands
    there from every process. CURRENT_DEVICE_AT_EXIT prints each rank's current device: cuda:0 on rank 1 too."""
    copy = broken_copy(bare, tmp_path / "copy", LESSONS["no-set-device"])
    (copy / "sitecustomize.py").write_text(CURRENT_DEVICE_AT_EXIT)
    proc = ok(
        torchrun(
            2,
            "train_ddp_launch.py",
            *args_for(tiny_data, tmp_path / "run", "--epochs", "1"),
            cwd=copy,
            env={**env(), "PYTHONPATH": str(copy)},
            launcher="torch.distributed.launch",
        )
    )
    assert "rank 1: current device cuda:0" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm needs 2 processes, one per GPU")
def test_lesson_no_sync_bn_no_longer_equals_one_gpu(bare, tiny_data, tmp_path):
    """no-sync-bn: --sync-bn without its conversion, 2 GPUs x batch 8, BatchNorm training. Converted, each BatchNorm
    normalises over the global batch of 16, as one GPU with batch 16 does, and the running statistics end where that
    run's end, within rounding; not converted, each GPU normalises over its own 8, and they end at least 10 times
    further from one GPU's."""
    copy = broken_copy(bare, tmp_path / "copy", LESSONS["no-sync-bn"])
    broken = args_for(tiny_data, tmp_path / "broken", "--sync-bn")
    ok(torchrun(2, "train_ddp_torchrun.py", *broken, cwd=copy, env=env()))
    ok(run_sh("ddp", 2, *args_for(tiny_data, tmp_path / "synced", "--sync-bn"), env=env()))
    ok(run_sh("single", *args_for(tiny_data, tmp_path / "single", "-b", "16"), env=env()))
    single = load_model_state(tmp_path / "single" / "last.pt")

    def apart(name):  # the largest difference of a running mean or variance from one GPU's
        state = load_model_state(tmp_path / name / "last.pt")
        return max((state[k] - single[k]).abs().max().item() for k in single if "running_" in k)

    assert apart("synced") * 10 < apart("broken"), (apart("synced"), apart("broken"))


def test_lesson_no_unscale_clips_the_scaled_gradients(bare, tiny_data, tmp_path, initial_weights):
    """no-unscale: train_ddp_amp.py without scaler.unscale_(optimizer), fp16 with --clip-grad FP16_CLIP, 1 GPU. The clip
    then meets the gradients times the GradScaler's scale (2**16 at the start) and cuts them to FP16_CLIP, and the
    step divides them by the scale: each step's gradient is at most FP16_CLIP / scale in norm, where the intact run's
    is up to FP16_CLIP. So the head moves no further than SGD with momentum 0.9 and weight decay 1e-4 can with such
    gradients (bounded as test_ddp.py's clipping test bounds it): under 1e-2 in all."""
    copy = broken_copy(bare, tmp_path / "copy", LESSONS["no-unscale"])
    fp16 = args_for(tiny_data, tmp_path / "run", "--amp-dtype", "fp16", "--clip-grad", FP16_CLIP)
    proc = ok(torchrun(1, "train_ddp_amp.py", *fp16, cwd=copy, env=env()))
    checkpoint = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    scale = checkpoint["scaler"]["scale"]  # the lowest it had: it grows only after 2000 steps without an overflow
    moved = torch.cat([(checkpoint["model"][k] - initial_weights[k]).flatten() for k in ("fc.weight", "fc.bias")])
    lrs = [float(line.split("  lr ")[1].split()[0]) for line in proc.stdout.splitlines() if "  step " in line]
    bound = sum(lrs) * 10 * (float(FP16_CLIP) / scale + 1e-4 * 1.5)
    assert moved.norm().item() <= bound < 1e-2, (moved.norm().item(), bound, scale)


def test_lesson_no_scaler_state_restarts_the_scaler_on_resume(bare, tiny_data, tmp_path):
    """no-scaler-state: train_ddp_amp.py without run.add_state(scaler=scaler), fp16, 1 GPU: one epoch, then --epochs 2
    --resume auto. last.pt holds no GradScaler state, so the resumed run starts a fresh scaler: after its first step
    it has counted 1 step since the scale last changed, where the scaler it should continue had counted the first
    run's 6 (or fewer after an overflow, whose lowered scale a fresh scaler also forgets). SCALER_AFTER_EACH_STEP
    prints the scaler's state after each step."""
    copy = broken_copy(bare, tmp_path / "copy", LESSONS["no-scaler-state"])
    (copy / "sitecustomize.py").write_text(SCALER_AFTER_EACH_STEP)
    scaler_env = {**env(), "PYTHONPATH": str(copy)}
    fp16 = args_for(tiny_data, tmp_path / "run", "--amp-dtype", "fp16")
    first = ok(torchrun(1, "train_ddp_amp.py", *fp16, "--epochs", "1", cwd=copy, env=scaler_env))
    resumed = ok(torchrun(1, "train_ddp_amp.py", *fp16, "--resume", "auto", cwd=copy, env=scaler_env))
    states = [line for line in resumed.stdout.splitlines() if line.startswith("GradScaler: ")]
    ended = [line for line in first.stdout.splitlines() if line.startswith("GradScaler: ")][-1]
    assert "resuming from" in resumed.stdout and states, resumed.stdout[-3000:]
    assert states[0] == "GradScaler: scale 65536, steps since it last changed 1", (ended, states[:2])
