"""What holds at scale and breaks only outside tiny tests: BatchNorm statistics at evaluation, restarts across nodes
whose agents disagree, a resume with another world size or batch, nodes that see different files, no launcher."""
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from torch.utils.data import DistributedSampler

from conftest import (REPO, assert_same_weights, deliver, finish, free_port, job_env, kill_mid_epoch,
                      load_model_state, ok, ranks, run_script, start)
import utils

TOL = 1e-5  # see test_ddp.py
EXACT = ["--img-size", "32", "--epochs", "2", "--workers", "0", "--print-freq", "1", "--val-fraction", "0.25",
         "--freeze"]  # as test_ddp.py's COMMON: with --freeze, W processes x batch B == 1 process x batch W*B


def torchrun(nproc, script, *args, env=None):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", script, *map(str, args)], cwd=REPO,
                          env=env or job_env(), capture_output=True, text=True, timeout=150)


@pytest.mark.parametrize("mode,nproc", [("ddp", 1), ("ddp", 2), ("amp", 2)])
def test_logged_accuracy_is_that_of_the_saved_checkpoint(default_runs, tiny_data, tmp_path, mode, nproc):
    """BatchNorm in train mode: every rank must evaluate with the statistics rank 0 saves (DDP syncs them only at the
    start of a training forward). Before the fix the logged figure differed from --test-only on last.pt."""
    results = utils.json.loads((default_runs / mode / "results.json").read_text())
    script = {"ddp": "train_ddp_torchrun.py", "amp": "train_ddp_amp.py"}[mode]
    ok(torchrun(nproc, script, "--test-only", "--resume", default_runs / mode / "last.pt", "--data-path", tiny_data,
                "--img-size", "32", "--val-fraction", "0.25", "--output-dir", tmp_path / "eval"))
    evaluated = utils.json.loads((tmp_path / "eval" / "results.json").read_text())
    assert evaluated["val_count"] == results["val_count"] == 17
    assert evaluated["val_acc"] == results["final_acc"]
    assert evaluated["val_loss"] == pytest.approx(results["val_loss"], rel=1e-6)
    assert evaluated["confusion"] == results["confusion"] and evaluated["per_class_acc"] == results["per_class_acc"]


@pytest.mark.parametrize("world_sizes,batches", [((2, 3), (8, 8)), ((2, 1), (8, 24)), ((3, 2), (4, 16))])
@pytest.mark.parametrize("position", [0, 16, 40, 48])
def test_a_resume_continues_at_the_same_sample_whatever_the_world_size(world_sizes, batches, position):
    """The samples of one epoch's shuffled order seen before a checkpoint and after its resume, with another number
    of processes and batch size, are every sample once: none repeated, none skipped, as the scripts compute it."""
    dataset = list(range(50))
    before, after = world_sizes
    order = list(DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=3))  # the shared order
    seen = set(order[:position])
    global_batch = after * batches[1]
    usable = len(DistributedSampler(dataset, num_replicas=after, rank=0, drop_last=True)) * after
    steps_left = (usable - position) // global_batch  # what the scripts run: the same on every rank
    for rank in range(after):
        sampler = utils.EpochSampler(DistributedSampler(dataset, num_replicas=after, rank=rank, shuffle=True, seed=3,
                                                        drop_last=True))
        sampler.start(0, position)
        mine = [index for _, index in sampler][:steps_left * batches[1]]
        assert len(mine) == steps_left * batches[1], (rank, len(mine))  # every rank fills every step
        assert not seen & set(mine), "a sample seen twice"
        seen |= set(mine)
    assert seen == set(order[:position + steps_left * global_batch])  # a prefix of the order: nothing skipped


def test_resume_at_another_world_size_and_batch_continues_the_same_training(tiny_data, tmp_path):
    """A checkpoint saved mid-epoch by 2 processes x batch 8 continues on 3 processes x batch 8, and, as the
    reference, in one process with batch 24: the same samples from the same point, the LR of the new global
    batch, and the same weights at the end (with --freeze the forward pass of a sample ignores its batch)."""
    args = [*EXACT, "--data-path", tiny_data, "-b", "8"]
    checkpoint = kill_mid_epoch("ddp", args, tmp_path / "two")
    shutil.copy(tmp_path / "two" / "last.pt", tmp_path / "saved.pt")

    three = ok(torchrun(3, "train_ddp_torchrun.py", *args, "--resume", tmp_path / "saved.pt",
                        "--output-dir", tmp_path / "three"))
    one = ok(run_script("train_single.py", *args[:-2], "-b", "24", "--resume", tmp_path / "saved.pt",
                        "--output-dir", tmp_path / "one"))
    for proc in (three, one):
        assert f"epoch 1 after {checkpoint['samples']} of its " in proc.stdout  # 48 samples on 3 ranks, 50 on 1
        assert "samples (at global batch 16)" in proc.stdout
        assert "lr 0.1 x 24/256 = 0.009375" in proc.stdout
        # the first step's LR: the new peak LR, at this step of the new run's schedule (2 steps of 24 an epoch)
        first = next(line for line in proc.stdout.splitlines() if "  step " in line)
        epoch, step = int(first.split("/")[0].split()[-1]), int(first.split("step ")[1].split("/")[0])
        expected = 0.009375 * utils.warmup_cosine(2 * 2)((epoch - 1) * 2 + step - 1)
        assert float(first.split("lr ")[1].split()[0]) == pytest.approx(expected, abs=1e-5), first
    assert_same_weights(load_model_state(tmp_path / "three" / "last.pt"),
                        load_model_state(tmp_path / "one" / "last.pt"), atol=TOL)


