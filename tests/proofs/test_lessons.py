"""The gallery of broken lines (docs/lessons.md): for each lesson line of the ladder, its script copied out with that
one line removed or changed (support.broken_copy), run as a user runs it (2 gloo processes under the rung's launcher,
tiny images, the smallest run that shows it), and the symptom a user meets asserted, with the fragment of the output
that shows it (Lesson.printed: docs/lessons.md quotes it, tests/units/test_lessons_listed.py keeps the two in step).
The GPU-only lessons are listed here too and proven in tests/gpu/test_gpu.py. What the scripts do not print (the
sample order) is recorded from outside the copy, by a sitecustomize.py on its PYTHONPATH.

LESSONS_UNBROKEN=1 runs every copy with its line intact: each lesson's test must then fail."""

import json
import os
import signal
import sys
from typing import NamedTuple, Optional

import pytest

from support import (
    EXACT,
    assert_same_weights,
    broken_copy,
    finish,
    job_env,
    load_model_state,
    ranks,
    read_until,
    run,
    run_and_kill_one_worker,
    start,
    torchrun,
)


class Lesson(NamedTuple):
    id: str  # what docs/lessons.md and the ladder's notes link to
    script: str  # the rung whose line it is
    line: str  # the exact text, found once in the script
    changed_to: str  # "": the line removed
    symptom: str  # what a user meets without it, in a line
    printed: Optional[str]  # the fragment of the broken run's output that its test asserts (None: GPU-only)
    test: str  # where its test is, as docs/lessons.md names it


