"""The peak FLOP/s that MFU is measured against: a known GPU's datasheet figure for the
matmul precision in use, else the best of a short sweep of square matmuls, measured once
per machine and setup, then cached (`python -m tools.peak` shows or remeasures it)."""

from __future__ import annotations

import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import default_cache_dir
from .environment import device_name, set_tf32, tf32_enabled
from .files import read_json, write_json
from .tables import format_flops

# Dense tensor-core peaks in TFLOP/s from NVIDIA's datasheets (which print the sparse
# figure, twice as high); "fp32" without tensor cores. The first pattern that matches wins.
DATASHEET_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"\bB200\b", {"bf16": 2250.0, "tf32": 1125.0, "fp32": 75.0}),     # HGX B200, per GPU
    (r"\bGH200\b", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),     # its Hopper GPU
    (r"\bH200 NVL\b", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH200\b", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),       # SXM
    (r"\bH100 NVL\b", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"\bH100 PCIe\b", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"\bH100 (SXM|80GB HBM3)", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    (r"\bH800 PCIe\b", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"\bH800 (SXM|80GB HBM3)", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    (r"\bL40S\b", {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL40\b", {"bf16": 181.0, "tf32": 90.5, "fp32": 90.5}),
    (r"\bA100\b", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),      # SXM and PCIe
    (r"\bA10\b", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),        # not A10G, A100
    (r"\bL4\b", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),         # not L40, L40S
]

CACHE_FILE = "matmul_peak.json"


@dataclass
class Peak:
    flops: float        # FLOP/s
    precision: str      # "bf16", "tf32" or "fp32": what the run's matmuls use
    source: str         # "datasheet" or "measured"

    def label(self) -> str:
        """e.g. '95.3 GFLOP/s (measured fp32 matmul peak)'."""
        return f"{format_flops(self.flops)} ({self.source} {self.precision} matmul peak)"


def matmul_precision(device: torch.device | str, dtype: str) -> str:
    """What a run's matmuls compute in: bf16 under autocast; fp32 on CUDA may be tf32."""
    if dtype == "bf16":
        return "bf16"
    if torch.device(device).type == "cuda" and tf32_enabled():
        return "tf32"
    return "fp32"


def datasheet_peak(name: str, precision: str) -> float | None:
    """The datasheet's dense peak FLOP/s of a known device, else None (also for a MIG
    slice: it has a fraction of the GPU, so its peak is measured)."""
    if re.search(r"\bMIG\b", name):
        return None
    for pattern, tflops in DATASHEET_TFLOPS:
        if re.search(pattern, name):
            return tflops[precision] * 1e12 if precision in tflops else None
    return None


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_matmul_flops(n: int, device: torch.device, precision: str, reps: int = 5,
                      budget_s: float = 0.6) -> float:
    """Best FLOP/s of an n×n matmul: a warm-up, then up to `reps` timed ones within `budget_s`."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)
    sync(device)
    best, spent = math.inf, 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        sync(device)
        took = time.perf_counter() - t0
        best, spent = min(best, took), spent + took
        if spent > budget_s:
            break
    return 2 * n**3 / best


def measure_matmul_peak(device: torch.device | str, precision: str) -> float:
    """The best FLOP/s over a few sizes (small ones fit caches, large ones amortise overheads)."""
    device = torch.device(device)
    sizes = (1024, 2048, 4096, 8192) if device.type == "cuda" else (128, 256, 512, 1024, 2048)
    if device.type != "cuda":
        # up while one matmul takes under a second: a CPU may emulate bf16, slowly
        best = 0.0
        for n in sizes:
            flops = best_matmul_flops(n, device, precision)
            best = max(best, flops)
            if 2 * n**3 / flops > 1.0:
                break
        return best
    tf32 = tf32_enabled()
    try:
        set_tf32(precision == "tf32")  # what an fp32 matmul computes in, on CUDA
        return max(best_matmul_flops(n, device, precision) for n in sizes)
    finally:
        set_tf32(tf32)


def cache_key(name: str, precision: str, device_type: str) -> str:
    """Device, precision, torch version; on a CPU the thread count (fewer, a lower peak)."""
    key = f"{name} | {precision} | torch {torch.__version__}"
    return key + (f" | {torch.get_num_threads()} threads" if device_type == "cpu" else "")


def cache_path(cache_dir=None) -> Path:
    return Path(cache_dir or default_cache_dir()) / CACHE_FILE


def measured_peak(device, precision: str, *, remeasure: bool = False, cache_dir=None) -> float:
    """This machine's peak in `precision`: from the cache, or measured now (and whenever
    `remeasure`) and cached."""
    device = torch.device(device)
    path, key = cache_path(cache_dir), cache_key(device_name(device), precision, device.type)
    cache = read_json(path)
    cache = cache if isinstance(cache, dict) else {}  # absent, torn or not this cache: measure
    record = cache.get(key)
    flops = record.get("flops") if isinstance(record, dict) else None
    if isinstance(flops, (int, float)) and math.isfinite(flops) and flops > 0 and not remeasure:
        return flops
    flops = measure_matmul_peak(device, precision)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {**cache, key: {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M:%S")}})
    except OSError as e:  # a read-only or full cache: the run's summary matters more
        print(f"warning: the matmul peak could not be cached in {path} ({e.strerror or e}); "
              f"it is measured again next time", file=sys.stderr, flush=True)
    return flops


def device_peak(device, dtype: str, *, cache_dir=None) -> Peak:
    """The peak MFU is measured against: the datasheet's where known, else measured."""
    precision = matmul_precision(device, dtype)
    flops = datasheet_peak(device_name(device), precision)
    if flops is not None:
        return Peak(flops, precision, "datasheet")
    return Peak(measured_peak(device, precision, cache_dir=cache_dir), precision, "measured")
