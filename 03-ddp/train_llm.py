"""Chapter 03: chapter 01 with DistributedDataParallel, one process per device.

torchrun starts one process per device; each holds a full replica, trains on its own
slice of every global batch (DistributedSampler), and DDP averages the gradients with
bucketed all-reduces during the backward pass, so every replica stays identical.

    torchrun --standalone --nproc-per-node=2 03-ddp/train_llm.py          # CPU: gloo
    torchrun --standalone --nproc-per-node=8 03-ddp/train_llm.py --model-preset base  # GPUs
"""

import itertools
import json
import os
import random
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from common.cli import base_parser, positive_int, setup_logging
from common.data import IGNORE_INDEX, build_datasets, check_enough_samples, dataset_info, local_rank0_first, worker_start_method
from common.distributed import DDP_NO_BUFFER_SYNC, backend_for, gc_and_destroy_process_group
from common.environment import environment_info, exit_with_launcher, set_tf32, share_cpu_threads
from common.errors import run_main
from common.masks import build_attention_mask
from common.model import LlamaForCausalLM, describe, flops_per_token, get_config, num_parameters
from common.runfolder import claim_run_folder, save_weights
from common.metrics import Tracker
from common.training import build_optimizer, evaluate, lr_lambda, sample

CHAPTER = "03-ddp"


def parse_args(argv=None):
    # every flag is checked as it is parsed: bad input stops here, before any work
    parser = base_parser(CHAPTER, "Chapter 03: DistributedDataParallel, launched with torchrun.",
                         distributed=True)
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="micro-batches per optimizer step (a larger batch in less memory)")
    return parser.parse_args(argv)


def setup(args):
    """The process group (one process per device), this process's device, the dtype the
    math runs in, the CPU threads, and the seeds. torchrun sets RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT; plain `python` sets none: world size 1, no process group."""
    exit_with_launcher()  # under torchrun: stop (SIGTERM) if torchrun dies, never train as an orphan
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)  # else every process would use GPU 0
    if "RANK" in os.environ:
        backend = backend_for(device)  # nccl for GPUs, gloo for CPUs (LLM_GUIDE_BACKEND=gloo: GPUs too)
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout),
                                device_id=device if backend == "nccl" else None)
    if device.type == "cuda":
        set_tf32(True)  # fp32 matmuls on tensor cores (TF32: 10-bit mantissa, much faster)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    # bf16 autocast: matmuls in bf16, weights and optimizer state stay fp32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
    threads = share_cpu_threads(device)  # like for like: the same CPU threads per machine (a collective under torchrun)
    random.seed(args.seed)
    torch.manual_seed(args.seed)  # same seed on every rank: same initial weights
    if args.deterministic:  # the same bits in every rerun, on GPUs too (chapter 01's README, part 3)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for it
        torch.use_deterministic_algorithms(True)  # kernels without atomics; an op with none stops the run
    return device, dtype, autocast, threads


def load_data(args, device, rank, world_size):
    """The corpus, tokenized once (cached), and this rank's training and validation loaders."""
    def build():
        data = build_datasets(args.dataset_name, args.seq_length, packed=not args.padded,
                              vocab_size=args.vocab_size, tokenizer_path=args.tokenizer,
                              subset=args.dataset_subset, text_column=args.text_column,
                              cache_dir=args.cache_dir)
        check_enough_samples(data.train, args.batch_size * world_size * args.grad_accum)
        return data
    # Local rank 0 of each machine builds the caches first, then the other ranks read
    # them; a data problem on any rank stops every rank here, with one line.
    data = local_rank0_first(build)
    # Each rank takes every world_size-th sample of one shared shuffle (seed + epoch),
    # so the ranks' batches together form exactly chapter 01's batch of world_size × B.
    # drop_last: no rank repeats samples to even out the split (the default pads so).
    sampler = DistributedSampler(data.train, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler,
                        drop_last=True,  # every step sees a full batch
                        num_workers=args.num_workers, pin_memory=device.type == "cuda",
                        multiprocessing_context=worker_start_method(args.num_workers),  # fork on Linux
                        generator=torch.Generator().manual_seed(args.seed))  # not the global RNG
    # Validation is split too: rank r evaluates samples r, r + world_size, ...
    val_sampler = DistributedSampler(data.val, num_replicas=world_size, rank=rank, shuffle=False)
    val_loader = DataLoader(data.val, batch_size=args.batch_size, sampler=val_sampler, num_workers=0)
    return data, sampler, loader, val_loader


