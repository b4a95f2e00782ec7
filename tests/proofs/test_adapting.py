"""Your task, your data, your model (issue 53): a rung copied with utils.py (and dist_utils.py) into an empty folder,
its whole task block (from the "your task" line to main(): add_task_arguments, build_datasets, build_model,
build_optimizer, compute_loss, target_problem, Metrics) replaced by a user's, keeps its guarantees for tasks that are
not a single-label classifier:

- multi-label images (BCEWithLogitsLoss on float 0/1 vectors; micro F1 from each label's true positives, false
  positives and false negatives): a CNN with BatchNorm and Dropout on normalised float images augmented by
  torchvision v2, Python's random and numpy; a flag of the user's own (--samples); the default optimizer copied.
  train_ddp_torchrun.py, train_dp.py, train_fsdp.py;
- semantic segmentation (per-pixel labels (N, H, W); a fully-convolutional model with BatchNorm, stochastic depth
  and Dropout that returns {"aux", "out"} as torchvision's segmentation models do, both heads in the loss; mIoU from
  a per-pixel confusion matrix) on one-channel uint8 images in a TensorDataset (an MNIST-like set, no
  augmentation): train_ddp_torchrun.py, train_ddp_launch.py;
- regression (MSE on float (2,) targets, lower is better; the user's own optimizer): train_ddp_torchrun.py,
  train_single.py;
- a small torchvision VisionTransformer classifier (Dropout, LayerNorm, attention) with the script's default
  optimizer, loss, target check and metrics, trained with --opt adamw: train_ddp_torchrun.py in fp32,
  train_ddp_amp.py in bf16.

With the defaults a user gets (loader workers, BatchNorm and Dropout training), each copy learns its task (well past
chance, which each threshold's comment gives); a stop mid-epoch (SIGTERM to every process of the job, as SLURM sends
it; the single, dp and launch rungs die of it and continue from --save-every) followed by --resume auto ends bitwise
equal to the uninterrupted run, with its best and final metric; and train_ddp_torchrun.py's uninterrupted checkpoint
evaluated by --test-only at 1 and at 3 processes gives the validation figures its 2-process run logged for the last
epoch (the metrics are made of sums that every process adds to). The DDP rungs also register the user's own gradient
communication hook (fp16 compression), which DDP allows once: nothing of ours may hold that slot.

In this process: each copy's own datasets pass its item check (utils.check_datasets with its target_problem), and a
float64 input, a uint8 image channels last and a target of another task each end in one line (utils.split_outputs:
tests/units/test_helpers.py).
"""

import importlib.util
import json
import math
import re
import shutil
import signal
import sys

import numpy
import pytest
import torch

import utils
from support import (
    BF16,
    REPO,
    assert_resumed_after,
    assert_same_weights,
    deliver,
    finish,
    load_model_state,
    ok,
    read_until,
    run,
    start,
)

# ------------------------------------------------------------------------------------------ the users' blocks
HEADER = '''# ------------------------------------------------------------------------------------------------ your task
# (a user's: {task})
import random

import numpy
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision.transforms import v2

import utils


def grid():  # (y, x): the coordinates of a 16 x 16 image
    return torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")


class Augmented(torch.utils.data.Dataset):
    """Float images normalised over the set (mean 0, standard deviation 1), and their targets; the training set's
    augmented with randomness from torch (torchvision v2), Python's random and numpy, none of which moves a target."""

    def __init__(self, images, targets, train):
        self.images, self.targets = (images - images.mean()) / images.std(), targets
        self.augment = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomCrop(16, padding=2, padding_mode="reflect")]
                                  ) if train else None

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        image = self.images[index]
        if self.augment:
            image = self.augment(image)
            if random.random() < 0.5:
                image = image.flip(-2)
            image = image + torch.from_numpy(numpy.random.normal(0, 0.05, image.shape).astype("float32"))
        return image, self.targets[index]


class AsGiven(nn.Module):
    """(the test's check) float batches reach the model as the dataset made them (over the dataset: mean 0, standard
    deviation 1), not normalised again with ImageNet's statistics (then: a batch's mean above 2 or its standard
    deviation above 2.5; BatchNorm would hide it from the metrics)"""

    def forward(self, x):
        assert abs(x.float().mean()) < 2 and 0.2 < x.float().std() < 2, f"re-normalised: {x.mean()}, {x.std()}"
        return x

'''