@pytest.fixture(scope="module")
def exact_reference(tiny_data, tmp_path_factory):
    """One node, 2 processes x batch 8, uninterrupted."""
    out = tmp_path_factory.mktemp("exact") / "run"
    ok(torchrun(2, "train_ddp_torchrun.py", *EXACT, "--data-path", tiny_data, "-b", "8", "--output-dir", out))
    return out


def read_lines(job, into):
    thread = threading.Thread(target=lambda: into.extend(job.stdout), daemon=True)
    thread.start()
    return thread


def test_restart_across_nodes_whose_agents_count_differently(exact_reference, tiny_data, tmp_path):
    """Two torchrun agents (nodes) with --max-restarts=1. One node's worker hangs (SIGSTOP, as a rank does when its
    NCCL peer died) and the other node's worker dies (SIGKILL). The second agent counts a restart; the first
    restarts for the membership change, which torchrun does not count, so the two nodes' restart counts differ.
    Both must still meet, resume from the checkpoint and finish with the uninterrupted weights."""
    env = job_env(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RDZV_ID="test-restart",
                  TORCHRUN_ARGS="--max-restarts=1")
    args = ["ddp", 1, *EXACT, "--data-path", tiny_data, "-b", "8", "--save-every", "1",
            "--output-dir", tmp_path / "run"]
    nodes = [start(*args, env=env) for _ in range(2)]
    outputs = [[], []]
    readers = [read_lines(node, out) for node, out in zip(nodes, outputs)]
    try:
        deadline = time.time() + 120
        while not any("epoch 1/2  step 2/3" in line for out in outputs for line in out):
            assert time.time() < deadline and all(node.poll() is None for node in nodes), outputs
            time.sleep(0.05)
        stuck, killed = (next(iter(ranks(node).values())) for node in nodes)
        os.kill(stuck, signal.SIGSTOP)
        os.kill(killed, signal.SIGKILL)
        time.sleep(3)  # the second agent re-rendezvouses; the first sees it waiting and stops its worker
        os.kill(stuck, signal.SIGCONT)  # (else torchrun SIGKILLs it after 30 s): it has a SIGTERM to act on
        for node in nodes:
            node.wait(timeout=150)
    finally:
        for node in nodes:
            if node.poll() is None:
                deliver(node, "every process", signal.SIGKILL)
        for reader in readers:
            reader.join(timeout=10)
    text = ["".join(out) for out in outputs]
    assert [node.returncode for node in nodes] == [0, 0], [t[-3000:] for t in text]
    assert any("resuming from" in t for t in text), text
    assert_same_weights(load_model_state(tmp_path / "run" / "last.pt"), load_model_state(exact_reference / "last.pt"),
                        atol=TOL)


def test_ranks_that_see_different_data_stop_with_one_line_per_node(tiny_data, tmp_path):
    """Two nodes with their own copy of the data, one copy missing an image: each node says so, once."""
    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)
    (other / "c1" / "0003.jpg").unlink()
    env = job_env(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RDZV_ID="test-data")
    nodes = [start("ddp", 1, *EXACT, "--data-path", data, "-b", "8", "--output-dir", tmp_path / "run", env=env)
             for data in (tiny_data, other)]
    outputs = [finish(node, [], timeout=120) for node in nodes]
    assert all(node.returncode != 0 for node in nodes), outputs
    for output in outputs:
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "sees training_images" in errors[0], output
        assert "49" in errors[0] and "50" in errors[0] and "--data-path" in errors[0], errors
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.parametrize("script,how", [("train_ddp_launch.py", "bash run.sh launch"),
                                        ("train_ddp_torchrun.py", "bash run.sh ddp")])
def test_a_ddp_script_started_without_a_launcher_says_how_to_start_it(script, how):
    proc = run_script(script, "--epochs", "1", timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: start this script with") and how in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
