"""Chapter 07, measured: the interleaved schedule's bubble against the formula; what
sequence parallelism takes off each rank's activations; what each rank holds and its
peak in a step, against `python -m tools.plan` (its formulas: common/sizing.py).

The bubble. Every rank is a pipeline rank (pp = the world size), with one stage each
(1F1B, chapter 06's schedule) or v stages each (the interleaved schedule), the small
preset's 4 layers cut into pp x v stages. For each micro-batch count m, --steps steps of
each: Pipeline.events says when each forward and backward ran, in which order. From
them: each rank's idle share of the real step (communication and a shared CPU's noise
included); and the schedule's own bubble: the operations replayed in the order torch's
schedule ran them, every forward taking the median forward's time and every backward
the median backward's (equal stages, free communication), the busiest rank's idle
share, against the formula ((p - 1) / v) / (m + (p - 1) / v). On a CPU, run one
process per core.

Sequence parallelism. tp 2 (dp the rest of the world): one decoder layer's forward, with
and without sequence parallelism, each rank counting the bytes autograd keeps for
backward (saved-tensor hooks, each storage once), against the planner.

What each rank holds. For each --layouts (world = dp x pp x tp), one step of train_llm.py's
composition (FSDP x TP+SP x PP): each rank's parameters, gradients and AdamW state, to
the byte against the planner; and every tensor the step creates counted while it lives
(a dispatch mode, as torch's MemTracker counts them): the peak of the rank's bytes, which
must stay far below the whole model's parameters, gradients and AdamW state.

    torchrun --standalone --nproc-per-node=2 07-3d-parallelism/measure.py
    torchrun --standalone --nproc-per-node=4 07-3d-parallelism/measure.py --layouts dp2xtp2,pp2xtp2,dp4
"""

import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from common.cli import comma_list, non_negative_int, one_of, positive_int, seed_value
from common.demos import script_parser, start_group
from common.distributed import gc_and_destroy_process_group
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.model import PRESETS, get_config
from common.runfolder import claim_run_folder
from common.sizing import PRECISIONS, fsdp_stage_state_bytes, llama, sequence_parallel_saving
from common.tables import markdown_table
from common.training import build_optimizer
from parallelize import Layout, build_stages, clip_grad_norm, materialize
from pipeline_parallel import Part, Pipeline, bubble
from prove import check_layout, layout_name, layout_of
from train_llm import compute_loss

COUNTS = ("1", "2", "4", "8", "16")


def parse_args(argv=None):
    p = script_parser("07-measure", "The interleaved schedule's bubble, sequence parallelism's saving, "
                      "what each rank holds and its peak.", min_world=2)
    p.add_argument("--model-preset", default="small", type=one_of(*PRESETS), help="model size")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers (4: 2 ranks x 2 stages each)")
    p.add_argument("--seq-length", type=positive_int, default=64, help="tokens per sample")
    p.add_argument("--vocab-size", type=positive_int, default=512, help="vocabulary of the random tokens")
    p.add_argument("--microbatches", type=comma_list(*COUNTS), default="2,4,8", help="micro-batch counts m")
    p.add_argument("--virtual-stages", type=positive_int, default=2, help="v of the interleaved schedule")
    p.add_argument("--steps", type=positive_int, default=3, help="measured steps per schedule and m")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="unmeasured first steps")
    p.add_argument("--seed", type=seed_value, default=0, help="weights and tokens")
    p.add_argument("--layouts", type=lambda t: [x for x in t.split(",") if x], default=None,
                   help="layouts whose bytes and peak to measure (prove.py's names; default: dp<world>)")

    def check(args):
        world, config = int(os.environ["WORLD_SIZE"]), config_of(args)
        if world * args.virtual_stages > config.num_hidden_layers:
            raise UsageError(f"{world} pipeline ranks x --virtual-stages {args.virtual_stages} stages exceed the "
                             f"{args.model_preset!r} preset's {config.num_hidden_layers} layers")
        if world % 2 or args.seq_length % 2:
            raise UsageError("sequence parallelism is measured on tp 2: an even world size and --seq-length")
        args.layouts = [check_layout(layout_of(n), n, world, config, world, args.seq_length)
                        for n in args.layouts or [f"dp{world}"]]
    p.checks.append(check)
    return p.parse_args(argv)


