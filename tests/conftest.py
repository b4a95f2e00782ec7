"""Shared helpers for the test suite: tiny image datasets, running the scripts, comparing checkpoints.

Other test files import these by name (`from conftest import REPO, FAST, run_script, ...`); keep the names and
signatures stable.
"""
import concurrent.futures
import inspect
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # so that tests can `import utils`

# A fast argument list: tiny crops, small batches, two epochs, data loading in the main process, a progress
# line (and TensorBoard train point) after every step.
FAST = ["--img-size", "32", "-b", "8", "--epochs", "2", "--workers", "0", "--print-freq", "1"]


# ------------------------------------------------------------------------------ what the tests' processes see
# The CPU tests hide every GPU from the processes they start: on a GPU machine run.sh would otherwise refuse 2
# processes on one GPU, `--device cuda` would train instead of failing, and the bitwise comparisons would run on
# cuDNN. Only tests/test_gpu.py sees the GPUs (as the user set CUDA_VISIBLE_DEVICES before starting the suite).
USER_VISIBLE_DEVICES = os.environ.get("CUDA_VISIBLE_DEVICES")
GPU_MODULES = ("test_gpu",)


def cpu_env(**extra):
    """The environment of every process a CPU test starts: this one's, with no GPU visible."""
    return {**os.environ, **extra, "CUDA_VISIBLE_DEVICES": ""}


def gpu_env(**extra):
    """tests/test_gpu.py's: the GPUs the suite was started with."""
    env = {**os.environ, **extra}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if USER_VISIBLE_DEVICES is not None:
        env["CUDA_VISIBLE_DEVICES"] = USER_VISIBLE_DEVICES
    return env


@pytest.fixture(scope="session", autouse=True)
def default_stop_signals():
    """A suite started with SIGINT or SIGHUP ignored (`nohup bash run.sh test &`: nohup ignores SIGHUP, and a shell
    script's background job SIGINT) would pass that on to every job it starts, and the tests that stop a job with
    those signals would watch it train on. A handler that does nothing keeps this process deaf to them, as it was
    started; exec resets a handler, unlike an ignore, so every started process gets the default."""
    ignored = [signum for signum in (signal.SIGINT, signal.SIGHUP) if signal.getsignal(signum) == signal.SIG_IGN]
    for signum in ignored:
        signal.signal(signum, lambda signum, frame: None)
    yield
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory):
    """What the started processes leave in $TMPDIR (run.sh keeps the launcher's report there) goes to the session's
    own temporary folder, not /tmp."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
        yield


@pytest.fixture(scope="module", autouse=True)
def hide_gpus(request):
    """Also hide them in this process's environment, for what a CPU test starts without a helper (anything that
    inherits os.environ). The GPU modules keep them."""
    if request.module.__name__ in GPU_MODULES:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        yield


def pytest_configure(config):
    # torchvision 0.29 deprecates its image codecs (utils.py uses them, with PIL as the fallback); the scripts
    # do not show the warning, and the test summary need not either
    config.addinivalue_line("filterwarnings", "ignore:The image decoding and encoding:DeprecationWarning")
    # bash run.sh test quick runs only these (pytest -m quick): each rung trains, DDP equals one device, a kill and
    # resume is bitwise, bad input gives one line, a stop signal saves and resumes
    config.addinivalue_line("markers", "quick: a headline proof, run by `bash run.sh test quick` too")
    config.addinivalue_line("markers", "alone: no reference run in the background beside this test (conftest.Ahead)")


def pytest_collection_modifyitems(items):
    """tests/test_bench.py first: its one job runs one process at a time, and so leaves a core to the first runs made
    ahead (conftest.Ahead: test_adapting.py's, two at a time), which the first test would otherwise wait for alone.
    The tests marked alone last: there no run made ahead is left to hold back (in the middle they stopped the
    background runs for half a minute, and the tests after them then waited for runs made one at a time)."""
    # (a stable sort: the rest keep their order)
    items.sort(key=lambda item: (item.module.__name__ != "test_bench", item.get_closest_marker("alone") is not None))


def make_dataset(root, counts, size=32, ext=".jpg"):
    """Write a deterministic class-folder image dataset and return its root as a Path.

    Class i is the folder "c<i>" with counts[i] images of size x size pixels. Each class has its own colour
    and stripe pattern (so a small network can tell them apart); every image adds its own seeded noise.
    """
    from PIL import Image
    file_format = Image.registered_extensions()[ext.lower()]  # "JPEG", "PNG", ...
    root = Path(root)
    y, x = torch.meshgrid(torch.arange(size, dtype=torch.float32), torch.arange(size, dtype=torch.float32),
                          indexing="ij")
    for label, count in enumerate(counts):
        folder = root / f"c{label}"
        folder.mkdir(parents=True, exist_ok=True)
        colour_gen = torch.Generator().manual_seed(1000 + label)
        background = torch.rand(3, 1, 1, generator=colour_gen) * 0.5
        foreground = background + 0.3 + 0.2 * torch.rand(3, 1, 1, generator=colour_gen)
        period = 2 + label % 5
        axis = x if label % 2 == 0 else y
        pattern = ((axis // period) % 2).expand(3, size, size)
        clean = background + (foreground - background) * pattern
        for i in range(count):
            noise_gen = torch.Generator().manual_seed(label * 100_000 + i)
            image = (clean + 0.06 * torch.randn(3, size, size, generator=noise_gen)).clamp(0, 1)
            image = (image * 255).round().to(torch.uint8)
            # PIL rather than torchvision.io.encode_*, which torchvision 0.29 deprecates
            array = image.permute(1, 2, 0).contiguous().numpy()
            options = {"quality": 95} if file_format == "JPEG" else {}
            Image.fromarray(array).save(folder / f"{i:04d}{ext}", format=file_format, **options)
    return root


# ------------------------------------------------------------------------------------------ running processes
# Every process a test starts carries a token of its own in its environment (TEST_JOB), inherited by everything it
# starts in turn: torchrun's workers (in sessions of their own) and their loader workers, even once reparented.
# A job that runs past its time is ended by the token, every process of it and nothing else.
def job_processes(token):
    """pids of the live processes whose environment holds TEST_JOB=token."""
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
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_job(cmd, *, cwd=REPO, env, timeout):
    """subprocess.run(cmd) with output captured; past `timeout` seconds every process of the job is killed (not only
    the first, whose launcher and workers would train on) and subprocess.TimeoutExpired is raised."""
    token = uuid.uuid4().hex
    proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env={**env, "TEST_JOB": token}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(token)
        proc.communicate()
        raise
    finally:
        kill_job(token)  # loader workers or an orphaned worker must not outlive the test either
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_script(script, *args, cwd=REPO, timeout=120, env=None):
    """Run `python script *args` (script relative to cwd unless absolute); return the CompletedProcess.

    Raises subprocess.TimeoutExpired (and kills the process) when it runs past `timeout` seconds.
    """
    if env is None:
        env = cpu_env(OMP_NUM_THREADS="2")
    return run_job([sys.executable, str(script), *map(str, args)], cwd=cwd, env=env, timeout=timeout)


def collectives_per_step(trace):
    """{collective: calls per profiled step} from a --profile run's trace.json, as tools/profile_report.py reads it."""
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "profile_report.py"), str(trace), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["collectives_per_step"]


