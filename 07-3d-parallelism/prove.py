"""Chapter 07, the proof: FSDP x tensor parallelism with sequence parallelism x pipeline,
built on the meta device, trains what chapter 01 trains.

One launch checks the layouts of its world size (default: those `LAYOUTS` lists for it)
against chapter 01's arithmetic on the same global batch: the whole model in one
process, the loss the global token mean (written out here with F.cross_entropy, apart
from the code under test), clipping at 1.0, AdamW. Everything in fp64, on random tokens
over a --vocab-size vocabulary (an odd size splits unevenly over tp ranks). Every layout
is built as train_llm.py builds it (parallelize.py: meta device, pp, tp + SP, FSDP,
then chapter 01's values materialised piece by piece) and stepped as it steps.

- Before the first step every rank's pieces of every weight equal chapter 01's initial
  weights, bit for bit (`materialize` replays chapter 01's draws).
- Each step starts every layout from the reference's weights and AdamW moments. After
  it: nothing is NaN or infinite (the first one found stops the proof, named in one
  line); the loss, each rank's pieces of the gradients before clipping, after clipping,
  and of the weights after the step equal the reference's within the tolerance of
  `Reference.tolerances` (chapter 06's: a gradient scaled by any factor fails at step 1);
  the tp ranks hold the same bits of the norm weights they all hold; and the
  from-scratch sequence parallelism equals torch's within twice the tolerance.

No rank gathers a whole weight: each compares its own pieces with the same pieces of
the reference's tensors (`parallelize.local_piece`). Any failure: exit status 1.

    torchrun --standalone --nproc-per-node=4 07-3d-parallelism/prove.py
    torchrun --standalone --nproc-per-node=3 07-3d-parallelism/prove.py --batch-size 6
"""

import json
import logging
import math
import os
import re
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import sequence_parallel
from common.cli import check_seq_length, one_of, positive_float, positive_int, seed_value
from common.demos import exact_kernels, script_parser, start_group
from common.distributed import gc_and_destroy_process_group
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.model import PRESETS, LlamaForCausalLM, RMSNorm, get_config, num_parameters
from common.runfolder import claim_run_folder
from common.training import build_optimizer
from parallelize import Layout, build_stages, clip_grad_norm, local_piece, materialize
from pipeline_parallel import Part, Pipeline
from train_llm import compute_loss

BETAS, EPS = (0.9, 0.95), 1e-8  # build_optimizer's AdamW: the weights' tolerance depends on them
UNIT = 2.0 ** -53  # fp64's unit of rounding
MAX_LAYERS = 64
# What one launch proves by default, per world size: FSDP x TP+SP, FSDP x PP, TP+SP x PP,
# each from scratch where there is tp; pp with 2 stages per rank (interleaved); 3 ranks.
LAYOUTS = {1: ["dp1"], 2: ["tp2", "tp2-scratch", "pp2v2"],
           3: ["dp3", "pp3"],
           4: ["dp2xtp2", "dp2xpp2", "pp2xtp2", "pp2v2xtp2", "dp2xtp2-scratch"]}


def layout_of(name: str) -> Layout:
    """dp2xtp2, pp2v2xtp2 (2 stages per pipeline rank: the interleaved schedule),
    tp2-scratch (sequence_parallel.py's layers), tp2-nosp (tp without sequence
    parallelism): the parts above 1."""
    match = re.fullmatch(r"((?:dp|pp|tp)\d+(?:v\d+)?(?:x(?:dp|pp|tp)\d+(?:v\d+)?)*)(-scratch|-nosp)?", name)
    if not match:
        raise UsageError(f"{name!r} is not a layout name (e.g. dp2xtp2, pp2v2xtp2, tp2-scratch)")
    sizes = {"dp": 1, "pp": 1, "tp": 1, "virtual": 1}
    for part in match[1].split("x"):
        kind, n, v = re.fullmatch(r"(dp|pp|tp)(\d+)(?:v(\d+))?", part).groups()
        sizes[kind] = int(n)
        sizes["virtual"] = int(v) if v and kind == "pp" else sizes["virtual"]
    return Layout(**sizes, sequence_parallel=match[2] != "-nosp", api="scratch" if match[2] == "-scratch" else "torch")


