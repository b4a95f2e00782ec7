"""train_fsdp.py (FSDP2, fully_shard) proven on CPU with real torchrun processes over gloo.

Most runs use a folder holding only the scripts and their helpers (the copy-out case, shared.bare). As in test_ddp.py,
--freeze makes W processes x batch B equal to one process with batch W x B: tolerance 1e-5.
"""

import json
import re
import shutil
import signal
import sys

import pytest
import torch
import torchvision

import utils
from support import (
    DEFAULTS,
    EXACT,
    REPO,
    assert_resumed_after,
    assert_same_weights,
    checkpoint_step,
    collectives_per_step,
    deliver,
    finish,
    load_model_state,
    ok,
    read_until,
    run_sh,
    start,
    start_sh,
    torchrun,
)
from support import copy_while_paused


TOL = 1e-5  # see test_ddp.py
COMMON = EXACT


def fsdp(cwd, nproc, *args, timeout=150):
    return torchrun(nproc, "train_fsdp.py", *args, cwd=cwd, timeout=timeout)


def results(folder):
    return json.loads((folder / "results.json").read_text())


@pytest.fixture(scope="module")
def references(fsdp_references):
    """The module's two uninterrupted runs (shared.fsdp_references): FSDP with 2 processes x batch 8 and
    --freeze, and bash run.sh fsdp 2 with default --workers and BatchNorm training."""
    return fsdp_references


@pytest.fixture(scope="module")
def runs(references, exact_single):
    """The --freeze references: one process with batch 16 (shared.exact_single), and FSDP with 2 processes x 8."""
    return {"dir": references["dir"], "fsdp": references["fsdp"], "single": exact_single}


@pytest.mark.quick
def test_fsdp_equals_single_process_and_saves_a_plain_torchvision_model(runs):
    out = runs["dir"]
    assert "global batch 16 = 8 per process x 2 processes" in runs["fsdp"]
    assert runs["fsdp"].count("epoch 2/2  step 3/3") == 1  # only global rank 0 prints
    single = runs["single"]
    assert_same_weights(load_model_state(out / "fsdp" / "last.pt"), load_model_state(single / "last.pt"), atol=TOL)
    assert results(out / "fsdp")["final_acc"] == pytest.approx(results(single)["final_acc"])
    assert results(out / "fsdp")["val_confusion"] == results(single)["val_confusion"]
    # The layout: plain last.pt and best.pt, and one sharded folder, the one last.pt names; nothing half-written
    for name in ("last.pt", "best.pt"):
        torchvision.models.resnet18(num_classes=3).load_state_dict(load_model_state(out / "fsdp" / name))
    checkpoint = torch.load(out / "fsdp" / "last.pt", weights_only=True)
    assert sorted(p.name for p in (out / "fsdp").iterdir() if "dcp" in p.name) == [checkpoint["optimizer"]]
    assert checkpoint["optimizer"].startswith("last-step6-") and (checkpoint["epoch"], checkpoint["samples"]) == (2, 0)


def test_resume_from_another_scripts_checkpoint_says_what_to_use(exact_single, tiny_data, bare, tmp_path):
    """train_single.py's last.pt holds the optimizer state itself, no sharded folder: one line, no worker traceback."""
    proc = fsdp(
        bare,
        1,
        *COMMON,
        *f"--data-path {tiny_data} --resume {exact_single / 'last.pt'} --output-dir {tmp_path / 'another'}".split(),
    )
    assert proc.returncode != 0
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no sharded state beside it; use a last.pt, or --weights" in errors[0], errors
    assert proc.stderr.count("Traceback") == 1  # torchrun's own report of the failed worker, none from the worker