HERE = "tests/proofs/test_lessons.py::"
GPU = "tests/gpu/test_gpu.py::"
LESSONS = [
    Lesson(
        "ranks-not-from-the-launcher",
        "train_ddp_launch.py",
        'rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])',
        "rank, world_size = 0, 1",
        "every process takes itself for rank 0 of 1: each prints every line and scores the whole validation set",
        "(34 samples)",
        HERE + "test_ranks_not_from_the_launcher_make_every_process_rank_0_of_1",
    ),
    Lesson(
        "no-init-process-group",
        "train_ddp_launch.py",
        "dist.init_process_group(",
        "if False: dist.init_process_group(",
        "the first call that needs the process group (the DistributedSampler asking the world size) ends the run",
        "ValueError: Default process group has not been initialized",
        HERE + "test_no_init_process_group_fails_at_the_first_distributed_call",
    ),
    Lesson(
        "no-distributed-sampler",
        "train_ddp_launch.py",
        "train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)",
        "train_sampler = DistributedSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=args.seed, "
        "drop_last=True)",
        "every rank reads the whole set: an epoch has twice its steps, and each sample trains once on each rank",
        "step 9/6",
        HERE + "test_no_distributed_sampler_trains_every_sample_on_every_rank",
    ),
    Lesson(
        "no-set-epoch",
        "train_ddp_launch.py",
        "train_sampler.set_epoch(epoch)  # without it every epoch would repeat the first epoch's order",
        "",
        "every epoch draws the first epoch's sample order again",
        "sample order of rank 0, epoch 2: that of epoch 1",
        HERE + "test_no_set_epoch_repeats_the_first_epochs_order",
    ),
    Lesson(
        "no-val-slice",
        "train_ddp_launch.py",
        "val_slice = Subset(val_set, range(rank, len(val_set), world_size))",
        "val_slice = val_set",
        "every rank scores the whole validation set: each sample counts once per process",
        "(34 samples)",
        HERE + "test_no_val_slice_counts_each_validation_sample_on_every_rank",
    ),
    Lesson(
        "lr-not-scaled",
        "train_ddp_launch.py",
        "lr = args.lr * global_batch / 256",
        "lr = args.lr * args.batch_size / 256",
        "the LR of one process's batch: 2 processes x batch 8 no longer end where one process with batch 16 ends",
        "lr 0.1 x 16/256 = 0.003125",
        HERE + "test_lr_not_scaled_no_longer_equals_one_device",
    ),
    Lesson(
        "save-wrapped-model",
        "train_ddp_launch.py",
        "run.save(model.module, ema, optimizer, position, is_best)",
        "run.save(model, ema, optimizer, position, is_best)",
        "the checkpoint's keys start with module. and a plain model refuses them",
        "the checkpoint's weights do not fit this model",
        HERE + "test_save_wrapped_model_writes_module_keys_that_a_plain_model_refuses",
    ),
    Lesson(
        "no-buffer-broadcast",
        "train_ddp_launch.py",
        "dist.broadcast(buffer, src=0)",
        "pass",
        "each rank evaluates with its own BatchNorm statistics: the logged figures are not those of the saved weights",
        "val loss",
        HERE + "test_no_buffer_broadcast_logs_figures_that_the_saved_checkpoint_does_not_give",
    ),
    Lesson(
        "no-all-reduce",
        "train_ddp_launch.py",
        "dist.all_reduce(total)",
        "pass",
        "rank 0 reports its own slice of the validation set: the metrics change with the number of processes",
        "(9 samples)",
        HERE + "test_no_all_reduce_reports_rank_0s_slice_only",
    ),
    Lesson(
        "no-ddp-wrap",
        "train_ddp_launch.py",
        'model = DDP(model, device_ids=None if device.type == "cpu" else [device.index])',
        'model = torch.nn.DataParallel(model, device_ids=None if device.type == "cpu" else [device.index])',
        "no gradient all-reduce (on a CPU, DataParallel only calls the model): each rank trains its own weights",
        "the processes' weights have drifted apart",
        HERE + "test_no_ddp_wrap_lets_the_ranks_weights_drift_apart",
    ),
    Lesson(
        "no-restart-resume",
        "train_ddp_torchrun.py",
        "run = dist_utils.Run(args, __file__, Metrics, restarts=True)",
        "run = dist_utils.Run(args, __file__, Metrics)",
        "torchrun --max-restarts restarts the group after a worker died, and it starts over in a new folder",
        "epoch 1/1  step 1/3",
        HERE + "test_no_restart_resume_starts_the_restarted_group_over",
    ),
    Lesson(
        "no-stop-vote",
        "train_ddp_torchrun.py",
        "if stop.agreed():  # a vote before each micro-step: every rank stops at the same one, saved below",
        "if stop:  # this rank's own flag",
        "SIGTERM to one node's ranks: they stop alone, the others wait in a collective, and the job dies unsaved",
        "did not all answer within --dist-timeout",
        HERE + "test_no_stop_vote_loses_the_stop_when_one_rank_is_signalled",
    ),
    Lesson(
        "no-no-sync",
        "train_ddp_torchrun.py",
        "with contextlib.nullcontext() if last_micro else model.no_sync():",
        "with contextlib.nullcontext():",
        "--accum-steps 4 all-reduces the gradients on every micro-step: 4 times a step instead of once",
        "collectives per step: 4 allreduce",
        HERE + "test_no_no_sync_all_reduces_on_every_micro_step",
    ),
    Lesson(
        "no-fully-shard-units",
        "train_fsdp.py",
        "for unit in batchnorms + units:",
        "for unit in batchnorms:",
        "the root is the only unit: each step gathers the whole model at once (every rank's peak holds all of it)",
        "collectives per step: 1 allgather, 1 reduce_scatter",
        HERE + "test_no_fully_shard_units_gathers_the_whole_model_at_once",
    ),
    Lesson(
        "no-sharded-save",
        "train_fsdp.py",
        'dcp.save(dict(zip(("model", "optimizer"), get_state_dict(model, optimizer))), checkpoint_id=folder[0])',
        "",
        "no rank writes its shards: the first checkpoint fails on the folder that last.pt would name, and none is left",
        "No such file or directory",
        HERE + "test_no_sharded_save_fails_at_the_first_checkpoint",
    ),
    Lesson(
        "no-set-device",
        "train_ddp_launch.py",
        "torch.accelerator.set_device_index(args.local_rank)",
        "",
        "each process's current GPU stays GPU 0: what uses it (pinned-memory threads, their CUDA context) lands there",
        None,
        GPU + "test_lesson_no_set_device_leaves_every_process_on_gpu_0",
    ),
    Lesson(
        "no-sync-bn",
        "train_ddp_torchrun.py",
        "model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)",
        "pass",
        "--sync-bn normalises over each GPU's batch, not the global one: DDP no longer equals one GPU",
        None,
        GPU + "test_lesson_no_sync_bn_no_longer_equals_one_gpu",
    ),
    Lesson(
        "no-unscale",
        "train_ddp_amp.py",
        "scaler.unscale_(optimizer)",
        "",
        "fp16's clipping sees gradients times the loss scale (2**16): every step shrinks to a 2**16-th",
        None,
        GPU + "test_lesson_no_unscale_clips_the_scaled_gradients",
    ),
    Lesson(
        "no-scaler-state",
        "train_ddp_amp.py",
        "run.add_state(scaler=scaler)  # saved in each checkpoint beside the model's and the optimizer's",
        "",
        "an fp16 resume starts a fresh GradScaler: its scale and growth count are not those of the run it continues",
        None,
        GPU + "test_lesson_no_scaler_state_restarts_the_scaler_on_resume",
    ),
]
LESSON = {lesson.id: lesson for lesson in LESSONS}

