# SPDX-License-Identifier: BSD-3-Clause
"""Everything this project still has to measure on a GPU, in one command: bash run.sh gpucheck [--report PATH].

On a CUDA machine, in this order, each part within a time limit, all within --budget (9 min):
  1. two timed launches: a tiny train_single.py run and a tiny `bash run.sh ddp 1` run (what one start costs here)
  2. tests/gpu/test_gpu.py, every test, each result printed as it ends; its limit sized from those launches and the
     starts each test makes (its LAUNCHES table)
  3. bash run.sh doctor: versions, the GPUs, the NCCL version, an all-reduce's latency and bus bandwidth
  4. the GPU bench rows (tools/bench.py --gpu-only, the most telling first) in the time left
and writes one report (default: gpucheck-report.txt here). A machine with an NVIDIA device (/dev/nvidia0 or
nvidia-smi) where torch cannot use CUDA fails, with one line saying why. Without any GPU only the doctor runs, and the
report and the last line say that nothing about GPUs was proven. Exit status 1 when a part failed, crashed or ran out
of time, else 0.
"""

import argparse
import ast
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Before anything is measured (and on a machine without a GPU, for the plan it shows): a script run in one process
# ~6 s, a torchrun launch ~9.5 s (imports, CUDA, loader workers, NCCL). On a GPU the two timed launches replace these.
GUESSED = {"script": 6.0, "torchrun": 9.5}
MARGIN = 1.5  # a test's runs train 2 epochs where the timed launch trains 1, and the machine may be busy
PYTEST_S = 10  # pytest's own start
IN_PROCESS_S = 15  # a test in pytest's process (CUDA context, 16 steps)
DOCTOR_S = 45  # doctor.py, and one all-reduce process per GPU beside it (2 starts, 64 MiB all-reduces)
BENCH_MIN_S = 30  # the bench rows need at least their first (the compute limits)
REPORT_S = 10  # writing the report, and a margin for the parts' own exits


