"""The suite's fixtures: what the tests' processes see, and the session's tiny datasets, hub cache, copied-out
folder and reference runs, each made once in the whole session even where xdist runs the tests in several
workers (support.shared_run). What the tests import is in support.py."""

import json
import shutil
import signal
import sys

import pytest
import torch

from support import (
    BF16,
    DEFAULTS,
    EXACT,
    FP16_CLIP,
    NAMED_WEIGHTS,
    REPO,
    copy_while_paused,
    finish,
    free_port,
    hub_env,
    job_env,
    kill_mid_epoch,
    make_dataset,
    ok,
    read_until,
    run,
    run_sh,
    shared_run,
    start,
    torchrun,
)


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
    torch.save(
        state,
        torch_home / "hub" / "checkpoints" / torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url.rsplit("/", 1)[-1],
    )
    return torch_home, state


@pytest.fixture(scope="session")
def initial_weights():
    """The weights every script starts from on 3 classes: its seed 0, then builtin.resnet("resnet18", 3)."""
    import builtin

    torch.manual_seed(0)
    return builtin.resnet("resnet18", 3).state_dict()


@pytest.fixture(scope="session")
def bare(tmp_path_factory):
    """An empty folder with the six scripts and their helpers copied in: what a user copies into a project."""
    folder = tmp_path_factory.mktemp("bare")
    for script in REPO.glob("train_*.py"):
        shutil.copy(script, folder)
    for name in ("utils.py", "guards.py", "reporting.py", "dist_utils.py", "fsdp_utils.py", "builtin.py"):
        shutil.copy(REPO / name, folder)
    return folder


@pytest.fixture(scope="session")
def default_ddp(tmp_path_factory, tiny_data):
    """bash run.sh ddp 2 with the defaults (loader workers, BatchNorm training), uninterrupted: its folder."""

    def make(folder):
        ok(run_sh("ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", folder / "run"))

    return shared_run(tmp_path_factory, "default_ddp", make)[0] / "run"


@pytest.fixture(scope="session")
def default_amp(tmp_path_factory, tiny_data):
    """bash run.sh amp 2 with the defaults and bf16, clipped at FP16_CLIP as tests/gpu/test_gpu.py's fp16 run is: its
    folder, its output in stdout.txt there."""

    def make(folder):
        amp = ok(
            run_sh(
                "amp",
                2,
                *DEFAULTS,
                *BF16,
                *f"--clip-grad {FP16_CLIP} --data-path {tiny_data} --output-dir {folder / 'run'}".split(),
            )
        )
        (folder / "run" / "stdout.txt").write_text(amp.stdout)

    return shared_run(tmp_path_factory, "default_amp", make)[0] / "run"


@pytest.fixture(scope="session")
def exact_single(tmp_path_factory, tiny_data, bare):
    """train_single.py (copied out), batch 16, EXACT: the reference of the --freeze runs of test_scale and test_fsdp."""

    def make(folder):
        ok(
            run(
                [
                    sys.executable,
                    "train_single.py",
                    *EXACT,
                    *f"--data-path {tiny_data} -b 16 --output-dir {folder}".split(),
                ],
                cwd=bare,
            )
        )

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
        fsdp = ok(
            torchrun(
                2,
                "train_fsdp.py",
                *EXACT,
                *f"--data-path {tiny_data} -b 8 --output-dir {folder / 'fsdp'}".split(),
                cwd=bare,
            )
        )
        bn = ok(
            run_sh(
                "fsdp",
                2,
                *DEFAULTS,
                *f"--data-path {tiny_data} --output-dir {folder / 'bn'}".split(),
                env=job_env(PYTHONWARNINGS="default"),
            )
        )
        return fsdp.stdout, bn.stderr

    folder, (stdout, stderr) = shared_run(tmp_path_factory, "fsdp_references", make)
    return {"dir": folder, "fsdp": stdout, "bn": folder / "bn", "bn_stderr": stderr}


@pytest.fixture(scope="session")
def amp_run(tmp_path_factory, tiny_data, bare, hub_cache):
    """train_ddp_amp.py (bf16 autocast), 2 processes x batch 8, NAMED_WEIGHTS, --save-every 2: test_ddp's amp tests and
    test_compile's eager run. Its checkpoint when step 3 of epoch 1 is logged is copied while the job is paused
    (copy_while_paused), for test_compile to resume compiled. {"dir", "stdout", "paused": the copy's folder}."""

    def make(folder):
        job, lines = (
            start(
                [
                    sys.executable,
                    *"-m torch.distributed.run --standalone --nproc-per-node=2 train_ddp_amp.py".split(),
                    *NAMED_WEIGHTS,
                    *BF16,
                    *f"--data-path {tiny_data} -b 8 --save-every 2 --output-dir {folder / 'run'}".split(),
                ],
                cwd=bare,
                env=hub_env(hub_cache),
                timeout=150,
            ),
            [],
        )
        if read_until(job, lines, "epoch 1/2  step 3/3"):
            copy_while_paused(job, folder / "run", folder / "paused")
        output = finish(job, lines, timeout=150)
        assert job.returncode == 0 and (folder / "paused").is_dir(), output[-3000:]
        return output

    folder, stdout = shared_run(tmp_path_factory, "amp_run", make)
    return {"dir": folder / "run", "stdout": stdout, "paused": folder / "paused"}


@pytest.fixture(scope="session")
def evaluations(tmp_path_factory, default_ddp, default_amp, tiny_data, bare):
    """--test-only of default_ddp's last.pt (BatchNorm training, loader workers) by each DDP rung at 1, 2 and 3
    processes: {name: results.json}. "alone": train_ddp_launch.py --local_rank=0 (the old spelling) with a launcher's
    variables and no launcher, 1 process; "launch": train_ddp_launch.py, 2 processes under torch.distributed.launch;
    "torchrun": train_ddp_torchrun.py, 3 processes; "amp": train_ddp_amp.py, 2 processes, of default_amp's last.pt.
    (train_single.py's evaluation equals DDP's: test_ddp.py's ladder runs.)"""
    alone = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    cases = {
        "alone": (["train_ddp_launch.py", "--local_rank=0"], default_ddp),
        "launch": (
            ["-m", "torch.distributed.launch", "--standalone", "--nproc-per-node=2", "train_ddp_launch.py"],
            default_ddp,
        ),
        "torchrun": (
            ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", "train_ddp_torchrun.py"],
            default_ddp,
        ),
        "amp": (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "train_ddp_amp.py"], default_amp),
    }

    def make(folder):
        results = {}
        for name, (started_as, run_dir) in cases.items():
            env = job_env(**alone, MASTER_PORT=str(free_port())) if name == "alone" else job_env()
            ok(
                run(
                    [
                        sys.executable,
                        *started_as,
                        *f"--test-only --resume {run_dir / 'last.pt'} --data-path {tiny_data} --img-size 32".split(),
                        *"--val-fraction 0.25".split(),
                        *(BF16 if name == "amp" else []),
                        "--output-dir",
                        folder / name,
                    ],
                    cwd=bare,
                    env=env,
                )
            )
            results[name] = json.loads((folder / name / "results.json").read_text())
        return results

    return shared_run(tmp_path_factory, "evaluations", make)[1]
