"""Pipeline parallelism with torch.distributed.pipelining, each stage sharded with FSDP,
and the interleaved schedule (Narayanan et al. 2021, "virtual stages").

Chapter 06 cut the decoder layers into pp stages, one per rank, and showed the bubble:
while the pipeline fills and drains, a stage waits, (p - 1) / (m + p - 1) of a step for
p stages and m micro-batches. Here the layers are cut into p x v stages and rank r
holds v of them, stages r, r + p, r + 2p, ... (a loop around the ranks, v times). A
micro-batch visits every rank v times, each visit v times shorter, so filling and
draining the pipeline takes (p - 1) / v of a micro-batch's work instead of p - 1:

    bubble = ((p - 1) / v) / (m + (p - 1) / v)        (v = 1: chapter 06's)

The price: v times the point-to-point sends, and more activations in flight on the
first ranks. torch's ScheduleInterleaved1F1B orders the work; GPipe and 1F1B are
chapter 06's schedules, one stage per rank.

Each stage is a module on its own (`StageModule`, chapter 06's, which knows how long
the sequence is when sequence parallelism cut it), sharded with FSDP (fully_shard, in
parallelize.py): torch's schedules tell FSDP which backward of a step is the last, so
it reduce-scatters each stage's gradients once per step, not once per micro-batch.

`Pipeline.events` records when each forward and backward ran (measure.py's bubble);
`Pipeline.forward` runs one batch through the stages with no schedule, for evaluation
(`evaluate`) and sampling (`PipelineModel`) through the pipeline: no rank ever holds
the whole model, not even at the end of training.
"""

from __future__ import annotations

import itertools
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from common.data import IGNORE_INDEX
from common.masks import build_attention_mask
from common.model import LlamaForCausalLM

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


