"""Timing, throughput, memory, and the run's output files.

- `PhaseTimer`: wall time of data / forward / backward / update per step. On CUDA it
  synchronises at each phase boundary, otherwise asynchronous kernels would charge
  their time to whichever phase happens to wait for them.
- `StepStats`: averages over the measured steps (the first `warmup` steps are left
  out: allocator growth, kernel selection and caches make them unrepresentative).
- `MetricsWriter`: `metrics.jsonl`, one JSON object per logged step.
- `write_summary` / `throughput_table`: `summary.json` and the Markdown table printed
  at the end of every run.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

PHASES = ("data", "forward", "backward", "update")


class PhaseTimer:
    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self.times: dict[str, float] = {}

    def reset(self):
        self.times = {p: 0.0 for p in PHASES}

    @contextmanager
    def phase(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


class StepStats:
    """Per-step phase times and token counts; means over steps after `warmup`."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.steps: list[tuple[dict, int]] = []

    def add(self, phase_times: dict, tokens: int):
        self.steps.append((dict(phase_times), tokens))

    def measured(self):
        # leave warm-up steps out, unless that would leave nothing
        return self.steps[self.warmup:] if len(self.steps) > self.warmup else self.steps

    def mean_phase_times(self) -> dict:
        steps = self.measured()
        if not steps:
            return {p: 0.0 for p in (*PHASES, "total")}
        out = {p: sum(t.get(p, 0.0) for t, _ in steps) / len(steps) for p in PHASES}
        out["total"] = sum(out.values())
        return out

    def tokens_per_s(self) -> float:
        steps = self.measured()
        total_time = sum(sum(t.values()) for t, _ in steps)
        return sum(n for _, n in steps) / total_time if total_time > 0 else 0.0


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
    }
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_RESTART_COUNT"):
        if var in os.environ:
            info[var] = os.environ[var]
    return info


def launcher() -> str:
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ else "python"


class MetricsWriter:
    """Appends one JSON line per logged step; line-buffered so a crash loses nothing."""

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.f = open(self.path, "a" if append else "w", buffering=1)

    def write(self, record: dict):
        self.f.write(json.dumps(record) + "\n")

    def close(self):
        self.f.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl; a torn line (a kill or a full disk mid-write) is
    skipped, not fatal."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def write_jsonl(path: str | os.PathLike, records: list[dict]):
    """Rewrite a JSON-lines file atomically (a resumed run drops lines it will redo)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, obj: dict):
    """Write beside the target and rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def build_summary(*, chapter: str, args, world_size: int, device, dtype: str,
                  num_params: int, flops_per_token: float, stats: StepStats,
                  tokens_per_step: int, final_loss: float | None, val_loss: float | None,
                  wall_time_s: float, num_devices: int = 1, backend: str | None = None,
                  extra: dict | None = None) -> dict:
    from .model import mfu

    name = device_name(device)
    tps = stats.tokens_per_s()
    per_device = tps / max(1, num_devices)
    peak_mb, peak_kind = peak_memory_mb(device)
    summary = {
        "chapter": chapter,
        "experiment_name": args.experiment_name,
        "launcher": launcher(),
        "world_size": world_size,
        "num_devices": num_devices,
        "backend": backend,
        "device": torch.device(device).type,
        "device_name": name,
        "dtype": dtype,
        "preset": args.model_preset,
        "num_params": num_params,
        "seq_length": args.seq_length,
        "batch_size": args.batch_size,
        "tokens_per_step": tokens_per_step,
        "steps": len(stats.steps),
        "measured_steps": len(stats.measured()),
        "tokens_per_s": tps,
        "tokens_per_s_per_device": per_device,
        "step_time_s": stats.mean_phase_times(),
        "peak_memory_mb": peak_mb,
        "peak_memory_kind": peak_kind,
        "flops_per_token": flops_per_token,
        "mfu": mfu(per_device, flops_per_token, name),
        "final_loss": final_loss,
        "val_loss": val_loss,
        "wall_time_s": wall_time_s,
        "torch_version": torch.__version__,
        "args": {k: v for k, v in vars(args).items()},
    }
    summary.update(extra or {})
    return summary


