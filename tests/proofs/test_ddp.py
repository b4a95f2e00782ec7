"""The parallel ladder, proven on CPU with real launchers and real gloo processes.

Most runs use a folder holding only the six scripts and their helpers (the copy-out case, shared.bare). With --freeze
the forward pass of a sample does not depend on the rest of its batch, so W processes x batch B must end where one
process with batch W x B ends. Tolerance 1e-5: float32 sums in another order explain ~1e-7 here (measured 3e-8), while a
sampler, averaging or LR bug moves the weights by 1e-3 or more. Every run starts from torchvision's "ImageNet weights"
by name (--weights IMAGENET1K_V1), read from the hub cache with no network (shared.hub_cache).
"""

import json
import os
import re
import shutil
import sys

import pytest
import torch

from support import (
    BF16,
    NAMED_WEIGHTS,
    NO_NETWORK,
    REPO,
    assert_same_weights,
    collectives_per_step,
    load_model_state,
    ok,
    run,
    run_sh,
    torchrun,
)
from support import make_dataset

TOL = 1e-5
COMMON = NAMED_WEIGHTS  # EXACT (--freeze) from --weights IMAGENET1K_V1


@pytest.fixture(scope="module", autouse=True)
def offline_hub(hub_cache):
    """Every process this module starts inherits TORCH_HOME (the cache holding IMAGENET1K_V1) and no network."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_HOME", str(hub_cache[0]))
        for name, value in NO_NETWORK.items():
            patch.setenv(name, value)
        yield


def train_losses(stdout):  # the loss of each progress line (utils.Logger.step's)
    return [float(loss) for loss in re.findall(r"^epoch \d+/\d+\s+step \d+/\d+\s+loss (\S+)", stdout, re.M)]


def results(folder):
    return json.loads((folder / "results.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_data, bare):
    """The references, NAMED_WEIGHTS: one process with batch 16 (single, dp: copied out) and 2 x batch 8 through
    run.sh as a user starts them (launch, ddp: run.sh picks the launcher, a free port, the threads).
    {"dir": their folder, "dp"|"launch"|"ddp": the CompletedProcess}."""
    out, data = tmp_path_factory.mktemp("ladder"), ["--data-path", tiny_data]
    runs = {"dir": out}
    for script in ("train_single.py", "train_dp.py"):
        runs[script[6:-3]] = ok(
            run(
                [sys.executable, script, *NAMED_WEIGHTS, *data, "-b", "16", "--output-dir", out / script[6:-3]],
                cwd=bare,
            )
        )
    for mode, extra in (("launch", []), ("ddp", ["--save-every", "2"])):
        runs[mode] = ok(run_sh(mode, 2, *NAMED_WEIGHTS, *data, "-b", "8", *extra, "--output-dir", out / mode))
    return runs


@pytest.mark.quick
def test_dp_on_cpu_runs_unwrapped_and_equals_single_exactly(runs):
    """On a CPU, train_dp.py has no GPUs to split the batch over and trains the module unwrapped, the same path as
    train_single.py: this proves the dp rung's own loop, LR and checkpoints, not DataParallel itself (which
    tests/gpu/test_gpu.py runs where 2 GPUs exist)."""
    assert "DataParallel needs 2 or more GPUs: training unwrapped on cpu" in runs["dp"].stdout
    assert_same_weights(
        load_model_state(runs["dir"] / "dp" / "last.pt"), load_model_state(runs["dir"] / "single" / "last.pt")
    )


@pytest.mark.quick
@pytest.mark.parametrize("name", ["launch", "ddp"])
def test_ddp_equals_single_process_with_the_global_batch(runs, name):
    out = runs["dir"]
    assert "global batch 16 = 8 per process x 2 processes" in runs[name].stdout
    assert_same_weights(
        load_model_state(out / name / "last.pt"), load_model_state(out / "single" / "last.pt"), atol=TOL
    )
    # Only global rank 0 prints: one progress line per step (3 steps x 2 epochs), not one per rank; its loss is the
    # ranks' mean, the loss of the global batch that one process logs (4 decimals: to the last digit's rounding)
    assert runs[name].stdout.count("epoch 2/2  step 3/3") == 1
    losses, single = (train_losses(runs[run].stdout) for run in (name, "single"))
    assert len(losses) == 6 and losses == pytest.approx(single, abs=2e-4), (losses, single)
    assert results(out / name)["final_acc"] == pytest.approx(results(out / "single")["final_acc"])
    assert results(out / name)["val_confusion"] == results(out / "single")["val_confusion"]  # summed over the ranks


def test_named_weights_are_read_from_the_hub_cache_on_every_rank(runs, hub_cache, initial_weights):
    """--weights IMAGENET1K_V1 with --freeze: the backbone ends exactly as the cached file holds it and the new
    3-class head trained, in every script; no rank tried the network (every proxy points at a closed port)."""
    _, pretrained = hub_cache
    initial = initial_weights  # the new head starts as this model's
    for name in ("single", "dp", "launch", "ddp"):
        trained = load_model_state(runs["dir"] / name / "last.pt")
        assert_same_weights(
            {k: trained[k] for k in pretrained if not k.startswith("fc.")},
            {k: v for k, v in pretrained.items() if not k.startswith("fc.")},
        )
        assert trained["fc.weight"].shape == (3, 512)
        assert (trained["fc.weight"] - initial["fc.weight"]).abs().max() > 1e-3, f"{name}: the head did not train"


def test_evaluation_is_exact_for_any_world_size(evaluations):
    """17 validation images: DistributedSampler would pad them to 18; every count and sum must match 1 process
    (shared.evaluations: one checkpoint evaluated by train_ddp_launch.py alone with --local_rank=0, the old spelling,
    and at 2 processes, and by train_ddp_torchrun.py at 3)."""
    one = evaluations["alone"]
    assert one["val_count"] == 17
    for name in ("launch", "torchrun"):
        other = evaluations[name]
        assert other["val_count"] == 17 and other["val_acc"] == one["val_acc"], (name, other, one)
        assert other["val_loss"] == pytest.approx(one["val_loss"], rel=1e-6), name
        assert other["val_confusion"] == one["val_confusion"], name


def test_accumulation_all_reduces_once_per_optimizer_step(tiny_data, bare, tmp_path):
    """2 x batch 2 x 2 micro-steps == 2 x batch 4: the same weights, and as many gradient all-reduces per optimizer
    step, not twice as many. Counted from --profile's trace by tools/profile_report.py (nothing is hooked into DDP):
    6 steps an epoch, and no progress line or evaluation in the profiled steps 4 and 5."""
    out = tmp_path
    for name, batch, accum in (("plain", 4, 1), ("accum", 2, 2)):
        proc = ok(
            torchrun(
                2,
                "train_ddp_torchrun.py",
                *COMMON,
                *f"--data-path {tiny_data} -b {batch} --accum-steps {accum} --sync-bn --print-freq 10".split(),
                *f"--profile 2 --output-dir {out / name}".split(),
                cwd=bare,
            )
        )
    assert_same_weights(
        load_model_state(out / "accum" / "last.pt"), load_model_state(out / "plain" / "last.pt"), atol=TOL
    )
    plain, accum = (collectives_per_step(out / name / "trace.json") for name in ("plain", "accum"))
    assert accum["allreduce"] == plain["allreduce"] == 1, (plain, accum)  # --freeze: the head's bucket only
    # --sync-bn on CPU: one warning, then per-process BatchNorm
    assert (proc.stdout + proc.stderr).count("warning: --sync-bn needs GPUs") == 1


def progress(stdout, field):
    """A field's value ("loss", "lr") in each progress line."""
    return [float(line.split(f"  {field} ")[1].split()[0]) for line in stdout.splitlines() if "  step " in line]


