"""The suite's own promises: the CPU tests hide the GPUs from everything they start (only tests/gpu/test_gpu.py sees
them), and a job a test starts ends at its time limit, every process of it, even one that stalls without output."""

import os
import signal
import subprocess
import sys
import time

import pytest

import support
from support import assert_job_gone, cpu_env, finish, job_env, run, start, start_sh


def test_cpu_tests_hide_the_gpus_from_what_they_start(tmp_path, monkeypatch):
    """On a GPU machine a CPU test that let a process see a GPU would train on it (cuDNN is not bitwise), or make
    run.sh refuse 2 processes on one GPU: every environment the CPU tests give, and the one a started process
    inherits, says CUDA_VISIBLE_DEVICES= (empty); test_gpu.py's keeps what the suite was started with."""
    monkeypatch.syspath_prepend(support.REPO / "tests" / "gpu")
    import test_gpu

    envs = {"os.environ (inherited)": dict(os.environ), "cpu_env()": cpu_env(), "job_env()": job_env()}
    exposed = {
        name: env.get("CUDA_VISIBLE_DEVICES") for name, env in envs.items() if env.get("CUDA_VISIBLE_DEVICES") != ""
    }
    assert not exposed, f"these environments do not hide the GPUs: {exposed}"
    assert test_gpu.env().get("CUDA_VISIBLE_DEVICES") == support.USER_VISIBLE_DEVICES

    # What real processes got: run()'s default environment, and start_sh()'s (bash run.sh) read from /proc
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))\n")
    assert run([sys.executable, probe]).stdout.strip() == "''"
    job, environ, deadline = start_sh("single", "--help"), {}, time.time() + 10
    while not environ and time.time() < deadline:  # empty while the process is still in its execve (seen once)
        with open(f"/proc/{job.pid}/environ", "rb") as f:
            environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    finish(job, [], timeout=60)
    assert environ.get(b"CUDA_VISIBLE_DEVICES") == b"", environ.get(b"CUDA_VISIBLE_DEVICES")


def test_a_job_that_stalls_without_output_is_ended_at_its_time_limit():
    """A job whose process tree goes silent (here: a child in a session of its own, as torchrun's workers are,
    holding the output pipe open): the loop reading its output ends at the watchdog's limit, and every process of
    the job is killed, the orphaned one too. run() does the same for jobs run to completion."""
    stall = [
        sys.executable,
        "-c",
        "import subprocess, time; subprocess.Popen(['sleep', '60'], start_new_session=True);"
        " print('started', flush=True); time.sleep(60)",
    ]

    started = time.time()
    job = start(stall, env=cpu_env(), timeout=3)
    lines = list(job.stdout)  # no deadline of its own: the watchdog ends it
    assert lines == ["started\n"] and time.time() - started < 30
    finish(job, lines, timeout=10)
    assert_job_gone(job.token, within=10)
    started = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        run(stall, env=cpu_env(), timeout=3)
    assert time.time() - started < 30


def test_a_suite_started_with_stop_signals_ignored_gives_its_jobs_the_defaults(tmp_path):
    """`nohup bash run.sh test &` starts the suite with SIGHUP and SIGINT ignored, and an ignore is inherited by
    every process started from there: the tests that stop a job with those signals would watch it train on. A suite
    in that state (a pytest run of one test, started with both ignored) must still start its jobs with the defaults."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import subprocess\n"
        "def test_probe():\n"
        "    job = subprocess.run(['grep', 'SigIgn', '/proc/self/status'],\n"
        "                         capture_output=True, text=True)\n"
        "    print('started job:', job.stdout.strip())\n"
    )

    def ignore_stop_signals():  # as nohup and a script's `&` leave them
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    result = subprocess.run(
        [
            sys.executable,
            *"-m pytest -q -s -p no:cacheprovider --rootdir".split(),
            str(tmp_path),
            "--confcutdir",
            str(tmp_path),
            "-p",
            "conftest",
            str(probe),
        ],
        cwd=tmp_path,
        env=job_env(PYTHONPATH=str(support.REPO / "tests")),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=ignore_stop_signals,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    ignored = int(result.stdout.split("started job: SigIgn:")[1].split()[0], 16)  # bit N-1: signal N ignored
    assert not ignored & (1 << signal.SIGINT - 1 | 1 << signal.SIGHUP - 1), result.stdout
