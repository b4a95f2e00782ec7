"""docs/lessons.md's table and tests/proofs/test_lessons.py's LESSONS say the same: a row per lesson and a lesson per
row, with its script, line, change, the printed fragment its test asserts, and that test, which exists and proves
that lesson; and each line is in its script exactly once (the GPU-only ones too, which no CPU test runs)."""

import re

from support import REPO, lessons

HEADER = "| lesson | script | the line | changed to | without it, the run printed | test |"


def rows():
    """{lesson id: its 6 cells} of the one table of docs/lessons.md (tools/site.py reads it so too)."""
    lines = (REPO / "docs" / "lessons.md").read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == HEADER]
    assert len(starts) == 1, f"docs/lessons.md holds {len(starts)} tables with the header {HEADER}"
    found = {}
    for line in lines[starts[0] + 2 :]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip()[1:-1])]
        lesson = re.fullmatch(r"`([\w.-]+)`", cells[0])
        assert len(cells) == 6 and lesson and lesson[1] not in found, line
        found[lesson[1]] = cells
    return found


def test_docs_lessons_md_and_the_lessons_agree():
    listed, table = lessons(), rows()
    assert len(listed) >= 14 and list(table) == list(listed), (list(table), list(listed))
    for name, lesson in listed.items():
        _, script, line, changed_to, printed, test = table[name]
        assert script == f"`{lesson.script}`", name
        assert line == f"`{lesson.line}`", name
        assert changed_to == (f"`{lesson.changed_to}`" if lesson.changed_to else "removed"), name
        if lesson.printed is None:  # GPU-only: no run has printed anything yet
            assert printed.startswith("not yet run on a GPU"), name
            assert test == f"GPU-only: `{lesson.test}` (not yet run on a GPU)", name
        else:
            assert re.match(r"`([^`]+)`", printed)[1] == lesson.printed, name  # the fragment quoted first
            assert test == f"`{lesson.test}`", name


def test_each_lesson_breaks_one_line_and_names_a_test_of_its_own():
    for name, lesson in lessons().items():
        assert (REPO / lesson.script).read_text().count(lesson.line) == 1, f"{name}: {lesson.line!r} not once"
        assert lesson.changed_to != lesson.line, name
        path, function = lesson.test.split("::")
        source = (REPO / path).read_text()
        body = re.search(rf"^def {function}\(.*?(?=^\S)", source + "\nend", re.S | re.M)
        assert body and f'"{name}"' in body[0], f"{name}: {lesson.test} is not a test of this lesson"
