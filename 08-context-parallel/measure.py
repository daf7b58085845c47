"""Chapter 08, measured: the attention work each rank does under the balanced and the
contiguous split; the activations each rank keeps at every cp the world allows and
several sequence lengths; the bytes ring and all-to-all attention move per step; the
last two against what `python -m tools.plan` says (its formulas: common/sizing.py).

The work. Every rank is a context-parallel rank (cp = the world size). Per rank, for
each split: the (query, key) pairs its queries attend, the sum over its tokens of
position + 1 (what a kernel that skips masked blocks, as flash attention does,
computes), and the FLOPs torch's FlopCounterMode counts in one forward and backward of
context_parallel.py's ring attention, whose blocks are dense matmuls (it computes the
masked half of its own block, then drops it). Both are counts, not timings: they do
not depend on the machine's load.

The activations. For each cp that divides the world (groups of cp ranks side by side)
and each sequence length, one forward of the model and its loss on this rank's tokens:
the bytes autograd saves for backward (saved-tensor hooks, each storage once, the
parameters and buffers left out), against the planner's `cp_activation_bytes`.

The bytes. For each cp above 1, one forward and backward of the whole model per
variant, counting what each rank's sends and all-to-alls carry at the dispatcher (as
torch's CommDebugMode counts collectives), against `cp_traffic_bytes`. The tables go
to the terminal and to tables.md.

    torchrun --standalone --nproc-per-node=4 08-context-parallel/measure.py
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from common.cli import comma_list, one_of, positive_int, seed_value
from common.data import IGNORE_INDEX
from common.demos import script_parser, start_group
from common.distributed import gc_and_destroy_process_group
from common.environment import share_cpu_threads
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.model import PRESETS, LlamaForCausalLM, get_config
from common.runfolder import claim_run_folder
from common.sizing import PRECISIONS, cp_activation_bytes, cp_sent_bytes, cp_traffic_bytes
from common.tables import markdown_table

import context_parallel as cp_lib

LENGTHS = tuple(str(2 ** k) for k in range(4, 14))  # 16 ... 8192


def parse_args(argv=None):
    p = script_parser("08-measure", "Context parallelism's work per rank, activations per rank and bytes per "
                      "step, against the planner.")
    p.add_argument("--model-preset", default="small", type=one_of(*PRESETS), help="model size")
    p.add_argument("--seq-lengths", type=comma_list(*LENGTHS), default="128,256,512",
                   help="sequence lengths of the activations table (the largest for the work and the bytes)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences per step")
    p.add_argument("--vocab-size", type=positive_int, default=512, help="vocabulary of the random tokens")
    p.add_argument("--seed", type=seed_value, default=0, help="weights and tokens")

    def check(args):  # after the torchrun check: it reads the world size
        world, longest = int(os.environ["WORLD_SIZE"]), PRESETS[args.model_preset]["max_position_embeddings"]
        args.seq_lengths = sorted(map(int, args.seq_lengths))
        for seq in args.seq_lengths:
            if seq % (2 * world):
                raise UsageError(f"--seq-lengths: {seq} does not cut into 2 x {world} ranks = {2 * world} equal chunks")
            if seq > longest:
                raise UsageError(f"--seq-lengths: {seq} exceeds the {args.model_preset!r} preset's "
                                 f"max_position_embeddings={longest}")
    p.checks.append(check)
    return p.parse_args(argv)


def variants(cp: int, config) -> list[str]:
    """The attention variants cp ranks can run: all-to-all needs cp to divide the heads and the KV heads."""
    fits = config.num_attention_heads % cp == 0 and config.num_key_value_heads % cp == 0
    return ["ring", "all-to-all"] if cp > 1 and fits else ["ring"]


def random_batch(args, config, seq: int, device):
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch_size, seq + 1), generator=gen).to(device)
    return ids[:, :-1].clone(), ids[:, 1:].clone()  # two tensors, as the data loader gives them


def loss_of(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


# ---- the work ----------------------------------------------------------------------------

def measure_work(args, demo, config) -> list[dict]:
    """Per split: every rank's attended pairs and the FLOPs FlopCounterMode counts in one
    forward and backward of ring attention (one layer's shapes, one sequence)."""
    cp, seq, D = demo.world, args.seq_lengths[-1], config.head_dim
    rows = []
    for balanced in (True, False):
        split = cp_lib.SequenceSplit(seq, cp, balanced)
        positions = split.positions(demo.rank)
        gen = torch.Generator().manual_seed(args.seed)
        q, k, v = (torch.randn(1, n, seq // cp, D, generator=gen).to(demo.device).requires_grad_()
                   for n in (config.num_attention_heads, config.num_key_value_heads, config.num_key_value_heads))
        with FlopCounterMode(display=False) as counter:
            cp_lib.ring_attention(q, k, v, dist.group.WORLD, split).sum().backward()
        mine = {"pairs": int((positions + 1).sum()), "flops": counter.get_total_flops()}
        every = [None] * cp
        dist.all_gather_object(every, mine)
        rows.append({"split": "balanced" if balanced else "contiguous", "seq": seq, "cp": cp, "ranks": every})
    return rows


# ---- the activations -----------------------------------------------------------------------

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


def model_on_shard(args, config, group, cp: int, seq: int, variant: str, device):
    """The model (the same weights on every rank) made to run on this rank's tokens of a
    sequence split over `group`'s cp ranks; and this rank's tokens of a random batch."""
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(device)
    x, y = random_batch(args, config, seq, device)
    if cp > 1:
        split = cp_lib.SequenceSplit(seq, cp)
        cp_lib.parallelize(model, group, split, variant)
        positions = cp_lib.shard_positions(split, group)
        x, y = cp_lib.shard(x, positions), cp_lib.shard(y, positions)
    return model, x, y


def measure_activations(args, demo, config) -> list[dict]:
    """For each cp that divides the world, each sequence length and variant: what one
    rank's forward and loss save, measured and planned (the largest over the ranks)."""
    rows = []
    for cp in [c for c in range(1, demo.world + 1) if demo.world % c == 0]:
        group = init_device_mesh(demo.device.type, (demo.world // cp, cp)).get_group(1)
        for seq in args.seq_lengths:
            for variant in variants(cp, config):
                model, x, y = model_on_shard(args, config, group, cp, seq, variant, demo.device)
                measured, loss = saved_bytes(lambda: loss_of(model(x), y), [*model.parameters(), *model.buffers()])
                loss.backward()  # the ring's collectives are in backward too: every rank runs it
                planned = cp_activation_bytes(config, args.batch_size, seq, PRECISIONS["fp32"], cp, variant,
                                              cpu=demo.device.type == "cpu")
                every = [None] * demo.world
                dist.all_gather_object(every, measured)
                rows.append({"cp": cp, "seq": seq, "variant": variant, "measured_min": min(every),
                             "measured_max": max(every), "planned": planned})
    return rows


# ---- the bytes ------------------------------------------------------------------------------

class CommunicatedBytes(TorchDispatchMode):
    """While on, the bytes of this rank's sends and of the arrays its all-to-alls trade,
    counted at the dispatcher (where dist.isend arrives as c10d's send, and
    dist.all_to_all_single as alltoall_base_), in forward and in backward alike."""

    def __init__(self):
        super().__init__()
        self.sent = self.all_to_all = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.c10d.send.default:
            self.sent += sum(t.numel() * t.element_size() for t in args[0])
        elif func is torch.ops.c10d.alltoall_base_.default:
            self.all_to_all += args[1].numel() * args[1].element_size()
        return func(*args, **(kwargs or {}))


def measure_bytes(args, demo, config) -> list[dict]:
    """For each cp above 1 that divides the world, and each variant: the bytes one
    training forward and backward moves on each rank, counted and planned."""
    seq, rows = args.seq_lengths[-1], []
    for cp in [c for c in range(2, demo.world + 1) if demo.world % c == 0]:
        group = init_device_mesh(demo.device.type, (demo.world // cp, cp)).get_group(1)
        for variant in variants(cp, config):
            model, x, y = model_on_shard(args, config, group, cp, seq, variant, demo.device)
            with CommunicatedBytes() as counted:
                loss_of(model(x), y).backward()
            tokens = args.batch_size * seq // cp
            every = [None] * demo.world
            dist.all_gather_object(every, {"sent": counted.sent, "all_to_all": counted.all_to_all})
            rows.append({"variant": variant, "cp": cp, "seq": seq, "ranks": every,
                         "planned": cp_traffic_bytes(config, tokens, PRECISIONS["fp32"], cp, variant),
                         "planned_sent": cp_sent_bytes(config, tokens, PRECISIONS["fp32"], cp, variant)})
    return rows


# ---- report -----------------------------------------------------------------------------------

def tables(work, activations, traffic) -> str:
    out = []
    for w in work:
        pairs, flops = [r["pairs"] for r in w["ranks"]], [r["flops"] for r in w["ranks"]]
        out.append(f"{w['split']} split, cp {w['cp']}, sequence {w['seq']}: the pairs each rank's queries attend, "
                   f"and the FLOPs counted in its ring attention (forward and backward, one layer)\n")
        rows = [(rank, f"{p:,}", f"{f:,}") for rank, (p, f) in enumerate(zip(pairs, flops))]
        rows.append(("last / first", f"{pairs[-1] / pairs[0]:.2f}", f"{flops[-1] / flops[0]:.2f}"))
        out += [markdown_table(("rank", "pairs attended", "FLOPs counted"), rows, right=(1, 2)), ""]
    rows = [(a["cp"], a["seq"], a["variant"] if a["cp"] > 1 else "(one process)", f"{a['measured_max']:,}",
             "the same" if a["measured_min"] == a["measured_max"] == a["planned"] else f"{a['planned']:,}")
            for a in activations]
    out += ["activations one rank saves for backward (fp32, the sequences split over cp ranks), measured and "
            "planned\n",
            markdown_table(("cp", "sequence", "attention", "bytes, measured", "planner"), rows, right=(0, 1, 3)), ""]
    rows = []
    for t in traffic:
        counted = t["ranks"][0]
        same = all(r == counted for r in t["ranks"])
        kind = "sent" if t["variant"] == "ring" else "all_to_all"
        rows.append((t["variant"], t["cp"], t["seq"], kind.replace("_", "-"), f"{counted[kind]:,}",
                     "the same" if same and counted[kind] == t["planned"][kind] else f"{t['planned'][kind]:,}",
                     f"{t['planned_sent']:,.0f}"))
    out += ["bytes one rank's attention moves in a training step (fp32), counted and planned; all-to-all sends "
            "(cp - 1) / cp of its array\n",
            markdown_table(("attention", "cp", "sequence", "counted", "bytes", "planner", "sent"), rows,
                           right=(1, 2, 4, 6))]
    return "\n".join(out)


def report(args, demo, config, work, activations, traffic, run_dir):
    text = tables(work, activations, traffic)
    print("\n" + text, flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tables.md").write_text(text + "\n")
    (run_dir / "measure.json").write_text(json.dumps(
        {"world_size": demo.world, "args": vars(args), "model_config": config.to_dict(), "work": work,
         "activations": activations, "bytes": traffic, "torch_version": torch.__version__}, indent=1) + "\n")
    print(f"\noutputs in {run_dir}", flush=True)


def main():
    args = parse_args()
    demo = start_group(args.timeout)
    try:
        share_cpu_threads(demo.device)
        run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=demo.rank)
        config = get_config(args.model_preset, args.vocab_size)
        if demo.rank == 0:
            print(f"{demo.world} ranks, {args.model_preset} preset, vocabulary {args.vocab_size}, batch "
                  f"{args.batch_size}, sequences of {', '.join(map(str, args.seq_lengths))} tokens", flush=True)
        work = measure_work(args, demo, config)
        activations = measure_activations(args, demo, config)
        traffic = measure_bytes(args, demo, config)
        if demo.rank == 0:
            report(args, demo, config, work, activations, traffic, run_dir)
        dist.barrier()
    finally:
        gc_and_destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