MULTILABEL = '''
LABELS = ["hstripes", "vstripes", "checkers", "square"]


def patterns(count, seed):
    """Images that hold each of 4 patterns with probability 1/2, and which they hold (float 0/1 vectors): horizontal
    stripes (red), vertical stripes (green), checkers (blue), a bright square (every channel); a dim noisy ground."""
    g = torch.Generator().manual_seed(seed)
    y, x = grid()
    present = (torch.rand(count, 4, generator=g) < 0.5).float()
    images = 0.3 * torch.rand(count, 3, 1, 1, generator=g) + 0.05 * torch.randn(count, 3, 16, 16, generator=g)
    for image, (h, v, c, s) in zip(images, present.tolist()):
        p = int(torch.randint(2, 4, (), generator=g))
        image[0] += 0.6 * h * (y // p % 2)
        image[1] += 0.6 * v * (x // p % 2)
        image[2] += 0.6 * c * ((y // p + x // p) % 2)
        top, left = torch.randint(2, 9, (2,), generator=g).tolist()
        image[:, top:top + 5, left:left + 5] += 0.5 * s
    return images, present


def add_task_arguments(parser):
    parser.add_argument("--samples", type=int, default=192, help="training images")


def build_datasets(args):
    return Augmented(*patterns(args.samples, 0), train=True), Augmented(*patterns(47, 1), train=False), LABELS


def build_model(args, num_outputs):
    return nn.Sequential(AsGiven(), nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(32, num_outputs))


{build_optimizer}

def compute_loss(outputs, targets):
    """Binary cross-entropy per label (BCEWithLogitsLoss); auxiliary outputs, if any, at 0.4."""
    main, auxiliary = utils.split_outputs(outputs)
    return F.binary_cross_entropy_with_logits(main, targets) + sum(
        0.4 * F.binary_cross_entropy_with_logits(aux, targets) for aux in auxiliary)


def target_problem(target, names):
    if not (torch.is_tensor(target) and target.is_floating_point() and target.shape == (len(names),)):
        return f"{target!r}: a target is a float tensor of {len(names)} values, 1.0 where its label applies, else 0.0"
    if not ((target == 0) | (target == 1)).all():
        return f"{target.tolist()}: a target holds 0.0 and 1.0 only"
    return None


class Metrics:
    """Each label's true positives, false positives and false negatives (predicted: a probability above 1/2), and
    the samples with every label right: micro F1 (the best one), each label's F1, the exact-match ratio."""

    best = "f1"
    higher_is_better = True

    def __init__(self, names, device):
        self.names = names
        self.sums = {kind: torch.zeros(len(names), dtype=torch.int64, device=device) for kind in ("tp", "fp", "fn")}
        self.sums.update(exact=torch.zeros(1, dtype=torch.int64, device=device),
                         samples=torch.zeros(1, dtype=torch.int64, device=device))

    def update(self, outputs, targets):
        predicted, truth = utils.split_outputs(outputs)[0] > 0, targets > 0.5
        self.sums["tp"] += (predicted & truth).sum(0)
        self.sums["fp"] += (predicted & ~truth).sum(0)
        self.sums["fn"] += (~predicted & truth).sum(0)
        self.sums["exact"] += (predicted == truth).all(1).sum()
        self.sums["samples"] += len(targets)

    def compute(self):
        tp, fp, fn = (self.sums[kind].tolist() for kind in ("tp", "fp", "fn"))
        per_label = {name: 2 * t / (2 * t + p + n) if t + p + n else None
                     for name, t, p, n in zip(self.names, tp, fp, fn)}
        return {"f1": 2 * sum(tp) / max(1, 2 * sum(tp) + sum(fp) + sum(fn)),
                "exact": self.sums["exact"].item() / max(1, self.sums["samples"].item()), "f1_per_label": per_label}
'''

