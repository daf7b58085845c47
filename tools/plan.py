"""The plan on paper: what each rank holds, sends and saves for a model, a batch and a
cluster, per way of distributing the training state, before renting the cluster.

    python -m tools.plan --model-preset large --seq-length 2048 --gpus-per-node 8
    python -m tools.plan --layers 32 --hidden-size 4096 --heads 32 --intermediate-size 11008 \\
        --vocab-size 32000 --seq-length 4096 --gpus-per-node 8 --nodes 2 --precision bf16
    python -m tools.plan --params 7e9 --gpus-per-node 8      # no shape: no units, no activations
    python -m tools.plan --layers 32 --hidden-size 4096 --heads 32 --intermediate-size 11008 \\
        --vocab-size 32000 --seq-length 131072 --cp 8 --gpu-memory-gb 80   # chapter 08: long sequences
    python -m tools.plan --layers 126 --hidden-size 16384 --heads 128 --kv-heads 8 --intermediate-size 53248 \\
        --vocab-size 128256 --seq-length 8192 --precision bf16 --fsdp --tp 8 --pp 16 --virtual-stages 2 \\
        --nodes 128 --global-batch-size 256                                # chapter 07: 405 B on 1,024 GPUs

The command line and the tables; the formulas, and what each mode and layout means, are
in common/sizing.py.
"""

from __future__ import annotations

import argparse
import math
import re

from common.cli import Parser, comma_list, one_of, positive_float, positive_int
from common.errors import UsageError
from common.layout import layout_for
from common.model import PRESETS, LlamaConfig, get_config
from common.sizing import (MODES, PRECISIONS, RING_FACTOR, Model, activation_bytes, checkpoint_bytes,
                           checkpoint_seconds, collective_bytes, count_only, cp_rank_bytes, cp_sent_bytes,
                           gathered_unit_bytes, in_flight, llama, longest_sequence, pipeline_bubble, rank_3d_bytes,
                           rank_3d_sent_bytes, rank_layers, sent_bytes, stage_activation_bytes, stage_kept_bytes,
                           stage_layers, stage_shapes, stage_state_bytes, state_bytes, tp_model, tp_all_reduce_bytes)
from common.tables import markdown_table

MAX_RANKS = 1_000_000  # ten times the largest training clusters
MAX_LAYERS = 10_000  # a hundred times the deepest models; the plan lists every layer's tensors


# ------------------------------------------------------------------- the command line

