"""Chapter 06, the proof: model-parallel training equals chapter 01's training.

One launch checks every layout its world size allows (dp x pp x tp), from scratch and
with torch's APIs, GPipe and 1F1B, against chapter 01's arithmetic on the same global
batch: the whole model in one process, the loss the global token mean (written out
here with F.cross_entropy, apart from the code under test), clipping at 1.0, AdamW.
Everything is in fp64, on random tokens over a --vocab-size vocabulary (the arithmetic
does not depend on the text; an odd size splits unevenly over tp ranks). Each step
starts every layout from the reference's weights and AdamW moments. After it:

- no loss, gradient or weight holds a NaN or an infinity: the first one found stops the
  proof at once, named in one line;
- the loss, the gradients before clipping, the gradients the optimizer gets (after
  clipping) and the weights after the step each equal the reference's within the
  tolerance of `Reference.tolerances` (a gradient scaled by any factor fails at step 1:
  it is compared before clipping can rescale it);
- the ranks that hold the same weights hold the same bits, GPipe equals 1F1B bit for bit,
  torch's pipelines equal this chapter's bit for bit, and torch's tensor parallelism
  equals this chapter's within twice the tolerance.

Any failure: exit status 1.

    torchrun --standalone --nproc-per-node=2 06-model-parallel/prove.py --model-preset tiny
    torchrun --standalone --nproc-per-node=4 06-model-parallel/prove.py
"""

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from common.cli import check_seq_length, one_of, positive_float, positive_int, seed_value
from common.demos import exact_kernels, script_parser, start_group
from common.distributed import gc_and_destroy_process_group
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.layout import every_layout
from common.model import PRESETS, LlamaForCausalLM, RMSNorm, get_config, num_parameters
from common.runfolder import claim_run_folder
from common.training import build_optimizer

from tensor_parallel import full_weight, local_grad, local_slice, to_local
from train_llm import all_reduce_gradients, clip_grad_norm, split_model

BETAS, EPS = (0.9, 0.95), 1e-8  # build_optimizer's AdamW: the weights' tolerance depends on them
UNIT = 2.0 ** -53  # fp64's unit of rounding
MAX_LAYERS = 64  # every layout builds the whole model on every rank, in fp64
MAX_VOCABULARY = 2 ** 20


