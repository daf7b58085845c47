"""Timers, throughput arithmetic, output files and the summary every run writes."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import common.files as files
import common.metrics as metrics
import common.timing as timing
from common.environment import peak_memory_mb
from common.files import write_json
from common.metrics import Tracker, build_summary, read_metrics, throughput_table
from common.peak_flops import Peak
from common.tables import format_flops
from common.timing import PHASES, PhaseTimer, StepStats, phase_seconds

SUMMARY_KEYS = {"chapter", "world_size", "device_name", "dtype", "preset", "num_params",
                "tokens_per_s", "tokens_per_s_per_device", "step_wall_s", "step_time_s",
                "peak_memory_mb", "mfu", "peak_flops", "peak_source", "peak_precision",
                "model_flops_per_s", "final_loss", "torch_version"}


def fake_clock(monkeypatch, ticks):
    """time.perf_counter returns these values in turn."""
    it = iter(ticks)
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(it))


class FakeDeviceClock:
    """Stands in for CUDA events, with their rule: a mark is recorded without waiting,
    and its time can be read only once the device has passed it (after a sync)."""

    def __init__(self, ticks):
        self.ticks = iter(ticks)          # device time at each mark, in order
        self.pending: list[dict] = []
        self.syncs = 0

    def mark(self):
        m = {"t": next(self.ticks), "done": False}
        self.pending.append(m)
        return m

    def sync(self):
        self.syncs += 1
        for m in self.pending:
            m["done"] = True
        self.pending = []

    def seconds(self, start, end):
        assert start["done"] and end["done"], "an event read before the device passed it"
        return end["t"] - start["t"]


def stats_of(steps: list[tuple[float, float, float, float]], tokens: int, warmup: int = 2):
    """StepStats of steps whose phases took these seconds on a fake clock, each step
    logged (a window of its own, as long as its phases)."""
    now = [0.0]
    timer, s = PhaseTimer("cpu"), StepStats(warmup=warmup)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing.time, "perf_counter", lambda: now[0])
        for times in steps:
            timer.reset()
            for name, t in zip(PHASES, times):
                with timer.phase(name):
                    now[0] += t
            s.add(timer, tokens)
            s.end_window()
    return s


def run_phases(timer, durations: dict):
    """One step through the timer; the phases take no real time (the clock is fake)."""
    timer.reset()
    for name in durations:
        with timer.phase(name):
            pass


def test_phase_timer_accumulates():
    clock = FakeDeviceClock([0.0, 1.0, 1.0, 1.5, 2.0, 4.0])
    timer = PhaseTimer("cpu", clock=clock)
    timer.reset()
    with timer.phase("forward"):
        pass
    with timer.phase("forward"):   # a second forward (e.g. gradient accumulation) adds up
        pass
    with timer.phase("update"):
        pass
    clock.sync()
    assert phase_seconds(clock, timer.marks) == {"data": 0.0, "forward": 1.5, "backward": 0.0, "update": 2.0}
    timer.reset()
    assert phase_seconds(clock, timer.marks) == dict.fromkeys(PHASES, 0.0)


def test_phases_are_read_once_per_window_without_waiting_at_boundaries(monkeypatch):
    # device time: each step is data 1, forward 2, backward 3, update 4 (10 in all)
    ticks, t = [], 0.0
    for _ in range(6):
        for d in (1.0, 2.0, 3.0, 4.0):
            ticks += [t, t + d]
            t += d
    clock = FakeDeviceClock(ticks)
    timer, stats = PhaseTimer("cuda", clock=clock), StepStats(warmup=2)
    # host time, read only when a window opens (first reset) and closes: the warm-up
    # window (steps 1-2) takes 50 s, the next (steps 3-6) 48 s
    fake_clock(monkeypatch, [0.0, 50.0, 52.0, 100.0])
    for step in range(1, 7):
        run_phases(timer, PHASES)
        stats.add(timer, tokens=1200)
        if step == 2:
            # the only wait so far: the window closes at the end of the warm-up, so
            # that no window mixes warm-up and measured steps
            assert clock.syncs == 1
    assert clock.syncs == 1            # none at phase boundaries, none at stats.add
    window = stats.end_window()
    assert clock.syncs == 2            # one per window
    assert (window.steps, window.tokens, window.wall_s) == (4, 4800, 48.0)
    assert window.tokens_per_s == pytest.approx(100.0)
    assert window.phase_s == {"data": 1.0, "forward": 2.0, "backward": 3.0, "update": 4.0}
    # the headline comes from wall time (48 s for 4 steps), not from the phase split
    # (40 s): on a GPU the split is an estimate, the wall time is what a reader waits
    assert stats.tokens_per_s() == pytest.approx(100.0)
    assert stats.wall_time_per_step() == pytest.approx(12.0)
    assert stats.mean_phase_times()["total"] == pytest.approx(10.0)
    assert len(stats.steps) == 6 and len(stats.measured()) == 4


def test_a_log_at_the_end_of_the_warmup_gets_the_window_just_closed(monkeypatch):
    clock = FakeDeviceClock([float(t) for t in range(8)])
    timer, stats = PhaseTimer("cuda", clock=clock), StepStats(warmup=2)
    fake_clock(monkeypatch, [0.0, 5.0])
    for _ in range(2):
        run_phases(timer, ["forward", "backward"])
        stats.add(timer, tokens=10)        # the 2nd closes the warm-up window
    window = stats.end_window()            # a log at step 2: the same window, no new wait
    assert (window.steps, window.wall_s, window.tokens_per_s) == (2, 5.0, 4.0)
    assert clock.syncs == 1


def test_phase_times_and_wall_time_agree_on_cpu():
    """On a CPU work is done when a call returns, so the phase split adds up to the
    step's wall time, but for the loop's own few statements between phases."""
    torch.manual_seed(0)
    w = torch.randn(384, 384)
    timer, stats = PhaseTimer("cpu"), StepStats(warmup=1)
    for _ in range(7):
        timer.reset()
        for name in PHASES:
            with timer.phase(name):
                for _ in range(6):
                    w = torch.tanh(w @ w)
        stats.add(timer, tokens=100)
    window = stats.end_window()
    phases = sum(t for times, _ in stats.steps[1:] for t in times.values())
    assert window.steps == 6
    assert phases <= window.wall_s
    # (tolerance: a few microseconds of Python per step against milliseconds of
    # matmuls; 10% leaves room for the scheduler on a loaded machine)
    assert phases == pytest.approx(window.wall_s, rel=0.10)
    assert stats.tokens_per_s() == pytest.approx(600 / phases, rel=0.10)


def test_step_stats_leave_out_warmup():
    slow, fast = (5.0, 5.0, 5.0, 5.0), (0.1, 0.2, 0.3, 0.4)
    s = stats_of([slow, slow, fast, fast, (0.3, 0.2, 0.3, 0.2)], tokens=500)
    assert len(s.measured()) == 3
    mean = s.mean_phase_times()
    assert mean["data"] == pytest.approx(0.5 / 3)
    assert mean["forward"] == pytest.approx(0.6 / 3)
    assert mean["total"] == pytest.approx(3.0 / 3)
    assert s.tokens_per_s() == pytest.approx(3 * 500 / 3.0)
    # fewer steps than the warm-up: use what there is rather than nothing
    few = stats_of([slow], tokens=100)
    assert few.tokens_per_s() == pytest.approx(100 / 20.0)
    assert StepStats().tokens_per_s() == 0.0
    assert StepStats().mean_phase_times()["total"] == 0.0


def test_metrics_lines_are_on_disk_at_once_and_a_resume_continues_them(tmp_path):
    """Line-buffered: a logged step is readable before the file is closed (a crash loses
    none); a resumed run keeps the lines up to its start and drops those it will redo."""
    import logging

    def tracker(start_step=0):
        args = argparse.Namespace(experiment_name="run", model_preset="tiny", seq_length=8, batch_size=2)
        return Tracker("01-single-gpu", tmp_path, "cpu", 9, 16, logging.getLogger("test"), threads=(1, 1),
                       args=args, dtype="fp32", num_params=1, flops_per_token=1.0, start_step=start_step)
    t = tracker()
    for step in (1, 2, 3):
        t.start_step()
        t.end_step()
        t.log(step, loss=2.5, lr=1e-3)
        assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step
    t.close()
    t = tracker(start_step=2)   # resumed after step 2: step 3 is redone
    t.start_step()
    t.end_step()
    t.log(3, loss=1.5, lr=1e-3)
    t.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 2.5), (2, 2.5), (3, 1.5)]


def test_a_line_that_is_not_utf8_or_too_deep_is_skipped(tmp_path):
    """A metrics.jsonl with a line in another encoding and one nested past the JSON
    parser's depth still reads (a resume rewrites the file from these records)."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 2.5}\n{"step": 2, "note": "caf\xe9"}\n'
                     + b"[" * 100_000 + b"\n" + b'{"step": 3, "loss": 2.0}\n')
    assert [r["step"] for r in read_metrics(path)] == [1, 3]

