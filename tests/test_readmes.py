"""The pages tell the truth and stay readable: links resolve, diff hunks are the real
diffs, code quoted from a chapter is its code, every command a page shows runs as
written (found in the page itself: no list of them is kept here), and each README stays
within its length."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_script, run
from pages import PAGES, argv_of, commands_run_by_tests, fenced_blocks, page_commands, split_command
from tools.chapters import CHAPTERS

PREVIOUS = {c.folder: c.builds_on for c in CHAPTERS if c.builds_on}  # whose diff each README shows
TOOL = re.compile(r"^python -m (tools\.\w+)(.*)$")
# Flags that make a run short, appended (argparse: the last occurrence wins) to every
# command a page shows; what a command is for does not change, only its size.
TRAIN_FAST = ["--model-preset", "tiny", "--seq-length", "64", "--batch-size", "4", "--max-steps", "3",
              "--val-batches", "2", "--num-workers", "0", "--log-freq", "1", "--warmup-steps", "1"]
SCRIPT_FAST = {
    "train_llm.py": TRAIN_FAST,
    "memory_anatomy.py": ["--model-preset", "tiny", "--seq-length", "64", "--batch-size", "2"],
    "ddp_knobs.py": ["--model-preset", "tiny", "--seq-length", "64", "--batch-size", "4", "--steps", "2"],
    "debug_hang.py": [],
    "collectives_demo.py": [],
    "bench_collectives.py": ["--max-bytes", "65536", "--iters", "3", "--warmup", "1"],
    "ddp_from_scratch.py": ["--model-preset", "tiny", "--seq-length", "32", "--batch-size", "2", "--steps", "2",
                            "--proof-steps", "2"],
    "sharded_from_scratch.py": ["--model-preset", "tiny", "--seq-length", "32", "--batch-size", "2",
                                "--steps", "2", "--timing-warmup", "1", "--proof-steps", "2"],
    "sharded_checkpoint.py": ["--model-preset", "tiny", "--seq-length", "32", "--batch-size", "2", "--steps", "2"],
    "overlap_timeline.py": ["--model-preset", "tiny", "--seq-length", "64", "--batch-size", "4",
                            "--modes", "naive,ddp", "--warmup", "1"],
    "prove.py": ["--model-preset", "tiny", "--seq-length", "16", "--proof-steps", "1"],
    "prove_resume.py": ["--seq-length", "16", "--save-at", "1", "--then", "1"],
    "measure.py": ["--model-preset", "tiny", "--seq-length", "32", "--microbatches", "1,2", "--steps", "1",
                   "--warmup", "0"],
}
TOOL_FAST = {"tools.tour": ["--dry-run"], "tools.gpu_check": ["--dry-run"],
             "tools.bench_model": ["--presets", "tiny", "--iters", "2", "--warmup", "1", "--no-compile"],
             "tools.data_memory": ["--tokens", "100000", "--nproc-per-node", "2"]}
RUN_BY_TESTS = commands_run_by_tests()  # {command: the test file that runs it as written}


def test_every_chapter_has_a_readme():
    for c in CHAPTERS:
        assert (REPO / c.folder / "README.md").is_file(), f"{c.folder}/README.md is missing"


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped,
    spaces to hyphens, a repeated heading numbered (-1, -2, ...)."""
    anchors, seen = set(), {}
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)  # no headings in code
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    """Every link to a file of the repo finds it, and a link to a section of a Markdown
    file (`#anchor`, on the same page too) finds that heading."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # web address
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path.read_text()):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)} links to missing files or sections: {broken}"


def test_the_readme_lists_the_chapters_in_order_as_they_launch():
    """The top README's chapter table is tools/chapters.py's list: a row per chapter, in
    order, linking its README and showing its command."""
    rows = re.findall(r"^\| \[(\d\d-[\w-]+)\]\(\1/README\.md\) \|.*\| `([^`]+)` \|$",
                      (REPO / "README.md").read_text(), flags=re.M)
    assert [folder for folder, _ in rows] == [c.folder for c in CHAPTERS]
    for (folder, command), c in zip(rows, CHAPTERS):
        assert command.startswith(c.command().split(" --nproc-per-node")[0]) and c.folder in command, command


def real_diff(chapter: str) -> list[str]:
    """`diff -u` of the chapter's script against the one it builds on, without the two
    header lines (they carry timestamps)."""
    old, new = f"{PREVIOUS[chapter]}/train_llm.py", f"{chapter}/train_llm.py"
    proc = subprocess.run(["diff", "-u", old, new], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, f"diff -u {old} {new} failed or found no difference"
    return [line for line in proc.stdout.splitlines() if not line.startswith(("--- ", "+++ "))]


@pytest.mark.parametrize("chapter", sorted(PREVIOUS))
def test_diff_blocks_are_real(chapter):
    diff = real_diff(chapter)
    blocks = fenced_blocks((REPO / chapter / "README.md").read_text(), "diff")
    assert blocks, f"{chapter}/README.md shows no diff against {PREVIOUS[chapter]}"
    for block in blocks:
        lines = block.rstrip("\n").splitlines()
        found = any(diff[i:i + len(lines)] == lines for i in range(len(diff) - len(lines) + 1))
        assert found, f"a diff block in {chapter}/README.md is not in the real diff -u:\n{block}"


@pytest.mark.parametrize("chapter", ["04-checkpointing", "06-model-parallel"])
def test_code_quoted_from_the_chapter_is_its_code(chapter):
    """A README that walks through its chapter's modules quotes them: every python block
    (inside a list item too) is a run of lines of one of the chapter's files."""
    text = (REPO / chapter / "README.md").read_text()
    sources = [p.read_text().splitlines() for p in (REPO / chapter).glob("*.py")]
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", text, flags=re.S | re.M)
    for indent, block in blocks:
        lines = [line.removeprefix(indent) for line in block.rstrip("\n").splitlines()]
        assert any(src[i:i + len(lines)] == lines for src in sources for i in range(len(src))), \
            f"{chapter}/README.md quotes code that is not in the chapter:\n{block}"


