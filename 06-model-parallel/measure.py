"""Chapter 06, measured: the pipeline's bubble and its timeline; what each rank holds
(parameters, gradients, AdamW's state, activations, what the pipeline keeps) and the
bytes tensor parallelism all-reduces, against what `python -m tools.plan` says (its
formulas: common/sizing.py).

The bubble. Every rank is a pipeline stage (pp = the world size). Pipeline runs --steps
steps of each schedule for every m in --microbatches, each micro-batch of
--microbatch-size samples (a forward or backward takes the same time whatever m is), and
calls back (`phase`) as each forward and backward starts and ends, on one machine's
clock (on a GPU after waiting for the device). Per step (`split_step`): each stage's
idle share; the schedule's own bubble, the operations replayed with free communication,
against (p - 1) / (m + p - 1); and communication and overhead, the rest. On a CPU, run
one process per core. The tokens are random over --vocab-size: at 64 the head costs
about 2% of a layer, so the stages are equal (at 512, 11% apart).

What a stage keeps: one more step of each schedule and m, every tensor its operations
create counted while it lives (a dispatch mode, as torch's MemTracker counts them): the
most bytes alive as a forward or backward starts, against the planner's
`stage_kept_bytes` (1F1B: p - s micro-batches' activations at most, whatever m is).

What each rank holds: for every layout of the world with one replica (pp x tp = the
world size), one training step of split_model's layout: its parameters, gradients and
AdamW state, and what one micro-batch's forward (and loss) saves for backward
(saved-tensor hooks) plus the output the pipeline keeps, to the byte against the
planner. Then every rank is a tensor-parallel rank (tp = the world size) and counts the
bytes its all-reduces carry in one step (at the dispatcher, as torch's CommDebugMode
counts collectives). The tables go to the terminal and to tables.md.

    torchrun --standalone --nproc-per-node=2 06-model-parallel/measure.py
"""

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from common.cli import comma_list, non_negative_int, one_of, positive_int, seed_value
from common.demos import script_parser, start_group
from common.distributed import gc_and_destroy_process_group
from common.environment import share_cpu_threads
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.layout import Layout, every_layout
from common.model import PRESETS, LlamaForCausalLM, get_config
from common.runfolder import claim_run_folder
from common.sizing import (PRECISIONS, RING_FACTOR, in_flight, stage_activation_bytes, stage_kept_bytes,
                           stage_state_bytes, tp_all_reduce_bytes)
from common.tables import markdown_table
from common.training import build_optimizer
from pipeline_parallel import SCHEDULES, Pipeline, StageModule, split_layers
from tensor_parallel import local_grad, parallelize, to_local, vocab_parallel_cross_entropy
from train_llm import split_model

COUNTS = ("1", "2", "4", "8", "16")
MAX_VOCABULARY = 2 ** 20


def parse_args(argv=None):
    p = script_parser("06-measure", "The pipeline bubble, timeline and what each stage keeps; what each "
                      "rank holds; tensor parallelism's all-reduced bytes.")
    p.add_argument("--model-preset", default="small", type=one_of(*PRESETS), help="model size")
    p.add_argument("--seq-length", type=positive_int, default=128, help="tokens per sample")
    p.add_argument("--microbatch-size", type=positive_int, default=1, help="samples per micro-batch")
    p.add_argument("--vocab-size", type=positive_int, default=64, help="vocabulary of the random tokens")
    p.add_argument("--microbatches", type=comma_list(*COUNTS), default="1,2,4,8",
                   help="micro-batch counts m to measure")
    p.add_argument("--steps", type=positive_int, default=4, help="measured steps per schedule and m")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="unmeasured first steps")
    p.add_argument("--seed", type=seed_value, default=0, help="weights and tokens")

    def check(args):
        preset, world = PRESETS[args.model_preset], int(os.environ["WORLD_SIZE"])
        if world > preset["num_hidden_layers"]:
            raise UsageError(f"{world} stages but the {args.model_preset!r} preset has "
                             f"{preset['num_hidden_layers']} layers: start fewer processes")
        if args.seq_length > preset["max_position_embeddings"]:
            raise UsageError(f"--seq-length {args.seq_length} exceeds the {args.model_preset!r} preset's "
                             f"max_position_embeddings={preset['max_position_embeddings']}")
        if args.vocab_size > MAX_VOCABULARY:
            raise UsageError(f"--vocab-size {args.vocab_size:,}: at most {MAX_VOCABULARY:,}")
        one_replica(world, get_config(args.model_preset, args.vocab_size))  # a vocabulary too small: refused
    p.checks.append(check)  # after the torchrun check: it reads the world size
    return p.parse_args(argv)