def test_write_json_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]

    def crash(*a):
        raise OSError("killed before the rename")

    monkeypatch.setattr(files.os, "replace", crash)
    with pytest.raises(OSError):
        write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}   # the old file is intact


def summary_for(device_name: str | None = None, monkeypatch=None, peak=None,
                dtype: str = "fp32") -> dict:
    if device_name:
        monkeypatch.setattr(metrics, "device_name", lambda d: device_name)
        monkeypatch.setattr("common.peak_flops.device_name", lambda d: device_name)
    args = argparse.Namespace(experiment_name="run-1", model_preset="tiny", seq_length=64,
                              batch_size=4, lr=1e-3)
    stats = stats_of([(1.0, 1.0, 1.0, 1.0)] * 2 + [(0.1, 0.2, 0.3, 0.4)] * 3, tokens=1024)
    return build_summary(chapter="03-ddp", args=args, world_size=2, device="cpu",
                         dtype=dtype, num_params=1_234_567, flops_per_token=2e7,
                         stats=stats, tokens_per_step=1024, final_loss=3.21, val_loss=3.5,
                         wall_time_s=12.0, num_devices=2, backend="gloo", peak=peak)


def test_build_summary_keys_and_figures():
    s = summary_for(peak=Peak(95e9, "fp32", "measured"))
    assert SUMMARY_KEYS <= set(s)
    assert s["chapter"] == "03-ddp" and s["world_size"] == 2 and s["preset"] == "tiny"
    assert s["tokens_per_s"] == pytest.approx(1024 / 1.0)
    assert s["tokens_per_s_per_device"] == pytest.approx(512.0)
    assert set(PHASES) <= set(s["step_time_s"])
    assert s["step_time_s"]["backward"] == pytest.approx(0.3)
    assert s["model_flops_per_s"] == pytest.approx(512.0 * 2e7)
    assert s["mfu"] == pytest.approx(512.0 * 2e7 / 95e9)
    assert (s["peak_flops"], s["peak_source"], s["peak_precision"]) == (95e9, "measured", "fp32")
    assert s["peak_memory_mb"] > 0 and s["peak_memory_kind"] == "process_peak_rss"
    assert s["torch_version"] == torch.__version__
    assert s["final_loss"] == 3.21 and s["args"]["lr"] == 1e-3
    json.dumps(s)                              # summary.json must be writable


