"""Stopping a run the way clusters and people do, with the settings a user gets: loader workers (the default
--workers 2, persistent), BatchNorm in train mode, jobs started by run.sh, signals delivered to the torchrun agent
(which forwards them with os.killpg) or to every process of the job (SLURM's scancel and preemption); a terminal's
Ctrl-C (tests/operations/test_run_sh.py, and here typed into one). Every claim ends with real weights compared to an
uninterrupted run.
"""

import os
import pty
import select
import signal
import sys
import time
import uuid

import pytest
import torch

from support import (
    DEFAULTS,
    REPO,
    assert_gone,
    assert_job_gone,
    assert_resumed_after,
    assert_same_weights,
    checkpoint_step,
    children,
    command,
    deliver,
    descendants,
    finish,
    job_env,
    kill_job,
    load_model_state,
    ok,
    ranks,
    read_until,
    run_sh,
    start_sh,
)


def stop_and_resume(hows, signum, reference, tiny_data, folder):
    """bash run.sh ddp 2 with the defaults, stopped by signum after its first step, delivered each way in `hows` in
    turn (support.deliver; "launcher killed": SIGKILL of the torchrun agent, whose ranks then get SIGTERM from the
    kernel): the first to the new job, each next one to the job that resumed the last stop (with --resume auto),
    after its own first step. While the first job runs (paused), a second one started into its folder with --resume
    auto ends at once in one line. A last --resume auto must end with the reference's weights. (Ctrl-C to run.sh's
    process group: tests/operations/test_run_sh.py.)"""
    args = ["ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", folder / "run"]
    stopped_after = 0
    for how in hows:
        resume = ["--resume", "auto"] if stopped_after else []
        job, lines, pids = start_sh(*args, *resume), [], []
        if read_until(job, lines, "  step "):  # its first progress line
            pids = descendants(job.pid)
            if not stopped_after:
                second_job_into_the_same_folder(job, args, folder / "run")
            if how == "launcher killed":
                deliver(job, "agent", signal.SIGKILL)
            else:
                deliver(job, how, signum)
        output = finish(job, lines, timeout=60)
        assert len(pids) >= 6, (how, [command(p) for p in pids])  # agent, 2 ranks, their loader workers
        name = signal.Signals(signal.SIGTERM if how == "launcher killed" else signum).name
        assert job.returncode == (128 + signal.SIGKILL if how == "launcher killed" else 128 + signum), (
            how,
            output[-3000:],
        )
        stops = [line for line in output.splitlines() if line.startswith("stopped by")]
        assert len(stops) == 1 and stops[0].startswith(f"stopped by {name} after step "), (how, output[-3000:])
        assert output.rstrip().splitlines()[-1] == stops[0], (how, output[-3000:])  # the log ends with that line
        assert "Traceback" not in output, (how, output[-3000:])
        assert not (folder / "run" / "results.json").exists()
        assert_gone(pids, within=15)
        if resume:  # it went on from the last stop, and trained at least a step before this one
            assert "resuming from " in output, (how, output[-3000:])
        step = int(stops[0].split("after step ")[1].split(":")[0])
        assert step > stopped_after, (how, stopped_after, output[-3000:])
        stopped_after = step

    assert (folder / "run" / ".lock").exists()  # a dead job's lock file does not hold the folder
    resumed = ok(run_sh(*args, "--resume", "auto"))
    assert_resumed_after(resumed.stdout, step=stopped_after)  # not a fresh start that prints "resuming from"
    assert_same_weights(load_model_state(folder / "run" / "last.pt"), load_model_state(reference / "last.pt"))


def second_job_into_the_same_folder(job, args, run):
    """The same command with --resume auto while the job runs (paused meanwhile, so that it cannot end first): one
    line naming the folder, and nothing of the running job's touched."""
    deliver(job, "every process", signal.SIGSTOP)
    try:
        before = {path.name: path.stat().st_mtime_ns for path in run.iterdir()}
        second = run_sh(*args, "--resume", "auto", timeout=60)
        errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert second.returncode == 1 and errors == [second.stderr.splitlines()[0]], second.stderr[-3000:]
        assert errors[0].startswith(f"error: {run} is in use by another job (pid "), errors
        assert {path.name: path.stat().st_mtime_ns for path in run.iterdir()} == before
    finally:
        deliver(job, "every process", signal.SIGCONT)


