"""train_single.py, run as a user runs it: a real subprocess on tiny data, checked by its outputs.

Training runs are shared across tests (module-scoped fixtures) because each costs seconds of CPU.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchvision

import builtin
import utils
from support import (
    FAST,
    NO_NETWORK,
    REPO,
    assert_same_weights,
    finish,
    in_this_process,
    job_env,
    load_model_state,
    read_until,
    run,
    start,
)
from support import logger, make_dataset

SCRIPT = "train_single.py"
PROGRESS = re.compile(r"^epoch (\d+)/(\d+)\s+step (\d+)/(\d+)\s")  # utils.Logger.step's progress line
EPOCHS, STEPS_PER_EPOCH, VAL_COUNT = 2, 6, 17  # FAST on tiny_data: 50 training images // batch 8; 17 held out
SAVE_EVERY = 2


def single(*args, env=None):
    """python train_single.py ARGS to its end; one compute thread (every run compared with it has one)."""
    return run([sys.executable, SCRIPT, *args], env=env)


def train_args(data, output_dir, *extra):
    return [
        *f"--data-path {data} --val-fraction 0.25".split(),
        *FAST,
        "--save-every",
        str(SAVE_EVERY),
        "--output-dir",
        output_dir,
        *extra,
    ]


def check_ok(proc):
    assert proc.returncode == 0, (
        f"exit status {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )


def progress_steps(stdout):
    """Global step numbers of the progress lines in a run's stdout."""
    steps = []
    for line in stdout.splitlines():
        match = PROGRESS.match(line)
        if match:
            epoch, _, step, steps_per_epoch = map(int, match.groups())
            steps.append((epoch - 1) * steps_per_epoch + step)
    return steps


