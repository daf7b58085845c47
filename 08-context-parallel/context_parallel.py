"""Context parallelism, from scratch: the sequence itself split over `cp` ranks.

Every layer but attention treats each token on its own: a rank can run the embedding,
the norms, the MLP and the loss on its own tokens alone. Attention is where a token
reads the tokens before it, on other ranks. Two ways to bring them together:

    ring attention  each rank keeps its queries; the key/value blocks travel around a
                    ring of send/recv, one hop per step, cp steps, and each rank merges
                    the partial softmax results through their log-sum-exp. The full
                    T x T scores never exist anywhere; a rank holds its own block of
                    keys and the one arriving.
    all-to-all      (DeepSpeed-Ulysses) one all-to-all trades the sequence split for a
                    head split: each rank gets the whole sequence of H/cp heads, runs
                    ordinary attention on them, and a second all-to-all trades back.
                    Simpler, but cp must divide the heads, and the KV heads.

Causal attention gives later tokens more work: split contiguously, the last rank's
queries read every key and the first rank's only their own. `SequenceSplit` balances
it: the sequence is cut into 2 x cp chunks, and rank r takes chunk r from the head and
chunk 2cp-1-r from the tail, so that every rank attends the same number of pairs.

A rank's tokens are not consecutive then, so the rotary embedding must rotate each one
by its position in the whole sequence, not in the shard: `shard_positions` gives those,
and `parallelize` makes each layer's rotary tables and attention use them. To the
weights, the cp ranks are data-parallel: each computes the gradient of its own tokens'
loss, and FSDP shards over the dp x cp ranks and sums them (`fsdp_mesh`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from common.model import shares_kv_heads

VARIANTS = ("ring", "all-to-all")


# ---- how the sequence is cut ---------------------------------------------------------

@dataclass(frozen=True)
class SequenceSplit:
    """A sequence of `seq_len` tokens over `cp` ranks, in 2 x cp chunks of
    seq_len / (2 cp) tokens. Balanced: rank r holds chunks r and 2cp-1-r (the head and
    the tail); contiguous: chunks 2r and 2r+1, the r-th cp-th of the sequence."""
    seq_len: int
    cp: int
    balanced: bool = True

    def __post_init__(self):
        if self.seq_len % (2 * self.cp):
            raise ValueError(f"a sequence of {self.seq_len} tokens does not cut into 2 x cp = {2 * self.cp} "
                             f"equal chunks")

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    def chunks(self, rank: int) -> tuple[int, int]:
        """The two chunks rank `rank` holds, in sequence order."""
        return (rank, 2 * self.cp - 1 - rank) if self.balanced else (2 * rank, 2 * rank + 1)

    def positions(self, rank: int) -> torch.Tensor:
        """The positions in the whole sequence of rank `rank`'s tokens, in order."""
        return torch.cat([torch.arange(i * self.chunk, (i + 1) * self.chunk) for i in self.chunks(rank)])

    def block(self, rank: int, source: int):
        """Which of rank `rank`'s queries attend which of rank `source`'s keys, as
        (query rows, key rows, causal), or None if none does. Each rank's tokens are in
        sequence order, so its own block is plain causal attention. Another rank's chunks
        lie wholly before or after each of this rank's: a block is all or nothing there.

        Balanced, rank r holds chunks (r, 2cp-1-r), rank j holds (j, 2cp-1-j). If j < r,
        both of r's chunks come after j's head chunk and before j's tail chunk: every
        query attends the first half of the keys. If j > r, r's head chunk comes before
        both of j's, r's tail chunk after both: the second half of the queries attends
        every key. Half of a block either way: the same work on every rank, every step."""
        everything, c = slice(None), self.chunk
        if source == rank:
            return everything, everything, True
        if not self.balanced:  # a whole earlier block, or nothing
            return (everything, everything, False) if source < rank else None
        if source < rank:
            return everything, slice(0, c), False
        return slice(c, 2 * c), everything, False


def shard_positions(split: SequenceSplit, group) -> torch.Tensor:
    """This rank's token positions in the whole sequence (see SequenceSplit)."""
    return split.positions(dist.get_rank(group))


