"""Train a torchvision ResNet image classifier with nn.DataParallel over all visible GPUs, in one process.

train_single.py plus DataParallel: each step splits the batch between the GPUs and gathers the outputs on the
first one. Simple, but one Python process feeds every GPU; DistributedDataParallel (train_ddp_*.py) scales better.
    python train_dp.py                                   # on a CPU or a single GPU it runs unwrapped
"""
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import utils


def build_datasets(args):
    """Your data goes here: (training set, validation set, class names). Any map-style Dataset of (image tensor, int
    label) items works: uint8 images are normalised on the device, float images used as given; the training set's
    random augmentation is seeded per sample (utils.SeededItems). See docs/adapting.md."""
    import builtin  # our image folders (builtin.py): not needed once this function is yours
    classes, train_files, val_files = builtin.find_images(args.data_path or builtin.demo_data(), args.val_fraction)
    return (builtin.ImageFiles(train_files, args.img_size, train=True),
            builtin.ImageFiles(val_files, args.img_size, train=False), classes)


def build_model(args, num_classes):
    """Your model goes here: any nn.Module that maps a batch of images to num_classes logits."""
    import builtin  # torchvision's ResNet and its weights (builtin.py): not needed once this function is yours
    return builtin.resnet(args.model, num_classes, args.weights, args.freeze)


