"""docs/proofs.md names the test of every claim by its function name: each name it gives must be a test that exists,
and each bullet must give one. (Names only, not files: the modules move between the folders of tests/.)"""

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = next(folder for folder in (HERE, *HERE.parents) if folder.name == "tests")
PROOFS = next(folder for folder in HERE.parents if (folder / "docs" / "proofs.md").is_file()) / "docs" / "proofs.md"
NAMED = re.compile(r"`(test_\w+)`")

# Bullets that no test proves: rules the suite is written by, kept by review, not by a test. (section, first words)
NO_TEST = {
    ("The suite's own rules", "**No check assumes an idle machine**"),
    ("The suite's own rules", "**Train once, assert many times**"),
    ("The suite's own rules", "**A passed test's folder goes when it ends**"),
}


def bullets():
    """[section, the bullet's text with its continuation lines] of every bullet of docs/proofs.md."""
    found, section, inside = [], None, False
    for line in PROOFS.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section, inside = line[3:].strip(), False
        elif line.startswith("- "):
            found.append([section, line[2:]])
            inside = True
        elif inside and line.startswith("  "):
            found[-1][1] += " " + line.strip()
        else:
            inside = False  # a blank or unindented line ends the bullet
    return found


def test_every_test_that_proofs_md_names_exists():
    named = set(NAMED.findall(PROOFS.read_text(encoding="utf-8")))
    defined = set()
    for module in TESTS.rglob("test_*.py"):
        defined.update(re.findall(r"^\s*def (test_\w+)\(", module.read_text(encoding="utf-8"), re.M))
    assert len(named) >= 80, f"docs/proofs.md names only {len(named)} tests"
    missing = sorted(named - defined)
    assert not missing, f"docs/proofs.md names tests that no tests/**/test_*.py defines: {missing}"


def test_every_bullet_of_proofs_md_names_its_test():
    unnamed, untested = [], set()
    for section, text in bullets():
        allowed = {(where, words) for where, words in NO_TEST if where == section and text.startswith(words)}
        if section == "Not tested" or NAMED.search(text):
            continue
        if allowed:
            untested |= allowed
        else:
            unnamed.append(f"{section}: {text[:80]}")
    assert not unnamed, "these bullets of docs/proofs.md name no test:\n" + "\n".join(unnamed)
    assert untested == NO_TEST, f"NO_TEST lists bullets that are gone or now name a test: {NO_TEST - untested}"
