"""What goes wrong on real clusters, as bounded scenarios with real processes: a full disk mid-run, a node that
never arrives, a peer that never comes, a taken port, and --profile."""
import json
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import FAST, REPO, assert_job_gone, cpu_env, finish, free_port, outcomes, popen, run_job


def env_1_thread(**extra):
    return cpu_env(OMP_NUM_THREADS="1", PYTHON=sys.executable, **extra)


@pytest.fixture(scope="module")
def jobs(tiny_data, tmp_path_factory):
    """Three of this module's jobs side by side, each with its own checks: the profiled run, and two that mostly wait
    (for RDZV_TIMEOUT, for --dist-timeout). {name: conftest.Outcome}; each test gets its own."""
    out = tmp_path_factory.mktemp("faults")
    return outcomes(at_once=3, profile=lambda: profile(tiny_data, out / "profile"), never_arrives=never_arrives,
                    dist_timeout=lambda: dist_timeout(tiny_data, out / "dist_timeout"))


def test_profile_writes_a_trace_and_counts_the_syncs_per_step(jobs):
    """torchrun rung, 2 processes x batch 1 (25 steps an epoch), the default --print-freq 10, steps 4-13 profiled: the
    host reads a device value only at step 10, for the progress line's loss and the ranks' stop vote. Reading the
    vote after every step, as before, made it 1.1 per step (and drained a GPU's queue each step). The count comes from
    tools/profile_report.py, reading the trace the script wrote."""
    jobs["profile"].get()


def profile(tiny_data, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "train_ddp_torchrun.py", "--img-size", "32", "-b", "1", "--epochs", "1", "--workers", "0",
                           "--freeze", "--data-path", str(tiny_data), "--val-fraction", "0.25", "--profile", "10",
                           "--output-dir", str(tmp_path / "run")], cwd=REPO, env=env_1_thread(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    trace = tmp_path / "run" / "trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(event.get("name", "").startswith("ProfilerStep") for event in events) == 10
    assert "profile: peak memory " in proc.stdout and f"python tools/profile_report.py {trace}" in proc.stdout
    report = subprocess.run([sys.executable, "tools/profile_report.py", str(trace)], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert report.returncode == 0 and report.stdout.startswith("profile: 10 steps: waiting for data "), report
    assert "% (may overlap compute" in report.stdout, report.stdout
    assert ", 0.20 host reads of device values (syncs) per step, 0.00 CUDA runtime syncs per step; " \
        "collectives per step: " in report.stdout, report.stdout  # (on a CPU: no CUDA runtime)


@pytest.fixture
def small_disk(tmp_path):
    """A 70 MiB tmpfs: room for one resnet18 checkpoint (~45 MiB), not for its replacement beside it."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=70m", "tmpfs", str(folder)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_full_disk_mid_run_is_one_error_and_keeps_the_last_checkpoint(tiny_data, small_disk):
    started = time.time()
    proc = run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "train_ddp_torchrun.py", *FAST, "--freeze", "--data-path", tiny_data, "--val-fraction", "0.25",
                    "--save-every", "1", "--output-dir", small_disk / "run"], env=env_1_thread(), timeout=120)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot write" in errors[0] and "last.pt" in errors[0], proc.stderr[-3000:]
    assert time.time() - started < 60
    checkpoint = torch.load(small_disk / "run" / "last.pt", weights_only=True)  # the first one, intact
    assert (checkpoint["epoch"], checkpoint["samples"]) == (0, 16)  # after step 1 of 2 processes x 8
    assert sorted(p.name for p in (small_disk / "run").glob(".*tmp")) == []


def test_a_node_that_never_arrives_ends_with_one_line(jobs):
    jobs["never_arrives"].get()


def never_arrives():
    started = time.time()
    proc = run_job(["bash", "run.sh", "ddp", "1", "--epochs", "1"], timeout=90,
                   env=env_1_thread(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                                    RDZV_TIMEOUT="5"))
    assert proc.returncode != 0
    assert "run.sh: not all 2 nodes joined" in proc.stderr and "RDZV_TIMEOUT" in proc.stderr
    assert time.time() - started < 60


def test_dist_timeout_ends_a_job_whose_peer_never_comes(jobs):
    """Local rank 1 never starts its script (it hangs before, here in a sleep): rank 0 waits for it at the process
    group's start for --dist-timeout seconds, not for the default 300, then fails; the launcher ends the sleeper,
    and no process of the job is left."""
    jobs["dist_timeout"].get()


def dist_timeout(tiny_data, tmp_path):
    tmp_path.mkdir()
    dist_timeout = 10
    hanging_peer = tmp_path / "hanging_peer.sh"
    hanging_peer.write_text(f'[ "$LOCAL_RANK" = 1 ] && exec sleep 600\nexec {sys.executable} "$@"\n')
    started = time.time()
    job = popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
                 "bash", hanging_peer, "train_ddp_torchrun.py", *FAST, "--freeze", "--data-path", tiny_data,
                 "--val-fraction", "0.25", "--dist-timeout", dist_timeout, "--output-dir", tmp_path / "run"],
                env=env_1_thread(), timeout=200)
    output = finish(job, [], timeout=150)  # well before the default 300 s
    took = time.time() - started
    assert job.returncode != 0, output[-3000:]
    assert took >= dist_timeout and "timeout" in output.lower(), (took, output[-3000:])  # it waited, then gave up
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "did not all answer within --dist-timeout" in errors[0], output[-3000:]
    assert "DistStoreError" not in output.split(errors[0])[0], output[-3000:]  # one line, not the rank's traceback
    assert not (tmp_path / "run" / "last.pt").exists()
    assert_job_gone(job.token)


def test_a_taken_master_port_is_refused_with_its_number():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        proc = run_job(["bash", "run.sh", "ddp", "1"], timeout=60,
                       env=env_1_thread(NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    assert proc.returncode == 2
    assert f"MASTER_PORT {port} is already in use" in proc.stderr
