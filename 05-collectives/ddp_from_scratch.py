"""Chapter 05, part 3: data parallelism rebuilt from two collectives, and proven equal to DDP.

DDP is, at heart, (1) a broadcast of rank 0's initial parameters and (2) an all_reduce of
the gradients scaled by 1/world size, so every replica takes the same step. Written here
three ways (naive: one all_reduce per tensor; bucketed: a few flat buffers; overlap:
buckets reduced while backward goes on, as DDP does), beside torch's DDP, from the same
weights on the same batches. Prove: --proof-steps float64 steps of every mode, each from
DDP's state (parameters and AdamW moments); after each step every mode's parameters must
equal DDP's, bit for bit on 2 ranks, on more within the rounding bound that summation
order allows in one step (proof.adam_step_bound), else exit status 1. Time:
--steps steps in the chapters' training dtype (bf16 autocast on GPUs, fp32 on CPUs), the
modes interleaved. Report: a table and JSON.

    torchrun --standalone --nproc-per-node=2 05-collectives/ddp_from_scratch.py
    torchrun --standalone --nproc-per-node=2 05-collectives/ddp_from_scratch.py --modes naive,bucketed,overlap,ddp
"""

import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function
from tqdm import tqdm

from common.cli import comma_list, non_negative_int, positive_float, positive_int
from common.data import IGNORE_INDEX, show_progress
from common.demos import fixed_batches, script_parser, start_group
from common.distributed import DDP_NO_BUFFER_SYNC, gc_and_destroy_process_group
from common.environment import device_name, environment_info
from common.errors import MODEL_OOM_ADVICE, run_main
from common.files import write_json
from common.model import LlamaForCausalLM, get_config, num_parameters
from common.runfolder import claim_run_folder
from common.tables import markdown_table
from common.training import build_optimizer

from proof import (NotFinite, adam_step_bound, exact_kernels, gradient_bound, max_abs_difference,
                   max_difference_to_rank0, max_over_ranks, stop_if_not_finite)

MODES = ("naive", "bucketed", "overlap", "ddp")


def parse_args(argv=None):
    p = script_parser("05-ddp-from-scratch", "Data parallelism rebuilt from broadcast + "
                      "all_reduce (naive, bucketed, overlapped), proven equal to DDP, and timed.",
                      training=True)
    p.add_argument("--proof-steps", type=positive_int, default=3, help="float64 steps per mode, proof")
    p.add_argument("--steps", type=positive_int, default=12,
                   help="timed steps of every mode (bf16 autocast on GPUs, fp32 on CPUs)")
    p.add_argument("--timing-warmup", type=non_negative_int, default=2,
                   help="first steps of each mode left out of the timing")
    p.add_argument("--bucket-mb", type=positive_float, default=25.0,
                   help="gradient bucket size in MiB (DDP's default is 25)")
    p.add_argument("--modes", default="naive,bucketed,ddp", type=comma_list(*MODES), help="comma list")
    return p.parse_args(argv)


# ------------------------------------------------------- step 1: broadcast initial state

def broadcast_initial_state(model):
    """Copy rank 0's parameters and buffers into every rank's replica, in place: the
    state_dict() tensors share storage with the module. (DDP's constructor does the same,
    in large coalesced chunks rather than one call per tensor.)"""
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


# ------------------------------------------- step 2: average the gradients, three ways

class NaiveAllReduce:
    """One all_reduce per parameter tensor, after backward. Correct, and simple; but each
    call pays the collective's fixed latency, and small tensors use the network badly
    (see the busbw of small messages in bench_collectives.py)."""

    def __init__(self, model, world):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.scale = 1.0 / world
        self.calls_per_step = len(self.params)

    def after_backward(self):
        for p in self.params:
            # Scale first, then sum: the order DDP uses (it keeps fp16 sums from
            # overflowing), so with 2 ranks the results match DDP's to the last bit.
            p.grad.mul_(self.scale)
            dist.all_reduce(p.grad)


class Bucket:
    """A flat buffer and, for each of its parameters, a view of its slice shaped like it."""

    def __init__(self, params, device):
        self.params = params
        self.buffer = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.pending = len(params)  # gradients still to arrive (overlap mode)


