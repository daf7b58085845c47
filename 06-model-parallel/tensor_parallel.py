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

Here f is `copy_to_tp` and g is `reduce_from_tp` (Megatron-LM's names for them).
Attention is split by heads (q, k, v column-parallel, o row-parallel), the SwiGLU MLP
by its intermediate features (gate, up column-parallel, down row-parallel): one f and
one g each, so two all-reduces forward and two backward per decoder layer. The
embedding and the output layer are split over the vocabulary.

`parallelize` turns a `common.model.LlamaForCausalLM` into this, in place: its attention
and MLP modules stay the model's own, with their linear layers swapped for split ones
built from the same weights. Built with chapter 01's seed and then split, the model
starts from chapter 01's weights exactly. `parallelize_with_torch` does the same with
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


# ---- the two conjugate functions ----------------------------------------------------

class CopyToTensorParallel(torch.autograd.Function):
    """f: identity forward; backward, the ranks' shares of the input's gradient summed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()  # a copy: autograd may share `grad` with another function
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """g: the partial outputs summed forward; backward, identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()  # a copy: the all-reduce writes in place, and x is the caller's
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group):
    """f: before the column-parallel layers that read x."""
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x, group):
    """g: after a row-parallel layer, its partial outputs summed."""
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


def to_local(t):
    """This rank's own tensor: a DTensor's local slice, any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_grad(p):
    """This rank's slice of p's gradient. torch's Rowwise embedding builds its gradient
    whole on every rank (a Replicate DTensor of V x h, torch 2.13): tp times the memory of
    its slice. It is cut here as the weight is, so that every rank keeps, and counts, its
    own slice only."""
    if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    return to_local(p.grad)


@torch.no_grad()
def full_weight(p, group, value=None) -> torch.Tensor:
    """The whole tensor of parameter `p`, or of `value` (its gradient, say) cut as p is,
    a copy (a collective over `group` for a slice): the slices gathered, each padded to
    the largest (all_gather takes equal sizes)."""
    value = p if value is None else value
    if isinstance(value, DTensor):
        return value.full_tensor()
    if not hasattr(p, "tp_dim"):
        return value.detach().clone()
    dim, tp = p.tp_dim, dist.get_world_size(group)
    shape = list(value.shape)
    shape[dim] = -(-p.tp_size // tp)
    padded = value.new_zeros(shape)
    padded.narrow(dim, 0, value.shape[dim]).copy_(value)
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
        return reduce_from_tp(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """The embedding table split by rows (tokens): a rank looks up the tokens in its
    range, gives zeros for the others, and g sums: each token's row from its one owner."""

    def __init__(self, embedding: nn.Embedding, group):
        super().__init__()
        self.group = group
        self.weight = shard_parameter(embedding.weight, 0, group)
        self.start = shard_range(embedding.weight.shape[0], dist.get_rank(group), dist.get_world_size(group))[0]

    def forward(self, ids):
        rows = ids - self.start  # the token's row in this rank's slice, if it is here
        elsewhere = (rows < 0) | (rows >= self.weight.shape[0])
        out = F.embedding(rows.masked_fill(elsewhere, 0), self.weight)
        return reduce_from_tp(out.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group)


class VocabParallelHead(nn.Module):
    """lm_head, column-parallel over the vocabulary: each rank computes the logits of its
    tokens only (never the whole B x T x V tensor), for `vocab_parallel_cross_entropy`."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.group = group
        self.weight = shard_parameter(linear.weight, 0, group)
        self.start = shard_range(linear.weight.shape[0], dist.get_rank(group), dist.get_world_size(group))[0]

    def forward(self, x):
        logits = F.linear(copy_to_tp(x, self.group), self.weight)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # as the model's head


def vocab_parallel_cross_entropy(logits, targets, vocab_start: int, group):
    """F.cross_entropy(reduction="sum", ignore_index=IGNORE_INDEX) over logits split by
    vocabulary: logits (N, V/tp) are this rank's columns, starting at token `vocab_start`.
    loss = log(sum_j exp(z_j)) - z_target, from three all-reduces of N numbers each (not
    of N x V): the largest logit (a shift, for exp's range), the sum of exp, the target's
    logit (from the one rank that holds it). g's identity backward is the right gradient
    of the two sums: each rank then gets softmax - onehot for its own columns."""
    top = logits.detach().max(dim=-1).values  # no gradient: the shift cancels out of the loss
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top.unsqueeze(-1)
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), group)
    column = targets - vocab_start  # the target's column in this rank's slice, if it is here
    mine = (column >= 0) & (column < logits.shape[-1])
    target_logit = shifted.gather(-1, column.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce_from_tp(target_logit * mine, group)
    loss = sum_exp.log() - target_logit
    return loss.masked_fill(targets == IGNORE_INDEX, 0.0).sum()


def parallelize(model, group):
    """Split `model` (a LlamaForCausalLM) over the ranks of `group`, in place. Each
    decoder layer keeps its own attention and MLP modules: their linear layers become
    column- and row-parallel ones, attention counts this rank's heads, and a hook puts
    f in front of each (one f for q, k and v: their input gradients add up on the rank
    first, then one all-reduce). The vocabulary is split in the embedding and the head.

    tp must divide the KV heads (layout_for refuses it otherwise): with more ranks than
    KV heads, a rank would need a KV head that another rank holds too. Megatron-LM
    refuses that as well; inference engines replicate such heads, which training would
    have to keep equal by summing their gradients over the ranks that share them."""
    tp = dist.get_world_size(group)

    def copy_input(module, args):
        return (copy_to_tp(args[0], group), *args[1:])

    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, group)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj, attn.k_proj, attn.v_proj = (ColumnParallelLinear(lin, group)
                                                 for lin in (attn.q_proj, attn.k_proj, attn.v_proj))
        attn.o_proj = RowParallelLinear(attn.o_proj, group)  # g inside: the heads' outputs summed
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp  # the views count these
        mlp.gate_proj, mlp.up_proj = (ColumnParallelLinear(lin, group) for lin in (mlp.gate_proj, mlp.up_proj))
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group)  # silu(gate) * up is elementwise: no all-reduce
        attn.register_forward_pre_hook(copy_input)
        mlp.register_forward_pre_hook(copy_input)
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
        # The outputs are this rank's columns as plain tensors, so the views count its own heads.
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
