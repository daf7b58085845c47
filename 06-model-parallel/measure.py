"""Chapter 06, measured: the pipeline's bubble, its timeline, the activations each stage
holds, and the bytes tensor parallelism all-reduces.

Every rank is a pipeline stage (pp = the world size): this chapter's Pipeline runs
--steps steps of each schedule for every micro-batch count in --microbatches, each
micro-batch of --microbatch-size samples, so a forward or backward takes the same time
whatever m is. Each stage records when each forward and backward started and ended. On
a CPU an operation has finished when its call returns, so these host timestamps are
the work itself (on a GPU the pipeline waits for the device at each one), and the
stages share one machine's monotonic clock. A stage's bubble is the share of the step
it spends on neither, against the textbook's (p - 1) / (m + p - 1). Then every rank is
a tensor-parallel rank (tp = the world size) and counts the bytes that go through
tensor_parallel.all_reduce in one step, against the formula.

On a CPU, run one process per core: more would share cores, and a stage that waits
for a core looks busy or idle at random. The tokens are random over a --vocab-size
vocabulary (timing does not depend on the text; a small vocabulary keeps the last
stage's head from outweighing a decoder layer, and the formula assumes stages of equal
work).

    torchrun --standalone --nproc-per-node=2 06-model-parallel/measure.py
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Runnable from the repo root or from inside this folder, installed or not.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import tensor_parallel  # noqa: E402
from pipeline_parallel import Pipeline, StageModule, split_layers  # noqa: E402
from common.cli import comma_list, non_negative_int, one_of, positive_int  # noqa: E402
from common.demos import script_parser, start_demo  # noqa: E402
from common.distributed import gc_and_destroy_process_group  # noqa: E402
from common.environment import share_cpu_threads  # noqa: E402
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main  # noqa: E402
from common.model import PRESETS, LlamaForCausalLM, get_config  # noqa: E402
from common.runfolder import claim_run_folder  # noqa: E402

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


def activation_bytes(config, args, demo):
    """The bytes autograd keeps for backward in one micro-batch's forward on this stage
    (parameters left out), counted as the saved tensors are packed."""
    torch.manual_seed(args.seed)
    p, stage = demo.world, demo.rank
    model = LlamaForCausalLM(config).to(demo.device)
    module = StageModule(model, split_layers(config.num_hidden_layers, p)[stage], stage == 0, stage == p - 1)
    params = {q.untyped_storage().data_ptr() for q in module.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    shape = (args.microbatch_size, args.seq_length)
    x = torch.randint(0, config.vocab_size, shape, device=demo.device) if stage == 0 else \
        torch.randn(*shape, config.hidden_size, device=demo.device, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


# ---- tensor parallelism's bytes ---------------------------------------------------------

def measure_tp_bytes(args, demo, config):
    """The bytes each tp rank all-reduces in one step of one decoder layer and of the
    whole model (forward and backward, tp = the world size), counted where
    tensor_parallel.all_reduce is called, against the formula: per layer 4 B T h
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
    size = torch.finfo(torch.float32).bits // 8
    L = config.num_hidden_layers
    return {"tp": demo.world, "batch_tokens": B * T, "hidden_size": h, "bytes_per_element": size,
            "layer_bytes": layer, "layer_formula": 4 * B * T * h * size,
            "model_bytes": whole, "model_formula": ((4 * L + 2) * B * T * h + 3 * B * T) * size,
            "ring_sent_per_rank_factor": 2 * (demo.world - 1) / demo.world}


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


def report(args, demo, config, results, acts, tp_bytes, run_dir):
    print("\nthe bubble: the share of a step a stage is idle (median over stages and steps)\n")
    print("| schedule | m | measured | textbook (p-1)/(m+p-1) | micro-batches in flight, per stage | "
          "activations held at most, MiB per stage |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    for r in results:
        held = [n * b / 2**20 for n, b in zip(r["peak_in_flight_per_stage"], acts)]
        r["activation_mib_per_stage"] = held
        print(f"| {r['schedule']} | {r['m']} | {r['bubble']:.1%} | {r['textbook']:.1%} | "
              f"{', '.join(map(str, r['peak_in_flight_per_stage']))} | {', '.join(f'{h:.1f}' for h in held)} |")
    t = tp_bytes
    print(f"\ntensor parallelism, tp {t['tp']}, {t['batch_tokens']} tokens x hidden {t['hidden_size']}, fp32: "
          f"bytes each rank all-reduces per step (a ring sends {t['ring_sent_per_rank_factor']:.2f} x that)\n")
    print("| part | counted | formula |\n| --- | ---: | ---: |")
    print(f"| one decoder layer | {t['layer_bytes']:,} | {t['layer_formula']:,} |")
    print(f"| the whole model, loss included | {t['model_bytes']:,} | {t['model_formula']:,} |")
    run_dir.mkdir(parents=True, exist_ok=True)
    m = max(n for n in map(int, args.microbatches) if n <= 4)
    plot_timeline(results, run_dir / "pipeline-timeline.png", m)
    (run_dir / "measure.json").write_text(json.dumps(
        {"world_size": demo.world, "args": vars(args), "model_config": config.to_dict(),
         "activation_bytes_per_microbatch": acts, "pipeline": results, "tensor_parallel": tp_bytes,
         "torch_version": torch.__version__}, indent=1) + "\n")
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
        acts = [None] * demo.world
        dist.all_gather_object(acts, activation_bytes(config, args, demo))
        tp_bytes = measure_tp_bytes(args, demo, config) if config.num_key_value_heads % demo.world == 0 \
            and config.intermediate_size % demo.world == 0 else None
        if demo.rank == 0:
            report(args, demo, config, results, acts, tp_bytes, run_dir)
        dist.barrier()
    finally:
        gc_and_destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
