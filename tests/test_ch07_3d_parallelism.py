"""Chapter 07: FSDP x tensor parallelism with sequence parallelism x pipeline (interleaved
too), built on the meta device, trains what chapter 01 trains; its sharded checkpoint
resumes in another layout as if uninterrupted; the export loads in transformers.

In fp64, step by step (prove.py): dp2 x tp2, dp2 x pp2, pp2 x tp2 (torch's layers and
the from-scratch ones), pp2 with two stages per rank x tp2, and 3 ranks, each from
chapter 01's initial weights bit for bit; bugs named below fail it. The checkpoint
(prove_resume.py): saved in dp2 x tp2 and loaded in pp2 x tp2, dp4, dp2 x tp2 and on 2
ranks, and pp2 into pp1 on 2 ranks, holds the saved state bit for bit and continues the
uninterrupted run; per-rank data positions would skip or repeat samples. The training
script logs chapter 01's losses; bad layouts are one line and exit 2; a SIGTERM to the
whole job in dp2 x tp2 on 4 ranks saves, and the rerun on 2 ranks as pp2 continues
chapter 01's losses; a lost rank ends the others within --timeout."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import NO_GPU, REPO, TINY, a_machine_dies, load_script, python_cmd, read_json, read_jsonl, \
    refused_on_ranks, run, run_warm, start, torchrun_cmd
from pages import readme_command
from procs import kill_job

SCRIPT = "07-3d-parallelism/train_llm.py"
PROVE = "07-3d-parallelism/prove.py"
PROVE_RESUME = "07-3d-parallelism/prove_resume.py"
PAGE = "07-3d-parallelism/README.md"
chapter = load_script(SCRIPT)  # puts its folder on sys.path: the modules beside it import
import checkpoint as ckpt  # noqa: E402
import parallelize  # noqa: E402
import pipeline_parallel  # noqa: E402

PROOF = ["--model-preset", "tiny", "--layers", "4", "--seq-length", 16, "--batch-size", 4]


# ------------------------------------------------------------------- in one process

def test_the_meta_build_materializes_chapter_01s_initial_weights(one_rank_group):
    """One rank, every cut of size 1, activation checkpointing on: built on the meta device,
    then materialised, every weight equals LlamaForCausalLM(config) after the same seed,
    bit for bit; and no whole model was ever allocated (its memory is the pieces')."""
    from torch.distributed.device_mesh import init_device_mesh
    from common.model import LlamaForCausalLM, get_config
    config = get_config("tiny", 301, num_hidden_layers=3)
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
    layout = parallelize.Layout()
    stages, ids = parallelize.build_stages(config, mesh, layout, torch.device("cpu"), activation_checkpointing=True)
    parallelize.materialize(stages, config, layout, seed=7, tp_rank=0)
    torch.manual_seed(7)
    reference = dict(LlamaForCausalLM(config).named_parameters())
    mine = dict(pipeline_parallel.Part(stages).named_parameters())
    assert ids == [0] and mine.keys() == reference.keys()
    for name, p in mine.items():
        assert torch.equal(p.full_tensor(), reference[name].detach()), name


def test_the_bubble_formula_shrinks_by_the_stages_per_rank():
    """(p - 1) / (m + p - 1) for one stage per rank (chapter 06's), and the fill (p - 1)
    divided by v with v stages per rank (Narayanan et al. 2021)."""
    assert pipeline_parallel.bubble(4, 8) == pytest.approx(3 / 11)
    assert pipeline_parallel.bubble(4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert pipeline_parallel.bubble(1, 8, 4) == 0.0
    assert pipeline_parallel.stages_of_rank(1, 4, 2) == [1, 5]


def read_after_resume(n: int, seed: int, batch: int, dp_a: int, dp_b: int, steps_a: int, steps_b: int,
                      position) -> tuple[list[int], list[int]]:
    """The samples an uninterrupted run of steps_a + steps_b global batches reads, and
    those a run reads that trains steps_a of them on dp_a replicas, then resumes on dp_b
    replicas at `position(samples_a_per_replica, global_samples)` into each replica's
    share, through the chapter's ResumableSampler."""
    from torch.utils.data import DistributedSampler

    def shares(dp):
        out = []
        for r in range(dp):
            s = ckpt.ResumableSampler(DistributedSampler(range(n), num_replicas=dp, rank=r, seed=seed, drop_last=True))
            out.append(s)
        return out
    whole = list(DistributedSampler(range(n), num_replicas=1, rank=0, seed=seed, drop_last=True))
    uninterrupted = sorted(whole[:(steps_a + steps_b) * batch])
    got = []
    for s in shares(dp_a):
        s.set_epoch(0)
        got += list(s)[:steps_a * batch // dp_a]
    for s in shares(dp_b):
        s.set_epoch(0, start=position(steps_a * batch // dp_a, steps_a * batch, dp_b))
        got += list(s)[:steps_b * batch // dp_b]
    return uninterrupted, sorted(got)


@pytest.mark.parametrize("dp_a, dp_b", [(2, 4), (4, 2), (2, 1)])
def test_the_data_position_is_the_global_batchs_and_a_per_rank_one_skips_or_repeats(dp_a, dp_b):
    """Resumed on another number of replicas, each at its share of the global batch's
    position (replica_start), the run reads exactly the uninterrupted run's samples; at
    the position its rank had read (as chapter 04 saved it, per rank) it skips samples
    (more replicas) or reads some twice (fewer)."""
    uninterrupted, right = read_after_resume(96, 3, 8, dp_a, dp_b, 3, 4,
                                             lambda mine, whole, dp: ckpt.replica_start(whole, dp))
    assert right == uninterrupted
    _, wrong = read_after_resume(96, 3, 8, dp_a, dp_b, 3, 4, lambda mine, whole, dp: mine)
    repeated = len(wrong) - len(set(wrong))
    skipped = len(set(uninterrupted) - set(wrong))
    assert (repeated > 0) if dp_b < dp_a else (skipped > 0), (repeated, skipped)


@pytest.mark.parametrize("world, argv, message", [
    (4, ["--tp", "3"], "--tp 3 does not divide the 'tiny' preset's 4 attention heads"),
    (4, ["--pp", "2", "--virtual-stages", "2"], "--pp 2 x --virtual-stages 2 stages exceed the 'tiny' preset's 2"),
    (6, ["--tp", "2", "--pp", "2"], "the world size 6 is not a multiple of --tp 2 x --pp 2"),
    (2, ["--tp", "2", "--seq-length", "63"], "--seq-length 63 is not a multiple of --tp 2"),
    (2, ["--pp", "2", "--schedule", "interleaved"], "--schedule interleaved runs --virtual-stages 2 or more"),
    (2, ["--pp", "2", "--virtual-stages", "2", "--model-preset", "small", "--batch-size", "6", "--microbatches", "3"],
     "over a multiple of --pp micro-batches (here --pp 2, --microbatches 3)"),
    (2, ["--pp", "2", "--microbatches", "1"], "Schedule1F1B needs --microbatches >= --pp"),
    (2, ["--compile"], "--compile is not wired into this chapter's composed model"),
    (2, ["--schedule", "zb"], "unknown 'zb'; choose one of: gpipe, 1f1b, interleaved"),
])
def test_a_layout_that_does_not_fit_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, world, argv, message):
    line = refused_on_ranks(capsys, monkeypatch, chapter.parse_args, world, [*TINY, *argv, "--save-dir", tmp_path / "out"])
    assert message in line, line
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the fp64 proofs

def prove(tmp_path, nproc: int, *flags, script=PROVE, name="proof", check=True, command=None):
    command = command or torchrun_cmd(nproc, script)
    proc = run_warm([*command, *PROOF, *flags, "--save-dir", tmp_path, "--experiment-name", name],
                    timeout=300, check=check)
    result = tmp_path / name / ("prove.json" if script == PROVE else "prove_resume.json")
    return proc, read_json(result) if result.exists() else None


def assert_proven(proc, result, expected):
    assert proc.returncode == 0 and result["passed"] and result["failures"] == [], proc.stderr[-3000:]
    assert sorted(result["layouts"]) == sorted(expected)
    for key, r in result["layouts"].items():
        assert r["init"] == 0.0, key  # chapter 01's initial weights, bit for bit
        for kind in ("loss", "grads", "clipped", "weights"):
            assert r[kind] <= 1, (key, kind)
        assert 0 < r["weights_abs"] < 1e-12, key  # every layout reorders sums: fp64 rounding, seen
    return result["layouts"]


@pytest.mark.long
def test_on_4_ranks_fsdp_tp_sp_and_pp_equal_chapter_01(tmp_path):
    """dp2 x tp2 (FSDP x TP+SP) with torch's layers and with sequence_parallel.py's (within
    twice the tolerance of each other), dp2 x pp2 (FSDP x PP), and pp2 x tp2 with SP and
    two stages per pipeline rank (the interleaved schedule)."""
    proc, result = prove(tmp_path, 4, "--layouts", "dp2xtp2,dp2xtp2-scratch,dp2xpp2,pp2v2xtp2",
                         command=readme_command(PAGE, "nproc-per-node=4 07-3d-parallelism/prove.py"))
    layouts = assert_proven(proc, result, ["dp2xtp2", "dp2xtp2-scratch", "dp2xpp2", "pp2v2xtp2"])
    assert layouts["dp2xtp2-scratch"]["vs"] == "dp2xtp2" and 0 < layouts["dp2xtp2-scratch"]["vs_weights"] <= 2
    assert "OK: every layout starts from chapter 01's weights bit for bit" in proc.stdout


def test_on_3_ranks_fsdp_cuts_rows_unevenly(tmp_path):
    """FSDP over 3 ranks: tensors of 64 or 176 rows, the vocabulary's 1001, cut 3 ways."""
    proc, result = prove(tmp_path, 3, "--batch-size", 6, "--layouts", "dp3")
    assert_proven(proc, result, ["dp3"])


SPOILED = """
import runpy, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/07-3d-parallelism"]
import checkpoint, parallelize, sequence_parallel
bug = sys.argv[2]
if bug == "scatter-without-sum":  # SP's reduce-scatter keeps this rank's partial sums, unsummed
    sequence_parallel.reduce_scatter = lambda t, group: t.chunk(2, dim=1)[sequence_parallel.dist.get_rank(group)].contiguous()
elif bug == "norm-gradients-not-summed":  # the norm weights' gradients left per sequence shard
    sequence_parallel.all_reduce_norm_gradients = lambda module, group: None
elif bug == "norms-counted-on-every-tp-rank":  # the clipping norm counts replicated pieces twice
    parallelize.counted_once = lambda p, tp_rank: True
elif bug == "every-rank-the-first-piece":  # materialize fills each piece from the tensor's first elements
    real = parallelize.local_piece
    def local_piece(full, name, p, layout, tp_rank):
        piece = real(full, name, p, layout, tp_rank)
        return full.reshape(-1)[:piece.numel()].view_as(piece)
    parallelize.local_piece = local_piece
elif bug == "moments-not-saved":  # the checkpoint keeps the weights only
    real_state = checkpoint.TrainState.state_dict
    def state_dict(self):
        state = real_state(self)
        state["optim"] = {k: v for k, v in state["optim"].items() if "exp_avg" not in k}
        return state
    checkpoint.TrainState.state_dict = state_dict
elif bug == "per-rank-position":  # each replica resumes at the samples its own rank had read
    checkpoint.replica_start = lambda samples_in_epoch, dp: samples_in_epoch
sys.argv = sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("bug, layouts, failure", [
    ("scatter-without-sum", "tp2-scratch", "tp2-scratch: step 1: the loss differs"),
    ("norm-gradients-not-summed", "tp2-scratch", "tp2-scratch: step 1: the gradient of "),
    ("norms-counted-on-every-tp-rank", "tp2", "tp2: step 1: the clipped gradient of "),
    ("every-rank-the-first-piece", "dp2", "dp2: the initial weights differ from chapter 01's"),
])
def test_a_bug_fails_the_proof(tmp_path, bug, layouts, failure):
    """Each bug, injected into the chapter's modules before prove.py runs, fails it at
    step 1 (or before it), with the line naming what differs."""
    proc = spoiled(tmp_path, bug, PROVE, *PROOF, "--proof-steps", 1, "--layouts", layouts)
    assert proc.returncode == 1, proc.stderr[-3000:]
    failures = read_json(tmp_path / "bug" / "prove.json")["failures"]
    assert any(f.startswith(failure) for f in failures), failures


def spoiled(tmp_path, bug: str, script: str, *args, nproc: int = 2):
    wrapper = tmp_path / "spoiled.py"
    wrapper.write_text(SPOILED)
    return run_warm(torchrun_cmd(nproc, wrapper, REPO, bug, REPO / script, *args, "--save-dir", tmp_path,
                                 "--experiment-name", "bug"), check=False, timeout=300)


# ------------------------------------------------------- the checkpoint that moves

@pytest.mark.long
def test_a_checkpoint_saved_in_one_layout_resumes_in_another(tmp_path):
    """fp64, through the script's sampling, across an epoch boundary: saved at step 2 in
    dp2 x tp2 and resumed for 2 steps in pp2 x tp2, in dp4, in dp2 x tp2 again (bit for
    bit), and, in a second launch, on 2 ranks as dp2; saved in pp2 and resumed in dp2
    (pp2 -> pp1 on 2 ranks). Every tensor loaded equals the saved one bit for bit, every
    resumed batch is the uninterrupted run's, the weights within 1e-11 of it."""
    proc4, result4 = prove(tmp_path, 4, script=PROVE_RESUME, name="four",
                           command=readme_command(PAGE, "prove_resume.py", "--experiment-name move4"))
    proc2, result2 = prove(tmp_path, 2, "--moves", "dp2xtp2:dp2,pp2:dp2", "--saved-in", tmp_path / "four",
                           script=PROVE_RESUME, name="two")
    moves = {**result4["moves"], **result2["moves"]}
    assert result4["passed"] and result2["passed"], (result4["failures"], result2["failures"])
    assert sorted(moves) == sorted(["dp2xtp2:pp2xtp2", "dp2xtp2:dp4", "dp2xtp2:dp2xtp2", "dp2xtp2:dp2", "pp2:dp2"])
    for key, r in moves.items():
        assert r["loaded_tensors"] > 0 and r["tensors_moved_wrong"] == 0, key
        assert r["weights_max_abs_diff"] <= 1e-11, key
        assert (r["weights_max_abs_diff"] == 0.0) == (key == "dp2xtp2:dp2xtp2"), key  # rounding, seen elsewhere
    assert "OK: every checkpoint loaded in its new layout holds what the old one saved" in proc2.stdout


@pytest.mark.parametrize("bug, failure", [
    ("moments-not-saved", "pp2:dp2: "),
    ("per-rank-position", "pp2:dp2: step 3's global batch in dp2 holds samples"),
])
def test_a_bug_fails_the_resume_proof(tmp_path, bug, failure):
    """The optimizer's moments left out of the checkpoint, or each replica resuming at
    its own rank's count: the move pp2 -> dp2 fails, naming what differs."""
    proc = spoiled(tmp_path, bug, PROVE_RESUME, *PROOF, "--moves", "pp2:dp2")
    assert proc.returncode != 0
    result = tmp_path / "bug" / "prove_resume.json"
    failures = read_json(result)["failures"] if result.exists() else [proc.stderr]
    assert any(failure in f for f in failures), failures


# ------------------------------------------------------------------------ measured

def test_the_interleaved_bubble_sequence_parallelism_and_the_bytes_are_the_planners(tmp_path):
    """The README's measure.py on 2 ranks (the small preset: 4 layers, 2 x 2 stages), m = 2
    and 4: torch's interleaved order, replayed, has the formula's bubble, half the plain
    1F1B's at each m; sequence parallelism saves what the planner says, to the byte; and
    in dp2, pp2 with 2 stages per rank and tp2, each rank holds the planner's parameters,
    gradients and AdamW state to the byte, its peak in a step below the whole model's."""
    run_warm([*readme_command(PAGE, "07-3d-parallelism/measure.py"), "--seq-length", 32, "--microbatches", "2,4",
              "--steps", 1, "--layouts", "dp2,pp2v2,tp2", "--save-dir", tmp_path, "--experiment-name", "m"],
             timeout=300)
    result = read_json(tmp_path / "m" / "measure.json")
    bubbles = {(b["v"], b["m"]): b for b in result["bubble"]}
    assert sorted(bubbles) == [(1, 2), (1, 4), (2, 2), (2, 4)]
    for b in bubbles.values():
        assert b["schedule_bubble"] == pytest.approx(b["formula"], abs=0.01), b
        assert b["formula"] == pipeline_parallel.bubble(2, b["m"], b["v"])
    for m in (2, 4):
        assert bubbles[(2, m)]["schedule_bubble"] < bubbles[(1, m)]["schedule_bubble"]
    sp = result["sequence_parallel"]
    assert sp["saving"] == sp["planned_saving"] > 0 and sp["sp_bytes"] < sp["tp_bytes"]
    assert sorted(result["layouts"]) == ["dp2", "pp2v2", "tp2"]
    for name, ranks in result["layouts"].items():
        for r in ranks:
            assert r["held"] == r["planned"], (name, r)
            assert sum(r["held"].values()) < r["peak_in_step"] < result["whole_model_bytes"], (name, r)


# ------------------------------------------------------------------ the planner at scale

LLAMA_405B = ["--layers", 126, "--hidden-size", 16384, "--heads", 128, "--kv-heads", 8, "--intermediate-size", 53248,
              "--vocab-size", 128256, "--seq-length", 8192, "--precision", "bf16"]
LLAMA_70B = ["--layers", 80, "--hidden-size", 8192, "--heads", 64, "--kv-heads", 8, "--intermediate-size", 28672,
             "--vocab-size", 128256, "--seq-length", 8192, "--precision", "bf16"]


@pytest.mark.parametrize("shape, flags, gpus, worst", [
    (LLAMA_405B, ["--tp", 8, "--pp", 16, "--virtual-stages", 2, "--nodes", 128, "--global-batch-size", 256], 1024,
     28.3e9),
    (LLAMA_70B, ["--tp", 8, "--pp", 4, "--virtual-stages", 2, "--nodes", 8, "--global-batch-size", 128], 64, 29.7e9),
])
def test_the_planner_lays_out_405b_on_1024_gpus_and_70b_on_64(capsys, shape, flags, gpus, worst):
    """tools.plan --fsdp: the Llama 3 paper's cut for 405 B (tp 8 x pp 16: Grattafiori et al.
    2024, Table 4) on 1,024 GPUs, 70 B on 64. Each GPU's peak (state shards, its stages
    gathered, the activations its interleaved schedule holds) fits 80 GB only with
    activation checkpointing; the bubble is the interleaved formula's."""
    from common.sizing import PRECISIONS, fsdp_stage_state_bytes, pipeline_bubble, rank_3d_bytes
    from tools import plan
    args = plan.parse_args([*map(str, shape), "--fsdp", *map(str, flags)])
    out = plan.plan(args)
    c, p = args.model.config, PRECISIONS["bf16"]
    assert args.world == gpus and args.microbatches == args.batch_size
    assert f"a bubble of {pipeline_bubble(args.pp, args.microbatches, 2):.1%}" in out
    peaks = [rank_3d_bytes(c, args.batch_size, 8192, p, args.dp, 8, args.pp, 2, args.microbatches, "interleaved", True,
                           r, ckpt) for r in range(args.pp) for ckpt in (False, True)]
    without, with_ckpt = [sum(b.values()) for b in peaks[0::2]], [sum(b.values()) for b in peaks[1::2]]
    assert max(with_ckpt) == pytest.approx(worst, rel=0.01) and max(with_ckpt) < 80e9 < max(without)
    # sixteen bytes per parameter (bf16 weights and gradients, fp32 master and moments), over every GPU
    state = sum(sum(fsdp_stage_state_bytes(c, args.dp, 8, args.pp, 2, r, p).values()) for r in range(args.pp))
    assert state * 8 * args.dp == pytest.approx(16 * args.model.num_params, rel=0.01)


def test_the_planners_bubble_and_in_flight_counts():
    from common.sizing import pipeline_bubble, stages_in_flight
    assert pipeline_bubble(16, 32, 2) == pytest.approx(7.5 / 39.5)
    assert pipeline_bubble(4, 8) == pipeline_parallel.bubble(4, 8)
    assert [stages_in_flight("1f1b", 8, 4, 1, r) for r in range(4)] == [4, 3, 2, 1]
    assert [stages_in_flight("interleaved", 8, 4, 2, r) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]


# --------------------------------------------------------- the training script

STEPS = 10  # short: a chapter 01 run of as many steps is its reference


def ch01_run(save_dir, steps: int, name: str, batch: int = 4) -> list[dict]:
    """Chapter 01 on the global batch the chapter 07 run it is compared with trains on."""
    run_warm(python_cmd("01-single-gpu/train_llm.py", *TINY, "--batch-size", batch, "--max-steps", steps,
                        "--save-dir", save_dir, "--experiment-name", name), env=NO_GPU)
    return read_jsonl(save_dir / name / "metrics.jsonl")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Chapter 07 on 4 ranks as dp2 x tp2 (FSDP x TP+SP, batch 2 per replica: chapter 01's
    global batch of 4), checkpoints at steps 5 and 10, and chapter 01's run beside it."""
    out = tmp_path_factory.mktemp("ch07")
    command = readme_command(PAGE, "torchrun --standalone --nproc-per-node=4 07-3d-parallelism/train_llm.py --tp 2")
    proc = run_warm([*command, *TINY, "--batch-size", 2, "--max-steps", STEPS, "--ckpt-freq", 5, "--save-dir", out,
                     "--experiment-name", "ch07"], env=NO_GPU)
    return proc, out / "ch07", ch01_run(out, STEPS, "ch01")


def test_fsdp_with_tp_and_sp_logs_chapter_01s_losses(trained):
    """fp32: each logged loss within 1e-5 relative of chapter 01's on the same global
    batch (chapter 03's tolerance for DDP; measured: a few units of fp32's 6e-8), the
    layout said, the summary's, and the final weights a checkpoint at the last step."""
    proc, run_dir, reference = trained
    got = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in reference], rel=1e-5, abs=0)
    assert "layout: dp 2 x pp 1 x tp 2, sequence parallel; 1f1b schedule, 1 micro-batches" in proc.stdout
    summary = read_json(run_dir / "summary.json")
    assert (summary["world_size"], summary["dp"], summary["pp"], summary["tp"]) == (4, 2, 1, 2)
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step-{STEPS:08d}"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-00000005", f"step-{STEPS:08d}"]
    assert proc.stdout.count("| metric ") == 1 and "[rank " not in proc.stdout + proc.stderr


def test_the_checkpoint_exports_to_a_transformers_folder_that_loads_offline(trained, tmp_path, capsys):
    """tools.export: LlamaForCausalLM.from_pretrained loads the folder offline, its logits
    equal chapter 01's model holding the checkpoint's weights (fp32, at most 1e-5 apart;
    measured 0), and generate continues a prompt the tokenizer encodes."""
    transformers = pytest.importorskip("transformers", reason="pip install -e '.[test]' installs transformers")
    from common.model import LlamaConfig, LlamaForCausalLM
    from tools import export
    _, run_dir, _ = trained
    export.main([str(run_dir), str(tmp_path / "hf")])
    assert "exported" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config, weights = export.read_weights(export.checkpoint_folder(str(run_dir)))
    ours = LlamaForCausalLM(LlamaConfig(**{k: config[k] for k in LlamaConfig.__dataclass_fields__}))
    ours.load_state_dict(weights)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ids = torch.randint(0, config["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-5
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    prompt = tokenizer("def f(x):", return_tensors="pt")
    out = hf.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 8
    assert tokenizer.decode(out[0]).startswith("def f(x):")


@pytest.mark.parametrize("damage, message", [
    ("flip a byte of rank 1's file", "__1_0.distcp does not match its checksum"),
    ("delete rank 3's file", "__3_0.distcp is missing"),
])
def test_a_damaged_checkpoint_is_not_exported(trained, tmp_path, capsys, damage, message):
    from tools import export
    _, run_dir, _ = trained
    copy = tmp_path / "run"
    import shutil
    shutil.copytree(run_dir / "checkpoints" / "step-00000005", copy)
    shard = copy / ("__1_0.distcp" if "flip" in damage else "__3_0.distcp")
    if "flip" in damage:
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
    with pytest.raises(SystemExit) as exit_:
        export.main([str(copy), str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("case", ["a flipped byte", "another global batch"])
def test_a_checkpoint_that_cannot_continue_the_run_stops_the_resume_in_one_line(trained, tmp_path, case):
    """Resumed on 2 ranks as pp2: the run's newest checkpoint with a flipped byte, or the
    same command with a global batch of 2 where the run had 4. Every rank stops before
    training with one line (the file named; the --batch-size that keeps the global
    batch), and the checkpoint is left as it was."""
    import shutil
    _, run_dir, _ = trained
    copy, step = tmp_path / "ch07", f"step-{STEPS:08d}"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns(".owner"))
    shard = copy / "checkpoints" / step / "__2_0.distcp"
    data = bytearray(shard.read_bytes())
    if case == "a flipped byte":
        data[100] ^= 0xFF
        shard.write_bytes(bytes(data))
    batch = 4 if case == "a flipped byte" else 2
    proc = run_warm(torchrun_cmd(2, SCRIPT, *TINY, "--batch-size", batch, "--pp", 2, "--max-steps", STEPS,
                                 "--save-dir", tmp_path, "--experiment-name", "ch07"), env=NO_GPU, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and errors, proc.stderr[-3000:]
    if case == "a flipped byte":
        assert errors[0].startswith(f"error: checkpoint {copy / 'checkpoints' / step} is damaged "
                                    f"(__2_0.distcp does not match its checksum (corrupted))"), errors
    else:
        assert "(global batch 4 -> 2); another layout keeps the global batch with --batch-size = global batch / " \
               "(dp x --grad-accum)" in errors[0], errors
    assert "step 1" not in proc.stdout and shard.read_bytes() == bytes(data)


def test_export_refuses_an_out_folder_that_holds_anything(trained, tmp_path, capsys):
    from tools import export
    _, run_dir, _ = trained
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "notes.txt").write_text("mine")
    for argv, message in (([str(run_dir), str(tmp_path / "hf")], "exists and is not an empty folder"),
                          ([str(tmp_path), str(tmp_path / "out")], "is not a chapter 07 checkpoint")):
        with pytest.raises(SystemExit) as exit_:
            export.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1 and message in err[0], err
    assert (tmp_path / "hf" / "notes.txt").read_text() == "mine" and not (tmp_path / "out").exists()


# ------------------------------------------------------------------- the real launchers

@pytest.mark.launch
def test_sigterm_to_the_job_saves_and_the_rerun_on_2_ranks_continues_chapter_01(tmp_path):
    """The README's run, stopped as SLURM stops a job: SIGTERM to every process of the
    4-rank tp2 x pp2 job (torchrun, the trainers, their DataLoader workers), mid-run.
    One line, a checkpoint at the step the ranks agreed on; the README's next command,
    on 2 ranks as FSDP over 2, resumes from it and ends at chapter 01's losses on the
    same global batch of 8, each within 1e-4 relative (measured about 2e-7)."""
    import os
    import signal
    from ch04_runs import THREADS, descendants, resume, steps_logged
    from procs import children
    from test_ch04_slurm import as_slurm_does, job_processes
    steps, flags = 12, [*TINY, "--max-steps", 12, "--ckpt-freq", 100, "--save-dir", tmp_path]
    reference = ch01_run(tmp_path, steps, "ch01", batch=8)
    metrics, log = tmp_path / "run1" / "metrics.jsonl", tmp_path / "job.log"
    # one DataLoader worker per trainer, stopped (SIGSTOP) after step 3: a trainer then waits
    # for its next batch, so the job cannot end before the signal, however busy the machine
    job = start([*readme_command(PAGE, "--tp 2 --pp 2 --batch-size 8 --experiment-name run1"), *flags,
                 "--batch-size", 8, "--num-workers", 1], log, env=THREADS)
    try:
        deadline, held = time.monotonic() + 240, []
        while steps_logged(metrics) < 3 or not held:
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            if steps_logged(metrics) >= 1 and not held:
                held = [p for trainer in children(job.pid) for p in descendants(trainer)]
            time.sleep(0.01)
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        as_slurm_does(job_processes(job.pid), signal.SIGTERM)
        resume(held)
        job.wait(timeout=120)
    finally:
        kill_job(job.pid)
    out = log.read_text()
    lines = [line for line in out.splitlines() if line.startswith("interrupted at step")]
    assert job.returncode != 0 and len(lines) == 1 and "error:" not in out, out[-3000:]
    step = int(lines[0].split()[3])
    assert 3 <= step < steps and f"checkpoint step-{step:08d} saved" in lines[0]
    proc = run([*readme_command(PAGE, "nproc-per-node=2 07-3d-parallelism/train_llm.py --batch-size 4 "
                                      "--experiment-name run1"), *flags], timeout=240)
    assert f"saved by dp 1 x pp 2 x tp 2, sequence parallel): step {step}, epoch 0, {8 * step} samples" \
        in proc.stdout
    got = read_jsonl(metrics)
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in reference], rel=1e-4, abs=0)


@pytest.mark.launch
def test_a_lost_rank_ends_the_other_with_one_line_within_the_timeout(tmp_path):
    """Two machines, one FSDP rank each (dp2): the machine of rank 1 dies whole mid-run,
    and rank 0, inside a collective, stops within --timeout with one line."""
    a_machine_dies(tmp_path, SCRIPT, *TINY)