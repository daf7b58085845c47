"""What a run records and prints, in one place: each logged step's line and
`metrics.jsonl`, the progress bar, `summary.json` with its MFU, and the throughput table.
Only rank 0 writes and shows anything; every rank times its steps.

    tracker = Tracker(CHAPTER, run_dir, device, total_steps, tokens_per_step, log,
                      threads=threads, args=args, dtype=dtype, ...)    # the run's facts
    tracker.start_step();  with tracker.phase("forward"): ...;  tracker.end_step(n_tokens)
    tracker.log(step, loss=..., lr=...)              # on logging steps
    tracker.finish(final_loss=..., val_loss=...)     # summary.json, then the table
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import suppress
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .data import show_progress
from .environment import device_name, launcher, peak_memory_mb
from .errors import fail
from .files import atomic_write, folder_mb, one_line, write_json
from .peak_flops import device_peak
from .tables import format_flops, markdown_table
from .timing import PHASES, PhaseTimer, StepStats


# ---- metrics.jsonl: one JSON object per logged step ------------------------------------

def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl; a line that is not a JSON object (torn by a kill)
    is skipped: one bad line must not block a resume."""
    records = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line.decode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def write_failed(path, e: OSError):
    """A file of the run could not be written (a full disk): one line, exit status 1."""
    fail(f"writing {path} failed ({one_line(e)}); free some space and run again", status=1)


def busy(load: float | None, cores: int) -> bool:
    """Other programs took CPU time: the load average exceeded the cores by half a core."""
    return load is not None and load > cores + 0.5


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


# ---- the loop's bookkeeping --------------------------------------------------------------