def scalars(run_dir):
    """TensorBoard scalars of a run folder as {tag: [(step, value), ...]}, read the way TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def snapshot(*folders):
    """{file: (mtime, sha256)} of every file under the folders."""
    files = {}
    for folder in folders:
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                files[path] = (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest())
    return files


def assert_untouched(before):
    changed = [
        str(path)
        for path, state in before.items()
        if not path.is_file() or (path.stat().st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()) != state
    ]
    assert not changed, f"files changed or removed: {changed}"


# ------------------------------------------------------------------------------------------ shared runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data):
    """Two complete runs: the baseline, and the same again with 2 loader workers and --resume auto in a new folder
    (which starts fresh). Bitwise equal weights prove both that a seed repeats a run and that loader workers change
    nothing (either broken, they differ). Both with every warning shown (PYTHONWARNINGS=default)."""
    out, env = tmp_path_factory.mktemp("single"), job_env(PYTHONWARNINGS="default")
    variants = {"baseline": [], "repeat": ["--resume", "auto", "--workers", "2"]}
    return {
        name: SimpleNamespace(dir=out / name, proc=single(*train_args(tiny_data, out / name, *extra), env=env))
        for name, extra in variants.items()
    }


@pytest.mark.quick
def test_no_warning_of_a_deprecated_or_unclosed_thing(runs):
    """With every warning shown, as `python -X dev` and pytest show them: nothing deprecated, no file or process left
    unclosed, from our code or from what it calls (torchvision.io's decoders, deprecated in 0.29, warned on every run;
    the run folder's lock file was left unclosed). The next deprecation shows here the day it lands."""
    for name, done in runs.items():
        check_ok(done.proc)  # a run that crashed early would warn of nothing
        warned = [line for line in done.proc.stderr.splitlines() if re.search(r"\w+Warning\b", line)]
        assert not warned, (name, warned)


@pytest.fixture(scope="module")
def baseline(runs):
    check_ok(runs["baseline"].proc)
    return runs["baseline"]


@pytest.mark.quick
def test_same_seed_gives_bitwise_identical_weights(runs, baseline, initial_weights):
    """The repeat ran with --resume auto in a folder without last.pt: it started fresh, from step 1 (and with 2 loader
    workers: the next test)."""
    check_ok(runs["repeat"].proc)
    assert "resuming from" not in runs["repeat"].proc.stdout
    assert progress_steps(runs["repeat"].proc.stdout) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    trained = load_model_state(baseline.dir / "last.pt")
    assert_same_weights(trained, load_model_state(runs["repeat"].dir / "last.pt"))
    assert_same_weights(load_model_state(baseline.dir / "best.pt"), load_model_state(runs["repeat"].dir / "best.pt"))
    # and the weights are trained ones, not the seeded initial weights saved unchanged
    assert (
        max(
            (trained[key] - initial_weights[key]).abs().max().item()
            for key in initial_weights
            if initial_weights[key].is_floating_point()
        )
        > 1e-3
    )


@pytest.mark.quick
def test_loader_workers_do_not_change_weights(runs, baseline):
    """The repeat loaded its data with 2 worker processes, the baseline in the main process (FAST: --workers 0)."""
    check_ok(runs["repeat"].proc)
    assert FAST[FAST.index("--workers") + 1] == "0"  # the baseline's
    assert_same_weights(load_model_state(baseline.dir / "last.pt"), load_model_state(runs["repeat"].dir / "last.pt"))


@pytest.mark.quick
def test_results_and_checkpoints(baseline, tiny_data):
    _, _, val = builtin.find_images(tiny_data, 0.25)
    results = json.loads((baseline.dir / "results.json").read_text())
    for key in ("best_acc", "final_acc"):
        assert 0.0 <= results[key] <= 1.0, (key, results[key])
    assert results["best_acc"] >= results["final_acc"]
    assert results["best_acc"] > 0.5, "3 easy classes: training should beat chance clearly"
    assert results["val_loss"] > 0 and results["val_loss"] == results["val_loss"]  # not NaN
    assert results["val_count"] == len(val) == VAL_COUNT
    assert results["epochs"] == EPOCHS
    assert results["train_img_per_s"] > 0
    assert results["wall_s"] > 0
    assert json.loads((baseline.dir / "class_indices.json").read_text()) == {"0": "c0", "1": "c1", "2": "c2"}
    assert results["final_acc"] == results["val_acc"]
    assert f"best val acc {results['best_acc']:.4f}, final {results['final_acc']:.4f}" in baseline.proc.stdout
    epoch_lines = [line for line in baseline.proc.stdout.splitlines() if re.match(r"epoch \d+/\d+  val loss", line)]
    assert len(epoch_lines) == EPOCHS and all(
        re.search(r"train time [\d.]+s, \d+% waiting for data", line) for line in epoch_lines
    ), epoch_lines
    for name in ("last.pt", "best.pt"):
        checkpoint = torch.load(baseline.dir / name, map_location="cpu", weights_only=True)
        model = torchvision.models.resnet18(num_classes=3)
        model.load_state_dict(checkpoint["model"])  # strict: a plain state dict, no "module." prefix


def counted_here(state, val):
    """The confusion matrix of `state` (a resnet18 state dict) on the validation files, made in this process without
    the scripts' evaluate(): each image scored on its own row (its class from the file list), in the scripts'
    batches of 8 (the same sums, the same predictions)."""
    model = torchvision.models.resnet18(num_classes=3)
    model.load_state_dict(state)
    model.eval()
    images = builtin.ImageFiles(val, 32, train=False)
    counts = torch.zeros(3, 3, dtype=torch.int64)
    with torch.no_grad():
        for first in range(0, len(val), 8):
            batch = range(first, min(first + 8, len(val)))
            predicted = model(utils.normalize(torch.stack([images[i][0] for i in batch]))).argmax(dim=1)
            for i, guess in zip(batch, predicted.tolist()):
                counts[val[i][1], guess] += 1
    return counts


def evaluate_only(checkpoint, tiny_data, output_dir):
    return single(
        *f"--data-path {tiny_data} --val-fraction 0.25".split(),
        *FAST,
        *f"--test-only --resume {checkpoint} --output-dir {output_dir}".split(),
    )


def test_per_class_accuracy_and_confusion_match_counts_made_here(baseline, initial_weights, tiny_data, tmp_path):
    """results.json's confusion (rows: true class) and per-class accuracy, for the trained model (the run's final
    evaluation) and for the untrained one (--test-only of a checkpoint holding the initial weights: a confusion matrix
    far from diagonal and not symmetric, so that rows and columns cannot be mistaken), against counted_here."""
    _, _, val = builtin.find_images(tiny_data, 0.25)
    checkpoint = torch.load(baseline.dir / "last.pt", weights_only=True)
    checkpoint["model"] = initial_weights  # the weights training started from
    torch.save(checkpoint, tmp_path / "untrained.pt")
    check_ok(evaluate_only(tmp_path / "untrained.pt", tiny_data, tmp_path / "untrained"))
    for results_json, weights in (
        (baseline.dir / "results.json", load_model_state(baseline.dir / "last.pt")),
        (tmp_path / "untrained" / "results.json", initial_weights),
    ):
        results, counts = json.loads(results_json.read_text()), counted_here(weights, val)
        assert counts.sum(dim=1).tolist() == [6, 5, 6]
        assert results["val_confusion"] == counts.tolist(), (results_json, results["val_confusion"], counts)
        assert results["val_per_class_acc"] == pytest.approx(
            {name: counts[i, i].item() / counts[i].sum().item() for i, name in enumerate(["c0", "c1", "c2"])}
        )
        assert results.get("final_acc", results.get("val_acc")) == pytest.approx(counts.trace().item() / VAL_COUNT)
    assert not torch.equal(counts, counts.T), counts  # the untrained model's: rows and columns tell apart


def test_test_only_evaluates_without_touching_the_run(baseline, tiny_data, tmp_path):
    before = snapshot(baseline.dir)
    results = json.loads((baseline.dir / "results.json").read_text())
    check_ok(evaluate_only(baseline.dir / "best.pt", tiny_data, tmp_path / "best"))
    evaluated = json.loads((tmp_path / "best" / "results.json").read_text())
    assert evaluated["val_count"] == VAL_COUNT
    assert evaluated["val_acc"] == results["best_acc"], "best.pt should score the best accuracy of the run"
    assert 0 < evaluated["val_loss"] < 20
    assert_untouched(before)
    assert sorted(p.name for p in baseline.dir.iterdir()) == sorted(p.name for p in before)


def test_tensorboard_scalars(baseline):
    logged = scalars(baseline.dir)
    train_steps = list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    val_steps = [STEPS_PER_EPOCH * (epoch + 1) for epoch in range(EPOCHS)]
    for tag in ("train/loss", "train/lr", "train/img_per_s"):
        assert tag in logged, f"{tag} missing; logged: {sorted(logged)}"
        assert [step for step, _ in logged[tag]] == train_steps, tag
    for tag in ("val/loss", "val/acc", "train/data_wait"):
        assert tag in logged, f"{tag} missing; logged: {sorted(logged)}"
        assert [step for step, _ in logged[tag]] == val_steps, tag
    assert all(0 <= value <= 1 for _, value in logged["train/data_wait"])
    # Images: the confusion matrix each epoch, and once, a grid of training images as the model sees them
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(baseline.dir), size_guidance={"images": 0})
    accumulator.Reload()
    assert [event.step for event in accumulator.Images("val/confusion")] == val_steps
    grid = accumulator.Images("train/augmented_images")
    assert len(grid) == 1 and grid[0].width > 4 * 32 and grid[0].height > 2 * 32  # 32 images, 8 to a row
    assert all(value > 0 for _, value in logged["train/img_per_s"])
    assert all(value >= 0 for _, value in logged["train/lr"])
    results = json.loads((baseline.dir / "results.json").read_text())
    accuracies = [value for _, value in logged["val/acc"]]
    assert accuracies[-1] == pytest.approx(results["final_acc"], abs=1e-6)
    assert max(accuracies) == pytest.approx(results["best_acc"], abs=1e-6)


