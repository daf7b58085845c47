"""Chapter 03: chapter 02 with DistributedDataParallel, one process per device.

torchrun starts one process per device; each holds a full replica, trains on its own
slice of every global batch (DistributedSampler), and DDP averages the gradients with
bucketed all-reduces during the backward pass, so every replica stays identical.

    torchrun --standalone --nproc-per-node=2 03-ddp/train_llm.py          # CPU: gloo
    torchrun --standalone --nproc-per-node=8 03-ddp/train_llm.py --model-preset base  # GPUs
"""

import atexit
import gc
import inspect
import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

# Runnable from the repo root or from inside this folder, installed or not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.cli import UsageError, base_parser, check_args, fail, setup_logging  # noqa: E402
from common.data import IGNORE_INDEX, DataError, build_datasets, check_enough_samples, dataset_info  # noqa: E402
from common.masks import build_attention_mask  # noqa: E402
from common.metrics import (MetricsWriter, PhaseTimer, StepStats, build_summary,  # noqa: E402
                            environment_info, find_baseline, throughput_table, write_json)
from common.model import LlamaForCausalLM, describe, flops_per_token, get_config, num_parameters  # noqa: E402

CHAPTER = "03-ddp"


def parse_args(argv=None):
    parser = base_parser(CHAPTER, "Chapter 03: DistributedDataParallel, launched with torchrun.")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per optimizer step; the gradient all-reduce runs "
                             "only on the last one")
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds a collective may wait for the other ranks before failing")
    parser.add_argument("--baseline", default=None,
                        help="chapter 01 summary.json for the scaling efficiency (default: the "
                             "latest matching one under --save-dir)")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except UsageError as e:
        fail(str(e))
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
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
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
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed, drop_last=True)
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

    # ---- outputs (created only now: bad input above leaves nothing behind) ---------
    run_dir = Path(args.save_dir) / args.experiment_name
    if rank == 0:  # one writer
        run_dir.mkdir(parents=True, exist_ok=True)
        metrics = MetricsWriter(run_dir / "metrics.jsonl")

    # ---- the training loop ---------------------------------------------------------
    timer, stats = PhaseTimer(device), StepStats()
    step, t_start = 0, time.perf_counter()
    loss_sum = torch.zeros((), device=device)
    window_tokens, window_time = 0, 0.0
    bar = tqdm(total=total_steps, desc=CHAPTER, disable=None if rank == 0 else True, dynamic_ncols=True)
    model.train()
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)  # a new order every epoch, the same in every run
        batches = iter(loader)
        for _ in range(steps_per_epoch):
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
                   "data": dataset_info(data)})
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