def load_model_state(path):
    """The "model" entry (a plain state dict) of a checkpoint written by the scripts."""
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def assert_same_weights(a, b, atol=0.0):
    """Same keys and shapes, integer tensors equal, and max |a - b| <= atol over float tensors (0: bitwise)."""
    assert set(a) == set(b), (f"different keys: only in first {sorted(set(a) - set(b))[:5]}, "
                              f"only in second {sorted(set(b) - set(a))[:5]}")
    worst_key, worst = None, -1.0
    for key in a:
        x, y = a[key], b[key]
        assert x.shape == y.shape, f"{key}: shape {tuple(x.shape)} != {tuple(y.shape)}"
        if x.is_floating_point():
            diff = _max_difference(x, y)
            if atol == 0.0 and diff == 0.0 and not torch.equal(_bits(x), _bits(y)):
                diff = float("inf")  # equal values, different bits: -0.0 and 0.0, or another dtype
            if diff > worst:
                worst_key, worst = key, diff
        else:
            assert torch.equal(x, y), f"{key}: integer tensors differ ({x.flatten()[:4]} vs {y.flatten()[:4]})"
    assert worst <= atol, f"weights differ: max |difference| {worst:.3g} > {atol} at {worst_key}"


def _max_difference(x, y):
    """max |x - y|, where NaN matches only NaN (inf otherwise) and inf matches the same inf."""
    if x.numel() == 0:
        return 0.0
    x, y = x.double(), y.double()
    if not torch.equal(x.isnan(), y.isnan()):
        return float("inf")
    diff = torch.where((x == y) | x.isnan(), 0.0, (x - y).abs())
    return diff.max().item()


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """3 classes of 32x32 JPEGs, 22 + 21 + 24 = 67 images.

    With --val-fraction 0.25 (per class round(0.25 * n): 6 + 5 + 6) the validation split holds 17 images
    (divisible neither by 2 nor by 3, so it cannot be sharded evenly) and the training split 16 + 16 + 18 = 50,
    which with -b 8 and drop_last is 6 steps per epoch.
    """
    import builtin
    root = make_dataset(tmp_path_factory.mktemp("tiny") / "data", [22, 21, 24])
    classes, train, val = builtin.find_images(root, 0.25)
    assert classes == ["c0", "c1", "c2"] and len(train) == 50 and len(val) == 17, (len(train), len(val))
    return root


