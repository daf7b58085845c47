"""Chapter 08: context parallelism. The sequence splits (balanced: each rank one chunk
from the head and one from the tail) and their attention blocks; ring attention and the
all-to-all variant equal one process's attention in fp64, output and gradients, and
whole training steps equal chapter 01's (cp 2 and 3, beside tp, dp and pp); a merge
without the log-sum-exp rescale, a causal mask off by a block, all-to-all's tokens out
of order, RoPE at the shard's own positions, the cp ranks left out of FSDP's gradient
sum and a merge that makes NaNs each fail that proof;
the training script logs chapter 01's losses with --cp 2 (either attention) and with
--cp 2 --tp 2; the work, activations and bytes per rank are counted against the
planner, and the page's measure command prints the page's tables; a bad layout is one
line and exit 2; a lost rank ends the other within --timeout; on GPUs, torch's
context_parallel equals the ring."""

from __future__ import annotations

import difflib
import shutil

import pytest
import torch

from common import sizing
from common.model import get_config
from common.sizing import PRECISIONS, cp_activation_bytes, cp_traffic_bytes
from conftest import NO_GPU, REPO, TINY, a_machine_dies, chapter_module, load_script, read_json, read_jsonl, \
    refused, refused_on_ranks, run, run_warm, torchrun_cmd
from pages import readme_command
from tools import plan

FOLDER = "08-context-parallel"
SCRIPT = f"{FOLDER}/train_llm.py"
PAGE = "08-context-parallel/README.md"
chapter = load_script(SCRIPT)  # puts its folder on sys.path: the modules beside it import
cp_lib = chapter_module(FOLDER, "context_parallel")


# ------------------------------------------------------------------- the split, in-process

@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_balanced_split_gives_each_rank_a_head_and_a_tail_chunk_covering_the_sequence_once(cp):
    split, contiguous = cp_lib.SequenceSplit(8 * cp, cp), cp_lib.SequenceSplit(8 * cp, cp, balanced=False)
    for s in (split, contiguous):
        every = torch.cat([s.positions(r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(8 * cp))
        assert all(bool((s.positions(r).diff() > 0).all()) for r in range(cp))  # each shard in sequence order
    assert split.positions(0).tolist() == [0, 1, 2, 3, *range(8 * cp - 4, 8 * cp)]
    assert contiguous.positions(cp - 1).tolist() == list(range(8 * cp - 8, 8 * cp))


@pytest.mark.parametrize("balanced", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_each_block_is_exactly_the_causal_pairs_of_its_two_shards(cp, balanced):
    """What `block` says a rank's queries attend of another rank's keys is, pair by pair,
    the causal rule on their positions in the whole sequence: key position <= query
    position. Balanced, every rank attends the same number of pairs; contiguous, rank r
    attends 2c(2c+1)/2 + 4c^2 r (2c tokens a rank), the last 2 cp - 1 times the first
    in the limit of long chunks."""
    split = cp_lib.SequenceSplit(12 * cp, cp, balanced)
    pairs = []
    for rank in range(cp):
        q_pos, mine = split.positions(rank), 0
        for source in range(cp):
            k_pos = split.positions(source)
            causal = k_pos[None, :] <= q_pos[:, None]
            got = torch.zeros_like(causal)
            block = split.block(rank, source)
            if block is not None:
                rows, cols, is_causal = block
                part = torch.ones_like(got[rows, cols])
                got[rows, cols] = part.tril() if is_causal else part
            assert torch.equal(got, causal), (rank, source)
            mine += int(causal.sum())
        pairs.append(mine)
    if balanced:
        assert len(set(pairs)) == 1
    else:
        c = split.chunk
        assert pairs == [2 * c * c + c + 4 * c * c * r for r in range(cp)]


def test_a_sequence_that_does_not_cut_into_2_cp_chunks_is_refused():
    with pytest.raises(ValueError, match="does not cut into 2 x cp = 6 equal chunks"):
        cp_lib.SequenceSplit(32, 3)


def test_merging_two_blocks_through_their_log_sum_exp_is_one_softmax_over_both():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 1, n, 8, generator=gen, dtype=torch.float64) for n in (5, 7, 7))
    whole, whole_lse = cp_lib.attend(q, k, v, causal=False, scale=0.3)
    out = torch.zeros_like(whole)
    lse = torch.full(whole_lse.shape, float("-inf"), dtype=torch.float64)
    for cols in (slice(0, 3), slice(3, 7)):
        out, lse = cp_lib.merge(out, lse, *cp_lib.attend(q, k[..., cols, :], v[..., cols, :], False, 0.3))
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-14)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=1e-14)