def world_of(layout: Layout) -> int:
    return layout.dp * layout.pp * layout.tp


def max_over_ranks(value: float, device) -> float:
    """The largest of every rank's `value` (a collective). A NaN anywhere gives NaN."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def adam_ratio_bound(betas: tuple[float, float], step: int) -> float:
    """An upper bound on |m_hat / sqrt(v_hat)| at AdamW step `step` (1-based), whatever
    the gradients (chapter 05's proof.py derives it): 1 at step 1."""
    b1, b2 = betas
    series = sum((b1 * b1 / b2) ** k for k in range(step))
    return (1 - b1) * math.sqrt((1 - b2 ** step) * series) / ((1 - b1 ** step) * math.sqrt(1 - b2))


def parse_args(argv=None):
    p = script_parser("07-prove", "FSDP x TP (+SP) x PP, built on the meta device, proven equal to "
                      "chapter 01's training in fp64, layout by layout.", min_world=1)
    p.add_argument("--model-preset", default="tiny", type=one_of(*PRESETS), help="model size")
    p.add_argument("--layers", type=positive_int, default=4,
                   help=f"decoder layers, instead of the preset's (interleaving needs pp x 2 at least; at most {MAX_LAYERS})")
    p.add_argument("--seq-length", type=positive_int, default=16, help="tokens per sample (a multiple of tp)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="samples per step: the global batch")
    p.add_argument("--vocab-size", type=positive_int, default=1001, help="vocabulary of the random tokens")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--seed", type=seed_value, default=0, help="weights and tokens")
    p.add_argument("--proof-steps", type=positive_int, default=2, help="fp64 steps of every layout")
    p.add_argument("--layouts", type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
                   default=None, help="comma list of layout names (dp2xtp2, pp2v2xtp2, tp2-scratch, tp2-nosp; "
                   "default: this world's in LAYOUTS)")

    def check(args):  # after the torchrun check: it needs the world size
        check_seq_length(args)
        if (args.layers or 0) > MAX_LAYERS:
            raise UsageError(f"--layers {args.layers:,}: at most {MAX_LAYERS}")
        world = int(os.environ["WORLD_SIZE"])
        names = args.layouts or LAYOUTS.get(world, [f"dp{world}"])
        args.layouts = [check_layout(layout_of(n), n, world, config_of(args), args.batch_size, args.seq_length)
                        for n in names]
    p.checks.append(check)
    return p.parse_args(argv)


def check_layout(layout: Layout, name: str, world: int, config, batch: int, seq: int) -> Layout:
    """The layout fits the world, the model and the batch. Raises UsageError."""
    if world_of(layout) != world:
        raise UsageError(f"layout {name} takes {world_of(layout)} ranks, this launch has {world}")
    if config.num_key_value_heads % layout.tp or config.intermediate_size % layout.tp:
        raise UsageError(f"layout {name}: tp {layout.tp} does not divide the model's KV heads and MLP features")
    if layout.pp * layout.virtual > config.num_hidden_layers:
        raise UsageError(f"layout {name} has {layout.pp * layout.virtual} stages, the model {config.num_hidden_layers} "
                         f"layers (--layers)")
    if batch % layout.dp or seq % layout.sequence_shards:
        raise UsageError(f"layout {name}: dp {layout.dp} must divide --batch-size {batch}, and tp --seq-length {seq}")
    return layout


def config_of(args):
    return get_config(args.model_preset, args.vocab_size, num_hidden_layers=args.layers)


def fp64_norms(model):
    """RMSNorm normalises in fp32 whatever its input (common/model.py); in an fp64 proof
    that would round the norms' inputs to fp32 (chapter 06's prove.py says why it
    matters). The proof's models, the reference's too, normalise in fp64."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.forward = lambda x, m=m: F.rms_norm(x, (x.shape[-1],), m.weight, m.eps)
    return model


def local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class Reference:
    """Chapter 01's step: the whole model on the whole global batch, in one process."""

    def __init__(self, args, config, device):
        torch.manual_seed(args.seed)
        self.model = fp64_norms(LlamaForCausalLM(config).to(device, torch.float64))
        self.optimizer = build_optimizer(self.model, args.lr, 0.1, device)  # the chapters' weight decay
        per_layer = 2 * (config.hidden_size + config.intermediate_size)  # chapter 06's count of reordered terms
        self.terms = (config.num_hidden_layers * per_layer + 2 * config.vocab_size + args.batch_size * args.seq_length
                      + num_parameters(self.model))

    def step(self, x, y, step: int) -> dict:
        """One step: its loss, gradients before and after clipping, and tolerances."""
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())  # chapter 01's loss: the token mean
        loss.backward()
        grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        clipped = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "norm": norm, "grads": grads, "clipped": clipped,
                "tolerance": self.tolerances(step, grads, clipped, loss.detach())}

    def tolerances(self, step: int, grads: dict, clipped: dict, loss) -> dict:
        """Chapter 06's tolerance, per element: 2 terms u G for a gradient (G the largest
        element of its tensor; `terms` every sum on a gradient's way that a layout may
        add in another order: sequence parallelism's reduce-scatters add the same tp
        partial sums as tensor parallelism's all-reduces, FSDP's reduce-scatter the dp
        replicas' as DDP's all-reduce); AdamW turns a gradient difference delta into a
        weight difference of at most lr (1 + A_t) delta / (sqrt(v_hat) + eps). Not a
        proven bound: a tolerance shaped like one. Every layout lands at 1e-4 to 1e-2
        of it (prove.json keeps the ratios); a scaled gradient, a skipped collective or
        a norm weight counted twice land orders of magnitude above, at step 1."""
        lr, (_, beta2), grain = self.optimizer.param_groups[0]["lr"], BETAS, 2 * self.terms * UNIT
        amplify = lr * (1 + adam_ratio_bound(BETAS, step))
        out = {"loss": grain * loss.abs(), "grads": {}, "clipped": {}, "weights": {}}
        for n, p in self.model.named_parameters():
            v_hat = self.optimizer.state[p]["exp_avg_sq"] / (1 - beta2 ** step)
            out["grads"][n] = (grain * grads[n].abs().max()).expand_as(p)
            out["clipped"][n] = (grain * clipped[n].abs().max()).expand_as(p)
            out["weights"][n] = amplify * out["clipped"][n] / (v_hat.sqrt() + EPS)
        return out

    def state(self) -> dict:
        """name -> (weight, AdamW's two moments, its step count)."""
        st = self.optimizer.state
        return {n: (p.detach(), st[p]["exp_avg"], st[p]["exp_avg_sq"], st[p]["step"])
                for n, p in self.model.named_parameters()}


