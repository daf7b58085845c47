"""Sizing a training job on paper: what each rank holds between steps, saves for backward
and sends per step, for a model, a batch and a way of distributing the work. The formulas
of `python -m tools.plan` (its command line and tables), which chapter 06's measure.py
holds to what its ranks really hold and send.

Modes as chapter 05 names them: ddp (everything on every rank), zero1 (as chapter 05
builds it), zero2 (the textbook stage; chapter 05 does not build it), zero3 and fsdp2
(chapter 05's ZeRO-3 and torch's fully_shard, one unit per decoder layer plus the root);
and chapter 06's layout, the model split over tp x pp ranks.

Per rank: the parameters, gradients and AdamW state held between steps (the worst
rank, padding and AdamW's 4-byte step counters included), the activations saved for
backward with and without activation checkpointing; per step: the bytes each rank
sends with ring collectives (nccl-tests' bus factors, `RING_FACTOR`); the checkpoint's
size and its save and resume time at a disk bandwidth. tests/test_plan.py and
tests/test_ch05_sharded.py hold the formulas against what chapter 05's modes and
autograd really hold and send.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from .model import LlamaConfig

MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
# What a rank sends per byte of the array with a ring algorithm, on n ranks (nccl-tests'
# bus factors; 05-collectives/bench_collectives.py derives them)
RING_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_reduce": lambda n: 2 * (n - 1) / n}
STEP_COUNTER = 4  # bytes: AdamW's `step`, one fp32 scalar per tensor it updates
CHECKPOINT_PER_PARAM = 12  # fp32 weights (or master copy) and AdamW's two moments
TOKEN_ID, FP32 = 8, 4  # int64 token ids; fp32


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each part of the training state, of what is sent, and of
    the activations (`act`: what the matmuls save; `stream`: the residual stream that
    activation checkpointing keeps; `autocast`: matmul inputs and weights cast per call)."""
    param: int
    grad: int
    master: int
    moments: int
    comm: int
    act: int
    stream: int
    autocast: bool
    what: str


PRECISIONS = {
    "fp32": Precision(4, 4, 0, 8, 4, 4, 4, False,
                      "fp32 weights, gradients, AdamW moments and activations (the chapters on CPUs)"),
    "autocast": Precision(4, 4, 0, 8, 4, 2, 4, True,
                          "fp32 weights, gradients and AdamW moments, bf16 autocast matmuls "
                          "(the chapters on GPUs)"),
    "bf16": Precision(2, 2, 4, 8, 2, 2, 2, False,
                      "bf16 weights, gradients and activations, fp32 master weights and AdamW "
                      "moments (the ZeRO paper's mixed precision)"),
}


@dataclass
class Model:
    """Parameter shapes grouped in sharding units, as chapter 05 groups them: the
    embedding, each decoder layer, the final norm, the head (zero3 shards each unit; fsdp2
    keeps the embedding, norm and head in its root unit). `config` is None when only a
    parameter count is known: one 1-D tensor, no activations."""
    units: list[list[tuple[int, ...]]]
    root: list[bool]
    config: LlamaConfig | None

    @property
    def num_params(self) -> int:
        return sum(math.prod(s) for unit in self.units for s in unit)

    @property
    def num_tensors(self) -> int:
        return sum(len(unit) for unit in self.units)


def llama(config: LlamaConfig) -> Model:
    """common.model.LlamaForCausalLM's parameters, shape by shape (nn.Linear: out x in)."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * config.head_dim
    layer = [(h,), (h, h), (kv, h), (kv, h), (h, h), (h,), (i, h), (i, h), (h, i)]
    units = [[(v, h)], *[list(layer) for _ in range(config.num_hidden_layers)], [(h,)], [(v, h)]]
    return Model(units, [True] + [False] * config.num_hidden_layers + [True, True], config)


def count_only(num_params: int) -> Model:
    return Model([[(num_params,)]], [False], None)


# ---------------------------------------------------------------- the training state

def shard(numel: int, world: int) -> int:
    """S: a flat buffer of `numel` elements padded to S x world, S per rank."""
    return -(-numel // world)


def most_pieces(buffers: list[tuple[int, int]]) -> int:
    """AdamW tensors on the worst rank, over flat buffers of (decayed, size per rank):
    chapter 05's FlatShard puts the decayed matrix elements first, so every rank holds
    one piece of each buffer, and the rank whose slice the cut falls inside holds two."""
    cuts = Counter(d // size for d, size in buffers if d % size)
    return len(buffers) + max(cuts.values(), default=0)


def decayed(unit) -> int:
    return sum(math.prod(s) for s in unit if len(s) >= 2)


def fsdp2_local(shape: tuple[int, ...], world: int) -> int:
    """Elements of rank 0's fully_shard shard of a tensor (the largest): dim 0 in chunks."""
    return shard(shape[0], world) * math.prod(shape[1:])


