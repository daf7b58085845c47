"""Chapter 08: context parallelism. The sequence splits (balanced: each rank one chunk
from the head and one from the tail) and their attention blocks; ring attention and the
all-to-all variant equal one process's attention in fp64, output and gradients, on 2 and
3 ranks; a merge without the log-sum-exp rescale, and a causal mask off by a block,
fail that proof."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import REPO, chapter_module, read_json, run_warm, torchrun_cmd

FOLDER = "08-context-parallel"
PROVE = f"{FOLDER}/prove.py"
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
    position. Balanced, every rank attends the same number of pairs; contiguous, the
    last rank attends 2 cp - 1 times the first rank's, in the limit of long chunks."""
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
        c = split.chunk  # 2c tokens a rank: its own block c(2c+1) pairs, each earlier one 4c^2
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


# ------------------------------------------------------------------ the proofs, warm ranks

def prove(tmp_path, ranks, *flags, folder=REPO / FOLDER, check=True):
    proc = run_warm(torchrun_cmd(ranks, folder / "prove.py", *flags, "--save-dir", tmp_path,
                                 "--experiment-name", "proof"), timeout=300, check=check)
    return proc, read_json(tmp_path / "proof" / "prove.json")


@pytest.mark.parametrize("ranks", [2, 3])
def test_split_attention_equals_one_process_output_and_gradients(tmp_path, ranks):
    """Ring attention (both splits) and, where cp divides the heads, all-to-all: output
    and the gradients of q, k and v within the tolerance of one process's, in fp64;
    the ring's merge reorders sums (rounding seen, not zero)."""
    proc, result = prove(tmp_path, ranks)
    assert result["passed"] and "OK: on" in proc.stdout, proc.stderr[-3000:]
    expected = ["ring, balanced", "ring, contiguous"] + ["all-to-all, balanced", "all-to-all, contiguous"] * (ranks == 2)
    assert list(result["attention"]) == expected
    for name, r in result["attention"].items():
        assert all(v <= 1 for v in r.values()), (name, r)
        assert (max(r.values()) > 0) == name.startswith("ring"), (name, r)


MUTANTS = {
    # the partial outputs added as they are, without exp(lse - joint lse)
    "no log-sum-exp rescale": (
        "    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)",
        "    out = out + block_out"),
    # each rank's block rule applied to the block one hop behind: the diagonal's causal
    # mask lands on the previous rank's keys, and the own keys get an off-diagonal rule
    "causal mask off by a block": ("        if source == rank:\n", "        if source == (rank - 1) % self.cp:\n"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_wrong_merge_or_mask_fails_the_proof(tmp_path, mutant):
    """context_parallel.py with one bug, in a copy of the chapter's folder: the ring's
    proof fails on 2 ranks, by far more than the tolerance."""
    copy = tmp_path / "chapter"
    shutil.copytree(REPO / FOLDER, copy, ignore=shutil.ignore_patterns("__pycache__", "*.md"))
    source = copy / "context_parallel.py"
    text, (old, new) = source.read_text(), MUTANTS[mutant]
    assert text.count(old) == 1, mutant
    source.write_text(text.replace(old, new))
    proc, result = prove(tmp_path, 2, folder=copy, check=False)
    assert proc.returncode == 1 and not result["passed"], proc.stderr[-3000:]
    ring = {k: v for k, v in result["attention"].items() if k.startswith("ring")}
    assert all(max(r.values()) > 1e6 for r in ring.values()), ring
    assert "FAILED: ring, balanced: output differs from one process's" in proc.stderr
