"""Chapter 05, part 4: sharding the training state, rebuilt from reduce_scatter and
all_gather, beside torch's DDP and FSDP2, and proven equal to DDP.

DDP keeps everything whole on every rank: parameters, gradients, AdamW's two moments.
  zero1  shards the optimizer state (ZeRO-1): gradients reduce-scattered, each rank
         updates its 1/N slice with its slice of AdamW's state, parameters all-gathered;
  zero3  shards everything (ZeRO-3): each module's parameters are all-gathered before its
         forward and again before its backward, freed after each; gradients reduce-scattered;
  fsdp2  torch's fully_shard on every decoder layer, then on the whole model.
Prove: --proof-steps fp64 steps of every mode on the same batches, each step from DDP's
state (weights and AdamW moments); after each step every mode's weights must equal DDP's
within the rounding bound that summation order allows in one step
(proof.adam_step_bound: 0 on 2 ranks), else exit 1. Time: --steps steps in the
chapters' training dtype (bf16 autocast on GPUs, fp32 on CPUs), modes interleaved step by
step. Prints bytes held and sent per rank, tokens/s.

    torchrun --standalone --nproc-per-node=2 05-collectives/sharded_from_scratch.py
    torchrun --standalone --nproc-per-node=4 05-collectives/sharded_from_scratch.py --lr 0.1
"""

import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function
from tqdm import tqdm

from common.cli import comma_list, non_negative_int, positive_int
from common.data import IGNORE_INDEX, show_progress
from common.demos import fixed_batches, script_parser, start_group
from common.distributed import DDP_NO_BUFFER_SYNC, gc_and_destroy_process_group
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.model import LlamaForCausalLM, get_config, num_parameters
from common.runfolder import claim_run_folder

import proof
import sharding

MODES = ("ddp", "zero1", "zero3", "fsdp2")
BETAS, EPS = (0.9, 0.95), 1e-8  # the chapters' AdamW; the proof's bound depends on them


def parse_args(argv=None):
    p = script_parser("05-sharded-from-scratch", "ZeRO-1 and ZeRO-3 from reduce_scatter + "
                      "all_gather, beside DDP and FSDP2, proven equal to DDP.", min_world=2,
                      training=True)
    p.add_argument("--proof-steps", type=positive_int, default=3, help="fp64 steps per mode, proof")
    p.add_argument("--steps", type=positive_int, default=8, help="timed steps per mode (training dtype)")
    p.add_argument("--timing-warmup", type=non_negative_int, default=2, help="untimed first steps")
    p.add_argument("--modes", type=comma_list(*MODES), default=",".join(MODES), help="comma list")

    def check(args):
        if args.steps <= args.timing_warmup:
            raise UsageError(f"--steps {args.steps} leaves no step to time after "
                             f"--timing-warmup {args.timing_warmup}")
    p.checks.insert(0, check)  # before "launch with torchrun": the flags come first
    return p.parse_args(argv)


def adamw(lr, params=None, decay=(), no_decay=()):
    """The chapters' optimizer: weight decay 0.1 on matrices, none on 1-D norm weights."""
    if params is not None:  # a whole model: each tensor's shape says which group it joins
        decay, no_decay = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    groups = [{"params": [t for t in ts if t.numel()], "weight_decay": wd}
              for ts, wd in ((decay, 0.1), (no_decay, 0.0))]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=BETAS, eps=EPS)


