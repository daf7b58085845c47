"""Chapter 06: tensor and pipeline parallelism train what chapter 01 trains. In fp64,
step by step, every layout of 2, 3 and 4 ranks (tp, pp, both, with dp beside them; from
scratch and with torch's APIs; GPipe and 1F1B) stays within the proof's tolerance of
chapter 01's step: its loss, its gradients before and after clipping, its weights
(tests/test_mutants.py: the bugs that break it); the training script logs chapter 01's
losses with --tp 2 --pp 2 and activation checkpointing, and on dp 2 x pp 2 with padded
samples, gradient accumulation and activation checkpointing; a bad layout, and bad
input to the proof and the measurements, are one line and exit 2; the measured bubble
shrinks as the micro-batches grow; `python -m tools.plan` says to the byte what each
rank of a tensor- or pipeline-parallel layout holds, keeps and all-reduces, and the
page's tables are what measure.py prints for its own command. (The pipeline's order of
sends and receives: tests/test_ch06_pipeline.py.)"""

from __future__ import annotations


import pytest
import torch

from ch06_runs import chapter_01_scenario, chapter_06_scenario, kept_off_plan, unlike_chapter_01
from conftest import CH01_STEPS, NO_GPU, REPO, TINY, a_machine_dies, load_script, read_json, read_jsonl, \
    refused, refused_on_ranks, run_warm
from common import sizing
from common.model import LlamaConfig, get_config
from pages import readme_command

SCRIPT = "06-model-parallel/train_llm.py"
PROVE = "06-model-parallel/prove.py"
MEASURE = "06-model-parallel/measure.py"
PAGE = "06-model-parallel/README.md"
chapter = load_script(SCRIPT)  # puts its folder on sys.path: the modules beside it import
import pipeline_parallel as pp  # noqa: E402
import tensor_parallel as tp  # noqa: E402


# ------------------------------------------------------------------- unit tests

def test_layers_split_into_consecutive_stages_the_first_ones_larger():
    assert pp.split_layers(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert pp.split_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert pp.split_layers(2, 1) == [range(0, 2)]
    ranges = pp.split_layers(4, 3)
    assert [pp.stage_of(n, ranges) for n in ("embed_tokens.weight", "layers.1.mlp.up_proj.weight",
                                             "layers.2.input_layernorm.weight", "norm.weight", "lm_head.weight")] \
        == [0, 0, 1, 2, 2]


@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_both_schedules_run_each_micro_batch_once_and_1f1b_holds_at_most_p_minus_s(p, m):
    """Each stage runs F then B of every micro-batch exactly once, backwards in order 0..m-1
    (so the two schedules add gradients in the same order); GPipe holds all m micro-
    batches' activations at its peak, 1F1B at most p - s on stage s."""
    for s in range(p):
        for schedule in (pp.gpipe, pp.one_f_one_b):
            actions = schedule(m, p, s)
            assert sorted(actions) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            assert [i for kind, i in actions if kind == "B"] == list(range(m))
            held, peak = set(), 0
            for kind, i in actions:
                assert (kind == "F") != (i in held)  # a backward follows its own forward
                held.symmetric_difference_update({i})
                peak = max(peak, len(held))
            assert peak == (m if schedule is pp.gpipe else min(p - s, m)), (schedule, s)


def test_the_planner_splits_as_this_chapter_does():
    for layers, stages in ((4, 3), (4, 4), (22, 4), (2, 1)):
        assert sizing.stage_layers(layers, stages) == [len(r) for r in pp.split_layers(layers, stages)]
    for size, world in ((8192, 2), (501, 2), (10, 4), (5, 4)):
        assert [sizing.slice_rows(size, world, r) for r in range(world)] == \
            [b - a for a, b in (tp.shard_range(size, r, world) for r in range(world))]
    assert [sizing.in_flight("1f1b", 8, 4, s) for s in range(4)] == [4, 3, 2, 1]
    assert [sizing.in_flight("gpipe", 8, 4, s) for s in range(4)] == [8] * 4 and sizing.in_flight("1f1b", 2, 4, 0) == 2


def test_shard_ranges_cover_each_row_once_as_torch_chunk_does():
    for size, world in ((8192, 2), (300, 4), (10, 4), (5, 4)):
        ranges = [tp.shard_range(size, r, world) for r in range(world)]
        assert [i for a, b in ranges for i in range(a, b)] == list(range(size))
        assert [b - a for a, b in ranges] == [c.numel() for c in torch.arange(size).chunk(world)] + \
            [0] * (world - len(torch.arange(size).chunk(world)))


def test_vocab_parallel_cross_entropy_is_the_summed_cross_entropy(one_rank_group):
    """On one rank it must be F.cross_entropy(sum) itself, value and gradient, ignoring
    IGNORE_INDEX targets; its three reductions are what tp ranks add."""
    import torch.distributed as dist
    logits = torch.randn(12, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (12,))
    targets[3] = -100
    ours = tp.vocab_parallel_cross_entropy(logits, targets, 0, dist.group.WORLD)
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    (g_ref,) = torch.autograd.grad(ref, logits)
    torch.testing.assert_close(ours, ref, rtol=1e-15, atol=0)
    torch.testing.assert_close(g_ours, g_ref, rtol=0, atol=1e-15)


# ------------------------------------------------------------ bad input: exit 2

@pytest.mark.parametrize("world, argv, message", [
    (4, ["--tp", "3"], "--tp 3 does not divide the 'tiny' preset's 4 attention heads"),
    (4, ["--tp", "4"], "--tp 4 does not divide the 'tiny' preset's 2 KV heads"),
    (4, ["--pp", "3"], "--pp 3 exceeds the 'tiny' preset's 2 layers"),
    (6, ["--tp", "2", "--pp", "2"], "the world size 6 is not a multiple of --tp 2 x --pp 2"),
    (2, ["--pp", "2", "--microbatches", "3"], "--microbatches 3 does not divide the batch of 4 per replica"),
    (2, ["--pp", "2", "--microbatches", "1", "--api", "torch"], "Schedule1F1B needs --microbatches >= --pp"),
    (2, ["--tp", "2", "--compile"], "--compile applies to data parallelism only"),
    (2, ["--schedule", "zb"], "unknown 'zb'; choose one of: gpipe, 1f1b"),
])
def test_a_layout_that_does_not_fit_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, world, argv, message):
    line = refused_on_ranks(capsys, monkeypatch, chapter.parse_args, world, [*TINY, *argv, "--save-dir", tmp_path / "out"])
    assert message in line, line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the proofs

