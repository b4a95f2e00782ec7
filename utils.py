"""Helpers every train_*.py script shares unchanged: arguments, the device, the sample stream, checkpoints, how a run
ends, logging. dist_utils.py adds what the multi-process rungs need; builtin.py holds our image folders and ResNet."""

import argparse
import atexit
import contextlib
import errno
import json
import math
import multiprocessing
import os
import pickle
import random
import re
import resource
import shutil
import signal
import socket
import sys
import textwrap
import threading
import time
import traceback
import weakref
import zipfile
from pathlib import Path

import numpy
import torch
from torch.utils.data import Dataset

# ImageNet's per-channel (RGB) mean and standard deviation, in 0-1
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
DIVERGED_HINT = "lower --lr, or clip the gradients (--clip-grad; with fp16, try --amp-dtype bf16)"


class UsageError(Exception):
    """Bad input: one line, no traceback, exit status 1 (one_line_errors)."""

    def __init__(self, message):
        if "Traceback" in message:  # re-raised from a loader worker, its traceback in the message: our line only
            message = message.strip().splitlines()[-1].split("Error: ", 1)[-1]
        super().__init__(message)


class OwnError(UsageError):
    """Bad input that only this process knows (an image it read, its loader worker, its environment): it says it,
    whatever its rank."""


class BadImageError(OwnError):
    """An undecodable image."""


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        """Raise instead of exiting, so that a multi-process job reports it once."""
        raise UsageError(f"{message} (see --help)")


# ----------------------------------------------------------------------------------------------- arguments
def get_args_parser(description):
    """The flags every rung shares; the task's own come from the script's add_task_arguments()."""
    parser = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("-b", "--batch-size", type=int, default=32, help="samples per process and step")
    parser.add_argument("--opt", default="sgd", choices=("sgd", "adamw"), help="the optimizer (build_optimizer())")
    parser.add_argument(
        "--lr",
        type=float,
        help="learning rate for a global batch of 256, scaled linearly to the "
        "real global batch, with linear warm-up and cosine decay (default: 0.1 for sgd, 5e-4 for "
        "adamw)",
    )
    parser.add_argument("--weight-decay", type=float, help="default: 1e-4 for sgd, 0.05 for adamw")
    parser.add_argument(
        "-j",
        "--workers",
        type=int,
        help="data loading processes per training process (default: "
        "with a GPU, the cores per process less one; on a CPU, 1)",
    )
    parser.add_argument("--clip-grad", type=float, default=0.0, help="max gradient norm (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", help="default: a new folder runs/<script>-<date>-<time>")
    parser.add_argument("--resume", help="checkpoint to continue from, or 'auto': <output-dir>/last.pt if it exists")
    parser.add_argument("--save-every", type=int, default=0, help="also checkpoint every N optimizer steps")
    parser.add_argument("--test-only", action="store_true", help="only evaluate the checkpoint given by --resume")
    parser.add_argument(
        "--device", help="cpu, cuda, cuda:N, xpu, mps (default: the accelerator torch finds, else the CPU)"
    )
    parser.add_argument("--print-freq", type=int, default=10, help="steps between progress lines")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile N steps (after 3 warm-up "
        "steps) with torch.profiler; writes trace.json (tools/profile_report.py reads it)",
    )
    return parser


