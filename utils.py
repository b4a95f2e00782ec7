# SPDX-License-Identifier: BSD-3-Clause
"""What every train_*.py's main() calls, in the order it calls it: the flags and the device, the sample stream and the
position in it, the LR schedule, the run's bookkeeping (Run: its folder, what it resumes, its checkpoints and
results), the stop on a signal and the progress log. Its refusals and one-line endings are in guards.py, the confusion
picture and the profiler in reporting.py; dist_utils.py adds what the multi-process rungs need, builtin.py holds our
image folders and ResNet."""

import argparse
import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import threading
import time

import numpy
import torch
from torch.utils.data import Dataset

import guards
import reporting
from guards import UsageError

# ImageNet's per-channel (RGB) mean and standard deviation, in 0-1
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
DIVERGED_HINT = "lower --lr, or clip the gradients (--clip-grad; with fp16, try --amp-dtype bf16)"


# ----------------------------------------------------------------------------------------- main() itself
def leaves_nothing_behind(main):
    """main(args), decorated: however it ends, it leaves the process as it found it, so that a notebook or a sweep
    can call it again: the stop signals' handlers and threading.excepthook as they were, the run folder's lock let
    go, TensorBoard's writer closed; after a return (a stop's too) no process group either. After an error the
    scripts' one_line_errors() reads the loader workers to name a killed one, then ends them and the group."""

    def group_exists():
        return torch.distributed.is_available() and torch.distributed.is_initialized()

    @functools.wraps(main)
    def called(args):
        handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
        excepthook = threading.excepthook
        caller_had_a_group = group_exists()  # (then it is the caller's, not main()'s)
        try:
            status = main(args)
            if group_exists() and not caller_had_a_group:  # main() made it: a stop's return, or --test-only's
                torch.distributed.destroy_process_group()
            return status
        finally:
            for logger in list(LOGGERS):
                with contextlib.suppress(Exception):  # (a full disk: said already, or said by the error)
                    logger.close()
            guards.release_run_folder()
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
            threading.excepthook = excepthook

    return called


# ----------------------------------------------------------------------------------------------- arguments
def get_args_parser(description):
    """The flags every rung shares; the task's own come from the script's add_task_arguments()."""
    parser = guards.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also evaluate (and save) every N optimizer steps (0: epoch ends only)",
    )
    parser.add_argument(
        "--early-stop", type=int, default=0, metavar="K", help="end training after K evaluations without a new best"
    )
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
    others = (
        "workers",
        "save_every",
        "eval_every",
        "early_stop",
        "profile",
        "seed",
        "clip_grad",
        "hsdp",
        "weight_decay",
    )
    for name in (*positive, *others):  # every rung's numbers, and the built-in task's
        value = getattr(args, name, None)  # None: a flag this rung does not have, or a default filled in below
        if value is not None and not (math.isfinite(value) and (value > 0 if name in positive else value >= 0)):
            raise UsageError(
                f"--{name.replace('_', '-')} must be {'positive' if name in positive else '0 or more'}, got {value}"
            )
    if args.seed >= 2**62:  # torch's generators take 64 bits, and the shuffle's seed is seed + epoch
        raise UsageError(f"--seed must be below 2**62, got {args.seed}")
    for name, most in (("lr", 1e30), ("weight_decay", 1e30), ("clip_grad", 1e30), ("dist_timeout", 10**9)):
        value = getattr(args, name, None)
        if value and value > most:  # past float32's range, or a timedelta's (seconds)
            raise UsageError(
                f"--{name.replace('_', '-')} {value:g} is past what training can use: give at most {most:g}"
            )
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


def get_device(requested):
    """--device, else the accelerator torch finds (CUDA, ROCm as cuda, XPU, MPS), else the CPU (docs/running.md)."""
    found = torch.accelerator.current_accelerator(check_available=True)  # None where none is usable
    launched = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if "LOCAL_RANK" in os.environ else 0
    count = torch.accelerator.device_count() if found else 0
    device = guards.choose_device(requested, found and found.type, count, launched)
    if device.index is not None:
        torch.accelerator.set_device_index(device.index)  # else pinned-memory threads and the profiler use device 0
    return device


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
                f"collate() cannot batch the {name} set's first two items ({guards.first_line(error)}): items of "
                f"different sizes need a collate() of their own in the task block (padding, or lists: docs/adapting.md)"
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
    """torch's (CPU), Python's and numpy's generators seeded from (seed, epoch, index) within the block, and as they
    were after it (with --workers 0 the training loop draws from them too: its draws stay its own)."""
    seed = hash((seed, epoch, index)) & 0xFFFF_FFFF_FFFF
    saved = torch.get_rng_state(), random.getstate(), numpy.random.get_state()
    torch.default_generator.manual_seed(seed)  # not torch.manual_seed: a GPU's generator stays the training's
    random.seed(seed)
    numpy.random.seed(seed & 0xFFFF_FFFF)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        numpy.random.set_state(saved[2])


