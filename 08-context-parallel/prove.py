"""Chapter 08, the proof: a sequence split over cp ranks trains what one process trains.

In fp64, every rank making the same random data:

1. attention: each variant (ring, all-to-all) and split (balanced, contiguous) the
   world allows, on each rank's tokens, against one process's causal attention on the
   whole sequence: the output and the gradients of q, k and v, within TOLERANCE.
2. training: the layouts of this world size (default: `LAYOUTS`, those that fit),
   built and stepped as train_llm.py builds and steps them, against chapter 01's step
   on the same global batch (the whole model in one process, clipping at 1.0, AdamW),
   each step from the reference's state: nothing NaN or infinite (the first one stops
   the proof, named in one line); the loss, each rank's pieces of the gradients before
   and after clipping and of the weights after the step within chapter 07's tolerance.
3. torch (GPUs only): torch's context_parallel against this chapter's ring.

Any failure: exit status 1.

    torchrun --standalone --nproc-per-node=2 08-context-parallel/prove.py
    torchrun --standalone --nproc-per-node=3 08-context-parallel/prove.py
    torchrun --standalone --nproc-per-node=4 08-context-parallel/prove.py --kv-heads 4
"""

import json
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
from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.attention import SDPBackend, sdpa_kernel

import context_parallel
from common.cli import comma_list, one_of, positive_float, positive_int, seed_value
from common.demos import exact_kernels, script_parser, start_group
from common.distributed import gc_and_destroy_process_group
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.layout import check_vocabulary
from common.model import PRESETS, LlamaForCausalLM, RMSNorm, get_config, num_parameters
from common.runfolder import claim_run_folder
from common.training import build_optimizer
from parallelize import Layout, build_stages, clip_grad_norm, local_piece, materialize
from pipeline_parallel import Part, Pipeline

# Split attention adds the same terms as one softmax in another order: in fp64 the two
# differ by about 1e-15 of the largest value (seen: 3e-15 at most), a wrong mask or
# merge by more than 1e-2 (the tests' mutants). 1e-12 sits far from both.
TOLERANCE = 1e-12
# torch's kernels run in fp32 on GPUs: two fp32 attentions agree to about 1e-6.
FP32_TOLERANCE = 1e-4
BETAS, EPS = (0.9, 0.95), 1e-8  # build_optimizer's AdamW: the weights' tolerance depends on them
UNIT = 2.0 ** -53  # fp64's unit of rounding
PARTS = ("attention", "training", "torch")
# What one launch trains by default, per world size (those that fit the model): cp with
# each attention, and beside tp, dp (FSDP) and a pipeline.
LAYOUTS = {1: [], 2: ["cp2", "cp2-all-to-all"], 3: ["cp3"],
           4: ["cp2xtp2", "cp2xtp2-all-to-all", "dp2xcp2", "pp2xcp2"]}


def layout_of(name: str) -> Layout:
    """cp2, cp2xtp2, dp2xcp2-all-to-all: the parts above 1, then the attention (ring if
    not said)."""
    match = re.fullmatch(r"((?:dp|pp|cp|tp)\d+(?:x(?:dp|pp|cp|tp)\d+)*)(-all-to-all|-ring)?", name)
    if not match:
        raise UsageError(f"{name!r} is not a layout name (e.g. cp2, cp2xtp2, dp2xcp2-all-to-all)")
    sizes = {k: int(n) for k, n in re.findall(r"(dp|pp|cp|tp)(\d+)", match[1])}
    return Layout(**sizes, cp_attention=(match[2] or "-ring")[1:])