def max_over_ranks(value: float, device) -> float:
    """The largest of every rank's `value` (a collective: every rank calls it). A NaN
    anywhere gives NaN."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def adam_ratio_bound(betas: tuple[float, float], step: int) -> float:
    """An upper bound on |m_hat / sqrt(v_hat)| at AdamW step `step` (1-based), whatever
    the gradients (Cauchy-Schwarz on AdamW's two moving averages): 1 at step 1. Chapter
    05's proof.py derives it."""
    b1, b2 = betas
    series = sum((b1 * b1 / b2) ** k for k in range(step))
    return (1 - b1) * math.sqrt((1 - b2 ** step) * series) / ((1 - b1 ** step) * math.sqrt(1 - b2))


def chosen(key: str, wanted) -> bool:
    """Whether --layouts names this layout, whole or by its first parts (pp2xtp2, pp4-1f1b)."""
    return wanted is None or any(key == w or key.startswith(w + "-") for w in wanted)


def parse_args(argv=None):
    p = script_parser("06-prove", "Tensor and pipeline parallelism proven equal to chapter 01's "
                      "training, in fp64, layout by layout.")
    p.add_argument("--model-preset", default="small", type=one_of(*PRESETS), help="model size")
    p.add_argument("--seq-length", type=positive_int, default=32, help="tokens per sample")
    p.add_argument("--batch-size", type=positive_int, default=4, help="samples per step: the global batch")
    p.add_argument("--vocab-size", type=positive_int, default=1001, help="vocabulary of the random tokens")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (constant)")
    p.add_argument("--seed", type=seed_value, default=0, help="weights and tokens")
    p.add_argument("--proof-steps", type=positive_int, default=3, help="fp64 steps of every layout")
    p.add_argument("--layers", type=positive_int, default=None,
                   help=f"decoder layers, instead of the preset's (a deeper pipeline needs more; at most {MAX_LAYERS})")
    p.add_argument("--layouts", type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
                   default=None, help="comma list of layouts to prove, by name (pp2xtp2-1f1b-torch) or "
                   "by their first parts (pp2xtp2: all its variants); default: every one the world allows")

    def check(args):  # after the torchrun check: it needs the world size
        check_seq_length(args)
        if (args.layers or 0) > MAX_LAYERS:
            raise UsageError(f"--layers {args.layers:,}: the proof builds every layout's whole model on every "
                             f"rank in fp64; at most {MAX_LAYERS}")
        if args.vocab_size > MAX_VOCABULARY:
            raise UsageError(f"--vocab-size {args.vocab_size:,}: at most {MAX_VOCABULARY:,}")
        world = int(os.environ["WORLD_SIZE"])
        every = [lay.name for lay in every_layout(world, config_of(args), args.batch_size)]
        if not every:
            raise UsageError(f"no layout of {world} ranks fits {config_of(args).num_hidden_layers} layers, "
                             f"{PRESETS[args.model_preset]['num_key_value_heads']} KV heads and --batch-size "
                             f"{args.batch_size}")
        unknown = [w for w in args.layouts or [] if not any(chosen(k, [w]) for k in every)]
        if unknown:
            raise UsageError(f"--layouts {','.join(unknown)}: no such layout of {world} ranks here; "
                             f"choose from: {', '.join(every)}")
    p.checks.append(check)
    return p.parse_args(argv)


def config_of(args):
    return get_config(args.model_preset, args.vocab_size, **({"num_hidden_layers": args.layers} if args.layers else {}))


def fp64_norms(model):
    """RMSNorm normalises in fp32 whatever its input (common/model.py, as Llama does). In
    an fp64 proof that rounds each norm's input to fp32: a 1e-16 difference from a
    reordered sum can then cross an fp32 rounding boundary and become 1e-7. The proof's
    models, the reference's too, normalise in fp64 instead: the same formula."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.forward = lambda x, m=m: F.rms_norm(x, (x.shape[-1],), m.weight, m.eps)
    return model


class Reference:
    """Chapter 01's step: the whole model on the whole global batch, in one process."""

    def __init__(self, args, config, device):
        torch.manual_seed(args.seed)
        self.model = fp64_norms(LlamaForCausalLM(config).to(device, torch.float64))
        self.optimizer = build_optimizer(self.model, args.lr, 0.1, device)  # the chapters' weight decay
        self.terms = reordered_terms(config, args, num_parameters(self.model))

    def step(self, x, y, step: int) -> dict:
        """One step: its loss, gradients before and after clipping, and tolerances."""
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())  # chapter 01's loss: the token mean
        loss.backward()
        grads = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        clipped = {n: p.grad.clone() for n, p in self.model.named_parameters()}
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "norm": norm, "grads": grads, "clipped": clipped,
                "tolerance": self.tolerances(step, grads, clipped, loss.detach())}

    def tolerances(self, step: int, grads: dict, clipped: dict, loss) -> dict:
        """How far a layout may land from this step, per element: a tolerance shaped
        like a first-order rounding bound, not a proven bound.

        A layout computes chapter 01's arithmetic with some sums in another order: a
        row-parallel layer adds tp partial sums where one matmul adds all its inputs,
        the vocabulary-parallel loss adds the exp of its logits in tp parts,
        micro-batches and dp replicas add a weight's gradient in parts, and the global
        gradient norm adds its squares in another order. A reordered sum of n terms
        moves by at most 2(n - 1) u sum|terms| (u = 2^-53). Counting every term on a
        gradient's way (`reordered_terms`) and taking sum|terms| as G, the largest
        gradient element of the tensor, gives 2 terms u G per gradient element. That
        step is not a proof: terms that cancel make sum|terms| larger than G. AdamW
        turns a gradient difference delta into a weight difference of at most
        lr (1 + A_t) delta / (sqrt(v_hat) + eps), per element (from the same moments,
        m_hat moves by at most delta, sqrt(v_hat) by at most delta, and |m_hat| <= A_t
        sqrt(v_hat): adam_ratio_bound).

        How it was chosen, and what it separates: every layout lands below 1e-2 of it
        (prove.json keeps the ratios), and the bugs of tests/test_mutants.py (a loss
        scaled, gradients summed over dp, an all-reduce left out, a norm weight counted
        on every tp rank, ...) land 1e6 to 1e12 times above it, at step 1."""
        lr, (_, beta2), grain = self.optimizer.param_groups[0]["lr"], BETAS, 2 * self.terms * UNIT
        amplify = lr * (1 + adam_ratio_bound(BETAS, step))
        out = {"loss": grain * loss.abs(), "grads": {}, "clipped": {}, "weights": {}}
        for n, p in self.model.named_parameters():
            v_hat = self.optimizer.state[p]["exp_avg_sq"] / (1 - beta2 ** step)
            out["grads"][n] = grain * grads[n].abs().max()
            out["clipped"][n] = grain * clipped[n].abs().max()
            out["weights"][n] = amplify * out["clipped"][n] / (v_hat.sqrt() + EPS)
        return out

    def state(self) -> dict:
        """name -> (weight, AdamW's two moments)."""
        st = self.optimizer.state
        return {n: (p.detach(), st[p]["exp_avg"], st[p]["exp_avg_sq"]) for n, p in self.model.named_parameters()}