def one_replica(world: int, config) -> list[Layout]:
    """Every layout of `world` ranks with one replica (pp x tp = the world) that fits."""
    return [lay for lay in every_layout(world, config, 1) if lay.api == "scratch" and lay.schedule == "1f1b"]


# ---- the bubble ----------------------------------------------------------------------

def clock(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # else the host's time would be a kernel launch's
    return time.perf_counter()


class LiveTensors(TorchDispatchMode):
    """While on, every tensor storage that an operation creates, for as long as it
    lives: `bytes()` is what they hold now. Storages that existed before (parameters,
    their gradients) are left out, and so are views of them."""

    def __init__(self, existing):
        super().__init__()
        self.before = {t.untyped_storage().data_ptr() for t in existing}
        self.sizes = WeakIdKeyDictionary()  # storage -> bytes; an entry goes with its storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.before:
                self.sizes[t.untyped_storage()] = t.untyped_storage().nbytes()
        return out

    def bytes(self) -> int:
        return sum(self.sizes.values())


class Recorder:
    """Pipeline.step's `phase` callback: when each forward and backward started and
    ended, and (with `live`) the bytes alive as each started."""

    def __init__(self, device, live=None):
        self.device, self.live, self.ops, self.kept = device, live, [], []

    @contextmanager
    def phase(self, name):
        if self.live is not None:
            self.kept.append(self.live.bytes())
        start = clock(self.device)
        yield
        self.ops.append((name[0].upper(), start, clock(self.device)))


class OnDemand(Sequence):
    """A step's micro-batches, each made when the pipeline asks for it: the tensors a
    micro-batch brings then count, as the step's, from its forward on."""

    def __init__(self, x, y, m):
        self.x, self.y = x.chunk(m), y.chunk(m)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i].clone(), self.y[i].clone(), None