def fits(layout: Layout, world: int, config, batch: int, seq: int) -> str | None:
    """Why `layout` does not fit the world, the model and the batch, or None."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if layout.world != world:
        return f"takes {layout.world} ranks, this launch has {world}"
    if kv % layout.tp or config.intermediate_size % layout.tp:
        return f"tp {layout.tp} does not divide the model's KV heads and MLP features"
    if layout.pp > config.num_hidden_layers or batch % layout.dp:
        return f"pp {layout.pp} exceeds the layers, or dp {layout.dp} does not divide --batch-size {batch}"
    if seq % (2 * layout.cp) or seq // layout.cp % layout.tp:
        return f"--seq-length {seq} does not cut into 2 x cp chunks, each rank's tokens into tp pieces"
    if layout.cp_attention == "all-to-all" and (heads // layout.tp % layout.cp or kv // layout.tp % layout.cp):
        return f"all-to-all: cp {layout.cp} does not divide the heads and KV heads per tp rank (--kv-heads)"
    return None


def parse_args(argv=None):
    p = script_parser("08-prove", "Context parallelism proven equal to one process, in fp64: attention, "
                      "then whole training steps against chapter 01's.", min_world=1)
    p.add_argument("--model-preset", default="tiny", type=one_of(*PRESETS), help="model size")
    p.add_argument("--kv-heads", type=positive_int, default=None, help="KV heads, instead of the preset's")
    p.add_argument("--seq-length", type=positive_int, default=48, help="tokens per sample")
    p.add_argument("--batch-size", type=positive_int, default=4, help="samples per step: the global batch")
    p.add_argument("--vocab-size", type=positive_int, default=1001, help="vocabulary of the random tokens")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--seed", type=seed_value, default=0, help="weights, tokens, queries, keys and values")
    p.add_argument("--proof-steps", type=positive_int, default=2, help="fp64 steps of every layout")
    p.add_argument("--parts", type=comma_list(*PARTS), default="attention,training",
                   help="what to prove (torch: torch's context_parallel against this chapter's ring; CUDA only)")
    p.add_argument("--layouts", type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
                   default=None, help="comma list of layout names to train (cp2, cp2xtp2-all-to-all, dp2xcp2; "
                   "default: this world's in LAYOUTS that fit the model)")

    def check(args):  # after the torchrun check: it needs the world size
        world = int(os.environ["WORLD_SIZE"])
        if "torch" in args.parts and not torch.cuda.is_available():
            raise UsageError("--parts torch needs CUDA GPUs: torch's context_parallel has no CPU kernel")
        if world == 1 and args.parts != ["torch"]:
            raise UsageError("this needs at least 2 processes (--nproc-per-node=2 or more); one is for --parts torch")
        if args.seq_length % (2 * world):
            raise UsageError(f"--seq-length {args.seq_length} does not cut into 2 x {world} ranks = {2 * world} "
                             f"equal chunks")
        if args.seq_length > PRESETS[args.model_preset]["max_position_embeddings"]:
            raise UsageError(f"--seq-length {args.seq_length} exceeds the {args.model_preset!r} preset's "
                             f"max_position_embeddings")
        heads = PRESETS[args.model_preset]["num_attention_heads"]
        if args.kv_heads is not None and heads % args.kv_heads:
            raise UsageError(f"--kv-heads {args.kv_heads} does not divide the {args.model_preset!r} preset's "
                             f"{heads} attention heads")
        config = config_of(args)
        if args.layouts is None:  # this world's defaults, those that fit
            args.layouts = [n for n in LAYOUTS.get(world, [f"cp{world}"])
                            if not fits(layout_of(n), world, config, args.batch_size, args.seq_length)]
        for name in args.layouts:
            if why := fits(layout_of(name), world, config, args.batch_size, args.seq_length):
                raise UsageError(f"layout {name}: {why}")
            check_vocabulary(config.vocab_size, layout_of(name).tp)
    p.checks.append(check)
    return p.parse_args(argv)


def config_of(args):
    return get_config(args.model_preset, args.vocab_size,
                      **({"num_key_value_heads": args.kv_heads} if args.kv_heads else {}))


def gap(got, want, tolerance: float) -> float:
    """The largest |got - want| over tolerance x the largest |want| (inf if got has a NaN)."""
    return ((got - want).abs().max() / (tolerance * want.abs().max())).item() if torch.isfinite(got).all() else math.inf


def worst_over_ranks(values: list[float], device) -> list[float]:
    """Each entry's largest value over the ranks (a collective). A NaN anywhere gives NaN."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# ---- 1. attention ----------------------------------------------------------------------

