"""What the tests share, imported by them: what their processes see (job_env), the one job runner (start, run,
finish, ...), the checks of checkpoints and resumes, and the tiny datasets. The fixtures are in conftest.py."""

import contextlib
import fcntl
import json
import os
import re
import runpy
import shutil
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


def logger(folder, names, epochs=1, steps_per_epoch=1, global_batch=2, print_freq=1, global_step=0):
    """utils.Logger as a run at its start makes it (a resumed one: at global_step), from the flags and the position it
    reads."""
    import argparse
    import types

    import utils

    flags = argparse.Namespace(epochs=epochs, print_freq=print_freq)
    position = types.SimpleNamespace(
        steps_per_epoch=steps_per_epoch, global_batch=global_batch, global_step=global_step
    )
    return utils.Logger(folder, names, flags, position)


# Tiny runs: 32-pixel crops, batch 8, two epochs, a progress line after every step. FAST: in the main process
# (no loader workers). DEFAULTS: what a user runs, made small (loader workers on, BatchNorm training). EXACT:
# --freeze (BatchNorm in eval mode, the head trains), where W processes x batch B end where one process with batch
# W x B ends, to float32 summation order.
FAST = ["--img-size", "32", "-b", "8", "--epochs", "2", "--workers", "0", "--print-freq", "1"]
DEFAULTS = ["--img-size", "32", "-b", "8", "--epochs", "2", "--print-freq", "1", "--val-fraction", "0.25"]
EXACT = [
    *"--img-size 32 --epochs 2 --workers 0 --print-freq 1 --val-fraction 0.25 --freeze".split(),
]
NAMED_WEIGHTS = [*EXACT, "--weights", "IMAGENET1K_V1"]  # torchvision's weights by name, from hub_cache
BF16 = ["--amp-dtype", "bf16"]  # asked for by name: where the CPU has no bf16 arithmetic, the amp rung refuses it
FP16_CLIP = "50"  # --clip-grad for the tiny runs' fp16/bf16: bounds the first steps (norm 60-80), which still learn
NO_NETWORK = {name: "http://127.0.0.1:9" for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
NO_NETWORK.update(no_proxy="", NO_PROXY="")  # every proxy at a closed port: a download fails at once


# ---------------------------------------------------------------------------- what the tests' processes see
# The CPU tests hide every GPU from what they start (on a GPU machine run.sh would refuse 2 processes on one GPU,
# and the bitwise comparisons would run on cuDNN); only tests/gpu/test_gpu.py sees the GPUs the suite was started with.
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


# ------------------------------------------------------------------------------------- the lessons' gallery
def module_at(path, name):
    """The module of the file REPO/path, imported by its path as `name`: tools/site.py (`import site` is the standard
    library's module, imported at every start), a test module that does not sit beside its reader."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_rung(rung, folder):
    """`bash run.sh copy RUNG FOLDER`, as a copier runs it (tools/copy_rung.py): the rung and its helpers in folder."""
    return module_at("tools/copy_rung.py", "copy_rung").copy(rung, Path(folder))


def lessons():
    """{id: Lesson} of tests/proofs/test_lessons.py's LESSONS, for the modules that do not sit beside it: the GPU
    tests prove the GPU-only lessons, and tests/units checks docs/lessons.md against them."""
    return {lesson.id: lesson for lesson in module_at("tests/proofs/test_lessons.py", "lessons_listed").LESSONS}


def broken_copy(bare, folder, lesson):
    """The scripts and helpers of `bare` copied into the new folder, lesson.line replaced there by lesson.changed_to
    in lesson.script. The line must occur in the script exactly once: where it changed or went, the lesson's test
    fails here instead of proving nothing. LESSONS_UNBROKEN=1 keeps the line (checked all the same): each lesson's
    test must then fail."""
    folder.mkdir()
    for path in bare.glob("*.py"):
        shutil.copy(path, folder)
    script = folder / lesson.script
    text = script.read_text()
    count = text.count(lesson.line)
    assert count == 1, f"{lesson.id}: {lesson.line!r} occurs {count} times in {lesson.script}, not once"
    if not os.environ.get("LESSONS_UNBROKEN"):
        script.write_text(text.replace(lesson.line, lesson.changed_to))
    return folder


# ------------------------------------------------------------------------------------------------- data
def make_dataset(root, counts, size=32, ext=".jpg"):
    """A class-folder dataset: class i is folder c<i> with counts[i] images, its own colours and stripes (a small
    network tells them apart), each image with seeded noise."""
    from PIL import Image

    file_format, root = Image.registered_extensions()[ext.lower()], Path(root)
    y, x = torch.meshgrid(
        torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32), indexing="ij"
    )
    for label, count in enumerate(counts):
        (root / f"c{label}").mkdir(parents=True, exist_ok=True)
        colours = torch.Generator().manual_seed(1000 + label)
        background = torch.rand(3, 1, 1, generator=colours) * 0.5
        foreground = background + 0.3 + 0.2 * torch.rand(3, 1, 1, generator=colours)
        clean = background + (foreground - background) * (((x if label % 2 == 0 else y) // (2 + label % 5)) % 2)
        for i in range(count):
            noise = 0.06 * torch.randn(3, size, size, generator=torch.Generator().manual_seed(label * 100_000 + i))
            image = ((clean + noise).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous()
            Image.fromarray(image.numpy()).save(
                root / f"c{label}" / f"{i:04d}{ext}",
                format=file_format,
                **({"quality": 95} if file_format == "JPEG" else {}),
            )
    return root


# ---------------------------------------------------------------------------------------- reference runs
def shared_run(tmp_path_factory, name, make):
    """make(folder) once in the whole session, even where xdist runs it in several workers (the first to ask makes
    it, the others wait for it); what it returns must be JSON. Returns (folder, that value)."""
    root = tmp_path_factory.getbasetemp()
    root = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / "shared"
    root.mkdir(exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"{name}.json").exists():
            shutil.rmtree(root / name, ignore_errors=True)  # a failed attempt's
            (root / name).mkdir()
            (root / f"{name}.json").write_text(json.dumps(make(root / name)))
    return root / name, json.loads((root / f"{name}.json").read_text())


def kill_mid_epoch(mode, args, output_dir):
    """bash run.sh MODE 2 ARGS --save-every 1, SIGKILLed (every process) once step 2 of epoch 1 is logged: its last.pt,
    of step 1 or 2 (16 or 32 samples at 2 processes x batch 8)."""
    job, lines = start_sh(mode, 2, *args, "--save-every", "1", "--output-dir", output_dir), []
    seen = read_until(job, lines, "epoch 1/2  step 2/3")
    if seen:
        deliver(job, "every process", signal.SIGKILL)
    output = finish(job, lines, timeout=60)
    assert seen, output[-3000:]
    checkpoint = torch.load(output_dir / "last.pt", weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["samples"] in (16, 32), checkpoint["samples"]
    return checkpoint


def copy_while_paused(job, folder, copy):
    """The checkpoint a SIGKILL would leave now: every process of the job paused, folder's last.pt copied into the new
    folder `copy` (with the shards it names, FSDP), the job let go on: it stays the uninterrupted run."""
    deliver(job, "every process", signal.SIGSTOP)
    try:
        copy.mkdir()
        shutil.copy(folder / "last.pt", copy)
        checkpoint = torch.load(copy / "last.pt", weights_only=True)
        if isinstance(checkpoint["optimizer"], str):
            shutil.copytree(folder / checkpoint["optimizer"], copy / checkpoint["optimizer"])
    finally:
        deliver(job, "every process", signal.SIGCONT)
    return checkpoint


def run_and_kill_one_worker(cwd, script, args, kill_after, victim, env=None):
    """torchrun --max-restarts=1; SIGKILL one worker once `kill_after` is printed. Returns (stdout, exit code, the
    pid killed). Every process of the job is killed at the latest 240 s after the start (the watchdog)."""
    proc = start(
        [
            sys.executable,
            *f"-m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1 {script}".split(),
            *args,
        ],
        env=env,
        cwd=cwd,
        timeout=240,
    )
    lines, killed = [], None
    for line in proc.stdout:
        lines.append(line)
        if killed is None and kill_after in line:
            killed = sorted(children(proc.pid))[victim]
            os.kill(killed, signal.SIGKILL)
    return finish(proc, lines, timeout=30), proc.returncode, killed


def read_lines(job, into):
    thread = threading.Thread(target=lambda: into.extend(job.stdout), daemon=True)
    thread.start()
    return thread


def end_all(jobs, readers):
    """(in a finally) every job's watchdog off and its processes killed, every output reader done."""
    for job in jobs:
        job.watchdog.cancel()
        kill_job(job.token)
    for reader in readers:
        reader.join(timeout=10)
