"""Every rung on a CUDA GPU, as a user starts it: short runs with the default settings (loader workers, BatchNorm
training), nccl for the DDP and FSDP rungs, one process (a one-GPU machine runs them all). Skipped without CUDA.

Sane results: exit 0, the script says it trained on cuda, results.json holds an accuracy that is a number, and
last.pt loads (weights_only) into a plain torchvision model. Checkpoints move between GPU and CPU both ways, and a
run SIGKILLed mid-epoch and resumed on the GPU ends within TOL of an uninterrupted one. About 20 short runs; the
budget is 4 minutes on one H200.
"""
import json
import math
import signal

import pytest
import torch
import torchvision

from conftest import DEFAULTS, assert_same_weights, deliver, finish, load_model_state, ok, run_sh, start

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (bash run.sh gpucheck runs these on a GPU machine)")

# cuDNN picks its algorithms per run and some CUDA backward kernels add with atomics (adaptive average pooling:
# see torch.use_deterministic_algorithms), so on a GPU a resumed run is equal within rounding, not bitwise. The
# uninterrupted run's BatchNorm running statistics move by ~10 % of their value each step (momentum 0.1): a step
# lost or repeated on resume is far outside this.
TOL = 1e-3


def args_for(tiny_data, output_dir, *extra):
    return [*DEFAULTS, "--data-path", tiny_data, "--output-dir", output_dir, *extra]


def check_run(proc, output_dir, device="cuda"):
    """The run trained on `device`, wrote a numeric accuracy and a last.pt that a plain resnet18 loads."""
    ok(proc)
    assert f"resnet18 on {device}" in proc.stdout, proc.stdout[:2000]
    results = json.loads((output_dir / "results.json").read_text())
    for key in ("best_acc", "final_acc", "val_loss"):
        value = results[key]
        assert isinstance(value, float) and math.isfinite(value), (key, value)
    assert 0.0 <= results["final_acc"] <= 1.0 and results["val_count"] == 17, results
    torchvision.models.resnet18(num_classes=3).load_state_dict(load_model_state(output_dir / "last.pt"))
    return results


@pytest.mark.parametrize("mode,extra", [
    ("single", []),
    ("dp", []),
    ("ddp", [1]),  # N before the script's arguments: run.sh's own
    ("launch", [1]),
    ("amp", [1, "--amp-dtype", "bf16"]),
    ("amp", [1, "--amp-dtype", "fp16", "--clip-grad", "1.0"]),
    ("ddp", [1, "--sync-bn"]),
    ("fsdp", [1]),
], ids=["single", "dp", "ddp", "launch", "amp-bf16", "amp-fp16-scaler-clip", "ddp-sync-bn", "fsdp"])
def test_each_script_trains_on_cuda(tiny_data, tmp_path, mode, extra):
    nproc, flags = ([extra[0]], extra[1:]) if extra and isinstance(extra[0], int) else ([], extra)
    proc = run_sh(mode, *nproc, *args_for(tiny_data, tmp_path / "run", *flags))
    check_run(proc, tmp_path / "run")
    assert "warning: --sync-bn needs CUDA" not in proc.stdout
    if "fp16" in flags:  # the GradScaler ran: its state (scale, growth tracker) is in the checkpoint
        scaler = torch.load(tmp_path / "run" / "last.pt", weights_only=True)["scaler"]
        assert scaler and scaler["scale"] > 0, scaler


@pytest.mark.parametrize("first,then", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_moves_between_gpu_and_cpu(tiny_data, tmp_path, first, then):
    """One epoch on one device, then --resume auto for the second on the other (checkpoints load to the CPU)."""
    out = tmp_path / "run"
    epoch1 = args_for(tiny_data, out, "--epochs", "1", "--device", first)
    check_run(run_sh("single", *epoch1), out, first)
    resumed = run_sh("single", *args_for(tiny_data, out, "--epochs", "2", "--device", then, "--resume", "auto"))
    assert "resuming from" in resumed.stdout, resumed.stdout[-2000:]
    assert check_run(resumed, out, then)["epochs"] == 2
    assert torch.load(out / "last.pt", weights_only=True)["epoch"] == 2


def test_mid_epoch_resume_on_the_gpu_ends_near_the_uninterrupted_run(tiny_data, tmp_path):
    """ddp 1 with nccl, --save-every 1, SIGKILLed (every process) at step 3 of 6, resumed with --resume auto."""
    check_run(run_sh("ddp", 1, *args_for(tiny_data, tmp_path / "whole")), tmp_path / "whole")
    job, lines = start("ddp", 1, *args_for(tiny_data, tmp_path / "killed", "--save-every", "1")), []
    for line in job.stdout:
        lines.append(line)
        if "epoch 1/2  step 3/6" in line:  # steps 1 and 2 are saved by now, step 3 may be too
            deliver(job, "every process", signal.SIGKILL)
            break
    finish(job, lines, timeout=60)
    checkpoint = torch.load(tmp_path / "killed" / "last.pt", weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["samples"] in (16, 24), checkpoint["samples"]
    resumed = run_sh("ddp", 1, *args_for(tiny_data, tmp_path / "killed", "--save-every", "1", "--resume", "auto"))
    assert "resuming from" in resumed.stdout and "epoch 1/2  step 1/6" not in resumed.stdout, resumed.stdout[-2000:]
    check_run(resumed, tmp_path / "killed")

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
    work never drained between the other steps. (fp16's GradScaler adds one read per step: bf16 here.)"""
    out = tmp_path / "run"
    proc = ok(run_sh(mode, 1, "--img-size", "32", "-b", "2", "--epochs", "1", "--val-fraction", "0.25",
                     "--data-path", tiny_data, "--profile", "10", "--output-dir", out))
    summary = [line for line in proc.stdout.splitlines() if line.startswith("profile:")]
    assert summary and ", 0.20 host reads of device values (syncs) per step;" in summary[0], proc.stdout[-2000:]