def test_accumulation_reduce_scatters_on_the_last_micro_step_only(tiny_data, bare, tmp_path):
    """2 x batch 2 x 2 micro-steps == 2 x batch 4: the same weights, and as many reduce-scatters per optimizer step,
    not twice as many; with --freeze only the root module (the head) has gradients: one a step. Counted from the
    trace by tools/profile_report.py (see test_ddp.py's accumulation test); the all-gathers double (two forwards)."""
    plain_dir, accum_dir = tmp_path / "plain", tmp_path / "accum"
    for folder, batch, accum in ((plain_dir, 4, 1), (accum_dir, 2, 2)):
        ok(
            fsdp(
                bare,
                2,
                *COMMON,
                *f"--data-path {tiny_data} -b {batch} --accum-steps {accum} --print-freq 10 --profile 2".split(),
                *f"--output-dir {folder}".split(),
            )
        )
    assert_same_weights(load_model_state(accum_dir / "last.pt"), load_model_state(plain_dir / "last.pt"), atol=TOL)
    plain, accum = (collectives_per_step(folder / "trace.json") for folder in (plain_dir, accum_dir))
    assert accum["reduce_scatter"] == plain["reduce_scatter"] == 1, (plain, accum)
    assert accum["allgather"] == 2 * plain["allgather"] > 0, (plain, accum)


@pytest.fixture(scope="module")
def trained_bn(references):
    """What a user runs: bash run.sh fsdp 2 with default --workers and BatchNorm training (no --freeze)."""
    return references["bn"]


def test_no_warning_of_a_deprecated_or_unclosed_thing(references):
    """bash run.sh fsdp 2 (DCP, DTensor, device meshes, the process group's teardown) with every warning shown: none
    (test_single.py's test says why)."""
    warned = [line for line in references["bn_stderr"].splitlines() if re.search(r"\w+Warning\b", line)]
    assert not warned, warned
    assert (references["bn"] / "results.json").is_file()  # it ran to the end (the fixture also checks its exit)


def test_evaluation_is_exact_for_any_world_size_and_logs_the_saved_checkpoints_figures(
    trained_bn, tiny_data, bare, tmp_path
):
    """17 validation images over 1, 2 and 3 processes: ranks with one batch fewer run an empty forward pass (FSDP
    all-gathers in every forward), and every image is counted once. And the buffer trap: FSDP leaves each rank's
    BatchNorm statistics its own; evaluated and saved with rank 0's, what bash run.sh fsdp 2 logged at its end
    (batch 8: 9 and 8 images, 2 and 1 batches) is what --test-only measures on its last.pt at 1 and 3 processes
    (batch 4: 2, 2 and 2 batches of 6, 6 and 5)."""
    common = [
        *f"--test-only --resume {trained_bn / 'last.pt'} --data-path {tiny_data} --img-size 32".split(),
        *"--val-fraction 0.25 --workers 0 -b 4".split(),
    ]
    for nproc in (1, 3):
        ok(fsdp(bare, nproc, *common, "--output-dir", tmp_path / str(nproc)))
    logged = results(trained_bn)
    assert logged["val_count"] == 17
    for nproc in (1, 3):
        evaluated = results(tmp_path / str(nproc))
        assert evaluated["val_count"] == 17 and evaluated["val_acc"] == logged["final_acc"], (nproc, evaluated)
        assert evaluated["val_loss"] == pytest.approx(logged["val_loss"], rel=1e-6), nproc
        assert evaluated["val_confusion"] == logged["val_confusion"], nproc


def test_sigterm_saves_every_shard_and_resume_auto_ends_with_uninterrupted_weights(trained_bn, tiny_data, tmp_path):
    args = ["fsdp", 2, *DEFAULTS, "--data-path", tiny_data, "--output-dir", tmp_path / "run"]
    job, lines = start_sh(*args), []
    if read_until(job, lines, "epoch 1/2  step 1/3"):
        deliver(job, "agent", signal.SIGTERM)
    output = finish(job, lines, timeout=60)
    assert job.returncode == 143, output[-3000:]
    stops = [line for line in output.splitlines() if line.startswith("stopped by SIGTERM after step ")]
    assert len(stops) == 1, output[-3000:]
    assert not (tmp_path / "run" / "results.json").exists()
    resumed = ok(run_sh(*args, "--resume", "auto"))
    assert_resumed_after(resumed.stdout, step=int(stops[0].split("after step ")[1].split(":")[0]))
    assert_same_weights(load_model_state(tmp_path / "run" / "last.pt"), load_model_state(trained_bn / "last.pt"))


