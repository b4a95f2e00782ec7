"""The suite's shared parts: what the started processes see, the one job runner, tiny datasets, checkpoint
comparisons, and the reference runs that several modules compare with.

`bash run.sh test` runs the suite with pytest-xdist: two workers, each taking whole modules (--dist loadfile). A
reference run that modules on both workers need is made once, by whichever asks first (shared_run).
"""
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

# Tiny runs: 32-pixel crops, batch 8, two epochs, a progress line after every step. FAST: in the main process
# (no loader workers). DEFAULTS: what a user runs, made small (loader workers on, BatchNorm training). EXACT:
# --freeze (BatchNorm in eval mode, the head trains), where W processes x batch B end where one process with batch
# W x B ends, to float32 summation order.
FAST = ["--img-size", "32", "-b", "8", "--epochs", "2", "--workers", "0", "--print-freq", "1"]
DEFAULTS = ["--img-size", "32", "-b", "8", "--epochs", "2", "--print-freq", "1", "--val-fraction", "0.25"]
EXACT = ["--img-size", "32", "--epochs", "2", "--workers", "0", "--print-freq", "1", "--val-fraction", "0.25",
         "--freeze"]
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
            with_no_error(os.kill, pid, signal.SIGKILL)


def with_no_error(call, *args):
    try:
        call(*args)
    except (ProcessLookupError, PermissionError):
        pass


def start(cmd, *, env=None, cwd=REPO, timeout=300):
    """Popen(cmd), stdout and stderr merged, in a session of its own; after `timeout` seconds every process of the job
    is killed (which also ends a loop reading its output). job.token names its processes."""
    token = uuid.uuid4().hex
    job = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env={**(env or job_env()), "TEST_JOB": token},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    job.token, job.watchdog = token, threading.Timer(timeout, kill_job, [token])
    job.watchdog.daemon = True
    job.watchdog.start()
    return job


def run(cmd, *, env=None, cwd=REPO, timeout=150):
    """cmd to its end (run_together's)."""
    return run_together([cmd], env=env, cwd=cwd, timeout=timeout)[0]


