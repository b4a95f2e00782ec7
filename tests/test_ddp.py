"""The parallel ladder, proven on CPU with real launchers and real gloo processes.

Most runs use a folder holding only the five scripts and utils.py (the copy-out case). With --freeze the forward
pass of a sample does not depend on the rest of its batch, so W processes x batch B must end where one process
with batch W x B ends. Tolerance 1e-5: float32 sums in another order explain ~1e-7 here (measured 3e-8), while a
sampler, averaging or LR bug moves the weights by 1e-3 or more. Every run starts from torchvision's "ImageNet weights"
by name (--weights IMAGENET1K_V1), read from the hub cache with no network (conftest.hub_cache).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import NO_NETWORK, REPO, assert_same_weights, free_port, load_model_state, make_dataset, ok, run_script

SCRIPTS = ["train_single.py", "train_dp.py", "train_ddp_launch.py", "train_ddp_torchrun.py", "train_ddp_amp.py"]
TOL = 1e-5
COMMON = ["--img-size", "32", "--epochs", "2", "--workers", "0", "--print-freq", "1", "--val-fraction", "0.25",
          "--freeze", "--weights", "IMAGENET1K_V1"]


@pytest.fixture(scope="module", autouse=True)
def offline_hub(hub_cache):
    """Every process this module starts inherits TORCH_HOME (the cache holding IMAGENET1K_V1) and no network."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_HOME", str(hub_cache[0]))
        for name, value in NO_NETWORK.items():
            patch.setenv(name, value)
        yield


def env_1_thread():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=sys.executable)


def torchrun(cwd, nproc, script, *args, launcher="torch.distributed.run", extra=(), timeout=120):
    return subprocess.run([sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={nproc}", *extra,
                           script, *map(str, args)], cwd=cwd, env=env_1_thread(), capture_output=True, text=True,
                          timeout=timeout)


