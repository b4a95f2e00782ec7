"""bash run.sh doctor (tools/doctor.py), run for real: no mocks, real processes and a real all-reduce.

One full run (about 10 s on a quiet 2-core machine) is shared by the tests of its report; the failing-port test
adds a shorter run without the all-reduce. Like every CPU test, these hide the GPUs from what they start
(support.cpu_env): on a GPU machine too, the doctor reports a machine without CUDA, and gpucheck dry-runs.
"""

import json
import math
import re
import socket
import sys

import pytest
import torch

from support import cpu_env, run

LINE = re.compile(r"^(ok|warn|fail|skip) +\S")


def run_doctor(*args, env=None, timeout=120):
    """bash run.sh doctor *args from the repository root, with PYTHON=this interpreter; the CompletedProcess."""
    base = {k: v for k, v in cpu_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return run(
        ["bash", "run.sh", "doctor", *args], timeout=timeout, env={**base, "PYTHON": sys.executable, **(env or {})}
    )


@pytest.fixture(scope="module")
def doctor_run(tmp_path_factory):
    """The full doctor, all-reduce included: (the process, its lines, its JSON)."""
    path = tmp_path_factory.mktemp("doctor") / "doctor.json"
    result = run_doctor("--json", str(path))
    assert path.exists(), f"no JSON written\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result, result.stdout.splitlines(), json.loads(path.read_text())


def line_of(lines, pattern):
    found = [line for line in lines if re.search(pattern, line)]
    assert len(found) == 1, f"expected one line matching {pattern!r}, got {found}\n" + "\n".join(lines)
    return found[0]


def test_exits_zero_with_one_aligned_line_per_check(doctor_run):
    result, lines, data = doctor_run
    assert result.returncode == 0, result.stdout + result.stderr
    *checks, summary = lines
    assert all(LINE.match(line) and line[6] != " " for line in checks), "\n".join(lines)  # message in column 7
    assert re.match(r"doctor: \d+ ok, \d+ warn, 0 fail, \d+ skipped in [\d.]+ s: ready", summary), summary
    assert data["exit_status"] == 0 and data["summary"]["fail"] == 0
    # the JSON holds the same checks as the screen, in the same order
    assert len(data["checks"]) == len(checks)
    for check, line in zip(data["checks"], checks):
        assert line.startswith(f"{check['status']:<6}{check['message']}"), (check, line)
        assert check["fix"] is None or line.endswith(f"; {check['fix']}")
    assert data["summary"] == {s: sum(c["status"] == s for c in data["checks"]) for s in ("ok", "warn", "fail", "skip")}


def test_reports_the_versions(doctor_run):
    _, lines, data = doctor_run
    from importlib.metadata import version  # importing torchvision here would cost seconds

    # Python before the fork fix of python/cpython#112275 (3.11.10, 3.10.15, ...) is a warning, with its issue
    fixed = {(3, 8): 20, (3, 9): 20, (3, 10): 15, (3, 11): 10}
    status = "warn" if sys.version_info[2] < fixed.get(sys.version_info[:2], 0) else "ok"
    python = line_of(lines, r"^\w+ +Python ")
    assert python.startswith(f"{status:6}Python {sys.version.split()[0]} "), python
    assert ("python/cpython#112275" in python) == (status == "warn"), python
    assert re.match(rf"^ok +torch {re.escape(torch.__version__)} \(", line_of(lines, r"^\w+ +torch \d"))
    assert line_of(lines, r"^\w+ +torchvision ").startswith(f"ok    torchvision {version('torchvision')}")
    assert line_of(lines, r"^\w+ +tensorboard ").startswith(f"ok    tensorboard {version('tensorboard')}")
    by_name = {c["name"]: c for c in data["checks"]}
    assert by_name["torch"]["version"] == torch.__version__
    # the wheel's metadata may leave out the local part (+cu130) that torchvision.__version__ has
    assert by_name["torchvision"]["version"].split("+")[0] == version("torchvision").split("+")[0]


def test_gpu_checks_are_skipped_on_a_cpu_machine(doctor_run):
    _, lines, data = doctor_run
    assert re.match(r"^warn +CUDA not available .*GPU checks skipped", line_of(lines, r"CUDA not available"))
    assert line_of(lines, r"GPUs: ").startswith("skip  GPUs: none visible")
    assert re.match(r"^skip +NCCL .*not used without GPUs", line_of(lines, r"^\w+ +NCCL \S"))
    by_name = {c["name"]: c for c in data["checks"]}
    assert by_name["cuda"]["status"] == "warn" and by_name["cuda"]["available"] is False
    assert by_name["gpus"]["status"] == by_name["nccl"]["status"] == "skip"
    assert by_name["gloo"]["status"] == "ok"


def test_gloo_allreduce_measures_latency_and_bandwidth(doctor_run):
    _, lines, data = doctor_run
    line = line_of(lines, r"all-reduce")
    match = re.match(
        r"^ok +all-reduce gloo, 2 processes: latency ([\d.]+) us \(8 B\), busbw ([\d.]+) GB/s "
        r"\(algbw ([\d.]+) GB/s, 64 MiB\)$",
        line,
    )
    assert match, line
    latency, busbw, algbw = map(float, match.groups())
    assert latency > 0 and busbw > 0 and algbw > 0 and busbw == algbw  # 2(n-1)/n = 1 for 2 processes
    check = next(c for c in data["checks"] if c["name"] == "allreduce")
    assert (check["status"], check["backend"], check["world_size"]) == ("ok", "gloo", 2)
    assert check["size_bytes"] == 64 << 20 and check["small_bytes"] == 8
    for key in ("latency_us", "algbw_gbps", "busbw_gbps", "seconds"):
        assert math.isfinite(check[key]) and check[key] > 0, (key, check[key])
    assert check["busbw_gbps"] == pytest.approx(check["algbw_gbps"])
    assert check["algbw_gbps"] == pytest.approx(check["size_bytes"] / check["seconds"] / 1e9)
    assert f"{check['latency_us']:.0f}" == match.group(1) and f"{check['busbw_gbps']:.2f}" == match.group(2)


def test_a_port_in_use_fails_the_run(tmp_path):
    path = tmp_path / "port.json"
    with socket.socket() as held:  # bound and listening for the whole run, closed afterwards
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_doctor("--no-allreduce", "--json", str(path), env={"MASTER_PORT": str(port)}, timeout=60)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    line = line_of(lines, r"MASTER_PORT")
    assert line.startswith(f"fail  MASTER_PORT {port} is already in use"), line
    assert f"MASTER_PORT={port + 1}" in line and f"sport = :{port}" in line  # the fix: another port, or what holds it
    assert re.search(r", 1 fail, .*: 1 check\(s\) failed", lines[-1]), lines[-1]
    data = json.loads(path.read_text())
    assert data["exit_status"] == 1 and data["summary"]["fail"] == 1
    port_check = next(c for c in data["checks"] if c["name"] == "port")
    assert port_check["status"] == "fail" and port_check["port"] == port
    assert next(c for c in data["checks"] if c["name"] == "allreduce")["status"] == "skip"


def test_a_broken_torchvision_is_its_one_failure(tmp_path):
    """The doctor is needed most when an install is broken: with a torchvision that does not import (a stand-in
    first on PYTHONPATH, as a torchvision built for another torch fails), that is its one failing check, and every
    other check still runs (the bf16 one used to import the project's helpers, and torchvision through them)."""
    (tmp_path / "torchvision").mkdir()
    (tmp_path / "torchvision" / "__init__.py").write_text('raise ImportError("built for another torch")\n')
    result = run_doctor("--no-allreduce", env={"PYTHONPATH": str(tmp_path)}, timeout=60)
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line for line in lines if line.startswith("fail")]
    assert failed == [
        "fail  torchvision does not import (ImportError: built for another torch); pip install -r requirements.txt"
    ], lines
    assert line_of(lines, r"CPU bf16: ").startswith(("ok    CPU bf16: ", "warn  CPU bf16: "))