class FlatShard:
    """Parameters laid end to end in one flat buffer, padded to a multiple of the world
    size N, so that rank r owns exactly elements [r*S, (r+1)*S) with S = ceil(numel/N).

    Weight decay must apply per element exactly as in DDP. Matrices go first and 1-D
    weights last, so a rank's slice splits into at most two pieces, one decayed and one
    not; each piece becomes a tensor in the matching AdamW group. (The padding sits at
    the very end, in the undecayed piece: its gradient is 0, so it stays 0.)"""

    def __init__(self, params, rank, world, keep_full):
        self.params = sorted(params, key=lambda p: p.dim() < 2)  # stable: order kept
        self.sizes = [p.numel() for p in self.params]
        size = -(-sum(self.sizes) // world)  # S, rounded up
        decay_numel = sum(p.numel() for p in params if p.dim() >= 2)
        self.full = torch.zeros(size * world, dtype=params[0].dtype, device=params[0].device)
        for p, view in zip(self.params, self.views(self.full)):
            view.copy_(p.detach())
            p.data = view  # the model's parameter now lives inside the flat buffer
        lo = self.lo = rank * size
        self.shard = self.full[lo:lo + size]  # zero1: a view; zero3: the only copy kept
        self.shard = self.shard if keep_full else self.shard.clone()
        self.grad_shard = torch.zeros_like(self.shard)
        cut = self.cut = min(max(decay_numel - lo, 0), size)
        self.decay, self.no_decay = [self.shard[:cut]], [self.shard[cut:]]
        self.decay[0].grad, self.no_decay[0].grad = self.grad_shard[:cut], self.grad_shard[cut:]

    def views(self, flat):
        """One view of `flat` per parameter, shaped like it."""
        return [v.view_as(p) for v, p in zip(flat[:sum(self.sizes)].split(self.sizes), self.params)]

    def take(self, optimizer, ddp_state, index):
        """Proof only: DDP's weights and AdamW moments (`ddp_state`: three lists, per
        parameter in model order; `index`: each of our parameters' place in that order)
        into the flat buffer, where it is allocated, and into this rank's slices."""
        values, avg, avg_sq = (self.slice_of([ts[index[p]] for p in self.params]) for ts in ddp_state)
        if self.full.untyped_storage().size():  # zero1 keeps the full buffer; zero3 frees it
            self.full.copy_(values[1])
        self.shard.copy_(values[0])
        for piece, part in ((self.decay[0], slice(0, self.cut)), (self.no_decay[0], slice(self.cut, None))):
            if piece.numel():  # an empty piece joined no AdamW group
                optimizer.state[piece]["exp_avg"].copy_(avg[0][part])
                optimizer.state[piece]["exp_avg_sq"].copy_(avg_sq[0][part])

    def slice_of(self, tensors):
        """(this rank's slice, the whole flat buffer) of `tensors` laid out as the
        parameters are."""
        flat = torch.zeros(self.full.numel(), dtype=self.shard.dtype, device=self.shard.device)
        for t, view in zip(tensors, self.views(flat)):
            view.copy_(t)
        return flat[self.lo:self.lo + self.shard.numel()], flat


# ------------------------------------------------------------------------ the modes

class Trainer:
    """One mode's model and optimizer; `step` records time and loss. This base is DDP;
    the other modes override `setup`, the three hooks around the step, and what the
    proof reads: `averaged_gradients` and `cut_like_mine`."""

    def __init__(self, mode, args, config, demo, dtype=torch.float32, autocast=None):
        self.mode, self.args, self.demo = mode, args, demo
        self.autocast = autocast or nullcontext()  # bf16 autocast: the timed GPU steps
        self.comm = sharding.Comm(demo.world)
        torch.manual_seed(args.seed)  # the same initial weights on every rank, in every mode
        self.model = LlamaForCausalLM(config).to(demo.device, dtype)
        self.param_bytes = sharding.local_bytes(self.model.parameters())
        self.forward_model, self.times, self.losses = self.model, [], []
        self.setup()

    def setup(self):
        cuda = self.demo.device.type == "cuda"
        self.forward_model = DDP(self.model, device_ids=[self.demo.device.index] if cuda else None,
                                 gradient_as_bucket_view=True, **DDP_NO_BUFFER_SYNC)
        counted = self.comm.ddp_hook()  # torch's allreduce_hook, its bytes counted
        self.largest_grad = torch.zeros((), dtype=torch.float64, device=self.demo.device)

        def hook(state, bucket):
            # this rank's own gradients, before averaging: the proof's bound needs the largest
            self.largest_grad = torch.maximum(self.largest_grad, bucket.buffer().detach().abs().max().double())
            return counted(state, bucket)
        self.forward_model.register_comm_hook(None, hook)
        self.optimizer = adamw(self.args.lr, list(self.model.parameters()))

    def before_forward(self):
        self.optimizer.zero_grad(set_to_none=False)  # DDP: the gradients are its buckets

    def after_backward(self):
        pass  # DDP all-reduced its buckets during backward

    def after_update(self):
        pass

    def step(self, x, y):
        t0 = sharding.clock(self.demo.device)
        self.gradients(x, y)
        self.update()
        self.times.append(sharding.clock(self.demo.device) - t0)

    # The record_function ranges name the phases in a profiler's trace (overlap_timeline.py).
    def gradients(self, x, y):
        """Forward, backward, and the gradients averaged over the ranks (or their slices)."""
        self.before_forward()
        with record_function("forward"), self.autocast:
            logits = self.forward_model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)
        with record_function("backward"):
            loss.backward()
        with record_function("sync"):
            self.after_backward()
        self.losses.append(loss.detach())

    def update(self):
        with record_function("optimizer"):
            self.optimizer.step()
        with record_function("sync"):
            self.after_update()

    def averaged_gradients(self) -> list:
        """Proof only: (name, tensor) of the averaged gradients this rank holds after
        `gradients`, before the update."""
        return [(f"the gradient of {n}", p.grad) for n, p in self.model.named_parameters()]

    def cut_like_mine(self, tensors) -> list:
        """Proof only: DDP's tensors (one per parameter, in model order) cut as this mode
        holds its averaged gradients."""
        return list(tensors)

    def state_tensors(self):
        """(parameters, gradients) this rank holds between steps."""
        return list(self.model.parameters()), [p.grad for p in self.model.parameters()]

    def full_parameters(self):
        return [p.detach().clone() for p in self.model.parameters()]

    def take_state(self, ddp_state):
        """Proof only: DDP's weights and AdamW moments (see `ddp_state`) become this mode's,
        so that its next step starts where DDP's does. DDP's own trainer has them."""

    def index(self):
        return {p: i for i, p in enumerate(self.model.parameters())}


class ZeRO1(Trainer):
    def setup(self):
        self.flat = FlatShard(list(self.model.parameters()), self.demo.rank, self.demo.world, keep_full=True)
        self.flat.grad_full = torch.zeros_like(self.flat.full)
        for p, g in zip(self.flat.params, self.flat.views(self.flat.grad_full)):
            p.grad = g  # backward accumulates into one flat buffer (like DDP's buckets)
        self.optimizer = adamw(self.args.lr, decay=self.flat.decay,  # only our slice: AdamW's
                               no_decay=self.flat.no_decay)  # two moments are 1/N of DDP's

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

    def take_state(self, ddp_state):
        self.flat.take(self.optimizer, ddp_state, self.index())

    def averaged_gradients(self):
        return [("its gradient shard", self.flat.grad_shard)]

    def cut_like_mine(self, tensors):
        index = self.index()
        return [self.flat.slice_of([tensors[index[p]] for p in self.flat.params])[0]]


class ShardedUnit(FlatShard):
    """ZeRO-3 for one module: its parameters are views of a flat buffer whose memory exists
    only while the module computes: freed (storage resized to 0 bytes) and refilled in
    place by all_gather, so the parameters, and autograd's references to them, stay valid."""

    def __init__(self, module, comm, rank, world):
        super().__init__(list(module.parameters()), rank, world, keep_full=False)
        self.comm, self.pending, self.grad_full = comm, len(self.params), None
        self.free()
        module.register_forward_pre_hook(lambda module, args: self.gather())
        module.register_forward_hook(self.after_forward)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def gather(self):
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self.comm.all_gather(self.full, self.shard)

    def free(self):
        self.full.untyped_storage().resize_(0)

    def after_forward(self, module, args, output):
        self.free()  # freed until backward reaches this module, i.e. until the gradient
        output.register_hook(self.before_backward)  # of its output is ready

    def before_backward(self, grad_output):
        self.gather()
        self.grad_full = torch.zeros_like(self.full)  # this module's full gradients, briefly
        for p, g in zip(self.params, self.views(self.grad_full)):
            p.grad = g

    def grad_ready(self, param):
        self.pending -= 1
        if self.pending == 0:  # all of this module's gradients are in: average, keep our slice
            self.pending = len(self.params)
            self.comm.reduce_scatter(self.grad_shard, self.grad_full.div_(self.comm.world))
            for p in self.params:
                p.grad = None
            self.grad_full = None
            self.free()


class ZeRO3(Trainer):
    def setup(self):
        m = self.model
        self.units = [ShardedUnit(module, self.comm, self.demo.rank, self.demo.world)
                      for module in (m.embed_tokens, *m.layers, m.norm, m.lm_head)]  # every parameter once
        self.unit_names = ["embed_tokens", *(f"layers.{i}" for i in range(len(m.layers))), "norm", "lm_head"]
        self.optimizer = adamw(self.args.lr, decay=[t for u in self.units for t in u.decay],
                               no_decay=[t for u in self.units for t in u.no_decay])

    def state_tensors(self):
        return [u.shard for u in self.units], [u.grad_shard for u in self.units]

    def take_state(self, ddp_state):
        index = self.index()
        for u in self.units:
            u.take(self.optimizer, ddp_state, index)

    def averaged_gradients(self):
        return [(f"the gradient shard of {name}", u.grad_shard) for name, u in zip(self.unit_names, self.units)]

    def cut_like_mine(self, tensors):
        index = self.index()
        return [u.slice_of([tensors[index[p]] for p in u.params])[0] for u in self.units]

    def full_parameters(self):
        for u in self.units:
            u.gather()
        params = super().full_parameters()
        for u in self.units:
            u.free()
        return params