def state_bytes(model: Model, mode: str, world: int, p: Precision) -> dict:
    """Bytes the worst rank holds between steps: parameters, gradients, optimizer (the
    master copy, AdamW's moments and step counters)."""
    n, opt = model.num_params, p.master + p.moments
    if mode == "ddp":
        return {"params": p.param * n, "grads": p.grad * n,
                "optimizer": opt * n + STEP_COUNTER * model.num_tensors}
    if mode in ("zero1", "zero2"):  # one flat buffer over every parameter
        s = shard(n, world)
        pieces = most_pieces([(sum(decayed(u) for u in model.units), s)])
        # chapter 05's zero1 keeps the full gradient buffer and the slice reduce-scatter
        # fills; ZeRO-2 reduce-scatters bucket by bucket and keeps the slice only
        grads = s * world + s if mode == "zero1" else s
        return {"params": p.param * s * world, "grads": p.grad * grads,
                "optimizer": opt * s + STEP_COUNTER * pieces}
    if mode == "zero3":  # one flat buffer per unit
        sizes = [shard(sum(math.prod(s) for s in u), world) for u in model.units]
        pieces = most_pieces([(decayed(u), s) for u, s in zip(model.units, sizes)])
        return {"params": p.param * sum(sizes), "grads": p.grad * sum(sizes),
                "optimizer": opt * sum(sizes) + STEP_COUNTER * pieces}
    if mode == "fsdp2":  # every tensor on its own, dim 0 split
        local = sum(fsdp2_local(s, world) for u in model.units for s in u)
        return {"params": p.param * local, "grads": p.grad * local,
                "optimizer": opt * local + STEP_COUNTER * model.num_tensors}
    raise ValueError(f"unknown mode {mode!r}")


def gathered_unit_bytes(model: Model, mode: str, world: int, p: Precision) -> int:
    """zero3, fsdp2: the largest unit's gathered parameters and full gradients, held
    besides the shards while it computes (fsdp2's prefetching: up to two units)."""
    if mode == "zero3":
        return max((p.comm + p.grad) * shard(sum(math.prod(s) for s in u), world) * world for u in model.units)
    if mode == "fsdp2":  # the embedding, final norm and head are one unit: the root
        root = [s for u, is_root in zip(model.units, model.root) if is_root for s in u]
        units = [u for u, is_root in zip(model.units, model.root) if not is_root] + [root]
        return max((p.comm + p.grad) * sum(fsdp2_local(s, world) * world for s in u) for u in units)
    return 0


# ---------------------------------------------------------------------- the traffic

def collective_bytes(model: Model, mode: str, world: int, p: Precision) -> dict:
    """Per step, the bytes of the arrays each kind of collective carries (the reduced,
    scattered or gathered whole, nccl-tests' size convention), summed over calls."""
    n = model.num_params
    if mode == "ddp":
        return {"all_reduce": p.comm * n}
    if mode in ("zero1", "zero2"):
        padded = shard(n, world) * world
        return {"reduce_scatter": p.comm * padded, "all_gather": p.comm * padded}
    if mode == "zero3":  # gathered before forward and again before backward
        padded = [shard(sum(math.prod(s) for s in u), world) * world for u in model.units]
        return {"all_gather": 2 * p.comm * sum(padded), "reduce_scatter": p.comm * sum(padded)}
    if mode == "fsdp2":  # the root unit stays gathered from forward to backward: once
        padded = [sum(fsdp2_local(s, world) * world for s in u) for u in model.units]
        gathers = sum(b * (1 if root else 2) for b, root in zip(padded, model.root))
        return {"all_gather": p.comm * gathers, "reduce_scatter": p.comm * sum(padded)}
    raise ValueError(f"unknown mode {mode!r}")


