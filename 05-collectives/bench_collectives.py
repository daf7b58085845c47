"""Chapter 05, part 2: how fast are the collectives? A small nccl-tests.

For each collective and each message size (powers of two from --min-bytes to
--max-bytes) it times --iters back-to-back calls after --warmup untimed ones and reports

    time    seconds per call (the slowest rank's average: a collective is finished
            only when every rank is)
    algbw   size / time: what the caller sees
    busbw   algbw x a factor that depends on the collective and the world size n:
            the bandwidth each link must carry with the best algorithm. It is the
            number to hold against the hardware's link speed.

The factors and the size convention are those of NVIDIA's nccl-tests, so the figures
compare with theirs: all_reduce 2(n-1)/n; all_gather and reduce_scatter (n-1)/n with
the size counted as the whole (gathered / reduced) array; broadcast and reduce 1.

    torchrun --standalone --nproc-per-node=2 05-collectives/bench_collectives.py
    torchrun --standalone --nproc-per-node=8 05-collectives/bench_collectives.py --max-bytes 4294967296 --dtype bf16   # GPUs

Rank 0 prints a Markdown table and writes bench_collectives.json and
bench_collectives.png to <save-dir>/<experiment-name>/.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from common.cli import comma_list, non_negative_int, one_of, positive_int
from common.demos import script_parser, start_group
from common.distributed import first_error, gc_and_destroy_process_group
from common.environment import device_name, environment_info
from common.errors import UsageError, run_main
from common.files import write_json
from common.runfolder import claim_run_folder
from common.tables import markdown_table

from proof import max_over_ranks

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for `op` on `world_size` ranks (the nccl-tests factors).

    all_reduce: a ring all-reduce is a reduce_scatter then an all_gather; each sends
    (n-1)/n of the array over every link, so each link carries 2(n-1)/n x size.
    all_gather, reduce_scatter: (n-1)/n x size (the size of the whole array).
    broadcast, reduce: a pipelined chain passes the whole array once over each link: 1.
    """
    n = world_size
    if n < 1:
        raise ValueError(f"world size must be at least 1 (got {n})")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}")


def power_of_two(text: str) -> int:
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of 2 (got {text})")
    return value


def parse_args(argv=None):
    # Everything is checked before init_process_group: bad input stops at once, with one
    # line, and leaves nothing on disk.
    p = script_parser("05-bench", "Time collectives over a sweep of message sizes; report "
                      "time, algbw and busbw (nccl-tests conventions). Launch with torchrun.")
    p.add_argument("--min-bytes", type=power_of_two, default=1024, help="smallest message (a power of 2)")
    p.add_argument("--max-bytes", type=power_of_two, default=64 * 2**20, help="largest message (a power of 2)")
    p.add_argument("--ops", default=",".join(OPS), type=comma_list(*OPS), help="comma list of collectives")
    p.add_argument("--iters", type=positive_int, default=20, help="timed calls per size")
    p.add_argument("--warmup", type=non_negative_int, default=5, help="untimed calls per size, before timing")
    p.add_argument("--dtype", default="fp32", type=one_of(*DTYPES), help="element type")

    def check_sizes(args):
        if args.min_bytes > args.max_bytes:
            raise UsageError(f"--min-bytes {args.min_bytes} is larger than --max-bytes {args.max_bytes}")
        # The smallest message holds one element, and one per rank where each rank holds a
        # part (all_gather, reduce_scatter): smaller sizes would be rounded up, and the table
        # would list a size it never timed.
        world = int(os.environ.get("WORLD_SIZE") or 1)
        parts = world if {"all_gather", "reduce_scatter"} & set(args.ops) else 1
        smallest = DTYPES[args.dtype].itemsize * parts
        if args.min_bytes < smallest:
            per_rank = f" per rank ({world} ranks) for all_gather and reduce_scatter" if parts > 1 else ""
            raise UsageError(f"--min-bytes {args.min_bytes}: the smallest message is one {args.dtype} "
                             f"element{per_rank}, {smallest} bytes; raise --min-bytes")
    p.checks.append(check_sizes)
    return p.parse_args(argv)