@pytest.mark.quick
def test_sigterm_saves_and_resume_ends_with_uninterrupted_weights(default_ddp, tiny_data, tmp_path):
    """SIGTERM to the torchrun agent (it forwards the signal to each worker's process group), then to every process
    of the job that resumed it, loader workers included (SLURM's scancel and preemption), then SIGKILL of the next
    one's agent (the OOM killer, a dying login shell: its ranks must not train on as orphans): each stop after the
    job's own first step, each saved, no process left within seconds, and the last resume ends with the
    uninterrupted weights; and a second job started into the folder of the first ends in one line
    (stop_and_resume)."""
    stop_and_resume(("agent", "every process", "launcher killed"), signal.SIGTERM, default_ddp, tiny_data, tmp_path)


def test_sigterm_during_evaluation_saves_and_the_resumed_run_evaluates_that_epoch(default_ddp, tiny_data, tmp_path):
    """The signal lands while the validation loader's workers run; the epoch is saved as trained, not evaluated.
    (Each rank forks its validation workers at the start, before its training workers: the lower pids. They read
    nothing while the training runs, and read the index queue and the image files as soon as evaluation starts.)"""
    reference, folder = default_ddp, tmp_path
    args = ["ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", folder / "run"]
    job, lines, landed = start_sh(*args), [], False
    if read_until(job, lines, "epoch 1/2  step 3/3"):
        workers = [sorted(children(pid)) for pid in ranks(job).values()]  # validation's, then training's
        validation = [pids[0] for pids in workers if len(pids) == 2]  # the default: one worker each
        before = {pid: read_chars(pid) for pid in validation}
        deadline = time.time() + 60
        while not landed and time.time() < deadline:  # signal while evaluation runs
            landed = any(read_chars(pid) > chars for pid, chars in before.items())
            time.sleep(0.002)  # a short nap, not a spin: the job needs both cores
        deliver(job, "every process", signal.SIGTERM)
    output = finish(job, lines, timeout=60)
    assert landed, "evaluation was never seen running"
    assert job.returncode == 143, output[-3000:]
    assert "epoch 1/2  val loss" not in output and output.count("stopped by SIGTERM after step 3") == 1, output[-3000:]
    checkpoint = torch.load(folder / "run" / "last.pt", weights_only=True)
    assert (checkpoint["epoch"], checkpoint["samples"]) == (0, 48)  # epoch 1 trained (3 x 16), not evaluated

    resumed = ok(run_sh(*args, "--resume", "auto"))
    assert "epoch 1/2  val loss" in resumed.stdout and "epoch 1/2  step" not in resumed.stdout
    assert_resumed_after(resumed.stdout, step=3)  # epoch 2 from its first step
    assert_same_weights(load_model_state(folder / "run" / "last.pt"), load_model_state(reference / "last.pt"))
    mine, theirs = (torch.load(run / "best.pt", weights_only=True) for run in (folder / "run", reference))
    assert mine["best"] == theirs["best"] and mine["epoch"] == theirs["epoch"]


def read_chars(pid):
    """Bytes the process has read (files and pipes), from /proc/PID/io; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    except (OSError, StopIteration):
        return 0


def test_a_crashed_rank_ends_the_job_within_seconds_and_leaves_no_process(tiny_data, tmp_path):
    """SIGKILL of one rank (out of memory, a node failure): the survivor must not sit out torchrun's 30 s."""
    job, lines, pids = start_sh("ddp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", tmp_path / "run"), [], []
    if read_until(job, lines, "epoch 1/2  step 1/3"):
        pids = descendants(job.pid)
        os.kill(ranks(job)[1], signal.SIGKILL)
        killed = time.time()
    output = finish(job, lines, timeout=60)
    assert pids and job.returncode != 0, output[-3000:]
    assert time.time() - killed < 15, f"the job took {time.time() - killed:.1f} s to end"
    assert_gone(pids)