# Every proxy points at a closed port: a script that tried the network would fail at once, not download
NO_NETWORK = {name: "http://127.0.0.1:9" for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
NO_NETWORK.update(no_proxy="", NO_PROXY="")


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    """A TORCH_HOME whose hub cache holds 'ImageNet weights' for resnet18: a seeded 1000-class state dict at the exact
    path torchvision's ResNet18_Weights.IMAGENET1K_V1 is read from (the file name of its URL), so that
    --weights IMAGENET1K_V1 loads it with no network. Returns (TORCH_HOME, the state dict)."""
    import torchvision
    torch_home = tmp_path_factory.mktemp("torch_home")
    checkpoints = torch_home / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.manual_seed(1234)
    state = torchvision.models.resnet18(num_classes=1000).state_dict()
    url = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url
    torch.save(state, checkpoints / url.rsplit("/", 1)[-1])
    return torch_home, state


@pytest.fixture(scope="session")
def initial_weights():
    """The weights every script starts from on 3 classes (its seed 0, then builtin.resnet("resnet18", 3)),
    made once in the main thread: a run made ahead (conftest.Ahead) must not draw from the global random state while
    a test does."""
    import builtin
    torch.manual_seed(0)
    return builtin.resnet("resnet18", 3).state_dict()


# ------------------------------------------------------------------------------------- jobs started by run.sh
# What a user runs, made small: default --workers, no --freeze (BatchNorm trains), 2 epochs of 3 steps
DEFAULTS = ["--img-size", "32", "-b", "8", "--epochs", "2", "--print-freq", "1", "--val-fraction", "0.25"]
# --clip-grad for the tiny runs' fp16 (GPU) and bf16 (CPU) tests: it bounds the first steps, whose gradient norm is
# 60-80 here, and the runs still learn (1.0 scaled every step by ~1/100: chance accuracy)
FP16_CLIP = "50"
# With --freeze (BatchNorm in eval mode, only the head trains) the forward pass of a sample does not depend on the rest
# of its batch, so W processes x batch B end where one process with batch W x B ends (to float32 summation order)
EXACT = ["--img-size", "32", "--epochs", "2", "--workers", "0", "--print-freq", "1", "--val-fraction", "0.25",
         "--freeze"]
# test_ddp.py's runs and test_compile.py's: EXACT from torchvision's "ImageNet weights" by name, read from the hub
# cache with no network (hub_cache, hub_env)
NAMED_WEIGHTS = [*EXACT, "--weights", "IMAGENET1K_V1"]
# The amp rung's bf16, asked for by name: on a CPU without bf16 hardware (AVX2 only), where bf16 autocast runs 23-32x
# slower than float32, the rung trains bf16 only when asked to; every amp run of the CPU tests asks
BF16 = ["--amp-dtype", "bf16"]


def job_env(**extra):
    """A job's environment: one thread per process (2 processes share the 2 cores), unbuffered output, no GPU."""
    return cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=sys.executable, **extra)


def hub_env(hub_cache, **extra):
    """job_env() with TORCH_HOME at the hub cache (conftest.hub_cache) and every proxy at a closed port."""
    return job_env(TORCH_HOME=str(hub_cache[0]), **NO_NETWORK, **extra)


def run_sh(*args, timeout=150, env=None):
    return run_job(["bash", "run.sh", *map(str, args)], env=env or job_env(), timeout=timeout)


