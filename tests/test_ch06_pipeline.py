"""Chapter 06's from-scratch pipeline talks to its neighbours in an order that cannot
deadlock, on NCCL too: every rank's point-to-point operations, recorded in a run of
2, 3 and 4 stages (tests/ch06_p2p_order.py), are pinned for one case, pair each
steady-state send with its receive, and run to the end under NCCL's rule that a send
waits until its receive is posted. The schedule's bubble, replayed from durations,
is the formula when the stages are equal."""

from __future__ import annotations

import pytest

from ch06_runs import completes, record_p2p
from conftest import REPO, load_script

SCHEDULE_CASES = [(schedule, p, m) for schedule in ("gpipe", "1f1b") for p in (2, 3, 4) for m in (1, 2, 3, 5)]


@pytest.fixture(scope="module")
def p2p(tmp_path_factory):
    return record_p2p(REPO / "06-model-parallel", tmp_path_factory.mktemp("p2p"))


def test_1f1b_pairs_each_steady_state_send_with_its_receive(p2p):
    """Two stages, three micro-batches: stage 0 sends micro-batch 0's activations alone
    (its warm-up forward), then fires each later activation together with the receive
    of a gradient; stage 1 fires each gradient together with the receive of the next
    activations. One batch each, waited for at once: no send waits on its own."""
    assert p2p[0]["1f1b p2 m3"] == [[["send", 1]], [["send", 1], ["recv", 1]], [["send", 1], ["recv", 1]],
                                     [["recv", 1]]]
    assert p2p[1]["1f1b p2 m3"] == [[["recv", 0]], [["send", 0], ["recv", 0]], [["send", 0], ["recv", 0]],
                                     [["send", 0]]]
    for p in (2, 3, 4):  # every stage but the last: its m - (p - s - 1) steady-state pairs, and no unpaired ones
        for s in range(p - 1):
            batches = p2p[s][f"1f1b p{p} m5"]
            paired = [b for b in batches if ["send", s + 1] in b and ["recv", s + 1] in b]
            assert len(paired) == 5 - (p - s - 1), (p, s, batches)


@pytest.mark.parametrize("schedule, p, m", SCHEDULE_CASES, ids=lambda c: str(c))
def test_every_schedule_runs_to_the_end_where_a_send_waits_for_its_receive(p2p, schedule, p, m):
    batches = [p2p[rank][f"{schedule} p{p} m{m}"] for rank in range(p)]
    for rank in range(p):  # m activations forward and m gradients back, over each link
        ops = [op for b in batches[rank] for op in b]
        assert sorted(ops) == sorted([["send", rank + 1]] * m * (rank < p - 1) + [["recv", rank + 1]] * m * (rank < p - 1)
                                     + [["send", rank - 1]] * m * (rank > 0) + [["recv", rank - 1]] * m * (rank > 0))
    assert completes(batches), batches


def test_sends_issued_apart_from_their_receive_would_deadlock():
    """The order the chapter had before: each stage sends (isend), then receives in a
    call of its own. Under NCCL's rule the two stages of 1F1B's steady state wait on
    each other's send: the check above would catch it."""
    stage0 = [[["send", 1]], [["send", 1]], [["recv", 1]], [["send", 1]], [["recv", 1]], [["recv", 1]]]
    stage1 = [[["recv", 0]], [["send", 0]], [["recv", 0]], [["send", 0]], [["recv", 0]], [["send", 0]]]
    assert not completes([stage0, stage1])
    assert completes([[[["send", 1]]], [[["recv", 0]]]])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_replayed_bubble_of_equal_stages_is_the_formula(schedule):
    """measure.py's replay: forwards of 1, backwards of 2 time units on every stage give
    (p - 1) / (m + p - 1) exactly, for 2 to 4 stages and 1 to 8 micro-batches; a stage
    twice as slow as the others makes the others wait, not itself."""
    measure = load_script("06-model-parallel/measure.py")
    for p in (2, 3, 4):
        for m in (1, 2, 4, 8):
            actions = [measure.SCHEDULES[schedule](m, p, s) for s in range(p)]
            length, busy = measure.replay(actions, [[1.0 if k == "F" else 2.0 for k, _ in a] for a in actions])
            assert 1 - max(busy) / length == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)
    actions = [measure.SCHEDULES[schedule](8, 2, s) for s in range(2)]
    length, busy = measure.replay(actions, [[1.0 if k == "F" else 2.0 for k, _ in actions[0]],
                                            [2.0 if k == "F" else 4.0 for k, _ in actions[1]]])
    assert busy == [24.0, 48.0] and length == pytest.approx(48.0 + 3.0)  # stage 0's first forward and last backward
