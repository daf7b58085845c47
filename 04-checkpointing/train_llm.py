"""Chapter 04: chapter 03 plus checkpoints: exact resume, atomic saves, restarts.

Every --ckpt-freq steps (and at the end) the whole training state is written into a
temporary folder, renamed into place and pointed at by `latest`. Starting the same
command again resumes from the newest checkpoint that loads, at the exact data
position, and continues with exactly the losses an uninterrupted run would have.

    torchrun --standalone --nproc-per-node=2 04-checkpointing/train_llm.py --experiment-name run1
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 04-checkpointing/train_llm.py \
        --experiment-name run2 --ckpt-freq 10 --crash-at-step 15     # survives a crash
"""

import atexit
import gc
import inspect
import itertools
import json
import math
import os
import random
import shutil
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Sampler
from tqdm import tqdm

# Runnable from the repo root or from inside this folder, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.cli import UsageError, base_parser, check_args, fail, setup_logging  # noqa: E402
from common.data import IGNORE_INDEX, DataError, build_datasets, check_enough_samples, dataset_info  # noqa: E402
from common.masks import build_attention_mask  # noqa: E402
from common.metrics import (MetricsWriter, PhaseTimer, StepStats, build_summary,  # noqa: E402
                            environment_info, find_baseline, read_metrics, throughput_table,
                            write_json, write_jsonl)
from common.model import LlamaForCausalLM, describe, flops_per_token, get_config, num_parameters  # noqa: E402

CHAPTER = "04-checkpointing"


def parse_args(argv=None):
    parser = base_parser(CHAPTER, "Chapter 04: checkpoints, exact resume, surviving crashes.")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step; the gradient all-reduce runs "
                             "only on the last one")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds a collective may wait for the other ranks before failing")
    parser.add_argument("--baseline", default=None,
                        help="chapter 01 summary.json for the scaling efficiency (default: the "
                             "latest matching one under --save-dir)")
    parser.add_argument("--ckpt-freq", type=int, default=25,
                        help="save a checkpoint every N steps (and always at the end); 0 = only at the end")
    parser.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep")
    parser.add_argument("--sharded", action="store_true",
                        help="save model and optimizer with torch.distributed.checkpoint, "
                             "each rank writing its part")
    parser.add_argument("--fresh", action="store_true",
                        help="ignore existing checkpoints and start at step 0 (the old run's "
                             "files are moved into an archive-* folder, not deleted)")
    parser.add_argument("--resume-from", default=None,
                        help="resume from this checkpoint folder instead of the latest")
    parser.add_argument("--crash-at-step", type=int, default=None,
                        help="fault injection: the last rank fails once, after this step")
    args = parser.parse_args(argv)
    try:
        # the run folder may exist: that is how a run resumes
        check_args(args, run_dir_must_be_new=False)
    except UsageError as e:
        fail(str(e))
    if args.ckpt_freq < 0:
        fail(f"--ckpt-freq must not be negative (got {args.ckpt_freq})")
    if args.keep_last < 1:
        fail(f"--keep-last must be at least 1 (got {args.keep_last})")
    if args.crash_at_step is not None and args.crash_at_step < 1:
        fail(f"--crash-at-step must be at least 1 (got {args.crash_at_step})")
    if args.fresh and args.resume_from:
        fail("--fresh and --resume-from contradict each other; pick one")
    if args.resume_from and not (Path(args.resume_from) / "state.pt").is_file():
        fail(f"--resume-from {args.resume_from!r} is not a checkpoint folder (no state.pt)")
    if args.device not in ("auto", "cpu", "cuda"):
        fail(f"--device {args.device}: each process takes the GPU of its LOCAL_RANK; use "
             f"auto, cuda or cpu (CUDA_VISIBLE_DEVICES chooses which GPUs)")
    if args.grad_accum < 1:
        fail(f"--grad-accum must be at least 1 (got {args.grad_accum})")
    if not args.timeout > 0:
        fail(f"--timeout must be positive (got {args.timeout})")
    if args.baseline is not None and not os.path.isfile(args.baseline):
        fail(f"--baseline {args.baseline!r} does not exist")
    return args


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warmup to the peak, then cosine decay to min_ratio × peak at the last step."""
    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def compute_loss(model, x, y, attn_mask):
    logits = model(x, attn_mask)
    # mean over the real target tokens; padding targets are IGNORE_INDEX
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)


@torch.no_grad()
def evaluate(model, loader, device, autocast, max_batches, pad_id, padded):
    model.eval()
    total, count = 0.0, 0
    for i, (x, y) in enumerate(loader):
        if i == max_batches:
            break
        x, y = x.to(device), y.to(device)
        mask = build_attention_mask(x, pad_id) if padded else None
        with autocast:
            loss = compute_loss(model, x, y, mask)
        n = int((y != IGNORE_INDEX).sum())
        total, count = total + loss.item() * n, count + n
    model.train()
    return total / count if count else None


# ---- checkpoints -----------------------------------------------------------------------
FORMAT_VERSION = 1
# Flags that change what training computes. A checkpoint resumes only a run started with
# the same ones; anything else would silently train something different.
MUST_MATCH = ("dataset_name", "dataset_subset", "text_column", "tokenizer", "vocab_size",
              "padded", "model_preset", "seq_length", "lr", "weight_decay", "warmup_steps",
              "num_epochs", "max_steps", "seed")


class ResumableSampler(Sampler):
    """This rank's DistributedSampler order, starting `start` samples in: a resumed run
    skips the samples it already trained on without even loading them."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def set_epoch(self, epoch, start=0):
        self.sampler.set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self):
        return len(self.sampler) - self.start