def compute_loss(model, x, y, attn_mask):
    logits = model(x, attn_mask)
    # summed over the real target tokens (padding targets are IGNORE_INDEX): the caller
    # divides by the step's count, so micro-batches (and ranks) add up to the token mean
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def main():
    # ---- arguments, device, environment --------------------------------------------
    args = parse_args()
    device, dtype, autocast, threads = setup(args)
    distributed = dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    log = setup_logging(rank)  # rank 0 informs; other ranks speak only on trouble
    log.info("environment: %s", json.dumps(environment_info()))
    log.info("arguments: %s", json.dumps(vars(args)))
    log.info("rank %d of %d, device %s, backend %s, dtype %s, seed %d", rank, world_size,
             device, dist.get_backend() if distributed else None, dtype, args.seed)

    # ---- data ----------------------------------------------------------------------
    data, sampler, loader, val_loader = load_data(args, device, rank, world_size)
    log.info("data: %s", json.dumps(dataset_info(data)))

    # ---- model, optimizer and schedule ---------------------------------------------
    config = get_config(args.model_preset, data.vocab_size)
    model = LlamaForCausalLM(config, args.activation_checkpointing).to(device)
    n_params = num_parameters(model)
    log.info("model: %s preset, %.2f M parameters (%s)", args.model_preset, n_params / 1e6,
             describe(config))
    raw_model = model  # the bare module: its weights are what we save
    if args.compile:  # the module, before DDP wraps it (README: "DDP and --compile")
        model.compile()
    if distributed:
        # DDP broadcasts rank 0's weights, then all-reduces gradients bucket by bucket
        # while backward runs; each .grad is a view into its bucket (no copy kept apart).
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                    gradient_as_bucket_view=True, **DDP_NO_BUFFER_SYNC)
    optimizer = build_optimizer(raw_model, args.lr, args.weight_decay, device)
    steps_per_epoch = len(loader) // args.grad_accum
    # --max-steps wins, with as many epochs as it takes; 0 = --num-epochs whole epochs
    total_steps = args.max_steps or args.num_epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, total_steps))
    global_batch = args.batch_size * world_size * args.grad_accum
    tokens_per_step = global_batch * args.seq_length  # processed, padding included
    log.info("training %d steps (%.2f epochs of %d); batch %d = %d x world %d x grad-accum %d, "
             "%d tokens per step", total_steps, total_steps / steps_per_epoch, steps_per_epoch,
             global_batch, args.batch_size, world_size, args.grad_accum, tokens_per_step)

    # ---- outputs (created only now: bad input above leaves nothing behind) ---------
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=rank)  # rank 0
    # timing, progress bar, metrics.jsonl, summary.json and the final table (rank 0)
    tracker = Tracker(CHAPTER, run_dir, device, total_steps, tokens_per_step, log, threads=threads,
                      args=args, dtype=dtype, num_params=n_params,
                      flops_per_token=flops_per_token(config, n_params, args.seq_length),
                      extra={"global_batch_size": global_batch, "grad_accum": args.grad_accum,
                             "data": dataset_info(data)},
                      rank=rank, world_size=world_size, backend=dist.get_backend() if distributed else None)

    # ---- the training loop ---------------------------------------------------------
    step = 0
    loss_sum = torch.zeros((), device=device)
    model.train()
    for epoch in itertools.count():
        if step == total_steps:
            break
        sampler.set_epoch(epoch)  # a new order every epoch, the same in every run
        batches = iter(loader)
        for _ in range(min(steps_per_epoch, total_steps - step)):
            tracker.start_step()
            loss_sum.zero_()
            with tracker.phase("data"):
                micro_batches = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                                 for x, y in (next(batches) for _ in range(args.grad_accum))]
                # The loss is the mean over the step's target tokens. Packed, every target
                # is a token: a known count. Padded, counted on the device (no host wait),
                # and summed over the ranks there: DDP averages the ranks' gradients, so
                # each rank's loss is x world_size / the global batch's token count.
                n_tokens = global_batch * args.seq_length
                if args.padded:
                    n_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
                    if distributed:
                        dist.all_reduce(n_tokens)
            # Gradient accumulation: backward adds into .grad, so the micro-batches' summed
            # losses, each divided by the step's token count, give one larger batch's gradient.
            for micro, (x, y) in enumerate(micro_batches):
                with tracker.phase("data"):
                    attn_mask = build_attention_mask(x, data.pad_id) if args.padded else None
                # Only the last micro-batch's backward all-reduces; the others just
                # accumulate local gradients (what `with model.no_sync():` does). It must
                # be set before the forward pass, where DDP prepares the reduction.
                if distributed:
                    model.require_backward_grad_sync = micro == args.grad_accum - 1
                with tracker.phase("forward"):
                    with autocast:
                        loss = compute_loss(model, x, y, attn_mask) * world_size / n_tokens
                with tracker.phase("backward"):
                    loss.backward()
                loss_sum += loss.detach()  # stays on the device: no host sync per step
            with tracker.phase("update"):
                grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            step += 1
            tracker.end_step(n_tokens)  # real tokens: padding left out
            if step % args.log_freq == 0 or step == total_steps:
                # The mean over the whole global batch: the ranks' shares (each x world_size)
                # summed, / world_size. Every rank joins this all-reduce, on the same steps;
                # .item() waits for it.
                if distributed:
                    dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
                    loss_sum /= world_size
                tracker.log(step, epoch=epoch, loss=loss_sum.item(), lr=scheduler.get_last_lr()[0],
                            grad_norm=grad_norm.item())
    tracker.close()

    # ---- validation, sample, weights, summary --------------------------------------
    # Every rank evaluates its share of the --val-batches batches (that many in all, of
    # its own samples r, r + world_size, ...) on the bare module: the replicas are
    # identical, and under no_grad a DDP forward would prepare no gradient reduction anyway.
    val_loss, val_batches = evaluate(raw_model, val_loader, data, device, autocast,
                                     len(range(rank, args.val_batches, world_size)))
    log.info("validation loss %s over %d batches",
             f"{val_loss:.4f}" if val_loss is not None else "n/a", val_batches)
    log.info("sample:\n%s", sample(raw_model, data, device, autocast, args.seed))
    # one writer; the bare module's weights load into a plain model; all hear its failure
    save_weights(run_dir / "model.pt", raw_model, writer=rank == 0)
    tracker.finish(final_loss=loss_sum.item(), val_loss=val_loss)
    if distributed:
        dist.barrier()  # nobody leaves while rank 0 may still need the group
        del model  # DDP's reducer holds the group: free it first
        gc_and_destroy_process_group()


if __name__ == "__main__":
    run_main(main)