SEGMENTATION = '''
CLASSES = ["background", "square", "disc"]


def scenes(count, seed):
    """One-channel uint8 images (1, 16, 16) in a TensorDataset, as an MNIST-like set comes, with their per-pixel
    labels (16, 16): a square and a disc of random sizes and places, each of its own brightness, on a noisy ground."""
    g = torch.Generator().manual_seed(seed)
    y, x = grid()
    images, masks = [], torch.zeros(count, 16, 16, dtype=torch.int64)
    for mask in masks:
        top, left = torch.randint(0, 10, (2,), generator=g).tolist()
        size = int(torch.randint(4, 8, (), generator=g))
        mask[top:top + size, left:left + size] = 1
        cy, cx = torch.randint(3, 13, (2,), generator=g).tolist()
        mask[(y - cy) ** 2 + (x - cx) ** 2 <= int(torch.randint(4, 10, (), generator=g))] = 2
        images.append(torch.tensor([60.0, 130.0, 200.0])[mask] + 15 * torch.randn(16, 16, generator=g))
    images = torch.stack(images)[:, None].clamp(0, 255).round().to(torch.uint8)
    return torch.utils.data.TensorDataset(images, masks)


class Segmenter(nn.Module):
    """Fully convolutional: a stem, a residual block under stochastic depth, a head per pixel with Dropout, and an
    auxiliary head on the stem's features; {"aux", "out"} as torchvision's FCN and DeepLabV3 return (any order)."""

    def __init__(self, classes):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1))
        self.drop_path = torchvision.ops.StochasticDepth(0.3, "row")
        self.head = nn.Sequential(nn.Dropout2d(0.1), nn.Conv2d(16, classes, 1))
        self.aux = nn.Conv2d(16, classes, 1)

    def forward(self, x):
        features = self.stem(x)
        deeper = torch.relu(features + self.drop_path(self.block(features)))
        return {"aux": self.aux(features), "out": self.head(deeper)}


def add_task_arguments(parser):
    pass


def build_datasets(args):
    return scenes(192, 0), scenes(47, 1), CLASSES


def build_model(args, num_outputs):
    return Segmenter(num_outputs)


{build_optimizer}

def compute_loss(outputs, targets):
    """Cross-entropy per pixel; the auxiliary head's at half weight (both heads learn: DDP finds a gradient for every
    parameter, no find_unused_parameters)."""
    main, auxiliary = utils.split_outputs(outputs)
    return F.cross_entropy(main, targets) + sum(0.5 * F.cross_entropy(aux, targets) for aux in auxiliary)


def target_problem(target, names):
    if not (torch.is_tensor(target) and target.dtype == torch.int64 and target.dim() == 2):
        kind = f"{target.dtype} tensor of shape {tuple(target.shape)}" if torch.is_tensor(target) else repr(target)
        return f"{kind}: a target is an int64 tensor (H, W), each pixel's class index"
    if target.min() < 0 or target.max() >= len(names):
        return f"pixel labels from {target.min()} to {target.max()}: each is from 0 to {len(names) - 1}"
    return None


class Metrics:
    """A per-pixel confusion matrix [true, predicted]: each class's IoU, their mean (mIoU, the best one) over the
    classes present, the pixel accuracy."""

    best = "miou"
    higher_is_better = True

    def __init__(self, names, device):
        self.names = names
        self.sums = {"confusion": torch.zeros(len(names), len(names), dtype=torch.int64, device=device)}

    def update(self, outputs, targets):
        predicted = utils.split_outputs(outputs)[0].argmax(dim=1)
        cells = targets.flatten() * len(self.names) + predicted.flatten()
        self.sums["confusion"].view(-1).index_add_(0, cells, torch.ones_like(cells))

    def compute(self):
        confusion = self.sums["confusion"].cpu()
        hits, union = confusion.diagonal(), confusion.sum(0) + confusion.sum(1) - confusion.diagonal()
        iou = {name: hits[i].item() / union[i].item() if union[i] else None for i, name in enumerate(self.names)}
        present = [value for value in iou.values() if value is not None]
        return {"miou": sum(present) / max(1, len(present)),
                "pixel_acc": hits.sum().item() / max(1, confusion.sum().item()), "iou": iou}
'''

