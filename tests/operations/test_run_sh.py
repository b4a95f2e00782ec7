"""run.sh as users and schedulers treat it, with real processes and the defaults (loader workers on, BatchNorm
training): killing run.sh or closing its terminal never leaves the job training; bad input ends with its one
`error:` line, the launcher's report kept in a log file; more processes than GPUs train on the CPU. The launcher
reports fed through a stand-in launcher were captured from real runs of torch 2.14.
"""

import os
import pty
import select
import shutil
import signal
import sys
import time
import uuid

import pytest
import torch

from support import (
    BF16,
    DEFAULTS,
    REPO,
    assert_gone,
    assert_resumed_after,
    assert_same_weights,
    checkpoint_step,
    descendants,
    finish,
    job_env,
    kill_job,
    load_model_state,
    ok,
    ranks,
    read_until,
    run,
    run_sh,
    start_sh,
)


def env_with(**settings):
    return {**job_env(), **settings}


def stopped_by(output, name):
    return [line for line in output.splitlines() if line.startswith(f"stopped by {name} after step ")]


def test_run_sh_copied_without_its_tools_runs_the_launcher_itself_or_says_what_is_missing(tiny_data, tmp_path):
    """run.sh and a rung copied into a project, tools/ left behind: the job runs under torchrun as it is (one line
    says what run.sh leaves out then); the modes that need a tool end in one line naming it."""
    folder = tmp_path
    for name in (
        "run.sh",
        "train_ddp_torchrun.py",
        "utils.py",
        "guards.py",
        "reporting.py",
        "dist_utils.py",
        "builtin.py",
    ):
        shutil.copy(REPO / name, folder)
    job = run(
        [
            "bash",
            "run.sh",
            "ddp",
            2,
            *DEFAULTS,
            *f"--epochs 1 --data-path {tiny_data} --output-dir {folder / 'run'}".split(),
        ],
        cwd=folder,
        timeout=120,
    )
    assert job.returncode == 0 and (folder / "run" / "results.json").is_file(), job.stderr[-3000:]
    assert job.stderr.startswith("run.sh: no tools/launcher.py beside run.sh: the launcher runs as it is"), job.stderr
    for args, missing in (
        (["doctor"], "tools/doctor.py"),
        (["bench"], "tools/bench.py"),
        (["ddp", 1], "tools/hosts.py"),
    ):
        proc = run(["bash", "run.sh", *args], cwd=folder, env=job_env(NNODES="2", MASTER_ADDR="127.0.0.1"), timeout=30)
        assert (proc.returncode, proc.stderr) == (
            2,
            f"run.sh: {missing} is missing: copy the tools/ folder beside run.sh\n",
        ), proc.stderr


