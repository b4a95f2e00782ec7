"""Your data, your model: a rung copied with utils.py into an empty folder, its build_datasets() and build_model()
replaced by a user's, keeps its guarantees, for the models and data people bring:

- train_single.py: a small CNN of the user's own (BatchNorm, Dropout) on normalised float images augmented by
  torchvision v2 (flip, padded crop), Python's random and numpy;
- train_ddp_torchrun.py and train_ddp_launch.py: torchvision's ConvNeXt (stochastic depth, LayerNorm), small, on
  one-channel uint8 images in a TensorDataset (an MNIST-like set: tensor labels, no augmentation);
- train_ddp_amp.py: torchvision's Swin Transformer (stochastic depth, Dropout, LayerNorm, attention), small, in bf16;
- train_fsdp.py: torchvision's VisionTransformer (Dropout, LayerNorm), small, sharded by its children.

With the defaults a user gets (loader workers, BatchNorm and Dropout training), each rung learns the task, and a stop
mid-epoch (SIGTERM to every process of the job, as SLURM sends it; the single and launch rungs die of it and continue
from --save-every) followed by --resume auto ends bitwise equal to the uninterrupted run: the randomness of the
models' forward passes included. The DDP rungs also register the user's own gradient communication hook (fp16
compression), which DDP allows once: nothing of ours may hold that slot.
"""
import json
import re
import shutil
import signal
import sys

import pytest

from conftest import (BF16, REPO, assert_resumed_after, assert_same_weights, deliver, finish, load_model_state, ok,
                      read_until, run, start)

USER_DATA = '''
import random

import numpy
import torch.nn as nn
import torchvision
from torchvision.transforms import v2


def patterns(count, seed):
    """count images of 3 classes, 16 x 16, 3 channels in [0, 1]: horizontal stripes on a dark background, vertical
    ones on a middle one, checkers on a light one (a task every model learns within a few dozen steps)."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    labels, images = torch.arange(count) % 3, []
    for label, period in zip(labels.tolist(), torch.randint(2, 5, (count,), generator=g).tolist()):
        pattern = ([y // period, x // period, x // period + y // period][label] % 2).float()
        background = 0.2 + 0.3 * label + 0.1 * torch.rand(3, 1, 1, generator=g)
        images.append(background + 0.15 * (2 * pattern - 1))
    return torch.stack(images), labels


class Stripes(torch.utils.data.Dataset):
    """Normalised float images, augmented with randomness from torch, Python's random and numpy."""

    def __init__(self, count, seed, train):
        images, self.labels = patterns(count, seed)
        self.images = (images - images.mean()) / images.std()
        self.augment = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomCrop(16, padding=2)]) if train else None

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index]
        if self.augment:
            image = self.augment(image) * random.uniform(0.8, 1.2)
            image = image + torch.from_numpy(numpy.random.normal(0, 0.1, image.shape).astype("float32"))
        return image, int(self.labels[index])


def grey(count, seed):
    """One-channel uint8 images in a TensorDataset, as an MNIST-like set comes: (1, 16, 16), labels as tensors."""
    images, labels = patterns(count, seed)
    return torch.utils.data.TensorDataset((images[:, :1] * 255).to(torch.uint8), labels)


class AsGiven(nn.Module):
    """(the test's check) float batches reach the model as the dataset made them (over the dataset: mean 0, standard
    deviation 1), not normalised again with ImageNet's statistics (then: a batch's mean above 2 or its standard
    deviation above 2.5; BatchNorm would hide it from the accuracy)"""

    def forward(self, x):
        assert abs(x.float().mean()) < 2 and 0.2 < x.float().std() < 2, f"re-normalised: {x.mean()}, {x.std()}"
        return x


'''
USERS = {  # rung: the user's two functions
    "single": '''
def build_datasets(args):
    return Stripes(192, 0, train=True), Stripes(48, 1, train=False), ["hstripes", "vstripes", "checkers"]


def build_model(args, num_classes):
    return nn.Sequential(AsGiven(), nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3), nn.Linear(32, num_classes))
''',
    "ddp": '''
def build_datasets(args):
    return grey(192, 0), grey(48, 1), ["hstripes", "vstripes", "checkers"]


def build_model(args, num_classes):
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt
    return nn.Sequential(nn.Conv2d(1, 3, 1), ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)],
                                                      stochastic_depth_prob=0.5, num_classes=num_classes))
''',
    "amp": '''
def build_datasets(args):
    return Stripes(192, 0, train=True), Stripes(48, 1, train=False), ["hstripes", "vstripes", "checkers"]


def build_model(args, num_classes):
    return nn.Sequential(AsGiven(), torchvision.models.SwinTransformer(
        patch_size=[2, 2], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[4, 4], dropout=0.1,
        stochastic_depth_prob=0.5, num_classes=num_classes))
''',
    "fsdp": '''
def build_datasets(args):
    return Stripes(192, 0, train=True), Stripes(48, 1, train=False), ["hstripes", "vstripes", "checkers"]


def build_model(args, num_classes):
    return torchvision.models.VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=2, hidden_dim=32,
                                                mlp_dim=64, dropout=0.1, num_classes=num_classes)
''',
}
USERS["launch"] = USERS["ddp"]  # the same arithmetic as the torchrun copy: its run is the launch copy's reference
# the user's own hook, right after the DDP wrap
HOOK = ("    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook\n"
        "    model.register_comm_hook(None, fp16_compress_hook)\n")