# One training step (25 images a rank at batch 16), BatchNorm training, 17 validation images
ONE_STEP = [*"--img-size 32 -b 16 --epochs 1 --workers 0 --print-freq 1 --val-fraction 0.25".split()]
TOL = 1e-5  # W processes x batch B against one process with batch W x B (test_ddp.py)

# The sample order each rank draws, seen from outside the copied scripts: wraps DistributedSampler.__iter__ in every
# process, prints whether each epoch's order is new, and keeps them in LESSON_ORDERS/rank<R>.json.
ORDER_RECORDER = """
import json, os
from torch.utils.data import DistributedSampler

orders = []
draw = DistributedSampler.__iter__


def recorded(self):
    order = list(draw(self))
    orders.append(order)
    rank = os.environ["RANK"]
    again = [epoch for epoch, seen in enumerate(orders[:-1], start=1) if seen == order]
    print(f"sample order of rank {rank}, epoch {len(orders)}: " + (f"that of epoch {again[0]}" if again else "new"))
    with open(os.path.join(os.environ["LESSON_ORDERS"], f"rank{rank}.json"), "w") as f:
        json.dump(orders, f)
    return iter(order)


DistributedSampler.__iter__ = recorded
"""


def broken_run(bare, tmp_path, lesson, *args):
    """The lesson's script, broken, in a copy of its own (tmp_path/copy), started as its rung is: 2 processes under
    torch.distributed.launch (train_ddp_launch.py) or torchrun. (The CompletedProcess, the copy.)"""
    copy = broken_copy(bare, tmp_path / "copy", lesson)
    launcher = "torch.distributed.launch" if lesson.script == "train_ddp_launch.py" else "torch.distributed.run"
    return torchrun(2, lesson.script, *args, cwd=copy, launcher=launcher), copy


def with_order_recorder(bare, tmp_path, lesson, *args):
    """broken_run with ORDER_RECORDER: (the CompletedProcess, {rank: the orders it drew, an epoch each})."""
    copy = broken_copy(bare, tmp_path / "copy", lesson)
    (copy / "sitecustomize.py").write_text(ORDER_RECORDER)
    env = job_env(PYTHONPATH=str(copy), LESSON_ORDERS=str(tmp_path))
    proc = torchrun(2, lesson.script, *args, cwd=copy, env=env, launcher="torch.distributed.launch")
    orders = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    return proc, orders


def evaluated_alone(copy, checkpoint, tiny_data, output_dir):
    """train_single.py --test-only of a checkpoint, in the copy: one process, the plain model."""
    return run(
        [
            sys.executable,
            "train_single.py",
            *f"--test-only --resume {checkpoint} --img-size 32 --val-fraction 0.25 --data-path {tiny_data}".split(),
            *f"--output-dir {output_dir}".split(),
        ],
        cwd=copy,
    )