class FSDP2(Trainer):
    def setup(self):
        # A unit per decoder layer, then the root (embedding, norm, head): each parameter
        # becomes a DTensor sharded on dim 0, gathered and freed by fully_shard's hooks.
        for layer in self.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.comm.watch_fsdp2([*self.model.layers, self.model])
        self.optimizer = adamw(self.args.lr, list(self.model.parameters()))

    def before_forward(self):
        self.optimizer.zero_grad(set_to_none=True)

    def full_parameters(self):
        return [proof.full_tensor(p).detach() for p in self.model.parameters()]

    def averaged_gradients(self):
        return [(f"the gradient of {n}", p.grad.to_local()) for n, p in self.model.named_parameters()]

    def cut_like_mine(self, tensors):
        return [distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None).to_local()
                for p, t in zip(self.model.parameters(), tensors)]

    def take_state(self, ddp_state):
        # each DTensor keeps its shard of DDP's tensor (the same on every rank: no collective)
        with torch.no_grad():
            for p, value, avg, avg_sq in zip(self.model.parameters(), *ddp_state):
                def shard(t):
                    return distribute_tensor(t, p.device_mesh, p.placements, src_data_rank=None)
                p.copy_(shard(value))
                self.optimizer.state[p]["exp_avg"].copy_(shard(avg))
                self.optimizer.state[p]["exp_avg_sq"].copy_(shard(avg_sq))


TRAINERS = {"ddp": Trainer, "zero1": ZeRO1, "zero3": ZeRO3, "fsdp2": FSDP2}


def ddp_state(trainer):
    """DDP's weights and AdamW's two moments: three lists, one tensor per parameter, in
    model order (the same order in every mode's model)."""
    params = list(trainer.model.parameters())
    state = trainer.optimizer.state
    return ([p.detach() for p in params], [state[p]["exp_avg"] for p in params],
            [state[p]["exp_avg_sq"] for p in params])


# ------------------------------------------------------------------------------ main

def main():
    args = parse_args()
    demo = start_group(args.timeout)
    try:
        return run(args, demo)
    finally:
        gc_and_destroy_process_group()


def steps(batches, what, demo):
    """The batches, announced in one line by rank 0, with a progress bar in a terminal."""
    if demo.rank == 0:
        print(what, flush=True)
    return tqdm(batches, desc=what.split(":")[0], leave=False, disable=demo.rank != 0 or not show_progress())


def train(args, config, demo, batches, what, dtype=torch.float32, autocast=None):
    """Every mode from the same weights on the same batches, one step of each mode in
    turn rather than one mode after the other: a change in the machine's load then hits
    every mode alike."""
    trainers = {mode: TRAINERS[mode](mode, args, config, demo, dtype, autocast) for mode in args.modes}
    for x, y in steps(batches, what, demo):
        for t in trainers.values():
            t.step(x, y)
    return trainers


def run(args, demo):
    # ours alone while it runs: a second job with this --experiment-name is refused, not
    # left to overwrite the report with its own (rank 0 holds it, every rank hears a refusal)
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=demo.rank)
    # each rank's shard of one shared shuffle (as in chapter 03), loaded before any timing
    data, batches = fixed_batches(args.dataset_name, args.seq_length, args.batch_size,
                                  max(args.steps, args.proof_steps), args.seed, demo.rank, demo.world,
                                  demo.device)
    config = get_config(args.model_preset, data.vocab_size)
    n_params = num_parameters(LlamaForCausalLM(config))
    # the chapters' training dtype: bf16 autocast on GPUs (fp32 weights), fp32 on CPUs
    cuda = demo.device.type == "cuda"
    timing_dtype = "bf16 autocast" if cuda else "fp32"
    summary = sharding.start_summary(args, demo, config, n_params, timing_dtype)

    # ---- 1. prove, in fp64: every mode's weights against DDP's, step by step -------
    diffs, failures = {}, []
    if "ddp" in args.modes:
        try:
            with proof.exact_kernels():
                diffs, failures, summary["proof_bound"] = prove(args, config, demo, batches[:args.proof_steps])
        except proof.NotFinite as stop:  # a NaN or an infinity: nothing after it means anything
            if demo.rank == 0:
                print(f"FAILED: {stop}", file=sys.stderr, flush=True)
            dist.barrier()  # nobody leaves before rank 0 has said it
            return 1

    # ---- 2. time, in the training dtype ----------------------------------------------
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else None
    trainers = train(args, config, demo, batches[:args.steps],
                     f"timing: {args.steps} {timing_dtype} steps of each mode", autocast=autocast)
    results = {mode: sharding.measure(t, args.timing_warmup, summary["tokens_per_step"])
               for mode, t in trainers.items()}
    for mode, t in trainers.items():  # then one more step each, under the memory tracker
        results[mode].update(diffs.get(mode, {}))
        results[mode]["bytes"]["peak_step"] = sharding.peak_step_bytes(t, batches[0])
    if demo.rank == 0:
        sharding.report(summary, results, failures, run_dir, "sharded_from_scratch")
    dist.barrier()  # nobody leaves while rank 0 still writes
    return 1 if failures else 0


