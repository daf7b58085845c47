"""Chapter 01: train a Llama model on one device.

The baseline every later chapter extends: command line, environment log, device and
dtype, seeding, data, model, AdamW with warmup + cosine, a loop that times each phase,
metrics, validation, a text sample, and the saved weights.

    python 01-single-gpu/train_llm.py                              # small preset, CPU ok
    python 01-single-gpu/train_llm.py --model-preset base --seq-length 1024   # a GPU
"""

import itertools
import json
import os
import random
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common.cli import base_parser, positive_int, setup_logging
from common.data import IGNORE_INDEX, build_datasets, check_enough_samples, dataset_info, local_rank0_first, worker_start_method
from common.environment import environment_info, exit_with_launcher, set_tf32, share_cpu_threads
from common.errors import run_main
from common.masks import build_attention_mask
from common.model import LlamaForCausalLM, describe, flops_per_token, get_config, num_parameters
from common.runfolder import claim_run_folder, save_weights
from common.metrics import Tracker
from common.training import build_optimizer, evaluate, lr_lambda, sample

CHAPTER = "01-single-gpu"


def parse_args(argv=None):
    # every flag is checked as it is parsed: bad input stops here, before any work
    parser = base_parser(CHAPTER, "Chapter 01: train a Llama model on one device.")
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="micro-batches per optimizer step (a larger batch in less memory)")
    return parser.parse_args(argv)


def setup(args):
    """The device, the dtype the math runs in, the CPU threads, and the seeds."""
    exit_with_launcher()  # under torchrun: stop (SIGTERM) if torchrun dies, never train as an orphan
    if args.device == "auto":
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda:0")  # a plain "cuda": the first visible GPU
    if device.type == "cuda":
        torch.cuda.set_device(device)
        set_tf32(True)  # fp32 matmuls on tensor cores (TF32: 10-bit mantissa, much faster)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    # bf16 autocast: matmuls in bf16, weights and optimizer state stay fp32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
    threads = share_cpu_threads(device)  # like for like: the same CPU threads per machine (a collective under torchrun)
    random.seed(args.seed)
    torch.manual_seed(args.seed)  # seeds every device; the model init depends on it
    if args.deterministic:  # the same bits in every rerun, on GPUs too (chapter 01's README, part 3)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for it
        torch.use_deterministic_algorithms(True)  # kernels without atomics; an op with none stops the run
    return device, dtype, autocast, threads


def load_data(args, device):
    """The corpus, tokenized once (cached), and the training and validation loaders."""
    def build():
        data = build_datasets(args.dataset_name, args.seq_length, packed=not args.padded,
                              vocab_size=args.vocab_size, tokenizer_path=args.tokenizer,
                              subset=args.dataset_subset, text_column=args.text_column,
                              cache_dir=args.cache_dir)
        check_enough_samples(data.train, args.batch_size * args.grad_accum)
        return data
    data = local_rank0_first(build)  # a data problem stops the run here, with one line
    # A fresh shuffle every epoch (seed + epoch). DistributedSampler with one replica is
    # just that shuffle; chapter 03's ranks split the very same order.
    sampler = DistributedSampler(data.train, num_replicas=1, rank=0,
                                 shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler,
                        drop_last=True,  # every step sees a full batch
                        num_workers=args.num_workers, pin_memory=device.type == "cuda",
                        multiprocessing_context=worker_start_method(args.num_workers),  # fork on Linux
                        generator=torch.Generator().manual_seed(args.seed))  # not the global RNG
    val_loader = DataLoader(data.val, batch_size=args.batch_size, num_workers=0)
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
    log = setup_logging()
    log.info("environment: %s", json.dumps(environment_info()))
    log.info("arguments: %s", json.dumps(vars(args)))
    log.info("device %s, dtype %s, seed %d", device, dtype, args.seed)

    # ---- data ----------------------------------------------------------------------
    data, sampler, loader, val_loader = load_data(args, device)
    log.info("data: %s", json.dumps(dataset_info(data)))

    # ---- model, optimizer and schedule ---------------------------------------------
    config = get_config(args.model_preset, data.vocab_size)
    model = LlamaForCausalLM(config, args.activation_checkpointing).to(device)
    n_params = num_parameters(model)
    log.info("model: %s preset, %.2f M parameters (%s)", args.model_preset, n_params / 1e6,
             describe(config))
    optimizer = build_optimizer(model, args.lr, args.weight_decay, device)
    steps_per_epoch = len(loader) // args.grad_accum
    # --max-steps wins, with as many epochs as it takes; 0 = --num-epochs whole epochs
    total_steps = args.max_steps or args.num_epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, total_steps))
    # --compile: model and loss as one graph (under DDP, chapter 03 compiles the module)
    loss_fn = torch.compile(compute_loss) if args.compile else compute_loss
    global_batch = args.batch_size * args.grad_accum
    tokens_per_step = global_batch * args.seq_length  # processed, padding included
    log.info("training %d steps (%.2f epochs of %d); batch %d = %d x grad-accum %d, %d tokens "
             "per step", total_steps, total_steps / steps_per_epoch, steps_per_epoch,
             global_batch, args.batch_size, args.grad_accum, tokens_per_step)

    # ---- outputs (created only now: bad input above leaves nothing behind) ---------
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name)  # ours alone
    # timing, progress bar, metrics.jsonl, summary.json and the final table
    tracker = Tracker(CHAPTER, run_dir, device, total_steps, tokens_per_step, log, threads=threads,
                      args=args, dtype=dtype, num_params=n_params,
                      flops_per_token=flops_per_token(config, n_params, args.seq_length),
                      extra={"global_batch_size": global_batch, "grad_accum": args.grad_accum,
                             "data": dataset_info(data)})

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
                # is a token: a known count. Padded, counted on the device (no host wait).
                n_tokens = global_batch * args.seq_length
                if args.padded:
                    n_tokens = sum((y != IGNORE_INDEX).sum() for _, y in micro_batches)
            # Gradient accumulation: backward adds into .grad, so the micro-batches' summed
            # losses, each divided by the step's token count, give one larger batch's gradient.
            for micro, (x, y) in enumerate(micro_batches):
                with tracker.phase("data"):
                    attn_mask = build_attention_mask(x, data.pad_id) if args.padded else None
                with tracker.phase("forward"):
                    with autocast:
                        loss = loss_fn(model, x, y, attn_mask) / n_tokens
                with tracker.phase("backward"):
                    loss.backward()
                loss_sum += loss.detach()  # stays on the device: no host sync per step
            with tracker.phase("update"):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            step += 1
            tracker.end_step(n_tokens)  # real tokens: padding left out
            if step % args.log_freq == 0 or step == total_steps:
                # .item() waits for the device: only on logging steps
                tracker.log(step, epoch=epoch, loss=loss_sum.item(), lr=scheduler.get_last_lr()[0],
                            grad_norm=grad_norm.item())
    tracker.close()

    # ---- validation, sample, weights, summary --------------------------------------
    val_loss, val_batches = evaluate(model, val_loader, data, device, autocast, args.val_batches)
    log.info("validation loss %s over %d batches",
             f"{val_loss:.4f}" if val_loss is not None else "n/a", val_batches)
    log.info("sample:\n%s", sample(model, data, device, autocast, args.seed))
    save_weights(run_dir / "model.pt", model)  # whole or absent: a full disk is one line
    tracker.finish(final_loss=loss_sum.item(), val_loss=val_loss)


if __name__ == "__main__":
    run_main(main)
