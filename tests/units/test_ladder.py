"""The ladder stays readable: each rung's diff within its budget, the README's table showing the real sizes, the
front page short, and every link between the pages resolving."""

import re
import subprocess

import pytest

from support import REPO

# (from, to): the most changed lines (`diff A B | grep -c '^[<>]'`) that one concept may cost, in code that
# `ruff format` lays out (one argument a line once a call does not fit on one): 20/112/96/33/141 when set;
# 26/121/98/32/157 once the loop took an EMA and stages (issue 59): the unwrapped model for the EMA, the optimizer and
# a stage (dp, DDP), DDP wrapped anew at a stage and the ranks' weights compared, FSDP's EMA sharded and saved whole;
# 26/133/74/32/157 once every rung stops on a signal (issue 60): the ranks' vote moved from torchrun's diff to launch's;
# 24/128/68/32/157 once the run's bookkeeping had one owner (issue 62): dp trains through `net` and saves `model`
BUDGETS = {
    ("train_single.py", "train_dp.py"): 28,
    ("train_single.py", "train_ddp_launch.py"): 136,
    ("train_ddp_launch.py", "train_ddp_torchrun.py"): 77,
    ("train_ddp_torchrun.py", "train_ddp_amp.py"): 36,
    ("train_ddp_torchrun.py", "train_fsdp.py"): 160,
}


def changed_lines(a, b):
    diff = subprocess.run(["diff", a, b], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert diff.returncode in (0, 1), diff.stderr
    return sum(line[:1] in "<>" for line in diff.stdout.splitlines() if line)


@pytest.mark.parametrize("rung", BUDGETS, ids=[f"{a}->{b}" for a, b in BUDGETS])
def test_each_diff_stays_within_its_budget(rung):
    assert changed_lines(*rung) <= BUDGETS[rung], f"{rung}: {changed_lines(*rung)} changed lines"


def test_the_readme_ladder_shows_the_real_sizes():
    rows = re.findall(
        r"^\| `(train_\w+\.py)` \| (?:`(train_\w+\.py)`|—) \|.*\| (\d+)(?: in all)? \|$",
        (REPO / "README.md").read_text(),
        re.M,
    )
    assert len(rows) == 6, rows
    for script, base, size in rows:
        expected = changed_lines(base, script) if base else len((REPO / script).read_text().splitlines())
        assert int(size) == expected, f"README says {size} for {script}, the files say {expected}"
    assert {(base, script) for script, base, _ in rows if base} == set(BUDGETS)


def test_the_front_pages_ddp_lines_link_to_where_they_are():
    """ "What DDP needs" links each line to file#L<n>: that line must hold the code shown (up to a trailing "...")."""
    links = re.findall(r"\[`([^`]+)`\]\((train_\w+\.py)#L(\d+)\)", (REPO / "README.md").read_text())
    assert len(links) >= 12, links
    for code, script, line in links:
        text = (REPO / script).read_text().splitlines()[int(line) - 1]
        assert code.split("...")[0].rstrip(", ") in text, f"{script}#L{line} is {text.strip()!r}, not {code!r}"


def test_the_front_page_is_short_and_every_link_resolves():
    assert len((REPO / "README.md").read_text().splitlines()) <= 250
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    anchors = {
        page: {
            re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.*)$", page.read_text(), re.M)
        }
        for page in pages
    }
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors.get(linked, ())):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken
