"""Attention masks: SDPA-ready shapes, keys-only padding, no NaN, and padding that
changes nothing at the real positions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.masks import (build_attention_mask, combine_masks, create_causal_mask,
                          create_padding_mask)
from common.model import LlamaForCausalLM, get_config

PAD = 0
VOCAB = 61
NEG = torch.finfo(torch.float32).min


def padded_batch(lengths: list[int], T: int, seed: int = 0) -> torch.Tensor:
    """Right-padded batch of random real tokens (never PAD) with the given lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(lengths), T), generator=g)
    for row, n in enumerate(lengths):
        ids[row, n:] = PAD
    return ids


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(get_config("tiny", VOCAB))


def eager_attention(q, k, v, mask):
    """The textbook attention many codebases copy: softmax(QK^T/sqrt(d) + mask) V."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask
    return torch.softmax(scores, dim=-1) @ v


def test_shapes_and_values():
    causal = create_causal_mask(4)
    assert causal.shape == (1, 1, 4, 4)
    allowed = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    assert torch.equal(causal[0, 0] == 0, allowed)
    assert (causal[0, 0][~allowed] == NEG).all()

    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    padding = create_padding_mask(keep)
    assert padding.shape == (2, 1, 1, 5)
    assert torch.equal(padding[:, 0, 0] == 0, keep.bool())

    ids = padded_batch([3, 5], T=5)
    full = build_attention_mask(ids, PAD, dtype=torch.float64)
    assert full.shape == (2, 1, 5, 5) and full.dtype == torch.float64
    assert torch.isfinite(full).all()

    # broadcasts against SDPA's (batch, heads, queries, keys) scores as it is
    q = k = v = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    assert F.scaled_dot_product_attention(q, k, v, attn_mask=full).shape == (2, 4, 5, 8)


def test_padding_masks_keys_only():
    ids = padded_batch([3], T=6)
    mask = build_attention_mask(ids, PAD)[0, 0]       # (queries, keys)
    # pad keys (columns 3..5) are masked for every query ...
    assert (mask[:, 3:] == NEG).all()
    # ... but pad queries (rows 3..5) still see every real key: no row is all masked
    assert (mask[3:, :3] == 0).all()
    assert ((mask == 0).sum(-1) >= 1).all()
    # real queries see exactly the causal real keys
    assert torch.equal(mask[:3, :3] == 0, torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_combined_masks_stay_finite():
    both = combine_masks(create_causal_mask(3), create_padding_mask(torch.tensor([[1, 0, 0]])))
    # a key masked twice (causal and padding) sums past float32's range without the clamp
    assert torch.isfinite(both).all()
    assert both[0, 0, 0, 2] == NEG


def test_padded_attention_equals_unpadded_at_real_positions_sdpa():
    T, H, D = 9, 2, 8
    lengths = [9, 5, 1]
    ids = padded_batch(lengths, T)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(len(lengths), H, T, D, generator=g) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=build_attention_mask(ids, PAD))
    for b, n in enumerate(lengths):
        alone = F.scaled_dot_product_attention(q[b:b + 1, :, :n], k[b:b + 1, :, :n],
                                               v[b:b + 1, :, :n], is_causal=True)
        torch.testing.assert_close(out[b:b + 1, :, :n], alone, rtol=1e-5, atol=1e-6)


def test_padded_logits_equal_unpadded_logits_at_real_positions():
    model = tiny_model().eval()
    lengths = [12, 7, 3]
    ids = padded_batch(lengths, T=12)
    with torch.no_grad():
        padded = model(ids, build_attention_mask(ids, PAD))
        for b, n in enumerate(lengths):
            alone = model(ids[b:b + 1, :n])              # the fast, mask-free path
            torch.testing.assert_close(padded[b:b + 1, :n], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_padded_batch_gives_no_nan_in_outputs_or_gradients(autocast):
    model = tiny_model()
    ids = padded_batch([10, 4, 1], T=10)
    targets = torch.roll(ids, -1, dims=1)
    targets[ids == PAD] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(ids, build_attention_mask(ids, PAD))
        loss = F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1), ignore_index=-100)
    loss.backward()
    assert torch.isfinite(logits).all()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_a_mask_that_also_blanks_pad_rows_produces_nan():
    """Why ours masks keys only. The widely copied mask blanks pad *queries* as well
    (keep[:, None, :, None] * keep[:, None, None, :], with -inf): a pad query's row then
    has every key at -inf, softmax is 0/0, and NaN reaches outputs and gradients.
    (Some SDPA kernels in recent PyTorch special-case fully masked rows; eager attention
    and other kernels do not, so the mask itself must never produce such a row.)"""
    ids = padded_batch([4, 6], T=6)
    keep = (ids != PAD).float()
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    both = keep[:, None, :, None] * keep[:, None, None, :]
    widely_copied = torch.zeros(2, 1, 6, 6).masked_fill(~(causal & both.bool()), float("-inf"))

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 6, 8, generator=g, requires_grad=True)
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)

    bad = eager_attention(q, k, v, widely_copied)
    assert torch.isnan(bad[0, :, 4:]).all()       # the pad rows of the first sample
    bad.sum().backward()
    assert torch.isnan(q.grad).any()

    q.grad = None
    ours = eager_attention(q, k, v, build_attention_mask(ids, PAD))
    ours.sum().backward()
    assert torch.isfinite(ours).all() and torch.isfinite(q.grad).all()
    # and at the real positions both masks agree
    torch.testing.assert_close(ours[0, :, :4], bad[0, :, :4].detach())
    # current SDPA returns 0, not NaN, for a fully masked row (what the READMEs say)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.detach(), k, v, attn_mask=widely_copied)
    assert torch.isfinite(sdpa).all() and (sdpa[0, :, 4:] == 0).all()
