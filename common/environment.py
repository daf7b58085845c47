"""The machine and the process a run is on.

- Facts: the device's name, what a reader needs to reproduce a run (`environment_info`),
  the launcher, the peak memory.
- The setup every chapter makes in sight, in its `setup()`: `exit_with_launcher` (under
  torchrun no worker trains on as an orphan), `share_cpu_threads` (the same CPU threads
  per machine in every chapter), `set_tf32` (fp32 matmuls on CUDA tensor cores).
"""

from __future__ import annotations

import ctypes
import os
import platform
import resource
import signal
import socket
import sys
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity

from common.errors import UsageError, fail

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def set_tf32(enabled: bool) -> None:
    """Let fp32 matmuls and cuDNN convolutions on CUDA use TF32 tensor cores (10-bit
    mantissa, several times faster), or not. Torch 2.9 on has two APIs for it, and reading
    one that disagrees with the other is an error: written through the new one only
    (`fp32_precision`), a read of the old `allow_tf32` or `get_float32_matmul_precision()`
    raises, and torch's own compiler reads the old one in some versions (lowering a
    `bmm` in 2.10, autotuning in 2.11). So both are written, to the same setting."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old API's deprecation notice
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled
    precision = "tf32" if enabled else "ieee"
    for flags in (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn):
        flags.fp32_precision = precision


def tf32_enabled() -> bool:
    """Whether fp32 matmuls on CUDA may use TF32, read through the API `set_tf32` writes
    (torch's default, 'none' on some versions, means IEEE fp32: TF32 matmuls are opt-in)."""
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
    """(peak MB, what was measured): the CUDA allocator's peak on GPU, else the
    process's peak resident set size."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if sys.platform == "darwin":  # bytes there, kilobytes on Linux
        rss_kb /= 1024
    return rss_kb / 1024, "process_peak_rss"


def end_with_parent(sig: int) -> bool:
    """On Linux, ask the kernel to send this process `sig` the moment its parent dies
    (PR_SET_PDEATHSIG); False where that cannot be asked (elsewhere, a no-op). A parent
    that died before the request leaves this process with another parent: the caller
    checks os.getppid()."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_launcher():
    """Under torchrun, on Linux (elsewhere a no-op): ask the kernel to send this process
    SIGTERM when its parent (torchrun's agent) dies. If the parent is already gone (we
    were orphaned before asking), exit now."""
    if "LOCAL_RANK" not in os.environ or not end_with_parent(signal.SIGTERM):
        return
    if os.getppid() == 1:
        sys.exit("error: the launcher (torchrun) is gone; stopping")


class ThreadBudget(NamedTuple):
    threads_per_process: int
    processes_per_machine: int


THREADS_ENV = "LLM_GUIDE_THREADS"


def threads_override() -> int | None:
    """LLM_GUIDE_THREADS, the CPU threads per process a user asks for; unset or empty:
    None. Anything but a whole number >= 1 raises UsageError (the chapters' parsers check
    it, so a bad value is one line and exit status 2 before any work)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return None
    if not value.isdecimal() or int(value) < 1:
        raise UsageError(f"{THREADS_ENV}={value!r}: must be a whole number >= 1 (CPU threads per process)")
    return int(value)


def share_cpu_threads(device: torch.device | str = "cpu") -> ThreadBudget:
    """The same CPU budget per machine in every chapter: each process gets its share of
    the machine's usable cores (divided by the processes training on it, counted across
    the process group, so two torchruns on one machine count as two), and torch uses that
    many threads. On a GPU the math runs on the device and a process's CPU threads only
    launch kernels and run the odd CPU op, while its DataLoader workers, the pin-memory
    thread and NCCL's proxy threads need cores of their own: torch gets half the share
    there, at most 8 (PyTorch's tuning advice: avoid oversubscribing the cores).
    LLM_GUIDE_THREADS=N sets the threads per process instead (for a machine that other
    jobs share; the test suite gives each of its workers' processes their share so). A
    collective when distributed."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    here = 1
    if dist.is_available() and dist.is_initialized():
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        here = hosts.count(socket.gethostname())
    share = max(1, (cores or 1) // here)
    if torch.device(device).type == "cuda":
        share = max(1, min(8, share // 2))
    try:
        threads = threads_override() or share
    except UsageError as e:  # a script whose parser did not check it
        fail(str(e))
    torch.set_num_threads(threads)
    return ThreadBudget(threads, here)


def profiler_activities(device: torch.device) -> list:
    """What torch.profiler records on `device`: the host's operators, and on a GPU its
    kernels too. On a CPU the profiler's tracing library (Kineto) would print a `USDT:
    ... profiler_start` and a `profiler_stop` line per recording, trace markers that read
    like errors: its log is silenced there (a KINETO_LOG_LEVEL of your own is kept). On a
    GPU it stays, since there it says when the GPU's activity cannot be recorded."""
    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read when a recording starts
    return [ProfilerActivity.CPU]
