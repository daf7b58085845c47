"""Chapter 05's overlap timeline: one launch traces naive all-reduces and chapter 03's DDP;
the fractions come from the Chrome traces it writes, naive overlaps nothing and DDP
overlaps clearly; the reading of a trace checked on hand-made CPU and GPU traces."""

from __future__ import annotations

import json

import pytest

from conftest import chapter_module, load_script, read_json, run_warm
from pages import readme_command
timeline = chapter_module("05-collectives", "timeline")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SCRIPT = "05-collectives/overlap_timeline.py"
# small preset: its layers' backward, which DDP's first bucket (the 8 MiB head) overlaps,
# lasts far longer than the head's all-reduce, even on two loaded cores
SIZES = ["--model-preset", "small", "--seq-length", "64", "--batch-size", "2"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("timeline")
    proc = run_warm([*readme_command("05-collectives/overlap.md", "nproc-per-node=2 05-collectives/overlap_timeline.py"),
                *SIZES, "--modes", "naive,ch03-ddp", "--save-dir", save_dir, "--experiment-name", "t"])
    return proc, save_dir / "t"


def rank_steps(trace: dict, world: int) -> list[timeline.RankStep]:
    """The merged Chrome trace split back into its ranks (rank r's processes are r*100+k)."""
    return [timeline.read_step({"traceEvents": [e for e in trace["traceEvents"] if e["pid"] // 100 == r]}, r)
            for r in range(world)]


def test_naive_overlaps_nothing_and_ddp_overlaps_clearly(traced):
    proc, run_dir = traced
    modes = read_json(run_dir / "overlap_timeline.json")["modes"]
    assert "| ch03-ddp " in (run_dir / "tables.md").read_text()  # what the tour's report shows
    naive, ddp = modes["naive"]["overlap_fraction"], modes["ch03-ddp"]["overlap_fraction"]
    # naive starts its all-reduces after backward has returned: 0 by construction (1% for
    # the clocks of two threads); DDP's first bucket is reduced during the layers' backward
    assert naive <= 0.01, proc.stdout
    assert ddp >= naive + 0.1, proc.stdout
    assert modes["naive"]["collectives"] > modes["ch03-ddp"]["collectives"] >= 2
    for mode, figures in modes.items():  # the figures are those of the trace the reader opens
        again = timeline.overlap(rank_steps(json.loads((run_dir / f"trace-{mode}.json").read_text()), 2))
        assert again["overlap_fraction"] == pytest.approx(figures["overlap_fraction"], rel=1e-6, abs=1e-9)
        assert again["collective_ms"] == pytest.approx(figures["collective_ms"], rel=1e-6)
        assert f"| {mode} " in proc.stdout


def test_png_and_chrome_traces_are_written(traced):
    proc, run_dir = traced
    # on a CPU the profiler's own log (a `USDT: ... profiler_start` line per recording) is off
    assert "USDT" not in proc.stdout + proc.stderr and "profiler_start" not in proc.stderr
    assert "Profiler clears events" not in proc.stderr  # torch 2.11's warning, unless acc_events
    png = (run_dir / "overlap_timeline.png").read_bytes()
    assert png[:8] == PNG_SIGNATURE and len(png) > 10_000
    for mode in ("naive", "ch03-ddp"):
        events = json.loads((run_dir / f"trace-{mode}.json").read_text())["traceEvents"]
        names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
        assert any(n.startswith("rank 0") for n in names) and any(n.startswith("rank 1") for n in names)
        for step in rank_steps({"traceEvents": events}, 2):
            assert [p for p, *_ in step.phases if p != "sync"] == ["forward", "backward", "optimizer"]
            assert step.collectives and all(name == "all_reduce" for name, *_ in step.collectives)
        gloo = {e["tid"] for e in events if e.get("name", "").startswith("gloo:")}
        phases = {e["tid"] for e in events if e.get("name") in timeline.PHASES}
        assert gloo and phases and not gloo & phases  # gloo's work runs on its own threads


def x(name, ts, dur, tid=1, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid, "cat": cat, "args": args}


def test_reading_a_cpu_trace():
    """A collective on gloo's thread (tid 2) is overlapped only while an ATen operator of
    backward runs; a copy inside a c10d call, or a backward node, is not computation."""
    trace = {"traceEvents": [
        x("step", 1000, 10000, cat="user_annotation"),
        x("forward", 1000, 2000, cat="user_annotation"), x("aten::mm", 1500, 1000),
        x("backward", 3000, 4000, cat="user_annotation"),
        x("autograd::engine::evaluate_function: MmBackward0", 3000, 4000),
        x("aten::mm", 3000, 2000), x("aten::mm", 6000, 500),
        x("c10d::allreduce_", 5000, 900), x("aten::clone", 5100, 700),
        x("gloo:all_reduce", 4000, 4000, tid=2, cat="user_annotation"),
        x("aten::copy_", 7500, 400, tid=2),
        x("optimizer", 8000, 1000, cat="user_annotation"), x("aten::add_", 8100, 800)]}
    step = timeline.read_step(trace)
    assert step.step_ms == 10 and step.collectives == [("all_reduce", 3.0, 7.0)]
    assert step.compute["backward"] == [(2.0, 4.0), (5.0, 5.5)]
    assert step.overlapped() == [(3.0, 4.0), (5.0, 5.5)]
    figures = timeline.overlap([step])
    assert figures["overlap_fraction"] == pytest.approx(1.5 / 4)


def gpu_step(*collective):
    """A traced GPU step: forward and backward each launch one kernel (a gemm), plus the
    `collective` events."""
    return {"traceEvents": [
        x("step", 0, 10000, cat="user_annotation"),
        x("forward", 0, 3000, cat="user_annotation"),
        x("backward", 3000, 5000, cat="user_annotation"),
        x("cudaLaunchKernel", 2900, 10, cat="cuda_runtime", correlation=1),
        x("cudaLaunchKernel", 3100, 10, cat="cuda_runtime", correlation=2),
        x("gemm_fwd", 3000, 1000, tid=20, cat="kernel", correlation=1),
        x("gemm_bwd", 4000, 2000, tid=20, cat="kernel", correlation=2),
        *collective]}


def test_reading_a_gpu_trace():
    """nccl kernels against the other kernels, each charged to the phase that launched it
    (a kernel launched in forward does not count, even if it runs during backward)."""
    trace = gpu_step(
        x("cudaLaunchKernel", 3200, 10, cat="cuda_runtime", correlation=3),
        x("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", 3500, 3000, tid=30, cat="kernel",
          correlation=3))
    step = timeline.read_step(trace)
    assert step.collectives == [("AllReduce", 3.5, 6.5)]
    assert step.compute["backward"] == [(4.0, 6.0)] and step.compute["forward"] == [(3.0, 4.0)]
    assert timeline.overlap([step])["overlap_fraction"] == pytest.approx(2 / 3)


def test_reading_a_gpu_trace_of_gloo():
    """Ranks sharing a GPU over gloo (LLM_GUIDE_BACKEND=gloo): the collectives are gloo's
    ranges on its thread, as on a CPU, though no nccl kernel ran; computation is still
    the kernels."""
    trace = gpu_step(x("gloo:all_reduce", 5000, 2000, tid=2, cat="user_annotation"))
    step = timeline.read_step(trace)
    assert step.collectives == [("all_reduce", 5.0, 7.0)]
    assert step.compute["backward"] == [(4.0, 6.0)] and step.compute["forward"] == [(3.0, 4.0)]
    assert timeline.overlap([step])["overlap_fraction"] == pytest.approx(1 / 2)


def test_a_trace_without_the_step_range_is_refused():
    with pytest.raises(ValueError, match="no 'step' range"):
        timeline.read_step({"traceEvents": [x("aten::mm", 0, 10)]})


def test_bad_modes_exit_2(monkeypatch, capsys):
    module = load_script(SCRIPT)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        module.parse_args(["--modes", "naive,turbo"])
    assert e.value.code == 2 and "turbo" in capsys.readouterr().err


def test_the_picture_says_what_its_percentages_count(tmp_path, monkeypatch):
    """Each panel's title names the collectives its percentage counts (a ZeRO-3 step
    waits for its all-gathers and reduce-scatters inside the backward bar: 0%); the
    legend says what the percentage is and how ddp and ch03-ddp differ."""
    import matplotlib.figure
    from argparse import Namespace

    from common.demos import Group
    drawn = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    phases = [("forward", 0.0, 3.0), ("backward", 3.0, 8.0), ("optimizer", 8.0, 9.0)]
    zero3 = timeline.RankStep(0, 9.0, phases, [("all_gather", 3.0, 4.0), ("all_reduce", 5.0, 6.0)],
                              {"backward": [(4.0, 5.0), (6.0, 8.0)]})
    ddp = timeline.RankStep(0, 9.0, phases, [("all_reduce", 4.0, 6.0)], {"backward": [(3.0, 8.0)]})
    args = Namespace(modes=["zero3", "ddp", "ch03-ddp"], bucket_mb=25.0, model_preset="tiny",
                     batch_size=2, seq_length=32)
    module = load_script(SCRIPT)
    module.report(args, Group(0, 1, "cpu", "gloo"), {"zero3": [zero3], "ddp": [ddp], "ch03-ddp": [ddp]},
                  tmp_path)
    [fig] = drawn
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles[0].startswith("zero3: 0% of 2.0 ms of collectives (all_gather, all_reduce) ran while "
                                "backward computed"), titles
    assert titles[2].startswith("ch03-ddp: 100% of 2.0 ms of collectives (all_reduce)"), titles
    legend = " ".join(t.get_text() for legend in fig.legends for t in legend.get_texts())
    assert "every kind listed, all-gathers too" in legend and "a collective the rank waits for" in legend
    assert "ddp: torch's DDP with bucket_cap_mb=25 (--bucket-mb)" in legend
    assert "ch03-ddp: torch's DDP as chapter 03 wraps it (no bucket_cap_mb)" in legend and "1 MiB" in legend