def number_of_params(text: str) -> int:
    """7e9, 7B, 6.7b, 350M, 125k, 7000000000."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"must be a parameter count like 7e9, 7B or 350M (got {text!r})")
    value = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m[2]]
    if value < 1 or not math.isfinite(value) or value != round(value):
        raise argparse.ArgumentTypeError(f"must be a whole number of parameters >= 1 (got {text!r})")
    return int(round(value))


SHAPE_FLAGS = {"layers": "num_hidden_layers", "hidden_size": "hidden_size", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "intermediate_size": "intermediate_size"}
NEEDED = ("layers", "hidden_size", "heads", "intermediate_size")


def parse_args(argv=None):
    p = Parser(prog="python -m tools.plan", description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("model (a preset, a shape, or only a parameter count)")
    g.add_argument("--model-preset", type=one_of(*PRESETS), default=None,
                   help=f"{', '.join(PRESETS)} (default: small, unless a shape or --params is given); "
                        "shape flags override its values")
    g.add_argument("--layers", type=positive_int, help="decoder layers")
    g.add_argument("--hidden-size", type=positive_int, help="d_model")
    g.add_argument("--heads", type=positive_int, help="attention (query) heads")
    g.add_argument("--kv-heads", type=positive_int, help="key/value heads (default: the preset's; without one, --heads)")
    g.add_argument("--intermediate-size", type=positive_int, help="the MLP's inner width")
    g.add_argument("--vocab-size", type=positive_int, default=8192, help="vocabulary (the head's rows)")
    g.add_argument("--params", type=number_of_params, default=None,
                   help="only a parameter count (7e9, 7B): no activations, no padding")
    g = p.add_argument_group("batch and cluster")
    g.add_argument("--seq-length", type=positive_int, default=2048, help="tokens per sample")
    g.add_argument("--batch-size", type=positive_int, default=None,
                   help="samples per step, per rank (with --tp or --pp: per replica, its ranks share it; default: 1)")
    g.add_argument("--global-batch-size", type=positive_int, default=None,
                   help="samples per step over all ranks (instead of --batch-size)")
    g.add_argument("--gpus-per-node", type=positive_int, default=8, help="ranks per node")
    g.add_argument("--nodes", type=positive_int, default=1, help="nodes")
    g = p.add_argument_group("training")
    g.add_argument("--modes", type=comma_list(*MODES), default=None,
                   help=f"comma list (default: {','.join(MODES)})")
    g.add_argument("--precision", type=one_of(*PRECISIONS), default="autocast",
                   help="; ".join(f"{k}: {v.what}" for k, v in PRECISIONS.items()))
    g.add_argument("--busbw-gbps", type=positive_float, default=100.0,
                   help="bus bandwidth of the collectives over all ranks, GB/s (bench_collectives.py "
                        "measures it; across nodes, the network's)")
    g.add_argument("--disk-gbps", type=positive_float, default=2.0,
                   help="write and read bandwidth of each node to the checkpoint's storage, GB/s")
    g = p.add_argument_group("model parallelism, as chapter 06 splits the model (world = dp x pp x tp)")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks")
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    g.add_argument("--microbatches", type=positive_int, default=None,
                   help="micro-batches per batch (default: the batch, one sample each, with --pp 2 or more; else 1)")
    g.add_argument("--schedule", type=one_of("gpipe", "1f1b", "interleaved"), default=None,
                   help="the pipeline's schedule (default: 1f1b; interleaved with --virtual-stages 2 or more)")
    g = p.add_argument_group("chapter 07's layout: the dp ranks shard with FSDP, tp with sequence parallelism, "
                             "pp with v stages per rank (world = dp x pp x tp)")
    g.add_argument("--fsdp", action="store_true", help="chapter 07's layout (with --tp and --pp)")
    g.add_argument("--virtual-stages", type=positive_int, default=1,
                   help="stages per pipeline rank (2 or more: the interleaved schedule)")
    g.add_argument("--sequence-parallel", default=True, action=argparse.BooleanOptionalAction,
                   help="with --fsdp and --tp: the residual stream cut over the sequence")
    g = p.add_argument_group("context parallelism, as chapter 08 splits each sequence (world = dp x cp x tp; "
                             "FSDP over dp x cp)")
    g.add_argument("--cp", type=positive_int, default=1, help="context-parallel ranks: each sequence split over them")
    g.add_argument("--cp-attention", type=one_of("ring", "all-to-all"), default="ring",
                   help="ring: the key/value blocks passed around; all-to-all: the sequence traded for the heads")
    g.add_argument("--gpu-memory-gb", type=positive_float, default=None,
                   help="chapter 08's layout, and the longest sequence whose rank fits in this memory (GB, 1e9 bytes)")

    def check(args):
        if (args.layers or 0) > MAX_LAYERS:
            raise UsageError(f"--layers {args.layers:,}: the plan handles at most {MAX_LAYERS:,}")
        shape = [f for f in SHAPE_FLAGS if getattr(args, f) is not None]
        if args.params is not None and (shape or args.model_preset):
            raise UsageError("--params stands for the whole model: give it alone, or a preset or a "
                             "shape instead")
        missing = [f for f in NEEDED if getattr(args, f) is None]
        if shape and not args.model_preset and missing:
            raise UsageError("a shape without --model-preset needs " +
                             ", ".join("--" + f.replace("_", "-") for f in missing))
        args.world = args.gpus_per_node * args.nodes
        if args.world > MAX_RANKS:
            raise UsageError(f"{args.world:,} ranks ({args.nodes} node(s) x {args.gpus_per_node}): "
                             f"the plan handles at most {MAX_RANKS:,}")
        if args.cp > 1 or args.gpu_memory_gb is not None:
            return check_context(args, shape)
        args.schedule = args.schedule or ("interleaved" if args.virtual_stages > 1 else "1f1b")
        if (args.schedule == "interleaved") != (args.virtual_stages > 1) or (args.virtual_stages > 1 and not args.fsdp):
            raise UsageError("--schedule interleaved runs --virtual-stages 2 or more, with --fsdp (chapter 07)")
        split = args.tp * args.pp > 1
        if split and args.params is not None:
            raise UsageError("--tp and --pp split the model's tensors: give a preset or a shape, not --params")
        if args.fsdp and args.params is not None:
            raise UsageError("--fsdp plans chapter 07's layout, which cuts the model's tensors: give a preset or a shape")
        if (split or args.fsdp) and args.modes is not None:
            raise UsageError("--modes are chapter 05's ways to shard data parallelism; with --tp or --pp the "
                             "plan is chapter 06's layout, whose replicas all-reduce as DDP")
        args.modes = args.modes or list(MODES)
        args.model = count_only(args.params) if args.params is not None else llama(config_of(args, shape))
        if split:  # the model's shape and the world first: the batch is known below
            layout_for(args.world, args.model.config, 1, tp=args.tp, pp=args.pp, microbatches=1)
        args.dp = args.world // (args.tp * args.pp)
        if args.global_batch_size is not None:
            if args.batch_size is not None:
                raise UsageError("give --batch-size (per rank) or --global-batch-size, not both")
            if args.global_batch_size % args.dp:
                who = f"{args.dp} replicas" if split else f"{args.world} ranks ({args.nodes} node(s) x {args.gpus_per_node})"
                raise UsageError(f"--global-batch-size {args.global_batch_size} is not divisible by the {who}")
            args.batch_size = args.global_batch_size // args.dp
        args.batch_size = args.batch_size or 1
        # chapter 06's rule of which splits fit (common/layout.py); without a split no pipeline
        args.microbatches = layout_for(args.world, args.model.config, args.batch_size, tp=args.tp, pp=args.pp,
                                       microbatches=args.microbatches,
                                       schedule="1f1b" if args.schedule == "interleaved" else args.schedule
                                       ).microbatches if split else 1
        layers = args.model.config.num_hidden_layers if args.model.config else 0
        if args.fsdp and args.pp * args.virtual_stages > layers:
            raise UsageError(f"--pp {args.pp} x --virtual-stages {args.virtual_stages} stages exceed the model's "
                             f"{layers} layers")
    p.checks.append(check)
    return p.parse_args(argv)


def check_context(args, shape) -> None:
    """Chapter 08's layout: dp x cp x tp ranks, FSDP over dp x cp, no pipeline here."""
    if args.params is not None or args.modes is not None or args.pp > 1:
        raise UsageError("--cp and --gpu-memory-gb plan chapter 08's layout (FSDP over dp x cp, with --tp): give a "
                         "preset or a shape, and neither --params, --modes nor --pp")
    args.model = llama(config_of(args, shape))
    c, world = args.model.config, args.world
    if world % (args.tp * args.cp):
        raise UsageError(f"the {world} ranks ({args.nodes} node(s) x {args.gpus_per_node}) are not a multiple of "
                         f"--tp {args.tp} x --cp {args.cp}")
    layout_for(world // args.cp, c, 1, tp=args.tp)  # tp fits the heads, MLP features and vocabulary
    if args.seq_length % (2 * args.cp * args.tp):
        raise UsageError(f"--seq-length {args.seq_length} does not cut into 2 x --cp {args.cp} chunks of a "
                         f"multiple of --tp {args.tp} tokens")
    if args.cp_attention == "all-to-all" and (c.num_attention_heads // args.tp % args.cp
                                              or c.num_key_value_heads // args.tp % args.cp):
        raise UsageError(f"--cp-attention all-to-all: --cp {args.cp} does not divide the heads and KV heads per tp "
                         f"rank ({c.num_attention_heads // args.tp} and {c.num_key_value_heads // args.tp})")
    if args.global_batch_size is not None:
        raise UsageError("with --cp give --batch-size: sequences per replica of dp")
    args.dp, args.batch_size, args.microbatches = world // (args.tp * args.cp), args.batch_size or 1, 1


def config_of(args, shape_flags) -> LlamaConfig:
    values = {SHAPE_FLAGS[f]: getattr(args, f) for f in shape_flags}
    if "num_attention_heads" in values and "num_key_value_heads" not in values and not args.model_preset:
        values["num_key_value_heads"] = values["num_attention_heads"]
    try:
        if shape_flags and not args.model_preset:
            return LlamaConfig(vocab_size=args.vocab_size, max_position_embeddings=args.seq_length, **values)
        return get_config(args.model_preset or "small", args.vocab_size, **values)
    except ValueError as e:
        raise UsageError(f"not a valid model shape: {e}") from None


def size(n: float) -> str:
    """Bytes for reading: 3 significant digits, decimal units (GB = 1e9 bytes)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return str(n)


def duration(s: float) -> str:
    return f"{s * 1e3:,.3g} ms" if s < 1 else f"{s:,.3g} s"


def describe(model: Model) -> str:
    c = model.config
    shape = ("shape unknown (--params): no units, no activations, no padding; fsdp2 counted as zero3" if c is None else
             f"{c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads "
             f"({c.num_key_value_heads} KV), MLP {c.intermediate_size}, vocab {c.vocab_size}")
    return f"model: {count(model.num_params)} parameters; {shape}"


def plan(args) -> str:
    """The plan as text: a header and three Markdown tables (two for chapter 06's layout)."""
    if args.cp > 1 or args.gpu_memory_gb is not None:
        return plan_context(args)
    if args.fsdp:
        return plan_3d(args)
    if args.tp * args.pp > 1:
        return plan_split(args)
    model, p, world = args.model, PRECISIONS[args.precision], args.world
    c = model.config
    lines = [describe(model),
             f"{world} ranks ({args.nodes} x {args.gpus_per_node} GPUs); {args.batch_size} x {args.seq_length} "
             f"tokens per rank per step",
             f"precision {args.precision}: {p.what}", "",
             "held per rank (the worst rank; one unit gathered: zero3 and fsdp2 hold a unit's full weights "
             "and gradients while it computes; activations: saved for backward, without and with activation "
             "checkpointing of every decoder layer):", ""]
    rows = []
    for mode in args.modes:
        held = state_bytes(model, mode, world, p)
        state = sum(held.values())
        gathered = gathered_unit_bytes(model, mode, world, p)
        if c is None:  # no shape, no units: the whole model would count as one
            acts = ("n/a", "n/a", "n/a", "n/a")
            unit = "n/a" if gathered else ""
        else:
            a = [activation_bytes(c, args.batch_size, args.seq_length, p, ckpt) for ckpt in (False, True)]
            acts = (*map(size, a), size(state + gathered + a[0]), size(state + gathered + a[1]))
            unit = size(gathered) if gathered else ""
        rows.append((mode, size(held["params"]), size(held["grads"]), size(held["optimizer"]), size(state),
                     unit, *acts))
    lines.append(markdown_table(("mode", "params", "grads", "optimizer", "state", "one unit gathered",
                                 "activations", "act. (ckpt)", "total", "total (ckpt)"),
                                rows, right=range(1, 10)))
    lines += ["", f"sent per rank per step (ring algorithms), and its time at {args.busbw_gbps:g} GB/s busbw:", ""]
    rows = []
    for mode in args.modes:
        arrays = collective_bytes(model, mode, world, p)
        sent = sum(sent_bytes(model, mode, world, p).values())
        rows.append((mode, ", ".join(f"{k} {size(b)}" for k, b in arrays.items()), size(sent),
                     duration(sent / (args.busbw_gbps * 1e9))))
    lines.append(markdown_table(("mode", "collectives (array bytes per step)", "sent", "time"), rows, right=(2, 3)))
    lines += ["", f"checkpoint: {size(checkpoint_bytes(model))} (fp32 weights and AdamW's two moments); "
                  f"at {args.disk_gbps:g} GB/s per node:", ""]
    rows = []
    for mode in args.modes:
        save, resume = checkpoint_seconds(model, mode, args.nodes, world, args.disk_gbps, args.busbw_gbps)
        who = "rank 0, one file (chapter 04)" if mode == "ddp" else f"every rank its part (DCP), {args.nodes} node{'s' * (args.nodes > 1)}"
        rows.append((mode, who, duration(save), duration(resume)))
    lines.append(markdown_table(("mode", "written by", "save", "resume"), rows, right=(2, 3)))
    notes = []
    if "zero1" in args.modes:
        notes.append("zero1 as chapter 05 builds it: the full gradient buffer plus the slice reduce-scatter fills")
    if "zero2" in args.modes:
        notes.append("zero2: the textbook stage (gradients reduce-scattered bucket by bucket); chapter 05 does "
                     "not build it")
    if "ddp" in args.modes and world > 1:
        notes.append("ddp resume: rank 0 reads, then broadcasts the state at the busbw")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


def plan_split(args) -> str:
    """Chapter 06's layout: per pipeline stage (its tp rank 0, which holds the largest
    vocabulary slice), what a rank holds and what it sends per step."""
    c, p, tp, pp, dp, m = args.model.config, PRECISIONS[args.precision], args.tp, args.pp, args.dp, args.microbatches
    tokens = args.batch_size * args.seq_length
    lines = [describe(args.model),
             f"{args.world} ranks ({args.nodes} x {args.gpus_per_node} GPUs): dp {dp} x pp {pp} x tp {tp}; "
             f"{args.batch_size} x {args.seq_length} tokens per replica per step in {m} micro-batch"
             f"{'es' * (m > 1)}, {args.schedule} schedule",
             f"precision {args.precision}: {p.what}", "",
             "held per rank (tp rank 0 of each stage, the largest vocabulary slice; activations: saved for backward "
             "by one micro-batch; kept: the most a stage keeps between its operations, the micro-batches its "
             "schedule holds at once, the gradient it has just received and the running loss; no activation "
             "checkpointing):", ""]
    held, sent = [], []
    first_layer = 0
    for stage, layers in enumerate(stage_layers(c.num_hidden_layers, pp)):
        state = stage_state_bytes(c, tp, pp, stage, p)
        micro = stage_activation_bytes(c, tokens // m, args.seq_length, p, tp, pp, stage)
        n = in_flight(args.schedule, m, pp, stage)
        kept = stage_kept_bytes(c, tokens // m, args.seq_length, p, tp, pp, stage, args.schedule, m)
        what = [f"layers {first_layer}-{first_layer + layers - 1}" if layers > 1 else f"layer {first_layer}"]
        what = ["embedding"] * (stage == 0) + what + ["head"] * (stage == pp - 1)
        first_layer += layers
        held.append((stage, ", ".join(what), size(state["params"]), size(state["grads"]), size(state["optimizer"]),
                     size(micro), n, size(kept), size(sum(state.values()) + kept)))
        layer, tp_bytes = tp_all_reduce_bytes(c, tokens, p, tp, pp, stage)
        p2p = tokens * c.hidden_size * p.stream * ((stage < pp - 1) + (stage > 0))  # forward, backward
        grads = p.comm * sum(math.prod(s) for s in stage_shapes(c, tp, pp, stage)) if dp > 1 else 0
        total = RING_FACTOR["all_reduce"](tp) * tp_bytes + p2p + RING_FACTOR["all_reduce"](dp) * grads
        sent.append((stage, size(layer), size(tp_bytes), size(p2p), size(grads), size(total),
                     duration(total / (args.busbw_gbps * 1e9))))
    lines.append(markdown_table(("stage", "holds", "params", "grads", "optimizer", "activations per micro-batch",
                                 "micro-batches held", "kept at most", "total"), held, right=range(2, 9)))
    lines += ["", f"per rank per step: the arrays tensor parallelism all-reduces (per decoder layer, whole stage), "
                  f"the pipeline sends to its neighbours, data parallelism all-reduces; sent with ring algorithms, "
                  f"and its time at {args.busbw_gbps:g} GB/s:", ""]
    lines.append(markdown_table(("stage", "tp all-reduce, per layer", "tp all-reduce", "pp sent",
                                 "dp all-reduce", "sent", "time"), sent, right=range(1, 7)))
    if tp > args.gpus_per_node:
        lines += ["", f"- tp {tp} spans nodes of {args.gpus_per_node} GPUs: its all-reduces, in every layer, "
                      f"cross the network"]
    return "\n".join(lines)


def plan_3d(args) -> str:
    """Chapter 07's layout: per pipeline rank (its tp and dp rank 0), what a GPU holds at
    its peak and what it sends per step over each dimension; and the bubble."""
    c, p, tp, pp, dp, v, m = (args.model.config, PRECISIONS[args.precision], args.tp, args.pp, args.dp,
                              args.virtual_stages, args.microbatches)
    sp = args.sequence_parallel and tp > 1
    lines = [describe(args.model),
             f"{args.world} ranks ({args.nodes} x {args.gpus_per_node} GPUs): dp {dp} (FSDP) x pp {pp}"
             f"{f' ({v} stages each)' if v > 1 else ''} x tp {tp}{' with sequence parallelism' * sp}; "
             f"{args.batch_size} x {args.seq_length} tokens per replica per step in {m} micro-batches, "
             f"{args.schedule} schedule: a bubble of {pipeline_bubble(pp, m, v):.1%} of the step",
             f"precision {args.precision}: {p.what}", "",
             "held per GPU at its peak (its shards of the training state; its stages' weights and gradients "
             "gathered whole, kept from a step's first forward to its last backward with a pipeline, one layer "
             "at a time without; the activations its schedule holds at once, without and with activation "
             "checkpointing):", ""]
    held, sent = [], []
    for r in range(pp):
        b, ck = (rank_3d_bytes(c, args.batch_size, args.seq_length, p, dp, tp, pp, v, m, args.schedule, sp, r, ckpt)
                 for ckpt in (False, True))
        held.append((r, rank_layers(c, pp, v, r), size(b["state"]), size(b["gathered"]), size(b["activations"]),
                     size(ck["activations"]), size(sum(b.values())), size(sum(ck.values()))))
        s = rank_3d_sent_bytes(c, args.batch_size, args.seq_length, p, dp, tp, pp, v, m, sp, r)
        sent.append((r, size(s["tp"]), size(s["pp"]), size(s["dp"]), size(sum(s.values())),
                     duration(sum(s.values()) / (args.busbw_gbps * 1e9))))
    lines.append(markdown_table(("pipeline rank", "layers", "state", "gathered", "activations", "act. (ckpt)",
                                 "total", "total (ckpt)"), held, right=range(1, 8)))
    lines += ["", f"sent per GPU per step (ring algorithms): tp's all-gathers and reduce-scatters (all-reduces "
                  f"without sequence parallelism), the pipeline's sends, FSDP's all-gathers and reduce-scatter; its "
                  f"time at {args.busbw_gbps:g} GB/s (tp runs inside a node, on its own links):", "",
              markdown_table(("pipeline rank", "tp", "pp", "dp (FSDP)", "sent", "time"), sent, right=range(1, 6))]
    if tp > args.gpus_per_node:
        lines += ["", f"- tp {tp} spans nodes of {args.gpus_per_node} GPUs: its collectives, in every layer, "
                      f"cross the network"]
    return "\n".join(lines)


def plan_context(args) -> str:
    """Chapter 08's layout: what a rank holds at its peak, what it sends per step, and
    (with --gpu-memory-gb) the longest sequence that fits."""
    c, p, dp, cp, tp = args.model.config, PRECISIONS[args.precision], args.dp, args.cp, args.tp
    batch, seq, variant = args.batch_size, args.seq_length, args.cp_attention
    lines = [describe(args.model),
             f"{args.world} ranks ({args.nodes} x {args.gpus_per_node} GPUs): dp {dp} x cp {cp} x tp {tp}, FSDP over "
             f"the dp x cp ranks; {batch} x {seq} tokens per replica per step, {seq // cp} of each sequence per "
             f"rank; {variant} attention",
             f"precision {args.precision}: {p.what}", "",
             "held per rank at its peak (its shards of the training state, one FSDP unit gathered whole, and the "
             "activations saved for backward, without and with activation checkpointing; tp as chapter 06 "
             "counts it, without sequence parallelism):", ""]
    held = [cp_rank_bytes(c, batch, seq, p, dp, cp, tp, variant, ckpt) for ckpt in (False, True)]
    lines.append(markdown_table(("state", "one unit gathered", "activations", "act. (ckpt)", "total", "total (ckpt)"),
                                [(size(held[0]["state"]), size(held[0]["gathered"]), size(held[0]["activations"]),
                                  size(held[1]["activations"]), *(size(sum(h.values())) for h in held))],
                                right=range(6)))
    fsdp = sum(sent_bytes(tp_model(c, tp), "fsdp2", dp * cp, p).values())
    tokens = batch * seq // cp
    attention = {v: cp_sent_bytes(c, tokens, p, cp, v, tp) for v in ("ring", "all-to-all")}
    rows = [(v, size(fsdp), size(b), size(fsdp + b), duration((fsdp + b) / (args.busbw_gbps * 1e9)))
            for v, b in attention.items()]
    lines += ["", f"sent per rank per step: FSDP's all-gathers and reduce-scatter over the dp x cp ranks, and "
                  f"attention's over the cp ranks (tp's all-reduces not counted), and its time at "
                  f"{args.busbw_gbps:g} GB/s:", "",
              markdown_table(("attention", "FSDP", "attention", "sent", "time"), rows, right=range(1, 5))]
    if args.gpu_memory_gb is not None:
        memory = args.gpu_memory_gb * 1e9
        longest = [longest_sequence(c, batch, p, dp, cp, tp, memory, variant, ckpt) for ckpt in (False, True)]
        lines += ["", f"the longest sequence whose rank fits in {args.gpu_memory_gb:g} GB (a multiple of 2 x cp x tp "
                      f"= {2 * cp * tp} tokens): {longest[0]:,} tokens; with activation checkpointing {longest[1]:,}"]
    return "\n".join(lines)


def main(argv=None):
    print(plan(parse_args(argv)))


if __name__ == "__main__":
    main()