def make_buckets(params, bucket_mb, device):
    """Group parameters into buckets of at most bucket_mb MiB, in *reverse* order: backward
    produces the gradients of the last layers first, so those fill the first bucket.
    (A tensor larger than the cap gets a bucket of its own.)"""
    cap = bucket_mb * 2**20
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return [Bucket(b, device) for b in buckets]


class BucketedAllReduce:
    """Flatten the gradients into a few large buffers; one all_reduce per buffer."""

    def __init__(self, model, world, bucket_mb, device):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = make_buckets(self.params, bucket_mb, device)
        self.scale = 1.0 / world
        self.calls_per_step = len(self.buckets)

    def after_backward(self):
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                view.copy_(p.grad)  # gather into the flat buffer
            b.buffer.mul_(self.scale)
            dist.all_reduce(b.buffer)  # one big message instead of many small ones
            for p, view in zip(b.params, b.views):
                p.grad.copy_(view)  # scatter the averaged gradient back


class OverlappedAllReduce(BucketedAllReduce):
    """Bucketed and overlapped with backward, as DDP does: a hook fires once backward has
    accumulated a parameter's gradient; when a bucket's last gradient is in, its
    all_reduce starts asynchronously (async_op=True returns at once) while backward goes
    on with earlier layers. After backward we only wait for what is still in flight.
    Buckets start strictly in index order, the same on every rank: collectives must be
    called in the same order everywhere, whatever order the hooks fire in."""

    def __init__(self, model, world, bucket_mb, device):
        super().__init__(model, world, bucket_mb, device)
        self.where = {}
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                self.where[p] = (b, view)
        self.next_bucket, self.works = 0, []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p):
        bucket, view = self.where[p]
        view.copy_(p.grad)
        bucket.pending -= 1
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            b = self.buckets[self.next_bucket]
            b.buffer.mul_(self.scale)
            self.works.append(dist.all_reduce(b.buffer, async_op=True))
            self.next_bucket += 1

    def after_backward(self):
        if self.next_bucket != len(self.buckets):
            raise RuntimeError("backward produced no gradient for some parameters; "
                               "their bucket was never reduced")
        for work in self.works:
            work.wait()  # the exposed communication: whatever backward did not hide
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                p.grad.copy_(view)
            b.pending = len(b.params)
        self.next_bucket, self.works = 0, []


# ------------------------------------------------------------ one mode's training run