def test_sigkill_of_run_sh_and_its_group_stops_the_job_and_leaves_no_process(tiny_data, tmp_path):
    """A job manager, `kill -9 -PGID` or a CI timeout: run.sh gets no chance to pass anything on. The launcher, told by
    its parent-death signal, stops the ranks as on SIGTERM: they save and end, and nothing trains on."""
    out = tmp_path / "run"
    job, lines, pids = start_sh("ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", out), [], []
    if read_until(job, lines, "epoch 1/2  step 1/3"):
        pids = descendants(job.pid)
        os.killpg(job.pid, signal.SIGKILL)
        killed = time.time()
        assert_gone(pids, within=60)
        took = time.time() - killed
    output = finish(job, lines, timeout=60)  # every writer is gone: this read ends
    assert len(pids) >= 7, pids  # the output filter, the launcher, 2 ranks and their loader workers
    assert len(stopped_by(output, "SIGTERM")) == 1, output[-3000:]
    saved = (out / "last.pt").stat().st_mtime_ns
    time.sleep(2)
    assert (out / "last.pt").stat().st_mtime_ns == saved  # nothing is still writing it
    checkpoint = torch.load(out / "last.pt", weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["samples"] in (16, 32, 48), checkpoint["samples"]
    print(f"SIGKILL of run.sh's group: the job ended {took:.1f} s later")


def run_on_a_terminal(args, until, timeout):
    """bash run.sh ARGS on a pseudo-terminal whose session it leads (as in an ssh session), until `until` is printed;
    then the terminal closes (the kernel sends SIGHUP to run.sh). Returns (output, exit status, the job's pids)."""
    token = uuid.uuid4().hex  # (conftest's runner marks every job so: kill_job ends what is left of it)
    pid, fd = pty.fork()
    if pid == 0:  # the child: run.sh, with the terminal as its controlling terminal
        try:
            os.chdir(REPO)
            os.execvpe("bash", ["bash", "run.sh", *map(str, args)], job_env(TEST_JOB=token))
        finally:
            os._exit(127)
    output, pids, status = b"", [], None
    try:
        deadline = time.time() + timeout
        while until.encode() not in output:
            assert time.time() < deadline, output.decode(errors="replace")[-3000:]
            if select.select([fd], [], [], 1)[0]:
                try:
                    output += os.read(fd, 1 << 16)
                except OSError:  # the terminal's other side is gone: run.sh ended
                    break
        pids = descendants(pid)
        os.close(fd)  # the terminal closes
        deadline = time.time() + 60
        while status is None and time.time() < deadline:
            done, raw = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(raw) if done else None
            time.sleep(0.2)
        return output.decode(errors="replace"), status, pids
    finally:
        kill_job(token)
        if status is None:
            os.waitpid(pid, 0)


def stop(how, args, folder):
    """bash run.sh ARGS stopped after its first step: its terminal closes (SIGHUP from the kernel), or a Ctrl-C
    (SIGINT to run.sh's process group). The step its last.pt was saved after."""
    if how == "terminal closes":
        output, status, pids = run_on_a_terminal(args, until="  step ", timeout=180)
        assert status == 128 + signal.SIGHUP, (how, status, output[-3000:])
    else:
        job, lines, pids = start_sh(*args), [], []
        if read_until(job, lines, "  step "):
            pids = descendants(job.pid)
            os.killpg(job.pid, signal.SIGINT)
        output = finish(job, lines, timeout=60)
        assert pids and job.returncode == 128 + signal.SIGINT, (how, output[-3000:])
        assert len(stopped_by(output, "SIGINT")) == 1, (how, output[-3000:])
        assert output.rstrip().splitlines()[-1].startswith("stopped by SIGINT"), (how, output[-3000:])
        assert "Traceback" not in output and not (folder / "run" / "results.json").exists(), output[-3000:]
    assert_gone(pids)
    return checkpoint_step(torch.load(folder / "run" / "last.pt", weights_only=True), 3)


def test_a_closed_terminal_and_ctrl_c_stop_and_save_and_resume_ends_with_uninterrupted_weights(
    default_ddp, tiny_data, tmp_path
):
    """SIGHUP: the terminal or ssh session closes (run.sh leads the terminal's session: the kernel signals it, and
    the ranks' output can no longer be written there); then Ctrl-C (SIGINT to the process group of the run.sh that
    resumed it, exit 130): each stopped after the job's own first step and saved it, no process left; a last
    --resume auto ends with the uninterrupted weights."""
    args = ["ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", tmp_path / "run"]
    closed = stop("terminal closes", args, tmp_path)
    assert 1 <= closed <= 3, closed  # (the job starts and saves in epoch 1; its 3 steps are all it may reach)
    interrupted = stop("Ctrl-C", [*args, "--resume", "auto"], tmp_path)
    assert interrupted > closed, (closed, interrupted)
    resumed = ok(run_sh(*args, "--resume", "auto"))
    assert_resumed_after(resumed.stdout, step=interrupted)
    assert_same_weights(load_model_state(tmp_path / "run" / "last.pt"), load_model_state(default_ddp / "last.pt"))


# ---------------------------------------------------------------------------------------- one line means one line
@pytest.mark.parametrize(
    "mode,nproc,case", [("ddp", 2, "missing --data-path"), ("amp", 1, "--epochs 0"), ("fsdp", 2, "unreadable --resume")]
)
def test_bad_input_through_run_sh_is_one_line_and_the_launchers_report_is_in_a_log(
    mode, nproc, case, tiny_data, tmp_path
):
    folder = tmp_path
    bad = folder / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    args = {
        "missing --data-path": ["--data-path", folder / "nowhere"],
        "--epochs 0": ["--data-path", tiny_data, "--epochs", "0", *BF16],
        "unreadable --resume": ["--data-path", tiny_data, "--resume", bad],
    }[case]
    started = time.time()
    proc = run_sh(
        mode, nproc, *DEFAULTS, *args, "--output-dir", folder / "run", env=job_env(TMPDIR=str(folder)), timeout=120
    )
    assert proc.returncode == 1, (case, proc.stderr[-3000:])
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1, (case, proc.stderr[-3000:])
    others = [line for line in proc.stderr.splitlines() if line not in errors]
    logs = list(folder.glob("run.sh-*-log.*"))
    assert others == [f"run.sh: the launcher's full report: {logs[0]}"], (case, proc.stderr[-3000:])
    report = logs[0].read_text()
    assert errors[0] in report and "ChildFailedError" in report and "Root Cause" in report, (case, report[-3000:])
    assert "Traceback" not in proc.stdout + proc.stderr, case
    print(f"{mode} {nproc}, {case}: {errors[0]} ({time.time() - started:.1f} s)")


# The launcher's report after a rank failed, captured from `bash run.sh ddp 2 --epochs 0` (site-packages paths cut).
CHILD_FAILED = """W1130 21:01:23.344000 9915 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 9948 closing signal SIGTERM
E1130 21:01:23.413000 9915 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 9947) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "<frozen runpy>", line 88, in _run_code
  File "torch/distributed/run.py", line 1142, in <module>
    main()
  File "torch/distributed/elastic/multiprocessing/errors/__init__.py", line 380, in wrapper
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "torch/distributed/run.py", line 1138, in main
    run(args)
  File "torch/distributed/run.py", line 1129, in run
    elastic_launch(
  File "torch/distributed/launcher/api.py", line 197, in __call__
    return launch_agent(
           ^^^^^^^^^^^^^
  File "torch/distributed/launcher/api.py", line 386, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
train_ddp_torchrun.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_21:01:23
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 9948)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 9948
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_21:01:23
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 9947) 
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
ERROR = "error: --epochs must be positive, got 0\n"
CRASH = """Traceback (most recent call last):
  File "train_ddp_torchrun.py", line 281, in <module>
    main(args)
RuntimeError: a rank's own crash
"""
# A node that cannot reach the rendezvous store, captured between two network namespaces (C++ frames shortened)
RENDEZVOUS = """[W1130 20:57:19.469812839 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3
[E1130 20:59:56.614336003 socket.cpp:1028] [c10d] The client socket has timed out after 60000ms while trying to connect to (10.77.9.1, 29561).
[E1130 20:59:56.614631053 TCPStore.cpp:328] [c10d] TCP client failed to connect/validate to host 10.77.9.1:29561 - timed out (try=1, timeout=60000ms): The client socket has timed out after 60000ms while trying to connect to (10.77.9.1, 29561).
Exception raised from throwTimeoutError at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/socket.cpp:1030 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >) + 0x9d (0x7f008ef5e60d in torch/lib/libc10.so)
frame #8: c10d::TCPStore::TCPStore(std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >, c10d::TCPStoreOptions const&) + 0x41d (0x7efffbd3e76d in torch/lib/libtorch_cpu.so)
<omitting python frames>
frame #39: _start + 0x21 (0x55ff20d01081 in /usr/bin/python3)

Traceback (most recent call last):
  File "torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 156, in _create_tcp_store
    store = TCPStore(
            ^^^^^^^^^
torch.distributed.DistNetworkError: The client socket has timed out after 60000ms while trying to connect to (10.77.9.1, 29561).

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "torch/distributed/run.py", line 1142, in <module>
    main()
  File "torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 180, in _create_tcp_store
    raise RendezvousConnectionError(
torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed. See inner exception for details.
"""


def stand_in(tmp_path, stderr, stdout=""):
    """A PYTHON for run.sh: the real one, except that "the launcher" writes what it is given and fails."""
    (tmp_path / "stderr.txt").write_text(stderr)
    (tmp_path / "stdout.txt").write_text(stdout)
    launcher = tmp_path / "python"
    launcher.write_text(
        f'#!/bin/bash\nif [ "$2" = torch.distributed.run ]; then cat {tmp_path}/stdout.txt; '
        f'cat {tmp_path}/stderr.txt >&2; exit 1; fi\nexec {sys.executable} "$@"\n'
    )
    launcher.chmod(0o755)
    return str(launcher)


@pytest.mark.parametrize("case", ["explained", "a rank crashed", "no rank said why"])
def test_run_sh_leaves_out_the_launchers_failure_report_only_after_a_ranks_error_line(tmp_path, case):
    stderr = {
        "explained": ERROR + CHILD_FAILED,
        "a rank crashed": CRASH + CHILD_FAILED,
        "no rank said why": CHILD_FAILED,
    }[case]
    proc = run_sh(
        "ddp",
        2,
        env=env_with(PYTHON=stand_in(tmp_path, stderr, stdout="epoch 1/2  step 1/3\n"), TMPDIR=str(tmp_path)),
        timeout=60,
    )
    logs = list(tmp_path.glob("run.sh-*-log.*"))
    assert proc.returncode == 1 and proc.stdout == "epoch 1/2  step 1/3\n", proc.stderr
    if case == "explained":
        assert proc.stderr == f"{ERROR}run.sh: the launcher's full report: {logs[0]}\n", proc.stderr
        assert logs[0].read_text() == stderr
    else:  # nothing said why it failed: the launcher's report is all there is, shown whole, and no log is kept
        assert proc.stderr == stderr and logs == [], proc.stderr


def test_run_sh_says_in_one_line_why_the_nodes_could_not_meet(tmp_path):
    env = env_with(
        PYTHON=stand_in(tmp_path, RENDEZVOUS),
        TMPDIR=str(tmp_path),
        NNODES="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29561",
    )
    proc = run_sh("ddp", 1, env=env, timeout=60)
    logs = list(tmp_path.glob("run.sh-*-log.*"))
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[1:] == [
        "run.sh: the nodes could not meet at 127.0.0.1:29561 (RendezvousConnectionError: The client socket has timed "
        "out after 60000ms while trying to connect to (10.77.9.1, 29561).): check MASTER_ADDR and MASTER_PORT on every "
        "node (bash run.sh doctor)",
        f"run.sh: the launcher's full report: {logs[0]}",
    ], proc.stderr
    assert proc.stderr.splitlines()[0].startswith("run.sh: this node holds MASTER_ADDR 127.0.0.1"), proc.stderr
    assert logs[0].read_text() == RENDEZVOUS


# ------------------------------------------------------------------------------------- more processes than GPUs
def gpus_answer(tmp_path, count):
    """A PYTHON for run.sh that answers its GPU count query with count: the real one for everything else."""
    python = tmp_path / "python"
    python.write_text(
        f'#!/bin/bash\ncase "$*" in *device_count*) echo {count}; exit 0 ;; esac\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    return str(python)


def test_more_processes_than_gpus_on_one_machine_train_on_the_cpu(tiny_data, tmp_path):
    """`bash run.sh ddp 4` on a one-GPU laptop: the processes train on the CPU with gloo, with one line saying so."""
    env = env_with(PYTHON=gpus_answer(tmp_path, 1), CUDA_VISIBLE_DEVICES="0")  # as on a machine with one GPU
    env.pop("OMP_NUM_THREADS")  # as a user runs it: run.sh shares the cores out as on a CPU-only machine
    job, lines, seen = (
        start_sh("ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", tmp_path / "run", env=env),
        [],
        {},
    )
    if read_until(job, lines, "epoch 1/2  step 1/3"):
        for rank, pid in ranks(job).items():
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            seen[rank] = (environ.get(b"CUDA_VISIBLE_DEVICES"), environ.get(b"OMP_NUM_THREADS"))
    output = finish(job, lines, timeout=180)
    threads = str(max(1, len(os.sched_getaffinity(0)) // 2)).encode()
    assert seen == {0: (b"", threads), 1: (b"", threads)}, seen
    assert job.returncode == 0, output[-3000:]
    assert output.splitlines()[0] == (
        "run.sh: 2 processes but 1 visible GPU: training on the CPU (gloo); use N <= 1 to train on the GPU"
    ), output[:1000]
    assert "global batch 16 = 8 per process x 2 processes" in output
    assert (tmp_path / "run" / "results.json").exists()


def test_more_processes_than_gpus_per_node_are_refused_on_several_nodes(tmp_path):
    # as on a machine with 2 GPUs (run.sh asks the stand-in only when CUDA_VISIBLE_DEVICES does not hide them all)
    env = env_with(PYTHON=gpus_answer(tmp_path, 2), CUDA_VISIBLE_DEVICES="0,1", NNODES="2", MASTER_ADDR="127.0.0.1")
    proc = run_sh("ddp", 4, env=env, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "run.sh: 4 processes but only 2 visible GPU(s): use N <= 2 (one process per GPU)\n"
