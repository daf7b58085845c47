"""Sequence parallelism (Megatron-LM, Korthikanti et al. 2022): tensor parallelism whose
residual stream is cut along the sequence, from scratch, then with PyTorch's own API.

Chapter 06's tensor parallelism splits every matmul over the `tp` ranks, but between the
matmuls every rank holds the whole residual stream, (B, T, h): the norms, the residual
additions and the activations they keep for backward are computed tp times over, once
per rank. Sequence parallelism cuts them along the sequence instead: rank r holds
tokens [r T/tp, (r+1) T/tp) of the stream and normalises only those. Where the stream
meets a column-parallel layer (which needs every token), an all-gather glues the
sequence together; the row-parallel layer's partial sums, which chapter 06 all-reduced,
are reduce-scattered instead, each rank keeping the sums of its own tokens:

    chapter 06   x whole --f-->  column-parallel ... row-parallel --g (all-reduce)-->  x whole
    here         x[my tokens] --all-gather--> column-parallel ... row-parallel
                 --reduce-scatter--> x[my tokens]

An all-reduce is a reduce-scatter then an all-gather: the two collectives carry exactly
the bytes of chapter 06's one, and what lies between them (norms, residuals, dropout,
what they keep for backward) shrinks tp times. The two conjugate functions:

    gather_sequence   all-gather along the sequence forward; backward, reduce-scatter
                      (each rank's share of the whole sequence's gradient, summed)
    scatter_sequence  reduce-scatter along the sequence forward; backward, all-gather

The norm weights stay whole on every rank, but each rank's gradient of them covers only
its own tokens: `all_reduce_norm_gradients` sums them over the tp ranks before the
optimizer step (the one all-reduce sequence parallelism adds, of h numbers per norm).

This file is chapter 06's tensor_parallel.py with f and g replaced so (`diff -u` shows
it). `parallelize_with_torch` does the same with torch.distributed.tensor.parallel:
`SequenceParallel` on the norms, the column-parallel inputs gathered from Shard(1), the
row-parallel outputs scattered to Shard(1).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from common.data import IGNORE_INDEX
from common.model import apply_rotary, shares_kv_heads

SEQUENCE_DIM = 1  # activations are (batch, sequence, hidden)


def all_reduce(t, group, op=dist.ReduceOp.SUM):
    """`t` summed (or `op`) over the ranks of `group`, in place: the vocabulary-parallel loss's sums."""
    dist.all_reduce(t, op=op, group=group)
    return t


def all_gather(t, group):
    """The ranks' pieces of the sequence, glued in rank order along SEQUENCE_DIM."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=SEQUENCE_DIM)


def reduce_scatter(t, group):
    """Summed over the ranks, and rank r keeps its piece r of the sequence."""
    parts = [p.contiguous() for p in t.chunk(dist.get_world_size(group), dim=SEQUENCE_DIM)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


# ---- the two conjugate functions ----------------------------------------------------

class GatherFromSequenceParallel(torch.autograd.Function):
    """All-gather forward; backward, each rank's own tokens of the summed gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, ctx.group), None


class ScatterToSequenceParallel(torch.autograd.Function):
    """Reduce-scatter forward (the partial sums added, each rank its tokens); backward,
    the gradients of all the tokens gathered (a sum's gradient reaches each term)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, ctx.group), None


def gather_sequence(x, group):
    return GatherFromSequenceParallel.apply(x, group)


def scatter_sequence(x, group):
    return ScatterToSequenceParallel.apply(x, group)


# ---- slices -------------------------------------------------------------------------

def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s slice [start, end) of `size` items in `world` parts: ceil(size/world)
    each, the last ones shorter (torch.chunk's split, which DTensor's Shard uses too)."""
    per = -(-size // world)
    start = min(rank * per, size)
    return start, min(start + per, size)


def shard_parameter(weight: torch.Tensor, dim: int, group) -> nn.Parameter:
    """This rank's slice of `weight` along `dim`."""
    start, end = shard_range(weight.shape[dim], dist.get_rank(group), dist.get_world_size(group))
    return nn.Parameter(weight.detach().narrow(dim, start, end - start).clone())


def tp_dim(name: str) -> int | None:
    """The dimension along which `parallelize` cuts parameter `name` over the tp ranks:
    0 for the column-parallel weights, the embedding and the head (rows), 1 for the
    row-parallel ones (columns), None for the norm weights (whole on every rank)."""
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return 1
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight",
                      "embed_tokens.weight", "lm_head.weight")):
        return 0
    return None


# ---- the layers ---------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """nn.Linear with its output features split: this rank's rows of the weight, applied
    to the whole sequence (the caller gathers it, once for the layers that share it)."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.weight = shard_parameter(linear.weight, 0, group)

    def forward(self, x):
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """nn.Linear with its input features split: this rank's columns of the weight give a
    partial sum of every token's output; the reduce-scatter adds the partial sums and
    leaves each rank the tokens of its piece of the sequence."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = shard_parameter(linear.weight, 1, group)

    def forward(self, x):
        return scatter_sequence(F.linear(x, self.weight), self.group)


class ParallelAttention(nn.Module):
    """Grouped-query attention split by heads, on this rank's tokens: they are gathered
    into the whole sequence (every query attends to every earlier key), this rank's
    heads computed, and o_proj's partial sums reduce-scattered back to its tokens."""

    def __init__(self, attn, group):
        super().__init__()
        tp = dist.get_world_size(group)
        self.group, self.head_dim = group, attn.head_dim
        self.n_heads, self.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
        self.q_proj = ColumnParallelLinear(attn.q_proj, group)
        self.k_proj = ColumnParallelLinear(attn.k_proj, group)
        self.v_proj = ColumnParallelLinear(attn.v_proj, group)
        self.o_proj = RowParallelLinear(attn.o_proj, group)

    def forward(self, x, cos, sin, attn_mask=None):
        x = gather_sequence(x, self.group)  # one gather for q, k and v
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # from here on as common.model.Attention, with this rank's heads
        mask = None if attn_mask is None else attn_mask.to(q.dtype)
        gqa = self.n_kv_heads != self.n_heads
        if gqa and not shares_kv_heads(q.device.type, q.dtype, masked=mask is not None):
            groups = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            gqa = False
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # reduce-scattered inside