def loss_function(layout: Layout, stages, mesh):
    """(the summed cross-entropy of a micro-batch's logits, the context a step runs in):
    train_llm.py's for torch's layers; sequence_parallel.py's vocabulary-parallel one
    for the from-scratch layers."""
    if layout.tp > 1 and layout.api == "scratch":
        head = next((s.lm_head for s in stages if s.lm_head is not None), None)
        start = head.start if head is not None else 0
        return (lambda logits, y: sequence_parallel.vocab_parallel_cross_entropy(
            logits.flatten(0, -2), y.reshape(-1), start, mesh.get_group("tp")), nullcontext)
    return compute_loss, loss_parallel if layout.tp > 1 else nullcontext


class Trainer:
    """One layout's part of the model on this rank, built and trained as train_llm.py
    builds and trains it."""

    def __init__(self, layout: Layout, args, config, device):
        self.layout, self.device = layout, device
        self.mesh = init_device_mesh(device.type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=("dp", "pp", "tp"))
        self.dp_rank, self.tp_rank = self.mesh.get_local_rank("dp"), self.mesh.get_local_rank("tp")
        stages, ids = build_stages(config, self.mesh, layout, device, torch.float64)
        for stage in stages:
            fp64_norms(stage)
        materialize(stages, config, layout, args.seed, self.tp_rank)
        self.part = Part(stages)
        self.microbatches = args.batch_size // layout.dp if layout.pp > 1 else 1
        schedule = "interleaved" if layout.virtual > 1 else "1f1b"
        self.pipeline = Pipeline(stages, ids, layout.pp * layout.virtual, self.mesh.get_group("pp"), schedule,
                                 self.microbatches, device, config.hidden_size, torch.float64)
        self.loss_fn, self.context = loss_function(layout, stages, self.mesh)
        self.optimizer = build_optimizer(self.part, args.lr, 0.1, device)

    def backward(self, x, y, n_tokens: int) -> torch.Tensor:
        """Forward and backward of this replica's share of a global batch (x, y) of
        n_tokens targets; returns the global batch's loss (on every rank)."""
        dp, m = self.layout.dp, self.microbatches
        with self.context():
            loss = self.pipeline.step(list(zip(x.chunk(m), y.chunk(m), [None] * m)),
                                      lambda logits, t: self.loss_fn(logits, t) * dp / n_tokens)
        if self.layout.api == "scratch" and self.layout.tp > 1:  # torch's SP sums the norms' gradients itself
            sequence_parallel.all_reduce_norm_gradients(self.part, self.mesh.get_group("tp"))
        loss = loss.detach().double()  # each replica's share, on its last stage: summed, / dp
        dist.all_reduce(loss)
        return loss / (dp * self.layout.tp)

    def step(self, x, y) -> dict:
        """train_llm.py's step on the global batch (x, y): the loss, and this rank's pieces
        of the gradients before and after clipping and of the weights after the step."""
        dp = self.layout.dp
        out = {"loss": self.backward(x[self.dp_rank::dp], y[self.dp_rank::dp], y.numel())}
        out["grads"] = self.pieces(grad=True)
        clip_grad_norm(self.part.parameters(), 1.0, self.tp_rank)
        out["clipped"] = self.pieces(grad=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        out["weights"] = self.pieces()
        return out

    @torch.no_grad()
    def initial_difference(self, initial: dict) -> float:
        """The largest difference between this rank's stages' weights, gathered whole over
        FSDP's dp ranks (and torch's tp ranks), and chapter 01's `initial` weights, cut
        over tp as sequence_parallel.py cuts them for its layers (a check that does not
        go through local_piece, which materialize uses). A collective."""
        worst = 0.0
        for n, p in self.part.named_parameters():
            mine, theirs = p.full_tensor() if isinstance(p, DTensor) else p, initial[n]
            dim = sequence_parallel.tp_dim(n) if self.layout.api == "scratch" and self.layout.tp > 1 else None
            if dim is not None:
                start, end = sequence_parallel.shard_range(theirs.shape[dim], self.tp_rank, self.layout.tp)
                theirs = theirs.narrow(dim, start, end - start)
            worst = max(worst, (mine - theirs).abs().max().item() if mine.shape == theirs.shape else math.inf)
        return worst

    def step_optimizer(self):
        """Clip the gradients of the whole model, then AdamW's step."""
        clip_grad_norm(self.part.parameters(), 1.0, self.tp_rank)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def pieces(self, grad: bool = False) -> dict:
        return {n: local(p.grad if grad else p).clone() for n, p in self.part.named_parameters()}

    def piece(self, full: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's piece of the whole tensor `full` of parameter `name`."""
        return local_piece(full, name, dict(self.part.named_parameters())[name], self.layout, self.tp_rank)

    @torch.no_grad()
    def take(self, state: dict):
        """The reference's weights and AdamW state, cut as this rank holds them."""
        for n, p in self.part.named_parameters():
            weight, avg, avg_sq, count = state[n]
            local(p).copy_(self.piece(weight, n))
            st = self.optimizer.state[p]
            local(st["exp_avg"]).copy_(self.piece(avg, n))
            local(st["exp_avg_sq"]).copy_(self.piece(avg_sq, n))
            st["step"].copy_(count)


def main():
    args = parse_args()
    group = start_group(args.timeout)
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # gathering 2-D shards: a note per rank
    try:
        return run(args, group)
    finally:
        gc_and_destroy_process_group()


def run(args, group):
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=group.rank)
    # the global batches of chapter 01 (one process, the whole batch): every rank has them
    ids = torch.randint(0, args.vocab_size, (args.proof_steps, args.batch_size, args.seq_length + 1),
                        generator=torch.Generator().manual_seed(args.seed)).to(group.device)
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in ids]
    config = config_of(args)
    names = [layout_name(lay) for lay in args.layouts]
    if group.rank == 0:
        print(f"{group.world} ranks; {args.model_preset} preset, {config.num_hidden_layers} layers; "
              f"{args.proof_steps} fp64 steps of {len(names)} layouts: {', '.join(names)}", flush=True)
    with exact_kernels():
        results, failures = prove(args, config, group, batches, dict(zip(names, args.layouts)))
    if group.rank == 0:
        report(args, group, results, failures, run_dir)
    dist.barrier()
    return 1 if failures else 0


