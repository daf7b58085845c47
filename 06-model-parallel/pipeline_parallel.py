"""Pipeline parallelism, from scratch, then with torch.distributed.pipelining.

The decoder layers are split into `pp` consecutive stages, one per rank of a pipeline
group: stage 0 also holds the embedding, the last stage the final norm and lm_head.
A stage sends its output activations to the next stage (`dist.isend` and `dist.irecv`:
point to point, not a collective) and gets the gradient of those activations back.

A batch is cut into m micro-batches so that the stages work at the same time, each on
another micro-batch. A stage still waits while the pipeline fills and drains: that idle
share of a step is the bubble, (p - 1) / (m + p - 1) for p stages whose forward and
backward each take the same time, in both schedules written out here:

    GPipe  every micro-batch's forward, then every backward: a stage holds the
           activations of all m micro-batches at once;
    1F1B   after p - s - 1 warm-up forwards, stage s alternates one forward and one
           backward: it holds at most p - s micro-batches' activations, whatever m is.

Both run the backward passes in micro-batch order 0, 1, ..., m - 1, so each weight's
gradients add up in the same order: the two schedules give the same bits.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint


def split_layers(num_layers: int, stages: int) -> list[range]:
    """The layers of each stage, in order; the first num_layers % stages stages take one
    more (4 layers over 3 stages: 2, 1, 1)."""
    per, extra = divmod(num_layers, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + per + (s < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class StageModule(nn.Module):
    """One stage's part of a LlamaForCausalLM (split with tensor_parallel first, or not):
    the embedding on the first stage, its run of decoder layers, the final norm and the
    head on the last. Parameter names stay the whole model's (a layer keeps its index),
    so a stage's state dict is a part of chapter 01's. `autocast` (bf16 on GPUs) covers
    the forward only, as in the chapters before: a schedule interleaves backwards."""

    def __init__(self, model, layers: range, first: bool, last: bool, autocast=None):
        super().__init__()
        self.autocast = autocast or nullcontext()
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary = model.rotary  # buffers only: every stage needs cos and sin
        self.activation_checkpointing = model.activation_checkpointing

    def forward(self, x, attn_mask=None):
        """Token ids (first stage) or the previous stage's activations; returns the next
        activations, or the logits (last stage). As LlamaForCausalLM.forward, in parts."""
        with self.autocast:
            return self.run(x, attn_mask)

    def run(self, x, attn_mask):
        cos, sin = self.rotary(x.shape[1])
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        for layer in self.layers.values():
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, cos, sin, attn_mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn_mask)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.norm(x))
        return logits.to(torch.promote_types(logits.dtype, torch.float32))


def stage_of(name: str, layer_ranges: list[range]) -> int:
    """Which stage holds the whole model's parameter `name`."""
    if name.startswith("embed_tokens."):
        return 0
    if name.startswith("layers."):
        index = int(name.split(".")[1])
        return next(s for s, r in enumerate(layer_ranges) if index in r)
    return len(layer_ranges) - 1  # norm, lm_head


# ---- the two schedules: what stage s of p does, in order ------------------------------

def gpipe(m: int, p: int, s: int) -> list[tuple[str, int]]:
    return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]


def one_f_one_b(m: int, p: int, s: int) -> list[tuple[str, int]]:
    warmup = min(p - s - 1, m)  # the forwards in flight before the first backward comes back
    actions = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", i) for i in range(m - warmup, m)]  # drain


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


