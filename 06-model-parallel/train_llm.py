"""Chapter 06: chapter 03 with the model split over the ranks: tensor and pipeline parallelism.

torchrun starts one process per device, laid out as dp x pp x tp. Each matmul is split
over --tp ranks (tensor_parallel.py), the decoder layers over --pp pipeline stages that
pass activations forward and gradients back (pipeline_parallel.py), and the dp
replicas of that split model each train on their own slice of every global batch, their
gradients averaged with one all-reduce per step.

    torchrun --standalone --nproc-per-node=4 06-model-parallel/train_llm.py --tp 2 --pp 2   # CPU: gloo
    torchrun --standalone --nproc-per-node=8 06-model-parallel/train_llm.py --model-preset medium --tp 2 --pp 2  # 8 GPUs
"""

import itertools
import json
import os
import random
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, DistributedSampler

from common.cli import base_parser, one_of, positive_int, setup_logging
from common.data import IGNORE_INDEX, build_datasets, check_enough_samples, dataset_info, local_rank0_first, worker_start_method
from common.distributed import backend_for, gc_and_destroy_process_group
from common.environment import environment_info, exit_with_launcher, set_tf32, share_cpu_threads
from common.errors import UsageError, run_main
from common.layout import APIS, SCHEDULES, Layout, layout_for
from common.masks import build_attention_mask
from common.model import LlamaForCausalLM, describe, flops_per_token, get_config, num_parameters
from common.runfolder import claim_run_folder, save_weights
from common.metrics import Tracker
from common.training import build_optimizer, evaluate, lr_lambda, sample

from pipeline_parallel import Pipeline, StageModule, TorchPipeline, split_layers, stage_of
from tensor_parallel import (full_weight, is_tp_sharded, local_grad, parallelize, parallelize_with_torch,
                             torch_cross_entropy, vocab_parallel_cross_entropy)

CHAPTER = "06-model-parallel"


def parse_args(argv=None):
    # every flag is checked as it is parsed: bad input stops here, before any work
    parser = base_parser(CHAPTER, "Chapter 06: tensor and pipeline parallelism, launched with torchrun.",
                         distributed=True)
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="batches per optimizer step (a larger batch in less memory)")
    g = parser.add_argument_group("model parallelism (the world size is dp x pp x tp)")
    g.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: each matmul split over them (heads, MLP features, vocabulary)")
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline stages: the decoder layers split into them")
    g.add_argument("--microbatches", type=positive_int, default=None,
                   help="micro-batches each batch is cut into for the pipeline (default: --batch-size "
                        "with --pp 2 or more: one sample each, the smallest bubble; else 1)")
    g.add_argument("--schedule", type=one_of(*SCHEDULES), default="1f1b",
                   help="gpipe: all forwards, then all backwards; 1f1b: one forward, one backward")
    g.add_argument("--api", type=one_of(*APIS), default="scratch",
                   help="scratch: this chapter's tensor_parallel.py and pipeline_parallel.py; torch: "
                        "torch.distributed.tensor.parallel and torch.distributed.pipelining")
    parser.checks.insert(0, check_layout)  # before "launch with torchrun": the flags come first
    return parser.parse_args(argv)


def layout_of(args) -> Layout:
    """The run's dp x pp x tp layout, from its flags and the world size torchrun gives.
    Raises UsageError where the split does not fit the model, the world or the batch."""
    return layout_for(int(os.environ.get("WORLD_SIZE", "1")), get_config(args.model_preset, args.vocab_size),
                      args.batch_size, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
                      schedule=args.schedule, api=args.api, model=f"the {args.model_preset!r} preset's")


def check_layout(args):
    """The split must fit the model, the world and the batch. Raises UsageError."""
    layout = layout_of(args)
    if args.compile and layout.tp * layout.pp > 1:
        raise UsageError("--compile applies to data parallelism only here (--tp 1 --pp 1): the "
                         "model-parallel layers communicate inside forward and backward")


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