def test_data_wait_share_names_the_bottleneck(tmp_path, capsys):
    """Logger.timed counts the time the loop waits for a batch: a loader as slow as the step is about half the
    training time, and the epoch line says what to try; a fast one is about 0% and says nothing more."""

    def batches(seconds):
        for index in range(4):
            time.sleep(seconds)
            yield index

    for loader_seconds, low, high in ((0.1, 35, 65), (0.0, 0, 5)):
        log = logger(tmp_path / str(loader_seconds), ["a", "b", "c"], 1, 4, 8, print_freq=100)
        log.start_epoch(0)
        for step, _ in enumerate(log.timed(batches(loader_seconds))):
            time.sleep(0.1)  # the step's compute
            log.step(step, step + 1, torch.tensor(1.0), 0.1)
        log.end_epoch(4, {"loss": 1.0, "count": 6, "acc": 0.5})
        log.close()
        line = capsys.readouterr().out.strip().splitlines()[-1]
        share = int(re.search(r"(\d+)% waiting for data", line)[1])
        assert low <= share <= high, line
        assert ("raise --workers" in line) == (share > 10), line


# ------------------------------------------------------------------------------------ kill and resume
@pytest.fixture(scope="module")
def resumed(tmp_path_factory, tiny_data):
    """A run SIGKILLed mid-epoch after a --save-every checkpoint, then continued with --resume auto."""
    out = tmp_path_factory.mktemp("resumed") / "run"
    job, lines, killed_after = start([sys.executable, SCRIPT, *train_args(tiny_data, out)], timeout=120), [], None
    saved = []  # global steps after which the script wrote a mid-epoch checkpoint
    for line in job.stdout:
        lines.append(line)
        if not (match := PROGRESS.match(line)):
            continue
        epoch, _, step, steps_per_epoch = map(int, match.groups())
        global_step = (epoch - 1) * steps_per_epoch + step
        if step < steps_per_epoch and saved and saved[-1] < global_step:
            job.send_signal(signal.SIGKILL)  # mid-epoch, a step after a checkpoint was written
            killed_after = line
            break
        if global_step % SAVE_EVERY == 0 and step < steps_per_epoch:
            saved.append(global_step)  # the script checkpoints right after printing this line
    output = finish(job, lines, timeout=60)
    result = SimpleNamespace(
        dir=out,
        killed_after=killed_after,
        killed_status=job.returncode,
        killed_output=output,
        results_after_kill=(out / "results.json").exists(),
        checkpoint=None,
    )
    if (out / "last.pt").exists():
        checkpoint = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
        result.checkpoint = {key: checkpoint.get(key) for key in ("epoch", "samples")}
    result.proc = single(*train_args(tiny_data, out, "--resume", "auto"))
    return result


