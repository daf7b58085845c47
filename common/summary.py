"""What a run reports at its end: `summary.json` (`build_summary`), the throughput table
printed by rank 0 (`throughput_table`), with MFU against the device's peak
(`common.peak_flops`), and the chapter 01 run a multi-process run compares against
(`find_baseline`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .environment import device_name, launcher, peak_memory_mb
from .peak_flops import device_peak, implausible_mfu_note, peak_label, slower_than_fp32_note
from .tables import format_flops, markdown_table
from .timing import PHASES, StepStats


def build_summary(*, chapter: str, args, world_size: int, device, dtype: str,
                  num_params: int, flops_per_token: float, stats: StepStats,
                  tokens_per_step: int, final_loss: float | None, val_loss: float | None,
                  wall_time_s: float, num_devices: int = 1, backend: str | None = None,
                  extra: dict | None = None, peak=None) -> dict:
    """Everything summary.json holds. `peak` (a `common.peak_flops.Peak`) defaults to the
    device's: its datasheet peak, else the measured one (measured once, then cached)."""
    name = device_name(device)
    tps = stats.tokens_per_s()
    per_device = tps / max(1, num_devices)
    peak = peak or device_peak(device, dtype)
    model_flops_per_s = per_device * flops_per_token
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
        "step_wall_s": stats.wall_time_per_step(),
        "step_time_s": stats.mean_phase_times(),
        "peak_memory_mb": peak_mb,
        "peak_memory_kind": peak_kind,
        "flops_per_token": flops_per_token,
        "model_flops_per_s": model_flops_per_s,
        "peak_flops": peak.flops,
        "peak_source": peak.source,
        "peak_precision": peak.precision,
        "mfu": model_flops_per_s / peak.flops,
        "final_loss": final_loss,
        "val_loss": val_loss,
        "wall_time_s": wall_time_s,
        "torch_version": torch.__version__,
        "args": {k: v for k, v in vars(args).items()},
    }
    summary.update(extra or {})
    for note in (implausible_mfu_note(summary["mfu"], peak), slower_than_fp32_note(device, peak)):
        if note:
            summary["notes"] = [*summary.get("notes", []), note]
    return summary


def _fmt(v, digits=1):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def mfu_text(s: dict) -> str:
    """'23.4% of 95.3 GFLOP/s (measured fp32 matmul peak)', from a summary."""
    if s.get("mfu") is None:
        return "n/a (no peak FLOP/s)"
    return f"{100 * s['mfu']:.1f}% of {peak_label(s['peak_flops'], s['peak_precision'], s['peak_source'])}"


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
        *([("tokens/s real (no padding)", _fmt(s["real_tokens_per_s"]))]
          if s.get("real_tokens_per_s") is not None else []),
        ("tokens/s per device", _fmt(s["tokens_per_s_per_device"])),
        ("step time (ms, wall)", f"{s.get('step_wall_s', total) * 1e3:.1f}"),
        ("phase split (estimate)", f"{total * 1e3:.1f} ms timed in phases"),
    ]
    for p in PHASES:
        rows.append((f"  {p}", f"{st[p] * 1e3:.1f} ms ({100 * st[p] / total:.1f}%)"))
    if s.get("threads_per_process"):
        rows.append(("CPU threads", f"{s['threads_per_process']} per process x "
                     f"{s['processes_per_machine']} process(es) on this machine ({s['cpu_cores']} cores)"))
    if s.get("load_avg_max") is not None:
        busy = " (busy: not comparable)" if s["load_avg_max"] > s["cpu_cores"] else ""
        rows.append(("machine load", f"{s['load_avg_max']:.1f} at most during the run{busy}"))
    rows.append(("peak memory", f"{s['peak_memory_mb']:,.0f} MB ({s['peak_memory_kind']})"))
    for i, mb in enumerate(s.get("peak_memory_per_device_mb") or []):
        rows.append((f"  device {i}", f"{mb:,.0f} MB"))
    if s.get("model_flops_per_s") is not None:
        rows.append(("model FLOP/s per device", format_flops(s["model_flops_per_s"])))
    rows.append(("MFU", mfu_text(s)))
    if s.get("compiled"):
        rows.append(("torch.compile", f"yes: about {s.get('compile_s') or 0:,.1f} s to compile "
                     f"(the first step; not in tokens/s)"))
    if s.get("activation_checkpointing"):
        rows.append(("activation checkpointing", "yes: each layer's forward runs again in backward"))
    if s.get("deterministic"):
        rows.append(("deterministic kernels", "yes: the same bits in every rerun"))
    if s.get("scaling_efficiency") is not None and s["world_size"] > 1:  # one process scales nothing
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


