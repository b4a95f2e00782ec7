"""Right on the hardware people have, proven on the CPU: what the scripts choose by default for the machine (loader
workers, bf16 where the CPU computes it), checkpoints that open on any machine, and the GPU check that sizes its
limits from a measured launch and fails on a crashed bench row. What needs a GPU is in tests/gpu/test_gpu.py."""

import json
import sys
import types

import torch

import dist_utils
import utils
from support import BF16, DEFAULTS, FP16_CLIP, job_env, load_model_state, ok, run, run_sh

AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}  # as a CPU without AVX512 (or AMX) runs


def test_default_loader_workers_follow_the_cores(monkeypatch):
    """With a GPU: the cores per process on this node, less the one that trains; on a CPU: 1 (the training
    threads use the cores; docs/performance.md)."""
    parser = utils.get_args_parser("test")
    monkeypatch.setattr(utils.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    found = lambda check_available=False: torch.device("cuda")  # noqa: E731  (a GPU machine)
    monkeypatch.setattr(utils.torch.accelerator, "current_accelerator", found)
    for local_world_size, device, workers in ((1, None, 15), (2, None, 7), (8, "cuda", 1), (1, "cpu", 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world_size))
        args = utils.check_args(parser.parse_args([] if device is None else ["--device", device]))
        assert args.workers == workers, (local_world_size, device, args.workers)
    monkeypatch.setattr(utils.torch.accelerator, "current_accelerator", lambda check_available=False: None)
    assert utils.check_args(parser.parse_args([])).workers == 1
    assert utils.check_args(parser.parse_args(["--workers", "5"])).workers == 5  # given: kept


def test_a_checkpoint_holds_cpu_tensors_only(tmp_path, monkeypatch):
    """Every tensor of the state (model, optimizer state, tensors nested in dicts and lists) goes through .cpu()
    before torch.save, so that a checkpoint written on a GPU opens with plain torch.load where there is none
    (tests/gpu/test_gpu.py proves it on a GPU)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "nested": [(torch.ones(2), {"x": torch.zeros(1)})],
        "epoch": 1,
    }
    tensors = []

    def count(value):
        if torch.is_tensor(value):
            tensors.append(value)
        elif isinstance(value, dict):
            [count(v) for v in value.values()]
        elif isinstance(value, (list, tuple)):
            [count(v) for v in value]

    count(state)
    moved = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: moved.append(self) or real_cpu(self, *a, **k))
    utils.save_checkpoint(state, tmp_path)
    assert len(moved) == len(tensors) > 8 and all(any(m is t for m in moved) for t in tensors)
    monkeypatch.undo()
    loaded = torch.load(tmp_path / "last.pt", weights_only=True)
    assert loaded["nested"][0][1]["x"].device.type == "cpu" and torch.equal(loaded["rng"], state["rng"])


def test_amp_on_a_cpu_without_bf16_says_so_in_one_line(default_amp, tiny_data, tmp_path):
    """On a CPU whose oneDNN has no bf16 kernels (emulated here with ONEDNN_MAX_CPU_ISA=AVX2, where bf16 autocast
    measured 10x slower than fp32), the amp rung refuses the default in one line naming what to run instead, and
    with --amp-dtype bf16 trains after one warning line. The doctor says the same."""
    args, out = [*DEFAULTS, "--epochs", "1", "--data-path", tiny_data], tmp_path
    check = ["tools/doctor.py", "--no-allreduce"]
    refused = run_sh("amp", 1, *args, "--output-dir", out / "refused", env=job_env(**AVX2_ONLY))
    doctor = run([sys.executable, *check], env=job_env(**AVX2_ONLY), timeout=120)
    errors = [line for line in (refused.stdout + refused.stderr).splitlines() if line.startswith("error:")]
    assert refused.returncode == 1 and len(errors) == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert (
        "no bf16 arithmetic" in errors[0]
        and "--amp-dtype bf16" in errors[0]
        and "train in fp32 with train_ddp_torchrun.py" in errors[0]
    )
    assert "Traceback" not in refused.stderr and not (out / "refused" / "last.pt").exists()
    assert any(line.startswith("warn  CPU bf16: no bf16 arithmetic") for line in doctor.stdout.splitlines()), (
        doctor.stdout
    )
    if dist_utils.cpu_computes_bf16():  # this machine's own CPU computes it: a run made to look like one that cannot
        asked = ok(run_sh("amp", 1, *args, *BF16, "--output-dir", out / "asked", env=job_env(**AVX2_ONLY))).stdout
        native = run([sys.executable, *check], timeout=120)
        assert any(line.startswith("ok    CPU bf16: computed natively") for line in native.stdout.splitlines())
    else:  # it cannot: default_amp asked for bf16 by name, and trained
        asked = (default_amp / "stdout.txt").read_text()
    assert asked.count("warning: this CPU has no bf16 arithmetic") == 1, asked[-2000:]


def test_the_fp16_clip_value_bounds_steps_and_still_learns(default_amp, fsdp_references, tiny_data, tmp_path):
    """tests/gpu/test_gpu.py's fp16 run clips at FP16_CLIP. default_amp clips there too, in bf16 on the CPU, and
    learns (better than the 6 of 17 that guessing one class scores); and the clip acts on these runs' gradients
    (the first steps' norm is 60-80): the fp32 FSDP run clipped at it (the global norm, as one process clips:
    test_fsdp.py) ends elsewhere than the unclipped one (fsdp_references' BatchNorm run)."""
    assert json.loads((default_amp / "results.json").read_text())["best_acc"] > 0.5
    ok(run_sh("fsdp", 2, *DEFAULTS, "--data-path", tiny_data, "--clip-grad", FP16_CLIP, "--output-dir", tmp_path))
    clipped, free = load_model_state(tmp_path / "last.pt"), load_model_state(fsdp_references["bn"] / "last.pt")
    assert any(not torch.equal(clipped[k], free[k]) for k in clipped if clipped[k].is_floating_point())


def test_bench_exits_with_status_1_when_a_gpu_row_crashes(monkeypatch, tmp_path):
    """A GPU row that crashes (a non-zero exit) is listed as crashed and fails the bench; one that does not fit its
    time is only skipped. Here the GPU rows' training runs are stand-ins."""
    import bench

    def train(cmd, threads, timeout, output_dir):
        if "train_ddp_amp.py" in cmd:
            raise RuntimeError("exit 1: Traceback ...")
        if "in-memory-single" in cmd:
            raise RuntimeError(f"timed out after {timeout} s: the limit")
        return {"img_s": 2.0}

    monkeypatch.setattr(bench, "make_jpegs", lambda *args: None)
    monkeypatch.setattr(bench, "in_memory", lambda script, folder: "in-memory-" + script.split("_")[-1][:-3])
    monkeypatch.setattr(bench, "train", train)
    rows = bench.gpu_rows(types.SimpleNamespace(gpu_budget=600), 4, tmp_path)
    assert [line.split(" --")[0] for line in rows["crashed"]] == ["amp 1 (bf16)"] * 2, rows  # --workers 3 and 2
    assert [line.split(" --")[0] for line in rows["skipped"]] == ["limit: train_single.py, data in memory"], rows
    assert [row["img_s"] for row in rows["rows"] if row["row"].startswith("train_single.py")] == [2.0], rows
    monkeypatch.setattr(bench, "gpu_rows", lambda *a: rows)
    monkeypatch.setattr(bench, "torch_sees_cuda", lambda: True)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--gpu-only", "--output-dir", str(tmp_path / "out")])
    assert bench.main() == 1
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["gpu"]["crashed"]
