"""The text tells the truth: links resolve, diff hunks are the real diffs, and every
command in a chapter README parses through its script's own parser, and every runnable
one runs: launched by the proof test that covers it, or here with tiny settings."""

from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_script, run
from tools import chapters as tools_chapters

CHAPTER_LIST = tools_chapters.CHAPTERS
CHAPTERS = [c.folder for c in CHAPTER_LIST]
READMES = [REPO / "README.md"] + [REPO / c / "README.md" for c in CHAPTERS]
PREVIOUS = {c.folder: c.builds_on for c in CHAPTER_LIST if c.builds_on}  # whose diff each README shows
NEEDS_MARK = re.compile(r"#\s*needs\b")
TOOL = re.compile(r"python -m (common\.\w+)(.*)$")  # e.g. python -m tools.plan --nodes 2
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
    "overlap_timeline.py": ["--model-preset", "tiny", "--seq-length", "64", "--batch-size", "4",
                            "--modes", "naive,ddp", "--warmup", "1"],
}


def fenced_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_every_chapter_has_a_readme():
    for readme in READMES:
        assert readme.is_file(), f"{readme} is missing"


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


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(readme):
    """Every link to a file of the repo finds it, and a link to a section of a Markdown
    file (`#anchor`, on the same page too) finds that heading."""
    text = readme.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = []
    for target in links:
        if re.match(r"[a-z]+:", target):
            continue  # web address
        file, _, anchor = target.partition("#")
        path = (readme.parent / file).resolve() if file else readme
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path.read_text()):
            broken.append(target)
    assert not broken, f"{readme.relative_to(REPO)} links to missing files or sections: {broken}"


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


