"""Your data, your model: a rung copied with utils.py into an empty folder, its build_datasets() and build_model()
replaced by a user's, keeps its guarantees. The user's data are normalised float tensors augmented by torchvision v2
(flip, padded crop), Python's random and numpy; the model is a small CNN with BatchNorm, not a ResNet. With the
defaults a user gets (loader workers, BatchNorm training), each rung learns the task, and a stop (SIGTERM to every
process of the job, as SLURM sends it; the single and launch rungs die of it and continue from --save-every) followed
by --resume auto ends bitwise equal to the uninterrupted run. The DDP rungs also register the user's own gradient
communication hook (fp16 compression), which DDP allows once: nothing of ours may hold that slot.
"""
import json
import re
import shutil
import signal
import sys

import pytest

from conftest import (BF16, REPO, ahead_fixture, assert_resumed_after, assert_same_weights, deliver, finish, job_env,
                      load_model_state, ok, outcomes, popen, read_until, run_job)

USER_CODE = '''
import random

import numpy
import torch.nn as nn
from torchvision.transforms import v2


class Stripes(torch.utils.data.Dataset):
    """3 classes of 16 x 16 normalised float images: horizontal stripes, vertical stripes, checkers."""

    def __init__(self, count, seed, train):
        g = torch.Generator().manual_seed(seed)
        y, x = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
        self.labels, images = torch.arange(count) % 3, []
        for label, period in zip(self.labels.tolist(), torch.randint(2, 5, (count,), generator=g).tolist()):
            pattern = ([y // period, x // period, x // period + y // period][label] % 2).float()
            background = torch.rand(3, 1, 1, generator=g)
            images.append(background + ((background + 0.5) % 1 - background) * pattern)  # each channel 0.5 apart
        images = torch.stack(images)
        self.images = (images - images.mean()) / images.std()
        self.augment = v2.Compose([v2.RandomHorizontalFlip(), v2.RandomCrop(16, padding=2)]) if train else None

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = self.images[index]
        if self.augment:  # randomness from torch, Python's random and numpy
            image = self.augment(image) * random.uniform(0.8, 1.2)
            image = image + torch.from_numpy(numpy.random.normal(0, 0.1, image.shape).astype("float32"))
        return image, int(self.labels[index])


def build_datasets(args):
    return Stripes(192, 0, train=True), Stripes(48, 1, train=False), ["hstripes", "vstripes", "checkers"]


class AsGiven(nn.Module):
    """(the test's check) the batches reach the model as the dataset made them: mean 0, standard deviation 1, not
    normalised again (BatchNorm would hide that from the accuracy)"""

    def forward(self, x):
        assert abs(x.float().mean()) < 0.5 and 0.5 < x.float().std() < 2, f"re-normalised: {x.mean()}, {x.std()}"
        return x


def build_model(args, num_classes):
    return nn.Sequential(AsGiven(), nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))


'''
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


def users_project(folder, script):
    """folder/ with the rung and utils.py copied in, the rung's two functions replaced by the user's."""
    folder.mkdir()
    shutil.copy(REPO / "utils.py", folder)
    text = (REPO / script).read_text()
    start, end = text.index("def build_datasets(args):"), text.index("def main(args):")
    text = text[:start] + USER_CODE.lstrip() + text[end:]
    if "model = DDP(" in text:
        text = re.sub(r"(\n    model = DDP\(.*\n)", lambda m: m[1] + HOOK, text, count=1)
    (folder / script).write_text(text)
    return folder


def command(rung, *args):
    script, launcher, batch, _ = RUNGS[rung]
    return [sys.executable, *launcher, script, *ARGS, "-b", batch, *(BF16 if rung == "amp" else []), *args]


def uninterrupted(rung, project):
    """The rung's whole run in its copy: it learns the task; the default loader workers show in the header."""
    whole = ok(run_job(command(rung, "--output-dir", "whole"), cwd=project, env=job_env(), timeout=150))
    results = json.loads((project / "whole" / "results.json").read_text())
    assert results["final_acc"] >= 0.9, (results["final_acc"], whole.stdout[-2000:])
    assert "Traceback" not in whole.stderr, whole.stderr[-3000:]
    assert "loader workers per process: 1;" in whole.stdout  # the default on a CPU, shown in the header
    return project / "whole" / "last.pt"


def stopped_and_resumed(rung, project):
    """Stopped in epoch 2 as SLURM stops a job (SIGTERM to every process, loader workers too), then --resume auto:
    the resumed run's last.pt."""
    saves_on_signal = RUNGS[rung][3]
    job, lines = popen(command(rung, "--output-dir", "run", "--save-every", "1"), cwd=project, env=job_env(),
                       timeout=150), []
    seen = read_until(job, lines, "epoch 2/3  step 4/12")
    if seen:
        deliver(job, "every process", signal.SIGTERM)
    output = finish(job, lines, timeout=60)
    assert seen, output[-3000:]
    assert job.returncode != 0 and not (project / "run" / "results.json").exists(), output[-3000:]
    if saves_on_signal:  # (plain torchrun then exits 1 with its own report; run.sh makes that 143)
        assert output.count("stopped by SIGTERM after step") == 1, output[-3000:]
    resumed = ok(run_job(command(rung, "--output-dir", "run", "--resume", "auto"), cwd=project, env=job_env(),
                         timeout=150))
    assert_resumed_after(resumed.stdout)
    assert json.loads((project / "run" / "results.json").read_text())["final_acc"] >= 0.9
    return project / "run" / "last.pt"


@ahead_fixture
def adapting_projects(out):
    """Each rung's copy: its uninterrupted run (none for launch: the torchrun copy's is its reference, the same
    arithmetic bit for bit: one micro-step a step, the same sampler, hook and loop) and its stopped and resumed run,
    each rung's jobs one after the other and two rungs side by side (conftest.outcomes); made ahead (conftest.Ahead).
    {rung: Outcome of (the reference's last.pt, the resumed run's)}."""
    def jobs(rung):
        (out / rung).mkdir()
        project = users_project(out / rung / "project", RUNGS[rung][0])
        whole = None if rung == "launch" else uninterrupted(rung, project)
        return whole, stopped_and_resumed(rung, project)
    # the longest first (fsdp's jobs, launch's two last), so that the last job has company
    return outcomes(**{rung: lambda rung=rung: jobs(rung) for rung in ("fsdp", "amp", "ddp", "single", "launch")})


@pytest.mark.parametrize("rung", list(RUNGS))
def test_a_users_dataset_and_model_learn_and_resume_bitwise(rung, adapting_projects):
    reference = adapting_projects["ddp" if rung == "launch" else rung].get()[0]
    resumed = adapting_projects[rung].get()[1]
    assert_same_weights(load_model_state(resumed), load_model_state(reference))
