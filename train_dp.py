# SPDX-License-Identifier: BSD-3-Clause
"""Train a torchvision ResNet image classifier with nn.DataParallel over all visible GPUs, in one process.

train_single.py plus DataParallel: each step splits the batch between the GPUs and gathers the outputs on the
first one. Simple, but one Python process feeds every GPU; DistributedDataParallel (train_ddp_*.py) scales better.
    python train_dp.py                                   # on a CPU or a single GPU it runs unwrapped
"""

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

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
    guards.require_one_process()  # a launcher's RANK left in the shell would make it another process's
    args = utils.check_args(args)  # a copy, with the defaults that depend on the machine
    device = utils.get_device(args.device)
    torch.backends.cudnn.benchmark = True  # fixed shapes (drop_last): cuDNN times its kernels once, keeps the best
    run = utils.Run(args, __file__, Metrics)  # its folder, and the checkpoint it resumes

    # Data. The sample stream is a pure function of (seed, epoch, index): see utils.SeededItems.
    train_set, val_set, classes = build_datasets(args)
    # Checked now (one line, not an error deep in the loader); a stream is read as a sequence (utils.Stream)
    train_set, val_set = utils.check_datasets(train_set, val_set, classes, input_problem, target_problem, collate)
    run.describe_data(train_set, val_set)  # checkpoints keep what a resume checks, and how inputs are prepared
    val_set = utils.SeededItems(val_set, args.seed)  # what its items draw (a random flip): alike in every evaluation
    loading = utils.loader_options(args.workers, device)  # worker processes, pinned memory for a GPU
    shuffle = torch.Generator()  # reseeded every epoch, so the order depends only on (seed, epoch)
    train_sampler = torch.utils.data.RandomSampler(train_set, generator=shuffle)
    train_loader = DataLoader(
        utils.SeededItems(train_set, args.seed),
        args.batch_size,
        sampler=utils.EpochSampler(train_sampler),
        collate_fn=collate,
        drop_last=True,
        **loading,
    )
    # (samples, batch): the loss and count weigh samples. Its workers forked now, before training starts threads.
    val_loader = DataLoader(val_set, args.batch_size, collate_fn=utils.Counted(collate), **loading)
    utils.loader_iterator(val_loader)
    steps_per_epoch = utils.steps_per_epoch(train_loader, args)

    # Model
    torch.manual_seed(args.seed)
    model = build_model(args, len(classes)).to(device)
    model_name = f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters)"
    ema = build_ema(args, model)  # an average of the weights, or None
    global_batch = args.batch_size
    position = utils.Position(train_loader.sampler, global_batch, steps_per_epoch)  # epoch, and its samples done
    # Resume: the weights and the position now, before the wrapper; the optimizer's state once it is built
    checkpoint = run.load(classes, model, ema, position)
    set_trainable(args, model, position.epoch)  # the parameters that train in the epoch it starts in
    gpus = torch.cuda.device_count() if device.type == "cuda" and device.index in (None, 0) else 0
    net = model  # what runs the batches; the model itself is what is saved and loaded (no "module." prefix)
    if gpus > 1:
        net = torch.nn.DataParallel(model)  # replicas on every visible GPU; the module must be on cuda:0
    else:
        print(f"DataParallel needs 2 or more GPUs: training unwrapped on {device}")

    # Optimizer: the LR given for a batch of 256 scales linearly with the real global batch (both optimizers).
    lr = args.lr * global_batch / 256
    optimizer = build_optimizer(args, model, lr)
    base_lrs = [group["lr"] for group in optimizer.param_groups]  # lr, or a group's own (a backbone's, say)
    schedule = lr_schedule(args, steps_per_epoch)  # LR factor per optimizer step
    if checkpoint:
        optimizer.load_state_dict(run.optimizer_state(checkpoint))
    run.claim()  # one running job per folder: a second one ends here, in one line
    print(
        f"{model_name} on {device}: {len(train_set)} training and {len(val_set)} validation samples, "
        f"{len(classes)} outputs, loader workers per process: {args.workers}; output in {run.dir}\n"
        f"global batch {global_batch} split over {max(gpus, 1)} device(s); "
        f"{args.opt} lr {args.lr:g} x {global_batch}/256 = {lr:g}{run.resuming}"
    )

    if args.test_only:
        metrics = evaluate(net, ema, val_loader, device, classes)
        run.report_test(metrics)
        return

    # Preemption (SIGTERM), Ctrl-C (SIGINT), a closed terminal (SIGHUP): the signal is noted, the loop stops after
    # the step it is in and saves there, and --resume auto continues.
    stop = utils.StopOnSignal()
    log = utils.Logger(run.dir, classes, args, position)  # progress lines, TensorBoard
    log.add_training_images(train_loader.dataset, position.epoch)
    profiler = reporting.Profiler(run.dir, args.profile)
    metrics = None
    # An epoch, or its part up to an evaluation (--eval-every); --early-stop may end training sooner
    while position.epoch < args.epochs and not run.stops_early():
        epoch = position.epoch
        shuffle.manual_seed(args.seed + epoch)
        position.start_epoch(epoch)  # the loader skips the samples that a resumed run had done
        utils.train_except_frozen_batchnorm(model)
        log.start_epoch(epoch, position.step)
        batches = utils.loader_iterator(train_loader)  # iter(train_loader), safe from a signal during its forks
        for step, (inputs, targets) in enumerate(log.timed(batches), start=position.step):
            if stop.agreed():  # checked before each step: the state after the last one is saved below
                break
            if run.evaluation_due(position):  # --eval-every: evaluated below, then the epoch goes on
                break
            utils.seed_step(args.seed, epoch, step)  # Dropout & co. draw from (seed, rank, step)
            inputs, targets = utils.to_device((inputs, targets), device)
            loss = compute_loss(run_model(net, inputs, targets), targets)
            loss.backward()
            if args.clip_grad:  # the norm of the whole gradient
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
            for group, base_lr in zip(optimizer.param_groups, base_lrs):  # a function of the step alone
                group["lr"] = base_lr * schedule(position.global_step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update_parameters(model)
            position.advance()  # a global batch more of the epoch's samples done
            log.step(step, position.global_step, loss, optimizer.param_groups[0]["lr"])
            profiler.step()
            saves_now = args.save_every and position.global_step % args.save_every == 0
            if saves_now and step + 1 < steps_per_epoch:  # the epoch's end saves anyway
                run.save(model, ema, optimizer, position)

        metrics = evaluate(net, ema, val_loader, device, classes, stop)  # (cut short by a stop)
        if stop.agreed():  # stopped in the epoch or its evaluation: saved, and --resume auto continues there
            run.save(model, ema, optimizer, position)
            return stop.exit(position.global_step, run.dir)  # one line; exit status 128 + the signal
        log.end_epoch(position.global_step, metrics)
        within_epoch = run.evaluation_due(position)  # (--eval-every's: the epoch goes on after it)
        is_best = run.new_best(metrics, position.global_step)
        if not within_epoch:
            position.end_epoch()  # the next epoch starts at its first sample
        if utils.new_stage(set_trainable, args, model, position.epoch):  # other parameters train from now
            optimizer = build_optimizer(args, model, lr)
            base_lrs = [group["lr"] for group in optimizer.param_groups]
        run.save(model, ema, optimizer, position, is_best)
    log.close()
    profiler.close()

    if metrics is None:  # the checkpoint had finished training already
        metrics = evaluate(net, ema, val_loader, device, classes)
    run.finish(metrics, log.img_per_s(), global_batch=global_batch, lr=lr)


@torch.no_grad()
def evaluate(model, ema, loader, device, names, stop=None):
    """The loss and the task's metrics over every validation sample exactly once; the EMA's too, as ema_<name>."""
    averaged = {} if ema is None else evaluate(ema, None, loader, device, names, stop)
    model.eval()
    metrics = Metrics(names, device)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # the samples, and those whose batch has a loss
    for samples, (inputs, targets) in utils.loader_iterator(loader):
        if stop:  # a stop signal: the caller saves within seconds instead of finishing the evaluation
            break
        inputs, targets = utils.to_device((inputs, targets), device)
        outputs = run_model(model, inputs, targets)
        loss = compute_loss(outputs, targets)
        if loss is not None:  # (None: a detection model's outputs in evaluation)
            loss_sum += loss.double() * samples
            counts[1] += samples
        counts[0] += samples
        metrics.update(outputs, targets)
    if stop:  # cut short: saved, never recorded, and the task's compute() never sees empty sums
        return None
    count, counted = counts.tolist()
    metrics = {"loss": loss_sum.item() / counted if counted else None, "count": count, **metrics.compute()}
    return metrics | {f"ema_{name}": value for name, value in averaged.items()}


def get_args_parser():
    """Every flag of this script with its default: main(get_args_parser().parse_args([...])) from Python."""
    parser = utils.get_args_parser(__doc__.splitlines()[0])
    add_task_arguments(parser)
    return parser


if __name__ == "__main__":
    with guards.one_line_errors():  # bad input: one line, not a traceback; Ctrl-C: one line, exit 130
        raise SystemExit(main(get_args_parser().parse_args()))  # None, or 128 + the signal after a stop