def attentions(cp: int, heads: int, kv_heads: int) -> list[tuple[str, bool]]:
    """(variant, balanced) of every attention the world allows: all-to-all needs cp to
    divide the heads and the KV heads."""
    out = [("ring", True), ("ring", False)]
    if heads % cp == 0 and kv_heads % cp == 0:
        out += [("all-to-all", True), ("all-to-all", False)]
    return out


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
    for variant, balanced in attentions(demo.world, H, KV):
        split = context_parallel.SequenceSplit(T, demo.world, balanced)
        positions = context_parallel.shard_positions(split, group)
        mine = [context_parallel.shard(t.detach(), positions, dim=2).requires_grad_() for t in (q, k, v)]
        out = context_parallel.ATTENTION[variant](*mine, group, split)
        out.backward(context_parallel.shard(upstream, positions, dim=2))
        got = {"output": out.detach(), "dq": mine[0].grad, "dk": mine[1].grad, "dv": mine[2].grad}
        ratios = [gap(got[n], context_parallel.shard(e, positions, dim=2), TOLERANCE) for n, e in expected.items()]
        name = f"{variant}, {'balanced' if balanced else 'contiguous'}"
        results[name] = dict(zip(expected, worst_over_ranks(ratios, demo.device)))
        failures += [f"{name}: {n} differs from one process's by {r:.3g} x the tolerance"
                     for n, r in results[name].items() if not r <= 1]
    return results, failures


# ---- 3. torch's context_parallel --------------------------------------------------------

def prove_torch(args, demo, config) -> tuple[dict, list[str]]:
    """On GPUs: torch's context_parallel (the memory-efficient kernel, fp32) against the
    ring, on the same q, k, v and upstream gradient; torch shards its buffers in place,
    head and tail as SequenceSplit does. One KV head per query head (its ring takes no
    grouped heads). Within FP32_TOLERANCE at each rank's tokens."""
    B, T, D, H = args.batch_size, args.seq_length, config.head_dim, config.num_attention_heads
    gen = torch.Generator().manual_seed(args.seed)
    q, k, v, upstream = (torch.randn(B, H, T, D, generator=gen).to(demo.device) for _ in range(4))
    split, group = context_parallel.SequenceSplit(T, demo.world), dist.group.WORLD
    positions = context_parallel.shard_positions(split, group)
    mine = [context_parallel.shard(t, positions, dim=2).requires_grad_() for t in (q, k, v)]
    ours = context_parallel.ring_attention(*mine, group, split)
    ours.backward(context_parallel.shard(upstream, positions, dim=2))
    buffers = [t.clone() for t in (q, k, v, upstream)]  # sharded in place by torch, on the sequence dim
    mesh = init_device_mesh(demo.device.type, (demo.world,))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), torch_context_parallel(
            mesh, buffers=buffers, buffer_seq_dims=[2] * 4, no_restore_buffers=set(buffers)):
        theirs_in = [t.detach().requires_grad_() for t in buffers[:3]]
        theirs = F.scaled_dot_product_attention(*theirs_in, is_causal=True)
        theirs.backward(buffers[3])
    pairs = {"output": (theirs, ours), "dq": (theirs_in[0].grad, mine[0].grad),
             "dk": (theirs_in[1].grad, mine[1].grad), "dv": (theirs_in[2].grad, mine[2].grad)}
    ratios = [gap(a, b, FP32_TOLERANCE) for a, b in pairs.values()]
    result = dict(zip(pairs, worst_over_ranks(ratios, demo.device)))
    return {f"torch's context_parallel vs the ring (fp32: / {FP32_TOLERANCE:g} x ...)": result}, [
        f"torch's context_parallel: {n} differs from this chapter's ring by {r:.3g} x the tolerance"
        for n, r in result.items() if not r <= 1]