def check_args(args):
    """The shared arguments checked; returns a copy with the defaults that depend on the machine filled in."""
    args = argparse.Namespace(**vars(args))
    positive = ("epochs", "batch_size", "img_size", "print_freq", "accum_steps", "dist_timeout", "lr")
    others = ("workers", "save_every", "profile", "seed", "clip_grad", "hsdp", "weight_decay")
    for name in (*positive, *others):  # every rung's numbers, and the built-in task's
        value = getattr(args, name, None)  # None: a flag this rung does not have, or a default filled in below
        if value is not None and not (math.isfinite(value) and (value > 0 if name in positive else value >= 0)):
            raise UsageError(
                f"--{name.replace('_', '-')} must be {'positive' if name in positive else '0 or more'}, got {value}"
            )
    if args.seed >= 2**62:  # torch's generators take 64 bits, and the shuffle's seed is seed + epoch
        raise UsageError(f"--seed must be below 2**62, got {args.seed}")
    if args.workers is None:  # a GPU waits for its loaders: give them the cores; a CPU trains on those cores itself
        found = torch.accelerator.current_accelerator(check_available=True)
        gpus = found is not None and not (args.device or found.type).startswith("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        args.workers = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)) - 1) if gpus else 1
    if args.test_only and not args.resume:
        raise UsageError("--test-only evaluates a checkpoint: give it with --resume PATH")
    if args.resume == "auto" and not args.output_dir:
        raise UsageError("--resume auto continues the run in --output-dir: give that folder too")
    if args.lr is None:  # the usual starting points of torchvision's recipes, per 256 samples
        args.lr = 0.1 if args.opt == "sgd" else 5e-4
    if args.weight_decay is None:
        args.weight_decay = 1e-4 if args.opt == "sgd" else 0.05
    return args


def require_one_process():
    """train_single.py and train_dp.py run one process: a launcher's ranks in the environment (left in a shell, or a
    launcher that started several copies) would make it another rank's, with another rank's randomness: one line."""
    env = os.environ
    found = [
        f"{name}={env[name]}"
        for name, alone in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"))
        if env.get(name, alone) != alone
    ]
    if found:
        raise OwnError(
            f"{Path(sys.argv[0]).name} runs one process, but {' '.join(found)} is set (a launcher's, left in the "
            f"shell, or a launcher started several): unset RANK LOCAL_RANK WORLD_SIZE, or train with a DDP script "
            f"(bash run.sh ddp)"
        )


def get_device(requested):
    """--device, else the accelerator torch finds (CUDA, ROCm as cuda, XPU, MPS), else the CPU (docs/running.md)."""
    found = torch.accelerator.current_accelerator(check_available=True)  # None where none is usable
    launched = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "LOCAL_RANK" in os.environ else 0
    count = torch.accelerator.device_count() if found else 0
    device = choose_device(requested, found and found.type, count, launched)
    if device.index is not None:
        torch.accelerator.set_device_index(device.index)  # else pinned-memory threads and the profiler use device 0
    return device


def choose_device(requested, accelerator, count, processes):
    """The device for --device `requested` (None: default) given `count` devices of type `accelerator` (None: the
    CPU only) and `processes` started on this node by a launcher (0: none)."""
    try:
        device = torch.device(requested or accelerator or "cpu")
    except RuntimeError:
        raise UsageError(
            f"--device {requested} is not a device name; use cpu, {accelerator or 'cuda'} or {accelerator or 'cuda'}:N"
        ) from None
    if device.type == "cpu":
        return device
    if device.type != accelerator:
        raise UsageError(
            f"--device {requested}: this machine has no usable {device.type} GPU; use --device {accelerator or 'cpu'}"
        )
    if processes and device.type == "mps":  # no collective backend on Apple's GPUs: the processes meet on the CPU
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            print(
                "Apple MPS has no backend for several processes: they train on the CPU (gloo); train_single.py "
                "trains on MPS",
                flush=True,
            )
        return torch.device("cpu")
    if processes and device.index is not None:  # before any rank opens a context on GPU N
        raise UsageError(
            f"--device {requested}: under a launcher each process uses the GPU of its local rank; use "
            f"--device {device.type}, and CUDA_VISIBLE_DEVICES=... to choose the GPUs"
        )
    if processes > count:
        raise UsageError(
            f"{processes} processes on this node but only {count} GPU(s): start at most one process per GPU"
        )
    if (device.index or 0) >= count:
        raise UsageError(f"--device {requested}: only {count} GPU(s) visible")
    return device


def resolve_run(args, script):
    """(output folder, checkpoint to resume), without touching the disk: a new folder by default. A run writes only
    into a new or empty folder, a run folder of these scripts (its .lock) or the folder of the checkpoint it resumes,
    and one holding a checkpoint or results only when it resumes it: it never overwrites what it did not write."""
    output_dir = Path(args.output_dir) if args.output_dir else None
    resume = None
    if args.resume == "auto":
        if (output_dir / "last.pt").exists():
            resume = output_dir / "last.pt"
        elif (output_dir / "results.json").exists():  # a run that ended, its last.pt gone
            raise UsageError(
                f"--resume auto: {output_dir} holds no last.pt to continue, only the results of a run that ended: "
                f"choose a new --output-dir (to start from its weights: --weights {output_dir / 'best.pt'})"
            )
    elif args.resume:
        resume = Path(args.resume)
        if not resume.is_file():
            raise UsageError(f"--resume {args.resume}: no such file; give a last.pt or best.pt from an earlier run")
        output_dir = output_dir or (None if args.test_only else resume.parent)  # continue the run where it was
    # A new folder: runs/<script>-<date>-<time>, then -2, -3, ... while the name is taken
    stem = f"{Path(script).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while output_dir is None or n > 1 and output_dir.exists():
        output_dir = Path("runs") / (stem if n == 1 else f"{stem}-{n}")
        n += 1
    taken = [name for name in ("last.pt", "results.json") if (output_dir / name).exists()]
    if args.test_only or resume is not None:
        taken = [name for name in taken if args.test_only and name == "results.json"]
    if taken:
        raise UsageError(
            f"{output_dir} already holds an earlier run ({taken[0]}); continue it with "
            f"--resume auto, or choose a new --output-dir"
        )
    foreign = []
    if (resume is None or output_dir != resume.parent) and not (output_dir / ".lock").exists():
        with contextlib.suppress(OSError):  # (not a folder, or not readable: claim_output_dir says so)
            foreign = sorted(entry.name for entry in os.scandir(output_dir))
    if foreign:
        raise UsageError(
            f"--output-dir {output_dir} holds files ({', '.join(foreign[:3])}{', ...' * (len(foreign) > 3)}) and "
            f"is not a run folder of these scripts (it has no .lock): choose a new or an empty folder"
        )
    return output_dir, resume


_RUN_DIR = {}  # "folder": the run folder (every rank); "lock": its open lock file (global rank 0)
OWN_TEMPORARY = re.compile(r"\.(last\.pt|best\.pt|results\.json|class_indices\.json)\.\d+\.tmp")  # atomic_write's


def claim_output_dir(output_dir):
    """Create the run folder and hold it until this job ends: a second job into it ends here in one line. Global rank
    0 holds a POSIX lock on .lock, which the kernel releases however the process ends (also on NFS); the other ranks
    only note the folder (dist_utils.Run.claim tells them rank 0's outcome)."""
    _RUN_DIR["folder"] = output_dir
    if int(os.environ.get("RANK", 0)) > 0:
        return
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = open(output_dir / ".lock", "a+")
    except OSError as failure:  # a read-only or full disk, a file where the folder should be
        raise UsageError(
            f"cannot write into {output_dir} ({failure.strerror or failure}): choose another "
            f"--output-dir, or make that one writable"
        ) from None
    error = hold(lock, output_dir)
    if error:
        raise UsageError(error)


def hold(lock, output_dir):
    """claim_output_dir's lock on the open .lock file, kept to the end: None, or why not (another job holds it)."""
    import fcntl

    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as failure:
        if failure.errno in (errno.EACCES, errno.EAGAIN):  # else a filesystem without locks: go on
            lock.seek(0)
            return (
                f"{output_dir} is in use by another job ({lock.read().strip() or 'its lock is held'}): let it "
                f"end (or stop it) before you resume it, or choose another --output-dir"
            )
        return None
    for stale in output_dir.glob(".*.tmp"):  # atomic_write's, left by a job killed while it wrote: only those
        if OWN_TEMPORARY.fullmatch(stale.name):
            stale.unlink(missing_ok=True)
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()
    _RUN_DIR["lock"] = lock
    atexit.register(lock.close)  # held to the end: closing it lets go of the lock
    return None


# ------------------------------------------------------------------------------------------------- data
_STATISTICS = {}  # (device, channels) -> (mean, std): built once (a tensor built from a list on a GPU waits)


def normalize(images):
    """uint8 images (0-255) normalised with ImageNet's statistics: per channel for RGB, their average for any other
    channel count (grey); float images (a dataset that normalises its own) as they are."""
    if images.dtype != torch.uint8:
        return images
    channels = images.shape[1] if images.dim() == 4 else 1
    key = (images.device, channels)
    if key not in _STATISTICS:
        _STATISTICS[key] = [
            torch.tensor(v if channels == 3 else sum(v) / 3, device=images.device).view(-1, 1, 1) for v in (MEAN, STD)
        ]
    mean, std = _STATISTICS[key]
    return images.float().div_(255).sub_(mean).div_(std)  # in place: the same values, no temporary batches


def check_datasets(train_set, val_set, names, input_problem, target_problem, collate):
    """build_datasets()'s result, checked before training: a wrong item would fail later, deep in the loader, on
    every rank. input_problem(input) and target_problem(target, names): the task block's checks, None where fine; its
    collate() must batch the first two items. Returns (training set, validation set), a stream as a Stream."""
    if len(names) < 1:
        raise UsageError("build_datasets() returned no names: give one per model output (class names for a classifier)")
    checked = []
    for name, dataset in (("training", train_set), ("validation", val_set)):
        dataset = as_dataset(dataset, f"the {name} set")
        if len(dataset) == 0:
            raise UsageError(f"the {name} set is empty; add data, or check the data's path and split")
        item = dataset[0]
        problem = pair_problem(item)
        if problem is None:
            problem = input_problem(item[0])
            problem = problem and f"({problem}, ...)"
        if problem is None:
            problem = target_problem(item[1], names)
            problem = problem and f"(input, {problem})"
        if problem:
            raise UsageError(f"the {name} set's items must be (input, target) pairs; its first is {problem}")
        try:
            collate([item, dataset[min(1, len(dataset) - 1)]])
        except Exception as error:
            raise UsageError(
                f"collate() cannot batch the {name} set's first two items ({first_line(error)}): items of different "
                f"sizes need a collate() of their own in the task block (padding, or lists: docs/adapting.md)"
            ) from None
        checked.append(dataset)
    return tuple(checked)


def as_dataset(dataset, what):
    """A map-style dataset as it is, a stream (an IterableDataset with a length) as a Stream; else one line."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        if not hasattr(dataset, "__len__"):
            raise UsageError(
                f"{what} is a stream (an IterableDataset) without __len__: give it one, its items per epoch (the steps "
                f"per epoch and the LR schedule come from it)"
            )
        return Stream(dataset)
    missing = [name for name in ("__len__", "__getitem__") if not hasattr(dataset, name)]
    if missing:
        raise UsageError(
            f"{what} is a {type(dataset).__name__} without {' and '.join(missing)}: give a map-style Dataset "
            f"(len(dataset) and dataset[index]) or a stream (an IterableDataset with __len__)"
        )
    return dataset


def pair_problem(item):
    """What is wrong with a dataset's item as the loop takes it (an input and a target), or None."""
    if isinstance(item, dict):
        return f"a dict with keys {', '.join(map(repr, item))}: return (item[input key], item[target key])"
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        return f"a {type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else "")
    return None


def image_problem(image):
    """What is wrong with an input as an image that run_model() normalises (uint8, (C, H, W)) or takes as it is
    (floating point), or None."""
    if not torch.is_tensor(image):
        kind = f"{type(image).__module__}.{type(image).__name__}"
        return (
            f"{kind}: convert the input in the dataset, e.g. torchvision.transforms.v2.ToImage() (uint8) or "
            f"torch.from_numpy(array).float()"
        )
    if image.dtype == torch.float64:  # numpy's default: a model's float32 weights refuse it
        return "float64 input: give float32, e.g. torch.from_numpy(array).float()"
    if image.dtype != torch.uint8 and not image.is_floating_point():
        return (
            f"{image.dtype} input: images are uint8 (0-255, normalised on the device) or floating point; for token "
            f"ids or other integers, write input_problem() and run_model() of your own (docs/adapting.md)"
        )
    if image.dtype == torch.uint8 and image.dim() == 3 and image.shape[-1] in (1, 3, 4) and image.shape[0] > 4:
        return (
            f"uint8 image of shape {tuple(image.shape)}: channels last (H, W, C); give (C, H, W), e.g. "
            f"torchvision.transforms.v2.ToImage() or image.permute(2, 0, 1)"
        )
    return None


LOSS_NAMES = ("loss", "losses", "aux_loss")  # what a model that computes its own loss names it (HF: .loss)


def split_outputs(outputs):
    """(main output, [auxiliary outputs]) of a model's forward: a tensor alone; a tuple or namedtuple, the main one
    first (GoogLeNet's, Inception's); a dict, the main one under "out" (torchvision's segmentation models) or
    "logits" (Hugging Face's outputs, dicts too), else the first. A loss the model returns with them (under a loss's
    name, or a 0-d tensor: no batch dimension) is neither."""
    if isinstance(outputs, dict):
        kept = {key: value for key, value in outputs.items() if key not in LOSS_NAMES and not is_scalar(value)}
        main = next((key for key in ("out", "logits") if key in kept), next(iter(kept), None))
        return kept.get(main), [value for key, value in kept.items() if key != main and value is not None]
    if isinstance(outputs, (tuple, list)):
        kept = [value for value in outputs if value is not None and not is_scalar(value)]
        return (kept[0] if kept else None), kept[1:]
    return outputs, []


def is_scalar(value):
    return torch.is_tensor(value) and value.dim() == 0


END = object()  # what next() gives at a stream's end: no stream yields it


class Stream(Dataset):
    """A stream (an IterableDataset) read as a sequence: stream[p] is item p of its epoch, read in order. Every
    process that asks for items reads the stream from its start and keeps those it was asked for: the ranks and
    loader workers share out the items, so the stream must yield all of them, every time, in the same order for the
    same epoch. len(): its items per epoch; set_epoch(epoch), where it has one, is called before each epoch."""

    def __init__(self, stream):
        self.stream = stream
        self.items = None  # the iterator over the epoch being read, by the process `reader`
        self.reader = None
        self.epoch = None
        self.next = 0  # the position of the item it gives next

    def __len__(self):
        return len(self.stream)

    def __getitem__(self, position):
        return self.item(0, position)

    def item(self, epoch, position, seed=None):
        """Item `position` of epoch `epoch`. With a seed, each item is read with the generators seeded from (seed,
        epoch, its position), so what the stream draws for it does not depend on the items skipped before it."""
        # From the start: in another epoch, for an item passed already, or in a loader worker forked from the reader
        # (a copy of its iterator would share its open files' positions)
        if epoch != self.epoch or position < self.next or self.reader != os.getpid():
            if hasattr(self.stream, "set_epoch"):
                self.stream.set_epoch(epoch)
            self.items = iter(self.stream)
            self.reader = os.getpid()
            self.epoch = epoch
            self.next = 0
        while self.next <= position:
            with seeded(seed, epoch, self.next) if seed is not None else contextlib.nullcontext():
                item = next(self.items, END)
            if item is END:
                raise UsageError(
                    f"the stream ended after {self.next} items of epoch {epoch + 1}, but its len() is {len(self)}: "
                    f"make len() its items per epoch, and yield all of them in every process (the script shares "
                    f"them out)"
                )
            self.next += 1
        return item


@contextlib.contextmanager
def seeded(seed, epoch, index):
    """torch's (CPU), Python's and numpy's generators seeded from (seed, epoch, index) within the block; torch's
    state as it was after it (with --workers 0 the training loop draws from it too: its draws stay its own)."""
    seed = hash((seed, epoch, index)) & 0xFFFF_FFFF_FFFF
    saved = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: a GPU's generator stays the training's
    random.seed(seed)
    numpy.random.seed(seed & 0xFFFF_FFFF)
    try:
        yield
    finally:
        torch.set_rng_state(saved)


class SeededItems(Dataset):
    """The training items for EpochSampler's keys (epoch, position, index): dataset[index] drawn with torch's (CPU),
    Python's and numpy's generators seeded from (seed, epoch, index), so its augmentation is the same whatever the
    workers, ranks or resumption; a Stream's item at that position of the epoch, seeded from it."""

    def __init__(self, dataset, seed):
        self.dataset = dataset
        self.seed = seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, position, index = key
        if isinstance(self.dataset, Stream):  # read in its own order: the sampler's shuffle is not used
            return self.dataset.item(epoch, position, self.seed)
        with seeded(self.seed, epoch, index):
            return self.dataset[index]


def seed_step(seed, epoch, step):
    """Seed torch (CPU and devices) from (seed, rank, epoch, step): what the model draws (Dropout, stochastic depth)
    is then the same in a resumed run as in an uninterrupted one, and each rank's own."""
    rank = int(os.environ.get("RANK", 0))  # the launcher's (require_launcher's where an engine starts the processes)
    torch.manual_seed(hash((seed, rank, epoch, step)) & 0xFFFF_FFFF_FFFF)


class EpochSampler(torch.utils.data.Sampler):
    """Wraps a training sampler: yields (epoch, position, index) for SeededItems, position the sample's place in the
    epoch's order over all processes, and can start mid-epoch after a resume."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.world_size = getattr(sampler, "num_replicas", 1)
        self.rank = getattr(sampler, "rank", 0)
        self.epoch = 0
        self.skip = 0  # positions of the sampler's order left out at the start (done before a resume)
        self.length = len(sampler)  # positions yielded

    def start(self, epoch, samples=0):
        """Start `epoch` after the first `samples` of its order. Rank r of W reads its positions r, r + W, ...: the
        samples seen do not depend on W, and every rank yields as many as rank 0."""
        self.epoch = epoch
        self.skip = max(0, samples - self.rank + self.world_size - 1) // self.world_size
        self.length = max(0, len(self.sampler) - (samples + self.world_size - 1) // self.world_size)

    def __iter__(self):
        for position, index in enumerate(self.sampler):
            if self.skip <= position < self.skip + self.length:
                yield self.epoch, position * self.world_size + self.rank, index

    def __len__(self):
        return self.length


def to_device(batch, device):
    """A batch's tensors on the device, wherever they are in it (tuples, lists, dicts: a detection batch's images
    and box dicts, padded token ids and their lengths)."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)