def test_build_summary_measures_the_peak_of_a_cpu():
    s = summary_for()                          # no peak given: this CPU's, measured
    assert s["peak_source"] == "measured" and s["peak_precision"] == "fp32"
    assert s["peak_flops"] > 1e8 and 0 < s["mfu"] == pytest.approx(512.0 * 2e7 / s["peak_flops"])


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H200 NVL", "bf16", 835e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
])
def test_build_summary_mfu_on_a_known_gpu(monkeypatch, name, dtype, peak):
    s = summary_for(name, monkeypatch, dtype=dtype)
    assert s["peak_source"] == "datasheet" and s["peak_flops"] == peak
    assert s["mfu"] == pytest.approx(512.0 * 2e7 / peak)


def test_throughput_table_shows_the_figures():
    table = throughput_table(summary_for(peak=Peak(95.3e9, "fp32", "measured")))
    lines = table.splitlines()
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines)
    assert set(lines[1]) <= {"|", "-", " "}
    for text in ("03-ddp", "tiny", "1.23 M", "1,024.0", "512.0", "1000.0", "estimate",
                 "10.2 GFLOP/s", "10.7% of 95.3 GFLOP/s (measured fp32 matmul peak)",
                 "3.2100", "gloo"):
        assert text in table, text


@pytest.mark.parametrize("flops, text", [(95.26e9, "95.3 GFLOP/s"), (989e12, "989 TFLOP/s"),
                                         (1.2e15, "1.2 PFLOP/s"), (5e6, "5 MFLOP/s")])
