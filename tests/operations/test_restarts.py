"""Elastic restarts (torchrun --max-restarts): a worker killed or hung mid-run, the restarted group resumes from
the last checkpoint and ends with the uninterrupted weights, on one node and across nodes whose agents count
restarts differently; for each rung that restarts (torchrun with loader workers, amp, FSDP). (A Kubeflow
PyTorchJob's restart: test_engines.py.)"""

import os
import signal
import sys
import time

from support import (
    BF16,
    DEFAULTS,
    EXACT,
    NAMED_WEIGHTS,
    assert_resumed_after,
    assert_same_weights,
    end_all,
    finish,
    free_port,
    hub_env,
    job_env,
    load_model_state,
    ranks,
    read_lines,
    read_until,
    run_and_kill_one_worker,
    start,
    start_sh,
)

TOL = 1e-5  # W processes x batch B against one process with batch W x B: float32 summation order (test_ddp.py)


def test_elastic_restart_with_loader_workers_resumes_and_ends_with_uninterrupted_weights(
    default_ddp, tiny_data, tmp_path
):
    reference, folder, env = default_ddp, tmp_path, job_env(TORCHRUN_ARGS="--max-restarts=1")
    job, lines, killed = (
        start_sh(
            "ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--save-every", "1", "--output-dir", folder / "run", env=env
        ),
        [],
        False,
    )
    if read_until(job, lines, "epoch 1/2  step 2/3"):
        os.kill(ranks(job)[0], signal.SIGKILL)
        killed = True
    output = finish(job, lines, timeout=120)
    assert killed and job.returncode == 0, output[-3000:]
    # the restarted group continued after its last checkpoint (step 2, written before the kill), once
    assert output.count("epoch 1/2  step 1/3") == 1, output[-3000:]
    assert_resumed_after(output)
    assert_same_weights(load_model_state(folder / "run" / "last.pt"), load_model_state(reference / "last.pt"))


def test_elastic_restart_resumes_and_ends_with_uninterrupted_weights(amp_run, hub_cache, tiny_data, bare, tmp_path):
    """The amp rung, with the weights named (read from the hub cache, no network) as its reference run has them."""
    args = [*NAMED_WEIGHTS, *BF16, "--data-path", tiny_data, "-b", "8", "--save-every", "2"]
    reference = amp_run["dir"]
    stdout, code, killed = run_and_kill_one_worker(
        bare,
        "train_ddp_amp.py",
        [*args, "--output-dir", tmp_path / "killed"],
        kill_after="epoch 1/2  step 3/3",
        victim=-1,
        env=hub_env(hub_cache),
    )
    assert killed, "the run ended before a worker could be killed"
    assert code == 0, stdout[-4000:]
    # The step-2 checkpoint was written before step 3 was logged; the epoch-end one may have been too
    resumed = stdout.split("resuming from")[1].splitlines()[0]
    assert resumed.endswith(
        (
            "epoch 1 after 32 of its 50 samples (at global batch 16)",
            "epoch 2 after 0 of its 50 samples (at global batch 16)",
        )
    ), resumed
    # the restarted group trained from the step after that checkpoint, not again from step 1
    assert stdout.count("epoch 1/2  step 1/3") == 1 and assert_resumed_after(stdout)[0] in (3, 4), stdout[-4000:]
    assert_same_weights(load_model_state(tmp_path / "killed" / "last.pt"), load_model_state(reference / "last.pt"))


def test_elastic_restart_after_a_killed_worker_resumes_and_finishes(fsdp_references, tiny_data, bare, tmp_path):
    """A worker SIGKILLed mid-run: the restarted group resumes the sharded checkpoint saved before the kill at its
    world size and ends bit for bit at the uninterrupted weights (same ranks, batches and summation order; DCP
    restores every parameter and momentum exactly, and with --freeze the BatchNorm statistics never change). (At
    another world size and mesh: test_fsdp.py's HSDP test.)"""
    args = [*EXACT, "--data-path", tiny_data, "-b", "8", "--save-every", "2", "--output-dir", tmp_path / "killed"]
    stdout, code, killed = run_and_kill_one_worker(
        bare, "train_fsdp.py", args, kill_after="epoch 1/2  step 3/3", victim=-1
    )
    assert killed, "the run ended before a worker could be killed"
    assert code == 0, stdout[-4000:]
    resumed = stdout.split("resuming from")[1].splitlines()[0]
    assert resumed.endswith(
        (
            "epoch 1 after 32 of its 50 samples (at global batch 16)",
            "epoch 2 after 0 of its 50 samples (at global batch 16)",
        )
    ), resumed
    # the restarted group trained from the step after that checkpoint, not again from step 1
    assert stdout.count("epoch 1/2  step 1/3") == 1 and assert_resumed_after(stdout)[0] in (3, 4), stdout[-4000:]
    assert_same_weights(
        load_model_state(tmp_path / "killed" / "last.pt"), load_model_state(fsdp_references["dir"] / "fsdp" / "last.pt")
    )