class Trainer:
    """One layout's part of the model on this rank, trained as train_llm.py trains it."""

    def __init__(self, layout, args, config, device):
        self.layout = layout
        self.mesh = init_device_mesh(device.type, (layout.dp, layout.pp, layout.tp),
                                     mesh_dim_names=("dp", "pp", "tp"))
        self.dp_rank = self.mesh.get_local_rank("dp")
        torch.manual_seed(args.seed)  # chapter 01's initial weights, then split
        model = fp64_norms(LlamaForCausalLM(config).to(device, torch.float64))
        self.split = split_model(model, self.mesh, layout, None, device)
        self.module = self.split.module
        self.optimizer = build_optimizer(self.module, args.lr, 0.1, device)

    def step(self, x, y) -> dict:
        """train_llm.py's step on this replica's share of the global batch (x, y): the
        global loss (on every rank), and this rank's stage's gradients before and after
        clipping and weights after the step, each tensor whole (a collective)."""
        n_tokens, dp, m = y.numel(), self.layout.dp, self.layout.microbatches
        x, y = x[self.dp_rank::dp], y[self.dp_rank::dp]  # this replica's share
        with self.split.step_context():
            loss = self.split.pipeline.step(list(zip(x.chunk(m), y.chunk(m), [None] * m)),
                                            lambda logits, t: self.split.loss_fn(logits, t) * dp / n_tokens)
        # As train_llm.py logs it: the last stage's loss to every stage (0 elsewhere), then
        # the replicas' (each x dp) summed, / dp.
        loss = loss.detach().double()
        dist.all_reduce(loss, group=self.mesh.get_group("pp"))
        dist.all_reduce(loss, group=self.mesh.get_group("dp"))
        loss /= dp
        if dp > 1:
            all_reduce_gradients(self.module.parameters(), self.mesh.get_group("dp"), dp)
        out = {"loss": loss, "grads": self.gradients()}
        clip_grad_norm(self.module.parameters(), 1.0, self.mesh)
        out["clipped"] = self.gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        out["weights"] = self.weights()
        return out

    @torch.no_grad()
    def gradients(self) -> dict:
        """name -> this rank's stage's gradient, whole (tp slices gathered: a collective)."""
        for p in self.module.parameters():
            local_grad(p)  # torch's Rowwise embedding: its whole gradient cut as the weight is
        return {n: full_weight(p, self.mesh.get_group("tp"), p.grad) for n, p in self.module.named_parameters()}

    @torch.no_grad()
    def weights(self) -> dict:
        """name -> this rank's stage's weight, whole (tp slices gathered: a collective)."""
        return {n: full_weight(p, self.mesh.get_group("tp")) for n, p in self.module.named_parameters()}

    @torch.no_grad()
    def take(self, state: dict):
        """The reference's weights and AdamW moments, cut as this rank holds them."""
        group = self.mesh.get_group("tp")
        for n, p in self.module.named_parameters():
            weight, avg, avg_sq = state[n]
            to_local(p).copy_(local_slice(weight, p, group))
            st = self.optimizer.state[p]
            to_local(st["exp_avg"]).copy_(local_slice(avg, p, group))
            to_local(st["exp_avg_sq"]).copy_(local_slice(avg_sq, p, group))


def fingerprint(tensors: dict) -> tuple:
    """The bits of this rank's weights, summed as integers per tensor (any changed bit
    changes its sum) with their names: cheap to compare between ranks."""
    return tuple((n, t.contiguous().view(torch.int64).sum().item()) for n, t in sorted(tensors.items()))