def config_of(args):
    return get_config(args.model_preset, args.vocab_size, num_hidden_layers=args.layers)


# ---- the bubble -------------------------------------------------------------------------

def replay(ops: list, durations: dict, stages: int) -> tuple[float, list[float]]:
    """Every rank's operations (`ops[r]`: (kind, stage, micro-batch) in the order they ran)
    each taking `durations[(r, kind, stage)]`, each starting once its rank is free and its
    input is there (a forward after the previous stage's forward of that micro-batch, a
    backward after the next stage's backward), communication free. Returns (the step's
    length, each rank's busy time)."""
    done, free, pos = {}, [0.0] * len(ops), [0] * len(ops)
    while any(pos[r] < len(ops[r]) for r in range(len(ops))):
        moved = False
        for r in range(len(ops)):
            while pos[r] < len(ops[r]):
                kind, s, i = ops[r][pos[r]]
                needs = ("F", s - 1, i) if kind == "F" and s > 0 else \
                    ("B", s + 1, i) if kind == "B" and s < stages - 1 else None
                if needs is not None and needs not in done:
                    break
                start = max(free[r], done[needs] if needs else 0.0)
                free[r] = done[(kind, s, i)] = start + durations[(r, kind, s)]
                pos[r], moved = pos[r] + 1, True
        if not moved:
            raise RuntimeError("the schedule waits on itself")
    return max(free), [sum(durations[(r, k, s)] for k, s, _ in ops[r]) for r in range(len(ops))]