def run_together(commands, *, env=None, cwd=REPO, timeout=150):
    """Every command started at once (the nodes of one job), each to its end: a CompletedProcess each (stdout and
    stderr apart, kept in files: no pipe fills up while another node is waited for), .seconds from the start to its
    end. Past `timeout` every process of them is killed and subprocess.TimeoutExpired raised; none outlives them."""
    token, started, procs = uuid.uuid4().hex, time.time(), []
    try:
        for command in commands:
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            procs.append((subprocess.Popen([str(c) for c in command], cwd=cwd, stdout=out, stderr=err,
                                           stdin=subprocess.DEVNULL, start_new_session=True,
                                           env={**(env or job_env()), "TEST_JOB": token}), out, err))
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
    return run([sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={nproc}", script, *args], cwd=cwd,
               env=env, timeout=timeout)


def in_this_process(script, args, capfd):
    """`python SCRIPT ARGS` run in this process, where torch is imported already (for bad input that ends before any
    training): its exit status and stderr."""
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
    """The job's whole output once it has ended (within `timeout` seconds, or every process of it is killed and the
    test fails)."""
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
        for pid in [job.pid, *descendants(job.pid)]:
            with_no_error(os.kill, pid, signum)


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
        diff = float("inf") if not torch.equal(x.isnan(), y.isnan()) else \
            torch.where((x == y) | x.isnan(), 0.0, (x - y).abs()).max().item() if x.numel() else 0.0
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
    global_batch = int(re.findall(r"global batch (\d+) ", output[:resumes[-1].start()])[-1])
    after = output[resumes[-1].end():]
    progress = PROGRESS.findall(after)
    assert progress, f"no progress line after the resume:\n{after[-3000:]}"
    epochs, steps_per_epoch = int(progress[-1][1]), int(progress[-1][3])
    done = epoch * steps_per_epoch - (epoch_samples - samples) // global_batch  # as the scripts count it
    assert step is None or done == step, f"resumed after step {done}, but the checkpoint was of step {step}"
    trained = progress_steps(after)
    assert trained == list(range(done + 1, epochs * steps_per_epoch + 1)), \
        f"resumed after step {done}, then trained steps {trained}:\n{after[-3000:]}"
    return trained


def collectives_per_step(trace):
    """{collective: calls per profiled step}, as tools/profile_report.py reads a --profile run's trace.json."""
    import profile_report
    return profile_report.figures(json.loads(Path(trace).read_text()))["collectives_per_step"]


def checkpoint_step(checkpoint, steps_per_epoch):
    """The global step after which a checkpoint was saved, in the global batch that saved it."""
    return checkpoint["epoch"] * steps_per_epoch + checkpoint["samples"] // checkpoint["global_batch"]


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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------- data
def make_dataset(root, counts, size=32, ext=".jpg"):
    """A class-folder dataset: class i is folder c<i> with counts[i] images, its own colours and stripes (a small
    network tells them apart), each image with seeded noise."""
    from PIL import Image
    file_format, root = Image.registered_extensions()[ext.lower()], Path(root)
    y, x = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                          indexing="ij")
    for label, count in enumerate(counts):
        (root / f"c{label}").mkdir(parents=True, exist_ok=True)
        colours = torch.Generator().manual_seed(1000 + label)
        background = torch.rand(3, 1, 1, generator=colours) * 0.5
        foreground = background + 0.3 + 0.2 * torch.rand(3, 1, 1, generator=colours)
        clean = background + (foreground - background) * (((x if label % 2 == 0 else y) // (2 + label % 5)) % 2)
        for i in range(count):
            noise = 0.06 * torch.randn(3, size, size, generator=torch.Generator().manual_seed(label * 100_000 + i))
            image = ((clean + noise).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).contiguous()
            Image.fromarray(image.numpy()).save(root / f"c{label}" / f"{i:04d}{ext}", format=file_format,
                                                **({"quality": 95} if file_format == "JPEG" else {}))
    return root


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """3 classes of 32x32 JPEGs, 22 + 21 + 24. With --val-fraction 0.25: 17 validation images (divisible neither by
    2 nor by 3) and 50 training images, 6 steps an epoch at batch 8, 3 at 2 processes x 8."""
    return make_dataset(tmp_path_factory.mktemp("tiny") / "data", [22, 21, 24])


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    """A TORCH_HOME whose hub cache holds seeded 1000-class "ImageNet weights" for resnet18 where torchvision reads
    ResNet18_Weights.IMAGENET1K_V1 from: --weights IMAGENET1K_V1 with no network. (TORCH_HOME, the state dict)."""
    import torchvision
    torch_home = tmp_path_factory.mktemp("torch_home")
    (torch_home / "hub" / "checkpoints").mkdir(parents=True)
    torch.manual_seed(1234)
    state = torchvision.models.resnet18(num_classes=1000).state_dict()
    torch.save(state, torch_home / "hub" / "checkpoints" / torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url
               .rsplit("/", 1)[-1])
    return torch_home, state


@pytest.fixture(scope="session")
def initial_weights():
    """The weights every script starts from on 3 classes: its seed 0, then builtin.resnet("resnet18", 3)."""
    import builtin
    torch.manual_seed(0)
    return builtin.resnet("resnet18", 3).state_dict()


@pytest.fixture(scope="session")
def bare(tmp_path_factory):
    """An empty folder with the six scripts, utils.py and builtin.py copied in: what a user copies into a project."""
    folder = tmp_path_factory.mktemp("bare")
    for script in REPO.glob("train_*.py"):
        shutil.copy(script, folder)
    for name in ("utils.py", "builtin.py"):
        shutil.copy(REPO / name, folder)
    return folder


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


@pytest.fixture(scope="session")
def default_runs(tmp_path_factory, tiny_data):
    """Uninterrupted runs with the defaults, torchrun and amp rungs, 2 processes through run.sh: its folder/<mode>."""
    def make(folder):
        for mode in ("ddp", "amp"):
            ok(run_sh(mode, 2, *DEFAULTS, *(BF16 if mode == "amp" else []), "--data-path", tiny_data, "--output-dir",
                      folder / mode))
    return shared_run(tmp_path_factory, "default_runs", make)[0]


@pytest.fixture(scope="session")
def exact_single(tmp_path_factory, tiny_data, bare):
    """train_single.py (copied out), batch 16, EXACT: the reference of the --freeze runs of test_scale and test_fsdp."""
    def make(folder):
        ok(run([sys.executable, "train_single.py", *EXACT, "--data-path", tiny_data, "-b", "16", "--output-dir",
                folder], cwd=bare))
    return shared_run(tmp_path_factory, "exact_single", make)[0]


@pytest.fixture(scope="session")
def ddp_killed(tmp_path_factory, tiny_data):
    """bash run.sh ddp 2 EXACT -b 8, SIGKILLed mid-epoch: (its last.pt, which no test writes to, the checkpoint)."""
    def make(folder):
        kill_mid_epoch("ddp", [*EXACT, "--data-path", tiny_data, "-b", "8"], folder)
    folder, _ = shared_run(tmp_path_factory, "ddp_killed", make)
    return folder / "last.pt", torch.load(folder / "last.pt", weights_only=True)


@pytest.fixture(scope="session")
def fsdp_killed(tmp_path_factory, tiny_data):
    """bash run.sh fsdp 2 EXACT -b 8, SIGKILLed mid-epoch: (its folder, which no test writes to, the checkpoint)."""
    def make(folder):
        kill_mid_epoch("fsdp", [*EXACT, "--data-path", tiny_data, "-b", "8"], folder)
    folder, _ = shared_run(tmp_path_factory, "fsdp_killed", make)
    return folder, torch.load(folder / "last.pt", weights_only=True)


@pytest.fixture(scope="session")
def fsdp_references(tmp_path_factory, tiny_data, bare):
    """train_fsdp.py, 2 processes x batch 8, EXACT (folder/fsdp, its stdout), and bash run.sh fsdp 2 with the
    defaults, BatchNorm training, every warning shown (folder/bn, its stderr)."""
    def make(folder):
        fsdp = ok(torchrun(2, "train_fsdp.py", *EXACT, "--data-path", tiny_data, "-b", "8", "--output-dir",
                           folder / "fsdp", cwd=bare))
        bn = ok(run_sh("fsdp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", folder / "bn",
                       env=job_env(PYTHONWARNINGS="default")))
        return fsdp.stdout, bn.stderr
    folder, (stdout, stderr) = shared_run(tmp_path_factory, "fsdp_references", make)
    return {"dir": folder, "fsdp": stdout, "bn": folder / "bn", "bn_stderr": stderr}


@pytest.fixture(scope="session")
def amp_run(tmp_path_factory, tiny_data, bare, hub_cache):
    """train_ddp_amp.py (bf16 autocast), 2 processes x batch 8, NAMED_WEIGHTS, --save-every 2: test_ddp's amp tests and
    test_compile's eager run. Its checkpoint when step 3 of epoch 1 is logged is copied while the job is paused
    (copy_while_paused), for test_compile to resume compiled. {"dir", "stdout", "paused": the copy's folder}."""
    def make(folder):
        job, lines = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "train_ddp_amp.py", *NAMED_WEIGHTS, *BF16, "--data-path", tiny_data, "-b", "8",
                            "--save-every", "2", "--output-dir", folder / "run"], cwd=bare, env=hub_env(hub_cache),
                           timeout=150), []
        if read_until(job, lines, "epoch 1/2  step 3/3"):
            copy_while_paused(job, folder / "run", folder / "paused")
        output = finish(job, lines, timeout=150)
        assert job.returncode == 0 and (folder / "paused").is_dir(), output[-3000:]
        return output
    folder, stdout = shared_run(tmp_path_factory, "amp_run", make)
    return {"dir": folder / "run", "stdout": stdout, "paused": folder / "paused"}