def memory_error(max_bytes: int, device: torch.device, ranks_here: int) -> str | None:
    """Do the largest buffers fit? all_gather and reduce_scatter hold the whole array plus
    one part: about 2 x --max-bytes per rank. On GPUs each rank asks about its own GPU,
    only after set_device (asking earlier would open a context on GPU 0 from every rank,
    which GPUs in EXCLUSIVE_PROCESS mode refuse), for its own buffers; on CPUs the
    machine's RAM holds the buffers of every rank on it (`ranks_here`, LOCAL_WORLD_SIZE),
    and gloo's own copies on top (a rank's peak grew by 2.4 x a 256 MiB message on 2
    ranks): 3 x there."""
    if device.type == "cuda":
        free, where, need = torch.cuda.mem_get_info(device)[0], f"GPU {device.index}", 2 * max_bytes
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
        where, need = f"this machine ({ranks_here} ranks)", 3 * max_bytes * ranks_here
    if need > free:
        return (f"--max-bytes {max_bytes}: the largest buffers need about {need / 2**30:.1f} GiB on "
                f"{where} and {free / 2**30:.1f} GiB are available; lower --max-bytes")
    return None


def make_call(op, nbytes, dtype, world, device):
    """Buffers for one message size and a function that runs the collective once.
    Returns (call, bytes actually counted). Sizes follow nccl-tests: for all_gather and
    reduce_scatter, nbytes is the whole array (each rank holds 1/n of it), rounded
    down to a multiple of n elements."""
    elem = torch.tensor([], dtype=dtype).element_size()
    count = max(1, nbytes // elem)
    # Zeros: sums stay finite (no inf, no slow denormals); the values do not matter here.
    if op in ("all_gather", "reduce_scatter"):
        count = max(world, count - count % world)
        whole = torch.zeros(count, dtype=dtype, device=device)
        part = torch.zeros(count // world, dtype=dtype, device=device)
        # The single-tensor forms: one contiguous buffer, no list of n tensors to copy.
        if op == "all_gather":
            fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            call = lambda: fn(whole, part)  # noqa: E731
        else:
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            call = lambda: fn(part, whole)  # noqa: E731
    else:
        buf = torch.zeros(count, dtype=dtype, device=device)
        call = {"all_reduce": lambda: dist.all_reduce(buf),
                "broadcast": lambda: dist.broadcast(buf, src=0),
                "reduce": lambda: dist.reduce(buf, dst=0)}[op]
    return call, count * elem


def supported(op, dtype, world, device):
    """Try the collective once on a tiny buffer. Every rank gets the same answer (a
    backend that lacks an op refuses it on every rank), so every rank skips alike."""
    try:
        make_call(op, 64 * world, dtype, world, device)[0]()
        return None
    except (RuntimeError, ValueError, NotImplementedError) as e:
        return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def time_call(call, iters, warmup, device):
    """Seconds per call on this rank: warm-up, line up at a barrier, time `iters` calls."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()  # all ranks start the timed loop together
    if device.type == "cuda":
        # CUDA events time the GPU's work; the host would only time the launches.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        call()  # gloo calls return when this rank's part is done
    return (time.perf_counter() - t0) / iters


def measure(op, nbytes, dtype, world, device, iters, warmup) -> dict:
    """One row of the table: `op` at `nbytes`, timed on every rank."""
    call, counted = make_call(op, nbytes, dtype, world, device)
    # A collective is done when the slowest rank is done: report the max (a collective
    # too, on the group's device). nccl-tests defaults to the mean over ranks; on large
    # messages the two hardly differ.
    t = max_over_ranks(time_call(call, iters, warmup, device), device)
    algbw = counted / t / 1e9  # GB/s, 1 GB = 1e9 bytes as in nccl-tests
    factor = bus_factor(op, world)
    return {"op": op, "bytes": counted, "requested_bytes": nbytes, "count": counted // dtype.itemsize,
            "time_s": t, "algbw_gbps": algbw, "bus_factor": factor, "busbw_gbps": algbw * factor}


def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def fmt_gbps(x: float) -> str:
    return f"{x:.3g}" if x < 1 else f"{x:,.2f}"


COLUMNS = ("op", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)")


def results_table(rows) -> str:
    """One Markdown row per (op, size); numbers right-aligned."""
    header = COLUMNS
    body = [(r["op"], fmt_bytes(r["bytes"]), f"{r['time_s'] * 1e6:,.1f}",
             fmt_gbps(r["algbw_gbps"]), fmt_gbps(r["busbw_gbps"])) for r in rows]
    return markdown_table(header, body, right={2, 3, 4})


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for op in dict.fromkeys(r["op"] for r in rows):
        pts = [r for r in rows if r["op"] == op and r["time_s"] is not None]
        if not pts:
            continue
        x = [r["bytes"] for r in pts]
        ax_t.plot(x, [r["time_s"] * 1e6 for r in pts], marker="o", ms=3, label=op)
        ax_b.plot(x, [r["busbw_gbps"] for r in pts], marker="o", ms=3, label=op)
    for ax, ylabel in ((ax_t, "time per call (us)"), (ax_b, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_t.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    args = parse_args()
    group = start_group(args.timeout)  # one process per device: nccl on GPUs, gloo on CPUs
    rank, world, device, backend = group.rank, group.world, group.device, group.backend
    # Only now, after set_device: each rank checks its own GPU. Every rank hears the first
    # rank's error and all stop, before any buffer or folder exists.
    error = first_error(memory_error(args.max_bytes, device, int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    if error:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        dist.barrier()  # rank 0 has said it before anyone leaves (torchrun ends the job then)
        gc_and_destroy_process_group()
        return 2
    # The run folder first: results are never lost to a folder that cannot be written.
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=rank)
    dtype = DTYPES[args.dtype]
    sizes = [args.min_bytes << i for i in range((args.max_bytes // args.min_bytes).bit_length())]
    machine = device_name(device)
    if rank == 0:
        print(f"{world} ranks, backend {backend}, {machine}, dtype {args.dtype}, "
              f"{len(sizes)} sizes {fmt_bytes(sizes[0])} .. {fmt_bytes(sizes[-1])}, "
              f"{args.iters} timed calls after {args.warmup} warm-up", flush=True)

    rows, notes = [], []
    for op in args.ops:
        why = supported(op, dtype, world, device)
        if why:
            # Skipped, not emulated: an emulation would time a different algorithm.
            notes.append(f"{op}: skipped, {backend} cannot run it with {args.dtype} ({why})")
            if rank == 0:
                print(f"note: {notes[-1]}", flush=True)
            continue
        for nbytes in sizes:  # each size's buffers are freed before the next, larger one
            rows.append({**measure(op, nbytes, dtype, world, device, args.iters, args.warmup),
                         "dtype": args.dtype})

    if rank == 0:
        peaks = []
        for op in dict.fromkeys(r["op"] for r in rows):
            # the peak, not the largest size: on a shared machine the largest need not be
            best = max((r for r in rows if r["op"] == op), key=lambda r: r["busbw_gbps"])
            peaks.append(f"{op:>15}: peak busbw {fmt_gbps(best['busbw_gbps'])} GB/s at "
                         f"{fmt_bytes(best['bytes'])} (algbw {fmt_gbps(best['algbw_gbps'])} GB/s x "
                         f"factor {best['bus_factor']:.3g})")
        tables = f"{results_table(rows)}\n\n" + "\n".join(peaks)
        print(f"\n{tables}", flush=True)
        (run_dir / "tables.md").write_text(tables + "\n")  # what the tour's report shows
        write_json(run_dir / "bench_collectives.json", {
            "experiment_name": args.experiment_name, "world_size": world, "backend": backend,
            "device": device.type, "device_name": machine, "dtype": args.dtype,
            "iters": args.iters, "warmup": args.warmup,
            "time_reduction": "max over ranks of the mean time per call",
            "bus_factors": {op: bus_factor(op, world) for op in args.ops},
            "peak_busbw_gbps": {op: max(r["busbw_gbps"] for r in rows if r["op"] == op)
                                for op in dict.fromkeys(r["op"] for r in rows)},
            "notes": notes, "rows": rows, "environment": environment_info(),
            "torch_version": torch.__version__})
        if rows:
            plot(rows, run_dir / "bench_collectives.png",
                 f"{backend}, {world} ranks, {machine}, {args.dtype}")
        print(f"\noutputs in {run_dir}", flush=True)
    dist.barrier()  # nobody leaves while rank 0 still writes
    gc_and_destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "try a smaller --max-bytes"))
