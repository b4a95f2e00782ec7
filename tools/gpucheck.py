"""Everything this project still has to measure on a GPU, in one command: bash run.sh gpucheck [--report PATH].

Runs these parts in this order, each within a time limit sized from what it starts, all within --budget (7 min):
  1. bash run.sh doctor: versions, the GPUs, the NCCL version, an all-reduce's latency and bus bandwidth
  2. tests/test_gpu.py, first part: no training step waits for the GPU (set_sync_debug_mode), every rung trains
  3. the GPU bench rows (tools/bench.py --gpu-only; the most telling first) in the time left beside part 4's limit
  4. tests/test_gpu.py, the rest: checkpoints between GPU and CPU, a mid-epoch resume, the reads per step
and writes one report (default: gpucheck-report.txt here). Without CUDA only the doctor runs, and the report and
the last line say that the CUDA parts were skipped, with the plan the check would follow on one GPU.
Exit status 1 when a part failed or ran out of time, else 0.
"""
import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch

from bench import kill_tree  # the runs start launchers whose workers live in sessions of their own

REPO = Path(__file__).resolve().parents[1]

# The time a start costs on a GPU machine, with a margin of about 1.5x (no GPU has run this check yet; the report's
# per-test durations are the figures to size them from): a script run in one process imports torch and torchvision
# (~3 s), starts CUDA (~1-2 s) and 2 loader workers, trains 12 small steps, evaluates and writes 4 checkpoints
# (~2 s); a torchrun launch starts the launcher first and NCCL too (~4 s more). pytest itself starts in ~5 s, and
# the in-process test builds the model on CUDA and runs 16 steps (cuDNN's first calls dominate).
SCRIPT_RUN_S, TORCHRUN_S, PYTEST_S, IN_PROCESS_S = 9, 14, 10, 15
DOCTOR_S = 45  # doctor.py, and one all-reduce process per GPU beside it (2 starts, 64 MiB all-reduces)
REPORT_S = 10  # writing the report, and a margin for the parts' own exits
FIRST = ("test_training_steps_never_wait_for_the_gpu", "test_each_script_trains_on_cuda")  # part 2; the rest: 4