@pytest.fixture(scope="session")
def evaluations(tmp_path_factory, default_runs, tiny_data, bare):
    """--test-only of default_runs' last.pt (BatchNorm training, loader workers) by each DDP rung at 1, 2 and 3
    processes: {name: results.json}. "single": train_single.py; "launch": train_ddp_launch.py, 2 processes under
    torch.distributed.launch; "alone": train_ddp_launch.py --local_rank=0 (the old spelling) with a launcher's
    variables and no launcher; "torchrun": train_ddp_torchrun.py, 3 processes; "amp": train_ddp_amp.py, 2 processes,
    of the amp run's last.pt."""
    alone = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    cases = {"single": (["train_single.py"], "ddp"), "alone": (["train_ddp_launch.py", "--local_rank=0"], "ddp"),
             "launch": (["-m", "torch.distributed.launch", "--standalone", "--nproc-per-node=2",
                         "train_ddp_launch.py"], "ddp"),
             "torchrun": (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                           "train_ddp_torchrun.py"], "ddp"),
             "amp": (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train_ddp_amp.py"], "amp")}

    def make(folder):
        results = {}
        for name, (started_as, mode) in cases.items():
            env = job_env(**alone, MASTER_PORT=str(free_port())) if name == "alone" else job_env()
            ok(run([sys.executable, *started_as, "--test-only", "--resume", default_runs / mode / "last.pt",
                    "--data-path", tiny_data, "--img-size", "32", "--val-fraction", "0.25",
                    *(BF16 if mode == "amp" else []), "--output-dir", folder / name], cwd=bare, env=env))
            results[name] = json.loads((folder / name / "results.json").read_text())
        return results
    return shared_run(tmp_path_factory, "evaluations", make)[1]
