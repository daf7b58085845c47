"""Chapter 08, the proof: attention split over the sequence equals attention on one process.

In fp64, on random queries, keys and values of the model's attention shape (every rank
makes the same ones): one process runs causal attention on the whole sequence, and its
output and the gradients of q, k and v; then every rank runs context_parallel.py's
attention on its own tokens, for each variant (ring, all-to-all) and each split
(balanced, contiguous) the world allows. Each rank's output and gradients must equal
the one process's at its tokens, within TOLERANCE; else exit status 1.

    torchrun --standalone --nproc-per-node=2 08-context-parallel/prove.py
    torchrun --standalone --nproc-per-node=3 08-context-parallel/prove.py
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.cli import one_of, positive_int, seed_value
from common.demos import exact_kernels, script_parser, start_demo
from common.distributed import gc_and_destroy_process_group
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.model import PRESETS, get_config
from common.runfolder import claim_run_folder

import context_parallel as cp_lib

# Split attention adds the same terms as one softmax, in another order: in fp64 the two
# differ by rounding, about 1e-15 of the largest value (seen: at most 3e-15). A wrong
# mask or merge moves values by more than 1e-2 of it (the mutants in the tests). Held to
# 1e-12 of the largest value, the check sits a thousand times above rounding and ten
# billion times below those bugs.
TOLERANCE = 1e-12


def parse_args(argv=None):
    p = script_parser("08-prove", "Context-parallel attention proven equal to one process's, in fp64.")
    p.add_argument("--model-preset", default="tiny", type=one_of(*PRESETS), help="the attention's shape: heads, "
                   "KV heads, head size")
    p.add_argument("--seq-length", type=positive_int, default=48, help="tokens per sample")
    p.add_argument("--batch-size", type=positive_int, default=2, help="samples")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads, instead of the preset's")
    p.add_argument("--seed", type=seed_value, default=0, help="the random queries, keys and values")

    def check(args):  # after the torchrun check: it needs the world size
        cp = dist_world()
        if args.seq_length % (2 * cp):
            raise UsageError(f"--seq-length {args.seq_length} does not cut into 2 x {cp} ranks = {2 * cp} "
                             f"equal chunks")
        heads = PRESETS[args.model_preset]["num_attention_heads"]
        if args.kv_heads is not None and heads % args.kv_heads:
            raise UsageError(f"--kv-heads {args.kv_heads} does not divide the {args.model_preset!r} preset's "
                             f"{heads} attention heads")
    p.checks.append(check)
    return p.parse_args(argv)


def dist_world() -> int:
    import os
    return int(os.environ["WORLD_SIZE"])


def variants(cp: int, heads: int, kv_heads: int) -> list[tuple[str, bool]]:
    """(variant, balanced) of every attention the world allows: all-to-all needs cp to
    divide the heads and the KV heads."""
    out = [("ring", True), ("ring", False)]
    if heads % cp == 0 and kv_heads % cp == 0:
        out += [("all-to-all", True), ("all-to-all", False)]
    return out


def worst_over_ranks(values: list[float], device) -> list[float]:
    """Each entry's largest value over the ranks (a collective)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def prove_attention(args, demo, config) -> tuple[dict, list[str]]:
    """Every variant's output and gradients against one process's, per rank; returns
    ({name: {tensor: largest difference / (TOLERANCE x its largest value)}}, failures)."""
    B, T, D = args.batch_size, args.seq_length, config.head_dim
    H, KV = config.num_attention_heads, config.num_key_value_heads
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(B, n, T, D, generator=gen, dtype=torch.float64).to(demo.device).requires_grad_()
               for n in (H, KV, KV))
    upstream = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).to(demo.device)
    # one process: the whole sequence, causal, as common/model.py's attention computes it
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != KV)
    whole.backward(upstream)
    expected = {"output": whole.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    group, results, failures = dist.group.WORLD, {}, []
    for variant, balanced in variants(demo.world, H, KV):
        split = cp_lib.SequenceSplit(T, demo.world, balanced)
        positions = cp_lib.shard_positions(split, group)
        mine = [cp_lib.shard(t.detach(), positions, dim=2).requires_grad_() for t in (q, k, v)]
        out = cp_lib.ATTENTION[variant](*mine, group, split)
        out.backward(cp_lib.shard(upstream, positions, dim=2))
        got = {"output": out.detach(), "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
        ratios = [((got[n] - cp_lib.shard(e, positions, dim=2)).abs().max() / (TOLERANCE * e.abs().max())).item()
                  if torch.isfinite(got[n]).all() else float("inf") for n, e in expected.items()]
        name = f"{variant}, {'balanced' if balanced else 'contiguous'}"
        results[name] = dict(zip(expected, worst_over_ranks(ratios, demo.device)))
        failures += [f"{name}: {n} differs from one process's by {r:.3g} x the tolerance"
                     for n, r in results[name].items() if not r <= 1]
    return results, failures


def report(args, demo, results, failures, run_dir):
    """Rank 0: the table, the verdict, prove.json."""
    rows = ["| attention | output | dq | dk | dv |", "| --- | ---: | ---: | ---: | ---: |"]
    rows += [f"| {name} | " + " | ".join(f"{r[n]:.2g}" for n in ("output", "dq", "dk", "dv")) + " |"
             for name, r in results.items()]
    print(f"\nlargest difference from one process, / ({TOLERANCE:g} x the largest value), over the ranks:\n\n"
          + "\n".join(rows) + "\n", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "prove.json").write_text(json.dumps(
        {"world_size": demo.world, "args": vars(args), "tolerance": TOLERANCE, "passed": not failures,
         "failures": failures, "attention": results}, indent=1) + "\n")
    print(f"outputs in {run_dir}", flush=True)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    else:
        print(f"OK: on {demo.world} ranks every attention's output and gradients equal one process's",
              flush=True)


def main():
    args = parse_args()
    demo = start_demo(args.timeout)
    try:
        run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=demo.rank)
        overrides = {"num_key_value_heads": args.kv_heads} if args.kv_heads else {}
        config = get_config(args.model_preset, 256, **overrides)
        with exact_kernels():
            results, failures = prove_attention(args, demo, config)
        if demo.rank == 0:
            report(args, demo, results, failures, run_dir)
        dist.barrier()
        return 1 if failures else 0
    finally:
        gc_and_destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