def prove(tmp_path, command, *flags):
    """The README's prove.py command (`command`), a small sequence, on the suite's budget."""
    proc = run_warm([*command, "--seq-length", 32, "--batch-size", 4, *flags, "--save-dir", tmp_path,
                "--experiment-name", "proof"], timeout=300)
    return proc, read_json(tmp_path / "proof" / "prove.json")


def assert_proven(proc, result, expected, steps=3):
    """Passed, every expected layout checked, within the tolerance; rounding visible where
    a layout reorders sums (the check compares something real)."""
    assert proc.returncode == 0 and result["passed"] and result["failures"] == [], proc.stderr[-3000:]
    assert f"OK: every layout's loss, gradients (before and after clipping) and weights equal chapter 01's " \
           f"after each of {steps} fp64 steps" in proc.stdout
    layouts = result["layouts"]
    assert sorted(layouts) == sorted(expected)
    for key, r in layouts.items():
        assert max(r[k] for k in ("loss", "grads", "clipped", "weights")) <= 1e-2, key  # far inside the tolerance
        assert 0 < r["grads"] and 0 < r["weights_abs"] < 1e-11, key  # each layout reorders sums: fp64 rounding, seen
        if key.endswith("-torch") and "tp" not in key:  # torch's schedules run our arithmetic
            assert r["vs_weights_abs"] == 0.0, key
    return layouts


def pipelines(shape):
    return [f"{shape}-{schedule}-{api}" for schedule in ("gpipe", "1f1b") for api in ("scratch", "torch")]


def test_on_2_ranks_tp_and_pp_equal_chapter_01_and_each_other(tmp_path):
    """tp 2 and pp 2 (tiny preset), from scratch and with torch's APIs: each within the
    tolerance of chapter 01's step, GPipe equal to 1F1B bit for bit, torch's pipelines
    equal to ours bit for bit, torch's tensor parallelism within twice the tolerance of
    ours."""
    proc, result = prove(tmp_path, readme_command(PAGE, "nproc-per-node=2 06-model-parallel/prove.py"))
    layouts = assert_proven(proc, result, [*pipelines("pp2"), "tp2-scratch", "tp2-torch"])
    assert layouts["tp2-torch"]["vs"] == "tp2-scratch" and 0 < layouts["tp2-torch"]["vs_weights"] <= 2


def test_on_3_ranks_a_pipeline_of_uneven_stages(tmp_path):
    """3 stages over 4 layers (2, 1, 1), every variant: torch's schedules run our
    arithmetic, to the bit."""
    proc, result = prove(tmp_path, readme_command(PAGE, "nproc-per-node=3 06-model-parallel/prove.py"))
    layouts = assert_proven(proc, result, pipelines("pp3"))
    assert layouts["pp3-1f1b-torch"]["vs"] == "pp3-1f1b-scratch"