def sent_bytes(model: Model, mode: str, world: int, p: Precision) -> dict:
    """Per step, the bytes each rank sends, per kind of collective (a ring algorithm)."""
    return {k: RING_FACTOR[k](world) * b for k, b in collective_bytes(model, mode, world, p).items()}


# ------------------------------------------------------------------ the activations

def normalised_bytes_per_token(h: int, p: Precision, cpu: bool = False) -> int:
    """One RMSNorm's normalised x, where autograd keeps it. On a bf16 stream the norm
    multiplies its bf16 result by the weight, which keeps that result (h in bf16). On an
    fp32 stream F.rms_norm takes the weight itself, and on CUDA (torch >= 2.9) its fused
    kernel keeps only its input and 1/rms: nothing more. A CPU's F.rms_norm is made of
    several operations, which keep the fp32 normalised x too (`cpu`: 4h)."""
    if p.stream != FP32:
        return p.stream * h
    return FP32 * h if cpu else 0


def layer_activation_bytes(config: LlamaConfig, tokens: int, seq: int, p: Precision, tp: int = 1,
                           cpu: bool = False) -> int:
    """What autograd saves for backward in one decoder layer of common.model on a GPU
    (`cpu`: on a CPU), for `tokens` = batch x seq, on one of `tp` tensor-parallel ranks
    (chapter 06; counted in tests/test_plan.py and 06-model-parallel/measure.py with
    saved-tensor hooks). Whole on every tp rank, fp32: the two RMSNorms' inputs (2h) and
    1/rms (2); on a bf16 stream the norms' normalised x (2h), which the multiply by the
    weight keeps (see `normalised_bytes_per_token`); the norms' outputs as the linears
    take them (2h in the compute dtype: once per norm, which under autocast hands them
    over in bf16 already). Split over the tp ranks (by heads, by MLP features):
    attention's logsumexp (one fp32 per head); in the compute dtype q (h), k and v
    (2 kv), attention's output (h), gate, up, silu and their product (4i). Autocast also
    saves a bf16 copy of every weight (this rank's slices) and of the rotary tables
    (4 x seq x head_dim)."""
    c = config
    h, i, heads = c.hidden_size, c.intermediate_size, c.num_attention_heads
    kv = c.num_key_value_heads * c.head_dim
    whole = FP32 * (2 * h + 2) + 2 * normalised_bytes_per_token(h, p, cpu) + p.act * 2 * h
    split = (FP32 * heads + p.act * (2 * h + 2 * kv + 4 * i)) // tp  # tp divides each (check_layout)
    total = tokens * (whole + split)
    if p.autocast:
        total += p.act * (sum(math.prod(s) for s in layer_shapes(c, tp) if len(s) >= 2) + 4 * seq * c.head_dim)
    return total


def embedding_activation_bytes(tokens: int, tp: int = 1) -> int:
    """The token ids the embedding keeps; split over tp ranks, also which ids are another
    rank's (one bool each)."""
    return tokens * (TOKEN_ID + (tp > 1))


def head_activation_bytes(config: LlamaConfig, tokens: int, p: Precision, tp: int = 1, tp_rank: int = 0,
                          cpu: bool = False) -> int:
    """After the layers: the final norm (as a layer's), its output as the head takes it,
    and the loss. On one rank F.cross_entropy keeps the targets, the fp32 log-softmax
    (vocab per token) and the total weight (one fp32); split over tp ranks, chapter 06's
    vocab_parallel_cross_entropy keeps this rank's exp of the shifted logits and the
    shifted logits (2 x its vocabulary slice per token, fp32), the gather's index, its
    own mask, the sum of exp and the padding mask. Autocast adds the head's bf16 weight."""
    h, v = config.hidden_size, slice_rows(config.vocab_size, tp, tp_rank)
    norm = FP32 * (h + 1) + normalised_bytes_per_token(h, p, cpu) + p.act * h
    if tp == 1:
        total = tokens * (norm + TOKEN_ID + FP32 * v) + FP32
    else:
        total = tokens * (norm + 2 * FP32 * v + TOKEN_ID + 1 + FP32 + 1)
    return total + (p.act * v * h if p.autocast else 0)


