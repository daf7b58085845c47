"""Process-group plumbing the chapters use but do not teach: the backend, every rank
stopping on the first rank's error, a join that survives torchrun restarts, teardown."""

from __future__ import annotations

import gc
import inspect
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .errors import fail

# Our only buffers are the constant RoPE tables: DDP need not re-broadcast them before every
# forward. The flag was renamed (broadcast_buffers -> forward_sync_buffers).
DDP_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})


BACKEND_ENV = "LLM_GUIDE_BACKEND"


def backend_for(device: torch.device | str) -> str:
    """nccl for GPUs, gloo for CPUs; LLM_GUIDE_BACKEND=gloo on GPUs lets several ranks
    share one GPU (through host memory, slowly), which nccl refuses."""
    return os.environ.get(BACKEND_ENV) or ("nccl" if torch.device(device).type == "cuda" else "gloo")


def gpu_sharing_error(choice: str, cuda: bool, processes: int, gpus: int) -> str | None:
    """What is wrong with LLM_GUIDE_BACKEND=`choice` ("" when unset) for `processes` ranks
    on a machine with `gpus` GPUs (`cuda`: the ranks train on them), or None."""
    if choice not in ("", "nccl", "gloo"):
        return f"{BACKEND_ENV}={choice!r}: choose nccl or gloo (or leave it unset)"
    if choice == "nccl" and not cuda:
        return f"{BACKEND_ENV}=nccl needs GPUs, and this run has none (leave it unset on CPUs)"
    if cuda and choice != "gloo" and processes > gpus:
        return (f"{processes} processes on this machine but {gpus} GPU(s): nccl needs a GPU per "
                f"process; start fewer, or set {BACKEND_ENV}=gloo to let them share")
    return None


def first_error(error: str | None, group=None) -> str | None:
    """Every rank passes its error (or None) and gets the lowest rank's error back (a collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        return error
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error, group=group)
    return next((e for e in errors if e), None)


def stop_on_any_error(error: str | None, status: int = 2, group=None) -> None:
    """If any rank passes an error, every rank stops with the lowest rank's (a collective)."""
    error = first_error(error, group)
    if error:
        fail(error, status=status)


def on_rank0(work, rank: int, explain, status: int = 2) -> None:
    """`work()` (a write) on rank 0 while the others wait (a collective). `explain(error)`
    gives the line every rank stops with, or None to raise the error as it is."""
    error = None
    if rank == 0:
        try:
            work()
        except (OSError, RuntimeError) as e:
            error = explain(e)
            if error is None:
                raise
    stop_on_any_error(error, status)


def patient_group(seconds: float = 4 * 3600):
    """A gloo group of all ranks whose waits may last `seconds`: for waiting on a peer's
    work (training the tokenizer), which --timeout should not cut short. A collective."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))


def init_process_group_for_restarts(backend: str, timeout: timedelta, **kwargs):
    """init_process_group on a store namespaced by torchrun's restart count: the store
    outlives restarts, and a restarted gloo group would try the dead workers' addresses."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_store, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{restart}", store),
                            rank=rank, world_size=world_size, timeout=timeout, **kwargs)


def gc_and_destroy_process_group():
    """Collect a dropped DDP wrapper (its reducer holds the group), then destroy the group:
    left to interpreter exit, the two teardowns can deadlock in gloo."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