def main():
    args = parse_args()
    group = start_group(args.timeout)
    try:
        return run(args, group)
    finally:
        gc_and_destroy_process_group()


def run(args, group):
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=group.rank)
    # The global batches of chapter 01 (one process, the whole batch): every rank has them.
    ids = torch.randint(0, args.vocab_size, (args.proof_steps, args.batch_size, args.seq_length + 1),
                        generator=torch.Generator().manual_seed(args.seed)).to(group.device)
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in ids]
    config = config_of(args)
    todo = [lay for lay in every_layout(group.world, config, args.batch_size) if chosen(lay.name, args.layouts)]
    if group.rank == 0:
        print(f"{group.world} ranks; {args.model_preset} preset; {args.proof_steps} fp64 steps of "
              f"{len(todo)} layouts: {', '.join(lay.name for lay in todo)}", flush=True)
    with exact_kernels():
        results, failures = prove(args, config, group, batches, todo)
    if group.rank == 0:
        report(args, group, results, failures, run_dir)
    dist.barrier()
    return 1 if failures else 0


def reordered_terms(config, args, params: int) -> int:
    """The count of the terms a layout may add in another order, on a gradient's way:
    both directions through each layer's row-parallel inputs (h + i each), the
    vocabulary twice, the batch's tokens, and every parameter (the gradient norm)."""
    per_layer = 2 * (config.hidden_size + config.intermediate_size)
    return config.num_hidden_layers * per_layer + 2 * config.vocab_size + args.batch_size * args.seq_length + params


def first_not_finite(got: dict) -> str | None:
    """What this rank computed that holds a NaN or an infinity, first in the order of the
    step: the loss, a gradient, a gradient after clipping, a weight; else None."""
    if not torch.isfinite(got["loss"]).all():
        return f"the loss is {got['loss'].item()}"
    for kind, what in (("grads", "the gradient of"), ("clipped", "the clipped gradient of"),
                       ("weights", "the weight")):
        for n, t in got[kind].items():
            if not torch.isfinite(t).all():
                return f"{what} {n} is not finite ({t[~torch.isfinite(t)].flatten()[0].item()})"
    return None


def ratio(a, b, tolerance) -> float:
    """max over elements of |a - b| / tolerance (0 where a == b)."""
    diff = (a - b).abs()
    return torch.where(diff == 0, 0.0, diff / tolerance).max().item()


def compare(key: str, step: int, got: dict, ref: dict, before: dict) -> tuple[dict, list]:
    """This rank's figures for one layout and step against the reference: per kind, the
    largest difference over its tolerance, and the failures (on this rank)."""
    tol, figures, failures = ref["tolerance"], {}, []
    checks = [("loss", "the loss", {"loss": got["loss"]}, {"loss": ref["loss"]}, {"loss": tol["loss"]}),
              ("grads", "the gradient of", got["grads"], ref["grads"], tol["grads"]),
              ("clipped", "the clipped gradient of", got["clipped"], ref["clipped"], tol["clipped"]),
              ("weights", "the weight", got["weights"], before, tol["weights"])]
    for kind, what, mine, theirs, tolerance in checks:
        worst, name = max((ratio(mine[n], theirs[n], tolerance[n]), n) for n in mine)
        figures[kind] = worst
        if not worst <= 1:
            diff = (mine[name] - theirs[name]).abs().max().item()
            label = what if kind == "loss" else f"{what} {name}"
            failures.append(f"{key}: step {step}: {label} differs from chapter 01's by {diff:.3g}, "
                            f"{worst:.3g} times the tolerance")
    figures["weights_abs"] = max((got["weights"][n] - before[n]).abs().max().item() for n in got["weights"])
    return figures, failures


