"""The bookkeeping around a training loop, in one object a chapter calls per step and at
the end: phase timing, the metrics window, the progress bar, `metrics.jsonl`,
`summary.json` and the throughput table. Only rank 0 writes and shows anything; the
other ranks time their steps all the same (their summary is never written). It sets
nothing up: threads, devices and signals are the chapter's `setup()`.

    tracker = Tracker(CHAPTER, run_dir, device, total_steps, tokens_per_step, log,
                      threads=threads, args=args, dtype=dtype, ...)   # the run's fixed facts
    tracker.start_step();  with tracker.phase("forward"): ...;  tracker.end_step(n_tokens)
    tracker.log(step, loss=..., lr=...)        # on logging steps
    tracker.finish(final_loss=..., val_loss=...)   # summary.json + the table
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .data import show_progress
from .durable import dir_size_mb, one_line
from .errors import fail
from .jsonfiles import MetricsWriter, read_metrics, write_json, write_jsonl
from .peak_flops import busy
from .summary import build_summary, comparison_warnings, find_baseline, throughput_table
from .timing import PhaseTimer, StepStats


class Tracker:
    def __init__(self, chapter: str, run_dir: Path, device, total_steps: int, tokens_per_step: int,
                 log, *, threads: tuple[int, int], args, dtype: str, num_params: int,
                 flops_per_token: float, extra: dict | None = None, rank: int = 0,
                 world_size: int = 1, num_devices: int | None = None, backend: str | None = None,
                 start_step: int = 0):
        """`threads`: (threads per process, processes on this machine), as
        `common.environment.share_cpu_threads` set them. The keywords from `args` on are
        the run's fixed facts for summary.json (`common.summary.build_summary`);
        `num_devices` defaults to one per process."""
        self.threads = threads
        self.facts = dict(args=args, dtype=dtype, num_params=num_params, flops_per_token=flops_per_token,
                          extra=extra, world_size=world_size, num_devices=num_devices or world_size,
                          backend=backend)
        self.load_max = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self.chapter, self.run_dir, self.device, self.logger = chapter, Path(run_dir), device, log
        self.total_steps, self.tokens_per_step, self.rank = total_steps, tokens_per_step, rank
        self.timer, self.stats = PhaseTimer(device), StepStats()
        self.writer = None
        if rank == 0:
            path = self.run_dir / "metrics.jsonl"
            try:
                if start_step and path.exists():  # a resumed run: drop what it will redo
                    write_jsonl(path, [r for r in read_metrics(path)
                                       if isinstance(r.get("step"), int) and r["step"] <= start_step])
                self.writer = MetricsWriter(path, append=start_step > 0)
            except OSError as e:  # a full disk, or a folder in its place: one line
                fail(f"writing {path} failed ({one_line(e)}); free some space (or move what "
                     f"is there aside) and run again", status=1)
        # Real (non-pad) target tokens: with --padded, tokens/s counts the padding too, so
        # the real count is kept beside it. Added up on the device (no wait per step) and
        # read at log time, when the loss is read anyway.
        self.padded = bool(getattr(args, "padded", False))
        self.window_real: list = []           # each step's count since the last log
        self.real_measured, self.steps_measured = 0, 0   # over steps after the warm-up
        self.real_all = 0                                # over every step
        self.saves = []  # (MB, seconds) of each checkpoint saved
        self.first_step_start, self.first_step_s = None, None
        self.t_start = time.perf_counter()
        # Log lines go through tqdm.write while the bar is shown, so neither garbles the other.
        self._redirect = logging_redirect_tqdm() if rank == 0 and show_progress() else None
        if self._redirect:
            self._redirect.__enter__()
        self.bar = tqdm(total=total_steps, initial=start_step, desc=chapter, dynamic_ncols=True,
                        disable=not show_progress() if rank == 0 else True)

    def phase(self, name: str):
        """`with tracker.phase("forward"):` times the block into this step's split."""
        return self.timer.phase(name)

    def start_step(self):
        if self.first_step_s is None and self.first_step_start is None:
            self.first_step_start = time.perf_counter()
        self.timer.reset()

    def end_step(self, real_tokens=None):
        """`real_tokens`: the step's real target tokens in the whole global batch (an int,
        or a tensor on the device: it is only added up here, never waited for); default
        every token of the step."""
        if self.first_step_s is None:  # with --compile, the first step compiles
            self.first_step_s = time.perf_counter() - self.first_step_start
        self.stats.add(self.timer, self.tokens_per_step)  # no wait for the device here
        real = self.tokens_per_step if real_tokens is None else real_tokens
        self.window_real.append(real)
        self.real_all = self.real_all + real
        if len(self.stats.steps) > self.stats.warmup:  # the steps the headline tokens/s measures
            self.real_measured = self.real_measured + real
            self.steps_measured += 1
        self.bar.update()

    def real_tokens_per_s(self, tokens_per_s: float, real, steps: int) -> float:
        """tokens/s × the real share of `steps` steps' tokens (`real` of them were real)."""
        return tokens_per_s * float(real) / (self.tokens_per_step * steps) if steps else tokens_per_s

    def log(self, step: int, **values):
        """One metrics line (rank 0): the values given, the window's tokens/s, this
        step's phase times; then the progress bar and the log line."""
        if self.load_max is not None:  # the machine's load while this run trains
            self.load_max = max(self.load_max, os.getloadavg()[0])
        # the window since the last log: wall time after one wait for the device, and the
        # mean phase split of its steps (an estimate on GPUs, where phases overlap)
        window = self.stats.end_window()
        # the window's own steps (it may have closed earlier, at the end of the warm-up)
        counted = self.window_real[len(self.window_real) - min(window.steps, len(self.window_real)):]
        self.window_real = []
        if not math.isfinite(values.get("loss", 0.0)):
            return self.diverged(step, values)
        if self.rank == 0:
            record = {"step": step, **values, "tokens_per_s": window.tokens_per_s}
            if self.padded:
                record["real_tokens_per_s"] = self.real_tokens_per_s(window.tokens_per_s, sum(counted),
                                                                     len(counted))
            record.update({f"{k}_s": v for k, v in window.phase_s.items()},
                          elapsed_s=time.perf_counter() - self.t_start)
            try:
                self.writer.write(record)
            except OSError as e:  # the disk filled up mid-run: one line, not a traceback
                path = self.writer.path
                self.writer.discard()
                self.writer = None
                self.close()
                fail(f"writing {path} failed ({one_line(e)}); free some space and run "
                     f"again", status=1)
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            real = f" ({record['real_tokens_per_s']:,.0f} real)" if self.padded else ""
            self.logger.info("step %d/%d | loss %.4f | lr %.2e | %.0f tokens/s%s", step, self.total_steps,
                             record["loss"], record["lr"], record["tokens_per_s"], real)

    def finish_untimed(self, val_loss: float | None) -> dict:
        """The end of a run whose training ended in an earlier process (chapter 04: stopped
        after its last checkpoint, before its summary): no step was timed here, so the
        summary holds the losses, from metrics.jsonl, and says so instead of speeds."""
        logged = [r for r in read_metrics(self.run_dir / "metrics.jsonl") if "loss" in r]
        summary = {"chapter": self.chapter, "experiment_name": self.facts["args"].experiment_name,
                   "world_size": self.facts["world_size"], "steps": self.total_steps,
                   "final_loss": logged[-1]["loss"] if logged else None, "val_loss": val_loss,
                   "notes": ["training ended in an earlier process; this one finished the run's end "
                             "(validation, sample, weights, summary), so no speed was measured"]}
        write_json(self.run_dir / "summary.json", summary)
        print(f"\n{summary['notes'][0]}\n\noutputs in {self.run_dir}", flush=True)
        return summary

    def diverged(self, step: int, values: dict):
        """A non-finite loss: the run has diverged and more steps only spread NaN. Keep what
        it produced (metrics up to here, a summary saying where), then stop with one line."""
        if self.rank == 0:
            self.writer.write({"step": step, **values})
            write_json(self.run_dir / "summary.json", {
                "chapter": self.chapter, "diverged_at_step": step, "loss": str(values["loss"]),
                "steps": len(self.stats.steps), "tokens_per_s": self.stats.tokens_per_s()})
        self.close()
        fail(f"the loss is {values['loss']} at step {step}: the run diverged (lower --lr, or "
             f"check the data); metrics.jsonl and summary.json in {self.run_dir} say where", status=1)

    def saved(self, checkpoint) -> Path:
        """Note a checkpoint save: (folder, seconds). Returns the folder."""
        path, seconds = checkpoint
        if self.timer.window_start is not None:  # training speed leaves the save out
            self.timer.window_start += seconds
        if self.rank == 0:
            self.saves.append((dir_size_mb(path), seconds))
            self.logger.info("checkpoint %s: %.1f MB in %.2f s", path, *self.saves[-1])
        return path

    def close(self):
        """End of training: the bar goes, log lines print plainly again."""
        self.bar.close()
        if self._redirect:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        if self.writer:
            self.writer.close()
            self.writer = None

    def finish(self, *, final_loss: float | None, val_loss: float | None) -> dict | None:
        """Rank 0: summary.json and the throughput table (with the scaling efficiency
        against a matching chapter 01 run when `args` has a --baseline flag)."""
        self.close()
        if self.rank != 0:
            return None
        if not self.stats.steps:
            return self.finish_untimed(val_loss)
        args = self.facts["args"]
        summary = build_summary(chapter=self.chapter, device=self.device, stats=self.stats,
                                tokens_per_step=self.tokens_per_step, final_loss=final_loss,
                                val_loss=val_loss, wall_time_s=time.perf_counter() - self.t_start,
                                **self.facts)
        if torch.device(self.device).type == "cuda" and summary["num_devices"] > 1 \
                and summary["world_size"] == 1:  # one process, several GPUs (DataParallel)
            summary["peak_memory_per_device_mb"] = [torch.cuda.max_memory_allocated(i) / 2**20
                                                    for i in range(torch.cuda.device_count())]
        summary.update(threads_per_process=self.threads[0], processes_per_machine=self.threads[1],
                       cpu_cores=os.cpu_count(), load_avg_max=self.load_max,
                       first_step_s=self.first_step_s, compiled=bool(getattr(args, "compile", False)),
                       activation_checkpointing=bool(getattr(args, "activation_checkpointing", False)),
                       deterministic=torch.are_deterministic_algorithms_enabled())
        if summary["compiled"] and self.first_step_s is not None:  # not in tokens/s (warm-up)
            summary["compile_s"] = max(0.0, self.first_step_s - summary.get("step_wall_s", 0.0))
        if self.saves:
            size_mb, save_s = self.saves[-1][0], sum(t for _, t in self.saves) / len(self.saves)
            summary["checkpoint"] = {"count": len(self.saves), "size_mb": size_mb, "save_s": save_s,
                                     "save_mb_per_s": size_mb / save_s}
        if self.padded:  # what the padding costs: the tokens/s that were real text
            steps, real = ((self.steps_measured, self.real_measured) if self.steps_measured
                           else (len(self.stats.steps), self.real_all))
            summary["real_tokens_per_s"] = self.real_tokens_per_s(summary["tokens_per_s"], real, steps)
        if hasattr(args, "baseline") and summary["world_size"] > 1:
            # tokens/s per process here over chapter 01's tokens/s with the same
            # per-process batch (1.0 = perfect linear scaling); one process scales nothing
            baseline = find_baseline(args.baseline or args.save_dir, summary)
            if baseline:
                summary["scaling_efficiency"] = summary["tokens_per_s_per_device"] / baseline["tokens_per_s"]
                summary["baseline"] = f"{baseline['chapter']} run {baseline['experiment_name']!r}"
                summary.setdefault("notes", []).extend(comparison_warnings(summary, baseline))
        if busy(summary["load_avg_max"], summary["cpu_cores"]):
            summary.setdefault("notes", []).append(
                f"the machine was busy (load average up to {summary['load_avg_max']:.1f} on "
                f"{summary['cpu_cores']} cores): other programs took CPU time from this run")
        try:
            write_json(self.run_dir / "summary.json", summary)
        except OSError as e:  # a full disk: one line, not a traceback
            fail(f"writing {self.run_dir / 'summary.json'} failed ({one_line(e)}); free some space "
                 f"and run again", status=1)
        print(f"\n{throughput_table(summary)}\n\noutputs in {self.run_dir}", flush=True)
        return summary
