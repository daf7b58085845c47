"""Not a test: launched with torchrun over gloo on CPUs by tests/test_ch05_dcp.py. The
gather that chapter 05's proofs use where torch's own crashes (gloo with CUDA tensors,
05-collectives/proof.py) must give what torch's gives: every parameter's `full_tensor`, shards of
uneven and empty size, and the whole state of an FSDP2 model and its AdamW after a step,
keys, dtypes and values exactly. Prints "same: N tensors" and exits 0, or says what
differs and exits 1."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils._pytree import tree_flatten_with_path, keystr

from common.model import LlamaForCausalLM, get_config
from common.training import build_optimizer
from conftest import chapter_module

proof = chapter_module("05-collectives", "proof")
full_state, full_tensor = proof.full_state, proof.full_tensor
gathers_through_functional_collectives = proof.gathers_through_functional_collectives

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = LlamaForCausalLM(get_config("tiny", 101))
for layer in model.layers:
    fully_shard(layer)
fully_shard(model)
optimizer = build_optimizer(model, 1e-2, 0.1, torch.device("cpu"))
x = torch.randint(0, 101, (2, 16))
model(x).float().square().mean().backward()
optimizer.step()

mesh = init_device_mesh("cpu", (world,))
uneven = [distribute_tensor(torch.arange(rows * 3.0).reshape(rows, 3), mesh, [Shard(0)])
          for rows in (1, world + 1, 2 * world - 1)]
problems, compared = [], 0
for i, t in enumerate([*model.parameters(), *uneven]):
    assert gathers_through_functional_collectives(t)  # gloo on a CPU: torch's own gather works
    ours, torchs = full_tensor(t, own_gather=True), t.full_tensor()
    compared += 1
    if ours.shape != torchs.shape or not torch.equal(ours, torchs):
        problems.append(f"tensor {i} {tuple(t.shape)}: our gather differs from full_tensor()")

ours, torchs = full_state(model, optimizer, own_gather=True), full_state(model, optimizer)
if rank == 0:
    a, b = (dict((keystr(k), v) for k, v in tree_flatten_with_path(s)[0]) for s in (ours, torchs))
    if a.keys() != b.keys():
        problems.append(f"full_state keys differ: {sorted(a.keys() ^ b.keys())[:5]}")
    for k in sorted(a.keys() & b.keys()):
        x, y = a[k], b[k]
        compared += 1
        tensors = torch.is_tensor(x) and torch.is_tensor(y)
        if not (tensors and (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device) and torch.equal(x, y)
                or not torch.is_tensor(x) and not torch.is_tensor(y) and x == y):
            problems.append(f"full_state {k}: ours {x!r:.60} vs torch's {y!r:.60}")
dist.barrier()
dist.destroy_process_group()
print("\n".join(problems) if problems else f"rank {rank} same: {compared} tensors")
sys.exit(1 if problems else 0)
