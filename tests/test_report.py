"""`python -m tools.report`: one row per run with the right figures, the device in every
row, a warning when devices differ, valid PNGs, corrupt summaries skipped, exit 2 when
there is nothing to report; readable with many runs; archived runs left out unless asked
for, then labelled."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest

from tools import report
from common.files import write_json
from common.metrics import build_summary
from common.timing import PHASES
from conftest import run_warm
from test_metrics import stats_of

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
H100 = "NVIDIA H100 80GB HBM3"


def fake_run(run_dir: Path, chapter: str, *, world: int, phases: dict, tokens: int,
             final_loss: float, losses: list[float], device_name: str | None = None,
             mfu: float | None = None, extra: dict | None = None) -> dict:
    """A run folder as a chapter writes it: summary.json from the real build_summary
    (so the schema is the real one) and metrics.jsonl."""
    run_dir.mkdir(parents=True)
    args = argparse.Namespace(experiment_name=run_dir.name, model_preset="tiny",
                              seq_length=64, batch_size=4)
    stats = stats_of([tuple(phases[p] for p in PHASES)] * 5, tokens, warmup=0)
    s = build_summary(chapter=chapter, args=args, world_size=world, device="cpu",
                      dtype="fp32", num_params=123_456, flops_per_token=1e6, stats=stats,
                      tokens_per_step=tokens, final_loss=final_loss, val_loss=final_loss + 0.1,
                      wall_time_s=3.0, num_devices=world, backend="gloo" if world > 1 else None,
                      extra=extra)
    if device_name:  # pretend it ran elsewhere: the fields a GPU run would carry
        s.update(device="cuda", device_name=device_name, mfu=mfu, peak_flops=989e12,
                 peak_source="datasheet", peak_precision="bf16",
                 peak_memory_kind="cuda_max_allocated")
    write_json(run_dir / "summary.json", s)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "loss": loss, "lr": 1e-3}) + "\n")
    return s


@pytest.fixture
def runs_dir(tmp_path):
    """Three runs in nested folders, created out of order; two on this CPU, one 'H100'."""
    root = tmp_path / "runs"
    fake_run(root / "b" / "04-ckpt", "04-checkpointing", world=2, tokens=2048,
             phases={"data": 0.001, "forward": 0.002, "backward": 0.004, "update": 0.001},
             final_loss=3.25, losses=[6.0, 5.0, 4.0], device_name=H100, mfu=0.42,
             extra={"checkpoint": {"size_mb": 10.0, "save_s": 0.123, "save_mb_per_s": 81.3,
                                   "load_s": 0.05}})
    fake_run(root / "a" / "03-ddp", "03-ddp", world=2, tokens=2048,
             phases={"data": 0.02, "forward": 0.2, "backward": 0.4, "update": 0.1},
             final_loss=4.0, losses=[6.5, 5.5, 4.5, 4.0],
             extra={"notes": ["global batch is 2 x 4 samples"]})
    fake_run(root / "a" / "01-single", "01-single-gpu", world=1, tokens=1024,
             phases={"data": 0.01, "forward": 0.1, "backward": 0.2, "update": 0.05},
             final_loss=2.5, losses=[6.0, 4.0, 2.5])
    return root


def table_rows(text: str) -> list[list[str]]:
    """Body rows of the first Markdown table in `text`, as stripped cells."""
    lines = [l for l in text.splitlines() if l.startswith("|")]
    return [[c.strip() for c in l.strip("|").split("|")] for l in lines[2:]]


def header(text: str) -> list[str]:
    line = next(l for l in text.splitlines() if l.startswith("|"))
    return [c.strip() for c in line.strip("|").split("|")]


def assert_png(path: Path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > 1000, f"{path} is suspiciously small"


def test_report_in_process(runs_dir, tmp_path, capsys):
    out = tmp_path / "report"
    assert report.main([str(runs_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    cols = header(printed)
    rows = table_rows(printed)
    assert len(rows) == 3
    # ordered by chapter, then name
    assert [r[cols.index("chapter")] for r in rows] == ["01-single-gpu", "03-ddp", "04-checkpointing"]
    by_name = {r[cols.index("run")]: dict(zip(cols, r)) for r in rows}

    one = by_name["01-single"]
    one_summary = json.loads((runs_dir / "a" / "01-single" / "summary.json").read_text())
    assert one["tokens/s"] == f"{1024 / 0.36:,.0f}"       # 2,844
    assert one["tokens/s/device"] == f"{1024 / 0.36:,.0f}"
    assert (one["data ms"], one["forward ms"], one["backward ms"], one["update ms"],
            one["step ms"]) == ("10.0", "100.0", "200.0", "50.0", "360.0")
    assert one["world size"] == "1" and one["launcher"] == "python"
    assert one["ckpt save ms"] == "-"
    # a CPU run's MFU: against the matmul peak measured on this CPU
    assert one["model FLOP/s"] == f"{1024 / 0.36 * 1e6 / 1e9:.3g} GFLOP/s"
    assert one["peak FLOP/s"].endswith("(measured)")
    assert one["MFU"] == f"{100 * 1024 / 0.36 * 1e6 / one_summary['peak_flops']:.1f}%"
    assert one["final loss"] == "2.5000"
    assert one["peak memory"].endswith("MB RSS")

    ddp = by_name["03-ddp"]
    assert ddp["tokens/s"] == f"{2048 / 0.72:,.0f}"
    assert ddp["tokens/s/device"] == f"{1024 / 0.72:,.0f}"  # total over 2 devices
    assert ddp["device"].endswith("× 2")

    ck = by_name["04-ckpt"]
    assert ck["device"] == f"{H100} × 2"
    assert ck["MFU"] == "42.0%" and ck["peak FLOP/s"] == "989 TFLOP/s (datasheet)"
    assert ck["ckpt save ms"] == "123"
    assert ck["tokens/s"] == f"{2048 / 0.008:,.0f}"
    assert ck["peak memory"].endswith("MB CUDA")

    # the device is in every row; runs on two devices are flagged above the table
    for r in rows:
        assert r[cols.index("device")].startswith(("CPU", "NVIDIA"))
    before_table = printed.split("|", 1)[0]
    assert "warning" in before_table and "2 different devices" in before_table
    assert "global batch is 2 x 4 samples" in printed  # notes are carried

    md = (out / "report.md").read_text()
    assert len(table_rows(md)) == 3 and "2 different devices" in md
    for name in report.PLOTS:
        assert_png(out / name)
        assert f"]({name})" in md


def test_report_subprocess_default_out_and_single_device(runs_dir):
    """As a reader runs it; one RUN_DIR → files land there; one device → no warning."""
    only_cpu = runs_dir / "a"
    proc = run_warm([sys.executable, "-m", "tools.report", only_cpu])
    rows = table_rows(proc.stdout)
    assert len(rows) == 2
    assert "warning" not in proc.stdout and proc.stderr == ""
    assert "report.md" in proc.stdout
    for name in ("report.md", *report.PLOTS):
        assert (only_cpu / name).stat().st_size > 0
    assert_png(only_cpu / "loss.png")


def test_corrupt_summary_is_skipped_with_warning(runs_dir, tmp_path, capsys):
    bad = runs_dir / "c" / "broken"
    bad.mkdir(parents=True)
    (bad / "summary.json").write_text('{"chapter": "01-single-gpu", "tokens_')
    incomplete = runs_dir / "c" / "incomplete"
    incomplete.mkdir()
    (incomplete / "summary.json").write_text('{"chapter": "01-single-gpu"}')
    wrong_type = runs_dir / "c" / "wrong-type"
    wrong_type.mkdir()
    s = json.loads((runs_dir / "a" / "01-single" / "summary.json").read_text())
    (wrong_type / "summary.json").write_text(json.dumps({**s, "tokens_per_s": "fast"}))
    no_device = runs_dir / "c" / "no-device"  # the table's keys all there, a plot label's not
    no_device.mkdir()
    (no_device / "summary.json").write_text(json.dumps({k: v for k, v in s.items() if k != "device"}))
    assert report.main([str(runs_dir), "--out", str(tmp_path / "r")]) == 0
    captured = capsys.readouterr()
    assert len(table_rows(captured.out)) == 3
    warnings = captured.err.splitlines()
    assert len(warnings) == 4 and all(w.startswith("warning: skipping") for w in warnings)
    assert any(str(no_device / "summary.json") in w and "'device'" in w for w in warnings)
    assert any(str(bad / "summary.json") in w for w in warnings)
    assert any(str(incomplete / "summary.json") in w and "missing keys" in w for w in warnings)
    assert any(str(wrong_type / "summary.json") in w and "not a number" in w for w in warnings)


def test_resumed_run_loss_curve_keeps_surviving_records(tmp_path):
    """Chapter 04 logs steps after its last checkpoint twice (before the crash, after the
    resume): the curve keeps one point per step, the later one; torn lines are ignored."""
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 3, "loss": 3.9},
             {"step": 2, "loss": 4.1}, {"step": 3, "loss": 3.0}, {"step": 4, "loss": 2.0}]
    path.write_text("".join(json.dumps(l) + "\n" for l in lines) + '{"step": 5, "lo')
    assert [(m["step"], m["loss"]) for m in report.read_loss_curve(path)] == \
        [(1, 5.0), (2, 4.1), (3, 3.0), (4, 2.0)]


def test_nothing_to_report_exits_2(tmp_path, capsys):
    """In this process (the command's own path, `python -m tools.report`, is launched by
    test_report_subprocess_default_out_and_single_device)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (empty, tmp_path / "does-not-exist"):
        assert report.main([str(target)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert len(captured.err.strip().splitlines()) == 1 and captured.err.startswith("error:")
    assert not any(empty.iterdir())  # nothing written when there is nothing to report


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's IHDR chunk."""
    return struct.unpack(">II", path.read_bytes()[16:24])


@pytest.fixture
def many_runs(tmp_path):
    """18 runs as a long outputs/ holds them (settings, threads, load), one from an older
    version without those fields, and two runs with an archived earlier run inside."""
    root = tmp_path / "outputs"
    chapters = ["01-single-gpu", "02-data-parallel", "03-ddp", "04-checkpointing"]
    for i in range(18):
        chapter = chapters[i % 4]
        fake_run(root / f"{chapter[:2]}-experiment-with-a-long-name-{i:02d}", chapter,
                 world=1 + i % 2, tokens=1024 * (1 + i % 2),
                 phases={"data": 0.01, "forward": 0.1 + i / 100, "backward": 0.2, "update": 0.05},
                 final_loss=3.0 + i / 10, losses=[6.0 - k / 10 - i / 50 for k in range(40)],
                 extra={"grad_accum": 1 + i % 3, "data": {"form": "padded" if i % 2 else "packed"},
                        "threads_per_process": 1, "processes_per_machine": 1 + i % 2,
                        "cpu_cores": 2, "load_avg_max": 3.5 if i % 2 else 1.0})
    old = root / "01-experiment-with-a-long-name-00" / "summary.json"
    summary = json.loads(old.read_text())
    for key in ("seq_length", "batch_size", "args", "grad_accum", "data", "threads_per_process",
                "processes_per_machine", "cpu_cores", "load_avg_max"):
        del summary[key]
    old.write_text(json.dumps(summary))
    for name in ("03-experiment-with-a-long-name-02", "04-experiment-with-a-long-name-03"):
        archive = root / name / "archive-20261122-010203"
        archive.mkdir()
        for f in ("summary.json", "metrics.jsonl"):
            shutil.copy(root / name / f, archive / f)
    return root


def test_many_runs_readable_with_settings_columns(many_runs, runs_dir, tmp_path, capsys,
                                                  monkeypatch):
    panels = []  # the curves of each loss panel, as (label, colour, line style)
    save = report._save

    def keep_panels(plt, fig, path):
        if path.name == "loss.png":
            panels.extend([(l.get_label(), l.get_color(), l.get_linestyle())
                           for l in ax.get_lines()] for ax in fig.axes)
        return save(plt, fig, path)

    monkeypatch.setattr(report, "_save", keep_panels)
    out = tmp_path / "report"
    assert report.main([str(many_runs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    cols, rows = header(printed), table_rows(printed)
    assert len(rows) == 18
    assert not any("archived" in r[cols.index("run")] for r in rows)
    assert "left out 2 archived run(s)" in printed and "--include-archived" in printed

    by_name = {r[cols.index("run")]: dict(zip(cols, r)) for r in rows}
    busy = by_name["02-experiment-with-a-long-name-01"]
    assert (busy["seq"], busy["batch"], busy["accum"], busy["data"], busy["threads"],
            busy["load/cores"]) == ("64", "4", "2", "padded", "1 × 2", "3.5/2 !")
    calm = by_name["03-experiment-with-a-long-name-02"]
    assert (calm["accum"], calm["data"], calm["threads"], calm["load/cores"]) == \
        ("3", "packed", "1 × 1", "1.0/2")
    old = by_name["01-experiment-with-a-long-name-00"]  # a summary without the new fields
    assert [old[c] for c in ("seq", "batch", "accum", "data", "threads", "load/cores")] == ["-"] * 6

    # fixed width; bar charts one row per run, so taller than for 3 runs but not huge
    small = tmp_path / "small"
    assert report.main([str(runs_dir), "--out", str(small)]) == 0
    for name in report.PLOTS:
        assert_png(out / name)
        width, height = png_size(out / name)
        assert 800 <= width <= 1600 and height <= 2500, (name, width, height)
    for name in ("tokens_per_s.png", "step_time.png"):
        assert png_size(out / name)[1] > png_size(small / name)[1] + 400
        assert png_size(out / name)[0] == png_size(small / name)[0]

    # loss curves: at most 8 per panel, no colour/style pair repeated within a panel
    # 3 runs → 1 panel; 18 runs → 01 (5 runs), 02 (5), 03 and 04 (4 + 4): chapters not split
    assert [sorted({label[:2] for label, _, _ in curves}) for curves in panels[:3]] == \
        [["01"], ["02"], ["03", "04"]]
    assert len(panels) == 3 + 1 and sum(map(len, panels)) == 18 + 3
    for curves in panels:
        assert 0 < len(curves) <= report.CURVES_PER_PANEL
        assert len({(str(c), s) for _, c, s in curves}) == len(curves)
        assert len({str(c) for _, c, _ in curves}) == len(curves)


def test_archived_runs_on_request_are_labelled(many_runs, tmp_path, capsys):
    assert report.main([str(many_runs), "--include-archived", "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    cols, rows = header(printed), table_rows(printed)
    names = [r[cols.index("run")] for r in rows]
    assert len(rows) == 20 and "archived run(s)" not in printed
    archived = [n for n in names if "archived" in n]
    assert archived == ["03-experiment-with-a-long-name-02 (archived 20261122-010203)",
                        "04-experiment-with-a-long-name-03 (archived 20261122-010203)"]
    for n in archived:  # next to the current run of the same name
        assert names[names.index(n) - 1] == n.split(" (")[0]

    # an archive folder named directly is read without the flag
    archive = many_runs / "03-experiment-with-a-long-name-02" / "archive-20261122-010203"
    assert report.main([str(archive), "--out", str(tmp_path / "a")]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0][cols.index("run")].endswith("(archived 20261122-010203)")


def test_odd_but_harmless_inputs_do_not_stop_the_report(tmp_path):
    """A metrics step of 1e400 (JSON's infinity) is skipped, and notes written as one
    string (a hand-edited summary) are one note."""
    from tools.report import notes_section, read_loss_curve

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 1e400, "loss": 1.0}\n')
    assert [r["step"] for r in read_loss_curve(metrics)] == [1]

    class Run:
        name, summary = "r", {"notes": "one note"}
    assert notes_section([Run()]) == ["- r: one note"]


def test_broken_runs_beside_a_good_one_still_give_a_report(tmp_path, capsys):
    """Runs with an infinite tokens/s, a NaN step time, a binary metrics.jsonl, or a
    summary nested past the JSON parser's depth: each is skipped or read around with one
    warning line, and the report of the rest is written."""
    root = tmp_path / "runs"
    phases = {"data": 0.01, "forward": 0.1, "backward": 0.2, "update": 0.05}
    for name in ("good", "inf", "nan", "binary"):
        fake_run(root / name, "01-single-gpu", world=1, tokens=1024, phases=phases,
                 final_loss=2.5, losses=[3.0, float("nan"), 2.5])
    for name, key, value in (("inf", "tokens_per_s", float("inf")), ("nan", "step_time_s", None)):
        s = json.loads((root / name / "summary.json").read_text())
        if value is None:
            s[key]["forward"] = float("nan")
        else:
            s[key] = value
        (root / name / "summary.json").write_text(json.dumps(s))  # NaN and Infinity, as Python writes them
    (root / "binary" / "metrics.jsonl").write_bytes(bytes(range(256)) * 8)
    (root / "deep").mkdir()
    (root / "deep" / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    assert report.main([str(root), "--out", str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    rows = table_rows(captured.out)
    assert sorted(r[1] for r in rows) == ["binary", "good"]
    warnings = captured.err.splitlines()
    assert len(warnings) == 3 and all(w.startswith("warning: skipping") for w in warnings), warnings
    assert not any(w.startswith("Traceback") for w in warnings)
    for name in report.PLOTS:
        assert_png(tmp_path / "out" / name)


def test_an_out_folder_that_cannot_be_written_is_one_line(runs_dir, tmp_path, capsys, monkeypatch):
    """Under a file, or on a read-only file system: one line, exit 2, before any work."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert report.main([str(runs_dir), "--out", str(blocker / "report")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "is a file" in err, err

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr("common.cli.tempfile.mkstemp", read_only)
    assert report.main([str(runs_dir), "--out", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Read-only file system" in err, err
    assert not (tmp_path / "report").exists()


def test_busy_and_padded_runs_are_marked_in_the_plot_as_in_the_table(tmp_path, capsys):
    """A run on a busy machine carries the table's mark in the tokens/s plot too (not a
    bare bar that looks twice as fast), and a --padded run shows its real tokens/s."""
    root = tmp_path / "runs"
    phases = {"data": 0.01, "forward": 0.1, "backward": 0.2, "update": 0.05}
    fake_run(root / "quiet", "01-single-gpu", world=1, tokens=1024, phases=phases, final_loss=2.5,
             losses=[3.0], extra={"load_avg_max": 0.5, "cpu_cores": 2})
    fake_run(root / "busy-padded", "03-ddp", world=2, tokens=2048, phases=phases, final_loss=2.5,
             losses=[3.0], extra={"load_avg_max": 9.0, "cpu_cores": 2, "real_tokens_per_s": 1234.0})
    runs = report.load_runs(report.find_summaries([root]))
    by_name = dict(zip([r.name for r in runs], zip(report.row_labels(runs), report.tokens_labels(runs))))
    assert report.BUSY_MARK not in " ".join(by_name["quiet"])
    row, value = by_name["busy-padded"]
    assert row.endswith(report.BUSY_MARK) and report.BUSY_MARK in value and "(1,234 real)" in value
    assert report.main([str(root), "--out", str(tmp_path / "out")]) == 0
    cols = header(capsys.readouterr().out)
    assert "real tokens/s" in cols
    assert_png(tmp_path / "out" / "tokens_per_s.png")


def test_a_quoted_tilde_in_out_is_the_home_folder(runs_dir, tmp_path, monkeypatch, capsys):
    """--out '~/report' (quoted) means the home folder, as --save-dir does, not a folder
    named '~' in the current one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert report.main([str(runs_dir), "--out", "~/report"]) == 0
    assert (tmp_path / "report" / "report.md").is_file() and not (tmp_path / "~").exists()


def test_a_full_disk_leaves_the_previous_report_whole(runs_dir, small_disk, capsys):
    """Writing the report again into a folder whose disk has filled: one line (exit
    status 1), and every file of the previous report is still whole (each is written
    beside its target and renamed over it), with no half-written copy beside it."""
    out = small_disk(2 << 20)
    assert report.main([str(runs_dir), "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    free = shutil.disk_usage(out).free
    (out / "filler").write_bytes(b"\0" * (free - 4096))
    capsys.readouterr()
    assert report.main([str(runs_dir), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: writing the report into {out} failed"), err
    (out / "filler").unlink()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_runs_without_speeds_by_design_are_left_out_with_a_note(runs_dir, tmp_path, capsys):
    """A chapter 04 run whose training ended in an earlier process, and a run that
    diverged, write summaries without speeds on purpose: the report leaves them out with
    a note that says why, not a warning that calls them corrupt."""
    for name, summary in [("finished-later", {"chapter": "04-checkpointing", "experiment_name": "x",
                                              "notes": ["training ended in an earlier process"]}),
                          ("diverged", {"chapter": "01-single-gpu", "diverged_at_step": 7, "loss": "nan",
                                        "steps": 7, "tokens_per_s": 1.0})]:
        (runs_dir / "d" / name).mkdir(parents=True)
        write_json(runs_dir / "d" / name / "summary.json", summary)
    assert report.main([str(runs_dir), "--out", str(tmp_path / "r")]) == 0
    captured = capsys.readouterr()
    assert len(table_rows(captured.out)) == 3
    notes = sorted(captured.err.splitlines())
    assert len(notes) == 2 and all(n.startswith("note: leaving out ") for n in notes), notes
    assert "(the run diverged at step 7)" in notes[0] and "(training ended in an earlier process)" in notes[1]


def test_a_report_md_this_command_did_not_write_is_never_replaced(runs_dir, tmp_path, capsys):
    """A user's own report.md, in --out or in the run folder that is the default --out:
    one line, exit 2, before any work; the file and the folder are as they were. A
    report.md the command wrote is replaced."""
    mine = runs_dir / "a" / "01-single"
    (mine / "report.md").write_text("my notes on this run\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("")  # an empty file is not a report either
    for argv, md in (([str(mine)], mine / "report.md"), ([str(runs_dir), "--out", str(out)], out / "report.md")):
        before = sorted(p.name for p in md.parent.iterdir())
        assert report.main(argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.splitlines() == [
            f"error: {str(md)!r} exists and was not written by this command (its first line is not "
            f"'# Run comparison'); move it, or choose another --out"]
        assert sorted(p.name for p in md.parent.iterdir()) == before
    assert (mine / "report.md").read_text() == "my notes on this run\n"
    ours = tmp_path / "ours"
    assert report.main([str(runs_dir), "--out", str(ours)]) == 0
    assert report.main([str(runs_dir / "a"), "--out", str(ours)]) == 0  # its own: replaced
    assert len(table_rows((ours / "report.md").read_text())) == 2


def test_a_fifo_named_summary_json_is_never_opened(runs_dir):
    """Opening a FIFO blocks until someone writes into it: a summary.json that is not a
    regular file is left out with one warning line, and the report of the others is
    written (a process of its own, so that a regression fails on the timeout)."""
    fifo = runs_dir / "c" / "pipe" / "summary.json"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    proc = run_warm([sys.executable, "-m", "tools.report", runs_dir, "--out", runs_dir / "r"], timeout=120)
    assert len(table_rows(proc.stdout)) == 3
    assert proc.stderr.splitlines() == [f"warning: skipping {fifo}: not a regular file, not opened"]
