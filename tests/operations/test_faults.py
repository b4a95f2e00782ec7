"""What goes wrong on real clusters, as bounded scenarios with real processes: a full disk mid-run, a node that
never arrives, a peer that never comes, a rank that freezes, a taken port, a crafted or truncated checkpoint, and
--profile."""

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
import zipfile

import pytest
import torch

from support import (
    DEFAULTS,
    EXACT,
    FAST,
    REPO,
    assert_job_gone,
    children,
    finish,
    job_env,
    ranks,
    read_until,
    run,
    run_sh,
    start,
    start_sh,
    torchrun,
)


def test_profile_writes_a_trace_and_counts_the_syncs_per_step(tiny_data, tmp_path):
    """torchrun rung, 2 processes x batch 1 (25 steps an epoch), the default --print-freq 10, steps 4-13 profiled: the
    host reads a device value only at step 10, for the progress line's loss. The ranks' stop vote, before every step,
    is an all-reduce of a CPU tensor (on a GPU too): no device to wait for, and counted apart from the training's
    collectives. The count comes from tools/profile_report.py, reading the trace the script wrote."""
    proc = torchrun(
        2,
        "train_ddp_torchrun.py",
        *f"--img-size 32 -b 1 --epochs 1 --workers 0 --freeze --data-path {tiny_data} --val-fraction 0.25".split(),
        *f"--profile 10 --output-dir {tmp_path / 'run'}".split(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    trace = tmp_path / "run" / "trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(event.get("name", "").startswith("ProfilerStep") for event in events) == 10
    assert "profile: peak memory " in proc.stdout and f"python tools/profile_report.py {trace}" in proc.stdout
    report = subprocess.run(
        [sys.executable, "tools/profile_report.py", str(trace)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert report.returncode == 0 and report.stdout.startswith("profile: 10 steps: waiting for data "), report
    assert "% (may overlap compute" in report.stdout, report.stdout
    assert (
        ", 0.10 host reads of device values (syncs) per step, 0.00 CUDA runtime syncs per step; "
        "collectives per step: " in report.stdout
    ), report.stdout  # (on a CPU: no CUDA runtime)
    assert report.stdout.rstrip().endswith(" (and 1 stop vote, on the CPU)"), report.stdout


@contextlib.contextmanager
def tmpfs(folder, size):
    folder.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 70 MiB tmpfs: room for one resnet18 checkpoint (~45 MiB), not for its replacement beside it."""
    with tmpfs(tmp_path / "disk", "70m") as folder:
        yield folder


def test_full_disk_mid_run_is_one_error_and_keeps_the_last_checkpoint(tiny_data, small_disk):
    started = time.time()
    proc = torchrun(
        2,
        "train_ddp_torchrun.py",
        *FAST,
        *f"--freeze --data-path {tiny_data} --val-fraction 0.25 --save-every 1".split(),
        *f"--output-dir {small_disk / 'run'}".split(),
        timeout=120,
    )
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot write" in errors[0] and "last.pt" in errors[0], proc.stderr[-3000:]
    assert time.time() - started < 60
    checkpoint = torch.load(small_disk / "run" / "last.pt", weights_only=True)  # the first one, intact
    assert (checkpoint["epoch"], checkpoint["samples"]) == (0, 16)  # after step 1 of 2 processes x 8
    assert sorted(p.name for p in (small_disk / "run").glob(".*tmp")) == []


def port_in_time_wait():
    """A port whose last connection this machine closed first, as a finished job's store does: it stays in TIME_WAIT
    for a minute, in which a plain bind() is refused but torch's store (SO_REUSEADDR) binds it."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # the server's side closes first: its end waits in TIME_WAIT
            assert client.recv(1) == b""
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("", port))
    return port


def test_a_node_that_never_arrives_ends_with_one_line():
    """The first node (NODE_RANK=0) alone, on a port that the job before it left in TIME_WAIT: the port is free for
    torch's store, and the job ends within RDZV_TIMEOUT in one line."""
    started = time.time()
    env = job_env(
        NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port_in_time_wait()), RDZV_TIMEOUT="5"
    )
    proc = run_sh("ddp", "1", "--epochs", "1", timeout=90, env=env)
    assert proc.returncode != 0
    assert "run.sh: not all 2 nodes joined" in proc.stderr and "RDZV_TIMEOUT" in proc.stderr
    assert time.time() - started < 60


def test_dist_timeout_ends_a_job_whose_peer_never_comes(tiny_data, tmp_path):
    """Local rank 1 never starts its script (it hangs before, here in a sleep): rank 0 waits for it at the process
    group's start for --dist-timeout seconds, not for the default 300, then fails; the launcher ends the sleeper,
    and no process of the job is left."""
    dist_timeout = 10
    hanging_peer = tmp_path / "hanging_peer.sh"
    hanging_peer.write_text(f'[ "$LOCAL_RANK" = 1 ] && exec sleep 600\nexec {sys.executable} "$@"\n')
    started = time.time()
    job = start(
        [
            sys.executable,
            *f"-m torch.distributed.run --standalone --nproc-per-node=2 --no-python bash {hanging_peer}".split(),
            *"train_ddp_torchrun.py".split(),
            *FAST,
            *f"--freeze --data-path {tiny_data} --val-fraction 0.25 --dist-timeout {dist_timeout}".split(),
            *f"--output-dir {tmp_path / 'run'}".split(),
        ],
        timeout=200,
    )
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
        proc = run_sh(
            "ddp",
            "1",
            timeout=60,
            env=job_env(NNODES="2", NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
        )
    assert proc.returncode == 2
    assert f"MASTER_PORT {port} is already in use" in proc.stderr


def test_a_master_port_held_by_a_foreign_listener_ends_in_one_line():
    """NNODES=2 and no NODE_RANK on the machine that holds MASTER_ADDR, its MASTER_PORT held by a process that is not
    torch's store (here: a listening socket that never answers): torchrun's client would wait on it for as long as it
    listens (500 s, measured), past RDZV_TIMEOUT; run.sh asks it as that client does, and ends within seconds."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        started = time.time()
        proc = run_sh(
            "ddp",
            "1",
            "--epochs",
            "1",
            timeout=90,
            env=job_env(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDZV_TIMEOUT="20"),
        )
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = (
        f"run.sh: MASTER_PORT {port} on this machine (it holds MASTER_ADDR) is held by a process that is not "
        f"torch's store: choose another port for every node, or stop what holds it (ss -ltnp 'sport = :{port}')"
    )
    assert proc.stderr.splitlines()[-1] == line, proc.stderr
    assert time.time() - started < 60


def test_a_frozen_rank_ends_the_job_in_one_line_naming_dist_timeout(tiny_data, tmp_path):
    """Rank 1 stopped (SIGSTOP: a hung NFS read, a stuck driver) with --dist-timeout 10: rank 0's all-reduce times out
    (gloo's RuntimeError, not a DistError) and says so in one line; the launcher then ends the frozen rank after
    its grace period (30 s), and its report stays in run.sh's log, in the run folder."""
    job, lines, frozen = (
        start_sh(
            "ddp",
            2,
            *DEFAULTS,
            *f"-b 2 --data-path {tiny_data} --dist-timeout 10 --output-dir {tmp_path / 'run'}".split(),
        ),
        [],
        None,
    )
    if read_until(job, lines, "epoch 1/2  step 2/12"):
        os.kill(ranks(job)[1], signal.SIGSTOP)
        frozen = time.time()
    output = finish(job, lines, timeout=120)
    assert frozen, output[-3000:]
    took = time.time() - frozen
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert job.returncode == 1 and len(errors) == 1, output[-3000:]
    # gloo's wait on the frozen rank, or (on a loaded machine) the pair it closed when that wait timed out
    timed_out = ("(Timed out waiting 10000ms for", "(Application timeout caused pair closure)")
    assert any(f"did not all answer within --dist-timeout {how}" in errors[0] for how in timed_out), errors
    assert "Traceback" not in output and "ChildFailedError" not in output, output[-3000:]
    assert 10 <= took < 10 + 30 + 20, took  # the timeout, the launcher's grace period, a loaded machine
    assert_job_gone(job.token)
    # the report left out is kept in the run folder, not in the temporary folder, where such logs piled up
    report = tmp_path / "run" / "launcher.log"
    assert f"run.sh: the launcher's full report: {report}" in output and "ChildFailedError" in report.read_text()


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_crafted_fsdp_run_folder_runs_no_code_on_resume(initial_weights, tiny_data, tmp_path):
    """A run folder whose last.pt is harmless (it loads with weights_only, and its weights fit) but names a shard
    folder whose .metadata is a pickle that runs code (torch's reader uses pickle.load): bash run.sh fsdp 2 --resume
    auto refuses it in one line, and the code never runs."""
    folder, marker = tmp_path / "run", tmp_path / "code-ran"
    (folder / "last-step1-1.dcp").mkdir(parents=True)
    (folder / "last-step1-1.dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    torch.save(
        {
            "model": initial_weights,
            "optimizer": "last-step1-1.dcp",
            "args": {"model": "resnet18"},
            "epoch": 0,
            "classes": ["c0", "c1", "c2"],
            "samples": 16,
            "global_batch": 16,
            "best": None,
        },
        folder / "last.pt",
    )
    proc = run_sh("fsdp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", folder, "--resume", "auto")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert ".metadata was refused (posix.mkdir is not a type of a checkpoint's metadata)" in errors[0], errors
    assert "Traceback" not in proc.stderr and not marker.exists()


def test_a_truncated_last_pt_under_torchrun_and_fsdp_is_one_line_naming_the_intact_best_pt(
    fsdp_references, tiny_data, tmp_path
):
    """An FSDP run's folder (bash run.sh fsdp 2, finished), its last.pt cut to half as a copy cut short leaves it:
    --resume auto by the FSDP rung and by the torchrun rung (which needs no shards) each end in one line."""
    for mode in ("fsdp", "ddp"):
        shutil.copytree(fsdp_references["bn"], tmp_path / mode)
        last = tmp_path / mode / "last.pt"
        last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
        proc = run_sh(mode, 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", tmp_path / mode, "--resume", "auto")
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1, (mode, proc.stderr[-3000:])
        best = last.with_name("best.pt")
        assert errors[0] == (
            f"error: --resume {last}: not a readable checkpoint, perhaps cut short "
            f"(PytorchStreamReader failed reading zip archive: failed finding central directory); "
            f"{best} is intact: continue from it with --resume {best}, or start from its weights "
            f"with --weights {best}"
        ), errors


def test_a_full_disk_while_fsdp_writes_its_shards_is_one_line_and_keeps_the_last_checkpoint(tiny_data, tmp_path):
    """100 MiB: room for the first save (shards of about 45 MiB, last.pt of as much), not for the second's shards:
    dcp.save fails on every rank with torch's "unexpected pos", which says nothing of the disk."""
    with tmpfs(tmp_path / "disk", "100m") as small_disk:
        started = time.time()
        proc = run_sh(
            "fsdp",
            2,
            *FAST,
            *f"--freeze --data-path {tiny_data} --val-fraction 0.25 --save-every 1".split(),
            *f"--output-dir {small_disk / 'run'}".split(),
            env=job_env(),
        )
        check_full_disk(proc, small_disk, started)


def check_full_disk(proc, small_disk, started):
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1, proc.stderr[-3000:]
    assert f"cannot write the sharded checkpoint into {small_disk / 'run'} (0 MiB left on its disk)" in errors[0]
    assert "Traceback" not in proc.stderr and time.time() - started < 60
    checkpoint = torch.load(small_disk / "run" / "last.pt", weights_only=True)  # the first one, and its shards
    assert (checkpoint["epoch"], checkpoint["samples"]) == (0, 16)
    assert (small_disk / "run" / checkpoint["optimizer"] / ".metadata").is_file()


def fill(folder):
    """Another writer takes every free byte of folder's disk: (the filler file)."""
    filler = folder / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * (1 << 20))
            f.flush()
    return filler


def one_error_line(output):
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    return errors[0]


def test_a_disk_filled_by_another_writer_mid_run_is_one_line_and_resumes(tiny_data, tmp_path):
    """bash run.sh ddp 2 on a 200 MiB disk, --save-every 1: once step 2's checkpoint is written, another writer
    fills the disk. Whatever writes next (TensorBoard's writer, whose thread meets the error first, or a checkpoint)
    ends the job in one line; last.pt stays loadable; with room again, --resume auto finishes the run."""
    with tmpfs(tmp_path / "disk", "200m") as disk:
        run = disk / "run"
        args = [*DEFAULTS, "--freeze", "--data-path", tiny_data, "--save-every", "1", "--output-dir", run]
        job, lines = start_sh("ddp", 2, *args, timeout=150), []
        seen = read_until(job, lines, "epoch 1/2  step 3/3")
        if seen:
            filler = fill(disk)
        output = finish(job, lines, timeout=120)
        assert seen and job.returncode == 1, output[-3000:]
        line = one_error_line(output)
        assert line.startswith("error: cannot write ") and "(No space left on device)" in line, line
        torch.load(run / "last.pt", weights_only=True)  # the last one written, whole
        filler.unlink()
        resumed = run_sh("ddp", 2, *args, "--resume", "auto")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert json.loads((run / "results.json").read_text())["epochs"] == 2
        assert sorted(p.name for p in run.glob(".*.tmp")) == []


def test_a_run_folder_turned_read_only_mid_run_is_one_line_and_resumes(tiny_data, tmp_path):
    """One process (train_single.py, defaults): its run folder turns read-only in epoch 2 (a read-only bind mount
    over it). The next write is TensorBoard's, at the epoch's end (its thread meets the error first): one line,
    last.pt (epoch 1's) loadable, and --resume auto finishes once the folder is writable again."""
    run = tmp_path / "run"
    args = [sys.executable, "train_single.py", *DEFAULTS, "--freeze", "--data-path", tiny_data, "--output-dir", run]
    job, lines = start(args, timeout=150), []
    seen = read_until(job, lines, "epoch 2/2  step 2/6")
    mounted = seen and not subprocess.run(["mount", "--bind", str(run), str(run)], capture_output=True).returncode
    try:
        if mounted:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(run)], check=True)
        output = finish(job, lines, timeout=120)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(run)], capture_output=True)
    if seen and not mounted:
        pytest.skip("cannot bind-mount here (needs root)")
    assert seen and job.returncode == 1, output[-3000:]
    line = one_error_line(output)
    assert line.startswith(f"error: cannot write TensorBoard logs into {run} (Read-only file system)"), line
    assert torch.load(run / "last.pt", weights_only=True)["epoch"] == 1
    resumed = subprocess.run(
        args + ["--resume", "auto"], cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=150
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and (run / "results.json").is_file()


def test_a_failed_first_best_pt_is_written_by_the_resumed_run(tiny_data, tmp_path):
    """70 MiB: room for one checkpoint of the frozen resnet18 (~45 MiB), not two. --save-every 3 leaves last.pt
    after step 3 of 6; the epoch's end then writes best.pt first, which does not fit: one line that claims no
    earlier best.pt, and last.pt is the mid-epoch one. A killed save's temporary file (planted as SIGKILL leaves
    it) is gone once the next job starts, and the resumed run, with room again, writes best.pt: the final weights
    of a 1-epoch run. The data holds an animated GIF (read as its first frame)."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    from PIL import Image

    frames = [Image.new("RGB", (40, 40), (40 * i, 90, 200)) for i in range(3)]
    frames[0].save(data / "c0" / "animated.gif", save_all=True, append_images=frames[1:], duration=50, loop=0)
    with tmpfs(tmp_path / "disk", "70m") as disk:
        run = disk / "run"
        args = [
            sys.executable,
            "train_single.py",
            *FAST,
            *f"--freeze --epochs 1 --data-path {data} --val-fraction 0.25 --save-every 3 --output-dir {run}".split(),
        ]
        first = subprocess.run(args, cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=150)
        assert first.returncode == 1, first.stderr[-3000:]
        line = one_error_line(first.stderr)
        assert line.startswith(f"error: cannot write {run / 'best.pt'} (No space left on device)") and line.endswith(
            "continue with --resume auto (nothing half-written is left)"
        ), line
        assert not (run / "best.pt").exists() and torch.load(run / "last.pt", weights_only=True)["samples"] > 0
        stale = run / f".last.pt.{2**22 + 1}.tmp"
        stale.write_bytes(b"\0" * 1000)
        subprocess.run(["mount", "-o", "remount,size=200m", str(disk)], check=True)
        resumed = subprocess.run(
            args + ["--resume", "auto"], cwd=REPO, env=job_env(), capture_output=True, text=True, timeout=150
        )
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert not stale.exists() and sorted(p.name for p in run.glob(".*.tmp")) == []
        best, last = (torch.load(run / name, weights_only=True) for name in ("best.pt", "last.pt"))
        assert best["epoch"] == 1 and best["best"] == json.loads((run / "results.json").read_text())["best_acc"]
        assert all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])


def test_an_image_bomb_in_a_folder_is_one_line_naming_it_undecoded(tiny_data, tmp_path):
    """A 15000 x 15000 PNG of one colour (0.2 MB on disk, 675 MB decoded) among the training images: refused from
    its header, before any pixel is decoded, in one line naming the file and the limit to raise."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    from PIL import Image

    Image.new("RGB", (15000, 15000), (10, 200, 30)).save(data / "c1" / "bomb.png")
    proc = subprocess.run(
        [
            sys.executable,
            "train_single.py",
            *FAST,
            *f"--data-path {data} --val-fraction 0.25 --output-dir {tmp_path / 'run'}".split(),
        ],
        cwd=REPO,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    assert line.startswith(
        f"error: image {data / 'c1' / 'bomb.png'} has 225000000 pixels, over PIL.Image.MAX_IMAGE_PIXELS ("
    ), line
    assert "raise that limit in build_datasets()" in line, line


def test_a_resume_with_other_trained_parameters_is_one_line(ddp_killed, fsdp_killed, tiny_data, tmp_path):
    """Head first (--freeze), then the whole model (--resume auto without --freeze): the optimizer's state is for
    the head alone. DDP and FSDP each end in one line naming the way (the weights with --weights)."""
    for mode, folder in (("ddp", ddp_killed[0].parent), ("fsdp", fsdp_killed[0])):
        shutil.copytree(folder, tmp_path / mode)
        args = [arg for arg in EXACT if arg != "--freeze"]
        proc = run_sh(
            mode, 2, *args, "--data-path", tiny_data, "-b", "8", "--output-dir", tmp_path / mode, "--resume", "auto"
        )
        assert proc.returncode == 1, (mode, proc.stderr[-3000:])
        line = one_error_line(proc.stderr)
        assert (
            line.startswith("error: --resume: the checkpoint's optimizer state is for other trained parameters")
            and "--weights" in line
        ), (mode, line)


def test_an_out_of_memory_kill_of_a_loader_worker_or_a_rank_is_one_line_naming_it(tiny_data, tmp_path):
    """The OOM killer's SIGKILL, simulated, under bash run.sh ddp 2 with the defaults, after the first step: first
    to a training loader worker of rank 1 (its usual pick: the one that grows), then to rank 1 itself. Each ends the
    job in one line that names the process, the signal and the likely out-of-memory kill, and what to lower: the
    worker's from its rank, the rank's from run.sh (torchrun's 31-line report is the only other word of it, kept in
    the run folder's launcher.log); no traceback, no process left behind (before: 66 lines and 2 tracebacks with no
    word of memory, and the 31-line report)."""
    for victim in ("worker", "rank"):
        folder = tmp_path / victim
        job, lines = start_sh("ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", folder), []
        killed = None
        if read_until(job, lines, "  step "):
            rank1 = ranks(job)[1]
            killed = max(children(rank1)) if victim == "worker" else rank1  # its training worker: forked last
            os.kill(killed, signal.SIGKILL)
        output = finish(job, lines, timeout=90)
        assert killed, output[-3000:]
        said = [line for line in output.splitlines() if "killed by SIGKILL" in line]
        if victim == "worker":
            assert said == [
                f"error: a data loader worker of rank 1 (pid {killed}) was killed by SIGKILL, most likely by the "
                f"out-of-memory killer (dmesg says which): lower --workers or --batch-size, then continue with "
                f"--resume auto --output-dir {folder}"
            ], output[-3000:]
        else:
            assert said == [
                f"run.sh: rank 1 (pid {killed}) was killed by SIGKILL, most likely by the out-of-memory killer "
                f"(dmesg says which): lower --batch-size or --workers, then continue with --resume auto "
                f"--output-dir {folder}"
            ], output[-3000:]
            assert (folder / "launcher.log").is_file()  # torchrun's own report, kept
        assert job.returncode == 1 and "Traceback" not in output and "Root Cause" not in output, output[-3000:]
        assert_job_gone(job.token)


def test_a_stop_that_reaches_one_rank_alone_stops_the_job_and_no_restart_undoes_it(tiny_data, tmp_path):
    """SIGINT to rank 1 alone (not the launcher) under bash run.sh ddp 2 with torchrun --max-restarts=1: the ranks
    agree to stop, rank 0 saves, one `stopped by` line, and the job ends with 130 (128 + SIGINT) and nothing else:
    torchrun takes the ranks' exit for a failure and restarts them, and the restarted ranks end at once, training
    nothing (before: the restart resumed and trained to the end; without restarts, a stop of one rank ended in
    torchrun's 31-line report and exit 1)."""
    env = job_env(TORCHRUN_ARGS="--max-restarts=1")
    job, lines = start_sh("ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", tmp_path, env=env), []
    if read_until(job, lines, "  step "):
        os.kill(ranks(job)[1], signal.SIGINT)
    output = finish(job, lines, timeout=180)
    stops = [line for line in output.splitlines() if line.startswith("stopped by")]
    assert job.returncode == 130 and len(stops) == 1 and stops[0].startswith("stopped by SIGINT after step "), output
    assert output.rstrip().splitlines()[-1] == stops[0] and "Traceback" not in output, output[-3000:]
    assert "resuming from" not in output and not (tmp_path / "results.json").exists(), output[-3000:]
    step = int(stops[0].split("after step ")[1].split(":")[0])
    assert torch.load(tmp_path / "last.pt", weights_only=True)["samples"] == 16 * step  # what it stopped at


def test_another_scripts_run_a_stale_launcher_environment_and_a_read_only_checkout_end_in_one_line(
    fsdp_references, tiny_data, tmp_path
):
    """As an operator meets them, each in one line with the next step, from one process, within seconds: a finished
    FSDP run's folder resumed by the torchrun rung (before: about 80 lines and an AttributeError from every rank);
    the same run's last.pt with one bit of a weight flipped, resumed (before: it loaded without a word, and the next
    --resume auto loaded it again);
    RANK=1 and LOCAL_RANK=1 left in the shell under bash run.sh single (before: a wrong line about the disk, or
    nothing and an exit after 10 s); a checkout whose data/ cannot hold the demo data (a file in its place, as a
    read-only root is to the script; before: 39 lines)."""
    shutil.copytree(fsdp_references["bn"], tmp_path / "fsdp")
    ended = [
        run_sh("ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", tmp_path / "fsdp", "--resume", "auto")
    ]
    shutil.copytree(fsdp_references["bn"], tmp_path / "flipped")  # one bit of a weight of its last.pt flipped
    last = tmp_path / "flipped" / "last.pt"
    with zipfile.ZipFile(last) as archive:
        weights = max(archive.infolist(), key=lambda entry: entry.file_size)  # a tensor's bytes, stored
    data = bytearray(last.read_bytes())
    data[weights.header_offset + weights.compress_size // 2] ^= 0x40
    last.write_bytes(data)
    ended.append(
        run_sh("fsdp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", last.parent, "--resume", "auto")
    )
    for name in ("RANK", "LOCAL_RANK"):
        env = job_env(**{name: "1"})
        ended.append(run_sh("single", *DEFAULTS, "--data-path", tiny_data, "--output-dir", tmp_path / name, env=env))
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("train_single.py", "utils.py", "guards.py", "reporting.py", "builtin.py"):
        shutil.copy(REPO / name, checkout)
    (checkout / "data").write_text("not a folder: data/demo cannot be made here")
    ended.append(run([sys.executable, "train_single.py", *DEFAULTS, "--output-dir", tmp_path / "demo"], cwd=checkout))
    expected = [
        f"error: --resume {tmp_path / 'fsdp' / 'last.pt'}: a run of train_fsdp.py (its optimizer state is sharded in ",
        f"error: --resume {last}: damaged ({weights.filename[-60:]} fails its CRC check); {last.parent / 'best.pt'} is "
        f"intact: continue from it",
        "error: train_single.py runs one process, but RANK=1 is set (a launcher's, left in the shell, or a launcher",
        "error: train_single.py runs one process, but LOCAL_RANK=1 is set (a launcher's, left in the shell, or a",
        f"error: cannot write the demo data into {checkout / 'data'} (Not a directory): give --data-path",
    ]
    for proc, words in zip(ended, expected):
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert proc.returncode == 1 and len(errors) == 1 and errors[0].startswith(words), proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and proc.seconds < 60, (proc.seconds, proc.stderr[-3000:])
