"""bash run.sh bench --tiny (--quick at a 32-pixel crop, batch 8 and the fewest steps: every run and every figure of
--quick, in a third of its time): runs end to end and writes a complete bench.json. No speed is asserted (the
machine may be shared). (The all-reduce counts of accumulation are proven by tests/test_ddp.py, from --profile.)"""
import json
import math
import sys

from conftest import cpu_env, run

FIGURES = ["compute_limit_img_s", "single_img_s", "single_ratio", "dp_img_s", "ddp_img_s", "ddp_ratio", "amp_img_s",
           "accum_speedup", "first_step_s", "import_s", "loader_img_s", "classic_loader_img_s",
           "loader_speedup"]


def test_quick_bench_writes_every_figure(tmp_path):
    out = tmp_path / "bench"
    env = cpu_env(PYTHON=sys.executable)
    env.pop("OMP_NUM_THREADS", None)  # bench.py sets the threads of every measurement itself
    proc = run(["bash", "run.sh", "bench", "--tiny", "--output-dir", out], env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    for key in FIGURES:
        value = result.get(key)
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{key}: {value!r}"
        assert math.isfinite(value) and value > 0, f"{key}: {value!r}"
    if result["config"]["device"] == "cpu":  # N processes' compute limit side by side: the accumulation ceiling
        for key in ("compute_limit_split_img_s", "accum_ceiling"):
            assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, key
    assert result["startup_s"] > 0, result  # the first step after the import, timed in the same process
    machine = result["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["gpu"] and machine["torch"]
    assert result["config"]["quick"] and result["config"]["tiny"] and result["config"]["repeats"] == 1
    assert (result["config"]["img_size"], result["config"]["batch_per_process"]) == (32, 8)
    assert all("--img-size 32 -b 8" in run["cmd"] for name, runs in result["runs"].items() if name not in
               ("probe", "split") for run in runs)
    # the markdown table on stdout
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(table) >= 10 and "train_single.py" in proc.stdout and "compute limit" in proc.stdout