def layout_name(layout: Layout) -> str:
    shape = "x".join(f"{k}{getattr(layout, k)}" + (f"v{layout.virtual}" if k == "pp" and layout.virtual > 1 else "")
                     for k in ("dp", "pp", "tp") if getattr(layout, k) > 1) or "dp1"
    suffix = "-scratch" if layout.api == "scratch" and layout.tp > 1 else "-nosp" if not layout.sequence_parallel else ""
    return shape + suffix


def first_not_finite(got: dict) -> str | None:
    """What this rank computed that holds a NaN or an infinity, first in the order of the
    step: the loss, a gradient, a gradient after clipping, a weight; else None."""
    if not torch.isfinite(got["loss"]).all():
        return f"the loss is {got['loss'].item()}"
    for kind, what in (("grads", "the gradient of"), ("clipped", "the clipped gradient of"), ("weights", "the weight")):
        for n, t in got[kind].items():
            if not torch.isfinite(t).all():
                return f"{what} {n} is not finite ({t[~torch.isfinite(t)].flatten()[0].item()})"
    return None


def ratio(a, b, tolerance) -> float:
    """max over elements of |a - b| / tolerance (0 where a == b, and for empty pieces)."""
    if a.numel() == 0:
        return 0.0
    diff = (a - b).abs()
    return torch.where(diff == 0, 0.0, diff / tolerance).max().item()