# Every runnable README command is either launched, in the same form, by the proof test
# named here (same script, same launcher, or the suite's warm one that gives the script
# what torchrun gives it, at least the same flags; the test asserts what the command is
# for), or run below. A new command must be added to one of the two.
LAUNCHED_BY = {
    "python 01-single-gpu/train_llm.py": "conftest.py::ch01_smoke",
    "python 01-single-gpu/train_llm.py --padded --max-steps 30":
        "test_ch01_single.py::test_runs_from_inside_the_chapter_folder",
    "python 01-single-gpu/train_llm.py --grad-accum 2 --max-steps 30":
        "test_ch01_single.py::test_runs_from_inside_the_chapter_folder",
    "torchrun --standalone --nproc-per-node=1 01-single-gpu/train_llm.py --max-steps 20":
        "test_ch01_single.py::test_runs_from_inside_the_chapter_folder",
    "python 01-single-gpu/train_llm.py --activation-checkpointing --max-steps 30":
        "test_ch01_single.py::test_compiled_and_eager_training_agree",
    "python 01-single-gpu/memory_anatomy.py": "test_ch01_memory.py::anatomy",
    "python 02-data-parallel/train_llm.py": "test_ch02_data_parallel.py::runs",
    "torchrun --standalone --nproc-per-node=2 03-ddp/train_llm.py": "test_ch03_ddp.py::ddp",
    "python 03-ddp/train_llm.py --max-steps 20": "test_ch03_ddp.py::accum",
    "torchrun --standalone --nproc-per-node=2 03-ddp/ddp_knobs.py": "test_ch03_ddp_knobs.py::knobs",
    "TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node=2 03-ddp/debug_hang.py":
        "test_ch03_debug_hang.py::test_detail_names_the_mismatched_collective_on_both_ranks",
    "TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node=2 03-ddp/debug_hang.py "
    "--failure hang --timeout 12": "test_ch03_debug_hang.py::test_a_hang_shows_every_stack_and_detail_names_the_missing_rank",
    "torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 "
    "--rdzv-id=demo 03-ddp/train_llm.py --experiment-name two-nodes --max-steps 20":
        "test_ch03_ddp.py::two_nodes",
    "torchrun --standalone --nproc-per-node=2 04-checkpointing/train_llm.py --experiment-name ckpt-demo":
        "ch04_runs.py::train",  # with --experiment-name
    "torchrun --standalone --nproc-per-node=2 --max-restarts=3 04-checkpointing/train_llm.py "
    "--experiment-name crash-demo --max-steps 30 --ckpt-freq 10 --crash-at-step 15 --log-freq 1":
        'test_ch04_checkpointing.py::train(tmp_path, "--crash-at-step", CRASH, restarts=3, warm=False)',
    "torchrun --standalone --nproc-per-node=2 04-checkpointing/train_llm.py --experiment-name "
    "crash-demo --max-steps 30 --ckpt-freq 10 --fresh": 'test_ch04_checkpointing.py::train(tmp_path, "--fresh")',
    "torchrun --standalone --nproc-per-node=2 04-checkpointing/train_llm.py --experiment-name "
    "crash-demo --max-steps 30 --ckpt-freq 10 --resume-from outputs/crash-demo/checkpoints/step-00000020":
        'test_ch04_safety.py::"--resume-from", link',
    "torchrun --standalone --nproc-per-node=2 04-checkpointing/train_llm.py --experiment-name "
    "save-speed --model-preset base --seq-length 64 --batch-size 1 --max-steps 3 --ckpt-freq 1 "
    "--keep-last 1": 'ch04_runs.py::"--keep-last", KEEP',
    "torchrun --standalone --nproc-per-node=2 05-collectives/collectives_demo.py":
        "test_ch05_collectives.py::test_every_collective_is_correct",
    "torchrun --standalone --nproc-per-node=3 05-collectives/collectives_demo.py":
        "test_ch05_collectives.py::test_every_collective_is_correct",
    "torchrun --standalone --nproc-per-node=3 05-collectives/collectives_demo.py --op all_to_all":
        "test_ch05_collectives.py::test_one_op_only",
    "torchrun --standalone --nproc-per-node=3 05-collectives/collectives_demo.py --emulate":
        "test_ch05_collectives.py::test_every_collective_is_correct",
    "torchrun --standalone --nproc-per-node=2 05-collectives/ddp_from_scratch.py":
        "test_ch05_collectives.py::test_ddp_from_scratch_equals_ddp_bit_for_bit_on_2_ranks",
    "torchrun --standalone --nproc-per-node=2 05-collectives/ddp_from_scratch.py --modes "
    "naive,bucketed,overlap,ddp --steps 12":
        "test_ch05_collectives.py::test_ddp_from_scratch_equals_ddp_bit_for_bit_on_2_ranks",
    "torchrun --standalone --nproc-per-node=2 05-collectives/ddp_from_scratch.py --modes "
    "bucketed,overlap,ddp --steps 12 --bucket-mb 4":
        "test_ch05_collectives.py::test_ddp_from_scratch_equals_ddp_bit_for_bit_on_2_ranks",
    "torchrun --standalone --nproc-per-node=3 05-collectives/ddp_from_scratch.py --model-preset tiny "
    "--seq-length 32 --batch-size 2 --steps 1 --timing-warmup 0 --proof-steps 16 --lr 0.1 --modes "
    "naive,bucketed,overlap,ddp": "test_ch05_collectives.py::README_3_RANKS = ",
    "torchrun --standalone --nproc-per-node=2 05-collectives/sharded_from_scratch.py --steps 12":
        "test_ch05_sharded.py::test_every_mode_equals_ddp_bit_for_bit_on_2_ranks",
    "torchrun --standalone --nproc-per-node=4 05-collectives/sharded_from_scratch.py --steps 12":
        "test_ch05_sharded.py::test_every_mode_equals_ddp_within_the_rounding_bound",
    "torchrun --standalone --nproc-per-node=3 05-collectives/sharded_from_scratch.py --model-preset tiny "
    "--seq-length 32 --batch-size 2 --steps 3 --timing-warmup 1 --proof-steps 8 --lr 0.1":
        "test_ch05_sharded.py::README_3_RANKS = ",
    "torchrun --standalone --nproc-per-node=2 05-collectives/overlap_timeline.py": "test_ch05_timeline.py::traced",
    "torchrun --standalone --nproc-per-node=2 05-collectives/sharded_checkpoint.py --experiment-name dcp-demo":
        "test_ch05_dcp.py::saved",
    "torchrun --standalone --nproc-per-node=3 05-collectives/sharded_checkpoint.py --load outputs/dcp-demo":
        "test_ch05_dcp.py::test_loaded_on_three_ranks_every_tensor_equals_the_saved_state",
    "python 01-single-gpu/train_llm.py --dataset-name common/ --vocab-size 2048 --seq-length 128 --max-steps 50":
        "test_ch01_single.py::test_max_steps_ends_the_run_whatever_num_epochs_says",
    "python 01-single-gpu/train_llm.py --dataset-name \"*/README.md\" --vocab-size 1024 --seq-length 64 "
    "--max-steps 50": "test_ch01_single.py::test_max_steps_ends_the_run_whatever_num_epochs_says",
}