def test_a_stop_comes_one_step_after_the_signal_whatever_the_print_freq(tiny_data, tmp_path):
    """--print-freq 20 and 12 steps an epoch: the ranks used to vote every 10 steps, so a stop could come 10 steps
    after the signal, past a scheduler's grace period where steps are slow (no checkpoint then). The job is paused
    (SIGSTOP) once rank 0 has saved a step, signalled as SLURM warns a job before its time is up (SIGUSR1 to every
    process: before, the launcher and the loader workers died of it, and nothing was saved), and let go on: it stops
    within two steps of that save, with its line and 128 + 10."""
    job = start_sh(
        "ddp",
        2,
        *DEFAULTS,
        *f"-b 2 --img-size 64 --print-freq 20 --save-every 1 --data-path {tiny_data}".split(),
        *f"--output-dir {tmp_path / 'run'}".split(),
    )
    last, deadline, saved = tmp_path / "run" / "last.pt", time.time() + 90, None
    while not last.exists() and job.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if last.exists():
        deliver(job, "every process", signal.SIGSTOP)
        saved = checkpoint_step(torch.load(last, weights_only=True), 12)
        deliver(job, "every process", signal.SIGUSR1)
        deliver(job, "every process", signal.SIGCONT)
    output = finish(job, [], timeout=60)
    assert saved is not None and saved + 2 < 10, (saved, output[-3000:])
    stops = [line for line in output.splitlines() if line.startswith("stopped by SIGUSR1 after step ")]
    assert job.returncode == 138 and len(stops) == 1 and "Traceback" not in output, output[-3000:]
    assert saved <= int(stops[0].split("after step ")[1].split(":")[0]) <= saved + 2, (saved, stops)


