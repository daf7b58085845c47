"""Chapter 06, the proof: model-parallel training equals chapter 01's training.

One launch checks every layout its world size allows (dp x pp x tp), from scratch and
with torch's APIs, GPipe and 1F1B, against chapter 01's arithmetic on the same global
batch: the whole model, one process, AdamW, clipping at 1.0, the loss the global token
mean. Everything in fp64, on random tokens over a --vocab-size vocabulary (the
arithmetic does not depend on the text; an odd size splits unevenly over tp ranks).
Each step starts every layout from the reference's weights and AdamW moments; after it,
every weight must equal the reference's within the rounding bound of
`Reference.bounds`, the ranks that hold the same weights must hold the same bits, GPipe
must equal 1F1B bit for bit, and torch's layouts must equal ours; else exit status 1.

    torchrun --standalone --nproc-per-node=2 06-model-parallel/prove.py --model-preset tiny
    torchrun --standalone --nproc-per-node=4 06-model-parallel/prove.py
"""

import json
import math
import os
import sys
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

# Runnable from the repo root or from inside this folder, installed or not.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from tensor_parallel import full_weight, local, local_slice  # noqa: E402
from train_llm import all_reduce_gradients, clip_grad_norm, compute_loss, split_model  # noqa: E402
from common.cli import check_seq_length, non_negative_int, one_of, positive_float, positive_int  # noqa: E402
from common.demos import exact_kernels, script_parser, start_demo  # noqa: E402
from common.distributed import gc_and_destroy_process_group  # noqa: E402
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main  # noqa: E402
from common.model import PRESETS, LlamaForCausalLM, RMSNorm, get_config  # noqa: E402
from common.runfolder import claim_run_folder  # noqa: E402
from common.training import build_optimizer  # noqa: E402

BETAS, EPS = (0.9, 0.95), 1e-8  # build_optimizer's AdamW: the bound depends on them


# ---- from chapter 05's proof.py (05-collectives/proof.py), repeated here so that this
# chapter reads on its own ---------------------------------------------------------------

