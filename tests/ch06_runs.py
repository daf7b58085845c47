"""Not tests: what chapter 06's tests and tests/test_mutants.py share, so that a mutant
fails the very check that the real code passes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from conftest import NO_GPU, TINY, made_once, python_cmd, read_jsonl, run_warm, torchrun_cmd

# Chapter 06 against chapter 01 with what the other tests leave out: padded samples (a
# mask through the pipeline, a token count all-reduced over dp), gradient accumulation,
# activation checkpointing. 4 ranks as dp 2 x pp 2 (each replica a batch of 2, each of
# its 2 micro-batches one sample), against chapter 01's batch of 4: the same global batch.
SCENARIO = [*TINY, "--padded", "--grad-accum", "2", "--activation-checkpointing", "--max-steps", "3"]
CH06_SCENARIO = ["--batch-size", "2", "--pp", "2"]


def record_p2p(chapter: Path, out: Path) -> list[dict]:
    """Each rank's batches of point-to-point operations, per case (tests/ch06_p2p_order.py)."""
    out.mkdir(parents=True, exist_ok=True)
    run_warm(torchrun_cmd(4, "tests/ch06_p2p_order.py", chapter, out), timeout=300)
    return [json.loads((out / f"p2p-{rank}.json").read_text()) for rank in range(4)]


def completes(batches: list[list]) -> bool:
    """Whether every rank gets through its batches (`batches[r]`: rank r's, in order) when
    a batch completes only once each of its operations meets its match: the n-th send
    from a to b and the n-th receive at b from a, posted (NCCL's rule for sends and
    receives, which a batch fires together). A rank posts one batch at a time."""
    where = {}  # (rank, kind, peer, n) -> the index of the batch it is in
    for rank, mine in enumerate(batches):
        count = {}
        for k, batch in enumerate(mine):
            for kind, peer in batch:
                n = count[kind, peer] = count.get((kind, peer), -1) + 1
                where[rank, kind, peer, n] = k
    pos = [0] * len(batches)

    def matched(rank, kind, peer, n):
        other = (peer, "recv" if kind == "send" else "send", rank, n)
        return other in where and pos[peer] >= where[other]
    while True:
        moved = False
        for rank, mine in enumerate(batches):
            if pos[rank] < len(mine):
                counts, ready = {}, True
                for k in range(pos[rank] + 1):  # the index of each op of the current batch among its kind
                    for kind, peer in mine[k]:
                        n = counts[kind, peer] = counts.get((kind, peer), -1) + 1
                        if k == pos[rank] and not matched(rank, kind, peer, n):
                            ready = False
                if ready:
                    pos[rank], moved = pos[rank] + 1, True
        if all(pos[r] == len(b) for r, b in enumerate(batches)):
            return True
        if not moved:
            return False


def kept_off_plan(measured: dict) -> list[str]:
    """Where the bytes a pipeline stage kept at most (measure.json) are not the
    planner's, per schedule and micro-batch count: none, when the pipeline lets each
    tensor go as soon as its backward and its send are done."""
    return [f"{r['schedule']} m={r['m']}: kept {r['kept_bytes_per_stage']}, planned {r['kept_bytes_planned']}"
            for r in measured["pipeline"] if r["kept_bytes_per_stage"] != r["kept_bytes_planned"]]


def chapter_01_scenario(tmp_path_factory) -> Path:
    """Chapter 01's run of SCENARIO (made once for the whole test session): its folder."""
    def train(out):
        run_warm(python_cmd("01-single-gpu/train_llm.py", *SCENARIO, "--save-dir", out, "--experiment-name", "ch01"),
                 env=NO_GPU)
        return str(out / "ch01")
    return Path(made_once(tmp_path_factory, "ch06-scenario-ch01", train))


def chapter_06_scenario(chapter: Path, out: Path) -> Path:
    """Chapter 06's run of SCENARIO (the script in `chapter`: the real folder or a copy
    with a bug in it): its folder."""
    run_warm(torchrun_cmd(4, chapter / "train_llm.py", *SCENARIO, *CH06_SCENARIO, "--save-dir", out,
                          "--experiment-name", "ch06"), env=NO_GPU)
    return out / "ch06"


def unlike_chapter_01(ch06: Path, ch01: Path) -> list[str]:
    """Where chapter 06's run differs from chapter 01's: each step's loss beyond fp32's
    rounding of a reordered sum (1e-5 relative, chapter 03's tolerance for DDP), its
    gradient norm beyond 1e-3 (chapter 01's is an fp32 sum over the 0.5M-element head
    gradient, this chapter's an fp64 one), a saved weight beyond chapter 03's bounds."""
    got, ref = read_jsonl(ch06 / "metrics.jsonl"), read_jsonl(ch01 / "metrics.jsonl")
    off = [] if [r["step"] for r in got] == [r["step"] for r in ref] else ["the steps differ"]
    for a, b in zip(got, ref):
        if not abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]):
            off.append(f"step {b['step']}: loss {a['loss']} against {b['loss']}")
        if not abs(a["grad_norm"] - b["grad_norm"]) <= 1e-3 * abs(b["grad_norm"]):
            off.append(f"step {b['step']}: gradient norm {a['grad_norm']} against {b['grad_norm']}")
    mine, theirs = (torch.load(d / "model.pt", weights_only=True) for d in (ch06, ch01))
    for k in theirs:
        if not (k in mine and ((mine[k] - theirs[k]).norm() / theirs[k].norm()).item() <= 5e-5
                and (mine[k] - theirs[k]).abs().max().item() <= 2e-4):
            off.append(f"weight {k}")
    return off