class Pipeline:
    """One stage of a pipeline, running a schedule over the micro-batches of a step.

    `prev_rank`, `next_rank`: the global ranks of the neighbouring stages (None at the
    ends). Every rank of the pipeline has every micro-batch (x, y, mask): the first stage
    reads x, the last y, each stage the mask.

    Sends and receives. What an operation sends (a forward's output, a backward's input
    gradient) goes out with the receive of the next operation, in one batch
    (`dist.batch_isend_irecv`), which is then waited for. In 1F1B's steady state stage s
    sends an activation to stage s + 1 at the moment that stage sends it a gradient
    back; on NCCL a send may wait until its receive is posted, so two sends issued apart
    could wait on each other for ever. Fired as one batch, each pair completes (torch's
    Schedule1F1B and Megatron-LM pair them the same way). A tensor is let go as soon as
    its send is done: a stage keeps only the micro-batches whose backward is still to
    come."""

    def __init__(self, module, *, stage: int, stages: int, prev_rank, next_rank, schedule: str,
                 hidden_size: int, dtype, device):
        self.module, self.stage, self.stages, self.schedule = module, stage, stages, schedule
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.first, self.last = stage == 0, stage == stages - 1
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.held = {}  # micro-batch -> (input, output), from its forward until its backward
        self.outbox = []  # what the last operation sends, fired with the next receive

    def step(self, micro_batches, loss_fn, phase=None):
        """Forward and backward of every micro-batch, in the schedule's order; gradients
        accumulate in .grad. `loss_fn(logits, y)` gives a micro-batch's share of the
        step's loss. `phase(name)` (the tracker's) is entered around each forward and
        backward, after its receive: what a stage spends waiting for its neighbours stays
        outside. Returns the sum of the micro-batch losses on the last stage, 0 elsewhere."""
        phase = phase or (lambda name: nullcontext())
        total = torch.zeros((), device=self.device)
        for kind, i in SCHEDULES[self.schedule](len(micro_batches), self.stages, self.stage):
            if kind == "F":
                loss = self.forward(i, micro_batches[i], loss_fn, phase)
                if loss is not None:
                    total = total + loss
            else:
                self.backward(i, phase)
        self.exchange()  # the last operation's send
        return total

    def exchange(self, source=None, shape=None):
        """Fire the sends in the outbox together with one receive (a tensor of `shape`
        from global rank `source`; none if `source` is None), wait for all of them, and
        return what was received. Called before every forward and backward, so that what
        one operation sends goes out before the next one starts."""
        ops, received = self.outbox, None
        if source is not None:
            received = torch.empty(shape, dtype=self.dtype, device=self.device)
            ops = ops + [dist.P2POp(dist.irecv, received, source)]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.outbox = []  # sent: the tensors are no longer ours to keep
        return received

    def forward(self, i, micro_batch, loss_fn, phase):
        """Micro-batch i's forward (and, on the last stage, its loss, which it returns)."""
        x, y, mask = micro_batch
        received = self.exchange(None if self.first else self.prev_rank, (*x.shape, self.hidden_size))
        # The previous stage's activations arrive as a leaf, whose .grad this stage sends back.
        inp = x if self.first else received.requires_grad_()
        with phase("forward"), record_function(f"forward {i}"):
            out = self.module(inp, mask)
            if self.last:
                out = loss_fn(out, y)
        self.held[i] = (inp, out)  # its graph, and so its activations, live until its backward
        if self.last:
            return out.detach()
        self.outbox.append(dist.P2POp(dist.isend, out.detach(), self.next_rank))
        return None

    def backward(self, i, phase):
        """Micro-batch i's backward, from the gradient of its output (the next stage's)."""
        grad = self.exchange(None if self.last else self.next_rank, self.held[i][1].shape)
        inp, out = self.held.pop(i)
        with phase("backward"), record_function(f"backward {i}"):
            torch.autograd.backward(out, grad)  # the last stage: out is the loss
        if not self.first:
            self.outbox.append(dist.P2POp(dist.isend, inp.grad, self.prev_rank))


class TorchPipeline:
    """The same stage with torch.distributed.pipelining: PipelineStage sends and receives
    (it learns the activations' shapes from the first micro-batch), ScheduleGPipe or
    Schedule1F1B orders the work, and `step` takes the whole batch and cuts it into
    micro-batches itself (along dim 0, as torch.chunk)."""

    def __init__(self, module, stage: int, stages: int, group, schedule: str, microbatches: int, device):
        self.stage = PipelineStage(module, stage, stages, device, group=group)
        self.first, self.last = stage == 0, stage == stages - 1
        self.loss_fn = None
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        # scale_grads=False: by default the schedules divide every gradient by the number
        # of micro-batches, which is right for a loss that is each micro-batch's mean.
        # Ours is each micro-batch's sum divided by the whole step's token count (the
        # global token mean, as in chapter 01): the micro-batches' gradients must add up.
        self.schedule = kind(self.stage, microbatches, loss_fn=lambda out, y: self.loss_fn(out, y),
                             scale_grads=False)

    def step(self, micro_batches, loss_fn, phase=None):
        self.loss_fn = loss_fn
        x, y, mask = (None if t[0] is None else torch.cat(t) for t in zip(*micro_batches))
        kwargs = {} if mask is None else {"attn_mask": mask}  # every stage gets its mask's chunks
        losses = [] if self.last else None
        with phase("pipeline") if phase else nullcontext():  # forwards and backwards, inside torch
            self.schedule.step(*([x] if self.first else []), target=y if self.last else None,
                               losses=losses, return_outputs=False, **kwargs)
        return torch.stack(losses).sum() if losses else torch.zeros((), device=x.device)
