"""Process-group plumbing the chapters use but do not teach.

- `DDP_NO_BUFFER_SYNC`: DDP's "do not re-send buffers before every forward" keyword,
  under the name this torch version knows.
- `first_error`: every rank learns the first rank's error, so all stop together.
- `init_process_group_for_restarts`: chapter 04's join, safe across torchrun restarts.
- `gc_and_destroy_process_group`: the teardown that avoids gloo's exit deadlock.
- `backend_for`, `gpu_sharing_error`: nccl for GPUs, gloo for CPUs, or gloo on GPUs when
  LLM_GUIDE_BACKEND says so (several ranks sharing one GPU, which nccl refuses).
- `start_demo`: the process group of the chapter 05 scripts (one process per device).
"""

from __future__ import annotations

import gc
import inspect
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .net_errors import check_network

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Our only buffers are the constant RoPE tables, so DDP need not re-broadcast them before
# every forward. The flag was renamed (broadcast_buffers -> forward_sync_buffers); the old
# name warns in recent torch.
DDP_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})


BACKEND_ENV = "LLM_GUIDE_BACKEND"
BACKENDS = ("nccl", "gloo")


def backend_for(device: torch.device | str) -> str:
    """The process group's backend for ranks on `device`: nccl for GPUs, gloo for CPUs.
    LLM_GUIDE_BACKEND=gloo picks gloo on GPUs too: it moves CUDA tensors through host
    memory (slowly), and unlike nccl it lets several ranks share one GPU. The choice is
    checked with the flags (`gpu_sharing_error`), before any work."""
    return os.environ.get(BACKEND_ENV) or ("nccl" if torch.device(device).type == "cuda" else "gloo")


def gpu_sharing_error(choice: str, cuda: bool, processes: int, gpus: int) -> str | None:
    """What is wrong with LLM_GUIDE_BACKEND=`choice` ("" when unset) for `processes`
    ranks on a machine with `gpus` GPUs (`cuda`: the ranks train on them), or None.
    Local rank r takes GPU r mod `gpus`: more ranks than GPUs share them, which gloo allows
    and nccl refuses."""
    if choice and choice not in BACKENDS:
        return f"{BACKEND_ENV}={choice!r}: choose nccl or gloo (or leave it unset)"
    if choice == "nccl" and not cuda:
        return f"{BACKEND_ENV}=nccl needs GPUs, and this run has none (leave it unset on CPUs)"
    if cuda and choice != "gloo" and processes > gpus:
        return (f"{processes} processes on this machine but {gpus} GPU(s): nccl needs a GPU per "
                f"process; start fewer, or set {BACKEND_ENV}=gloo to let them share")
    return None


def local_gpu(local_rank: int) -> torch.device:
    """The GPU of the process with this LOCAL_RANK: GPU `local_rank`, or with more processes
    than GPUs (gloo only, `gpu_sharing_error`) GPU local_rank mod the number of GPUs."""
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def first_error(error: str | None, group=None) -> str | None:
    """Every rank passes its error (or None) and gets the lowest rank's error back. A
    collective: every rank calls it. Without a process group it returns `error`."""
    if not (dist.is_available() and dist.is_initialized()):
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e), None)


def patient_group(seconds: float = 4 * 3600):
    """A CPU (gloo) group of all ranks whose waits may last `seconds`: for waiting on work
    that is not a collective (a peer training the tokenizer), which --timeout, meant for
    collectives, should not cut short. A collective: every rank calls it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))


def init_process_group_for_restarts(backend: str, timeout: timedelta, **kwargs):
    """init_process_group on a store namespaced by torchrun's restart count. torchrun
    keeps one store across restarts, still holding the dead workers' addresses; without
    the prefix a restarted gloo group tries to reach them and times out (torch 2.13)."""
    check_network(backend)  # several machines: an unreachable address stops here, in one line
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{restart}", store),
                            rank=rank, world_size=world_size, timeout=timeout, **kwargs)


def gc_and_destroy_process_group():
    """Collect garbage first (a DDP wrapper the caller just dropped holds the group in its
    reducer), then destroy the group. Left to interpreter exit, the two teardowns can
    deadlock in gloo."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Demo:
    """A chapter 05 script's process group: this rank, the world size, the one device
    whose tensors its collectives may send, and the backend (nccl or gloo)."""
    rank: int
    world: int
    device: torch.device
    backend: str


def start_demo(timeout_s: float) -> Demo:
    """The chapter 05 scripts' process group: torchrun set RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT; nccl moves GPU memory between GPUs, gloo moves CPU
    memory over sockets (and, with LLM_GUIDE_BACKEND=gloo, GPU memory through the host).
    Every tensor a collective sends must live on `Demo.device`: nccl refuses CPU tensors. (The proofs ask for exact kernels
    themselves, for their duration only: `common.proof.exact_kernels`.)"""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    kwargs = {}
    device = local_gpu(local_rank) if torch.cuda.is_available() else torch.device("cpu")
    backend = backend_for(device)  # gloo on GPUs too when LLM_GUIDE_BACKEND=gloo
    if device.type == "cuda":
        torch.cuda.set_device(device)  # else every process would use GPU 0
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return Demo(dist.get_rank(), dist.get_world_size(), device, backend)
