"""Photos as people have them: reduced JPEG decoding, tools/shrink.py, the data-wait hint and the confusion picture.

In-process tests of builtin.ImageFiles against the pipeline as it was before reduced decoding (full decode, then the
crop), and real runs of tools/shrink.py through run.sh on generated class folders.
"""

import hashlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image

import builtin
import reporting
import utils
from support import REPO, job_env, logger, run_sh

import shrink  # noqa: E402


def photo(path, width, height, seed=0, quality=90):
    """A photo-like picture whose red and green channels are the x and y position (so a crop's colour says where it
    was taken) and whose blue channel is a smooth pattern with fine noise. Saved in the format of path's suffix."""
    g = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.linspace(0, 1, height), torch.linspace(0, 1, width), indexing="ij")
    bumps = torch.nn.functional.interpolate(
        torch.rand(1, 1, 5, 7, generator=g), size=(height, width), mode="bicubic", align_corners=False
    )[0, 0]
    blue = bumps + 0.04 * torch.randn(height, width, generator=g)
    image = (torch.stack([x, y, blue]).clamp(0, 1) * 255).round().byte()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    options = {"quality": quality} if path.suffix == ".jpg" else {}
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(path, **options)
    return path


def before(path, img_size, train, seed, epoch, index):
    """The pipeline before reduced decoding: decode in full, then draw the box from the decoded size."""
    image = builtin.decode_image(path)  # (no scale: the whole image)
    if not train:
        return TF.center_crop(TF.resize(image, round(img_size * 8 / 7), antialias=True), img_size)
    generator = torch.Generator().manual_seed(hash((seed, epoch, index)) & 0xFFFF_FFFF_FFFF)
    top, left, height, width, flip = builtin.random_crop_box(image.shape[-2], image.shape[-1], generator)
    image = torch.nn.functional.interpolate(
        image[None, :, top : top + height, left : left + width], size=[img_size] * 2, mode="bilinear", antialias=True
    )[0]
    return image.flip(-1) if flip else image


def items(files, img_size, train, epochs=3, seed=0):
    dataset = builtin.ImageFiles(builtin.FileList([(str(f), 0) for f in files]), img_size, train)
    if not train:
        return [(i, dataset[i][0]) for i in range(len(files))]
    items = utils.SeededItems(dataset, seed)  # as the scripts' training loader reads it
    return [((epoch, i), items[(epoch, i, i)][0]) for epoch in range(epochs) for i in range(len(files))]


def mean_difference(a, b):
    return (a.int() - b.int()).abs().float().mean().item()


# ------------------------------------------------------------------------------------------ reduced decoding
def test_images_at_todays_sizes_decode_bitwise_as_before(tmp_path):
    # less than twice the crop (or the 8/7 resize) they need: decoded in full, exactly as before; and any PNG
    demo = [
        photo(tmp_path / "a.jpg", 80, 80),
        photo(tmp_path / "b.jpg", 90, 130, seed=1),
        photo(tmp_path / "c.png", 300, 200, seed=2),
    ]
    imagenet = [photo(tmp_path / "d.jpg", 500, 375, seed=3), photo(tmp_path / "e.jpg", 375, 500, seed=4)]
    for files, img_size in ((demo, 64), (demo + imagenet, 224)):
        for train in (True, False):
            for key, image in items(files, img_size, train):
                epoch, index = key if train else (0, key)
                expected = before(files[index], img_size, train, 0, epoch, index)
                assert image.dtype == torch.uint8 and image.shape == (3, img_size, img_size)
                assert torch.equal(image, expected), (img_size, train, key, mean_difference(image, expected))


