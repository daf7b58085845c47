"""Comparisons behind chapter 05's "proven equal" claims (data parallelism and sharding
rebuilt from collectives, against DDP), and the rounding bound they are held to.

- `max_over_ranks`: the largest of every rank's number (a collective).
- `max_relative_difference`, `max_abs_difference`: two sets of tensors on one rank.
- `max_difference_to_rank0`: are the ranks' copies identical? (a collective)
- `first_not_finite`, `stop_if_not_finite`, `NotFinite`: the first tensor that holds a NaN or an
  infinity, by name; the proof stops there, on every rank.
- `gradient_bound`, `adam_step_bound`: how far summation order alone can move the
  averaged gradients, and AdamW's weights, in one step.
- `exact_kernels` (from common/demos.py): deterministic kernels and no TF32 while a proof runs.
- `full_tensor`, `full_state`: fully_shard's DTensors gathered whole, also over gloo
  with CUDA tensors, where torch's own gather crashes.

Every tensor a collective here sends lives on the device the caller's tensors (or
`device`) name: nccl takes only GPU tensors, gloo CPU ones.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from common.demos import all_gather_single, exact_kernels  # noqa: F401 (the proofs' callers import it from here)


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
    """max over all elements of |a - b| on this rank: 0.0 when equal, NaN where either
    holds a NaN (Python's max(0.0, nan) would say 0.0)."""
    diffs = [(a - b).abs().max() for a, b in zip(params, reference) if a.numel()]
    return torch.stack(diffs).max().item() if diffs else 0.0


@torch.no_grad()
def first_not_finite(named) -> str | None:
    """'<name> is not finite (<value>)' for the first of the (name, tensor) pairs that
    holds a NaN or an infinity; None when every one is finite."""
    for name, t in named:
        bad = ~torch.isfinite(t)
        if bad.any():
            return f"{name} is not finite ({t[bad].flatten()[0].item()})"
    return None


class NotFinite(Exception):
    """A loss, gradient or weight that holds a NaN or an infinity: the proof stops at once
    with this one line, on every rank."""


def stop_if_not_finite(modes: dict, step: int, named) -> None:
    """Raise NotFinite, on every rank, naming the first tensor of `named(trainer)` that
    holds a NaN or an infinity, for the first of the `modes` (name -> trainer) and the
    first rank that has one (a collective: every rank calls it, and every rank raises)."""
    line = next((f"{mode}: step {step}: {bad}" for mode, trainer in modes.items()
                 for bad in [first_not_finite(named(trainer))] if bad), None)
    lines = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    said = next((s for s in lines if s is not None), None)
    if said is not None:
        raise NotFinite(said)


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


def gradient_bound(world: int, dtype: torch.dtype, max_grad: float) -> float:
    """The largest |g - g_ddp| per element of the averaged gradient that summation order
    alone can cause: each rank's gradient, divided by N (the same numbers in every
    mode), summed over the N ranks in another order. With N <= 2 the sum is the same
    (a + b = b + a), so the bound is 0. Otherwise a sum of N terms is off by at most
    (N - 1) u sum|terms| (u: the dtype's unit of rounding), and sum|terms| <= N G / N = G,
    G the largest gradient element any rank made: two modes differ by at most
    2 (N - 1) u G, below the 2 N u G returned (`adam_step_bound`'s delta)."""
    return 0.0 if world <= 2 else 2 * world * (torch.finfo(dtype).eps / 2) * max_grad


def adam_step_bound(world: int, dtype: torch.dtype, lr: float, step: int, max_grad: float,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> float:
    """The largest |w - w_ddp| per weight element that summation order alone can cause in
    AdamW step `step` (1-based) taken from the same weights and moments, derived here
    (05-collectives/data-parallel.md sketches it):

    - each rank's gradient, divided by N, is summed over N ranks in an order that differs
      between the modes; with N <= 2 the sum is the same (a + b = b + a, halving is
      exact), so the bound is 0. Otherwise two modes' averaged gradients differ by at
      most delta = 2 N u G (`gradient_bound`), G the largest gradient element any rank made;
    - AdamW's update lr * m_hat / (sqrt(v_hat) + eps) moves by at most
      lr * (1 + A_t) * delta / eps for such a change (eps bounds the amplification near
      zero gradients; A_t = adam_ratio_bound), and never by more than 2 lr A_t.

    One step only: over several steps a weight moved by rounding also changes the next
    gradients, which no such bound follows (a trajectory can amplify it step after step),
    so a proof compares every step from the same state."""
    if world <= 2:
        return 0.0
    delta = gradient_bound(world, dtype, max_grad)
    ratio = adam_ratio_bound(betas, step)
    return lr * min((1 + ratio) * delta / eps, 2 * ratio)


def gathers_through_functional_collectives(t: torch.Tensor) -> bool:
    """Can `t.full_tensor()` (and `get_state_dict`'s full state, which calls it) gather
    this DTensor? Not a CUDA one over gloo: the DTensor gathers with torch's functional
    all-gather, which reaches gloo's coalesced all-gather, and that reads the CUDA address
    as host memory and kills the process (SIGSEGV; seen with torch 2.11 on an H100 with
    two ranks sharing it: pytorch/pytorch#152645). `dist.all_gather_into_tensor` stages
    CUDA tensors through host memory and works."""
    group = t.device_mesh.get_group()
    return not (t.device.type == "cuda" and dist.get_backend(group) == "gloo")


@torch.no_grad()
def gather_dim0_shards(t: torch.Tensor) -> torch.Tensor:
    """A DTensor sharded on dim 0 over a 1-D mesh (fully_shard's parameters and AdamW
    moments), gathered whole on every rank with one `dist.all_gather_into_tensor`: as
    torch.chunk splits it (shards of ceil(rows / ranks) rows, the last ones shorter or
    empty), each shard padded to that size, the padding cut off the result."""
    group = t.device_mesh.get_group()
    world, rows, local = dist.get_world_size(group), t.shape[0], t.to_local()
    chunk = -(-rows // world)
    padded = local.new_zeros((chunk, *local.shape[1:]))
    padded[:local.shape[0]] = local
    out = local.new_empty((chunk * world, *local.shape[1:]))
    all_gather_single(out, padded, group=group)
    return out[:rows]


def full_tensor(t: torch.Tensor, own_gather: bool | None = None) -> torch.Tensor:
    """`t.full_tensor()` for a DTensor, `t` itself otherwise; over gloo with CUDA tensors
    (or with own_gather=True) a DTensor sharded on dim 0 is gathered by
    `gather_dim0_shards` instead (see gathers_through_functional_collectives). A
    collective for a DTensor: every rank calls it."""
    from torch.distributed.tensor import DTensor, Shard
    if not isinstance(t, DTensor):
        return t
    if own_gather is None:
        own_gather = not gathers_through_functional_collectives(t)
    if own_gather and t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),):
        return gather_dim0_shards(t)
    return t.full_tensor()


def full_state(model, optimizer, own_gather: bool | None = None) -> tuple[dict, dict]:
    """The whole model and optimizer state on rank 0's CPU, keyed by parameter name, as
    `get_state_dict(..., options=StateDictOptions(full_state_dict=True, cpu_offload=True))`
    returns it (the other ranks get empty dicts). Over gloo with CUDA tensors (or with
    own_gather=True) each rank's DTensor shards are gathered by `full_tensor` instead,
    and every rank gets the whole state. A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only
    if own_gather is None:
        own_gather = any(isinstance(p, DTensor) and not gathers_through_functional_collectives(p)
                         for p in model.parameters())
    if not own_gather:
        return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model_state, optim_state = get_state_dict(model, optimizer)  # this rank's shards
    return tuple(tree_map_only(torch.Tensor, lambda t: full_tensor(t, own_gather=True).cpu(), state)
                 for state in (model_state, optim_state))
