"""Chapter 05, part 3: data parallelism rebuilt from two collectives, and proven equal to DDP.

DDP is, at heart, two collectives:
  1. broadcast  rank 0's initial parameters, so every replica starts the same;
  2. all_reduce the gradients after (or during) backward, scaled by 1/world size so
     the sum is the mean, so every replica takes the same optimizer step.

This script writes that three ways and runs them beside torch's DDP, from the same
initial weights on the same batches:

  naive     one all_reduce per parameter tensor, after backward
  bucketed  gradients copied into a few large flat buffers (--bucket-mb), one
            all_reduce per buffer, after backward
  overlap   bucketed, but each buffer's all_reduce starts (asynchronously) as soon as
            backward has produced its last gradient, while backward goes on: what DDP does
  ddp       torch.nn.parallel.DistributedDataParallel with the same bucket size

After --steps steps every mode's parameters must equal DDP's (bit for bit with 2 ranks;
max relative difference at most 1e-6 in fp32 with any number, else exit status 1), and
rank 0 prints tokens/s side by side.

    torchrun --standalone --nproc-per-node=2 05-collectives/ddp_from_scratch.py
    torchrun --standalone --nproc-per-node=2 05-collectives/ddp_from_scratch.py --modes naive,bucketed,overlap,ddp
"""

import argparse
import inspect
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

# Runnable from the repo root or from inside this folder, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.cli import DEFAULT_SAVE_DIR, Parser, UsageError, check_run_folder, fail  # noqa: E402
from common.data import (IGNORE_INDEX, DataError, build_datasets, check_dataset_name,  # noqa: E402
                         check_enough_samples)
from common.metrics import device_name, environment_info, markdown_table, write_json  # noqa: E402
from common.model import PRESETS, LlamaForCausalLM, get_config, num_parameters  # noqa: E402

MODES = ("naive", "bucketed", "overlap", "ddp")
# DDP's switch for "do not re-broadcast buffers before each forward": renamed in recent
# torch (forward_sync_buffers), the old name broadcast_buffers warns there.
NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                  if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                  else {"broadcast_buffers": False})
TOLERANCE = 1e-6  # max relative difference to DDP after training (fp32, per-tensor norm)


def parse_args(argv=None):
    p = Parser(formatter_class=argparse.ArgumentDefaultsHelpFormatter,
               description="Data parallelism rebuilt from broadcast + all_reduce (naive, "
                           "bucketed, overlapped), checked against DDP. Launch with torchrun.")
    p.add_argument("--model-preset", default="small", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per sample")
    p.add_argument("--batch-size", type=int, default=8, help="samples per step, per process")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per mode")
    p.add_argument("--timing-warmup", type=int, default=2,
                   help="first steps of each mode left out of the timing")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--seed", type=int, default=0, help="initial weights (plus rank) and data order")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradient bucket size in MiB (DDP's default is 25)")
    p.add_argument("--modes", default="naive,bucketed,ddp", help=f"comma list of: {', '.join(MODES)}")
    p.add_argument("--dataset-name", default="stdlib",
                   help="'stdlib' (embedded, offline), a Hugging Face hub id, or a local path")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds a collective may wait for the other ranks before failing")
    p.add_argument("--save-dir", default=str(DEFAULT_SAVE_DIR), help="parent of the run folder")
    p.add_argument("--experiment-name", default=None,
                   help="run folder name (default: 05-ddp-from-scratch-<timestamp>)")
    args = p.parse_args(argv)

    # Everything checked before init_process_group: one line, exit 2, nothing on disk.
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown or not args.modes:
        fail(f"unknown --modes {','.join(unknown) or '(empty)'}; choose from {', '.join(MODES)}")
    if len(set(args.modes)) != len(args.modes):
        fail(f"--modes lists a mode twice: {','.join(args.modes)}")
    if args.model_preset not in PRESETS:
        fail(f"unknown --model-preset {args.model_preset!r}; choose one of {', '.join(PRESETS)}")
    for name in ("seq_length", "batch_size"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    max_pos = PRESETS[args.model_preset]["max_position_embeddings"]
    if args.seq_length > max_pos:
        fail(f"--seq-length {args.seq_length} exceeds the {args.model_preset!r} preset's "
             f"max_position_embeddings={max_pos}")
    if args.steps < 2:
        fail(f"--steps must be at least 2: one to warm up, one to time (got {args.steps})")
    if args.timing_warmup < 0:
        fail(f"--timing-warmup must not be negative (got {args.timing_warmup})")
    if not args.lr > 0:
        fail(f"--lr must be positive (got {args.lr})")
    if not args.bucket_mb > 0:
        fail(f"--bucket-mb must be positive (got {args.bucket_mb})")
    if not args.timeout > 0:
        fail(f"--timeout must be positive (got {args.timeout})")
    try:
        check_dataset_name(args.dataset_name)
    except DataError as e:
        fail(str(e))
    try:
        check_run_folder(args, "05-ddp-from-scratch")
    except UsageError as e:
        fail(str(e))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        fail("launch with torchrun, e.g. torchrun --standalone --nproc-per-node=2 "
             "05-collectives/ddp_from_scratch.py")
    return args


# ------------------------------------------------------- step 1: broadcast initial state

def broadcast_initial_state(model):
    """Copy rank 0's parameters and buffers into every rank's replica, in place.
    state_dict() tensors share storage with the module, so broadcasting into them
    overwrites the model's own weights. (DDP does the same in its constructor, in
    large coalesced chunks rather than one call per tensor.)"""
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)


