"""The shared setup of the demonstration scripts (chapter 03's ddp_knobs.py and
debug_hang.py, chapter 05's scripts, chapter 06's proof and measurements), which the
training scripts do not need:

- `script_parser`: their flags and checks (torchrun with at least N processes, ...);
- `start_group`: their process group, one process per device;
- `fixed_batches`: the same batches for every method a script compares;
- `all_gather_single`, `reduce_scatter_single`: the two collectives under this torch's names;
- `exact_kernels`: deterministic kernels and no TF32 while a proof runs (chapters 05, 06).
"""

from __future__ import annotations

import itertools
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity
from torch.utils.data import DataLoader, DistributedSampler

from .cli import (DEFAULT_SAVE_DIR, REPO_ROOT, Parser, check_backend_choice, check_run_folder,
                  check_seq_length, one_of, positive_float, positive_int, seconds, seed_value)
from .data import Data, build_datasets, check_dataset_name, check_enough_samples, local_rank0_first
from .distributed import backend_for
from .environment import set_tf32, tf32_enabled
from .errors import UsageError
from .model import PRESETS

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def script_parser(name: str, description: str, *, min_world: int = 2,
                  run_folder: bool = True, training: bool = False) -> Parser:
    """The flags and checks the demo scripts (chapter 05's, chapter 03's ddp_knobs.py and
    debug_hang.py) share: torchrun with at least `min_world` processes, --timeout, (if
    `run_folder`) --save-dir and --experiment-name (default `<name>-<job id>`), and (if
    `training`) the model and data flags of the scripts that train: --model-preset,
    --seq-length, --batch-size, --lr, --seed, --dataset-name."""
    p = Parser(description=description)
    if training:
        p.add_argument("--model-preset", default="small", type=one_of(*PRESETS), help="model size")
        p.add_argument("--seq-length", type=positive_int, default=128, help="tokens per sample")
        p.add_argument("--batch-size", type=positive_int, default=8, help="samples per step, per process")
        p.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (constant)")
        p.add_argument("--seed", type=seed_value, default=0, help="initial weights (plus rank), data order")
        p.add_argument("--dataset-name", default="stdlib", help="'stdlib', a hub id, or a local path")
        p.checks += [check_seq_length, lambda args: check_dataset_name(args.dataset_name)]
    p.add_argument("--timeout", type=seconds, default=600,
                   help="seconds a collective may wait for the other ranks before failing")
    if run_folder:
        p.add_argument("--save-dir", default=str(DEFAULT_SAVE_DIR), help="parent of the run folder")
        p.add_argument("--experiment-name", default=None,
                       help=f"run folder name (default: {name}-<job id>, torchrun's rendezvous id; "
                            f"{name}-<timestamp> where the job has none)")
        p.checks.append(lambda args: check_run_folder(args, name))

    def check_torchrun(args):
        script = Path(sys.argv[0]).resolve()
        script = script.relative_to(REPO_ROOT) if script.is_relative_to(REPO_ROOT) else sys.argv[0]
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise UsageError(f"launch with torchrun, e.g. torchrun --standalone "
                             f"--nproc-per-node={min_world} {script}")
        if int(os.environ["WORLD_SIZE"]) < min_world:
            raise UsageError(f"this needs at least {min_world} processes "
                             f"(--nproc-per-node={min_world} or more)")
        check_backend_choice(cuda=torch.cuda.is_available())
    p.checks.append(check_torchrun)
    return p


def local_gpu(local_rank: int) -> torch.device:
    """The GPU of the process with this LOCAL_RANK: GPU `local_rank`, or with more processes
    than GPUs (gloo only, `gpu_sharing_error`) GPU local_rank mod the number of GPUs."""
    return torch.device("cuda", local_rank % torch.cuda.device_count())


@dataclass
class Group:
    """A chapter 05 script's process group: this rank, the world size, the one device
    whose tensors its collectives may send, and the backend (nccl or gloo)."""
    rank: int
    world: int
    device: torch.device
    backend: str


def start_group(timeout_s: float) -> Group:
    """The chapter 05 scripts' process group: torchrun set RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT; nccl moves GPU memory between GPUs, gloo moves CPU
    memory over sockets (and, with LLM_GUIDE_BACKEND=gloo, GPU memory through the host).
    Every tensor a collective sends must live on `Group.device`: nccl refuses CPU tensors. (The proofs ask for exact kernels
    themselves, for their duration only: `exact_kernels` below.)"""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    kwargs = {}
    device = local_gpu(local_rank) if torch.cuda.is_available() else torch.device("cpu")
    backend = backend_for(device)  # gloo on GPUs too when LLM_GUIDE_BACKEND=gloo
    if device.type == "cuda":
        torch.cuda.set_device(device)  # else every process would use GPU 0
    if backend == "nccl":
        kwargs["device_id"] = device
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return Group(dist.get_rank(), dist.get_world_size(), device, backend)


def fixed_batches(dataset_name: str, seq_len: int, batch_size: int, count: int, seed: int,
                  rank: int, world: int, device) -> tuple[Data, list]:
    """`count` packed training batches of this rank's shard of one shared shuffle (the
    DistributedSampler order of chapter 03), loaded onto `device` before any timing, for
    the chapter 05 scripts that run several methods on the very same data."""
    def build():
        data = build_datasets(dataset_name, seq_len, packed=True)
        check_enough_samples(data.train, batch_size * world)
        return data
    data = local_rank0_first(build)
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=batch_size, sampler=sampler, drop_last=True)
    batches, epoch = [], 0
    while len(batches) < count:
        sampler.set_epoch(epoch)
        batches += [(x.to(device), y.to(device)) for x, y in itertools.islice(loader, count - len(batches))]
        epoch += 1
    return data, batches


def profiler_activities(device: torch.device) -> list:
    """What torch.profiler records: host operators, and GPU kernels; Kineto's log muted."""
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when a recording starts
    return [ProfilerActivity.CPU]


@contextmanager
def exact_kernels():
    """While a proof runs: deterministic kernels (no atomics whose order varies between
    runs) wherever torch has one (warn_only: an operation without one warns and runs as
    usual) and, on GPUs, no TF32 in fp32 matmuls. Restored afterwards, so that timed steps
    run at the chapters' usual speed."""
    # read by cuBLAS when it starts; the proof runs first, so this is in time
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), tf32_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    set_tf32(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        set_tf32(before[2])
