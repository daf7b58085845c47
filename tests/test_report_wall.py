"""`python -m tools.report`, what a user meets: every step time is the wall time, the
waits shown as a part of it; a user's own images are never replaced; a value no float
holds is a skipped line, not a traceback."""

from __future__ import annotations

import json

import pytest

from tools import report
from common.metrics import throughput_table
from test_report import fake_run, header, table_rows

PHASES_MS = {"data": 0.01, "forward": 0.1, "backward": 0.2, "update": 0.05}  # 360 ms in phases


def pipeline_run(folder):
    """A run whose steps took 662.5 ms of wall time, 360 of them in timed phases: the
    rest waited for the pipeline's other stage (chapter 06's bubble)."""
    s = fake_run(folder, "06-model-parallel", world=2, tokens=1024, phases=PHASES_MS,
                 final_loss=2.5, losses=[3.0, 2.5])
    s["step_wall_s"] = 0.6625
    (folder / "summary.json").write_text(json.dumps(s))
    return s


def test_every_step_time_is_the_wall_time_with_its_waits_as_a_part(tmp_path, capsys):
    s = pipeline_run(tmp_path / "runs" / "06")
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "r")]) == 0
    printed = capsys.readouterr().out
    row = dict(zip(header(printed), table_rows(printed)[0]))
    assert (row["data ms"], row["forward ms"], row["backward ms"], row["update ms"],
            row["other ms"], row["step ms"]) == ("10.0", "100.0", "200.0", "50.0", "302.5", "662.5")
    assert report.step_parts_s(s) == pytest.approx({**PHASES_MS, "other": 0.3025})
    # the run's own table says the same
    rows = {cells[1].strip(): cells[2].strip() for cells in
            (line.split("|") for line in throughput_table(s).splitlines())}
    assert rows["step time (ms, wall)"] == "662.5 = phases 360.0 (an estimate) + other 302.5"
    assert rows["other"] == "302.5 ms (45.7%): waiting for other ranks or stages, untimed work"
    # a GPU's device-time phases can add up to a little more than the wall: no negative part
    assert report.step_parts_s({**s, "step_wall_s": 0.35})["other"] == 0.0


def test_a_user_s_own_images_are_never_replaced(tmp_path, capsys):
    """A run folder (the default --out of `tools.report RUN_DIR`) holding a user's own
    loss.png or step_time.png: refused with one line, nothing written; the plots the
    command wrote itself are replaced on the next report."""
    run_dir = tmp_path / "06"
    pipeline_run(run_dir)
    for name in ("loss.png", "step_time.png"):
        mine = run_dir / name
        mine.write_bytes(b"\x89PNG\r\n\x1a\nmy own plot")
        before = sorted(p.name for p in run_dir.iterdir())
        assert report.main([str(run_dir)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.splitlines() == [
            f"error: {str(mine)!r} exists and was not written by this command (its PNG has no Source "
            f"note 'python -m tools.report'); move it, or choose another --out"]
        assert sorted(p.name for p in run_dir.iterdir()) == before
        assert mine.read_bytes() == b"\x89PNG\r\n\x1a\nmy own plot"
        mine.unlink()
    assert report.main([str(run_dir)]) == 0
    assert report.main([str(run_dir)]) == 0  # its own plots and report: replaced
    assert all(report.written_here(run_dir / name) for name in ("report.md", *report.PLOTS))


def test_a_number_no_float_holds_is_skipped_not_a_traceback(tmp_path, capsys):
    """A metrics line or a summary value that is an integer of 400 digits (valid JSON)
    raised OverflowError: the line is skipped, the run left out with one warning."""
    runs = tmp_path / "runs"
    pipeline_run(runs / "good")
    with open(runs / "good" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 10 ** 400}) + "\n")
        f.write('{"step": 4, "loss": 1' + "0" * 400 + "}\n")
        f.write(json.dumps({"step": 10 ** 400, "loss": 2.0}) + "\n")
    for key in ("tokens_per_s", "peak_memory_mb", "mfu"):
        s = pipeline_run(runs / key)
        s[key] = 10 ** 400
        (runs / key / "summary.json").write_text(json.dumps(s))
    assert report.main([str(runs), "--out", str(tmp_path / "r")]) == 0
    captured = capsys.readouterr()
    assert len(table_rows(captured.out)) == 1
    warnings = captured.err.splitlines()
    assert len(warnings) == 3 and all(w.startswith("warning: skipping") for w in warnings), warnings
    assert [m["step"] for m in report.read_loss_curve(runs / "good" / "metrics.jsonl")] == [1, 2]