def test_format_flops(flops, text):
    assert format_flops(flops) == text


def test_peak_memory_on_cpu():
    mb, kind = peak_memory_mb("cpu")
    assert kind == "process_peak_rss"
    assert 10 < mb < 1e6   # torch alone takes tens of MB; never absurd units


def test_mfu_over_100_percent_asks_to_remeasure_the_peak():
    s = summary_for(peak=Peak(5e9, "fp32", "measured"))      # 10.24 GFLOP/s achieved
    assert s["mfu"] > 1
    assert any("--remeasure" in note for note in s["notes"])
    assert "--remeasure" in throughput_table(s)
    assert "notes" not in summary_for(peak=Peak(95e9, "fp32", "measured"))



def tracked_run(save_dir, monkeypatch, world_size: int, padded: bool = True,
                load: float = 0.5) -> tuple[dict, list[dict], int]:
    """Six steps of 16 tokens, 12 of them real if `padded`, through the Tracker, logged at
    steps 3 and 6. Returns the summary,
    the metrics records and how often a count was read back from a tensor."""
    import logging

    monkeypatch.setattr(metrics, "device_peak", lambda device, dtype: Peak(1e9, "fp32", "measured"))
    monkeypatch.setattr(metrics, "load_average", lambda: load)  # an idle machine, unless said
    args = argparse.Namespace(experiment_name="run", model_preset="tiny", seq_length=8,
                              batch_size=2, padded=padded, save_dir=str(save_dir))
    (save_dir / "run").mkdir(parents=True)
    reads = []
    real_float = torch.Tensor.__float__
    monkeypatch.setattr(torch.Tensor, "__float__", lambda t: reads.append(1) or real_float(t))
    t = Tracker("03-ddp", save_dir / "run", "cpu", 6, 16, logging.getLogger("test"),
                threads=(1, world_size), args=args, dtype="fp32", num_params=1000,
                flops_per_token=1e4, world_size=world_size)
    for step in range(1, 7):
        t.start_step()
        with t.phase("forward"):
            sum(range(20000))  # some time passes
        before = len(reads)
        if padded:
            t.end_step(torch.tensor(12))
        else:
            t.end_step()
        assert len(reads) == before  # a step never waits to read its count
        if step % 3 == 0:
            t.log(step, loss=1.0, lr=1e-3)
    s = t.finish(final_loss=1.0, val_loss=None)
    return s, read_metrics(save_dir / "run" / "metrics.jsonl"), len(reads)


def test_padded_real_tokens_are_counted_on_the_device_and_shown(tmp_path, monkeypatch, capsys):
    """--padded: tokens/s counts the padding, so the real tokens/s is shown beside it
    (metrics, summary, table), from counts added up without a wait per step."""
    s, records, reads = tracked_run(tmp_path, monkeypatch, world_size=1)
    assert reads == 3  # read at the two logs and once for the summary
    assert s["real_tokens_per_s"] == pytest.approx(0.75 * s["tokens_per_s"])
    assert [r["real_tokens_per_s"] / r["tokens_per_s"] for r in records] == pytest.approx([0.75, 0.75])
    row = next(l for l in capsys.readouterr().out.splitlines() if "tokens/s real" in l)
    assert f"{s['real_tokens_per_s']:,.1f}" in row