# ---- 2. training -------------------------------------------------------------------------

def adam_ratio_bound(betas: tuple[float, float], step: int) -> float:
    """An upper bound on |m_hat / sqrt(v_hat)| at AdamW step `step` (1-based), whatever
    the gradients (chapter 05's proof.py derives it): 1 at step 1."""
    b1, b2 = betas
    series = sum((b1 * b1 / b2) ** k for k in range(step))
    return (1 - b1) * math.sqrt((1 - b2 ** step) * series) / ((1 - b1 ** step) * math.sqrt(1 - b2))


def fp64_norms(model):
    """The proof's models normalise in fp64, not fp32 as common/model.py's RMSNorm does
    (chapter 06's prove.py says why)."""
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
        # chapter 07's count of the terms a layout may add in another order, and the
        # sequence each layer's attention sums over, merged block by block here
        per_layer = 2 * (config.hidden_size + config.intermediate_size) + args.seq_length
        self.terms = (config.num_hidden_layers * per_layer + 2 * config.vocab_size + args.batch_size * args.seq_length
                      + num_parameters(self.model))

    def step(self, x, y, step: int) -> dict:  # its loss, gradients before and after clipping, and tolerances
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
        """Chapter 07's tolerance, per element: 2 terms u G for a gradient (G the largest
        element of its tensor), and what AdamW turns that into. Not a proven bound: a
        tolerance shaped like one; prove.json keeps how far below it each layout lands."""
        lr, (_, beta2), grain = self.optimizer.param_groups[0]["lr"], BETAS, 2 * self.terms * UNIT
        amplify = lr * (1 + adam_ratio_bound(BETAS, step))
        out = {"loss": grain * loss.abs(), "grads": {}, "clipped": {}, "weights": {}}
        for n, p in self.model.named_parameters():
            v_hat = self.optimizer.state[p]["exp_avg_sq"] / (1 - beta2 ** step)
            out["grads"][n] = (grain * grads[n].abs().max()).expand_as(p)
            out["clipped"][n] = (grain * clipped[n].abs().max()).expand_as(p)
            out["weights"][n] = amplify * out["clipped"][n] / (v_hat.sqrt() + EPS)
        return out

    def state(self) -> dict:  # name -> (weight, AdamW's two moments, its step count)
        st = self.optimizer.state
        return {n: (p.detach(), st[p]["exp_avg"], st[p]["exp_avg_sq"], st[p]["step"])
                for n, p in self.model.named_parameters()}