def side_by_side(*calls, at_once=2):
    """Call the functions (each runs a job to its end) in threads, `at_once` at a time, the next one as soon as one
    ends; their results in order.

    A job of one or two single-threaded processes keeps about one of the 2 cores busy on average (imports, the
    launcher's start and the teardown run one process at a time), so two such jobs side by side end sooner than one
    after the other (13 min 58 s for the suite, against about 16 one after the other). Only for jobs whose results
    do not depend on timing, each with one thread per process: a multi-threaded run next to another, or ranks that
    wait for each other at every step among more processes than cores, lose more than they gain. More at once only
    for jobs that mostly wait (a rendezvous or process group that times out)."""
    with concurrent.futures.ThreadPoolExecutor(min(len(calls), at_once)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


class Outcome:
    """What a function ended with, its value or the exception it raised; get() returns the one or raises the other.
    For a module fixture that runs the jobs of several tests side by side (outcomes), each test getting its own."""

    def __init__(self, call):
        try:
            self.value, self.error = call(), None
        except Exception as error:  # (an AssertionError of the job's own checks too)
            self.value, self.error = None, error

    def get(self):
        if self.error is not None:
            raise self.error
        return self.value


def outcomes(at_once=2, **calls):
    """side_by_side(*calls.values()), each call's Outcome by its name."""
    return dict(zip(calls, side_by_side(*[lambda call=call: Outcome(call) for call in calls.values()],
                                        at_once=at_once)))


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def free_port():
    """A port nothing listens on now, for a MASTER_PORT on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parent_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def descendants(pid):
    """Every live process below pid, depth first."""
    return [p for child in children(pid) for p in (child, *descendants(child))]


def command(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def ranks(job):
    """{global rank: pid} of the training processes under a job started by run.sh."""
    found = {}
    for pid in descendants(job.pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env and "torch.distributed" in command(parent_of(pid)):  # not its loader workers
            found[int(env[b"RANK"])] = pid
    return found


def start(*args, env=None, timeout=300):
    """bash run.sh ARGS in a session of its own (so the test can signal its process group), output merged.

    A watchdog kills every process of the job after `timeout` seconds (see run_job), which also ends a
    `for line in job.stdout` loop over a job that stalls without output; finish() stops it."""
    return popen(["bash", "run.sh", *map(str, args)], env=env or job_env(), timeout=timeout)


def popen(cmd, *, env, timeout, cwd=REPO):
    """Popen(cmd), output merged, in a session of its own, with the watchdog of start(); job.token names its
    processes (job_processes)."""
    token = uuid.uuid4().hex
    job = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env={**env, "TEST_JOB": token}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    job.token = token
    job.watchdog = threading.Timer(timeout, kill_job, [token])
    job.watchdog.daemon = True
    job.watchdog.start()
    return job


def read_until(job, lines, marker):
    """Read the job's output into `lines` until a line holds `marker`: that line, or None if the output ended
    first (the job exited, or its watchdog ended it)."""
    for line in job.stdout:
        lines.append(line)
        if marker in line:
            return line
    return None


def deliver(job, how, signum):
    if how == "agent":  # what torchrun's own signal handling sees: the agent forwards it to each worker's group
        agent = next(p for p in descendants(job.pid) if "torch.distributed.run" in command(p))
        os.kill(agent, signum)
    elif how == "group":  # a terminal's Ctrl-C: run.sh's foreground process group
        os.killpg(job.pid, signum)
    elif how == "every process":  # SLURM (scancel, preemption): every process of the job, loader workers too
        for pid in [job.pid, *descendants(job.pid)]:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def finish(job, lines, timeout):
    """The job's whole output once it has ended (at most `timeout` seconds from now; then every process of it is
    killed and the test fails)."""
    try:
        out, _ = job.communicate(timeout=timeout)
        lines.append(out)
    except subprocess.TimeoutExpired:
        kill_job(job.token)
        lines.append(job.communicate()[0])
        raise AssertionError(f"the job was still running {timeout} s later:\n{''.join(lines)[-3000:]}") from None
    finally:
        job.watchdog.cancel()
        if job.poll() is None:
            kill_job(job.token)
            job.wait()
    return "".join(lines)


def copy_while_paused(job, folder, copy):
    """Pause every process of the job (SIGSTOP), copy folder's last.pt into the new folder `copy`, with the sharded
    folder it names (FSDP), and let the job go on (SIGCONT): the checkpoint a SIGKILL at that moment would leave
    (last.pt is replaced atomically, after the shards it names are complete), while the job stays the uninterrupted
    run. Returns the copied checkpoint."""
    deliver(job, "every process", signal.SIGSTOP)
    try:
        copy.mkdir()
        shutil.copy(folder / "last.pt", copy)
        checkpoint = torch.load(copy / "last.pt", weights_only=True)
        if isinstance(checkpoint["optimizer"], str):  # FSDP: the name of the sharded folder
            shutil.copytree(folder / checkpoint["optimizer"], copy / checkpoint["optimizer"])
    finally:
        deliver(job, "every process", signal.SIGCONT)
    return checkpoint


def assert_job_gone(token, within=30):
    """No process that carries the job's token (job_processes) is left, zombies aside."""
    deadline = time.time() + within
    while True:
        alive = [p for p in job_processes(token) if _state(p) not in ("Z", None)]
        if not alive or time.time() > deadline:
            break
        time.sleep(0.2)
    kill_job(token)
    assert not alive, f"processes left behind: {[(p, command(p)[:80]) for p in alive]}"


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def assert_gone(pids, within=30):
    """No process of the job outlives it: loader workers end with their parent (PyTorch checks every 5 s; the
    margin is for a loaded machine)."""
    deadline = time.time() + within
    while time.time() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and parent_of(p) is not None]
        alive = [p for p in alive if open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        if not alive:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes left behind: {[(p, command(p)[:80]) for p in alive]}")


# ------------------------------------------------------------------ reference runs, started ahead of their tests
# Most of a test's time goes to starting processes, and on average about a quarter of the 2 cores sits idle (a launcher
# starting, a teardown, a job waiting for a timeout). The session's reference runs below are started ahead, in a
# background thread, one after the other, in the order the selected tests first need them (so a run of a few tests
# makes only what they use); each fixture waits for its own. A test marked `alone` has no background job beside it:
# it waits for the one in progress, and the next waits for it.
@pytest.fixture(scope="session")
def bare(tmp_path_factory):
    """An empty folder with only the six scripts and utils.py copied in: what a user copies into a project."""
    folder = tmp_path_factory.mktemp("bare")
    for name in ("train_single.py", "train_dp.py", "train_ddp_launch.py", "train_ddp_torchrun.py", "train_ddp_amp.py",
                 "train_fsdp.py", "utils.py", "builtin.py"):
        shutil.copy(REPO / name, folder / name)
    return folder


AHEAD = {}  # name: the function that makes it (ahead_fixture)


def ahead_fixture(make):
    """A session fixture named as make(out, **needs), whose value Ahead makes in its thread; for a test module's
    reference runs. Its needs: session fixtures (tiny_data, bare, hub_cache) or other AHEAD names, made before it."""
    assert make.__name__ not in AHEAD, f"two AHEAD runs named {make.__name__}"
    AHEAD[make.__name__] = make

    @pytest.fixture(scope="session", name=make.__name__)
    def made(ahead):
        return ahead.get(make.__name__)
    return made


@ahead_fixture
def default_runs(out, tiny_data):
    """Uninterrupted runs with the defaults, torchrun and amp rungs, 2 processes through run.sh."""
    side_by_side(*[lambda mode=mode: ok(run_sh(mode, 2, *DEFAULTS, *(BF16 if mode == "amp" else []), "--data-path",
                                               tiny_data, "--output-dir", out / mode)) for mode in ("ddp", "amp")])
    return out


@ahead_fixture
def exact_single(out, tiny_data, bare):
    """The reference of the --freeze runs that are not test_ddp.py's: train_single.py (copied out), batch 16, EXACT.
    Its run folder."""
    ok(run_script(bare / "train_single.py", *EXACT, "--data-path", tiny_data, "-b", "16", "--output-dir",
                  out / "single", cwd=bare, env=job_env()))
    return out / "single"


@ahead_fixture
def ddp_killed(out, tiny_data):
    """bash run.sh ddp 2 EXACT -b 8, SIGKILLed mid-epoch (kill_mid_epoch): (a copy of its last.pt, the checkpoint).
    test_scale.py resumes it at other sizes, test_endings.py with uneven batches."""
    checkpoint = kill_mid_epoch("ddp", [*EXACT, "--data-path", tiny_data, "-b", "8"], out / "run")
    shutil.copy(out / "run" / "last.pt", out / "saved.pt")
    return out / "saved.pt", checkpoint


@ahead_fixture
def fsdp_killed(out, tiny_data):
    """bash run.sh fsdp 2 EXACT -b 8, SIGKILLed mid-epoch (kill_mid_epoch): (its folder, which no test writes to: each
    resumes a copy, the checkpoint). test_fsdp.py resumes it at 3 and 2 processes, test_endings.py in one process."""
    return out / "run", kill_mid_epoch("fsdp", [*EXACT, "--data-path", tiny_data, "-b", "8"], out / "run")


@ahead_fixture
def amp_run(out, tiny_data, bare, hub_cache):
    """train_ddp_amp.py (bf16 autocast on the CPU), 2 processes x batch 8, with the arguments of test_ddp.py's
    torchrun reference run (NAMED_WEIGHTS): test_ddp.py's amp tests and test_compile.py's eager run. Its checkpoint
    when step 3 of epoch 1 is logged (after step 2, or the epoch's end) is copied while the job is paused
    (copy_while_paused): test_compile.py resumes it compiled. {"dir", "proc" (CompletedProcess, output merged),
    "paused": (the copy's folder, its checkpoint)}."""
    job, lines = popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "train_ddp_amp.py", *NAMED_WEIGHTS, *BF16, "--data-path", tiny_data, "-b", "8", "--save-every",
                        "2", "--output-dir", out / "run"], cwd=bare, env=hub_env(hub_cache), timeout=150), []
    if read_until(job, lines, "epoch 1/2  step 3/3"):
        paused = out / "paused", copy_while_paused(job, out / "run", out / "paused")
    output = finish(job, lines, timeout=150)
    assert job.returncode == 0 and (out / "paused").is_dir(), output[-3000:]
    return {"dir": out / "run", "proc": subprocess.CompletedProcess(job.args, 0, output, ""), "paused": paused}