def prove(args, config, group, batches, todo):
    """Every layout, step by step from the reference's state (weights and AdamW moments),
    against the reference's step. Returns (per-layout figures, failures); stops at once
    at the first value that is not finite."""
    reference = Reference(args, config, group.device)
    trainers = {lay.name: Trainer(lay, args, config, group.device) for lay in todo}
    results = {k: {"loss": 0.0, "grads": 0.0, "clipped": 0.0, "weights": 0.0, "weights_abs": 0.0, "vs": None,
                   "vs_weights": 0.0, "vs_weights_abs": 0.0} for k in trainers}
    failures = []
    for step, (x, y) in enumerate(batches, start=1):
        ref = reference.step(x, y, step)
        state = reference.state()
        before = {n: w.clone() for n, (w, _, _) in state.items()}
        finals = {}
        for key, t in trainers.items():
            got = t.step(x, y)
            # 1. nothing that is not finite: the first one found, on any rank, stops the proof
            said = [None] * group.world
            dist.all_gather_object(said, first_not_finite(got) or first_not_finite(
                {"loss": ref["loss"], "grads": {}, "clipped": {}, "weights": {}}))
            if any(said):
                return results, [f"{key}: step {step}: {next(s for s in said if s)}"]
            # 2. the loss, the gradients before and after clipping and the weights within the tolerance
            figures, wrong = compare(key, step, got, ref, before)
            everyone = [None] * group.world
            dist.all_gather_object(everyone, (figures, wrong))
            for kind in figures:
                results[key][kind] = max(results[key][kind], *(f[kind] for f, _ in everyone))
            failures += next((w for _, w in everyone if w), [])  # one rank's lines: the ranks repeat each other
            finals[key] = got["weights"]  # this rank's stage, whole
            t.take(state)  # the next step starts from the reference's state again
        for key, t in trainers.items():
            mine = finals[key]
            # 3. the ranks that hold the same weights (dp replicas, tp ranks) hold the same bits
            digests = [None] * group.world
            dist.all_gather_object(digests, (t.mesh.get_local_rank("pp"), fingerprint(mine)))
            if len(set(digests)) != t.layout.pp:
                failures.append(f"{key}: step {step}: ranks that hold the same weights differ")
            # 4. GPipe equals 1F1B, to the bit; torch's layout equals ours
            twin = key.replace("-gpipe-", "-1f1b-") if "-gpipe-" in key else None
            if twin in finals:
                differ = max_over_ranks(float(any(not torch.equal(mine[n], finals[twin][n]) for n in mine)),
                                        group.device)
                if differ:
                    failures.append(f"{key}: step {step}: GPipe's weights differ from 1F1B's")
            ours = key.replace("-torch", "-scratch") if key.endswith("-torch") else None
            if ours in finals:
                r = results[key]
                vs = max_over_ranks(max((mine[n] - finals[ours][n]).abs().max().item() for n in mine), group.device)
                vs_over = max_over_ranks(max(ratio(mine[n], finals[ours][n], ref["tolerance"]["weights"][n])
                                             for n in mine), group.device)
                r["vs"], r["vs_weights_abs"], r["vs_weights"] = ours, max(r["vs_weights_abs"], vs), \
                    max(r["vs_weights"], vs_over)
                if not vs_over <= 2:  # each within the tolerance of the reference: within twice of each other
                    failures.append(f"{key}: step {step}: its weights differ from {ours}'s by {vs:.3g}, "
                                    f"{vs_over:.3g} times the tolerance")
        if group.rank == 0:
            print(f"step {step}: loss {ref['loss'].item():.6f}, gradient norm {ref['norm'].item():.6f}", flush=True)
    return results, failures


def report(args, group, results, failures, run_dir):
    """Rank 0: the table, the verdict, prove.json."""
    rows = ["| layout | loss / tol | gradients / tol | clipped / tol | weights / tol | largest weight difference "
            "| vs | its difference | / tol |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for key, r in results.items():
        vs = f"{r['vs']} | {r['vs_weights_abs']:.2g} | {r['vs_weights']:.2g}" if r["vs"] else "| |"
        rows.append(f"| {key} | {r['loss']:.2g} | {r['grads']:.2g} | {r['clipped']:.2g} | {r['weights']:.2g} | "
                    f"{r['weights_abs']:.2g} | {vs} |")
    print("\n" + "\n".join(rows) + "\n", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "prove.json").write_text(json.dumps(
        {"world_size": group.world, "args": vars(args), "passed": not failures, "failures": failures,
         "layouts": results}, indent=1) + "\n")
    print(f"outputs in {run_dir}", flush=True)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    else:
        print(f"OK: every layout's loss, gradients (before and after clipping) and weights equal chapter 01's "
              f"after each of {args.proof_steps} fp64 steps from the same state, within the tolerance; GPipe's "
              f"weights equal 1F1B's bit for bit; torch's pipelines equal this chapter's bit for bit, its tensor "
              f"parallelism within twice the tolerance", flush=True)


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