# ---- every command a page shows -----------------------------------------------------------------

def option_strings(module) -> set[str]:
    """The flags a script's parser knows (its parse_args, stopped before it parses)."""
    import argparse
    seen = {}

    def grab(self, args=None, namespace=None):
        seen["parser"] = self
        raise SystemExit(0)
    original, argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_args, grab
    try:
        module.parse_args([])
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
    return {s for a in seen["parser"]._actions for s in a.option_strings}


def parse_only(command: str, save_dir: Path):
    """A command that needs hardware or an earlier command's outputs: its script exists and
    knows every flag it is given."""
    parts = split_command(command, save_dir)
    assert (REPO / parts["script"]).is_file(), f"{command}: no script {parts['script']}"
    flags = {w.split("=")[0] for w in parts["args"] if w.startswith("--")}
    unknown = flags - option_strings(load_script(parts["script"]))
    assert not unknown, f"{command}: unknown flags {unknown}"


def fast_argv(command: str, save_dir: Path) -> tuple[list[str], dict]:
    """The command as argv, its size made small, its outputs in `save_dir`."""
    parts = split_command(command, save_dir)
    name = Path(parts["script"]).name
    assert name in SCRIPT_FAST, f"{command}: add the flags that make {name} short to SCRIPT_FAST"
    argv = [*argv_of(parts), *SCRIPT_FAST[name]]
    if "--save-dir" in option_strings(load_script(parts["script"])):
        argv += ["--save-dir", str(save_dir)]
    return argv, parts["env"]


@pytest.mark.launch
@pytest.mark.parametrize("page", [p for p in PAGES if page_commands(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_runs_as_written(page, tmp_path):
    """Each command a page shows runs (its size made small by flags appended), once
    however often the page shows it; a command marked `# needs ...` (GPUs, machines, root)
    or naming an earlier command's outputs is parsed by its script's own parser, and so
    is one that a chapter's own test runs as written (tests/pages.py: readme_command)."""
    ran = set()
    for command, need in page_commands(page):
        tool = TOOL.match(command)
        if tool:
            argv = [*shlex.split(tool[2]), *TOOL_FAST.get(tool[1], [])]
            if need is None and "outputs/" not in command and (tool[1], *argv) not in ran:
                ran.add((tool[1], *argv))
                run([sys.executable, "-m", tool[1], *argv], timeout=600)
            continue
        if need is not None or "outputs/" in command or command in RUN_BY_TESTS:
            parse_only(command, tmp_path)
            continue
        argv, env = fast_argv(command, tmp_path)
        key = (tuple(sorted(env.items())), *argv)
        if key not in ran:
            ran.add(key)
            run(argv, env=env, timeout=600)


def test_the_commands_chapter_tests_run_are_on_their_pages():
    """A command left to a chapter's own test (readme_command) is one a page shows, and
    that test file calls for it: the pages' largest commands are run once, there."""
    shown = {c for page in PAGES for c, _ in page_commands(page)}
    assert RUN_BY_TESTS and set(RUN_BY_TESTS) <= shown
    for command, file in RUN_BY_TESTS.items():
        assert "readme_command(" in (REPO / "tests" / file).read_text(), (command, file)


# ---- readable ---------------------------------------------------------------------------------

WORDS = {REPO / "README.md": 1500}  # the map; a chapter's README at most 3,000


@pytest.mark.parametrize("readme", [REPO / "README.md", *REPO.glob("0*/*.md")], ids=lambda p: str(p.relative_to(REPO)))
def test_a_readme_reads_in_under_half_an_hour(readme):
    words = len(readme.read_text().split())
    assert words <= WORDS.get(readme, 3000), f"{readme.relative_to(REPO)}: {words} words"


@pytest.mark.parametrize("page", [p for p in PAGES if p.name != "results.md"], ids=lambda p: str(p.relative_to(REPO)))
def test_no_commit_hash_or_hand_kept_count(page):
    """Provenance lives in docs/results.md, written by a command; a page quotes a figure
    and links there. A commit hash or a count of tests goes stale the next day."""
    text = page.read_text()
    assert not re.search(r"\b(commit|on) `?[0-9a-f]{7,40}\b", text), f"{page.relative_to(REPO)}: a commit hash"
    assert not re.search(r"\b\d{2,} (tests|passed)\b", text), f"{page.relative_to(REPO)}: a count of tests"


# A promised exit status; under torchrun it is the workers', not the shell's.
PROMISED_STATUS = re.compile(r"\bexit(s|ing)?( with)?( status)? (2|130|143)\b|\((130|143) for")


def test_statuses_promised_for_torchrun_runs_say_what_the_shell_sees():
    """Where a README promises exit status 2, 130 or 143 for a script torchrun launches,
    the same paragraph says that the shell sees torchrun's own status (1, after its
    ChildFailedError report): tests/test_cli.py shows torchrun returning 1 for a worker's 2."""
    missing = []
    for page in PAGES:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for paragraph in re.split(r"\n\s*\n", prose):
            if PROMISED_STATUS.search(paragraph) and "torchrun" in paragraph \
                    and "torchrun's own status" not in " ".join(paragraph.split()):
                missing.append(f"{page.relative_to(REPO)}: {paragraph.strip()[:120]}")
    assert not missing, "\n".join(missing)