def load_data(args, device, rank, world_size, dp_rank, dp):
    """The corpus, tokenized once (cached), and this rank's training and validation loaders."""
    def build():
        data = build_datasets(args.dataset_name, args.seq_length, packed=not args.padded,
                              vocab_size=args.vocab_size, tokenizer_path=args.tokenizer,
                              subset=args.dataset_subset, text_column=args.text_column,
                              cache_dir=args.cache_dir)
        check_enough_samples(data.train, args.batch_size * dp * args.grad_accum)
        return data
    # Local rank 0 of each machine builds the caches first, then the other ranks read
    # them; a data problem on any rank stops every rank here, with one line.
    data = local_rank0_first(build)
    # Each data-parallel replica takes every dp-th sample of one shared shuffle (seed +
    # epoch), so the replicas' batches together form exactly chapter 01's batch of dp × B.
    # The tp x pp ranks of one replica hold parts of one model: they read the same batches.
    # drop_last: no rank repeats samples to even out the split (the default pads so).
    sampler = DistributedSampler(data.train, num_replicas=dp, rank=dp_rank,
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


def compute_loss(logits, y):
    # summed over the real target tokens (padding targets are IGNORE_INDEX): the caller
    # divides by the step's count, so micro-batches (and ranks) add up to the token mean
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


class Split(NamedTuple):
    """What split_model gives a rank: its part of the model and how to train it."""
    module: torch.nn.Module  # this stage's layers, each holding this rank's tensor-parallel slice
    pipeline: Pipeline | TorchPipeline  # runs the stage's forwards and backwards in the schedule's order
    loss_fn: Callable  # a micro-batch's summed loss, from the last stage's logits and the targets
    step_context: Callable  # the context every step runs in (torch's loss_parallel, or none)


def split_model(model, mesh, layout: Layout, autocast, device) -> Split:
    """This rank's part of `model`: its tensor-parallel slice of every weight, then its
    pipeline stage's layers, with the pipeline that runs them and the loss of a
    micro-batch's logits."""
    tp_group, step_context = mesh.get_group("tp") if mesh else None, nullcontext
    loss_fn = compute_loss
    if layout.tp > 1 and layout.api == "torch":
        parallelize_with_torch(model, mesh["tp"])
        loss_fn, step_context = torch_cross_entropy, loss_parallel  # its backward needs loss_parallel too
    elif layout.tp > 1:
        start = parallelize(model, tp_group).lm_head.start  # this rank's first token of the vocabulary
        loss_fn = lambda logits, y: vocab_parallel_cross_entropy(  # noqa: E731
            logits.flatten(0, -2), y.reshape(-1), start, tp_group)
    stage = mesh.get_local_rank("pp") if mesh else 0
    module = StageModule(model, split_layers(len(model.layers), layout.pp)[stage], stage == 0,
                         stage == layout.pp - 1, autocast)
    if layout.api == "torch" and layout.pp > 1:
        pipeline = TorchPipeline(module, stage, layout.pp, mesh.get_group("pp"), layout.schedule,
                                 layout.microbatches, device)
    else:  # the neighbouring stages hold the same tp slice, tp ranks away (tp is innermost)
        rank = dist.get_rank() if mesh else 0
        pipeline = Pipeline(module, stage=stage, stages=layout.pp,
                            prev_rank=rank - layout.tp if stage > 0 else None,
                            next_rank=rank + layout.tp if stage < layout.pp - 1 else None,
                            schedule=layout.schedule, hidden_size=model.config.hidden_size,
                            dtype=model.norm.weight.dtype, device=device)
    return Split(module, pipeline, loss_fn, step_context)


@torch.no_grad()
def all_reduce_gradients(params, group, dp: int):
    """Average the gradients over the dp replicas: one all-reduce of them all laid end to
    end (chapter 05 rebuilt DDP so; DDP itself would also overlap it with backward)."""
    grads = [local_grad(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads]).div_(dp)  # divide, then sum: DDP's order
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, mesh):
    """clip_grad_norm_ with the whole model's gradient norm: squares summed over this
    rank's tensors, then over the tensor-parallel slices and the stages. A tensor every
    tp rank holds whole (a norm weight) counts once, on tp rank 0."""
    params = list(params)
    # In fp64: an fp32 sum of a large gradient's squares drifts (1e-4 for the tiny preset's head).
    squares = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for p in params:
        if is_tp_sharded(p) or not mesh or mesh.get_local_rank("tp") == 0:
            squares += local_grad(p).double().square().sum()
    if mesh:
        dist.all_reduce(squares, group=mesh.get_group("tp"))
        dist.all_reduce(squares, group=mesh.get_group("pp"))
    total = squares.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_
    for p in params:
        local_grad(p).mul_(coef.to(p.grad.dtype))
    return total