def comparison_warnings(summary: dict, baseline: dict) -> list[str]:
    """Why a scaling efficiency may not be like for like: above 100% (more per device than
    one device alone can do), or a different CPU thread budget per machine."""
    notes = []
    eff = summary.get("scaling_efficiency")
    if eff is not None and eff > 1.05:
        notes.append("scaling efficiency above 100%: the baseline ran slower than this run's "
                     "devices (a busier machine then, or another thread budget); rerun both "
                     "on an idle machine to compare")
    per_machine = [s.get("threads_per_process", 0) * s.get("processes_per_machine", 0)
                   for s in (summary, baseline)]
    if all(per_machine) and per_machine[0] != per_machine[1]:
        notes.append(f"CPU threads per machine differ from the baseline's ({per_machine[0]} vs "
                     f"{per_machine[1]}): not like for like")
    return notes


def throughput_table(summary: dict) -> str:
    return markdown_table(("metric", "value"), throughput_rows(summary))


def baseline_problem(s) -> str | None:
    """Why a parsed summary.json cannot be a baseline (what the scaling efficiency divides
    by and names), or None."""
    if not isinstance(s, dict):
        return "not a JSON object"
    tps = s.get("tokens_per_s")
    if not (isinstance(tps, (int, float)) and math.isfinite(tps) and tps > 0):
        return "no tokens_per_s above 0 in it"
    missing = [k for k in ("chapter", "experiment_name") if k not in s]
    if missing:
        return f"no {' or '.join(missing)} in it"
    if not isinstance(s.get("data") or {}, dict):
        return "its data field is not an object"
    if not all(isinstance(s.get(k, 0), (int, float)) for k in ("threads_per_process", "processes_per_machine")):
        return "its thread counts are not numbers"
    return None


def find_baseline(path: str | os.PathLike, summary: dict) -> dict | None:
    """A chapter 01 summary to compare a multi-process run against: the file itself if
    `path` is one, else the newest chapter 01 run under `path` with the same preset,
    sequence length, per-process batch, gradient accumulation, data form (packed or
    padded), device type, dtype, and the same of --compile, --activation-checkpointing and
    --deterministic (on or off)."""
    path = Path(path)
    if path.is_file():
        try:
            s = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            return None
        return None if baseline_problem(s) else s
    best, best_mtime = None, -1.0
    for f in path.glob("*/summary.json") if path.is_dir() else []:
        try:
            s = json.loads(f.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        if baseline_problem(s):  # a broken or unfinished run's summary: not comparable
            continue
        same = (all(s.get(k) == summary.get(k) for k in ("preset", "seq_length", "batch_size", "device",
                                                          "dtype", "grad_accum"))
                and (s.get("data") or {}).get("form") == (summary.get("data") or {}).get("form")
                and all(bool(s.get(k)) == bool(summary.get(k))
                        for k in ("compiled", "activation_checkpointing", "deterministic")))
        if s.get("chapter") == "01-single-gpu" and same and f.stat().st_mtime > best_mtime:
            best, best_mtime = s, f.stat().st_mtime
    return best
