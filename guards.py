# SPDX-License-Identifier: BSD-3-Clause
"""Hardening, in one place: what a user or the machine gives that would go wrong (a launcher's variables left in a
shell, a missing GPU, someone's folder, a folder in use, a damaged or crafted file) is refused, and what goes wrong
anyway (bad input, Ctrl-C, a killed loader worker, a full /dev/shm) ends in one line from one process, not a
traceback from every rank. The loop's helpers (utils.py) call it; it imports nothing of these scripts.

dist_utils.py and fsdp_utils.py add the lines for what only several processes meet."""

import argparse
import atexit
import contextlib
import errno
import itertools
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import textwrap
import time
import traceback
import weakref
import zipfile
from pathlib import Path

import torch


# -------------------------------------------------------------------------------------------------- errors
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


# ----------------------------------------------------------------------------- the launcher and the device
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
            f"(train_ddp_torchrun.py)"
        )


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
        if device.index:  # (cpu:0 is the CPU too)
            raise UsageError(f"--device {requested}: the CPU is one device; use --device cpu")
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


# ------------------------------------------------------------------------------------------ the run folder
def resolve_run(args, script):
    """(output folder, checkpoint to resume), without touching the disk: a new folder by default. A run writes only
    into a new or empty folder, a run folder of these scripts (its .lock) or the folder of the checkpoint it resumes,
    and one holding a checkpoint or results only when it resumes it: it never overwrites what it did not write."""
    try:
        return resolve_run_folder(args, script)
    except OSError as error:  # a name too long, a folder that cannot be read
        raise UsageError(
            f"--output-dir {str(args.output_dir)[:80]}{'...' * (len(str(args.output_dir)) > 80)}: "
            f"{error.strerror or error}; choose another folder"
        ) from None


def resolve_run_folder(args, script):
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