def test_large_jpegs_same_box_and_a_close_image(tmp_path):
    """Tolerance: mean |difference| <= 2 of 255 per image. Decoding at 1/2, 1/4 or 1/8 scale averages blocks of 2
    to 8 pixels (in the DCT domain) before the antialiased bilinear resize, so the finest detail and noise are
    filtered a little differently (measured: 0.4 to 1.7 on photo-like noise). The red and green channels encode
    the position: a box 1% of the image away moves their mean by about 2.5."""
    files = [photo(tmp_path / f"{i}.jpg", 1024, 768, seed=i) for i in range(3)]
    assert builtin.decode_image(files[0], lambda height, width: 4).shape == (3, 192, 256)  # 1/4 scale: really smaller
    assert builtin.decode_image(files[0], lambda height, width: 1).shape == (3, 768, 1024)
    for img_size, train in ((64, True), (96, True), (64, False)):
        reduced = 0
        for key, image in items(files, img_size, train):
            epoch, index = key if train else (0, key)
            expected = before(files[index], img_size, train, 0, epoch, index)
            assert mean_difference(image, expected) <= 2.0, (img_size, train, key, mean_difference(image, expected))
            position = (image[:2].double().mean((1, 2)) - expected[:2].double().mean((1, 2))).abs().max().item()
            assert position <= 1.0, (img_size, train, key, position)  # the crop's place: red = x, green = y
            reduced += not torch.equal(image, expected)
        assert reduced == len(files) * (3 if train else 1), "an image did not take the reduced path"


def test_sample_stream_unchanged_across_workers(tmp_path):
    # the defaults a user gets: loader workers on; reduced decoding in the workers and in the main process
    files = [photo(tmp_path / f"c{i % 2}" / f"{i}.jpg", 640, 480, seed=i) for i in range(8)]
    dataset = utils.SeededItems(
        builtin.ImageFiles(builtin.FileList([(str(f), i % 2) for i, f in enumerate(files)]), 48, True), seed=5
    )

    def stream(workers):
        sampler = utils.EpochSampler(torch.utils.data.RandomSampler(dataset, generator=torch.Generator()))
        loader = torch.utils.data.DataLoader(dataset, 4, sampler=sampler, num_workers=workers)
        batches = []
        for epoch in range(2):
            sampler.sampler.generator.manual_seed(epoch)
            sampler.start(epoch)
            batches += [images for images, _ in loader]
        return torch.cat(batches)

    one, two = stream(0), stream(2)
    assert one.shape == (16, 3, 48, 48) and torch.equal(one, two)
    assert not torch.equal(one[:8], one[8:])  # the epochs differ


# ------------------------------------------------------------------------------------------ tools/shrink.py
def tree(root):
    """{relative path: (sha256, mtime_ns)} of every file under root."""
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


