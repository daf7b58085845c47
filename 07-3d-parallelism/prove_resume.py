"""Chapter 07, the proof of a checkpoint that moves: a run saved at step k in layout A
and resumed in layout B for n more steps trains what an uninterrupted run of k + n steps
trains.

For each move A:B of --moves, in fp64, on random tokens read through the training
script's own sampling (a DistributedSampler over the dp replicas, resumed at the global
batch's position by checkpoint.py's ResumableSampler, an epoch boundary crossed):

1. layout A trains k steps from chapter 01's initial weights, saves a checkpoint
   (checkpoint.py, as train_llm.py saves it), then trains on to step k + n: the
   uninterrupted run;
2. layout B is built afresh and loads the checkpoint: every piece of every weight and
   AdamW moment it holds, each step count, the learning-rate schedule and the data
   position must equal what A saved, bit for bit;
3. B trains n steps: each step's global batch must be the uninterrupted run's, sample
   for sample, and B's weights after them must equal the uninterrupted run's: bit for
   bit when B is A, else within TOLERANCE (the layouts add their sums in other orders).

A and B may have different world sizes: a launch runs the parts whose layout takes its
world size. Each A runs once and saves into <its run folder>/<A>/ (its state whole
beside the checkpoint, for the comparison only); every B of it resumes from there, in a
later launch from the run folder --saved-in names. Any failure: exit status 1.

    torchrun --standalone --nproc-per-node=4 07-3d-parallelism/prove_resume.py --model-preset tiny --moves dp2xtp2:pp2xtp2,dp2xtp2:dp4,dp2xtp2:dp2xtp2
    torchrun --standalone --nproc-per-node=4 07-3d-parallelism/prove_resume.py --model-preset tiny --moves dp2xtp2:dp2 --experiment-name move4
    torchrun --standalone --nproc-per-node=2 07-3d-parallelism/prove_resume.py --model-preset tiny --moves dp2xtp2:dp2 --saved-in outputs/move4
"""

import itertools
import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils.data import DistributedSampler

from checkpoint import ResumableSampler, TrainState, latest_checkpoint, load_checkpoint, replica_start, save_checkpoint
from common.cli import check_seq_length, non_negative_int, one_of, positive_float, positive_int, seed_value
from common.demos import exact_kernels, script_parser, start_group
from common.distributed import gc_and_destroy_process_group
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.model import PRESETS, get_config
from common.runfolder import claim_run_folder
from common.training import lr_lambda
from prove import Trainer, check_layout, layout_of, world_of

# How far B's weights may land from the uninterrupted run's after n steps in another
# layout: a tolerance, not a derived bound (over several steps a rounding difference
# feeds the next gradients). Chosen from what the moves measure, 1e-15 to 1e-14 (the
# largest difference of weights of about 0.02), with room for a larger model; a moment
# or step count left behind, the schedule restarted, a batch skipped land above 1e-6.
TOLERANCE = 1e-11
STEPS_PER_EPOCH = 3  # the random corpus is 3 global batches long: a few steps cross an epoch


def parse_args(argv=None):
    p = script_parser("07-prove-resume", "A checkpoint saved in one layout and resumed in another, "
                      "proven equal to the uninterrupted run, in fp64.", min_world=1)
    p.add_argument("--model-preset", default="tiny", type=one_of(*PRESETS), help="model size")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers, instead of the preset's")
    p.add_argument("--seq-length", type=positive_int, default=16, help="tokens per sample (a multiple of tp)")
    p.add_argument("--batch-size", type=positive_int, default=4, help="samples per step: the global batch")
    p.add_argument("--vocab-size", type=positive_int, default=1001, help="vocabulary of the random tokens")
    p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW's peak learning rate")
    p.add_argument("--seed", type=seed_value, default=0, help="weights, tokens and the shuffle")
    p.add_argument("--save-at", type=positive_int, default=2, help="k: the step A saves at")
    p.add_argument("--then", type=positive_int, default=2, help="n: the steps B trains after it")
    p.add_argument("--warmup-steps", type=non_negative_int, default=1, help="of the schedule (warmup, cosine)")
    p.add_argument("--moves", required=True, type=lambda text: [m.split(":") for m in text.split(",") if m.strip()],
                   help="comma list of A:B, layout names as prove.py takes them (dp2xtp2:pp2xtp2)")
    p.add_argument("--saved-in", default=None, help="the run folder of the launch that ran the A side "
                   "of the moves whose A takes another world size (default: this run's)")

    def check(args):
        check_seq_length(args)
        world, config = int(os.environ["WORLD_SIZE"]), config_of(args)
        for move in args.moves:
            if len(move) != 2:
                raise UsageError(f"--moves: {':'.join(move)!r} is not A:B")
            for name in move:
                layout = layout_of(name)
                check_layout(layout, name, world_of(layout), config, args.batch_size, args.seq_length)
                if layout.api != "torch":
                    raise UsageError(f"--moves: {name}: a checkpoint moves between torch's DTensor layouts only")
            if world not in map(world_of, map(layout_of, move)):
                raise UsageError(f"--moves {':'.join(move)}: neither layout takes {world} ranks")
    p.checks.append(check)
    return p.parse_args(argv)


