"""Chapter 07: chapter 06's split as large runs train it, and a checkpoint that moves.

torchrun starts one process per device, laid out as dp x pp x tp on one DeviceMesh.
Each matmul is split over --tp ranks, the residual stream between them over the
sequence (sequence_parallel.py), the decoder layers over --pp pipeline ranks of
--virtual-stages stages each (pipeline_parallel.py), and every weight, gradient and
AdamW moment over the dp ranks with FSDP (parallelize.py, which builds the model on
the meta device: no rank ever holds it whole). Every --ckpt-freq steps, at the end,
and on Ctrl-C or SIGTERM, each rank saves its pieces (checkpoint.py); the same command
resumes from the newest checkpoint in whatever layout it now runs.

    torchrun --standalone --nproc-per-node=4 07-3d-parallelism/train_llm.py --tp 2   # CPU: gloo
    torchrun --standalone --nproc-per-node=8 07-3d-parallelism/train_llm.py --model-preset medium --tp 2 --pp 2  # 8 GPUs
"""

import argparse
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

from checkpoint import (ResumableSampler, TrainState, latest_checkpoint, load_checkpoint, replica_start, run_settings,
                        save_checkpoint)
from common.cli import base_parser, non_negative_int, one_of, positive_int, setup_logging
from common.data import IGNORE_INDEX, build_datasets, check_enough_samples, dataset_info, local_rank0_first, worker_start_method
from common.distributed import backend_for, gc_and_destroy_process_group, init_process_group_for_restarts
from common.environment import environment_info, exit_with_launcher, set_tf32, share_cpu_threads
from common.errors import UsageError, run_main
from common.layout import layout_for
from common.masks import build_attention_mask
from common.model import describe, flops_per_token, get_config, num_parameters
from common.runfolder import archive_run, claim_run_folder
from common.metrics import Tracker
from common.training import build_optimizer, lr_lambda, sample
from parallelize import Layout, build_stages, clip_grad_norm, materialize
from pipeline_parallel import SCHEDULES, Part, Pipeline, PipelineModel, evaluate
from preemption import StopRequest, data_worker_ignores_stops, holding_sigterm

CHAPTER = "07-3d-parallelism"


def parse_args(argv=None):
    # every flag is checked as it is parsed: bad input stops here, before any work
    parser = base_parser(CHAPTER, "Chapter 07: FSDP x tensor (+ sequence) x pipeline parallelism, launched "
                         "with torchrun; checkpoints that resume in another layout.", distributed=True, resumes=True)
    parser.add_argument("--grad-accum", type=positive_int, default=1,
                        help="batches per optimizer step (a larger batch in less memory)")
    g = parser.add_argument_group("the layout (the world size is dp x pp x tp; the dp ranks shard with FSDP)")
    g.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: each matmul split over them (heads, MLP features, vocabulary)")
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline ranks: the decoder layers split over them")
    g.add_argument("--virtual-stages", type=positive_int, default=1,
                   help="pipeline stages per pipeline rank (2 or more: the interleaved schedule)")
    g.add_argument("--microbatches", type=positive_int, default=None,
                   help="micro-batches each batch is cut into for the pipeline (default: --batch-size "
                        "with --pp 2 or more: one sample each, the smallest bubble; else 1)")
    g.add_argument("--schedule", type=one_of(*SCHEDULES), default=None,
                   help="gpipe: all forwards, then all backwards; 1f1b: one forward, one backward; interleaved: "
                        "1f1b over --virtual-stages stages per rank (default: 1f1b, or interleaved with them)")
    g.add_argument("--sequence-parallel", default=True, action=argparse.BooleanOptionalAction,
                   help="with --tp: the residual stream between the matmuls cut over the sequence")
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--ckpt-freq", type=non_negative_int, default=25,
                   help="save a checkpoint every N steps (and always at the end); 0 = only at the end")
    g.add_argument("--keep-last", type=positive_int, default=2, help="checkpoints to keep")
    g.add_argument("--fresh", action="store_true",
                   help="start at step 0; earlier files move to an archive-* folder, once per job")
    parser.checks.insert(0, check_layout)  # before "launch with torchrun": the flags come first
    return parser.parse_args(argv)