class Counted:
    """collate_fn for the validation loader: (the number of items, collate(items)), so that the loss and count
    weigh samples, whatever the structure of a batch's targets."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, items):
        return len(items), self.collate(items)


def loader_options(workers, device):
    """What both DataLoaders share: worker processes kept across epochs (forked once: see start_workers) that ignore
    the stop signals, and for a GPU batches in page-locked memory, copied to it while it computes."""
    return {
        "num_workers": workers,
        "pin_memory": device.type in ("cuda", "xpu"),
        "persistent_workers": workers > 0,
        "worker_init_fn": ignore_stop_signals,
    }


def steps_per_epoch(train_loader, args):
    """Optimizer steps per epoch: the loader's batches per --accum-steps (where the rung has it). None: one line."""
    accum_steps = getattr(args, "accum_steps", 1)
    steps = len(train_loader) // accum_steps
    if steps == 0 and not args.test_only:
        accumulated = f" x --accum-steps {accum_steps}" if hasattr(args, "accum_steps") else ""
        raise UsageError(
            f"--batch-size {args.batch_size}{accumulated} is more than the training images per process "
            f"({len(train_loader.sampler)}); lower {'either' if accumulated else 'it'}"
        )
    return steps


class Position:
    """Where training is: an epoch, and how many samples of its shuffled order (over all processes) are done.

    A checkpoint keeps the samples done, not the step: they are the same whatever the batch size and number of
    processes that did them, so a run resumed with other ones continues at the same sample. Its steps (the LR
    schedule, logs and checkpoints) count in its own global batch: a global step after a resume at another global
    batch is a step of this run's size."""

    def __init__(self, sampler, global_batch, steps_per_epoch):
        self.sampler = sampler  # the training loader's EpochSampler
        self.global_batch = global_batch  # samples per optimizer step, over all processes
        self.steps_per_epoch = steps_per_epoch
        # One epoch's samples over all processes: each of the world's ranks reads as many
        self.epoch_samples = len(sampler.sampler) * getattr(sampler.sampler, "num_replicas", 1)
        self.epoch = 0
        self.samples = 0

    @property
    def step(self):
        """This epoch's optimizer steps done, in this run's global batch: the index of the next one."""
        samples_left = self.epoch_samples - self.samples
        return self.steps_per_epoch - samples_left // self.global_batch

    @property
    def global_step(self):
        """Optimizer steps done since training began."""
        return self.epoch * self.steps_per_epoch + self.step

    def start_epoch(self, epoch):
        """The loader yields this epoch's order from the first sample not done: all of it, but for the epoch that a
        resume starts in."""
        self.epoch = epoch
        self.sampler.start(epoch, self.samples)

    def advance(self):
        """One optimizer step done: a global batch more of the epoch's samples."""
        self.samples += self.global_batch

    def end_epoch(self):
        """The epoch is done (and evaluated): the next one starts at its first sample."""
        self.epoch += 1
        self.samples = 0

    def state_dict(self):
        return {"epoch": self.epoch, "samples": self.samples, "global_batch": self.global_batch}

    def load_state_dict(self, state):
        """Continue where a checkpoint's run was, whatever its global batch."""
        self.epoch = state["epoch"]
        self.samples = state["samples"]

    def __str__(self):
        return f"epoch {self.epoch + 1} after {self.samples} of its {self.epoch_samples} samples"


