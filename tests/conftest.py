"""What the tests' processes see, the one job runner, and the checks of checkpoints and resumes. The session
fixtures (tiny datasets, the reference runs) are in shared.py. `bash run.sh test` runs the suite with pytest-xdist:
two workers, each taking whole modules (--dist loadfile)."""

import contextlib
import json
import os
import re
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools")]  # so that tests can import utils, builtin and the tools
pytest_plugins = ["shared"]  # the session fixtures (shared.py): tiny datasets, the reference runs

# Tiny runs: 32-pixel crops, batch 8, two epochs, a progress line after every step. FAST: in the main process
# (no loader workers). DEFAULTS: what a user runs, made small (loader workers on, BatchNorm training). EXACT:
# --freeze (BatchNorm in eval mode, the head trains), where W processes x batch B end where one process with batch
# W x B ends, to float32 summation order.
FAST = ["--img-size", "32", "-b", "8", "--epochs", "2", "--workers", "0", "--print-freq", "1"]
DEFAULTS = ["--img-size", "32", "-b", "8", "--epochs", "2", "--print-freq", "1", "--val-fraction", "0.25"]
EXACT = [
    "--img-size",
    "32",
    "--epochs",
    "2",
    "--workers",
    "0",
    "--print-freq",
    "1",
    "--val-fraction",
    "0.25",
    "--freeze",
]
NAMED_WEIGHTS = [*EXACT, "--weights", "IMAGENET1K_V1"]  # torchvision's weights by name, from hub_cache
BF16 = ["--amp-dtype", "bf16"]  # asked for by name: where the CPU has no bf16 arithmetic, the amp rung refuses it
FP16_CLIP = "50"  # --clip-grad for the tiny runs' fp16/bf16: bounds the first steps (norm 60-80), which still learn
NO_NETWORK = {name: "http://127.0.0.1:9" for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
NO_NETWORK.update(no_proxy="", NO_PROXY="")  # every proxy at a closed port: a download fails at once


# ---------------------------------------------------------------------------- what the tests' processes see
# The CPU tests hide every GPU from what they start (on a GPU machine run.sh would refuse 2 processes on one GPU,
# and the bitwise comparisons would run on cuDNN); only tests/test_gpu.py sees the GPUs the suite was started with.
USER_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")


def cpu_env(**extra):
    return {**os.environ, **extra, "CUDA_VISIBLE_DEVICES": ""}


def gpu_env(**extra):
    env = {**os.environ, **extra}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if USER_VISIBLE_DEVICES is not None:
        env["CUDA_VISIBLE_DEVICES"] = USER_VISIBLE_DEVICES
    return env


def job_env(**extra):
    """A job's environment: one thread per process (2 processes share the 2 cores), unbuffered output, no GPU."""
    return cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=sys.executable, **extra)


def hub_env(hub_cache, **extra):
    return job_env(TORCH_HOME=str(hub_cache[0]), **NO_NETWORK, **extra)


@pytest.fixture(scope="module", autouse=True)
def hide_gpus(request):
    """Also in this process's environment, for what a CPU test starts without job_env()."""
    with pytest.MonkeyPatch.context() as patch:
        if request.module.__name__ != "test_gpu":
            patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