REGRESSION = '''
TARGETS = ["brightness", "contrast"]


def levels(count, seed):
    """Images a + b * pattern (stripes or checkers of -1 and 1, a random period) + noise, and their targets (a, b),
    float (2,): the brightness from -1 to 1, the contrast from 0.1 to 1."""
    g = torch.Generator().manual_seed(seed)
    y, x = grid()
    targets = torch.stack([2 * torch.rand(count, generator=g) - 1, 0.1 + 0.9 * torch.rand(count, generator=g)], 1)
    images = []
    for a, b in targets.tolist():
        p, kind = int(torch.randint(2, 5, (), generator=g)), int(torch.randint(0, 3, (), generator=g))
        pattern = 2.0 * ([y // p, x // p, y // p + x // p][kind] % 2) - 1
        images.append(a + b * pattern + 0.1 * torch.randn(3, 16, 16, generator=g))
    return torch.stack(images), targets


def add_task_arguments(parser):
    pass


def build_datasets(args):
    return Augmented(*levels(192, 0), train=True), Augmented(*levels(47, 1), train=False), TARGETS


def build_model(args, num_outputs):
    return nn.Sequential(AsGiven(), nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.1), nn.Linear(32, num_outputs))


def build_optimizer(args, model, lr):
    """Ours: SGD with Nesterov momentum, no weight decay; the head at half the LR (a group's own LR, which the
    schedule scales as it scales lr)."""
    head = list([m for m in model.modules() if isinstance(m, nn.Linear)][-1].parameters())  # (DDP's wrapper too)
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    groups = [{"params": body}, {"params": head, "lr": lr / 2}]
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)


def compute_loss(outputs, targets):
    main, auxiliary = utils.split_outputs(outputs)
    return F.mse_loss(main, targets) + sum(0.4 * F.mse_loss(aux, targets) for aux in auxiliary)


def target_problem(target, names):
    if not (torch.is_tensor(target) and target.is_floating_point() and target.shape == (len(names),)):
        return f"{target!r}: a target is a float tensor of {len(names)} values, one per name"
    return None


class Metrics:
    """Each output's sum of squared errors (float64) and the samples: the mean squared error (the best one, lower is
    better) and each output's."""

    best = "mse"
    higher_is_better = False

    def __init__(self, names, device):
        self.names = names
        self.sums = {"squared_error": torch.zeros(len(names), dtype=torch.float64, device=device),
                     "samples": torch.zeros(1, dtype=torch.int64, device=device)}

    def update(self, outputs, targets):
        errors = utils.split_outputs(outputs)[0].double() - targets.double()
        self.sums["squared_error"] += errors.square().sum(0)
        self.sums["samples"] += len(targets)

    def compute(self):
        per_output = (self.sums["squared_error"].cpu() / max(1, self.sums["samples"].item())).tolist()
        return {"mse": sum(per_output) / len(per_output),
                **{f"mse_{name}": value for name, value in zip(self.names, per_output)}}
'''

VIT = '''
def stripes(count, seed):
    """3 classes: horizontal stripes on a dark ground, vertical ones on a middle one, checkers on a light one; a
    random period each. (images, labels as an int64 tensor)"""
    g = torch.Generator().manual_seed(seed)
    y, x = grid()
    labels, images = torch.arange(count) % 3, []
    for label, period in zip(labels.tolist(), torch.randint(2, 5, (count,), generator=g).tolist()):
        pattern = ([y // period, x // period, x // period + y // period][label] % 2).float()
        background = 0.2 + 0.3 * label + 0.1 * torch.rand(3, 1, 1, generator=g)
        images.append(background + 0.15 * (2 * pattern - 1))
    return torch.stack(images), labels


def add_task_arguments(parser):
    pass


def build_datasets(args):
    return (Augmented(*stripes(192, 0), train=True), Augmented(*stripes(47, 1), train=False),
            ["hstripes", "vstripes", "checkers"])


def build_model(args, num_outputs):
    return nn.Sequential(AsGiven(), torchvision.models.VisionTransformer(
        image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, dropout=0.1,
        num_classes=num_outputs))


{defaults}'''

# task: its block, its flags, its best metric, whether higher is better and the value it must reach (chance and what
# was measured in each comment), and its metrics that are float sums: evaluated at another number of processes they
# are summed in another order, so they match within 1e-6 (as the loss does), not bit for bit
TASKS = {
    # labels present with probability 1/2: all predicted present gives F1 0.67, all absent 0; measured 0.94-0.96
    # (exact match 0.79-0.85, chance 1/16)
    "multilabel": dict(code=MULTILABEL, args=["--lr", "4"], best="f1", higher=True, threshold=0.85, float_sums=()),
    # every pixel predicted background: mIoU ~0.25; measured 0.92 (pixel accuracy 0.99)
    "segmentation": dict(code=SEGMENTATION, args=["--lr", "4"], best="miou", higher=True, threshold=0.8, float_sums=()),
    # the targets' means predicted: MSE 0.2 (variances 1/3 and 0.0675); measured 0.004-0.005
    "regression": dict(
        code=REGRESSION,
        args=["--lr", "1"],
        best="mse",
        higher=False,
        threshold=0.02,
        float_sums=("mse", "mse_brightness", "mse_contrast"),
    ),
    # 3 classes: 1/3; measured 1.0 (fp32 and bf16). AdamW's LR per 256 samples raised for 36 steps at batch 16 (its
    # default 5e-4 reached 0.66). This task is easy: SGD at its default LR learns it too (1.0 in train_single.py); the
    # test proves a ViT trains with --opt adamw through the copies, not that SGD fails on harder data
    "vit": dict(
        code=VIT, args=["--opt", "adamw", "--lr", "0.05"], best="acc", higher=True, threshold=0.9, float_sums=()
    ),
}