@ahead_fixture
def ladder_runs(out, tiny_data, bare, hub_cache):
    """test_ddp.py's references, NAMED_WEIGHTS: one process with batch 16 (single, dp) and 2 x batch 8 through run.sh
    as a user starts them (launch, ddp: run.sh picks the launcher, a free port, the threads), two at a time, one
    thread per process. {"dir": out, "dp"|"launch"|"ddp": the CompletedProcess}."""
    env, data = hub_env(hub_cache), ["--data-path", tiny_data]

    def single(script, name):
        return ok(run_script(bare / script, *NAMED_WEIGHTS, *data, "-b", "16", "--output-dir", out / name, cwd=bare,
                             env=env))

    def through_run_sh(mode, *extra):
        return ok(run_sh(mode, 2, *NAMED_WEIGHTS, *data, "-b", "8", *extra, "--output-dir", out / mode, env=env))
    _, launch, dp, ddp = side_by_side(lambda: single("train_single.py", "single"), lambda: through_run_sh("launch"),
                                      lambda: single("train_dp.py", "dp"),
                                      lambda: through_run_sh("ddp", "--save-every", "2"))
    return {"dir": out, "dp": dp, "launch": launch, "ddp": ddp}


@ahead_fixture
def fsdp_references(out, tiny_data, bare):
    """test_fsdp.py's two uninterrupted runs, side by side: train_fsdp.py with 2 processes x batch 8 and EXACT, and
    what a user runs, bash run.sh fsdp 2 with default --workers and BatchNorm training (no --freeze).
    {"dir": out, "fsdp": its CompletedProcess, "bn": the folder of the second}."""
    fsdp, _ = side_by_side(
        lambda: ok(run_job([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "train_fsdp.py", *EXACT, "--data-path", tiny_data, "-b", "8", "--output-dir",
                            out / "fsdp"], cwd=bare, env=job_env(), timeout=150)),
        lambda: ok(run_sh("fsdp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", out / "bn")))
    return {"dir": out, "fsdp": fsdp, "bn": out / "bn"}