def shard(t: torch.Tensor, positions: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `t` (a batch of whole sequences along `dim`)."""
    return t.index_select(dim, positions.to(t.device))


def unshard(t: torch.Tensor, split: SequenceSplit, group, dim: int = 1) -> torch.Tensor:
    """Every rank's tokens of `t` gathered (a collective) and put back in sequence order."""
    parts = [torch.empty_like(t) for _ in range(split.cp)]
    dist.all_gather(parts, t.contiguous(), group=group)
    order = torch.cat([split.positions(r) for r in range(split.cp)]).to(t.device)
    return torch.cat(parts, dim).index_select(dim, torch.argsort(order))


# ---- attention over one block of keys, and merging two blocks ------------------------

def attend(q, k, v, causal: bool, scale: float):
    """Softmax attention of queries q (B, KV heads, group, Tq, D) over one block of keys
    and values k, v (B, KV heads, 1, Tk, D): each KV head serves its group of query
    heads. Returns the output, normalised over this block only, and each query's
    log-sum-exp of its scores here (B, KV heads, group, Tq): what merging needs."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:  # query i attends keys 0..i: Tq == Tk, the same tokens
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def merge(out, lse, block_out, block_lse):
    """Two softmax results over disjoint sets of keys, as one over both. Each output is
    normalised by its own sum of exp(score); rescaled by exp(its lse - the joint lse),
    it is normalised by the joint sum, and then the two add up. lse = -inf (no key yet)
    gives a weight of 0, so the first block needs no special case."""
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


def attend_backward(q, k, v, grad_out, lse, delta, causal: bool, scale: float):
    """The gradients of one block's share of the attention, from the saved final lse
    and delta = rowsum(grad_out x out) (the softmax's backward without its
    probabilities kept): P = exp(scores - lse), dV = P^T dO, dS = P (dO V^T - delta),
    dQ = dS K, dK = dS^T Q. dK and dV are summed over each KV head's query group."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    p = torch.exp(scores - lse.unsqueeze(-1))
    dv = (p.transpose(-1, -2) @ grad_out).sum(dim=2, keepdim=True)
    ds = p * (grad_out @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    dq = (ds @ k) * scale
    dk = (ds.transpose(-1, -2) @ q).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


# ---- the ring ------------------------------------------------------------------------

def ring_pass(t: torch.Tensor, group):
    """Start sending `t` to the next rank of the ring and receiving the previous rank's:
    returns (the buffer that will hold it, the requests to wait for). The transfer runs
    while the caller computes on what it has."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
    received = torch.empty_like(t)
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, t.contiguous(), nxt),
                                       dist.P2POp(dist.irecv, received, prev)])
    return received, requests


def wait(requests):
    for r in requests:
        r.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys, the key/value
    blocks passed around the ring. q (B, H, T_local, D), k and v (B, KV heads, T_local,
    D), each rank's tokens as `split` cuts them.

    Forward, step s: this rank holds the keys and values of rank (rank - s) mod cp,
    sends them on while it attends them, and merges the result into its running output.
    Backward goes around the ring again: with each key/value block travels the gradient
    of those keys and values, to which every rank adds its queries' share; after cp
    hops it arrives back at the rank that owns the block, complete."""

    @staticmethod
    def forward(ctx, q, k, v, group, split: SequenceSplit):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        B, H, T, D = q.shape
        work = torch.promote_types(q.dtype, torch.float32)  # bf16 blocks merge in fp32
        qg = q.view(B, k.shape[1], H // k.shape[1], T, D).to(work)
        kv = torch.stack([k, v])  # one message per hop
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=work, device=q.device)
        for step in range(cp):
            if step < cp - 1:
                incoming, requests = ring_pass(kv, group)
            block = split.block(rank, (rank - step) % cp)
            if block is not None:
                rows, cols, causal = block
                o, l = attend(qg[..., rows, :], kv[0, :, :, None, cols].to(work), kv[1, :, :, None, cols].to(work),
                              causal, 1 / math.sqrt(D))
                out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], o, l)
            if step < cp - 1:
                wait(requests)
                kv = incoming
        out = out.view(B, H, T, D).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)  # what one process's flash attention keeps
        ctx.group, ctx.split = group, split
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, split = ctx.group, ctx.split
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        B, H, T, D = q.shape
        work = lse.dtype
        grouped = (B, k.shape[1], H // k.shape[1], T, D)
        qg, dout = q.view(grouped).to(work), grad_out.reshape(grouped).to(work)
        delta = (dout * out.view(grouped).to(work)).sum(dim=-1)
        dq = torch.zeros_like(qg)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=work, device=q.device)  # summed in fp32 (bf16 runs) on its way
        for step in range(cp):
            if step < cp - 1:
                incoming, requests = ring_pass(kv, group)
            block = split.block(rank, (rank - step) % cp)
            if block is not None:
                rows, cols, causal = block
                gq, gk, gv = attend_backward(qg[..., rows, :], kv[0, :, :, None, cols].to(work),
                                             kv[1, :, :, None, cols].to(work), dout[..., rows, :], lse[..., rows],
                                             delta[..., rows], causal, 1 / math.sqrt(D))
                dq[..., rows, :] += gq
                dkv[0, :, :, cols] += gk.squeeze(2)
                dkv[1, :, :, cols] += gv.squeeze(2)
            if cp > 1:  # the block's gradient moves on with it; the last hop takes it home
                incoming_grad, grad_requests = ring_pass(dkv, group)
            if step < cp - 1:
                wait(requests)
                kv = incoming
            if cp > 1:
                wait(grad_requests)
                dkv = incoming_grad
        return dq.view(B, H, T, D).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q, k, v, group, split: SequenceSplit):
    return RingAttention.apply(q, k, v, group, split)


