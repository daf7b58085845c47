"""Tensor parallelism (Megatron-LM style), from scratch, then with PyTorch's own API.

Each of the `tp` ranks of a tensor-parallel group holds a slice of every weight matrix
and computes its slice of every matmul. Two kinds of linear layer do it:

    column-parallel  Y = X W^T with W's rows (output features) split: rank r computes
                     Y[:, r-th slice]. X must be whole on every rank.
    row-parallel     W's columns (input features) split: rank r multiplies its slice of
                     X by its slice of W, a partial sum of the whole Y; an all-reduce
                     adds the partial sums.

A column-parallel layer followed by a row-parallel one needs no communication in
between: the column layer's output slice is exactly the row layer's input slice. Two
conjugate autograd functions put the all-reduces where the data meet:

    f  before the column-parallel layers: identity forward, all-reduce backward (each
       rank has only its slice's share of the gradient of X)
    g  after the row-parallel layer: all-reduce forward (sum the partial outputs),
       identity backward (the gradient of a sum reaches every term unchanged)

Attention is split by heads (q, k, v column-parallel, o row-parallel), the SwiGLU MLP
by its intermediate features (gate, up column-parallel, down row-parallel): one f and
one g each, so two all-reduces forward and two backward per decoder layer. The
embedding and the output layer are split over the vocabulary.

`parallelize` turns a `common.model.LlamaForCausalLM` into this, in place, from its own
weights: built with chapter 01's seed and then split, it starts from chapter 01's
weights exactly. `parallelize_with_torch` does the same with
`torch.distributed.tensor.parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from common.data import IGNORE_INDEX
from common.model import apply_rotary, shares_kv_heads


def all_reduce(t, group, op=dist.ReduceOp.SUM):
    """Where the layers below communicate, all of it (measure.py counts the bytes here)."""
    dist.all_reduce(t, op=op, group=group)
    return t


# ---- the two conjugate functions ----------------------------------------------------

class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward; backward, the ranks' shares of the input's gradient summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.clone(), ctx.group), None  # a copy: autograd may share `grad`


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: the partial outputs summed forward; backward, identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)  # a copy: the all-reduce writes in place

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def f(x, group):
    return CopyToTensorParallel.apply(x, group)


def g(x, group):
    return ReduceFromTensorParallel.apply(x, group)


# ---- slices -------------------------------------------------------------------------

def shard_range(size: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s slice [start, end) of `size` items in `world` parts: ceil(size/world)
    each, the last ones shorter (torch.chunk's split, which DTensor's Shard uses too)."""
    per = -(-size // world)
    start = min(rank * per, size)
    return start, min(start + per, size)


def shard_parameter(weight: torch.Tensor, dim: int, group) -> nn.Parameter:
    """This rank's slice of `weight` along `dim`, as a parameter that remembers how it
    was cut (`tp_dim`, `tp_size`): gradient clipping counts it once per slice, and
    `full_weight` glues the slices back together."""
    start, end = shard_range(weight.shape[dim], dist.get_rank(group), dist.get_world_size(group))
    p = nn.Parameter(weight.detach().narrow(dim, start, end - start).clone())
    p.tp_dim, p.tp_size = dim, weight.shape[dim]
    return p


def is_tp_sharded(p) -> bool:
    """Whether each tensor-parallel rank holds a different slice of `p` (ours or torch's);
    the others (norm weights) are whole, and the same, on every rank."""
    if isinstance(p, DTensor):
        return any(isinstance(pl, Shard) for pl in p.placements)
    return hasattr(p, "tp_dim")


def local(t):
    """This rank's own tensor: a DTensor's local slice, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(p):
    """This rank's slice of p's gradient. torch's Rowwise embedding leaves its gradient
    whole on every rank (Replicate, torch 2.13): it is cut here as the weight is, so that
    every rank holds, and counts, its own slice only."""
    if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    return local(p.grad)


@torch.no_grad()
def full_weight(p, group) -> torch.Tensor:
    """The whole tensor of parameter `p`, a copy (a collective over `group` for a slice):
    the slices gathered, each padded to the largest (all_gather takes equal sizes)."""
    if isinstance(p, DTensor):
        return p.full_tensor()
    if not hasattr(p, "tp_dim"):
        return p.detach().clone()
    dim, tp = p.tp_dim, dist.get_world_size(group)
    shape = list(p.shape)
    shape[dim] = -(-p.tp_size // tp)
    padded = p.new_zeros(shape)
    padded.narrow(dim, 0, p.shape[dim]).copy_(p)
    parts = [torch.empty_like(padded) for _ in range(tp)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat(parts, dim).narrow(dim, 0, p.tp_size)


def local_slice(full: torch.Tensor, p, group) -> torch.Tensor:
    """This rank's part of `full` cut as parameter `p` is cut (no communication)."""
    if isinstance(p, DTensor):
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    if not hasattr(p, "tp_dim"):
        return full
    start, end = shard_range(p.tp_size, dist.get_rank(group), dist.get_world_size(group))
    return full.narrow(p.tp_dim, start, end - start)


# ---- the layers ---------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """nn.Linear with its output features split: this rank's rows of the weight. The
    input must be whole on every rank; the caller puts f in front (once for all the
    column-parallel layers that read the same input)."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.weight = shard_parameter(linear.weight, 0, group)

    def forward(self, x):
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """nn.Linear with its input features split: this rank's columns of the weight, applied
    to this rank's slice of the input, then g sums the ranks' partial outputs."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = shard_parameter(linear.weight, 1, group)

    def forward(self, x):
        return g(F.linear(x, self.weight), self.group)


class ParallelAttention(nn.Module):
    """Grouped-query attention split by heads: this rank's n_heads/tp query heads and
    n_kv_heads/tp KV heads. Query head i reads KV head i // (n_heads/n_kv_heads), and
    slicing both in rank order keeps every query head with its KV head on one rank.

    tp may not exceed the KV heads: a rank would then need a KV head another rank holds
    too (Megatron replicates it, and sums its gradients over the ranks that share it: one
    more all-reduce, and copies to keep equal). The command line refuses that instead."""

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
        B, T, _ = x.shape
        x = f(x, self.group)  # one f for q, k and v: their input gradients add up locally first
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
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))  # g inside: the heads' outputs summed


class ParallelMLP(nn.Module):
    """SwiGLU split by intermediate features: silu(gate) * up is elementwise, so each
    rank computes it on its own slice, and down (row-parallel) sums the slices."""

    def __init__(self, mlp, group):
        super().__init__()
        self.group = group
        self.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
        self.up_proj = ColumnParallelLinear(mlp.up_proj, group)
        self.down_proj = RowParallelLinear(mlp.down_proj, group)

    def forward(self, x):
        x = f(x, self.group)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by rows (tokens): a rank looks up the tokens in its
    range, gives zeros for the others, and g sums: each token's row from its one owner."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        self.group = group
        self.weight = shard_parameter(embedding.weight, 0, group)
        self.start = shard_range(embedding.weight.shape[0], dist.get_rank(group), dist.get_world_size(group))[0]

    def forward(self, ids):
        local = ids - self.start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return g(out.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group)


class VocabParallelHead(nn.Module):
    """lm_head, column-parallel over the vocabulary: each rank computes the logits of its
    tokens only (never the whole B x T x V tensor), for `vocab_parallel_cross_entropy`."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = shard_parameter(linear.weight, 0, group)
        self.start = shard_range(linear.weight.shape[0], dist.get_rank(group), dist.get_world_size(group))[0]

    def forward(self, x):
        logits = F.linear(f(x, self.group), self.weight)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # as the model's head


def vocab_parallel_cross_entropy(logits, targets, vocab_start: int, group):
    """F.cross_entropy(reduction="sum", ignore_index=IGNORE_INDEX) over logits split by
    vocabulary: logits (N, V/tp) are this rank's columns, starting at token `vocab_start`.
    loss = log(sum_j exp(z_j)) - z_target, from three all-reduces of N numbers each (not
    of N x V): the largest logit (a shift, for exp's range), the sum of exp, the target's
    logit (from the one rank that holds it). g's identity backward is the right gradient
    of the two sums: each rank then gets softmax - onehot for its own columns."""
    top = all_reduce(logits.detach().max(dim=-1).values, group, dist.ReduceOp.MAX)  # no gradient: the shift cancels
    shifted = logits - top.unsqueeze(-1)
    sum_exp = g(shifted.exp().sum(dim=-1), group)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    target_logit = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = g(target_logit * mine, group)
    loss = sum_exp.log() - target_logit
    return loss.masked_fill(targets == IGNORE_INDEX, 0.0).sum()


def parallelize(model, group):
    """Split `model` (a LlamaForCausalLM) over the ranks of `group`, in place."""
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, group)
    for layer in model.layers:
        layer.self_attn = ParallelAttention(layer.self_attn, group)
        layer.mlp = ParallelMLP(layer.mlp, group)
    model.lm_head = VocabParallelHead(model.lm_head, group)
    return model


# ---- the same with torch.distributed.tensor.parallel ------------------------------------

def parallelize_with_torch(model, tp_mesh):
    """The same split with PyTorch's API: each weight becomes a DTensor sharded over
    `tp_mesh` (a 1-D DeviceMesh), and the styles convert inputs and outputs, so the
    all-reduces (our f and g) come from DTensor's own rules. Colwise shards a Linear's
    output features, Rowwise its input features (and an Embedding's rows, with its
    partial outputs summed). The head's logits stay sharded over the vocabulary
    (Shard(-1)) for `loss_parallel`, torch's vocab-parallel cross-entropy."""
    tp = tp_mesh.size()
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })
        # the outputs are this rank's columns as plain tensors: the views count local heads
        layer.self_attn.n_heads //= tp
        layer.self_attn.n_kv_heads //= tp
    parallelize_module(model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    return model


def torch_cross_entropy(logits, targets):
    """The summed cross-entropy of DTensor logits sharded over the vocabulary, as a plain
    tensor (the same on every rank). Call it, and run its backward, inside
    `loss_parallel()`: the context gives DTensor the vocab-parallel rules both need."""
    loss = F.cross_entropy(logits.flatten(0, -2), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    return loss.to_local()
