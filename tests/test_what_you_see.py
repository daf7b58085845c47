"""Every "What you should see" block of chapters 01-05 (chapter 05's pages on DDP rebuilt
and on sharding too) is what the page's own command prints: the command is run as the
page writes it (its run folder redirected), and each line the block shows must be in its
output, in order. `...` in a block stands for what
the page leaves out (timestamps, speeds, torchrun's lines), a line of `...` for any
lines."""

from __future__ import annotations

import re

import pytest

from conftest import REPO, run, run_warm
from pages import find_command, readme_command


def shown_after(page: str, command: str) -> str:
    """The text block a page shows for `command`: the first after both the command's line
    and the start of its "What you should see" section."""
    text = (REPO / page).read_text()
    start = max(text.index(command) + len(command), text.index("## What you should see"))
    return re.search(r"^```text\n(.*?)^```", text[start:], flags=re.S | re.M)[1]


def unmatched(shown: str, stdout: str, stderr: str = "") -> list[str]:
    """The lines of `shown` not found in the output: in order among the lines of stdout
    (timestamps cut), or else anywhere in stderr (the launcher's lines, a traceback)."""
    out = [re.sub(r"^\d\d:\d\d:\d\d ", "", line) for line in stdout.splitlines()]
    err = stderr.splitlines()
    missing, at = [], 0
    for want in shown.rstrip("\n").splitlines():
        if want.strip() == "...":
            continue
        pattern = re.compile(".*".join(map(re.escape, want.split("..."))))
        found = next((i for i in range(at, len(out)) if pattern.fullmatch(out[i].rstrip())), None)
        if found is not None:
            at = found + 1
        elif not any(pattern.fullmatch(line.rstrip()) for line in err):
            missing.append(want)
    return missing


# (one name a line: the tests read the calls of readme_command to know which commands
# their own tests run)
PAGE_01 = "01-single-gpu/README.md"
RUN_01 = "python 01-single-gpu/train_llm.py --model-preset tiny --seq-length 64 --max-steps 30"
PAGE_02 = "02-data-parallel/README.md"
RUN_02 = "python 02-data-parallel/train_llm.py --model-preset tiny --seq-length 64 --max-steps 30"
PAGE_03 = "03-ddp/README.md"
RUN_03 = "torchrun --standalone --nproc-per-node=2 03-ddp/train_llm.py --model-preset tiny --seq-length 64 --max-steps 30"
PAGE_04 = "04-checkpointing/README.md"
RUN_04 = "--crash-at-step 15"
PAGE_05 = "05-collectives/README.md"
RUN_05 = "torchrun --standalone --nproc-per-node=3 05-collectives/collectives_demo.py"
PAGE_DP = "05-collectives/data-parallel.md"
RUN_DP = "torchrun --standalone --nproc-per-node=2 05-collectives/ddp_from_scratch.py --modes naive,bucketed,overlap,ddp"
PAGE_SH = "05-collectives/sharding.md"
RUN_SH = "torchrun --standalone --nproc-per-node=2 05-collectives/sharded_from_scratch.py"


@pytest.mark.parametrize("page, command", [(PAGE_01, RUN_01), (PAGE_02, RUN_02), (PAGE_03, RUN_03)])
def test_a_chapter_s_run_prints_what_its_page_shows(tmp_path, page, command):
    """Chapters 01, 02 and 03 on the page's small run: the losses to the digit, the
    batch each step makes, the lines a reader compares."""
    argv = {RUN_01: readme_command(PAGE_01, RUN_01), RUN_02: readme_command(PAGE_02, RUN_02),
            RUN_03: readme_command(PAGE_03, RUN_03)}[command]
    proc = run_warm([*argv, "--save-dir", tmp_path], env={"CUDA_VISIBLE_DEVICES": ""})
    assert not unmatched(shown_after(page, command), proc.stdout), (unmatched(shown_after(page, command), proc.stdout),
                                                                      proc.stdout[-4000:])


def test_the_collectives_demo_prints_what_its_page_shows():
    proc = run_warm(readme_command(PAGE_05, RUN_05))
    shown = shown_after(PAGE_05, RUN_05)
    assert shown.count("ok") >= 9 and not unmatched(shown, proc.stdout), proc.stdout[-4000:]


@pytest.mark.launch
def test_the_crash_command_prints_what_its_page_shows(tmp_path):
    """Chapter 04's crash command under the real torchrun, which restarts its workers:
    the checkpoint, the injected crash, the resume, the same losses before and after,
    and the final loss of an uninterrupted run (chapter 03's block, the same flags)."""
    command = find_command(PAGE_04, RUN_04)
    proc = run([*readme_command(PAGE_04, RUN_04), "--save-dir", tmp_path], env={"CUDA_VISIBLE_DEVICES": ""},
               timeout=600)
    shown = shown_after(PAGE_04, command)
    assert not unmatched(shown, proc.stdout, proc.stderr), (unmatched(shown, proc.stdout, proc.stderr),
                                                            proc.stdout[-3000:], proc.stderr[-3000:])
    last = re.search(r"step 30/30 \| loss [\d.]+", shown)[0]
    assert last in shown_after(PAGE_03, RUN_03)  # as an uninterrupted run ends


def shown_lines(page: str, command: str) -> list[str]:
    """What a page shows for `command` in its "What you should see" section, up to its
    first bullet: the table's rows and the text block's lines."""
    text = (REPO / page).read_text()
    start = max(text.index(command) + len(command), text.index("## What you should see"))
    section = text[start:].split("\n- ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|") or line.startswith("OK:")]


def missing_lines(shown: list[str], stdout: str) -> list[str]:
    """The lines shown that no line of stdout matches, spaces aside (`…`: any figure)."""
    def squeeze(line):
        return re.sub(r"\s+", " ", line.strip())
    out = [squeeze(line) for line in stdout.splitlines()]
    patterns = [re.compile(".*".join(map(re.escape, squeeze(line).split("…")))) for line in shown]
    return [line for line, pattern in zip(shown, patterns) if not any(pattern.fullmatch(o) for o in out)]


@pytest.mark.launch
@pytest.mark.parametrize("page, command", [(PAGE_DP, RUN_DP), (PAGE_SH, RUN_SH)], ids=["ddp-rebuilt", "sharding"])
def test_chapter_05s_pages_show_what_their_commands_print(tmp_path, page, command):
    """DDP rebuilt and sharding, each page's command as written (the small preset, its
    float64 proof, then its timed steps: a minute of two processes each): every row of the
    table the page shows (its speeds left out as `…`: they depend on the machine; the
    calls, bytes and proof columns do not) and the proof's last line."""
    no_gpu = {"CUDA_VISIBLE_DEVICES": ""}
    if command == RUN_DP:  # (a call each: test_readmes.py then knows these commands run here)
        proc = run([*readme_command(PAGE_DP, RUN_DP), "--save-dir", tmp_path], env=no_gpu, timeout=900)
    else:
        proc = run([*readme_command(PAGE_SH, RUN_SH), "--save-dir", tmp_path], env=no_gpu, timeout=900)
    shown = shown_lines(page, command)
    assert len(shown) >= 6 and not missing_lines(shown, proc.stdout), (missing_lines(shown, proc.stdout),
                                                                      proc.stdout[-4000:])