def compare(key: str, step: int, trainer: Trainer, got: dict, ref: dict, before: dict) -> tuple[dict, list]:
    """This rank's pieces for one layout and step against the same pieces of the
    reference's: per kind, the largest difference over its tolerance, and the failures."""
    tol, figures, failures, piece = ref["tolerance"], {}, [], trainer.piece
    checks = [("grads", "the gradient of", got["grads"], ref["grads"], tol["grads"]),
              ("clipped", "the clipped gradient of", got["clipped"], ref["clipped"], tol["clipped"]),
              ("weights", "the weight", got["weights"], before, tol["weights"])]
    figures["loss"] = ratio(got["loss"], ref["loss"], tol["loss"])
    if not figures["loss"] <= 1:
        failures.append(f"{key}: step {step}: the loss differs from chapter 01's by "
                        f"{(got['loss'] - ref['loss']).abs().item():.3g}, {figures['loss']:.3g} times the tolerance")
    for kind, what, mine, theirs, tolerance in checks:
        worst, name = max((ratio(mine[n], piece(theirs[n], n), piece(tolerance[n], n)), n) for n in mine)
        figures[kind] = worst
        if not worst <= 1:
            diff = (mine[name] - piece(theirs[name], name)).abs().max().item()
            failures.append(f"{key}: step {step}: {what} {name} differs from chapter 01's by {diff:.3g}, "
                            f"{worst:.3g} times the tolerance")
    figures["weights_abs"] = max(((got["weights"][n] - piece(before[n], n)).abs().max().item()
                                  for n in got["weights"] if got["weights"][n].numel()), default=0.0)
    return figures, failures


