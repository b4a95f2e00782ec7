"""utils.py's checks and messages, called in this process: what needs no training process of its own (argument
checks, a dataset's items, normalisation, checkpoint files, the sharded reader, the run folder's lock, the lines
that known failures end with). The scripts reach each of these by the same call; the jobs of the other modules show
that they do."""

import argparse
import inspect
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
import zipfile
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torchvision
from PIL import Image
from torch.distributed.checkpoint.state_dict import get_state_dict

import builtin
import dist_utils
import fsdp_utils
import train_single  # its task block: the default loss, optimizer and target check
import guards
import reporting
import utils
from support import logger, make_dataset


# ------------------------------------------------------------------------------ what a copier of a rung pays for
HELPERS_ALONE = r"""
import sys
import time
sys.path.insert(0, sys.argv[1])
sys.modules["torchvision"] = None  # not installed: a copy with its own task needs none (builtin.py does)
sys.modules["torch.distributed.checkpoint"] = None  # FSDP's checkpoints (fsdp_utils.py)
import utils
import guards
import reporting
import dist_utils
print("imported")
"""


def test_a_copier_pays_only_for_the_helpers_of_its_rung():
    """utils.py, guards.py and reporting.py (all that train_single.py and train_dp.py import) and dist_utils.py (what
    the DDP rungs add) import without torchvision and without FSDP's checkpoint machinery, and none of the three
    uses anything of torch.distributed (but utils.leaves_nothing_behind, which ends a process group that main() left),
    nor recognises DDP's or FSDP's errors (dist_utils.py and fsdp_utils.py do)."""
    proc = subprocess.run(
        [sys.executable, "-c", HELPERS_ALONE, str(Path(utils.__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.stdout == "imported\n", proc.stderr[-2000:]
    for module in (utils, guards, reporting):
        source = Path(module.__file__).read_text().replace(inspect.getsource(utils.leaves_nothing_behind), "")
        assert "torch.distributed" not in source and "import dist" not in source, module
        for words in ("Expected to have finished reduction", "unexpected pos", "Missing key in checkpoint state_dict"):
            assert words not in source, (module, words)


# --------------------------------------------------------------------------------------------- arguments
def parse(*args):
    """Every rung's flags, as the scripts add them."""
    parser = utils.get_args_parser("test")
    builtin.add_arguments(parser)
    for flag, kind in (("--accum-steps", int), ("--dist-timeout", int), ("--hsdp", int)):
        parser.add_argument(flag, type=kind)
    return utils.check_args(parser.parse_args(list(args)))


@pytest.mark.parametrize(
    "args,words",
    [
        (["--lr", "-1"], "--lr must be positive, got -1.0"),
        (["--lr", "0"], "--lr must be positive, got 0.0"),
        (["--lr", "nan"], "--lr must be positive, got nan"),
        (["--clip-grad", "-1"], "--clip-grad must be 0 or more, got -1.0"),
        (["--clip-grad", "inf"], "--clip-grad must be 0 or more, got inf"),
        (["--seed", "-3"], "--seed must be 0 or more, got -3"),
        (["--seed", str(2**64)], "--seed must be below 2**62"),
        (["--hsdp", "-2"], "--hsdp must be 0 or more, got -2"),
        (["--dist-timeout", "0"], "--dist-timeout must be positive, got 0"),
        (["--accum-steps", "0"], "--accum-steps must be positive, got 0"),
        (["--save-every", "-1"], "--save-every must be 0 or more, got -1"),
        (["--profile", "-1"], "--profile must be 0 or more, got -1"),
        (["--workers", "-1"], "--workers must be 0 or more, got -1"),
        (["--print-freq", "0"], "--print-freq must be positive, got 0"),
        (["--img-size", "-32"], "--img-size must be positive, got -32"),
        # past what float32 or a timedelta holds (issue 69: a traceback each, from the optimizer or the process group)
        (["--lr", "1e300"], "--lr 1e+300 is past what training can use: give at most 1e+30"),
        (["--dist-timeout", str(10**14)], "--dist-timeout 1e+14 is past what training can use: give at most 1e+09"),
    ],
)
def test_every_numeric_flag_is_checked_by_name(args, words):
    with pytest.raises(guards.UsageError, match=None) as refused:
        parse(*args)
    assert words in str(refused.value)


def test_a_cpu_index_an_image_too_large_and_a_folder_name_too_long_are_one_line_each():
    """Issue 69: --device cpu:1 initialised CUDA (a traceback on a machine without it), --img-size 100000 asked for
    30 GB in one image's resize, and a 300-character --output-dir raised from pathlib: each a line now."""
    with pytest.raises(guards.UsageError, match=r"^--device cpu:1: the CPU is one device; use --device cpu$"):
        guards.choose_device("cpu:1", None, 0, 0)
    assert guards.choose_device("cpu:0", None, 0, 0).type == "cpu"
    with pytest.raises(guards.UsageError, match=r"^--img-size 100000: a batch of 32 such images takes \d+ GiB, more"):
        builtin.datasets(parse("--img-size", "100000"))
    with pytest.raises(
        guards.UsageError, match=r"^--output-dir x{80}\.\.\.: File name too long; choose another folder$"
    ):
        guards.resolve_run(parse("--output-dir", "x" * 300), "train_single.py")


def test_sensible_numbers_pass():
    args = parse("--lr", "0.01", "--clip-grad", "0", "--seed", "7", "--hsdp", "0", "--workers", "0")
    assert (args.lr, args.clip_grad, args.seed, args.epochs, args.img_size) == (0.01, 0.0, 7, 12, None)
    assert (parse().lr, parse().weight_decay) == (0.1, 1e-4)  # SGD's, as torchvision's classification recipe
    assert (parse("--opt", "adamw").lr, parse("--opt", "adamw").weight_decay) == (5e-4, 0.05)
    bare = utils.get_args_parser("a copy whose task has flags of its own")
    assert utils.check_args(bare.parse_args([])).epochs == 30  # the built-in task's 12 leave with builtin.py


@pytest.mark.parametrize(
    "args,epochs",
    [
        ([], 12),  # the demo's textures
        (["--data-path", "photos"], 30),  # a folder of photos: 98.3 % after 30 epochs, 95.0 % after 12 (docs/data.md)
        (["--data-path", "photos", "--epochs", "5"], 5),
        (["--epochs", "5", "--data-path", "photos"], 5),
        (["--epochs", "12", "--data-path", "photos"], 12),  # given, even where it is the demo's number
    ],
)
def test_epochs_default_to_the_demos_12_and_a_folders_30(args, epochs):
    """The built-in task's default epochs: 12 on the demo data, 30 for a folder given with --data-path (a change to
    either shows here), and --epochs wins, given before or after --data-path; a plain int in the checkpoint's args."""
    parsed = parse(*args)
    assert parsed.epochs == epochs and type(parsed.epochs) is int


# ------------------------------------------------------------------------------------ the device and backend
@pytest.mark.parametrize(
    "requested,accelerator,count,processes,expected",
    [
        (None, None, 0, 0, "cpu"),
        (None, "cuda", 4, 0, "cuda"),
        (None, "xpu", 2, 0, "xpu"),
        (None, "mps", 1, 0, "mps"),
        ("cuda:1", "cuda", 2, 0, "cuda:1"),
        ("cpu", "cuda", 4, 0, "cpu"),  # one process: any device it names
        (None, "cuda", 4, 4, "cuda"),
        (None, "xpu", 2, 2, "xpu"),  # a launcher: the rung takes its local rank's index
        (None, "mps", 1, 2, "cpu"),  # Apple's GPU has no backend between processes: they meet on the CPU
        (None, None, 0, 2, "cpu"),
    ],
)
def test_the_device_for_each_accelerator(requested, accelerator, count, processes, expected, capsys):
    """What a machine with CUDA (and ROCm, which poses as CUDA), an Intel GPU (XPU), Apple's MPS or only a CPU gets,
    as the function the scripts call decides it (utils.get_device gives it torch.accelerator's answers)."""
    assert guards.choose_device(requested, accelerator, count, processes) == torch.device(expected)
    if accelerator == "mps" and processes:
        assert capsys.readouterr().out.startswith(
            "Apple MPS has no backend for several processes: they train on the CPU (gloo)"
        )


@pytest.mark.parametrize(
    "requested,accelerator,count,processes,words",
    [
        ("cuda", None, 0, 0, "--device cuda: this machine has no usable cuda GPU; use --device cpu"),
        ("xpu", "cuda", 2, 0, "--device xpu: this machine has no usable xpu GPU; use --device cuda"),
        ("cuda:1", "cuda", 4, 2, "under a launcher each process uses the GPU of its local rank"),
        (None, "cuda", 2, 4, "4 processes on this node but only 2 GPU(s)"),
        ("cuda:3", "cuda", 2, 0, "--device cuda:3: only 2 GPU(s) visible"),
        ("gpu", "cuda", 1, 0, "--device gpu is not a device name; use cpu, cuda or cuda:N"),
    ],
)
def test_a_device_that_cannot_be_used_is_refused_in_one_line(requested, accelerator, count, processes, words):
    with pytest.raises(guards.UsageError, match=re.escape(words)):
        guards.choose_device(requested, accelerator, count, processes)


def test_the_backend_follows_the_device():
    """dist.get_default_backend_for_device, which the DDP and FSDP rungs call: NCCL (CUDA, ROCm's RCCL poses as it),
    XCCL (Intel XPU), gloo (the CPU, and where MPS leaves the processes)."""
    backend = torch.distributed.get_default_backend_for_device
    assert [backend(torch.device(kind)) for kind in ("cuda", "xpu", "cpu")] == ["nccl", "xccl", "gloo"]


# ---------------------------------------------------------------------------------------- a dataset's items
class Items(torch.utils.data.Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return self.item


GOOD = (torch.zeros(1, 28, 28, dtype=torch.uint8), 2)
DEFAULT_CHECKS = (train_single.input_problem, train_single.target_problem, train_single.collate)  # the block's


@pytest.mark.parametrize(
    "item,words",
    [
        ({"image": GOOD[0], "label": 1}, "its first is a dict with keys 'image', 'label': return (item[input key]"),
        ((Image.new("L", (28, 28)), 1), "its first is (PIL.Image.Image: convert the input in the dataset"),
        ((numpy.zeros((1, 28, 28), dtype=numpy.uint8), 1), "(numpy.ndarray: "),
        ((GOOD[0].short(), 1), "(torch.int16 input: images are uint8 (0-255, normalised on the device) or floating"),
        ((GOOD[0].long(), 1), "for token ids or other integers, write input_problem() and run_model() of your own"),
        ((torch.from_numpy(numpy.zeros((1, 28, 28))), 1), "(float64 input: give float32, e.g. torch.from_numpy("),
        (
            (torch.zeros(28, 28, 3, dtype=torch.uint8), 1),
            "(uint8 image of shape (28, 28, 3): channels last (H, W, C); give (C, H, W)",
        ),
        ((GOOD[0], 3), "(input, 3: a label is an int from 0 to 2"),
        ((GOOD[0], -1), "(input, -1: "),
        ((GOOD[0], 1.0), "(input, 1.0: "),
        ((GOOD[0], torch.tensor([1, 0])), "(input, tensor([1, 0]): "),
        ((GOOD[0],), "its first is a tuple of 1"),
        (GOOD[0], "its first is a Tensor"),
    ],
)
def test_a_wrong_item_is_named_with_the_contract(item, words):
    """utils.check_datasets with the rungs' default input_problem, target_problem (a classifier's int label) and
    collate."""
    with pytest.raises(guards.UsageError) as refused:
        utils.check_datasets(Items(item), Items(GOOD), ["a", "b", "c"], *DEFAULT_CHECKS)
    message = str(refused.value)
    assert message.startswith("the training set's items must be (input, target) pairs; ") and words in message, message
    assert "\n" not in message


@pytest.mark.parametrize("label", [2, torch.tensor(2), numpy.int64(2), torch.tensor(2, dtype=torch.uint8)])
def test_labels_as_ints_tensors_and_numpy_scalars_pass(label):
    utils.check_datasets(Items((GOOD[0], label)), Items((torch.zeros(3, 8, 8), 0)), ["a", "b", "c"], *DEFAULT_CHECKS)


def test_a_task_checks_its_own_inputs_and_targets():
    """The task block's own checks decide what an input and a target must be: a multi-label vector passes its
    target check and fails the classifier's; token ids (int64) pass a text task's input check and fail ours."""

    def multi_label(target, names):
        return None if torch.is_tensor(target) and target.shape == (len(names),) else f"{target!r}: one 0/1 per label"

    def token_ids(inputs):
        return None if inputs.dtype == torch.int64 and inputs.dim() == 1 else "token ids"

    vector = Items((torch.zeros(3, 8, 8, dtype=torch.uint8), torch.tensor([1.0, 0.0, 1.0])))
    utils.check_datasets(vector, vector, ["a", "b", "c"], train_single.input_problem, multi_label, train_single.collate)
    with pytest.raises(guards.UsageError, match="a label is an int from 0 to 2"):
        utils.check_datasets(vector, vector, ["a", "b", "c"], *DEFAULT_CHECKS)
    text = Items((torch.tensor([5, 7, 9]), 1))
    utils.check_datasets(text, text, ["a", "b"], token_ids, train_single.target_problem, train_single.collate)
    with pytest.raises(guards.UsageError, match="write input_problem\\(\\) and run_model\\(\\) of your own"):
        utils.check_datasets(text, text, ["a", "b"], *DEFAULT_CHECKS)


class Sized(torch.utils.data.Dataset):
    """Items of their own sizes: the default collate cannot stack them."""

    def __len__(self):
        return 3

    def __getitem__(self, index):
        return torch.zeros(3, 8 + index, 8), 0


def test_items_the_collate_cannot_batch_are_named_before_training():
    with pytest.raises(guards.UsageError) as refused:
        utils.check_datasets(Sized(), Items(GOOD), ["a", "b", "c"], *DEFAULT_CHECKS)
    assert str(refused.value).startswith(
        "collate() cannot batch the training set's first two items (stack expects each tensor to be equal size"
    ) and str(refused.value).endswith(
        "items of different sizes need a collate() of their own in the task block (padding, or lists: docs/adapting.md)"
    )


def test_an_empty_validation_set_and_no_names_are_refused():
    with pytest.raises(guards.UsageError, match="the validation set is empty"):
        utils.check_datasets(Items(GOOD), [], ["a", "b", "c"], *DEFAULT_CHECKS)
    with pytest.raises(guards.UsageError, match="build_datasets\\(\\) returned no names: give one per model output"):
        utils.check_datasets(Items(GOOD), Items(GOOD), [], *DEFAULT_CHECKS)


class Counting(torch.utils.data.IterableDataset):
    """A stream of (float vector, label) items 0, 1, 2, ... of an epoch, each with a draw of torch's generator;
    `reads` counts the items it has made in this process."""

    def __init__(self, count=10, length=None):
        self.count, self.length, self.epoch, self.reads = count, length or count, 0, 0

    def __len__(self):
        return self.length

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for i in range(self.count):
            self.reads += 1
            yield torch.tensor([float(100 * self.epoch + i), torch.rand(()).item()]), i % 2


def test_a_stream_is_read_in_order_and_each_item_drawn_alike_whichever_were_skipped():
    """utils.Stream: item p of an epoch, read forward (from the start for an item passed or another epoch, each with
    set_epoch); with a seed, what the stream draws for an item depends on (seed, epoch, p) only, not on the items a
    process skipped to reach it (other ranks' and workers'), so every layout and a resume see the same items."""
    stream = utils.Stream(Counting())
    assert len(stream) == 10 and stream[3][0][0] == 3 and stream.stream.reads == 4
    assert stream[5][0][0] == 5 and stream.stream.reads == 6  # onwards: no new pass
    assert stream[2][0][0] == 2 and stream.stream.reads == 9  # an item passed: from the start
    assert stream.item(1, 4)[0][0] == 104  # another epoch
    everyone = [utils.Stream(Counting()).item(2, p, seed=7)[0] for p in range(10)]  # each item read on its own
    one = utils.Stream(Counting())
    assert all(torch.equal(one.item(2, p, seed=7)[0], everyone[p]) for p in (1, 4, 5, 9))  # skipping 2-3, 6-8
    assert not torch.equal(utils.Stream(Counting()).item(3, 4, seed=7)[0][1:], everyone[4][1:])  # another epoch


def test_a_stream_shorter_than_its_len_and_one_without_len_are_named():
    with pytest.raises(guards.UsageError) as refused:
        utils.Stream(Counting(count=4, length=6)).item(0, 5)
    assert str(refused.value).startswith("the stream ended after 4 items of epoch 1, but its len() is 6: make len()")

    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield GOOD

    with pytest.raises(
        guards.UsageError, match="the training set is a stream \\(an IterableDataset\\) without __len__"
    ):
        utils.check_datasets(Endless(), Items(GOOD), ["a", "b", "c"], *DEFAULT_CHECKS)
    with pytest.raises(guards.UsageError, match="the training set is a generator without __len__ and __getitem__"):
        utils.check_datasets((item for item in [GOOD]), Items(GOOD), ["a", "b", "c"], *DEFAULT_CHECKS)
    train, val = utils.check_datasets(Counting(), Items(GOOD), ["a", "b", "c"], *DEFAULT_CHECKS)
    assert isinstance(train, utils.Stream) and val.__class__ is Items


def test_the_training_keys_place_each_sample_in_the_epoch():
    """utils.EpochSampler's keys (epoch, position, index): rank r's k-th sample is at position k * W + r of the
    epoch's order over all processes, whose index the sampler gave; SeededItems reads a map-style dataset at the
    index and a stream at the position."""
    order = list(torch.utils.data.DistributedSampler(range(12), num_replicas=1, rank=0, shuffle=True, seed=4))
    for rank in (0, 1, 2):
        sampler = utils.EpochSampler(
            torch.utils.data.DistributedSampler(range(12), num_replicas=3, rank=rank, shuffle=True, seed=4)
        )
        sampler.start(0)
        assert all(order[position] == index and position % 3 == rank for _, position, index in sampler)
    items = utils.SeededItems(utils.Stream(Counting(12)), seed=0)
    assert items[(0, 7, 3)][0][0] == 7  # a stream: its 7th item, whichever index the shuffle gave


def test_a_batch_reaches_the_device_whatever_its_structure_and_counts_its_items():
    detection = (
        (torch.zeros(3, 8, 8), torch.zeros(3, 6, 9)),
        ({"boxes": torch.zeros(1, 4), "labels": torch.tensor([1])}, {"boxes": torch.zeros(0, 4), "labels": []}),
    )
    moved = utils.to_device(detection, torch.device("meta"))
    assert [image.device.type for image in moved[0]] == ["meta", "meta"] and moved[1][1]["labels"] == []
    assert moved[1][0]["boxes"].device.type == "meta" and isinstance(moved[1], tuple)
    samples, batch = utils.Counted(train_single.collate)([(torch.zeros(2), {"a": torch.ones(1)})] * 3)
    assert samples == 3 and batch[1]["a"].shape == (3, 1)  # 3 items, not the 1 key of their dict target


def test_a_new_stage_is_a_change_of_the_trained_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))

    def head_first(args, model, epoch):
        model[0].requires_grad_(epoch >= 2)

    assert utils.new_stage(head_first, None, model, 0) and not utils.new_stage(head_first, None, model, 1)
    assert utils.new_stage(head_first, None, model, 2) and not utils.new_stage(
        train_single.set_trainable, None, model, 3
    )


def test_the_metric_best_pt_follows_is_named_if_missing():
    assert utils.beats_best({"acc": 0.5}, "acc", 0.4, True) and not utils.beats_best({"mse": 0.5}, "mse", 0.4, False)
    with pytest.raises(guards.UsageError, match="Metrics.best is 'ema_acc', but the metrics are loss, acc: name one"):
        utils.beats_best({"loss": 0.1, "acc": 0.5}, "ema_acc", None, True)


def test_auxiliary_outputs_are_split_from_the_main_one():
    """Tuples and namedtuples (GoogLeNet's and Inception's, whose aux may be None) and dicts (torchvision's
    segmentation models: "out" and "aux"; Hugging Face's "logits"; else the first entry is the main one). A loss a
    model returns beside them (under a loss's name, or 0-d: no batch dimension) is never taken for an output."""
    from torchvision.models import InceptionOutputs

    main, aux, loss = torch.ones(2, 3), torch.zeros(2, 3), torch.tensor(0.7)
    for outputs, expected in (
        (main, []),
        ((main, aux), [aux]),
        (InceptionOutputs(main, None), []),
        (InceptionOutputs(main, aux), [aux]),
        ({"aux": aux, "out": main}, [aux]),
        ({"logits": main}, []),
        ({"loss": loss, "logits": main}, []),  # Hugging Face's, labels given
        ({"loss": loss, "hidden": aux, "logits": main}, [aux]),
        ((loss, main), []),  # Hugging Face's return_dict=False, labels given
    ):
        found, auxiliary = utils.split_outputs(outputs)
        assert found is main and len(auxiliary) == len(expected) and all(a is b for a, b in zip(auxiliary, expected))


def test_the_default_loss_adds_auxiliary_outputs_and_adamw_skips_norms_and_biases():
    logits, aux = torch.randn(4, 3), torch.randn(4, 3)
    targets = torch.tensor([0, 1, 2, 1])
    plain = torch.nn.functional.cross_entropy(logits, targets)
    assert train_single.compute_loss(logits, targets) == plain
    assert torch.allclose(
        train_single.compute_loss({"out": logits, "aux": aux}, targets),
        plain + 0.4 * torch.nn.functional.cross_entropy(aux, targets),
    )
    model = torchvision.models.VisionTransformer(
        image_size=16, patch_size=4, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=3
    )
    args = argparse.Namespace(opt="adamw", weight_decay=0.05)
    optimizer = train_single.build_optimizer(args, model, 1e-3)
    decayed, not_decayed = ({id(p) for p in group["params"]} for group in optimizer.param_groups)
    names = {id(p): name for name, p in model.named_parameters()}
    assert optimizer.param_groups[1]["weight_decay"] == 0.0 and optimizer.param_groups[0]["weight_decay"] == 0.05
    assert {names[i] for i in not_decayed} >= {
        "class_token",
        "encoder.pos_embedding",
        "heads.head.bias",
        "encoder.ln.weight",
    }
    assert {names[i] for i in decayed} == {name for name, p in model.named_parameters() if p.ndim > 1} - {
        "class_token",
        "encoder.pos_embedding",
    }
    sgd = train_single.build_optimizer(argparse.Namespace(opt="sgd", weight_decay=1e-4), model, 0.1)
    assert len(sgd.param_groups) == 1 and sgd.param_groups[0]["weight_decay"] == 1e-4  # as before: every parameter


# ------------------------------------------------------------------------------------------ normalisation
def test_uint8_images_of_any_channel_count_are_normalised_by_the_documented_rule():
    rgb = torch.full((2, 3, 4, 4), 128, dtype=torch.uint8)
    expected = (128 / 255 - torch.tensor(utils.MEAN)) / torch.tensor(utils.STD)
    assert torch.allclose(utils.normalize(rgb)[0, :, 0, 0], expected)
    grey = torch.full((2, 1, 4, 4), 128, dtype=torch.uint8)  # (an MNIST-like TensorDataset's batch)
    grey_mean, grey_std = sum(utils.MEAN) / 3, sum(utils.STD) / 3
    assert torch.allclose(utils.normalize(grey), torch.tensor((128 / 255 - grey_mean) / grey_std))
    two = torch.full((2, 2, 4, 4), 255, dtype=torch.uint8)
    assert torch.allclose(utils.normalize(two), torch.tensor((1 - grey_mean) / grey_std))
    no_channels = torch.zeros(2, 4, 4, dtype=torch.uint8)
    assert utils.normalize(no_channels).shape == (2, 4, 4)
    floats = torch.randn(2, 1, 4, 4)
    assert utils.normalize(floats) is floats  # a dataset's own normalisation, as given


def test_the_training_image_grid_takes_grey_and_float_images(tmp_path):
    for images in (
        [torch.randint(0, 256, (1, 8, 8), dtype=torch.uint8) for _ in range(4)],
        [torch.randn(1, 8, 8) for _ in range(4)],
    ):
        log = logger(tmp_path, ["a", "b"], 1, 1, 4, 1)
        log.add_training_images(utils.SeededItems([(image, 0) for image in images], 0), 0)
        log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert "train/augmented_images" in events.Tags()["images"]


def test_metrics_jsonl_holds_each_step_once_across_a_kill_and_its_resume(tmp_path):
    """metrics.jsonl, as a run killed after step 5 left it (its last checkpoint at step 3), then resumed from that
    checkpoint: the lines past step 3 go, and the resumed run's steps 4 to 6 follow step 3 once (as TensorBoard's
    purge_step drops its events)."""
    log = logger(tmp_path, ["a", "b"], 1, 6, 2, 1)
    log.start_epoch(0)
    for step in range(5):
        log.step(step, step + 1, torch.tensor(1.0 + step), 0.1)
    log.close()
    resumed = logger(tmp_path, ["a", "b"], 1, 6, 2, 1, global_step=3)
    resumed.start_epoch(0, 3)
    for step in range(3, 6):
        resumed.step(step, step + 1, torch.tensor(1.0 + step), 0.1)
    resumed.end_epoch(6, {"loss": 0.5, "count": 4, "acc": 0.75})
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line.get("loss"), line.get("val_acc")) for line in lines] == [
        *[(step, 1.0 * step, None) for step in range(1, 7)],
        (6, None, 0.75),
    ]
    assert sorted(lines[-1]) == ["data_wait", "epoch", "step", "val_acc", "val_count", "val_loss"], lines[-1]


# --------------------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def checkpoint_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoint")
    torch.manual_seed(0)
    state = {
        "model": torchvision.models.resnet18(num_classes=3).state_dict(),
        "optimizer": {},
        "args": {"model": "resnet18"},
        "classes": ["a", "b", "c"],
        "samples": 0,
        "epoch": 1,
        "best": None,
    }
    utils.save_checkpoint(state, folder, is_best=True)
    return folder / "last.pt"


def test_a_truncated_last_pt_names_the_intact_best_pt_and_is_not_cut_mid_word(checkpoint_file, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(checkpoint_file.with_name("best.pt"), run / "best.pt")
    data = checkpoint_file.read_bytes()
    (run / "last.pt").write_bytes(data[: len(data) // 3])
    with pytest.raises(guards.UsageError) as refused:
        utils.load_checkpoint(run / "last.pt", ["a", "b", "c"])
    message = str(refused.value)
    assert "not a readable checkpoint, perhaps cut short (" in message, message
    best = run / "best.pt"
    assert message.endswith(
        f"; {best} is intact: continue from it with --resume {best}, or start from its weights with --weights {best}"
    ), message
    assert "(PytorchStreamReader failed reading zip archive: failed finding central directory); " in message  # whole
    (run / "best.pt").write_bytes(data[:100])  # no intact best.pt: nothing promised
    with pytest.raises(guards.UsageError) as refused:
        utils.load_checkpoint(run / "last.pt", ["a", "b", "c"])
    assert "intact" not in str(refused.value)


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_a_pickled_checkpoint_is_refused_as_unsafe_and_runs_nothing(tmp_path):
    marker = tmp_path / "code-ran"
    torch.save({"model": {}, "optimizer": RunsCode(marker)}, tmp_path / "last.pt")
    with pytest.raises(guards.UsageError) as refused:
        utils.load_checkpoint(tmp_path / "last.pt", ["a"])
    assert "refused as unsafe" in str(refused.value) and not marker.exists(), str(refused.value)


def test_a_resume_into_other_classes_names_them(checkpoint_file):
    with pytest.raises(guards.UsageError) as refused:
        utils.load_checkpoint(checkpoint_file, ["a", "b", "d", "e"])
    assert "(names only in the checkpoint: c; only here: d, e)" in str(refused.value), str(refused.value)
    with pytest.raises(guards.UsageError, match="the same names in another order"):
        utils.load_checkpoint(checkpoint_file, ["c", "b", "a"])


def test_a_full_disk_says_no_space_left(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(guards.UsageError) as refused:
            utils.save_checkpoint({"model": {"w": torch.zeros(1_000_000)}}, disk)
        assert "cannot write" in str(refused.value) and "(No space left on device)" in str(refused.value)
        assert os.listdir(disk) == []  # no temporary file left
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# ----------------------------------------------------------------------------- FSDP's sharded checkpoints
@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A run folder with a sharded checkpoint as train_fsdp.py saves it (one process), and a state to load it into."""

    def state(lr):
        torch.manual_seed(0)
        model = torchvision.models.resnet18(num_classes=3)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        optimizer.step()
        return dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))

    run = tmp_path_factory.mktemp("run")
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state(0.1), checkpoint_id=run / "last-step1-1.dcp")
    return run, state


def load(run, name, state):
    reader = fsdp_utils.sharded_checkpoint(run, name)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, storage_reader=reader, planner=reader.planner)


def test_a_shard_cut_short_is_one_line_naming_best_pt(sharded, tmp_path):
    """A copy of the run folder whose shard file is cut to half (a full disk, an interrupted copy): the reader names
    the shard and best.pt before dcp.load reads anything (before: 141 lines and 5 tracebacks, no word of best.pt)."""
    run, _ = sharded
    shutil.copytree(run, tmp_path / "run")
    (tmp_path / "run" / "best.pt").write_bytes(b"")
    shard = next((tmp_path / "run" / "last-step1-1.dcp").glob("*.distcp"))
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    with pytest.raises(guards.UsageError) as refused:
        fsdp_utils.sharded_checkpoint(tmp_path / "run", "last-step1-1.dcp")
    assert str(refused.value).startswith(f"--resume: the shard last-step1-1.dcp/{shard.name} is cut short or missing")
    assert str(refused.value).endswith(
        f"; {tmp_path / 'run' / 'best.pt'} holds the best epoch's weights: start from them with --weights "
        f"{tmp_path / 'run' / 'best.pt'}"
    )


def test_a_flipped_bit_in_a_shard_is_one_line_naming_best_pt(sharded, tmp_path):
    """The CRC of each file of a shard folder, written beside them as train_fsdp.py writes them once dcp.save is done:
    one flipped bit in a shard (which dcp.load would load without a word) names the file and best.pt."""
    run, state = sharded
    shutil.copytree(run, tmp_path / "run")
    (tmp_path / "run" / "best.pt").write_bytes(b"")
    fsdp_utils.write_checksums(tmp_path / "run" / "last-step1-1.dcp")
    load(tmp_path / "run", "last-step1-1.dcp", state(0.5))  # intact: it loads
    shard = next((tmp_path / "run" / "last-step1-1.dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x04
    shard.write_bytes(data)
    with pytest.raises(guards.UsageError) as refused:
        fsdp_utils.sharded_checkpoint(tmp_path / "run", "last-step1-1.dcp")
    assert str(refused.value) == (
        f"--resume: the shard file last-step1-1.dcp/{shard.name} is damaged or missing (its size or CRC is not the "
        f"one written beside it); {tmp_path / 'run' / 'best.pt'} holds the best epoch's weights: start from them "
        f"with --weights {tmp_path / 'run' / 'best.pt'}"
    )


def test_a_flipped_bit_or_an_entry_that_would_inflate_is_refused_before_torch_load(tmp_path):
    """A checkpoint's entries are checked against the zip's directory and their CRCs before torch.load trusts them:
    one flipped bit in a tensor's data (which torch.load loads without a word) names the entry and the intact
    best.pt; an entry stored compressed, as no torch.save writes (a crafted file that would inflate gigabytes in
    memory), is refused unread."""
    torch.save({"model": {"w": torch.arange(1000.0)}}, tmp_path / "last.pt")
    shutil.copy(tmp_path / "last.pt", tmp_path / "best.pt")
    data = bytearray((tmp_path / "last.pt").read_bytes())
    at = bytes(data).index(torch.arange(1000.0).numpy().tobytes()[400:416])  # inside the tensor's bytes
    data[at] ^= 0x10
    (tmp_path / "last.pt").write_bytes(data)
    assert not torch.equal(torch.load(tmp_path / "last.pt", weights_only=True)["model"]["w"], torch.arange(1000.0))
    with pytest.raises(guards.UsageError) as refused:
        guards.load_checked(tmp_path / "last.pt", "--resume")
    assert str(refused.value) == (
        f"--resume {tmp_path / 'last.pt'}: damaged (last/data/0 fails its CRC check); {tmp_path / 'best.pt'} is "
        f"intact: continue from it with --resume {tmp_path / 'best.pt'}, or start from its weights with --weights "
        f"{tmp_path / 'best.pt'}"
    )
    with zipfile.ZipFile(tmp_path / "inflates.pt", "w", zipfile.ZIP_DEFLATED) as crafted:
        crafted.writestr("archive/data.pkl", b"\0" * (8 << 20))
    with pytest.raises(guards.UsageError) as refused:
        guards.load_checked(tmp_path / "inflates.pt", "--resume")
    assert str(refused.value).startswith(
        f"--resume {tmp_path / 'inflates.pt'}: its entry archive/data.pkl would inflate to 8388608 bytes from "
    ) and str(refused.value).endswith(
        "(torch.save stores, never compresses): not a checkpoint of these scripts, refused unread"
    )


def test_the_safe_reader_loads_what_fsdp_saved(sharded):
    run, state = sharded
    loaded = state(0.5)
    load(run, "last-step1-1.dcp", loaded)
    assert loaded["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert torch.equal(loaded["model"]["conv1.weight"], state(0.1)["model"]["conv1.weight"])


def test_a_crafted_metadata_pickle_runs_no_code(sharded, tmp_path):
    run, state = sharded
    shutil.copytree(run / "last-step1-1.dcp", tmp_path / "last-step1-1.dcp")
    (tmp_path / "last-step1-1.dcp" / ".metadata").write_bytes(pickle.dumps(RunsCode(tmp_path / "code-ran")))
    with pytest.raises(guards.UsageError) as refused:
        fsdp_utils.sharded_checkpoint(tmp_path, "last-step1-1.dcp")
    assert ".metadata was refused (posix.mkdir is not a type of a checkpoint's metadata)" in str(refused.value)
    assert not (tmp_path / "code-ran").exists()


def test_a_crafted_item_runs_no_code(sharded, tmp_path):
    """The metadata is sound, but an item that is not a tensor (the optimizer's lr here) is a pickle that runs code."""
    run, state = sharded
    crafted = state(0.1)
    crafted["optimizer"]["param_groups"][0]["lr"] = RunsCode(tmp_path / "code-ran")
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(crafted, checkpoint_id=tmp_path / "last-step1-1.dcp")
    with pytest.raises(BaseException) as refused:  # dcp's CheckpointException, which the rung ends in one line
        load(tmp_path, "last-step1-1.dcp", state(0.5))
    assert fsdp_utils.sharded_checkpoint_failure(refused.value).startswith(
        "--resume: the sharded checkpoint holds Python objects besides tensors"
    )
    assert not (tmp_path / "code-ran").exists()


@pytest.mark.parametrize(
    "name",
    [
        "../elsewhere/last-step1-1.dcp",
        "/tmp",
        "last-step1-1.dcp/..",
        "linked.dcp",
        "last-link.dcp",
        "",
        None,
        ["a list"],
    ],
)
def test_the_shards_folder_must_be_a_folder_of_the_run(sharded, tmp_path, name):
    run, _ = sharded
    (tmp_path / "elsewhere").mkdir()
    shutil.copytree(run / "last-step1-1.dcp", tmp_path / "elsewhere" / "last-step1-1.dcp")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "last-link.dcp").symlink_to(tmp_path / "elsewhere" / "last-step1-1.dcp")
    with pytest.raises(guards.UsageError) as refused:
        fsdp_utils.sharded_checkpoint(tmp_path / "run", name)
    assert "are not a folder beside it" in str(refused.value)


# --------------------------------------------------------------------------------------------- the run folder
def test_a_run_folder_that_cannot_be_written_is_one_line(tmp_path):
    """A file where the run folder should be (as a read-only or full disk, an OSError from mkdir or from opening the
    lock): one line naming the folder and the way, not a traceback."""
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(guards.UsageError) as refused:
        guards.claim_output_dir(tmp_path / "taken" / "run")
    assert str(refused.value) == (
        f"cannot write into {tmp_path / 'taken' / 'run'} (Not a directory): choose another "
        f"--output-dir, or make that one writable"
    ), refused.value


def test_a_run_folder_is_held_by_one_job_and_free_once_it_ends(tmp_path):
    """A second process that claims the folder while the first holds it is refused, with the holder named; once the
    holder has ended (here: killed), the folder is free, though its lock file stays."""
    folder = tmp_path / "run"
    read, write = os.pipe()
    holder = os.fork()
    if holder == 0:  # the first job
        try:
            guards.claim_output_dir(folder)
            os.write(write, b"held")
            signal.pause()
        finally:
            os._exit(0)
    try:
        assert os.read(read, 4) == b"held"
        with pytest.raises(guards.UsageError) as refused:
            guards.claim_output_dir(folder)
        assert str(refused.value).startswith(f"{folder} is in use by another job (pid {holder} on ")
        assert "let it end (or stop it) before you resume it, or choose another --output-dir" in str(refused.value)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    guards.claim_output_dir(folder)  # free again
    assert (folder / ".lock").read_text().startswith(f"pid {os.getpid()} on ")
    guards._RUN_DIR.pop("lock").close()


def args_for(output_dir, resume=None, test_only=False):
    return argparse.Namespace(output_dir=str(output_dir), resume=resume and str(resume), test_only=test_only)


def test_a_run_writes_only_where_it_overwrites_nothing_of_another(tmp_path):
    """guards.resolve_run: an --output-dir that holds files and is not a run folder of these scripts (no .lock) is
    refused in one line, even for --test-only and a resume from elsewhere; an empty folder, a run folder and the
    folder of the checkpoint resumed are taken (before: someone's best.pt and class_indices.json overwritten)."""
    someones = tmp_path / "someones"
    someones.mkdir()
    for name in ("best.pt", "class_indices.json", "notes.txt", "photo.jpg"):
        (someones / name).write_text("theirs")
    for args in (args_for(someones), args_for(someones, test_only=True, resume=tmp_path / "a" / "last.pt")):
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "a" / "last.pt").write_text("a checkpoint")
        with pytest.raises(guards.UsageError) as refused:
            guards.resolve_run(args, "train_single.py")
        assert str(refused.value) == (
            f"--output-dir {someones} holds files (best.pt, class_indices.json, notes.txt, ...) and is not a run "
            f"folder of these scripts (it has no .lock): choose a new or an empty folder"
        ), refused.value
    (tmp_path / "empty").mkdir()
    assert guards.resolve_run(args_for(tmp_path / "empty"), "x.py") == (tmp_path / "empty", None)
    (someones / ".lock").write_text("")  # a run folder: a run that stopped before its first checkpoint
    assert guards.resolve_run(args_for(someones), "x.py") == (someones, None)
    ours = tmp_path / "a"
    assert guards.resolve_run(args_for(ours, resume=ours / "last.pt"), "x.py") == (ours, ours / "last.pt")


def test_resume_auto_of_a_finished_run_without_its_last_pt_says_what_to_do(tmp_path):
    (tmp_path / ".lock").write_text("")
    (tmp_path / "results.json").write_text("{}")
    with pytest.raises(guards.UsageError) as refused:
        guards.resolve_run(args_for(tmp_path, resume="auto"), "x.py")
    assert str(refused.value) == (
        f"--resume auto: {tmp_path} holds no last.pt to continue, only the results of a run that ended: choose a "
        f"new --output-dir (to start from its weights: --weights {tmp_path / 'best.pt'})"
    )


def test_a_run_removes_only_its_own_temporary_files(tmp_path):
    """claim_output_dir removes what a killed job's atomic_write left (.last.pt.<pid>.tmp, ...), nothing else hidden
    (before: every .*.tmp)."""
    for name in (".last.pt.123.tmp", ".results.json.9.tmp", ".editor-swap.tmp", ".last.pt.tmp", ".x.1.tmp"):
        (tmp_path / name).write_text("")
    guards.claim_output_dir(tmp_path)
    guards._RUN_DIR.pop("lock").close()
    assert sorted(p.name for p in tmp_path.glob(".*.tmp")) == [".editor-swap.tmp", ".last.pt.tmp", ".x.1.tmp"]


def test_another_scripts_run_a_stale_launcher_environment_and_a_read_only_checkout_are_one_line(tmp_path, monkeypatch):
    """An FSDP run's last.pt (its optimizer state names its shards) resumed by another script; RANK, LOCAL_RANK or
    WORLD_SIZE left in the shell for a one-process script (before: a wrong line about the disk, or nothing and an
    exit after 10 s, and another rank's randomness); the demo data that cannot be written (a read-only checkout)."""
    with pytest.raises(guards.UsageError) as refused:
        resumed = argparse.Namespace(resume=tmp_path / "last.pt")  # a Run that resumes that file
        utils.Run.optimizer_state(resumed, {"optimizer": "last-step3-1.dcp"})
    assert str(refused.value) == (
        f"--resume {tmp_path / 'last.pt'}: a run of train_fsdp.py (its optimizer state is sharded in "
        f"last-step3-1.dcp): continue it with train_fsdp.py, or start from its weights with "
        f"--weights {tmp_path / 'last.pt'}"
    )
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        with monkeypatch.context() as env:
            env.setenv(name, value)
            env.setattr(sys, "argv", ["train_single.py"])
            with pytest.raises(guards.OwnError) as refused:
                guards.require_one_process()
            assert str(refused.value) == (
                f"train_single.py runs one process, but {name}={value} is set (a launcher's, left in the shell, or "
                f"a launcher started several): unset RANK LOCAL_RANK WORLD_SIZE, or train with a DDP script "
                f"(train_ddp_torchrun.py)"
            )
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # a launcher of one process: fine
    guards.require_one_process()
    (tmp_path / "checkout").write_text("a file where the checkout's data/ would be: mkdir fails as read-only")
    monkeypatch.setattr(builtin, "DEMO_DIR", tmp_path / "checkout" / "data" / "demo")
    with pytest.raises(guards.UsageError) as refused:
        builtin.demo_data()
    assert str(refused.value) == (
        f"cannot write the demo data into {tmp_path / 'checkout' / 'data'} (Not a directory): give --data-path (a "
        f"folder of class folders), or run from a checkout that can be written"
    )


# ------------------------------------------------------------------------------- the lines failures end with
@pytest.mark.parametrize(
    "error,line",
    [
        (
            RuntimeError(
                "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for "
                "recv operation to complete"
            ),
            "error: the other processes did not all answer within --dist-timeout (Timed out waiting 30000ms for recv "
            "operation to complete): one is missing or stuck",
        ),
        (
            RuntimeError("Application timeout caused pair closure"),  # gloo, a DDP forward's buffer broadcast
            "error: the other processes did not all answer within --dist-timeout (Application timeout caused pair "
            "closure): one is missing or stuck",
        ),
        (
            RuntimeError(
                "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
                "RuntimeError: unable to allocate shared memory(shm) for file </torch_1_2>: No space left on device"
            ),
            "error: /dev/shm holds ",
        ),
        (
            RuntimeError(
                "DataLoader worker (pid 123) is killed by signal: Bus error. It is possible that dataloader's "
                "workers are out of shared memory. Please try to raise your shared memory limit."
            ),
            "error: /dev/shm holds ",
        ),
        (
            RuntimeError(
                "Expected to have finished reduction in the prior iteration before starting a new one. ...\n"
                "Parameter indices which did not receive grad for rank 0: 62 63\n In addition, ..."
            ),
            "error: some parameters got no gradient in the last step (62 63): the model holds a module that forward() "
            "does not use; remove it, or pass find_unused_parameters=True in the DDP(...) line",
        ),
        (
            ValueError(
                "Expected more than 1 value per channel when training, got input size torch.Size([1, 512, 1, 1])"
            ),
            "error: a BatchNorm layer saw one value per channel in training "
            "(got input size torch.Size([1, 512, 1, 1])): raise --batch-size (images per process) or --img-size",
        ),
        (
            RuntimeError("DataLoader worker (pid 4321) is killed by signal: Killed. "),
            "error: a data loader worker of rank 0 (pid 4321) was killed by SIGKILL, most likely by the out-of-memory "
            "killer (dmesg says which): lower --workers or --batch-size, then continue with --resume auto",
        ),
        (
            RuntimeError("DataLoader worker (pid(s) 4321) exited unexpectedly"),
            "error: a data loader worker of rank 0 (pid 4321) ended unexpectedly: lower --workers or --batch-size",
        ),
        (
            RuntimeError('Error(s) in loading state_dict for Sequential:\n\tMissing key(s) in state_dict: "2.weight".'),
            "error: the checkpoint's weights do not fit this model (Error(s) in loading state_dict for Sequential:); ",
        ),
    ],
)
def test_known_failures_end_in_one_line(error, line, capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as ended:
        with dist_utils.one_line_errors():  # guards.one_line_errors(), and what only a job of several processes meets
            raise error
    err = capsys.readouterr().err
    assert ended.value.code == 1 and err.startswith(line) and err.count("\n") == 1, err


class SlowItems(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        if torch.utils.data.get_worker_info() is not None:
            time.sleep(60)  # never ready in a worker: it is killed first
        return torch.zeros(3)  # (check_shm's look at an item, in this process)


def test_a_killed_worker_that_torch_says_exited_unexpectedly_is_named_by_its_signal(capsys, monkeypatch):
    """torch reports a dead loader worker by its SIGCHLD handler ("is killed by signal: Killed") or, when its queue
    read notices first, as "exited unexpectedly" with no signal (seen in the OOM test under load): the worker's
    process object, kept by the iterator that utils.loader_iterator made, says SIGKILL."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    loader = torch.utils.data.DataLoader(SlowItems(), num_workers=1)
    iterator = utils.loader_iterator(loader)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would raise its own line first: the other path
    worker = iterator._workers[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(timeout=10)
    with pytest.raises(SystemExit) as ended:
        with dist_utils.one_line_errors():  # (it ends the loader's workers as a script's exit does)
            raise RuntimeError(f"DataLoader worker (pid(s) {worker.pid}) exited unexpectedly")
    iterator._shutdown_workers()
    err = capsys.readouterr().err
    assert ended.value.code == 1 and err.startswith(
        f"error: a data loader worker of rank 0 (pid {worker.pid}) was killed by SIGKILL, most likely by the "
        f"out-of-memory killer"
    ), err


def killed_loader_worker(monkeypatch):
    """A loader iterator as the rungs make it, and its worker, killed by SIGKILL (torch's handler held off)."""
    monkeypatch.setattr(guards, "LOADER_ITERATORS", weakref.WeakSet())  # a new process's: none of earlier tests'
    iterator = utils.loader_iterator(torch.utils.data.DataLoader(SlowItems(), num_workers=1))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.kill(iterator._workers[0].pid, signal.SIGKILL)
    return iterator, iterator._workers[0]


@pytest.mark.parametrize("handover", [ConnectionResetError(104, "Connection reset by peer"), EOFError()])
def test_a_batch_handover_that_fails_as_its_worker_is_killed_names_the_kill(handover, capsys, monkeypatch):
    """A killed worker's sockets close a moment before the kernel says it ended: a batch it was handing over fails
    first, and torch, finding the worker still alive, raises the handover's error (20 of 150 kills in a loop, one
    misread as a lost peer, the other a traceback): the line names the killed worker all the same."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    iterator, worker = killed_loader_worker(monkeypatch)  # not waited for: its end is reported a moment later
    with pytest.raises(SystemExit) as ended:
        with dist_utils.one_line_errors():
            raise handover
    iterator._shutdown_workers()
    err = capsys.readouterr().err
    assert ended.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: a data loader worker of rank 0 (pid {worker.pid}) was killed by SIGKILL"), err


def test_a_worker_killed_while_an_error_is_reported_leaves_the_report_whole(capsys, monkeypatch):
    """CI's OOM test: a worker killed as its rank reported another error; torch's SIGCHLD handler raised in the
    middle of the traceback, past the loader workers' end, and the rank then waited for them at its exit until the
    job was killed 90 s later. The report stays whole and the workers end."""
    iterator = utils.loader_iterator(torch.utils.data.DataLoader(SlowItems(), num_workers=1))
    # torch's own handler, as torch sets it (once a process: an earlier test may have reset it)
    signal.signal(signal.SIGCHLD, lambda signum, frame: torch._C._error_if_any_worker_fails())
    report = guards.traceback.print_exc

    def killed_while_reporting():
        os.kill(iterator._workers[0].pid, signal.SIGKILL)
        time.sleep(1)  # SIGCHLD arrives
        report()

    monkeypatch.setattr(guards.traceback, "print_exc", killed_while_reporting)
    with pytest.raises(SystemExit) as ended:
        with guards.one_line_errors():
            raise ValueError("a bug of one's own")
    err = capsys.readouterr().err
    assert ended.value.code == 1 and "ValueError: a bug of one's own" in err and "killed by signal" not in err, err
    assert not any(worker.is_alive() for worker in iterator._workers)


def test_the_loader_workers_end_when_the_report_itself_is_interrupted(monkeypatch):
    """Workers ignore SIGTERM: left alive, they would hold their process at its exit."""
    iterator = utils.loader_iterator(torch.utils.data.DataLoader(SlowItems(), num_workers=1))

    def interrupted():
        raise KeyboardInterrupt  # a second Ctrl-C, as its handler raises it

    monkeypatch.setattr(guards.traceback, "print_exc", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with guards.one_line_errors():
            raise ValueError("a bug of one's own")
    iterator._workers[0].join(timeout=10)
    assert not iterator._workers[0].is_alive()


A_HANDOVER_RESET = """
import os, socket, struct, sys, time
from multiprocessing import resource_sharer
sys.path.insert(0, sys.argv[1])
import utils
utils.init_loader_worker(0)
handover = resource_sharer.DupFd(os.pipe()[0])  # as torch hands a batch's shared memory to the training process
rank = socket.socket(socket.AF_UNIX)
rank.connect(handover._id[0])
rank.recv(1, socket.MSG_PEEK)  # the handover has begun: its challenge is sent
rank.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
rank.close()  # the rank killed: a reset
time.sleep(1)
raise ValueError("any other error")
"""


def test_a_loader_worker_whose_rank_is_killed_mid_handover_prints_no_traceback():
    """A loader worker hands a batch's shared memory to its rank as a file descriptor, from multiprocessing's
    resource_sharer thread. CI's OOM test once killed the rank mid-handover, and the worker printed a
    ConnectionResetError traceback beside run.sh's one line. In a worker set up by utils.init_loader_worker that reset
    prints nothing, and another uncaught error still prints its traceback."""
    proc = subprocess.run(
        [sys.executable, "-c", A_HANDOVER_RESET, str(Path(utils.__file__).parent)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]
    assert "ConnectionResetError" not in proc.stderr and "ValueError: any other error" in proc.stderr, proc.stderr


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_sparse_gradient_under_the_default_optimizers_is_one_line(opt, capsys, monkeypatch):
    """nn.Embedding(sparse=True) under the task block's build_optimizer: SGD's weight decay cannot add a sparse
    gradient, AdamW takes none at all; the real errors, each one line naming the way."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    model = torch.nn.Embedding(10, 4, sparse=True)
    args = argparse.Namespace(opt=opt, weight_decay=1e-4 if opt == "sgd" else 0.05)
    optimizer = train_single.build_optimizer(args, model, 0.1)
    with pytest.raises(SystemExit) as ended:
        with guards.one_line_errors():
            model(torch.tensor([1, 2])).sum().backward()
            optimizer.step()
    err = capsys.readouterr().err
    assert ended.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith(
        "error: a sparse gradient (an nn.Embedding(sparse=True)) reached the optimizer ("
    ) and err.endswith(
        "use sparse=False, or, in build_optimizer(), SGD with weight_decay 0 for those parameters (docs/adapting.md)\n"
    ), err


def test_other_failures_keep_their_traceback(capsys):
    with pytest.raises(SystemExit):
        with guards.one_line_errors():
            raise ZeroDivisionError("a bug of one's own")
    assert "Traceback" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ the randomness of a step
def test_a_steps_randomness_is_a_function_of_seed_rank_epoch_and_step():
    def masks(seed, epoch, step):
        utils.seed_step(seed, epoch, step)
        return torch.nn.functional.dropout(torch.ones(64), 0.5)

    torch.manual_seed(123)  # whatever came before
    first = masks(0, 1, 5)
    torch.rand(1000)
    assert torch.equal(masks(0, 1, 5), first)
    assert not torch.equal(masks(0, 1, 6), first) and not torch.equal(masks(1, 1, 5), first)
    assert not torch.equal(masks(0, 2, 5), first)


def test_each_rank_draws_its_own_randomness(monkeypatch):
    """Separate GPUs would not share Dropout masks: rank 1's step differs from rank 0's, and repeats itself."""

    def masks(rank):
        monkeypatch.setenv("RANK", str(rank))  # as the launcher sets it
        utils.seed_step(0, 1, 5)
        return torch.nn.functional.dropout(torch.ones(64), 0.5)

    assert not torch.equal(masks(0), masks(1)) and torch.equal(masks(1), masks(1))


def test_a_data_folder_that_holds_itself_or_an_empty_data_path_is_refused(tmp_path):
    """Issue 69: --data-path "" (an unset shell variable) trained on the demo data and exited 0; a class folder that
    is a link to the data folder became a class holding every image again, and one linked into another class put
    its images in two classes: each now one line, before anything is read."""
    parser = utils.get_args_parser("test")
    builtin.add_arguments(parser)
    with pytest.raises(guards.UsageError, match=r"^--data-path is empty \(an unset shell variable\?\)"):
        parser.parse_args(["--data-path", ""])
    root = make_dataset(tmp_path / "data", [2, 2], size=8)
    (root / "c2").symlink_to(root)
    with pytest.raises(guards.UsageError) as refused:
        builtin.find_images(root, 0.5)
    assert (
        str(refused.value) == f"class folder {root / 'c2'} is a link to {root}, which holds the data folder: remove it"
    )
    (root / "c2").unlink()
    (root / "c2").symlink_to(root / "c0")
    with pytest.raises(guards.UsageError, match=r"is a link into class c0 .*: its images would be in two classes"):
        builtin.find_images(root, 0.5)
    (root / "c2").unlink()
    assert builtin.find_images(root, 0.5)[0] == ["c0", "c1"]


SWEEP_JOB = r"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import guards
while time.time() < float(sys.argv[2]):  # the jobs of a sweep, started in the same second
    time.sleep(0.001)
print(guards.claim_output_dir(Path("runs/train_single-20261207-120000"), new=True), flush=True)
time.sleep(1)  # each holds its folder while the others claim theirs
"""


def test_jobs_of_a_sweep_started_together_get_a_default_folder_each(tmp_path):
    """Issue 69: four jobs started at once with the default --output-dir (runs/<script>-<date>-<time>, the same name
    within a second) shared one folder, and three were refused as 'in use by another job' after 44 s. Each now makes
    its folder (the next name where another job made it first) and holds it."""
    start = time.time() + 4  # after every process has imported torch
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", SWEEP_JOB, str(Path(utils.__file__).parent), str(start)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    ended = [job.communicate(timeout=60) for job in jobs]
    assert [job.returncode for job in jobs] == [0] * 4, ended
    stem = "runs/train_single-20261207-120000"
    assert sorted(out.strip() for out, _ in ended) == [stem, f"{stem}-2", f"{stem}-3", f"{stem}-4"], ended


FSDP_UNITS = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import torch, torch.nn as nn, torchvision
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import fsdp_utils

class Block(nn.Module):  # a decoder layer: attention and MLP, each with its norm
    def __init__(self, width):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
    def forward(self, x):
        x = x + self.attention(*[self.norm1(x)] * 3, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))

class NanoGPT(nn.Module):  # nanoGPT's layout: a ModuleDict holding the ModuleList h, the head tied to the embedding
    def __init__(self, vocab=32, width=16, layers=3):
        super().__init__()
        blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, width), wpe=nn.Embedding(8, width),
                                              h=blocks, ln_f=nn.LayerNorm(width)))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
    def forward(self, tokens):
        x = self.transformer.wte(tokens) + self.transformer.wpe(torch.arange(tokens.shape[1]))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

class Decoder(nn.Module):  # Hugging Face's layout: model.layers, a ModuleList
    def __init__(self, vocab=32, width=16, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)
    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

vit = torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=8,
                                           mlp_dim=16, num_classes=3)
cnn = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
resnet = torchvision.models.resnet18(num_classes=3)
nano, decoder = NanoGPT(), Decoder()
expected = {"resnet": (resnet, ["BasicBlock"] * 8), "vit": (vit, ["EncoderBlock"] * 2),
            "nanogpt": (nano, ["Block"] * 3), "decoder": (decoder, ["Block"] * 2),
            "cnn": (cnn, ["Conv2d", "BatchNorm2d", "LazyLinear"])}
for name, (model, kinds) in expected.items():
    found = [type(unit).__name__ for unit in fsdp_utils.units(model)]
    assert found == kinds, (name, found)
dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=0, world_size=1)
inputs = {"resnet": torch.rand(2, 3, 32, 32), "vit": torch.rand(2, 3, 16, 16), "nanogpt": torch.randint(0, 32, (2, 8)),
          "decoder": torch.randint(0, 32, (2, 8)), "cnn": torch.rand(2, 3, 8, 8)}
for name, (model, _) in expected.items():
    model(inputs[name])  # (the lazy layer's shape)
    for unit in fsdp_utils.units(model):
        fully_shard(unit)
    fully_shard(model)
    model(inputs[name]).sum().backward()
dist.destroy_process_group()
print("ok")
"""


def test_fsdps_units_are_the_repeated_blocks_of_the_layouts_people_use(tmp_path):
    """Issue 69: a transformer's nn.ModuleList of decoder layers was handed to fully_shard whole (its forward does
    nothing: 105 lines, 3 tracebacks). The units: a ResNet's residual blocks, torchvision ViT's encoder layers,
    nanoGPT's h (in a ModuleDict, the head tied to the embedding, which stay with the root), Hugging Face's layers,
    and each child with parameters of a model without repeated blocks; each sharded, then trained a step (one
    process)."""
    proc = subprocess.run(
        [sys.executable, "-c", FSDP_UNITS, str(Path(utils.__file__).parent), str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.stdout == "ok\n", proc.stderr[-3000:]
