"""The peak FLOP/s that MFU is measured against, on every device.

Where the device's datasheet is known (a few NVIDIA data-centre GPUs), its dense peak
for the matmul precision in use; otherwise a measured one: the best FLOP/s of a short
sweep of square matmuls in that precision, with the threads this process uses. A
measurement is cached in the guide's cache folder, keyed by device, precision, torch
version and (on CPU) thread count, so it runs once per machine and setup
(`python -m common.peak` shows it, or measures it again).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import default_cache_dir
from .environment import device_name, set_tf32, tf32_enabled
from .jsonfiles import write_json
from .tables import format_flops

# Dense (no structured sparsity) tensor-core peaks in TFLOP/s from NVIDIA's datasheets,
# which print the sparse figure (twice the dense one) for bf16 and tf32. "fp32" is the
# plain (non-tensor-core) fp32 rate. The first pattern that matches the device name wins,
# so the NVL parts come before the plain names they contain.
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


def peak_label(flops: float, precision: str, source: str) -> str:
    """e.g. '95.3 GFLOP/s (measured fp32 matmul peak)'."""
    return f"{format_flops(flops)} ({source} {precision} matmul peak)"


@dataclass
class Peak:
    flops: float        # FLOP/s
    precision: str      # "bf16", "tf32" or "fp32": what the run's matmuls use
    source: str         # "datasheet" or "measured"

    def label(self) -> str:
        """e.g. '95.3 GFLOP/s (measured fp32 matmul peak)'."""
        return peak_label(self.flops, self.precision, self.source)


def matmul_precision(device: torch.device | str, dtype: str) -> str:
    """What a run's matmuls compute in: bf16 under bf16 autocast; for fp32 on CUDA,
    tf32 when PyTorch is allowed to use it (the chapters allow it), else fp32."""
    if dtype == "bf16":
        return "bf16"
    if torch.device(device).type == "cuda" and tf32_enabled():
        return "tf32"
    return "fp32"


def datasheet_peak(name: str, precision: str) -> float | None:
    """The datasheet's dense peak FLOP/s of a known device, else None. A MIG slice (its
    name carries "MIG 1g.10gb", say) has a fraction of the GPU's compute units, not the
    whole GPU's datasheet figure: None, so its peak is measured."""
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
    """Best FLOP/s of an n×n by n×n matmul: one untimed warm-up, then up to `reps`
    timed ones, stopping early once `budget_s` is spent."""
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
    """The device's dense matmul peak in `precision`, measured: the best over a few
    sizes (small ones fit caches, large ones amortise overheads; the best wins)."""
    device = torch.device(device)
    sizes = (1024, 2048, 4096, 8192) if device.type == "cuda" else (128, 256, 512, 1024, 2048)
    if device.type != "cuda":
        # From small sizes up, while one matmul takes under a second: a CPU without bf16
        # instructions emulates them, fastest on small matrices (3.1 GFLOP/s at 128, 0.5 at
        # 1024 on an AVX2 CPU), where 2048 would take minutes, not a second.
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
    """Device, precision, torch version, and on CPU the thread count: with several
    processes per machine (torchrun) each one has fewer threads, so a lower peak."""
    key = f"{name} | {precision} | torch {torch.__version__}"
    if device_type == "cpu":
        key += f" | {torch.get_num_threads()} threads"
    return key


def read_cache(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}  # absent or half-written by a crashed run: measure again
    return cache if isinstance(cache, dict) else {}  # JSON, but not this cache: measure again


