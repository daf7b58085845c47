"""Lesson first (DESIGN.md): each chapter's diff is its wiring and nothing else, and a
script's main() reads in one go. Two budgets hold: changed lines between the scripts a
reader diffs where the lesson is wiring (01 -> 02, 01 -> 03), and the longest main().
Chapter 04's lesson lives in modules beside its script, and a chapter 05 script is as
long as its demonstration needs: a line budget must never push a lesson into `common`.
The top-level README's table shows the real figures."""

from __future__ import annotations

import ast
import re
import subprocess

import pytest

from conftest import REPO

# Changed-line budgets of the steps whose lesson is wiring. 03 -> 04 has none: its
# lesson is checkpoint.py and preemption.py; the README's table shows its real figures.
BUDGETS = {("01-single-gpu", "02-data-parallel"): 60, ("01-single-gpu", "03-ddp"): 140}
STEPS = [*BUDGETS, ("03-ddp", "04-checkpointing")]
SCRIPTS = sorted(REPO.glob("0*/*.py"))


def changed_lines(old: str, new: str) -> int:
    """`diff -u A B | grep -E '^[+-][^+-]' | wc -l`, as DESIGN.md measures it."""
    out = subprocess.run(["diff", "-u", f"{old}/train_llm.py", f"{new}/train_llm.py"], cwd=REPO,
                         capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if re.match(r"^[+-][^+-]", line))


def main_length(path) -> int:
    tree = ast.parse(path.read_text())
    return max((n.end_lineno - n.lineno + 1 for n in tree.body
                if isinstance(n, ast.FunctionDef) and n.name == "main"), default=0)


@pytest.mark.parametrize("step", BUDGETS, ids=lambda s: f"{s[0][:2]}-{s[1][:2]}")
def test_each_step_is_small(step):
    assert changed_lines(*step) <= BUDGETS[step]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_main_reads_in_one_go(script):
    """About two screens: chapter 04's, the longest, adds the resume before its loop and
    the vote and save inside it."""
    assert main_length(script) <= 160


def test_the_readme_table_shows_the_real_figures():
    text = (REPO / "README.md").read_text()
    for old, new in STEPS:
        row = re.search(rf"\| {old[:2]} → {new[:2]} \| (\d+) \| (\d+) lines \|", text)
        assert row, f"no row for {old[:2]} -> {new[:2]}"
        assert int(row.group(1)) == changed_lines(old, new)
        assert int(row.group(2)) == main_length(REPO / new / "train_llm.py")
    base = re.search(r"\| 01 \(the base\) \| \| (\d+) lines \|", text)
    assert base and int(base.group(1)) == main_length(REPO / "01-single-gpu" / "train_llm.py")


def test_each_chapter_readme_states_its_real_diff_size():
    """A chapter README that says how many lines its diff changes says the real number."""
    stated = []
    for readme in sorted(REPO.glob("0*/README.md")):
        text = " ".join(readme.read_text().split())  # a sentence may wrap anywhere
        for old, new, n in re.findall(r"`diff -u (\S+)/train_llm\.py (\S+)/train_llm\.py` is (\d+) changed", text):
            stated.append(readme.parent.name)
            assert int(n) == changed_lines(old, new), f"{readme.parent.name}/README.md: {old} -> {new}"
    assert stated == ["02-data-parallel", "03-ddp"]
