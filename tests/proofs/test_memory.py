"""builtin.FileList: the file list that forked DataLoader workers read without copying it."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import builtin
from support import REPO, job_env


def imagenet_like(count, classes=1000):
    return [
        (f"/data/imagenet/train/n{1440764 + i % classes:08d}/n{1440764 + i % classes:08d}_{i}.JPEG", i % classes)
        for i in range(count)
    ]


def test_samples_read_back_as_built():
    pairs = [
        ("/data/ç/é.jpg", 0),
        ("/data/日本/猫 1.png", 1),
        ("/data/a/b.JPEG", 2),
        ("/data/\udcff.jpg", 1),
        *imagenet_like(1000),
    ]
    samples = builtin.FileList(pairs)
    assert len(samples) == len(pairs)
    assert [samples[i] for i in range(len(pairs))] == list(samples) == pairs
    assert samples[-1] == pairs[-1]
    with pytest.raises(IndexError):
        samples[len(pairs)]
    assert list(builtin.FileList([])) == []


def private_dirty_mb():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Private_Dirty:")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux /proc/PID/smaps_rollup")
def test_forked_worker_reads_samples_without_copying_them():
    """A forked child reads all 300,000 samples once; its private dirty memory must stay nearly flat.

    The old layout, a list of (path, label) tuples, made the child copy 58 MB here (every read writes the
    reference counts of a tuple and its string); builtin.FileList measured 0.2 MB.
    """
    samples = builtin.FileList(imagenet_like(300_000))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child, like a DataLoader worker: read, report, and never return into pytest
        try:
            os.close(read)
            before = private_dirty_mb()
            total = 0
            for i in range(len(samples)):
                path, label = samples[i]
                total += len(path) + label
            os.write(write, f"{private_dirty_mb() - before} {total}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        growth, total = f.read().split()
    os.waitpid(pid, 0)
    assert int(total) > 300_000 * 40  # the child really read the paths
    assert float(growth) < 8, f"the child copied {float(growth):.1f} MB of the parent's memory"


READ_IN_A_PROCESS = """if True:
    import re, sys
    sys.path.insert(0, sys.argv[1])
    import builtin, guards

    def peak():  # the process's peak resident size so far, MiB
        return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read())[1]) >> 10

    if sys.argv[3] == "unchecked":  # (the control: what reading it costs without the check)
        guards.check_archive = lambda path, flag: None
    imported = peak()  # torch and torchvision (their libraries' pages resident: 0.7-1.3 GiB, by the page cache)
    try:
        if sys.argv[2].endswith(".jpg"):
            builtin.decode_image(sys.argv[2])
        else:
            guards.load_checked(sys.argv[2], "--resume")
        print("read")
    except guards.UsageError as refused:
        print(refused)
    print(peak() - imported)  # what reading the file added to the peak
"""


def test_a_file_that_would_take_gigabytes_is_refused_within_what_it_may_hold(tmp_path):
    """Memory stays bounded by what a file may honestly hold, measured by the peak resident size of a process that
    reads it: a 2 GiB file named .jpg whose header says 40 x 30 pixels (before: read whole, twice, 5.1 GB before its
    refusal) is refused from its header and its size; a 0.5 MiB checkpoint, a real torch.save whose tensor entry is
    stored compressed (512 MiB of zeros; before: 6.6 GB and 130 s for a 5.8 MB one), is refused from the zip's
    directory. Neither raises the process's peak beyond what its imports reached by 200 MiB; the same checkpoint read
    without the check adds 512 MiB (torch.load inflates it, and loads it)."""
    from PIL import Image

    image = tmp_path / "big.jpg"
    Image.new("RGB", (40, 30), "red").save(image)
    with open(image, "r+b") as file:
        file.truncate(2 << 30)  # sparse: no disk used for the zeros
    torch.save({"model": {"w": torch.zeros(128 << 20)}}, tmp_path / "stored.pt")
    crafted = tmp_path / "last.pt"
    with zipfile.ZipFile(tmp_path / "stored.pt") as stored, zipfile.ZipFile(crafted, "w") as archive:
        for entry in stored.infolist():  # the same entries, the tensor's compressed
            packed = zipfile.ZipInfo(entry.filename, entry.date_time)
            packed.compress_type = zipfile.ZIP_DEFLATED if entry.filename.endswith("/data/0") else zipfile.ZIP_STORED
            with stored.open(entry) as source, archive.open(packed, "w", force_zip64=True) as target:
                shutil.copyfileobj(source, target, 64 << 20)
    (tmp_path / "stored.pt").unlink()
    assert crafted.stat().st_size < 1 << 20

    def read(path, how="checked"):
        proc = subprocess.run(
            [sys.executable, "-c", READ_IN_A_PROCESS, str(REPO), str(path), how],
            capture_output=True,
            text=True,
            timeout=120,
            env=job_env(),
        )
        said, added = proc.stdout.splitlines()[-2:]
        return said, int(added)

    said, added = read(image)
    assert said.startswith(f"image {image} is 2048 MiB for 40 x 30 pixels, more than an image") and added < 200, said
    said, added = read(crafted)
    assert said.startswith(f"--resume {crafted}: its entry ") and "would inflate to 536870912 bytes" in said, said
    assert added < 200, added
    said, added = read(crafted, "unchecked")  # the control: the limit is one that reading it passes
    assert said == "read" and added > 500, (said, added)