@pytest.mark.quick
def test_kill_mid_epoch_and_resume_gives_identical_weights(resumed, baseline):
    assert resumed.killed_after is not None, f"no mid-epoch progress line after a checkpoint\n{resumed.killed_output}"
    assert resumed.killed_status == -signal.SIGKILL, "the run finished before the kill landed"
    assert not resumed.results_after_kill
    assert resumed.checkpoint is not None, "no last.pt after the kill, although --save-every 2 had saved"
    assert resumed.checkpoint["samples"] > 0, (
        f"the kill was meant to leave a mid-epoch checkpoint: {resumed.checkpoint}"
    )
    check_ok(resumed.proc)
    # it continued after the checkpoint instead of starting over, and did every remaining step once
    done = resumed.checkpoint["epoch"] * STEPS_PER_EPOCH + resumed.checkpoint["samples"] // 8  # FAST: -b 8
    assert progress_steps(resumed.proc.stdout) == list(range(done + 1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert_same_weights(load_model_state(resumed.dir / "last.pt"), load_model_state(baseline.dir / "last.pt"))
    results = json.loads((resumed.dir / "results.json").read_text())
    expected = json.loads((baseline.dir / "results.json").read_text())
    for key in ("best_acc", "final_acc", "val_loss", "val_count", "epochs"):
        assert results[key] == expected[key], key


def test_resume_keeps_tensorboard_curves_complete(resumed, baseline):
    """After the resume, TensorBoard shows the same curves as the uninterrupted run: no point lost or doubled."""
    check_ok(resumed.proc)
    logged, expected = scalars(resumed.dir), scalars(baseline.dir)
    for tag in ("train/loss", "train/lr", "val/loss", "val/acc"):
        assert [step for step, _ in logged.get(tag, [])] == [step for step, _ in expected[tag]], tag
        assert logged[tag] == expected[tag], tag


def test_kill_during_checkpoint_write_keeps_previous_checkpoint(tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    child = (
        "import sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from pathlib import Path\n"
        "import torch, utils\n"
        "out = Path(sys.argv[2])\n"
        "utils.save_checkpoint({'model': {'w': torch.arange(6.0)}, 'epoch': 1}, out)\n"
        "print('first written', flush=True)\n"
        "utils.save_checkpoint({'model': {'w': torch.ones(75_000_000)}, 'epoch': 2}, out)  # 300 MB\n"
        "print('second written', flush=True)\n"
    )
    proc = start([sys.executable, "-c", child, REPO, out], timeout=60)
    temporary = out / f".last.pt.{proc.pid}.tmp"
    first = proc.stdout.readline().strip()
    deadline = time.monotonic() + 30
    while first and not temporary.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    seen = temporary.exists()
    proc.send_signal(signal.SIGKILL)
    output = finish(proc, [], timeout=30)
    assert first == "first written" and seen, f"never saw {temporary.name}: the write went unseen\n{output}"
    assert proc.returncode == -signal.SIGKILL, "the second write finished before the kill"
    state = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    assert state["epoch"] == 1
    assert torch.equal(state["model"]["w"], torch.arange(6.0))


# ---------------------------------------------------------------------------------------------- demo data
def test_demo_data_is_deterministic(tmp_path):
    builtin.make_demo_images(tmp_path / "a", per_class=3)
    builtin.make_demo_images(tmp_path / "b", per_class=3)
    assert len(builtin.DEMO_CLASSES) == 5
    for folder in (tmp_path / "a", tmp_path / "b"):
        assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == sorted(builtin.DEMO_CLASSES)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert len(files) == 5 * 3
    differing = [str(f) for f in files if (tmp_path / "a" / f).read_bytes() != (tmp_path / "b" / f).read_bytes()]
    assert not differing, f"demo images differ between two generations: {differing}"
    first_images = {
        (tmp_path / "a" / name / sorted(os.listdir(tmp_path / "a" / name))[0]).read_bytes()
        for name in builtin.DEMO_CLASSES
    }
    assert len(first_images) == 5, "classes should not share images"
    image = builtin.decode_image(tmp_path / "a" / builtin.DEMO_CLASSES[0] / sorted(files)[0].name)
    assert image.shape == (3, 80, 80) and image.dtype == torch.uint8


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.quick
def test_bad_input_gives_one_error_line(baseline, tiny_data, tmp_path, capfd, monkeypatch):
    """Each case: non-zero exit, one stderr line "error: ..." naming the problem, no traceback, files untouched. The
    cases run in this process (in_this_process); two of them again as separate interpreters, line for line."""
    missing = tmp_path / "no-such-folder"
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a dataset\n")
    nothing = tmp_path / "nothing_here"
    nothing.mkdir()
    (nothing / "readme.txt").write_text("no images here\n")
    empty_class = make_dataset(tmp_path / "empty_class", [6, 6])
    (empty_class / "c2").mkdir()
    (empty_class / "c2" / "readme.txt").write_text("no images here\n")
    one_class = make_dataset(tmp_path / "one_class", [12])
    tiny_val = make_dataset(tmp_path / "tiny_val", [1, 1, 1])  # round(0.25 * 1) = 0 held out per class
    broken = make_dataset(tmp_path / "broken", [11, 10, 11])  # 24 training images: every one read in epoch 1
    (broken / "c1" / "0010.jpg").write_bytes(b"\xff\xd8 this is not a JPEG " * 20)
    two_classes = make_dataset(tmp_path / "two_classes", [10, 10])
    old_run = tmp_path / "old_run"
    old_run.mkdir()
    shutil.copyfile(baseline.dir / "last.pt", old_run / "last.pt")
    results_only = tmp_path / "results_only"  # what --test-only leaves, say
    results_only.mkdir()
    shutil.copyfile(baseline.dir / "results.json", results_only / "results.json")
    older = torch.load(old_run / "last.pt", weights_only=True)
    del older["samples"]  # a checkpoint from before the position was kept in samples
    torch.save(older, tmp_path / "older.pt")
    truncated = tmp_path / "truncated.pt"
    data = (old_run / "last.pt").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    text_pt = tmp_path / "x.pt"
    text_pt.write_text("this is not a checkpoint\n")
    resnet50 = tmp_path / "resnet50.pt"
    with torch.device("meta"):  # its keys and shapes, without drawing from the random state another thread may use
        shapes = torchvision.models.resnet50().state_dict()
    torch.save({key: torch.zeros(t.shape, dtype=t.dtype) for key, t in shapes.items()}, resnet50)
    cut_weights = tmp_path / "cut_weights.pth"
    cut_weights.write_bytes(resnet50.read_bytes()[:100_000])
    # A hub cache (TORCH_HOME) with no resnet18 weights and a half-downloaded resnet34 file; no network at all
    torch_home = tmp_path / "torch_home"
    (torch_home / "hub" / "checkpoints").mkdir(parents=True)
    resnet34_url = torchvision.models.ResNet34_Weights.DEFAULT.url
    (torch_home / "hub" / "checkpoints" / resnet34_url.rsplit("/", 1)[-1]).write_bytes(cut_weights.read_bytes())

    # name: (arguments, words the error line must contain (a tuple: any one of them), case-insensitive)
    no_such = ("no such", "not found", "does not exist", "not exist")
    cases = {
        "missing --data-path": (["--data-path", missing], ["no-such-folder"]),
        "--data-path is a file": (["--data-path", a_file], ["notes.txt", ("directory", "folder")]),
        "folder without images": (["--data-path", nothing], ["nothing_here", ("class", "image")]),
        "class folder without images": (["--data-path", empty_class], ["c2", "no image"]),
        "only one class": (["--data-path", one_class], [("one class", "at least 2", "two classes")]),
        "empty validation split": (["--data-path", tiny_val], [("validation", "val split"), "empty"]),
        "undecodable image": (["--data-path", broken], ["0010.jpg", "decode"]),
        "undecodable image, 2 workers": (["--data-path", broken, "--workers", "2"], ["0010.jpg", "decode"]),
        "--batch-size 0": (["--data-path", tiny_data, "-b", "0"], ["--batch-size"]),
        "--epochs 0": (["--data-path", tiny_data, "--epochs", "0"], ["--epochs"]),
        "--workers -1": (["--data-path", tiny_data, "--workers", "-1"], ["--workers"]),
        "--val-fraction 0": (["--data-path", tiny_data, "--val-fraction", "0"], ["--val-fraction"]),
        "--val-fraction 1.5": (["--data-path", tiny_data, "--val-fraction", "1.5"], ["--val-fraction"]),
        "--resume missing": (["--data-path", tiny_data, "--resume", tmp_path / "nope.pt"], ["nope.pt", no_such]),
        "--resume truncated": (["--data-path", tiny_data, "--resume", truncated], ["truncated.pt", "checkpoint"]),
        "--resume text file": (["--data-path", tiny_data, "--resume", text_pt], ["x.pt", "checkpoint"]),
        "--resume other classes": (["--data-path", two_classes, "--resume", old_run / "last.pt"], ["last.pt", "class"]),
        "--resume without samples": (
            ["--data-path", tiny_data, "--resume", tmp_path / "older.pt"],
            ["older.pt", "older version", "--weights"],
        ),
        "--weights of resnet50": (["--data-path", tiny_data, "--weights", resnet50], ["resnet50.pt", "resnet18"]),
        "--weights truncated": (["--data-path", tiny_data, "--weights", cut_weights], ["cut_weights", "checkpoint"]),
        "--weights named for resnet50": (
            ["--data-path", tiny_data, "--weights", "ResNet50_Weights.IMAGENET1K_V2"],
            ["resnet50", "--model"],
        ),
        "--weights a name resnet18 lacks": (
            ["--data-path", tiny_data, "--weights", "IMAGENET1K_V2"],
            ["IMAGENET1K_V2", "resnet18", "IMAGENET1K_V1"],
        ),
        "--weights default, no network": (
            ["--data-path", tiny_data, "--weights", "default"],
            ["cannot download", f"put that file at {torch_home}/hub/checkpoints/"],
        ),
        "--weights DEFAULT, a cut cached file": (
            ["--data-path", tiny_data, "--model", "resnet34", "--weights", "DEFAULT"],
            ["resnet34-", "delete it"],
        ),
        "unknown --model": (["--data-path", tiny_data, "--model", "resnet9"], ["resnet9"]),
        "--device cuda": (["--data-path", tiny_data, "--device", "cuda"], ["cuda", "gpu"]),
        "--output-dir of an earlier run": (
            ["--data-path", tiny_data, "--output-dir", old_run],
            ["old_run", ("already", "earlier", "exists")],
        ),
        "--output-dir holding only results.json": (
            ["--data-path", tiny_data, "--output-dir", results_only],
            ["results_only", "results.json", "--resume auto"],
        ),
    }
    before = snapshot(tmp_path, tiny_data)

    def args(name, outputs="out"):
        return [
            "--val-fraction",
            "0.25",
            *FAST,
            "--output-dir",
            tmp_path / outputs / re.sub(r"\W+", "_", name),
            *cases[name][0],
        ]

    env = {"TORCH_HOME": str(torch_home), **NO_NETWORK}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    procs = {name: in_this_process(SCRIPT, args(name), capfd) for name in cases}

    failures = []
    for name, proc in procs.items():
        lines = proc.stderr.strip().splitlines()
        problems = []
        if proc.returncode == 0:
            problems.append("exit status 0")
        if "Traceback" in proc.stderr:
            problems.append("a traceback")
        if len(lines) != 1 or not lines[0].startswith("error:"):
            problems.append(f"{len(lines)} stderr lines, not one starting with 'error:'")
        else:
            for words in cases[name][1]:
                words = (words,) if isinstance(words, str) else words
                if not any(word.lower() in lines[0].lower() for word in words):
                    problems.append(f"no {' / '.join(map(repr, words))} in the message")
        if problems:
            failures.append(f"{name}: {', '.join(problems)}\n    stderr: {proc.stderr.strip()[-1500:]!r}")
    assert not failures, "\n".join(failures)
    # and as separate interpreters, `python train_single.py ...`: the same ending, line for line
    for name in ("--epochs 0", "undecodable image, 2 workers"):
        alone = run([sys.executable, SCRIPT, *args(name, "alone")], timeout=60, env=job_env(**env))
        assert (alone.returncode, alone.stderr) == (procs[name].returncode, procs[name].stderr), (name, alone.stderr)
    assert_untouched(before)


# ------------------------------------------------------------------------------------------------ run.sh
def test_run_sh_usage():
    bad = run(["bash", "run.sh", "nonsense"], timeout=30)
    assert bad.returncode == 2
    assert "usage: bash run.sh MODE" in bad.stdout + bad.stderr and "single" in bad.stdout + bad.stderr
    good = run(["bash", "run.sh", "help"], timeout=30)
    assert good.returncode == 0
    assert "usage: bash run.sh MODE" in good.stdout


def test_weights_with_another_head_then_freeze_trains_only_the_head(tiny_data, tmp_path, hub_cache, initial_weights):
    """--weights from a 1000-class torchvision state dict (hub_cache's, in a file of its own): the head is skipped
    (shape differs), and with --freeze the backbone, BatchNorm statistics included, ends exactly as loaded while the
    new head, which starts as the scripts' initial weights' head, learns."""
    pretrained, initial = hub_cache[1], initial_weights
    torch.save(pretrained, tmp_path / "resnet18.pth")
    proc = single(
        *FAST,
        *f"--data-path {tiny_data} --val-fraction 0.25 --epochs 1 --weights {tmp_path / 'resnet18.pth'}".split(),
        *f"--freeze --output-dir {tmp_path / 'run'}".split(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    trained = load_model_state(tmp_path / "run" / "last.pt")
    backbone = {k: v for k, v in pretrained.items() if not k.startswith("fc.")}
    assert_same_weights({k: trained[k] for k in backbone}, backbone)
    assert trained["fc.weight"].shape == (3, 512)
    for key in ("fc.weight", "fc.bias"):
        assert (trained[key] - initial[key]).abs().max() > 1e-3, f"{key} did not train"


# What a notebook cell runs: main() twice in one process, the first stopped by Ctrl-C after its first step (SIGINT,
# as a terminal's Ctrl-C sends it), the second resuming; what the process holds is printed after each.
NOTEBOOK = """
import fcntl, json, os, signal, subprocess, sys, threading
import train_single, utils

def held():
    lock = subprocess.run([sys.executable, "-c", "import fcntl, sys; fcntl.lockf(open(sys.argv[1], 'a'), "
                           "fcntl.LOCK_EX | fcntl.LOCK_NB)", "run/.lock"], capture_output=True)
    return {"handlers": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)],
            "excepthook": str(threading.excepthook), "threads": sorted(t.name for t in threading.enumerate()),
            "children": len(__import__("multiprocessing").active_children()),
            "locked by this process": lock.returncode != 0 if os.path.exists("run/.lock") else None}

step = utils.Logger.step
def step_then_ctrl_c(self, *args):  # Ctrl-C once, after the first run's first step
    step(self, *args)
    if not getattr(utils, "pressed", False):
        utils.pressed = True
        os.kill(os.getpid(), signal.SIGINT)
utils.Logger.step = step_then_ctrl_c

found = held()
argv = sys.argv[1:]
stopped = train_single.main(train_single.get_args_parser().parse_args(argv))
after_stop = held()
resumed = train_single.main(train_single.get_args_parser().parse_args([*argv, "--resume", "auto", "--workers", "1"]))
print(json.dumps({"found": found, "stopped": stopped, "after stop": after_stop, "resumed": resumed,
                  "after resume": held()}))
"""


def test_main_twice_in_one_process_leaves_nothing_behind_and_equals_a_fresh_process(tiny_data, bare, exact_single):
    """As a notebook calls it (issue 68): Ctrl-C ends the first main() with its one line and status 130 (not a
    SystemExit into the session); afterwards the process holds what it held before (the signal handlers,
    threading.excepthook, its threads, no loader worker) and no lock on the run folder, so a second main() in the same
    process resumes it (with a loader worker, ended when it returns), ending where one uninterrupted run in a fresh
    process ends (exact_single's arguments)."""
    args = [*"--img-size 32 --epochs 2 --workers 0 --print-freq 1 --val-fraction 0.25 --freeze -b 16".split()]
    ended = run([sys.executable, "-c", NOTEBOOK, *args, "--data-path", str(tiny_data), "--output-dir", "run"], cwd=bare)
    assert ended.returncode == 0, ended.stdout[-3000:] + ended.stderr[-3000:]
    held = json.loads(ended.stdout.splitlines()[-1])
    assert "stopped by SIGINT after step 1: checkpoint saved" in ended.stdout, ended.stdout
    assert held["stopped"] == 130 and held["resumed"] is None, held
    for moment in ("after stop", "after resume"):
        assert held[moment] == {**held["found"], "locked by this process": False}, (moment, held)
    assert_same_weights(load_model_state(bare / "run" / "last.pt"), load_model_state(exact_single / "last.pt"))


def test_the_docs_predict_script_gives_the_runs_own_validation_predictions(exact_single, tiny_data, bare, tmp_path):
    """docs/adapting.md's predict.py, as it stands there and with no helper beside it, on best.pt and the run's
    validation images: each image's class and probability as the run's evaluation computes them (its validation set,
    the model normalising as run_model() does). Evaluated with other inputs (--test-only --img-size 48), a line says
    so."""
    code = re.search(r"```python\n(# predict\.py.*?)```", (REPO / "docs" / "adapting.md").read_text(), re.S)[1]
    (tmp_path / "predict.py").write_text(code)
    checkpoint = torch.load(exact_single / "best.pt", map_location="cpu", weights_only=True)
    _, val_set, classes = builtin.datasets(SimpleNamespace(**checkpoint["args"]))
    model = torchvision.models.get_model(checkpoint["args"]["model"], num_classes=len(classes))
    model.load_state_dict(checkpoint["model"])
    model.eval()
    expected = []
    with torch.no_grad():
        for (path, _), (image, _) in zip(val_set.files, val_set):
            probabilities = model(utils.normalize(image[None]))[0].softmax(0)
            expected.append(f"{path}: {classes[probabilities.argmax()]} {probabilities.max():.6f}")
    files = [path for path, _ in val_set.files]
    predicted = run([sys.executable, "predict.py", str(exact_single / "best.pt"), *files], cwd=tmp_path)
    assert predicted.returncode == 0, predicted.stderr[-2000:]
    assert predicted.stdout.splitlines() == expected

    other = run(
        [sys.executable, SCRIPT, "--test-only", "--resume", str(exact_single / "best.pt"), "--img-size", "48"]
        + ["--data-path", str(tiny_data), "--val-fraction", "0.25", "--output-dir", str(tmp_path / "other")],
        cwd=bare,
    )
    assert other.returncode == 0, other.stderr[-2000:]
    assert f"warning: {exact_single / 'best.pt'} was evaluated with inputs prepared as" in other.stdout, other.stdout
    assert "'center_crop': 32" in other.stdout and "'center_crop': 48" in other.stdout


def test_a_reader_that_goes_away_loses_nothing(tiny_data, tmp_path):
    """`python train_single.py | head -2`: once the reader has gone, the progress lines are dropped and the run trains
    to its end and saves, with exit 0 and no traceback (before: a BrokenPipeError traceback at the next line, and no
    checkpoint)."""
    args = [*"--img-size 32 -b 8 --epochs 2 --print-freq 1 --val-fraction 0.25".split(), "--data-path", tiny_data]
    with open(tmp_path / "stderr", "w") as stderr:
        job = subprocess.Popen(
            [sys.executable, SCRIPT, *map(str, args), "--output-dir", str(tmp_path / "run")],
            cwd=REPO,
            env=job_env(),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        head = [job.stdout.readline() for _ in range(2)]
        job.stdout.close()  # head ends
        assert job.wait(timeout=120) == 0 and "ResNet" in head[0], head
    errors = (tmp_path / "stderr").read_text()
    assert "Traceback" not in errors and "Error" not in errors, errors[-3000:]
    assert (tmp_path / "run" / "results.json").is_file() and (tmp_path / "run" / "last.pt").is_file()


def test_a_resume_onto_changed_data_is_refused_and_onto_moved_data_continues(tmp_path):
    """Issue 69: one image added to each class reshuffled the validation split under a resume (29 of its 40 images had
    been training images) with no word, and a folder with fewer images resumed 'after 120 of its 65 samples'. The
    checkpoint keeps each set's size and its files' fingerprint: changed data ends in one line before training;
    the same data in another folder resumes."""
    data = make_dataset(tmp_path / "data", [12, 12, 12])
    first = [sys.executable, SCRIPT, *FAST, "--epochs", "1", "--data-path", data, "--output-dir", tmp_path / "first"]
    assert run(first).returncode == 0
    shutil.copytree(data, tmp_path / "moved")
    resume = [sys.executable, SCRIPT, *FAST, "--resume", tmp_path / "first" / "last.pt"]
    moved = run([*resume, "--data-path", tmp_path / "moved", "--output-dir", tmp_path / "moved-run"])
    assert moved.returncode == 0 and "resuming from" in moved.stdout, moved.stderr[-2000:]
    make_dataset(tmp_path / "grown", [13, 13, 13])  # one more image in each class
    grown = run([*resume, "--data-path", tmp_path / "grown", "--output-dir", tmp_path / "grown-run"])
    assert grown.returncode == 1 and grown.stderr == (
        f"error: --resume {tmp_path / 'first' / 'last.pt'}: the data changed since it was saved (validation samples: "
        f"6 then, 9 now; other training files; other validation files): resume with the data it was trained on, or "
        f"start a new run from its weights (--weights, a new --output-dir)\n"
    ), grown.stderr
    assert "Traceback" not in grown.stderr and not (tmp_path / "grown-run" / "last.pt").exists()


def test_evaluation_every_n_steps_resumes_bitwise_and_early_stopping_ends_the_run(tiny_data, tmp_path):
    """--eval-every 2 on 6 steps an epoch: an evaluation (and a save) at steps 2, 4 and each epoch's end, training on in
    train mode after each. SIGTERM as step 4 ends: whether it lands before that evaluation, in it or after it, the
    evaluation is recorded once (a cut-short one by the resumed run, first); SIGTERM once step 10's evaluation is
    printed: the resumed run does not make it again. The resumed run ends bitwise where the uninterrupted one does,
    with the same metrics.jsonl and best.pt. --early-stop 2 with an LR that learns nothing
    ends the run after the third evaluation, with its line and results.json, and a resume of it trains no more."""
    args = [sys.executable, SCRIPT, *FAST, "--epochs", "3", "--eval-every", "2", "--data-path", tiny_data]
    whole = run([*args, "--output-dir", tmp_path / "whole"])
    assert whole.returncode == 0, whole.stderr[-2000:]
    evaluations = [json.loads(line)["step"] for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [step for step in evaluations if evaluations.count(step) == 2]  # a step's line and its evaluation's
    assert sorted(set(evaluations)) == list(range(2, 19, 2)), evaluations

    # SIGTERM as step 4 ends (its evaluation not yet recorded, or cut short), then, resumed, once step 10's evaluation
    # is printed (recorded, and saved just after it): each stop is one line, and each evaluation is made once
    for trigger, resume in (("epoch 1/3  step 4/6", []), ("epoch 2/3  val", ["--resume", "auto"])):
        job, lines = start([*args, "--output-dir", tmp_path / "run", *resume]), []
        seen = read_until(job, lines, trigger)
        if seen and resume:  # the second evaluation of epoch 2: step 10's
            seen = read_until(job, lines, trigger)
        if seen:
            job.send_signal(signal.SIGTERM)
        output = finish(job, lines, timeout=120)
        assert seen and job.returncode == 143 and "stopped by SIGTERM after step" in output, output[-2000:]
    resumed = run([*args, "--output-dir", tmp_path / "run", "--resume", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    for name in ("last.pt", "best.pt"):
        assert_same_weights(load_model_state(tmp_path / "run" / name), load_model_state(tmp_path / "whole" / name))

    def logged(folder):
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [
            {k: v for k, v in json.loads(line).items() if k not in ("samples_per_s", "data_wait")} for line in lines
        ]

    assert logged(tmp_path / "run") == logged(tmp_path / "whole")

    still = [*args, "--freeze", "--lr", "1e-12", "--early-stop", "2", "--eval-every", "1"]
    still += ["--output-dir", tmp_path / "early"]
    early = run(still)
    assert early.returncode == 0 and "stopping early: val acc has not beaten its best" in early.stdout, early.stdout
    assert early.stdout.count("val loss") == 3 and (tmp_path / "early" / "results.json").is_file(), early.stdout
    again = run([*still, "--resume", tmp_path / "early" / "last.pt", "--output-dir", tmp_path / "again"])
    assert again.returncode == 0 and "  step " not in again.stdout, again.stdout[-2000:]