def test_chapter_07s_modules_come_unchanged_but_for_a_cp_layout():
    """The README says chapter 07's modules come along unchanged, parallelize.py but for
    its Layout's cp dimension (and the line that says so): each copy is 07's file."""
    for name in ("checkpoint", "pipeline_parallel", "sequence_parallel", "preemption"):
        assert (REPO / FOLDER / f"{name}.py").read_text() == (REPO / "07-3d-parallelism" / f"{name}.py").read_text(), name
    ours = (REPO / FOLDER / "parallelize.py").read_text().splitlines()
    theirs = (REPO / "07-3d-parallelism" / "parallelize.py").read_text().splitlines()
    diff = [line for line in difflib.unified_diff(theirs, ours, lineterm="", n=0) if not line.startswith(("+++", "---"))]
    removed = [line[1:] for line in diff if line.startswith("-")]
    assert [line.split("(")[0] for line in removed] == [
        '"""The composition: one model cut four ways on one DeviceMesh ', "    DTensor layers ",
        '        shape = " x ".join'], removed  # the docstrings' first and last lines, the shape's dimensions
    assert sum(line.startswith("+") for line in diff) <= 20 and any("cp: int = 1" in line for line in diff), diff


# ------------------------------------------------------------ bad input: exit 2

@pytest.mark.parametrize("world, argv, message", [
    (2, ["--cp", "3"], "the world size 2 is not a multiple of --tp 1 x --pp 1 x --cp 3"),
    (3, ["--cp", "3"], "--seq-length 64 does not cut into 2 x --cp 3 = 6 equal chunks"),
    (8, ["--model-preset", "medium", "--cp", "2", "--tp", "4", "--seq-length", "36"],
     "--seq-length 36 / --cp 2 is not a multiple of --tp 4"),
    (4, ["--cp", "4", "--cp-attention", "all-to-all"], "--cp 4 does not divide the 'tiny' preset's 2 KV heads per tp"),
    (4, ["--cp", "2", "--tp", "2", "--cp-attention", "all-to-all"],
     "--cp 2 does not divide the 'tiny' preset's 1 KV heads per tp rank"),
    (2, ["--cp", "2", "--padded"], "--padded with --cp"),
    (2, ["--cp", "2", "--cp-attention", "ulysses"], "unknown 'ulysses'; choose one of: ring, all-to-all"),
])
def test_a_layout_that_does_not_fit_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, world, argv, message):
    line = refused_on_ranks(capsys, monkeypatch, chapter.parse_args, world, [*TINY, *argv, "--save-dir", tmp_path / "out"])
    assert message in line, line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the proofs, warm ranks

def prove(tmp_path, ranks, *flags, folder=REPO / FOLDER, check=True):
    proc = run_warm(torchrun_cmd(ranks, folder / "prove.py", *flags, "--save-dir", tmp_path,
                                 "--experiment-name", "proof"), timeout=600, check=check)
    return proc, read_json(tmp_path / "proof" / "prove.json")


def assert_proven(proc, result, attentions, layouts):
    """Passed; every attention within its tolerance, the ring's rounding seen (it merges
    in another order), all-to-all's exact (the same kernel on the same numbers); every
    layout's loss, gradients and weights within chapter 01's tolerance, and not equal."""
    assert proc.returncode == 0 and result["passed"] and result["failures"] == [], proc.stderr[-3000:]
    assert "OK: on" in proc.stdout
    assert list(result["attention"]) == attentions
    for name, r in result["attention"].items():
        assert all(v <= 1 for v in r.values()), (name, r)
        assert (max(r.values()) > 0) == name.startswith("ring"), (name, r)
    assert list(result["training"]) == layouts
    for name, r in result["training"].items():
        assert all(v <= 1 for v in r.values()) and r["weights"] > 0, (name, r)


ATTENTIONS = ["ring, balanced", "ring, contiguous", "all-to-all, balanced", "all-to-all, contiguous"]


def test_on_2_ranks_attention_and_training_steps_equal_one_process(tmp_path):
    proc, result = prove(tmp_path, 2)
    assert_proven(proc, result, ATTENTIONS, ["cp2", "cp2-all-to-all"])


def test_on_3_ranks_the_ring_equals_one_process(tmp_path):
    """cp 3 does not divide the tiny preset's 4 heads: the ring alone."""
    proc, result = prove(tmp_path, 3)
    assert_proven(proc, result, ATTENTIONS[:2], ["cp3"])


