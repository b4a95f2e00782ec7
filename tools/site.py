# SPDX-License-Identifier: BSD-3-Clause
"""The ladder as a static site: each step's `diff` with a note beside each hunk, the gallery of broken lines, the
proofs, and pictures of runs that a page claims are equal.

    bash run.sh site [--out DIR] [--runs DIR] [--data-path DIR] [--no-runs] [--check]

Writes into --out (default site/): index.html, one page per step (single-dp.html, single-launch.html,
launch-torchrun.html, torchrun-amp.html, torchrun-fsdp.html), lessons.html, proofs.html, site.css and source/ (the
test files the proofs page shows): plain files that work opened from the disk (file://) and on a static host that
serves the folder alone, with nothing fetched from the network. The hunks are
GNU diff's own (`diff OLD NEW`, parsed), so a page shows what the learner's terminal shows. The notes come from
docs/ladder-notes.toml, the gallery from the table of docs/lessons.md, the proofs' docstrings and sources from the
tests they name. The pictures are drawn from real runs on the CPU (five of them, into --runs, default site/runs, each
reused by a rebuild while its command, data and code are the same; only their logs and a record are kept, not their
checkpoints); --no-runs leaves them out. Any error (a hunk no note explains, a note whose code is gone, an unknown
page, kind, lesson, proof or picture, a failed run) is one line, and the exit status 2. --check makes only the checks
of the notes: no runs, no pages, nothing printed when they pass.

The notes' matching rule (covers()): a hunk's lines are its changed lines (diff's `<` and `>` lines, marker
stripped); a note covers a hunk of its page if one of its `code` fragments is a substring of one of those lines.
Every hunk needs a note, and every fragment a hunk.

What the pages hold, for a browser test (kept stable):
- a step page: <main class="diff" data-old="OLD.py" data-new="NEW.py">, rows in file order. A hunk is
  <section class="row hunk KIND" id="hunk-N" data-diff="12,14c12,15" data-ideas="..." data-old-lines="12-14"
  data-new-lines="12-15">
  (N from 1 in diff's order; data-diff is diff's command line; the line ranges are "A-B", "A" for one line, "" for
  none; KIND is "lesson", or "robustness" where every note on it is one). Its code is in <div class="code old"> and
  <div class="code new">, one <span class="line ..." data-line="LINE NUMBER"> per line: class "changed" for diff's
  `<` (in .old) and `>` (in .new) lines, "same" for an unchanged line, "filler" (no data-line) where a side has fewer
  lines; a line's textContent is the file's line exactly (its number is drawn by CSS from data-line). Its notes are
  in <div class="notes">: <div class="note KIND" id="note-M" data-note="M"> (M: the note's place in
  docs/ladder-notes.toml, from 1) where the note is first shown, <div class="note see KIND" data-note="M"> (a link
  to it) beside a later hunk it also covers. A note's links: a.proof (proofs.html#SLUG), a.lesson
  (lessons.html#LESSON-ID), and its picture: <figure class="picture" data-picture="NAME"> holding an <svg>, or with
  --no-runs <p class="picture no-runs" data-picture="NAME">built without runs: bash run.sh site</p>.
  Unchanged stretches: <div class="row context" data-old-lines=... data-new-lines=...> a few lines beside a hunk, the
  rest folded in <details class="fold" data-old-lines=... data-new-lines=...><summary>N unchanged lines</summary>.
  The button#toggle-robustness ("Hide robustness", hidden until the script runs) sets body.hide-robustness, which
  hides .hunk.robustness and .note.robustness; without JavaScript every hunk and note shows. A step of several
  ideas (notes' `ideas`, e.g. torchrun, accumulation and SyncBN on launch-torchrun): each hunk's data-ideas lists
  its notes' ideas, and a button.only-idea[data-idea] per idea shows that idea's hunks only (class other-idea on the
  rest), pressed again all of them.
- lessons.html: <tr id="LESSON-ID" class="lesson"> per row of docs/lessons.md's table.
- proofs.html: <section class="proof" id="SLUG" data-test="NODE ID"> per test, SLUG = the node id with every
  character outside [A-Za-z0-9_-] replaced by "-" (tests/proofs/test_ddp.py::test_x: tests-proofs-test_ddp-py--test_x).
"""

import argparse
import ast
import contextlib
import hashlib
import html
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11 (the training scripts run on 3.9)
    sys.exit(
        "error: tools/site.py needs Python 3.11 or newer (tomllib): run it with PYTHON=python3.11 bash run.sh site"
    )

ROOT = Path(__file__).resolve().parents[1]
NOTES = Path("docs/ladder-notes.toml")
LESSONS = Path("docs/lessons.md")

# id: (old script, new script, one sentence). The path first (one idea a step), then the side steps.
STEPS = {
    "single-launch": (
        "train_single.py",
        "train_ddp_launch.py",
        "DistributedDataParallel: a process per device, a process group, each rank its share of every epoch, exact "
        "evaluation and output from rank 0. Started here by torch.distributed.launch, which is deprecated (torch "
        "prints a FutureWarning; torchrun replaced it, the next step): the DDP lines are the same under either.",
    ),
    "launch-torchrun": (
        "train_ddp_launch.py",
        "train_ddp_torchrun.py",
        "torchrun: ranks from the environment, elastic restarts that resume, several nodes, SyncBN and gradient "
        "accumulation.",
    ),
    "single-dp": (
        "train_single.py",
        "train_dp.py",
        "DataParallel: one process drives every GPU; the batches run through the wrapper, the unwrapped model is "
        "saved.",
    ),
    "torchrun-amp": (
        "train_ddp_torchrun.py",
        "train_ddp_amp.py",
        "Mixed precision: autocast around the forward pass and the loss, a GradScaler for fp16, clipping after "
        "unscale_.",
    ),
    "torchrun-fsdp": (
        "train_ddp_torchrun.py",
        "train_fsdp.py",
        "FSDP2: each process keeps a shard of the model; sharded checkpoints, ZeRO-2/3, HSDP, bf16 with BatchNorm in "
        "fp32.",
    ),
}
PATH = ["single-launch", "launch-torchrun"]
SIDE = ["single-dp", "torchrun-amp", "torchrun-fsdp"]
KINDS = ("lesson", "robustness")
NOTE_KEYS = {"page", "code", "kind", "ideas", "text", "lessons", "proofs", "picture"}
CONTEXT = 3  # unchanged lines shown beside a hunk; the rest of a stretch is folded
LESSONS_HEADER = (
    "| lesson | script | the line | changed to | without it, the run printed (GPU rows: what is expected) | test |"
)
NODE_ID = re.compile(r"tests/[\w/.-]+?\.py(?:::\w+)+(?:\[[^\]\s]*\])?")
BARE_TEST = re.compile(r"`(test_\w+)`")

