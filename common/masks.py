"""Additive attention masks for `F.scaled_dot_product_attention`.

Only the padded data form needs them: packed sequences have no padding and take the
`is_causal=True` fast path with no mask tensor at all.

A mask here is a float tensor added to the attention scores: 0 where a query may look
at a key, a very large negative number where it may not. Shapes broadcast against the
scores `(batch, heads, queries, keys)`:

    causal   (1, 1, T, T)
    padding  (B, 1, 1, T)   masks *keys* only
    combined (B, 1, T, T)

Why keys only: if the padding mask also blanked the *rows* of pad queries, those rows
would have every key masked. In a hand-written attention, softmax over all -inf is 0/0
and NaN spreads into the outputs and the gradients; current `scaled_dot_product_attention`
returns 0 for such a row instead, so the NaN appears only with hand-written attention or
older kernels. Masking keys only leaves every row at least one real key (right padding,
and every sample starts with a real token), which is right with any kernel; the pad rows
compute something harmless and the loss ignores their targets.
"""

from __future__ import annotations

import torch


def _neg(dtype: torch.dtype) -> float:
    # The most negative finite value, not -inf: adding two masks then clamping stays
    # finite. (Cast to bf16 for autocast it may round to -inf; harmless, since every
    # row keeps at least one real key.)
    return torch.finfo(dtype).min


def create_causal_mask(seq_len: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """(1, 1, T, T): query i may attend to keys 0..i."""
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, _neg(dtype))[None, None]


def create_padding_mask(attention_mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(B, 1, 1, T) from a (B, T) tensor with 1 for real tokens and 0 for padding.
    Masks keys only (see the module docstring)."""
    keep = attention_mask.bool()[:, None, None, :]
    mask = torch.zeros(keep.shape, dtype=dtype, device=attention_mask.device)
    return mask.masked_fill(~keep, _neg(dtype))


def combine_masks(*masks: torch.Tensor) -> torch.Tensor:
    """Sum of additive masks, clamped so that masked + masked stays finite."""
    out = masks[0]
    for m in masks[1:]:
        out = out + m
    return out.clamp(min=_neg(out.dtype))


def build_attention_mask(input_ids: torch.Tensor, pad_id: int, dtype=torch.float32) -> torch.Tensor:
    """Causal + key-padding mask (B, 1, T, T) for a right-padded batch."""
    causal = create_causal_mask(input_ids.shape[1], dtype=dtype, device=input_ids.device)
    padding = create_padding_mask(input_ids != pad_id, dtype=dtype)
    return combine_masks(causal, padding)
