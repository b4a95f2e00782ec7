"""tools/gpucheck.py (`bash run.sh gpucheck`) without a GPU: its plan sized from a measured launch, the doctor run and
the CUDA parts said skipped on a CPU, and one error line where torch cannot use the NVIDIA GPU there. On a GPU
it runs tests/gpu/test_gpu.py."""

import sys
import pytest

from support import REPO, cpu_env, run


def test_gpucheck_on_a_cpu_runs_the_doctor_and_says_the_cuda_parts_were_skipped(tmp_path):
    report = tmp_path / "report.txt"
    result = run(
        ["bash", "run.sh", "gpucheck", "--report", report],
        timeout=120,
        env={k: v for k, v in cpu_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    skipped = "CUDA parts (tests/gpu/test_gpu.py, GPU bench rows): skipped, no CUDA GPU on this machine"
    assert skipped in result.stdout.splitlines() and f"report: {report}" in result.stdout
    text = report.read_text()
    assert skipped in text and "## bash run.sh doctor: ok" in text and "all-reduce gloo, 2 processes" in text
    assert "plan on one GPU, from guessed launch costs: tests/gpu/test_gpu.py " in result.stdout
    assert "(budget 540 s)" in result.stdout
    assert "what this proves: nothing about GPUs (no CUDA GPU here" in result.stdout  # said plainly
    import gpucheck  # on a GPU, what one GPU cannot prove is said too

    assert any(
        "what one GPU cannot prove: NCCL between ranks" in line
        for line in gpucheck.what_it_proves(True, 1, [("bash run.sh doctor: ok, 9 s", True)])
    )


def test_gpucheck_sizes_its_limits_from_a_measured_launch(monkeypatch):
    """Every GPU test is counted in tests/gpu/test_gpu.py's LAUNCHES, and the plan's limit for them grows with the
    measured cost of a launch; on one GPU as on eight the guessed costs leave the bench rows their first 90 s."""
    import ast
    import gpucheck

    tree = ast.parse((REPO / "tests" / "gpu" / "test_gpu.py").read_text())
    tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    assert set(gpucheck.launches()) == tests
    for gpus in (1, 8):
        parts = dict(gpucheck.plan(gpus, 540, gpucheck.GUESSED))
        assert list(parts) == ["tests/gpu/test_gpu.py", "doctor", "GPU bench rows"] and parts["GPU bench rows"] >= 90
    quick, slow = (
        dict(gpucheck.plan(1, 540, {"script": s, "torchrun": 2 * s}))["tests/gpu/test_gpu.py"] for s in (5, 10)
    )
    runs = sum(gpucheck.MARGIN * (a + 2 * b) for a, b, needs in gpucheck.launches().values() if needs <= 1)
    assert slow - quick == pytest.approx(5 * runs, abs=1)


def test_gpucheck_fails_where_torch_cannot_use_the_nvidia_gpu(monkeypatch, capsys, tmp_path):
    """An NVIDIA device on the machine (here: a stand-in nvidia-smi) and a torch that cannot use CUDA (a wheel built
    for a newer driver): one error line and exit status 1, not "skipped"."""
    import gpucheck

    monkeypatch.setenv("PATH", str(tmp_path), prepend=":")
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI 535.00'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # not hidden on purpose
    monkeypatch.setattr(gpucheck.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpucheck, "run_part", lambda title, *args, **kwargs: (f"{title}: ok, 1 s", True, 1.0))
    monkeypatch.setattr(sys, "argv", ["gpucheck.py", "--report", str(tmp_path / "report.txt")])
    assert gpucheck.main() == 1
    out = capsys.readouterr().out
    assert "error: this machine has an NVIDIA GPU, but torch" in out and "cannot use it" in out, out
    assert "what this proves: nothing about GPUs" in out