# The runs behind the pictures, with the flags the tests use (tests/support.py EXACT: with --freeze, 2 processes x
# batch 8 train as one process with batch 16 does), started as users start them. name: (label, launcher and script,
# batch per process).
EXACT = "--img-size 32 --epochs 2 --workers 0 --print-freq 1 --val-fraction 0.25 --freeze".split()
LAUNCH = ["-m", "torch.distributed.launch", "--standalone", "--nproc-per-node=2"]
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
RUNS = {
    "single": ("train_single.py, batch 16", ["train_single.py"], "16"),
    "launch": ("train_ddp_launch.py, 2 processes × batch 8", [*LAUNCH, "train_ddp_launch.py"], "8"),
    "torchrun": ("train_ddp_torchrun.py, 2 × 8, uninterrupted", [*TORCHRUN, "train_ddp_torchrun.py"], "8"),
    "resumed": ("train_ddp_torchrun.py, 2 × 8, stopped and resumed", [*TORCHRUN, "train_ddp_torchrun.py"], "8"),
    "fsdp": ("train_fsdp.py, 2 processes × batch 8", [*TORCHRUN, "train_fsdp.py"], "8"),
}
# name: (the reference run, drawn solid; the run claimed equal to it, dashed; what the picture shows)
PICTURES = {
    "ddp-equals-single": (
        "single",
        "launch",
        "Loss per step of train_single.py with batch 16 and of train_ddp_launch.py with 2 processes × batch 8 (the "
        "global batch of 16). The DDP line is what rank 0 prints: the two ranks' mean, the loss of the global batch."
        " Both runs use --freeze (the head trains, BatchNorm in eval mode), so a sample's forward pass does not depend "
        "on the rest of its batch: that is what makes 2 processes × 8 equal one process × 16. With BatchNorm training, "
        "each process normalises over its own 8 samples and the lines part (docs/adapting.md: what stays exact).",
    ),
    "resumed-equals-uninterrupted": (
        "torchrun",
        "resumed",
        "Loss per step of train_ddp_torchrun.py, 2 processes × batch 8: once uninterrupted, once stopped by SIGTERM "
        "mid-epoch and resumed with --resume from the last.pt it saved (the two parts joined by epoch and step).",
    ),
    "fsdp-equals-ddp": (
        "torchrun",
        "fsdp",
        "Loss per step of train_ddp_torchrun.py (DDP) and train_fsdp.py (FSDP2), both 2 processes × batch 8."
        " Both runs use --freeze (the head trains, BatchNorm in eval mode). With BatchNorm training, DDP copies rank "
        "0's running statistics to every rank at each forward and FSDP keeps each rank's own (docs/fsdp.md).",
    ),
}
PROGRESS = re.compile(r"^epoch (\d+)/(\d+)\s+step (\d+)/(\d+)\s+loss (\S+)", re.M)  # utils.Logger.step's line
STOP_AT = re.compile(r"^epoch 1/\d+\s+step 2/")  # the stopped run gets SIGTERM once this is printed
VALIDATION = re.compile(r"^epoch (\d+)/\d+\s+val loss (\S+)", re.M)  # utils.Logger.end_epoch's line
STOPPED = re.compile(r"^stopped by SIGTERM after step (\d+)", re.M)
RECORD = 2  # the records' format: a record of another is run again
RUN_TIMEOUT = 600  # seconds a run may take (the demo data: 15-30 s a run on 2 cores)


class BuildError(Exception):
    """Ends the build: each of .lines is one line for the user."""

    def __init__(self, *lines):
        super().__init__("\n".join(lines))
        self.lines = list(lines)


# ------------------------------------------------------------------------------------------------ the diffs
class Hunk:
    """One command of diff's normal output: old and new are the ranges of line numbers it covers (an `a` hunk's old
    range, a `d` hunk's new range, is empty, starting after the line it names); removed, added: the `<`, `>` lines."""

    def __init__(self, command, old, new):
        self.command, self.old, self.new, self.removed, self.added = command, old, new, [], []

    @property
    def lines(self):
        return self.removed + self.added


COMMAND = re.compile(r"^(\d+)(?:,(\d+))?([acd])(\d+)(?:,(\d+))?$")


def parse_diff(text):
    hunks = []
    for line in text.splitlines():
        found = COMMAND.match(line)
        if found:
            a, a_end, op, b, b_end = found.groups()
            a, b = int(a), int(b)
            old = range(a + 1, a + 1) if op == "a" else range(a, int(a_end or a) + 1)
            new = range(b + 1, b + 1) if op == "d" else range(b, int(b_end or b) + 1)
            hunks.append(Hunk(line, old, new))
        elif line.startswith("<"):
            hunks[-1].removed.append(line[2:])
        elif line.startswith(">"):
            hunks[-1].added.append(line[2:])
        # "---" between the sides and "\ No newline at end of file" are no lines of the files
    for hunk in hunks:
        if (len(hunk.removed), len(hunk.added)) != (len(hunk.old), len(hunk.new)):
            raise BuildError(f"error: diff's output at {hunk.command} is not in the normal format this tool reads")
    return hunks


