"""tools/site.py, the ladder's pages: the real notes explain every hunk of every step's diff (--check), a check fails in
one line where a hunk has no note, a note's code is gone or it names a lesson or a test that does not exist, and a
build without runs writes every page, each step page showing exactly the hunks of `diff OLD NEW`. No training runs
here: the pictures' runs are what `bash run.sh site` does."""

import re
import shutil
import subprocess
import tomllib
from html.parser import HTMLParser

import pytest

from support import REPO, module_at

ladder_site = module_at("tools/site.py", "ladder_site")

FAKE_LESSONS = "\n".join(
    [
        "# Lessons",
        "",
        "| lesson | script | the line | changed to | without it, the run printed (GPU rows: what is expected) | test |",
        "|---|---|---|---|---|---|",
        "| `no-set-epoch` | `train_ddp_launch.py` | `train_sampler.set_epoch(epoch)` | (removed) | `the same order` "
        "| `tests/proofs/test_ddp.py::test_ddp_equals_single_process_with_the_global_batch` |",
        "| `a-pipe` | `train_single.py` | `a \\| b` | **bold** and [a link](ladder.md#the-ladder) | `x` "
        "| `test_evaluation_is_exact_for_any_world_size` |",
        "",
    ]
)


def copy_of_the_repository(tmp_path, notes):
    """The scripts, the tests (the proofs' sources) and docs/ with `notes` as ladder-notes.toml and FAKE_LESSONS as
    lessons.md, in tmp_path."""
    tmp_path.mkdir(exist_ok=True)
    for script in REPO.glob("train_*.py"):
        shutil.copy(script, tmp_path)
    shutil.copytree(REPO / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ladder-notes.toml").write_text(notes)
    (tmp_path / "docs" / "lessons.md").write_text(FAKE_LESSONS)
    return tmp_path


def toml_string(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def notes_for_every_hunk(root):
    """ladder-notes.toml with one note per hunk (its first non-blank changed line as the code), so that these tests
    hold whatever the real notes say; the first note of a page names a lesson, a proof and, where a page has one, a
    picture. (The real notes pass the same check: test_the_real_notes_explain_every_hunk.)"""
    pictures = {"single-launch": "ddp-equals-single", "launch-torchrun": "resumed-equals-uninterrupted"}
    notes = []
    for step in ladder_site.STEPS:
        old, new, _ = ladder_site.STEPS[step]
        for i, hunk in enumerate(ladder_site.run_diff(root, old, new)):
            code = next(line for line in hunk.lines if line.strip())
            notes.append(
                f"[[note]]\npage = {toml_string(step)}\ncode = [{toml_string(code)}]\n"
                f'kind = "{"lesson" if i % 2 else "robustness"}"\ntext = "Why `{step}` hunk {i + 1} is **there**."\n'
                + (
                    'lessons = ["no-set-epoch"]\n'
                    'proofs = ["tests/proofs/test_ddp.py::test_evaluation_is_exact_for_any_world_size"]\n'
                    + (f'picture = "{pictures[step]}"\n' if step in pictures else "")
                    if i == 0
                    else ""
                )
            )
    return "\n".join(notes)


@pytest.fixture
def repo(tmp_path):
    root = copy_of_the_repository(tmp_path / "repo", "")
    (root / "docs" / "ladder-notes.toml").write_text(notes_for_every_hunk(root))
    return root


def errors_of(root, capsys):
    """`site.py --check --root ROOT`: its exit status and its lines on stderr."""
    status = ladder_site.main(["--check", "--root", str(root)])
    captured = capsys.readouterr()
    assert captured.out == ""
    return status, captured.err.splitlines()


def test_the_real_notes_explain_every_hunk(tmp_path):
    """docs/ladder-notes.toml passes --check against the scripts as they are (the gallery: docs/lessons.md, once
    written; until then a copy with the lesson ids the notes name)."""
    if (REPO / "docs" / "lessons.md").is_file():
        errors = ladder_site.check(REPO)
    else:
        root = copy_of_the_repository(tmp_path, (REPO / "docs" / "ladder-notes.toml").read_text())
        notes = tomllib.loads((root / "docs" / "ladder-notes.toml").read_text())["note"]
        named = {lesson for note in notes for lesson in note.get("lessons", [])}
        rows = "".join(f"| `{lesson}` | x | x | x | x | x |\n" for lesson in sorted(named - {"no-set-epoch"}))
        (root / "docs" / "lessons.md").write_text(FAKE_LESSONS.rstrip("\n") + "\n" + rows)
        errors = ladder_site.check(root)
    assert not errors, "\n".join(errors)


def test_a_hunk_without_a_note_or_a_note_whose_code_is_gone_fails_in_one_line(repo, capsys):
    assert errors_of(repo, capsys) == (0, [])
    notes = (repo / "docs" / "ladder-notes.toml").read_text()

    with open(repo / "train_dp.py", "a") as script:  # a new hunk at the end of `diff train_single.py train_dp.py`
        script.write("print('a line no note explains')\n")
    status, errors = errors_of(repo, capsys)
    assert status == 2 and len(errors) == 1, errors
    assert re.match(r"error: single-dp: hunk \d+a\d+ \(train_single.py lines none, train_dp.py lines \d+; ", errors[0])
    assert "print('a line no note explains')" in errors[0] and 'page = "single-dp"' in errors[0], errors
    shutil.copy(REPO / "train_dp.py", repo)

    first, _, rest = notes.partition("\n\n[[note]]")  # the first note gone: its hunk has none
    (repo / "docs" / "ladder-notes.toml").write_text("[[note]]" + rest)
    status, errors = errors_of(repo, capsys)
    assert status == 2 and len(errors) == 1 and errors[0].startswith("error: single-launch: hunk 2c2 ("), errors

    gone = notes.replace('code = ["', 'code = ["a_call_that_is_gone()", "', 1)
    (repo / "docs" / "ladder-notes.toml").write_text(gone)
    status, errors = errors_of(repo, capsys)
    assert status == 2 and len(errors) == 1, errors
    assert errors[0].startswith(
        "error: docs/ladder-notes.toml note 1 (page 'single-launch'): code 'a_call_that_is_gone()'"
    )
    assert "the code it explains is gone" in errors[0]


@pytest.mark.parametrize(
    "change, says",
    [
        (('lessons = ["no-set-epoch"]', 'lessons = ["no-such-lesson"]'), "lesson 'no-such-lesson' is not in"),
        (("::test_evaluation_is_exact_for_any_world_size", "::test_that_does_not_exist"), "has no test_that_does_not"),
        (("tests/proofs/test_ddp.py", "tests/proofs/test_gone.py"), "tests/proofs/test_gone.py is no file under"),
        (('picture = "ddp-equals-single"', 'picture = "a-sketch"'), "unknown picture 'a-sketch'"),
        (('kind = "lesson"', 'kind = "aside"'), "unknown kind 'aside'"),
        (('page = "single-launch"', 'page = "single-ddp"'), "unknown page 'single-ddp'"),
    ],
)
def test_an_unknown_lesson_proof_picture_kind_or_page_fails_in_one_line(repo, capsys, change, says):
    notes = (repo / "docs" / "ladder-notes.toml").read_text()
    (repo / "docs" / "ladder-notes.toml").write_text(notes.replace(*change, 1))
    status, errors = errors_of(repo, capsys)
    assert status == 2 and says in errors[0], errors
    assert len(errors) == 1 + change[0].startswith("page"), errors  # a note on no page leaves its hunk without one


class Hunks(HTMLParser):
    """What a step page shows, read from the HTML alone: .hunks [(data-diff, old side's changed lines, new side's)],
    .lines {"old"|"new": [(line number, text)] of every line shown, folded or not, in page order}."""

    def __init__(self):
        super().__init__()
        self.hunks, self.lines, self.stack, self.text = [], {"old": [], "new": []}, [], None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = (attrs.get("class") or "").split()
        self.stack.append((tag, classes))
        if tag == "section" and "hunk" in classes:
            self.hunks.append((attrs["data-diff"], [], []))
        if "line" in classes and "data-line" in attrs:
            self.number, self.text = int(attrs["data-line"]), ""

    def handle_endtag(self, tag):
        _, classes = self.stack.pop()
        if "line" in classes and self.text is not None:
            side = next(c for _, cs in reversed(self.stack) for c in cs if c in ("old", "new"))
            self.lines[side].append((self.number, self.text))
            if "changed" in classes:
                self.hunks[-1][1 if side == "old" else 2].append(self.text)
            self.text = None

    def handle_data(self, data):
        if self.text is not None:
            self.text += data


def diffs_hunks(root, old, new):
    """`diff OLD NEW` as the learner reads it: [(command, its < lines, its > lines)]."""
    out = subprocess.run(["diff", old, new], cwd=root, capture_output=True, text=True).stdout
    hunks = []
    for line in out.splitlines():
        if line[:1].isdigit():
            hunks.append((line, [], []))
        elif line[:2] in ("< ", "> "):
            hunks[-1][1 if line[0] == "<" else 2].append(line[2:])
    return hunks


def test_a_build_without_runs_writes_every_page_with_diffs_own_hunks(repo, tmp_path, capsys):
    out = tmp_path / "site"
    assert ladder_site.main(["--root", str(repo), "--out", str(out), "--no-runs"]) == 0
    assert "pages in" in capsys.readouterr().out
    pages = {path.name for path in out.iterdir()}
    steps = {f"{step}.html" for step in ladder_site.STEPS}
    assert pages == {"index.html", "lessons.html", "proofs.html", "site.css", ".nojekyll", "source", *steps}, pages
    shown = re.findall(r'href="(source/[^"]+)"', (out / "proofs.html").read_text())  # the test files, copied in
    assert shown and all((out / path).read_text() == (repo / path[7:]).read_text() for path in shown)
    assert not (out / "runs").exists()
    index = (out / "index.html").read_text()
    assert all(f'href="{step}"' in index for step in steps) and 'href="lessons.html"' in index
    assert index.index("single-launch.html") < index.index("launch-torchrun.html") < index.index("single-dp.html")
    for step, (old, new, _) in ladder_site.STEPS.items():
        html = (out / f"{step}.html").read_text()
        shown = Hunks()
        shown.feed(html)
        assert shown.hunks == diffs_hunks(repo, old, new), step
        for side, script in (("old", old), ("new", new)):  # each file whole, in order, folded stretches included
            text = (repo / script).read_text().splitlines()
            assert shown.lines[side] == list(enumerate(text, start=1)), (step, side)
        assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
        assert html.count('class="picture no-runs"') == (step in ("single-launch", "launch-torchrun"))
    launch = (out / "single-launch.html").read_text()
    assert 'href="proofs.html#tests-proofs-test_ddp-py--test_evaluation_is_exact_for_any_world_size"' in launch
    assert 'href="lessons.html#no-set-epoch"' in launch and "<strong>there</strong>" in launch
    assert re.search(r'<details class="fold" [^>]*><summary>\d+ unchanged lines</summary>', launch)

    lessons = (out / "lessons.html").read_text()
    assert '<tr id="no-set-epoch" class="lesson">' in lessons and '<tr id="a-pipe" class="lesson">' in lessons
    assert "<code>a | b</code>" in lessons and '<a href="../repo/docs/ladder.md#the-ladder">a link</a>' in lessons
    proofs = (out / "proofs.html").read_text()
    for test in ("test_ddp_equals_single_process_with_the_global_batch", "test_evaluation_is_exact_for_any_world_size"):
        assert f'id="tests-proofs-test_ddp-py--{test}"' in proofs
        assert f"def {test}(" in proofs
    assert "@pytest.mark.quick" in proofs  # the decorators with the source


def test_a_build_needs_the_gallery_and_diff(repo, tmp_path, capsys, monkeypatch):
    (repo / "docs" / "lessons.md").unlink()
    assert ladder_site.main(["--root", str(repo), "--out", str(tmp_path / "site"), "--no-runs"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: docs/lessons.md is missing: lessons.html, the gallery, is made from its table",
        "error: docs/lessons.md is missing, and the notes name lessons that its table should hold",
    ]
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert ladder_site.main(["--root", str(repo), "--check"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: the `diff` command is missing: install GNU diffutils (apt-get install diffutils)"
    ]


def test_the_picture_of_two_runs():
    """A picture from two runs' records: two polylines (the second dashed by the stylesheet), the largest
    difference as a figure."""
    record = {"steps": 3, "losses": [[1, 1, 1.5], [1, 2, 1.25], [1, 3, 1.0], [2, 1, 0.75], [2, 2, 0.5], [2, 3, 0.5]]}
    record["val"] = [[1, 0.9], [2, 0.45]]
    claimed = {**record, "losses": [*record["losses"][:5], [2, 3, 0.4]], "stopped_after": 2}
    shown = ladder_site.figure(
        "resumed-equals-uninterrupted",
        {"torchrun": record, "resumed": claimed},
        REPO / "site" / "runs",
        REPO / "site",
        None,
    )
    assert shown.count("<polyline") == 2 and 'class="run run-2"' in shown
    assert "Largest |difference| of the two losses: <strong>0.1000</strong> (at step 6 of 6" in shown
    assert "every sample counted: 0.9000, 0.4500; in the second run the same." in shown
    assert "stopped after step 2" in shown and 'href="runs/resumed-stopped.log"' in shown