class SeededItems(Dataset):
    """The training items for EpochSampler's keys (epoch, position, index): dataset[index] drawn with torch's (CPU),
    Python's and numpy's generators seeded from (seed, epoch, index), so its augmentation is the same whatever the
    workers, ranks or resumption; a Stream's item at that position of the epoch, seeded from it. The validation
    items for an index alone: seeded from (seed, index), the same in every evaluation and every run."""

    first_key = (0, 0, 0)  # the key of the first epoch's first item (guards.check_shm reads one item)

    def __init__(self, dataset, seed):
        self.dataset = dataset
        self.seed = seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        if not isinstance(key, tuple):  # a validation item: seeded from (seed, index) alone
            if isinstance(self.dataset, Stream):  # (its epoch 0, as a stream's validation set is read)
                return self.dataset.item(0, key, (self.seed, -1))
            with seeded(self.seed, -1, key):
                return self.dataset[key]
        epoch, position, index = key
        if isinstance(self.dataset, Stream):  # read in its own order: the sampler's shuffle is not used
            return self.dataset.item(epoch, position, self.seed)
        with seeded(self.seed, epoch, index):
            return self.dataset[index]


def seed_step(seed, epoch, step):
    """Seed torch (CPU and devices), Python's and numpy's generators from (seed, rank, epoch, step): what the model
    and run_model() draw (Dropout, stochastic depth, a mixup's lambda from `random`) is then the same in a resumed
    run as in an uninterrupted one, and each rank's own."""
    rank = int(os.environ.get("RANK", 0))  # the launcher's (require_launcher's where an engine starts the processes)
    step_seed = hash((seed, rank, epoch, step)) & 0xFFFF_FFFF_FFFF
    torch.manual_seed(step_seed)
    random.seed(step_seed)
    numpy.random.seed(step_seed & 0xFFFF_FFFF)


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
    """What both DataLoaders share: worker processes kept across epochs (forked once: see loader_iterator) that ignore
    the stop signals, and for a GPU batches in page-locked memory, copied to it while it computes."""
    return {
        "num_workers": workers,
        "pin_memory": device.type in ("cuda", "xpu"),
        "persistent_workers": workers > 0,
        "worker_init_fn": init_loader_worker,
        # forked on Linux also where this process was started by spawn (a launch from Python: docs/running.md), where
        # each worker would import torch again (seconds each); elsewhere the platform's default
        "multiprocessing_context": "fork" if workers and sys.platform.startswith("linux") else None,
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
        self.preprocessing = None  # how an input is prepared for evaluation: the validation set's, where it says
        self.data = None  # the datasets' sizes and fingerprints: a resume onto changed data is refused
        self.run_id = run_id  # torchrun's, under --max-restarts: a restart continues the last.pt of its own job
        self.metric = metrics.best
        self.higher_is_better = metrics.higher_is_better
        self.dir, self.resume = guards.resolve_run(args, script)
        self.new = not args.output_dir and self.resume is None  # runs/<script>-<date>-<time>, to be made (claim)
        self.best = None  # the best value of the metric so far
        self.evaluated_at = 0  # the global step of the last evaluation recorded
        self.evaluations_since_best = 0  # (--early-stop)
        self.classes = None
        self.resuming = ""  # for the start-up line: where a resumed run continues
        self.more = {}  # other objects whose state a checkpoint keeps (add_state)
        self.read = None  # the checkpoint to resume, where it was read already (a restart's: dist_utils.Run)

    def describe_data(self, train_set, val_set):
        """What checkpoints keep of the data: each set's size and, where it has one, its fingerprint (a hash of its
        files and labels: builtin.ImageFiles), which a resume compares; and the validation set's preprocessing, where
        it has one (docs/adapting.md: predicting from best.pt)."""
        self.preprocessing = getattr(val_set, "preprocessing", None)
        self.data = {
            "training samples": len(train_set),
            "validation samples": len(val_set),
            "training files": getattr(train_set, "fingerprint", None),
            "validation files": getattr(val_set, "fingerprint", None),
        }

    def load(self, classes, model, ema, position):
        """The checkpoint of --resume, if any: its weights into the model (None: they are read another way) and the
        EMA, now, before any wrapper; its position and best metric where training continues. Returns the checkpoint
        where training continues from it (the optimizer's state is loaded once it is built), else None."""
        self.classes = classes
        if self.resume is None:
            return None
        checkpoint = load_checkpoint(self.resume, classes, self.read)
        self.read = None
        if model is not None:
            model.load_state_dict(checkpoint["model"])
        if ema is not None and checkpoint.get("ema"):
            ema.load_state_dict(checkpoint["ema"])
        if self.args.test_only:
            saved = checkpoint.get("preprocessing", self.preprocessing)
            if saved != self.preprocessing and int(os.environ.get("RANK", 0)) == 0:
                print(
                    f"warning: {self.resume} was evaluated with inputs prepared as {saved}, this run prepares them "
                    f"as {self.preprocessing}: its metrics are not the run's; give the flags it was trained with",
                    flush=True,
                )
            return None
        saved = checkpoint.get("data", self.data)
        changed = [
            f"other {name}" if name.endswith("files") else f"{name}: {saved.get(name)} then, {value} now"
            for name, value in self.data.items()
            if saved.get(name) != value
        ]
        if changed:  # a file added or removed: the validation split shifts (training images in it), the position too
            raise UsageError(
                f"--resume {self.resume}: the data changed since it was saved ({'; '.join(changed)}): resume with "
                f"the data it was trained on, or start a new run from its weights (--weights, a new --output-dir)"
            )
        position.load_state_dict(checkpoint)
        self.best = checkpoint["best"]
        self.evaluated_at = checkpoint.get("evaluated_at", 0)
        self.evaluations_since_best = checkpoint.get("evaluations_since_best", 0)
        self.resuming = f"\nresuming from {self.resume}: {position} (at global batch {checkpoint['global_batch']})"
        return checkpoint

    def add_state(self, **objects):
        """Objects (a GradScaler, say) whose state_dict() every checkpoint also keeps, under their names."""
        self.more.update(objects)

    def optimizer_state(self, checkpoint):
        """The checkpoint's optimizer state; train_fsdp.py's last.pt names its shards' folder instead: one line."""
        if isinstance(checkpoint["optimizer"], str):
            raise UsageError(
                f"--resume {self.resume}: a run of train_fsdp.py (its optimizer state is sharded in "
                f"{checkpoint['optimizer']}): continue it with train_fsdp.py, or start from its "
                f"weights with --weights {self.resume}"
            )
        return checkpoint["optimizer"]

    def claim(self):
        """Hold the folder to the end of the job (a second job into it ends here, in one line); its class names."""
        self.dir = guards.claim_output_dir(self.dir, self.new)
        if int(os.environ.get("RANK", 0)) == 0:
            write_json(self.dir / "class_indices.json", dict(enumerate(self.classes)))

    def evaluation_due(self, position):
        """Whether --eval-every asks for an evaluation before the next step: within an epoch (its end has its own),
        and not recorded yet (a stop that cut it short leaves it to the resumed run, which makes it first)."""
        every, step = getattr(self.args, "eval_every", 0), position.global_step
        due = every and step % every == 0 and step not in (0, self.evaluated_at)
        return bool(due) and position.step < position.steps_per_epoch

    def new_best(self, metrics, step):
        """The evaluation after global step `step`, recorded: whether its metrics beat the best so far (then they are
        the best, and best.pt is written with this state)."""
        self.evaluated_at = step
        if not beats_best(metrics, self.metric, self.best, self.higher_is_better):
            self.evaluations_since_best += 1
            return False
        self.best = metrics[self.metric]
        self.evaluations_since_best = 0
        return True

    def stops_early(self):
        """Whether --early-stop K ends training here: K evaluations in a row without a new best (said on rank 0)."""
        patience = getattr(self.args, "early_stop", 0)
        if not patience or self.evaluations_since_best < patience:
            return False
        if int(os.environ.get("RANK", 0)) == 0:
            print(
                f"stopping early: val {self.metric} has not beaten its best ({self.best:.4f}) in {patience} "
                f"evaluations (--early-stop {patience})",
                flush=True,
            )
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
            "evaluated_at": self.evaluated_at,
            "evaluations_since_best": self.evaluations_since_best,
            "run_id": self.run_id,
            "args": vars(self.args),
            "classes": self.classes,
            "preprocessing": self.preprocessing,  # how an input is prepared for the model (docs/adapting.md)
            "data": self.data,  # (describe_data)
        }
        save_checkpoint(checkpoint, self.dir, is_best)

    def report_test(self, metrics):
        """--test-only's outputs: results.json and one line."""
        if int(os.environ.get("RANK", 0)) == 0:
            write_json(self.dir / "results.json", {"checkpoint": str(self.resume), **val_results(metrics)})
            print(f"{metrics_line(metrics)}; results in {self.dir / 'results.json'}")

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
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else guards.first_line(error)
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