def config_of(args):
    return get_config(args.model_preset, args.vocab_size, num_hidden_layers=args.layers)


def main():
    args = parse_args()
    group = start_group(args.timeout)
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)  # gathering 2-D shards: a note per rank
    try:
        return run(args, group)
    finally:
        gc_and_destroy_process_group()


class Run:
    """A layout's trainer, its schedule and training state, and its replica's batches."""

    def __init__(self, name: str, args, tokens, group):
        self.name, self.layout = name, layout_of(name)
        self.trainer = Trainer(self.layout, args, config_of(args), group.device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.trainer.optimizer,
                                                           lr_lambda(args.warmup_steps, args.save_at + args.then))
        self.state = TrainState(self.trainer.part, self.trainer.optimizer, self.scheduler)
        self.tokens, self.dp = tokens, self.layout.dp
        self.batch = args.batch_size // self.dp  # per replica: the global batch stays
        self.sampler = ResumableSampler(DistributedSampler(range(len(tokens)), num_replicas=self.dp,
                                                           rank=self.trainer.dp_rank, shuffle=True, seed=args.seed,
                                                           drop_last=True))

    def train(self, steps: int) -> list[list[int]]:
        """`steps` steps from the state's position, as train_llm.py's loop takes them;
        returns the samples of each step's global batch (every replica's, gathered)."""
        read, st, G = [], self.state, self.batch * self.dp
        while len(read) < steps:
            done = st.samples_in_epoch // G  # steps of this epoch already taken
            self.sampler.set_epoch(st.epoch, start=replica_start(st.samples_in_epoch, self.dp))
            order = iter(self.sampler)
            for _ in range(done, min(STEPS_PER_EPOCH, done + steps - len(read))):
                mine = list(itertools.islice(order, self.batch))
                every = [None] * self.dp
                dist.all_gather_object(every, mine, group=self.trainer.mesh.get_group("dp"))
                read.append(sorted(i for share in every for i in share))
                if any(len(share) < self.batch for share in every):  # a replica ran out: read.append says
                    return read + [[]] * (steps - len(read))
                ids = self.tokens[mine]
                self.trainer.backward(ids[:, :-1], ids[:, 1:], G * (ids.shape[1] - 1))
                self.trainer.step_optimizer()
                self.scheduler.step()
                st.step, st.samples_in_epoch = st.step + 1, st.samples_in_epoch + G
            if st.samples_in_epoch // G == STEPS_PER_EPOCH:
                st.epoch, st.samples_in_epoch = st.epoch + 1, 0
        return read

    @torch.no_grad()
    def whole(self, moments: bool) -> dict:
        """Every tensor of the state, whole, on every rank (collectives): this run's
        weights (and AdamW's moments and step counts), named as in chapter 01's model."""
        out = {}
        for n, p in self.trainer.part.named_parameters():
            tensors = {n: p}
            if moments:
                st = self.trainer.optimizer.state[p]
                tensors.update({f"{n}.{k}": st.get(k) for k in ("exp_avg", "exp_avg_sq", "step")})
            out.update({k: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
                        for k, t in tensors.items() if torch.is_tensor(t)})
        stages = [None] * dist.get_world_size()
        dist.all_gather_object(stages, out)  # the other pipeline stages' tensors
        return {k: v for part in stages for k, v in part.items()}


def run(args, group):
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=group.rank)
    tokens = torch.randint(0, args.vocab_size, (STEPS_PER_EPOCH * args.batch_size + 1, args.seq_length + 1),
                           generator=torch.Generator().manual_seed(args.seed))
    settings = {"model_preset": args.model_preset, "layers": args.layers, "vocab_size": args.vocab_size,
                "seed": args.seed, "global batch": args.batch_size}
    results, failures = {}, []
    with exact_kernels():
        for a in dict.fromkeys(a for a, _ in args.moves):  # each saving layout runs once
            if world_of(layout_of(a)) == group.world:
                save_side(args, group, tokens, a, run_dir / a, settings)
        for a, b in args.moves:
            if world_of(layout_of(b)) == group.world:
                folder = run_dir / a if world_of(layout_of(a)) == group.world else Path(args.saved_in or run_dir) / a
                results[f"{a}:{b}"], wrong = resume_side(args, group, tokens, a, b, folder, settings)
                failures += wrong
    if group.rank == 0:
        report(args, results, failures, run_dir)
    dist.barrier()
    return 1 if failures else 0


