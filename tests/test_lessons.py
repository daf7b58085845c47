"""Lesson first (DESIGN.md): each chapter's diff against the chapter it builds on is its
wiring, within the budget tools/chapters.py gives it; a script's main() reads in one go;
no chapter script passes 500 lines; every script's first screen is the lesson, its
imports plain. A budget is a signal that wiring grew, never a
reason to move a lesson out of its chapter."""

from __future__ import annotations

import ast
import re
import subprocess

import pytest

from conftest import REPO
from tools.chapters import CHAPTERS

STEPS = [c for c in CHAPTERS if c.builds_on]
SCRIPTS = sorted(REPO.glob("0*/*.py"))


def changed_lines(old: str, new: str) -> int:
    """`diff -u A B | grep -cE '^[+-][^+-]'`, as DESIGN.md measures it."""
    out = subprocess.run(["diff", "-u", f"{old}/train_llm.py", f"{new}/train_llm.py"], cwd=REPO,
                         capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if re.match(r"^[+-][^+-]", line))


def main_length(path) -> int:
    tree = ast.parse(path.read_text())
    return max((n.end_lineno - n.lineno + 1 for n in tree.body
                if isinstance(n, ast.FunctionDef) and n.name == "main"), default=0)


@pytest.mark.parametrize("chapter", STEPS, ids=lambda c: f"{c.builds_on[:2]}-{c.number}")
def test_each_step_is_within_its_budget(chapter):
    assert changed_lines(chapter.builds_on, chapter.folder) <= chapter.diff_budget


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_script_reads_in_one_go(script):
    """main() about two screens (chapter 04's, the longest, adds the resume before its loop
    and the vote and save inside it); the whole script under 500 lines."""
    assert main_length(script) <= 160
    assert len(script.read_text().splitlines()) <= 500


def test_a_readme_that_states_its_diff_size_states_the_real_one():
    for readme in sorted(REPO.glob("0*/README.md")):
        text = " ".join(readme.read_text().split())  # a sentence may wrap anywhere
        for old, new, n in re.findall(r"`diff -u (\S+)/train_llm\.py (\S+)/train_llm\.py` is (\d+) changed", text):
            assert int(n) == changed_lines(old, new), f"{readme.parent.name}/README.md: {old} -> {new}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_script_imports_plainly(script):
    """The project is installed (the Quickstart's pip install -e .) and a script's folder
    is on the path when it runs, so nothing comes before the imports: no signal held
    while they run, no sys.path edited, no import excused from the top (noqa: E402)."""
    text = script.read_text()
    assert "sys.path" not in text and "noqa: E402" not in text
    assert not re.search(r"pthread_sigmask\(signal\.SIG_BLOCK, \[signal\.SIGINT\]\)", text)
