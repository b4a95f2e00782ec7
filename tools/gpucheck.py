"""Everything this project still has to measure on a GPU, in one command: bash run.sh gpucheck [--report PATH].

Runs, each part within its own time limit, and writes one report (default: gpucheck-report.txt here):
  1. bash run.sh doctor: versions, the GPUs, the NCCL version, an all-reduce's latency and bus bandwidth  (60 s)
  2. tests/test_gpu.py: every rung trains on CUDA, checkpoints move between GPU and CPU, mid-epoch resume (240 s)
  3. the GPU bench rows (tools/bench.py --gpu-only) in the time still left of --budget               (420 s in all)
Without CUDA only the doctor runs, and the report and the last line say that the CUDA parts were skipped.
Exit status 1 when a part failed or ran out of time, else 0.
"""
import argparse
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default=str(REPO / "gpucheck-report.txt"), help="where the report goes")
    parser.add_argument("--budget", type=float, default=420, help="seconds for all the parts together")
    opts = parser.parse_args()
    started = time.perf_counter()
    cuda = torch.cuda.is_available()
    gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if cuda else "none"
    report = [f"# gpucheck {datetime.now().isoformat(timespec='seconds')}: torch {torch.__version__}, "
              f"CUDA {torch.version.cuda or 'none'}, GPUs: {gpu}\n"]
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        doctor_json = Path(tmp) / "doctor.json"
        summary = [run_part("bash run.sh doctor", ["bash", "run.sh", "doctor", "--json", doctor_json], 60, report)]
        if cuda:
            summary.append(run_part("tests/test_gpu.py", [py, "-m", "pytest", "-q", "-rs", "--durations=0",
                                                         "tests/test_gpu.py"], 240, report))
            left = opts.budget - (time.perf_counter() - started) - 15  # 15 s: the report, and a margin
            bench = Path(tmp) / "bench"
            summary.append(run_part("GPU bench rows", [py, "tools/bench.py", "--gpu-only", "--gpu-budget",
                                                       str(int(left) - 10), "--output-dir", bench], left, report))
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
    lines = [line for line, _ in summary] + [f"in all: {time.perf_counter() - started:.0f} s"]
    report.insert(1, "## summary\n\n" + "\n".join(lines) + "\n")
    Path(opts.report).write_text("\n".join(report))
    print("\n".join(lines) + f"\nreport: {opts.report}")
    return 0 if all(passed for _, passed in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
