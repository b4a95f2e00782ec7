"""What holds at scale and breaks only outside tiny tests: BatchNorm statistics at evaluation, restarts across nodes
whose agents disagree, a resume with another world size or batch, nodes that see different files, no launcher."""

import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from support import (
    EXACT,
    REPO,
    assert_resumed_after,
    assert_same_weights,
    finish,
    free_port,
    in_this_process,
    job_env,
    load_model_state,
    ok,
    run,
    start_sh,
    torchrun,
)
import builtin
import utils

TOL = 1e-5  # see test_ddp.py


@pytest.mark.parametrize("mode,name", [("ddp", "alone"), ("ddp", "launch"), ("ddp", "torchrun"), ("amp", "amp")])
def test_logged_accuracy_is_that_of_the_saved_checkpoint(default_ddp, default_amp, evaluations, mode, name):
    """BatchNorm in train mode: every rank must evaluate with the statistics rank 0 saves (DDP syncs them only at the
    start of a training forward). Before the fix the logged figure differed from --test-only on last.pt
    (shared.evaluations: at 1, 2 and 3 processes; amp at 2)."""
    results = utils.json.loads(({"ddp": default_ddp, "amp": default_amp}[mode] / "results.json").read_text())
    evaluated = evaluations[name]
    assert evaluated["val_count"] == results["val_count"] == 17
    assert evaluated["val_acc"] == results["final_acc"]
    assert evaluated["val_loss"] == pytest.approx(results["val_loss"], rel=1e-6)
    assert evaluated["val_confusion"] == results["val_confusion"]
    assert evaluated["val_per_class_acc"] == results["val_per_class_acc"]