def layout_of(args) -> Layout:
    """The run's dp x pp x tp layout, from its flags and the world size torchrun gives,
    with --virtual-stages stages per pipeline rank and sequence parallelism. Raises
    UsageError where the split does not fit the model, the world or the batch."""
    schedule = args.schedule or ("interleaved" if args.virtual_stages > 1 else "1f1b")
    layout = layout_for(int(os.environ.get("WORLD_SIZE", "1")), get_config(args.model_preset, args.vocab_size),
                        args.batch_size, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
                        schedule="1f1b" if schedule == "interleaved" else schedule, api="torch",
                        model=f"the {args.model_preset!r} preset's")
    return Layout(layout.dp, layout.pp, layout.tp, layout.microbatches, schedule, "torch", args.virtual_stages,
                  args.sequence_parallel)


def check_layout(args):
    """The split must fit the model, the world and the batch. Raises UsageError."""
    layout, layers = layout_of(args), get_config(args.model_preset, args.vocab_size).num_hidden_layers
    if layout.pp * layout.virtual > layers:
        raise UsageError(f"--pp {layout.pp} x --virtual-stages {layout.virtual} stages exceed the "
                         f"{args.model_preset!r} preset's {layers} layers: a stage needs one at least")
    if (layout.schedule == "interleaved") != (layout.virtual > 1):
        raise UsageError("--schedule interleaved runs --virtual-stages 2 or more, and they need it")
    if layout.virtual > 1 and (layout.pp == 1 or layout.microbatches % layout.pp):
        raise UsageError(f"--virtual-stages {layout.virtual} interleave --pp 2 or more ranks, over a multiple of "
                         f"--pp micro-batches (here --pp {layout.pp}, --microbatches {layout.microbatches})")
    if layout.sequence_shards > 1 and args.seq_length % layout.tp:
        raise UsageError(f"--seq-length {args.seq_length} is not a multiple of --tp {layout.tp}: sequence "
                         f"parallelism cuts it evenly (or --no-sequence-parallel)")
    if args.compile:
        raise UsageError("--compile is not wired into this chapter's composed model (its README says where to start)")