def test_memory_per_rank_shrinks_as_one_over_the_processes(trained_bn, tiny_data, tmp_path):
    """Parameters, gradients and optimizer state held by rank 0, summed over its local shards after the first step
    (BatchNorm training: every parameter has a gradient and a momentum buffer), at 2 processes (trained_bn) and 3
    (one epoch here), against the whole model's float32 bytes."""
    ok(
        fsdp(
            REPO,
            3,
            *"--img-size 32 -b 8 --epochs 1 --workers 0 --print-freq 1 --val-fraction 0.25".split(),
            *f"--data-path {tiny_data} --output-dir {tmp_path / '3'}".split(),
        )
    )
    per_rank = {2: results(trained_bn)["bytes_per_rank"], 3: results(tmp_path / "3")["bytes_per_rank"]}
    size = 4 * sum(p.numel() for p in torchvision.models.resnet18(num_classes=3).parameters())
    whole = {"params": size, "grads": size, "optimizer": size}
    for nproc, figures in per_rank.items():
        assert set(figures) == set(whole), figures
        for name, size in figures.items():
            # rank 0's shard: a dim-0 chunk, rounded up (64 rows on 3 ranks: 22, 22, 20)
            assert whole[name] / nproc <= size <= 1.1 * whole[name] / nproc, (nproc, name, size, whole[name])
    print(
        {
            nproc: {name: f"{size / 2**20:.1f} MiB" for name, size in figures.items()}
            for nproc, figures in sorted(per_rank.items())
        }
    )


# --------------------------------------------------------------------------- mixed precision, ZeRO-2, HSDP, clipping
def zero(stage, tiny_data, folder):
    """ZeRO-3 or -2, profiled: BatchNorm training, batch 4, steps 4 and 5 of 6 in the trace."""
    ok(
        fsdp(
            REPO,
            2,
            *DEFAULTS,
            *f"-b 4 --workers 0 --print-freq 10 --profile 2 --data-path {tiny_data}".split(),
            {3: "--reshard-after-forward", 2: "--no-reshard-after-forward"}[stage],
            "--output-dir",
            folder,
        )
    )


def bf16_with_a_dtype_hook(tiny_data, out):
    """bash run.sh fsdp 2 --amp-dtype bf16 in a copy of the script whose hook prints the dtypes each BatchNorm and
    convolution met: (the process, those (layer, input, weight, output) dtypes)."""
    copy = out / "copy"
    copy.mkdir()
    for name in ("utils.py", "guards.py", "reporting.py", "dist_utils.py", "fsdp_utils.py", "builtin.py"):
        shutil.copy(REPO / name, copy)
    hook = (
        "    seen = set()  # (test) the dtypes each layer type meets\n"
        "    for m in model.modules():\n"
        "        if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.Conv2d)):\n"
        "            m.register_forward_hook(lambda m, i, o: seen.add((type(m).__name__, str(i[0].dtype), "
        "str(m.weight.dtype), str(o.dtype))))\n"
        "    __import__('atexit').register(lambda: print('dtypes', sorted(seen)) if rank == 0 else None)\n"
    )
    text = (REPO / "train_fsdp.py").read_text()
    anchor = "        fully_shard(module, mesh=mesh, mp_policy=policy)\n"  # the sharding loop's last line
    assert text.count(anchor) == 1
    (copy / "train_fsdp.py").write_text(text.replace(anchor, anchor + hook))
    proc = ok(fsdp(copy, 2, *DEFAULTS, "--data-path", tiny_data, "--amp-dtype", "bf16", "--output-dir", out / "bf16"))
    return eval(next(line for line in proc.stdout.splitlines() if line.startswith("dtypes "))[7:])