def results(folder):
    return json.loads((folder / "results.json").read_text())


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """An empty folder with only the five scripts and utils.py copied in: what a user copies into a project."""
    folder = tmp_path_factory.mktemp("bare")
    for name in SCRIPTS + ["utils.py"]:
        shutil.copy(REPO / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def runs(tiny_data, bare, tmp_path_factory):
    """The reference runs, started once: single-process batch 16, and the DDP scripts with 2 x batch 8."""
    out = tmp_path_factory.mktemp("ladder")
    data = ["--data-path", tiny_data]
    ok(run_script(bare / "train_single.py", *COMMON, *data, "-b", "16", "--output-dir", out / "single", cwd=bare))
    ok(run_script(bare / "train_dp.py", *COMMON, *data, "-b", "16", "--output-dir", out / "dp", cwd=bare))
    # Through run.sh, as a user starts them (run.sh picks the launcher, a free port and 1 thread per process)
    launch = ok(subprocess.run(["bash", "run.sh", "launch", "2", *COMMON, *data, "-b", "8", "--output-dir",
                                out / "launch"], cwd=REPO, env=env_1_thread(), capture_output=True, text=True,
                               timeout=120))
    ddp = ok(subprocess.run(["bash", "run.sh", "ddp", "2", *COMMON, *data, "-b", "8", "--save-every", "2",
                             "--output-dir", out / "ddp"], cwd=REPO, env=env_1_thread(), capture_output=True,
                            text=True, timeout=120))
    return {"dir": out, "launch": launch, "ddp": ddp}


def test_dp_on_cpu_equals_single_exactly(runs):
    assert_same_weights(load_model_state(runs["dir"] / "dp" / "last.pt"),
                        load_model_state(runs["dir"] / "single" / "last.pt"))


@pytest.mark.parametrize("name", ["launch", "ddp"])
def test_ddp_equals_single_process_with_the_global_batch(runs, name):
    out = runs["dir"]
    assert "global batch 16 = 8 per process x 2 processes" in runs[name].stdout
    assert_same_weights(load_model_state(out / name / "last.pt"), load_model_state(out / "single" / "last.pt"),
                        atol=TOL)
    # Only global rank 0 prints: one progress line per step (3 steps x 2 epochs), not one per rank
    assert runs[name].stdout.count("epoch 2/2  step 3/3") == 1
    assert results(out / name)["final_acc"] == pytest.approx(results(out / "single")["final_acc"])
    assert results(out / name)["confusion"] == results(out / "single")["confusion"]  # summed over the ranks


def test_named_weights_are_read_from_the_hub_cache_on_every_rank(runs, hub_cache):
    """--weights IMAGENET1K_V1 with --freeze: the backbone ends exactly as the cached file holds it and the new
    3-class head trained, in every script; no rank tried the network (every proxy points at a closed port)."""
    _, pretrained = hub_cache
    for name in ("single", "dp", "launch", "ddp"):
        trained = load_model_state(runs["dir"] / name / "last.pt")
        assert_same_weights({k: trained[k] for k in pretrained if not k.startswith("fc.")},
                            {k: v for k, v in pretrained.items() if not k.startswith("fc.")})
        assert trained["fc.weight"].shape == (3, 512)


def test_evaluation_is_exact_for_any_world_size(runs, tiny_data, bare, tmp_path):
    """17 validation images: DistributedSampler would pad them to 18; every count and sum must match 1 process."""
    checkpoint = runs["dir"] / "single" / "last.pt"
    common = ["--test-only", "--resume", checkpoint, "--data-path", tiny_data, "--img-size", "32",
              "--val-fraction", "0.25", "--workers", "0"]
    ok(run_script(bare / "train_single.py", *common, "--output-dir", tmp_path / "one", cwd=bare))
    ok(torchrun(bare, 2, "train_ddp_launch.py", *common, "--output-dir", tmp_path / "two",
                launcher="torch.distributed.launch"))
    ok(torchrun(bare, 3, "train_ddp_torchrun.py", *common, "--output-dir", tmp_path / "three"))
    # --local_rank (the old spelling) is accepted too; this process is its own launcher here
    env = dict(env_1_thread(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ok(run_script(bare / "train_ddp_launch.py", "--local_rank=0", *common, "--output-dir", tmp_path / "alone",
                  cwd=bare, env=env))
    one = results(tmp_path / "one")
    assert one["val_count"] == 17
    for name in ("two", "three", "alone"):
        other = results(tmp_path / name)
        assert other["val_count"] == 17 and other["val_acc"] == one["val_acc"], (name, other, one)
        assert other["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6), name


def test_accumulation_all_reduces_once_per_optimizer_step(runs, tiny_data, bare, tmp_path):
    """2 x batch 4 x 2 micro-steps == 2 x batch 8: same weights, and exactly as many all-reduces (not twice)."""
    proc = ok(torchrun(bare, 2, "train_ddp_torchrun.py", *COMMON, "--data-path", tiny_data, "-b", "4",
                       "--accum-steps", "2", "--sync-bn", "--output-dir", tmp_path / "accum"))
    reference = runs["dir"] / "ddp"
    assert_same_weights(load_model_state(tmp_path / "accum" / "last.pt"), load_model_state(reference / "last.pt"),
                        atol=TOL)
    assert results(tmp_path / "accum")["allreduces"] == results(reference)["allreduces"] > 0
    # --sync-bn on CPU: one warning, then per-process BatchNorm
    assert (proc.stdout + proc.stderr).count("warning: --sync-bn needs CUDA") == 1


def children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return sorted(found)


def run_and_kill_one_worker(cwd, script, args, kill_after, victim):
    """torchrun --max-restarts=1; SIGKILL one worker once `kill_after` is printed. Returns (stdout, exit code)."""
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "--max-restarts=1", script, *map(str, args)], cwd=cwd, env=env_1_thread(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, killed = [], None
    try:
        deadline = time.time() + 150
        for line in proc.stdout:
            lines.append(line)
            if killed is None and kill_after in line:
                workers = children(proc.pid)
                killed = workers[victim]
                os.kill(killed, signal.SIGKILL)
            assert time.time() < deadline, "timed out"
        return "".join(lines), proc.wait(timeout=30), killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("script,victim", [("train_ddp_torchrun.py", -1), ("train_ddp_amp.py", -1)])
def test_elastic_restart_resumes_and_ends_with_uninterrupted_weights(runs, tiny_data, bare, tmp_path, script,
                                                                    victim):
    args = [*COMMON, "--data-path", tiny_data, "-b", "8", "--save-every", "2"]
    if script == "train_ddp_torchrun.py":
        reference = runs["dir"] / "ddp"
    else:
        reference = tmp_path / "uninterrupted"
        ok(torchrun(bare, 2, script, *args, "--output-dir", reference))
    stdout, code, killed = run_and_kill_one_worker(bare, script, [*args, "--output-dir", tmp_path / "killed"],
                                                   kill_after="epoch 1/2  step 3/3", victim=victim)
    assert killed, "the run ended before a worker could be killed"
    assert code == 0, stdout[-4000:]
    # The step-2 checkpoint was written before step 3 was logged; the epoch-end one may have been too
    resumed = stdout.split("resuming from")[1].splitlines()[0]
    assert resumed.endswith(("epoch 1 after 32 of its 50 samples (at global batch 16)",
                             "epoch 2 after 0 of its 50 samples (at global batch 16)")), resumed
    assert_same_weights(load_model_state(tmp_path / "killed" / "last.pt"), load_model_state(reference / "last.pt"))


def test_amp_bf16_on_cpu_trains_and_checkpoints_the_scaler(tiny_data, bare, tmp_path):
    proc = ok(torchrun(bare, 2, "train_ddp_amp.py", "--img-size", "32", "--epochs", "3", "--workers", "0",
                       "--print-freq", "1", "--data-path", tiny_data, "-b", "8", "--clip-grad", "1.0",
                       "--output-dir", tmp_path / "amp"))
    losses = [float(line.split("loss ")[1].split()[0]) for line in proc.stdout.splitlines() if "  step " in line]
    assert len(losses) == 9
    assert sum(losses[-3:]) / 3 < losses[0], losses
    checkpoint = torch.load(tmp_path / "amp" / "last.pt", weights_only=True)
    assert "scaler" in checkpoint  # empty for bf16 (no scaler needed), filled for fp16 on CUDA
    assert results(tmp_path / "amp")["epochs"] == 3


def test_two_nodes_match_one_node(runs, tiny_data, tmp_path):
    """Two torchrun agents (one process each) rendezvous over c10d on 127.0.0.1, started by run.sh."""
    env = dict(env_1_thread(), NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               RDZV_ID="test-two-nodes")
    cmd = ["bash", "run.sh", "ddp", "1", *COMMON, "--data-path", str(tiny_data), "-b", "8",
           "--output-dir", str(tmp_path / "nodes")]
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=150)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert sum("global batch 16 = 8 per process x 2 processes" in out for out in outputs) == 1
    assert_same_weights(load_model_state(tmp_path / "nodes" / "last.pt"),
                        load_model_state(runs["dir"] / "ddp" / "last.pt"), atol=TOL)


def test_bad_input_is_reported_once_and_ends_the_job(tiny_data, bare, tmp_path):
    started = time.time()
    # Local rank 0 starts 2 s late, as on a loaded machine: rank 1 finds the error first, and the launcher stops every
    # rank once one fails, so without rank 1 waiting the job ended with no error line at all (seen in CI).
    late_rank_0 = tmp_path / "late_rank_0.sh"
    late_rank_0.write_text(f'[ "$LOCAL_RANK" = 0 ] && sleep 2\nexec {sys.executable} "$@"\n')
    proc = torchrun(bare, 2, late_rank_0, "train_ddp_torchrun.py", "--epochs", "0", "--data-path", tiny_data,
                    extra=["--no-python", "bash"], timeout=60)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert errors == ["error: --epochs must be positive, got 0"], proc.stderr[-2000:]

    # Named weights missing from the cache, no network: local rank 0 tries the download and reports it; rank 1 waits
    proc = torchrun(bare, 2, "train_ddp_torchrun.py", *COMMON, "--data-path", tiny_data, "--model", "resnet34",
                    "--weights", "DEFAULT", "-b", "4", "--output-dir", tmp_path / "no_network", timeout=60)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-2000:]
    assert "cannot download" in errors[0] and f"put that file at {os.environ['TORCH_HOME']}/hub/checkpoints/resnet34-" \
        in errors[0], errors

    # A file that only one rank reads: that rank reports it, and the job ends instead of hanging on a collective
    data = make_dataset(tmp_path / "data", [12, 12])
    (data / "c1" / "0003.jpg").write_bytes(b"not an image at all")
    proc = torchrun(bare, 2, "train_ddp_torchrun.py", *COMMON, "--data-path", data, "-b", "4",
                    "--output-dir", tmp_path / "out", timeout=90)
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "0003.jpg" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout
    assert time.time() - started < 90


def test_run_sh_refuses_a_bad_process_count():
    proc = subprocess.run(["bash", "run.sh", "ddp", "0"], cwd=REPO, env=env_1_thread(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "N must be at least 1" in proc.stderr