def split_command(command: str, save_dir: Path) -> dict:
    """A README line taken apart: environment, launcher, its options, script, script args
    (outputs/ redirected to `save_dir`)."""
    words = shlex.split(command, comments=True)
    env = {}
    if words[0] == "sudo":
        words.pop(0)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    words = [w.replace("outputs/", f"{save_dir}/") for w in words]
    launcher = words[0]
    assert launcher in ("python", "torchrun"), \
        f"README command starts with {launcher!r}: the test knows python and torchrun"
    i = next(i for i, w in enumerate(words) if w.endswith(".py"))
    return {"env": env, "launcher": launcher, "options": words[1:i], "script": words[i],
            "args": words[i + 1:]}


def option_value(options: list[str], name: str, default: str) -> str:
    for i, w in enumerate(options):
        if w.startswith(f"{name}="):
            return w.split("=", 1)[1]
        if w == name:
            return options[i + 1]
    return default


_scripts = {}


def script_module(script: str):
    if script not in _scripts:
        _scripts[script] = load_script(script)
    return _scripts[script]


def check_command_parses(command: str, runnable: bool, save_dir: Path, monkeypatch):
    """The command as the script's own parser sees it, in this process: the script exists,
    and (runnable commands) parse_args accepts the line as written, under the launcher's
    environment; commands marked as needing GPUs or machines, or naming the outputs of an
    earlier command, are checked flag by flag (their values need that hardware or run)."""
    parts = split_command(command, save_dir)
    script = parts["script"]
    assert (REPO / script).is_file(), f"{command}: no script {script}"
    parser_args = parts["args"]
    module = script_module(script)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if parts["launcher"] == "torchrun":
        world = int(option_value(parts["options"], "--nnodes", "1")) * \
            int(option_value(parts["options"], "--nproc-per-node", "1"))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "readme")
    if runnable and f"{save_dir}/" not in " ".join(parser_args):
        extra = ["--save-dir", str(save_dir)] if "--save-dir" in _option_strings(module) else []
        monkeypatch.setattr(sys, "argv", [script, *parser_args])
        try:
            module.parse_args([*parser_args, *extra])
        except SystemExit as e:
            pytest.fail(f"{command}: its parser refused it (exit {e.code})")
    else:
        known = _option_strings(module)
        flags = [w.split("=")[0] for w in parser_args if w.startswith("--")]
        assert set(flags) <= known, f"{command}: unknown flags {set(flags) - known}"


def _option_strings(module) -> set[str]:
    import argparse
    seen = {}

    def grab(self, args=None, namespace=None):
        seen["parser"] = self
        raise SystemExit(0)
    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab
    try:
        module.parse_args([])
    except SystemExit:
        pass
    finally:
        argparse.ArgumentParser.parse_args = original
    return {s for a in seen["parser"]._actions for s in a.option_strings}


