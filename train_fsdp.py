# SPDX-License-Identifier: BSD-3-Clause
"""Train a torchvision ResNet image classifier with FSDP2 (fully_shard) under torchrun.

train_ddp_torchrun.py with the model sharded, not replicated: each process holds 1/N of the parameters, gradients
and optimizer state (ZeRO-3; ZeRO-2 with --no-reshard-after-forward), or 1/(N/R) in R replicas (--hsdp R); bf16 with
BatchNorm in fp32 (--amp-dtype bf16); sharded checkpoints resume at any number of processes and mesh shape.
    torchrun --standalone --nproc-per-node=4 train_fsdp.py --amp-dtype bf16 --hsdp 2
Stopped by a signal, plain torchrun prints its own report last and exits 1; bash run.sh ends with the ranks' line
and 128 + the signal (143 for SIGTERM), as schedulers that requeue expect.
"""

import argparse
import os
import shutil
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, Subset

import dist_utils
import fsdp_utils
import guards
import reporting
import utils


# ------------------------------------------------------------------------------------------------ your task
# What a copier replaces: the task's flags, data, model, optimizer, loss and metrics, and how a batch is made and
# reaches the model. The block is the same in every train_*.py, and the code below it takes any task:
# docs/adapting.md has text, detection, streams, an EMA, a model with its own loss, fine-tuning in two stages.


def add_task_arguments(parser):
    """Your task's flags, shown by --help. Ours: the built-in image folders and ResNet (--data-path, --model, ...)."""
    import builtin  # our image folders and ResNet (builtin.py): not needed once this block is yours

    builtin.add_arguments(parser)


def build_datasets(args):
    """Your data goes here: (training set, validation set, names). A map-style Dataset (len and [index]) or a stream
    (an IterableDataset with len, read in order) of (input, target) items; the training set's random augmentation is
    seeded per sample (utils.SeededItems). names: one per model output (class names; label names for multi-label;
    what is predicted, for regression)."""
    import builtin

    return builtin.datasets(args)


def input_problem(inputs):
    """What is wrong with a dataset's input, or None: checked on the first item of each set before training. Ours:
    an image tensor (C, H, W), uint8 (run_model() normalises it) or floating point (used as it is)."""
    return utils.image_problem(inputs)


def target_problem(target, names):
    """What is wrong with a dataset's target, or None: checked on the first item of each set before training."""
    if getattr(target, "ndim", None) == 0:  # a 0-d tensor, or a numpy number
        target = target.item()
    if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target < len(names):
        return f"{target!r}: a label is an int from 0 to {len(names) - 1}, the index of its class name"
    return None


def collate(items):
    """A batch from a list of items, made in the loader's workers. It reaches the device as it is: tensors, or
    tuples, lists and dicts of them. Ours: torch's default, which stacks tensors of one size."""
    return torch.utils.data.default_collate(items)


def build_model(args, num_outputs):
    """Your model goes here: any nn.Module that maps a batch of inputs to num_outputs scores per sample (per pixel
    for segmentation). It may also return auxiliary outputs: a tuple or namedtuple (main first), or a dict ("out")."""
    import builtin

    return builtin.resnet(args.model, num_outputs, args.weights, args.freeze)


def run_model(model, inputs, targets):
    """How a batch, on the device, reaches the model; what it returns goes to compute_loss() and Metrics. Ours:
    uint8 images normalised here, a whole batch at once, then model(inputs)."""
    return model(utils.normalize(inputs))


def set_trainable(args, model, epoch):
    """Which parameters train in `epoch` (their requires_grad), set before it starts; where that changes, the script
    wraps the model anew and builds a new optimizer (fine-tuning: the head first, then all). Ours: as built."""


def build_ema(args, model):
    """An average of the weights, updated after each optimizer step and evaluated beside them (its metrics named
    ema_<name>; Metrics.best may name one), or None. Ours: none; e.g. torch.optim.swa_utils.AveragedModel."""
    return None


