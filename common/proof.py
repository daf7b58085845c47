"""Comparisons behind chapter 05's "proven equal" claims (data parallelism and sharding
rebuilt from collectives, against DDP), and the rounding bound they are held to.

- `max_over_ranks`: the largest of every rank's number (a collective).
- `max_relative_difference`, `max_abs_difference`: two sets of tensors on one rank.
- `max_difference_to_rank0`: are the ranks' copies identical? (a collective)
- `adam_step_bound`: how far summation order alone can move AdamW's weights in one step.
- `exact_kernels`: deterministic kernels and no TF32 while a proof runs.

Every tensor a collective here sends lives on the device the caller's tensors (or
`device`) name: nccl takes only GPU tensors, gloo CPU ones.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .environment import set_tf32, tf32_enabled


def max_over_ranks(value: float, device) -> float:
    """The largest of every rank's `value` (a collective: every rank calls it), sent as a
    tensor on `device`, the process group's device."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


@torch.no_grad()
def max_relative_difference(params, reference) -> float:
    """max over tensors of ||a - b|| / ||b|| on this rank: 0.0 when equal. A per-tensor
    norm, not a per-element maximum: Adam divides by the root of its second moment, so an
    element whose gradients nearly cancel across ranks turns rounding into a visible
    difference, while a real bug moves whole tensors."""
    worst = 0.0
    for a, b in zip(params, reference):
        worst = max(worst, ((a - b).norm() / (b.norm() + 1e-30)).item())
    return worst


@torch.no_grad()
def max_abs_difference(params, reference) -> float:
    """max over all elements of |a - b| on this rank: 0.0 when equal."""
    return max(((a - b).abs().max().item() for a, b in zip(params, reference) if a.numel()), default=0.0)


@torch.no_grad()
def max_difference_to_rank0(tensors) -> float:
    """Largest |x - rank 0's x| over all elements and ranks (a collective): 0.0 means
    identical copies. Sent on the tensors' own device."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    return max_over_ranks((flat - ref).abs().max().item(), flat.device)


def adam_ratio_bound(betas: tuple[float, float], step: int) -> float:
    """An upper bound on |m_hat / sqrt(v_hat)| at AdamW step `step` (1-based), whatever
    the gradients: Cauchy-Schwarz on m = (1-b1) sum b1^k g_k against v = (1-b2) sum b2^k
    g_k^2. It is 1 at step 1 (the update is sign(g)) and stays near 1 for b1^2 < b2."""
    b1, b2 = betas
    series = sum((b1 * b1 / b2) ** k for k in range(step))
    return (1 - b1) * math.sqrt((1 - b2 ** step) * series) / ((1 - b1 ** step) * math.sqrt(1 - b2))


def adam_step_bound(world: int, dtype: torch.dtype, lr: float, step: int, max_grad: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> float:
    """The largest |w - w_ddp| per weight element that summation order alone can cause in
    AdamW step `step` (1-based) taken from the same weights and moments (the chapter 05
    README derives it):

    - each rank's gradient, divided by N, is summed over N ranks in an order that differs
      between the modes; with N <= 2 the sum is the same (a + b = b + a, halving is
      exact), so the bound is 0. Otherwise each sum is off by at most (N-1) u |terms|
      (u: the dtype's unit of rounding), plus one rounding of the division: two modes
      differ by at most delta = 2 N u G, G the largest gradient element any rank made;
    - AdamW's update lr * m_hat / (sqrt(v_hat) + eps) moves by at most
      lr * (1 + A_t) * delta / eps for such a change (eps bounds the amplification near
      zero gradients; A_t = adam_ratio_bound), and never by more than 2 lr A_t.

    One step only: over several steps a weight moved by rounding also changes the next
    gradients, which no such bound follows (a trajectory can amplify it step after step),
    so a proof compares every step from the same state."""
    if world <= 2:
        return 0.0
    delta = 2 * world * (torch.finfo(dtype).eps / 2) * max_grad
    ratio = adam_ratio_bound(betas, step)
    return lr * min((1 + ratio) * delta / eps, 2 * ratio)


@contextmanager
def exact_kernels():
    """While a proof runs: deterministic kernels (no atomics whose order varies between
    runs) wherever torch has one (warn_only: an operation without one warns and runs as
    usual) and, on GPUs, no TF32 in fp32 matmuls. Restored afterwards, so that timed steps
    run at the chapters' usual speed."""
    # read by cuBLAS when it starts; the proof runs first, so this is in time
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), tf32_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    set_tf32(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        set_tf32(before[2])