@pytest.mark.quick
def test_amp_bf16_on_cpu_runs_under_autocast(runs, amp_run):
    """The amp rung with the torchrun rung's arguments: without autocast it would compute exactly what that rung
    computes, bitwise (the same processes, threads and order of sums). With bf16 autocast the weights end near the
    torchrun rung's, and further from them than a different order of float32 sums could take them: bf16 keeps 8
    bits of mantissa. (The printed losses are rounded to 4 decimals: on a CPU with native bf16 the first ones can
    print equal, so they prove nothing here.)"""
    amp_losses, fp32_losses = progress(amp_run["stdout"], "loss"), progress(runs["ddp"].stdout, "loss")
    assert len(amp_losses) == len(fp32_losses) == 6
    assert all(abs(a - b) < 0.05 for a, b in zip(amp_losses, fp32_losses)), (amp_losses, fp32_losses)
    amp, fp32 = (load_model_state(folder / "last.pt") for folder in (amp_run["dir"], runs["dir"] / "ddp"))
    assert_same_weights(amp, fp32, atol=1e-2)
    apart = max((amp[k].double() - fp32[k].double()).abs().max().item() for k in amp if amp[k].is_floating_point())
    assert apart > 1e-6, apart  # without autocast: 0 (docs/proofs.md has the figures)


