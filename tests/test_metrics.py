"""Timers, throughput arithmetic, output files and the summary every run writes."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import common.metrics as metrics
from common.metrics import (PHASES, MetricsWriter, PhaseTimer, StepStats, build_summary,
                            peak_memory_mb, read_metrics, throughput_table, write_json)

SUMMARY_KEYS = {"chapter", "world_size", "device_name", "dtype", "preset", "num_params",
                "tokens_per_s", "tokens_per_s_per_device", "step_time_s", "peak_memory_mb",
                "mfu", "final_loss", "torch_version"}


def fake_clock(monkeypatch, ticks):
    """time.perf_counter returns these values in turn."""
    it = iter(ticks)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(it))


def stats_of(steps: list[tuple[float, float, float, float]], tokens: int, warmup: int = 2):
    s = StepStats(warmup=warmup)
    for times in steps:
        s.add(dict(zip(PHASES, times)), tokens)
    return s


def test_phase_timer_accumulates(monkeypatch):
    fake_clock(monkeypatch, [0.0, 1.0, 1.0, 1.5, 2.0, 4.0])
    timer = PhaseTimer("cpu")
    timer.reset()
    with timer.phase("forward"):
        pass
    with timer.phase("forward"):   # a second forward (e.g. gradient accumulation) adds up
        pass
    with timer.phase("update"):
        pass
    assert timer.times == {"data": 0.0, "forward": 1.5, "backward": 0.0, "update": 2.0}
    timer.reset()
    assert timer.times == dict.fromkeys(PHASES, 0.0)


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


def test_metrics_writer_lines_are_on_disk_at_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    w = MetricsWriter(path)
    w.write({"step": 1, "loss": 2.5})
    # line-buffered: readable before close, so a crash loses no logged step
    assert json.loads(path.read_text()) == {"step": 1, "loss": 2.5}
    w.write({"step": 2, "loss": 2.0})
    w.close()
    w = MetricsWriter(path, append=True)   # a resumed run continues the file
    w.write({"step": 3, "loss": 1.5})
    w.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]


def test_write_json_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]

    def crash(*a):
        raise OSError("killed before the rename")

    monkeypatch.setattr(metrics.os, "replace", crash)
    with pytest.raises(OSError):
        write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}   # the old file is intact


def summary_for(device_name: str | None = None, monkeypatch=None) -> dict:
    if device_name:
        monkeypatch.setattr(metrics, "device_name", lambda d: device_name)
    args = argparse.Namespace(experiment_name="run-1", model_preset="tiny", seq_length=64,
                              batch_size=4, lr=1e-3)
    stats = stats_of([(1.0, 1.0, 1.0, 1.0)] * 2 + [(0.1, 0.2, 0.3, 0.4)] * 3, tokens=1024)
    return build_summary(chapter="03-ddp", args=args, world_size=2, device="cpu",
                         dtype="fp32", num_params=1_234_567, flops_per_token=2e7,
                         stats=stats, tokens_per_step=1024, final_loss=3.21, val_loss=3.5,
                         wall_time_s=12.0, num_devices=2, backend="gloo")


def test_build_summary_keys_and_figures():
    s = summary_for()
    assert SUMMARY_KEYS <= set(s)
    assert s["chapter"] == "03-ddp" and s["world_size"] == 2 and s["preset"] == "tiny"
    assert s["tokens_per_s"] == pytest.approx(1024 / 1.0)
    assert s["tokens_per_s_per_device"] == pytest.approx(512.0)
    assert set(PHASES) <= set(s["step_time_s"])
    assert s["step_time_s"]["backward"] == pytest.approx(0.3)
    assert s["mfu"] is None                    # no known peak for a CPU
    assert s["peak_memory_mb"] > 0 and s["peak_memory_kind"] == "process_peak_rss"
    assert s["torch_version"] == torch.__version__
    assert s["final_loss"] == 3.21 and s["args"]["lr"] == 1e-3
    json.dumps(s)                              # summary.json must be writable


def test_build_summary_mfu_on_a_known_gpu(monkeypatch):
    s = summary_for("NVIDIA H100 80GB HBM3", monkeypatch)
    assert s["mfu"] == pytest.approx(512.0 * 2e7 / 989e12)


def test_throughput_table_shows_the_figures():
    table = throughput_table(summary_for())
    lines = table.splitlines()
    assert all(line.startswith("| ") and line.endswith(" |") for line in lines)
    assert set(lines[1]) <= {"|", "-", " "}
    for text in ("03-ddp", "tiny", "1.23 M", "1,024.0", "512.0", "1000.0", "n/a",
                 "3.2100", "gloo"):
        assert text in table, text


def test_peak_memory_on_cpu():
    mb, kind = peak_memory_mb("cpu")
    assert kind == "process_peak_rss"
    assert 10 < mb < 1e6   # torch alone takes tens of MB; never absurd units
