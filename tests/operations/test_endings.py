"""Jobs that always end, and resumes that stay right: a data error mid-run with loader workers, a resume whose ranks
would run different numbers of batches, a sharded save at a step number that was saved before, a mixed-precision
resume from another rung's checkpoint, and the teardown of the FSDP process group. Real processes, the defaults.
"""

import shutil
import signal
import sys

import pytest
import torch

from support import (
    BF16,
    DEFAULTS,
    EXACT,
    REPO,
    assert_gone,
    assert_job_gone,
    assert_same_weights,
    descendants,
    finish,
    free_port,
    load_model_state,
    ok,
    read_until,
    run,
    start,
    start_sh,
    torchrun,
)


def test_images_that_disappear_mid_run_end_the_job_within_seconds(tiny_data, tmp_path):
    """bash run.sh ddp 2 with the default loader workers (which ignore SIGTERM); the images vanish after epoch 1 (a
    dataset cleaned up, a dropped NFS mount). Each rank that reads a missing file says so, and the job ends: before,
    every rank printed its line and then waited forever for its loader workers at exit."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    lines = []
    job = start_sh("ddp", 2, *DEFAULTS, "--epochs", "3", "--data-path", data, "--output-dir", tmp_path / "run")
    assert read_until(job, lines, "epoch 1/3  val loss"), "".join(lines)[-3000:]
    pids = descendants(job.pid)
    for folder in data.iterdir():
        shutil.rmtree(folder)
    output = finish(job, lines, timeout=45)  # before: every rank still waiting at exit for its workers
    assert job.returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors and all(line.startswith("error: cannot decode image") for line in errors), output[-3000:]
    assert "Traceback" not in output and "run.sh: the launcher's full report: " in output, output[-3000:]
    assert_gone(pids)
    assert_job_gone(job.token)


def test_an_error_after_the_loader_workers_started_leaves_no_process_once_torchrun_ends(tiny_data, tmp_path):
    """An unreadable --resume, found by both ranks after their loader workers started (one each, the default on a
    CPU): local rank 0 says so, rank 1 waits for the launcher to stop it. When torchrun has ended, no process of the
    job is left: rank 1 ended its workers before it waited (they ignore SIGTERM; before, they outlived the job by up
    to 5 s, and whatever read its output waited for them)."""
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    job, lines = (
        start(
            [
                sys.executable,
                *"-m torch.distributed.run --standalone --nproc-per-node=2 train_ddp_torchrun.py".split(),
                *DEFAULTS,
                *f"--data-path {tiny_data} --resume {bad} --output-dir {tmp_path / 'run'}".split(),
            ],
            timeout=120,
        ),
        [],
    )
    try:
        job.wait(timeout=120)  # torchrun's own end, not its output's
        assert_job_gone(job.token, within=0)
    finally:
        output = finish(job, lines, timeout=60)
    assert job.returncode == 1, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(bad) in errors[0], output[-3000:]


def test_launch_resume_whose_ranks_have_uneven_batches_runs_the_same_steps(ddp_killed, tiny_data, tmp_path):
    """A mid-epoch checkpoint of 2 processes x batch 8 (16 or 32 samples done; shared.ddp_killed) resumed by
    train_ddp_launch.py on 3 processes x batch 1: the ranks skip 6/5/5 or 11/11/10 of their 16 samples, so they hold
    10/11/11 or 5/5/6 batches. Every rank must run the same steps (before, one rank was still in a backward pass
    while the others evaluated, and gloo aborted on the mismatched collectives). The reference: the torchrun rung,
    which stops at its step count, resumed the same way."""
    args = [*EXACT, "--data-path", tiny_data]
    saved, checkpoint = ddp_killed
    launchers = {"launch": "torch.distributed.launch", "torchrun": "torch.distributed.run"}
    resumed = {
        name: ok(
            torchrun(
                3,
                f"train_ddp_{name}.py",
                *args,
                *f"-b 1 --resume {saved} --output-dir {tmp_path / name}".split(),
                launcher=launcher,
            )
        )
        for name, launcher in launchers.items()
    }
    steps_left = (48 - checkpoint["samples"]) // 3  # 16 samples per rank x 3 ranks are usable, 3 per step
    for proc in resumed.values():
        steps = [line for line in proc.stdout.splitlines() if line.startswith("epoch 1/2  step ")]
        assert len(steps) == steps_left, proc.stdout[-3000:]
    # (the torchrun rung's counting hook averages before the all-reduce: float rounding, ~4e-9 here)
    assert_same_weights(
        load_model_state(tmp_path / "launch" / "last.pt"),
        load_model_state(tmp_path / "torchrun" / "last.pt"),
        atol=1e-6,
    )


def test_fsdp_last_pt_names_the_shards_it_was_saved_with_after_steps_renumber(fsdp_killed, tiny_data, tmp_path):
    """Killed mid-epoch at 2 processes x batch 8 (saved as step 1 or 2; shared.fsdp_killed), then resumed in one
    process at a bigger batch chosen so that its first save, after a training step, falls on that same step number
    (the bigger global batch renumbers the steps). The shards that last.pt names must hold its own weights; before, a
    save at a step already on disk kept the old shards (up to 105 apart), and the next resume went back in training.
    (--freeze: the head moves at every step, and a shard one step old holds another head.)"""
    import torch.distributed.checkpoint as dcp
    import torchvision

    args = [*EXACT, "--data-path", tiny_data]
    killed, checkpoint = fsdp_killed
    shutil.copytree(killed, tmp_path / "run")
    saved_step = checkpoint["samples"] // 16  # 2 processes x batch 8
    batch = {1: 26, 2: 18}[saved_step]  # 50 images: 1 step left of 1 per epoch, or of 2: it saves as step 1, or 2
    resumed = ok(
        torchrun(
            1,
            "train_fsdp.py",
            *args,
            *f"--epochs 1 -b {batch} --resume auto --output-dir {tmp_path / 'run'}".split(),
        )
    )
    assert resumed.stdout.count("  step ") == 1, resumed.stdout[-2000:]  # it trained before saving
    checkpoint = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert checkpoint["optimizer"].startswith(f"last-step{saved_step}-"), checkpoint["optimizer"]
    shards = {"model": torchvision.models.resnet18(num_classes=3).state_dict()}
    with pytest.warns(UserWarning, match="single process"):  # DCP's note that it loads in this process alone
        dcp.load(shards, checkpoint_id=tmp_path / "run" / checkpoint["optimizer"])  # the full tensors
    assert_same_weights(shards["model"], checkpoint["model"])
    assert [p.name for p in (tmp_path / "run").iterdir() if ".dcp" in p.name] == [checkpoint["optimizer"]]


def test_amp_resumes_a_checkpoint_of_the_torchrun_rung_with_a_fresh_scaler(default_ddp, tiny_data, tmp_path):
    """train_ddp_torchrun.py's last.pt has no scaler state: the amp rung continues it (a new GradScaler) instead of
    ending with KeyError: 'scaler', and saves what it trained when stopped (after its first step or two: bf16 is
    slow on a CPU without bf16 arithmetic)."""
    shutil.copytree(default_ddp, tmp_path / "run")
    job, lines = (
        start(
            [
                sys.executable,
                *"-m torch.distributed.run --standalone --nproc-per-node=2 train_ddp_amp.py".split(),
                *DEFAULTS,
                *BF16,
                *f"--epochs 3 --workers 0 --data-path {tiny_data} --resume {tmp_path / 'run' / 'last.pt'}".split(),
                *f"--output-dir {tmp_path / 'run'}".split(),
            ]
        ),
        [],
    )
    if read_until(job, lines, "epoch 3/3  step 1/3"):
        job.send_signal(signal.SIGTERM)  # to torchrun, which passes it on
    output = finish(job, lines, timeout=120)
    assert "resuming from" in output and "epoch 3 after 0 of its 50 samples" in output, output[-2000:]
    assert "epoch 3/3  step 1/3" in output and "epoch 2/3  step" not in output, output[-2000:]
    assert output.count("stopped by SIGTERM after step ") == 1, output[-2000:]
    checkpoint = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["samples"]) in ((2, 16), (2, 32)) and "scaler" in checkpoint


TEARDOWN = r"""
import gc, os, sys, torch, torch.distributed as dist
gc.disable()  # (a program that runs without the collector: importing builtin must leave it off)
sys.path.insert(0, sys.argv[1])
import builtin, fsdp_utils
print("collector after importing builtin:", "on" if gc.isenabled() else "off")
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
for case in ("as in torch 2.14", "renamed"):
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{sys.argv[2 + len(case) % 2]}")
    mesh = init_device_mesh("cpu", (1,))
    if case == "renamed":  # a torch release without the private attribute
        del mesh._pg_registry
    dist.destroy_process_group()
    fsdp_utils.release_meshes()
    print(f"{case}: initialized after:", dist.is_initialized())
"""


def test_the_process_group_teardown_survives_a_torch_without_its_private_attribute():
    """fsdp_utils.release_meshes() empties each DeviceMesh's private _pg_registry so the group goes at once: if a
    torch release renames it, the exit must still end with the script's own status, not a traceback. (And importing
    builtin, which imports torchvision with the garbage collector paused, leaves it as the program had it: off here.)"""
    proc = run([sys.executable, "-c", TEARDOWN, REPO, free_port(), free_port()], timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [
        "collector after importing builtin: off",
        "as in torch 2.14: initialized after: False",
        "renamed: initialized after: False",
    ], proc.stdout
