"""Chapter 07's parallelize.py with a cp dimension in its Layout (`diff -u` shows it).

The composition: one model cut four ways on one DeviceMesh (dp x pp x tp), built on
the meta device, each rank materialising only its own pieces, with chapter 01's values.

The order in which the cuts are applied, for every stage this rank holds:

1. pp, outermost: the decoder layers are cut into stages first (pipeline_parallel.py).
   A stage is then a model of its own, and everything below happens inside it: its
   tensor parallelism, its checkpointing, its FSDP units. (Cut after FSDP, a stage
   would hold FSDP units of layers it does not run.)
2. tp (+ sequence parallelism): each weight becomes a DTensor over the tp ranks and
   each layer's forward gains its collectives (sequence_parallel.py). It changes what
   a layer computes, so it comes before anything that wraps a layer's forward.
3. activation checkpointing: each layer's forward, tensor-parallel collectives
   included, is run again in backward instead of keeping its activations. It wraps
   the forward that tp made, and sits inside FSDP's unit: FSDP gathers a layer's
   weights once around the recomputation, never inside it.
4. FSDP (`fully_shard`) over the dp ranks, last: it shards whatever parameters it
   finds, here the tp DTensors, into 2-D DTensors (dp x tp), one unit per decoder
   layer, then the stage itself. Its hooks are the outermost around each layer: the
   all-gather before the layer's forward and backward, the reduce-scatter after.

No rank ever holds the whole model. The model is first built on the meta device
(shapes, no memory); after the cuts, `to_empty` gives each rank memory for its own
pieces only, and `materialize` fills them with the values chapter 01's
`LlamaForCausalLM(config)` draws after `torch.manual_seed(seed)`: it replays chapter
01's random draws in order, one tensor at a time, and keeps the piece of each tensor
this rank holds. So the initial weights are the same whatever the layout (and a rank
holds one whole tensor at a time, on its CPU, while it does so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

import common.layout
import sequence_parallel
from common.model import LlamaForCausalLM, RotaryEmbedding, init_parameter
from pipeline_parallel import StageModule, split_layers, stages_of_rank


@dataclass(frozen=True)
class Layout(common.layout.Layout):
    """Chapter 06's layout (dp x pp x tp ranks, tp innermost; the micro-batches, the
    schedule, whose layers), with `virtual` stages per pipeline rank and sequence
    parallelism on the tp ranks or not. The dp ranks shard with FSDP. `api`: torch's
    DTensor layers (what the training script runs) or sequence_parallel.py's. `cp`
    ranks between dp and tp split each sequence, their attention `cp_attention`
    (context_parallel.py): world = pp x dp x cp x tp."""
    api: str = "torch"
    virtual: int = 1
    sequence_parallel: bool = True
    cp: int = 1
    cp_attention: str = "ring"

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def sequence_shards(self) -> int:
        return self.tp if self.sequence_parallel and self.tp > 1 else 1

    def __str__(self) -> str:
        shape = " x ".join(f"{k} {getattr(self, k)}" for k in ("pp", "dp", "cp", "tp"))
        extras = [f"{self.virtual} stages per pipeline rank"] * (self.virtual > 1)
        extras += [f"{self.cp_attention} attention"] * (self.cp > 1)
        extras += ["sequence parallel"] * (self.sequence_shards > 1)
        return ", ".join([shape, *extras])


def checkpoint_forward(layer: nn.Module) -> None:
    """Activation checkpointing of one layer, set on the layer itself (its parameter names
    unchanged): its forward keeps only its inputs, and runs again in backward."""
    forward = layer.forward

    def recomputed(*args):
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False)
        return forward(*args)
    layer.forward = recomputed


def build_stages(config, mesh, layout: Layout, device, dtype=torch.float32, autocast=None,
                 activation_checkpointing: bool = False) -> tuple[list[StageModule], list[int]]:
    """This rank's stages, cut in the order above, their memory allocated but not yet
    filled (`materialize` does). Returns (stage modules, their stage numbers)."""
    with torch.device("meta"):  # shapes only: no memory, no random draws
        model = LlamaForCausalLM(config).to(dtype)
    pp_rank = mesh.get_local_rank("pp")
    ranges = split_layers(config.num_hidden_layers, layout.pp * layout.virtual)
    stage_ids = stages_of_rank(pp_rank, layout.pp, layout.virtual)
    stages = [StageModule(model, ranges[s], s == 0, s == len(ranges) - 1, autocast, layout.sequence_shards)
              for s in stage_ids]
    for stage in stages:
        if layout.tp > 1 and layout.api == "torch":
            sequence_parallel.parallelize_with_torch(stage, mesh["tp"], layout.sequence_parallel)
        elif layout.tp > 1:
            sequence_parallel.parallelize(stage, mesh.get_group("tp"))
        # With a pipeline, a stage's weights stay gathered from its first micro-batch's forward
        # to its last backward: one all-gather a step, not one per micro-batch (torchtitan's
        # default; the Llama 3 run's too). Without one, each layer is freed after its forward.
        reshard = layout.pp == 1
        for layer in stage.layers.values():
            if activation_checkpointing:
                checkpoint_forward(layer)
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=reshard)  # the embedding, the norm, the head
        stage.to_empty(device=device)  # this rank's pieces only
        stage.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                       config.rope_theta).to(device)  # computed, not drawn
    return stages, stage_ids


def local_piece(full: torch.Tensor, name: str, p, layout: Layout, tp_rank: int) -> torch.Tensor:
    """This rank's piece of the whole tensor `full` of parameter `name`, cut as `p`
    (this rank's parameter) is cut: by its DTensor placements, and for the from-scratch
    layers first by the tp slice sequence_parallel.py takes (no communication)."""
    if layout.api == "scratch" and layout.tp > 1 and (dim := sequence_parallel.tp_dim(name)) is not None:
        start, end = sequence_parallel.shard_range(full.shape[dim], tp_rank, layout.tp)
        full = full.narrow(dim, start, end - start)
    if isinstance(p, DTensor):
        return distribute_tensor(full.detach(), p.device_mesh, p.placements, src_data_rank=None).to_local()
    return full


@torch.no_grad()
def materialize(stages, config, layout: Layout, seed: int, tp_rank: int) -> None:
    """Fill this rank's pieces with chapter 01's initial values: after
    torch.manual_seed(seed), LlamaForCausalLM(config) first draws each nn.Linear's and
    nn.Embedding's default initialisation as it creates them, then reset_parameters
    draws every parameter again, in order. Both are replayed here on the CPU, one whole
    tensor at a time; each rank keeps the pieces it holds."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        reference = LlamaForCausalLM(config)  # names, shapes and order; meta draws nothing
    for m in reference.modules():  # the constructor's draws, discarded
        if isinstance(m, nn.Linear):
            nn.init.kaiming_uniform_(torch.empty(m.weight.shape), a=math.sqrt(5))
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(torch.empty(m.weight.shape))
    mine = {name: p for stage in stages for name, p in stage.named_parameters()}
    for name, p in reference.named_parameters():  # reset_parameters' draws, kept where they are ours
        full = torch.empty(p.shape)
        init_parameter(name, full, config.num_hidden_layers)
        if name in mine:
            target = mine[name]
            local = target.to_local() if isinstance(target, DTensor) else target
            local.copy_(local_piece(full, name, target, layout, tp_rank))


def counted_once(p, tp_rank: int) -> bool:
    """Whether this rank's piece of p's gradient counts in the global gradient norm. The
    norm weights (the model's only 1-D parameters) are whole on every tp rank: they
    count on the first tp rank only. Every other piece is held by one rank alone."""
    return p.dim() > 1 or tp_rank == 0


@torch.no_grad()
def clip_grad_norm(params, max_norm: float, tp_rank: int):
    """clip_grad_norm_ over the whole model, whose gradients are cut four ways: each
    rank's pieces squared and summed (in fp64), then summed over every rank, each piece
    once. Returns the norm."""
    params = [p for p in params if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for p in params:
        if counted_once(p, tp_rank):
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            squares += g.double().square().sum()
    dist.all_reduce(squares)  # every rank: the stages, the dp shards, the tp pieces
    total = squares.sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        g.mul_(coef.to(g.dtype))
    return total