def claim_output_dir(output_dir, new=False):
    """Create the run folder and hold it until this job ends: a second job into it ends here in one line. Global rank
    0 holds a POSIX lock on .lock, which the kernel releases however the process ends (also on NFS); the other ranks
    only note the folder (dist_utils.Run.claim tells them rank 0's outcome). new: a default folder, made here as a new
    one: where a job of a sweep started in the same second made it first, the next name (-2, -3, ...). Returns the
    folder."""
    _RUN_DIR["folder"] = output_dir
    if int(os.environ.get("RANK", 0)) > 0:
        return output_dir
    try:
        if new:
            output_dir = _RUN_DIR["folder"] = make_new_folder(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        lock = open(output_dir / ".lock", "a+")
    except OSError as failure:  # a read-only or full disk, a file where the folder should be
        raise UsageError(
            f"cannot write into {output_dir} ({failure.strerror or failure}): choose another "
            f"--output-dir, or make that one writable"
        ) from None
    error = lock_run_folder(lock, output_dir)
    if error:
        raise UsageError(error)
    return output_dir


def make_new_folder(folder):
    """folder, made by this process; where another made it first (a job of a sweep started in the same second),
    folder-2, folder-3, ...: the one this process made."""
    for n in itertools.count(1):
        candidate = folder if n == 1 else folder.with_name(f"{folder.name}-{n}")
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:
            continue


def lock_run_folder(lock, output_dir):
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


def release_run_folder():
    """Let go of the run folder's lock (main()'s end, from a notebook: its next run may resume the folder)."""
    lock = _RUN_DIR.pop("lock", None)
    if lock is not None:
        atexit.unregister(lock.close)
        lock.close()


# ---------------------------------------------------------------------------------------------- files read
def load_checked(path, flag):
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


# ------------------------------------------------------------------------------------------ how a run ends
@contextlib.contextmanager
def one_line_errors(*every_rank_lines):
    """Every rung's __main__: bad input, Ctrl-C, a full /dev/shm, a failure every rank meets: one line from one
    process (docs/robustness.md); anything else: its traceback. Loader workers end on every exit. every_rank_lines: more
    functions that give the line for an error every rank meets alike, or None (DDP's and FSDP's, from
    dist_utils.one_line_errors(), which adds a lost or silent peer and the process group's teardown)."""
    status = 1

    def local_rank_0():
        """Read when needed: under srun, LOCAL_RANK is set by require_launcher(), after this block begins."""
        return int(os.environ.get("LOCAL_RANK", 0)) == 0

    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = DroppedWhenGone(sys.stdout), DroppedWhenGone(sys.stderr)  # a closed terminal, | head
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
        # torch's loader handler would raise again for a worker that dies while this reports
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if "shared memory" in str(error):  # a loader worker's batch did not fit: /dev/shm is full
            print(f"error: {shm_too_small('the loader workers of this node', 'fewer --workers')}", file=sys.stderr)
        elif line := killed_worker(error):  # one of this process's loader workers: it says so
            print(f"error: {line}", file=sys.stderr)
        elif line := next(filter(None, (say(error) for say in (failure_of_every_rank, *every_rank_lines))), None):
            # the same on every rank: local rank 0 says it
            if local_rank_0():
                print(f"error: {line}", file=sys.stderr)
            else:
                wait_to_be_stopped()
        else:
            traceback.print_exc()
    finally:
        end_loader_workers()  # whatever the report met: live workers ignore SIGTERM, and the exit would wait for them
        sys.stdout, sys.stderr = streams
    sys.exit(status)


class DroppedWhenGone:
    """A script's sys.stdout or sys.stderr: once what it writes to has gone, a terminal closed (EIO, with SIGHUP) or
    a reader that ended (EPIPE: `python train_single.py | head`), the rest goes to /dev/null instead of failing the
    run before it saves (the stop's checkpoint, or training on to its end)."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except OSError:
            self.gone()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except OSError:
            self.gone()

    def gone(self):
        """Its file descriptor onto /dev/null: what is left in the buffer, and Python's flush at exit, go there."""
        with contextlib.suppress(OSError, ValueError, AttributeError):  # (a stream without a descriptor: pytest's)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def __getattr__(self, name):  # the rest as the stream has it (isatty, fileno, encoding, ...)
        return getattr(self.stream, name)


def killed_worker(error):
    """The line for a loader worker killed by a signal (most often the out-of-memory killer's SIGKILL), or None."""
    found = re.search(
        r"DataLoader worker \(pids?\(?s?\)? ([\d, ]+)\) (?:is killed by signal: ([^.\n]+)|exited unexpectedly)",
        str(error),
    )
    if found:
        # torch's SIGCHLD handler names the signal; its other path ("exited unexpectedly") does not: the worker's
        # process object, kept by the loader's iterator, knows
        pid, signum = found[1], found[2] or worker_signal(int(found[1].split(",")[0]))
    elif isinstance(error, (ConnectionError, EOFError)) and (dead := worker_ended_by_a_signal(patience=2)):
        # a batch's handover from a worker killed mid-way, before torch has noticed the worker is gone
        pid, signum = dead
    else:
        return None
    how = f"was killed by a signal ({signum})" if signum else "ended unexpectedly"
    if signum in ("Killed", "SIGKILL"):
        how = "was killed by SIGKILL, most likely by the out-of-memory killer (dmesg says which)"
    again = f" --output-dir {_RUN_DIR['folder']}" if "folder" in _RUN_DIR else ""
    return (
        f"a data loader worker of rank {os.environ.get('RANK', 0)} (pid {pid}) {how}: lower --workers or "
        f"--batch-size, then continue with --resume auto{again}"
    )


OTHER_OPTIMIZER_STATE = (
    "--resume: the checkpoint's optimizer state is for other trained parameters (a run with another --freeze or "
    "--opt, or another build_optimizer()): resume with the same, or start from its weights with --weights (the "
    "built-in model) and --output-dir a new folder"
)


def run_dir():
    """The run folder of this process (claim_output_dir's), or None before it is known."""
    return _RUN_DIR.get("folder")


def failure_of_every_rank(error):
    """The line for a failure that every rank meets alike, or None."""
    text = str(error)
    if "Error(s) in loading state_dict" in text:  # a checkpoint of another model
        return (
            f"the checkpoint's weights do not fit this model ({first_line(error)}); resume with the model that "
            f"saved it, or start from its weights with --weights"
        )
    if "doesn't match the size of optimizer's group" in text or "different number of parameter groups" in text:
        return OTHER_OPTIMIZER_STATE  # the optimizer state of other parameters
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
    return None


def wait_to_be_stopped():
    """Leave local rank 0 time to print the line: the launcher then stops every rank."""
    end_loader_workers()  # now: ended by SIGTERM in the sleep, this rank would leave them running
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(10)


LOADER_ITERATORS = weakref.WeakSet()  # this process's loader iterators (utils.loader_iterator's): their workers


def loader_workers():
    """The worker processes of this process's loader iterators."""
    return [worker for iterator in list(LOADER_ITERATORS) for worker in getattr(iterator, "_workers", ())]


def worker_signal(pid):
    """The name of the signal that ended loader worker `pid`, or None."""
    for worker in loader_workers():
        if worker.pid == pid and (worker.exitcode or 0) < 0:
            return signal.Signals(-worker.exitcode).name
    return None


def worker_ended_by_a_signal(patience):
    """(pid, signal name) of a loader worker of this process that a signal ended, waiting up to `patience` s for one,
    or None. A killed worker's sockets close a moment before the kernel reports it ended: its batch's handover fails
    first (ConnectionResetError, EOFError), and torch, finding the worker alive, raises that."""
    workers = loader_workers()
    deadline = time.monotonic() + patience
    while workers:
        for worker in workers:
            if (worker.exitcode or 0) < 0:
                return worker.pid, signal.Signals(-worker.exitcode).name
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return None


def quiet_handover_to_a_killed_process(kind, value, tb):
    """sys.excepthook in a loader worker. A batch's shared memory reaches the training process as a file descriptor
    that multiprocessing's resource_sharer thread hands over; when that process is killed mid-handover (the OOM
    killer), the thread's ConnectionResetError traceback would stand beside the one line that names the kill."""
    handover = tb is not None and tb.tb_frame.f_globals.get("__name__") == "multiprocessing.resource_sharer"
    if not (handover and issubclass(kind, (ConnectionError, EOFError))):
        sys.__excepthook__(kind, value, tb)


def end_loader_workers():
    """Kill the loader workers: they ignore SIGTERM, and would outlive this process by up to 5 s, holding its output."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # (the DataLoader's handler would report the kills below)
    for worker in multiprocessing.active_children():
        worker.kill()


_SHM_BYTES = weakref.WeakKeyDictionary()  # loader -> (a batch's bytes, its prefetch factor, its batches in /dev/shm)


# ------------------------------------------------------------------------------------------------ /dev/shm
def check_shm(loader):
    """One line where /dev/shm is too small for the batches that every loader's workers hold there (a pod's 64 MB)."""
    if loader.num_workers and len(loader.dataset) and os.path.isdir("/dev/shm"):
        # The first item's bytes (SeededItems' key: (epoch, position, index)), not the sampler's first: iterating
        # a sampler draws from its generator (RandomSampler's), which would change the order it then gives
        key = getattr(loader.dataset, "first_key", 0)
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


def shm_too_small(what, fewer):
    """The line for a /dev/shm too small for `what`, suggesting `fewer` (the flag that needs less of it)."""
    return (
        f"/dev/shm holds {shutil.disk_usage('/dev/shm').total >> 20} MiB, too little for {what}: mount a "
        f"memory-backed volume there (Kubernetes: an emptyDir with medium: Memory, see examples/; docker run "
        f"--shm-size=8g), or use {fewer}"
    )
