"""train_ddp_amp.py --compile on the CPU: torch.compile of the DDP-wrapped model, compiled by inductor with gcc.

Compiling is what costs here: on 2 processes x 1 thread, resnet18 at 32 px took ~21 s to its first step with a
frozen backbone and ~56 s without (the backward graph then covers every layer), with an empty inductor cache. So
there is one compiled job, with --freeze (only the head trains, BatchNorm in eval mode), and its own empty cache, so
that it costs the same on a fresh machine as on a warm one. It resumes the eager run's mid-epoch checkpoint
(shared.amp_run: the same arguments without --compile, shared with test_ddp.py; its checkpoint copied while it
ran) and must end where that run ended.
"""

import shutil

import torch
import torchvision

from support import (
    BF16,
    NAMED_WEIGHTS,
    assert_resumed_after,
    assert_same_weights,
    checkpoint_step,
    hub_env,
    load_model_state,
    ok,
    run_sh,
)

# bf16 autocast: inductor fuses and rounds differently from eager, and the head's weights end ~5e-5 apart after 3
# steps (measured); a rank that skipped the all-reduce, or a step lost on resume, moves them by ~1e-3.
TOL = 5e-4


def test_compiled_ddp_matches_eager_saves_plain_keys_and_resumes(
    amp_run, hub_cache, initial_weights, tiny_data, tmp_path
):
    """The compiled model resumes a checkpoint (loaded into the plain module inside the compiled DDP wrapper), trains
    to the end within TOL of the eager run, and saves plain keys: a resnet18 loads them strictly, and so does the
    next --resume, compiled or not."""
    cache = tmp_path / "inductor"  # a cold compile, every time
    env = hub_env(hub_cache, TORCHINDUCTOR_CACHE_DIR=str(cache))
    paused = amp_run["paused"]  # after step 2 of epoch 1, or after epoch 1
    checkpoint = torch.load(paused / "last.pt", weights_only=True)
    shutil.copytree(paused, tmp_path / "compiled")
    resumed = ok(
        run_sh(
            "amp",
            2,
            *NAMED_WEIGHTS,
            *BF16,
            *f"-b 8 --data-path {tiny_data} --compile --resume auto --output-dir {tmp_path / 'compiled'}".split(),
            env=env,
        )
    )
    assert compiled_kernels(cache), "--compile compiled nothing: the test's inductor cache is empty"
    assert_resumed_after(resumed.stdout, step=checkpoint_step(checkpoint, 3))

    state = load_model_state(tmp_path / "compiled" / "last.pt")
    assert not [key for key in state if key.startswith(("_orig_mod.", "module."))], list(state)[:3]
    torchvision.models.resnet18(num_classes=3).load_state_dict(state)  # strict: every key, nothing extra
    eager = load_model_state(amp_run["dir"] / "last.pt")
    assert_same_weights(state, eager, atol=TOL)
    # the head must have moved far from where the scripts start, far more than the tolerance
    assert (eager["fc.weight"] - initial_weights["fc.weight"]).abs().max() > 20 * TOL


def compiled_kernels(cache):
    """The kernels inductor wrote into its cache folder (generated Python and C++ sources), if any."""
    return [path for path in cache.rglob("*") if path.suffix in (".py", ".cpp")] if cache.exists() else []
