"""The documentation builds with every link and anchor resolved (MkDocs, strict), and the README stays short and
links only to what exists."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strictly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "how-it-works" / "index.html").exists()


def _anchor(title: str) -> str:
    """MkDocs' (Python-Markdown toc) anchor of a heading."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title.strip().lower()))


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme):
        path, anchor = target
        if path.startswith(("http://", "https://")):
            continue
        assert (ROOT / path).exists(), path
        if anchor:
            headings = re.findall(r"(?m)^#+ (.+)$", (ROOT / path).read_text())
            assert anchor in {_anchor(h) for h in headings}, (path, anchor)


DOCS = sorted((ROOT / "docs").glob("*.md"))
_LIST_ITEM = re.compile(r"^\s*(?:[-*] |\d+\. )")
MAX_PARAGRAPH_WORDS = 150


def _paragraphs(text: str):
    """(first line number, words) of each prose paragraph: a block of consecutive non-blank lines outside fenced
    code blocks, tables (lines starting with "|") and headings; every list item (with its continuation lines) is
    a paragraph of its own."""
    paragraph, start, fenced = [], 0, False
    for number, line in enumerate([*text.splitlines(), ""], 1):
        stripped = line.strip()
        prose = not (fenced or not stripped or stripped.startswith(("```", "|", "#")))
        if not prose or _LIST_ITEM.match(line):
            if paragraph:
                yield start, " ".join(paragraph).split()
            paragraph = []
        if stripped.startswith("```"):
            fenced = not fenced
        if prose:
            start = start if paragraph else number
            paragraph.append(_LIST_ITEM.sub("", line, count=1).strip())


def test_paragraph_counter_reads_blocks_lists_code_and_tables():
    text = "# T\n\none two\nthree\n\n- a b\n  c\n- d\n\n```\nnot prose at all\n```\n| x | y |\n"
    assert list(_paragraphs(text)) == [(3, ["one", "two", "three"]), (6, ["a", "b", "c"]), (8, ["d"])]


def test_no_paragraph_over_150_words():
    """Long paragraphs are split: every prose paragraph of every page stays readable (at most 150 words)."""
    long = [
        f"docs/{page.name}:{line}: {len(words)} words"
        for page in DOCS
        for line, words in _paragraphs(page.read_text())
        if len(words) > MAX_PARAGRAPH_WORDS
    ]
    assert not long, f"paragraphs over {MAX_PARAGRAPH_WORDS} words:\n" + "\n".join(long)


OPENING_LINES = 15  # the example starts within this many lines after the title
LEAD_WORDS = 80  # the lead before it: one or two sentences


def _opening(text: str) -> tuple[int | None, int]:
    """(line after the title where the page's first example starts, or None; words of prose before it). Headings
    are skipped; the example is a fenced code block or a table."""
    lines = text.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("# "))
    lead = 0
    for offset, line in enumerate(lines[title + 1 : title + 1 + OPENING_LINES], 1):
        stripped = line.strip()
        if stripped.startswith(("```", "|")):
            return offset, lead
        if not stripped.startswith("#"):
            lead += len(stripped.split())
    return None, lead


def test_opening_reader_finds_the_example():
    assert _opening("# T\n\nWhat this is for.\n\n```python\nx()\n```\n") == (4, 4)
    assert _opening("# T\n\n## Part\n\n| a | b |\n") == (4, 0)  # a table, but no lead: the page test refuses it
    assert _opening("# T\n\n" + "Prose only, no example.\n" * 20)[0] is None


def test_every_page_opens_with_a_lead_and_an_example():
    """Right under its title each page says in a sentence or two what it is for, then shows an example (a fenced
    code block: a call, a command, a plan excerpt; or a table) before any long prose."""
    bad = []
    for page in DOCS:
        start, lead = _opening(page.read_text())
        if start is None:
            bad.append(f"docs/{page.name}: no code block or table within {OPENING_LINES} lines of the title")
        elif not 5 <= lead <= LEAD_WORDS:
            bad.append(
                f"docs/{page.name}: {lead} words of prose before the first example (a sentence or two: "
                f"5 to {LEAD_WORDS})"
            )
    assert not bad, "\n".join(bad)


def test_every_figure_says_the_command_that_draws_it():
    """A picture in docs/figures/ is embedded next to the command that regenerates it (`... --svg docs/figures/F`
    in the page, at most 12 lines from the image), so it can be redrawn when the planner changes."""
    missing = []
    for page in DOCS:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            for figure in re.findall(r"!\[[^\]]*\]\((figures/[^)\s]+)\)", line):
                near = "\n".join(lines[max(0, number - 12) : number + 13])
                if f"--svg docs/{figure}" not in near:
                    missing.append(f"docs/{page.name}:{number + 1}: {figure}")
    assert not missing, "figures without the command that draws them:\n" + "\n".join(missing)


_NAMED = re.compile(r"(tests/test_\w+\.py)((?:::\w+)?)|`::(test_\w+)")


def _tests_of(path: Path) -> dict[str, bool]:
    """Each test function of a test file -> whether it runs in the slow tier only (marked slow itself or by the file;
    a test with some of its parameters marked slow runs the others in the default tier)."""
    tree = ast.parse(path.read_text())
    whole = any(
        isinstance(n, ast.Assign) and "pytestmark" in ast.unparse(n) and "slow" in ast.unparse(n.value)
        for n in tree.body
    )
    return {
        n.name: whole
        or any("mark.slow" in ast.unparse(d) and "parametrize" not in ast.unparse(d) for d in n.decorator_list)
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")
    }


def _units(text: str) -> list[str]:
    """Paragraphs and table rows: where a claim and the test that checks it are written together."""
    units = []
    for block in re.split(r"\n\s*\n", text):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        units += rows if rows else [block]
    return units


def test_the_tests_the_docs_name_exist_and_slow_ones_are_said_to_be():
    """A claim that names its test names one that exists, and one that runs only in the slow tier (``pytest -m
    slow``, not what CI runs) says so where it is named."""
    bad = []
    for page in [ROOT / "README.md", *DOCS]:
        for unit in _units(page.read_text()):
            file = None
            for path, name, more in _NAMED.findall(unit):
                file = path or file
                name = (name[2:] if name else more) or None
                if file is None or not (ROOT / file).exists():
                    bad.append(f"{page.name}: {file or '::' + more} does not exist")
                    continue
                tests = _tests_of(ROOT / file)
                if name and name not in tests:
                    bad.append(f"{page.name}: {file}::{name} does not exist")
                elif name and tests[name] and "slow" not in unit:
                    bad.append(f"{page.name}: {file}::{name} runs in the slow tier only, and the text does not say so")
    assert not bad, "\n".join(bad)