def activation_bytes(config: LlamaConfig, batch: int, seq: int, p: Precision, checkpointing: bool) -> int:
    """Saved for backward on one rank. With activation checkpointing (each decoder layer
    under torch.utils.checkpoint) only each layer's input is kept; in backward one layer
    at a time is recomputed, its activations held until its gradients are done."""
    tokens, layers = batch * seq, config.num_hidden_layers
    layer = layer_activation_bytes(config, tokens, seq, p)
    kept = layers * tokens * config.hidden_size * p.stream + layer if checkpointing else layers * layer
    return kept + embedding_activation_bytes(tokens) + head_activation_bytes(config, tokens, p)


# -------------------------------------------- chapter 06: the model split over ranks

def slice_rows(size: int, tp: int, rank: int = 0) -> int:
    """Rows of `size` on tp rank `rank`: ceil(size / tp) each, the last ones shorter
    (torch.chunk's split, as chapter 06's shard_range cuts); rank 0 holds the most."""
    per = -(-size // tp)
    start = min(rank * per, size)
    return min(start + per, size) - start


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Decoder layers per pipeline stage: the first num_layers % pp stages take one more
    (chapter 06's split_layers)."""
    per, extra = divmod(num_layers, pp)
    return [per + (s < extra) for s in range(pp)]


def layer_shapes(config: LlamaConfig, tp: int = 1) -> list[tuple[int, ...]]:
    """One decoder layer's parameters on one of `tp` ranks: q, k, v, gate and up cut by
    rows (output features), o and down by columns (input features), the norms whole."""
    h, i = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * config.head_dim
    return [(h,), (h // tp, h), (kv // tp, h), (kv // tp, h), (h, h // tp), (h,), (i // tp, h), (i // tp, h),
            (h, i // tp)]


def stage_shapes(config: LlamaConfig, tp: int, pp: int, stage: int, tp_rank: int = 0) -> list[tuple[int, ...]]:
    """The parameters one rank of chapter 06's layout holds: its stage's layers, the
    embedding on the first stage, the final norm and the head on the last; the embedding
    and the head cut over the tp ranks by vocabulary rows."""
    h, v = config.hidden_size, slice_rows(config.vocab_size, tp, tp_rank)
    layers = layer_shapes(config, tp) * stage_layers(config.num_hidden_layers, pp)[stage]
    return [(v, h)] * (stage == 0) + layers + [(h,), (v, h)] * (stage == pp - 1)


def stage_state_bytes(config: LlamaConfig, tp: int, pp: int, stage: int, p: Precision, tp_rank: int = 0) -> dict:
    """Parameters, gradients and AdamW's state one rank holds between steps: its own
    tensors, each in full (as ddp holds the whole model)."""
    return state_bytes(Model([stage_shapes(config, tp, pp, stage, tp_rank)], [False], config), "ddp", 1, p)


def in_flight(schedule: str, m: int, pp: int, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once at most: GPipe all m; 1F1B
    its p - s - 1 warm-up forwards and one more (m, where there are fewer)."""
    return m if schedule == "gpipe" else min(pp - stage, m)


def stage_activation_bytes(config: LlamaConfig, tokens: int, seq: int, p: Precision, tp: int, pp: int, stage: int,
                           tp_rank: int = 0, cpu: bool = False) -> int:
    """One micro-batch of `tokens` on one rank of a stage: what autograd saves in its
    forward (and the loss, on the last stage), and the output the pipeline keeps until
    its backward: the activations it sent on, or, on the last stage, the loss (one fp32)."""
    total = stage_layers(config.num_hidden_layers, pp)[stage] * layer_activation_bytes(config, tokens, seq, p, tp, cpu)
    if stage == 0:
        total += embedding_activation_bytes(tokens, tp)
    if stage == pp - 1:
        return total + head_activation_bytes(config, tokens, p, tp, tp_rank, cpu) + FP32
    return total + tokens * config.hidden_size * p.stream


def stage_kept_bytes(config: LlamaConfig, tokens: int, seq: int, p: Precision, tp: int, pp: int, stage: int,
                     schedule: str, m: int, tp_rank: int = 0, cpu: bool = False) -> int:
    """The most bytes one rank of a stage keeps between its operations in a step of m
    micro-batches of `tokens` each (as a backward starts): the micro-batches in flight
    (`in_flight`: for 1F1B at most pp - stage, whatever m is), the gradient of its output
    it has just received (every stage but the last), and the step's running loss (one
    fp32). Chapter 06's measure.py counts it."""
    kept = in_flight(schedule, m, pp, stage) * stage_activation_bytes(config, tokens, seq, p, tp, pp, stage,
                                                                       tp_rank, cpu)
    if stage < pp - 1:
        kept += tokens * config.hidden_size * p.stream
    return kept + FP32


def tp_all_reduce_bytes(config: LlamaConfig, tokens: int, p: Precision, tp: int, pp: int, stage: int) -> tuple[int, int]:
    """Per step of `tokens` (every micro-batch), the bytes of the arrays one tp rank
    all-reduces: (per decoder layer, the whole stage). A layer: g after attention and
    after the MLP in forward (the row-parallel outputs) and f before them in backward (the
    gradient of the norms' outputs), tokens x h each, in the matmuls' dtype. The first
    stage adds the embedding's g (in the stream's dtype), the last the head's f and the
    loss's three all-reduces of one fp32 number per token."""
    if tp == 1:
        return 0, 0
    h = config.hidden_size
    layer = 4 * tokens * h * p.act
    total = stage_layers(config.num_hidden_layers, pp)[stage] * layer
    total += tokens * h * p.stream if stage == 0 else 0
    total += tokens * (h * p.act + 3 * FP32) if stage == pp - 1 else 0
    return layer, total


# ------------------------------------------------------------------ the checkpoint

def checkpoint_bytes(model: Model) -> int:
    """The training state a checkpoint holds: fp32 weights (the master copy in bf16),
    AdamW's moments and step counters (chapter 04's file; chapter 05's DCP shards)."""
    return CHECKPOINT_PER_PARAM * model.num_params + STEP_COUNTER * model.num_tensors


def checkpoint_seconds(model: Model, mode: str, nodes: int, world: int, disk_gbps: float,
                       busbw_gbps: float) -> tuple[float, float]:
    """(save, resume) seconds. ddp: chapter 04, rank 0 writes the whole file, and on
    resume reads it and broadcasts it to the others. Sharded modes: DCP, every rank
    writes and reads its own part, so every node's storage bandwidth works at once."""
    size = checkpoint_bytes(model)
    if mode == "ddp":
        write = size / (disk_gbps * 1e9)
        broadcast = size / (busbw_gbps * 1e9) if world > 1 else 0.0
        return write, write + broadcast
    seconds = size / (nodes * disk_gbps * 1e9)
    return seconds, seconds


# ------------------------------------- chapter 08: the sequence split over cp ranks

def cp_layer_activation_bytes(config: LlamaConfig, tokens: int, seq: int, p: Precision, cp: int,
                              variant: str = "ring", tp: int = 1, cpu: bool = False) -> int:
    """One decoder layer on one of `cp` context-parallel ranks, `tokens` = batch x seq /
    cp of its own. Ring attention keeps what one process's attention keeps for the same
    tokens (q, k, v, the output, the log-sum-exp: `layer_activation_bytes`, with the
    shard's rotary tables). All-to-all also keeps the output as o_proj reads it (it
    comes back from the trade in another layout: h / tp per token in the compute dtype)
    and the two orders of the whole sequence's positions it reorders by (int64 each)."""
    total = layer_activation_bytes(config, tokens, seq // cp, p, tp, cpu)
    if variant == "all-to-all":
        total += tokens * config.hidden_size // tp * p.act + 2 * TOKEN_ID * seq
    return total


def cp_activation_bytes(config: LlamaConfig, batch: int, seq: int, p: Precision, cp: int, variant: str = "ring",
                        tp: int = 1, checkpointing: bool = False, cpu: bool = False) -> int:
    """What one of `cp` ranks saves for backward in a forward of `batch` sequences of
    `seq` tokens (and the loss), the whole model on every rank: a cp-th of the tokens
    each (with activation checkpointing, each layer's input kept and one layer's
    activations at a time, as `activation_bytes`)."""
    tokens, layers = batch * seq // cp, config.num_hidden_layers
    layer = cp_layer_activation_bytes(config, tokens, seq, p, cp, variant, tp, cpu)
    kept = layers * tokens * config.hidden_size * p.stream + layer if checkpointing else layers * layer
    return kept + embedding_activation_bytes(tokens, tp) + head_activation_bytes(config, tokens, p, tp, cpu=cpu)


def cp_traffic_bytes(config: LlamaConfig, tokens: int, p: Precision, cp: int, variant: str, tp: int = 1) -> dict:
    """Per step of `tokens` on one rank (its share of the sequence: batch x seq / cp),
    the bytes its attention communicates, forward and backward, every layer.

    ring: {"sent": bytes sent}. Each hop carries a block's keys and values (2 kv / tp
    per token, in the compute dtype): cp - 1 hops in forward, cp - 1 again in backward,
    and beside them the block's key/value gradients, cp hops (the last one home), summed
    in fp32 at least on their way.
    all-to-all: {"all_to_all": bytes of the arrays traded}; a rank keeps a cp-th of
    each and sends the rest. Forward trades q, k and v away and the output back
    ((2 h + 2 kv) / tp per token), backward their gradients."""
    if cp == 1:
        return {}
    h, kv = config.hidden_size // tp, config.num_key_value_heads * config.head_dim // tp
    if variant == "ring":
        layer = tokens * 2 * kv * (2 * (cp - 1) * p.act + cp * max(p.act, FP32))
        return {"sent": config.num_hidden_layers * layer}
    return {"all_to_all": config.num_hidden_layers * 2 * tokens * (2 * h + 2 * kv) * p.act}


def cp_sent_bytes(config: LlamaConfig, tokens: int, p: Precision, cp: int, variant: str, tp: int = 1) -> float:
    """`cp_traffic_bytes` as the bytes one rank sends: an all-to-all keeps a cp-th of its array."""
    traffic = cp_traffic_bytes(config, tokens, p, cp, variant, tp)
    return traffic.get("sent", 0) + traffic.get("all_to_all", 0) * (cp - 1) / cp


def tp_model(config: LlamaConfig, tp: int, tp_rank: int = 0) -> Model:
    """One tp rank's slice of the model (tp rank 0's: the largest vocabulary slice), in
    FSDP's units: the embedding, each decoder layer, the final norm, the head."""
    h, v, layers = config.hidden_size, slice_rows(config.vocab_size, tp, tp_rank), config.num_hidden_layers
    units = [[(v, h)], *[layer_shapes(config, tp) for _ in range(layers)], [(h,)], [(v, h)]]
    return Model(units, [True] + [False] * layers + [True, True], config)


def cp_rank_bytes(config: LlamaConfig, batch: int, seq: int, p: Precision, dp: int, cp: int, tp: int,
                  variant: str = "ring", checkpointing: bool = False) -> dict:
    """What one rank of chapter 08's layout (dp x cp x tp, FSDP over the dp x cp ranks,
    each holding tp rank 0's slice) holds at its peak: its shards of the training state,
    one FSDP unit gathered whole (weights and gradients), and the activations saved for
    backward by a forward of its tokens (`cp_activation_bytes`)."""
    model = tp_model(config, tp)
    return {"state": sum(state_bytes(model, "fsdp2", dp * cp, p).values()),
            "gathered": gathered_unit_bytes(model, "fsdp2", dp * cp, p),
            "activations": cp_activation_bytes(config, batch, seq, p, cp, variant, tp, checkpointing)}


def longest_sequence(config: LlamaConfig, batch: int, p: Precision, dp: int, cp: int, tp: int, memory: float,
                     variant: str = "ring", checkpointing: bool = False, limit: int = 1 << 26) -> int:
    """The longest sequence, a multiple of 2 x cp x tp tokens (up to `limit`), for which
    a rank's `cp_rank_bytes` stay within `memory` bytes; 0 if not even the shortest fits
    (the bytes grow with the sequence: a binary search)."""
    step = 2 * cp * tp

    def fits(n: int) -> bool:
        return sum(cp_rank_bytes(config, batch, n * step, p, dp, cp, tp, variant, checkpointing).values()) <= memory

    low, high = 0, limit // step  # fits(low) holds (or low is 0), fits(high + 1) is not asked
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low * step


# ------------------------- chapter 07: FSDP x tp (+ sequence parallelism) x pp (x interleaving)

def tp_cut_shapes(config: LlamaConfig, tp: int, layers: int, first: bool, last: bool,
                  tp_rank: int = 0) -> list[tuple[int, ...]]:
    """One pipeline stage's parameters as one tp rank holds them (chapter 06's cut: q, k,
    v, gate and up by rows, o and down by columns, the embedding and the head by
    vocabulary rows, the norms whole), in the order FSDP shards them."""
    h, v = config.hidden_size, slice_rows(config.vocab_size, tp, tp_rank)
    return [(v, h)] * first + layer_shapes(config, tp) * layers + [(h,), (v, h)] * last


def fsdp_stage_state_bytes(config: LlamaConfig, dp: int, tp: int, pp: int, virtual: int, pp_rank: int, p: Precision,
                           dp_rank: int = 0, tp_rank: int = 0) -> dict:
    """What one rank of chapter 07's layout holds between steps: its stages (pp_rank,
    pp_rank + pp, ...: `virtual` of them), each tensor cut over the tp ranks, then its
    rows over the dp ranks by fully_shard, in chunks of ceil(rows / dp). FSDP keeps every
    rank's parameters, and its reduce-scattered gradients, in chunks of that size (the
    last ranks' padded); AdamW's moments are the rank's own rows, plus a 4-byte step per
    tensor. Counted by 07-3d-parallelism/measure.py, to the byte."""
    stages = stage_layers(config.num_hidden_layers, pp * virtual)
    padded = own = tensors = 0
    for s in range(pp_rank, pp * virtual, pp):
        for shape in tp_cut_shapes(config, tp, stages[s], s == 0, s == pp * virtual - 1, tp_rank):
            rows, rest = shape[0], math.prod(shape[1:])
            chunk = shard(rows, dp)
            padded += chunk * rest
            own += max(0, min(chunk, rows - dp_rank * chunk)) * rest
            tensors += 1
    return {"params": p.param * padded, "grads": p.grad * padded,
            "optimizer": (p.master + p.moments) * own + STEP_COUNTER * tensors}


def sequence_parallel_saving(config: LlamaConfig, tokens: int, p: Precision, tp: int, cpu: bool = False) -> int:
    """What sequence parallelism takes off one decoder layer's saved activations on each
    of tp ranks, for `tokens` = batch x seq: the part of `layer_activation_bytes` that is
    whole on every rank with tensor parallelism alone, the two norms' inputs (the
    residual stream), their 1/rms and their normalised x, is kept for 1/tp of the tokens.
    The norms' outputs stay whole: the linears keep the gathered sequence they take.
    Counted by 07-3d-parallelism/measure.py, to the byte."""
    h = config.hidden_size
    per_token = FP32 * (2 * h + 2) + 2 * normalised_bytes_per_token(h, p, cpu)
    return tokens * per_token - (tokens // tp) * per_token


def pipeline_bubble(pp: int, m: int, virtual: int = 1) -> float:
    """The idle share of a step: ((p - 1) / v) / (m + (p - 1) / v), p pipeline ranks of
    v stages each, m micro-batches (m a multiple of p when v > 1); chapter 06's
    (p - 1) / (m + p - 1) at v = 1 (Narayanan et al. 2021)."""
    fill = (pp - 1) / virtual
    return fill / (m + fill)


def stages_in_flight(schedule: str, m: int, pp: int, virtual: int, pp_rank: int) -> float:
    """The micro-batches whose activations pipeline rank `pp_rank` holds at once at most,
    in units of its whole part (all its stages): GPipe all m; 1F1B p - r; the
    interleaved schedule's (p - r - 1) x 2 + (v - 1) x p warm-up forwards and one more
    (Megatron-LM's count), each of one stage, 1/v of the rank's part."""
    if schedule != "interleaved":
        return in_flight(schedule, m, pp, pp_rank)
    return min((pp - pp_rank - 1) * 2 + (virtual - 1) * pp + 1, m * virtual) / virtual


def rank_layers(config: LlamaConfig, pp: int, virtual: int, pp_rank: int) -> int:
    """Decoder layers pipeline rank `pp_rank` holds: its v stages' (pp_rank, pp_rank + pp, ...)."""
    stages = stage_layers(config.num_hidden_layers, pp * virtual)
    return sum(stages[s] for s in range(pp_rank, pp * virtual, pp))


def rank_3d_bytes(config: LlamaConfig, batch: int, seq: int, p: Precision, dp: int, tp: int, pp: int,
                  virtual: int, microbatches: int, schedule: str, sequence_parallel: bool, pp_rank: int,
                  checkpointing: bool = False) -> dict:
    """What pipeline rank `pp_rank` of chapter 07's layout (its tp rank 0 and dp rank 0)
    holds at its peak: its shards of the training state (`fsdp_stage_state_bytes`);
    its stages gathered whole, weights and gradients (with a pipeline, fully_shard keeps
    them gathered from the first forward to the last backward of a step, as torchtitan
    and the Llama 3 run do; without one, one layer at a time); and the activations of
    the micro-batches its schedule holds at once (each layer's as `layer_activation_bytes`
    counts them on a GPU, less `sequence_parallel_saving`; with activation checkpointing
    each layer's input only, this rank's piece of it, and one layer's whole while it is
    computed again)."""
    layers = rank_layers(config, pp, virtual, pp_rank)
    shapes = tp_cut_shapes(config, tp, layers, pp_rank == 0, pp_rank == pp - 1)  # stage 0, stage pp x v - 1
    gathered = (p.param + p.grad) * (sum(math.prod(s) for s in shapes) if pp > 1 else
                                     sum(math.prod(s) for s in layer_shapes(config, tp)))
    tokens = batch * seq // microbatches  # one micro-batch
    layer = layer_activation_bytes(config, tokens, seq, p, tp)
    if sequence_parallel and tp > 1:
        layer -= sequence_parallel_saving(config, tokens, p, tp)
    held = stages_in_flight(schedule, microbatches, pp, virtual, pp_rank)
    if checkpointing:
        kept = tokens * config.hidden_size * p.stream // (tp if sequence_parallel and tp > 1 else 1)
        activations = layers * kept * held + layer
    else:
        activations = layers * layer * held
    return {"state": sum(fsdp_stage_state_bytes(config, dp, tp, pp, virtual, pp_rank, p).values()),
            "gathered": gathered, "activations": int(activations)}


def rank_3d_sent_bytes(config: LlamaConfig, batch: int, seq: int, p: Precision, dp: int, tp: int, pp: int,
                       virtual: int, microbatches: int, sequence_parallel: bool, pp_rank: int) -> dict:
    """Per step, the bytes pipeline rank `pp_rank` of chapter 07's layout sends, per
    dimension, with ring algorithms: tp, its layers' two all-reduces forward and two
    backward (with sequence parallelism an all-gather and a reduce-scatter each: the
    same bytes); pp, the activations forward and their gradients back at each of its
    stages' boundaries, every micro-batch (cut over the tp ranks with sequence
    parallelism); dp, FSDP's all-gather of its shards (once a step with a pipeline,
    which keeps them gathered; twice without) and the reduce-scatter of its gradients."""
    layers, tokens = rank_layers(config, pp, virtual, pp_rank), batch * seq
    h = config.hidden_size
    tp_sent = RING_FACTOR["all_reduce"](tp) * layers * 4 * tokens * h * p.act
    boundaries = (virtual - (pp_rank == pp - 1)) + (virtual - (pp_rank == 0)) if pp > 1 else 0  # sends out, back
    pp_sent = boundaries * tokens * h * p.stream // (tp if sequence_parallel else 1)
    shapes = tp_cut_shapes(config, tp, layers, pp_rank == 0, pp_rank == pp - 1)
    padded = sum(shard(s[0], dp) * dp * math.prod(s[1:]) for s in shapes)
    gathers = 1 if pp > 1 else 2
    dp_sent = RING_FACTOR["all_gather"](dp) * p.comm * padded * (gathers + 1)
    return {"tp": tp_sent, "pp": pp_sent, "dp": dp_sent}