def save_side(args, group, tokens, a: str, folder: Path, settings: dict):
    """A: k steps, the checkpoint, then n more steps uninterrupted; A's whole state at k
    and its weights at k + n beside the checkpoint, for the resume side to compare."""
    run = Run(a, args, tokens, group)
    read = run.train(args.save_at)
    save_checkpoint(folder / "checkpoints", run.state, settings, a, keep_last=1, rank=group.rank, world=group.world)
    saved = run.whole(moments=True)
    position = {"step": run.state.step, "epoch": run.state.epoch, "samples_in_epoch": run.state.samples_in_epoch,
                "lr_steps": run.scheduler.last_epoch}
    read += run.train(args.then)
    after = run.whole(moments=False)
    if group.rank == 0:
        torch.save({"saved": saved, "position": position, "after": after, "read": read}, folder / "uninterrupted.pt")
    dist.barrier()
    if group.rank == 0:
        print(f"{a}: saved at step {args.save_at}, trained on to step {args.save_at + args.then}", flush=True)


def resume_side(args, group, tokens, a: str, b: str, folder: Path, settings: dict) -> tuple[dict, list]:
    """B: load A's checkpoint, compare with A's state, train n steps, compare with A's
    uninterrupted run. Returns (figures, failures), the same on every rank."""
    if not (folder / "uninterrupted.pt").is_file():
        raise UsageError(f"{folder} holds no saved run of {a}: run this move on {world_of(layout_of(a))} ranks "
                         f"first, then pass its run folder as --saved-in")
    expected = torch.load(folder / "uninterrupted.pt", weights_only=True)
    run = Run(b, args, tokens, group)
    load_checkpoint(latest_checkpoint(folder / "checkpoints"), run.state, settings, rank=group.rank, world=group.world)
    failures, key = [], f"{a}:{b}"
    loaded = run.whole(moments=True)
    moved = [k for k, t in expected["saved"].items() if k not in loaded or not torch.equal(loaded[k], t)]
    if moved:
        failures.append(f"{key}: {len(moved)} tensors loaded in {b} differ from what {a} saved, e.g. {moved[0]}")
    position = {"step": run.state.step, "epoch": run.state.epoch, "samples_in_epoch": run.state.samples_in_epoch,
                "lr_steps": run.scheduler.last_epoch}
    if position != expected["position"]:
        failures.append(f"{key}: the position loaded in {b} is {position}, {a} saved {expected['position']}")
    figures = {"loaded_tensors": len(expected["saved"]), "tensors_moved_wrong": len(moved),
               "weights_max_abs_diff": None, "bit_for_bit_expected": a == b}
    if failures:  # training on from a wrong state proves nothing more
        return figures, failures
    read = run.train(args.then)
    for step, (got, want) in enumerate(zip(read, expected["read"][args.save_at:]), start=args.save_at + 1):
        if got != want:
            failures.append(f"{key}: step {step}'s global batch in {b} holds samples {got}, the uninterrupted "
                            f"run's {want}")
    after = run.whole(moments=False)
    worst = max((after[k] - expected["after"][k]).abs().max().item() for k in expected["after"])
    exact = a == b
    if (exact and worst != 0.0) or not worst <= TOLERANCE:
        failures.append(f"{key}: after step {args.save_at + args.then} the weights differ from the uninterrupted "
                        f"run's by {worst:.3g} ({'bit for bit expected' if exact else f'tolerance {TOLERANCE:g}'})")
    return {**figures, "weights_max_abs_diff": worst}, failures


def report(args, results, failures, run_dir):
    """Rank 0: one line per move, the verdict, prove_resume.json."""
    for key, r in results.items():
        after = r["weights_max_abs_diff"]
        print(f"{key}: {r['loaded_tensors']} tensors loaded, {r['tensors_moved_wrong']} differ; " +
              (f"after step {args.save_at + args.then} the weights differ from the uninterrupted run's by {after:.3g}"
               if after is not None else "not trained on"), flush=True)
    (run_dir / "prove_resume.json").write_text(json.dumps(
        {"args": {**vars(args), "moves": [":".join(m) for m in args.moves]}, "passed": not failures,
         "failures": failures, "moves": results}, indent=1) + "\n")
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr, flush=True)
    elif results:
        print(f"OK: every checkpoint loaded in its new layout holds what the old one saved, bit for bit; the "
              f"resumed runs read the uninterrupted run's batches and end within {TOLERANCE:g} of its weights "
              f"(bit for bit in the same layout)", flush=True)


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