def test_bf16_keeps_batchnorm_in_fp32_and_learns_like_the_amp_rung(default_amp, tiny_data, tmp_path):
    """--amp-dtype bf16 (FSDP's MixedPrecisionPolicy), BatchNorm training, default workers: a hook in a copy of the
    script sees every BatchNorm take fp32 inputs with fp32 weights and hand bf16 to the next layer, while the
    convolutions compute in bf16; the run learns as the amp rung's bf16 DDP does on the same settings."""
    seen = bf16_with_a_dtype_hook(tiny_data, tmp_path)
    assert {d[1:] for d in seen if d[0].endswith("BatchNorm2d")} == {  # (FSDPBatchNorm2d once sharded on its own)
        ("torch.float32", "torch.float32", "torch.bfloat16")
    }, seen
    assert {d[1:3] for d in seen if d[0] == "Conv2d"} == {("torch.bfloat16", "torch.bfloat16")}, seen
    out = tmp_path
    state = load_model_state(out / "bf16" / "last.pt")
    assert state["bn1.weight"].dtype == state["bn1.running_var"].dtype == torch.float32
    bf16, amp = results(out / "bf16"), results(default_amp)
    assert bf16["best_acc"] > 0.5 and amp["best_acc"] > 0.5, (bf16, amp)  # chance: 6 of 17


def test_zero2_and_zero3_end_equal_with_the_all_gathers_the_docs_say(tiny_data, tmp_path):
    """ZeRO-3 (the default) gathers each residual block's weights for its forward and again for its backward: 8
    blocks x 2 + the root's once (the root is not resharded) = 17 all-gathers a step; ZeRO-2
    (--no-reshard-after-forward) keeps them gathered: 9. The same arithmetic, so bitwise the same weights. BatchNorm
    training (every block has gradients), 6 steps an epoch, steps 4 and 5 profiled."""
    out = tmp_path
    zero(3, tiny_data, out / "zero3")
    zero(2, tiny_data, out / "zero2")
    counts = {name: collectives_per_step(out / name / "trace.json") for name in ("zero3", "zero2")}
    assert counts["zero3"]["allgather"] == 17 and counts["zero2"]["allgather"] == 9, counts
    assert counts["zero3"]["reduce_scatter"] == counts["zero2"]["reduce_scatter"] == 9, counts
    assert_same_weights(load_model_state(out / "zero2" / "last.pt"), load_model_state(out / "zero3" / "last.pt"))
    assert results(out / "zero2")["bytes_per_rank"] == results(out / "zero3")["bytes_per_rank"]