# ------------------------------------------------------------------------------------------------ model
def train_except_frozen_batchnorm(model):
    """model.train(), but BatchNorm layers whose weights are all frozen (a frozen backbone) stay in eval mode: their
    statistics stay the ones the weights were trained with."""
    model.train()
    for module in model.modules():
        frozen = [not p.requires_grad for p in module.parameters()]
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and frozen and all(frozen):
            module.eval()


def new_stage(set_trainable, args, model, epoch):
    """set_trainable(args, model, epoch), the task block's: whether it changed which parameters train (a new stage:
    the script then wraps the model anew, where DDP's wrapper knows the trained parameters, and builds an optimizer)."""
    before = [p.requires_grad for p in model.parameters()]
    set_trainable(args, model, epoch)
    return before != [p.requires_grad for p in model.parameters()]


def warmup_cosine(total_steps):
    """LR factor per optimizer step: linear warm-up over 5% of the steps, then cosine decay to zero."""
    warmup = max(1, total_steps // 20)

    def factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    return factor


# ---------------------------------------------------------------------------------------------- checkpoints
class Run:
    """The run's bookkeeping, in one owner: where it lives (its folder, held by one job at a time), what it resumes
    from, the best value of the metric that best.pt follows, its checkpoints and its results. main() calls it in a
    few lines; dist_utils.Run adds torchrun's restarts and the ranks' agreement on the folder. Its files and lines
    come from global rank 0 alone, but for save(): the script decides who saves (FSDP's ranks all write shards)."""

    def __init__(self, args, script, metrics, run_id=None):
        """metrics: the task's Metrics class (.best names the metric best.pt follows). Nothing is written yet."""
        self.started = time.time()
        self.args = args
        self.run_id = run_id  # torchrun's, under --max-restarts: a restart continues the last.pt of its own job
        self.metric = metrics.best
        self.higher_is_better = metrics.higher_is_better
        self.dir, self.resume = resolve_run(args, script)
        self.best = None  # the best value of the metric so far
        self.classes = None
        self.resuming = ""  # for the start-up line: where a resumed run continues
        self.more = {}  # other objects whose state a checkpoint keeps (add_state)

    def load(self, classes, model, ema, position):
        """The checkpoint of --resume, if any: its weights into the model (None: they are read another way) and the
        EMA, now, before any wrapper; its position and best metric where training continues. Returns the checkpoint
        where training continues from it (the optimizer's state is loaded once it is built), else None."""
        self.classes = classes
        if self.resume is None:
            return None
        checkpoint = load_checkpoint(self.resume, classes)
        if model is not None:
            model.load_state_dict(checkpoint["model"])
        if ema is not None and checkpoint.get("ema"):
            ema.load_state_dict(checkpoint["ema"])
        if self.args.test_only:
            return None
        position.load_state_dict(checkpoint)
        self.best = checkpoint["best"]
        self.resuming = f"\nresuming from {self.resume}: {position} (at global batch {checkpoint['global_batch']})"
        return checkpoint

    def add_state(self, **objects):
        """Objects (a GradScaler, say) whose state_dict() every checkpoint also keeps, under their names."""
        self.more.update(objects)

    def optimizer_state(self, checkpoint):
        return optimizer_state(checkpoint, self.resume)

    def claim(self):
        """Hold the folder to the end of the job (a second job into it ends here, in one line); its class names."""
        claim_output_dir(self.dir)
        if int(os.environ.get("RANK", 0)) == 0:
            write_json(self.dir / "class_indices.json", dict(enumerate(self.classes)))

    def new_best(self, metrics):
        """Whether metrics beat the best so far (then they are the best): best.pt is written with this epoch."""
        if not beats_best(metrics, self.metric, self.best, self.higher_is_better):
            return False
        self.best = metrics[self.metric]
        return True

    def save(self, model, ema, optimizer, position, is_best=False):
        """last.pt (and best.pt) with everything a resume needs. model, ema, optimizer: objects whose state_dict() is
        saved, or states already taken (FSDP's full weights, its shards' folder); and those of add_state()."""
        checkpoint = {
            "model": state_of(model),
            "ema": state_of(ema),
            "optimizer": state_of(optimizer),
            **{name: state_of(value) for name, value in self.more.items()},
            **position.state_dict(),  # epoch, samples done, global batch
            "best": self.best,
            "run_id": self.run_id,
            "args": vars(self.args),
            "classes": self.classes,
        }
        save_checkpoint(checkpoint, self.dir, is_best)

    def report_test(self, metrics):
        """--test-only's outputs: results.json and one line."""
        if int(os.environ.get("RANK", 0)) == 0:
            report_test(self.dir, self.resume, metrics)

    def finish(self, metrics, img_per_s, **figures):
        """results.json and the last lines: the best and final metric, the run's figures, every validation metric."""
        if int(os.environ.get("RANK", 0)) > 0:
            return
        key = self.metric
        results = {
            f"best_{key}": self.best,
            f"final_{key}": metrics[key],
            "epochs": self.args.epochs,
            "opt": self.args.opt,
            "world_size": int(os.environ.get("WORLD_SIZE", 1)),
            **figures,
            "train_img_per_s": img_per_s,
            "wall_s": time.time() - self.started,
            **val_results(metrics),
        }
        write_json(self.dir / "results.json", results)
        print(
            f"done in {results['wall_s']:.0f}s: best val {key} {self.best:.4f}, final {metrics[key]:.4f}, "
            f"{img_per_s:.1f} img/s\n"
            f"checkpoints, results.json and TensorBoard logs in {self.dir}; "
            f"view them with: tensorboard --logdir {self.dir.parent}"
        )


def state_of(value):
    """value.state_dict() for a module, an optimizer or a scaler; a state already taken (or None) as it is."""
    return value.state_dict() if hasattr(value, "state_dict") else value


def save_checkpoint(state, output_dir, is_best=False):
    """last.pt (and best.pt) written atomically, with CPU tensors: a kill at any moment leaves the previous file.
    best.pt is written first: if that fails, last.pt still holds the state before this one, so the resumed run comes
    to this evaluation again and writes best.pt then."""
    broken = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if broken:  # never replace a good checkpoint with a diverged one
        raise UsageError(
            f"the weights are NaN or inf ({broken[0]}, {len(broken)} tensors): training diverged, "
            f"{output_dir / 'last.pt'} keeps the last good state; {DIVERGED_HINT}"
        )
    state = torch.utils._pytree.tree_map_only(torch.Tensor, lambda tensor: tensor.cpu(), state)
    first = output_dir / ("best.pt" if is_best else "last.pt")
    atomic_write(first, lambda f: torch.save(state, f))
    if is_best:  # a copy in chunks, not the whole file in memory
        with open(first, "rb") as best:
            atomic_write(output_dir / "last.pt", lambda f: shutil.copyfileobj(best, f))


def atomic_write(path, write):
    """write(file) into a temporary file beside path, then renamed over it (claim_output_dir removes the temporary
    files of a job killed while writing)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    kept = f"the previous {path.name} is intact" if path.exists() else "nothing half-written is left"
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except (OSError, RuntimeError) as error:  # torch.save reports a full disk as a RuntimeError, the OSError inside
        cause = error if isinstance(error, OSError) else error.__context__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else first_line(error)
        raise UsageError(
            f"cannot write {path} ({reason}); free space or fix the folder's permissions, then continue "
            f"with --resume auto ({kept})"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            temporary.unlink()


def write_json(path, data):
    """data as indented JSON, written atomically; a list of numbers (a row of the confusion matrix) on one line."""
    text = re.sub(
        r"\[\n\s+([-+\d.eE,\s]+?)\n\s+\]",
        lambda match: "[" + re.sub(r",\s+", ", ", match[1]) + "]",
        json.dumps(data, indent=2),
    )
    atomic_write(path, lambda f: f.write((text + "\n").encode()))


def load_file(path, flag):
    if not Path(path).is_file():
        raise UsageError(f"{flag} {path}: no such file")
    check_archive(path, flag)  # read before it is trusted: nothing inflated, every entry's CRC right
    try:  # weights_only: plain tensors and Python types only, so an untrusted file cannot run code
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):
            raise UsageError(f"{flag} {path}: not a readable checkpoint ({first_line(error)})") from None
        raise UsageError(
            f"{flag} {path}: refused as unsafe: it holds Python objects besides tensors and plain types, "
            f"and loading those could run code; give a file written by these scripts, or a plain state "
            f"dict"
        ) from None
    except Exception as error:  # a file cut short (a full disk, an interrupted copy), or not a checkpoint at all
        raise UsageError(
            f"{flag} {path}: not a readable checkpoint, perhaps cut short ({first_line(error)})"
            f"{intact_fallback(path, flag)}"
        ) from None


def check_archive(path, flag):
    """A checkpoint is a zip that torch.save writes with every entry stored, not compressed: one that would inflate
    (a crafted file: gigabytes from megabytes, which torch.load would inflate in memory) is refused from the zip's
    directory, unread, and a damaged one (a flipped bit, which torch.load does not check) by its entries' CRCs,
    read in chunks: each in one line, naming the intact fallback where there is one. A file that is not a zip is
    left to torch.load (a legacy checkpoint, or one cut short: it says so)."""
    if not zipfile.is_zipfile(path):
        return
    with zipfile.ZipFile(path) as archive:
        for entry in archive.infolist():
            if entry.compress_type != zipfile.ZIP_STORED or entry.file_size > os.path.getsize(path):
                raise UsageError(
                    f"{flag} {path}: its entry {entry.filename[-60:]} would inflate to {entry.file_size} bytes "
                    f"from {entry.compress_size} (torch.save stores, never compresses): not a checkpoint of "
                    f"these scripts, refused unread"
                )
        try:
            damaged = archive.testzip()  # the first entry whose CRC is wrong, or None
        except (OSError, zipfile.BadZipFile, EOFError) as error:  # (a local header that does not match: damaged too)
            damaged = first_line(error)
    if damaged:
        raise UsageError(f"{flag} {path}: damaged ({damaged[-60:]} fails its CRC check){intact_fallback(path, flag)}")


def intact_fallback(path, flag):
    """ "; best.pt is intact: ..." where a damaged last.pt has a best.pt beside it that is whole, else ""."""
    best = Path(path).with_name("best.pt")
    if flag != "--resume" or Path(path).name != "last.pt" or not best.is_file() or not zipfile.is_zipfile(best):
        return ""
    with zipfile.ZipFile(best) as archive:
        with contextlib.suppress(Exception):
            if archive.testzip() is None:
                return (
                    f"; {best} is intact: continue from it with --resume {best}, or start from its weights with "
                    f"--weights {best}"
                )
    return ""


def first_line(error, width=160):
    """An exception's first sentence, without a C++ source location, shortened to `width` characters."""
    line = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
    return textwrap.shorten(re.sub(r"^\[[^\]]*\] *", "", line).split(". ")[0], width, placeholder=" ...")


def optimizer_state(checkpoint, path):
    """The checkpoint's optimizer state; train_fsdp.py's last.pt names the folder of its shards instead: one line."""
    if isinstance(checkpoint["optimizer"], str):
        raise UsageError(
            f"--resume {path}: a run of train_fsdp.py (its optimizer state is sharded in {checkpoint['optimizer']}): "
            f"continue it with train_fsdp.py (bash run.sh fsdp), or start from its weights with --weights {path}"
        )
    return checkpoint["optimizer"]


def load_checkpoint(path, names):
    checkpoint = load_file(path, "--resume")
    if not isinstance(checkpoint, dict) or not {"model", "optimizer", "args", "classes"} <= checkpoint.keys():
        raise UsageError(f"--resume {path}: not a checkpoint written by these scripts (use --weights for bare weights)")
    if "samples" not in checkpoint or "best" not in checkpoint:
        raise UsageError(
            f"--resume {path}: written by an older version of these scripts; continue it with that "
            f"version, or start from its weights with --weights"
        )
    saved = checkpoint["classes"]
    if saved != names:
        missing, extra = (
            ", ".join(map(str, sorted(set(a) - set(b)))) or "none" for a, b in ((saved, names), (names, saved))
        )
        differ = (
            f"names only in the checkpoint: {missing}; only here: {extra}"
            if set(saved) != set(names)
            else "the same names in another order"
        )
        raise UsageError(
            f"--resume {path} was trained for {len(saved)} classes (outputs), not these {len(names)} "
            f"({differ}); resume with the data it was trained on"
        )
    return checkpoint


# ------------------------------------------------------------------------------------------ how a run ends
@contextlib.contextmanager
def one_line_errors():
    """Every rung's __main__: bad input, Ctrl-C, a full /dev/shm, a failure every rank meets: one line from one
    process (docs/robustness.md); anything else: its traceback. Loader workers end first. The rungs that a launcher
    starts use dist_utils.one_line_errors(), which adds a lost or silent peer and the process group's teardown."""
    status = 1

    def local_rank_0():
        """Read when needed: under srun, LOCAL_RANK is set by require_launcher(), after this block begins."""
        return int(os.environ.get("LOCAL_RANK", 0)) == 0

    try:
        yield
        status = 0
    except UsageError as error:
        if local_rank_0() or isinstance(error, OwnError):
            print(f"error: {error}", file=sys.stderr, flush=True)
        else:
            wait_to_be_stopped()
    except KeyboardInterrupt:
        if local_rank_0():
            print(
                "stopped by Ctrl-C: continue from the last checkpoint with --resume auto --output-dir <the run's "
                "folder>",
                file=sys.stderr,
            )
        status = 130
    except SystemExit as exit:  # a stop on a signal (128 + the signal), or --help
        status = exit.code
    except BaseException as error:
        if "shared memory" in str(error):  # a loader worker's batch did not fit: /dev/shm is full
            print(f"error: {shm_too_small('the loader workers of this node', 'fewer --workers')}", file=sys.stderr)
        elif line := killed_worker(error):  # one of this process's loader workers: it says so
            print(f"error: {line}", file=sys.stderr)
        elif line := failure_of_every_rank(error):  # the same on every rank: local rank 0 says it
            if local_rank_0():
                print(f"error: {line}", file=sys.stderr)
            else:
                wait_to_be_stopped()
        else:
            traceback.print_exc()
    end_loader_workers()
    sys.exit(status)


def killed_worker(error):
    """The line for a loader worker killed by a signal (most often the out-of-memory killer's SIGKILL), or None."""
    found = re.search(
        r"DataLoader worker \(pids?\(?s?\)? ([\d, ]+)\) (?:is killed by signal: ([^.\n]+)|exited unexpectedly)",
        str(error),
    )
    if not found:
        return None
    how = f"was killed by a signal ({found[2]})" if found[2] else "ended unexpectedly"
    if found[2] == "Killed":
        how = "was killed by SIGKILL, most likely by the out-of-memory killer (dmesg says which)"
    again = f" --output-dir {_RUN_DIR['folder']}" if "folder" in _RUN_DIR else ""
    return (
        f"a data loader worker of rank {os.environ.get('RANK', 0)} (pid {found[1]}) {how}: lower --workers or "
        f"--batch-size, then continue with --resume auto{again}"
    )


def failure_of_every_rank(error):
    """The line for a failure that every rank meets alike, or None."""
    text = str(error)
    if "Error(s) in loading state_dict" in text:  # a checkpoint of another model
        return (
            f"the checkpoint's weights do not fit this model ({first_line(error)}); resume with the model that "
            f"saved it, or start from its weights with --weights"
        )
    if "unexpected pos" in text and "folder" in _RUN_DIR:  # torch.save's write failed: in dcp.save (FSDP's shards)
        free = shutil.disk_usage(_RUN_DIR["folder"]).free
        return (
            f"cannot write the sharded checkpoint into {_RUN_DIR['folder']} ({free >> 20} MiB left on its disk): "
            f"free space, then continue with --resume auto (last.pt and the shards it names are intact)"
        )
    if "Weights only load failed" in text:  # an item of a sharded checkpoint (SafeLoadPlanner)
        return (
            "--resume: the sharded checkpoint holds Python objects besides tensors and plain types, and loading "
            "them could run code: refused; resume from a folder that these scripts wrote"
        )
    # The optimizer state of other parameters (DDP's and FSDP's words)
    if (
        "doesn't match the size of optimizer's group" in text
        or "different number of parameter groups" in text
        or "Missing key in checkpoint state_dict: optimizer." in text
    ):
        return (
            "--resume: the checkpoint's optimizer state is for other trained parameters (a run with another "
            "--freeze or --opt, or another build_optimizer()): resume with the same, or start from its weights "
            "with --weights (the built-in model) and --output-dir a new folder"
        )
    if "add(sparse, dense)" in text or "does not support sparse gradients" in text:  # nn.Embedding(sparse=True)
        return (
            f"a sparse gradient (an nn.Embedding(sparse=True)) reached the optimizer ({first_line(error)}): use "
            f"sparse=False, or, in build_optimizer(), SGD with weight_decay 0 for those parameters "
            f"(docs/adapting.md)"
        )
    if "Expected more than 1 value per channel when training" in text:  # BatchNorm over a batch of one value
        size = re.search(r"got input size [^\n]*", text)
        return (
            f"a BatchNorm layer saw one value per channel in training ({size[0] if size else text[:80]}): raise "
            f"--batch-size (images per process) or --img-size"
        )
    if "Expected to have finished reduction in the prior iteration" in text:  # DDP: a parameter without a gradient
        unused = re.search(r"did not receive grad for rank \d+: ([^\n]+)", text)  # their indices, or names
        which = f" ({unused[1].strip()})" if unused else ""
        return (
            f"some parameters got no gradient in the last step{which}: the model holds a module that forward() "
            f"does not use; remove it, or pass find_unused_parameters=True in the DDP(...) line "
            f"(docs/troubleshooting.md)"
        )
    return None


def wait_to_be_stopped():
    """Leave local rank 0 time to print the line: the launcher then stops every rank."""
    end_loader_workers()  # now: ended by SIGTERM in the sleep, this rank would leave them running
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(10)


def end_loader_workers():
    """Kill the loader workers: they ignore SIGTERM, and would outlive this process by up to 5 s, holding its output."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (the DataLoader's handler would report the kills below)
    for worker in multiprocessing.active_children():
        worker.kill()


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}  # preemption, Ctrl-C, a closed terminal


class StopOnSignal:
    """A stop signal is noted, not acted on at once: the loop stops at the next step or after the evaluation, saves
    there and ends in one line. Schedulers send SIGTERM (then SIGKILL after a grace period), terminals SIGINT or
    SIGHUP, to every process of the job. dist_utils.StopOnSignal adds the ranks' vote to agreed()."""

    def __init__(self):
        self.seen = []  # the signals that reached this process
        self.signum = 0  # the one it stops on (0: none)
        for signum in STOP_SIGNALS:
            signal.signal(signum, self.note)

    def note(self, signum, frame):
        self.seen.append(signum)

    def __bool__(self):
        """Whether a signal reached this process, or the ranks agreed to stop on one."""
        return bool(self.seen or self.signum)

    def agreed(self):
        """The signal to stop on (0: none): in one process, the last one it has seen."""
        self.signum = self.seen[-1] if self.seen else 0
        return self.signum

    def exit(self, step, output_dir):
        if int(os.environ.get("RANK", 0)) == 0:
            print(
                f"stopped by {signal.Signals(self.signum).name} after step {step}: checkpoint saved; continue "
                f"with --resume auto --output-dir {output_dir}",
                flush=True,
            )
        sys.exit(128 + self.signum)  # as if the signal had ended the process: 143 for SIGTERM, 130 for SIGINT


def ignore_stop_signals(worker_id):
    """worker_init_fn where StopOnSignal is used: the signals reach loader workers too, and a worker they end takes
    its process down with it. The training process decides; workers still exit when it dies."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held back since the fork by start_workers()


_SHM_BYTES = weakref.WeakKeyDictionary()  # loader -> (a batch's bytes, its prefetch factor, its batches in /dev/shm)


def start_workers(loader):
    """iter(loader), the stop signals held back while it forks the workers (until they ignore them), after one line
    if /dev/shm is too small for the batches every loader's workers hold there (a pod's 64 MB)."""
    if loader.num_workers and len(loader.dataset) and os.path.isdir("/dev/shm"):
        # The first item's bytes (SeededItems': the key (epoch, position, index)), not the sampler's first: iterating
        # a sampler draws from its generator (RandomSampler's), which would change the order it then gives
        key = (0, 0, 0) if isinstance(loader.dataset, SeededItems) else 0
        tensors = torch.utils._pytree.tree_leaves(loader.dataset[key])
        batch = sum(t.nbytes for t in tensors if torch.is_tensor(t)) * loader.batch_size
        # measured: each worker's prefetched batches and one more; the validation loader's stay there all along
        in_shm = min(loader.num_workers * loader.prefetch_factor, len(loader)) + 1
        _SHM_BYTES[loader] = (batch, loader.prefetch_factor, in_shm)
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # the processes of a node share its /dev/shm
        held = list(_SHM_BYTES.values())
        shm = shutil.disk_usage("/dev/shm").total
        if processes * sum(batch * count for batch, _, count in held) > shm:
            # a process's bytes there with w workers each: w * prefetched + one
            one = sum(batch for batch, _, _ in held)
            prefetched = sum(batch * factor for batch, factor, _ in held)
            fits = max(0, (shm // processes - one) // prefetched)  # workers per process that would fit
            raise UsageError(
                shm_too_small(f"the batches of {loader.num_workers} loader workers per process", f"--workers {fits}")
            )
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def shm_too_small(what, fewer):
    """The line for a /dev/shm too small for `what`, suggesting `fewer` (the flag that needs less of it)."""
    return (
        f"/dev/shm holds {shutil.disk_usage('/dev/shm').total >> 20} MiB, too little for {what}: mount a "
        f"memory-backed volume there (Kubernetes: an emptyDir with medium: Memory, see examples/; docker run "
        f"--shm-size=8g), or use {fewer}"
    )


# --------------------------------------------------------------------------------------------- logging
def report_test(output_dir, checkpoint, metrics):
    """--test-only's outputs: results.json and one line."""
    write_json(output_dir / "results.json", {"checkpoint": str(checkpoint), **val_results(metrics)})
    print(f"{metrics_line(metrics)}; results in {output_dir / 'results.json'}")


