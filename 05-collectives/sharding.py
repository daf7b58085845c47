"""Measuring the sharded-training lesson (05-collectives/sharded_from_scratch.py); not
the lesson itself.

- `Comm`: all_gather and reduce_scatter that count what they carry, plus the same
  counting for torch's DDP (a comm hook) and FSDP2 (its custom-collective hooks).
- `local_bytes`, `optimizer_state_bytes`: bytes of the tensors a rank really holds
  (a DTensor counts its local shard).
- `peak_step_bytes`: the peak bytes of live tensors during one step, as torch's
  MemTracker (a dispatch mode that sees every tensor created) counts them.
- `measure`, `mean_over_ranks`: a mode's results, over all ranks (every collective on
  the demo's device: nccl takes only GPU tensors).
- `start_summary`, `report`: the run's header, tables (printed), JSON and figure.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from common.demos import all_gather_single, reduce_scatter_single
from common.environment import device_name, environment_info
from common.files import write_json
from common.sizing import RING_FACTOR  # what a ring algorithm sends per byte of the array
from common.tables import markdown_table

from proof import max_over_ranks


class Comm:
    """The collectives the sharded modes call, each counted: calls and array bytes per
    kind. `sent_bytes()` converts them to what each rank sends with a ring algorithm."""

    def __init__(self, world: int):
        self.world, self.counted = world, True
        self.calls, self.array_bytes = Counter(), Counter()

    def count(self, kind: str, tensor: torch.Tensor):
        self.calls[kind] += 1
        self.array_bytes[kind] += tensor.numel() * tensor.element_size()

    def all_gather(self, output, shard) -> None:
        self.count("all_gather", output)
        all_gather_single(output, shard)

    def reduce_scatter(self, shard, full) -> None:
        self.count("reduce_scatter", full)
        reduce_scatter_single(shard, full)

    def sent_bytes(self) -> dict:
        return {k: RING_FACTOR[k](self.world) * b for k, b in self.array_bytes.items()}

    def ddp_hook(self):
        """A DDP comm hook: torch's own allreduce_hook (divide by world size, all_reduce
        the bucket), counted."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            self.count("all_reduce", bucket.buffer())
            return allreduce_hook(state, bucket)
        return hook

    def watch_fsdp2(self, modules):
        """Count FSDP2's all-gathers and reduce-scatters through its documented hooks
        (FSDPModule.set_custom_all_gather / set_custom_reduce_scatter), calling the same
        collectives it would call itself. A torch without them: not counted."""
        try:
            from torch.distributed.fsdp._fully_shard._fsdp_collectives import (DefaultAllGather,
                                                                               DefaultReduceScatter)
        except ImportError:
            self.counted = False
            return
        comm = self

        class CountedAllGather(DefaultAllGather):
            def __call__(self, output_tensor, input_tensor, group, async_op=False):
                comm.count("all_gather", output_tensor)
                return super().__call__(output_tensor, input_tensor, group, async_op)

        class CountedReduceScatter(DefaultReduceScatter):
            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                comm.count("reduce_scatter", input_tensor)
                return super().__call__(output_tensor, input_tensor, group, op, async_op)

        for m in modules:
            m.set_custom_all_gather(CountedAllGather())
            m.set_custom_reduce_scatter(CountedReduceScatter())


def textbook_sent_bytes(mode: str, param_bytes: int, world: int) -> float:
    """Per rank per step: DDP's all-reduce and ZeRO-1's reduce-scatter + all-gather send
    2(n-1)/n of the parameters' bytes; full sharding gathers twice: 3(n-1)/n."""
    return (3 if mode in ("zero3", "fsdp2") else 2) * (world - 1) / world * param_bytes