def _fmt(v, digits=1):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def throughput_rows(s: dict) -> list[tuple[str, str]]:
    """The rows every chapter prints; chapter-specific keys add rows when present."""
    st = s["step_time_s"]
    total = st.get("total") or 1.0
    rows = [
        ("chapter", s["chapter"]),
        ("launcher / world size", f"{s['launcher']} / {s['world_size']}"
         + (f" ({s['backend']})" if s.get("backend") else "")),
        ("device", f"{s['device_name']} x {s['num_devices']}"),
        ("dtype / preset / params", f"{s['dtype']} / {s['preset']} / {s['num_params'] / 1e6:.2f} M"),
        ("tokens per step", _fmt(s["tokens_per_step"])),
        ("tokens/s total", _fmt(s["tokens_per_s"])),
        ("tokens/s per device", _fmt(s["tokens_per_s_per_device"])),
        ("step time (ms)", f"{total * 1e3:.1f}"),
    ]
    for p in PHASES:
        rows.append((f"  {p}", f"{st[p] * 1e3:.1f} ms ({100 * st[p] / total:.1f}%)"))
    rows.append(("peak memory", f"{s['peak_memory_mb']:,.0f} MB ({s['peak_memory_kind']})"))
    for i, mb in enumerate(s.get("peak_memory_per_device_mb") or []):
        rows.append((f"  device {i}", f"{mb:,.0f} MB"))
    rows.append(("MFU", f"{100 * s['mfu']:.1f}%" if s.get("mfu") is not None else "n/a (no known peak FLOPs)"))
    if s.get("scaling_efficiency") is not None:
        rows.append(("scaling efficiency", f"{100 * s['scaling_efficiency']:.1f}% vs {s.get('baseline', 'baseline')}"))
    ck = s.get("checkpoint")
    if ck:
        rows.append(("checkpoint size", f"{ck['size_mb']:,.1f} MB"))
        rows.append(("checkpoint save", f"{ck['save_s'] * 1e3:,.0f} ms ({ck['save_mb_per_s']:,.0f} MB/s)"))
        if ck.get("load_s") is not None:
            rows.append(("checkpoint load", f"{ck['load_s'] * 1e3:,.0f} ms"))
    rows.append(("final loss / val loss", f"{_fmt(s['final_loss'], 4)} / {_fmt(s['val_loss'], 4)}"))
    for note in s.get("notes", []):
        rows.append(("note", note))
    return rows


def markdown_table(header, rows, right=()) -> str:
    """A Markdown table padded for reading in a terminal. Columns whose index is in
    `right` (numbers) are right-aligned, with Markdown's `:` marker; the rest left."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(header)]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + ":" if i in right else "-" * w
                             for i, w in enumerate(widths)) + " |"
    return "\n".join([line(header), rule, *map(line, rows)])


def throughput_table(summary: dict) -> str:
    return markdown_table(("metric", "value"), throughput_rows(summary))


def find_baseline(path: str | os.PathLike, summary: dict) -> dict | None:
    """A chapter 01 summary to compare a multi-process run against: the file itself if
    `path` is one, else the newest chapter 01 run under `path` with the same preset,
    sequence length, per-process batch, device type and dtype."""
    path = Path(path)
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    best, best_mtime = None, -1.0
    for f in path.glob("*/summary.json") if path.is_dir() else []:
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        same = all(s.get(k) == summary.get(k) for k in ("preset", "seq_length", "batch_size", "device", "dtype"))
        if s.get("chapter") == "01-single-gpu" and same and f.stat().st_mtime > best_mtime:
            best, best_mtime = s, f.stat().st_mtime
    return best