def profile_report(trace):
    """What tools/profile_report.py prints about a --profile run's trace.json."""
    return run([sys.executable, "tools/profile_report.py", trace], timeout=60).stdout


def test_ranks_not_from_the_launcher_make_every_process_rank_0_of_1(bare, tiny_data, tmp_path):
    """The process group still reads the launcher's environment (2 ranks), but the script's own rank and world size
    say 0 of 1: both processes print as rank 0, and each scores all 17 validation images, which the all-reduce then
    counts twice."""
    lesson = LESSON["ranks-not-from-the-launcher"]
    proc, _ = broken_run(bare, tmp_path, lesson, *ONE_STEP, "--data-path", tiny_data, "--output-dir", tmp_path / "run")
    assert lesson.printed in proc.stdout and proc.stdout.count("epoch 1/1  val loss") == 2, proc.stdout[-3000:]


def test_no_init_process_group_fails_at_the_first_distributed_call(bare, tiny_data, tmp_path):
    lesson = LESSON["no-init-process-group"]
    proc, _ = broken_run(bare, tmp_path, lesson, *ONE_STEP, "--data-path", tiny_data)
    assert proc.returncode != 0 and lesson.printed in proc.stderr, proc.stderr[-3000:]


def test_no_distributed_sampler_trains_every_sample_on_every_rank(bare, tiny_data, tmp_path):
    """Batch 8: 3 steps an epoch, each rank reading half the 50 images. Reading all of them, each rank runs 6 steps;
    the position counts the samples of both ranks, so the steps are numbered 4 to 9 of 6."""
    lesson = LESSON["no-distributed-sampler"]
    args = [*ONE_STEP, "-b", "8", "--data-path", tiny_data, "--output-dir", tmp_path / "run"]
    proc, orders = with_order_recorder(bare, tmp_path, lesson, *args)
    assert proc.returncode == 0 and f"epoch 1/1  {lesson.printed}" in proc.stdout, proc.stdout[-3000:]
    assert orders[0] == orders[1] and sorted(orders[0][0]) == list(range(50)), orders  # both ranks: all of it


def test_no_set_epoch_repeats_the_first_epochs_order(bare, tiny_data, tmp_path):
    lesson = LESSON["no-set-epoch"]
    args = [*ONE_STEP, "--epochs", "2", "--data-path", tiny_data, "--output-dir", tmp_path / "run"]
    proc, orders = with_order_recorder(bare, tmp_path, lesson, *args)
    assert proc.returncode == 0 and lesson.printed in proc.stdout, proc.stdout[-3000:]
    assert orders[0][0] == orders[0][1] and orders[1][0] == orders[1][1]


def test_no_val_slice_counts_each_validation_sample_on_every_rank(bare, tiny_data, tmp_path):
    lesson = LESSON["no-val-slice"]
    proc, _ = broken_run(bare, tmp_path, lesson, *ONE_STEP, "--data-path", tiny_data, "--output-dir", tmp_path / "run")
    assert proc.returncode == 0 and lesson.printed in proc.stdout, proc.stdout[-3000:]  # 17 images, counted twice


def test_lr_not_scaled_no_longer_equals_one_device(bare, tiny_data, exact_single, tmp_path):
    """EXACT (--freeze): 2 processes x batch 8 end within TOL of one process with batch 16 (shared.exact_single) with
    the LR of the global batch 16 (test_ddp.py); with that of batch 8, they do not."""
    lesson = LESSON["lr-not-scaled"]
    args = [*EXACT, "-b", "8", "--data-path", tiny_data, "--output-dir", tmp_path / "run"]
    proc, _ = broken_run(bare, tmp_path, lesson, *args)
    assert proc.returncode == 0 and lesson.printed in proc.stdout, proc.stdout[-3000:]
    with pytest.raises(AssertionError, match="weights differ"):
        assert_same_weights(
            load_model_state(tmp_path / "run" / "last.pt"), load_model_state(exact_single / "last.pt"), TOL
        )