def build_optimizer(args, model, lr):
    """--opt sgd: SGD with momentum and weight decay on every parameter (torchvision's classification recipe).
    --opt adamw: AdamW, without weight decay on norms, biases, embeddings and tokens (its transformer recipes).
    model: yours, unwrapped, in every script. lr: this run's, for its global batch; a group given an LR of its own
    keeps it, and the schedule scales both."""
    trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if args.opt == "sgd":
        return torch.optim.SGD([p for _, p in trained], lr=lr, momentum=0.9, weight_decay=args.weight_decay)
    embeddings = [m.weight for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    tokens = ("token", "pos_embed", "pos_embedding", "position_embeddings", "relative_position_bias_table")
    decayed, not_decayed = [], []
    for name, p in trained:
        if p.ndim <= 1 or name.endswith(tokens) or any(p is e for e in embeddings):
            not_decayed.append(p)
        else:
            decayed.append(p)
    groups = [{"params": decayed}, {"params": not_decayed, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=args.weight_decay)


def lr_schedule(args, steps_per_epoch):
    """The LR factor of each optimizer step (counted from 0 over the whole run), which multiplies every group's LR.
    Ours: linear warm-up over 5 % of the steps, then cosine decay to 0."""
    return utils.warmup_cosine(args.epochs * steps_per_epoch)


def compute_loss(outputs, targets):
    """The loss of a batch: cross-entropy over the classes (per pixel for (N, C, H, W) outputs and (N, H, W) targets),
    auxiliary outputs added at 0.4 each (as PyTorch's fine-tuning tutorial trains Inception v3). None: these
    outputs hold no loss (a detection model's in evaluation); the validation loss counts the batches that have one."""
    main, auxiliary = utils.split_outputs(outputs)
    return F.cross_entropy(main, targets) + sum(0.4 * F.cross_entropy(aux, targets) for aux in auxiliary)


class Metrics:
    """Validation metrics from sums over every validation sample: update() adds a batch's, the script all-reduces
    the tensors in .sums (so the metrics are exact at any number of processes), compute() gives {name: value}. Ours:
    a confusion matrix, for the accuracy and each class's (a "confusion" metric is drawn in TensorBoard)."""

    best = "acc"  # best.pt keeps the epoch where this metric was best
    higher_is_better = True

    def __init__(self, names, device):
        self.names = names
        self.sums = {"confusion": torch.zeros(len(names), len(names), dtype=torch.int64, device=device)}

    def update(self, outputs, targets):
        predicted = utils.split_outputs(outputs)[0].argmax(dim=1)
        cells = targets.flatten() * len(self.names) + predicted.flatten()  # [true, predicted]
        self.sums["confusion"].view(-1).index_add_(0, cells, torch.ones_like(cells))

    def compute(self):
        confusion = self.sums["confusion"].cpu()
        counts = confusion.sum(dim=1).tolist()  # validation samples per class
        per_class = {}
        for i, (name, count) in enumerate(zip(self.names, counts)):
            per_class[name] = confusion[i, i].item() / count if count else None  # None: no sample of it
        return {
            "acc": confusion.trace().item() / max(1, sum(counts)),
            "per_class_acc": per_class,
            "confusion": confusion.tolist(),
        }


@utils.leaves_nothing_behind  # returns the process as it found it: a notebook may call main() again
def main(args):
    dist_utils.require_launcher("torchrun")
    args = utils.check_args(args)  # a copy, with the defaults that depend on the machine
    device = utils.get_device(args.device)
    torch.backends.cudnn.benchmark = True  # fixed shapes (drop_last): cuDNN times its kernels once, keeps the best
    # Its folder and what it resumes; torchrun --max-restarts reruns a failed job, which continues its own last.pt
    run = dist_utils.Run(args, __file__, Metrics, restarts=True)

    # One process per device. The launcher's environment tells each process its rank and the master's address.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])  # the process's index on its node: which GPU it drives
    if device.type != "cpu":  # the GPU of this process's local rank
        device = torch.device(device.type, local_rank)
        torch.accelerator.set_device_index(local_rank)
    store = dist_utils.restart_safe_store(args.dist_timeout)  # a restarted group must not read a dead attempt's keys
    # NCCL between NVIDIA or AMD GPUs, XCCL between Intel's, gloo on CPUs; bound to this process's GPU
    dist.init_process_group(
        dist.get_default_backend_for_device(device),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=args.dist_timeout),
        device_id=None if device.type == "cpu" else device,
    )

    # Data. The sample stream is a pure function of (seed, epoch, index): see utils.SeededItems.
    train_set, val_set, classes = build_datasets(args)
    # Checked now (one line, not an error deep in the loader); a stream is read as a sequence (utils.Stream)
    train_set, val_set = utils.check_datasets(train_set, val_set, classes, input_problem, target_problem, collate)
    run.describe_data(train_set, val_set)  # checkpoints keep what a resume checks, and how inputs are prepared
    val_set = utils.SeededItems(val_set, args.seed)  # what its items draw (a random flip): alike in every evaluation
    loading = utils.loader_options(args.workers, device)  # worker processes, pinned memory for a GPU
    # Each rank takes every world_size-th sample of one shared permutation, reshuffled by set_epoch each epoch.
    # drop_last: the tail that does not divide among the ranks is dropped (without it, padded with repeated samples).
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(
        utils.SeededItems(train_set, args.seed),
        args.batch_size,
        sampler=utils.EpochSampler(train_sampler),
        collate_fn=collate,
        drop_last=True,
        **loading,
    )
    # Exact evaluation: each rank scores its own slice, nothing padded (DistributedSampler would repeat samples).
    val_slice = Subset(val_set, range(rank, len(val_set), world_size))
    # (samples, batch): the loss and count weigh samples. Its workers forked now, before training starts threads.
    val_loader = DataLoader(val_slice, args.batch_size, collate_fn=utils.Counted(collate), **loading)
    utils.loader_iterator(val_loader)
    steps_per_epoch = utils.steps_per_epoch(train_loader, args)  # optimizer steps: batches / --accum-steps

    # Model
    torch.manual_seed(args.seed)
    with dist_utils.local_rank_0_first():  # --weights DEFAULT: one download per node, into its cache
        model = build_model(args, len(classes)).to(device)
    model_name = f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters)"
    ema = build_ema(args, model)  # an average of the weights, or None
    global_batch = args.batch_size * world_size * args.accum_steps
    position = utils.Position(train_loader.sampler, global_batch, steps_per_epoch)  # epoch, and its samples done
    # Resume: the weights and the position now, before the wrapper; the optimizer's state once it is built
    checkpoint = run.load(classes, model, ema, position)
    set_trainable(args, model, position.epoch)  # the parameters that train in the epoch it starts in
    if args.sync_bn and device.type != "cpu" and world_size > 1:
        # Before wrapping: BatchNorm statistics over the global batch instead of each process's share
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif args.sync_bn and rank == 0:
        print("warning: --sync-bn needs GPUs and 2+ processes (SyncBatchNorm has no CPU kernels): plain BatchNorm")
    # Shard each unit, then the root (what is left). Each rank keeps 1/world_size of the weights, all-gathers a unit
    # just before it runs and frees it after; gradients are reduce-scattered, each rank receiving its shard's. Unlike
    # DDP nothing is copied from rank 0: every rank built the same weights (same seed). The parameters are DTensors
    # then: the optimizer keeps its state (momentum) for the local shards only.
    # --amp-dtype bf16: weights gathered and computed in bf16, gradients reduced in fp32. BatchNorm stays in fp32 (its
    # statistics need the precision): each BatchNorm a unit of its own, its output cast back to bf16 for the next layer.
    bf16 = dist_utils.autocast_dtype(args.amp_dtype, device) if args.amp_dtype else None  # one line if it would crawl
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16 and torch.float32)
    # --hsdp R: R replicas, each sharded over world_size / R processes (replicate across nodes, shard within one)
    if args.hsdp and world_size % args.hsdp:
        raise guards.UsageError(f"--hsdp {args.hsdp} does not divide the {world_size} processes into replicas")
    shape = (args.hsdp, world_size // args.hsdp) if args.hsdp else (world_size,)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
    for module in [model] if ema is None else [model, ema.module]:  # an EMA's copy alike: it updates shard by shard
        # The units, each gathered whole (its size bounds the memory): the model's repeated blocks (a ResNet's residual
        # blocks, a transformer's layers), else each child that holds parameters; for other ones, list yours here
        units = fsdp_utils.units(module)
        batchnorms = [m for m in module.modules() if bf16 and isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        for unit in batchnorms + units:  # ZeRO-3 frees a unit's gathered weights after its forward; ZeRO-2 keeps them
            fully_shard(
                unit,
                mesh=mesh,
                reshard_after_forward=args.reshard_after_forward,
                mp_policy=MixedPrecisionPolicy(torch.float32, output_dtype=bf16) if unit in batchnorms else policy,
            )
        fully_shard(module, mesh=mesh, mp_policy=policy)

    # Optimizer: the LR given for a batch of 256 scales linearly with the real global batch (both optimizers).
    lr = args.lr * global_batch / 256
    optimizer = build_optimizer(args, model, lr)
    base_lrs = [group["lr"] for group in optimizer.param_groups]  # lr, or a group's own (a backbone's, say)
    schedule = lr_schedule(args, steps_per_epoch)  # LR factor per optimizer step
    if checkpoint:  # each rank reads the pieces of its own shards, whatever wrote them
        sharded = checkpoint["optimizer"]  # our last.pt names the folder of its shards (other scripts': the state)
        if not isinstance(sharded, str) or not (run.resume.parent / sharded).is_dir():  # another script's, or best.pt
            raise guards.UsageError(f"--resume {run.resume}: no sharded state beside it; use a last.pt, or --weights")
        state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
        reader = fsdp_utils.sharded_checkpoint(run.resume.parent, sharded)  # torch's own reader could run code from it
        dcp.load(state, storage_reader=reader, planner=reader.planner)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    # Every rank must train on the same data from the same point (each node may read its own disk): compare.
    dist_utils.same_on_every_rank(classes, train_set, val_set, resume_point=(position.epoch, position.samples))
    run.claim()  # one running job per folder: a second one ends here, in one line
    if rank == 0:  # only global rank 0 prints and writes files (local rank 0 exists once per node)
        print(
            f"{model_name} on {device}: {len(train_set)} training and {len(val_set)} validation samples, "
            f"{len(classes)} outputs, loader workers per process: {args.workers}; output in {run.dir}\n"
            f"global batch {global_batch} = {args.batch_size} per process x {world_size} processes x "
            f"{args.accum_steps} accumulation steps; "
            f"{args.opt} lr {args.lr:g} x {global_batch}/256 = {lr:g}{run.resuming}"
        )

    if args.test_only:
        metrics = evaluate(model, ema, val_loader, device, classes)
        run.report_test(metrics)
        return

    # Preemption (SIGTERM), Ctrl-C (SIGINT), a closed terminal (SIGHUP): the signal is noted, the ranks agree to
    # stop after the same step, rank 0 saves there, and --resume auto continues.
    stop = dist_utils.StopOnSignal()
    # Progress lines and TensorBoard on rank 0, with the loss averaged over the ranks (the global batch's loss)
    log = utils.Logger(run.dir, classes, args, position, enabled=rank == 0, mean=dist_utils.mean_over_ranks)
    log.add_training_images(train_loader.dataset, position.epoch)
    profiler = reporting.Profiler(run.dir, args.profile, enabled=rank == 0)
    metrics = None
    memory = None  # bytes of parameters, gradients and optimizer state held by this rank
    # An epoch, or its part up to an evaluation (--eval-every); --early-stop may end training sooner
    while position.epoch < args.epochs and not run.stops_early():
        epoch = position.epoch
        train_sampler.set_epoch(epoch)  # without it every epoch would repeat the first epoch's order
        position.start_epoch(epoch)  # the loader skips the samples that a resumed run had done
        utils.train_except_frozen_batchnorm(model)
        log.start_epoch(epoch, position.step)
        batches = utils.loader_iterator(train_loader)  # iter(train_loader), safe from a signal during its forks
        for micro_step, (inputs, targets) in enumerate(log.timed(batches), start=position.step * args.accum_steps):
            step, micro = divmod(micro_step, args.accum_steps)
            last_micro = micro == args.accum_steps - 1
            if step == steps_per_epoch:  # leftover micro-batches that cannot fill an optimizer step
                break
            if stop.agreed():  # a vote before each micro-step: every rank stops at the same one, saved below
                break
            if run.evaluation_due(position):  # --eval-every: evaluated below, then the epoch goes on
                break
            utils.seed_step(args.seed, epoch, micro_step)  # Dropout & co. draw from (seed, rank, step)
            inputs, targets = utils.to_device((inputs, targets), device)
            # Accumulate: reduce-scatter only on the last micro-step; before it, each rank sums its full gradients.
            model.set_requires_gradient_sync(last_micro)
            loss = compute_loss(run_model(model, inputs, targets), targets) / args.accum_steps
            loss.backward()
            if not last_micro:
                continue
            if args.clip_grad:  # the norm of the whole gradient: every rank's shards (DTensors) count
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            for group, base_lr in zip(optimizer.param_groups, base_lrs):  # a function of the step alone
                group["lr"] = base_lr * schedule(position.global_step)
            optimizer.step()
            memory = memory or fsdp_utils.shard_bytes(model, optimizer)  # what sharding saves, after the first step
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                fsdp_utils.update_average(ema, model)  # shard by shard
            position.advance()  # a global batch more of the epoch's samples done
            log.step(step, position.global_step, loss * args.accum_steps, optimizer.param_groups[0]["lr"])
            profiler.step()
            saves_now = args.save_every and position.global_step % args.save_every == 0
            if saves_now and step + 1 < steps_per_epoch:  # the epoch's end saves anyway
                save_sharded(run, model, ema, optimizer, position)

        metrics = evaluate(model, ema, val_loader, device, classes, stop)  # (cut short by a stop)
        if stop.agreed():  # stopped in the epoch or its evaluation: saved, and --resume auto continues there
            save_sharded(run, model, ema, optimizer, position)  # every rank: each writes its shards
            return stop.exit(position.global_step, run.dir)  # one line; exit status 128 + the signal
        log.end_epoch(position.global_step, metrics)
        within_epoch = run.evaluation_due(position)  # (--eval-every's: the epoch goes on after it)
        is_best = run.new_best(metrics, position.global_step)
        if not within_epoch:
            position.end_epoch()  # the next epoch starts at its first sample
        if utils.new_stage(set_trainable, args, model, position.epoch):  # other parameters train from now: FSDP
            # reduce-scatters the gradients of those that require one at each step, so the sharding stays
            optimizer = build_optimizer(args, model, lr)
            base_lrs = [group["lr"] for group in optimizer.param_groups]
        save_sharded(run, model, ema, optimizer, position, is_best)
    log.close()
    profiler.close()

    if metrics is None:  # the checkpoint had finished training already
        metrics = evaluate(model, ema, val_loader, device, classes)
    run.finish(metrics, log.img_per_s(), global_batch=global_batch, lr=lr, bytes_per_rank=memory)
    dist.destroy_process_group()  # a clean exit (after an error, one_line_errors() destroys it)


@torch.no_grad()
def evaluate(model, ema, loader, device, names, stop=None):
    """The loss and the task's metrics over every validation sample exactly once; the EMA's too, as ema_<name>."""
    averaged = {} if ema is None else evaluate(ema, None, loader, device, names, stop)
    # FSDP never syncs buffers: evaluate every slice with rank 0's BatchNorm statistics. Every forward all-gathers
    # weights, so all ranks run as many as the one with the most batches, or stop early together.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    metrics = Metrics(names, device)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # the samples, and those whose batch has a loss
    batches, last = utils.loader_iterator(loader), None
    while True:
        batch = next(batches, None)
        more = torch.tensor([batch is not None, bool(stop)], dtype=torch.int64, device=device)  # ints: any backend
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more[0] or more[1]:
            break
        samples, (inputs, targets) = batch or last  # done: its last batch again (every rank has had one at least)
        inputs, targets = utils.to_device((inputs, targets), device)
        outputs = run_model(model, inputs, targets)
        if batch is None:  # that forward pass only took part in the all-gathers
            continue
        last = batch
        loss = compute_loss(outputs, targets)
        if loss is not None:  # (None: a detection model's outputs in evaluation)
            loss_sum += loss.double() * samples
            counts[1] += samples
        counts[0] += samples
        metrics.update(outputs, targets)
    for total in (loss_sum, counts, *metrics.sums.values()):  # sums of the ranks' sums
        dist.all_reduce(total)
    if stop:  # cut short: saved, never recorded, and the task's compute() never sees empty sums
        return None
    count, counted = counts.tolist()
    metrics = {"loss": loss_sum.item() / counted if counted else None, "count": count, **metrics.compute()}
    return metrics | {f"ema_{name}": value for name, value in averaged.items()}


def save_sharded(run, model, ema, optimizer, position, is_best=False):
    """FSDP's checkpoint: every rank writes its shards to a new folder; global rank 0 then writes last.pt (and best.pt),
    the full weights and the folder's name, and removes the folder before it."""
    for buffer in model.buffers():  # FSDP never syncs buffers: save rank 0's BatchNorm statistics on every rank
        dist.broadcast(buffer, src=0)
    # The name is unique: a resume at another global batch renumbers the steps.
    folder = [run.dir / f"last-step{position.global_step}-{time.time_ns()}.dcp"]
    dist.broadcast_object_list(folder, src=0)  # rank 0's name
    dcp.save(dict(zip(("model", "optimizer"), get_state_dict(model, optimizer))), checkpoint_id=folder[0])
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=whole)
    full_ema = None if ema is None else get_model_state_dict(ema, options=whole)
    if dist.get_rank() > 0:
        return
    fsdp_utils.write_checksums(folder[0])  # each shard file's CRC, checked on resume (torch's carry none)
    run.save(full, full_ema, folder[0].name, position, is_best)
    for old in set(run.dir.glob("last-*.dcp")) - {folder[0]}:  # last.pt names the new one
        shutil.rmtree(old)


def get_args_parser():
    """Every flag of this script with its default: main(get_args_parser().parse_args([...])) from Python."""
    parser = utils.get_args_parser(__doc__.splitlines()[0])
    add_task_arguments(parser)
    parser.add_argument("--sync-bn", action="store_true", help="synchronise BatchNorm statistics across GPUs")
    parser.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--dist-timeout",
        type=int,
        default=300,
        help="seconds a collective waits for a missing rank before the job fails instead of hanging",
    )
    parser.add_argument("--amp-dtype", choices=("bf16",), help="FSDP's mixed precision, BatchNorm kept in fp32")
    parser.add_argument(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ZeRO-3: gather each unit's weights again for the backward (--no-...: ZeRO-2, keep them)",
    )
    parser.add_argument("--hsdp", type=int, default=0, metavar="R", help="HSDP: R replicas, each sharded over N/R")
    return parser


if __name__ == "__main__":
    with fsdp_utils.one_line_errors():  # bad input: one line, not a traceback; Ctrl-C: one line, exit 130
        raise SystemExit(main(get_args_parser().parse_args()))  # None, or 128 + the signal after a stop
