"""The machine and the process a run is on: facts (device name, `environment_info`, the
launcher, peak memory), and the setup every chapter's `setup()` makes in sight
(`exit_with_launcher`, `share_cpu_threads`, `set_tf32`)."""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal
import socket
import sys
import warnings

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from .errors import UsageError

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_tf32(enabled: bool) -> None:
    """Let fp32 matmuls and cuDNN convolutions on CUDA use TF32 tensor cores (10-bit
    mantissa, several times faster), or not. Both of torch's APIs for it are written, to
    the same setting: reading one that disagrees with the other raises, and torch's own
    compiler reads the old one in some versions."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old API's deprecation notice
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    precision = "tf32" if enabled else "ieee"
    for flags in (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn):
        flags.fp32_precision = precision


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32 (torch's default 'none' means no)."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU {cpu} ({os.cpu_count()} cores)"


def environment_info() -> dict:
    """What a reader needs to reproduce or compare a run."""
    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cuda_version": torch.version.cuda,
        "nccl_available": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RESTART_COUNT", "CUBLAS_WORKSPACE_CONFIG"):
        if var in os.environ:
            info[var] = os.environ[var]
    return info


def launcher() -> str:
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ else "python"


def peak_memory_mb(device: torch.device | str) -> tuple[float, str]:
    """(peak MB, what): the CUDA allocator's peak, else the process's peak resident set."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.platform == "darwin":  # bytes there, kilobytes on Linux
        rss_kb /= 1024
    return rss_kb / 1024, "process_peak_rss"


def end_with_parent(sig: int) -> bool:
    """On Linux, ask the kernel to send this process `sig` the moment its parent dies
    (PR_SET_PDEATHSIG); False where that cannot be asked. A parent that died before the
    request is not noticed: the caller checks."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_launcher():
    """Under torchrun, on Linux: SIGTERM to this process when torchrun's agent dies (exit
    now if it is already gone). No worker trains on as an orphan."""
    if "LOCAL_RANK" not in os.environ or not end_with_parent(signal.SIGTERM):
        return
    if os.getppid() == 1:
        sys.exit("error: the launcher (torchrun) is gone; stopping")


THREADS_ENV = "LLM_GUIDE_THREADS"


def threads_override() -> int | None:
    """LLM_GUIDE_THREADS, the CPU threads per process a user asks for (None: unset).
    UsageError unless a whole number >= 1 (the chapters' parsers check it)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdecimal() or int(value) < 1:
        raise UsageError(f"{THREADS_ENV}={value!r}: must be a whole number >= 1 (CPU threads per process)")
    return int(value)


def share_cpu_threads(device: torch.device | str = "cpu") -> tuple[int, int]:
    """The same CPU budget per machine in every chapter: each process gets its share of
    the usable cores (divided by the processes of the group on this machine). On a GPU
    the math runs on the device, and DataLoader workers and NCCL's threads need cores of
    their own: half the share there, at most 8. LLM_GUIDE_THREADS=N sets it instead (a
    machine other jobs share). Returns (threads per process, processes on this machine).
    A collective when distributed."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    here = 1
    if dist.is_available() and dist.is_initialized():
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        here = hosts.count(socket.gethostname())
    share = max(1, (cores or 1) // here)
    if torch.device(device).type == "cuda":
        share = max(1, min(8, share // 2))
    threads = threads_override() or share
    torch.set_num_threads(threads)
    return threads, here


def profiler_activities(device: torch.device) -> list:
    """What torch.profiler records: the host's operators, and on a GPU its kernels. On a
    CPU the profiler's Kineto log, whose trace markers read like errors, is silenced."""
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when a recording starts
    return [ProfilerActivity.CPU]