def test_save_wrapped_model_writes_module_keys_that_a_plain_model_refuses(bare, tiny_data, tmp_path):
    """The checkpoint of the DDP wrapper, evaluated by train_single.py (one process, the plain model)."""
    lesson = LESSON["save-wrapped-model"]
    proc, copy = broken_run(
        bare, tmp_path, lesson, *ONE_STEP, "--data-path", tiny_data, "--output-dir", tmp_path / "run"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(key.startswith("module.") for key in load_model_state(tmp_path / "run" / "last.pt"))
    evaluated = evaluated_alone(copy, tmp_path / "run" / "last.pt", tiny_data, tmp_path / "test")
    assert evaluated.returncode == 1 and lesson.printed in evaluated.stderr, evaluated.stderr[-3000:]


def test_no_buffer_broadcast_logs_figures_that_the_saved_checkpoint_does_not_give(bare, tiny_data, tmp_path):
    """BatchNorm training: each rank's statistics are those of its own last batch, and rank 0's are saved. The figures
    the run logged differ from those of its last.pt evaluated by train_single.py --test-only (which equals DDP's
    evaluation of it: test_scale.py's test_logged_accuracy_is_that_of_the_saved_checkpoint)."""
    lesson = LESSON["no-buffer-broadcast"]
    proc, copy = broken_run(
        bare, tmp_path, lesson, *ONE_STEP, "--data-path", tiny_data, "--output-dir", tmp_path / "run"
    )
    evaluated = evaluated_alone(copy, tmp_path / "run" / "last.pt", tiny_data, tmp_path / "test")
    assert proc.returncode == evaluated.returncode == 0, (proc.stderr[-3000:], evaluated.stderr[-3000:])
    assert lesson.printed in proc.stdout and lesson.printed in evaluated.stdout
    logged, tested = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("run", "test"))
    assert logged["val_count"] == tested["val_count"] == 17
    assert logged["val_loss"] != pytest.approx(tested["val_loss"], rel=1e-6), (logged["val_loss"], tested["val_loss"])


def test_no_all_reduce_reports_rank_0s_slice_only(bare, tiny_data, tmp_path):
    lesson = LESSON["no-all-reduce"]
    proc, _ = broken_run(bare, tmp_path, lesson, *ONE_STEP, "--data-path", tiny_data, "--output-dir", tmp_path / "run")
    assert proc.returncode == 0 and lesson.printed in proc.stdout, proc.stdout[-3000:]  # of 17


def test_no_ddp_wrap_lets_the_ranks_weights_drift_apart(bare, tiny_data, tmp_path):
    """Found by dist_utils.check_replicas() at the first evaluation, after one step."""
    lesson = LESSON["no-ddp-wrap"]
    proc, _ = broken_run(bare, tmp_path, lesson, *ONE_STEP, "--data-path", tiny_data, "--output-dir", tmp_path / "run")
    assert proc.returncode != 0 and f"error: {lesson.printed}" in proc.stderr, proc.stderr[-3000:]


def test_no_restart_resume_starts_the_restarted_group_over(bare, tiny_data, tmp_path):
    """torchrun --max-restarts=1 as the script's docstring starts it (no --output-dir), a worker SIGKILLed once step 2
    of 3 is logged (--save-every 1: a checkpoint to resume is there). The restarted group trains again from step 1,
    in a new folder of runs/, instead of resuming the job's own last.pt."""
    lesson = LESSON["no-restart-resume"]
    copy = broken_copy(bare, tmp_path / "copy", lesson)
    args = [*ONE_STEP, "-b", "8", "--save-every", "1", "--data-path", tiny_data]
    output, code, killed = run_and_kill_one_worker(copy, lesson.script, args, "epoch 1/1  step 2/3", victim=-1)
    assert killed and code == 0, output[-3000:]
    assert output.count(lesson.printed) == 2 and "resuming from" not in output, output[-3000:]
    assert len(list((copy / "runs").iterdir())) == 2