def cache_path(cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / CACHE_FILE


def cached_peak(device: torch.device, precision: str, cache_dir=None) -> float | None:
    return cached_record(device, precision, cache_dir).get("flops")


def cached_record(device: torch.device, precision: str, cache_dir=None) -> dict:
    """The cache's entry for this device, precision, torch and thread count: the best
    peak seen (`flops`), when (`measured`) and under which load (`load`, `cores`)."""
    key = cache_key(device_name(device), precision, device.type)
    record = read_cache(cache_path(cache_dir)).get(key, {})
    flops = record.get("flops") if isinstance(record, dict) else None
    # a record without a usable peak (edited, another version's) is measured again
    ok = isinstance(flops, (int, float)) and math.isfinite(flops) and flops > 0
    return record if ok else {}


def machine_load() -> tuple[float | None, int]:
    """(1-minute load average or None where unknown, CPU cores)."""
    return (os.getloadavg()[0] if hasattr(os, "getloadavg") else None), (os.cpu_count() or 1)


def busy(load: float | None, cores: int) -> bool:
    """Other programs took CPU time: the load average went above the cores by more than
    half a core. A run that keeps every core busy itself sits at about `cores`, and its
    own short spikes (a progress bar, a data worker) must not flag it."""
    return load is not None and load > cores + 0.5


def measured_peak(device: torch.device | str, precision: str, *, remeasure: bool = False,
                  cache_dir: str | Path | None = None) -> float:
    """The best peak ever measured here, from the cache. Measured when absent, when
    `remeasure` is set, or when the best so far was taken on a busy machine and this one
    is quieter (other work lowers a measurement, so a busy figure must not stay the peak).
    A new measurement replaces the cached one only if it is higher."""
    device = torch.device(device)
    record = cached_record(device, precision, cache_dir)
    load, cores = machine_load()
    quieter = busy(record.get("load"), record.get("cores", cores)) and not busy(load, cores)
    if record.get("flops") and not remeasure and not (device.type == "cpu" and quieter):
        return record["flops"]
    flops = measure_matmul_peak(device, precision)
    if record.get("flops", 0) >= flops:
        return record["flops"]
    path = cache_path(cache_dir)
    key = cache_key(device_name(device), precision, device.type)
    record = {"flops": flops, "measured": time.strftime("%Y-%m-%d %H:%M:%S"), "load": load, "cores": cores}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # re-read: another process may have added its own key meanwhile
        write_json(path, {**read_cache(path), key: record})
    except OSError as e:  # a read-only or full cache: the run's summary matters more
        print(f"warning: the measured matmul peak could not be cached in {path} "
              f"({e.strerror or e}); it is measured again next time", file=sys.stderr, flush=True)
    return flops


def device_peak(device: torch.device | str, dtype: str, *,
                cache_dir: str | Path | None = None) -> Peak:
    """The peak MFU is measured against: the datasheet's where known, else measured."""
    precision = matmul_precision(device, dtype)
    flops = datasheet_peak(device_name(device), precision)
    if flops is not None:
        return Peak(flops, precision, "datasheet")
    return Peak(measured_peak(device, precision, cache_dir=cache_dir), precision, "measured")


def slower_than_fp32_note(device: torch.device | str, peak: Peak,
                          cache_dir: str | Path | None = None) -> str | None:
    """A note when a CPU's measured bf16 matmul peak is below its fp32 one: without bf16
    instructions it emulates them, and `--dtype fp32` trains faster there."""
    device = torch.device(device)
    if device.type != "cpu" or peak.precision != "bf16" or peak.source != "measured":
        return None
    fp32 = measured_peak(device, "fp32", cache_dir=cache_dir)
    if fp32 <= peak.flops:
        return None
    return (f"bf16 matmuls on this CPU reach {format_flops(peak.flops)} against fp32's "
            f"{format_flops(fp32)} (no bf16 instructions: emulated); --dtype fp32 trains faster here")


def implausible_mfu_note(mfu: float, peak: Peak) -> str | None:
    """A note when MFU exceeds 100%: a measured peak taken while other work loaded the
    device is too low, and stays cached until re-measured."""
    if mfu <= 1.0:
        return None
    return (f"MFU over 100%: the {peak.source} peak ({format_flops(peak.flops)}) is too low"
            + (" (measured while the device was busy?): re-measure it with "
               "`python -m common.peak --remeasure`" if peak.source == "measured" else ""))
