"""Chapter 05, part 1: every collective, on every rank, shown and checked.

A collective is a call that every process of the group makes together. Each block below
runs one of them on small tensors whose values say where they came from, then rank 0
prints every rank's input and output in rank order, and every rank checks its own result
against the value worked out by hand. Any wrong result makes the script exit non-zero.

    torchrun --standalone --nproc-per-node=2 05-collectives/collectives_demo.py
    torchrun --standalone --nproc-per-node=3 05-collectives/collectives_demo.py --op reduce_scatter
    torchrun --standalone --nproc-per-node=2 05-collectives/collectives_demo.py --timeout-demo

`--timeout-demo` shows the other side: one rank skips a collective, and the others fail
after the group's timeout instead of waiting forever.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from common.cli import one_of
from common.demos import script_parser, start_group
from common.distributed import gc_and_destroy_process_group
from common.errors import run_main

OPS = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter",
       "reduce_scatter", "all_to_all", "barrier")


def parse_args(argv=None):
    # Checked before any process group exists: bad input costs nothing and leaves nothing.
    p = script_parser("05-collectives-demo", "Every torch.distributed collective on small "
                      "tensors, shown rank by rank and checked. Launch with torchrun (2 or "
                      "more processes).", run_folder=False)
    p.add_argument("--op", default="all", type=one_of("all", *OPS), help="which collective to show")
    p.add_argument("--emulate", action="store_true",
                   help="build avg, reduce_scatter and all_to_all from other collectives "
                        "even where the backend has them (what to do where it does not)")
    p.add_argument("--timeout-demo", action="store_true",
                   help="one rank skips an all_reduce; the others fail after --timeout")
    p.set_defaults(timeout=5.0)  # short: the timeout demo waits this long
    return p.parse_args(argv)


# --------------------------------------------------------------------------- helpers

def fmt(x) -> str:
    """A tensor (or list of tensors) as a short list, integers without '.0'."""
    if x is None:
        return "-"
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(fmt(t) for t in x) + "]"
    vals = x.tolist()
    vals = vals if isinstance(vals, list) else [vals]
    return "[" + ", ".join(str(int(v)) if float(v).is_integer() else f"{v:g}" for v in vals) + "]"


def same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a.shape == b.shape and torch.allclose(a.double().cpu(), b.double().cpu())


def unsupported(e: Exception) -> bool:
    """Does this error say 'the backend cannot do that' (rather than 'something broke')?"""
    msg = str(e).lower()
    return any(s in msg for s in ("not supported", "unsupported", "cannot use", "does not support"))


def native_or_built(native, built, emulate):
    """Run the backend's own collective; where the backend lacks it (or with --emulate),
    run `built`, the same result made from other collectives. Returns (result, why)."""
    if emulate:
        return built(), "--emulate"
    try:
        return native(), None
    except (RuntimeError, ValueError) as e:
        if not unsupported(e):
            raise
        return built(), f"the backend lacks it ({str(e).strip().splitlines()[0][:120]})"


class Demo:
    """Runs the blocks; rank 0 prints them; remembers whether every check passed."""

    def __init__(self, rank, world, device, emulate):
        self.rank, self.world, self.device, self.emulate = rank, world, device, emulate
        self.failures = []

    def t(self, values):
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def show(self, title, what, inp, out, expected, note=None, ok=None):
        """Every rank sends (input, output, ok) to every rank; rank 0 prints them in rank
        order. Gathering the strings, rather than each rank printing, keeps the lines
        from interleaving, and lets every rank learn whether any rank was wrong.
        `expected` None: nothing to check on this rank; `ok` given: checked by the caller."""
        if ok is None:
            ok = expected is None or same(out, expected)
        row = (fmt(inp), fmt(out) if out is not None else "-",
               "ok" if ok else f"WRONG, expected {fmt(expected)}")
        rows = [None] * self.world
        dist.all_gather_object(rows, row)  # a collective too: every rank calls it
        if self.rank == 0:
            print(f"\n=== {title} ===\n    {what}")
            if note:
                print(f"    note: {note}")
            w_in = max(len(r[0]) for r in rows)
            w_out = max(len(r[1]) for r in rows)
            for r, (i, o, k) in enumerate(rows):
                print(f"  rank {r}: in {i:<{w_in}}  ->  out {o:<{w_out}}  {k}", flush=True)
        bad = [r for r, (_, _, k) in enumerate(rows) if k != "ok"]
        if bad:
            self.failures.append(f"{title}: wrong result on rank(s) {bad}")

    # Every rank r starts from x_r = [r+1, 10(r+1)]: rank 0 [1, 10], rank 1 [2, 20], ...
    def x(self):
        r = self.rank
        return self.t([r + 1, 10 * (r + 1)])

    # ----------------------------------------------------------------------- the ops

    def all_reduce(self):
        n = self.world
        total = n * (n + 1) / 2  # 1 + 2 + ... + n
        for name, op, expected in (("sum", dist.ReduceOp.SUM, self.t([total, 10 * total])),
                                   ("max", dist.ReduceOp.MAX, self.t([n, 10 * n]))):
            x = self.x()
            out = x.clone()
            dist.all_reduce(out, op=op)  # in place: every rank ends with the same result
            self.show(f"all_reduce ({name})", f"every rank ends with the element-wise {name} "
                      "of all ranks' tensors", x, out, expected)
        # Average: ReduceOp.AVG where the backend has it, else sum then divide by n
        # (what DDP does anyway: it scales by 1/n and sums).
        x = self.x()
        expected = self.t([total / n, 10 * total / n])

        def native():
            out = x.clone()
            dist.all_reduce(out, op=dist.ReduceOp.AVG)
            return out

        def built():
            out = x.clone()
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            return out / n

        out, why = native_or_built(native, built, self.emulate)
        note = f"{why}: computed as SUM / world_size" if why else None
        self.show("all_reduce (avg)", "every rank ends with the element-wise mean", x, out,
                  expected, note)

    def reduce(self):
        n = self.world
        total = n * (n + 1) / 2
        x = self.x()
        out = x.clone()
        dist.reduce(out, dst=0, op=dist.ReduceOp.SUM)
        # Only the destination's result is defined; the others' buffers may hold anything
        # (partial sums on some backends), so only rank 0 checks and shows it.
        if self.rank == 0:
            self.show("reduce (sum, dst=0)", "like all_reduce, but only rank 0 receives the "
                      "sum (other ranks' buffers: undefined, not shown)", x, out,
                      self.t([total, 10 * total]))
        else:
            self.show("reduce (sum, dst=0)", "", x, None, None)

    def broadcast(self):
        # Rank 0 holds the data, the others a buffer of the right shape to receive it.
        x = self.t([7, 42]) if self.rank == 0 else self.t([0, 0])
        inp = x.clone()
        dist.broadcast(x, src=0)
        self.show("broadcast (src=0)", "rank 0's tensor is copied to every rank "
                  "(how DDP starts all replicas from the same weights)", inp, x, self.t([7, 42]))

    def all_gather(self):
        x = self.x()
        out = [torch.zeros_like(x) for _ in range(self.world)]
        dist.all_gather(out, x)
        expected = [self.t([r + 1, 10 * (r + 1)]) for r in range(self.world)]
        self.show("all_gather", "every rank ends with every rank's tensor, in rank order",
                  x, out, expected)

    def gather(self):
        x = self.x()
        out = [torch.zeros_like(x) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(x, out, dst=0)  # only the destination passes a list to fill
        expected = [self.t([r + 1, 10 * (r + 1)]) for r in range(self.world)] \
            if self.rank == 0 else None
        self.show("gather (dst=0)", "like all_gather, but only rank 0 receives the list",
                  x, out, expected)

    def scatter(self):
        # Rank 0 holds one chunk per rank: chunk j = [100 j, 100 j + 1] goes to rank j.
        chunks = [self.t([100 * j, 100 * j + 1]) for j in range(self.world)] \
            if self.rank == 0 else None
        out = self.t([0, 0])
        dist.scatter(out, chunks, src=0)
        self.show("scatter (src=0)", "rank 0's list is dealt out: chunk j goes to rank j",
                  chunks, out, self.t([100 * self.rank, 100 * self.rank + 1]))

    def reduce_scatter(self):
        # Each rank holds n chunks of 2: x_r = (r+1) * [1, 2, ..., 2n]. Rank j receives the
        # sum over ranks of chunk j: S * [2j+1, 2j+2], with S = 1 + 2 + ... + n.
        n, j = self.world, self.rank
        s = n * (n + 1) / 2
        x = (self.rank + 1) * torch.arange(1, 2 * n + 1, dtype=torch.float32, device=self.device)
        expected = self.t([s * (2 * j + 1), s * (2 * j + 2)])

        def native():
            out = self.t([0, 0])
            dist.reduce_scatter(out, list(x.chunk(n)))
            return out

        def built():
            # The same result from an all_reduce of the whole tensor, keeping our chunk:
            # correct, but it moves about twice the data a real reduce_scatter moves.
            full = x.clone()
            dist.all_reduce(full)
            return full.chunk(n)[j].clone()

        out, why = native_or_built(native, built, self.emulate)
        note = f"{why}: built from all_reduce + keep own chunk" if why else None
        self.show("reduce_scatter (sum)", "chunk j of the element-wise sum lands on rank j "
                  "only (all_reduce = reduce_scatter + all_gather)", x, out, expected, note)

    def all_to_all(self):
        # Rank r holds [10r, 10r+1, ..., 10r+n-1] and sends element j to rank j: the
        # ranks' rows become columns (a transpose). Rank j ends with [j, 10+j, 20+j, ...].
        n, j = self.world, self.rank
        x = self.t([10 * self.rank + k for k in range(n)])
        expected = [self.t([10 * r + j]) for r in range(n)]

        def native():
            out = [self.t([0]) for _ in range(n)]
            dist.all_to_all(out, list(x.chunk(n)))
            return out

        def built():
            # From all_gather: everyone receives everything and keeps its column
            # (n times the traffic, fine for a demo).
            rows = [torch.zeros_like(x) for _ in range(n)]
            dist.all_gather(rows, x)
            return [row[j:j + 1].clone() for row in rows]

        out, why = native_or_built(native, built, self.emulate)
        note = f"{why}: built from all_gather + keep own column" if why else None
        self.show("all_to_all", "chunk j of rank r goes to rank j, slot r: a transpose "
                  "(used by expert parallelism)", x, out, expected, note)

    def barrier(self):
        # Rank r arrives after sleeping 0.3 r seconds; nobody leaves before the last
        # one (rank n-1, after 0.3 (n-1) s) has arrived.
        step = 0.3
        dist.barrier()  # a common starting line
        t0 = time.perf_counter()
        time.sleep(step * self.rank)
        dist.barrier()
        waited = time.perf_counter() - t0
        last = step * (self.world - 1)
        # small slack: the ranks leave the first barrier at slightly different moments
        ok = waited >= last - 0.1
        self.show("barrier", f"rank r arrives after r x {step} s (in), leaves after 'out' s: "
                  f"nobody leaves before the last rank arrives at {last:.1f} s",
                  self.t([round(step * self.rank, 1)]), self.t([round(waited, 2)]), self.t([last]), ok=ok)


# ------------------------------------------------------------------- timeout demo

def timeout_demo(rank, world, device, timeout):
    """One rank skips an all_reduce. Returns the exit status (always non-zero)."""
    skipper = world - 1
    if rank == 0:
        print(f"timeout demo: {world} ranks, process group timeout {timeout:g} s.\n"
              f"rank {skipper} will NOT call all_reduce (think: an `if rank == ...` around a "
              f"collective, or one rank with fewer batches); the other ranks call it and wait.",
              flush=True)
    dist.barrier()  # everyone is up and connected: what follows is the skipped collective
    if rank == skipper:
        # Busy elsewhere, still alive: had it exited, the others would see a closed
        # connection at once rather than a timeout. torchrun stops it when a peer fails;
        # the sleep is bounded so that it also ends under any other launcher.
        time.sleep(timeout + 30)
        return 1
    t0 = time.perf_counter()
    try:
        x = torch.ones(1, device=device)
        dist.all_reduce(x)
        # nccl only queues the all_reduce on the GPU; waiting for it is where a hang would
        # show. Its watchdog then aborts the whole process after the timeout (no exception
        # here), which ends the run just as surely.
        if device.type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # gloo raises in the waiting ranks once the timeout expires
        waited = time.perf_counter() - t0
        if rank == 0:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"\nrank 0 waited {waited:.1f} s in all_reduce, then the backend gave up:\n"
                  f"    {type(e).__name__}: {first[:300]}\n"
                  f"What happened: a collective completes only when every rank of the group "
                  f"has called it. Rank {skipper} never did, so the others waited until the "
                  f"process group's timeout ({timeout:g} s, init_process_group(timeout=...)) "
                  f"expired and raised. Rank 0 now exits non-zero and torchrun stops the "
                  f"remaining ranks, so the job ends instead of hanging forever.",
                  flush=True)
        return 1
    if rank == 0:
        print("unexpected: the all_reduce completed although one rank skipped it", flush=True)
    return 1


# ---------------------------------------------------------------------------- main

def main():
    args = parse_args()
    # One process per device: nccl moves GPU memory between GPUs, gloo moves CPU memory
    # over sockets. The timeout bounds how long any collective may wait for the others.
    group = start_group(args.timeout)
    rank, world, device = group.rank, group.world, group.device
    if args.timeout_demo:
        # After a timeout the group is broken: tearing it down, even the interpreter's own
        # clean-up at exit, can block or abort (SIGABRT from gloo's threads). Leave at
        # once with the demo's status; torchrun ends the other ranks anyway.
        rc = timeout_demo(rank, world, device, args.timeout)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(rc)
    if rank == 0:
        print(f"{world} ranks, backend {group.backend}, device {device.type}; "
              f"torch {torch.__version__}", flush=True)
    demo = Demo(rank, world, device, args.emulate)
    for op in OPS if args.op == "all" else (args.op,):
        getattr(demo, op)()
    if rank == 0 and demo.failures:
        print("\nFAILED: " + "; ".join(demo.failures), file=sys.stderr, flush=True)
    elif rank == 0:
        print(f"\nall {len(OPS) if args.op == 'all' else 1} collective(s) gave the expected "
              f"result on all {world} ranks", flush=True)
    gc_and_destroy_process_group()
    return 1 if demo.failures else 0


if __name__ == "__main__":
    sys.exit(run_main(main, "its tensors are a few KB: free memory on the device (other programs)"))