CLIP = 1e-3


def test_clip_grad_bounds_each_step(amp_run, initial_weights, tiny_data, bare, tmp_path):
    """--clip-grad small enough to clip every step (CLIP) bounds how far the head moves (with --freeze only the head
    trains); unclipped (the amp run above) it moves more than ten times as far."""
    clip = CLIP
    proc = ok(
        torchrun(
            2,
            "train_ddp_amp.py",
            *COMMON,
            *BF16,
            *f"--data-path {tiny_data} -b 8 --clip-grad {clip} --output-dir {tmp_path / 'clipped'}".split(),
            cwd=bare,
        )
    )
    initial = initial_weights  # where the head starts
    moved = {}
    for name, folder in (("clipped", tmp_path / "clipped"), ("unclipped", amp_run["dir"])):
        state = load_model_state(folder / "last.pt")
        moved[name] = torch.cat([(state[k] - initial[k]).flatten() for k in ("fc.weight", "fc.bias")]).norm().item()
    # SGD with momentum 0.9 and weight decay 1e-4: each step moves the head by at most lr x 10 x (the clipped
    # gradient norm + 1e-4 x the head's norm, ~1)
    bound = sum(progress(proc.stdout, "lr")) * 10 * (clip + 1e-4 * 1.5)
    assert moved["clipped"] <= bound < moved["unclipped"] / 10, (moved, bound)