def epoch_order(n, seed, epoch):
    """An epoch's shuffled order as DistributedSampler draws it (one permutation, the same for every world size)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


@pytest.mark.parametrize(
    "before,after", [((2, 8), (3, 8)), ((2, 8), (1, 24)), ((3, 4), (2, 8)), ((1, 16), (3, 4)), ((2, 7), (3, 4))]
)
def test_a_resume_continues_at_the_same_sample_whatever_the_world_size(before, after):
    """A checkpoint written after any step of an epoch by W1 processes x batch B1, resumed by W2 processes x batch
    B2 (each a (W, B) pair; B stands for batch x accumulation steps): the position the scripts save and resume
    (utils.Position), and the samples each rank reads from it (utils.EpochSampler over DistributedSampler), against
    the order itself. Each rank's whole remainder is its share of the rest of the order, as long on every rank (else
    one rank would run a batch more than the others: mismatched collectives), so every rank fills each of the steps
    the scripts run, no sample is repeated and none skipped; the global step counts in the second run's batch."""
    dataset, seed = list(range(50)), 3
    order = epoch_order(len(dataset), seed, 0)

    def position(world_size, rank, batch):
        sampler = utils.EpochSampler(
            DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
        )
        steps_per_epoch = len(dataset) // world_size // batch  # as the scripts' drop_last loaders give it
        return utils.Position(sampler, world_size * batch, steps_per_epoch)

    (w1, b1), (w2, b2) = before, after
    usable2 = len(dataset) // w2 * w2  # drop_last: the same count on each rank
    stepped = 0
    for steps_done in range(len(dataset) // w1 // b1):  # a checkpoint after each step of the first run's epoch
        seen = []
        for rank in range(w1):
            first = position(w1, rank, b1)
            first.start_epoch(0)
            keys = list(first.sampler)
            # each key's position is the sample's place in the epoch's order over all ranks (a stream reads that)
            assert all(order[position] == index for _, position, index in keys)
            seen += [index for _, _, index in keys][: steps_done * b1]
            for _ in range(steps_done):
                first.advance()
        saved = first.state_dict()
        assert saved == {"epoch": 0, "samples": steps_done * w1 * b1, "global_batch": w1 * b1}
        assert sorted(seen) == sorted(order[: saved["samples"]])  # the first run trained on a prefix of the order

        resumed = []
        for rank in range(w2):
            second = position(w2, rank, b2)
            second.load_state_dict(saved)
            second.start_epoch(0)
            steps_left = second.steps_per_epoch - second.step
            assert second.global_step == second.step  # epoch 0
            mine = [index for _, _, index in second.sampler]
            rest = order[saved["samples"] : usable2]
            share = rest[(rank - saved["samples"]) % w2 :: w2][: len(rest) // w2]  # as many on every rank
            assert mine == share, (rank, saved)  # the whole remainder: its share of the rest of the order
            assert len(mine) >= steps_left * b2, (rank, len(mine), steps_left)  # enough for every step run
            resumed += mine[: steps_left * b2]
            for _ in range(steps_left):
                second.advance()
            assert second.step == second.steps_per_epoch  # the epoch ends where the scripts' loop ends it
            second.end_epoch()
            assert (second.epoch, second.samples, second.global_step) == (1, 0, second.steps_per_epoch)
        assert sorted(seen + resumed) == sorted(order[: saved["samples"] + steps_left * w2 * b2])  # none twice
        stepped += steps_left > 0
    assert stepped >= 2  # most checkpoints leave steps to run: the comparisons above are not of empty lists


def continue_here(checkpoint_path, data, global_batch, epochs=2, lr=0.1, seed=0, img_size=32):
    """The reference for a resume at another size, computed in this process without the scripts' samplers: the
    checkpoint's head (with --freeze only the head trains, and BatchNorm keeps its statistics) continued by SGD on
    the rest of each epoch's order (epoch_order), global_batch samples a step, as many steps as fit."""
    classes, train, _ = builtin.find_images(data, 0.25)
    dataset = utils.SeededItems(builtin.ImageFiles(train, img_size, train=True), seed)  # as the scripts read it
    checkpoint = torch.load(checkpoint_path, weights_only=True)
    model = builtin.resnet("resnet18", len(classes), freeze=True)
    model.load_state_dict(checkpoint["model"])
    utils.train_except_frozen_batchnorm(model)  # the frozen backbone's BatchNorm in eval mode
    peak = lr * global_batch / 256
    optimizer = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=peak, momentum=0.9, weight_decay=1e-4
    )
    optimizer.load_state_dict(checkpoint["optimizer"])
    steps_per_epoch = len(train) // global_batch
    schedule = utils.warmup_cosine(epochs * steps_per_epoch)
    position = checkpoint["samples"]
    for epoch in range(checkpoint["epoch"], epochs):
        order = epoch_order(len(train), seed, epoch)
        first_step = steps_per_epoch - (len(train) - position) // global_batch
        for step in range(first_step, steps_per_epoch):
            batch = [dataset[(epoch, 0, index)] for index in order[position : position + global_batch]]
            position += global_batch
            images, labels = torch.stack([image for image, _ in batch]), torch.tensor([label for _, label in batch])
            F.cross_entropy(model(utils.normalize(images)), labels).backward()
            for group in optimizer.param_groups:
                group["lr"] = peak * schedule(epoch * steps_per_epoch + step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        position = 0
    return model.state_dict()


def test_resume_at_another_world_size_and_batch_continues_the_same_training(ddp_killed, tiny_data, tmp_path):
    """A checkpoint saved mid-epoch by 2 processes x batch 8 (shared.ddp_killed) continues on 3 processes x batch 8,
    and in one process with batch 24: the same samples from the same point, the LR of the new global batch, and the
    weights this test computes itself from the checkpoint and the shuffled order (continue_here, which does not use
    the scripts' skip of the samples already seen; with --freeze the forward pass of a sample ignores its batch)."""
    saved, checkpoint = ddp_killed
    args = [*EXACT, "--data-path", tiny_data, "-b", "8"]
    three = ok(torchrun(3, "train_ddp_torchrun.py", *args, "--resume", saved, "--output-dir", tmp_path / "three"))
    one = ok(
        run(
            [
                sys.executable,
                "train_single.py",
                *args[:-2],
                *f"-b 24 --resume {saved} --output-dir {tmp_path / 'one'}".split(),
            ]
        )
    )
    for proc in (three, one):
        assert f"epoch 1 after {checkpoint['samples']} of its " in proc.stdout  # 48 samples on 3 ranks, 50 on 1
        assert "samples (at global batch 16)" in proc.stdout
        assert "lr 0.1 x 24/256 = 0.009375" in proc.stdout
        # in steps of 24 (2 an epoch): 16 samples done leave one step of epoch 1, 32 leave none (too few for a step)
        assert assert_resumed_after(proc.stdout)[0] == {16: 2, 32: 3}[checkpoint["samples"]], proc.stdout[-3000:]
        # the first step's LR: the new peak LR, at this step of the new run's schedule (2 steps of 24 an epoch)
        first = next(line for line in proc.stdout.splitlines() if "  step " in line)
        epoch, step = int(first.split("/")[0].split()[-1]), int(first.split("step ")[1].split("/")[0])
        expected = 0.009375 * utils.warmup_cosine(2 * 2)((epoch - 1) * 2 + step - 1)
        assert float(first.split("lr ")[1].split()[0]) == pytest.approx(expected, abs=1e-5), first
    reference = continue_here(saved, tiny_data, global_batch=24)
    saved = checkpoint["model"]
    assert (reference["fc.weight"] - saved["fc.weight"]).abs().max() > 100 * TOL  # the steps left moved the head
    for name in ("three", "one"):
        assert_same_weights(load_model_state(tmp_path / name / "last.pt"), reference, atol=TOL)


def test_ranks_that_see_different_data_stop_with_one_line_per_node(tiny_data, tmp_path):
    """Two nodes with their own copy of the data, one copy missing an image: each node says so, once."""
    other = tmp_path / "other"
    shutil.copytree(tiny_data, other)
    (other / "c1" / "0003.jpg").unlink()
    env = job_env(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RDZV_ID="test-data")
    nodes = [
        start_sh("ddp", 1, *EXACT, "--data-path", data, "-b", "8", "--output-dir", tmp_path / "run", env=env)
        for data in (tiny_data, other)
    ]
    outputs = [finish(node, [], timeout=120) for node in nodes]
    assert all(node.returncode != 0 for node in nodes), outputs
    for output in outputs:
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "sees training_images" in errors[0], output
        assert "49" in errors[0] and "50" in errors[0] and "--data-path" in errors[0], errors
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.parametrize(
    "script,how", [("train_ddp_launch.py", "bash run.sh launch"), ("train_ddp_torchrun.py", "bash run.sh ddp")]
)
def test_a_ddp_script_started_without_a_launcher_says_how_to_start_it(script, how, capfd):
    proc = in_this_process(script, ["--epochs", "1"], capfd)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: start this script with") and how in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_renamed_copy_keeps_its_launcher(tmp_path, capfd):
    """The launch rung copied as my_training.py: still torch.distributed.launch's (its --local-rank says so, not its
    name), and the line names the copy, not a run.sh mode it has none of."""
    copy = tmp_path / "my_training.py"
    shutil.copy(REPO / "train_ddp_launch.py", copy)
    proc = in_this_process(str(copy), ["--epochs", "1"], capfd)
    assert proc.returncode == 1
    assert proc.stderr == (
        "error: start this script with a launcher, which runs one process per device: python -m "
        "torch.distributed.launch --nproc-per-node=N my_training.py\n"
    ), proc.stderr