def launches():
    """tests/gpu/test_gpu.py's LAUNCHES table ({test: (script runs, torchrun launches, GPUs needed)}), read from its
    source: importing it would import pytest's conftest."""
    tree = ast.parse((REPO / "tests" / "gpu" / "test_gpu.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LAUNCHES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("gpucheck: tests/gpu/test_gpu.py has no LAUNCHES table")


def plan(gpus, budget, costs):
    """[(part, limit in seconds)] after the timed launches, in the order the check runs them. costs: the seconds
    of one script run and of one torchrun launch on this machine. The bench rows get what the others leave."""
    tests = PYTEST_S
    for script_runs, torchrun_launches, needs in launches().values():
        if gpus >= needs:
            tests += MARGIN * (script_runs * costs["script"] + torchrun_launches * costs["torchrun"])
            tests += IN_PROCESS_S if script_runs == torchrun_launches == 0 else 0
    return [
        ("tests/gpu/test_gpu.py", round(tests)),
        ("doctor", DOCTOR_S),
        ("GPU bench rows", round(budget - tests - DOCTOR_S - REPORT_S)),
    ]


def time_launches(folder, report):
    """One tiny run of each kind, timed: {"script": s, "torchrun": s}, and whether both trained."""
    import builtin

    data = folder / "data"
    builtin.make_demo_images(data, per_class=12, size=32)
    costs = {}
    ok = True
    for kind, mode in (("script", ["single"]), ("torchrun", ["ddp", "1"])):
        cmd = [
            "bash",
            "run.sh",
            *mode,
            "--data-path",
            data,
            "--img-size",
            "32",
            "-b",
            "8",
            "--epochs",
            "1",
            "--output-dir",
            folder / kind,
        ]
        line, passed, costs[kind] = run_part(
            f"timed launch: bash run.sh {' '.join(mode)}, 1 tiny epoch", cmd, 120, report, quiet=True
        )
        print(f"gpucheck: {line}", flush=True)
        ok = ok and passed
    return costs, ok


def kill(proc):
    """Kill proc's session; torchrun's ranks follow it (dist_utils.require_launcher's parent-death signal)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_part(title, cmd, limit, report, quiet=False):
    """Run cmd (at most `limit` seconds), its output shown line by line as it comes (unless quiet) and added to the
    report; (its summary line, whether it passed, its seconds)."""
    if not quiet:
        print(f"gpucheck: {title} (at most {limit:.0f} s)", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [str(c) for c in cmd],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHON=sys.executable),
        start_new_session=True,
    )
    timed_out = threading.Event()

    def time_out():
        timed_out.set()
        kill(proc)

    timer = threading.Timer(limit, time_out)
    timer.start()
    lines = []
    for line in proc.stdout:  # as it comes: what a part printed before it was killed is kept
        lines.append(line)
        if not quiet:
            print(f"  {line}", end="", flush=True)
    proc.wait()
    timer.cancel()
    seconds = time.perf_counter() - start
    verdict = (
        "ok"
        if proc.returncode == 0
        else f"ran out of its {limit:.0f} s"
        if timed_out.is_set()
        else f"failed (exit {proc.returncode})"
    )
    report.append(
        f"## {title}: {verdict}, {seconds:.0f} s\n\n$ {' '.join(map(str, cmd))}\n\n{''.join(lines).rstrip()}\n"
    )
    return f"{title}: {verdict}, {seconds:.0f} s", proc.returncode == 0, seconds


def nvidia_device():
    """Whether this machine has an NVIDIA GPU that is not hidden on purpose (CUDA_VISIBLE_DEVICES empty or -1, as
    the CPU tests do), whatever torch thinks: its device node or its driver's tool."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    return not hidden and (Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None)


def what_it_proves(cuda, gpus, summary):
    """The plain words: what this run showed about the GPU path, and what it could not show."""
    if not cuda:
        return [
            (
                "what this proves: nothing about GPUs (no CUDA GPU here; everything GPU-side in this project is by "
                "reading until this check runs on one)"
            )
        ]
    passed = [line.split(":")[0] for line, ok in summary if ok and not line.startswith("NCCL")]
    lines = [f"what this proves on {gpus} GPU(s): {'; '.join(passed) or 'nothing (every part failed)'}"]
    if gpus < 2:
        lines.append(
            "what one GPU cannot prove: NCCL between ranks (one rank per GPU, and NCCL refuses two ranks on "
            "one GPU), SyncBatchNorm across ranks (at world size 1 it is plain BatchNorm), nn.DataParallel's "
            "split (with one GPU the module runs unwrapped), restarts and stops across ranks on NCCL"
        )
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=str(REPO / "gpucheck-report.txt"), help="where the report goes")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all the parts together")
    opts = parser.parse_args()
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    gpu = f"{gpus} x {torch.cuda.get_device_name(0)}" if cuda else "none"
    report = [
        (
            f"# gpucheck {datetime.now().isoformat(timespec='seconds')}: torch {torch.__version__}, "
            f"CUDA {torch.version.cuda or 'none'}, GPUs: {gpu}\n"
        )
    ]
    summary = []
    if nvidia_device() and not cuda:
        summary.append(
            (
                (
                    f"error: this machine has an NVIDIA GPU, but torch {torch.__version__} (built for CUDA "
                    f"{torch.version.cuda or 'none: a CPU-only build'}) cannot use it: install a torch build for "
                    f"a CUDA version the driver supports (nvidia-smi shows the driver's); see the doctor's lines"
                ),
                False,
            )
        )
        print(f"gpucheck: {summary[-1][0]}", flush=True)
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        costs = GUESSED
        timed = cuda  # whether both timed launches trained (they run on a GPU only)
        if cuda:
            costs, timed = time_launches(Path(tmp), report)
            line = f"timed launches: a script run {costs['script']:.0f} s, a torchrun launch {costs['torchrun']:.0f} s"
            summary.append((line, timed))
        parts = dict(plan(max(gpus, 1), opts.budget, costs))
        planned = (
            "plan"
            + ("" if cuda else " on one GPU, from guessed launch costs")
            + ": "
            + ", ".join(f"{name} {limit:.0f} s" for name, limit in parts.items())
            + f" (budget {opts.budget:.0f} s)"
        )
        print(f"gpucheck: {planned}", flush=True)
        if cuda:
            summary.append(
                run_part(
                    "tests/gpu/test_gpu.py",
                    [
                        py,
                        "-m",
                        "pytest",
                        "-v",
                        "-rs",
                        "--durations=0",
                        "-p",
                        "no:cacheprovider",
                        "tests/gpu/test_gpu.py",
                    ],
                    parts["tests/gpu/test_gpu.py"],
                    report,
                )[:2]
            )
        doctor_json = Path(tmp) / "doctor.json"
        summary.append(
            run_part("bash run.sh doctor", ["bash", "run.sh", "doctor", "--json", doctor_json], DOCTOR_S, report)[:2]
        )
        if cuda:
            left = opts.budget - (time.perf_counter() - started) - REPORT_S
            bench = Path(tmp) / "bench"
            if left >= BENCH_MIN_S:
                summary.append(
                    run_part(
                        "GPU bench rows",
                        [
                            py,
                            "tools/bench.py",
                            "--gpu-only",
                            "--gpu-budget",
                            str(int(left) - 10),
                            "--output-dir",
                            bench,
                        ],
                        left,
                        report,
                    )[:2]
                )
            else:
                summary.append((f"GPU bench rows: skipped, {left:.0f} s left of the budget", False))
            if (bench / "bench.json").exists():
                report.append("## bench.json\n\n" + (bench / "bench.json").read_text())
        else:
            summary.append(
                (
                    "CUDA parts (tests/gpu/test_gpu.py, GPU bench rows): skipped, no CUDA GPU on this machine",
                    not nvidia_device(),
                )
            )
        if doctor_json.exists():
            data = json.loads(doctor_json.read_text())
            nccl = next((c.get("version") for c in data["checks"] if c["name"] == "nccl"), None)
            summary.append((f"NCCL version: {nccl or 'none'}", True))
            report.append("## doctor.json\n\n" + json.dumps(data, indent=2) + "\n")
    lines = (
        [line for line, _ in summary]
        + [planned, f"in all: {time.perf_counter() - started:.0f} s"]
        + what_it_proves(cuda, gpus, summary)
    )
    report.insert(1, "## summary\n\n" + "\n".join(lines) + "\n")
    Path(opts.report).write_text("\n".join(report))
    print("\n".join(lines) + f"\nreport: {opts.report}")
    return 0 if all(passed for _, passed in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
