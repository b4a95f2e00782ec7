"""bash run.sh bench 1 --tiny (one repetition at a 32-pixel crop, batch 8, without dp, the ceiling and amp's limit;
the DDP rows under torchrun with 1 process): runs end to end and writes a complete bench.json, every training row and
the limit timed the same way. No speed is asserted (the machine may be shared). (The all-reduce counts of accumulation
are proven by tests/proofs/test_ddp.py, from --profile.)"""

import json
import math
import sys

import bench
import dist_utils
from support import cpu_env, run

FIGURES = [
    "compute_limit_img_s",
    "single_img_s",
    "single_ratio",
    "ddp_img_s",
    "ddp_ratio",
    "accum_img_s",
    "accum_speedup",
    "first_step_s",
    "import_s",
    "step_s",
    "startup_s",
    "loader_img_s",
    "decode_loader_img_s",
    "loader_of_decode",
    "textbook_loader_img_s",
    "loader_speedup",
    "photo_loader_img_s",
    "photo_decode_loader_img_s",
    "photo_loader_of_decode",
    "photo_textbook_loader_img_s",
    "photo_loader_speedup",
    "drift_check_s",
    "drift_check_of_epoch",
]


def test_tiny_bench_writes_every_figure(tmp_path):
    out = tmp_path / "bench"
    env = cpu_env(PYTHON=sys.executable)
    env.pop("OMP_NUM_THREADS", None)  # bench.py sets the threads of every measurement itself
    proc = run(["bash", "run.sh", "bench", "1", "--tiny", "--output-dir", out], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    for key in FIGURES:
        value = result.get(key)
        assert isinstance(value, float) and math.isfinite(value) and value > 0, f"{key}: {value!r}"
    config, runs = result["config"], result["runs"]
    assert config["tiny"] and config["repeats"] == 1 and (config["img_size"], config["batch_per_process"]) == (32, 8)
    machine = result["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["gpu"] and machine["torch"]

    # Comparable rows: the limit is train_single.py's in-memory copy with single's own flags, and every training
    # row ran with the same flags after its script
    limit, single = runs["limit"][0]["cmd"].split(), runs["single"][0]["cmd"].split()
    assert limit[0].endswith("/in_memory_train_single.py") and single[0] == "train_single.py", (limit, single)
    assert limit[1:] == single[1:] and "--img-size 32 -b 8" in runs["single"][0]["cmd"]
    for name in ("ddp", "accum"):
        cmd = runs[name][0]["cmd"]
        assert "train_ddp_torchrun.py" in cmd and cmd.endswith(" ".join(single[1:])), cmd

    # Skipped rows are named, with why, in the table: dp, the ceiling and amp's limit under --tiny; amp and its limit
    # where the CPU has no bf16
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 18, proc.stdout  # the header, its rule and 16 rows
    bf16 = config["device"] == "cuda" or dist_utils.cpu_computes_bf16()
    assert sum("skipped: --tiny" in line for line in table) == (3 if bf16 else 2), proc.stdout
    amp_row = next(line for line in table if line.startswith("| amp 1: train_ddp_amp.py --amp-dtype bf16"))
    if bf16:
        assert result["amp_img_s"] > 0 and "bf16" in runs["amp"][0]["cmd"], amp_row
    else:
        assert "skipped: this CPU has no bf16 arithmetic" in amp_row and "amp" not in runs, amp_row


def test_each_target_is_judged_against_a_limit_of_the_same_run():
    """Each verdict from the run's own figures: a ratio to its limit whose median meets the target is met; one that
    only some repetitions meet is within noise, with their range; one that none meets is missed."""

    def rows(*rates):
        return [{"img_s": rate} for rate in rates]

    def loader(project, decode):
        return {"img_s": project, "decode_img_s": decode, "textbook_img_s": 1.0}

    runs = {
        "limit": rows(100, 100, 100),
        "single": rows(98, 99, 97),  # 0.98: met
        "ddp": rows(95, 95, 95),
        "amp_limit": rows(100, 100, 100),
        "amp": rows(85, 92, 86),  # 0.86, one repetition 0.92: within noise
        "ceiling": rows(100, 100, 100),
        "accum": rows(80, 81, 82),  # 0.81: missed
        "loader": [{**loader(95, 100), "of_decode": 0.95, "speedup": 95.0}],
        "photos": [{**loader(50, 100), "of_decode": 0.5, "speedup": 50.0}],
        "drift": [{"check_s": 0.01}],  # of a ddp epoch of 768 images at 95 img/s (8.1 s): 0.0012
    }
    config = {"device": "cpu", "nproc": 2, "threads_single": 2, "train_images": 800, "batch_per_process": 32}
    r = bench.summarize(runs, {}, config, {"gpu": "none", "gpus": 0, "torch": "2"})
    assert (r["single_ratio"], r["amp_of_limit"], r["accum_of_ceiling"]) == (0.98, 0.86, 0.81)
    verdicts = {key: (t["met"], t["within_noise"]) for key, t in r["targets"].items() if t["met"] is not None}
    assert verdicts == {
        "single_ratio": (True, False),
        "ddp_ratio": (True, False),
        "amp_of_limit": (False, True),
        "accum_of_ceiling": (False, False),
        "loader_of_decode": (True, False),
        "photo_loader_of_decode": (False, False),
        "drift_check_of_epoch": (True, False),  # at most (the lower the better)
    }