def setup(args):
    """The process group (one process per device), this process's device, the dtype the
    math runs in, the CPU threads, and the seeds. torchrun sets RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT; plain `python` sets none: a group of one (FSDP needs one)."""
    exit_with_launcher()  # under torchrun: stop (SIGTERM) if torchrun dies, never train as an orphan
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)  # else every process would use GPU 0
    backend = backend_for(device)  # nccl for GPUs, gloo for CPUs (LLM_GUIDE_BACKEND=gloo: GPUs too)
    if "RANK" in os.environ:  # on a store per torchrun restart (chapter 04)
        init_process_group_for_restarts(backend, timeout=timedelta(seconds=args.timeout),
                                        device_id=device if backend == "nccl" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device.type == "cuda":
        set_tf32(True)  # fp32 matmuls on tensor cores (TF32: 10-bit mantissa, much faster)
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    # bf16 autocast: matmuls in bf16, weights and optimizer state stay fp32
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()
    threads = share_cpu_threads(device)  # like for like: the same CPU threads per machine (a collective under torchrun)
    random.seed(args.seed)  # (the initial weights: materialize, with chapter 01's seed)
    if args.deterministic:  # the same bits in every rerun, on GPUs too (chapter 01's README, part 3)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's condition for it
        torch.use_deterministic_algorithms(True)  # kernels without atomics; an op with none stops the run
    return device, dtype, autocast, threads


def load_data(args, device, dp_rank, dp):
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
    # epoch), so the replicas' batches together form exactly chapter 01's batch of dp × B,
    # whatever dp is: the data position is the global batch's, the same in every layout.
    # The tp x pp ranks of one replica hold parts of one model: they read the same batches.
    # drop_last: no rank repeats samples to even out the split (the default pads so).
    sampler = ResumableSampler(DistributedSampler(data.train, num_replicas=dp, rank=dp_rank,
                                                  shuffle=True, seed=args.seed, drop_last=True))
    loader = DataLoader(data.train, batch_size=args.batch_size, sampler=sampler,
                        drop_last=True,  # every step sees a full batch
                        num_workers=args.num_workers, pin_memory=device.type == "cuda",
                        multiprocessing_context=holding_sigterm(worker_start_method(args.num_workers)),
                        generator=torch.Generator().manual_seed(args.seed),  # not the global RNG
                        worker_init_fn=data_worker_ignores_stops)  # a stop signal is the trainer's to handle
    # Validation is split too, through the pipeline: replica r evaluates samples r, r + dp, ...
    val_sampler = DistributedSampler(data.val, num_replicas=dp, rank=dp_rank, shuffle=False)
    val_loader = DataLoader(data.val, batch_size=args.batch_size, sampler=val_sampler, num_workers=0)
    return data, sampler, loader, val_loader


def compute_loss(logits, y):
    # summed over the real target tokens (padding targets are IGNORE_INDEX): the caller
    # divides by the step's count, so micro-batches (and ranks) add up to the token mean
    loss = F.cross_entropy(logits.flatten(0, -2), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss.to_local() if hasattr(loss, "to_local") else loss  # tp: torch's loss_parallel gives a DTensor


class Split(NamedTuple):
    """What split_model gives a rank: its part of the model and how to train it."""
    part: torch.nn.Module  # this rank's stages as one model, its pieces of each tensor, named as chapter 01's
    pipeline: Pipeline  # runs the stages' forwards and backwards in the schedule's order
    loss_fn: Callable  # a micro-batch's summed loss, from the last stage's logits and the targets
    step_context: Callable  # the context every step runs in (torch's loss_parallel, or none)


def split_model(config, mesh, layout: Layout, args, autocast, device) -> Split:
    """This rank's part of the model, built on the meta device and cut (parallelize.py:
    the pipeline's stages, then tp with sequence parallelism, activation checkpointing,
    FSDP), then given chapter 01's initial weights piece by piece; with the pipeline
    that runs its stages and the loss of a micro-batch's logits."""
    stages, stage_ids = build_stages(config, mesh, layout, device, autocast=autocast,
                                     activation_checkpointing=args.activation_checkpointing)
    materialize(stages, config, layout, args.seed, mesh.get_local_rank("tp"))
    pipeline = Pipeline(stages, stage_ids, layout.pp * layout.virtual, mesh.get_group("pp"), layout.schedule,
                        layout.microbatches, device, config.hidden_size, torch.float32)
    # logits cut over the vocabulary (tp): their loss, and its backward, need loss_parallel
    return Split(Part(stages), pipeline, compute_loss, loss_parallel if layout.tp > 1 else nullcontext)


def resume(args, run_dir, train_state, settings, rank, world_size, log) -> Path | None:
    """Load the newest checkpoint of this run into this layout, or return None for a
    fresh start. --fresh acts once per job: a torchrun restart resumes, as any rerun."""
    if args.fresh and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0:
        if rank == 0:
            log.info("--fresh: earlier files moved to %s", archive_run(run_dir))
        dist.barrier()
        return None
    path = latest_checkpoint(run_dir / "checkpoints")
    if path:
        meta = load_checkpoint(path, train_state, settings, rank=rank, world=world_size)
        log.info("resumed from %s (saved by %s): step %d, epoch %d, %d samples into it", path, meta["layout"],
                 train_state.step, train_state.epoch, train_state.samples_in_epoch)
    return path


def export_files(config, data) -> dict:
    """What tools/export.py needs beside the shards: the model's shape and the tokenizer."""
    special = {f"{name}_id": i for name, i in (("pad", data.pad_id), ("bot", data.bot_id), ("eot", data.eot_id))}
    tokens = {f"{name[:-3]}_token": data.tokenizer.id_to_token(i) for name, i in special.items()}
    return {"model.json": json.dumps({**config.to_dict(), **special, **tokens}).encode(),
            "tokenizer.json": data.tokenizer.to_str().encode()}


def main():
    # ---- arguments, device, environment --------------------------------------------
    args = parse_args()
    device, dtype, autocast, threads = setup(args)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    log = setup_logging(rank)  # rank 0 informs; other ranks speak only on trouble
    log.info("environment: %s", json.dumps(environment_info()))
    log.info("arguments: %s", json.dumps(vars(args)))
    log.info("rank %d of %d, device %s, backend %s, dtype %s, seed %d", rank, world_size,
             device, dist.get_backend(), dtype, args.seed)
    # The layout: rank = (dp_rank x pp + stage) x tp + tp_rank. tp is innermost, so a
    # tensor-parallel group's ranks are neighbours (one machine on a cluster: they talk in
    # every layer); the stages of a pipeline are tp ranks apart; the dp replicas furthest.
    layout = layout_of(args)
    dp = layout.dp
    mesh = init_device_mesh(device.type, (dp, layout.pp, layout.tp), mesh_dim_names=("dp", "pp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    log.info("layout: %s; %s schedule, %d micro-batches", layout, layout.schedule, layout.microbatches)

    # ---- data ----------------------------------------------------------------------
    data, sampler, loader, val_loader = load_data(args, device, dp_rank, dp)
    log.info("data: %s", json.dumps(dataset_info(data)))

    # ---- model, optimizer and schedule ---------------------------------------------
    config = get_config(args.model_preset, data.vocab_size)
    # this rank's part of the model only, with chapter 01's weights (same seed)
    part, pipeline, loss_fn, step_context = split_model(config, mesh, layout, args, autocast, device)
    n_params = torch.tensor(float(num_parameters(part)), dtype=torch.float64, device=device)  # whole tensors
    dist.all_reduce(n_params, group=mesh.get_group("pp"))  # and the other stages'
    n_params = int(n_params.item())
    log.info("model: %s preset, %.2f M parameters (%s)", args.model_preset, n_params / 1e6,
             describe(config))
    optimizer = build_optimizer(part, args.lr, args.weight_decay, device)
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
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=rank, resumes=True)  # rank 0
    # the training state as one object (chapter 04's), each rank holding its pieces of it
    train_state = TrainState(part, optimizer, scheduler)
    settings = run_settings(args, dtype, global_batch, data.fingerprint)  # what defines this run; not the layout
    resume(args, run_dir, train_state, settings, rank, world_size, log)
    start_step, start_epoch = train_state.step, train_state.epoch
    # timing, progress bar, metrics.jsonl, summary.json and the final table (rank 0)
    tracker = Tracker(CHAPTER, run_dir, device, total_steps, tokens_per_step, log, threads=threads,
                      args=args, dtype=dtype, num_params=n_params, start_step=start_step,
                      flops_per_token=flops_per_token(config, n_params, args.seq_length),
                      extra={"global_batch_size": global_batch, "grad_accum": args.grad_accum,
                             "dp": dp, "pp": layout.pp, "tp": layout.tp, "virtual_stages": layout.virtual,
                             "sequence_parallel": layout.sequence_shards > 1, "data": dataset_info(data),
                             "resumed_at_step": start_step},
                      rank=rank, world_size=world_size, backend=dist.get_backend())

    # ---- the training loop ---------------------------------------------------------
    step, stopped, path, loss = start_step, None, None, None
    loss_sum = torch.zeros((), device=device)
    stop = StopRequest()  # Ctrl-C and SIGTERM: finish the step, save, then leave
    for epoch in itertools.count(start_epoch):
        if step == total_steps or stopped:
            break
        # a new order every epoch, the same in every run; a resumed epoch starts at the
        # global batch's position, each replica at its share of it
        done = train_state.samples_in_epoch // global_batch if epoch == start_epoch else 0
        sampler.set_epoch(epoch, start=replica_start(done * global_batch, dp))
        batches = iter(loader)
        for in_epoch in range(done, min(steps_per_epoch, done + total_steps - step)):
            tracker.start_step()
            loss_sum.zero_()
            with tracker.phase("data"):
                step_batches = [(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
                                for x, y in (next(batches) for _ in range(args.grad_accum))]
                # The loss is the mean over the step's target tokens. Packed, every target
                # is a token: a known count. Padded, counted on the device (no host wait),
                # and summed over the dp replicas there: FSDP averages their gradients, so
                # each replica's loss is x dp / the global batch's token count.
                n_tokens = global_batch * args.seq_length
                if args.padded:
                    n_tokens = sum((y != IGNORE_INDEX).sum() for _, y in step_batches)
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
                # neither). FSDP gathers each layer's weights around them, and reduce-
                # scatters the gradients over the dp ranks after the last backward.
                with step_context():
                    loss = pipeline.step(micro_batches, lambda out, t: loss_fn(out, t) * dp / n_tokens,
                                         tracker.phase)
                loss_sum += loss.detach()  # stays on the device: no host sync per step
            with tracker.phase("update"):
                grad_norm = clip_grad_norm(part.parameters(), 1.0, tp_rank)  # the whole model's norm
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            step += 1
            tracker.end_step(n_tokens)  # real tokens: padding left out
            if step % args.log_freq == 0 or step == total_steps:
                # The mean over the whole global batch: the last stage's loss (its tp ranks
                # hold the same value: one counts) summed over the replicas (each x dp), / dp.
                # Every rank joins this all-reduce, on the same steps; .item() waits for it.
                loss = loss_sum.double() * (tp_rank == 0)
                dist.all_reduce(loss)
                loss = loss.item() / dp
                tracker.log(step, epoch=epoch, loss=loss, lr=scheduler.get_last_lr()[0],
                            grad_norm=grad_norm.item())
            stopped = stop.agreed(last_step=step == total_steps)  # all ranks vote: all stop together
            if step == total_steps or stopped or (args.ckpt_freq and step % args.ckpt_freq == 0):
                # where the data stands: the epoch (its shuffle), the samples of it trained on
                epoch_done = in_epoch + 1 == steps_per_epoch
                train_state.step, train_state.epoch = step, epoch + epoch_done
                train_state.samples_in_epoch = 0 if epoch_done else (in_epoch + 1) * global_batch
                path = tracker.saved(save_checkpoint(run_dir / "checkpoints", train_state, settings, str(layout),
                                                     keep_last=args.keep_last, rank=rank, world=world_size,
                                                     extras=export_files(config, data)))
            if stopped:
                break
    tracker.close()
    stop.uninstall()  # the last step is committed: from here a signal acts as usual
    if stopped:  # the checkpoint holds everything: the same command continues from it
        stop.leave(step, path)

    # ---- validation, sample, summary -----------------------------------------------
    # Through the pipeline, as training ran: no rank ever holds the whole model. Each
    # replica evaluates its share of the --val-batches batches (samples r, r + dp, ...).
    # The final weights are the last checkpoint: `python -m tools.export` makes a
    # transformers folder of it.
    val_loss, val_batches = evaluate(pipeline, val_loader, data, loss_fn, step_context,
                                     len(range(dp_rank, args.val_batches, dp)), tp_rank)
    log.info("validation loss %s over %d batches",
             f"{val_loss:.4f}" if val_loss is not None else "n/a", val_batches)
    with step_context():
        log.info("sample:\n%s", sample(PipelineModel(pipeline, config), data, device, autocast, args.seed))
    tracker.finish(final_loss=loss, val_loss=val_loss)
    dist.barrier()  # nobody leaves while rank 0 may still need the group
    gc_and_destroy_process_group()


if __name__ == "__main__":
    run_main(main, resumes=True)  # Ctrl-C outside the loop; its lines say the run resumes