@torch.no_grad()
def max_difference_to_rank0(model) -> float:
    """Largest |parameter - rank 0's parameter| over all ranks: 0.0 means identical replicas."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    diff = (flat - ref).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


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
    """Bucketed, and overlapped with backward, as DDP does: a hook on every parameter
    fires once backward has accumulated its gradient; when a bucket's last gradient
    has arrived, its all_reduce starts asynchronously (async_op=True returns at once)
    and backward carries on computing earlier layers' gradients meanwhile. After
    backward we only wait for what is still in flight.

    Buckets are launched strictly in index order, the same on every rank: collectives
    must be called in the same order everywhere, whatever order hooks fire in."""

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

    def __init__(self, mode, args, config, device, rank, world):
        self.mode, self.device, self.world = mode, device, world
        # A different seed on every rank, on purpose: nothing but the broadcast (or
        # DDP's constructor) makes the replicas equal. Rank 0's seed is the same in
        # every mode, so every mode starts from the same weights.
        torch.manual_seed(args.seed + rank)
        self.model = LlamaForCausalLM(config).to(device)
        self.differ_before = max_difference_to_rank0(self.model)
        if mode == "ddp":
            # The constructor broadcasts rank 0's state, then installs the bucketed,
            # overlapped all-reduce hooks. Our only buffers are the constant RoPE
            # tables: no need to re-broadcast them before every forward (as in chapter 03).
            self.forward_model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None,
                                     bucket_cap_mb=args.bucket_mb, **NO_BUFFER_SYNC)
            self.sync = None
        else:
            broadcast_initial_state(self.model)
            self.forward_model = self.model
            self.sync = {"naive": lambda: NaiveAllReduce(self.model, world),
                         "bucketed": lambda: BucketedAllReduce(self.model, world, args.bucket_mb, device),
                         "overlap": lambda: OverlappedAllReduce(self.model, world, args.bucket_mb, device),
                         }[mode]()
        differ_after = max_difference_to_rank0(self.model)
        if differ_after != 0.0:
            raise RuntimeError(f"{mode}: replicas differ by {differ_after:g} after the initial broadcast")
        # The chapters' optimizer: AdamW, no weight decay on the 1-D norm weights.
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=args.lr, betas=(0.9, 0.95))
        self.times = {"step": [], "compute": [], "sync": []}
        self.losses = []

    def clock(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: wait before reading the clock
        return time.perf_counter()

    def step(self, x, y):
        t0 = self.clock()
        logits = self.forward_model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)
        loss.backward()  # ddp and overlap: the all-reduces start in here, from hooks
        t1 = self.clock()
        if self.sync is not None:
            self.sync.after_backward()  # all gradients averaged when this returns
        t2 = self.clock()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t3 = self.clock()
        self.times["compute"].append(t1 - t0)
        self.times["sync"].append(t2 - t1)
        self.times["step"].append(t3 - t0)
        self.losses.append(loss.detach())

    def result(self):
        # The slowest rank's time per step (the steps end together anyway).
        times = torch.tensor([self.times[k] for k in ("step", "compute", "sync")],
                             dtype=torch.float64, device=self.device)
        fastest = times[1].clone()
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        # How far apart the ranks finish backward: an all_reduce cannot end before the
        # slowest rank joins, so the faster ones spend this skew waiting inside it.
        dist.all_reduce(fastest, op=dist.ReduceOp.MIN)
        # The global batch's loss: the mean of the ranks' means (equal token counts).
        losses = torch.stack(self.losses).float()
        dist.all_reduce(losses)
        losses /= self.world
        sync = self.sync
        return {
            "step_times_s": times[0].tolist(),
            "forward_backward_times_s": times[1].tolist(),
            "forward_backward_skew_s": (times[1] - fastest).tolist(),
            "sync_times_s": times[2].tolist() if sync is not None else None,
            "allreduce_calls_per_step": sync.calls_per_step if sync is not None else None,
            "buckets_mib": [round(b.buffer.numel() * b.buffer.element_size() / 2**20, 2)
                            for b in sync.buckets] if hasattr(sync, "buckets") else None,
            "losses": losses.tolist(),
            "replicas_differ_before_broadcast": self.differ_before,
            "replicas_differ_after_training": max_difference_to_rank0(self.model),
        }


def max_relative_difference(params, reference) -> float:
    """max over parameter tensors of ||a - b|| / ||b||: 0.0 when equal.

    With 2 ranks every mode adds the same two numbers per gradient element (a + b ==
    b + a), so the modes agree bit for bit. With 3 or more, gloo and nccl add the ranks'
    contributions in an order that depends on where an element sits in its message,
    which differs between one-message-per-tensor, our buckets and DDP's; fp32 addition
    is not associative, so results then differ by rounding (about 1e-7 of a tensor's
    norm). Adam amplifies it in the rare elements whose gradients nearly cancel across
    ranks, so a per-element maximum would flag rounding; the norm does not, while real
    bugs show up far above it (a missing 1/world: 3e-4 after 3 tiny steps; a bucket
    not reduced: 2e-2)."""
    worst = 0.0
    for a, b in zip(params, reference):
        worst = max(worst, ((a - b).norm() / (b.norm() + 1e-30)).item())
    return worst


def max_abs_difference(params, reference) -> float:
    """The largest |a - b| over all elements (reported, not checked)."""
    return max((a - b).abs().max().item() for a, b in zip(params, reference))


# ------------------------------------------------------------------------------ main

def main():
    args = parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        # fp32 without TF32, deterministic kernels: on GPUs too, the modes must agree
        # to rounding, which nondeterministic atomics in some backward kernels would spoil.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.cuda.set_device(local_rank)  # else every process would use GPU 0
        backend, device = "nccl", torch.device("cuda", local_rank)
    else:
        backend, device = "gloo", torch.device("cpu")
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    status = 1
    try:
        status = run(args, backend, device)
    finally:
        dist.destroy_process_group()
    return status


def run(args, backend, device):
    rank, world = dist.get_rank(), dist.get_world_size()

    # ---- data: rank 0 tokenizes once (cached), the others then read its cache -------
    def load():
        data = build_datasets(args.dataset_name, args.seq_length, packed=True)
        check_enough_samples(data.train, args.batch_size * world)
        return data
    error, data = None, None
    if rank == 0:
        try:
            data = load()
        except DataError as e:
            error = str(e)
    box = [error]
    dist.broadcast_object_list(box, src=0)  # a barrier that also says whether rank 0 failed
    if box[0]:
        fail(box[0])
    if rank != 0:
        data = load()

    # Each rank's shard of one shared shuffle (DistributedSampler, as in chapter 03).
    # The batches are loaded once, before any timing, and reused by every mode: all
    # modes see the same data, and the timing holds compute and communication only.
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    batches, epoch = [], 0
    while len(batches) < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            batches.append((x.to(device), y.to(device)))
            if len(batches) == args.steps:
                break
        epoch += 1

    config = get_config(args.model_preset, data.vocab_size)
    n_params = num_parameters(LlamaForCausalLM(config))
    tokens_per_step = world * args.batch_size * args.seq_length
    machine = device_name(device)
    if rank == 0:
        print(f"{world} ranks, backend {backend}, {machine}; {args.model_preset} preset, "
              f"{n_params / 1e6:.2f} M parameters ({4 * n_params / 2**20:.1f} MiB of fp32 "
              f"gradients per step); {args.steps} steps of {tokens_per_step:,} tokens per mode",
              flush=True)

    # ---- the modes: same start, same batches, steps interleaved ---------------------
    # One step of each mode in turn, rather than one mode after the other: a change in
    # the machine's load (other programs, turbo, caches) then hits every mode alike.
    replicas = {mode: Replica(mode, args, config, device, rank, world) for mode in args.modes}
    for x, y in batches:
        for replica in replicas.values():
            replica.step(x, y)
    results = {mode: r.result() for mode, r in replicas.items()}
    finals = {mode: [p.detach() for p in r.model.parameters()] for mode, r in replicas.items()}
    if rank == 0:
        for mode, r in results.items():
            print(f"  {mode:<8}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} "
                  f"over {args.steps} steps", flush=True)

    # ---- proof: the same parameters as DDP, on every rank ---------------------------
    reference = "ddp" if "ddp" in args.modes else None
    failures = []
    for mode, r in results.items():
        if r["replicas_differ_after_training"] != 0.0:
            failures.append(f"{mode}: replicas differ by {r['replicas_differ_after_training']:g}")
        if reference and mode != reference:
            d = torch.tensor([max_relative_difference(finals[mode], finals[reference]),
                              max_abs_difference(finals[mode], finals[reference])],
                             dtype=torch.float64, device=device)
            dist.all_reduce(d, op=dist.ReduceOp.MAX)  # the worst rank
            r["max_rel_diff_vs_ddp"], r["max_abs_diff_vs_ddp"] = d.tolist()
            if r["max_rel_diff_vs_ddp"] > TOLERANCE:
                failures.append(f"{mode}: max relative difference to DDP "
                                f"{r['max_rel_diff_vs_ddp']:.3g} > {TOLERANCE:g}")
        else:
            r["max_rel_diff_vs_ddp"] = r["max_abs_diff_vs_ddp"] = 0.0 if mode == reference else None

    # ---- throughput: warm-up steps left out ------------------------------------------
    skip = min(args.timing_warmup, args.steps - 1)  # keep at least one measured step
    for r in results.values():
        measured = r["step_times_s"][skip:]
        r["measured_steps"] = len(measured)
        r["tokens_per_s"] = tokens_per_step * len(measured) / sum(measured)
        r["step_time_s_mean"] = statistics.mean(measured)
        r["step_time_s_median"] = statistics.median(measured)
        r["forward_backward_s_mean"] = statistics.mean(r["forward_backward_times_s"][skip:])
        r["skew_s_mean"] = statistics.mean(r["forward_backward_skew_s"][skip:])
        r["sync_time_s_mean"] = (statistics.mean(r["sync_times_s"][skip:])
                                 if r["sync_times_s"] is not None else None)
    ddp_tps = results["ddp"]["tokens_per_s"] if "ddp" in results else None
    for r in results.values():
        r["tokens_per_s_vs_ddp"] = r["tokens_per_s"] / ddp_tps if ddp_tps else None

    if rank == 0:
        print()
        print(results_table(results))
        print(f"\ntimed steps {skip + 1}..{args.steps} of each mode (the first {skip} "
              f"are warm-up); tolerance {TOLERANCE:g}", flush=True)

        run_dir = Path(args.save_dir) / args.experiment_name
        run_dir.mkdir(parents=True, exist_ok=True)  # created only now, by rank 0 only
        write_json(run_dir / "ddp_from_scratch.json", {
            "experiment_name": args.experiment_name,
            "world_size": world,
            "backend": backend,
            "device": device.type,
            "device_name": machine,
            "preset": args.model_preset,
            "num_params": n_params,
            "seq_length": args.seq_length,
            "batch_size": args.batch_size,
            "tokens_per_step": tokens_per_step,
            "steps": args.steps,
            "timing_warmup_steps": skip,
            "bucket_mb": args.bucket_mb,
            "tolerance": TOLERANCE,
            "passed": not failures,
            "failures": failures,
            "modes": results,
            "bucketed_vs_ddp": (results["bucketed"]["tokens_per_s_vs_ddp"]
                                if "bucketed" in results and ddp_tps else None),
            "args": vars(args),
            "environment": environment_info(),
            "torch_version": torch.__version__,
        })
        print(f"outputs in {run_dir}", flush=True)
        if failures:
            hint = ("" if world == 2 else
                    f" (with {world} ranks the modes add in different orders, and fp32 rounding "
                    f"grows with --steps: a difference near 1e-6 after many steps can be "
                    f"rounding rather than a bug; see the chapter README)")
            print("FAILED: " + "; ".join(failures) + hint, file=sys.stderr, flush=True)
        elif reference:
            worst = max(r["max_rel_diff_vs_ddp"] for r in results.values())
            how = "bit for bit" if worst == 0.0 else \
                f"to fp32 rounding (max relative difference {worst:.2g} <= {TOLERANCE:g})"
            print(f"OK: every mode's parameters equal DDP's after {args.steps} steps, {how}",
                  flush=True)
    dist.barrier()  # nobody leaves while rank 0 still writes
    return 1 if failures else 0


def results_table(results) -> str:
    """The modes side by side, as a Markdown table."""
    header = ("mode", "tokens/s", "vs DDP", "step (ms)", "fwd+bwd (ms)", "rank skew (ms)",
              "exposed all-reduce (ms)", "all_reduce calls/step", "max rel diff vs DDP")
    rows = []
    for mode, r in results.items():
        rows.append((
            mode,
            f"{r['tokens_per_s']:,.0f}",
            f"{100 * r['tokens_per_s_vs_ddp']:.1f}%" if r["tokens_per_s_vs_ddp"] else "n/a",
            f"{r['step_time_s_mean'] * 1e3:,.1f}",
            f"{r['forward_backward_s_mean'] * 1e3:,.1f}",
            f"{r['skew_s_mean'] * 1e3:,.1f}",
            f"{r['sync_time_s_mean'] * 1e3:,.1f}" if r["sync_time_s_mean"] is not None
            else "(in backward)",
            str(r["allreduce_calls_per_step"] or "(DDP's)"),
            f"{r['max_rel_diff_vs_ddp']:.2e}" if r["max_rel_diff_vs_ddp"] is not None else "n/a"))
    return markdown_table(header, rows, right=range(1, len(header)))


if __name__ == "__main__":
    sys.exit(main())