class ParallelMLP(nn.Module):
    """SwiGLU split by intermediate features, on the gathered sequence; down_proj
    reduce-scatters back to this rank's tokens."""

    def __init__(self, mlp, group):
        super().__init__()
        self.group = group
        self.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
        self.up_proj = ColumnParallelLinear(mlp.up_proj, group)
        self.down_proj = RowParallelLinear(mlp.down_proj, group)

    def forward(self, x):
        x = gather_sequence(x, self.group)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by rows (tokens): a rank looks up the tokens of the whole
    sequence that fall in its range (zeros for the others); the reduce-scatter adds the
    ranks' rows and leaves each rank its piece of the sequence: the residual stream
    starts cut."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        self.group = group
        self.weight = shard_parameter(embedding.weight, 0, group)
        self.start = shard_range(embedding.weight.shape[0], dist.get_rank(group), dist.get_world_size(group))[0]

    def forward(self, ids):
        local = ids - self.start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return scatter_sequence(out.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group)


class VocabParallelHead(nn.Module):
    """lm_head, column-parallel over the vocabulary, on the gathered sequence: each rank
    computes the logits of its tokens of the vocabulary for every position."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = shard_parameter(linear.weight, 0, group)
        self.start = shard_range(linear.weight.shape[0], dist.get_rank(group), dist.get_world_size(group))[0]

    def forward(self, x):
        logits = F.linear(gather_sequence(x, self.group), self.weight)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # as the model's head


class ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward; backward, identity (chapter 06's g)."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_cross_entropy(logits, targets, vocab_start: int, group):
    """Chapter 06's: F.cross_entropy(reduction="sum", ignore_index=IGNORE_INDEX) over
    logits (N, V/tp) split by vocabulary, from three all-reduces of N numbers each."""
    top = all_reduce(logits.detach().max(dim=-1).values, group, dist.ReduceOp.MAX)
    shifted = logits - top.unsqueeze(-1)
    sum_exp = ReduceFromTensorParallel.apply(shifted.exp().sum(dim=-1), group)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    target_logit = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = ReduceFromTensorParallel.apply(target_logit * mine, group)
    loss = sum_exp.log() - target_logit
    return loss.masked_fill(targets == IGNORE_INDEX, 0.0).sum()


def parallelize(model, group):
    """Split `model` (a LlamaForCausalLM, or a pipeline stage of one) over the ranks of
    `group`, in place, with its residual stream cut along the sequence. The norms are
    left as they are: they run on this rank's tokens."""
    if getattr(model, "embed_tokens", None) is not None:
        model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, group)
    for layer in model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers:
        layer.self_attn = ParallelAttention(layer.self_attn, group)
        layer.mlp = ParallelMLP(layer.mlp, group)
    if getattr(model, "lm_head", None) is not None:
        model.lm_head = VocabParallelHead(model.lm_head, group)
    return model


@torch.no_grad()
def all_reduce_norm_gradients(module, group):
    """The norm weights (the model's only 1-D parameters) are whole on every tp rank, and
    each rank's backward saw only its own tokens: their gradients summed over the tp
    ranks, after backward, before clipping. (Under FSDP each gradient is this rank's dp
    shard, cut alike on every tp rank: the shards add up the same way.)"""
    for p in module.parameters():
        if p.dim() == 1 and p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            all_reduce(grad, group)


# ---- the same with torch.distributed.tensor.parallel ------------------------------------

def parallelize_with_torch(model, tp_mesh, sequence_parallel: bool = True):
    """Chapter 06's split with PyTorch's API, and with `sequence_parallel` the residual
    stream cut along the sequence: `SequenceParallel` makes each norm take and give
    Shard(1) (this rank's tokens; its weight Replicate, its gradient summed over the
    ranks by DTensor); `PrepareModuleInput` gathers the sequence (Shard(1) -> Replicate:
    an all-gather) before attention and the MLP; the row-parallel layers hand back
    Shard(1) (a reduce-scatter) instead of Replicate (an all-reduce). The embedding's
    output is scattered so too, and the head gathers its input. `model` is a
    LlamaForCausalLM or a pipeline stage of one; the head's logits stay sharded over
    the vocabulary for `loss_parallel`."""
    tp = tp_mesh.size()
    seq, whole = (Shard(SEQUENCE_DIM), Replicate()) if sequence_parallel else (Replicate(), Replicate())
    layers = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for layer in layers:
        plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            plan.update({
                "input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                # attention's inputs are (x, cos, sin, mask): only x is cut
                "self_attn": PrepareModuleInput(input_layouts=(seq, None, None, None),
                                                desired_input_layouts=(whole, None, None, None)),
                "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,))})
        parallelize_module(layer, tp_mesh, plan)
        layer.self_attn.n_heads //= tp  # the views count this rank's heads
        layer.self_attn.n_kv_heads //= tp
    plan = {}
    if getattr(model, "embed_tokens", None) is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    return model