def val_results(metrics):
    """results.json's validation figures: val_loss, val_count, val_<each metric>."""
    return {f"val_{name}": value for name, value in metrics.items()}


def metrics_line(metrics):
    """The numbers among the metrics, in one line: "val loss 0.5123  acc 0.8235 (17 samples)"."""
    numbers = [f"{name} {value:.4f}" for name, value in metrics.items() if isinstance(value, float)]
    return f"val {'  '.join(numbers)} ({metrics['count']} samples)"


def beats_best(metrics, name, best, higher_is_better):
    """Whether metrics[name] (Metrics.best) beats the best so far (None: none yet; a NaN is beaten by any value)."""
    if name not in metrics:
        raise UsageError(f"Metrics.best is {name!r}, but the metrics are {', '.join(metrics)}: name one of them")
    if best is None or best != best:
        return True
    return metrics[name] > best if higher_is_better else metrics[name] < best


class Logger:
    """Progress lines on stdout and scalars in TensorBoard; a no-op where enabled is False (non-zero ranks)."""

    def __init__(self, output_dir, names, args, position, enabled=True):
        """args: --epochs and --print-freq; position: the run's steps per epoch, global batch and first step."""
        self.enabled = enabled
        self.epochs = args.epochs
        self.steps_per_epoch = position.steps_per_epoch
        self.names = names  # drawn on the confusion matrix's picture
        self.global_batch = position.global_batch
        self.print_freq = args.print_freq
        self.fix = "raise --workers or use faster storage"  # the advice when data loading is the bottleneck
        self.train_images = 0
        self.train_seconds = 0.0
        self.writer = None
        self.output_dir = output_dir
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step, the first step this run logs, drops what a killed run logged after its last checkpoint
            with self.writing():
                self.writer = SummaryWriter(str(output_dir), purge_step=position.global_step + 1)
            threading.excepthook = quiet_tensorboard_thread

    @contextlib.contextmanager
    def writing(self):
        """TensorBoard's writes: a full disk or a read-only folder ends the run in one line, as a checkpoint's does.
        (The writer's thread meets the error first; the next call here raises it again.)"""
        try:
            yield
        except OSError as error:
            raise UsageError(
                f"cannot write TensorBoard logs into {self.output_dir} ({error.strerror or error}); free "
                f"space or fix the folder's permissions, then continue with --resume auto (the "
                f"checkpoints are intact)"
            ) from None

    def add_training_images(self, items, epoch, count=32):
        """TensorBoard: 32 training images as the model gets them (floats scaled from min to max each), where the
        inputs are images (C, H, W) of 1 or 3 channels, and not a stream's (read in order: a pass over it)."""
        if not self.enabled or isinstance(items.dataset, Stream) or not is_image(items[(epoch, 0, 0)][0]):
            return
        picks = torch.linspace(0, len(items) - 1, min(count, len(items))).long().tolist()  # of every class
        images = [items[(epoch, i, i)][0] for i in picks]
        if all(is_image(image) and image.shape == images[0].shape for image in images):
            batch = torch.stack(images)
            if batch.is_floating_point():  # TensorBoard draws floats from 0 to 1: each image from its min to its max
                low = batch.amin(dim=(1, 2, 3), keepdim=True)
                high = batch.amax(dim=(1, 2, 3), keepdim=True)
                batch = (batch - low) / (high - low).clamp(min=1e-12)
            with self.writing():
                self.writer.add_images("train/augmented_images", batch, epoch)  # a grid, 8 a row
        if hasattr(items.dataset, "large_photo_hint"):  # (builtin.ImageFiles)
            self.fix = items.dataset.large_photo_hint() or self.fix

    def start_epoch(self, epoch, start_step=0):
        self.epoch = epoch
        self.epoch_steps = 0
        self.data_wait = 0.0
        self.last_step = start_step
        self.epoch_start = self.last_time = self.step_end = time.perf_counter()

    def timed(self, batches):
        """The loader's batches, adding up the time the training loop waits for them."""
        waiting = time.perf_counter()
        for batch in batches:
            self.data_wait += time.perf_counter() - waiting
            yield batch
            waiting = time.perf_counter()
        self.data_wait += time.perf_counter() - waiting

    def step(self, step, global_step, loss, lr):
        """After each optimizer step (`step` counts from 0 in the epoch): a line and TensorBoard's scalars every
        print_freq steps and at the epoch's end."""
        self.epoch_steps += 1
        self.step_end = now = time.perf_counter()
        if (step + 1) % self.print_freq and step + 1 != self.steps_per_epoch:
            return
        loss = loss.item()  # waits for the device: once per print_freq steps, on every rank (docs/performance.md)
        if not math.isfinite(loss):  # every rank stops here: a diverged model has NaN weights on every rank
            raise UsageError(
                f"the loss is {loss} at step {global_step} (lr {lr:.5g}): training diverged; {DIVERGED_HINT}"
            )
        if not self.enabled:
            return
        img_per_s = (step + 1 - self.last_step) * self.global_batch / (now - self.last_time)
        eta = (now - self.epoch_start) / self.epoch_steps * (self.steps_per_epoch - step - 1)
        print(
            f"epoch {self.epoch + 1}/{self.epochs}  step {step + 1}/{self.steps_per_epoch}  loss {loss:.4f}  "
            f"lr {lr:.5f}  {img_per_s:.1f} img/s  eta {eta:.0f}s",
            flush=True,
        )
        with self.writing():
            for name, value in (("loss", loss), ("lr", lr), ("img_per_s", img_per_s)):
                self.writer.add_scalar(f"train/{name}", value, global_step)
        self.last_time = now
        self.last_step = step + 1

    def end_epoch(self, global_step, metrics):
        """After each evaluation: one line, and TensorBoard's val/<name> for each number among the metrics."""
        seconds = self.step_end - self.epoch_start  # training only, not the evaluation
        self.train_seconds += seconds
        self.train_images += self.epoch_steps * self.global_batch
        if self.enabled:
            # Time the loop waited for a batch: the GPU (or CPU) idled then, unless it still had queued work
            waiting = min(1.0, self.data_wait / max(seconds, 1e-9))
            hint = f": data loading is the bottleneck; {self.fix}" if waiting > 0.1 else ""
            print(
                f"epoch {self.epoch + 1}/{self.epochs}  {metrics_line(metrics)}  train time {seconds:.1f}s, "
                f"{100 * waiting:.0f}% waiting for data{hint}",
                flush=True,
            )
            try:  # a classifier's [true, predicted] counts, names x names, are drawn
                confusion = torch.as_tensor(metrics.get("confusion", []))
            except (TypeError, ValueError):  # another task's "confusion", of another shape
                confusion = torch.zeros(0)
            with self.writing():
                self.writer.add_scalar("train/data_wait", waiting, global_step)
                for name, value in metrics.items():
                    if isinstance(value, float):
                        self.writer.add_scalar(f"val/{name}", value, global_step)
                if confusion.shape == (len(self.names), len(self.names)):
                    self.writer.add_image("val/confusion", confusion_image(confusion, self.names), global_step)
                self.writer.flush()

    def img_per_s(self):
        return self.train_images / self.train_seconds if self.train_seconds else 0.0

    def close(self):
        if self.writer:
            with self.writing():
                self.writer.close()