def default(name):
    """The rung's own definition of `name` in its task block, as a user who keeps it copies it."""
    text = (REPO / "train_ddp_torchrun.py").read_text()
    return re.search(rf"^(def|class) {name}\b.*?(?=^(def|class) |\Z)", text, re.S | re.M)[0]


def users_block(task):
    """The user's whole task block: their imports and data helpers, then their seven definitions."""
    defaults = "".join(default(name) for name in ("build_optimizer", "compute_loss", "target_problem", "Metrics"))
    code = TASKS[task]["code"].replace("{build_optimizer}", default("build_optimizer")).replace("{defaults}", defaults)
    return HEADER.replace("{task}", task) + code


# ------------------------------------------------------------------------------------------- the copied rungs
# the user's own hook, right after the DDP wrap
HOOK = (
    "    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook\n"
    "\n"
    "    def compressed(state, bucket):  # fp16_compress_hook, its first call said (the test looks for it)\n"
    "        if not compressed.ran and rank == 0:\n"
    "            print('the communication hook ran', flush=True)\n"
    "        compressed.ran = True\n"
    "        return fp16_compress_hook(state, bucket)\n"
    "\n"
    "    compressed.ran = False\n"
    "    model.register_comm_hook(None, compressed)\n"
)
HOOK_RAN = "the communication hook ran"
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
RUNGS = {  # rung: (script, how it is started, its batch, whether it saves on the stop signal itself)
    "single": ("train_single.py", [], "16", False),
    "dp": ("train_dp.py", [], "16", False),
    "launch": (
        "train_ddp_launch.py",
        ["-m", "torch.distributed.launch", "--standalone", "--nproc-per-node=2"],
        "8",
        False,
    ),
    "torchrun": ("train_ddp_torchrun.py", TORCHRUN, "8", True),
    "amp": ("train_ddp_amp.py", TORCHRUN, "8", True),
    "fsdp": ("train_fsdp.py", TORCHRUN, "8", True),
}
# 192 training samples: global batch 16 (2 processes x 8, or 16), 12 steps an epoch, 3 epochs. 47 validation samples:
# unequal slices at 2 and 3 processes (24 + 23, 16 + 16 + 15), where a mean of the ranks' means would show
ARGS = ["--epochs", "3", "--print-freq", "1"]
STOP_AT = "epoch 2/3  step 5/12"  # mid-epoch, the epoch after a best.pt, so that the resumed run carries `best` on


def users_project(folder, rung, task):
    """folder/ with the rung and its helpers copied in (utils.py; dist_utils.py where a launcher starts it;
    fsdp_utils.py for FSDP), the rung's task block replaced by the user's; the DDP rungs register the user's hook."""
    folder.mkdir()
    script = RUNGS[rung][0]
    helpers = ["utils.py"]
    if RUNGS[rung][1]:  # started by a launcher
        helpers.append("dist_utils.py")
    if rung == "fsdp":
        helpers.append("fsdp_utils.py")
    for name in helpers:
        shutil.copy(REPO / name, folder)
    text = (REPO / script).read_text()
    start, end = re.search(r"^# -+ your task$", text, re.M).start(), text.index("def main(args):")
    text = text[:start] + users_block(task) + "\n\n" + text[end:]
    if rung in ("launch", "torchrun", "amp"):
        text = re.sub(r"(\n    model = DDP\(.*\n)", lambda m: m[1] + HOOK, text, count=1)
        assert HOOK in text, f"{script}: the hook was not inserted after its DDP(...) line"
    (folder / script).write_text(text)
    return folder