@pytest.mark.long
def test_on_4_ranks_every_layout(tmp_path):
    """pp 4, tp with pp, dp with pp, dp with tp: the 14 layouts of 4 ranks, over 2 steps
    of 16-token samples (3 steps on 2 and 3 ranks)."""
    proc, result = prove(tmp_path, readme_command(PAGE, "nproc-per-node=4 06-model-parallel/prove.py"),
                         "--seq-length", 16, "--proof-steps", 2)
    assert_proven(proc, result, [*pipelines("pp4"), *pipelines("dp2xpp2"), *pipelines("pp2xtp2"),
                                 "dp2xtp2-scratch", "dp2xtp2-torch"], steps=2)


# --------------------------------------------------------------- the training script

def test_tp2_pp2_training_logs_chapter_01s_losses(ch01_smoke, tmp_path):
    """torchrun 4 ranks, --tp 2 --pp 2 (dp 1: the global batch is chapter 01's), 2 micro-
    batches, each layer's activations recomputed in backward (activation checkpointing
    runs f and g again: the same values), against chapter 01's reference run with the
    same flags (checkpointing changes no value). fp32: the losses of
    step 1 agree to fp32's rounding, and over the 40 steps they stay within 1e-5
    relative, chapter 03's tolerance for DDP (measured: 2.4e-7 at most, a few units of
    fp32's 6e-8). The gradient norms within 1e-3: chapter 01's is torch's fp32 norm,
    whose sum over the 0.5M-element head gradient is itself off by about 6e-5 here (this
    chapter adds the squares in fp64). The saved weights within chapter 03's bounds."""
    _, ref_dir, ref, _ = ch01_smoke
    proc = run_warm([*readme_command(
                PAGE, "torchrun --standalone --nproc-per-node=4 06-model-parallel/train_llm.py --tp 2 --pp 2"), *TINY,
                "--max-steps", CH01_STEPS, "--microbatches", 2, "--activation-checkpointing", "--save-dir", tmp_path,
                "--experiment-name", "ch06"],
               env=NO_GPU)
    got = read_jsonl(tmp_path / "ch06" / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, CH01_STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5, abs=0)
    assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=3e-7, abs=0)
    assert [r["grad_norm"] for r in got] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-3, abs=0)
    a = torch.load(tmp_path / "ch06" / "model.pt", weights_only=True)
    b = torch.load(ref_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in b:
        assert ((a[k] - b[k]).norm() / b[k].norm()).item() <= 5e-5, k
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-4, msg=k)
    summary = read_json(tmp_path / "ch06" / "summary.json")
    assert (summary["world_size"], summary["dp"], summary["pp"], summary["tp"]) == (4, 1, 2, 2)
    assert "layout: dp 1 x pp 2 x tp 2; 1f1b schedule, 2 micro-batches, scratch API" in proc.stdout
    assert proc.stdout.count("| metric ") == 1 and "[rank " not in proc.stdout + proc.stderr


def test_padded_accumulating_checkpointed_dp_and_pp_training_equals_chapter_01(tmp_path, tmp_path_factory):
    """dp 2 x pp 2 on 4 ranks with --padded (each micro-batch's mask through the
    pipeline, the step's token count all-reduced over the replicas), --grad-accum 2 and
    --activation-checkpointing, against chapter 01 with the same flags and the same
    global batch (tests/ch06_runs.py): each step's loss and gradient norm, and the saved
    weights. (Measured: the same losses to the bit.)"""
    ch06 = chapter_06_scenario(REPO / "06-model-parallel", tmp_path)
    assert unlike_chapter_01(ch06, chapter_01_scenario(tmp_path_factory)) == []
    summary = read_json(ch06 / "summary.json")
    assert (summary["dp"], summary["pp"], summary["tp"], summary["grad_accum"]) == (2, 2, 1, 2)


# ------------------------------------------------------------------ measured