def rng_states(device):
    """Every random generator this rank could draw from."""
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states, device):
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"].cpu())
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


def fsync_write(path, write):
    """Write a file and force it to disk: a rename is only as durable as its contents."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the renames inside it durable
    finally:
        os.close(fd)


def checkpoint_candidates(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, newest first. Half-written ones are still named .tmp-*, so
    never listed; a step-* folder newer than `latest` (a kill between the rename and
    the pointer update) is complete, so it comes first too."""
    found = sorted(ckpt_dir.glob("step-*"), reverse=True) if ckpt_dir.is_dir() else []
    return [p for p in found if p.is_dir()]


def save_checkpoint(ckpt_dir: Path, step: int, state: dict, model, optimizer, *, sharded,
                    keep_last, rank, distributed):
    """Write into .tmp-step-N, rename to step-N (atomic), then repoint `latest`. A kill
    at any moment leaves the previous checkpoint and pointer untouched."""
    tmp, final = ckpt_dir / f".tmp-step-{step:08d}", ckpt_dir / f"step-{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier kill
        tmp.mkdir(parents=True)
    if distributed:
        dist.barrier()  # the folder exists before anyone writes into it
    if sharded:
        # Each rank writes its part; replicated DDP tensors are written once, spread
        # over the ranks. (The folder must be on storage every rank can reach.)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=tmp / "sharded")
    else:
        # DDP replicas are identical: rank 0's copy is everyone's.
        state = {**state, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if rank == 0:
        fsync_write(tmp / "state.pt", lambda f: torch.save(state, f))
        if final.exists():  # the same step saved before a crash: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)                           # the commit point
        fsync_write(ckpt_dir / "latest.tmp", lambda f: f.write(final.name.encode()))
        os.replace(ckpt_dir / "latest.tmp", ckpt_dir / "latest")
        fsync_dir(ckpt_dir)
        for old in sorted(ckpt_dir.glob("step-*"))[:-keep_last]:
            shutil.rmtree(old)                          # keep the newest keep_last
    if distributed:
        dist.barrier()  # nobody trains on while the checkpoint is incomplete
    return final


def load_checkpoint(path: Path, model, optimizer, device):
    """weights_only=True: tensors and plain containers only, never arbitrary pickled
    objects; map_location: onto this rank's device, not the device that saved it."""
    state = torch.load(path / "state.pt", map_location=device, weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"format version {state.get('format_version')}, expected {FORMAT_VERSION}")
    if state["sharded"]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path / "sharded")
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    return state