def prove(args, config, demo, batches):
    """Every mode in fp64 on the same batches, one step at a time. After each backward no
    loss or gradient may be NaN or infinite (the first stops the proof: proof.NotFinite),
    and each mode's averaged gradients (its slices) must equal DDP's within the bound of
    summation order; after the update, the same for the weights (gathered, within AdamW's
    bound), the ranks' copies equal. Then every mode takes DDP's weights and moments, so
    that no difference grows from step to step. Returns (per-mode figures: the largest
    differences over the steps; failures; the largest one-step bound)."""
    trainers = {mode: TRAINERS[mode](mode, args, config, demo, torch.float64) for mode in args.modes}
    ddp = trainers["ddp"]
    diffs = {mode: {"ranks_differ": 0.0, "max_abs_grad_diff_vs_ddp": 0.0, "max_abs_diff_vs_ddp": 0.0,
                    "max_rel_diff_vs_ddp": 0.0} for mode in trainers}
    failures, bounds = [], []
    for step, (x, y) in enumerate(steps(batches, f"proof: {len(batches)} fp64 steps of each mode, "
                                        f"each from DDP's state", demo), start=1):
        ddp.largest_grad.zero_()
        for t in trainers.values():
            t.gradients(x, y)
        proof.stop_if_not_finite(trainers, step, lambda t: [("the loss", t.losses[-1]), *t.averaged_gradients()])
        largest_grad = proof.max_over_ranks(ddp.largest_grad.item(), demo.device)
        grad_bound = proof.gradient_bound(demo.world, torch.float64, largest_grad)
        ddp_grads = [p.grad for p in ddp.model.parameters()]
        for mode, t in trainers.items():
            diff = proof.max_over_ranks(proof.max_abs_difference([g for _, g in t.averaged_gradients()],
                                                                 t.cut_like_mine(ddp_grads)), demo.device)
            diffs[mode]["max_abs_grad_diff_vs_ddp"] = max(diffs[mode]["max_abs_grad_diff_vs_ddp"], diff)
            if not diff <= grad_bound:
                failures.append(f"{mode}: step {step}: an averaged gradient differs from DDP's by {diff:.3g} > "
                                f"{grad_bound:.3g}, the most that summation order allows")
        for t in trainers.values():
            t.update()
        finals = {mode: t.full_parameters() for mode, t in trainers.items()}
        names = [n for n, _ in ddp.model.named_parameters()]
        proof.stop_if_not_finite(trainers, step, lambda t: [(f"the weight {n}", w) for n, w in zip(names, finals[t.mode])])
        bound = proof.adam_step_bound(demo.world, torch.float64, args.lr, step, largest_grad, BETAS, EPS)
        bounds.append(bound)
        for mode, final in finals.items():
            d, ranks_differ = diffs[mode], proof.max_difference_to_rank0(final)
            vs_ddp = proof.max_over_ranks(proof.max_abs_difference(final, finals["ddp"]), demo.device)
            d["ranks_differ"] = max(d["ranks_differ"], ranks_differ)
            d["max_abs_diff_vs_ddp"] = max(d["max_abs_diff_vs_ddp"], vs_ddp)
            d["max_rel_diff_vs_ddp"] = max(d["max_rel_diff_vs_ddp"], proof.max_over_ranks(
                proof.max_relative_difference(final, finals["ddp"]), demo.device))
            if ranks_differ != 0.0:
                failures.append(f"{mode}: ranks hold different weights after step {step} (by {ranks_differ:.3g})")
            if not vs_ddp <= bound:
                failures.append(f"{mode}: after step {step} a weight differs from DDP's by {vs_ddp:.3g} > "
                                f"{bound:.3g}, the most that summation order allows in one step")
        state = ddp_state(ddp)
        for t in trainers.values():
            t.take_state(state)
    return diffs, failures, max(bounds)


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