def main(args):
    start_time = time.time()
    utils.check_args(args)
    device = utils.get_device(args.device)
    torch.backends.cudnn.benchmark = True  # fixed shapes (drop_last): cuDNN times its kernels once, keeps the best
    output_dir, resume = utils.resolve_run(args, __file__)

    # Data. The sample stream is a pure function of (seed, epoch, index): see utils.SeededItems.
    train_set, val_set, classes = build_datasets(args)
    utils.check_datasets(train_set, val_set, classes)  # (image tensor, int label) items: else one line now
    pin = device.type in ("cuda", "xpu")  # batches in page-locked memory: copied to the GPU while it computes
    shuffle = torch.Generator()  # reseeded every epoch, so the order depends only on (seed, epoch)
    train_sampler = torch.utils.data.RandomSampler(train_set, generator=shuffle)
    train_loader = DataLoader(utils.SeededItems(train_set, args.seed), args.batch_size,
                              sampler=utils.EpochSampler(train_sampler), num_workers=args.workers, drop_last=True,
                              pin_memory=pin, persistent_workers=args.workers > 0)
    # Persistent, and its workers forked now, before training starts more threads: a fork copies only the forking
    # thread, and a lock another thread held stays locked in the child (docs/robustness.md)
    val_loader = DataLoader(val_set, args.batch_size, num_workers=args.workers, pin_memory=pin,
                            persistent_workers=args.workers > 0)
    utils.start_workers(val_loader)
    steps_per_epoch = len(train_loader)
    epoch_samples = len(train_sampler)  # one epoch's samples
    if steps_per_epoch == 0 and not args.test_only:
        raise utils.UsageError(f"--batch-size {args.batch_size} is more than the training images per process "
                               f"({len(train_loader.sampler)}); lower it")

    # Model
    torch.manual_seed(args.seed)
    model = build_model(args, len(classes)).to(device)
    model_name = f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)"
    model_without_dp = model  # saved and loaded as is: no "module." prefix in the checkpoints
    gpus = torch.cuda.device_count() if device.type == "cuda" and device.index in (None, 0) else 0
    if gpus > 1:
        model = torch.nn.DataParallel(model)  # replicas on every visible GPU; the module must be on cuda:0
    else:
        print(f"DataParallel needs 2 or more GPUs: training unwrapped on {device}")

    # Optimizer: the LR given for a batch of 256 scales linearly with the real global batch.
    global_batch = args.batch_size
    lr = args.lr * global_batch / 256
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr, momentum=0.9,
                                weight_decay=1e-4)
    schedule = utils.warmup_cosine(args.epochs * steps_per_epoch)  # LR factor per optimizer step

    start_epoch, start_samples, best_acc, resumed = 0, 0, -1.0, ""
    if resume:
        checkpoint = utils.load_checkpoint(resume, args.model, classes)
        model_without_dp.load_state_dict(checkpoint["model"])
        if not args.test_only:
            optimizer.load_state_dict(checkpoint["optimizer"])
            start_epoch, start_samples, best_acc = checkpoint["epoch"], checkpoint["samples"], checkpoint["best_acc"]
            resumed = (f"\nresuming from {resume}: epoch {start_epoch + 1} after {start_samples} of its "
                       f"{epoch_samples} samples (at global batch {checkpoint['global_batch']})")
    # The first step to run: the samples done are the same whatever the batch size and processes that did
    # them, and this run's steps (its LR schedule, logs and checkpoints) count in its own global batch.
    start_step = steps_per_epoch - (epoch_samples - start_samples) // global_batch
    utils.claim_output_dir(output_dir)  # one running job per folder: a second one ends here, in one line
    utils.write_json(output_dir / "class_indices.json", dict(enumerate(classes)))
    print(f"{model_name} on {device}: {len(train_set)} training and {len(val_set)} validation images, "
          f"{len(classes)} classes, loader workers per process: {args.workers}; output in {output_dir}\n"
          f"global batch {global_batch} split over {max(gpus, 1)} device(s); "
          f"lr {args.lr} x {global_batch}/256 = {lr:g}{resumed}")

    if args.test_only:
        val_loss, val_acc, val_count, confusion = evaluate(model, val_loader, device, len(classes))
        utils.report_test(output_dir, resume, classes, val_loss, val_acc, val_count, confusion)
        return

    def save(epoch, samples, is_best=False):  # samples: how far into the epoch's shuffled order training is
        utils.save_checkpoint({"model": model_without_dp.state_dict(), "optimizer": optimizer.state_dict(),
                               "epoch": epoch,
                               "samples": samples, "global_batch": global_batch, "best_acc": best_acc,
                               "args": vars(args), "classes": classes}, output_dir, is_best)

    log = utils.Logger(output_dir, classes, args.epochs, steps_per_epoch, global_batch, args.print_freq,
                       purge_step=start_epoch * steps_per_epoch + start_step + 1)
    log.add_training_images(train_loader.dataset, start_epoch)
    profiler = utils.Profiler(output_dir, args.profile)
    val_acc = None
    for epoch in range(start_epoch, args.epochs):
        shuffle.manual_seed(args.seed + epoch)
        train_loader.sampler.start(epoch, start_samples)
        utils.train_mode(model, args.freeze)
        log.start_epoch(epoch, start_step)
        samples = start_samples
        for step, (images, labels) in enumerate(log.timed(train_loader), start=start_step):
            utils.seed_step(args.seed, epoch, step)  # Dropout & co. draw from (seed, rank, step)
            images = utils.normalize(images.to(device, non_blocking=True))
            labels = labels.to(device, non_blocking=True)
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            global_step = epoch * steps_per_epoch + step + 1
            for group in optimizer.param_groups:  # the LR is a function of the step alone: nothing to checkpoint
                group["lr"] = lr * schedule(global_step - 1)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            samples += global_batch
            log.step(step, global_step, loss, optimizer.param_groups[0]["lr"])
            profiler.step()
            if args.save_every and global_step % args.save_every == 0 and step + 1 < steps_per_epoch:
                save(epoch, samples)
        start_step, start_samples = 0, 0

        val_loss, val_acc, val_count, confusion = evaluate(model, val_loader, device, len(classes))
        log.end_epoch(global_step, val_loss, val_acc, val_count, confusion)
        is_best = val_acc > best_acc
        best_acc = max(best_acc, val_acc)
        save(epoch + 1, 0, is_best)
    log.close()
    profiler.close()

    if val_acc is None:  # the checkpoint had finished training already
        val_loss, val_acc, val_count, confusion = evaluate(model, val_loader, device, len(classes))
    results = {"best_acc": best_acc, "final_acc": val_acc, "val_loss": val_loss, "val_count": val_count,
               "epochs": args.epochs, "global_batch": global_batch, "lr": lr,
               "train_img_per_s": log.img_per_s(), "wall_s": time.time() - start_time,
               **utils.class_results(confusion, classes)}
    utils.write_json(output_dir / "results.json", results)
    print(f"done in {results['wall_s']:.0f}s: best val acc {100 * best_acc:.2f}%, final {100 * val_acc:.2f}%, "
          f"{results['train_img_per_s']:.1f} img/s\n"
          f"{utils.weakest_classes(results['per_class_acc'])} (per class in results.json)\n"
          f"checkpoints, results.json and TensorBoard logs in {output_dir}; "
          f"view them with: tensorboard --logdir {output_dir.parent}")


@torch.no_grad()
def evaluate(model, loader, device, num_classes):
    """Loss, top-1 accuracy and confusion matrix over every validation image exactly once."""
    model.eval()
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)  # [true, predicted] counts
    for images, labels in loader:
        images = utils.normalize(images.to(device, non_blocking=True))
        labels = labels.to(device, non_blocking=True)
        logits = model(images)
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum")
        confusion.view(-1).index_add_(0, labels * num_classes + logits.argmax(dim=1), torch.ones_like(labels))
    confusion = confusion.cpu()
    count = int(confusion.sum())  # every prediction; the right ones are the diagonal
    return loss_sum.item() / count, confusion.trace().item() / count, count, confusion


if __name__ == "__main__":
    parser = utils.get_args_parser(__doc__.splitlines()[0])
    with utils.one_line_errors():  # bad input: one line, not a traceback; Ctrl-C: one line, exit 130
        main(parser.parse_args())