class Replica:
    """This rank's replica in one mode: model, gradient averaging, optimizer, timings."""

    def __init__(self, mode, args, config, device, rank, world, dtype, autocast=None):
        self.mode, self.device = mode, device
        self.autocast = autocast or nullcontext()
        # A different seed on every rank, on purpose: only the broadcast (or DDP's
        # constructor) makes the replicas equal. Every mode starts from rank 0's weights.
        torch.manual_seed(args.seed + rank)
        self.model = LlamaForCausalLM(config).to(device, dtype)
        self.differ_before = max_difference_to_rank0(list(self.model.parameters()))
        if mode == "ddp":
            # The constructor broadcasts rank 0's state, then installs the bucketed,
            # overlapped all-reduce hooks (no buffer re-broadcast: as in chapter 03).
            self.forward_model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                                     bucket_cap_mb=args.bucket_mb, **DDP_NO_BUFFER_SYNC)
            self.sync = None
        else:
            broadcast_initial_state(self.model)
            self.forward_model = self.model
            self.sync = {"naive": lambda: NaiveAllReduce(self.model, world),
                         "bucketed": lambda: BucketedAllReduce(self.model, world, args.bucket_mb, device),
                         "overlap": lambda: OverlappedAllReduce(self.model, world, args.bucket_mb, device),
                         }[mode]()
        if max_difference_to_rank0(list(self.model.parameters())) != 0.0:
            raise RuntimeError(f"{mode}: replicas differ after the initial broadcast")
        # the chapters' AdamW (fused on GPUs; not in the float64 proof)
        self.optimizer = build_optimizer(self.model, args.lr, 0.1, "cpu" if dtype == torch.float64 else device)
        self.times, self.losses = {"step": [], "compute": [], "sync": []}, []

    def clock(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: wait before reading the clock
        return time.perf_counter()

    def step(self, x, y):
        """One training step, timed: its gradients, then the update."""
        t0 = self.clock()
        self.forward_backward(x, y)  # ddp and overlap: the all-reduces start in here, from hooks
        t1 = self.clock()
        self.average_gradients()
        t2 = self.clock()
        self.update()
        t3 = self.clock()
        for key, seconds in (("compute", t1 - t0), ("sync", t2 - t1), ("step", t3 - t0)):
            self.times[key].append(seconds)

    # The record_function ranges name the phases in a profiler's trace (overlap_timeline.py).
    def forward_backward(self, x, y):
        with record_function("forward"), self.autocast:  # bf16 autocast in the timed GPU steps
            logits = self.forward_model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)
        with record_function("backward"):
            loss.backward()
        self.losses.append(loss.detach().float())

    def average_gradients(self):
        if self.sync is not None:
            with record_function("sync"):
                self.sync.after_backward()  # all gradients averaged when this returns

    def update(self):
        with record_function("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def steps(batches, what, group):
    """The batches, announced in one line by rank 0, with a progress bar in a terminal."""
    if group.rank == 0:
        print(what, flush=True)
    return tqdm(batches, desc=what.split(":")[0], leave=False, disable=group.rank != 0 or not show_progress())


def make_replicas(args, config, group, dtype=torch.float32, autocast=None):
    """One replica per mode, every one from rank 0's initial weights."""
    return {mode: Replica(mode, args, config, group.device, group.rank, group.world, dtype, autocast)
            for mode in args.modes}


def run_modes(args, config, batches, group, what, dtype=torch.float32, autocast=None):
    """Every mode from the same start on the same batches, one step of each in turn, so
    a change in the machine's load (other programs, turbo, caches) hits all modes alike."""
    replicas = make_replicas(args, config, group, dtype, autocast)
    for x, y in steps(batches, what, group):
        for replica in replicas.values():
            replica.step(x, y)
    return replicas


# ------------------------------------------------------------- prove, time, report

def prove(args, config, batches, group):
    """--proof-steps float64 steps of every mode, one step at a time. After each step's
    backward, no loss or gradient may hold a NaN or an infinity (the first one stops the
    proof at once: NotFinite, naming it), and each mode's averaged gradients must equal DDP's
    within the bound that summation order allows (0 on 2 ranks); after its update, the
    same for the parameters (within AdamW's bound), and each mode's replicas must equal
    rank 0's. Then every mode takes DDP's parameters and AdamW moments, so that the next
    step starts from the same state again and rounding cannot grow from step to step (a
    run at a large lr can amplify it chaotically). Returns (per-mode figures, failures,
    the largest one-step bound); without a ddp mode, nothing to compare with."""
    replicas = make_replicas(args, config, group, torch.float64)
    proof = {mode: {"max_abs_diff_vs_ddp": None, "max_abs_grad_diff_vs_ddp": None,
                    "replicas_differ_before_broadcast": r.differ_before, "replicas_differ_after_training": 0.0}
             for mode, r in replicas.items()}
    reference, failures, bounds = replicas.get("ddp"), [], [0.0]
    if reference is not None:
        for p in proof.values():
            p["max_abs_diff_vs_ddp"] = p["max_abs_grad_diff_vs_ddp"] = 0.0
        largest_grad = largest_gradient_element(reference.model)
    what = f"proof: {args.proof_steps} float64 steps of each mode" + (", each from DDP's state" if reference else "")
    for step, (x, y) in enumerate(steps(batches[:args.proof_steps], what, group), start=1):
        if reference is not None:
            largest_grad.zero_()
        for r in replicas.values():
            r.forward_backward(x, y)
            r.average_gradients()
        stop_if_not_finite(replicas, step, lambda r: [("the loss", r.losses[-1]), *(
            (f"the gradient of {n}", p.grad) for n, p in r.model.named_parameters())])
        if reference is not None:
            g_bound = gradient_bound(group.world, torch.float64, max_over_ranks(largest_grad.item(), group.device))
            for mode, r in replicas.items():
                diff = max_over_ranks(max_abs_difference([p.grad for p in r.model.parameters()],
                                                         [p.grad for p in reference.model.parameters()]), group.device)
                proof[mode]["max_abs_grad_diff_vs_ddp"] = max(proof[mode]["max_abs_grad_diff_vs_ddp"], diff)
                if not diff <= g_bound:
                    failures.append(f"{mode}: step {step}: an averaged gradient differs from DDP's by {diff:.3g} > "
                                    f"{g_bound:.3g}, the most that summation order allows")
        for r in replicas.values():
            r.update()
        stop_if_not_finite(replicas, step, lambda r: [(f"the parameter {n}", p) for n, p in r.model.named_parameters()])
        for mode, r in replicas.items():
            differ = max_difference_to_rank0(list(r.model.parameters()))
            proof[mode]["replicas_differ_after_training"] = max(proof[mode]["replicas_differ_after_training"], differ)
            if differ != 0.0:
                failures.append(f"{mode}: replicas differ by {differ:g} after step {step}")
        if reference is None:
            continue
        opt = reference.optimizer.defaults
        bound = adam_step_bound(group.world, torch.float64, args.lr, step,
                                max_over_ranks(largest_grad.item(), group.device), opt["betas"], opt["eps"])
        bounds.append(bound)
        for mode, r in replicas.items():
            diff = max_over_ranks(max_abs_difference(list(r.model.parameters()),
                                                     list(reference.model.parameters())), group.device)
            proof[mode]["max_abs_diff_vs_ddp"] = max(proof[mode]["max_abs_diff_vs_ddp"], diff)
            if not diff <= bound:
                failures.append(f"{mode}: after step {step} a parameter differs from DDP's by {diff:.3g} > "
                                f"{bound:.3g}, the most that summation order allows in one step")
            if r is not reference:  # DDP's state becomes every mode's, for the next step
                take_state(r, reference)
    return proof, failures, max(bounds)


@torch.no_grad()
def take_state(replica, reference):
    """The reference's parameters and AdamW state, copied into the replica's own tensors.
    (Not optimizer.load_state_dict: it keeps the very tensors it is given, and the two
    optimizers would then update one shared exp_avg twice a step.)"""
    for p, q in zip(replica.model.parameters(), reference.model.parameters()):
        p.copy_(q)
        for key, value in reference.optimizer.state[q].items():
            replica.optimizer.state[p][key].copy_(value)


def largest_gradient_element(model):
    """A 0-d tensor that holds the largest |gradient element| this rank computed in the
    current step, before any averaging (a hook on every parameter sees its local
    gradient before DDP's reducer does): the G of the rounding bound."""
    largest = torch.zeros((), dtype=torch.float64, device=next(model.parameters()).device)

    def record(grad):
        torch.maximum(largest, grad.detach().abs().max().to(largest.dtype), out=largest)
    for p in model.parameters():
        p.register_hook(record)
    return largest


def time_modes(args, config, batches, group) -> dict:
    """--steps steps of every mode, interleaved, in the chapters' training dtype: bf16
    autocast on GPUs (fp32 weights, gradients and optimizer), fp32 on CPUs. Figures from
    the median step of the slowest rank (the steps end together anyway)."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if group.device.type == "cuda" else None
    replicas = run_modes(args, config, batches[:args.steps], group,
                         f"timing: {args.steps} {timing_dtype(group)} steps of each mode", autocast=autocast)
    results = {}
    for mode, r in replicas.items():
        times = torch.tensor([r.times[k] for k in ("step", "compute", "sync")],
                             dtype=torch.float64, device=group.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        losses = torch.stack(r.losses).to(group.device)
        dist.all_reduce(losses)  # the global batch's loss: the sum of the ranks' means / world
        skip = min(args.timing_warmup, args.steps - 1)  # keep at least one measured step
        step, compute, sync = (statistics.median(t[skip:].tolist()) for t in times)
        results[mode] = {
            "step_times_s": times[0].tolist(), "tokens_per_s": args.tokens_per_step / step,
            "step_time_s_median": step, "forward_backward_s_median": compute,
            "sync_time_s_median": sync if r.sync is not None else None,
            "allreduce_calls_per_step": getattr(r.sync, "calls_per_step", None),
            "buckets_mib": [round(b.buffer.numel() * b.buffer.element_size() / 2**20, 2)
                            for b in r.sync.buckets] if hasattr(r.sync, "buckets") else None,
            "losses": (losses / group.world).tolist()}
    for r in results.values():
        r["tokens_per_s_vs_ddp"] = r["tokens_per_s"] / results["ddp"]["tokens_per_s"] if "ddp" in results else None
    return results


def timing_dtype(group) -> str:
    return "bf16 autocast" if group.device.type == "cuda" else "fp32"


COLUMNS = ("mode", "tokens/s", "vs DDP", "step (ms)", "fwd+bwd (ms)", "exposed all-reduce (ms)",
           "all_reduce calls/step", "proof: max abs diff vs DDP")


def results_table(results, proof) -> str:
    """The modes side by side, as a Markdown table."""
    header = COLUMNS
    ms = lambda t: "(in backward)" if t is None else f"{t * 1e3:,.1f}"  # noqa: E731
    rows = [(mode, f"{r['tokens_per_s']:,.0f}",
             f"{100 * r['tokens_per_s_vs_ddp']:.1f}%" if r["tokens_per_s_vs_ddp"] else "n/a",
             ms(r["step_time_s_median"]), ms(r["forward_backward_s_median"]),
             ms(r["sync_time_s_median"]), str(r["allreduce_calls_per_step"] or "(DDP's)"),
             "n/a" if proof[mode]["max_abs_diff_vs_ddp"] is None
             else f"{proof[mode]['max_abs_diff_vs_ddp']:.2e}") for mode, r in results.items()]
    return markdown_table(header, rows, right=range(1, len(header)))


def main():
    args = parse_args()
    group = start_group(args.timeout)
    rank, world = group.rank, group.world
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=rank)
    data, batches = fixed_batches(args.dataset_name, args.seq_length, args.batch_size,
                                  max(args.steps, args.proof_steps), args.seed, rank, world, group.device)
    config = get_config(args.model_preset, data.vocab_size)
    args.tokens_per_step = world * args.batch_size * args.seq_length
    n_params = num_parameters(LlamaForCausalLM(config))
    if rank == 0:
        print(f"{world} ranks, {group.backend}, {device_name(group.device)}; {args.model_preset} "
              f"preset, {n_params / 1e6:.2f} M parameters; proof {args.proof_steps} float64 "
              f"steps, timing {args.steps} {timing_dtype(group)} steps of {args.tokens_per_step:,} tokens",
              flush=True)

    # ---- 1. prove: the same parameters as DDP, on every rank ------------------------
    try:
        with exact_kernels():  # deterministic kernels, no TF32: the modes may differ only in the sums
            proof, failures, bound = prove(args, config, batches, group)  # bound 0 on 2 ranks: a + b == b + a
    except NotFinite as stop:  # a NaN or an infinity: nothing after it means anything
        if rank == 0:
            print(f"FAILED: {stop}", file=sys.stderr, flush=True)
        dist.barrier()  # nobody leaves before rank 0 has said it
        gc_and_destroy_process_group()
        return 1

    # ---- 2. time: the training dtype, steps interleaved -----------------------------
    results = time_modes(args, config, batches, group)

    # ---- 3. report -----------------------------------------------------------------
    if rank == 0:
        skipped = min(args.timing_warmup, args.steps - 1)
        tables = (f"{results_table(results, proof)}\n\nmedians of "
                  + (f"the steps after the first {skipped}" if skipped else "all the steps"))
        print(f"\n{tables}", flush=True)
        (run_dir / "tables.md").write_text(tables + "\n")  # what the tour's report shows
        write_json(run_dir / "ddp_from_scratch.json", {
            **vars(args), "world_size": world, "backend": group.backend,
            "device_name": device_name(group.device), "num_params": n_params,
            "proof_dtype": "float64", "timing_dtype": timing_dtype(group),
            "proof_bound": bound, "passed": not failures, "failures": failures,
            "modes": {m: {**r, **proof[m]} for m, r in results.items()},
            "environment": environment_info()})
        if failures:
            print("FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
        elif "ddp" in results:
            worst = max(p["max_abs_diff_vs_ddp"] for p in proof.values())
            print(f"OK: every mode's parameters equal DDP's after each of {args.proof_steps} float64 steps "
                  "taken from DDP's state, " + ("bit for bit" if worst == 0.0 else
                                                f"to rounding (largest difference {worst:.2g} <= bound {bound:.2g})"))
        print(f"outputs in {run_dir}", flush=True)
    dist.barrier()  # nobody leaves while rank 0 still writes
    gc_and_destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