def load_checkpoint(path, names, checkpoint=None):
    """The checkpoint at path (or the one already read from it), checked to be one of ours, for these names."""
    if checkpoint is None:
        checkpoint = guards.load_checked(path, "--resume")
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


# ------------------------------------------------------------------------------------------------ stopping
# preemption, Ctrl-C, a closed terminal, SLURM's warning before the job's time is up (sbatch --signal=USR1@N)
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}


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
        """The stop's line; returns main()'s exit status, as if the signal had ended the process: 143 for SIGTERM,
        130 for SIGINT (a notebook's Ctrl-C ends the run, not the session)."""
        if int(os.environ.get("RANK", 0)) == 0:
            print(
                f"stopped by {signal.Signals(self.signum).name} after step {step}: checkpoint saved; continue "
                f"with --resume auto --output-dir {output_dir}",
                flush=True,
            )
        return 128 + self.signum


def init_loader_worker(worker_id):
    """worker_init_fn. The stop signals reach loader workers too, and a worker they end takes its process down with
    it: workers ignore them, the training process decides, and workers still exit when it dies."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # held back since the fork by loader_iterator()
    sys.excepthook = guards.quiet_handover_to_a_killed_process  # its process killed: that process's line says it


def loader_iterator(loader):
    """iter(loader), the stop signals held back while it forks the workers (until they ignore them), after one line
    if /dev/shm is too small for the batches every loader's workers hold there (a pod's 64 MB)."""
    guards.check_shm(loader)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        iterator = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    guards.LOADER_ITERATORS.add(iterator)  # how a worker ended, where torch's error does not say (a killed worker)
    return iterator


# --------------------------------------------------------------------------------------------- logging
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


LOGGERS = (
    set()
)  # the Loggers open in this process (their writer's thread lives on): leaves_nothing_behind() closes them


class Logger:
    """Progress lines on stdout, scalars in TensorBoard and the same figures in metrics.jsonl (a JSON object a line:
    the loss, LR and speed of each printed step, the validation figures of each evaluation, each with its step and
    epoch), for your own plots or tracker; a no-op where enabled is False (non-zero ranks)."""

    def __init__(self, output_dir, names, args, position, enabled=True, mean=None):
        """args: --epochs and --print-freq; position: the run's steps per epoch, global batch and first step; mean:
        where several processes train, the loss's mean over them (every process calls step() alike)."""
        self.enabled = enabled
        self.mean = mean
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

            # purge_step, the first step this run logs, drops what a killed run logged after its last checkpoint; the
            # lines of metrics.jsonl past it go too
            with self.writing():
                self.writer = SummaryWriter(str(output_dir), purge_step=position.global_step + 1)
                self.jsonl = output_dir / "metrics.jsonl"
                if self.jsonl.exists():
                    lines = self.jsonl.read_text().splitlines(keepends=True)
                    # (a line cut short by a kill mid-write has no newline: dropped, never parsed)
                    kept = "".join(
                        line
                        for line in lines
                        if line.endswith("\n") and json.loads(line)["step"] <= position.global_step
                    )
                    atomic_write(self.jsonl, lambda f: f.write(kept.encode()))
            LOGGERS.add(self)
            threading.excepthook = reporting.quiet_tensorboard_thread

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
        if not self.enabled or isinstance(items.dataset, Stream) or not reporting.is_image(items[(epoch, 0, 0)][0]):
            return
        picks = torch.linspace(0, len(items) - 1, min(count, len(items))).long().tolist()  # of every class
        images = [items[(epoch, i, i)][0] for i in picks]
        if all(reporting.is_image(image) and image.shape == images[0].shape for image in images):
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
        if self.mean is not None:
            loss = self.mean(loss)  # the global batch's, not this rank's share's
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
            self.add_line(global_step, loss=loss, lr=lr, samples_per_s=img_per_s)
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
                numbers = {
                    name: value for name, value in val_results(metrics).items() if isinstance(value, (int, float))
                }
                self.add_line(global_step, **numbers, data_wait=waiting)
                if confusion.shape == (len(self.names), len(self.names)):
                    self.writer.add_image(
                        "val/confusion", reporting.confusion_image(confusion, self.names), global_step
                    )
                self.writer.flush()

    def add_line(self, step, **figures):
        """A line of metrics.jsonl: {"step": global step, "epoch": from 1, figures...}."""
        with open(self.jsonl, "a") as file:
            file.write(json.dumps({"step": step, "epoch": self.epoch + 1, **figures}) + "\n")

    def img_per_s(self):
        return self.train_images / self.train_seconds if self.train_seconds else 0.0

    def close(self):
        LOGGERS.discard(self)
        if self.writer:
            with self.writing():
                self.writer.close()
