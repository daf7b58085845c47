"""Comparisons behind the guide's "proven equal" claims (chapter 05's rebuilt data
parallelism against DDP): how far apart two sets of parameters are, and whether the
replicas of one model on all ranks are identical."""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def max_relative_difference(params, reference) -> float:
    """max over tensors of ||a - b|| / ||b||: 0.0 when equal. A per-tensor norm, not a
    per-element maximum: Adam divides by the root of its second moment, so an element
    whose gradients nearly cancel across ranks turns rounding into a visible difference,
    while a real bug moves whole tensors."""
    worst = 0.0
    for a, b in zip(params, reference):
        worst = max(worst, ((a - b).norm() / (b.norm() + 1e-30)).item())
    return worst


@torch.no_grad()
def max_difference_to_rank0(model) -> float:
    """Largest |parameter - rank 0's parameter| over all ranks (a collective): 0.0 means
    identical replicas."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    diff = (flat - ref).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def worst_over_ranks(value: float, device) -> float:
    """The largest of every rank's `value` (a collective)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