def diverge(mode, tiny_data, folder):
    args = [*DEFAULTS, "--data-path", tiny_data, "--lr", "1e6", "--save-every", "1", "--output-dir", folder / "run"]
    proc = run_sh(mode, *([2] if mode == "ddp" else []), *args)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, (mode, proc.stderr[-3000:])
    assert len(errors) == 1 and "diverged" in errors[0] and "--lr" in errors[0], (mode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stdout and "[rank" not in proc.stderr, mode  # (torchrun's own summary may follow)
    # --save-every 1 saved the steps before the loss went NaN: last.pt is the last good one, finite, and so is
    # best.pt where an epoch ended before (ddp 2: 3 steps an epoch)
    diverged_at = int(errors[0].split(" at step ")[1].split()[0])
    checkpoint = torch.load(folder / "run" / "last.pt", weights_only=True)
    steps_per_epoch = 6 if mode == "single" else 3
    assert 1 <= checkpoint_step(checkpoint, steps_per_epoch) < diverged_at, (mode, checkpoint["samples"], errors[0])
    saved = [folder / "run" / "last.pt"] + ([folder / "run" / "best.pt"] if diverged_at > steps_per_epoch else [])
    for path in saved:
        state = load_model_state(path)
        broken = [k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        assert not broken, (mode, path.name, broken)


def test_a_diverging_loss_stops_with_one_line_and_keeps_good_checkpoints(tiny_data, tmp_path):
    """bash run.sh single and ddp 2 with --lr 1e6 (diverge)."""
    for mode in ("single", "ddp"):
        diverge(mode, tiny_data, tmp_path / mode)


TERMINAL_MODES = ["single", "dp", "launch"]


def in_a_terminal(args, env, token, act):
    """args run in a real terminal (a pseudo-terminal), as a user types them; act(terminal) once the first progress
    line shows (type Ctrl-C, close the terminal). Returns (what the terminal showed, when it acted, the exit status:
    None if the job still ran 180 s on, then killed)."""
    pid, terminal = pty.fork()
    if pid == 0:  # the child: bash run.sh in the terminal, as a user types it
        try:
            os.chdir(REPO)
            os.execvpe("bash", [str(a) for a in args], env)
        finally:
            os._exit(127)
    output, acted, status, deadline = b"", None, None, time.time() + 180
    try:
        while time.time() < deadline:
            if terminal is not None and select.select([terminal], [], [], 0.1)[0]:
                try:
                    chunk = os.read(terminal, 4096)
                except OSError:  # EIO: no process holds the terminal any more
                    chunk = b""
                output += chunk
                if acted is None and b"  step 1/" in output:
                    acted = time.time()
                    if act(terminal) == "closed":
                        terminal = None
                if chunk:
                    continue
            time.sleep(0.1 if terminal is None else 0)
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(code)
                break
    finally:
        if status is None:  # still running at the deadline
            kill_job(token)
            os.waitpid(pid, 0)
        if terminal is not None:
            os.close(terminal)
    return output.decode(errors="replace").replace("\r\n", "\n"), acted, status


def test_a_terminal_that_closes_stops_a_one_process_run_and_saves(tiny_data, tmp_path):
    """bash run.sh single in a terminal that closes after the first step (SIGHUP, and every later write fails with
    EIO): the stop saves and ends with 129, no process left (before: the next progress line failed with an EIO
    traceback and exit 1, the save skipped)."""
    token = uuid.uuid4().hex
    args = ["bash", "run.sh", "single", *DEFAULTS, "--data-path", tiny_data, "--output-dir", tmp_path / "run"]

    def close(terminal):
        os.close(terminal)
        return "closed"

    text, closed, status = in_a_terminal(args, job_env(TEST_JOB=token, TERM="dumb"), token, close)
    assert closed, f"no progress line within 180 s:\n{text[-3000:]}"
    assert status == 129 and (tmp_path / "run" / "last.pt").is_file(), (status, text[-3000:])
    assert not (tmp_path / "run" / "results.json").exists()
    assert_job_gone(token)


@pytest.mark.parametrize("mode", TERMINAL_MODES)
def test_ctrl_c_in_a_terminal_stops_with_one_line(mode, tiny_data, tmp_path):
    """The one-process rungs and the launch rung: Ctrl-C typed into a real terminal (a pseudo-terminal: the terminal
    sends SIGINT to its foreground process group, loader workers included; `kill -INT` on a background job would
    interrupt nothing) stops the run at a step and saves it, with the script's one line, exit 130, no traceback, and
    no process left (before: a line, and no checkpoint)."""
    folder = tmp_path
    token = uuid.uuid4().hex
    env = job_env(TEST_JOB=token, TERM="dumb")
    args = [
        "bash",
        "run.sh",
        mode,
        *([2] if mode == "launch" else []),
        *DEFAULTS,
        *f"--data-path {tiny_data} --output-dir {folder / 'run'}".split(),
    ]
    text, pressed, status = in_a_terminal(args, env, token, lambda terminal: os.write(terminal, b"\x03"))  # Ctrl-C
    assert pressed, f"no progress line within 180 s:\n{text[-3000:]}"
    assert status is not None, f"still running {time.time() - pressed:.0f} s after Ctrl-C:\n{text[-3000:]}"
    lines = [line for line in text.splitlines() if line.strip()]
    stops = [line for line in lines if "stopped by SIGINT after step " in line]  # the terminal echoes ^C before it
    assert status == 130, text[-3000:]
    assert len(stops) == 1 and stops[0] == lines[-1] and "checkpoint saved" in stops[0], text[-3000:]
    assert "Traceback" not in text and (folder / "run" / "last.pt").is_file(), text[-3000:]
    assert_job_gone(token)


# The agent's report of a signal, as torch 2.14 prints it, in the two shapes a second signal gives it: interrupted
# inside its handler (a blank source line; seen in a full test run, when SIGTERM reached every process and run.sh
# forwarded it too), and chained to the first report.
INTERRUPTED = """Traceback (most recent call last):
  File "torch/distributed/elastic/agent/server/api.py", line 923, in _invoke_run
    time.sleep(monitor_interval)
  File "torch/distributed/elastic/multiprocessing/api.py", line 85, in _terminate_process_handler
    sigval = signal.Signals(signum)
             ^^^^^^^^^^^^^^^^^^^^^^
  File "enum.py", line 1093, in __new__
    def __new__(cls, value):

  File "torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 17578 got signal: 15
"""
CHAINED = """Traceback (most recent call last):
  File "torch/distributed/elastic/agent/server/api.py", line 923, in _invoke_run
    time.sleep(monitor_interval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 17578 got signal: 15

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "torch/distributed/elastic/agent/server/api.py", line 937, in _invoke_run
    self._shutdown(e.sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 17578 got signal: 15
"""


@pytest.mark.parametrize(
    "report,status",
    [(INTERRUPTED, 143), (CHAINED, 143), (INTERRUPTED.replace(CHAINED.splitlines()[-1], "RuntimeError: boom"), 1)],
)
def test_run_sh_leaves_out_the_agents_signal_report_and_nothing_else(tmp_path, report, status):
    """run.sh's stderr filter, fed the agent's exact reports by a stand-in for the launcher: a signal's report is
    left out (the exit status says which signal), any other traceback is shown whole."""
    (tmp_path / "report.txt").write_text(report)
    launcher = tmp_path / "python"  # run.sh's PYTHON: the real one, except where it starts the launcher
    launcher.write_text(
        f'#!/bin/bash\nif [ "$2" = torch.distributed.run ]; then cat {tmp_path}/report.txt >&2; '
        f'exit 1; fi\nexec {sys.executable} "$@"\n'
    )
    launcher.chmod(0o755)
    job = run_sh("ddp", 1, env=dict(job_env(), PYTHON=str(launcher)), timeout=60)
    assert job.returncode == status, job.stderr
    assert job.stderr == ("" if status == 143 else report), job.stderr


def test_a_one_process_job_stops_on_sigterm_and_sighup_saves_and_resumes_bitwise(tiny_data, tmp_path):
    """bash run.sh single (a one-GPU job) stopped as a scheduler preempts it (SIGTERM to every process of the job,
    loader workers included), then as a closed ssh session stops it (SIGHUP), then as SLURM warns it before its time
    is up (SIGUSR1 to every process), each after the job's own first step:
    each stop saves after its step and ends in one line with 128 + the signal, no temporary file left, and the last
    --resume auto ends with the uninterrupted run's weights. Before: no line, no save. (The launch rung's stop, the
    torchrun rungs' vote: test_ctrl_c_in_a_terminal_stops_with_one_line and the tests above.)"""
    args = ["single", *DEFAULTS, "--data-path", tiny_data]
    ok(run_sh(*args, "--output-dir", tmp_path / "whole"))
    folder, stopped_after = tmp_path / "run", 0
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        resume = ["--resume", "auto"] if stopped_after else []
        job, lines = start_sh(*args, "--output-dir", folder, *resume), []
        if read_until(job, lines, "  step "):
            deliver(job, "every process", signum)
        output = finish(job, lines, timeout=60)
        stops = [line for line in output.splitlines() if line.startswith("stopped by")]
        assert job.returncode == 128 + signum and len(stops) == 1, (signum, job.returncode, output[-3000:])
        assert stops[0].startswith(f"stopped by {signal.Signals(signum).name} after step "), output[-3000:]
        assert output.rstrip().splitlines()[-1] == stops[0] and "Traceback" not in output, output[-3000:]
        assert not list(folder.glob(".*.tmp")) and not (folder / "results.json").exists()
        step = int(stops[0].split("after step ")[1].split(":")[0])
        assert step > stopped_after, (stopped_after, output[-3000:])
        stopped_after = step
        assert_job_gone(job.token)
    resumed = ok(run_sh(*args, "--output-dir", folder, "--resume", "auto"))
    assert_resumed_after(resumed.stdout, step=stopped_after)
    assert_same_weights(load_model_state(folder / "last.pt"), load_model_state(tmp_path / "whole" / "last.pt"))