@torch.no_grad()
def gather_model(module, config, mesh, device):
    """The whole model on every rank, as a plain LlamaForCausalLM: each weight's slices
    gathered over tp by its stage, then sent to the other stages."""
    model = LlamaForCausalLM(config).to(device, next(module.parameters()).dtype)
    if not mesh:
        model.load_state_dict(module.state_dict())  # one rank holds it all
        return model
    mine, stage, tp = dict(module.named_parameters()), mesh.get_local_rank("pp"), mesh.size(2)
    ranges = split_layers(config.num_hidden_layers, mesh.size(1))
    for name, p in model.named_parameters():
        owner = stage_of(name, ranges)
        value = full_weight(mine[name], mesh.get_group("tp")) if owner == stage else torch.empty_like(p)
        dist.broadcast(value, src=dist.get_rank() + (owner - stage) * tp, group=mesh.get_group("pp"))
        p.copy_(value)
    return model


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
    # The layout: rank = (dp_rank x pp + stage) x tp + tp_rank. tp is innermost, so a
    # tensor-parallel group's ranks are neighbours (one machine on a cluster: they talk in
    # every layer); the stages of a pipeline are tp ranks apart; the dp replicas furthest.
    layout = layout_of(args)
    dp = layout.dp
    mesh = init_device_mesh(device.type, (dp, layout.pp, layout.tp), mesh_dim_names=("dp", "pp", "tp")) \
        if distributed else None
    dp_rank = mesh.get_local_rank("dp") if mesh else 0
    log.info("layout: dp %d x pp %d x tp %d; %s schedule, %d micro-batches, %s API", dp, layout.pp,
             layout.tp, layout.schedule, layout.microbatches, layout.api)

    # ---- data ----------------------------------------------------------------------
    data, sampler, loader, val_loader = load_data(args, device, rank, world_size, dp_rank, dp)
    log.info("data: %s", json.dumps(dataset_info(data)))

    # ---- model, optimizer and schedule ---------------------------------------------
    config = get_config(args.model_preset, data.vocab_size)
    # The whole model, with chapter 01's weights (the same seed), then this rank's part of it.
    model = LlamaForCausalLM(config, args.activation_checkpointing).to(device)
    n_params = num_parameters(model)
    log.info("model: %s preset, %.2f M parameters (%s)", args.model_preset, n_params / 1e6,
             describe(config))
    module, pipeline, loss_fn, step_context = split_model(model, mesh, layout, autocast, device)
    del model  # what this rank keeps is in `module`; the rest is freed
    if args.compile:  # only with --tp 1 --pp 1 (check_layout): the one stage is the whole model
        module.compile()
    optimizer = build_optimizer(module, args.lr, args.weight_decay, device)
    steps_per_epoch = len(loader) // args.grad_accum
    # --max-steps wins, with as many epochs as it takes; 0 = --num-epochs whole epochs
    total_steps = args.max_steps or args.num_epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, total_steps))
    global_batch = args.batch_size * dp * args.grad_accum
    tokens_per_step = global_batch * args.seq_length  # processed, padding included
    log.info("training %d steps (%.2f epochs of %d); batch %d = %d x dp %d x grad-accum %d, "
             "%d tokens per step", total_steps, total_steps / steps_per_epoch, steps_per_epoch,
             global_batch, args.batch_size, dp, args.grad_accum, tokens_per_step)

    # ---- outputs (created only now: bad input above leaves nothing behind) ---------
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=rank)  # rank 0
    # timing, progress bar, metrics.jsonl, summary.json and the final table (rank 0)
    tracker = Tracker(CHAPTER, run_dir, device, total_steps, tokens_per_step, log, threads=threads,
                      args=args, dtype=dtype, num_params=n_params,
                      flops_per_token=flops_per_token(config, n_params, args.seq_length),
                      extra={"global_batch_size": global_batch, "grad_accum": args.grad_accum,
                             "dp": dp, "pp": layout.pp, "tp": layout.tp, "data": dataset_info(data)},
                      rank=rank, world_size=world_size, backend=dist.get_backend() if distributed else None)

    # ---- the training loop ---------------------------------------------------------
    step = 0
    loss_sum = torch.zeros((), device=device)
    module.train()
    for epoch in itertools.count():
        if step == total_steps:
            break
        sampler.set_epoch(epoch)  # a new order every epoch, the same in every run
        batches = iter(loader)
        for _ in range(min(steps_per_epoch, total_steps - step)):
            tracker.start_step()
            loss_sum.zero_()
            with tracker.phase("data"):
                step_batches = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                                for x, y in (next(batches) for _ in range(args.grad_accum))]
                # The loss is the mean over the step's target tokens. Packed, every target
                # is a token: a known count. Padded, counted on the device (no host wait),
                # and summed over the dp replicas there: their gradients are averaged, so
                # each replica's loss is x dp / the global batch's token count.
                n_tokens = global_batch * args.seq_length
                if args.padded:
                    n_tokens = sum((y != IGNORE_INDEX).sum() for _, y in step_batches)
                    if dp > 1:
                        dist.all_reduce(n_tokens, group=mesh.get_group("dp"))
            # Gradient accumulation: backward adds into .grad, so the batches' (and their micro-
            # batches') summed losses, each divided by the step's token count, give one larger
            # batch's gradient.
            for x, y in step_batches:
                with tracker.phase("data"):
                    attn_mask = build_attention_mask(x, data.pad_id) if args.padded else None
                    m = layout.microbatches
                    micro_batches = list(zip(x.chunk(m), y.chunk(m),
                                             [None] * m if attn_mask is None else attn_mask.chunk(m)))
                # The pipeline runs the forward and backward of each micro-batch, in its
                # schedule's order; the tracker times each (waiting for a neighbour is
                # neither). The loss exists on the last stage only.
                with step_context():
                    loss = pipeline.step(micro_batches, lambda out, t: loss_fn(out, t) * dp / n_tokens,
                                         tracker.phase)
                loss_sum += loss.detach()  # stays on the device: no host sync per step
            with tracker.phase("update"):
                if dp > 1:  # the replicas' gradients averaged, as DDP does
                    all_reduce_gradients(module.parameters(), mesh.get_group("dp"), dp)
                grad_norm = clip_grad_norm(module.parameters(), 1.0, mesh)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            step += 1
            tracker.end_step(n_tokens)  # real tokens: padding left out
            if step % args.log_freq == 0 or step == total_steps:
                # The mean over the whole global batch: the last stage's loss brought to
                # every stage, then the replicas' shares (each x dp) summed, / dp. Every
                # rank joins these all-reduces, on the same steps; .item() waits for them.
                if distributed:
                    dist.all_reduce(loss_sum, group=mesh.get_group("pp"))
                    dist.all_reduce(loss_sum, group=mesh.get_group("dp"))
                    loss_sum /= dp
                tracker.log(step, epoch=epoch, loss=loss_sum.item(), lr=scheduler.get_last_lr()[0],
                            grad_norm=grad_norm.item())
    tracker.close()

    # ---- validation, sample, weights, summary --------------------------------------
    # The whole model gathered on every rank, then as in chapter 03. (A model too large
    # for one device would be evaluated through the pipeline and saved in slices, as
    # chapter 05's sharded checkpoint saves them.) Every rank evaluates its share of the
    # --val-batches batches (that many in all, of its own samples r, r + world_size, ...).
    raw_model = gather_model(module, config, mesh, device)
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
        gc_and_destroy_process_group()


if __name__ == "__main__":
    run_main(main)