@pytest.mark.long
def test_on_4_ranks_cp_beside_tp_fsdp_and_a_pipeline(tmp_path):
    """With 4 KV heads (one per query head) all-to-all fits cp 2 x tp 2 too."""
    proc, result = prove(tmp_path, 4, "--kv-heads", 4)
    assert_proven(proc, result, ATTENTIONS, ["cp2xtp2", "cp2xtp2-all-to-all", "dp2xcp2", "pp2xcp2"])


MUTANTS = {
    # the partial outputs added as they are, without exp(lse - joint lse)
    "no log-sum-exp rescale": (
        "context_parallel.py", "attention",
        "    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)",
        "    out = out + block_out"),
    # each rank's block rule applied to the block one hop behind: the diagonal's causal
    # mask lands on the previous rank's keys, and the own keys get an off-diagonal rule
    "causal mask off by a block": (
        "context_parallel.py", "attention", "        if source == rank:\n", "        if source == (rank - 1) % self.cp:\n"),
    # all-to-all's gathered tokens left in rank order: the causal mask reads them as the sequence
    "all-to-all out of order": (
        "context_parallel.py", "attention",
        "    q, k, v = (AllToAll.apply(t, group, 1, 2).index_select(2, in_order) for t in (q, k, v))\n",
        "    q, k, v = (AllToAll.apply(t, group, 1, 2) for t in (q, k, v))\n"),
    # RoPE at the shard's own positions 0, 1, ... instead of the whole sequence's
    "rotary at the shard's positions": (
        "context_parallel.py", "training", "    positions = shard_positions(split, group).to(model.rotary.cos.device)\n",
        "    positions = torch.arange(split.seq_len // split.cp).to(model.rotary.cos.device)\n"),
    # the joint log-sum-exp a plain sum: the first block's -inf makes NaNs, which stop the proof at once
    "log-sum-exps added": (
        "context_parallel.py", "training", "    new_lse = torch.logaddexp(lse, block_lse)\n",
        "    new_lse = lse + block_lse\n"),
    # FSDP over the dp ranks only: the cp ranks' gradients, each of its own tokens, never summed
    "cp ranks left out of FSDP": (
        "context_parallel.py", "training",
        '    return init_device_mesh(device_type, (pp, dp * cp, tp), mesh_dim_names=("pp", "dp", "tp"))\n',
        '    return init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))\n'),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_each_named_bug_fails_the_proof(tmp_path, mutant):
    """The chapter with one bug, in a copy of its folder: the proof that targets it
    (the attention, or a cp 2 training step) fails on 2 ranks at its first step, far
    beyond the tolerance, with its FAILED line."""
    copy = tmp_path / "chapter"
    shutil.copytree(REPO / FOLDER, copy, ignore=shutil.ignore_patterns("__pycache__", "*.md"))
    file, part, old, new = MUTANTS[mutant]
    text = (copy / file).read_text()
    assert text.count(old) == 1, mutant
    (copy / file).write_text(text.replace(old, new))
    flags = ["--parts", part] + (["--layouts", "cp2", "--proof-steps", 1] if part == "training" else [])
    proc, result = prove(tmp_path, 2, *flags, folder=copy, check=False)
    assert proc.returncode == 1 and not result["passed"], proc.stderr[-3000:]
    if part == "attention":
        # (all-to-all's contiguous split gathers the tokens in sequence order already)
        variant = "all-to-all" if "all-to-all" in mutant else "ring"
        wrong = {k: v for k, v in result["attention"].items() if k.startswith(variant)}
        assert max(wrong[f"{variant}, balanced"].values()) > 1e6, wrong
        assert variant == "all-to-all" or max(wrong["ring, contiguous"].values()) > 1e6, wrong
        assert f"FAILED: {variant}, balanced: output differs from one process's" in proc.stderr
    elif mutant == "log-sum-exps added":  # stopped at the first value that is not finite, named in one line
        assert result["failures"] == ["cp2: step 1: the loss is nan"], result["failures"]
    else:
        assert max(result["training"]["cp2"].values()) > 1e3, result["training"]
        assert "FAILED: cp2: step 1: " in proc.stderr, proc.stderr[-2000:]


# --------------------------------------------------------------- the training script

@pytest.mark.parametrize("ranks, flags", [(2, ["--cp", 2]), (2, ["--cp", 2, "--cp-attention", "all-to-all"]),
                                          (4, ["--cp", 2, "--tp", 2])])
def test_the_script_logs_chapter_01s_losses(ch01_smoke, tmp_path, ranks, flags):
    """torchrun --cp 2 on 2 ranks (the ring, then all-to-all), and --cp 2 --tp 2 on 4 (dp
    1: the global batch is chapter 01's), 3 steps against the first 3 of chapter 01's
    reference run with the same flags (its learning rates are warmup's up to then,
    whatever --max-steps says): the losses within 1e-5 relative, chapter 03's tolerance
    for DDP in fp32, the first to fp32's rounding; validation and the sample ran."""
    _, _, ref, _ = ch01_smoke
    proc = run_warm(torchrun_cmd(ranks, SCRIPT, *TINY, *flags, "--max-steps", 3, "--save-dir", tmp_path,
                                 "--experiment-name", "cp"), env=NO_GPU)
    got = read_jsonl(tmp_path / "cp" / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref[:3]], rel=1e-5, abs=0)
    assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=3e-7, abs=0)
    summary = read_json(tmp_path / "cp" / "summary.json")
    assert (summary["world_size"], summary["dp"], summary["cp"]) == (ranks, 1, 2)
    assert "validation loss " in proc.stdout and "sample:" in proc.stdout, proc.stdout[-3000:]


