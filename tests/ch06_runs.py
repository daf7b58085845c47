"""Not tests: what chapter 06's tests and tests/test_mutants.py share, so that a mutant
fails the very check that the real code passes."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_warm, torchrun_cmd


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