# 2 processes x batch 8 (single: 16), 12 steps an epoch, 3 epochs; BatchNorm trains, loader workers by default
ARGS = ["--epochs", "3", "--lr", "1", "--print-freq", "1"]
RUNGS = {  # rung: (script, how it is started, its batch, whether it saves on the stop signal itself)
    "single": ("train_single.py", [], "16", False),
    "launch": ("train_ddp_launch.py", ["-m", "torch.distributed.launch", "--standalone", "--nproc-per-node=2"], "8",
               False),
    "ddp": ("train_ddp_torchrun.py", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"], "8", True),
    "amp": ("train_ddp_amp.py", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"], "8", True),
    "fsdp": ("train_fsdp.py", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"], "8", True),
}


def users_project(folder, rung):
    """folder/ with the rung and its helpers copied in (utils.py; dist_utils.py where a launcher starts it), the rung's
    two functions replaced by the user's."""
    folder.mkdir()
    script = RUNGS[rung][0]
    for name in ("utils.py",) + (("dist_utils.py",) if script != "train_single.py" else ()):
        shutil.copy(REPO / name, folder)
    text = (REPO / script).read_text()
    start, end = text.index("def build_datasets(args):"), text.index("def main(args):")
    text = text[:start] + USER_DATA.lstrip() + USERS[rung].lstrip() + "\n\n" + text[end:]
    if "model = DDP(" in text:
        text = re.sub(r"(\n    model = DDP\(.*\n)", lambda m: m[1] + HOOK, text, count=1)
    (folder / script).write_text(text)
    return folder


def command(rung, *args):
    script, launcher, batch, _ = RUNGS[rung]
    return [sys.executable, *launcher, script, *ARGS, "-b", batch, *(BF16 if rung == "amp" else []), *args]


def uninterrupted(rung, project):
    """The rung's whole run in its copy: it learns the task; the default loader workers show in the header."""
    whole = ok(run(command(rung, "--output-dir", "whole"), cwd=project, timeout=150))
    results = json.loads((project / "whole" / "results.json").read_text())
    assert results["final_acc"] >= 0.9, (results["final_acc"], whole.stdout[-2000:])
    assert "Traceback" not in whole.stderr, whole.stderr[-3000:]
    assert "loader workers per process: 1;" in whole.stdout  # the default on a CPU, shown in the header
    return project / "whole" / "last.pt"


def stopped_and_resumed(rung, project):
    """Stopped in epoch 2 as SLURM stops a job (SIGTERM to every process, loader workers too), then --resume auto:
    the resumed run's last.pt."""
    saves_on_signal = RUNGS[rung][3]
    job, lines = start(command(rung, "--output-dir", "run", "--save-every", "1"), cwd=project,
                       timeout=150), []
    seen = read_until(job, lines, "epoch 2/3  step 4/12")
    if seen:
        deliver(job, "every process", signal.SIGTERM)
    output = finish(job, lines, timeout=60)
    assert seen, output[-3000:]
    assert job.returncode != 0 and not (project / "run" / "results.json").exists(), output[-3000:]
    if saves_on_signal:  # (plain torchrun then exits 1 with its own report; run.sh makes that 143)
        assert output.count("stopped by SIGTERM after step") == 1, output[-3000:]
    resumed = ok(run(command(rung, "--output-dir", "run", "--resume", "auto"), cwd=project,
                         timeout=150))
    assert_resumed_after(resumed.stdout)
    assert json.loads((project / "run" / "results.json").read_text())["final_acc"] >= 0.9
    return project / "run" / "last.pt"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each rung's copy and its uninterrupted run's last.pt (none for launch: the torchrun copy's is its reference,
    the same arithmetic bit for bit: one micro-step a step, the same sampler, hook and loop)."""
    out = tmp_path_factory.mktemp("adapting")
    projects = {rung: users_project(out / rung, rung) for rung in RUNGS}
    return projects, {rung: uninterrupted(rung, projects[rung]) for rung in RUNGS if rung != "launch"}


@pytest.mark.parametrize("rung", list(RUNGS))
def test_a_users_dataset_and_model_learn_and_resume_bitwise(rung, references):
    projects, whole = references
    resumed = stopped_and_resumed(rung, projects[rung])
    assert_same_weights(load_model_state(resumed), load_model_state(whole["ddp" if rung == "launch" else rung]))