def test_a_checkpoint_saved_with_cp_resumes_with_tp_instead(tmp_path):
    """--cp 2 on 2 ranks, 4 steps, a checkpoint every 2; with the last one gone (as if the
    job had died after step 2's save), the same run folder rerun with --tp 2 instead
    resumes at step 2 and logs steps 3 and 4 as the first run did (fp32: other sums,
    1e-5 relative)."""
    flags = [*TINY, "--max-steps", 4, "--ckpt-freq", 2, "--save-dir", tmp_path, "--experiment-name", "moved"]
    run_warm(torchrun_cmd(2, SCRIPT, *flags, "--cp", 2), env=NO_GPU)
    first = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "moved" / "metrics.jsonl")}
    checkpoints = tmp_path / "moved" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000004")
    (checkpoints / "latest").unlink()  # the newest step-N folder is then the one resumed
    proc = run_warm(torchrun_cmd(2, SCRIPT, *flags, "--tp", 2), env=NO_GPU)
    assert "resumed from " in proc.stdout and "step-00000002 (saved by pp 1 x dp 1 x cp 2 x tp 1, ring attention)" \
        in proc.stdout, proc.stdout[-3000:]
    again = {r["step"]: r["loss"] for r in read_jsonl(tmp_path / "moved" / "metrics.jsonl")[-2:]}
    assert sorted(again) == [3, 4] and [again[s] for s in (3, 4)] == pytest.approx([first[3], first[4]], rel=1e-5)


# ------------------------------------------------------------------ measured