def test_shrink_copies_resumes_and_reports_unreadable_files(tmp_path, capsys):
    src, dst = tmp_path / "photos", tmp_path / "small"
    big = photo(src / "train" / "cat" / "big.jpg", 1200, 900)
    photo(src / "train" / "cat" / "tall.png", 300, 700, seed=1)
    small = photo(src / "train" / "dog" / "small.jpg", 100, 80, seed=2)
    photo(src / "val" / "dog" / "v.jpg", 800, 600, seed=3)
    photo(src / "val" / "cat" / "w.jpg", 640, 480, seed=4)
    (src / "train" / "dog" / "broken.jpg").write_bytes(small.read_bytes()[:300])  # truncated
    (src / "train" / "dog" / "notes.txt").write_text("not an image")
    before_run = tree(src)

    proc = run_sh("shrink", src, dst, "--max-side", "256", timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one file failed, the others were done
    assert (
        len(errors) == 1
        and f"cannot decode image {src / 'train' / 'dog' / 'broken.jpg'} (" in errors[0]
        and errors[0].endswith("remove or replace the file")
    ), proc.stderr
    assert tree(src) == before_run  # SRC untouched
    with Image.open(dst / "train" / "cat" / "big.jpg") as image:
        assert image.format == "JPEG" and image.size == (256, 192)
    with Image.open(dst / "train" / "cat" / "tall.png") as image:
        assert image.format == "PNG" and image.size == (110, 256)
    assert (dst / "train" / "dog" / "small.jpg").read_bytes() == small.read_bytes()  # small: copied unchanged
    assert not (dst / "train" / "dog" / "broken.jpg").exists() and not (dst / "train" / "dog" / "notes.txt").exists()
    classes, train, val = builtin.find_images(dst, 0.2)  # what the scripts will read
    assert classes == ["cat", "dog"] and len(train) == 3 and len(val) == 2
    assert "4 shrunk" in proc.stdout and "1 copied unchanged" in proc.stdout, proc.stdout

    done = tree(dst)
    again = run_sh("shrink", src, dst, "--max-side", "256", timeout=120)  # only the broken file is tried again
    assert again.returncode == 1 and "0 shrunk" in again.stdout and "5 done before" in again.stdout, again.stdout
    assert tree(dst) == done
    (src / "train" / "dog" / "broken.jpg").unlink()
    os.utime(big, ns=(big.stat().st_atime_ns, big.stat().st_mtime_ns + 10**9))  # a newer source: redone
    third = run_sh("shrink", src, dst, "--max-side", "256", timeout=120)
    assert third.returncode == 0 and "1 shrunk" in third.stdout and "4 done before" in third.stdout, third.stdout
    assert f"--data-path {dst}" in third.stdout
    now = tree(dst)
    assert {path for path in now if now[path] != done.get(path)} == {"train/cat/big.jpg"}
    assert shrink.main([str(src), str(dst), "--max-side", "300"]) == 2  # another size into the same copy
    refused = capsys.readouterr().err
    assert refused.startswith("error: ") and "max_side" in refused, refused
    assert tree(dst) == now


def test_shrink_never_writes_into_src(tmp_path, capsys):
    """(In this process: an argument check, before any worker starts.)"""
    src = tmp_path / "photos"
    photo(src / "a" / "1.jpg", 600, 400)
    photo(src / "b" / "1.jpg", 600, 400, seed=1)
    before_run = tree(tmp_path)
    for dst in (src, src / "a" / "copy", tmp_path, tmp_path / "photos" / ".." / "photos" / "b"):
        assert shrink.main([str(src), str(dst)]) == 2, dst
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: DST ") and "outside" in lines[0], lines
    assert tree(tmp_path) == before_run


def test_shrink_killed_leaves_no_partial_file_and_resumes(tmp_path):
    # PNGs, whose compression makes writing most of the work: a kill lands inside a write most of the time
    src, dst = tmp_path / "photos", tmp_path / "small"
    for i in range(12):
        photo(src / f"c{i % 2}" / f"{i:02d}.png", 1200, 900, seed=i)
    kills = 0
    for attempt in range(4):  # kill the whole job (every process of its group) at once, a few times
        job = subprocess.Popen(
            ["bash", "run.sh", "shrink", src, dst, "--max-side", "1000", "--jobs", "2"],
            cwd=REPO,
            env=job_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.time() + 60
        while time.time() < deadline and job.poll() is None and not list(dst.rglob("*.png*")):  # writing one
            time.sleep(0.01)
        time.sleep(0.05 * attempt)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            kills += 1
        job.wait(timeout=30)
        for path in dst.rglob("*.png"):
            if not path.name.startswith("."):  # every file under its real name is a complete image
                with Image.open(path) as image:
                    image.load()
                    assert image.size == (1000, 750), path
    assert kills >= 2
    left = list(dst.rglob(f"*{shrink.TEMPORARY}"))
    done = len([p for p in dst.rglob("*.png") if not p.name.startswith(".")])
    proc = run_sh("shrink", src, dst, "--max-side", "1000", timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"{done} done before" in proc.stdout and f"{12 - done} shrunk" in proc.stdout, (done, proc.stdout)
    assert not list(dst.rglob(f"*{shrink.TEMPORARY}")), f"stale temporary files stayed ({len(left)} after the kills)"
    assert sorted(p.name for p in dst.rglob("*.png")) == sorted(p.name for p in src.rglob("*.png"))


# ------------------------------------------------------------------------------------------ logging
def epoch_line(tmp_path, dataset, capsys):
    """One epoch of the Logger in which the loop waited for data half of the time: the epoch line it prints."""
    log = logger(tmp_path, ["cat", "dog"], epochs=1, steps_per_epoch=2, global_batch=4, print_freq=10)
    log.add_training_images(utils.SeededItems(dataset, 0), 0)  # as the scripts pass it
    capsys.readouterr()
    log.start_epoch(0)

    def slow_loader():
        for batch in range(2):
            time.sleep(0.2)
            yield batch

    for step, _ in enumerate(log.timed(slow_loader())):
        time.sleep(0.05)
        log.step(step, step + 1, torch.tensor(1.0), 0.1)
    log.end_epoch(2, {"loss": 1.0, "count": 4, "acc": 0.5, "confusion": [[2, 0], [1, 1]]})
    log.close()
    return capsys.readouterr().out


def test_data_wait_hint_names_shrink_for_large_photos(tmp_path, capsys):
    large = [photo(tmp_path / "large" / f"{i}.jpg", 1200, 900, seed=i) for i in range(6)]
    small = [photo(tmp_path / "small" / f"{i}.jpg", 200, 150, seed=i) for i in range(6)]
    files = builtin.FileList([(str(f), i % 2) for i, f in enumerate(large)])
    line = epoch_line(tmp_path / "a", builtin.ImageFiles(files, 64, True), capsys)
    assert (
        "data loading is the bottleneck" in line
        and "900 px images for a 64 px crop" in line
        and "bash run.sh shrink" in line
    ), line
    files = builtin.FileList([(str(f), i % 2) for i, f in enumerate(small)])
    line = epoch_line(tmp_path / "b", builtin.ImageFiles(files, 64, True), capsys)
    assert "data loading is the bottleneck; raise --workers" in line and "shrink" not in line, line


def grey(image):
    return (image.max(dim=0).values.int() - image.min(dim=0).values.int()).le(8).all().item()


def test_confusion_picture_names_shares_and_colours():
    classes = list(builtin.DEMO_CLASSES)
    confusion = torch.tensor([[8, 2, 0, 0, 0], [0, 7, 2, 0, 1], [3, 0, 6, 1, 0], [0, 0, 0, 9, 1], [0, 1, 1, 0, 8]])
    image = reporting.confusion_image(confusion, classes)
    assert image.dtype == torch.uint8 and image.shape[0] == 3
    assert 5 * 34 < image.shape[1] < 600 and 5 * 34 + 480 < image.shape[2] < 1200, image.shape
    assert not grey(image)  # the colour scale, not the bare grey grid
    left = image[:, 60 : image.shape[1] // 2, :40]  # where the first letters of the row names are
    assert (left.max(dim=0).values < 100).sum() > 30, "no text left of the rows"
    assert not torch.equal(image, reporting.confusion_image(confusion, ["a", "b", "c", "d", "e"]))  # the names drawn
    assert not torch.equal(image, reporting.confusion_image(confusion.flip(1), classes))  # and the shares


def test_confusion_picture_for_many_classes_lists_the_weakest():
    g = torch.Generator().manual_seed(0)
    confusion = torch.randint(0, 3, (1000, 1000), generator=g) + torch.eye(1000, dtype=torch.long) * 40
    confusion[17, 17] = 0  # the weakest class
    names = [f"n{i:08d} a rather long class name {i}" for i in range(1000)]
    start = time.perf_counter()
    image = reporting.confusion_image(confusion, names)
    seconds = time.perf_counter() - start
    assert seconds < 5, f"{seconds:.1f} s for 1000 classes (it runs once per epoch)"
    assert image.shape[1] >= 600 and image.shape[2] >= 1000 and not grey(image)
    text = (image[:, :, 1078:].max(dim=0).values < 100).any(dim=1)  # rows with text right of the colour scale
    lines = (text[1:] & ~text[:-1]).sum().item()
    assert lines >= 22, f"{lines} lines of text beside the heatmap: not a title, 20 weakest classes and a caption"


def test_confusion_picture_reaches_tensorboard_where_the_metrics_have_one(tmp_path):
    """A classifier's metrics (a "confusion" of names x names counts) are drawn; a regression's (numbers only) and a
    multi-label task's (no square matrix) are not, and every number among the metrics is a val/ scalar."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    confusion = torch.tensor([[3, 1], [0, 4]])
    tasks = {
        "classifier": {"loss": 0.5, "count": 8, "acc": 0.875, "confusion": confusion.tolist()},
        "regression": {"loss": 0.5, "count": 8, "mse": 0.25},
        "multilabel": {"loss": 0.5, "count": 8, "f1": 0.75, "confusion": [[1, 2, 3]]},
    }
    for task, metrics in tasks.items():
        log = logger(tmp_path / task, ["cat", "dog"], epochs=1, steps_per_epoch=1, global_batch=2, print_freq=1)
        log.start_epoch(0)
        log.end_epoch(1, metrics)
        log.close()
        events = EventAccumulator(str(tmp_path / task), size_guidance={"images": 0})
        events.Reload()
        numbers = sorted(name for name, value in metrics.items() if isinstance(value, float))
        assert sorted(events.Tags()["scalars"]) == sorted(["train/data_wait"] + [f"val/{n}" for n in numbers]), task
        assert events.Tags()["images"] == (["val/confusion"] if task == "classifier" else []), task
    events = EventAccumulator(str(tmp_path / "classifier"), size_guidance={"images": 0})
    events.Reload()
    [logged] = events.Images("val/confusion")
    picture = TF.pil_to_tensor(Image.open(io.BytesIO(logged.encoded_image_string)).convert("RGB"))
    assert torch.equal(picture, reporting.confusion_image(confusion, ["cat", "dog"]))


def test_training_image_grid_for_any_dataset(tmp_path):
    """TensorBoard's grid of training images shows a dataset's own float images (each stretched from its minimum to
    its maximum) and is left out, with no error, when the items are not images (a user's vectors)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class Items(torch.utils.data.Dataset):
        def __init__(self, shape):
            self.shape = shape

        def __len__(self):
            return 40

        def __getitem__(self, index):
            return torch.randn(self.shape), index % 2

    for name, shape, shown in (("floats", (3, 16, 16), 1), ("vectors", (10,), 0)):
        log = logger(tmp_path / name, ["a", "b"], epochs=1, steps_per_epoch=1, global_batch=2, print_freq=1)
        log.add_training_images(utils.SeededItems(Items(shape), 0), 0)
        log.close()
        accumulator = EventAccumulator(str(tmp_path / name), size_guidance={"images": 0})
        accumulator.Reload()
        images = accumulator.Tags()["images"]
        assert len(images) == shown and (not shown or images == ["train/augmented_images"]), (name, images)


def test_torchcodec_decodes_where_installed_and_its_absence_is_said_in_one_line(
    tiny_data, tmp_path, capsys, monkeypatch
):
    """requirements.txt installs TorchCodec: builtin.py decodes every JPEG and PNG of the folder with it (counted
    through the module's own names). Where it cannot be imported, builtin.datasets() says so once, at start, and the
    images decode with PIL alike."""
    import importlib
    import importlib.util
    import types

    assert importlib.util.find_spec("torchcodec") and builtin.codec_decode is not None and builtin.codec_missing is None
    calls = []
    for name in ("codec_decode", "codec_jpeg"):
        real = getattr(builtin, name)
        monkeypatch.setattr(
            builtin, name, lambda data, mode, real=real, name=name: calls.append(name) or real(data, mode=mode)
        )
    photo(tmp_path / "extra.png", 40, 30)
    for path in (next(tiny_data.glob("c0/*.jpg")), tmp_path / "extra.png"):
        assert builtin.decode_image(path).shape[0] == 3
    assert calls == ["codec_jpeg", "codec_decode"], calls
    monkeypatch.undo()
    args = types.SimpleNamespace(data_path=str(tiny_data), img_size=32, val_fraction=0.25)
    builtin.datasets(args)
    assert "TorchCodec" not in capsys.readouterr().out
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "torchcodec.decoders", None)  # as if not installed: its import raises
        importlib.reload(builtin)
        try:
            assert builtin.codec_decode is None
            _, val_set, _ = builtin.datasets(args)
            assert val_set[0][0].shape == (3, 32, 32)  # PIL decoded it
        finally:
            patch.undo()
            importlib.reload(builtin)
    lines = capsys.readouterr().out.splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("warning: TorchCodec cannot be imported (")
        and lines[0].endswith(
            "): the images are decoded with PIL, slower on small images; pip install -r requirements.txt"
        )
    ), lines
    assert builtin.codec_decode is not None
