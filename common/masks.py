"""Additive attention masks (0: may look, a large negative number: may not) for the
padded data form; packed sequences take `is_causal=True` with no mask at all.

The padding mask masks *keys* only: blanking a pad query's whole row would make its
softmax 0/0, NaN in a hand-written attention. With keys only, every row keeps a real key
(right padding, and every sample starts with a real token); the loss ignores pad rows.
"""

from __future__ import annotations

import torch


def _neg(dtype: torch.dtype) -> float:
    # the most negative finite value, not -inf: two masks added and clamped stay finite
    return torch.finfo(dtype).min


def create_causal_mask(seq_len: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """(1, 1, T, T): query i may attend to keys 0..i."""
    allowed = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    mask = torch.zeros(seq_len, seq_len, dtype=dtype, device=device)
    return mask.masked_fill(~allowed, _neg(dtype))[None, None]


def create_padding_mask(attention_mask: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """(B, 1, 1, T) from a (B, T) tensor with 1 for real tokens and 0 for padding."""
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