@pytest.fixture(scope="session", autouse=True)
def default_stop_signals(tmp_path_factory):
    """A suite started with SIGINT or SIGHUP ignored (`nohup bash run.sh test &`) would pass the ignore on to every
    job, and the tests that stop a job with those signals would watch it train on: a handler that does nothing keeps
    this process deaf to them, and exec gives every started process the default. Started processes keep what they
    leave in $TMPDIR (run.sh's launcher logs) in the session's folder."""
    ignored = [signum for signum in (signal.SIGINT, signal.SIGHUP) if signal.getsignal(signum) == signal.SIG_IGN]
    for signum in ignored:
        signal.signal(signum, lambda signum, frame: None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
        yield
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: a headline proof, run by `bash run.sh test quick` too")


# ------------------------------------------------------------------------------------------- the job runner
# Every job carries a token of its own in its environment (TEST_JOB), inherited by every process under it: torchrun's
# workers (in sessions of their own) and their loader workers, even once reparented. Past its time limit, every
# process with the token is killed, and nothing else.
def job_processes(token):
    mark, found = f"TEST_JOB={token}".encode(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def kill_job(token):
    for _ in range(3):  # a process may fork while we look
        for pid in job_processes(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def start(cmd, *, env=None, cwd=REPO, timeout=300):
    """Popen(cmd), stdout and stderr merged, in a session of its own; after `timeout` seconds every process of the job
    is killed (which also ends a loop reading its output). job.token names its processes."""
    token = uuid.uuid4().hex
    job = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=cwd,
        env={**(env or job_env()), "TEST_JOB": token},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    job.token, job.watchdog = token, threading.Timer(timeout, kill_job, [token])
    job.watchdog.daemon = True
    job.watchdog.start()
    return job


def run(cmd, *, env=None, cwd=REPO, timeout=150):
    return run_together([cmd], env=env, cwd=cwd, timeout=timeout)[0]


def run_together(commands, *, env=None, cwd=REPO, timeout=150):
    """Every command started at once (the nodes of one job), each to its end: a CompletedProcess each (stdout and
    stderr apart, kept in files: no pipe fills up while another node is waited for), .seconds from the start to its
    end. Past `timeout` every process of them is killed and subprocess.TimeoutExpired raised; none outlives them."""
    token, started, procs = uuid.uuid4().hex, time.time(), []
    try:
        for command in commands:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            procs.append(
                (
                    subprocess.Popen(
                        [str(c) for c in command],
                        cwd=cwd,
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                        env={**(env or job_env()), "TEST_JOB": token},
                    ),
                    out,
                    err,
                )
            )
        done = []
        for proc, out, err in procs:
            code = proc.wait(timeout=max(1, timeout - (time.time() - started)))
            out.seek(0), err.seek(0)
            done.append(subprocess.CompletedProcess(proc.args, code, out.read(), err.read()))
            done[-1].seconds = time.time() - started
        return done
    finally:
        kill_job(token)
        for _, out, err in procs:
            out.close(), err.close()


def run_sh(*args, env=None, timeout=150):
    return run(["bash", "run.sh", *args], env=env, timeout=timeout)


def start_sh(*args, env=None, timeout=300):
    return start(["bash", "run.sh", *args], env=env, timeout=timeout)


def torchrun(nproc, script, *args, cwd=REPO, env=None, timeout=150, launcher="torch.distributed.run"):
    return run(
        [sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={nproc}", script, *args],
        cwd=cwd,
        env=env,
        timeout=timeout,
    )


def in_this_process(script, args, capfd):
    """`python SCRIPT ARGS` in this process, torch imported already (bad input ending before training): code, stderr."""
    capfd.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [script, *map(str, args)])
        try:
            runpy.run_path(str(REPO / script), run_name="__main__")
            status = 0
        except SystemExit as ending:
            status = ending.code
    return subprocess.CompletedProcess([script, *args], status, "", capfd.readouterr().err)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def read_until(job, lines, marker):
    """Read the job's output into `lines` until a line holds `marker`: that line, or None if the output ended."""
    for line in job.stdout:
        lines.append(line)
        if marker in line:
            return line
    return None


def finish(job, lines, timeout):
    """The job's whole output once it has ended within `timeout` s (else every process of it is killed: a failure)."""
    try:
        lines.append(job.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        kill_job(job.token)
        lines.append(job.communicate()[0])
        raise AssertionError(f"the job was still running {timeout} s later:\n{''.join(lines)[-3000:]}") from None
    finally:
        job.watchdog.cancel()
        kill_job(job.token)
    return "".join(lines)


def deliver(job, how, signum):
    """signum as it arrives: to torchrun's agent ("agent", which forwards it to each worker's process group), to the
    job's process group ("group": a terminal's Ctrl-C) or to every process of it ("every process": SLURM's scancel)."""
    if how == "agent":
        os.kill(next(p for p in descendants(job.pid) if "torch.distributed.run" in command(p)), signum)
    elif how == "group":
        os.killpg(job.pid, signum)
    else:
        pids = [job.pid, *descendants(job.pid)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        while signum == signal.SIGSTOP and any(proc_field(p, "state") not in ("T", "Z", "") for p in pids):
            time.sleep(0.01)  # kill() returns before a process running on the other core has stopped (seen: a write)


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def descendants(pid):
    return [p for child in children(pid) for p in (child, *descendants(child))]


def proc_field(pid, name):
    """/proc/PID/cmdline ("cmdline"), or a field of /proc/PID/stat ("state", "ppid"); "" once it is gone."""
    try:
        if name == "cmdline":
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[{"state": 0, "ppid": 1}[name]]
    except OSError:
        return ""


def command(pid):
    return proc_field(pid, "cmdline")


def ranks(job):
    """{global rank: pid} of the training processes under a job (not their loader workers)."""
    found = {}
    for pid in descendants(job.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and "torch.distributed" in command(proc_field(pid, "ppid")):
            found[int(env[b"RANK"])] = pid
    return found


def assert_gone(pids, within=30):
    """None of pids left but zombies (loader workers notice a dead parent within 5 s; the margin is for load)."""
    deadline = time.time() + within
    while (alive := [p for p in pids if proc_field(p, "state") not in ("", "Z")]) and time.time() < deadline:
        time.sleep(0.2)
    assert not alive, f"processes left behind: {[(p, command(p)[:80]) for p in alive]}"


def assert_job_gone(token, within=30):
    assert_gone(job_processes(token), within)


# --------------------------------------------------------------------------------- checkpoints and resumes
def load_model_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_weights(a, b, atol=0.0):
    """Same keys and shapes, integer tensors equal, float tensors within atol (0: bitwise, -0.0 and 0.0 apart)."""
    assert set(a) == set(b), f"keys only in one: {sorted(set(a) ^ set(b))[:5]}"
    worst_key, worst = None, -1.0
    for key in a:
        x, y = a[key], b[key]
        assert x.shape == y.shape, f"{key}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        if not x.is_floating_point():
            assert torch.equal(x, y), f"{key}: integer tensors differ"
            continue
        x, y = x.double(), y.double()
        diff = (
            float("inf")
            if not torch.equal(x.isnan(), y.isnan())
            else torch.where((x == y) | x.isnan(), 0.0, (x - y).abs()).max().item()
            if x.numel()
            else 0.0
        )
        if atol == 0.0 and diff == 0.0 and not torch.equal(x.signbit(), y.signbit()):
            diff = float("inf")
        if diff > worst:
            worst_key, worst = key, diff
    assert worst <= atol, f"weights differ: max |difference| {worst:.3g} > {atol} at {worst_key}"


PROGRESS = re.compile(r"^epoch (\d+)/(\d+)\s+step (\d+)/(\d+)\s", re.MULTILINE)  # utils.Logger.step's line
RESUMING = re.compile(r"resuming from .*: epoch (\d+) after (\d+) of its (\d+) samples \(at global batch \d+\)")


def progress_steps(output):
    """The global step numbers of a run's progress lines, in order (--print-freq 1: every step)."""
    return [(int(epoch) - 1) * int(steps) + int(step) for epoch, _, step, steps in PROGRESS.findall(output)]


def assert_resumed_after(output, step=None):
    """The last run in `output` resumed (its `resuming from` line) and then trained each step after the checkpoint's
    once, to the end; `step`, if given, must be the checkpoint's (in this run's global batch). Returns those steps."""
    resumes = list(RESUMING.finditer(output))
    assert resumes, f"no 'resuming from' line:\n{output[-3000:]}"
    epoch, samples, epoch_samples = map(int, resumes[-1].groups())
    global_batch = int(re.findall(r"global batch (\d+) ", output[: resumes[-1].start()])[-1])
    after = output[resumes[-1].end() :]
    progress = PROGRESS.findall(after)
    assert progress, f"no progress line after the resume:\n{after[-3000:]}"
    epochs, steps_per_epoch = int(progress[-1][1]), int(progress[-1][3])
    done = epoch * steps_per_epoch - (epoch_samples - samples) // global_batch  # as the scripts count it
    assert step is None or done == step, f"resumed after step {done}, but the checkpoint was of step {step}"
    trained = progress_steps(after)
    assert trained == list(range(done + 1, epochs * steps_per_epoch + 1)), (
        f"resumed after step {done}, then trained steps {trained}:\n{after[-3000:]}"
    )
    return trained


def collectives_per_step(trace):  # as tools/profile_report.py reads a --profile run's trace.json
    import profile_report

    return profile_report.figures(json.loads(Path(trace).read_text()))["collectives_per_step"]


def checkpoint_step(checkpoint, steps_per_epoch):  # in the global batch that saved it
    return checkpoint["epoch"] * steps_per_epoch + checkpoint["samples"] // checkpoint["global_batch"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