# ---- all-to-all (DeepSpeed-Ulysses) ----------------------------------------------------

def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Cut `x` into cp parts along `scatter_dim`, send part i to rank i, and join the
    parts received, rank by rank, along `gather_dim` (one dist.all_to_all_single)."""
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class AllToAll(torch.autograd.Function):
    """all_to_all forward; backward, the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim: int, gather_dim: int):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all_attention(q, k, v, group, split: SequenceSplit):
    """The same attention as ring_attention, by trading the sequence split for a head
    split: (B, H, T/cp, D) -> (B, H/cp, T, D), heads scattered and tokens gathered.
    The gathered tokens come rank by rank, each rank's in its split's order: they are
    put in sequence order for causal attention, and back before the return trip."""
    cp = dist.get_world_size(group)
    if q.shape[1] % cp or k.shape[1] % cp:
        raise ValueError(f"all-to-all attention over {cp} ranks needs cp to divide the heads ({q.shape[1]}) "
                         f"and the KV heads ({k.shape[1]})")
    gathered = torch.cat([split.positions(r) for r in range(cp)]).to(q.device)
    in_order = torch.argsort(gathered)  # gathered[in_order] = 0, 1, ..., T-1
    q, k, v = (AllToAll.apply(t, group, 1, 2).index_select(2, in_order) for t in (q, k, v))
    gqa = k.shape[1] != q.shape[1]
    if gqa and not shares_kv_heads(q.device.type, q.dtype, masked=False):
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        gqa = False
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return AllToAll.apply(y.index_select(2, gathered), group, 2, 1)


ATTENTION = {"ring": ring_attention, "all-to-all": all_to_all_attention}


# ---- the model -----------------------------------------------------------------------

class ShardRotary(nn.Module):
    """The rotary tables at this rank's token positions (in the whole sequence), whatever
    the shard's length: cos[positions], sin[positions]. `whole` is the table it replaced."""

    def __init__(self, rotary: nn.Module, positions: torch.Tensor):
        super().__init__()
        self.whole = rotary
        self.register_buffer("cos", rotary.cos[positions], persistent=False)
        self.register_buffer("sin", rotary.sin[positions], persistent=False)

    def forward(self, seq_len: int):
        return self.cos, self.sin


def decoder_layers(model):
    """The decoder layers of a LlamaForCausalLM (a list) or of a pipeline stage (a dict)."""
    return model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers


def parallelize(model, group, split: SequenceSplit, variant: str = "ring"):
    """Make `model` (a LlamaForCausalLM or a pipeline stage of one, split by tensor
    parallelism first or not) run on this rank's tokens of every sequence, in place: the
    rotary tables at the shard's positions, and each layer's attention over the whole
    sequence through `variant`."""
    positions = shard_positions(split, group).to(model.rotary.cos.device)
    model.rotary = ShardRotary(model.rotary, positions)
    for layer in decoder_layers(model):
        # the layer computes q, k and v of this rank's tokens; they attend every rank's
        layer.self_attn.attend = partial(attend_split, ATTENTION[variant], group, split)
    return model


def attend_split(attention, group, split: SequenceSplit, q, k, v, attn_mask=None):
    """common.model.Attention.attend's place, for `attention` over the split sequence:
    packed sequences only (no padding mask: train_llm.py refuses --padded)."""
    if attn_mask is not None:
        raise ValueError("context parallelism here takes packed sequences, without a padding mask")
    return attention(q, k, v, group, split)


def fsdp_mesh(device_type: str, pp: int, dp: int, cp: int, tp: int):
    """The mesh FSDP shards over: dp x cp ranks. The cp ranks of a replica hold the same
    weights and each computes the gradient of its own tokens' loss, so to FSDP they are
    data-parallel ranks like the dp ones: it shards the weights and AdamW's state over
    all dp x cp of them, and its reduce-scatter sums their gradients. This is the same
    ranks as the mesh (pp, dp, cp, tp), seen as (pp, dp x cp, tp): its "dp" dimension
    is dp x cp (dp and cp neighbours in the rank order, so each of its groups is one)."""
    return init_device_mesh(device_type, (pp, dp * cp, tp), mesh_dim_names=("pp", "dp", "tp"))


@contextmanager
def whole_sequences(models):
    """For the duration, `models` (parallelized as above) attend over their own input as
    one process does, rotated from position 0: for sampling, where every rank of a cp
    group runs the same growing sequence, whole."""
    undo = []
    for m in models:
        if isinstance(m.rotary, ShardRotary):
            attends = [layer.self_attn.attend for layer in decoder_layers(m)]
            for layer in decoder_layers(m):
                del layer.self_attn.attend  # back to common.model's Attention.attend
            undo.append((m, m.rotary, attends))
            m.rotary = m.rotary.whole
    try:
        yield
    finally:
        for m, rotary, attends in undo:
            m.rotary = rotary
            for layer, attend in zip(decoder_layers(m), attends):
                layer.self_attn.attend = attend