def is_image(value):
    return torch.is_tensor(value) and value.dim() == 3 and value.shape[0] in (1, 3)


def quiet_tensorboard_thread(hook):
    """threading.excepthook: TensorBoard's writer thread re-raises its I/O error, and Logger.writing() says it in one
    line from the main thread: the thread's own traceback would only repeat it. Any other thread's as usual."""
    if not (isinstance(hook.exc_value, OSError) and type(hook.thread).__module__.startswith("tensorboard")):
        threading.__excepthook__(hook)


def confusion_image(confusion, classes):
    """val/confusion, (3, H, W) uint8: rows true classes, columns predicted, shares white to blue (square root: small
    ones show); up to 30 classes named with each cell's %; the weakest listed beside (docs/data.md)."""
    from PIL import Image, ImageDraw, ImageFont

    n = len(confusion)
    counts = confusion.sum(dim=1).tolist()  # validation images per true class
    font = ImageFont.load_default(size=12)
    rows = confusion.double() / confusion.sum(dim=1, keepdim=True).clamp(min=1)  # each row's shares
    # each class's name (its first 24 characters) and its count of images
    labels = [f"{str(name)[:24]}{'…' * (len(str(name)) > 24)} ({count})" for name, count in zip(classes, counts)]
    blue = torch.tensor([247, 207, 148])  # 255 - (8, 48, 107): white to dark blue

    def paint(share):
        """An RGB image of shares (0 to 1): white to dark blue, by the square root."""
        return Image.fromarray((255 - share.sqrt()[..., None] * blue).byte().numpy())

    if n <= 30:  # cells that hold their %, the names beside the grid
        cell = 34
        side = 12 + int(max(map(font.getlength, labels)))
    else:  # the grid alone, about 600 pixels wide (a pixel a cell past 600 classes)
        cell = 600 // n or 1
        side = 10
    weak = [i for i in rows.diagonal().argsort().tolist() if counts[i] and rows[i, i] < 1][:20]  # with mistakes
    other = (rows[weak] - 2 * torch.eye(n)[weak]).argmax(1).tolist()  # each one's most frequent wrong prediction
    notes = (
        ["weakest classes: accuracy; most often taken for" if weak else "no validation image mistaken"]
        + [f"{rows[i, i]:.0%}  {labels[i]}: {labels[j]} {rows[i, j]:.0%}" for i, j in zip(weak, other)]
        + ["", "rows: true class (validation images), columns: predicted; % of each row"]
    )
    grid = n * cell
    canvas = Image.new(
        "RGB",
        (side + grid + 80 + int(max(map(font.getlength, notes))), side + max(grid, 22 * len(notes) + 20) + 10),
        "white",
    )
    canvas.paste(paint(rows).resize((grid, grid), Image.NEAREST), (side, side))
    canvas.paste(paint(torch.linspace(1, 0, grid)[:, None].expand(grid, 14)), (side + grid + 10, side))  # the scale
    draw = ImageDraw.Draw(canvas)
    strip = Image.new("RGB", (side, grid), "white")  # the names, pasted along both axes
    for share in (0, 0.05, 0.25, 0.5, 1):
        draw.text((side + grid + 28, side + (1 - share**0.5) * grid), f"{share:.0%}", "black", font, anchor="lm")
    if n <= 30:
        for i, j in confusion.nonzero().tolist():
            draw.text(
                (side + (j + 0.5) * cell, side + (i + 0.5) * cell),
                f"{100 * rows[i, j]:.0f}",
                "white" if rows[i, j] > 0.3 else "black",
                font,
                anchor="mm",
            )
        for i in range(n):
            ImageDraw.Draw(strip).text((6, (i + 0.5) * cell), labels[i], "black", font, anchor="lm")
    canvas.paste(strip, (0, side))
    canvas.paste(strip.rotate(90, expand=True), (side, 0))
    draw.multiline_text((side + grid + 70, side), "\n".join(notes), "black", font, spacing=8)
    return torch.from_numpy(numpy.array(canvas)).permute(2, 0, 1)