def test_write_json_on_a_full_disk_keeps_the_old_file_and_leaves_no_half_copy(small_disk):
    """ENOSPC mid-write: the error reaches the caller (the Tracker turns it into one line),
    the file already there is untouched, and no half-written temporary stays beside it."""
    disk = small_disk(64 << 10)
    path = disk / "summary.json"
    write_json(path, {"old": 1})
    with pytest.raises(OSError):
        write_json(path, {"big": "x" * (256 << 10)})
    assert [p.name for p in disk.iterdir()] == ["summary.json"]
    assert json.loads(path.read_text()) == {"old": 1}


def test_a_resumed_run_on_a_full_disk_keeps_its_metrics_and_says_one_line(small_disk, capsys):
    """Chapter 04 resuming rewrites metrics.jsonl without the steps it will redo. On a
    disk with no room for that copy the run stops with one line (exit status 1), the
    metrics already there stay whole, and no half-written copy is left beside them."""
    import logging

    disk = small_disk(64 << 10)
    (disk / "run").mkdir()
    # 40 KB of metrics on a 64 KB disk: no room for the rewritten copy of 39 KB
    lines = "".join(json.dumps({"step": i, "loss": 1.0, "note": "x" * 200}) + "\n" for i in range(1, 166))
    (disk / "run" / "metrics.jsonl").write_text(lines)
    args = argparse.Namespace(experiment_name="run", model_preset="tiny", seq_length=8, batch_size=2)
    with pytest.raises(SystemExit) as stop:
        Tracker("04-checkpointing", disk / "run", "cpu", 200, 16, logging.getLogger("test"), threads=(1, 1),
                args=args, dtype="fp32", num_params=1000, flops_per_token=1e4, start_step=160)
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: writing {disk / 'run' / 'metrics.jsonl'} failed (OSError: [Errno 28] "), err
    assert sorted(p.name for p in (disk / "run").iterdir()) == ["metrics.jsonl"]
    assert (disk / "run" / "metrics.jsonl").read_text() == lines


@pytest.mark.parametrize("bar", [False, True], ids=["log-file", "progress-bar"])
def test_a_disk_that_fills_mid_run_stops_the_log_with_one_line(small_disk, capsys, monkeypatch, bar):
    """metrics.jsonl is written a line at a time: when the disk fills mid-run, the run
    stops with exit status 1 and one line naming the file, no traceback and no
    'Exception ignored' from the unflushed file at exit. Under a progress bar (a
    terminal) the line starts a line of its own, below the bar's last state."""
    import logging

    if bar:
        monkeypatch.setenv("LLM_GUIDE_PROGRESS", "1")
    disk = small_disk(64 << 10)
    (disk / "run").mkdir()
    args = argparse.Namespace(experiment_name="run", model_preset="tiny", seq_length=8, batch_size=2)
    t = Tracker("01-single-gpu", disk / "run", "cpu", 10_000, 16, logging.getLogger("test"),
                threads=(1, 1), args=args, dtype="fp32", num_params=1000, flops_per_token=1e4)
    with pytest.raises(SystemExit) as stop:
        for step in range(1, 10_001):
            t.start_step()
            t.end_step()
            t.log(step, loss=1.0, lr=1e-3, note="x" * 200)
    err = capsys.readouterr().err
    if bar:
        drawn, line, end = err.rsplit("\n", 2)
        assert "01-single-gpu:" in drawn.rsplit("\r", 1)[-1], err[-400:]  # the bar's last state stays
        err = f"{line}\n{end}"
    assert stop.value.code == 1 and err.count("\n") == 1, err
    assert err.startswith(f"error: writing {disk / 'run' / 'metrics.jsonl'} failed (OSError: [Errno 28] "), err
