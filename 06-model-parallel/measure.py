"""Chapter 06, measured: the pipeline's bubble and its timeline; what each rank holds
(parameters, gradients, AdamW's state, activations) and the bytes tensor parallelism
all-reduces, against what `python -m tools.plan` says.

The bubble. Every rank is a pipeline stage (pp = the world size): this chapter's
Pipeline runs --steps steps of each schedule for every micro-batch count in
--microbatches, each micro-batch of --microbatch-size samples, so a forward or backward
takes the same time whatever m is. Each stage records when each forward and backward
started and ended. On a CPU an operation has finished when its call returns, so these
host timestamps are the work itself (on a GPU the pipeline waits for the device at each
one), and the stages share one machine's monotonic clock. A stage's bubble is the share
of the step it spends on neither, against the textbook's (p - 1) / (m + p - 1). On a
CPU, run one process per core: more would share cores, and a stage that waits for a
core looks busy or idle at random. The tokens are random over a --vocab-size vocabulary
(timing does not depend on the text; a small vocabulary keeps the last stage's head
from outweighing a decoder layer, and the formula assumes stages of equal work).

The memory. For every layout of the world with one replica (pp x tp = the world size),
one training step of this chapter's split_model: each rank counts its parameters,
gradients and AdamW state, and what one micro-batch's forward (and loss) keeps for
backward (saved-tensor hooks) plus the output the pipeline keeps; the planner must say
the same, to the byte. Then every rank is a tensor-parallel rank (tp = the world size)
and counts the bytes that go through tensor_parallel.all_reduce in one step, against
the planner. The tables go to the terminal and to tables.md.

    torchrun --standalone --nproc-per-node=2 06-model-parallel/measure.py
"""

import json
import os
import statistics
import sys
import time
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from common.cli import comma_list, non_negative_int, one_of, positive_int
from common.demos import script_parser, start_demo
from common.distributed import gc_and_destroy_process_group
from common.environment import share_cpu_threads
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.model import PRESETS, LlamaForCausalLM, get_config
from common.runfolder import claim_run_folder
from common.sizing import PRECISIONS, RING_FACTOR, in_flight, stage_activation_bytes, stage_state_bytes, tp_all_reduce_bytes
from common.tables import markdown_table
from common.training import build_optimizer

import tensor_parallel
from pipeline_parallel import Pipeline, StageModule, split_layers
from train_llm import split_model

COUNTS = ("1", "2", "4", "8", "16")


def parse_args(argv=None):
    p = script_parser("06-measure", "The pipeline bubble, timeline and activations in flight; "
                      "tensor parallelism's all-reduced bytes.")
    p.add_argument("--model-preset", default="small", type=one_of(*PRESETS), help="model size")
    p.add_argument("--seq-length", type=positive_int, default=128, help="tokens per sample")
    p.add_argument("--microbatch-size", type=positive_int, default=1, help="samples per micro-batch")
    p.add_argument("--vocab-size", type=positive_int, default=512, help="vocabulary of the random tokens")
    p.add_argument("--microbatches", type=comma_list(*COUNTS), default="1,2,4,8",
                   help="micro-batch counts m to measure")
    p.add_argument("--steps", type=positive_int, default=4, help="measured steps per schedule and m")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="unmeasured first steps")
    p.add_argument("--seed", type=non_negative_int, default=0, help="weights and tokens")

    def check(args):
        preset, world = PRESETS[args.model_preset], int(os.environ["WORLD_SIZE"])
        if world > preset["num_hidden_layers"]:
            raise UsageError(f"{world} stages but the {args.model_preset!r} preset has "
                             f"{preset['num_hidden_layers']} layers: start fewer processes")
        if args.seq_length > preset["max_position_embeddings"]:
            raise UsageError(f"--seq-length {args.seq_length} exceeds the {args.model_preset!r} preset's "
                             f"max_position_embeddings={preset['max_position_embeddings']}")
    p.checks.append(check)  # after the torchrun check: it reads the world size
    return p.parse_args(argv)


# ---- the bubble ----------------------------------------------------------------------

def textbook_bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def pipeline_step(pipeline, micro_batches, loss_fn):
    """One step, timed from a barrier (every stage starts together) to this stage's end."""
    dist.barrier()
    start = time.perf_counter()
    pipeline.step(micro_batches, loss_fn)
    end = time.perf_counter()
    for p in pipeline.module.parameters():
        p.grad = None
    return start, end, pipeline.events