class Tracker:
    def __init__(self, chapter: str, run_dir: Path, device, total_steps: int, tokens_per_step: int,
                 log, *, threads: tuple[int, int], args, dtype: str, num_params: int,
                 flops_per_token: float, extra: dict | None = None, rank: int = 0,
                 world_size: int = 1, num_devices: int | None = None, backend: str | None = None,
                 start_step: int = 0):
        self.chapter, self.run_dir, self.device, self.logger = chapter, Path(run_dir), device, log
        self.total_steps, self.tokens_per_step, self.rank = total_steps, tokens_per_step, rank
        self.facts = dict(args=args, dtype=dtype, num_params=num_params, flops_per_token=flops_per_token,
                          extra=extra or {}, world_size=world_size, num_devices=num_devices or world_size,
                          backend=backend, threads=threads)
        self.timer, self.stats = PhaseTimer(device), StepStats()
        self.load_max = load_average()
        # --padded: tokens/s counts the padding; the real tokens are added up on the
        # device (no wait per step) and read at log time, when the loss is read anyway
        self.padded = bool(getattr(args, "padded", False))
        self.real_tokens = 0
        self.saves = []  # (MB, seconds) of each checkpoint saved
        self.first_step_start = self.first_step_s = None
        self.t_start = time.perf_counter()
        self.metrics = self._open_metrics(start_step) if rank == 0 else None
        # log lines go through tqdm.write while the bar is shown, so neither garbles the other
        self._redirect = logging_redirect_tqdm() if rank == 0 and show_progress() else None
        if self._redirect:
            self._redirect.__enter__()
        self.bar = tqdm(total=total_steps, initial=start_step, desc=chapter, dynamic_ncols=True,
                        disable=rank != 0 or not show_progress())

    def _open_metrics(self, start_step: int):
        """metrics.jsonl, line-buffered (a crash loses no line)."""
        path = self.run_dir / "metrics.jsonl"
        try:
            if start_step and path.exists():  # a resumed run: drop the lines it will redo
                kept = [r for r in read_metrics(path) if isinstance(r.get("step"), int) and r["step"] <= start_step]
                text = "".join(json.dumps(r) + "\n" for r in kept)
                atomic_write(path, lambda f: f.write(text.encode()))
            return open(path, "a" if start_step > 0 else "w", buffering=1)
        except OSError as e:  # a full disk, or a folder in its place
            write_failed(path, e)

    def phase(self, name: str):
        """`with tracker.phase("forward"):` times the block into this step's split."""
        return self.timer.phase(name)

    def start_step(self):
        if self.first_step_start is None:
            self.first_step_start = time.perf_counter()
        self.timer.reset()

    def end_step(self, real_tokens=None):
        """`real_tokens`: the step's real target tokens in the global batch (a tensor on
        the device is only added up here, never waited for)."""
        if self.first_step_s is None:  # with --compile, the first step compiles
            self.first_step_s = time.perf_counter() - self.first_step_start
        self.stats.add(self.timer, self.tokens_per_step)  # no wait for the device here
        self.real_tokens = self.real_tokens + (self.tokens_per_step if real_tokens is None else real_tokens)
        self.bar.update()

    def real_share(self) -> float:
        """The share of the tokens so far that were real text (not padding)."""
        return float(self.real_tokens) / (self.tokens_per_step * max(1, len(self.stats.steps)))

    def log(self, step: int, **values):
        """One metrics line (rank 0): the values given, the window's tokens/s and this
        step's phase times; then the progress bar and the log line."""
        loads = [x for x in (self.load_max, load_average()) if x is not None]
        self.load_max = max(loads) if loads else None  # the machine's load while this run trains
        window = self.stats.end_window()  # one wait for the device per window
        if not math.isfinite(values.get("loss", 0.0)):
            return self._diverged(step, values)
        if self.rank != 0:
            return
        record = {"step": step, **values, "tokens_per_s": window.tokens_per_s}
        if self.padded:
            record["real_tokens_per_s"] = window.tokens_per_s * self.real_share()
        record.update({f"{k}_s": v for k, v in window.phase_s.items()},
                      elapsed_s=time.perf_counter() - self.t_start)
        try:
            self.metrics.write(json.dumps(record) + "\n")
        except OSError as e:  # the disk filled up mid-run
            self.close()
            write_failed(self.run_dir / "metrics.jsonl", e)
        self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
        real = f" ({record['real_tokens_per_s']:,.0f} real)" if self.padded else ""
        self.logger.info("step %d/%d | loss %.4f | lr %.2e | %.0f tokens/s%s", step, self.total_steps,
                         record["loss"], record["lr"], record["tokens_per_s"], real)

    def _diverged(self, step: int, values: dict):
        """A non-finite loss: keep the metrics and a summary saying where, stop with one line."""
        if self.rank == 0:
            self.metrics.write(json.dumps({"step": step, **values}) + "\n")
            write_json(self.run_dir / "summary.json", {
                "chapter": self.chapter, "diverged_at_step": step, "loss": str(values["loss"]),
                "steps": len(self.stats.steps)})
        self.close()
        fail(f"the loss is {values['loss']} at step {step}: the run diverged (lower --lr, or "
             f"check the data); metrics.jsonl and summary.json in {self.run_dir} say where", status=1)

    def saved(self, checkpoint: tuple[Path, float]) -> Path:
        """Note a checkpoint save, (folder, seconds), which tokens/s leaves out."""
        path, seconds = checkpoint
        if self.timer.window_start is not None:
            self.timer.window_start += seconds
        if self.rank == 0:
            self.saves.append((folder_mb(path), seconds))
            self.logger.info("checkpoint %s: %.1f MB in %.2f s", path, *self.saves[-1])
        return path

    def close(self):
        """End of training: the bar goes, log lines print plainly again."""
        self.bar.close()
        if self._redirect:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self.metrics:
            with suppress(OSError):  # after a failed write (a full disk): dropped, not retried
                self.metrics.close()
            self.metrics = None

    def finish(self, *, final_loss: float | None, val_loss: float | None) -> dict | None:
        """Rank 0: summary.json, then the throughput table."""
        self.close()
        if self.rank != 0:
            return None
        if not self.stats.steps:  # chapter 04: training ended in an earlier process
            summary = self._untimed_summary(val_loss)
        else:
            summary = build_summary(chapter=self.chapter, device=self.device, stats=self.stats,
                                    tokens_per_step=self.tokens_per_step, final_loss=final_loss,
                                    val_loss=val_loss, wall_time_s=time.perf_counter() - self.t_start,
                                    load_max=self.load_max, first_step_s=self.first_step_s,
                                    saves=self.saves, **self.facts,
                                    real_share=self.real_share() if self.padded else None)
        try:
            write_json(self.run_dir / "summary.json", summary)
        except OSError as e:  # a full disk
            write_failed(self.run_dir / "summary.json", e)
        print(f"\n{throughput_table(summary) if self.stats.steps else summary['notes'][0]}"
              f"\n\noutputs in {self.run_dir}", flush=True)
        return summary

    def _untimed_summary(self, val_loss: float | None) -> dict:
        logged = [r for r in read_metrics(self.run_dir / "metrics.jsonl") if "loss" in r]
        return {"chapter": self.chapter, "experiment_name": self.facts["args"].experiment_name,
                "world_size": self.facts["world_size"], "steps": self.total_steps,
                "final_loss": logged[-1]["loss"] if logged else None, "val_loss": val_loss,
                "notes": ["training ended in an earlier process; this one finished the run's end "
                          "(validation, sample, weights, summary), so no speed was measured"]}