def command(rung, task, *args):
    script, launcher, batch, _ = RUNGS[rung]
    return [
        sys.executable,
        *launcher,
        script,
        *ARGS,
        "-b",
        batch,
        *TASKS[task]["args"],
        *(BF16 if rung == "amp" else []),
        *args,
    ]


def learned(task, value):
    return value >= TASKS[task]["threshold"] if TASKS[task]["higher"] else value <= TASKS[task]["threshold"]


class Runs:
    """The copies, made when first asked for, and their uninterrupted runs (results.json), run when first asked for.
    The launch copy's reference is the torchrun copy's run: the same arithmetic bit for bit (one micro-step a step,
    the same sampler, hook and loop)."""

    def __init__(self, root):
        self.root, self.results = root, {}

    def project(self, rung, task):
        if not (self.root / f"{rung}-{task}").is_dir():
            users_project(self.root / f"{rung}-{task}", rung, task)
        return self.root / f"{rung}-{task}"

    def whole(self, rung, task):
        """The copy's uninterrupted run: (its folder, its results.json). It learns the task; the default loader
        workers show in the header, the best metric in each epoch's line."""
        rung = "torchrun" if rung == "launch" else rung
        project, best = self.project(rung, task), TASKS[task]["best"]
        if (rung, task) not in self.results:
            whole = ok(run(command(rung, task, "--output-dir", "whole"), cwd=project, timeout=150))
            results = json.loads((project / "whole" / "results.json").read_text())
            assert learned(task, results[f"final_{best}"]), (results, whole.stdout[-2000:])
            assert "Traceback" not in whole.stderr, whole.stderr[-3000:]
            assert "loader workers per process: 1;" in whole.stdout  # the default on a CPU, shown in the header
            if rung in ("torchrun", "amp"):  # the DDP copies: the user's hook was inserted, and DDP called it
                assert whole.stdout.count(HOOK_RAN) == 1, whole.stdout[-2000:]
            # each epoch's line shows the metric; best_<metric> is the highest, or the lowest (higher_is_better)
            epochs = re.findall(
                rf"^epoch \d/3  val loss \d\.\d{{4}}  .*\b{best} (\d+\.\d{{4}}) .*\(47 samples\)", whole.stdout, re.M
            )
            assert len(epochs) == 3, whole.stdout[-2000:]
            best_epoch = (max if TASKS[task]["higher"] else min)(epochs, key=float)
            assert f"{results[f'best_{best}']:.4f}" == best_epoch, (epochs, results)
            self.results[rung, task] = results
        return project / "whole", self.results[rung, task]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("adapting"))


def stopped_and_resumed(rung, task, project):
    """Stopped in epoch 2 as SLURM stops a job (SIGTERM to every process, loader workers too), then --resume auto:
    the resumed run's folder."""
    saves_on_signal = RUNGS[rung][3]
    job, lines = start(command(rung, task, "--output-dir", "run", "--save-every", "1"), cwd=project, timeout=150), []
    seen = read_until(job, lines, STOP_AT)
    if seen:
        deliver(job, "every process", signal.SIGTERM)
    output = finish(job, lines, timeout=60)
    assert seen, output[-3000:]
    assert job.returncode != 0 and not (project / "run" / "results.json").exists(), output[-3000:]
    if saves_on_signal:  # (plain torchrun then exits 1 with its own report; run.sh makes that 143)
        assert output.count("stopped by SIGTERM after step") == 1, output[-3000:]
    resumed = ok(run(command(rung, task, "--output-dir", "run", "--resume", "auto"), cwd=project, timeout=150))
    assert_resumed_after(resumed.stdout)
    return project / "run"


def assert_same_figures(found, expected, task):
    """Each val_* figure of results.json: the counts and what the metrics make of integer sums equal, the loss and the
    metrics that are float sums within 1e-6 (summed in another order)."""
    figures = sorted(key for key in expected if key.startswith("val_"))
    assert sorted(key for key in found if key.startswith("val_")) == figures
    for key in figures:
        if key == "val_loss" or key[len("val_") :] in TASKS[task]["float_sums"]:
            assert math.isclose(found[key], expected[key], rel_tol=1e-6), (key, found[key], expected[key])
        else:
            assert found[key] == expected[key], (key, found[key], expected[key])


CASES = [("torchrun", task) for task in TASKS] + [
    ("single", "regression"),
    ("dp", "multilabel"),
    ("launch", "segmentation"),
    ("amp", "vit"),
    ("fsdp", "multilabel"),
]