# --------------------------------------------------------------------------------------------- profiling
class Profiler:
    """--profile N: torch.profiler over N steps after 3 warm-up steps: trace.json (https://ui.perfetto.dev), the top
    operators, the peak memory (tools/profile_report.py: where the step time went, the collectives per step)."""

    def __init__(self, output_dir, steps, enabled=True):
        self.output_dir = output_dir
        self.profile = None
        if steps and enabled:  # (the accelerator's activity too: torch's default)
            schedule = torch.profiler.schedule(wait=0, warmup=3, active=steps, repeat=1)
            self.profile = torch.profiler.profile(schedule=schedule, on_trace_ready=self.report, profile_memory=True)
            self.profile.start()

    def step(self):
        if self.profile:
            self.profile.step()

    def close(self):
        if self.profile:
            self.profile.stop()

    def report(self, profile):
        trace = self.output_dir / "trace.json"
        cuda = torch.cuda.is_available()
        profile.export_chrome_trace(str(trace))
        print(
            profile.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=8)
        )
        peak = (
            f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB on the GPU"
            if cuda
            else f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB resident"
        )
        print(
            f"profile: peak memory {peak}; trace in {trace}; where the step time went, and the collectives per "
            f"step: python tools/profile_report.py {trace}",
            flush=True,
        )