def test_hsdp_equals_one_device_and_its_checkpoint_resumes_at_other_mesh_shapes(runs, tiny_data, bare, tmp_path):
    """--hsdp 2 on 4 processes: 2 replicas, each sharded over 2 (a 2-D mesh), batch 4 each: the weights of one
    process with batch 16 and of FSDP 2 x 8 within TOL (the gradients reduced in another order). Its mid-epoch
    checkpoint (--save-every 1), as a SIGKILL would leave it (copied while every process of the job is paused: the
    same run is the uninterrupted one), continues at HSDP 2 x 2 to the run's own weights bit for bit, and at FSDP 3
    from the same sample, with the LR of its global batch."""
    args = [*COMMON, "--data-path", tiny_data, "-b", "4"]  # (the resumes save at epoch ends only: sooner done)
    job, lines = (
        start(
            [
                sys.executable,
                *"-m torch.distributed.run --standalone --nproc-per-node=4 train_fsdp.py".split(),
                *args,
                *f"--save-every 1 --hsdp 2 --output-dir {tmp_path / 'whole'}".split(),
            ],
            cwd=bare,
            timeout=200,
        ),
        [],
    )
    paused = read_until(job, lines, "epoch 2/2  step 1/3")  # step 3 saved by now, step 4 perhaps
    if paused:
        checkpoint = copy_while_paused(job, tmp_path / "whole", tmp_path / "copied")
    output = finish(job, lines, timeout=120)
    assert paused and job.returncode == 0, output[-3000:]
    assert "global batch 16 = 4 per process x 4 processes" in output
    sharded = results(tmp_path / "whole")["bytes_per_rank"]["params"]  # over 2 processes, not 4
    assert sharded == pytest.approx(
        2 * sum(p.numel() for p in torchvision.models.resnet18(num_classes=3).parameters()), rel=0.01
    ), sharded
    whole = load_model_state(tmp_path / "whole" / "last.pt")
    for reference in (runs["single"], runs["dir"] / "fsdp"):
        assert_same_weights(whole, load_model_state(reference / "last.pt"), atol=TOL)
    assert (checkpoint["epoch"], checkpoint["samples"]) in ((1, 0), (1, 16)), checkpoint["samples"]
    shutil.copytree(tmp_path / "copied", tmp_path / "saved")
    again = ok(
        fsdp(bare, 4, *args, "--hsdp", "2", "--resume", "auto", "--output-dir", tmp_path / "copied", timeout=200)
    )
    assert_resumed_after(again.stdout, step=checkpoint_step(checkpoint, 3))
    assert_same_weights(load_model_state(tmp_path / "copied" / "last.pt"), whole)
    # at FSDP 3 x 4 (the 2-D mesh's shards redistributed over a 1-D one): the same sample, with the LR of global
    # batch 12 at this step of the new run's schedule (4 steps an epoch)
    three = ok(
        fsdp(
            bare, 3, *args, "--resume", tmp_path / "saved" / "last.pt", "--output-dir", tmp_path / "three", timeout=200
        )
    )
    assert f"epoch 2 after {checkpoint['samples']} of its 48 samples (at global batch 16)" in three.stdout
    assert "lr 0.1 x 12/256 = 0.0046875" in three.stdout
    # 0 samples of epoch 2 done leave its 4 steps of 12, 16 leave 2 (its steps 3 and 4)
    assert assert_resumed_after(three.stdout)[0] == {0: 5, 16: 7}[checkpoint["samples"]], three.stdout[-3000:]
    first = next(line for line in three.stdout.splitlines() if "  step " in line)  # as in test_scale.py
    epoch, step = int(first.split("/")[0].split()[-1]), int(first.split("step ")[1].split("/")[0])
    expected = 0.0046875 * utils.warmup_cosine(2 * 4)((epoch - 1) * 4 + step - 1)
    assert float(first.split("lr ")[1].split()[0]) == pytest.approx(expected, abs=1e-5), first


def test_clip_grad_clips_the_global_norm_of_the_shards(runs, tiny_data, bare, tmp_path):
    """--clip-grad on the DTensor gradients: 4 x batch 4 (each rank another shard of the head; the 3-class head has
    no row for the fourth rank: an empty shard, as 8 GPUs give a 7-class head) and 1 x batch 16 (the whole head on
    one rank) end equal within TOL, so the norm clipped is the whole gradient's, not a shard's; and
    away from the unclipped 2 x 8 run, so the clip acted. (--freeze: only the head trains, BatchNorm fixed.)"""
    for nproc, batch, name in ((4, "4", "four"), (1, "16", "one")):
        ok(
            fsdp(
                bare,
                nproc,
                *COMMON,
                *f"--data-path {tiny_data} --clip-grad 0.01 -b {batch} --output-dir {tmp_path / name}".split(),
                timeout=200,
            )
        )
    one, four = (load_model_state(tmp_path / name / "last.pt") for name in ("one", "four"))
    assert_same_weights(one, four, atol=TOL)
    free = load_model_state(runs["dir"] / "fsdp" / "last.pt")
    assert (four["fc.weight"] - free["fc.weight"]).abs().max() > 100 * TOL
