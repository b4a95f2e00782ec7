"""The ladder's site (`bash run.sh site`, tools/site.py) as a learner meets it: built with its five real runs on tiny
images, opened from the disk in headless Chromium (Debian's `chromium`, driven by Playwright: requirements-site.txt).
Every page loads with no console error, every link leads to a file of the site and an anchor that exist, each step
page shows exactly `diff`'s hunks with a note beside each, the robustness toggle folds and restores, the pictures'
runs are equal as the pages claim, and the pages fit a desktop and a phone (screenshots kept with a failed test's
folder). Where the browser or Playwright is missing the tests are skipped with the reason; .ci/run installs the
browser and sets SITE_BROWSER_REQUIRED=1, which turns the skip into a failure."""

import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from support import REPO, ok, run_sh, shared_run

REQUIRED = os.environ.get("SITE_BROWSER_REQUIRED") == "1"
# Chromium as root in a closed network: no sandbox (root), and none of its calls home (each a refused connection)
CHROMIUM_ARGS = [
    *"--no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking".split(),
    *"--disable-component-update --disable-sync".split(),
]
STEPS = ("single-launch", "launch-torchrun", "single-dp", "torchrun-amp", "torchrun-fsdp")
WIDTHS = {"desktop": (1400, 900), "phone": (390, 844)}


def missing_browser():
    reasons = []
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        reasons.append("Playwright is missing (pip install -r requirements-site.txt)")
    if shutil.which("chromium") is None:
        reasons.append("no chromium on PATH (Debian: apt-get install chromium)")
    return "; ".join(reasons)


# Skipped before the site is built (a session fixture, set up before any fixture of this module)
pytestmark = pytest.mark.skipif(bool(missing_browser()) and not REQUIRED, reason=missing_browser())


@pytest.fixture(scope="module")
def browser():
    if missing_browser():
        pytest.fail(f"SITE_BROWSER_REQUIRED=1, but {missing_browser()}")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=shutil.which("chromium"), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="session")
def site(tmp_path_factory, tiny_data):
    """The site as `bash run.sh site` builds it, its pictures from real runs on tiny_data: its folder."""

    def make(folder):
        ok(run_sh("site", *f"--out {folder / 'site'} --data-path {tiny_data}".split(), timeout=600))

    return shared_run(tmp_path_factory, "site", make)[0] / "site"


def open_page(browser, path, width="desktop"):
    """A page at the width's viewport, and what it reported: console errors, uncaught exceptions, failed requests."""
    page = browser.new_page(viewport=dict(zip(("width", "height"), WIDTHS[width])))
    errors = []
    page.on("console", lambda message: message.type == "error" and errors.append(f"console: {message.text}"))
    page.on("pageerror", lambda error: errors.append(f"exception: {error}"))
    page.on("requestfailed", lambda request: errors.append(f"request failed: {request.url}"))
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    return page, errors


def png_pixels(png):
    """A PNG's image data as stored (each row's filter byte, then its filtered bytes): a blank page holds a handful
    of distinct values, a page of text and colours well over a hundred."""
    data, at = b"", 8
    while at < len(png):
        length, kind = struct.unpack(">I4s", png[at : at + 8])
        data += png[at + 8 : at + 8 + length] if kind == b"IDAT" else b""
        at += 12 + length
    return zlib.decompress(data)


def diff_hunks(old, new):
    """diff's own hunks: {command line: (old side's changed line numbers, new side's)}."""
    output = subprocess.run(["diff", old, new], cwd=REPO, capture_output=True, text=True).stdout
    hunks, numbers = {}, None
    for line in output.splitlines():
        match = re.fullmatch(r"(\d+)(?:,(\d+))?([acd])(\d+)(?:,(\d+))?", line)
        if match:
            a, b, kind, c, d = match.groups()
            old_lines = [] if kind == "a" else list(range(int(a), int(b or a) + 1))
            new_lines = [] if kind == "d" else list(range(int(c), int(d or c) + 1))
            hunks[line] = numbers = (old_lines, new_lines)
    assert numbers is not None, f"diff {old} {new} found no difference"
    return hunks


def test_every_page_loads_cleanly_and_every_link_resolves(browser, site):
    pages = sorted(site.glob("*.html"))
    assert {page.stem for page in pages} >= {"index", "lessons", "proofs", *STEPS}, pages
    ids, links = {}, []
    for path in pages:
        page, errors = open_page(browser, path)
        ids[path] = set(page.eval_on_selector_all("[id]", "elements => elements.map(element => element.id)"))
        links += [(path.name, href) for href in page.eval_on_selector_all("a[href]", "a => a.map(link => link.href)")]
        page.close()
        assert not errors, (path.name, errors)
    for name, href in links:
        url = urlparse(href)
        assert url.scheme == "file", f"{name} links off the disk: {href} (the pages work offline)"
        target = Path(unquote(url.path))
        # Within the site (its pages, the test files it shows, its runs' logs): a static host serves the folder alone
        assert target.resolve().is_relative_to(site) and target.is_file(), f"{name}: {href}"
        if url.fragment and target.suffix == ".html":
            assert unquote(url.fragment) in ids[target], f"{name}: {href} has no #{url.fragment}"
    assert len(links) > 100, f"only {len(links)} links"