class Trainer:
    """One layout's part of the model on this rank, built and trained as train_llm.py
    builds and trains it: pp, tp (torch's, with sequence parallelism), FSDP over the
    dp x cp ranks, then each stage on this rank's tokens, its attention across the cp
    ranks."""

    def __init__(self, layout: Layout, args, config, device):
        self.layout, self.device = layout, device
        self.mesh = init_device_mesh(device.type, (layout.pp, layout.dp, layout.cp, layout.tp),
                                     mesh_dim_names=("pp", "dp", "cp", "tp"))
        self.dp_rank, self.tp_rank = self.mesh.get_local_rank("dp"), self.mesh.get_local_rank("tp")
        stages, ids = build_stages(config, context_parallel.fsdp_mesh(device.type, layout.pp, layout.dp, layout.cp,
                                                                      layout.tp), layout, device, torch.float64)
        for stage in stages:
            fp64_norms(stage)
        materialize(stages, config, layout, args.seed, self.tp_rank)
        split = context_parallel.SequenceSplit(args.seq_length, layout.cp)
        for stage in stages:
            context_parallel.parallelize(stage, self.mesh.get_group("cp"), split, layout.cp_attention)
        self.positions = context_parallel.shard_positions(split, self.mesh.get_group("cp"))
        self.part = Part(stages)
        self.microbatches = args.batch_size // layout.dp if layout.pp > 1 else 1
        self.pipeline = Pipeline(stages, ids, layout.pp, self.mesh.get_group("pp"), "1f1b", self.microbatches,
                                 device, config.hidden_size, torch.float64)
        if layout.tp > 1:  # logits sharded over the vocabulary: torch's loss_parallel
            self.loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, -2), y.reshape(-1),
                                                             reduction="sum").to_local()
            self.context = loss_parallel
        else:
            self.loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, -2), y.reshape(-1), reduction="sum")
            self.context = nullcontext
        self.optimizer = build_optimizer(self.part, args.lr, 0.1, device)

    def step(self, x, y) -> dict:
        """train_llm.py's step on the global batch (x, y): the loss, and this rank's pieces
        of the gradients before and after clipping and of the weights after the step."""
        dp, m, n_tokens = self.layout.dp, self.microbatches, y.numel()
        x, y = (context_parallel.shard(t[self.dp_rank::dp], self.positions) for t in (x, y))  # this rank's tokens
        ranks = dp * self.layout.cp  # FSDP averages over the dp x cp ranks
        with self.context():
            loss = self.pipeline.step(list(zip(x.chunk(m), y.chunk(m), [None] * m)),
                                      lambda logits, t: self.loss_fn(logits, t) * ranks / n_tokens)
        loss = loss.detach().double() * (self.tp_rank == 0)  # the dp x cp ranks' shares, summed
        dist.all_reduce(loss)
        out = {"loss": loss / ranks, "grads": self.pieces(grad=True)}
        clip_grad_norm(self.part.parameters(), 1.0, self.tp_rank)
        out["clipped"] = self.pieces(grad=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        out["weights"] = self.pieces()
        return out

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
    figures["loss"] = ratio(got["loss"], ref["loss"], tol["loss"])
    if not figures["loss"] <= 1:
        failures.append(f"{key}: step {step}: the loss differs from chapter 01's by "
                        f"{(got['loss'] - ref['loss']).abs().item():.3g}, {figures['loss']:.3g} times the tolerance")
    kinds = (("grads", "the gradient of", ref["grads"]), ("clipped", "the clipped gradient of", ref["clipped"]),
             ("weights", "the weight", before))
    for kind, what, theirs in kinds:
        mine = got[kind]
        worst, name = max((ratio(mine[n], piece(theirs[n], n), piece(tol[kind][n], n)), n) for n in mine)
        figures[kind] = worst
        if not worst <= 1:
            diff = (mine[name] - piece(theirs[name], name)).abs().max().item()
            failures.append(f"{key}: step {step}: {what} {name} differs from chapter 01's by {diff:.3g}, "
                            f"{worst:.3g} times the tolerance")
    return figures, failures


def prove_training(args, config, demo) -> tuple[dict, list[str]]:
    """Every layout, step by step from the reference's state, against the reference's
    step. Returns (per-layout figures, failures); stops at once at the first value that
    is not finite."""
    ids = torch.randint(0, args.vocab_size, (args.proof_steps, args.batch_size, args.seq_length + 1),
                        generator=torch.Generator().manual_seed(args.seed)).to(demo.device)
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in ids]  # chapter 01's global batches
    reference = Reference(args, config, demo.device)
    trainers = {name: Trainer(layout_of(name), args, config, demo.device) for name in args.layouts}
    results = {k: {"loss": 0.0, "grads": 0.0, "clipped": 0.0, "weights": 0.0} for k in trainers}
    failures = []
    for step, (x, y) in enumerate(batches, start=1):
        ref = reference.step(x, y, step)
        state = reference.state()
        before = {n: w.clone() for n, (w, _, _, _) in state.items()}
        for key, t in trainers.items():
            got = t.step(x, y)
            said = [None] * demo.world  # 1. nothing that is not finite, on any rank
            dist.all_gather_object(said, first_not_finite(got))
            if any(said):
                return results, [f"{key}: step {step}: {next(s for s in said if s)}"]
            figures, wrong = compare(key, step, t, got, ref, before)  # 2. within the tolerance
            everyone = [None] * demo.world
            dist.all_gather_object(everyone, (figures, wrong))
            for kind in figures:
                results[key][kind] = max(results[key][kind], *(f[kind] for f, _ in everyone))
            failures += next((w for _, w in everyone if w), [])  # one rank's lines: the others repeat them
            t.take(state)  # the next step starts from the reference's state again
        if demo.rank == 0:
            print(f"step {step}: loss {ref['loss'].item():.6f}, gradient norm {ref['norm'].item():.6f}", flush=True)
    return results, failures


