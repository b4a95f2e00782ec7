"""builtin.FileList: the file list that forked DataLoader workers read without copying it."""

import os
import subprocess
import sys
import zipfile

import pytest

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
    import resource, sys
    sys.path.insert(0, sys.argv[1])
    import builtin, utils
    try:
        builtin.decode_image(sys.argv[2]) if sys.argv[2].endswith(".jpg") else utils.load_file(sys.argv[2], "--resume")
        print("read")
    except utils.UsageError as refused:
        print(refused)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)  # peak resident MiB
"""


def test_a_file_that_would_take_gigabytes_is_refused_within_what_it_may_hold(tmp_path):
    """Memory stays bounded by what a file may honestly hold, measured as the peak resident size of a process that
    reads it: a 2 GiB file named .jpg whose header says 40 x 30 pixels (before: read whole, twice, 5.1 GB before its
    refusal) is refused from its header and its size; a 5 MiB checkpoint whose one compressed entry inflates to
    1 GiB (before: 6.6 GB and 130 s for a 5.8 MB one) is refused from the zip's directory. Each peak stays under
    1200 MiB (torch and torchvision imported, the CUDA build's libraries loaded: about 700), where reading either
    would pass 1.7 GiB."""
    from PIL import Image

    image = tmp_path / "big.jpg"
    Image.new("RGB", (40, 30), "red").save(image)
    with open(image, "r+b") as file:
        file.truncate(2 << 30)  # sparse: no disk used for the zeros
    crafted = tmp_path / "last.pt"
    with zipfile.ZipFile(crafted, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        with archive.open("archive/data/0", "w", force_zip64=True) as entry:
            zeros = bytes(64 << 20)
            for _ in range(16):  # 1 GiB, written as it is compressed
                entry.write(zeros)
    assert crafted.stat().st_size < 8 << 20
    for path, words in (
        (image, f"image {image} is 2048 MiB for 40 x 30 pixels, more than an image of that size holds"),
        (crafted, f"--resume {crafted}: its entry archive/data/0 would inflate to 1073741824 bytes from "),
    ):
        proc = subprocess.run(
            [sys.executable, "-c", READ_IN_A_PROCESS, str(REPO), str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env=job_env(),
        )
        said, peak = proc.stdout.splitlines()[-2:]
        assert said.startswith(words) and int(peak) < 1200, (said, peak, proc.stderr[-2000:])