def local_bytes(tensors) -> int:
    """Bytes of the tensors themselves on this rank (a DTensor: its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def optimizer_state_bytes(optimizer) -> int:
    return local_bytes(v for state in optimizer.state.values() for v in state.values()
                       if isinstance(v, torch.Tensor))


def peak_step_bytes(trainer, batch) -> float:
    """One more step of `trainer` under torch's MemTracker: the peak bytes of live tensors
    on the device (worst rank). MemTracker sees the tensors created inside it, plus the
    model, optimizer and state we name; not allocator caching, nor the communication
    library's own buffers. Untimed: it slows every operation down."""
    from torch.distributed._tools.mem_tracker import MemTracker

    params, grads = trainer.state_tensors()
    tracker = MemTracker()
    with warnings.catch_warnings():  # it warns about every parameter whose .grad is None
        warnings.simplefilter("ignore", UserWarning)
        tracker.track_external(trainer.model, trainer.optimizer, *(t for t in params + grads if t is not None))
    with tracker, warnings.catch_warnings():
        # ZeRO-3 frees a module's full gradients (.grad = None) in its post-accumulate hook,
        # which runs before MemTracker's own: that one then finds no gradient to count and
        # warns, once per process. A freed gradient holds no memory, so nothing is missed.
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass",
                                UserWarning)
        trainer.step(*batch)
    peak = tracker.get_tracker_snapshot("peak")
    return max_over_ranks(max(snap["Total"] for snap in peak.values()), trainer.demo.device)


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()  # GPU work is asynchronous: wait before reading the clock
    return time.perf_counter()


