"""Chapter 01, the baseline: a tiny run learns and writes every documented output; the
script runs however a reader launches it; its data order is DistributedSampler's; its
schedule is warmup + cosine over --max-steps; its AdamW decays the matrices only; its
validation loss is the mean over real target tokens; bad input stops before any work."""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from common.data import IGNORE_INDEX
from common.masks import build_attention_mask
from common.model import LlamaForCausalLM, get_config
from common.metrics import throughput_table
from common.training import build_optimizer, evaluate
from conftest import CH01_STEPS, NO_GPU, REPO, SMALL_CORPUS_FLAGS, TINY, load_script, python_cmd, \
    read_json, read_jsonl, refused, run, run_warm, shuffled_epochs, small_corpus, training_order

SCRIPT = "01-single-gpu/train_llm.py"
FOLDER = REPO / "01-single-gpu"
STEPS = CH01_STEPS  # the session's chapter 01 reference run (conftest's ch01_smoke)
PEAK_LR, WARMUP = 1e-3, 2  # the --lr default and TINY's --warmup-steps
RECORD_KEYS = {"step", "loss", "lr", "tokens_per_s", "data_s", "forward_s", "backward_s", "update_s"}
SUMMARY_KEYS = {"chapter", "world_size", "device_name", "dtype", "preset", "num_params",
                "tokens_per_s", "tokens_per_s_per_device", "step_time_s", "peak_memory_mb",
                "mfu", "final_loss", "val_loss", "torch_version"}
PHASE_KEYS = {"data", "forward", "backward", "update", "total"}


def train_args(save_dir, name, steps, *extra):
    return [*TINY, "--max-steps", steps, "--save-dir", save_dir, "--experiment-name", name, *extra]


@pytest.fixture(scope="module")
def smoke(ch01_smoke):
    """One 40-step run of the tiny preset, from the repo root with plain python (shared
    with chapter 02's tests, which must reproduce it)."""
    return ch01_smoke


def test_loss_falls_over_the_run(smoke):
    _, _, records, _ = smoke
    losses = [r["loss"] for r in records]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"mean loss of the first 5 steps {first:.3f}, of the last 5 {last:.3f}"


def test_every_output_is_written_with_its_documented_fields(smoke):
    _, run_dir, records, summary = smoke
    # .owner: the lock that keeps a second job out of the folder
    assert {p.name for p in run_dir.iterdir()} == {".owner", "metrics.jsonl", "summary.json", "model.pt"}
    for r in records:
        assert RECORD_KEYS <= r.keys(), RECORD_KEYS - r.keys()
        assert r["tokens_per_s"] > 0 and min(r[f"{p}_s"] for p in ("forward", "backward", "update")) > 0
    assert SUMMARY_KEYS <= summary.keys(), SUMMARY_KEYS - summary.keys()
    assert set(summary["step_time_s"]) == PHASE_KEYS
    assert summary["step_time_s"]["total"] == pytest.approx(
        sum(summary["step_time_s"][p] for p in PHASE_KEYS - {"total"}))
    assert (summary["chapter"], summary["world_size"], summary["preset"], summary["dtype"]) == \
        ("01-single-gpu", 1, "tiny", "fp32")
    assert summary["torch_version"] == torch.__version__
    assert summary["final_loss"] == records[-1]["loss"]
    assert math.isfinite(summary["val_loss"])
    assert summary["tokens_per_s"] > 0 and summary["tokens_per_s_per_device"] == summary["tokens_per_s"]
    assert summary["peak_memory_mb"] > 0


def test_validation_reads_val_batches_batches(smoke):
    proc, *_ = smoke
    assert "over 2 batches" in proc.stdout  # TINY's --val-batches 2, not the whole split


def test_model_pt_is_a_plain_state_dict_of_the_llama_model(smoke):
    _, run_dir, _, summary = smoke
    state = torch.load(run_dir / "model.pt", weights_only=True)
    model = LlamaForCausalLM(get_config("tiny", summary["data"]["vocab_size"]))
    model.load_state_dict(state, strict=True)
    assert sum(p.numel() for p in model.parameters()) == summary["num_params"]


def test_stdout_ends_with_the_throughput_table(smoke):
    proc, run_dir, _, summary = smoke
    assert proc.stdout.endswith(f"\n{throughput_table(summary)}\n\noutputs in {run_dir}\n")