def measure_bubble(args, demo, config):
    """For each schedule and m: every stage's bubble (median over the steps), its most
    micro-batches in flight, and the last step's events (for the timeline)."""
    p, stage = demo.world, demo.rank
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(demo.device)
    module = StageModule(model, split_layers(config.num_hidden_layers, p)[stage], stage == 0, stage == p - 1)
    tokens = args.microbatch_size * args.seq_length

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / tokens

    results = []
    for schedule in ("gpipe", "1f1b"):
        pipeline = Pipeline(module, stage, p, stage - 1 if stage else None, stage + 1 if stage < p - 1 else None,
                            schedule, config.hidden_size, torch.float32, demo.device)
        pipeline.timed = True
        for m in map(int, args.microbatches):
            ids = torch.randint(0, config.vocab_size, (m * args.microbatch_size, args.seq_length + 1),
                                generator=torch.Generator().manual_seed(args.seed))
            x, y = ids[:, :-1].to(demo.device), ids[:, 1:].to(demo.device)
            micro_batches = list(zip(x.chunk(m), y.chunk(m), [None] * m))
            pipeline.peak_in_flight = 0
            steps = [pipeline_step(pipeline, micro_batches, loss_fn) for _ in range(args.warmup + args.steps)]
            everyone = [None] * p
            dist.all_gather_object(everyone, steps[args.warmup:])
            bubbles, busy = [[] for _ in range(p)], [[] for _ in range(p)]
            for i in range(args.steps):  # one window per step: all stages' first start to last end
                begin, finish = min(s[i][0] for s in everyone), max(s[i][1] for s in everyone)
                for s in range(p):
                    work = sum(e[3] - e[2] for e in everyone[s][i][2])
                    busy[s].append(work)
                    bubbles[s].append(1 - work / (finish - begin))
            in_flight = [None] * p
            dist.all_gather_object(in_flight, pipeline.peak_in_flight)
            last = everyone_last_step(everyone)
            results.append({"schedule": schedule, "m": m, "stages": p,
                            "bubble_per_stage": [statistics.median(b) for b in bubbles],
                            "bubble": statistics.median([statistics.median(b) for b in bubbles]),
                            "textbook": textbook_bubble(p, m),
                            "busy_s_per_stage": [statistics.median(b) for b in busy],
                            "peak_in_flight_per_stage": in_flight, "timeline": last})
    return results


def everyone_last_step(everyone):
    """The last measured step's events, every stage's, as (stage, kind, micro-batch,
    start, end) in seconds from the step's start."""
    begin = min(s[-1][0] for s in everyone)
    return [(s, kind, mb, a - begin, b - begin) for s, steps in enumerate(everyone) for kind, mb, a, b in steps[-1][2]]