def mean_over_ranks(losses, device) -> list[float]:
    """Per step, the mean of the ranks' losses: the global batch's loss (equal token
    counts). A collective, sent on `device`."""
    t = torch.stack(losses).to(device, torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def start_summary(args, demo, config, num_params: int, timing_dtype: str) -> dict:
    """The run's facts for the JSON; rank 0 announces the run."""
    summary = {"world_size": demo.world, "backend": demo.backend, "device_name": device_name(demo.device),
               "model_config": config.to_dict(), "num_params": num_params, "proof_dtype": "fp64", "timing_dtype": timing_dtype,
               "proof_bound": None, "load_average_before": os.getloadavg()[0],
               "tokens_per_step": demo.world * args.batch_size * args.seq_length, "args": vars(args)}
    if demo.rank == 0:
        print(f"{demo.world} ranks, {demo.backend}, {summary['device_name']}; {args.model_preset} "
              f"preset, {num_params / 1e6:.2f} M parameters; proof {args.proof_steps} fp64 steps, timing "
              f"{args.steps} {timing_dtype} steps of {summary['tokens_per_step']:,} tokens per mode, "
              f"modes interleaved step by step", flush=True)
    return summary


def measure(trainer, warmup: int, tokens_per_step: int) -> dict:
    """A mode's results, over all ranks: throughput from the median step (slowest rank)
    after `warmup` (a median shrugs off steps that other programs slowed down), mean loss
    per step, the bytes this rank holds between steps, and its collectives per step."""
    t, device = trainer, trainer.demo.device
    steps, world = len(t.times), t.comm.world
    times = torch.tensor(t.times, dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    median = statistics.median(times[warmup:].tolist())
    params, grads = t.state_tensors()
    held = {"params": local_bytes(params), "grads": local_bytes(grads),
            "optimizer": optimizer_state_bytes(t.optimizer)}
    return {"losses": mean_over_ranks(t.losses, device), "step_times_s": times.tolist(),
            "step_time_s_median": median, "tokens_per_s": tokens_per_step / median,
            "bytes": {k: max_over_ranks(v, device) for k, v in held.items()},
            "comm_calls_per_step": {k: v / steps for k, v in t.comm.calls.items()} if t.comm.counted else None,
            "comm_sent_bytes_per_step": ({k: v / steps for k, v in t.comm.sent_bytes().items()}
                                         if t.comm.counted else None),
            "textbook_sent_bytes_per_step": textbook_sent_bytes(t.mode, t.param_bytes, world)}


def report(summary: dict, results: dict, failures: list, run_dir: Path, name: str) -> None:
    """Rank 0: print the two tables and the verdict, write <name>.json and <name>.png."""
    world, a = summary["world_size"], summary["args"]
    ddp = results.get("ddp", {}).get("tokens_per_s")
    for r in results.values():
        r["tokens_per_s_vs_ddp"] = r["tokens_per_s"] / ddp if ddp else None
    tables = (f"per-rank bytes, {world} ranks (params, grads, AdamW state: held between steps):\n\n"
              f"{memory_table(results)}\n\nthroughput; bytes each rank sends per step (counted: the "
              f"sizes of the collectives called, as a ring algorithm sends them; textbook: 2(N-1)/N or "
              f"3(N-1)/N x the parameters' bytes); proof:\n\n{comm_table(results)}")
    print(f"\n{tables}")
    print(f"\nmedian step of steps {a['timing_warmup'] + 1}..{a['steps']} ({summary['timing_dtype']}), "
          f"slowest rank; load "
          f"average {summary['load_average_before']:.2f} before, {os.getloadavg()[0]:.2f} after", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)  # created only now, by rank 0 only
    (run_dir / "tables.md").write_text(tables + "\n")  # what the tour's report shows
    write_json(run_dir / f"{name}.json", {**summary, "load_average_after": os.getloadavg()[0],
                                          "passed": not failures, "failures": failures, "modes": results,
                                          "environment": environment_info(), "torch_version": torch.__version__})
    plot(results, run_dir / f"{name}.png", f"{world} ranks, {summary['backend']}, "
         f"{summary['device_name']}, {a['model_preset']}, {summary['timing_dtype']}")
    print(f"outputs in {run_dir}", flush=True)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    elif ddp:
        worst = max(r["max_abs_diff_vs_ddp"] for r in results.values())
        how = "bit for bit" if worst == 0.0 else \
            f"to rounding (largest difference {worst:.2g} <= bound {summary['proof_bound']:.2g})"
        print(f"OK: every mode's weights equal DDP's after each of {a['proof_steps']} fp64 steps "
              f"taken from DDP's state, {how}", flush=True)


def _mib(n) -> str:
    return f"{n / 2**20:,.2f}"


MEMORY_COLUMNS = ("mode", "params MiB", "grads MiB", "AdamW state MiB", "state vs DDP",
                  "peak in step MiB (MemTracker)")
COMM_COLUMNS = ("mode", "tokens/s", "vs DDP", "step ms (median)", "calls/step", "MiB sent/step (counted)",
                "MiB sent/step (textbook)", "proof: max abs diff vs DDP")


def memory_table(results: dict) -> str:
    header = MEMORY_COLUMNS
    ref = results.get("ddp", {}).get("bytes", {}).get("optimizer")
    rows = [(m, _mib(r["bytes"]["params"]), _mib(r["bytes"]["grads"]), _mib(r["bytes"]["optimizer"]),
             f"{100 * r['bytes']['optimizer'] / ref:.1f}%" if ref else "n/a",
             _mib(r["bytes"]["peak_step"])) for m, r in results.items()]
    return markdown_table(header, rows, right=range(1, len(header)))


def comm_table(results: dict) -> str:
    header = COMM_COLUMNS
    rows = []
    for m, r in results.items():
        counted = r["comm_sent_bytes_per_step"] is not None
        calls = ", ".join(f"{v:.3g} {k}" for k, v in r["comm_calls_per_step"].items()) if counted else "n/a"
        diff = r.get("max_abs_diff_vs_ddp")
        rows.append((m, f"{r['tokens_per_s']:,.0f}",
                     f"{100 * r['tokens_per_s_vs_ddp']:.1f}%" if r.get("tokens_per_s_vs_ddp") else "n/a",
                     f"{r['step_time_s_median'] * 1e3:,.1f}", calls,
                     _mib(sum(r["comm_sent_bytes_per_step"].values())) if counted else "n/a",
                     _mib(r["textbook_sent_bytes_per_step"]),
                     f"{diff:.2e}" if diff is not None else "n/a"))
    return markdown_table(header, rows, right=(1, 2, 3, 5, 6, 7))


def plot(results: dict, path, title: str) -> None:
    """Per-rank bytes (stacked: params, grads, AdamW state; peak as a marker) and
    tokens/s, one bar per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    bottom = [0.0] * len(modes)
    for key, label in (("params", "parameters"), ("grads", "gradients"), ("optimizer", "AdamW state")):
        vals = [results[m]["bytes"][key] / 2**20 for m in modes]
        ax1.bar(modes, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.plot(modes, [results[m]["bytes"]["peak_step"] / 2**20 for m in modes], "k_",
             markersize=30, label="peak in a step (MemTracker)")
    ax1.set_ylabel("MiB per rank")
    ax1.legend(fontsize=8)
    ax2.bar(modes, [results[m]["tokens_per_s"] for m in modes], color="tab:gray")
    ax2.set_ylabel("tokens/s (all ranks)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