def prove(args, config, group, batches, todo: dict):
    """Every layout, step by step from the reference's state, against the reference's
    step. Returns (per-layout figures, failures); stops at once at the first value that
    is not finite."""
    reference = Reference(args, config, group.device)
    initial = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    trainers = {key: Trainer(lay, args, config, group.device) for key, lay in todo.items()}
    results = {k: {"init": 0.0, "loss": 0.0, "grads": 0.0, "clipped": 0.0, "weights": 0.0, "weights_abs": 0.0,
                   "vs": None, "vs_weights": 0.0} for k in trainers}
    failures = []
    for key, t in trainers.items():  # 0. materialised on the meta device: chapter 01's initial weights
        worst = max_over_ranks(t.initial_difference(initial), group.device)
        results[key]["init"] = worst
        if worst != 0.0:
            failures.append(f"{key}: the initial weights differ from chapter 01's by {worst:.3g}")
    for step, (x, y) in enumerate(batches, start=1):
        ref = reference.step(x, y, step)
        state = reference.state()
        before = {n: w.clone() for n, (w, _, _, _) in state.items()}
        finals = {}
        for key, t in trainers.items():
            got = t.step(x, y)
            # 1. nothing that is not finite: the first one found, on any rank, stops the proof
            said = [None] * group.world
            dist.all_gather_object(said, first_not_finite(got) or first_not_finite(
                {"loss": ref["loss"], "grads": {}, "clipped": {}, "weights": {}}))
            if any(said):
                return results, [f"{key}: step {step}: {next(s for s in said if s)}"]
            # 2. the loss, the gradients before and after clipping, the weights: within the tolerance
            figures, wrong = compare(key, step, t, got, ref, before)
            everyone = [None] * group.world
            dist.all_gather_object(everyone, (figures, wrong))
            for kind in figures:
                results[key][kind] = max(results[key][kind], *(f[kind] for f, _ in everyone))
            failures += next((w for _, w in everyone if w), [])  # one rank's lines: the ranks repeat each other
            # 3. the tp ranks hold the same bits of the norm weights
            norms = [(n, w.contiguous().view(torch.int64).sum().item()) for n, w in sorted(got["weights"].items())
                     if w.dim() == 1]
            seen = [None] * t.layout.tp
            dist.all_gather_object(seen, norms, group=t.mesh.get_group("tp"))
            if max_over_ranks(float(any(s != norms for s in seen)), group.device):
                failures.append(f"{key}: step {step}: the tp ranks hold different norm weights")
            finals[key] = got["weights"]
            t.take(state)  # the next step starts from the reference's state again
        for key, t in trainers.items():  # 4. from scratch equals torch's sequence parallelism
            twin = key.replace("-scratch", "")
            if key.endswith("-scratch") and twin in finals:
                # the same elements on the same rank: FSDP cuts each tp slice alike, whoever made it
                mine, theirs, tol = finals[key], finals[twin], ref["tolerance"]["weights"]
                vs = max_over_ranks(max(ratio(mine[n], theirs[n], t.piece(tol[n], n)) for n in mine), group.device)
                results[key]["vs"], results[key]["vs_weights"] = twin, max(results[key]["vs_weights"], vs)
                if not vs <= 2:  # each within the tolerance of the reference: within twice of each other
                    failures.append(f"{key}: step {step}: its weights differ from {twin}'s, {vs:.3g} times the "
                                    f"tolerance")
        if group.rank == 0:
            print(f"step {step}: loss {ref['loss'].item():.6f}, gradient norm {ref['norm'].item():.6f}", flush=True)
    return results, failures


def report(args, group, results, failures, run_dir):
    """Rank 0: the table, the verdict, prove.json."""
    rows = ["| layout | initial weights: largest difference | loss / tol | gradients / tol | clipped / tol "
            "| weights / tol | largest weight difference | vs | / tol |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for key, r in results.items():
        vs = f"{r['vs']} | {r['vs_weights']:.2g}" if r["vs"] else "|"
        rows.append(f"| {key} | {r['init']:.2g} | {r['loss']:.2g} | {r['grads']:.2g} | {r['clipped']:.2g} | "
                    f"{r['weights']:.2g} | {r['weights_abs']:.2g} | {vs} |")
    print("\n" + "\n".join(rows) + "\n", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "prove.json").write_text(json.dumps(
        {"world_size": group.world, "args": {**vars(args), "layouts": list(results)}, "passed": not failures,
         "failures": failures, "layouts": results}, indent=1) + "\n")
    print(f"outputs in {run_dir}", flush=True)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    else:
        print(f"OK: every layout starts from chapter 01's weights bit for bit, and its loss, gradients (before "
              f"and after clipping) and weights equal chapter 01's after each of {args.proof_steps} fp64 steps from "
              f"the same state, within the tolerance; sequence parallelism from scratch equals torch's within "
              f"twice the tolerance", flush=True)


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