@ahead_fixture
def evaluations(out, default_runs, tiny_data, bare):
    """--test-only of conftest.default_runs' last.pt (BatchNorm training, default loader workers) by each DDP rung at
    1, 2 and 3 processes, two at a time: test_ddp.py proves the count and sums the same whatever the processes,
    test_scale.py each equal to what the run logged. {name: results.json}: "single" (train_single.py), "launch"
    (train_ddp_launch.py, 2 processes under torch.distributed.launch), "alone" (train_ddp_launch.py --local_rank=0,
    the old spelling, with a launcher's variables and no launcher), "torchrun" (train_ddp_torchrun.py, 3 processes),
    "amp" (train_ddp_amp.py, 2 processes, of the amp run's last.pt)."""
    def evaluate(name, started_as, mode):
        command = [sys.executable, *started_as, "--test-only", "--resume", default_runs / mode / "last.pt",
                   "--data-path", tiny_data, "--img-size", "32", "--val-fraction", "0.25",
                   *(BF16 if mode == "amp" else []), "--output-dir", out / name]
        env = job_env(**(alone_env if name == "alone" else {}))
        ok(run_job(command, cwd=bare, env=env, timeout=150))
        return json.loads((out / name / "results.json").read_text())

    def launched(module, nproc, script):
        return ["-m", module, "--standalone", f"--nproc-per-node={nproc}", script]
    alone_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cases = {"single": (["train_single.py"], "ddp"),
             "launch": (launched("torch.distributed.launch", 2, "train_ddp_launch.py"), "ddp"),
             "alone": (["train_ddp_launch.py", "--local_rank=0"], "ddp"),
             "torchrun": (launched("torch.distributed.run", 3, "train_ddp_torchrun.py"), "ddp"),
             "amp": (launched("torch.distributed.run", 2, "train_ddp_amp.py"), "amp")}
    return dict(zip(cases, side_by_side(*[lambda name=name: evaluate(name, *cases[name]) for name in cases])))


