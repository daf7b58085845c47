"""`python -m tools.plan`: its model is common.model's, parameter for parameter; its
activation estimate is what autograd saves (counted with saved-tensor hooks, in fp32,
bf16 autocast and bf16, with and without activation checkpointing); its checkpoint size
is the training state's bytes; its traffic follows the ring's textbook volumes; bad
input exits 2 with one line; the chapter 05 README's table is its output. What it says
each chapter 05 mode holds and sends per rank is held against measured runs in
tests/test_ch05_sharded.py (`assert_the_plan_matches`)."""

from __future__ import annotations

import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from conftest import REPO, chapter_module, run_warm
from common import sizing
from tools import plan
from common.model import LlamaForCausalLM, get_config, num_parameters
from common.training import build_optimizer
sharding = chapter_module("05-collectives", "sharding")

FP32, BF16 = sizing.PRECISIONS["fp32"], sizing.PRECISIONS["bf16"]


@pytest.mark.parametrize("preset, vocab", [("tiny", 300), ("small", 8192)])
def test_the_plans_model_is_common_model(preset, vocab):
    config = get_config(preset, vocab)
    model = LlamaForCausalLM(config)
    m = sizing.llama(config)
    units = [model.embed_tokens, *model.layers, model.norm, model.lm_head]
    assert m.units == [[tuple(p.shape) for p in u.parameters()] for u in units]
    assert m.num_params == num_parameters(model) and m.num_tensors == len(list(model.parameters()))