@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The README's measure.py on 2 ranks, m = 1, 2, 4, 8 (its small preset: on the tiny
    one a micro-batch is too short for the bubble to show); a vocabulary of 501 splits
    unevenly over 2 tp ranks (251 and 250 rows)."""
    out = tmp_path_factory.mktemp("measure")
    run_warm([*readme_command(PAGE, "06-model-parallel/measure.py"), "--seq-length", 32, "--steps", 2,
              "--vocab-size", 501, "--save-dir", out, "--experiment-name", "m"], timeout=300)
    return out / "m"


def test_the_measured_bubble_shrinks_as_micro_batches_grow(measured):
    """Two stages, m = 1, 2, 4, 8: for each schedule the schedule's own bubble (the
    measured operations replayed) at m = 8 is well below the one at m = 1 (the formula:
    11% against 50%; on a busy machine the figures wander, so only the trend is
    asserted; the real step's idle share need not follow on a loaded machine, where the
    hand-offs' overhead grows with m); the timeline is drawn."""
    result = read_json(measured / "measure.json")
    runs = {(r["schedule"], r["m"]): r for r in result["pipeline"]}
    for schedule in ("gpipe", "1f1b"):
        assert runs[schedule, 8]["schedule_bubble"] < runs[schedule, 1]["schedule_bubble"] - 0.1, schedule
        for m in (1, 2, 4, 8):
            r = runs[schedule, m]
            assert r["textbook"] == pytest.approx(1 / (m + 1))
            assert 0 <= r["schedule_bubble"] < 1 and -0.05 < r["communication_overhead"] < 1, r
    assert (measured / "pipeline-timeline.png").stat().st_size > 10_000


def test_what_a_stage_keeps_is_the_planners_and_1f1b_keeps_p_minus_s_micro_batches(measured):
    """Every tensor the pipeline's step creates, counted while it lives (measure.py's
    dispatch mode), as each forward and backward starts: the most each stage kept is
    the planner's to the byte, for both schedules and every m. GPipe keeps all m
    micro-batches; 1F1B at most p - s (2 on stage 0, 1 on stage 1), whatever m is: a
    sent tensor is let go when its send is done (tests/test_mutants.py: kept until the
    step's end, they fail this)."""
    result = read_json(measured / "measure.json")
    assert kept_off_plan(result) == []
    runs = {(r["schedule"], r["m"]): r for r in result["pipeline"]}
    assert all(runs["gpipe", m]["in_flight_planned"] == [m, m] for m in (1, 2, 4, 8))
    assert all(runs["1f1b", m]["in_flight_planned"] == [2, 1] for m in (2, 4, 8))
    assert runs["1f1b", 8]["kept_bytes_per_stage"] == runs["1f1b", 2]["kept_bytes_per_stage"]
    assert runs["gpipe", 8]["kept_bytes_per_stage"][0] > 3 * runs["1f1b", 8]["kept_bytes_per_stage"][0]


def test_the_planner_says_what_each_rank_holds_and_all_reduces_to_the_byte(measured):
    """Each rank of pp 2 and of tp 2, after one step of split_model's layout: its
    parameters, gradients and AdamW state as counted, and one micro-batch's activations
    as autograd saved them (plus the output a stage keeps), are what `tools.plan` says
    (with a CPU's F.rms_norm); the bytes tensor parallelism all-reduced (counted at the
    dispatcher) are the planner's. measure.py's tables say so for the tour."""
    result = read_json(measured / "measure.json")
    config, fp32 = LlamaConfig(**result["model_config"]), sizing.PRECISIONS["fp32"]
    tokens = result["args"]["microbatch_size"] * result["args"]["seq_length"]
    layouts = {"pp2": (2, 1), "tp2": (1, 2)}
    assert sorted((m["layout"], m["stage"], m["tp_rank"]) for m in result["memory"]) == \
        [("pp2", 0, 0), ("pp2", 1, 0), ("tp2", 0, 0), ("tp2", 0, 1)]
    for m in result["memory"]:
        stages, tp_size = layouts[m["layout"]]
        held = sizing.stage_state_bytes(config, tp_size, stages, m["stage"], fp32, m["tp_rank"])
        assert {k: m["measured"][k] for k in held} == held, m
        assert m["measured"]["activations_per_microbatch"] == sizing.stage_activation_bytes(
            config, tokens, result["args"]["seq_length"], fp32, tp_size, stages, m["stage"], m["tp_rank"], cpu=True), m
    ranks = {(m["layout"], m["tp_rank"]): m["measured"] for m in result["memory"]}
    assert ranks["tp2", 0]["params"] - ranks["tp2", 1]["params"] == 2 * 4 * config.hidden_size  # 251 rows vs 250
    t = result["tensor_parallel"]
    assert (t["layer_bytes"], t["model_bytes"]) == sizing.tp_all_reduce_bytes(config, tokens, fp32, 2, 1, 0)
    assert t["layer_bytes"] == 4 * tokens * config.hidden_size * 4  # 4 all-reduces of B x T x h, fp32
    table = (measured / "tables.md").read_text()
    assert table.count("| the same |") == 4 and table.count("| the same        |") == 8
    assert "| one decoder layer" in table


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the Markdown table whose header row starts with `header`."""
    lines = text[text.index(header):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def test_the_pages_tables_are_what_measure_py_prints_for_its_own_command(monkeypatch):
    """The page shows measure.py's tables for its own command: at measure.py's defaults
    (the small preset, a random vocabulary of 64, micro-batches of 1 x 128 tokens, fp32
    on a CPU) each byte count and each MiB shown is the planner's, which measure.py's own
    test above holds to what the ranks hold and keep."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    args = load_script(MEASURE).parse_args([])
    assert (args.model_preset, args.vocab_size, args.microbatch_size, args.seq_length) == ("small", 64, 1, 128)
    config, fp32, tokens = get_config("small", 64), sizing.PRECISIONS["fp32"], 128
    text = (REPO / PAGE).read_text()
    rows = table_rows(text, "| layout | stage, tp rank | params |")
    assert len(rows) == 4
    for layout, where, *counts, planner in rows:
        (pp, tp), (stage, tp_rank) = {"pp2": (2, 1), "tp2": (1, 2)}[layout], map(int, where.split(", "))
        held = sizing.stage_state_bytes(config, tp, pp, stage, fp32, tp_rank)
        acts = sizing.stage_activation_bytes(config, tokens, 128, fp32, tp, pp, stage, tp_rank, cpu=True)
        assert counts == [f"{n:,}" for n in (held["params"], held["grads"], held["optimizer"], acts)], layout
        assert planner == "the same"
    rows = table_rows(text, "| schedule | micro-batches | kept, MiB per stage |")
    assert len(rows) >= 3
    for schedule, m, kept, in_flight, planner in rows:
        planned = [sizing.stage_kept_bytes(config, tokens, 128, fp32, 1, 2, s, schedule, int(m), cpu=True)
                   for s in (0, 1)]
        assert kept == ", ".join(f"{k / 2**20:.2f}" for k in planned), (schedule, m)
        assert in_flight == ", ".join(str(sizing.in_flight(schedule, int(m), 2, s)) for s in (0, 1))
        assert planner == "the same"


# ------------------------------------------------- bad input to the proof and the measurements

@pytest.mark.parametrize("script, world, argv, message", [
    (PROVE, 2, ["--seed", "100000000000000000000000"], "argument --seed: must be a whole number in [0, 2**63)"),
    (PROVE, 2, ["--model-preset", "tiny", "--vocab-size", "1"], "a vocabulary of 1 leaves tp rank 1 of 2 no rows of it"),
    (PROVE, 2, ["--layers", "100000"], "--layers 100,000: the proof builds every layout's whole model"),
    (PROVE, 2, ["--vocab-size", "10000000000"], "--vocab-size 10,000,000,000: at most 1,048,576"),
    (MEASURE, 2, ["--seed", "100000000000000000000000"], "argument --seed: must be a whole number in [0, 2**63)"),
    (MEASURE, 2, ["--model-preset", "tiny", "--vocab-size", "1"], "a vocabulary of 1 leaves tp rank 1 of 2 no rows"),
    (MEASURE, 3, ["--model-preset", "tiny"], "3 stages but the 'tiny' preset has 2 layers"),
])
def test_bad_input_to_the_proof_and_the_measurements_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys,
                                                                             script, world, argv, message):
    """Before any work or any folder: a seed past 64 bits, a vocabulary that leaves a
    tensor-parallel rank no rows, a model too deep to build on every rank."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}.items():
        monkeypatch.setenv(k, v)
    line = refused(capsys, load_script(script).parse_args, [*argv, "--save-dir", tmp_path / "out"])
    assert message in line, line
    assert not (tmp_path / "out").exists()


def test_the_timeline_shows_a_measured_micro_batch_count():
    """The largest measured m up to 4, else the smallest: --microbatches 8 alone draws
    m = 8 (it once failed after all the work)."""
    measure = load_script(MEASURE)
    assert [measure.timeline_count(c) for c in (["1", "2", "4", "8"], ["8"], ["16", "8"], ["2", "1"])] == [4, 8, 8, 2]


# ------------------------------------------------------------------ a lost stage

@pytest.mark.launch
def test_a_lost_stage_ends_the_other_with_one_line_within_the_timeout(tmp_path):
    """Two machines, one pipeline stage each: the machine of stage 1 dies whole mid-run,
    and stage 0, waiting on a send or a recv, stops within --timeout with one line."""
    a_machine_dies(tmp_path, SCRIPT, *TINY, "--pp", 2)