def cpu_times():
    """(all, idle) CPU time of this machine so far, in clock ticks (/proc/stat; (0, 0) where there is none)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return 0, 0
    return sum(values), values[3] + values[4]  # idle and iowait


class Ahead:
    """Makes the AHEAD runs the session's tests use, one after the other in a thread of its own; get() waits.

    At most CREDIT runs ahead of the last one a test has asked for: the background work is spread over the session
    instead of piling onto its first minutes (its cores are busy there already, and idle later, in modules whose jobs
    mostly wait). Beyond that only while the cores sit idle: over IDLE of their time idle for IDLE_WINDOW seconds (the
    tests are waiting for a timeout, a rendezvous, a signal's effect, or run one process at a time: on 2 cores that
    leaves one idle, half their time)."""
    CREDIT, IDLE, IDLE_WINDOW = 2, 0.3, 3

    def __init__(self, request, tmp_path_factory):
        used = []

        def use(name):  # after the AHEAD runs it needs
            for need in list(inspect.signature(AHEAD[name]).parameters)[1:]:
                if need in AHEAD and need not in used:
                    use(need)
            if name not in used:
                used.append(name)
        for name in dict.fromkeys(name for item in request.session.items for name in item.fixturenames
                                  if name in AHEAD):
            use(name)
        self.quiet, self.stopping, self.made = threading.Lock(), False, {name: concurrent.futures.Future()
                                                                           for name in used}
        self.turn, self.asked = threading.Condition(), -1  # the last run in the queue a test has asked for
        self.holding = False  # quiet held by the tests marked alone (hold)
        self.jobs = []
        for name in used:  # what each needs, made here first (quick, and not thread-safe), or by an earlier run
            needs = list(inspect.signature(AHEAD[name]).parameters)[1:]
            self.jobs.append((name, tmp_path_factory.mktemp(name),
                              {n: n if n in AHEAD else request.getfixturevalue(n) for n in needs}))
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        for queued, (name, out, needs) in enumerate(self.jobs):
            with self.turn:
                while not (self.stopping or queued <= self.asked + self.CREDIT):
                    (total, idle), notified = cpu_times(), self.turn.wait(self.IDLE_WINDOW)
                    total_now, idle_now = cpu_times()
                    if not notified and idle_now - idle > self.IDLE * (total_now - total):
                        break  # the cores sat idle: use them
            with self.quiet:
                if self.stopping:
                    self.made[name].cancel()
                    continue
                try:
                    made = {n: self.get(n) if n in AHEAD else value for n, value in needs.items()}
                    self.made[name].set_result(AHEAD[name](out, **made))
                except Exception as error:  # the fixture raises it, for each test that uses it
                    self.made[name].set_exception(error)

    def get(self, name):
        if self.holding and not self.made[name].done():  # a run not made yet: let the thread make it
            self.hold(False)
        with self.turn:
            self.asked = max(self.asked, [job[0] for job in self.jobs].index(name))
            self.turn.notify_all()
        return self.made[name].result()

    def hold(self, alone):
        """Hold back the background runs from a test marked alone until the next test that is not: the run in
        progress ends first, and none starts between two such tests."""
        if alone and not self.holding:
            self.quiet.acquire()
        elif not alone and self.holding:
            self.quiet.release()
        self.holding = alone

    def stop(self):
        self.hold(False)
        with self.turn:
            self.stopping = True
            self.turn.notify_all()
        self.thread.join()  # the job in progress ends (every job is bounded in time)


@pytest.fixture(scope="session", autouse=True)
def ahead(request, tmp_path_factory):
    runs = Ahead(request, tmp_path_factory)
    yield runs
    runs.stop()


@pytest.fixture(autouse=True)
def alone_if_marked(request, ahead):
    """A test marked `alone` waits for the reference run in progress and holds back the next one (Ahead.hold)."""
    ahead.hold(request.node.get_closest_marker("alone") is not None)


def kill_mid_epoch(mode, args, output_dir, env=None):
    """bash run.sh MODE 2 ARGS --save-every 1, SIGKILLed (every process) once step 2 of epoch 1 is logged; returns
    its last.pt, saved after step 1 or 2 of the epoch: 16 or 32 samples at 2 processes x batch 8."""
    job, lines = start(mode, 2, *args, "--save-every", "1", "--output-dir", output_dir, env=env), []
    seen = read_until(job, lines, "epoch 1/2  step 2/3")
    if seen:  # step 1 is saved by now, step 2 may be too
        deliver(job, "every process", signal.SIGKILL)
    output = finish(job, lines, timeout=60)
    assert seen, output[-3000:]
    checkpoint = torch.load(output_dir / "last.pt", weights_only=True)
    assert checkpoint["epoch"] == 0 and checkpoint["samples"] in (16, 32), checkpoint["samples"]
    return checkpoint


# ------------------------------------------------------------------------------------------ where a run resumed
PROGRESS = re.compile(r"^epoch (\d+)/(\d+)\s+step (\d+)/(\d+)\s", re.MULTILINE)  # utils.Logger.step's line
RESUMING = re.compile(r"resuming from .*: epoch (\d+) after (\d+) of its (\d+) samples \(at global batch \d+\)")
GLOBAL_BATCH = re.compile(r"global batch (\d+) ")


def progress_steps(output):
    """The global step numbers of the progress lines in a run's output, in order (--print-freq 1: every step)."""
    return [(int(epoch) - 1) * int(steps) + int(step) for epoch, _, step, steps in PROGRESS.findall(output)]


def assert_resumed_after(output, step=None):
    """The last run in `output` resumed (its `resuming from` line) and then trained exactly the steps after the
    checkpoint's, each once, to the end: its first progress line is the step after the checkpoint's, not step 1.

    The `resuming from` line is printed whatever the restore does; the steps are what training did. The step to
    resume after comes from that line's epoch and samples and this run's global batch (which may differ from the
    checkpoint's); `step` (what the stop line, or the checkpoint read by the test, said) must agree with it.
    Returns the progress steps trained after the resume."""
    resumes = list(RESUMING.finditer(output))
    assert resumes, f"no 'resuming from' line:\n{output[-3000:]}"
    resume = resumes[-1]
    epoch, samples, epoch_samples = map(int, resume.groups())
    global_batch = int(GLOBAL_BATCH.findall(output[:resume.start()])[-1])
    after = output[resume.end():]
    progress = PROGRESS.findall(after)
    assert progress, f"no progress line after the resume:\n{after[-3000:]}"
    epochs, steps_per_epoch = int(progress[-1][1]), int(progress[-1][3])
    # as the scripts count it: the samples done, whatever the batch that did them, in this run's global batch
    done = (epoch - 1) * steps_per_epoch + steps_per_epoch - (epoch_samples - samples) // global_batch
    if step is not None:
        assert done == step, f"resumed after step {done}, but the checkpoint was of step {step}"
    trained = progress_steps(after)
    assert trained == list(range(done + 1, epochs * steps_per_epoch + 1)), \
        f"resumed after step {done}, then trained steps {trained}:\n{after[-3000:]}"
    return trained