# ---- report ------------------------------------------------------------------------------

def report(args, demo, attention, training, failures, run_dir):
    """Rank 0: the tables, the verdict, prove.json."""
    if attention:
        rows = ["| attention | output | dq | dk | dv |", "| --- | ---: | ---: | ---: | ---: |"]
        rows += [f"| {name} | " + " | ".join(f"{r[n]:.2g}" for n in ("output", "dq", "dk", "dv")) + " |"
                 for name, r in attention.items()]
        print(f"\nattention: largest difference from one process, / ({TOLERANCE:g} x the largest value), over "
              f"the ranks:\n\n" + "\n".join(rows) + "\n", flush=True)
    if training:
        rows = ["| layout | loss / tol | gradients / tol | clipped / tol | weights / tol |",
                "| --- | ---: | ---: | ---: | ---: |"]
        rows += [f"| {key} | {r['loss']:.2g} | {r['grads']:.2g} | {r['clipped']:.2g} | {r['weights']:.2g} |"
                 for key, r in training.items()]
        print("training: largest difference from chapter 01's step, / the tolerance, over the ranks and steps:\n\n"
              + "\n".join(rows) + "\n", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "prove.json").write_text(json.dumps(
        {"world_size": demo.world, "args": vars(args), "tolerance": TOLERANCE, "passed": not failures,
         "failures": failures, "attention": attention, "training": training}, indent=1) + "\n")
    print(f"outputs in {run_dir}", flush=True)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    else:
        said = [f"every attention ({len(attention)}) equals one process's"] * bool(attention) + [
            f"every layout ({len(training)}) equals chapter 01's, {args.proof_steps} steps"] * bool(training)
        print(f"OK: on {demo.world} ranks, in fp64, {' and '.join(said)}, within the tolerance", flush=True)


def main():
    args = parse_args()
    demo = start_group(args.timeout)
    try:
        run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=demo.rank)
        config = config_of(args)
        if demo.rank == 0:
            print(f"{demo.world} ranks; {args.model_preset} preset, {config.num_hidden_layers} layers, "
                  f"{config.num_attention_heads} heads ({config.num_key_value_heads} KV); "
                  f"{', '.join(args.parts)}" + (f": {args.proof_steps} fp64 steps of {', '.join(args.layouts)}"
                                                if "training" in args.parts else ""), flush=True)
        attention, training, failures = {}, {}, []
        with exact_kernels():
            if "attention" in args.parts:
                attention, failures = prove_attention(args, demo, config)
            if "training" in args.parts and args.layouts:
                training, more = prove_training(args, config, demo)
                failures += more
            if "torch" in args.parts:
                more_attention, more = prove_torch(args, demo, config)
                attention.update(more_attention)
                failures += more
        if demo.rank == 0:
            report(args, demo, attention, training, failures, run_dir)
        dist.barrier()
        return 1 if failures else 0
    finally:
        gc_and_destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
