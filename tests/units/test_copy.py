"""`bash run.sh copy RUNG DEST` (tools/copy_rung.py): the files a rung needs, read from its imports, agree with every
page that names them; a copy may be taken (a LICENSE, an SPDX line in each file), never overwrites a user's file,
and its messages name what works in the copy. That each copy trains a user's task is proven in
tests/proofs/test_adapting.py, whose projects this command makes."""

import re
import subprocess
import sys

import pytest

from support import REPO, copy_rung, module_at

copying = module_at("tools/copy_rung.py", "copy_rung")


def test_the_pages_list_the_files_that_each_rung_imports():
    """docs/adapting.md's table is the one list, equal to what the imports say; the README and ladder.md point to the
    command instead of naming files (the two lists that had drifted apart)."""
    page = (REPO / "docs" / "adapting.md").read_text()
    rows = dict(re.findall(r"^\| `\w+`: `(train_\w+\.py)` \| (.+?) \|$", page, re.M))
    assert sorted(rows) == sorted(script for script, _ in copying.RUNGS.values())
    for script, helpers in rows.items():
        assert re.findall(r"`([\w.]+)`", helpers) == copying.files_for(script)[1:], script
    for name in ("README.md", "docs/ladder.md"):
        text = (REPO / name).read_text()
        assert "bash run.sh copy" in text, name
        assert not re.search(r"[Cc]opy[^.]*?`utils\.py`", text), f"{name} lists the files to copy"


def test_every_file_of_a_copy_says_what_it_is_and_may_be_copied():
    files = {name for script, _ in copying.RUNGS.values() for name in copying.files_for(script)}
    assert "BSD 3-Clause License" in (REPO / "LICENSE").read_text()
    for name in files:
        assert (REPO / name).read_text().startswith("# SPDX-License-Identifier: BSD-3-Clause\n"), name
        assert name.startswith("train_") or name in copying.ROLES, f"{name}: no line in tools/copy_rung.py's ROLES"


def test_a_copy_holds_its_files_and_never_overwrites_a_users(tmp_path):
    said = copy_rung("fsdp", tmp_path / "project")
    written = sorted(path.name for path in (tmp_path / "project").iterdir())
    assert written == sorted([*copying.files_for("train_fsdp.py"), "LICENSE"])
    assert "build_datasets, input_problem" in "\n".join(said) and "torchrun --standalone" in said[-2], said
    assert copy_rung("fsdp", tmp_path / "project") == said  # the same files again: fine
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "utils.py").write_text("# the user's own\n")
    ended = subprocess.run(
        ["bash", "run.sh", "copy", "ddp", str(tmp_path / "mine")], cwd=REPO, capture_output=True, text=True
    )
    assert ended.returncode == 1 and ended.stderr == (
        f"copy: {tmp_path / 'mine'} already has utils.py, different from ours: nothing was written; copy into "
        f"another folder, or move those files away\n"
    )
    assert sorted(path.name for path in (tmp_path / "mine").iterdir()) == ["utils.py"]
    assert (tmp_path / "mine" / "utils.py").read_text() == "# the user's own\n"


@pytest.mark.parametrize("rung", ["ddp", "launch"])
def test_a_copy_started_without_a_launcher_names_a_command_that_works_there(rung, tmp_path):
    """No run.sh in a copy: the line names the launcher's command alone (beside run.sh, both: test_scale.py)."""
    copy_rung(rung, tmp_path)
    script = copying.RUNGS[rung][0]
    ended = subprocess.run([sys.executable, script, "--epochs", "1"], cwd=tmp_path, capture_output=True, text=True)
    launcher = "torchrun --standalone" if rung == "ddp" else "python -m torch.distributed.launch"
    assert ended.returncode == 1 and ended.stderr == (
        f"error: start this script with a launcher, which runs one process per device: {launcher} "
        f"--nproc-per-node=N {script}\n"
    )