def checkpoint_step(checkpoint, steps_per_epoch):
    """The global step after which a checkpoint was saved, in the global batch that saved it."""
    return checkpoint["epoch"] * steps_per_epoch + checkpoint["samples"] // checkpoint["global_batch"]


# ------------------------------------------------------------------------- bounding what run.sh starts
def kill_all(pids):
    """SIGKILL each of pids that is still there (processes this test started, recorded while they ran)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def read_lines_until(job, text, timeout):
    """The lines of job.stdout up to the first one that contains text. A watchdog kills the job and every process
    under it if that takes longer than timeout seconds (run.sh's launcher and output filter run in process groups
    of their own, so killing run.sh's group would not end the read)."""
    import threading
    watchdog = threading.Timer(timeout, lambda: kill_all([job.pid, *descendants(job.pid)]))
    watchdog.start()
    lines = []
    try:
        for line in job.stdout:
            lines.append(line)
            if text in line:
                return lines
    finally:
        watchdog.cancel()
    raise AssertionError(f"{text!r} did not come (the output ended, or {timeout} s passed):\n"
                         + "".join(lines)[-3000:])


# ------------------------------------------------------------------------- many short runs of one script
# A fresh interpreter spends 2-3 s of CPU importing torch, torchvision and utils before a script reads its first
# argument. For many short runs of one script (bad input that ends at once), a process that has imported them once
# forks a child for each run, and the child runs the script as `python SCRIPT ARGS` would: as __main__, with that
# argv, sys.path[0] and environment, its own stdout and stderr, and the interpreter's ending (the exit status of a
# SystemExit, or the traceback and 1; then threads joined and atexit handlers run, as at exit).
FORK_SERVER = r"""
import atexit, json, os, runpy, signal, sys, threading, time
script, cases_path, results_path, parallel, timeout = sys.argv[1:6]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
import torch, torchvision, utils  # once here, not once per case
assert len(os.listdir("/proc/self/task")) == 1, "threads running before fork"  # a fork must not copy a thread pool
cases = json.load(open(cases_path))


def run_case(args, out, err):
    status = 1
    try:
        os.setpgid(0, 0)  # the case and its loader workers: one group, killed together at the time limit
        for fd, path in ((0, os.devnull), (1, out), (2, err)):
            os.dup2(os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
            status = 0
        except SystemExit as ending:  # as the interpreter ends on one
            if ending.code is None or isinstance(ending.code, int):
                status = ending.code or 0
            else:
                print(ending.code, file=sys.stderr)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        threading._shutdown()  # the interpreter's exit: non-daemon threads, then atexit handlers
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(status)


statuses, running, todo = {}, {}, list(range(len(cases)))
while todo or running:
    while todo and len(running) < int(parallel):
        i = todo.pop(0)
        pid = os.fork()
        if pid == 0:
            run_case(cases[i]["args"], cases[i]["stdout"], cases[i]["stderr"])
        running[pid] = (i, time.monotonic())
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid:
        statuses[running.pop(pid)[0]] = os.waitstatus_to_exitcode(status)
        continue
    for pid, (i, started) in list(running.items()):
        if time.monotonic() - started > float(timeout):
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            statuses[running.pop(pid)[0]] = None  # still running at its time limit
    time.sleep(0.02)
json.dump(statuses, open(results_path, "w"))
"""


def run_forked(script, cases, *, env, folder, parallel=3, timeout=60):
    """`python SCRIPT ARGS` for each ARGS in cases, `parallel` at a time, each run forked from one process that
    imported torch, torchvision and utils once (utils from the script's folder). Returns one CompletedProcess per
    case (exit status, stdout, stderr), or None for a case still running after `timeout` seconds (then killed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specs = [{"args": [str(a) for a in args], "stdout": str(folder / f"{i}.out"), "stderr": str(folder / f"{i}.err")}
             for i, args in enumerate(cases)]
    (folder / "cases.json").write_text(json.dumps(specs))
    server = run_job([sys.executable, "-c", FORK_SERVER, str(script), folder / "cases.json", folder / "statuses.json",
                      parallel, timeout], env=env, timeout=60 + timeout * (len(cases) // parallel + 1))
    assert server.returncode == 0, server.stderr[-3000:]
    statuses = json.loads((folder / "statuses.json").read_text())
    return [None if statuses[str(i)] is None else
            subprocess.CompletedProcess([script, *spec["args"]], statuses[str(i)], Path(spec["stdout"]).read_text(),
                                        Path(spec["stderr"]).read_text()) for i, spec in enumerate(specs)]