def init_process_group_for_restarts(backend, timeout):
    """init_process_group on a store namespaced by torchrun's restart count. torchrun
    keeps one store across restarts, still holding the dead workers' addresses; without
    the prefix a restarted gloo group tries to reach them and times out (torch 2.13)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{restart}", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main():
    # ---- arguments and environment -------------------------------------------------
    args = parse_args()

    # ---- process group: one process per device, started by torchrun ----------------
    # torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Plain
    # `python` sets none of them: world size 1, no process group needed.
    distributed = "RANK" in os.environ
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if distributed:
        backend = "nccl" if use_cuda else "gloo"  # nccl for GPUs, gloo for CPUs
        if use_cuda:
            torch.cuda.set_device(local_rank)  # else every process would use GPU 0
        init_process_group_for_restarts(backend, timedelta(seconds=args.timeout))
        # leave the group on any exit, error included, so no peer waits for us
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        backend, rank, world_size = None, 0, 1
    log = setup_logging(rank)  # rank 0 informs; other ranks speak only on trouble
    log.info("environment: %s", json.dumps(environment_info()))
    log.info("arguments: %s", json.dumps(vars(args)))

    # ---- device, dtype, seed -------------------------------------------------------
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    # bf16 autocast: matmuls in bf16, weights and optimizer state stay fp32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
    random.seed(args.seed)
    torch.manual_seed(args.seed)  # same seed on every rank: same initial weights
    log.info("rank %d of %d, local rank %d, device %s, backend %s, dtype %s, seed %d",
             rank, world_size, local_rank, device, backend, dtype, args.seed)

    # ---- data ----------------------------------------------------------------------
    # Rank 0 trains the tokenizer and tokenizes the corpus once; the others wait for
    # its word (the broadcast below) and then read the cache it wrote.
    def load_data():
        data = build_datasets(args.dataset_name, args.seq_length, packed=not args.padded,
                              vocab_size=args.vocab_size, tokenizer_path=args.tokenizer,
                              subset=args.dataset_subset, text_column=args.text_column,
                              cache_dir=args.cache_dir)
        check_enough_samples(data.train, args.batch_size * world_size * args.grad_accum)
        return data
    error, data = None, None
    if rank == 0:
        try:
            data = load_data()
        except DataError as e:
            error = str(e)
    if distributed:
        box = [error]
        dist.broadcast_object_list(box, src=0)  # every rank learns whether rank 0 failed
        error = box[0]
    if error:
        fail(error)
    if rank != 0:
        data = load_data()
    log.info("data: %s", json.dumps(dataset_info(data)))
    # Each rank takes every world_size-th sample of one shared shuffle (seed + epoch),
    # so the ranks' batches together form exactly chapter 01's batch of world_size × B.
    # drop_last: every rank gets the same number of samples, hence of steps; uneven
    # ranks would leave one waiting forever in an all-reduce the others never start.
    sampler = ResumableSampler(DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                                  shuffle=True, seed=args.seed, drop_last=True))
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler,
                        drop_last=True,  # every step sees a full batch
                        num_workers=args.num_workers, pin_memory=device.type == "cuda")
    val_loader = DataLoader(data.val, batch_size=args.batch_size, num_workers=0)

    # ---- model ---------------------------------------------------------------------
    config = get_config(args.model_preset, data.vocab_size)
    model = LlamaForCausalLM(config).to(device)
    n_params = num_parameters(model)
    log.info("model: %s preset, %.2f M parameters (%s)", args.model_preset, n_params / 1e6,
             describe(config))
    raw_model = model  # the bare module: its weights are what we save
    if distributed:
        # DDP broadcasts rank 0's weights to every rank, then registers hooks that
        # all-reduce gradients bucket by bucket while backward is still running.
        # Our only buffers are the constant RoPE tables: no need to re-send them
        # before every forward (the flag was renamed in recent torch versions).
        no_buffer_sync = ({"forward_sync_buffers": False}
                          if "forward_sync_buffers" in inspect.signature(DDP).parameters
                          else {"broadcast_buffers": False})
        model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None,
                    **no_buffer_sync)

    # ---- optimizer and schedule ----------------------------------------------------
    # No weight decay on norm weights (1-D); fused AdamW does the update in a few
    # kernels instead of several per parameter on CUDA.
    decay = [p for p in raw_model.parameters() if p.dim() >= 2]
    no_decay = [p for p in raw_model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    steps_per_epoch = len(loader) // args.grad_accum
    total_steps = args.num_epochs * steps_per_epoch
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, total_steps))
    global_batch = args.batch_size * world_size * args.grad_accum
    tokens_per_step = global_batch * args.seq_length  # processed, padding included
    log.info("training %d steps (%d per epoch); global batch %d = batch %d x world %d x "
             "grad-accum %d, %d tokens per step", total_steps, steps_per_epoch, global_batch,
             args.batch_size, world_size, args.grad_accum, tokens_per_step)

    # ---- resume: the newest checkpoint that loads ------------------------------------
    run_dir = Path(args.save_dir) / args.experiment_name
    ckpt_dir = run_dir / "checkpoints"
    start_step, start_epoch, start_in_epoch, resumed_from, load_s = 0, 0, 0, None, None
    if args.fresh and rank == 0 and run_dir.is_dir() and any(run_dir.iterdir()):
        # a fresh start never destroys the old run: it moves into an archive folder
        archive = run_dir / f"archive-{time.strftime('%Y%m%d-%H%M%S')}"
        archive.mkdir()
        for item in list(run_dir.iterdir()):
            if not item.name.startswith("archive-"):
                os.rename(item, archive / item.name)
        log.info("--fresh: moved the previous run's files into %s", archive)
    candidates = [] if args.fresh else (
        [Path(args.resume_from)] if args.resume_from else checkpoint_candidates(ckpt_dir))
    for path in candidates:
        t0 = time.perf_counter()
        try:
            state = load_checkpoint(path, raw_model, optimizer, device)
            ok = 1
        except Exception as e:  # truncated, corrupt, wrong format: try the one before
            log.warning("checkpoint %s failed to load (%s: %s); falling back to the previous one",
                        path, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            ok = 0
        if distributed:  # all ranks must resume from the same checkpoint
            flag = torch.tensor(ok, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = int(flag.item())
        if not ok:
            continue
        saved = state["args"]
        changed = [f"--{k.replace('_', '-')} {saved.get(k)} -> {getattr(args, k)}"
                   for k in MUST_MATCH if saved.get(k) != getattr(args, k)]
        if state["global_batch"] != global_batch:
            changed.append("global batch (batch x world size x grad-accum): "
                           f"{state['global_batch']} -> {global_batch}")
        if changed:
            fail(f"checkpoint {path} belongs to a run with different settings ({', '.join(changed)}); "
                 f"use the same flags, --fresh, or another --experiment-name")
        # Same global batch, so batch k is the same samples whatever the world size.
        if state["world_size"] != world_size:
            log.warning("resuming a run saved by %d processes with %d; global batch unchanged, "
                        "so the data order continues exactly", state["world_size"], world_size)
        scheduler.load_state_dict(state["scheduler"])
        set_rng_states(state["rng"][rank % len(state["rng"])], device)
        start_step, start_epoch, start_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        resumed_from, load_s = str(path), time.perf_counter() - t0
        log.info("resumed from %s: step %d, epoch %d, %d steps into it (loaded in %.2f s)",
                 path, start_step, start_epoch, start_in_epoch, load_s)
        break
    else:
        if args.resume_from:
            fail(f"--resume-from {args.resume_from!r} could not be loaded (see the warning above)")
        if candidates:
            log.warning("no checkpoint could be loaded; starting from step 0")
    if start_step >= total_steps:
        log.info("this run already finished (step %d of %d); nothing to do", start_step, total_steps)
        if distributed:
            del model  # as at the end of main(): free DDP before its process group
            gc.collect()
            dist.destroy_process_group()
        return

    # ---- outputs (created only now: bad input above leaves nothing behind) ---------
    if rank == 0:  # one writer
        run_dir.mkdir(parents=True, exist_ok=True)
        if start_step:  # drop lines logged after the checkpoint: they are redone now
            kept = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] <= start_step] \
                if (run_dir / "metrics.jsonl").exists() else []
            write_jsonl(run_dir / "metrics.jsonl", kept)
        metrics = MetricsWriter(run_dir / "metrics.jsonl", append=bool(start_step))
    saves = []

    # ---- the training loop ---------------------------------------------------------
    timer, stats = PhaseTimer(device), StepStats()
    step, t_start = start_step, time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    window_tokens, window_time = 0, 0.0
    bar = tqdm(total=total_steps, initial=start_step, desc=CHAPTER,
               disable=None if rank == 0 else True, dynamic_ncols=True)
    model.train()
    for epoch in range(start_epoch, args.num_epochs):
        # a new order every epoch, the same in every run; a resumed epoch starts where
        # the checkpoint left it (samples = steps done x micro-batches x batch)
        done = start_in_epoch if epoch == start_epoch else 0
        sampler.set_epoch(epoch, start=done * args.grad_accum * args.batch_size)
        batches = iter(loader)
        for in_epoch in range(done, steps_per_epoch):
            if step == total_steps:
                break
            timer.reset()
            loss_sum.zero_()
            for micro in range(args.grad_accum):
                with timer.phase("data"):
                    x, y = next(batches)
                    x = x.to(device, non_blocking=True)
                    y = y.to(device, non_blocking=True)
                    attn_mask = build_attention_mask(x, data.pad_id) if args.padded else None
                # Only the last micro-batch's backward all-reduces; the others just
                # accumulate local gradients (what `with model.no_sync():` does). It must
                # be set before the forward pass, where DDP prepares the reduction.
                if distributed:
                    model.require_backward_grad_sync = micro == args.grad_accum - 1
                with timer.phase("forward"):
                    with autocast:
                        loss = compute_loss(model, x, y, attn_mask) / args.grad_accum
                with timer.phase("backward"):
                    loss.backward()
                loss_sum += loss.detach()  # stays on the device: no host sync per step
            with timer.phase("update"):
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            step += 1
            stats.add(timer.times, tokens_per_step)
            window_tokens += tokens_per_step
            window_time += sum(timer.times.values())
            bar.update()

            if step % args.log_freq == 0 or step == total_steps:
                # The mean over the whole global batch: average the ranks' means (every
                # rank holds the same number of tokens). Every rank joins this
                # all-reduce, on the same steps; .item() waits for it.
                if distributed:
                    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
                    loss_sum /= world_size
                if rank == 0:
                    record = {"step": step, "epoch": epoch, "loss": loss_sum.item(),
                              "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm.item(),
                              "tokens_per_s": window_tokens / window_time,
                              **{f"{k}_s": v for k, v in timer.times.items()},
                              "elapsed_s": time.perf_counter() - t_start}
                    metrics.write(record)
                    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
                    log.info("step %d/%d | loss %.4f | lr %.2e | %.0f tokens/s", step, total_steps,
                             record["loss"], record["lr"], record["tokens_per_s"])
                window_tokens, window_time = 0, 0.0

            if step == total_steps or (args.ckpt_freq and step % args.ckpt_freq == 0):
                t0 = time.perf_counter()
                # RNG states differ per rank: gather them so that one file holds them all
                rngs = [rng_states(device)]
                if distributed:
                    rngs = [None] * world_size
                    dist.all_gather_object(rngs, rng_states(device))
                finished_epoch = in_epoch + 1 == steps_per_epoch
                state = {"format_version": FORMAT_VERSION, "step": step,
                         # where the next step starts: epoch and steps done inside it
                         "epoch": epoch + 1 if finished_epoch else epoch,
                         "step_in_epoch": 0 if finished_epoch else in_epoch + 1,
                         "sampler": {"seed": args.seed, "epoch": epoch},
                         "scheduler": scheduler.state_dict(), "world_size": world_size,
                         "global_batch": global_batch, "sharded": args.sharded,
                         "args": dict(vars(args)), "rng": rngs}
                path = save_checkpoint(ckpt_dir, step, state, raw_model, optimizer,
                                       sharded=args.sharded, keep_last=args.keep_last,
                                       rank=rank, distributed=distributed)
                if rank == 0:
                    saves.append((dir_size_mb(path), time.perf_counter() - t0))
                    log.info("checkpoint %s: %.1f MB in %.2f s", path, *saves[-1])

            if step == args.crash_at_step and rank == world_size - 1:
                marker = run_dir / f"crash-injected-at-step-{step}"
                if not marker.exists():  # once: a restarted or resumed run goes on
                    marker.touch()
                    raise RuntimeError(f"injected crash after step {step} (--crash-at-step) "
                                       f"on rank {rank}")
    bar.close()

    # ---- validation, sample, weights, summary (rank 0) -----------------------------
    # The replicas are identical, so rank 0 alone evaluates the bare module (a DDP
    # forward would expect every rank) and writes the files.
    if rank == 0:
        metrics.close()
        final_loss = loss_sum.item()
        val_loss = evaluate(raw_model, val_loader, device, autocast, args.val_batches, data.pad_id, args.padded)
        log.info("validation loss %s over %d batches",
                 f"{val_loss:.4f}" if val_loss is not None else "n/a", args.val_batches)
        prompt = ([data.bot_id] if args.padded else []) + data.tokenizer.encode("def ").ids
        raw_model.eval()
        with autocast:
            out = raw_model.generate(torch.tensor([prompt], device=device), max_new_tokens=48,
                                     generator=torch.Generator(device).manual_seed(args.seed),
                                     eos_id=data.eot_id)
        log.info("sample:\n%s", data.tokenizer.decode(out[0].tolist()))

        # The bare module's weights (no "module." prefix): they load into a plain model.
        torch.save(raw_model.state_dict(), run_dir / "model.pt")
        summary = build_summary(
            chapter=CHAPTER, args=args, world_size=world_size, device=device, dtype=dtype,
            num_params=n_params, flops_per_token=flops_per_token(config, n_params, args.seq_length),
            stats=stats, tokens_per_step=tokens_per_step, final_loss=final_loss, val_loss=val_loss,
            wall_time_s=time.perf_counter() - t_start, num_devices=world_size, backend=backend,
            extra={"global_batch_size": global_batch, "grad_accum": args.grad_accum,
                   "data": dataset_info(data), "resumed_from": resumed_from,
                   "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))})
        if saves:
            size_mb = saves[-1][0]
            save_s = sum(t for _, t in saves) / len(saves)
            summary["checkpoint"] = {"count": len(saves), "size_mb": size_mb, "save_s": save_s,
                                     "save_mb_per_s": size_mb / save_s, "load_s": load_s,
                                     "sharded": args.sharded}
        if resumed_from:
            summary.setdefault("notes", []).append(f"resumed from {resumed_from} at step {start_step}")
        # Scaling efficiency: tokens/s per process here over chapter 01's tokens/s with
        # the same per-process batch (1.0 = perfect linear scaling).
        baseline = find_baseline(args.baseline or args.save_dir, summary)
        if baseline:
            summary["scaling_efficiency"] = summary["tokens_per_s_per_device"] / baseline["tokens_per_s"]
            summary["baseline"] = f"{baseline['chapter']} run {baseline['experiment_name']!r}"
        write_json(run_dir / "summary.json", summary)
        print(f"\n{throughput_table(summary)}\n\noutputs in {run_dir}", flush=True)
    if distributed:
        dist.barrier()  # nobody leaves while rank 0 may still need the group
        # Free DDP (its reducer holds the group) while the group is alive, then destroy
        # the group. Left to interpreter exit, the two teardowns can deadlock in gloo.
        del model
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
