# SPDX-License-Identifier: BSD-3-Clause
"""Copy a training script and exactly the helpers it needs into your project, ready to train there.

    bash run.sh copy RUNG DEST     # RUNG: a script (train_ddp_torchrun.py) or its run.sh mode (ddp)

The files are the script, every module of this folder that it imports and theirs (read from the code, so the list
cannot drift from it), and LICENSE. Nothing in DEST is overwritten: a file of the same name that differs ends the
copy in one line, before anything is written.
"""

import argparse
import ast
import filecmp
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# run.sh's modes, and how the demo trains in a copy (no run.sh there)
RUNGS = {
    "single": ("train_single.py", "python train_single.py"),
    "dp": ("train_dp.py", "python train_dp.py"),
    "launch": ("train_ddp_launch.py", "python -m torch.distributed.launch --nproc-per-node=2 train_ddp_launch.py"),
    "ddp": ("train_ddp_torchrun.py", "torchrun --standalone --nproc-per-node=2 train_ddp_torchrun.py"),
    "amp": ("train_ddp_amp.py", "torchrun --standalone --nproc-per-node=2 train_ddp_amp.py"),
    "fsdp": ("train_fsdp.py", "torchrun --standalone --nproc-per-node=2 train_fsdp.py"),
}
DEMO = "builtin.py"  # the demo task's data and model: what a copier replaces
ROLES = {  # what each file is, in a few words (a helper without one fails tests/units/test_copy.py)
    "utils.py": "the loop's helpers: flags, device, sample stream, position, checkpoints, stop, log",
    "guards.py": "the refusals and one-line endings (bad input, a folder in use, a damaged file)",
    "reporting.py": "TensorBoard's confusion picture, and --profile's profiler",
    "dist_utils.py": "what several processes need: the launcher's ranks, restarts, checks, stop vote",
    "fsdp_utils.py": "FSDP's sharded checkpoints checked, shard sizes, the EMA by shard",
    DEMO: "the demo task: our image folders and ResNet (your task block replaces it)",
}


def files_for(script):
    """The script and the modules of this folder it imports, at any depth (inside functions too): the script, its
    helpers by name, the demo task last."""
    files = [script]
    for name in files:
        for node in ast.walk(ast.parse((REPO / name).read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                found = f"{module.split('.')[0]}.py"
                if (REPO / found).is_file() and found not in files:
                    files.append(found)
    return [script, *sorted(set(files[1:]) - {DEMO}), *[DEMO] * (DEMO in files)]


def task_block(script):
    """The definitions of the script's task block (from `# --- your task` to `def main(args):`)."""
    text = (REPO / script).read_text()
    start = text[: text.index("your task\n")].count("\n") + 1  # the block's first line
    names = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            break
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.lineno > start:
            names.append(node.name)
    return names


def copy(rung, dest):
    """Copy the rung's files into dest; returns the lines that say what was written."""
    by_script = {script: (script, command) for script, command in RUNGS.values()}
    if rung not in RUNGS and rung not in by_script:
        raise SystemExit(f"copy: {rung} is not a training script: give one of {', '.join(RUNGS)}, or its train_*.py")
    script, command = RUNGS.get(rung) or by_script[rung]
    names = [*files_for(script), "LICENSE"]
    clashes = [name for name in names if (dest / name).exists() and not filecmp.cmp(REPO / name, dest / name, False)]
    if clashes:
        raise SystemExit(
            f"copy: {dest} already has {', '.join(clashes)}, different from ours: nothing was written; copy into "
            f"another folder, or move those files away"
        )
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(REPO / name, dest / name)
    lines = sum(len((REPO / name).read_text().splitlines()) for name in names if name.endswith(".py") and name != DEMO)
    said = [f"copied {script} into {dest}: {lines} lines of Python ({DEMO} aside), under the BSD-3-Clause LICENSE"]
    said += [f"  {name:<22} {ROLES.get(name, 'the script: your task block at its top')}" for name in names[:-1]]
    said += [
        f"Your task: replace in {script}'s task block (from `# --- your task` down to `def main(args):`) what differs:",
        f"  {', '.join(task_block(script))}",
        f"  (docs/adapting.md shows tasks of every kind); with your data and model, {DEMO} is not needed.",
        f"The demo trains there with: cd {dest} && {command}",
        "It needs torch, torchvision and tensorboard (torchcodec decodes the demo's images faster where installed).",
    ]
    return said


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rung", help=f"a training script, or its run.sh mode: {', '.join(RUNGS)}")
    parser.add_argument("dest", type=Path, help="the folder to copy into (created where it does not exist)")
    args = parser.parse_args()
    print("\n".join(copy(args.rung, args.dest)))


if __name__ == "__main__":
    sys.exit(main())