def smoke_argv(command: str, save_dir: Path) -> tuple[list[str], dict]:
    """The command as argv, with tiny settings appended and outputs/ redirected."""
    parts = split_command(command, save_dir)
    if parts["launcher"] == "python":
        argv = [sys.executable, *parts["options"]]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", *parts["options"]]
    argv += [parts["script"], *parts["args"]]
    name = Path(parts["script"]).name
    if name == "train_llm.py":
        argv += TRAIN_OVERRIDES + ["--save-dir", str(save_dir)]
    else:
        argv += SCRIPT_OVERRIDES[name]
        if name != "collectives_demo.py":
            argv += ["--save-dir", str(save_dir)]
    return argv, parts["env"]


@pytest.mark.parametrize("chapter", [*CHAPTERS, "."])
def test_readme_commands_parse_and_run(chapter, tmp_path, monkeypatch):
    """Every command parses (in this process, through the script's own parser); the
    runnable ones nothing else launches also run, with tiny settings."""
    commands = readme_commands(chapter)
    assert commands, f"{chapter}/README.md has no commands"
    assert any(runnable for _, runnable in commands), \
        f"{chapter}/README.md: every command is marked as needing special hardware"
    monkeypatch.chdir(REPO)  # relative paths in the commands are from the repo root
    for command, runnable in commands:
        if not TOOL.match(command):
            check_command_parses(command, runnable, tmp_path, monkeypatch)
    monkeypatch.undo()
    ran = set()
    for command, runnable in commands:
        if not runnable:
            continue
        remark, command = command, re.sub(r"\s+#.*$", "", command)  # a remark after it
        if command in ran:
            continue  # shown twice in the README: run once
        ran.add(command)
        tool = TOOL.match(command)
        if tool:  # a command of `tools`: its main(), in this process, as written
            importlib.import_module(tool[1]).main(shlex.split(tool[2]))
            continue
        if command in LAUNCHED_BY:
            file, _, where = LAUNCHED_BY[command].partition("::")
            code = (REPO / "tests" / file).read_text()
            assert (f"def {where}(" if where.isidentifier() else where) in code, \
                f"{command}: {LAUNCHED_BY[command]} is gone; run the command here instead"
            continue
        assert "two terminals" not in remark, f"{command}: a two-node command is launched by a test"
        argv, env = smoke_argv(command, tmp_path)
        run(argv, env=env, timeout=600)


def test_launched_by_names_only_readme_commands():
    commands = {re.sub(r"\s+#.*$", "", c) for ch in [*CHAPTERS, "."] for c, _ in readme_commands(ch)}
    assert set(LAUNCHED_BY) <= commands, set(LAUNCHED_BY) - commands


# A promised exit status; under torchrun it is the workers', not the shell's.
PROMISED_STATUS = re.compile(r"\bexit(s|ing)?( with)?( status)? (2|130|143)\b|\((130|143) for")
# Paragraphs about tools a reader runs with python, where the status is the shell's.
PYTHON_LAUNCHED = ("tests/test_plan.py",)  # python -m tools.plan


def test_statuses_promised_for_torchrun_runs_say_what_the_shell_sees():
    """Where a README promises exit status 2, 130 or 143 for a script torchrun launches,
    the same paragraph says that the shell sees torchrun's own status (1, after its
    ChildFailedError report): tests/test_cli.py shows torchrun returning 1 for a worker's 2."""
    missing = []
    for readme in [REPO / "README.md"] + [REPO / c / "README.md" for c in ("03-ddp", "04-checkpointing",
                                                                          "05-collectives")]:
        prose = re.sub(r"```.*?```", "", readme.read_text(), flags=re.S)
        for paragraph in re.split(r"\n\s*\n", prose):
            if PROMISED_STATUS.search(paragraph) and "torchrun's own status" not in paragraph \
                    and not any(tool in paragraph for tool in PYTHON_LAUNCHED):
                missing.append(f"{readme.relative_to(REPO)}: {paragraph.strip()[:120]}")
    assert not missing, "\n".join(missing)