def test_work_activations_and_bytes_per_rank_are_the_planners(tmp_path):
    """measure.py on 4 ranks (tiny, sequences of 32 and 64): the balanced split gives
    every rank the same attended pairs and the same counted FLOPs, the contiguous one
    2 cp - 1 and cp times the first rank's at most; every rank's activations at cp 1,
    2 and 4, and the bytes each variant moves, are the planner's to the byte."""
    run_warm(torchrun_cmd(4, f"{FOLDER}/measure.py", "--model-preset", "tiny", "--seq-lengths", "32,64",
                          "--save-dir", tmp_path, "--experiment-name", "m"), timeout=600)
    result = read_json(tmp_path / "m" / "measure.json")
    work = {w["split"]: w["ranks"] for w in result["work"]}
    assert len({(r["pairs"], r["flops"]) for r in work["balanced"]}) == 1
    pairs, flops = [r["pairs"] for r in work["contiguous"]], [r["flops"] for r in work["contiguous"]]
    assert pairs == sorted(pairs) and 5 < pairs[-1] / pairs[0] < 7 and flops[-1] / flops[0] == 4
    assert sum(r["flops"] for r in work["contiguous"]) == sum(r["flops"] for r in work["balanced"])
    config, fp32 = get_config("tiny", 512), PRECISIONS["fp32"]
    rows = {(a["cp"], a["seq"], a["variant"]) for a in result["activations"]}
    assert rows == {(cp, seq, v) for cp in (1, 2, 4) for seq in (32, 64)
                    for v in (("ring",) + ("all-to-all",) * (cp == 2))}
    for a in result["activations"]:
        planned = cp_activation_bytes(config, 1, a["seq"], fp32, a["cp"], a["variant"], cpu=True)
        assert a["measured_min"] == a["measured_max"] == a["planned"] == planned, a
    for t in result["bytes"]:
        planned = cp_traffic_bytes(config, t["seq"] // t["cp"], fp32, t["cp"], t["variant"])
        assert all({k: v for k, v in r.items() if v} == planned for r in t["ranks"]), t
    assert [(t["cp"], t["variant"]) for t in result["bytes"]] == [(2, "ring"), (2, "all-to-all"), (4, "ring")]
    table = (tmp_path / "m" / "tables.md").read_text()
    assert table.count("| the same |") == len(result["activations"]) + len(result["bytes"])


@pytest.mark.launch
def test_the_pages_measure_command_prints_the_pages_tables(tmp_path):
    """The README's measure.py command, as written (4 fresh ranks): every count is the
    planner's, and its tables are the ones the page shows, to the character (they are
    counts, the same on every machine)."""
    run([*readme_command(PAGE, "08-context-parallel/measure.py"), "--save-dir", tmp_path, "--experiment-name", "m"],
        timeout=600)
    tables = (tmp_path / "m" / "tables.md").read_text()
    assert tables.count("| the same |") == 11, tables
    assert tables.strip() in (REPO / PAGE).read_text(), "08-context-parallel/README.md shows other tables"


# ------------------------------------------------------------------ the planner

LLAMA_7B = ["--layers", 32, "--hidden-size", 4096, "--heads", 32, "--intermediate-size", 11008, "--vocab-size", 32000]


def test_the_planner_finds_the_longest_sequence_a_rank_holds(capsys):
    """tools.plan --cp: a rank's bytes at its peak are sizing's (whose activations
    measure.py counts), the longest sequence that fits is the last multiple of 2 cp tp
    tokens under the memory, and on 8 GPUs cp 8 holds about 8 times cp 1's sequence
    (FSDP shards the state over 8 ranks either way, and only the activations grow with
    the sequence)."""
    config, p = get_config("tiny", 32000, num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                           num_key_value_heads=32, intermediate_size=11008), PRECISIONS["autocast"]
    plan.main([str(a) for a in [*LLAMA_7B, "--seq-length", 131072, "--cp", 8, "--gpu-memory-gb", 80]])
    out = capsys.readouterr().out
    longest = [sizing.longest_sequence(config, 1, p, 8 // cp, cp, 1, 80e9, checkpointing=ckpt)
               for cp in (1, 8) for ckpt in (False, True)]  # 8 GPUs: FSDP over 8 either way
    assert f"fits in 80 GB (a multiple of 2 x cp x tp = 16 tokens): {longest[2]:,} tokens; with activation " \
           f"checkpointing {longest[3]:,}" in out, out
    for (cp, ckpt), n in zip([(1, False), (1, True), (8, False), (8, True)], longest):
        step = 2 * cp
        assert sum(sizing.cp_rank_bytes(config, 1, n, p, 8 // cp, cp, 1, checkpointing=ckpt).values()) <= 80e9
        assert sum(sizing.cp_rank_bytes(config, 1, n + step, p, 8 // cp, cp, 1, checkpointing=ckpt).values()) > 80e9
    assert 7.9 < longest[2] / longest[0] < 8.1 and 7.9 < longest[3] / longest[1] < 8.1, longest
    held = sizing.cp_rank_bytes(config, 1, 131072, p, 1, 8, 1)
    assert held["activations"] == sizing.cp_activation_bytes(config, 1, 131072, p, 8)
    assert f"| {plan.size(held['state'])} |" in out and "| ring " in out and "| all-to-all " in out


@pytest.mark.parametrize("argv, message", [
    (["--model-preset", "tiny", "--cp", 3, "--seq-length", 64, "--gpus-per-node", 3],
     "--seq-length 64 does not cut into 2 x --cp 3 chunks"),
    (["--model-preset", "tiny", "--cp", 2, "--tp", 2, "--cp-attention", "all-to-all", "--seq-length", 64,
      "--gpus-per-node", 4], "--cp 2 does not divide the heads and KV heads per tp rank (2 and 1)"),
    (["--model-preset", "tiny", "--cp", 3, "--gpus-per-node", 8], "not a multiple of --tp 1 x --cp 3"),
    (["--params", "7e9", "--cp", 2], "give a preset or a shape, and neither --params, --modes nor --pp"),
])
def test_the_planner_refuses_a_layout_cp_does_not_fit(capsys, argv, message):
    assert message in refused(capsys, plan.parse_args, argv)


# ------------------------------------------------------------------ a lost rank

@pytest.mark.launch
def test_a_lost_rank_ends_the_other_with_one_line_within_the_timeout(tmp_path):
    """Two machines, one cp rank each: the machine of cp rank 1 dies whole mid-run, and
    rank 0, waiting in the ring's send and receive, stops within --timeout with one line."""
    a_machine_dies(tmp_path, SCRIPT, *TINY, "--cp", 2, "--ckpt-freq", 0)