def test_state_and_traffic_formulas():
    config = get_config("small", 8192)
    m, n = sizing.llama(config), sizing.llama(config).num_params
    ddp = sizing.state_bytes(m, "ddp", 4, FP32)
    assert (ddp["params"], ddp["grads"]) == (4 * n, 4 * n)
    assert ddp["optimizer"] == 8 * n + 4 * m.num_tensors  # both moments, one step counter per tensor
    s = -(-n // 4)
    assert sizing.state_bytes(m, "zero1", 4, FP32)["grads"] == 4 * (4 * s + s)  # full buffer + its slice
    assert sizing.state_bytes(m, "zero2", 4, FP32)["grads"] == 4 * s
    for mode in ("zero1", "zero2", "zero3", "fsdp2"):  # 1/N of the optimizer state, up to padding
        assert sizing.state_bytes(m, mode, 4, FP32)["optimizer"] == pytest.approx(8 * n / 4, rel=1e-3), mode
    for mode in ("zero3", "fsdp2"):
        held = sizing.state_bytes(m, mode, 4, FP32)
        assert held["params"] == held["grads"] == pytest.approx(n, rel=1e-3), mode
    # while a unit computes: zero3's largest module (the embedding, the head), fsdp2's root
    # unit (both, and the final norm)
    assert sizing.gathered_unit_bytes(m, "ddp", 4, FP32) == 0
    assert sizing.gathered_unit_bytes(m, "zero3", 4, FP32) == 8 * 8192 * 256
    assert sizing.gathered_unit_bytes(m, "fsdp2", 4, FP32) == 8 * (2 * 8192 * 256 + 256)
    # the ZeRO paper's mixed precision: 2 + 2 + 12 per parameter, the same 16 in all
    assert sum(sizing.state_bytes(m, "ddp", 4, BF16).values()) == sum(ddp.values())
    assert sizing.state_bytes(m, "zero1", 4, BF16)["optimizer"] == pytest.approx(12 * n / 4, rel=1e-3)
    # traffic: the ring's 2(N-1)/N and 3(N-1)/N, less for fsdp2 (its root is gathered once)
    for world in (2, 3, 8, 64):
        sent = {mode: sum(sizing.sent_bytes(m, mode, world, FP32).values()) for mode in sizing.MODES}
        for mode in ("ddp", "zero1", "zero2", "zero3"):
            assert sent[mode] == pytest.approx(sharding.textbook_sent_bytes(mode, 4 * n, world), rel=1e-3)
        assert sent["ddp"] < sent["fsdp2"] < sent["zero3"]
        assert sum(sizing.sent_bytes(m, "zero3", world, BF16).values()) == pytest.approx(sent["zero3"] / 2)
    assert sizing.sent_bytes(m, "ddp", 1, FP32) == {"all_reduce": 0.0}
    # a parameter count alone: no padding; fsdp2 as zero3
    alone = sizing.count_only(7_000_000_000)
    assert sum(sizing.state_bytes(alone, "ddp", 8, FP32).values()) == 16 * 7_000_000_000 + 4
    assert sizing.state_bytes(alone, "fsdp2", 8, FP32)["params"] == 4 * 7_000_000_000 / 8
    assert sizing.sent_bytes(alone, "fsdp2", 8, FP32) == sizing.sent_bytes(alone, "zero3", 8, FP32)
    # the checkpoint: rank 0 alone (ddp), or every node at once (sharded)
    ckpt = sizing.checkpoint_bytes(m)
    assert sizing.checkpoint_seconds(m, "ddp", 2, 16, 2.0, 100.0) == (ckpt / 2e9, ckpt / 2e9 + ckpt / 100e9)
    assert sizing.checkpoint_seconds(m, "fsdp2", 2, 16, 2.0, 100.0) == (ckpt / 4e9, ckpt / 4e9)


def test_checkpoint_bytes_are_the_training_state():
    """What chapter 04 saves of the model and AdamW (tensor bytes, not the file's
    pickling) is what the plan counts."""
    torch.manual_seed(0)
    config = get_config("tiny", 300)
    model = LlamaForCausalLM(config)
    optimizer = build_optimizer(model, 1e-3, 0.1, torch.device("cpu"))
    x = torch.randint(0, 300, (2, 16))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    optimizer.step()
    tensors = [*model.state_dict().values(),
               *(t for s in optimizer.state_dict()["state"].values() for t in s.values())]
    assert sum(t.numel() * t.element_size() for t in tensors) == sizing.checkpoint_bytes(sizing.llama(config))


# ------------------------------------------------------------------ the activations

def saved_bytes(model, x, y, precision: str, checkpointing: bool) -> int:
    """Bytes autograd saves for backward in one forward and loss of `model`, each storage
    once, leaving out the parameters and buffers themselves. With checkpointing each
    decoder layer runs under torch.utils.checkpoint (non-reentrant): what it saves for
    the recomputation goes through these hooks, what it recomputes later does not."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        h = model.embed_tokens(x)
        cos, sin = model.rotary(x.shape[1])
        for layer in model.layers:
            h = checkpoint(layer, h, cos, sin, use_reentrant=False) if checkpointing else layer(h, cos, sin)
        logits = model.lm_head(model.norm(h))
        F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # the loss in fp32
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "autocast", "bf16"])
def test_the_activation_estimate_is_what_autograd_saves(precision):
    torch.manual_seed(0)
    config = get_config("tiny", 300)
    model = LlamaForCausalLM(config).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    batch, seq = 2, 32
    x, y = torch.randint(0, 300, (2, batch, seq))
    p = sizing.PRECISIONS[precision]
    # The estimate is a GPU's. On a CPU, F.rms_norm on an fp32 stream also keeps its fp32
    # normalised x (on CUDA one fused kernel keeps only its input and 1/rms).
    cpu_norm = sizing.FP32 * config.hidden_size * batch * seq if p.stream == sizing.FP32 else 0
    full = saved_bytes(model, x, y, precision, checkpointing=False)
    norms = 2 * config.num_hidden_layers + 1
    assert full - norms * cpu_norm == sizing.activation_bytes(config, batch, seq, p, checkpointing=False)
    kept = saved_bytes(model, x, y, precision, checkpointing=True)  # each layer's input only
    recomputed = sizing.layer_activation_bytes(config, batch * seq, seq, p)  # one layer, in backward
    assert kept - cpu_norm == sizing.activation_bytes(config, batch, seq, p, checkpointing=True) - recomputed
    assert kept < full / 3


# ------------------------------------------------------------------ the command line

def run_plan(argv, capsys) -> str:
    plan.main(argv)
    return capsys.readouterr().out


def test_with_tp_and_pp_the_command_prints_chapter_06s_layout(capsys):
    """8 ranks as dp 2 x pp 2 x tp 2: a row per stage, what its tp rank 0 holds (1F1B:
    stage 0 holds 2 micro-batches, the last 1; GPipe: all 4; and what it keeps at most
    between operations: those micro-batches, the gradient just received, the running
    loss) and sends. 06-model-parallel/measure.py holds these figures against what each
    rank really holds and keeps."""
    argv = ["--model-preset", "tiny", "--vocab-size", "301", "--global-batch-size", "8", "--seq-length", "64",
            "--precision", "fp32", "--tp", "2", "--pp", "2"]
    out = run_plan(argv, capsys)
    assert "8 ranks (1 x 8 GPUs): dp 2 x pp 2 x tp 2; 4 x 64 tokens per replica per step in 4 micro-batches, " \
           "1f1b schedule" in out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if re.match(r"\| [01] ", line)]
    assert [r[:2] for r in rows[:2]] == [["0", "embedding, layer 0"], ["1", "layer 1, head"]]
    c, fp32 = get_config("tiny", 301), sizing.FP32
    for stage, row in enumerate(rows[:2]):
        state = sizing.stage_state_bytes(c, 2, 2, stage, sizing.PRECISIONS["fp32"])
        micro = sizing.stage_activation_bytes(c, 64, 64, sizing.PRECISIONS["fp32"], 2, 2, stage)
        kept = (2 - stage) * micro + 64 * 64 * fp32 * (stage == 0) + fp32  # + the gradient received, the loss
        assert kept == sizing.stage_kept_bytes(c, 64, 64, sizing.PRECISIONS["fp32"], 2, 2, stage, "1f1b", 4)
        assert row[2:] == [plan.size(state["params"]), plan.size(state["grads"]), plan.size(state["optimizer"]),
                           plan.size(micro), str(2 - stage), plan.size(kept), plan.size(sum(state.values()) + kept)]
    # sent: tp's all-reduces (2 ranks: a ring sends 1 x the array), the pipeline's
    # activations or gradients to one neighbour, the gradients all-reduced over 2 replicas
    layer, stage_0 = sizing.tp_all_reduce_bytes(c, 4 * 64, sizing.PRECISIONS["fp32"], 2, 2, 0)
    assert layer == 4 * 4 * 64 * 64 * fp32
    grads = sizing.stage_state_bytes(c, 2, 2, 0, sizing.PRECISIONS["fp32"])["grads"]
    assert rows[2][1:6] == [plan.size(layer), plan.size(stage_0), plan.size(4 * 64 * 64 * fp32), plan.size(grads),
                            plan.size(stage_0 + 4 * 64 * 64 * fp32 + grads)]
    out = run_plan([*argv, "--schedule", "gpipe"], capsys)
    assert [line.split("|")[7].strip() for line in out.splitlines() if re.match(r"\| [01] +\| \w", line)] == ["4", "4"]


def test_the_command_prints_the_three_tables(capsys):
    out = run_plan(["--model-preset", "tiny", "--vocab-size", "300", "--gpus-per-node", "2",
                    "--nodes", "2", "--global-batch-size", "8", "--seq-length", "64"], capsys)
    assert "4 ranks (2 x 2 GPUs); 2 x 64 tokens per rank" in out  # 8 samples over 4 ranks
    for mode in sizing.MODES:
        assert len(re.findall(rf"^\| {mode} ", out, flags=re.M)) == 3, mode
    assert "time at 100 GB/s busbw" in out and "at 2 GB/s per node" in out
    out = run_plan(["--params", "7B", "--modes", "ddp,fsdp2"], capsys)
    assert out.startswith("model: 7 B parameters; shape unknown") and " n/a |" in out and "zero1" not in out


@pytest.mark.parametrize("argv, message", [
    (["--params", "0"], "argument --params: must be a whole number of parameters >= 1"),
    (["--params=-7e9"], "argument --params: must be a parameter count"),
    (["--nodes", "0"], "argument --nodes: must be a whole number >= 1"),
    (["--busbw-gbps", "-1"], "argument --busbw-gbps: must be a finite number > 0"),
    (["--modes", "ddp,zero4"], "unknown zero4"),
    (["--precision", "fp8"], "unknown 'fp8'"),
    (["--model-preset", "huge"], "unknown 'huge'"),
    (["--gpus-per-node", "8", "--nodes", "3", "--global-batch-size", "36"], "not divisible by the 24 ranks"),
    (["--batch-size", "2", "--global-batch-size", "16"], "not both"),
    (["--gpus-per-node", "100000000", "--nodes", "100000000"], "the plan handles at most 1,000,000"),
    (["--model-preset", "small", "--layers", "10001"], "--layers 10,001: the plan handles at most 10,000"),
    (["--params", "7e9", "--model-preset", "large"], "--params stands for the whole model"),
    (["--layers", "32", "--hidden-size", "4096"], "needs --heads, --intermediate-size"),
    (["--model-preset", "tiny", "--heads", "5"], "not a valid model shape"),
    (["--model-preset", "tiny", "--tp", "4"], "--tp 4 does not divide the model's 2 KV heads"),
    (["--tp", "3", "--gpus-per-node", "3"], "--tp 3 does not divide the model's 8 attention heads"),
    (["--model-preset", "tiny", "--pp", "4"], "--pp 4 exceeds the model's 2 layers"),
    (["--tp", "2", "--pp", "3"], "the world size 8 is not a multiple of --tp 2 x --pp 3"),
    (["--pp", "2", "--batch-size", "4", "--microbatches", "3"], "--microbatches 3 does not divide the batch of 4"),
    (["--model-preset", "tiny", "--vocab-size", "1", "--tp", "2"], "a vocabulary of 1 leaves tp rank 1 of 2 no rows"),
    (["--tp", "2", "--global-batch-size", "6"], "not divisible by the 4 replicas"),
    (["--params", "7B", "--tp", "2"], "give a preset or a shape, not --params"),
    (["--pp", "2", "--modes", "ddp"], "with --tp or --pp the plan is chapter 06's layout"),
    (["--pp", "2", "--schedule", "zb"], "unknown 'zb'"),
])
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        plan.main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert stop.value.code == 2 and out == "", err
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


def test_absurd_sizes_answer_at_once():
    """A hundred million layers (every layer's tensors are listed) are refused with one
    line; a million ranks of a 10,000-layer model are planned without a loop per rank.
    Both used to run for hours (in a process of their own here, so that a regression
    fails on the timeout instead of hanging the suite)."""
    proc = run_warm([sys.executable, "-m", "tools.plan", "--model-preset", "small", "--layers", "100000000"],
               timeout=120, check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == ["error: --layers 100,000,000: the plan handles at most 10,000"]
    proc = run_warm([sys.executable, "-m", "tools.plan", "--model-preset", "small", "--layers", "10000",
                "--gpus-per-node", "1000", "--nodes", "1000"], timeout=120)
    assert "1000000 ranks (1000 x 1000 GPUs)" in proc.stdout
    assert all(len(re.findall(rf"^\| {mode} ", proc.stdout, flags=re.M)) == 3 for mode in sizing.MODES)


def test_without_a_shape_no_unit_is_gathered(capsys):
    """--params alone: no layers, so no unit to gather; the column says n/a, as the
    activations do, not the whole model as one unit."""
    out = run_plan(["--params", "7B", "--gpus-per-node", "8"], capsys)
    for mode in ("zero3", "fsdp2"):
        row = next(l for l in out.splitlines() if l.startswith(f"| {mode} "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[5] == "n/a" and cells[6] == "n/a", row  # one unit gathered; activations


def test_the_chapter_05_pages_show_the_commands_output(capsys, monkeypatch):
    """Each `python -m tools.plan` command in chapter 05's pages is followed by its
    output, as the current code prints it."""
    text = "\n".join(page.read_text() for page in sorted((REPO / "05-collectives").glob("*.md")))
    shown = re.findall(r"^```bash\n(python -m tools\.plan [^\n]*)\n```\n\n```text\n(.*?)^```", text,
                       flags=re.S | re.M)
    assert shown, "chapter 05's pages show no plan"
    for command, output in shown:
        monkeypatch.setattr(sys, "argv", ["python -m tools.plan"])
        assert run_plan(command.split()[3:], capsys) == output, command