def layouts(world: int, config) -> list[tuple[int, int]]:
    """(pp, tp) of every layout of `world` ranks with one replica that fits the model."""
    return [(world // tp, tp) for tp in range(1, world + 1) if world % tp == 0 and world // tp <= config.num_hidden_layers
            and config.num_key_value_heads % tp == 0 and config.intermediate_size % tp == 0]


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


def measure_memory(args, demo, config, pp: int, tp: int) -> dict:
    """One training step of this layout, as train_llm.py takes it (split_model, AdamW),
    on one micro-batch: what this rank holds, measured and planned."""
    mesh = init_device_mesh(demo.device.type, (1, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    stage, tp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    torch.manual_seed(args.seed)
    layout = Namespace(tp=tp, pp=pp, api="scratch", schedule="1f1b", microbatches=1)
    module, pipeline, loss_fn, _ = split_model(LlamaForCausalLM(config).to(demo.device), mesh, layout, None,
                                               demo.device)
    optimizer = build_optimizer(module, 1e-3, 0.1, demo.device)
    shape = (args.microbatch_size, args.seq_length)
    gen = torch.Generator().manual_seed(args.seed)
    x, y = (torch.randint(0, config.vocab_size, shape, generator=gen).to(demo.device) for _ in range(2))
    inp = x if stage == 0 else torch.randn(*shape, config.hidden_size, device=demo.device, requires_grad=True)
    last = stage == pp - 1
    # one micro-batch's forward (and loss): what it saves, and the output the pipeline keeps
    acts, out = saved_bytes(lambda: loss_fn(module(inp), y) if last else module(inp),
                            [*module.parameters(), *module.buffers()])
    acts += 0 if last else nbytes([out])
    del out
    pipeline.step([(x, y, None)], loss_fn)
    measured = {"params": nbytes(map(tensor_parallel.local, module.parameters())),
                "grads": nbytes(map(tensor_parallel.local_grad, module.parameters()))}
    optimizer.step()
    measured["optimizer"] = nbytes(t for st in optimizer.state.values() for t in st.values())
    measured["activations_per_microbatch"] = acts
    fp32 = PRECISIONS["fp32"]
    planned = {**stage_state_bytes(config, tp, pp, stage, fp32, tp_rank),
               "activations_per_microbatch": stage_activation_bytes(
                   config, args.microbatch_size * args.seq_length, args.seq_length, fp32, tp, pp, stage, tp_rank,
                   cpu=demo.device.type == "cpu")}
    return {"layout": f"pp{pp}xtp{tp}" if pp > 1 and tp > 1 else f"pp{pp}" if pp > 1 else f"tp{tp}",
            "stage": stage, "tp_rank": tp_rank, "measured": measured, "planned": planned}


# ---- tensor parallelism's bytes ---------------------------------------------------------

def measure_tp_bytes(args, demo, config):
    """The bytes each tp rank all-reduces in one step of one decoder layer and of the
    whole model (forward and backward, tp = the world size), counted where
    tensor_parallel.all_reduce is called, against the planner: per layer 4 B T h
    elements (g after attention and after the MLP forward, f before them backward); the
    whole model adds the embedding's g and the head's f (B T h each) and the loss's
    three all-reduces of B T numbers."""
    group, counted = dist.group.WORLD, []
    real = tensor_parallel.all_reduce

    def counting(t, group, op=dist.ReduceOp.SUM):
        counted.append(t.numel() * t.element_size())
        return real(t, group, op)
    tensor_parallel.all_reduce = counting
    try:
        torch.manual_seed(args.seed)
        model = tensor_parallel.parallelize(LlamaForCausalLM(config).to(demo.device), group)
        B, T, h = args.microbatch_size, args.seq_length, config.hidden_size
        ids = torch.randint(0, config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(args.seed))
        x, y = ids[:, :-1].to(demo.device), ids[:, 1:].to(demo.device)
        cos, sin = model.rotary(T)
        hidden = torch.randn(B, T, h, device=demo.device, requires_grad=True)
        model.layers[0](hidden, cos, sin).sum().backward()
        layer = sum(counted)
        counted.clear()
        logits = model(x)
        tensor_parallel.vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten(), model.lm_head.start,
                                                     group).backward()
        whole = sum(counted)
    finally:
        tensor_parallel.all_reduce = real
    layer_planned, whole_planned = tp_all_reduce_bytes(config, B * T, PRECISIONS["fp32"], demo.world, 1, 0)
    return {"tp": demo.world, "batch_tokens": B * T, "hidden_size": h, "layer_bytes": layer,
            "layer_planned": layer_planned, "model_bytes": whole, "model_planned": whole_planned,
            "ring_sent_per_rank_factor": RING_FACTOR["all_reduce"](demo.world)}


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
        ax.set_title(f"{r['schedule']}: {p} stages, {m} micro-batches; bubble {r['bubble']:.0%} measured, "
                     f"{r['textbook']:.0%} textbook", fontsize=10)
    axes[-1, 0].set_xlabel("ms from the step's start (F: forward, B: backward of micro-batch n)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tables(results, memory, tp_bytes) -> str:
    """The three tables, in Markdown: the bubble, what each rank holds, tp's bytes."""
    mib = {(m["stage"]): m["measured"]["activations_per_microbatch"] / 2**20 for m in memory
           if m["layout"] == f"pp{results[0]['stages']}"}
    rows = []
    for r in results:
        p = r["stages"]
        planned = [in_flight(r["schedule"], r["m"], p, s) for s in range(p)]
        rows.append((r["schedule"], r["m"], f"{r['bubble']:.1%}", f"{r['textbook']:.1%}",
                     ", ".join(map(str, r["peak_in_flight_per_stage"])), ", ".join(map(str, planned)),
                     ", ".join(f"{n * mib[s]:.2f}" for s, n in enumerate(r["peak_in_flight_per_stage"]))))
    out = ["the bubble: the share of a step a stage is idle (median over stages and steps), and the "
           "micro-batches whose activations each stage held at once\n",
           markdown_table(("schedule", "micro-batches", "bubble", "textbook (p-1)/(m+p-1)", "held, per stage",
                           "planner", "activations held, MiB per stage"), rows, right=(1, 2, 3))]
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


def report(args, demo, config, results, memory, tp_bytes, run_dir):
    text = tables(results, memory, tp_bytes)
    print("\n" + text, flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tables.md").write_text(text + "\n")  # what the tour's report shows
    m = max(n for n in map(int, args.microbatches) if n <= 4)
    plot_timeline(results, run_dir / "pipeline-timeline.png", m)
    (run_dir / "measure.json").write_text(json.dumps(
        {"world_size": demo.world, "args": vars(args), "model_config": config.to_dict(), "pipeline": results,
         "memory": memory, "tensor_parallel": tp_bytes, "torch_version": torch.__version__}, indent=1) + "\n")
    print(f"\noutputs in {run_dir} (timeline: pipeline-timeline.png, m = {m})", flush=True)


def main():
    args = parse_args()
    demo = start_demo(args.timeout)
    try:
        share_cpu_threads(demo.device)  # one process per core: a stage never waits for a core
        run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=demo.rank)
        config = get_config(args.model_preset, args.vocab_size)
        if demo.rank == 0:
            print(f"{demo.world} stages, {args.model_preset} preset, vocabulary {args.vocab_size}, micro-batches "
                  f"of {args.microbatch_size} x {args.seq_length} tokens; m = {', '.join(args.microbatches)}; "
                  f"{args.steps} steps each after {args.warmup}", flush=True)
        results = measure_bubble(args, demo, config)
        memory = []
        for pp, tp in layouts(demo.world, config):
            every = [None] * demo.world
            dist.all_gather_object(every, measure_memory(args, demo, config, pp, tp))
            memory += every
        tp_bytes = measure_tp_bytes(args, demo, config) if (demo.world, demo.world) in \
            [(pp * tp, tp) for pp, tp in layouts(demo.world, config)] else None
        if demo.rank == 0:
            report(args, demo, config, results, memory, tp_bytes, run_dir)
        dist.barrier()
    finally:
        gc_and_destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
