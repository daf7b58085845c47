"""Timing, throughput, memory, and the run's output files.

- `PhaseTimer`: how long data / forward / backward / update take in each step. It never
  waits for the device at a phase boundary: on CUDA each boundary records an event in
  the stream, and the events are read once per logging window (`StepStats.end_window`).
- `StepStats`: the steps and the logging windows of a run. The headline tokens/s is
  uninstrumented wall time over whole windows; the phase split is an estimate (on a GPU
  the device time between boundaries, which overlaps the host's work). Both leave out
  the first `warmup` steps: allocator growth, kernel selection and caches make them
  unrepresentative.
- `MetricsWriter`: `metrics.jsonl`, one JSON object per logged step.
- `build_summary` / `throughput_table`: `summary.json` and the Markdown table printed
  at the end of every run, with MFU against the device's peak (`common.peak`).

A chapter's loop:

    timer, stats = PhaseTimer(device), StepStats()
    for ...:
        timer.reset()                      # a step starts
        with timer.phase("data"): ...      # likewise forward, backward, update
        stats.add(timer, tokens_per_step)  # no wait for the device
        if logging:
            window = stats.end_window()    # one wait for the device per window
            window.tokens_per_s, window.phase_s
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
from dataclasses import dataclass, field
from pathlib import Path

import torch

PHASES = ("data", "forward", "backward", "update")


class WallClock:
    """Phase boundaries as host time: right where the work is done when a call returns
    (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def sync(self):
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """Phase boundaries as CUDA events recorded in the current stream. Recording does
    not wait: the host runs ahead and queues the next kernels. An event's time can be
    read once the device has passed it, so `seconds` is called only after `sync`."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def sync(self):
        torch.cuda.synchronize(self.device)

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3  # milliseconds


def phase_seconds(clock, marks: list[tuple[str, object, object]]) -> dict[str, float]:
    """Seconds per phase from (phase, start mark, end mark); a phase entered twice in a
    step (gradient accumulation) adds up. The clock must have been synced."""
    times = dict.fromkeys(PHASES, 0.0)
    for name, start, end in marks:
        times[name] = times.get(name, 0.0) + clock.seconds(start, end)
    return times


class PhaseTimer:
    """Marks the phases of the current step and when the open logging window began.
    `clock` defaults to CUDA events on a CUDA device, host time elsewhere."""

    def __init__(self, device: torch.device | str = "cpu", clock=None):
        cuda = torch.device(device).type == "cuda"
        self.clock = clock or (CudaEventClock(device) if cuda else WallClock())
        self.marks: list[tuple[str, object, object]] = []
        self.window_start: float | None = None

    def reset(self):
        """A step starts; so does a window, if none is open."""
        if self.window_start is None:
            self.window_start = time.perf_counter()
        self.marks = []

    @contextmanager
    def phase(self, name: str):
        start = self.clock.mark()
        try:
            yield
        finally:
            self.marks.append((name, start, self.clock.mark()))

    @property
    def times(self) -> dict[str, float]:
        """This step's seconds per phase. On CUDA this waits for the device: once per
        logged step at most (`StepStats.end_window` reads a whole window with one wait)."""
        self.clock.sync()
        return phase_seconds(self.clock, self.marks)

    def end_window(self) -> float:
        """Wall seconds since the window began, after the device has finished the
        window's work (the one wait); the next `reset` opens a new window."""
        self.clock.sync()
        start, self.window_start = self.window_start, None
        return 0.0 if start is None else time.perf_counter() - start


@dataclass
class Window:
    """The steps between two logs: wall time and the mean phase split of a step."""
    steps: int
    tokens: int
    wall_s: float
    phase_s: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


class StepStats:
    """Per-step phase times and token counts, and the logging windows' wall times.

    `add(timer, tokens)` keeps the step's marks unread; `end_window()` reads them all
    with one wait for the device and times the window. `add(times_dict, tokens)` (phase
    seconds already read) still works; without windows, tokens/s falls back to the sum
    of phase times."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.steps: list[tuple[dict, int]] = []
        self.windows: list[tuple[int, Window]] = []   # (index of its first step, window)
        self.timer: PhaseTimer | None = None
        self.unread: list[tuple[dict, list]] = []     # (times to fill in, marks)
        self.window_first = 0                         # index of the open window's first step

    def add(self, timer_or_times, tokens: int):
        if isinstance(timer_or_times, PhaseTimer):
            self.timer, times = timer_or_times, {}
            self.unread.append((times, timer_or_times.marks))
        else:
            times = dict(timer_or_times)
        self.steps.append((times, tokens))
        if self.timer is not None and len(self.steps) == self.warmup:
            self.end_window()  # one extra wait, so that no window mixes warm-up and measured steps

    def read_times(self, synced: bool = False):
        """Fill in the phase times of steps added from the timer (waits for the device
        unless it was just synced)."""
        if self.unread:
            if not synced:
                self.timer.clock.sync()
            for times, marks in self.unread:
                times.update(phase_seconds(self.timer.clock, marks))
            self.unread = []

    def end_window(self) -> Window:
        """Close the window of steps added since the last call: its wall time (one wait
        for the device) and mean phase times. Call it at every logged step and after
        the last step: steps of a window never closed count in the phase split only."""
        steps = self.steps[self.window_first:]
        if not steps and self.windows:
            return self.windows[-1][1]  # closed already, at the end of the warm-up
        if self.timer is None:          # steps added as dicts: no wall time, phase sums
            return Window(len(steps), sum(n for _, n in steps),
                          sum(sum(t.values()) for t, _ in steps), mean_times(steps))
        wall = self.timer.end_window()
        self.read_times(synced=True)
        window = Window(len(steps), sum(n for _, n in steps), wall, mean_times(steps))
        if steps:
            self.windows.append((self.window_first, window))
        self.window_first = len(self.steps)
        return window

    def measured(self):
        # leave warm-up steps out, unless that would leave nothing
        self.read_times()
        return self.steps[self.warmup:] if len(self.steps) > self.warmup else self.steps

    def measured_windows(self) -> list[Window]:
        """Windows that hold no warm-up step, unless that would leave nothing."""
        late = [w for first, w in self.windows if first >= self.warmup]
        return late or [w for _, w in self.windows]

    def mean_phase_times(self) -> dict:
        out = mean_times(self.measured())
        out["total"] = sum(out.values())
        return out

    def wall_time_per_step(self) -> float:
        """Mean wall seconds of a measured step; the phase sum when no window closed."""
        windows = self.measured_windows()
        steps = sum(w.steps for w in windows)
        if steps:
            return sum(w.wall_s for w in windows) / steps
        return self.mean_phase_times()["total"]

    def tokens_per_s(self) -> float:
        windows = self.measured_windows()
        if windows:
            wall = sum(w.wall_s for w in windows)
            return sum(w.tokens for w in windows) / wall if wall > 0 else 0.0
        steps = self.measured()
        total_time = sum(sum(t.values()) for t, _ in steps)
        return sum(n for _, n in steps) / total_time if total_time > 0 else 0.0


def mean_times(steps: list[tuple[dict, int]]) -> dict[str, float]:
    """Mean seconds per phase over (times, tokens) steps; zeros for no steps."""
    if not steps:
        return dict.fromkeys(PHASES, 0.0)
    return {p: sum(t.get(p, 0.0) for t, _ in steps) / len(steps) for p in PHASES}


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
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent writers: one each
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def build_summary(*, chapter: str, args, world_size: int, device, dtype: str,
                  num_params: int, flops_per_token: float, stats: StepStats,
                  tokens_per_step: int, final_loss: float | None, val_loss: float | None,
                  wall_time_s: float, num_devices: int = 1, backend: str | None = None,
                  extra: dict | None = None, peak=None) -> dict:
    """Everything summary.json holds. `peak` (a `common.peak.Peak`) defaults to the
    device's: its datasheet peak, else the measured one (measured once, then cached)."""
    from .peak import device_peak, implausible_mfu_note

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
    note = implausible_mfu_note(summary["mfu"], peak)
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


def format_flops(flops: float) -> str:
    """e.g. '95.3 GFLOP/s', '989 TFLOP/s'."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if flops >= scale:
            return f"{flops / scale:,.3g} {unit}"
    return f"{flops / 1e6:,.3g} MFLOP/s"


def peak_label(flops: float, precision: str, source: str) -> str:
    """e.g. '95.3 GFLOP/s (measured fp32 matmul peak)'."""
    return f"{format_flops(flops)} ({source} {precision} matmul peak)"


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
    sequence length, per-process batch, gradient accumulation, data form (packed or
    padded), device type and dtype."""
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
        same = (all(s.get(k) == summary.get(k) for k in ("preset", "seq_length", "batch_size", "device",
                                                          "dtype", "grad_accum"))
                and (s.get("data") or {}).get("form") == (summary.get("data") or {}).get("form"))
        if s.get("chapter") == "01-single-gpu" and same and f.stat().st_mtime > best_mtime:
            best, best_mtime = s, f.stat().st_mtime
    return best