def test_bad_input_is_reported_once_and_ends_the_job(tiny_data, bare, tmp_path):
    """Each job must end well before --dist-timeout (300 s): each has 120 s (the time a loaded machine may need)."""
    # Local rank 0 starts 2 s late, as on a loaded machine: rank 1 finds the error first, and the launcher stops every
    # rank once one fails, so without rank 1 waiting the job ended with no error line at all (seen in CI).
    late_rank_0 = tmp_path / "late_rank_0.sh"
    late_rank_0.write_text(f'[ "$LOCAL_RANK" = 0 ] && sleep 2\nexec {sys.executable} "$@"\n')
    # A file that only one rank reads (below): that rank reports it, and the job ends instead of hanging
    data = make_dataset(tmp_path / "data", [12, 12])
    (data / "c1" / "0003.jpg").write_bytes(b"not an image at all")
    # A user's copy whose dataset returns dicts, and one whose model holds a layer that forward() never calls
    dicts, unused = (users_copy(tmp_path / name, code) for name, code in (("dicts", DICT_ITEMS), ("unused", UNUSED)))
    # each job fails within seconds, mostly starting up
    dict_items = torchrun(2, "train_ddp_torchrun.py", "--epochs", "1", "--output-dir", "out", cwd=dicts, timeout=120)
    unused_layer = torchrun(
        2, "train_ddp_torchrun.py", "--epochs", "1", "-b", "8", "--output-dir", "out", cwd=unused, timeout=120
    )
    # (a device this machine lacks, as every rank finds it: "--device cuda:1" where no GPU is visible)
    late = run(
        [
            sys.executable,
            *f"-m torch.distributed.run --standalone --nproc-per-node=2 --no-python bash {late_rank_0}".split(),
            *f"train_ddp_torchrun.py --device cuda:1 --data-path {tiny_data}".split(),
        ],
        cwd=bare,
        timeout=120,
    )
    # Named weights missing from the cache, no network: local rank 0 tries the download and reports it; rank 1 waits
    no_network = torchrun(
        2,
        "train_ddp_torchrun.py",
        *COMMON,
        *f"--data-path {tiny_data} --model resnet34 --weights DEFAULT -b 4".split(),
        *f"--output-dir {tmp_path / 'no_network'}".split(),
        cwd=bare,
        timeout=120,
    )
    unreadable = torchrun(
        2,
        "train_ddp_torchrun.py",
        *COMMON,
        *f"--data-path {data} -b 4 --output-dir {tmp_path / 'out'}".split(),
        cwd=bare,
        timeout=120,
    )

    assert late.returncode != 0
    errors = [line for line in (late.stdout + late.stderr).splitlines() if line.startswith("error:")]
    assert errors == ["error: --device cuda:1: this machine has no usable cuda GPU; use --device cpu"], late.stderr[
        -2000:
    ]

    errors = [line for line in (no_network.stdout + no_network.stderr).splitlines() if line.startswith("error:")]
    assert no_network.returncode != 0 and len(errors) == 1, no_network.stderr[-2000:]
    assert (
        "cannot download" in errors[0]
        and f"put that file at {os.environ['TORCH_HOME']}/hub/checkpoints/resnet34-" in errors[0]
    ), errors

    assert unreadable.returncode != 0
    errors = [line for line in (unreadable.stdout + unreadable.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "0003.jpg" in errors[0], unreadable.stderr[-3000:]
    assert "Traceback" not in unreadable.stdout

    for proc, line in (
        (
            dict_items,
            "error: the training set's items must be (input, target) pairs; its "
            "first is a dict with keys 'image', 'label': return (item[input key], "
            "item[target key])",
        ),
        (
            unused_layer,
            "error: some parameters got no gradient in the last step (2 3): the model holds "
            "a module that forward() does not use; remove it, or pass "
            "find_unused_parameters=True in the DDP(...) line (docs/troubleshooting.md)",
        ),
    ):
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
        assert proc.returncode != 0 and errors == [line], proc.stderr[-3000:]
        assert proc.stderr.count("Traceback") == 1, proc.stderr[-3000:]  # torchrun's own report, after the line


DICT_ITEMS = """
class Dicts(torch.utils.data.Dataset):  # items as some libraries return them
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"image": torch.zeros(3, 8, 8), "label": index % 2}


def build_datasets(args):
    return Dicts(), Dicts(), ["a", "b"]


def build_model(args, num_classes):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, num_classes))
"""
UNUSED = """
class Net(torch.nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, num_classes))
        self.aux_head = torch.nn.Linear(3 * 8 * 8, num_classes)  # never called

    def forward(self, x):
        return self.body(x)


def build_datasets(args):
    data = torch.utils.data.TensorDataset(torch.randn(64, 3, 8, 8), torch.arange(64) % 2)
    return data, data, ["a", "b"]


def build_model(args, num_classes):
    return Net(num_classes)
"""


def users_copy(folder, code):
    """train_ddp_torchrun.py, utils.py and dist_utils.py in folder (no builtin.py), the task block's flags, data and
    model replaced by code (our other definitions kept)."""
    folder.mkdir()
    for name in ("utils.py", "guards.py", "reporting.py", "dist_utils.py"):
        shutil.copy(REPO / name, folder)
    text = (REPO / "train_ddp_torchrun.py").read_text()
    for name in ("add_task_arguments", "build_datasets", "build_model"):  # ours of the others kept
        text = re.sub(rf"^def {name}\(.*?(?=^(def|class) )", "", text, count=1, flags=re.S | re.M)
    start = text.index("def input_problem(")
    no_flags = "def add_task_arguments(parser):\n    pass\n\n\n"
    (folder / "train_ddp_torchrun.py").write_text(text[:start] + no_flags + code.lstrip() + "\n\n" + text[start:])
    return folder


def test_run_sh_refuses_a_bad_process_count():
    proc = run_sh("ddp", 0, timeout=60)
    assert proc.returncode == 2 and "N must be at least 1" in proc.stderr