def test_lr_warms_up_then_decays_by_cosine_to_a_tenth_at_max_steps(smoke):
    _, _, records, _ = smoke
    # The logged lr is the one the next step will use: peak x lr_lambda(step).
    from common.training import lr_lambda
    f = lr_lambda(WARMUP, STEPS)
    assert [r["lr"] for r in records] == pytest.approx([PEAK_LR * f(r["step"]) for r in records])
    assert records[-1]["lr"] == pytest.approx(0.1 * PEAK_LR)  # total steps = --max-steps

    f = lr_lambda(10, 110)
    assert [f(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    decay = [f(s) for s in range(10, 111)]
    assert decay[0] == 1.0 and all(a > b for a, b in zip(decay, decay[1:]))
    assert f(60) == pytest.approx(0.55)            # halfway down the cosine
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_adamw_decays_the_matrices_only_with_betas_0_9_and_0_95():
    """Part 7's optimizer: AdamW with betas (0.9, 0.95) and weight decay on matrices only.
    A step with zero gradients moves a weight by its decay alone (Adam's term is 0): every
    matrix shrinks by lr x weight decay, and the norm weights stay as they are."""
    lr, weight_decay = 1e-2, 0.1
    model = LlamaForCausalLM(get_config("tiny", 300))
    optimizer = build_optimizer(model, lr, weight_decay, "cpu")
    assert optimizer.defaults["betas"] == (0.9, 0.95)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    norms = [name for name, p in model.named_parameters() if p.dim() < 2]
    assert norms and all("norm" in name for name in norms)
    for name, p in model.named_parameters():
        kept = 1.0 if name in norms else 1 - lr * weight_decay
        torch.testing.assert_close(p.detach(), before[name] * kept, rtol=1e-6, atol=0, msg=name)


def test_validation_loss_is_the_mean_over_every_real_target_token():
    """evaluate: the loss per real target token over the --val-batches batches it reads
    (a batch with fewer real targets weighs less: not a mean of the batches' means), with
    padded batches masked, and the model back in training mode."""
    torch.manual_seed(0)
    model, pad = LlamaForCausalLM(get_config("tiny", 300)), 0
    x = torch.randint(1, 300, (3, 2, 16))
    x[0, :, 5:] = pad  # batch 0: 10 real targets; batch 1: 16 + 9
    x[1, 1, 10:] = pad
    y = torch.where(x.roll(-1, dims=-1) == pad, IGNORE_INDEX, x.roll(-1, dims=-1))
    data = SimpleNamespace(packed=False, pad_id=pad)
    loss, batches = evaluate(model, list(zip(x, y)), data, "cpu", nullcontext(), max_batches=2)
    with torch.no_grad():
        sums = [F.cross_entropy(model(xb, build_attention_mask(xb, pad)).flatten(0, 1), yb.flatten(),
                                ignore_index=IGNORE_INDEX, reduction="sum") for xb, yb in zip(x[:2], y[:2])]
    assert batches == 2 and loss == pytest.approx(float(sum(sums)) / int((y[:2] != IGNORE_INDEX).sum()), rel=1e-5)
    assert model.training


@pytest.mark.parametrize("n, seed", [(10, 0), (97, 1), (1000, 1234)])
def test_data_order_is_a_fresh_seeded_shuffle_every_epoch(n, seed):
    """Chapter 01's DistributedSampler with one replica is exactly randperm(seed + epoch),
    and two ranks' orders interleave into it: chapter 03 splits the very same order."""
    one = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    halves = [DistributedSampler(range(n), num_replicas=2, rank=r, shuffle=True, seed=seed,
                                 drop_last=True) for r in (0, 1)]
    orders = []
    for epoch in range(4):
        for s in (one, *halves):
            s.set_epoch(epoch)
        expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        orders.append(list(one))
        assert orders[-1] == expected
        a, b = list(halves[0]), list(halves[1])
        assert [x for pair in zip(a, b) for x in pair] == expected[: 2 * (n // 2)]
    assert len({tuple(o) for o in orders}) == len(orders)  # a new order every epoch


def test_the_script_trains_on_a_fresh_seeded_shuffle_every_epoch(tmp_path):
    """The script itself, over three epochs of a 13-sample corpus (3 steps of 4 each):
    the samples it reads are randperm(seed + epoch), epoch after epoch, in whole batches.
    A script that forgot sampler.set_epoch(epoch) would repeat epoch 0's order."""
    steps, seed = 7, 5
    [order] = training_order(tmp_path, python_cmd, SCRIPT, *train_args(
        tmp_path, "order", steps, "--dataset-name", small_corpus(tmp_path), *SMALL_CORPUS_FLAGS,
        "--seed", seed, "--val-batches", 1))
    n = read_json(tmp_path / "order" / "summary.json")["data"]["train_samples"]
    assert n == 13
    assert order == shuffled_epochs(n, seed, epochs=3, batch=4)[0][: steps * 4]


@pytest.mark.launch
@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_runs_from_inside_the_chapter_folder(tmp_path, launcher):
    """`python train_llm.py` and `torchrun --nproc-per-node=1 train_llm.py` in the
    chapter's folder. The python run also trains the padded form with --grad-accum 2
    (the README's two other python commands, in one run)."""
    if launcher == "python":
        cmd, extra = [sys.executable, "train_llm.py"], ["--padded", "--grad-accum", "2"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=1", "train_llm.py"]
        extra = []
    run([*cmd, *train_args(tmp_path, "here", 3, *extra)], cwd=FOLDER)
    summary = read_json(tmp_path / "here" / "summary.json")
    assert summary["launcher"] == launcher and summary["world_size"] == 1
    assert summary["data"]["form"] == ("padded" if extra else "packed")
    assert summary["grad_accum"] == (2 if extra else 1)
    assert summary["global_batch_size"] == 4 * summary["grad_accum"]
    assert math.isfinite(summary["final_loss"]) and math.isfinite(summary["val_loss"])
    assert [r["step"] for r in read_jsonl(tmp_path / "here" / "metrics.jsonl")] == [1, 2, 3]


def test_two_processes_are_refused(tmp_path, monkeypatch, capsys):
    """Under torchrun with 2 processes (WORLD_SIZE=2) the parser refuses; that a torchrun
    worker's one line reaches the user is test_cli's end-to-end torchrun refusal."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", [str(REPO / SCRIPT)])  # the line names the script that runs
    save_dir = tmp_path / "out"
    line = refused(capsys, load_script(SCRIPT).parse_args, train_args(save_dir, "two", 3))
    assert "error: 01-single-gpu trains in one process; launch it with `python 01-single-gpu/train_llm.py`" in line
    assert not save_dir.exists()


REFUSALS = {  # case: (extra flags, environment, words the one line must hold)
    "batch-size-0": (["--batch-size", "0"], {}, "--batch-size: must be a whole number >= 1"),
    "seq-longer-than-preset": (["--seq-length", "100000"], {}, "--seq-length 100000 exceeds"),
    "negative-lr": (["--lr", "-1"], {}, "--lr: must be a finite number > 0"),
    "infinite-lr": (["--lr", "inf"], {}, "--lr: must be a finite number > 0"),
    "negative-max-steps": (["--max-steps", "-1"], {}, "--max-steps: must be a whole number >= 0"),
    "unknown-preset": (["--model-preset", "nope"], {}, "--model-preset: unknown 'nope'"),
    "missing-local-dataset": (["--dataset-name", "./missing/*.txt"], {}, "does not exist"),
    # an endpoint that refuses at once: the reachability probe fails without waiting
    "unreachable-hub": (["--dataset-name", "someone/some-dataset"],
                        {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0",
                         "HF_DATASETS_OFFLINE": "0"}, "cannot reach the Hugging Face hub"),
    "cuda-without-gpus": (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""}, "CUDA is not available"),
    "existing-run-folder": ([], {}, "already exists and is not empty"),
    "bad-threads": ([], {"LLM_GUIDE_THREADS": "0"}, "LLM_GUIDE_THREADS='0': must be a whole number >= 1"),
}
EXISTING = "an earlier run's notes\n"


def assert_nothing_created(case, save_dir):
    if case == "existing-run-folder":
        assert [p.relative_to(save_dir).as_posix() for p in sorted(save_dir.rglob("*"))] == \
            ["exp", "exp/notes.txt"]
        assert (save_dir / "exp" / "notes.txt").read_text() == EXISTING
    else:
        assert not save_dir.exists()


# Refused after parsing, by the data loading that starts main() (run_main turns its
# DataError into the one line): launched for real, as the user runs it. It is also the
# suite's end-to-end proof that a refusal leaves the python process with status 2, one
# line and nothing on disk; every other case is the parser's, checked in this process.
END_TO_END = "unreachable-hub"


@pytest.mark.parametrize("case", [c for c in REFUSALS if c != END_TO_END])
def test_bad_input_exits_2_with_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys, case):
    flags, env, words = REFUSALS[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    save_dir = tmp_path / case
    if case == "existing-run-folder":
        (save_dir / "exp").mkdir(parents=True)
        (save_dir / "exp" / "notes.txt").write_text(EXISTING)
    line = refused(capsys, load_script(SCRIPT).parse_args, train_args(save_dir, "exp", 5, *flags))
    assert words in line
    assert_nothing_created(case, save_dir)


@pytest.mark.launch
def test_bad_input_end_to_end_exits_2_with_one_line_and_creates_nothing(tmp_path):
    flags, env, words = REFUSALS[END_TO_END]
    save_dir = tmp_path / END_TO_END
    proc = run(python_cmd(SCRIPT, *train_args(save_dir, "exp", 5, *flags)), env=env, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], proc.stderr
    assert_nothing_created(END_TO_END, save_dir)


def test_compiled_and_eager_training_agree(smoke, tmp_path):
    """--compile (inductor, model and loss as one graph) trains what eager trains: the
    same losses as the eager reference run over its 40 steps, to within 1e-4 relative.
    Kernels fuse and reorder float additions, so the match is to rounding (about 1e-7
    per step, growing slowly through AdamW), not bit for bit. (The suite's one compile.)
    The compiled run also checkpoints its layers' activations (--activation-checkpointing,
    which changes no number: test_model.py), so the two compile together."""
    eager, _, records, _ = smoke
    compiled = run_warm(python_cmd(SCRIPT, *train_args(tmp_path, "compiled", STEPS, "--compile",
                                                  "--activation-checkpointing")),
                   env=NO_GPU, timeout=600)
    a = [r["loss"] for r in records]
    b = [r["loss"] for r in read_jsonl(tmp_path / "compiled" / "metrics.jsonl")]
    assert len(a) == len(b) == STEPS and b == pytest.approx(a, rel=1e-4)
    print(f"\ncompiled vs eager over {STEPS} steps: largest loss rel diff "
          f"{max(abs(x - y) / y for x, y in zip(b, a)):.1e}")
    summary = read_json(tmp_path / "compiled" / "summary.json")
    assert summary["compiled"] and summary["compile_s"] > 0 and summary["activation_checkpointing"]
    assert "| torch.compile" in compiled.stdout and "| torch.compile" not in eager.stdout
    assert "| activation checkpointing" in compiled.stdout and "| activation checkpointing" not in eager.stdout


def test_a_diverging_run_stops_with_one_line_and_keeps_what_it_made(tmp_path):
    """--lr 1e30 passes the flag checks (finite, positive) and the loss turns NaN within a
    few steps: the run says at which step in one line, exit status 1, and keeps its
    metrics and a summary naming the step."""
    proc = run_warm(python_cmd(SCRIPT, *train_args(tmp_path, "div", 20, "--lr", "1e30",
                                               "--warmup-steps", "0")), check=False)
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("error: the loss is nan at step ") and "the run diverged" in line
    step = int(line.split("at step ")[1].split(":")[0])
    summary = read_json(tmp_path / "div" / "summary.json")
    assert summary["diverged_at_step"] == step < 20
    assert read_jsonl(tmp_path / "div" / "metrics.jsonl")[-1]["step"] == step


def test_max_steps_ends_the_run_whatever_num_epochs_says(tmp_path):
    """--max-steps wins: 10**12 epochs do not make the run spin after its last step, and
    steps beyond one epoch run on into the next epochs."""
    run_warm(python_cmd(SCRIPT, *train_args(tmp_path, "many-epochs", 3, "--num-epochs", 10**12)),
        timeout=120)
    assert [r["step"] for r in read_jsonl(tmp_path / "many-epochs" / "metrics.jsonl")] == [1, 2, 3]
    small = small_corpus(tmp_path)  # 13 samples: one epoch is 3 steps of 4
    proc = run_warm(python_cmd(SCRIPT, *train_args(tmp_path, "epochs", 5, "--dataset-name", small,
                                               *SMALL_CORPUS_FLAGS)))
    assert "training 5 steps (" in proc.stdout
    records = read_jsonl(tmp_path / "epochs" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and records[-1]["epoch"] >= 1


def test_a_full_disk_at_the_final_save_is_one_line_and_leaves_no_truncated_weights(small_disk):
    """A 2 MB disk takes the metrics, not the 4.5 MB model.pt: exit status 1, one line
    naming the cause, no traceback, and no half-written model.pt a later load would trust."""
    disk = small_disk(2 << 20)
    proc = run_warm(python_cmd(SCRIPT, *train_args(disk, "full", 2)), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: disk full while saving {disk / 'full' / 'model.pt'}"), errors
    assert {p.name for p in (disk / "full").iterdir()} == {".owner", "metrics.jsonl"}