@pytest.mark.parametrize("step", STEPS)
def test_each_step_page_shows_diffs_hunks_with_a_note_beside_each(browser, site, step):
    page, errors = open_page(browser, site / f"{step}.html")
    old, new = page.eval_on_selector("main.diff", "main => [main.dataset.old, main.dataset.new]")
    shown = page.eval_on_selector_all(
        "section.hunk",
        """hunks => hunks.map(hunk => ({
            diff: hunk.dataset.diff,
            old: [...hunk.querySelectorAll('.code.old .line.changed')].map(line => +line.dataset.line),
            new: [...hunk.querySelectorAll('.code.new .line.changed')].map(line => +line.dataset.line),
            text: [...hunk.querySelectorAll('.code.new .line.changed')].map(line => line.textContent),
            notes: [...hunk.querySelectorAll('.notes .note')].map(note => note.innerText.trim()),
            visible: hunk.checkVisibility(),
        }))""",
    )
    page.close()
    assert not errors, errors
    expected = diff_hunks(old, new)
    assert [hunk["diff"] for hunk in shown] == list(expected), "the hunks shown are not diff's, in diff's order"
    new_lines = (REPO / new).read_text().splitlines()
    for hunk in shown:
        assert (hunk["old"], hunk["new"]) == expected[hunk["diff"]], hunk["diff"]
        assert hunk["text"] == [new_lines[number - 1] for number in hunk["new"]], hunk["diff"]
        assert hunk["visible"] and hunk["notes"] and all(hunk["notes"]), f"{step} {hunk['diff']}: no note shown"


def test_the_robustness_toggle_folds_those_hunks_and_restores_them(browser, site):
    page, errors = open_page(browser, site / "single-launch.html")
    count = "sel => [...document.querySelectorAll(sel)].filter(element => element.checkVisibility()).length"
    lesson, robustness = (page.evaluate(count, f"section.hunk.{kind}") for kind in ("lesson", "robustness"))
    assert lesson > 0 and robustness > 0, (lesson, robustness)
    page.click("#toggle-robustness")
    assert page.evaluate(count, "section.hunk.robustness") == 0
    assert page.evaluate(count, "section.hunk.lesson") == lesson
    page.click("#toggle-robustness")
    assert page.evaluate(count, "section.hunk.robustness") == robustness
    page.close()
    assert not errors, errors


def test_the_pictures_show_runs_that_are_equal_as_claimed(browser, site):
    """Each picture's caption gives the largest difference between its two runs' losses, as printed to 4 decimals."""
    figures = {}
    for step in STEPS:
        page, _ = open_page(browser, site / f"{step}.html")
        for name, svg, caption in page.eval_on_selector_all(
            "figure.picture",
            "figures => figures.map(f => [f.dataset.picture, !!f.querySelector('svg polyline'), f.innerText])",
        ):
            figures[name] = caption
            assert svg, f"{name}: no curve drawn"
        page.close()
    assert set(figures) == {"ddp-equals-single", "resumed-equals-uninterrupted", "fsdp-equals-ddp"}, figures
    for name, caption in figures.items():
        largest = re.search(r"Largest \|difference\| of the two losses: ([\d.]+)", caption)
        assert largest and float(largest.group(1)) <= 2e-4, (name, caption)


@pytest.mark.parametrize("width", WIDTHS)
def test_the_pages_fit_a_desktop_and_a_phone(browser, site, width, tmp_path):
    """No page is wider than the screen (code scrolls in its own box), and each screenshot shows a page, not a blank:
    they are kept in the test's folder when it fails, to look at."""
    for name in ("index", "single-launch", "lessons"):
        page, errors = open_page(browser, site / f"{name}.html", width)
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        shot = tmp_path / f"{name}-{width}.png"
        page.screenshot(path=shot)
        page.close()
        assert not errors and overflow <= 0, (name, width, errors, overflow)
        assert len(set(png_pixels(shot.read_bytes()))) > 64, f"{shot}: a blank page"


def test_the_torchrun_step_shows_one_idea_at_a_time(browser, site):
    """launch-torchrun carries three ideas (docs/ladder.md#one-idea-per-step-a-proposal-for-the-torchrun-step): "Only
    torchrun" leaves the hunks of torchrun itself, pressed again every hunk."""
    page, errors = open_page(browser, site / "launch-torchrun.html")
    visible = """() => [...document.querySelectorAll('section.hunk')].filter(h => h.checkVisibility())
        .map(h => h.dataset.ideas.split(' '))"""
    every = page.evaluate(visible)
    page.click("button.only-idea[data-idea=torchrun]")
    torchrun = page.evaluate(visible)
    assert 0 < len(torchrun) < len(every) and all("torchrun" in ideas for ideas in torchrun), torchrun
    assert any("torchrun" not in ideas for ideas in every)
    page.click("button.only-idea[data-idea=torchrun]")
    assert page.evaluate(visible) == every
    page.close()
    assert not errors, errors
