"""Chapter 01's memory anatomy: torch's MemTracker, read after every operation of one
training step, finds the textbook's 16 bytes per parameter and the counted activations;
activation checkpointing keeps less for backward and lowers the step's peak; the script
draws its plot and table from one command and refuses bad input before any work."""

from __future__ import annotations

import functools
from contextlib import nullcontext

import pytest
import torch

from common.model import LlamaForCausalLM, get_config, num_parameters
from common.training import build_optimizer
from conftest import load_script, python_cmd, read_json, refused, run_warm, run_folder_held, torchrun_cmd
from pages import readme_command

SCRIPT = "01-single-gpu/memory_anatomy.py"


@functools.cache
def anatomy_script():
    """The script as a module, loaded at first use: it imports torch's MemTracker (about
    2 s of CPU), which a pytest-xdist worker that only collects this file need not pay."""
    return load_script(SCRIPT)


# A small vocabulary, so that the layers' activations, not the logits, dominate.
BATCH, SEQ, VOCAB = 4, 64, 512
SMALL = ["--model-preset", "tiny", "--seq-length", SEQ, "--batch-size", BATCH, "--vocab-size", VOCAB,
         "--steps", 1]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_measured_memory_is_the_textbook_and_checkpointing_keeps_less(dtype):
    """In this process, on the CPU: the state held is 16 bytes per parameter (4 + 4 + 8;
    AdamW adds a step counter per tensor, 1% here; RoPE's tables go with the weights), and the activations kept for backward
    are the tensor-by-tensor count of `activation_bytes` to 3%, with bf16
    autocast too; checkpointed, they are under half (the head's log-softmax, which is not
    checkpointed, is much of what is left at this size), and the step's peak lower."""
    bf16 = dtype == "bf16"
    torch.manual_seed(0)
    config = get_config("tiny", VOCAB)
    model = LlamaForCausalLM(config)
    n = num_parameters(model)
    rope_tables = sum(b.numel() * b.element_size() for b in model.buffers())  # filed with the weights
    optimizer = build_optimizer(model, 1e-4, 0.1, "cpu")
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    x, y = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    anatomy_script().train_step(model, optimizer, x, y, autocast)  # AdamW makes its state
    book = anatomy_script().textbook(config, n, BATCH, SEQ, "cpu", bf16)
    got = {}
    for setting, on in (("off", False), ("on", True)):
        model.activation_checkpointing = on
        timeline = anatomy_script().tracked_step(model, optimizer, x, y, autocast, torch.device("cpu"))
        got[setting] = r = anatomy_script().summarize(timeline, [1.0], None)
        assert r["state"]["parameters"] == 4 * n + rope_tables
        assert r["state"]["gradients"] == 4 * n
        assert r["state"]["AdamW state"] == pytest.approx(8 * n, rel=0.01)
        assert r["activations_kept_for_backward"] == pytest.approx(book[f"activations_{setting}"], rel=0.03)
        assert set(timeline.phases) == {"forward", "backward", "update"}
        assert r["peak_bytes"] == r["tracker_peak_bytes"]  # read after every op, the peak is caught
    assert got["on"]["activations_kept_for_backward"] < got["off"]["activations_kept_for_backward"] / 2
    assert got["on"]["peak_bytes"] < got["off"]["peak_bytes"]
    # the price: every layer's forward ops once more
    assert len(got["on"]["timeline"]["phases"]) > len(got["off"]["timeline"]["phases"])


@pytest.fixture(scope="module")
def anatomy(tmp_path_factory):
    """The README's command, with tiny settings: one tracked step per setting."""
    save_dir = tmp_path_factory.mktemp("anatomy")
    proc = run_warm([*readme_command("01-single-gpu/README.md", "memory_anatomy.py"), *SMALL, "--save-dir", save_dir,
                "--experiment-name", "a"])
    return proc, save_dir / "a"


def test_the_script_writes_its_plot_json_and_table(anatomy):
    proc, run_dir = anatomy
    assert (run_dir / "memory_anatomy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = read_json(run_dir / "memory_anatomy.json")
    assert result["dtype"] == "fp32" and result["textbook"]["state"] == 16 * result["num_params"]
    for setting in ("off", "on"):
        r = result["results"][setting]
        timeline = r["timeline"]
        assert set(timeline) == {"phases", *anatomy_script().CATEGORIES}
        totals = [sum(timeline[c][i] for c in anatomy_script().CATEGORIES) for i in range(len(timeline["phases"]))]
        assert max(totals) == r["peak_bytes"] and r["step_s_median"] > 0
    assert result["results"]["on"]["peak_bytes"] < result["results"]["off"]["peak_bytes"]
    for row in ("| state: 16 bytes per parameter", "| activations kept for backward",
                "| peak of the step (MemTracker)", "| step time, ms"):
        assert row in proc.stdout
    assert "activation checkpointing: peak" in proc.stdout and f"outputs in {run_dir}" in proc.stdout


def test_bad_input_exits_2_with_one_line_and_creates_nothing(tmp_path, capsys):
    for flags, words in ((["--seq-length", "100000"], "--seq-length 100000 exceeds"),
                         (["--steps", "0"], "--steps: must be a whole number >= 1"),
                         (["--dtype", "fp16"], "--dtype: unknown 'fp16'")):
        line = refused(capsys, anatomy_script().parse_args, [*SMALL, *flags, "--save-dir", tmp_path / "x"])
        assert words in line
    assert not (tmp_path / "x").exists()


def test_a_second_job_with_the_same_name_is_refused_not_overwriting(tmp_path):
    """The run folder is held while the script measures, as every chapter's is: a second
    job with the same --experiment-name stops with one line instead of overwriting the
    first one's memory_anatomy.json and plot with its own."""
    with run_folder_held(tmp_path / "same") as holder:
        proc = run_warm(python_cmd(SCRIPT, *SMALL, "--save-dir", tmp_path, "--experiment-name", "same"),
                   check=False)
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"error: run folder '{tmp_path / 'same'}' is in use by pid {holder.pid} on "), lines
        assert not (tmp_path / "same" / "memory_anatomy.json").exists()


def test_under_torchrun_it_says_to_launch_it_with_python(tmp_path):
    """One process measures one step: under torchrun the first check says so, naming this
    script (the line named train_llm.py), before the run folder that every rank would
    claim (which used to be the error: the folder 'is in use' by the other rank)."""
    proc = run_warm(torchrun_cmd(2, SCRIPT, *SMALL, "--save-dir", tmp_path / "x"), check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]  # torchrun's own status (1) after rank 0's 2
    assert ("error: 01-single-gpu trains in one process; launch it with `python 01-single-gpu/memory_anatomy.py` "
            "(several processes are chapter 03)") in proc.stderr.splitlines(), proc.stderr[-3000:]
    assert not (tmp_path / "x").exists()


def test_out_of_memory_names_this_script_s_flags(tmp_path):
    """A batch that cannot be allocated: one line, exit status 1, naming flags this script
    has (not chapter 01's --grad-accum), and no run folder left."""
    proc = run_warm(python_cmd(SCRIPT, *SMALL[:4], "--batch-size", 10**13, "--save-dir", tmp_path), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: out of memory ("), lines
    assert lines[0].endswith("): try a smaller --batch-size, --seq-length or --model-preset"), lines
    assert not any(tmp_path.iterdir())