def run_diff(root, old, new):
    if shutil.which("diff") is None:
        raise BuildError("error: the `diff` command is missing: install GNU diffutils (apt-get install diffutils)")
    done = subprocess.run(
        ["diff", old, new], cwd=root, capture_output=True, text=True, encoding="utf-8", errors="replace", timeout=60
    )
    if done.returncode not in (0, 1):
        raise BuildError(f"error: diff {old} {new}: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return parse_diff(done.stdout)


def covers(code, lines):
    """The matching rule: a note (its `code` fragments) covers a hunk (its changed lines) if a fragment is in a
    line."""
    return any(fragment in line for fragment in code for line in lines)


def span(lines):
    """data-*-lines: "12-14", "12" for one line, "" for none."""
    return "" if not lines else str(lines[0]) if len(lines) == 1 else f"{lines[0]}-{lines[-1]}"


# ------------------------------------------------------------------------------------------- what is read
class Ladder:
    """Everything the site is made of, read and checked: .errors lists what is wrong, one line each."""

    def __init__(self, root):
        self.root = Path(root)
        self.errors = []
        self.steps = {}  # id: (old, new, hunks, old lines, new lines)
        for step, (old, new, _) in STEPS.items():
            texts = [(self.root / name).read_text(encoding="utf-8").splitlines() for name in (old, new)]
            self.steps[step] = (old, new, run_diff(self.root, old, new), *texts)
        self.notes = self.read_notes()
        self.lessons = self.read_lessons()
        self.tests = {}  # node id: (file, function node, its source text) of every test named
        self.named_by = {}  # node id: [(page link, what names it)]
        self.check()

    def rel(self, path):
        return str(Path(path).relative_to(self.root)) if Path(path).is_absolute() else str(path)

    def read_notes(self):
        path = self.root / NOTES
        if not path.is_file():
            self.errors.append(f"error: {NOTES} is missing: it holds the note beside each hunk of the pages")
            return []
        try:
            notes = tomllib.loads(path.read_text(encoding="utf-8")).get("note", [])
        except tomllib.TOMLDecodeError as error:
            self.errors.append(f"error: {NOTES} is not valid TOML: {error}")
            return []
        good = []
        for n, note in enumerate(notes, start=1):
            where = f"{NOTES} note {n} (page {note.get('page')!r})"
            wrong = []
            if set(note) - NOTE_KEYS:
                wrong.append(f"unknown keys {sorted(set(note) - NOTE_KEYS)} (it takes {', '.join(sorted(NOTE_KEYS))})")
            if note.get("page") not in STEPS:
                wrong.append(f"unknown page {note.get('page')!r}: give one of {', '.join(STEPS)}")
            if note.get("kind") not in KINDS:
                wrong.append(f'unknown kind {note.get("kind")!r}: give "lesson" or "robustness"')
            code = note.get("code")
            if not (isinstance(code, list) and code and all(isinstance(c, str) and c for c in code)):
                wrong.append("code must be a list of the code fragments the note explains, none empty")
            if not isinstance(note.get("text"), str) or not note.get("text").strip():
                wrong.append("text is missing: say why the hunk is there")
            for key in ("lessons", "proofs", "ideas"):
                if not (isinstance(note.get(key, []), list) and all(isinstance(v, str) for v in note.get(key, []))):
                    wrong.append(f"{key} must be a list of strings")
            if "picture" in note and note["picture"] not in PICTURES:
                wrong.append(f"unknown picture {note['picture']!r}: give one of {', '.join(PICTURES)}")
            self.errors += [f"error: {where}: {problem}" for problem in wrong]
            if note.get("page") in STEPS and isinstance(code, list) and all(isinstance(c, str) and c for c in code):
                good.append({**note, "n": n, "where": where})  # it still covers its hunks: one error, not two
        return good

    def read_lessons(self):
        """{lesson id: its 6 cells} from the one table of docs/lessons.md; None if the file is missing."""
        path = self.root / LESSONS
        if not path.is_file():
            return None
        lines = path.read_text(encoding="utf-8").splitlines()
        starts = [i for i, line in enumerate(lines) if line.strip() == LESSONS_HEADER]
        if len(starts) != 1:
            self.errors.append(f"error: {LESSONS} holds {len(starts)} tables with the header {LESSONS_HEADER}: one")
            return {}
        lessons = {}
        for i in range(starts[0] + 2, len(lines)):
            if not lines[i].strip().startswith("|"):
                break
            cells = [cell.strip().replace("\\|", "|") for cell in re.split(r"(?<!\\)\|", lines[i].strip()[1:-1])]
            found = re.fullmatch(r"`([\w.-]+)`", cells[0])
            if len(cells) != 6 or not found:
                self.errors.append(
                    f"error: {LESSONS} line {i + 1}: a row has 6 cells, the first the lesson id in backticks"
                )
            elif found[1] in lessons:
                self.errors.append(f"error: {LESSONS} line {i + 1}: lesson id {found[1]} is given twice")
            else:
                lessons[found[1]] = cells
        return lessons

    def lesson_tests(self, cells):
        """The tests a lesson's test cell names: node ids, or bare `test_name`s found under tests/."""
        named = NODE_ID.findall(cells[5])
        for name in BARE_TEST.findall(cells[5]):
            if not any(node.split("::")[-1].split("[")[0] == name for node in named):
                named.append(self.find_bare(name) or name)
        return named

    def find_bare(self, name):
        for module in sorted((self.root / "tests").rglob("test_*.py")):
            if re.search(rf"^def {name}\(", module.read_text(encoding="utf-8"), re.M):
                return f"{self.rel(module)}::{name}"
        return None

    def find_test(self, node):
        """(file, the function's ast node, the file's text), or the reason it is not a test that exists."""
        path, *names = node.split("::")
        names[-1] = names[-1].split("[")[0]  # a parametrized case: its function
        file = self.root / path
        if not (path.startswith("tests/") and path.endswith(".py") and file.is_file()):
            return f"{path} is no file under tests/"
        text = file.read_text(encoding="utf-8")
        scope = ast.parse(text).body
        for name in names:
            found = [n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
            found = [n for n in found if n.name == name]
            if not found:
                return f"{path} has no {'::'.join(names)}"
            scope = found[0].body
        return file, found[0], text

    def check(self):
        if self.lessons is None and any(note.get("lessons") for note in self.notes):
            self.errors.append(f"error: {LESSONS} is missing, and the notes name lessons that its table should hold")
        for note in self.notes:
            old, new, hunks, *_ = self.steps[note["page"]]
            for fragment in note["code"]:
                if not any(covers([fragment], hunk.lines) for hunk in hunks):
                    self.errors.append(
                        f"error: {note['where']}: code {fragment!r} is in no changed line of `diff {old} {new}`: the "
                        f"code it explains is gone; give the code as it is now, or remove the note"
                    )
            for lesson in note.get("lessons", []):
                if self.lessons is not None and lesson not in self.lessons:
                    self.errors.append(
                        f"error: {note['where']}: lesson {lesson!r} is not in {LESSONS}'s table: give one of its ids "
                        f"({', '.join(sorted(self.lessons)) or 'none yet'}) or add its row"
                    )
            for node in note.get("proofs", []):
                self.add_test(
                    node,
                    f"{note['page']}.html#note-{note['n']}",
                    f"note {note['n']} on {note['page'].replace('-', ' → ')}",
                    note["where"],
                )
        for lesson, cells in (self.lessons or {}).items():
            for node in self.lesson_tests(cells):
                self.add_test(node, f"lessons.html#{lesson}", f"lesson {lesson}", f"{LESSONS} lesson {lesson}")
        for step, (old, new, hunks, *_) in self.steps.items():
            for hunk in hunks:
                if not any(covers(note["code"], hunk.lines) for note in self.notes if note["page"] == step):
                    first = next((line.strip() for line in hunk.lines if line.strip()), "")
                    self.errors.append(
                        f"error: {step}: hunk {hunk.command} ({old} lines {span(hunk.old) or 'none'}, {new} lines "
                        f"{span(hunk.new) or 'none'}; first changed line {first!r}) has no note: add a [[note]] with "
                        f'page = "{step}" and a fragment of it in code to {NOTES}'
                    )

    def add_test(self, node, link, label, where):
        if not NODE_ID.fullmatch(node):
            self.errors.append(f"error: {where}: proof {node!r}: name it as tests/<path>.py::test_name")
            return
        if node not in self.tests:
            found = self.find_test(node)
            if isinstance(found, str):
                self.errors.append(f"error: {where}: proof {node!r} does not exist: {found}")
                return
            self.tests[node] = found
        self.named_by.setdefault(node, []).append((link, label))


def check(root=ROOT):
    """The notes' checks (what --check does): the list of error lines, empty if the notes are right."""
    try:
        return Ladder(root).errors
    except BuildError as error:
        return error.lines


# ------------------------------------------------------------------------------------------------ the runs
def end_job(job):
    """The job's session killed, as bench.py and gpucheck.py end theirs; torchrun's workers, in sessions of their own,
    follow it (dist_utils.require_launcher's parent-death signal)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()


def start_job(cmd, root, log, stop=False):
    """Runs cmd to its end (at most RUN_TIMEOUT s) in a session of its own, its output into `log`; with stop, its
    process group gets SIGTERM once step 2 of epoch 1 is printed (torchrun's agent forwards it to the workers, as
    from a scheduler). Returns (exit status, output)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen(
        [sys.executable, *map(str, cmd)],
        cwd=root,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines = []

    def read():
        signalled = False
        for line in job.stdout:
            lines.append(line)
            if stop and not signalled and STOP_AT.match(line):
                signalled = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(job.pid, signal.SIGTERM)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status = job.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        end_job(job)
        status = f"killed after {RUN_TIMEOUT} s"
    finally:
        if job.poll() is None:  # interrupted here (Ctrl-C): no run left behind
            end_job(job)
        reader.join(timeout=10)
        log.write_text("".join(lines), encoding="utf-8")
    return status, "".join(lines)


def failed(name, cmd, status, output, why):
    tail = output.rstrip().splitlines()[-15:]
    return BuildError(
        f"error: the run {name} ({' '.join(map(str, cmd))}) {why} "
        f"({f'exit status {status}' if isinstance(status, int) else status}); its last lines:",
        *(f"    {line}" for line in tail),
    )


def read_losses(output):
    """{(epoch, step): loss} and the steps per epoch, from the progress lines; {epoch: validation loss}."""
    found = PROGRESS.findall(output)
    losses = {(int(e), int(s)): float(loss) for e, _, s, _, loss in found}
    return losses, int(found[-1][3]) if found else 0, {int(e): float(v) for e, v in VALIDATION.findall(output)}


def run_record(root, runs, name, data):
    """The run's losses, from its record in `runs` where the same command ran the same code, else from a new run:
    {"losses": [[epoch, step, loss], ...], "steps": steps per epoch, "stopped_after": step or None}."""
    _, launcher, batch = RUNS[name]
    args = [*launcher, *EXACT, "-b", batch, *(["--data-path", str(data)] if data else [])]
    code = b"".join((root / f).read_bytes() for f in sorted(os.listdir(root)) if f.endswith(".py"))
    key = hashlib.sha256(json.dumps([RECORD, name, args]).encode() + code).hexdigest()
    record = runs / f"{name}.json"
    if record.is_file():
        with contextlib.suppress(ValueError):
            saved = json.loads(record.read_text())
            if saved.get("key") == key:
                return saved
    folder = runs / name
    if folder.exists():
        if not (folder / ".lock").exists() and any(folder.iterdir()):
            raise BuildError(f"error: {folder} holds files but is no run folder: move it away, or give another --runs")
        shutil.rmtree(folder)  # an earlier run of other code or data, or one cut short
    print(f"site.py: running {' '.join(args)}", flush=True)
    stopped_after = None
    if name == "resumed":
        first = [*args, "--output-dir", folder]
        status, output = start_job(first, root, runs / "resumed-stopped.log", stop=True)
        stop = STOPPED.search(output)
        if not stop or not (folder / "last.pt").is_file():
            raise failed(name, first, status, output, "was to stop on SIGTERM after step 2 and save, but did not")
        stopped_after = int(stop[1])
        losses, steps, val = read_losses(output)
        second = [*args, "--resume", folder / "last.pt"]
        status, output = start_job(second, root, runs / f"{name}.log")
        if status != 0 or "resuming from " not in output:
            raise failed(name, second, status, output, "did not resume and finish")
        more, _, more_val = read_losses(output)
        losses.update(more)  # the two parts joined by (epoch, step)
        val.update(more_val)
    else:
        cmd = [*args, "--output-dir", folder]
        status, output = start_job(cmd, root, runs / f"{name}.log")
        if status != 0:
            raise failed(name, cmd, status, output, "failed")
        losses, steps, val = read_losses(output)
    if not losses:
        raise failed(name, args, status, output, "printed no progress line")
    saved = {"key": key, "args": args, "steps": steps, "stopped_after": stopped_after}
    saved["val"] = [[epoch, loss] for epoch, loss in sorted(val.items())]
    saved["losses"] = [[epoch, step, loss] for (epoch, step), loss in sorted(losses.items())]
    record.write_text(json.dumps(saved))
    shutil.rmtree(folder)  # the checkpoints (90 MB a run) are no part of the site: its log and record are
    return saved


def draw_pictures(root, out, runs, data, names):
    """{picture name: its <figure>} for the pictures the notes show, from at most five runs, one at a time (each
    run's processes share the cores)."""
    runs.mkdir(parents=True, exist_ok=True)
    records = {}
    for picture in PICTURES:
        if picture in names:
            for name in PICTURES[picture][:2]:
                if name not in records:
                    records[name] = run_record(root, runs, name, data)
    return {picture: figure(picture, records, runs, out, data) for picture in names}


# --------------------------------------------------------------------------------------------------- HTML
def esc(text):
    return html.escape(str(text), quote=True)


INLINE = re.compile(
    r"`(?P<code>[^`]+)`"
    r"|\[(?P<label>(?:[^\]`]|`[^`]*`)+)\]\((?P<url>[^)\s]+)\)"
    r"|\*\*(?P<bold>.+?)\*\*"
)


class Render:
    """Inline markdown (code, links, bold) and the links between the pages; a relative link in the docs points into
    the repository beside the site (file://, or a host that serves the repository)."""

    def __init__(self, root, out):
        self.root = root
        self.repo = Path(os.path.relpath(root, out)).as_posix() + "/"

    def link(self, url, base=Path("docs")):
        if re.match(r"[a-zA-Z][\w+.-]*:|#", url):
            return url
        path, _, anchor = url.partition("#")
        target = os.path.normpath(base / path).replace(os.sep, "/")
        if target == LESSONS.as_posix():
            return f"lessons.html{'#' + anchor if anchor else ''}"
        return f"{self.repo}{target}{'#' + anchor if anchor else ''}"

    def inline(self, text):
        out, at = [], 0
        for found in INLINE.finditer(text):
            out.append(esc(text[at : found.start()]))
            if found["code"] is not None:
                out.append(f"<code>{esc(found['code'])}</code>")
            elif found["label"] is not None:
                out.append(f'<a href="{esc(self.link(found["url"]))}">{self.inline(found["label"])}</a>')
            else:
                out.append(f"<strong>{self.inline(found['bold'])}</strong>")
            at = found.end()
        out.append(esc(text[at:]))
        return "".join(out)

    def paragraphs(self, text):
        return "".join(f"<p>{self.inline(' '.join(p.split()))}</p>" for p in re.split(r"\n\s*\n", text.strip()))


def slug(node):
    return re.sub(r"[^A-Za-z0-9_-]", "-", node)


def page(title, body, script=""):
    nav = '<a href="index.html">The ladder</a> <a href="lessons.html">Lessons</a> <a href="proofs.html">Proofs</a>'
    return (
        '<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<title>{esc(title)}</title>\n<link rel="stylesheet" href="site.css">\n</head>\n<body>\n'
        f'<nav class="top">{nav}</nav>\n{body}\n{script}</body>\n</html>\n'
    )


def line(text, number=None, kind="same"):
    if number is None:
        return '<span class="line filler"></span>'
    return f'<span class="line {kind}" data-line="{number}">{esc(text)}</span>'


def context_row(old_lines, new_lines, a, b, offset, cls="row context"):
    """Unchanged lines a..b (1-based, inclusive) of the old file, at b + offset in the new one."""
    olds = "".join(line(old_lines[i - 1], i) for i in range(a, b + 1))
    news = "".join(line(new_lines[i + offset - 1], i + offset) for i in range(a, b + 1))
    lines = f'data-old-lines="{span(range(a, b + 1))}" data-new-lines="{span(range(a + offset, b + offset + 1))}"'
    return (
        f'<div class="{cls}" {lines}><div class="code old"><pre>{olds}</pre></div>'
        f'<div class="code new"><pre>{news}</pre></div><div class="notes"></div></div>'
    )


def stretch(old_lines, new_lines, a, b, offset, before, after):
    """The unchanged lines a..b: CONTEXT lines after a hunk (before=True) and before one (after=True) shown, the
    rest folded (unless folding would hide fewer than 2 lines)."""
    if b < a:
        return ""
    show_a = a + CONTEXT - 1 if before else a - 1  # shown: a..show_a and show_b..b
    show_b = b - CONTEXT + 1 if after else b + 1
    if show_b - show_a - 1 < 2:
        return context_row(old_lines, new_lines, a, b, offset)
    parts = [context_row(old_lines, new_lines, a, show_a, offset)] if show_a >= a else []
    n = show_b - show_a - 1
    folded = context_row(old_lines, new_lines, show_a + 1, show_b - 1, offset)
    parts.append(
        f'<details class="fold" data-old-lines="{span(range(show_a + 1, show_b))}" '
        f'data-new-lines="{span(range(show_a + 1 + offset, show_b + offset))}">'
        f"<summary>{n} unchanged lines</summary>{folded}</details>"
    )
    if show_b <= b:
        parts.append(context_row(old_lines, new_lines, show_b, b, offset))
    return "".join(parts)


def note_html(note, render, pictures):
    proofs = ", ".join(
        f'<a class="proof" href="proofs.html#{esc(slug(node))}"><code>{esc(node.split("::")[-1])}</code></a>'
        for node in note.get("proofs", [])
    )
    lessons = ", ".join(
        f'<a class="lesson" href="lessons.html#{esc(lesson)}"><code>{esc(lesson)}</code></a>'
        for lesson in note.get("lessons", [])
    )
    links = ([f"proved by {proofs}"] if proofs else []) + ([f"what breaks without it: {lessons}"] if lessons else [])
    picture = ""
    if "picture" in note:
        picture = pictures.get(note["picture"]) or (
            f'<p class="picture no-runs" data-picture="{esc(note["picture"])}">built without runs: bash run.sh site</p>'
        )
    ideas = "".join(f' <span class="idea">{esc(idea)}</span>' for idea in note.get("ideas", []))
    return (
        f'<div class="note {note["kind"]}" id="note-{note["n"]}" data-note="{note["n"]}">'
        f'<p class="kind">{note["kind"]}{ideas}</p>'
        f"{render.paragraphs(note['text'])}"
        + (f'<p class="links">{" · ".join(links)}</p>' if links else "")
        + picture
        + "</div>"
    )


def step_page(ladder, step, render, pictures):
    old, new, hunks, old_lines, new_lines = ladder.steps[step]
    notes = [note for note in ladder.notes if note["page"] == step]
    shown, rows = {}, []  # shown: note n -> the hunk it was first shown beside
    previous_old, previous_new = 0, 0  # the last line of the previous hunk, in each file
    for i, hunk in enumerate(hunks, start=1):
        offset = previous_new - previous_old
        rows.append(stretch(old_lines, new_lines, previous_old + 1, hunk.old.start - 1, offset, i > 1, True))
        mine = [note for note in notes if covers(note["code"], hunk.lines)]
        kind = "lesson" if any(note["kind"] == "lesson" for note in mine) else "robustness"
        ideas = " ".join(sorted({idea for note in mine for idea in note.get("ideas", [])}))
        olds = [line(text, n, "changed") for n, text in zip(hunk.old, hunk.removed)]
        news = [line(text, n, "changed") for n, text in zip(hunk.new, hunk.added)]
        height = max(len(olds), len(news))
        olds += [line(None)] * (height - len(olds))
        news += [line(None)] * (height - len(news))
        parts = []
        for note in mine:
            if note["n"] in shown:
                parts.append(
                    f'<div class="note see {note["kind"]}" data-note="{note["n"]}"><p>Explained with '
                    f'<a href="#note-{note["n"]}">hunk {esc(shown[note["n"]])}</a> above.</p></div>'
                )
            else:
                shown[note["n"]] = hunk.command
                parts.append(note_html(note, render, pictures))
        rows.append(
            f'<section class="row hunk {kind}" id="hunk-{i}" data-diff="{hunk.command}" data-ideas="{esc(ideas)}" '
            f'data-old-lines="{span(hunk.old)}" data-new-lines="{span(hunk.new)}">'
            f'<p class="where"><a href="#hunk-{i}"><code>{hunk.command}</code></a></p>'
            f'<div class="code old"><pre>{"".join(olds)}</pre></div>'
            f'<div class="code new"><pre>{"".join(news)}</pre></div>'
            f'<div class="notes">{"".join(parts)}</div></section>'
        )
        previous_old, previous_new = hunk.old.stop - 1, hunk.new.stop - 1
    offset = previous_new - previous_old
    rows.append(stretch(old_lines, new_lines, previous_old + 1, len(old_lines), offset, bool(hunks), False))

    order = PATH + SIDE
    where = (
        f"step {PATH.index(step) + 1} of the path single → launch → torchrun"
        if step in PATH
        else "a side step from the path"
    )
    near = [f'<a href="{s}.html">{esc(STEPS[s][0])} → {esc(STEPS[s][1])}</a>' for s in order if s != step]
    changed = sum(len(hunk.lines) for hunk in hunks)
    lessons = sum(note["kind"] == "lesson" for note in notes)
    head = (
        f'<header class="prose">\n<p class="crumbs">{where}</p>\n'
        f"<h1><code>{esc(old)}</code> → <code>{esc(new)}</code></h1>\n<p>{esc(STEPS[step][2])}</p>\n"
        f"<p><code>diff {esc(old)} {esc(new)}</code>: {len(hunks)} hunks, {changed} changed lines, each with a note "
        f'beside it: why it is there (<span class="tag lesson">lesson</span>, {lessons} notes) or what it protects '
        f'against (<span class="tag robustness">robustness</span>, {len(notes) - lessons} notes).</p>\n'
        f'<p><button type="button" id="toggle-robustness" hidden aria-pressed="false">Hide robustness</button>'
        + "".join(
            f' <button type="button" class="only-idea" data-idea="{esc(idea)}" hidden aria-pressed="false">'
            f"Only {esc(idea)}</button>"
            for idea in dict.fromkeys(idea for note in notes for idea in note.get("ideas", []))
        )
        + "</p>\n</header>\n"
    )
    columns = (
        f'<div class="row heads"><div class="code old"><code>{esc(old)}</code></div>'
        f'<div class="code new"><code>{esc(new)}</code></div><div class="notes">why</div></div>'
    )
    body = (
        f'{head}<main class="diff" data-old="{esc(old)}" data-new="{esc(new)}">\n{columns}\n'
        + "\n".join(row for row in rows if row)
        + f'\n</main>\n<footer class="prose"><p>The other steps: {" · ".join(near)}</p></footer>\n'
    )
    return page(f"{old} → {new}", body, TOGGLE)


TOGGLE = """<script>
// Hides the robustness hunks and notes (the page shows them all without JavaScript)
(() => {
  const button = document.getElementById("toggle-robustness");
  button.hidden = false;
  button.addEventListener("click", () => {
    const hide = document.body.classList.toggle("hide-robustness");
    button.setAttribute("aria-pressed", String(hide));
    button.textContent = hide ? "Show robustness" : "Hide robustness";
  });
  // A step of several ideas (data-ideas on each hunk): show one idea's hunks at a time, or all again
  const only = [...document.querySelectorAll("button.only-idea")];
  for (const choice of only) {
    choice.hidden = false;
    choice.addEventListener("click", () => {
      const idea = choice.getAttribute("aria-pressed") === "true" ? null : choice.dataset.idea;
      for (const other of only) other.setAttribute("aria-pressed", String(other === choice && idea !== null));
      for (const hunk of document.querySelectorAll("section.hunk")) {
        hunk.classList.toggle("other-idea", idea !== null && !hunk.dataset.ideas.split(" ").includes(idea));
      }
    });
  }
})();
</script>
"""


def index_page(ladder):
    def item(step):
        old, new, hunks, *_ = ladder.steps[step]
        changed = sum(len(hunk.lines) for hunk in hunks)
        return (
            f'<li><a href="{step}.html"><code>{esc(old)}</code> → <code>{esc(new)}</code></a> '
            f'<span class="size">({changed} changed lines)</span><br>{esc(STEPS[step][2])}</li>'
        )

    body = f"""<header class="prose">
<h1>Multi-GPU training in PyTorch, one idea per step</h1>
<p>Six scripts train the same image classifier, each in one parallel style; each is the one before it plus one idea.
Each page below is <code>diff OLD NEW</code>, as your terminal shows it, with a note beside each hunk: why it is
there, or what it protects against; the test that proves it; and what a run printed without it.</p>
</header>
<main class="prose">
<h2>The path</h2>
<p>From one device to DistributedDataParallel, then to torchrun: read these two in order.</p>
<ol class="steps">{"".join(item(step) for step in PATH)}</ol>
<h2>Side steps</h2>
<p>Each starts from a script on the path and adds one thing.</p>
<ul class="steps">{"".join(item(step) for step in SIDE)}</ul>
<h2>Also</h2>
<ul>
<li><a href="lessons.html">Lessons</a>: the gallery of broken lines: one line of a script changed, and what the run
printed then.</li>
<li><a href="proofs.html">Proofs</a>: the source of every test a note or a lesson names.</li>
</ul>
</main>
"""
    return page("The ladder", body)


def lessons_page(ladder, render):
    named = {}  # lesson id: [(page, note n)] of the notes that name it
    for note in ladder.notes:
        for lesson in note.get("lessons", []):
            named.setdefault(lesson, []).append(note)
    heads = [
        "lesson",
        "script",
        "the line",
        "changed to",
        "without it, the run printed (GPU rows: what is expected)",
        "test",
    ]
    rows = []
    for lesson, cells in ladder.lessons.items():
        tests = ladder.lesson_tests(cells)
        test = " ".join(
            f'<a class="proof" href="proofs.html#{esc(slug(node))}"><code>{esc(node.split("::")[-1])}</code></a>'
            for node in tests
            if node in ladder.tests
        )
        notes = " ".join(
            f'<a href="{note["page"]}.html#note-{note["n"]}">{note["page"].replace("-", " → ")}</a>'
            for note in named.get(lesson, [])
        )
        shown = [*map(render.inline, cells[:5]), test or render.inline(cells[5])]
        shown[0] += f'<br><span class="explained">explained on {notes}</span>' if notes else ""
        rows.append(
            f'<tr id="{esc(lesson)}" class="lesson">'
            + "".join(f'<td data-head="{esc(h)}">{c}</td>' for h, c in zip(heads, shown))
            + "</tr>"
        )
    body = f"""<header class="prose">
<h1>Lessons: what breaks without a line</h1>
<p>Each row is one line of a script changed, and what the run printed then; the test named makes that run. From
<code>{LESSONS}</code>.</p>
</header>
<main class="wide">
<table class="lessons">
<thead><tr>{"".join(f"<th>{esc(h)}</th>" for h in heads)}</tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody>
</table>
</main>
"""
    return page("Lessons: what breaks without a line", body)


def proofs_page(ladder, render):
    sections, files = [], {}
    folders = ["tests/proofs/", "tests/operations/", "tests/units/", "tests/tools/", "tests/gpu/"]  # tests/README's

    def order(node):
        return next((i for i, f in enumerate(folders) if node.startswith(f)), len(folders)), node

    for node in sorted(ladder.tests, key=order):
        files.setdefault(node.split("::")[0], []).append(node)
    for path, nodes in files.items():
        sections.append(f'<h2><code>{esc(path)}</code> <a class="file" href="source/{esc(path)}">the file</a></h2>')
        for node in nodes:
            file, function, text = ladder.tests[node]
            decorators = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in function.decorator_list)
            source = decorators + ast.get_source_segment(text, function)
            doc = ast.get_docstring(function) or "(no docstring)"
            name = node.split("::")[-1].split("[")[0]
            how = "bash run.sh gpucheck" if path.startswith("tests/gpu/") else f"bash run.sh test -k {name}"
            by = ", ".join(f'<a href="{esc(link)}">{esc(label)}</a>' for link, label in ladder.named_by[node])
            sections.append(
                f'<section class="proof" id="{esc(slug(node))}" data-test="{esc(node)}">'
                f"<h3><code>{esc(node.split('::', 1)[1])}</code></h3>"
                f'<p class="how">run it: <code>{esc(how)}</code> · named by {by}</p>'
                f'<div class="doc">{render.paragraphs(doc)}</div>'
                f'<details class="source" open><summary>its source (line {function.lineno})</summary>'
                f'<div class="code"><pre>{esc(source)}</pre></div></details></section>'
            )
    body = f"""<header class="prose">
<h1>Proofs</h1>
<p>Every test that a note or a lesson names: what it proves, in its own words, and its source. They run with
<code>bash run.sh test</code>; real <code>torchrun</code> processes on the CPU.</p>
</header>
<main class="prose">
{chr(10).join(sections)}
</main>
"""
    return page("Proofs", body)


# ---------------------------------------------------------------------------------------------- pictures
def ticks(low, high, count=5):
    """Round numbers from low to high, about count of them."""
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if raw <= step * m)
    first = math.ceil(low / step - 1e-9)
    return [v * step for v in range(first, int(math.floor(high / step + 1e-9)) + 1)]


def figure(picture, records, runs, out, data):
    reference, claimed, caption = PICTURES[picture]
    curves = []
    for name in (reference, claimed):
        record = records[name]
        curves.append({(e - 1) * record["steps"] + s: loss for e, s, loss in record["losses"]})
    if set(curves[0]) != set(curves[1]):
        raise BuildError(
            f"error: picture {picture}: the runs {reference} and {claimed} logged different steps "
            f"({len(curves[0])} and {len(curves[1])}): see their logs in {runs}"
        )
    steps = sorted(curves[0])
    worst = max(abs(curves[0][s] - curves[1][s]) for s in steps)
    at = max(steps, key=lambda s: abs(curves[0][s] - curves[1][s]))
    # About the note column's width, so that 11-px text stays 11 px; the legend under the axes covers no line
    width, height, left, right, top, bottom = 380, 250, 46, 10, 10, 76
    x0, x1 = steps[0], max(steps[-1], steps[0] + 1)
    values = [*curves[0].values(), *curves[1].values()]
    y0, y1 = min(values), max(values)
    pad = (y1 - y0) * 0.08 or 0.05
    y0, y1 = y0 - pad, y1 + pad

    def x(v):
        return left + (v - x0) / (x1 - x0) * (width - left - right)

    def y(v):
        return top + (y1 - v) / (y1 - y0) * (height - top - bottom)

    svg = [
        f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{esc(caption)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{esc(caption)}</title>",
        f'<g class="axes"><line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}"/>'
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}"/></g>',
    ]
    for v in ticks(x0, x1):
        svg.append(
            f'<g class="tick"><line x1="{x(v):.1f}" y1="{height - bottom}" x2="{x(v):.1f}" y2="{height - bottom + 4}"/>'
            f'<text x="{x(v):.1f}" y="{height - bottom + 16}" text-anchor="middle">{v:g}</text></g>'
        )
    for v in ticks(y0, y1):
        svg.append(
            f'<g class="tick"><line x1="{left - 4}" y1="{y(v):.1f}" x2="{left}" y2="{y(v):.1f}"/>'
            f'<text x="{left - 7}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text></g>'
        )
    svg.append(
        f'<text class="label" x="{(left + width - right) / 2}" y="{height - bottom + 30}" '
        f'text-anchor="middle">step</text>'
    )
    svg.append(
        f'<text class="label" x="14" y="{(top + height - bottom) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(top + height - bottom) / 2})">loss</text>'
    )
    for i, (name, curve) in enumerate(zip((reference, claimed), curves)):
        points = " ".join(f"{x(s):.1f},{y(curve[s]):.1f}" for s in steps)
        svg.append(f'<polyline class="run run-{i + 1}" points="{points}"/>')
        label_y = height - 24 + 16 * i
        svg.append(
            f'<line class="run run-{i + 1}" x1="{left - 30}" y1="{label_y - 4}" x2="{left - 4}" y2="{label_y - 4}"/>'
            f'<text class="legend" x="{left + 2}" y="{label_y}">{esc(RUNS[name][0])}</text>'
        )
    svg.append("</svg>")
    stopped = records[claimed].get("stopped_after")
    logs = [f"{name}.log" for name in (reference, claimed)] + (["resumed-stopped.log"] if stopped else [])
    logs_html = ", ".join(
        f'<a href="{esc(Path(os.path.relpath(runs / log, out)).as_posix())}">{log}</a>' for log in logs
    )
    where = f"at step {at} of {len(steps)}" if worst else f"equal at each of the {len(steps)} steps"
    stop = f" The second run was stopped after step {stopped}." if stopped else ""
    # The validation loss (every sample once, summed over the ranks) of each epoch, as each run printed it
    vals = [
        ", ".join(f"{loss:.4f}" for _, loss in records[name].get("val", [])) or "none" for name in (reference, claimed)
    ]
    val = "the same" if vals[0] == vals[1] else vals[1]
    return (
        f'<figure class="picture" data-picture="{esc(picture)}">{"".join(svg)}'
        f"<figcaption><p>{esc(caption)}{stop} On {esc(data or 'the demo data')}, with "
        f"<code>{esc(' '.join(EXACT))}</code>.</p>"
        f'<p class="difference">Largest |difference| of the two losses: <strong>{worst:.4f}</strong> ({where}; the '
        f"progress lines print 4 decimals). Validation loss after each epoch, every sample counted: {vals[0]}; in "
        f"the second run {val}. Logs: {logs_html}.</p></figcaption></figure>"
    )


CSS = """/* The ladder's pages: readable on a desktop (three columns) and a phone (one), no web fonts. */
:root {
  --fg: #1f2328; --muted: #59636e; --bg: #ffffff; --box: #f6f8fa; --edge: #d1d9e0; --link: #0550ae;
  --del: #ffebe9; --add: #dafbe1; --lesson: #ddf4ff; --robustness: #fff8c5; --one: #0969da; --two: #cf222e;
}
* { box-sizing: border-box; }
body { margin: 0; color: var(--fg); background: var(--bg);
  font: 16px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
a { color: var(--link); text-underline-offset: .3em; }  /* clear of the underscores */
code, pre { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "Liberation Mono", monospace; font-size: 13px; }
nav.top { padding: .5rem 1rem; border-bottom: 1px solid var(--edge); display: flex; gap: 1rem; flex-wrap: wrap; }
header, main, footer { padding: 0 1rem; margin: 0 auto; }
.prose { max-width: 52rem; }
main.diff, main.wide { max-width: 120rem; }
.crumbs { color: var(--muted); margin-bottom: 0; }
h1 { font-size: 1.6rem; line-height: 1.25; overflow-wrap: anywhere; }
h1 code { font-size: inherit; }
.steps li { margin-bottom: .75rem; }
.size { color: var(--muted); }
.tag { padding: 0 .3rem; border-radius: 3px; font-size: .85em; }
.tag.lesson, .note.lesson .kind { background: var(--lesson); }
.tag.robustness, .note.robustness .kind { background: var(--robustness); }
button { font: inherit; padding: .3rem .8rem; border: 1px solid var(--edge); border-radius: 6px; background: var(--box);
  cursor: pointer; }
/* The diff: old | new | notes, each hunk a row */
.row { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr) minmax(15rem, 24rem); gap: 0 .75rem;
  align-items: start; }
.row.heads { position: sticky; top: 0; background: var(--bg); padding: .4rem 0; border-bottom: 1px solid var(--edge);
  z-index: 1; font-weight: 600; }
.row.heads .code { border: 0; background: none; }
.hunk { border-top: 1px solid var(--edge); padding: .4rem 0 .8rem; }
.where { grid-column: 1 / -1; margin: 0 0 .2rem; font-size: .8rem; }
.where a { color: var(--muted); text-decoration: none; }
.code { overflow-x: auto; background: var(--box); border: 1px solid var(--edge); border-radius: 4px; min-width: 0; }
.code pre { margin: 0; padding: .2rem 0; width: max-content; min-width: 100%; }
.line { display: block; white-space: pre; min-height: 1.45em; line-height: 1.45; padding-right: .75rem; }
.line::before { content: attr(data-line); display: inline-block; width: 3.2em; margin-right: .75em; padding-right: .4em;
  text-align: right; color: var(--muted); user-select: none; -webkit-user-select: none; }
.old .changed { background: var(--del); }
.new .changed { background: var(--add); }
.filler { background: repeating-linear-gradient(135deg, transparent 0 4px, var(--edge) 4px 5px); }
.context .code { border-radius: 0; }
.fold summary { cursor: pointer; color: var(--muted); font-size: .85rem; padding: .15rem .5rem; background: var(--box);
  border: 1px dashed var(--edge); margin: .2rem 0; }
.notes { min-width: 0; }
.note { border-left: 3px solid var(--edge); padding: 0 .6rem; margin-bottom: .6rem; font-size: .92rem;
  overflow-wrap: anywhere; }
.note.lesson { border-left-color: var(--one); }
.note.robustness { border-left-color: #bf8700; }
.note p { margin: .3rem 0; }
.note .kind { display: inline-block; padding: 0 .3rem; border-radius: 3px; font-size: .75rem; margin: 0; }
.note.see { color: var(--muted); }
.links { font-size: .85rem; }
.hide-robustness .hunk.robustness, .hide-robustness .note.robustness, .hunk.other-idea { display: none; }
.idea { font-weight: normal; background: var(--box); border-radius: 3px; padding: 0 .3em; }
button[aria-pressed="true"] { font-weight: bold; }
/* The pictures */
.picture { margin: .5rem 0; }
.picture svg { width: 100%; height: auto; max-width: 32rem; background: var(--bg); }
.picture .axes line, .picture .tick line { stroke: var(--muted); stroke-width: 1; }
.picture text { font: 11px system-ui, sans-serif; fill: var(--fg); }
.picture .run { fill: none; stroke-width: 2; }
.picture .run-1 { stroke: var(--one); }
.picture .run-2 { stroke: var(--two); stroke-dasharray: 6 4; }
.picture figcaption { font-size: .85rem; color: var(--muted); }
.no-runs { color: var(--muted); font-style: italic; }
/* The gallery and the proofs */
table.lessons { border-collapse: collapse; width: 100%; font-size: .9rem; }
table.lessons th, table.lessons td { border: 1px solid var(--edge); padding: .35rem .5rem; vertical-align: top;
  text-align: left; overflow-wrap: anywhere; }
table.lessons tr:target { background: var(--lesson); }
.explained { font-size: .8rem; color: var(--muted); }
.proof { border-top: 1px solid var(--edge); }
.proof:target { background: var(--lesson); }
.proof h3 { overflow-wrap: anywhere; }
.proof h3 code { font-size: 1rem; }
h2 .file { font-size: .9rem; font-weight: normal; margin-left: .5rem; }
.proof .code pre { padding: .4rem .6rem; }
.how { overflow-wrap: anywhere; }
/* A phone: one column, the note under its hunk, each code box scrolling inside itself */
@media (max-width: 760px) {
  .row { grid-template-columns: minmax(0, 1fr); }
  .row.heads { display: none; }
  .hunk .code.new { margin-top: .3rem; }
  .notes { margin-top: .5rem; }
  .context .code.old { display: none; }
  table.lessons thead { display: none; }
  table.lessons, table.lessons tbody, table.lessons tr, table.lessons td { display: block; width: 100%; }
  table.lessons tr { margin-bottom: 1rem; border: 1px solid var(--edge); }
  table.lessons td { border: 0; border-top: 1px solid var(--edge); }
  table.lessons td::before { content: attr(data-head); display: block; font-weight: 600; font-size: .8rem;
    color: var(--muted); }
}
"""


# ---------------------------------------------------------------------------------------------------- main
def build(root, out, runs, data, with_runs):
    """Every page into out; returns their paths."""
    ladder = Ladder(root)
    if ladder.lessons is None:
        ladder.errors.insert(0, f"error: {LESSONS} is missing: lessons.html, the gallery, is made from its table")
    if ladder.errors:
        raise BuildError(*ladder.errors)
    pictures = {}
    if with_runs:
        names = {note["picture"] for note in ladder.notes if "picture" in note}
        pictures = draw_pictures(root, out, runs, data, names)
    render = Render(root, out)
    pages = {"index.html": index_page(ladder)}
    pages.update({f"{step}.html": step_page(ladder, step, render, pictures) for step in STEPS})
    pages["lessons.html"] = lessons_page(ladder, render)
    pages["proofs.html"] = proofs_page(ladder, render)
    # The test files the proofs page shows, copied in: the site holds all it links to, wherever it is served from
    pages.update({f"source/{node.split('::')[0]}": "" for node in ladder.tests})
    pages.update({name: (root / name.removeprefix("source/")).read_text() for name in pages if name[:7] == "source/"})
    pages["site.css"] = CSS
    pages[".nojekyll"] = ""  # a static host serves the files as they are
    out.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text, encoding="utf-8")
    return [out / name for name in pages]


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="bash run.sh site",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="the folder the pages go into (default: site/ in the repository)"
    )
    parser.add_argument(
        "--runs", type=Path, metavar="DIR", help="the runs' folder: their logs and records (default: OUT/runs)"
    )
    parser.add_argument(
        "--data-path", type=Path, metavar="DIR", help="the runs' data (default: the scripts' demo data)"
    )
    parser.add_argument("--no-runs", action="store_true", help="no runs: each picture is a line that says so")
    parser.add_argument("--check", action="store_true", help="only check the notes against the diffs; write nothing")
    parser.add_argument(
        "--root",
        type=Path,
        default=ROOT,
        metavar="DIR",
        help="the repository the pages are made from (default: this one)",
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.check:
            errors = check(root)
            if errors:
                raise BuildError(*errors)
            return 0
        started = time.perf_counter()
        out = (args.out or root / "site").resolve()
        runs = (args.runs or out / "runs").resolve()
        data = args.data_path.resolve() if args.data_path else None
        written = build(root, out, runs, data, not args.no_runs)
        seconds = time.perf_counter() - started
        pages = sum(path.suffix == ".html" for path in written)
        print(f"site.py: {pages} pages in {out} in {seconds:.1f} s: open {out / 'index.html'}")
        return 0
    except BuildError as error:
        print("\n".join(error.lines), file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # (the run it was waiting for is ended: start_job)
        print("site.py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
