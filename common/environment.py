"""The machine a run is on (device name, environment, peak memory), and the setup each
chapter's `setup()` makes in sight (`exit_with_launcher`, `share_cpu_threads`, `set_tf32`)."""

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

from .errors import UsageError

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_tf32(enabled: bool) -> None:
    """Let fp32 matmuls on CUDA use TF32 tensor cores (10-bit mantissa, faster), or not.
    Both of torch's APIs are set: they must agree, and its compiler reads the old one."""
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
    """On Linux, ask the kernel to send this process `sig` when its parent dies; False
    where that cannot be asked (a parent already gone is not noticed: the caller checks)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_launcher():
    """Under torchrun: SIGTERM when torchrun's agent dies, so no worker trains on alone."""
    if "LOCAL_RANK" not in os.environ or not end_with_parent(signal.SIGTERM):
        return
    if os.getppid() == 1:
        sys.exit("error: the launcher (torchrun) is gone; stopping")


THREADS_ENV = "LLM_GUIDE_THREADS"


def threads_override() -> int | None:
    """LLM_GUIDE_THREADS, the CPU threads per process a user asks for (None: unset)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdecimal() or int(value) < 1:
        raise UsageError(f"{THREADS_ENV}={value!r}: must be a whole number >= 1 (CPU threads per process)")
    return int(value)


def share_cpu_threads(device: torch.device | str = "cpu") -> tuple[int, int]:
    """Each process's share of this machine's cores (half, at most 8, on a GPU: workers
    and NCCL need cores too), or LLM_GUIDE_THREADS. Returns (threads, processes on this
    machine). A collective when distributed."""
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