def split_layers(num_layers: int, stages: int) -> list[range]:
    """The layers of each stage, in order; the first num_layers % stages stages take one
    more (4 layers over 3 stages: 2, 1, 1). Chapter 06's."""
    per, extra = divmod(num_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + per + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def stages_of_rank(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds: one per round of the loop, p apart."""
    return [pp_rank + i * pp for i in range(virtual)]


def bubble(p: int, m: int, v: int = 1) -> float:
    """The idle share of a step for p ranks of v stages each and m micro-batches, when
    every forward and backward of a stage takes the same time. With v > 1 it holds for m
    a multiple of p (Narayanan et al.'s condition): fewer micro-batches cannot fill the
    loop of stages, and one micro-batch leaves the pipeline as idle as with v = 1."""
    fill = (p - 1) / v
    return fill / (m + fill)


class StageModule(nn.Module):
    """One stage's part of a LlamaForCausalLM: the embedding on the first stage, its run
    of decoder layers, the final norm and the head on the last. Parameter names stay the
    whole model's (a layer keeps its index), so a stage's state dict is a part of chapter
    01's. `sequence_shards`: the tp ranks over which sequence parallelism cut the
    activations a later stage receives (the rotary tables need the whole length).
    `autocast` (bf16 on GPUs) covers the forward only. Activation checkpointing is set
    on each layer before FSDP wraps it (parallelize.py), not here."""

    def __init__(self, model, layers: range, first: bool, last: bool, autocast=None, sequence_shards: int = 1):
        super().__init__()
        self.autocast = autocast or nullcontext()
        self.sequence_shards = sequence_shards
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary = model.rotary  # buffers only: every stage needs cos and sin

    def forward(self, x, attn_mask=None):
        """Token ids (first stage) or the previous stage's activations (this rank's piece of
        the sequence); returns the next activations, or the logits (last stage)."""
        with self.autocast:
            length = x.shape[1] * (1 if self.embed_tokens is not None else self.sequence_shards)
            cos, sin = self.rotary(length)
            if self.embed_tokens is not None:
                x = self.embed_tokens(x)
            for layer in self.layers.values():
                x = layer(x, cos, sin, attn_mask)
            if self.lm_head is None:
                return x
            logits = self.lm_head(self.norm(x))
            return logits.to(torch.promote_types(logits.dtype, torch.float32))


class Part(nn.Module):
    """This rank's stages seen as one model with the whole model's names: the union of
    their embedding, layers, norm and head. What the optimizer, clipping and the
    checkpoint take (each parameter once, named as in chapter 01's model)."""

    def __init__(self, stages: list[StageModule]):
        super().__init__()
        self.embed_tokens = next((s.embed_tokens for s in stages if s.embed_tokens is not None), None)
        self.layers = nn.ModuleDict({k: v for s in stages for k, v in s.layers.items()})
        self.norm = next((s.norm for s in stages if s.norm is not None), None)
        self.lm_head = next((s.lm_head for s in stages if s.lm_head is not None), None)


class Pipeline:
    """This rank's stages of a pipeline of pp ranks x `virtual` stages, run by one of
    torch's schedules over the micro-batches of a step. `step` takes the micro-batches
    (x, y, mask) of a batch; the schedule cuts the batch again itself (along dim 0, as
    torch.chunk), the micro-batches must be equal. pp = 1: no pipeline, the micro-batches
    run one after the other through the one stage."""

    def __init__(self, stages: list[StageModule], stage_ids: list[int], num_stages: int, group, schedule: str,
                 microbatches: int, device, hidden_size: int, dtype):
        self.modules, self.stage_ids, self.num_stages, self.group = stages, stage_ids, num_stages, group
        self.device, self.hidden_size, self.dtype = device, hidden_size, dtype
        self.first, self.last = stage_ids[0] == 0, stage_ids[-1] == num_stages - 1
        self.events = []  # (kind, stage, micro-batch, start, end) of each forward and backward
        self.loss_fn, self.phase = None, None
        self.schedule = None
        if num_stages > 1:
            self.stages = [PipelineStage(m, s, num_stages, device, group=group) for m, s in zip(stages, stage_ids)]
            for stage in self.stages:
                self.timed(stage, "forward_one_chunk", "F")
                self.timed(stage, "backward_one_chunk", "B")
            kind = SCHEDULES[schedule]
            # scale_grads=False: the loss of a micro-batch is its share of the step's token
            # mean already (chapter 06); the schedules would otherwise divide by m again
            self.schedule = kind(self.stages if kind is ScheduleInterleaved1F1B else self.stages[0], microbatches,
                                 loss_fn=lambda out, y: self.loss_fn(out, y), scale_grads=False)

    def timed(self, stage, method: str, kind: str):
        """Record each call of stage.`method` (a forward or backward, without the waits
        for neighbours around it) in self.events, inside the tracker's phase of its name."""
        run = getattr(stage, method)

        def record(chunk, *args, **kwargs):
            start = time.perf_counter()
            try:
                with self.phase("forward" if kind == "F" else "backward"):
                    return run(chunk, *args, **kwargs)
            finally:
                self.events.append((kind, stage.stage_index, chunk, start, time.perf_counter()))
        setattr(stage, method, record)

    def step(self, micro_batches, loss_fn, phase=None) -> torch.Tensor:
        """Forward and backward of every micro-batch; gradients accumulate in .grad.
        `loss_fn(logits, y)` gives a micro-batch's share of the step's loss; `phase(name)`
        (the tracker's) times each forward and backward. Returns the sum of the micro-
        batch losses on the ranks of the last stage, 0 elsewhere."""
        self.events, self.phase = [], phase or (lambda name: nullcontext())
        if self.schedule is None:
            losses = []
            for x, y, mask in micro_batches:
                with self.phase("forward"):
                    loss = loss_fn(self.modules[0](x, mask), y)
                with self.phase("backward"):
                    loss.backward()
                losses.append(loss.detach())
            return torch.stack(losses).sum()
        self.loss_fn = loss_fn
        x, y, mask = (None if t[0] is None else torch.cat(t) for t in zip(*micro_batches))
        kwargs = {} if mask is None else {"attn_mask": mask}
        losses = [] if self.last else None
        self.schedule.step(*([x] if self.first else []), target=y if self.last else None,
                           losses=losses, return_outputs=False, **kwargs)
        return torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)

    @torch.no_grad()
    def forward(self, x, mask=None):
        """One batch through every stage in turn, forward only (no schedule, no micro-
        batches): the activations go from stage to stage with blocking sends. Returns the
        last stage's output (the logits) on the rank holding it, None elsewhere. Every
        rank of the pipeline calls it with the same batch."""
        if self.schedule is None:
            return self.modules[0](x, mask)
        pp, me = dist.get_world_size(self.group), dist.get_rank(self.group)
        shape = (x.shape[0], x.shape[1] // self.modules[-1].sequence_shards, self.hidden_size)
        out = None
        for s in range(self.num_stages):
            if s % pp != me:
                continue
            if s == 0:
                inp = x
            else:  # stage s - 1 is on the previous rank of the loop
                inp = torch.empty(shape, dtype=self.dtype, device=self.device)
                dist.recv(inp, group_src=(s - 1) % pp, group=self.group)
            out = self.modules[self.stage_ids.index(s)](inp, mask)
            if s < self.num_stages - 1:
                dist.send(out.contiguous(), group_dst=(s + 1) % pp, group=self.group)
        return out if self.last else None


@torch.no_grad()
def evaluate(pipeline: Pipeline, loader, data, loss_fn, context, max_batches: int, tp_rank: int):
    """Chapter 01's validation loss (the mean over every real target token), through the
    pipeline: each replica's ranks evaluate the same batches (a loader over the dp
    replicas), the last stage's first tp rank counts them. Returns (loss or None, the
    batches evaluated over all replicas). Every rank calls it."""
    for m in pipeline.modules:
        m.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=pipeline.device)
    for x, y in itertools.islice(loader, max_batches):
        x, y = x.to(pipeline.device), y.to(pipeline.device)
        with context():
            logits = pipeline.forward(x, None if data.packed else build_attention_mask(x, data.pad_id))
            if logits is not None:  # the last stage's ranks: all of them compute (tp: a collective)
                loss = torch.stack([loss_fn(logits, y).double(), (y != IGNORE_INDEX).sum().double(),
                                    torch.ones((), dtype=torch.float64, device=y.device)])
                sums += loss * (tp_rank == 0)  # its tp ranks hold the same: one counts
    dist.all_reduce(sums)
    for m in pipeline.modules:
        m.train()
    total, count, batches = sums.tolist()
    return (total / count if count else None), int(batches)


class PipelineModel:
    """The pipeline as chapter 01's `sample` sees a model: token ids in, the logits of the
    last position out, whole, on every rank of the pipeline (the last stage gathers them
    over its tp ranks and sends them to the other stages). Its `generate` is chapter
    01's, unchanged. The sequence is padded on the right to a multiple of the tp ranks
    (sequence parallelism cuts it evenly): causal attention never lets the padding
    change an earlier position."""

    generate = LlamaForCausalLM.generate  # chapter 01's sampling loop

    def __init__(self, pipeline: Pipeline, config):
        self.pipeline, self.config = pipeline, config

    def eval(self):
        return self

    def __call__(self, ids, attn_mask=None, last_only: bool = False):
        p, (batch, length) = self.pipeline, ids.shape
        shards = p.modules[0].sequence_shards
        padded = torch.nn.functional.pad(ids, (0, -length % shards))
        out = torch.empty((batch, 1, self.config.vocab_size), dtype=torch.float32, device=p.device)
        logits = p.forward(padded)
        if logits is not None:
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits  # the vocabulary, whole
            out.copy_(logits[:, length - 1:length])
        if p.schedule is not None:  # from the last stage's rank to the others of the pipeline
            dist.broadcast(out, group_src=(p.num_stages - 1) % dist.get_world_size(p.group), group=p.group)
        return out