def pending_signals(pid):
    """The signals sent to a process and not yet delivered (it is stopped, or blocks them)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    mask = int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)
    return {signal.Signals(bit + 1) for bit in range(64) if mask >> bit & 1 and bit + 1 in signal.valid_signals()}


def test_restart_across_nodes_whose_agents_count_differently(exact_single, tiny_data, tmp_path):
    """Two torchrun agents (nodes) with --max-restarts=1. One node's worker hangs (SIGSTOP, as a rank does when its
    NCCL peer died) and the other node's worker dies (SIGKILL). The second agent counts a restart; the first
    restarts for the membership change, which torchrun does not count, so the two nodes' restart counts differ (the
    agents' own log lines say which each did). Both must still meet, resume from the checkpoint and finish with the
    uninterrupted weights: two nodes (run.sh, NNODES=2, c10d on 127.0.0.1) end as one process with the global batch
    (tests/operations/test_hosts.py: two hosts, without a restart, bitwise as one machine)."""
    env = job_env(
        NNODES="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RDZV_ID="test-restart",
        TORCHRUN_ARGS="--max-restarts=1",
        LOGLEVEL="INFO",
    )  # INFO: the agents say why they restart
    args = [
        "ddp",
        1,
        *EXACT,
        *f"--data-path {tiny_data} -b 8 --save-every 1 --output-dir {tmp_path / 'run'}".split(),
    ]
    nodes = [start_sh(*args, env=env, timeout=300) for _ in range(2)]
    outputs = [[], []]
    readers = [read_lines(node, out) for node, out in zip(nodes, outputs)]
    try:
        deadline = time.time() + 150
        while not any("epoch 1/2  step 2/3" in line for out in outputs for line in out):
            assert time.time() < deadline and all(node.poll() is None for node in nodes), outputs
            time.sleep(0.05)
        stuck, killed = (next(iter(ranks(node).values())) for node in nodes)
        os.kill(stuck, signal.SIGSTOP)
        os.kill(killed, signal.SIGKILL)
        # the second agent re-rendezvouses; the first sees it waiting and stops its worker: SIGTERM, held while it
        # is stopped (torchrun SIGKILLs it 30 s later). Wait for that SIGTERM, then let the worker act on it.
        deadline = time.time() + 60
        while signal.SIGTERM not in pending_signals(stuck):
            assert time.time() < deadline, f"the first agent never stopped its worker:\n{''.join(outputs[0])[-3000:]}"
            time.sleep(0.05)
        os.kill(stuck, signal.SIGCONT)
        for node in nodes:
            node.wait(timeout=180)
    finally:
        end_all(nodes, readers)
    text = ["".join(out) for out in outputs]
    assert [node.returncode for node in nodes] == [0, 0], [t[-3000:] for t in text]
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in text[1], text[1][-3000:]
    assert "new nodes from group_rank=" in text[0] and "Worker group FAILED" not in text[0], text[0][-3000:]
    assert sum(t.count("global batch 16 = 8 per process x 2 processes") for t in text) == 2, text  # rank 0, twice
    resumed = [t for t in text if "resuming from" in t]
    assert len(resumed) == 1, text
    assert assert_resumed_after(resumed[0])[0] in (2, 3, 4), resumed[0][-3000:]  # after step 1, 2 or 3
    # the uninterrupted weights: one process with the global batch (shared.exact_single; W x B == 1 x W*B)
    assert_same_weights(
        load_model_state(tmp_path / "run" / "last.pt"), load_model_state(exact_single / "last.pt"), atol=TOL
    )


def test_restarts_across_nodes_without_a_fresh_store_each_are_refused(tiny_data, tmp_path):
    """torchrun started directly, two agents with --max-restarts=1 and without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (which run.sh sets): the restarted nodes may never meet again, so every attempt is refused with one line naming
    the variable, before it trains."""
    env = job_env()
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    port = free_port()
    cmd = [
        sys.executable,
        *"-m torch.distributed.run --nnodes=2 --nproc-per-node=1 --max-restarts=1 --rdzv-backend=c10d".split(),
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=test-shared-store",
        "train_ddp_torchrun.py",
        *EXACT,
        *f"--data-path {tiny_data} -b 8 --output-dir {tmp_path / 'run'}".split(),
    ]
    nodes = [start(cmd, env=env, timeout=200) for _ in range(2)]
    outputs = [finish(node, [], timeout=180) for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode != 0, output[-3000:]
        errors = {line for line in output.splitlines() if line.startswith("error:")}
        assert errors == {
            "error: restarts on several nodes need TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
            "environment (run.sh sets it), or the restarted nodes may never meet again"
        }, output[-3000:]
        assert "  step " not in output and not (tmp_path / "run" / "last.pt").exists()