def launches():
    """tests/test_gpu.py's LAUNCHES table ({test: (script runs, torchrun launches, GPUs needed)}), read from its
    source: importing it would import pytest's conftest."""
    tree = ast.parse((REPO / "tests" / "test_gpu.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "LAUNCHES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("gpucheck: tests/test_gpu.py has no LAUNCHES table")


def test_limit(tests, table, gpus):
    """Seconds for pytest running `tests` on `gpus` GPUs: what they start, at the costs above."""
    seconds = PYTEST_S
    for name in tests:
        script_runs, torchrun_launches, needs = table[name]
        if gpus >= needs:
            seconds += script_runs * SCRIPT_RUN_S + torchrun_launches * TORCHRUN_S
            seconds += IN_PROCESS_S if script_runs == torchrun_launches == 0 else 0
    return seconds


def plan(gpus, budget):
    """[(part, limit in seconds)] in the order the check runs them; the bench rows get what the others leave."""
    table = launches()
    rest = [name for name in table if name not in FIRST]
    parts = [("doctor", DOCTOR_S), ("tests, first part", test_limit(FIRST, table, gpus))]
    last = ("tests, the rest", test_limit(rest, table, gpus))
    bench = budget - sum(limit for _, limit in parts) - last[1] - REPORT_S
    return parts + [("GPU bench rows", bench), last], rest


def run_part(title, cmd, limit, report):
    """Run cmd (at most `limit` seconds), add its output to the report; its summary line for the screen."""
    print(f"gpucheck: {title} (at most {limit:.0f} s)", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHON=sys.executable), start_new_session=True)
    try:
        output, status = proc.communicate(timeout=limit)[0], proc.returncode
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        output, status = proc.communicate()[0], None
    seconds = time.perf_counter() - start
    verdict = ("ok" if status == 0 else f"ran out of its {limit:.0f} s" if status is None
               else f"failed (exit {status})")
    report.append(f"## {title}: {verdict}, {seconds:.0f} s\n\n$ {' '.join(map(str, cmd))}\n\n{output.rstrip()}\n")
    return f"{title}: {verdict}, {seconds:.0f} s", status == 0


def what_it_proves(cuda, gpus, summary):
    """The plain words: what this run showed about the GPU path, and what it could not show."""
    if not cuda:
        return ["what this proves: nothing about GPUs (no CUDA GPU here; everything GPU-side in this project is by "
                "reading until this check runs on one)"]
    passed = [line.split(":")[0] for line, ok in summary if ok and not line.startswith("NCCL")]
    lines = [f"what this proves on {gpus} GPU(s): {'; '.join(passed) or 'nothing (every part failed)'}"]
    if gpus < 2:
        lines.append("what one GPU cannot prove: NCCL between ranks (one rank per GPU, and NCCL refuses two ranks on "
                     "one GPU), SyncBatchNorm across ranks (at world size 1 it is plain BatchNorm), nn.DataParallel's "
                     "split (with one GPU the module runs unwrapped), restarts and stops across ranks on NCCL")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=str(REPO / "gpucheck-report.txt"), help="where the report goes")
    parser.add_argument("--budget", type=float, default=420, help="seconds for all the parts together")
    opts = parser.parse_args()
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    gpu = f"{gpus} x {torch.cuda.get_device_name(0)}" if cuda else "none"
    report = [f"# gpucheck {datetime.now().isoformat(timespec='seconds')}: torch {torch.__version__}, "
              f"CUDA {torch.version.cuda or 'none'}, GPUs: {gpu}\n"]
    parts, rest = plan(max(gpus, 1), opts.budget)
    planned = "plan" + ("" if cuda else " on one GPU") + ": " + ", ".join(
        f"{name} {limit:.0f} s" for name, limit in parts) + f" (budget {opts.budget:.0f} s)"
    print(f"gpucheck: {planned}", flush=True)
    py = sys.executable
    pytest = [py, "-m", "pytest", "-q", "-rs", "--durations=0", "tests/test_gpu.py", "-k"]
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        doctor_json = Path(tmp) / "doctor.json"
        summary = [run_part("bash run.sh doctor", ["bash", "run.sh", "doctor", "--json", doctor_json], DOCTOR_S,
                            report)]
        if cuda:
            summary.append(run_part("tests/test_gpu.py, first part", pytest + [" or ".join(FIRST)], parts[1][1],
                                    report))
            # the bench gets the time left once the last part's limit is set aside
            left = opts.budget - (time.perf_counter() - started) - parts[3][1] - REPORT_S
            bench = Path(tmp) / "bench"
            if left >= 30:
                summary.append(run_part("GPU bench rows", [py, "tools/bench.py", "--gpu-only", "--gpu-budget",
                                                           str(int(left) - 10), "--output-dir", bench], left, report))
            else:
                summary.append((f"GPU bench rows: skipped, {left:.0f} s left of the budget", False))
            summary.append(run_part("tests/test_gpu.py, the rest", pytest + [" or ".join(rest)], parts[3][1], report))
            if (bench / "bench.json").exists():
                report.append("## bench.json\n\n" + (bench / "bench.json").read_text())
        else:
            summary.append(("CUDA parts (tests/test_gpu.py, GPU bench rows): skipped, no CUDA GPU on this machine",
                            True))
        if doctor_json.exists():
            data = json.loads(doctor_json.read_text())
            nccl = next((c.get("version") for c in data["checks"] if c["name"] == "nccl"), None)
            summary.append((f"NCCL version: {nccl or 'none'}", True))
            report.append("## doctor.json\n\n" + json.dumps(data, indent=2) + "\n")
    lines = [line for line, _ in summary] + [planned, f"in all: {time.perf_counter() - started:.0f} s"] + \
        what_it_proves(cuda, gpus, summary)
    report.insert(1, "## summary\n\n" + "\n".join(lines) + "\n")
    Path(opts.report).write_text("\n".join(report))
    print("\n".join(lines) + f"\nreport: {opts.report}")
    return 0 if all(passed for _, passed in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
