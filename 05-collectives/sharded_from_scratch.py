"""Chapter 05, part 4: sharding the training state, rebuilt from reduce_scatter and
all_gather, and proven equal to DDP.

DDP keeps a whole copy of everything on every rank: parameters, gradients and AdamW's
two moments. Sharding keeps 1/N of some of them per rank and fetches the rest when needed:

  ddp    torch's DistributedDataParallel: the reference
  zero1  ZeRO-1, optimizer state sharded: gradients reduce-scattered (each rank gets the
         average of its 1/N slice), each rank updates only its slice with its slice of
         AdamW's state, then the parameters are all-gathered
  zero3  ZeRO-3, everything sharded: each layer's parameters are all-gathered just before
         its forward and again before its backward, freed after each, and its gradients
         reduce-scattered as soon as backward has produced them
  fsdp2  torch's fully_shard (FSDP2) on every decoder layer, then on the whole model

All modes start from the same weights and train on the same batches, one step each in
turn; their losses and final weights must equal DDP's (within a bound set by rounding:
see TOLERANCE), else exit status 1. Rank 0 prints per-rank bytes of parameters,
gradients and optimizer state, the bytes each collective sent, and tokens/s.

    torchrun --standalone --nproc-per-node=2 05-collectives/sharded_from_scratch.py
    torchrun --standalone --nproc-per-node=4 05-collectives/sharded_from_scratch.py --dtype fp64
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

# Runnable from the repo root or from inside this folder, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.cli import (UsageError, comma_list, non_negative_int, one_of, positive_float,  # noqa: E402
                        positive_int, script_parser, seed_value)
from common.data import IGNORE_INDEX, DataError, build_datasets, check_dataset_name, check_enough_samples, prepare  # noqa: E402
from common.distributed import DDP_NO_BUFFER_SYNC, destroy_process_group, start_demo  # noqa: E402
from common.metrics import device_name, environment_info, write_json  # noqa: E402
from common.model import PRESETS, LlamaForCausalLM, get_config, num_parameters  # noqa: E402
from common import sharding  # noqa: E402

MODES = ("ddp", "zero1", "zero3", "fsdp2")
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}
# Max relative difference to DDP (per tensor, ||a - b|| / ||b||, and per step loss). Only
# the order in which the ranks' gradients are summed differs between the modes (and not
# at all with 2 ranks): see the chapter README for how these bounds were derived.
TOLERANCE = {"fp64": 1e-9, "fp32": 1e-4}


def parse_args(argv=None):
    p = script_parser("05-sharded-from-scratch", "Optimizer-state and full sharding (ZeRO-1, "
                      "ZeRO-3) from reduce_scatter + all_gather, beside DDP and FSDP2.", min_world=2)
    p.add_argument("--model-preset", default="small", type=one_of(*PRESETS), help="model size")
    p.add_argument("--seq-length", type=positive_int, default=128, help="tokens per sample")
    p.add_argument("--batch-size", type=positive_int, default=8, help="samples per step, per process")
    p.add_argument("--steps", type=positive_int, default=8, help="optimizer steps per mode")
    p.add_argument("--timing-warmup", type=non_negative_int, default=2,
                   help="first steps of each mode left out of the timing")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--seed", type=seed_value, default=0, help="initial weights and data order")
    p.add_argument("--modes", type=comma_list(*MODES), default=",".join(MODES),
                   help=f"comma list of: {', '.join(MODES)}")
    p.add_argument("--dtype", type=one_of(*DTYPES), default="fp32",
                   help="fp64: rounding differences shrink by 2**29, for the tightest proof")
    p.add_argument("--dataset-name", default="stdlib",
                   help="'stdlib' (embedded, offline), a Hugging Face hub id, or a local path")

    def check(args):
        max_pos = PRESETS[args.model_preset]["max_position_embeddings"]
        if args.seq_length > max_pos:
            raise UsageError(f"--seq-length {args.seq_length} exceeds the {args.model_preset!r} "
                             f"preset's max_position_embeddings={max_pos}")
        if args.steps <= args.timing_warmup:
            raise UsageError(f"--steps {args.steps} leaves no step to time after "
                             f"--timing-warmup {args.timing_warmup}")
        try:
            check_dataset_name(args.dataset_name)
        except DataError as e:
            raise UsageError(str(e)) from None
    p.checks.insert(0, check)  # before "launch with torchrun": the flags come first
    return p.parse_args(argv)


def adamw(decay, no_decay, lr):
    """The chapters' optimizer: weight decay 0.1 on matrices, none on 1-D norm weights."""
    groups = [{"params": [t for t in ts if t.numel()], "weight_decay": wd}
              for ts, wd in ((decay, 0.1), (no_decay, 0.0))]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))


