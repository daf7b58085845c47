"""The text tells the truth: links resolve, diff hunks are the real diffs, and every
command in a chapter README runs (smoke-tested with tiny settings) unless it is marked
as needing GPUs or several machines."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run

CHAPTERS = ["01-single-gpu", "02-data-parallel", "03-ddp", "04-checkpointing", "05-collectives"]
READMES = [REPO / "README.md"] + [REPO / c / "README.md" for c in CHAPTERS]
# chapter 03 builds on chapter 01: nn.DataParallel (02) is a detour, not a base
PREVIOUS = {"02-data-parallel": "01-single-gpu", "03-ddp": "01-single-gpu",
            "04-checkpointing": "03-ddp"}
NEEDS_MARK = re.compile(r"#\s*needs\b")
# appended to every train_llm.py command (argparse: the last occurrence wins)
TRAIN_OVERRIDES = ["--model-preset", "tiny", "--seq-length", "64", "--batch-size", "4",
                   "--val-batches", "2", "--num-workers", "0", "--log-freq", "5"]
SCRIPT_OVERRIDES = {
    "bench_collectives.py": ["--max-bytes", "65536", "--iters", "3", "--warmup", "1"],
    "ddp_from_scratch.py": ["--model-preset", "tiny", "--seq-length", "64", "--batch-size", "4",
                            "--steps", "3"],
    "collectives_demo.py": [],
    "sharded_from_scratch.py": ["--model-preset", "tiny", "--seq-length", "64", "--batch-size", "4",
                                "--steps", "3", "--timing-warmup", "1"],
    "sharded_checkpoint.py": ["--model-preset", "tiny", "--seq-length", "32", "--batch-size", "2",
                              "--steps", "2"],
}


def fenced_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_every_chapter_has_a_readme():
    for readme in READMES:
        assert readme.is_file(), f"{readme} is missing"


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(readme):
    text = readme.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for target in links:
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # web address or anchor in the same page
        path = (readme.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{readme.relative_to(REPO)} links to missing files: {broken}"


def real_diff(chapter: str) -> list[str]:
    """`diff -u` of the chapter's script against the previous chapter's, without the
    two header lines (they carry timestamps)."""
    old = f"{PREVIOUS[chapter]}/train_llm.py"
    new = f"{chapter}/train_llm.py"
    proc = subprocess.run(["diff", "-u", old, new], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1, f"diff -u {old} {new} failed or found no difference"
    return [line for line in proc.stdout.splitlines() if not line.startswith(("--- ", "+++ "))]


@pytest.mark.parametrize("chapter", sorted(PREVIOUS))
def test_diff_blocks_are_real(chapter):
    diff = real_diff(chapter)
    text = (REPO / chapter / "README.md").read_text()
    blocks = fenced_blocks(text, "diff")
    assert blocks, f"{chapter}/README.md shows no diff against {PREVIOUS[chapter]}"
    for block in blocks:
        lines = block.rstrip("\n").splitlines()
        found = any(diff[i:i + len(lines)] == lines for i in range(len(diff) - len(lines) + 1))
        assert found, (f"a diff block in {chapter}/README.md is not in the real diff -u "
                       f"against {PREVIOUS[chapter]}:\n{block}")


def test_code_quoted_in_chapter_04_is_its_code():
    """Chapter 04's README walks through its modules by quoting them: every python block
    (inside a list item too) is a run of lines of checkpoint.py or preemption.py."""
    text = (REPO / "04-checkpointing" / "README.md").read_text()
    sources = [p.read_text().splitlines() for p in (REPO / "04-checkpointing").glob("*.py")]
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", text, flags=re.S | re.M)
    assert len(blocks) >= 4
    for indent, block in blocks:
        lines = [line.removeprefix(indent) for line in block.rstrip("\n").splitlines()]
        assert any(src[i:i + len(lines)] == lines for src in sources for i in range(len(src))), \
            f"04-checkpointing/README.md quotes code that is not in the chapter:\n{block}"


def readme_commands(chapter: str) -> list[tuple[str, bool]]:
    """(command, runnable) for every command line in the README's bash blocks. In the
    top-level README (chapter "."), only the part after "## Using it for real": its
    Quickstart is what CI itself runs (.ci/run) and what tests/test_tour.py covers."""
    text = (REPO / chapter / "README.md").read_text()
    if chapter == ".":
        text = text.split("## Using it for real", 1)[1]
    out = []
    for block in fenced_blocks(text, "bash"):
        for line in block.splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append((line, not NEEDS_MARK.search(line)))
    return out


def smoke_argv(command: str, save_dir: Path) -> tuple[list[str], dict]:
    """The command as argv, with tiny settings appended and outputs/ redirected."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    words = [w.replace("outputs/", f"{save_dir}/") for w in words]
    if words[0] == "python":
        argv = [sys.executable, *words[1:]]
    elif words[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
    else:
        raise AssertionError(f"README command starts with {words[0]!r}: the test knows "
                             f"python and torchrun")
    script = next(w for w in words if w.endswith(".py"))
    name = Path(script).name
    if name == "train_llm.py":
        argv += TRAIN_OVERRIDES + ["--save-dir", str(save_dir)]
    else:
        argv += SCRIPT_OVERRIDES[name]
        if name != "collectives_demo.py":
            argv += ["--save-dir", str(save_dir)]
    return argv, env


@pytest.mark.parametrize("chapter", [*CHAPTERS, "."])
def test_readme_commands_run(chapter, tmp_path):
    commands = readme_commands(chapter)
    assert commands, f"{chapter}/README.md has no commands"
    ran = 0
    for command, runnable in commands:
        if not runnable:
            continue
        argv, env = smoke_argv(command, tmp_path)
        if "two terminals" in command:
            # two "nodes" that meet at one rendezvous: start both, wait for both
            procs = [subprocess.Popen(argv, cwd=REPO, env={**os.environ, **env},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                     for _ in range(2)]
            outs = [p.communicate(timeout=300)[0] for p in procs]
            for p, o in zip(procs, outs):
                assert p.returncode == 0, f"{command}\n{o[-4000:]}"
        else:
            run(argv, env=env, timeout=600)
        ran += 1
    assert ran, f"{chapter}/README.md: every command is marked as needing special hardware"