# ---- summary.json ----------------------------------------------------------------------------

def build_summary(*, chapter: str, args, world_size: int, device, dtype: str, num_params: int,
                  flops_per_token: float, stats: StepStats, tokens_per_step: int,
                  final_loss: float | None, val_loss: float | None, wall_time_s: float,
                  num_devices: int = 1, backend: str | None = None, extra: dict | None = None,
                  threads: tuple[int, int] = (0, 0), load_max: float | None = None,
                  first_step_s: float | None = None, saves=(), real_share=None, peak=None) -> dict:
    """Everything summary.json holds. MFU: the model's FLOP/s per device over `peak`
    (default the device's). `real_share`: --padded, the share of real tokens."""
    tps = stats.tokens_per_s()
    per_device = tps / max(1, num_devices)
    peak = peak or device_peak(device, dtype)
    peak_mb, peak_kind = peak_memory_mb(device)
    s = {"chapter": chapter, "experiment_name": args.experiment_name, "launcher": launcher(),
         "world_size": world_size, "num_devices": num_devices, "backend": backend,
         "device": torch.device(device).type, "device_name": device_name(device), "dtype": dtype,
         "preset": args.model_preset, "num_params": num_params, "seq_length": args.seq_length,
         "batch_size": args.batch_size, "tokens_per_step": tokens_per_step, "steps": len(stats.steps),
         "tokens_per_s": tps, "tokens_per_s_per_device": per_device,
         "step_wall_s": stats.wall_time_per_step(), "step_time_s": stats.mean_phase_times(),
         "peak_memory_mb": peak_mb, "peak_memory_kind": peak_kind,
         "flops_per_token": flops_per_token, "model_flops_per_s": per_device * flops_per_token,
         "peak_flops": peak.flops, "peak_source": peak.source, "peak_precision": peak.precision,
         "mfu": per_device * flops_per_token / peak.flops,
         "final_loss": final_loss, "val_loss": val_loss, "wall_time_s": wall_time_s,
         "torch_version": torch.__version__, "args": dict(vars(args)),
         "threads_per_process": threads[0], "processes_per_machine": threads[1],
         "cpu_cores": os.cpu_count(), "load_avg_max": load_max,
         "compiled": bool(getattr(args, "compile", False)),
         "activation_checkpointing": bool(getattr(args, "activation_checkpointing", False)),
         "deterministic": torch.are_deterministic_algorithms_enabled(), **(extra or {})}
    notes = []
    if s["mfu"] > 1.0:  # a peak measured while other work loaded the device is too low
        notes.append(f"MFU over 100%: the {peak.label()} is too low" + (
            "; measure it again: `python -m tools.peak --remeasure`" if peak.source == "measured" else ""))
    if torch.device(device).type == "cuda" and num_devices > 1 and world_size == 1:  # DataParallel
        s["peak_memory_per_device_mb"] = [torch.cuda.max_memory_allocated(i) / 2**20
                                          for i in range(torch.cuda.device_count())]
    if s["compiled"] and first_step_s is not None:  # the first step compiles: not in tokens/s
        s["compile_s"] = max(0.0, first_step_s - s["step_wall_s"])
    if saves:
        size_mb, save_s = saves[-1][0], sum(t for _, t in saves) / len(saves)
        s["checkpoint"] = {"count": len(saves), "size_mb": size_mb, "save_s": save_s,
                           "save_mb_per_s": size_mb / save_s}
    if real_share is not None:  # what the padding costs: the tokens/s that were real text
        s["real_tokens_per_s"] = tps * real_share
    if busy(load_max, s["cpu_cores"]):
        notes.append(f"the machine was busy (load average up to {load_max:.1f} on {s['cpu_cores']} "
                     f"cores): other programs took CPU time from this run")
    if notes:
        s["notes"] = [*s.get("notes", []), *notes]
    return s