@pytest.mark.parametrize("rung,task", CASES, ids=[f"{rung}-{task}" for rung, task in CASES])
def test_a_users_task_learns_resumes_bitwise_and_evaluates_alike(rung, task, runs):
    whole, results = runs.whole(rung, task)
    project, best = runs.project(rung, task), TASKS[task]["best"]
    resumed = stopped_and_resumed(rung, task, project)
    assert_same_weights(load_model_state(resumed / "last.pt"), load_model_state(whole / "last.pt"))
    again = json.loads((resumed / "results.json").read_text())
    assert (again[f"best_{best}"], again[f"final_{best}"]) == (results[f"best_{best}"], results[f"final_{best}"])
    if task == "regression":  # the user's head group kept its own LR, half the body's, through the schedule
        body, head = torch.load(whole / "last.pt", weights_only=True)["optimizer"]["param_groups"]
        assert 0 < body["lr"] < 1 and math.isclose(head["lr"], body["lr"] / 2), (body["lr"], head["lr"])
    if rung != "torchrun":
        return
    for processes in (1, 3):  # the 2-process run's checkpoint, evaluated by 1 and by 3 processes
        ok(
            run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={processes}",
                    RUNGS[rung][0],
                    "-b",
                    "8",
                    "--test-only",
                    "--resume",
                    whole / "last.pt",
                    "--output-dir",
                    f"test{processes}",
                ],
                cwd=project,
            )
        )
        assert_same_figures(json.loads((project / f"test{processes}" / "results.json").read_text()), results, task)


# ------------------------------------------------------------------------------- in this process: the slips
class One(torch.utils.data.Dataset):
    def __init__(self, item):
        self.item = item

    def __len__(self):
        return 2

    def __getitem__(self, index):
        return self.item


def copied_rung(runs, task):
    """The torchrun copy's script for `task`, imported here (its `utils` is this process's: the same file)."""
    spec = importlib.util.spec_from_file_location(
        f"copied_{task}", runs.project("torchrun", task) / RUNGS["torchrun"][0]
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WRONG_TARGETS = {  # task: a target of another task, and what the copy's target_problem says of it
    "multilabel": (torch.tensor(2), "tensor(2): a target is a float tensor of 4 values, 1.0 where its label applies"),
    "segmentation": (torch.zeros(16, 16), "torch.float32 tensor of shape (16, 16): a target is an int64 tensor (H, W)"),
    "regression": (torch.tensor([0.5]), "tensor([0.5000]): a target is a float tensor of 2 values, one per name"),
    "vit": (torch.tensor([1.0, 0.0, 0.0]), "tensor([1., 0., 0.]): a label is an int from 0 to 2"),
}


@pytest.mark.parametrize("task", list(TASKS))
def test_a_copys_item_check_names_a_users_slips_in_one_line(task, runs):
    """The copy's own datasets pass its check (utils.check_datasets with its target_problem); a float64 input
    (torch.from_numpy of numpy's default floats), a uint8 image channels last, and a target of another task each end
    in one line that says what was found and what to do."""
    copy = copied_rung(runs, task)
    train_set, val_set, names = copy.build_datasets(type("Args", (), {"samples": 4})())
    utils.check_datasets(train_set, val_set, names, copy.target_problem)
    image, target = train_set[0]
    as_numpy = torch.from_numpy(numpy.random.default_rng(0).random((3, 16, 16)))
    slips = (
        ((as_numpy, target), "(float64 input, ...): give float32, e.g. torch.from_numpy(array).float()"),
        (
            (torch.zeros(16, 16, 3, dtype=torch.uint8), target),
            "(uint8 image of shape (16, 16, 3), ...): channels "
            "last (H, W, C); give (C, H, W), e.g. torchvision.transforms.v2.ToImage() or image.permute(2, 0, 1)",
        ),
        ((image, WRONG_TARGETS[task][0]), f"(input, {WRONG_TARGETS[task][1]}"),
    )
    for item, words in slips:
        assert (utils.item_problem(item) is None) == (item[0] is image)  # the input's check, then the target's
        with pytest.raises(utils.UsageError) as refused:
            utils.check_datasets(One(item), val_set, names, copy.target_problem)
        line = str(refused.value)
        assert (
            line.startswith(f"the training set's items must be (input tensor, target) pairs; its first is {words}")
            and "\n" not in line
        ), line
