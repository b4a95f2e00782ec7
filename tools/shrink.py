# SPDX-License-Identifier: BSD-3-Clause
"""A smaller copy of an image dataset, made once, for training on photos far larger than the crop.

    bash run.sh shrink SRC DST [--max-side N] [--jobs J]

Writes the same folders and file names under DST, each image's longer side at most N pixels (JPEGs stay JPEGs at
quality 90, with their EXIF and colour profile; other formats keep their format). Images already small enough are
copied unchanged. Every file is written under a hidden temporary name and renamed when complete, so a kill leaves
no partial image under a real name; run the same command again and it does only what is missing, or older than its
source. Unreadable files are reported as the training scripts report them, the others done all the same, and the
exit status is 1. SRC is only read: DST may not be SRC, lie inside it, or contain it. One shrink at a time writes
into a DST (a lock on DST/.shrink.json, which also records the options).
"""

import argparse
import fcntl
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from builtin import IMAGE_EXTENSIONS
from guards import ArgumentParser, UsageError

TEMPORARY = ".shrink-tmp"  # suffix of the hidden files being written; the training scripts skip hidden files
MAX_SIDE = 512  # twice the evaluation resize (256) of the default 224-pixel crop; about ImageNet's own 500 x 375


def main(argv=None):
    parser = ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("src", metavar="SRC", help="the dataset: class folders, or train/ and val/ of class folders")
    parser.add_argument("dst", metavar="DST", help="where the copy goes (created; may hold an earlier, partial copy)")
    parser.add_argument(
        "--max-side",
        type=int,
        default=MAX_SIDE,
        help="the longer side in pixels. For the default --img-size 224, 512 keeps a 4:3 photo's "
        "shorter side at 384, above the 256 that evaluation resizes to, and about ImageNet's size "
        "(500 x 375), where the 224-pixel recipe and the pretrained weights come from; for "
        "--img-size S, about 2.3 x S",
    )
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)), help="processes")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of the shrunk images")
    try:
        return shrink(parser.parse_args(argv))
    except UsageError as error:  # exit status 2: nothing was done (1: some images could not be read)
        print(f"error: {error}", file=sys.stderr)
        return 2


def shrink(args):
    src = Path(args.src).resolve()
    dst = Path(args.dst).resolve()
    if not src.is_dir():
        raise UsageError(f"SRC {args.src} is not a directory; give the dataset's folder")
    if dst == src or src in dst.parents or dst in src.parents:
        if dst == src:
            where = "SRC"
        elif src in dst.parents:
            where = "inside SRC"
        else:
            where = "a folder holding SRC"
        raise UsageError(f"DST {args.dst} is {where}: give a folder outside {args.src} (SRC is never written to)")
    if args.max_side < 16 or args.jobs < 1 or not 1 <= args.quality <= 100:
        raise UsageError("--max-side must be at least 16, --jobs at least 1, --quality between 1 and 100")
    jobs = []
    skipped = 0  # images done by an earlier run
    others = 0  # files that are not images
    for folder, subfolders, names in os.walk(src):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith("."))
        for name in sorted(n for n in names if not n.startswith(".")):
            if not name.lower().endswith(IMAGE_EXTENSIONS):
                others += 1
                continue
            source = Path(folder) / name
            target = dst / source.relative_to(src)
            try:  # done before: the copy carries its source's modification time
                if target.stat().st_mtime_ns >= source.stat().st_mtime_ns:
                    skipped += 1
                    continue
            except FileNotFoundError:
                pass
            jobs.append((str(source), str(target), args.max_side, args.quality))
    if not jobs and not skipped:
        raise UsageError(f"no images in {args.src} ({', '.join(IMAGE_EXTENSIONS)})")
    settings = {"max_side": args.max_side, "quality": args.quality}
    made = dst / ".shrink.json"
    if made.exists() and json.loads(made.read_text()) != settings:
        raise UsageError(
            f"{args.dst} holds a copy made with {json.loads(made.read_text())}, not {settings}: "
            f"give the same options to complete it, or another DST"
        )
    if not made.exists():
        dst.mkdir(parents=True, exist_ok=True)
        made.write_text(json.dumps(settings) + "\n")
    lock = open(made)  # noqa: SIM115 held until this process and its workers end, however they end
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise UsageError(f"another shrink is writing into {args.dst}: wait for it to end") from None
    for path in dst.rglob(f".*{TEMPORARY}"):  # what a killed run was writing: no other run writes here now
        path.unlink(missing_ok=True)

    counts = {"shrunk": 0, "copied": 0}
    failed = []
    start = time.perf_counter()
    progress = Progress(len(jobs))
    # Ctrl-C reaches every process of the terminal's group: the workers ignore it, and this process ends them
    with multiprocessing.get_context("fork").Pool(
        args.jobs, initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)
    ) as pool:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))  # leaves the with: the pool is ended
        try:
            for outcome, message in pool.imap_unordered(shrink_one, jobs, chunksize=2):
                if outcome == "failed":
                    failed.append(message)
                    progress.clear()
                    print(f"error: {message}", file=sys.stderr, flush=True)
                else:
                    counts[outcome] += 1
                progress.update()
        except KeyboardInterrupt:
            progress.clear()
            print("stopped by Ctrl-C: run the same command again to finish (what is done is kept)", file=sys.stderr)
            return 130
    progress.clear()
    seconds = time.perf_counter() - start
    print(
        f"shrink: {len(jobs) + skipped} images in {args.src}: {counts['shrunk']} shrunk to at most "
        f"{args.max_side} px, {counts['copied']} copied unchanged (small enough), {skipped} done before, "
        f"{len(failed)} unreadable"
        + (f"; {len(jobs) / max(seconds, 1e-9):.1f} images/s" if jobs else "")
        + (f"; {others} other files left out" if others else "")
    )
    if failed:
        print(
            f"shrink: {len(failed)} of {len(jobs) + skipped} images could not be read (above): remove or replace "
            f"them in {args.src}, then run the same command again",
            file=sys.stderr,
        )
        return 1
    print(f"train on the copy with --data-path {args.dst}")
    return 0