def max_over_ranks(value: float, device) -> float:
    """The largest of every rank's `value` (a collective: every rank calls it)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def adam_ratio_bound(betas: tuple[float, float], step: int) -> float:
    """An upper bound on |m_hat / sqrt(v_hat)| at AdamW step `step` (1-based), whatever
    the gradients (Cauchy-Schwarz on AdamW's two moving averages): 1 at step 1."""
    b1, b2 = betas
    series = sum((b1 * b1 / b2) ** k for k in range(step))
    return (1 - b1) * math.sqrt((1 - b2 ** step) * series) / ((1 - b1 ** step) * math.sqrt(1 - b2))


def layouts(world: int, config, batch: int) -> list[Namespace]:
    """Every layout of `world` ranks that splits the model (tp and pp alone and together,
    dp beside them), from scratch and with torch's APIs, each pipeline in both schedules
    with one sample per micro-batch (the most micro-batches: the most reordering)."""
    out = []
    for tp in range(1, config.num_key_value_heads + 1):
        for pp in range(1, config.num_hidden_layers + 1):
            if world % (tp * pp) or tp * pp == 1 or config.num_key_value_heads % tp:
                continue
            dp = world // (tp * pp)
            if batch % dp:
                continue
            for api in ("scratch", "torch"):
                for schedule in ("gpipe", "1f1b") if pp > 1 else ("1f1b",):
                    if api == "torch" and schedule == "1f1b" and batch // dp < pp:
                        continue  # torch's 1F1B needs a micro-batch per stage at least
                    out.append(Namespace(dp=dp, pp=pp, tp=tp, api=api, schedule=schedule,
                                         microbatches=batch // dp if pp > 1 else 1))
    return out


def name(layout) -> str:
    """e.g. pp2xtp2-1f1b-torch (the parts above 1, the schedule where there is a pipeline)."""
    shape = "x".join(f"{k}{getattr(layout, k)}" for k in ("dp", "pp", "tp") if getattr(layout, k) > 1)
    return "-".join([shape, *([layout.schedule] if layout.pp > 1 else []), layout.api])


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
    p.add_argument("--seed", type=non_negative_int, default=0, help="weights and tokens")
    p.add_argument("--proof-steps", type=positive_int, default=3, help="fp64 steps of every layout")
    p.add_argument("--layers", type=positive_int, default=None,
                   help="decoder layers, instead of the preset's (a deeper pipeline needs more)")
    p.add_argument("--layouts", type=lambda text: [t.strip() for t in text.split(",") if t.strip()],
                   default=None, help="comma list of layouts to prove, by name (pp2xtp2-1f1b-torch) or "
                   "by their first parts (pp2xtp2: all its variants); default: every one the world allows")

    def check(args):  # after the torchrun check: it needs the world size
        check_seq_length(args)
        preset = PRESETS[args.model_preset]
        shape = Namespace(num_key_value_heads=preset["num_key_value_heads"],
                          num_hidden_layers=args.layers or preset["num_hidden_layers"])
        every = [name(lay) for lay in layouts(int(os.environ["WORLD_SIZE"]), shape, args.batch_size)]
        unknown = [w for w in args.layouts or [] if not any(chosen(k, [w]) for k in every)]
        world = os.environ["WORLD_SIZE"]
        if not every:
            raise UsageError(f"no layout of {world} ranks fits {shape.num_hidden_layers} layers, "
                             f"{shape.num_key_value_heads} KV heads and --batch-size {args.batch_size}")
        if unknown:
            raise UsageError(f"--layouts {','.join(unknown)}: no such layout of {world} ranks here; "
                             f"choose from: {', '.join(every)}")
    p.checks.append(check)
    return p.parse_args(argv)


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

    def step(self, x, y, step: int, terms: int):
        """One step; returns (loss, gradient norm, per-weight bounds: see `bounds`)."""
        loss = compute_loss(self.model(x), y) / y.numel()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        largest = {n: p.grad.abs().max() for n, p in self.model.named_parameters()}  # G of each tensor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item(), norm.item(), self.bounds(step, terms, largest)

    def bounds(self, step: int, terms: int, largest: dict) -> dict:
        """How far rounding alone may move each weight in this step, to first order.

        A layout computes chapter 01's arithmetic with some sums in another order: a
        row-parallel layer adds tp partial sums where one matmul adds all its inputs, the
        vocabulary-parallel loss adds the exp of its logits in tp parts, micro-batches
        and dp replicas add a weight's gradient in parts, and the global gradient norm
        adds its squares in another order. A sum of n terms, reordered, moves by at most
        2(n - 1) u sum|terms| (u = 2^-53, fp64's unit of rounding). Counting every such
        term on a gradient's way (`terms`: both directions through each layer's row-
        parallel inputs, h + i each; the vocabulary twice; the batch's tokens; and every
        parameter, for the norm) and taking each term at most the largest gradient of
        the tensor, G (first order: a freshly initialised, normalised network does not
        amplify rounding), a gradient element moves by delta <= 2 terms u G. AdamW turns
        that into a weight change of at most lr (1 + A_t) delta / (sqrt(v_hat) + eps), per
        element: from the same moments, m_hat moves by (1 - b1) / (1 - b1^t) delta <= delta,
        sqrt(v_hat) by sqrt((1 - b2) / (1 - b2^t)) delta <= delta, and |m_hat| <= A_t
        sqrt(v_hat) (adam_ratio_bound). The denominator is the element's
        own: where a gradient is large, rounding is small beside it."""
        lr, (_, beta2) = self.optimizer.param_groups[0]["lr"], BETAS
        amplify = lr * (1 + adam_ratio_bound(BETAS, step))
        out = {}
        for n, p in self.model.named_parameters():
            v_hat = self.optimizer.state[p]["exp_avg_sq"] / (1 - beta2 ** step)
            out[n] = amplify * 2 * terms * 2.0 ** -53 * largest[n] / (v_hat.sqrt() + EPS)
        return out

    def state(self) -> dict:
        """name -> (weight, AdamW's two moments)."""
        st = self.optimizer.state
        return {n: (p.detach(), st[p]["exp_avg"], st[p]["exp_avg_sq"]) for n, p in self.model.named_parameters()}


class Layout:
    """One layout's part of the model on this rank, trained as train_llm.py trains it."""

    def __init__(self, layout, args, config, device):
        self.layout = layout
        self.mesh = init_device_mesh(device.type, (layout.dp, layout.pp, layout.tp),
                                     mesh_dim_names=("dp", "pp", "tp"))
        self.dp_rank = self.mesh.get_local_rank("dp")
        torch.manual_seed(args.seed)  # chapter 01's initial weights, then split
        model = fp64_norms(LlamaForCausalLM(config).to(device, torch.float64))
        self.module, self.pipeline, self.loss_fn, self.context = split_model(model, self.mesh, layout, None,
                                                                             device)
        self.optimizer = build_optimizer(self.module, args.lr, 0.1, device)

    def step(self, x, y):
        """train_llm.py's step on this replica's share of the global batch (x, y)."""
        n_tokens, dp = y.numel(), self.layout.dp
        x, y, m = x[self.dp_rank::dp], y[self.dp_rank::dp], self.layout.microbatches  # this replica's share
        with self.context():
            self.pipeline.step(list(zip(x.chunk(m), y.chunk(m), [None] * m)),
                               lambda logits, t: self.loss_fn(logits, t) * dp / n_tokens)
        if dp > 1:
            all_reduce_gradients(self.module.parameters(), self.mesh.get_group("dp"), dp)
        norm = clip_grad_norm(self.module.parameters(), 1.0, self.mesh)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.item()

    @torch.no_grad()
    def full_weights(self) -> dict:
        """name -> the whole tensor, for this rank's stage (tp slices gathered: a collective)."""
        return {n: full_weight(p, self.mesh.get_group("tp")) for n, p in self.module.named_parameters()}

    @torch.no_grad()
    def take(self, state: dict):
        """The reference's weights and AdamW moments, cut as this rank holds them."""
        group = self.mesh.get_group("tp")
        for n, p in self.module.named_parameters():
            weight, avg, avg_sq = state[n]
            local(p).copy_(local_slice(weight, p, group))
            st = self.optimizer.state[p]
            local(st["exp_avg"]).copy_(local_slice(avg, p, group))
            local(st["exp_avg_sq"]).copy_(local_slice(avg_sq, p, group))


def fingerprint(tensors: dict) -> tuple:
    """The bits of this rank's weights, summed as integers per tensor (any changed bit
    changes its sum) with their names: cheap to compare between ranks."""
    return tuple((n, t.contiguous().view(torch.int64).sum().item()) for n, t in sorted(tensors.items()))


def main():
    args = parse_args()
    demo = start_demo(args.timeout)
    try:
        return run(args, demo)
    finally:
        gc_and_destroy_process_group()


def run(args, demo):
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=demo.rank)
    # the global batches of chapter 01 (one process, the whole batch): every rank has them
    ids = torch.randint(0, args.vocab_size, (args.proof_steps, args.batch_size, args.seq_length + 1),
                        generator=torch.Generator().manual_seed(args.seed)).to(demo.device)
    batches = [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in ids]
    config = get_config(args.model_preset, args.vocab_size,
                        **({"num_hidden_layers": args.layers} if args.layers else {}))
    todo = [lay for lay in layouts(demo.world, config, args.batch_size) if chosen(name(lay), args.layouts)]
    if demo.rank == 0:
        print(f"{demo.world} ranks; {args.model_preset} preset; {args.proof_steps} fp64 steps of "
              f"{len(todo)} layouts: {', '.join(name(lay) for lay in todo)}", flush=True)
    with exact_kernels():
        results, failures = prove(args, config, demo, batches, todo)
    if demo.rank == 0:
        report(args, demo, results, failures, run_dir)
    dist.barrier()
    return 1 if failures else 0


def reordered_terms(config, args, params: int) -> int:
    """`Reference.bounds`'s count of the terms a layout may add in another order."""
    per_layer = 2 * (config.hidden_size + config.intermediate_size)
    return config.num_hidden_layers * per_layer + 2 * config.vocab_size + args.batch_size * args.seq_length + params


def ratio(a: dict, b: dict, bounds: dict) -> float:
    """max over elements of |a - b| / bound on this rank (0 where both are equal)."""
    worst = 0.0
    for n in a:
        diff = (a[n] - b[n]).abs()
        worst = max(worst, torch.where(diff == 0, 0.0, diff / bounds[n]).max().item())
    return worst


def prove(args, config, demo, batches, todo):
    """Every layout, step by step from the reference's state (weights and AdamW moments),
    against the reference's step. Returns (per-layout figures, failures)."""
    reference = Reference(args, config, demo.device)
    terms = reordered_terms(config, args, sum(p.numel() for p in reference.model.parameters()))
    trainers = {name(lay): Layout(lay, args, config, demo.device) for lay in todo}
    results = {k: {"max_abs_diff": 0.0, "max_diff_over_bound": 0.0, "vs": None, "vs_diff_over_bound": 0.0}
               for k in trainers}
    failures = []
    for step, (x, y) in enumerate(batches, start=1):
        loss, norm, bounds = reference.step(x, y, step, terms)
        state = reference.state()
        before = {n: w.clone() for n, (w, _, _) in state.items()}
        finals = {}
        for key, t in trainers.items():
            t.step(x, y)
            finals[key] = t.full_weights()  # this rank's stage, whole
            t.take(state)  # the next step starts from the reference's state again
        for key, t in trainers.items():
            r, mine = results[key], finals[key]
            # 1. every weight within the bound of the reference's
            diff = max_over_ranks(max((mine[n] - before[n]).abs().max().item() for n in mine), demo.device)
            over = max_over_ranks(ratio(mine, before, bounds), demo.device)
            r["max_abs_diff"] = max(r["max_abs_diff"], diff)
            r["max_diff_over_bound"] = max(r["max_diff_over_bound"], over)
            if over > 1:
                failures.append(f"{key}: after step {step} a weight differs from chapter 01's by {diff:.3g}, "
                                f"{over:.3g} times the rounding bound")
            # 2. the ranks that hold the same weights (dp replicas, tp ranks) hold the same bits
            digests = [None] * demo.world
            dist.all_gather_object(digests, (t.mesh.get_local_rank("pp"), fingerprint(mine)))
            if len(set(digests)) != t.layout.pp:
                failures.append(f"{key}: after step {step} ranks that hold the same weights differ")
            # 3. GPipe equals 1F1B, to the bit; torch's layout equals ours
            twin = key.replace("-gpipe-", "-1f1b-") if "-gpipe-" in key else None
            if twin in finals:
                same = max_over_ranks(float(any(not torch.equal(mine[n], finals[twin][n]) for n in mine)), demo.device)
                if same:
                    failures.append(f"{key}: after step {step} GPipe's weights differ from 1F1B's")
            ours = key.replace("-torch", "-scratch") if key.endswith("-torch") else None
            if ours in finals:
                vs = max_over_ranks(max((mine[n] - finals[ours][n]).abs().max().item() for n in mine), demo.device)
                vs_over = max_over_ranks(ratio(mine, finals[ours], bounds), demo.device)
                r["vs"], r["vs_max_abs_diff"] = ours, max(r.get("vs_max_abs_diff", 0.0), vs)
                r["vs_diff_over_bound"] = max(r["vs_diff_over_bound"], vs_over)
                if vs_over > 2:  # each within the bound of the reference: within twice of each other
                    failures.append(f"{key}: after step {step} differs from {ours} by {vs:.3g}, "
                                    f"{vs_over:.3g} times the rounding bound")
        if demo.rank == 0:
            print(f"step {step}: loss {loss:.6f}, gradient norm {norm:.6f}", flush=True)
    return results, failures


def report(args, demo, results, failures, run_dir):
    """Rank 0: the table, the verdict, prove.json."""
    rows = ["| layout | largest abs difference | / bound (at most) | vs | its difference | / bound |",
            "| --- | ---: | ---: | --- | ---: | ---: |"]
    for key, r in results.items():
        vs = (f"{r['vs']} | {r['vs_max_abs_diff']:.2g} | {r['vs_diff_over_bound']:.2g}" if r["vs"] else "| | ")
        rows.append(f"| {key} | {r['max_abs_diff']:.2g} | {r['max_diff_over_bound']:.2g} | {vs} |")
    print("\n" + "\n".join(rows) + "\n", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "prove.json").write_text(json.dumps(
        {"world_size": demo.world, "args": vars(args), "passed": not failures, "failures": failures,
         "layouts": results}, indent=1) + "\n")
    print(f"outputs in {run_dir}", flush=True)
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    else:
        print(f"OK: every layout's weights equal chapter 01's after each of {args.proof_steps} fp64 steps "
              f"from the same state, within the rounding bound; GPipe's equal 1F1B's bit for bit; "
              f"torch's equal this chapter's", flush=True)


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