def _fmt(v, digits=1):
    if v is None:
        return "n/a"
    return f"{v:,.{digits}f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)


def throughput_rows(s: dict) -> list[tuple[str, str]]:
    """The rows every chapter prints; optional keys add rows when present."""
    st = s["step_time_s"]
    total = st.get("total") or 1.0
    rows = [("chapter", s["chapter"]), ("launcher / world size", f"{s['launcher']} / {s['world_size']}"
             + (f" ({s['backend']})" if s.get("backend") else "")),
            ("device", f"{s['device_name']} x {s['num_devices']}"),
            ("dtype / preset / params", f"{s['dtype']} / {s['preset']} / {s['num_params'] / 1e6:.2f} M"),
            ("tokens per step", _fmt(s["tokens_per_step"])), ("tokens/s total", _fmt(s["tokens_per_s"]))]
    if s.get("real_tokens_per_s") is not None:
        rows.append(("tokens/s real (no padding)", _fmt(s["real_tokens_per_s"])))
    # the wall time in parts: the timed phases (device time on a GPU: an estimate), and
    # the rest, other (waiting for other ranks or pipeline stages, what no phase times)
    wall = s.get("step_wall_s") or total
    other = max(0.0, wall - total)
    rows += [("tokens/s per device", _fmt(s["tokens_per_s_per_device"])),
             ("step time (ms, wall)", f"{wall * 1e3:.1f} = phases {total * 1e3:.1f} (an estimate) "
                                      f"+ other {other * 1e3:.1f}")]
    rows += [(f"  {p}", f"{st[p] * 1e3:.1f} ms ({100 * st[p] / wall:.1f}%)") for p in PHASES]
    rows.append(("  other", f"{other * 1e3:.1f} ms ({100 * other / wall:.1f}%): waiting for other "
                            f"ranks or stages, untimed work"))
    if s.get("threads_per_process"):
        rows.append(("CPU threads", f"{s['threads_per_process']} per process x "
                     f"{s['processes_per_machine']} process(es) on this machine ({s['cpu_cores']} cores)"))
    if s.get("load_avg_max") is not None:
        rows.append(("machine load", f"{s['load_avg_max']:.1f} at most during the run"
                     + (" (busy: not comparable)" if busy(s["load_avg_max"], s["cpu_cores"]) else "")))
    rows.append(("peak memory", f"{s['peak_memory_mb']:,.0f} MB ({s['peak_memory_kind']})"))
    rows += [(f"  device {i}", f"{mb:,.0f} MB") for i, mb in enumerate(s.get("peak_memory_per_device_mb") or [])]
    mfu = f"{100 * s['mfu']:.1f}% of {format_flops(s['peak_flops'])} ({s['peak_source']} {s['peak_precision']} matmul peak)"
    rows += [("model FLOP/s per device", format_flops(s["model_flops_per_s"])), ("MFU", mfu)]
    if s.get("compiled"):
        rows.append(("torch.compile", f"yes: about {s.get('compile_s') or 0:,.1f} s to compile "
                     f"(the first step; not in tokens/s)"))
    if s.get("activation_checkpointing"):
        rows.append(("activation checkpointing", "yes: each layer's forward runs again in backward"))
    if s.get("deterministic"):
        rows.append(("deterministic kernels", "yes: the same bits in every rerun"))
    if s.get("checkpoint"):
        ck = s["checkpoint"]
        rows += [("checkpoint size", f"{ck['size_mb']:,.1f} MB"),
                 ("checkpoint save", f"{ck['save_s'] * 1e3:,.0f} ms ({ck['save_mb_per_s']:,.0f} MB/s)")]
    rows.append(("final loss / val loss", f"{_fmt(s['final_loss'], 4)} / {_fmt(s['val_loss'], 4)}"))
    return rows + [("note", note) for note in s.get("notes", [])]


def throughput_table(summary: dict) -> str:
    return markdown_table(("metric", "value"), throughput_rows(summary))