def test_no_stop_vote_loses_the_stop_when_one_rank_is_signalled(bare, tiny_data, tmp_path):
    """SIGTERM to rank 1 alone (one node of a job preempted) after step 1 of 6. With the vote every rank stops after
    the same step and rank 0 saves there (test_preemption.py); without it rank 1 stops alone and evaluates while rank
    0 waits in its next step's all-reduce, until --dist-timeout (10 s here) ends the job: no checkpoint. (Had the
    signal come after rank 1's last step, the vote after the evaluation, which the copy keeps, would stop both: 6
    steps leave the test 4 to send it in.)"""
    lesson = LESSON["no-stop-vote"]
    copy = broken_copy(bare, tmp_path / "copy", lesson)
    args = [*ONE_STEP, "-b", "4", "--dist-timeout", "10", "--data-path", tiny_data]
    job = start(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", lesson.script, *args]
        + ["--output-dir", tmp_path / "run"],
        cwd=copy,
        timeout=120,
    )
    lines = []
    signalled = read_until(job, lines, "epoch 1/1  step 1/6")
    if signalled:
        os.kill(ranks(job)[1], signal.SIGTERM)
    output = finish(job, lines, timeout=90)
    assert signalled and job.returncode != 0 and lesson.printed in output, output[-3000:]
    assert "stopped by" not in output and not (tmp_path / "run" / "last.pt").exists(), output[-3000:]


def test_no_no_sync_all_reduces_on_every_micro_step(bare, tiny_data, tmp_path):
    """EXACT (--freeze: one gradient bucket), batch 1 x 4 micro-steps: 6 steps, 4 and 5 profiled. With no_sync() the
    gradients are all-reduced once a step (test_ddp.py's accumulation test)."""
    lesson = LESSON["no-no-sync"]
    args = [*EXACT, *"-b 1 --accum-steps 4 --epochs 1 --profile 2 --print-freq 10".split(), "--data-path", tiny_data]
    proc, _ = broken_run(bare, tmp_path, lesson, *args, "--output-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = profile_report(tmp_path / "run" / "trace.json")
    assert lesson.printed in report, report


def test_no_fully_shard_units_gathers_the_whole_model_at_once(bare, tiny_data, tmp_path):
    """BatchNorm training, 2 x batch 4: 6 steps, 4 and 5 profiled. Each residual block a unit: 17 all-gathers and 9
    reduce-scatters a step (test_fsdp.py's ZeRO test), the largest gathered at once a block; the root alone: one
    each, the whole model gathered at once. The shards at rest are as small: half the parameters' bytes a rank."""
    import builtin  # (here: tests/units loads this module for its LESSONS alone, without torchvision)

    lesson = LESSON["no-fully-shard-units"]
    args = [*ONE_STEP, *"-b 4 --profile 2 --print-freq 10".split(), "--data-path", tiny_data]
    proc, _ = broken_run(bare, tmp_path, lesson, *args, "--output-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = profile_report(tmp_path / "run" / "trace.json")
    assert lesson.printed in report, report
    sharded = json.loads((tmp_path / "run" / "results.json").read_text())["bytes_per_rank"]["params"]
    assert sharded == pytest.approx(2 * sum(p.numel() for p in builtin.resnet("resnet18", 3).parameters()), rel=0.01)


def test_no_sharded_save_fails_at_the_first_checkpoint(bare, tiny_data, tmp_path):
    lesson = LESSON["no-sharded-save"]
    proc, _ = broken_run(bare, tmp_path, lesson, *ONE_STEP, "--data-path", tiny_data, "--output-dir", tmp_path / "run")
    failure = [line for line in proc.stderr.splitlines() if lesson.printed in line]
    assert proc.returncode != 0 and failure and failure[0].endswith(".dcp'"), proc.stderr[-3000:]
    assert not (tmp_path / "run" / "last.pt").exists()
