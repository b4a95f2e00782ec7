"""docs/lessons.md's table and tests/proofs/test_lessons.py's LESSONS say the same: a row per lesson and a lesson per
row, with its script, line, change, the printed fragment its test asserts, and that test, which exists and proves
that lesson; and each line is in its script exactly once (the GPU-only ones too, which no CPU test runs)."""

import re

from support import REPO, lessons, module_at


def rows():
    """{lesson id: its 6 cells} of the one table of docs/lessons.md, as tools/site.py reads it for the gallery's page:
    one table with that header, each row 6 cells, the first a lesson id in backticks given once."""
    ladder = module_at("tools/site.py", "ladder_site").Ladder(REPO)
    wrong = [error for error in ladder.errors if "docs/lessons.md" in error]
    assert not wrong, "\n".join(wrong)
    return ladder.lessons


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