def replay(actions: list, durations: list) -> tuple[float, list[float]]:
    """Every stage's operations (`actions[s]`: the schedule's order) with their measured
    durations (`durations[s][k]`: its k-th operation's), each starting as soon as its
    stage is free and its input is there (a forward after the previous stage's forward
    of that micro-batch, a backward after the next stage's backward), communication
    taking no time. Returns (the step's length, each stage's busy time)."""
    p, done, free, pos = len(actions), {}, [0.0] * len(actions), [0] * len(actions)
    while any(pos[s] < len(actions[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pos[s] < len(actions[s]):
                kind, i = actions[s][pos[s]]
                needs = (s - 1, "F", i) if kind == "F" and s > 0 else (s + 1, "B", i) if kind == "B" and s < p - 1 \
                    else None
                if needs is not None and needs not in done:
                    break
                start = max(free[s], done[needs] if needs else 0.0)
                free[s] = done[(s, kind, i)] = start + durations[s][pos[s]]
                pos[s], moved = pos[s] + 1, True
        if not moved:
            raise RuntimeError("the schedule waits on itself")
    return max(free), [sum(d) for d in durations]


def typical_durations(runs) -> list[dict]:
    """Each stage's forward and backward as the replay times them: the median of all it
    measured in every run (its imbalance stays in; the machine's noise goes)."""
    return [{kind: statistics.median(b - a for steps in runs for step in steps for k, a, b in step[s][2] if k == kind)
             for kind in "FB"} for s in range(len(runs[0][0]))]


def split_step(steps, p: int, schedule: str, m: int, typical: list[dict]) -> dict:
    """One measured step, every stage's (start, end, operations): each stage's idle share
    of the real step and busy seconds; the schedule's bubble, the idle share of the
    busiest stage (it waits only while the pipeline fills and drains) when the schedule
    is replayed with free communication and each operation at its `typical` duration; and
    communication and overhead, the real step's share beyond a replay of its own operations."""
    begin, finish = min(s[0] for s in steps), max(s[1] for s in steps)
    busy, actions = [sum(b - a for _, a, b in s[2]) for s in steps], [SCHEDULES[schedule](m, p, s) for s in range(p)]
    length, replayed = replay(actions, [[typical[s][kind] for kind, _ in actions[s]] for s in range(p)])
    own, _ = replay(actions, [[b - a for _, a, b in s[2]] for s in steps])
    real = finish - begin
    return {"idle": [1 - b / real for b in busy], "schedule": 1 - max(replayed) / length,
            "communication_overhead": 1 - own / real, "busy": busy}


def pipeline_step(pipeline, micro_batches, loss_fn, recorder):
    """One step, timed from a barrier (every stage starts together) to this stage's end."""
    dist.barrier()
    start = time.perf_counter()
    pipeline.step(micro_batches, loss_fn, recorder.phase)
    end = time.perf_counter()
    for p in pipeline.module.parameters():
        p.grad.zero_()  # in place: the next step's gradients go where these were
    return start, end, recorder.ops


def measure_bubble(args, group, config):
    """For each schedule and m: the bubble (measured, the schedule's own, the formula),
    communication and overhead, the bytes each stage kept at most against the planner,
    and the last step's operations (for the timeline)."""
    p, stage = group.world, group.rank
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(group.device)
    module = StageModule(model, split_layers(config.num_hidden_layers, p)[stage], stage == 0, stage == p - 1)
    tokens = args.microbatch_size * args.seq_length
    for param in module.parameters():
        param.grad = torch.zeros_like(param)  # made before any step: a step adds into them in place

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / tokens

    runs, results = [], []
    for schedule in ("gpipe", "1f1b"):
        pipeline = Pipeline(module, stage=stage, stages=p, prev_rank=stage - 1 if stage else None,
                            next_rank=stage + 1 if stage < p - 1 else None, schedule=schedule,
                            hidden_size=config.hidden_size, dtype=torch.float32, device=group.device)
        for m in map(int, args.microbatches):
            ids = torch.randint(0, config.vocab_size, (m * args.microbatch_size, args.seq_length + 1),
                                generator=torch.Generator().manual_seed(args.seed)).to(group.device)
            x, y = ids[:, :-1], ids[:, 1:]
            micro_batches = list(zip(x.chunk(m), y.chunk(m), [None] * m))
            steps = [pipeline_step(pipeline, micro_batches, loss_fn, Recorder(group.device))
                     for _ in range(args.warmup + args.steps)][args.warmup:]
            # One more step, every tensor it creates counted while it lives.
            on_demand = OnDemand(x, y, m)
            with LiveTensors([*module.parameters(), *module.buffers(), *(q.grad for q in module.parameters())]) \
                    as live:
                recorder = Recorder(group.device, live)
                pipeline.step(on_demand, loss_fn, recorder.phase)
            kept = max(recorder.kept)
            del live, recorder
            everyone = [None] * p
            dist.all_gather_object(everyone, (steps, kept))
            runs.append((schedule, m, everyone))
    typical = typical_durations([[[s[i] for s, _ in run] for i in range(args.steps)] for _, _, run in runs])
    for schedule, m, everyone in runs:
        split = [split_step([s[i] for s, _ in everyone], p, schedule, m, typical) for i in range(args.steps)]
        results.append({
            "schedule": schedule, "m": m, "stages": p,
            "idle_per_stage": [statistics.median(s["idle"][k] for s in split) for k in range(p)],
            "idle": statistics.median(statistics.median(s["idle"]) for s in split),
            "schedule_bubble": statistics.median(s["schedule"] for s in split),
            "communication_overhead": statistics.median(s["communication_overhead"] for s in split),
            "textbook": (p - 1) / (m + p - 1),
            "busy_s_per_stage": [statistics.median(s["busy"][k] for s in split) for k in range(p)],
            "kept_bytes_per_stage": [k for _, k in everyone],
            "kept_bytes_planned": [stage_kept_bytes(config, tokens, args.seq_length, PRECISIONS["fp32"], 1, p, s,
                                                    schedule, m, cpu=group.device.type == "cpu")
                                   for s in range(p)],
            "in_flight_planned": [in_flight(schedule, m, p, s) for s in range(p)],
            "timeline": last_step(everyone)})
    return results


def last_step(everyone):
    """The last measured step's operations, every stage's, as (stage, kind, micro-batch,
    start, end) in seconds from the step's start. Both schedules run the forwards, and
    the backwards, in micro-batch order: the k-th forward is micro-batch k's."""
    steps = [s[-1] for s, _ in everyone]
    begin, out = min(s[0] for s in steps), []
    for stage, (_, _, ops) in enumerate(steps):
        count = {"F": 0, "B": 0}
        for kind, a, b in ops:
            out.append((stage, kind, count[kind], a - begin, b - begin))
            count[kind] += 1
    return out


# ---- what each rank holds ------------------------------------------------------------------

def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def saved_bytes(run, own) -> tuple[int, object]:
    """(the bytes autograd keeps for backward while `run()` computes, each storage once,
    leaving out `own`, the parameters and buffers; what `run()` returned)."""
    skip, seen = {t.untyped_storage().data_ptr() for t in own}, {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def measure_memory(args, group, config, layout: Layout) -> dict:
    """One training step of this layout, as train_llm.py takes it (split_model, AdamW),
    on one micro-batch: what this rank holds, measured and planned."""
    pp, tp = layout.pp, layout.tp
    mesh = init_device_mesh(group.device.type, (1, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    stage, tp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    torch.manual_seed(args.seed)
    split = split_model(LlamaForCausalLM(config).to(group.device), mesh, layout, None, group.device)
    module = split.module
    optimizer = build_optimizer(module, 1e-3, 0.1, group.device)
    shape = (args.microbatch_size, args.seq_length)
    gen = torch.Generator().manual_seed(args.seed)
    x, y = (torch.randint(0, config.vocab_size, shape, generator=gen).to(group.device) for _ in range(2))
    inp = x if stage == 0 else torch.randn(*shape, config.hidden_size, device=group.device, requires_grad=True)
    last = stage == pp - 1
    # One micro-batch's forward (and loss): what it saves, and the output the pipeline
    # keeps for its backward (the loss, on the last stage).
    acts, out = saved_bytes(lambda: split.loss_fn(module(inp), y) if last else module(inp),
                            [*module.parameters(), *module.buffers()])
    acts += nbytes([out])
    del out
    split.pipeline.step([(x, y, None)], split.loss_fn)
    measured = {"params": nbytes(map(to_local, module.parameters())),
                "grads": nbytes(map(local_grad, module.parameters()))}
    optimizer.step()
    measured["optimizer"] = nbytes(t for st in optimizer.state.values() for t in st.values())
    measured["activations_per_microbatch"] = acts
    fp32 = PRECISIONS["fp32"]
    planned = {**stage_state_bytes(config, tp, pp, stage, fp32, tp_rank),
               "activations_per_microbatch": stage_activation_bytes(
                   config, args.microbatch_size * args.seq_length, args.seq_length, fp32, tp, pp, stage, tp_rank,
                   cpu=group.device.type == "cpu")}
    return {"layout": layout.name.removesuffix("-1f1b-scratch").removesuffix("-scratch"),
            "stage": stage, "tp_rank": tp_rank, "measured": measured, "planned": planned}


# ---- tensor parallelism's bytes ---------------------------------------------------------

class AllReducedBytes(TorchDispatchMode):
    """While on, the bytes of every all-reduce this rank calls, as torch's CommDebugMode
    counts collectives: at the dispatcher, where dist.all_reduce arrives as c10d's
    allreduce_, in forward and in backward alike."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.allreduce_.default:
            self.bytes += nbytes(args[0])
        return func(*args, **(kwargs or {}))


def measure_tp_bytes(args, group, config):
    """The bytes each tp rank all-reduces in one step of one decoder layer and of the
    whole model (forward and backward, tp = the world size), against the planner: per
    layer 4 B T h numbers (g after attention and after the MLP in forward, f before them
    in backward); the whole model adds the embedding's g and the head's f (B T h each)
    and the loss's three all-reduces of B T numbers."""
    torch.manual_seed(args.seed)
    model = parallelize(LlamaForCausalLM(config).to(group.device), dist.group.WORLD)
    B, T, h = args.microbatch_size, args.seq_length, config.hidden_size
    ids = torch.randint(0, config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(args.seed))
    x, y = ids[:, :-1].to(group.device), ids[:, 1:].to(group.device)
    cos, sin = model.rotary(T)
    hidden = torch.randn(B, T, h, device=group.device, requires_grad=True)
    with AllReducedBytes() as layer:
        model.layers[0](hidden, cos, sin).sum().backward()
    with AllReducedBytes() as whole:
        vocab_parallel_cross_entropy(model(x).flatten(0, 1), y.flatten(), model.lm_head.start,
                                     dist.group.WORLD).backward()
    layer_planned, whole_planned = tp_all_reduce_bytes(config, B * T, PRECISIONS["fp32"], group.world, 1, 0)
    return {"tp": group.world, "batch_tokens": B * T, "hidden_size": h, "layer_bytes": layer.bytes,
            "layer_planned": layer_planned, "model_bytes": whole.bytes, "model_planned": whole_planned,
            "ring_sent_per_rank_factor": RING_FACTOR["all_reduce"](group.world)}


# ---- report -----------------------------------------------------------------------------

def plot_timeline(results, path: Path, m: int):
    """Both schedules' last step at m micro-batches: a lane per stage, a box per forward
    (light) and backward (dark), numbered by micro-batch."""
    import matplotlib
    matplotlib.use("Agg")  # files only; works without a display
    import matplotlib.pyplot as plt
    runs = [r for r in results if r["m"] == m]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.2 + 0.9 * runs[0]["stages"] * len(runs)), squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        p = r["stages"]
        for stage, kind, mb, start, end in r["timeline"]:
            ax.barh(p - 1 - stage, (end - start) * 1e3, left=start * 1e3, height=0.8,
                    color="#9ecae1" if kind == "F" else "#3182bd", edgecolor="white")
            ax.text((start + end) / 2 * 1e3, p - 1 - stage, f"{kind}{mb}", ha="center", va="center", fontsize=8,
                    color="black" if kind == "F" else "white")
        ax.set_yticks(range(p), [f"stage {p - 1 - i}" for i in range(p)])
        ax.set_title(f"{r['schedule']}: {p} stages, {m} micro-batches; the schedule's bubble "
                     f"{r['schedule_bubble']:.0%} (formula {r['textbook']:.0%}), idle {r['idle']:.0%}", fontsize=10)
    axes[-1, 0].set_xlabel("ms from the step's start (F: forward, B: backward of micro-batch n)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tables(results, memory, tp_bytes) -> str:
    """The four tables, in Markdown: the bubble, what each stage keeps, what each rank
    holds, tp's bytes."""
    rows = [(r["schedule"], r["m"], f"{r['textbook']:.1%}", f"{r['schedule_bubble']:.1%}", f"{r['idle']:.1%}",
             f"{r['communication_overhead']:.1%}") for r in results]
    out = ["the bubble: the formula, the schedule's own (the measured operations replayed with free "
           "communication), the share of the real step a stage computes nothing (median over stages and steps), "
           "and the share of the real step beyond the replay (communication and overhead)\n",
           markdown_table(("schedule", "micro-batches", "formula (p-1)/(m+p-1)", "the schedule's bubble", "idle",
                           "communication and overhead"), rows, right=range(1, 6))]
    rows = [(r["schedule"], r["m"], ", ".join(f"{k / 2**20:.2f}" for k in r["kept_bytes_per_stage"]),
             ", ".join(map(str, r["in_flight_planned"])),
             "the same" if r["kept_bytes_per_stage"] == r["kept_bytes_planned"] else
             ", ".join(f"{k:,}" for k in r["kept_bytes_planned"])) for r in results]
    out += ["\nwhat each stage keeps at most between its operations (MiB; as a forward or backward starts: the "
            "micro-batches in flight, the gradient just received), and the planner\n",
            markdown_table(("schedule", "micro-batches", "kept, MiB per stage", "micro-batches in flight (planner)",
                            "planner's bytes"), rows, right=(1, 2, 3))]
    parts = ("params", "grads", "optimizer", "activations_per_microbatch")
    rows = [(m["layout"], f"{m['stage']}, {m['tp_rank']}", *(f"{m['measured'][k]:,}" for k in parts),
             "the same" if m["measured"] == m["planned"] else
             "; ".join(f"{k} {m['planned'][k]:,}" for k in parts if m["planned"][k] != m["measured"][k]))
            for m in memory]
    out += ["\nbytes each rank holds after one step (one micro-batch), measured, and what "
            "`python -m tools.plan` says (fp32; the activations as a CPU's F.rms_norm keeps them)\n",
            markdown_table(("layout", "stage, tp rank", "params", "grads", "AdamW state",
                            "activations, one micro-batch", "planner"), rows, right=range(2, 6))]
    if tp_bytes:
        t = tp_bytes
        out += [f"\ntensor parallelism, tp {t['tp']}, {t['batch_tokens']} tokens x hidden {t['hidden_size']}, fp32: "
                f"bytes each rank all-reduces per step (a ring sends {t['ring_sent_per_rank_factor']:.2f} x that)\n",
                markdown_table(("part", "counted", "planner"),
                               [("one decoder layer", f"{t['layer_bytes']:,}", f"{t['layer_planned']:,}"),
                                ("the whole model, loss included", f"{t['model_bytes']:,}", f"{t['model_planned']:,}")],
                               right=(1, 2))]
    return "\n".join(out)


def timeline_count(counts) -> int:
    """The m the timeline shows: the largest measured up to 4 (it still reads), else the smallest."""
    counts = sorted(map(int, counts))
    return max([n for n in counts if n <= 4], default=counts[0])


def report(args, group, config, results, memory, tp_bytes, run_dir):
    text = tables(results, memory, tp_bytes)
    print(f"\nvocabulary {args.vocab_size}, micro-batches of {args.microbatch_size} x {args.seq_length} tokens\n\n"
          + text, flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tables.md").write_text(text + "\n")  # what the tour's report shows
    m = timeline_count(args.microbatches)
    plot_timeline(results, run_dir / "pipeline-timeline.png", m)
    (run_dir / "measure.json").write_text(json.dumps(
        {"world_size": group.world, "args": vars(args), "model_config": config.to_dict(), "pipeline": results,
         "memory": memory, "tensor_parallel": tp_bytes, "torch_version": torch.__version__}, indent=1) + "\n")
    print(f"\noutputs in {run_dir} (timeline: pipeline-timeline.png, m = {m})", flush=True)


def main():
    args = parse_args()
    group = start_group(args.timeout)
    try:
        share_cpu_threads(group.device)  # one process per core: a stage never waits for a core
        run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=group.rank)
        config = get_config(args.model_preset, args.vocab_size)
        if group.rank == 0:
            print(f"{group.world} stages, {args.model_preset} preset, vocabulary {args.vocab_size}, micro-batches "
                  f"of {args.microbatch_size} x {args.seq_length} tokens; m = {', '.join(args.microbatches)}; "
                  f"{args.steps} steps each after {args.warmup}", flush=True)
        results = measure_bubble(args, group, config)
        memory, layouts = [], one_replica(group.world, config)
        for layout in layouts:
            every = [None] * group.world
            dist.all_gather_object(every, measure_memory(args, group, config, layout))
            memory += every
        tp_bytes = measure_tp_bytes(args, group, config) if any(lay.tp == group.world for lay in layouts) else None
        if group.rank == 0:
            report(args, group, config, results, memory, tp_bytes, run_dir)
        dist.barrier()
    finally:
        gc_and_destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