# ------------------------------------------ the flat shard: 1/N of a list of parameters

class FlatShard:
    """Parameters laid end to end in one flat buffer, padded to a multiple of the world
    size N, so that rank r owns exactly elements [r*S, (r+1)*S) with S = ceil(numel/N).

    Weight decay must apply per element exactly as in DDP. Matrices go first and 1-D
    weights last, so a rank's slice splits into at most two pieces, one decayed and one
    not; each piece becomes a tensor in the matching AdamW group. (The padding sits at
    the very end, in the undecayed piece: its gradient is 0, so it stays 0.)"""

    def __init__(self, params, rank, world, keep_full):
        self.params = sorted(params, key=lambda p: p.dim() < 2)  # stable: order kept
        self.world = world
        numel = sum(p.numel() for p in self.params)
        decay_numel = sum(p.numel() for p in self.params if p.dim() >= 2)
        size = -(-numel // world)  # S
        self.full = torch.zeros(size * world, dtype=params[0].dtype, device=params[0].device)
        for p, view in zip(self.params, self.views(self.full)):
            view.copy_(p.detach())
            p.data = view  # the model's parameter now lives inside the flat buffer
        lo = rank * size
        self.shard = self.full[lo:lo + size]  # zero1: a view; zero3: the only copy left
        if not keep_full:
            self.shard = self.shard.clone()
        self.grad_shard = torch.zeros_like(self.shard)
        cut = min(max(decay_numel - lo, 0), size)
        self.decay, self.no_decay = [self.shard[:cut]], [self.shard[cut:]]
        self.decay[0].grad, self.no_decay[0].grad = self.grad_shard[:cut], self.grad_shard[cut:]

    def views(self, flat):
        """One view of `flat` per parameter, shaped like it."""
        out, offset = [], 0
        for p in self.params:
            out.append(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return out


# ------------------------------------------------------------------------ the modes

class Trainer:
    """One mode: model, optimizer, per-step timing, and what was measured."""

    def __init__(self, mode, args, config, demo):
        self.mode, self.args, self.demo = mode, args, demo
        self.comm = sharding.Comm(demo.world)
        # The same seed on every rank: every rank builds the same initial weights (the
        # sharded modes then keep only their part), and every mode starts from them.
        torch.manual_seed(args.seed)
        self.model = LlamaForCausalLM(config).to(demo.device, DTYPES[args.dtype])
        self.param_bytes = sharding.local_bytes(self.model.parameters())
        self.setup()
        self.times, self.losses = [], []

    def setup(self):  # ddp
        self.forward_model = DDP(self.model, device_ids=[self.demo.device.index] if self.demo.device.type == "cuda"
                                 else None, gradient_as_bucket_view=True, **DDP_NO_BUFFER_SYNC)
        self.forward_model.register_comm_hook(None, self.comm.ddp_hook())
        params = list(self.model.parameters())
        self.optimizer = adamw([p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2],
                               self.args.lr)

    def before_forward(self):
        self.optimizer.zero_grad(set_to_none=False)  # DDP: the gradients are its buckets

    def after_backward(self):
        pass  # DDP all-reduced its buckets during backward

    def after_update(self):
        pass

    def step(self, x, y):
        t0 = self.clock()
        self.before_forward()
        logits = self.forward_model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)
        loss.backward()
        self.after_backward()
        self.optimizer.step()
        self.after_update()
        self.times.append(self.clock() - t0)
        self.losses.append(loss.detach())

    def clock(self):
        if self.demo.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def state_tensors(self):
        """(parameters, gradients) this rank holds between steps."""
        return list(self.model.parameters()), [p.grad for p in self.model.parameters()]

    def full_parameters(self):
        return [p.detach().clone() for p in self.model.parameters()]


class ZeRO1(Trainer):
    def setup(self):
        self.forward_model = self.model
        self.flat = FlatShard(list(self.model.parameters()), self.demo.rank, self.demo.world, keep_full=True)
        self.flat.grad_full = torch.zeros_like(self.flat.full)
        for p, g in zip(self.flat.params, self.flat.views(self.flat.grad_full)):
            p.grad = g  # backward accumulates into the flat gradient buffer (like DDP's buckets)
        # AdamW sees only this rank's slice: its two moments are 1/N of DDP's.
        self.optimizer = adamw(self.flat.decay, self.flat.no_decay, self.args.lr)

    def before_forward(self):
        self.flat.grad_full.zero_()

    def after_backward(self):
        # Divide, then sum (DDP's order): rank r receives the average of slice r only.
        self.comm.reduce_scatter(self.flat.grad_shard, self.flat.grad_full.div_(self.demo.world))

    def after_update(self):
        # Every rank updated its slice; all_gather puts every slice in everyone's buffer.
        self.comm.all_gather(self.flat.full, self.flat.shard)

    def state_tensors(self):
        return [self.flat.full], [self.flat.grad_full, self.flat.grad_shard]


class ShardedUnit(FlatShard):
    """ZeRO-3 for one module: its parameters are views of a flat buffer whose memory
    exists only while the module computes. The storage is freed (resized to 0 bytes) and
    re-filled in place by all_gather, so the parameter tensors, and the references
    autograd saved to them, stay valid throughout."""

    def __init__(self, module, comm, rank, world):
        super().__init__(list(module.parameters()), rank, world, keep_full=False)
        self.comm, self.pending, self.grad_full = comm, len(self.params), None
        self.free()
        module.register_forward_pre_hook(self.gather_for_forward)
        module.register_forward_hook(self.free_after_forward)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def gather(self):
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.comm.all_gather(self.full, self.shard)

    def free(self):
        self.full.untyped_storage().resize_(0)

    def gather_for_forward(self, module, args):
        self.gather()

    def free_after_forward(self, module, args, output):
        self.free()  # "reshard after forward": backward gathers again, just before
        # backward enters this module, i.e. when the gradient of its output is ready:
        if output.requires_grad:
            output.register_hook(self.gather_for_backward)

    def gather_for_backward(self, grad_output):
        self.gather()
        self.grad_full = torch.zeros_like(self.full)  # this module's full gradients, briefly
        for p, g in zip(self.params, self.views(self.grad_full)):
            p.grad = g

    def grad_ready(self, param):
        self.pending -= 1
        if self.pending:
            return
        self.pending = len(self.params)
        # All of this module's gradients are in: average and keep only our slice.
        self.comm.reduce_scatter(self.grad_shard, self.grad_full.div_(self.comm.world))
        for p in self.params:
            p.grad = None
        self.grad_full = None
        self.free()


class ZeRO3(Trainer):
    def setup(self):
        self.forward_model = self.model
        m = self.model
        modules = [m.embed_tokens, *m.layers, m.norm, m.lm_head]  # every parameter, once
        self.units = [ShardedUnit(mod, self.comm, self.demo.rank, self.demo.world) for mod in modules]
        self.optimizer = adamw([t for u in self.units for t in u.decay],
                               [t for u in self.units for t in u.no_decay], self.args.lr)

    def state_tensors(self):
        return [u.shard for u in self.units], [u.grad_shard for u in self.units]

    def full_parameters(self):
        for u in self.units:
            u.gather()
        params = super().full_parameters()
        for u in self.units:
            u.free()
        return params


class FSDP2(Trainer):
    def setup(self):
        # One unit per decoder layer, then the root (embedding, final norm, head). Every
        # parameter becomes a DTensor sharded on dim 0; fully_shard's hooks gather a unit
        # before its forward and backward, free it after, and reduce-scatter its gradients.
        for layer in self.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.comm.watch_fsdp2([*self.model.layers, self.model])
        self.forward_model = self.model
        params = list(self.model.parameters())
        self.optimizer = adamw([p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2],
                               self.args.lr)

    def before_forward(self):
        self.optimizer.zero_grad(set_to_none=True)

    def full_parameters(self):
        return [p.full_tensor().detach() for p in self.model.parameters()]


TRAINERS = {"ddp": Trainer, "zero1": ZeRO1, "zero3": ZeRO3, "fsdp2": FSDP2}


# ------------------------------------------------------------------------------ main

def main():
    args = parse_args()
    demo = start_demo(args.timeout, deterministic=True)
    try:
        return run(args, demo)
    finally:
        destroy_process_group()


def load_batches(args, demo):
    """Each rank's shard of one shared shuffle (DistributedSampler, as in chapter 03),
    loaded once before any timing and reused by every mode."""
    def load():
        data = build_datasets(args.dataset_name, args.seq_length, packed=True)
        check_enough_samples(data.train, args.batch_size * demo.world)
        return data
    data = prepare(load)
    sampler = DistributedSampler(data.train, num_replicas=demo.world, rank=demo.rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    batches, epoch = [], 0
    while len(batches) < args.steps:
        sampler.set_epoch(epoch)
        batches += [(x.to(demo.device), y.to(demo.device)) for x, y in loader][:args.steps - len(batches)]
        epoch += 1
    return data, batches


def run(args, demo):
    data, batches = load_batches(args, demo)
    config = get_config(args.model_preset, data.vocab_size)
    n_params = num_parameters(LlamaForCausalLM(config))
    tokens_per_step = demo.world * args.batch_size * args.seq_length
    load_before = os.getloadavg()
    if demo.rank == 0:
        print(f"{demo.world} ranks, {demo.backend}, {device_name(demo.device)}; {args.model_preset} preset, "
              f"{n_params / 1e6:.2f} M parameters, {args.dtype}; {args.steps} steps of "
              f"{tokens_per_step:,} tokens per mode, modes interleaved step by step", flush=True)

    trainers = {mode: TRAINERS[mode](mode, args, config, demo) for mode in args.modes}
    for x, y in batches:
        for t in trainers.values():
            t.step(x, y)
    results = {mode: measure(t, args, tokens_per_step) for mode, t in trainers.items()}
    failures = prove(trainers, results, args) if "ddp" in trainers else []
    # One more step per mode, untimed, under the memory tracker (it slows every op).
    for mode, t in trainers.items():
        results[mode]["bytes"]["peak_step"] = worst_rank(sharding.peak_step_bytes(
            lambda: t.step(*batches[0]), t.model, t.optimizer, *t.state_tensors()[0], *t.state_tensors()[1]))
    ddp_tps = results["ddp"]["tokens_per_s"] if "ddp" in results else None
    for r in results.values():
        r["tokens_per_s_vs_ddp"] = r["tokens_per_s"] / ddp_tps if ddp_tps else None
    if demo.rank == 0:
        report(args, demo, results, failures, n_params, tokens_per_step, (load_before, os.getloadavg()))
    dist.barrier()  # nobody leaves while rank 0 still writes
    return 1 if failures else 0


def worst_rank(value) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(t, args, tokens_per_step):
    """Timing (median of the steps after the warm-up, slowest rank), the mean loss over
    all ranks per step, the bytes this rank holds, and the collectives' bytes per step."""
    times = torch.tensor(t.times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    losses = torch.stack(t.losses).double()
    dist.all_reduce(losses)
    median = statistics.median(times[args.timing_warmup:].tolist())
    params, grads = t.state_tensors()
    steps = len(t.times)
    return {
        "losses": (losses / t.demo.world).tolist(),
        "step_times_s": times.tolist(),
        "step_time_s_median": median,
        "tokens_per_s": tokens_per_step / median,
        "bytes": {"params": worst_rank(sharding.local_bytes(params)),
                  "grads": worst_rank(sharding.local_bytes(grads)),
                  "optimizer": worst_rank(sharding.optimizer_state_bytes(t.optimizer))},
        "comm_calls_per_step": {k: v / steps for k, v in t.comm.calls.items()},
        "comm_sent_bytes_per_step": {k: v / steps for k, v in t.comm.sent_bytes().items()},
        "textbook_sent_bytes_per_step": sharding.textbook_sent_bytes(t.mode, t.param_bytes, t.demo.world),
    }


def relative_difference(params, reference) -> float:
    """max over tensors of ||a - b|| / ||b||: 0.0 when equal (as in ddp_from_scratch.py)."""
    return max(((a - b).norm() / (b.norm() + 1e-30)).item() for a, b in zip(params, reference))


def prove(trainers, results, args):
    """Every mode's final weights and per-step losses against DDP's, on every rank."""
    finals = {mode: t.full_parameters() for mode, t in trainers.items()}
    tolerance, failures = TOLERANCE[args.dtype], []
    for mode, r in results.items():
        flat = torch.cat([p.reshape(-1) for p in finals[mode]])
        rank0 = flat.clone()
        dist.broadcast(rank0, src=0)
        r["ranks_differ"] = worst_rank((flat - rank0).abs().max().item())
        r["max_rel_diff_vs_ddp"] = worst_rank(relative_difference(finals[mode], finals["ddp"]))
        r["max_abs_diff_vs_ddp"] = worst_rank(max((a - b).abs().max().item()
                                                  for a, b in zip(finals[mode], finals["ddp"])))
        r["max_loss_rel_diff_vs_ddp"] = max(abs(a - b) / abs(b) for a, b in
                                            zip(r["losses"], results["ddp"]["losses"]))
        if r["ranks_differ"] != 0.0:
            failures.append(f"{mode}: ranks hold different weights (by {r['ranks_differ']:.3g})")
        worst = max(r["max_rel_diff_vs_ddp"], r["max_loss_rel_diff_vs_ddp"])
        if worst > tolerance:
            failures.append(f"{mode}: relative difference to DDP {worst:.3g} > {tolerance:g} "
                            f"({args.dtype})")
    return failures


def report(args, demo, results, failures, n_params, tokens_per_step, load):
    machine = device_name(demo.device)
    print(f"\nper-rank bytes ({demo.world} ranks; params and grads between steps):\n")
    print(sharding.memory_table(results))
    print(f"\nthroughput, collectives (bytes each rank sends per step: counted from the calls "
          f"made, as a ring algorithm sends them; textbook: 2(N-1)/N or 3(N-1)/N x parameter "
          f"bytes) and proof:\n")
    print(sharding.comm_table(results))
    print(f"\nmedian of steps {args.timing_warmup + 1}..{args.steps}, slowest rank; load average "
          f"{load[0][0]:.2f} before, {load[1][0]:.2f} after", flush=True)
    run_dir = Path(args.save_dir) / args.experiment_name
    run_dir.mkdir(parents=True, exist_ok=True)  # created only now, by rank 0 only
    write_json(run_dir / "sharded_from_scratch.json", {
        "experiment_name": args.experiment_name, "world_size": demo.world, "backend": demo.backend,
        "device": demo.device.type, "device_name": machine, "preset": args.model_preset,
        "dtype": args.dtype, "num_params": n_params, "seq_length": args.seq_length,
        "batch_size": args.batch_size, "tokens_per_step": tokens_per_step, "steps": args.steps,
        "timing_warmup_steps": args.timing_warmup, "tolerance": TOLERANCE[args.dtype],
        "load_average_before_after": [load[0][0], load[1][0]],
        "passed": not failures, "failures": failures, "modes": results,
        "args": vars(args), "environment": environment_info(), "torch_version": torch.__version__,
    })
    sharding.plot(results, run_dir / "sharded_from_scratch.png",
                  f"{demo.world} ranks, {demo.backend}, {machine}, {args.model_preset}, {args.dtype}")
    print(f"outputs in {run_dir}", flush=True)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    elif "ddp" in results:
        worst = max(max(r["max_rel_diff_vs_ddp"], r["max_loss_rel_diff_vs_ddp"]) for r in results.values())
        how = "bit for bit" if worst == 0.0 else \
            f"to rounding (max relative difference {worst:.2g} <= {TOLERANCE[args.dtype]:g})"
        print(f"OK: every mode's losses and weights equal DDP's after {args.steps} steps, {how}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