def shrink_one(job):
    """One image: ('shrunk' | 'copied' | 'failed', message). Written to a hidden temporary file, renamed when done."""
    source, target, max_side, quality = job
    target = Path(target)
    temporary = target.with_name(f".{target.name}.{os.getpid()}{TEMPORARY}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with Image.open(source) as image:
            if max(image.size) <= max_side:
                image.load()  # decodes it: an unreadable file is reported, not copied
                shutil.copyfile(source, temporary)
                outcome = "copied"
            else:
                # on a JPEG, thumbnail() first decodes at 1/2, 1/4 or 1/8 scale where that keeps twice the target size
                if image.format in ("JPEG", "MPO"):
                    kind = "JPEG"
                    extra = {"quality": quality}
                else:
                    kind = image.format
                    extra = {}
                extra.update({key: image.info[key] for key in ("exif", "icc_profile") if image.info.get(key)})
                image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
                image.save(temporary, kind, **extra)
                outcome = "shrunk"
        stat = os.stat(source)
        os.utime(temporary, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the source's time: a newer source is redone
        os.replace(temporary, target)
        return outcome, None
    except Exception as error:  # noqa: BLE001 (whatever fails to read, the file is reported)
        temporary.unlink(missing_ok=True)
        reason = str(error).splitlines()[0] if str(error) else repr(error)
        return "failed", f"cannot decode image {source} ({reason}); remove or replace the file"


class Progress:
    """A bar with the rate and the time left, on stderr: redrawn in place on a terminal, else a line every 10 s."""

    def __init__(self, total):
        self.total = total
        self.done = 0
        self.start = time.perf_counter()
        self.shown = 0.0  # when the bar was last drawn
        self.tty = sys.stderr.isatty()

    def update(self):
        self.done += 1
        now = time.perf_counter()
        if now - self.shown < (0.2 if self.tty else 10) and self.done < self.total:
            return
        self.shown = now
        rate = self.done / max(now - self.start, 1e-9)
        left = (self.total - self.done) / rate
        bar = "#" * (30 * self.done // self.total)
        line = (
            f"shrink: [{bar:<30}] {self.done}/{self.total} images {100 * self.done // self.total}%  "
            f"{rate:.1f} images/s  eta {int(left // 60)}:{int(left % 60):02d}"
        )
        print(f"\r{line}\033[K" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def clear(self):
        if self.tty and self.shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