def measure_bubble(args, group, config, v: int, m: int) -> dict:
    """pp = the world, v stages per rank, m micro-batches of one sample each."""
    p = group.world
    # (torch's 1F1B needs a micro-batch per stage at least; GPipe has the same bubble)
    layout = Layout(pp=p, virtual=v, microbatches=m, schedule="interleaved" if v > 1 else "1f1b" if m >= p else "gpipe")
    mesh = init_device_mesh(group.device.type, (1, p, 1), mesh_dim_names=("dp", "pp", "tp"))
    stages, ids = build_stages(config, mesh, layout, group.device)
    materialize(stages, config, layout, args.seed, 0)
    pipeline = Pipeline(stages, ids, p * v, mesh.get_group("pp"), layout.schedule, m, group.device,
                        config.hidden_size, torch.float32)
    tokens = torch.randint(0, config.vocab_size, (m, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(args.seed)).to(group.device)
    micro = list(zip(tokens[:, :-1].chunk(m), tokens[:, 1:].chunk(m), [None] * m))
    steps = []
    for _ in range(args.warmup + args.steps):
        dist.barrier()  # every rank starts the step together
        start = time.perf_counter()
        pipeline.step(micro, lambda out, y: compute_loss(out, y) / y.numel())
        steps.append((start, time.perf_counter(), list(pipeline.events)))
        for q in Part(stages).parameters():
            q.grad = None
    everyone = [None] * p
    dist.all_gather_object(everyone, steps[args.warmup:])
    idle, schedule = [], []
    for k in range(args.steps):
        ranks = [e[k] for e in everyone]
        real = max(s[1] for s in ranks) - min(s[0] for s in ranks)
        idle.append(statistics.median(1 - sum(b - a for *_, a, b in s[2]) / real for s in ranks))
        ops = [[(kind, stage, i) for kind, stage, i, _, _ in s[2]] for s in ranks]
        typical = {kind: statistics.median(b - a for s in ranks for k2, _, _, a, b in s[2] if k2 == kind)
                   for kind in "FB"}
        durations = {(r, kind, stage): typical[kind] for r in range(p) for kind, stage, _ in ops[r]}
        length, busy = replay(ops, durations, p * v)
        schedule.append(1 - max(busy) / length)
    return {"v": v, "m": m, "stages": p, "idle": statistics.median(idle),
            "schedule_bubble": statistics.median(schedule), "formula": bubble(p, m, v)}


# ---- sequence parallelism's saving ----------------------------------------------------------

def saved_bytes(run, own) -> int:
    """The bytes autograd keeps for backward while `run()` computes, each storage once,
    leaving out `own` (the parameters)."""
    skip, seen = {t.untyped_storage().data_ptr() for t in own}, {}

    def pack(t):
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def measure_sequence_parallel(args, group, config) -> dict:
    """One decoder layer's saved bytes on a rank of tp 2, with and without sequence
    parallelism, for one sample of --seq-length tokens."""
    tp, out = 2, {}
    for sp in (False, True):
        layout = Layout(dp=group.world // tp, tp=tp, sequence_parallel=sp)
        mesh = init_device_mesh(group.device.type, (layout.dp, 1, tp), mesh_dim_names=("dp", "pp", "tp"))
        stages, _ = build_stages(config, mesh, layout, group.device)
        materialize(stages, config, layout, args.seed, mesh.get_local_rank("tp"))
        layer, rotary = stages[0].layers["1"], stages[0].rotary
        shard = args.seq_length // layout.sequence_shards
        x = torch.randn(1, shard, config.hidden_size, device=group.device, requires_grad=True)
        cos, sin = rotary(args.seq_length)
        # the layer's input counts: its first norm keeps it (the previous layer's output)
        own = [q.to_local() if isinstance(q, DTensor) else q for q in layer.parameters()]
        out["sp" if sp else "tp"] = saved_bytes(lambda: layer(x, cos, sin), own)
    planned = sequence_parallel_saving(config, args.seq_length, PRECISIONS["fp32"], tp, cpu=group.device.type == "cpu")
    return {"tp": tp, "tokens": args.seq_length, "tp_bytes": out["tp"], "sp_bytes": out["sp"],
            "saving": out["tp"] - out["sp"], "planned_saving": planned}


# ---- what each rank holds, and its peak ------------------------------------------------------

class LiveTensors(TorchDispatchMode):
    """While on, every tensor storage an operation creates, for as long as it lives (as
    chapter 06's measure.py counts them), but those that existed before (`existing`: the
    rank's state, counted apart); `peak` the most they held at once."""

    def __init__(self, existing):
        super().__init__()
        self.sizes, self.peak = WeakIdKeyDictionary(), 0
        self.before = {(t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()
                       for t in existing}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # (a DTensor's own storage is none: its local tensor's counts, where it is made)
            if type(t) is torch.Tensor and t.untyped_storage().data_ptr() not in self.before:
                self.sizes[t.untyped_storage()] = True
        # each storage's size now: FSDP frees a gathered layer by resizing its storage to 0
        self.peak = max(self.peak, sum(storage.nbytes() for storage in self.sizes.keys()))
        return out


def local_nbytes(tensors) -> int:
    """The bytes of the storages under `tensors` (this rank's pieces), each storage once:
    FSDP keeps a layer's gradients in one buffer."""
    storages = {}
    for t in tensors:
        if t is not None:
            storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure_layout(args, group, config, layout: Layout) -> dict:
    """One training step of this layout, as train_llm.py takes it: this rank's bytes held
    between steps, and its peak while stepping (its state included)."""
    mesh = init_device_mesh(group.device.type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=("dp", "pp", "tp"))
    stages, ids = build_stages(config, mesh, layout, group.device)
    materialize(stages, config, layout, args.seed, mesh.get_local_rank("tp"))
    part = Part(stages)
    batch = layout.dp * max(layout.pp, 1)
    m = batch // layout.dp if layout.pp > 1 else 1
    pipeline = Pipeline(stages, ids, layout.pp * layout.virtual, mesh.get_group("pp"),
                        "interleaved" if layout.virtual > 1 else "1f1b", m, group.device, config.hidden_size,
                        torch.float32)
    optimizer = build_optimizer(part, 1e-3, 0.1, group.device)
    tokens = torch.randint(0, config.vocab_size, (batch, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(args.seed)).to(group.device)
    x, y = tokens[mesh.get_local_rank("dp")::layout.dp, :-1], tokens[mesh.get_local_rank("dp")::layout.dp, 1:]

    def step():
        with loss_parallel() if layout.tp > 1 else nullcontext():
            pipeline.step(list(zip(x.chunk(m), y.chunk(m), [None] * m)),
                          lambda out, t: compute_loss(out, t) / t.numel())
        clip_grad_norm(part.parameters(), 1.0, mesh.get_local_rank("tp"))
        optimizer.step()
    step()  # AdamW's state exists from here
    optimizer.zero_grad(set_to_none=False)
    params = list(part.parameters())
    held = {"params": local_nbytes(params), "grads": local_nbytes(q.grad for q in params),
            "optimizer": local_nbytes(t for s in optimizer.state.values() for t in s.values())}
    state = [t for s in optimizer.state.values() for t in s.values()]
    with LiveTensors([*params, *(q.grad for q in params), *state]) as live:
        step()
    stage, dp_rank, tp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    planned = fsdp_stage_state_bytes(config, layout.dp, layout.tp, layout.pp, layout.virtual, stage,
                                     PRECISIONS["fp32"], dp_rank, tp_rank)
    return {"rank": group.rank, "held": held, "planned": planned, "peak_in_step": live.peak + sum(held.values())}


# ---- report ---------------------------------------------------------------------------

def main():
    args = parse_args()
    group = start_group(args.timeout)
    try:
        run(args, group)
    finally:
        gc_and_destroy_process_group()


def run(args, group):
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=group.rank)
    config = config_of(args)
    bubbles = [measure_bubble(args, group, config, v, int(m)) for v in sorted({1, args.virtual_stages})
               for m in args.microbatches]
    sp = measure_sequence_parallel(args, group, config)
    layouts = {}
    whole = 16 * llama(config).num_params  # fp32 weights and gradients, AdamW's two moments
    for layout in args.layouts:
        everyone = [None] * group.world
        dist.all_gather_object(everyone, measure_layout(args, group, config, layout))
        layouts[layout_name(layout)] = everyone
    if group.rank == 0:
        report(args, config, bubbles, sp, layouts, whole, run_dir)


def report(args, config, bubbles, sp, layouts, whole, run_dir):
    """Rank 0: the tables (terminal and tables.md) and measure.json."""
    rows = [(f"{b['v']}", f"{b['m']}", f"{b['idle']:.3f}", f"{b['schedule_bubble']:.3f}", f"{b['formula']:.3f}")
            for b in bubbles]
    text = [f"the bubble, {bubbles[0]['stages']} pipeline ranks, {config.num_hidden_layers} layers (idle: the real "
            f"step's; schedule: torch's order replayed, equal stages, free communication; formula: "
            f"((p-1)/v) / (m + (p-1)/v)):",
            "", markdown_table(("stages per rank v", "micro-batches m", "idle", "schedule", "formula"), rows,
                               right=range(5)), "",
            f"sequence parallelism, one decoder layer on one of {sp['tp']} tp ranks, {sp['tokens']} tokens: saved for "
            f"backward {sp['tp_bytes']:,} bytes with tp alone, {sp['sp_bytes']:,} with sequence parallelism; "
            f"{sp['saving']:,} bytes less, the planner says {sp['planned_saving']:,}", ""]
    rows = []
    for name, ranks in layouts.items():
        for r in ranks:
            h, pl = r["held"], r["planned"]
            rows.append((name, str(r["rank"]), f"{h['params']:,}", f"{pl['params']:,}", f"{h['grads']:,}",
                         f"{pl['grads']:,}", f"{h['optimizer']:,}", f"{pl['optimizer']:,}", f"{r['peak_in_step']:,}",
                         f"{r['peak_in_step'] / whole:.2f}"))
    text += [f"what each rank holds (bytes; plan: common/sizing.py) and its peak in a step, against the whole "
             f"model's parameters, gradients and AdamW state ({whole:,} bytes):", "",
             markdown_table(("layout", "rank", "params", "plan", "grads", "plan", "AdamW", "plan", "peak in a step",
                             "peak / whole"), rows, right=range(1, 10))]
    print("\n".join(text), flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tables.md").write_text("\n".join(text) + "\n")
    (run_dir / "measure.json").write_text(json.dumps({"args": {**vars(args), "layouts": list(layouts)},
                                                      "bubble": bubbles, "sequence_parallel": sp,
                                                      "layouts": layouts, "whole_model_bytes": whole}, indent=1))
    print(f"outputs in {run_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
