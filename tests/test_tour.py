"""`python -m tools.tour`: the plan (every chapter, in order, launched as its README
says), flag validation before any work, failure reporting, and a real short tour that
ends with the comparison report."""

from __future__ import annotations

import json
import socket
import sys
import time

import pytest

from tools import report, tour
from tools.chapters import CHAPTERS
from common.errors import UsageError
from conftest import REPO, run, run_folder_held, run_warm

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CH05 = ["05-collectives-demo", "05-bench", "05-ddp-from-scratch", "05-sharded-from-scratch", "05-overlap-timeline"]
# every command of the tour, in order: one per chapter, chapter 05's five scripts
NAMES = [n for c in CHAPTERS for n in (CH05 if c.folder == "05-collectives" else [c.folder])]
UNKNOWN = "42"  # a chapter number no folder has


def plan_for(tmp_path, *flags, gpus=0):
    return tour.build_plan(tour.parse_args([*flags, "--out", str(tmp_path / "t")], gpus=gpus))


def flag(step, name):
    return step.argv[step.argv.index(name) + 1]


def test_plan_runs_every_chapter_in_order_as_the_readmes_launch_them(tmp_path):
    plan = plan_for(tmp_path)
    assert list(dict.fromkeys(s.chapter for s in plan)) == [c.folder for c in CHAPTERS]
    assert [s.name for s in plan] == NAMES
    by_name = {s.name: s for s in plan}
    for name in ("01-single-gpu", "02-data-parallel"):
        assert by_name[name].display.startswith(f"python {name}/train_llm.py ")
        assert by_name[name].argv[:2] == [sys.executable, f"{name}/train_llm.py"]
    for s in plan[2:]:
        # CPU default: two processes; executed via python -m, shown as torchrun
        assert s.display.startswith("torchrun --standalone --nproc-per-node=2 ")
        assert s.argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
        assert s.env == {}
    ck = by_name["04-checkpointing"]
    assert "--max-restarts=3" in ck.argv
    freq, crash = int(flag(ck, "--ckpt-freq")), int(flag(ck, "--crash-at-step"))
    assert (freq, crash) == (6, 9)                     # between the 1st and 2nd checkpoint
    assert int(flag(ck, "--max-steps")) == 20
    assert flag(by_name["06-model-parallel"], "--pp") == "2"  # its line's tour flags
    # one per-process batch and one run folder for every chapter; each run its own name
    train = [s for s in plan if s.chapter != "05-collectives"]
    assert {flag(s, "--batch-size") for s in train} == {"8"}
    assert {flag(s, "--save-dir") for s in plan if "--save-dir" in s.argv} == {str(tmp_path / "t")}
    assert [flag(s, "--experiment-name") for s in train] == [s.name for s in train]
    assert all(flag(s, "--dataset-name") == "stdlib" for s in train)
    # on CPU the overlap timeline traces four modes of the eight, on GPUs all of them
    assert flag(by_name["05-overlap-timeline"], "--modes") == "naive,ddp,ch03-ddp,fsdp2"
    assert "--modes" not in {s.name: s for s in plan_for(tmp_path, gpus=2)}["05-overlap-timeline"].argv


def test_plan_sizes_follow_the_hardware(tmp_path):
    eight = plan_for(tmp_path, gpus=8)
    assert flag(eight[0], "--model-preset") == "base" and flag(eight[0], "--seq-length") == "1024"
    assert all("--nproc-per-node=8" in s.display for s in eight[2:])
    # one GPU: 03/04 run one process; 05 needs two, and 06 a multiple of its --pp 2, so
    # they run two CPU processes (gloo) at the CPU sizes, and say so
    one = plan_for(tmp_path, gpus=1)
    by_name = {s.name: s for s in one}
    assert "--nproc-per-node=1" in by_name["03-ddp"].display
    for s in [by_name[n] for n in (*CH05, "06-model-parallel")]:
        assert s.env == {"CUDA_VISIBLE_DEVICES": ""} and "--nproc-per-node=2" in s.display
        assert s.display.startswith("CUDA_VISIBLE_DEVICES= torchrun") and "gloo" in s.note
    assert flag(by_name["06-model-parallel"], "--model-preset") == "small"
    assert "--pp 2 needs a multiple of 2 processes" in by_name["06-model-parallel"].note
    # the reader's choices win
    mine = plan_for(tmp_path, "--preset", "tiny", "--steps", "9", "--seq-length", "32",
                    "--batch-size", "3", "--nproc", "4")
    assert [flag(mine[0], f) for f in ("--model-preset", "--max-steps", "--seq-length", "--batch-size")] \
        == ["tiny", "9", "32", "3"]
    assert "--nproc-per-node=4" in mine[2].display
    assert (flag(mine[3], "--ckpt-freq"), flag(mine[3], "--crash-at-step")) == ("3", "4")


def test_chapter_selection(tmp_path):
    plan = plan_for(tmp_path, "--chapters", "03,1")      # any order, with or without 0
    assert [s.name for s in plan] == ["01-single-gpu", "03-ddp"]
    plan = plan_for(tmp_path, "--chapters", "05-collectives")
    assert {s.chapter for s in plan} == {"05-collectives"} and len(plan) == 5
    with pytest.raises(UsageError, match=f"unknown chapter '{UNKNOWN}'"):
        tour.parse_args(["--chapters", f"01,{UNKNOWN}"], gpus=0)
    with pytest.raises(UsageError, match="only 2 GPU"):
        tour.parse_args(["--nproc", "4"], gpus=2)


@pytest.mark.parametrize("flags, message", [
    (["--chapters", f"01,{UNKNOWN}"], "unknown chapter"),
    # chapter 06 runs with --pp 2: three processes cannot all take it (it ran 01 first)
    (["--nproc", "3", "--chapters", "01,06"], "--nproc-per-node 3: the tour runs chapter "
                                              "06-model-parallel with --pp 2, so its world size must be a multiple of 2"),
    (["--chapters", ","], "at least one chapter"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),   # the chapters' flag names,
    (["--chapters", "04", "--steps", "2"], "chapter 04 needs at least 3"),  # and short aliases
    (["--model-preset", "huge"], "argument --model-preset/--preset: unknown 'huge'; choose one of: tiny"),
    (["--preset", "tiny", "--seq-length", "4096"], "exceeds"),
    (["--bogus"], "unrecognized arguments"),
    (["--nproc-per-node", "1000"], "--nproc-per-node 1000: "),  # more processes than cores (or GPUs)
    (["--nproc", "0"], "--nproc-per-node must be at least 1"),
])
def test_bad_flags_exit_2_with_one_line_before_any_work(tmp_path, capsys, flags, message):
    out = tmp_path / "never"
    try:  # in-process (fast); argparse's own errors exit through SystemExit
        code = tour.main([*flags, "--out", str(out)])
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1
    assert message in captured.err
    assert not out.exists()



def test_an_out_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert tour.main(["--out", str(blocker / "tour")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "is a file" in err, err

    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr("common.cli.tempfile.mkstemp", read_only)
    assert tour.main(["--out", str(tmp_path / "tour")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "Read-only file system" in captured.err and not (tmp_path / "tour").exists()

def test_bad_flag_from_the_command_line(tmp_path):
    proc = run_warm([sys.executable, "-m", "tools.tour", "--chapters", f"01,{UNKNOWN}"], check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"error: --chapters: unknown chapter '{UNKNOWN}'; choose from "
        f"{', '.join(c.number for c in CHAPTERS)} (or the folder names)"]


def test_non_empty_out_is_refused_and_dry_run_runs_nothing(tmp_path, capsys):
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    assert tour.main(["--out", str(used)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in used.iterdir()] == ["keep.txt"]

    fresh = tmp_path / "fresh"
    proc = run_warm([sys.executable, "-m", "tools.tour", "--dry-run", "--out", fresh])
    lines = [l for l in proc.stdout.splitlines() if l.startswith("[")]
    n = len(CHAPTERS)
    assert len(lines) == len(NAMES)  # a line per chapter, chapter 05's five scripts each
    assert lines[0].startswith(f"[1/{n}] 01-single-gpu: python 01-single-gpu/train_llm.py")
    assert lines[3].startswith(f"[4/{n}] 04-checkpointing: torchrun --standalone "
                               "--nproc-per-node=2 --max-restarts=3 04-checkpointing/train_llm.py")
    assert "--crash-at-step 9" in lines[3]
    assert all(l.startswith(f"[5/{n}] 05-collectives: torchrun") for l in lines[4:9])
    assert lines[9].startswith(f"[6/{n}] 06-model-parallel: torchrun --standalone --nproc-per-node=2 "
                               "06-model-parallel/train_llm.py") and "--pp 2" in lines[9]
    assert not fresh.exists()


def test_tours_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch, capsys):
    """The default folder is named by the second: a tour that finds it taken (at parse
    time, or created by another tour after that) takes the next free name, -2, -3, ...,
    and never writes into the other's."""
    monkeypatch.setattr(tour, "DEFAULT_SAVE_DIR", tmp_path)
    monkeypatch.setattr(tour.time, "strftime", lambda fmt: "20990101-000000")
    first = tmp_path / "tour-20990101-000000"
    first.mkdir()
    (first / "01-single-gpu.log").write_text("the other tour's")
    assert tour.parse_args([]).out_dir == tmp_path / "tour-20990101-000000-2"

    plans = []

    def plan_of_a_tour_that_loses_the_race(args):
        if not plans:  # another tour creates this name between parse_args and mkdir
            args.out_dir.mkdir()
        plans.append(args.out_dir)
        return [tour.Step("01-single-gpu", "01-single-gpu", [sys.executable, "-c", "pass"], "python -c pass")]

    monkeypatch.setattr(tour, "build_plan", plan_of_a_tour_that_loses_the_race)
    assert tour.main(["--chapters", "01", "--quiet"]) == 0
    assert plans == [tmp_path / "tour-20990101-000000-2", tmp_path / "tour-20990101-000000-3"]
    assert (tmp_path / "tour-20990101-000000-3" / "01-single-gpu.log").exists()
    assert not any((tmp_path / "tour-20990101-000000-2").iterdir())
    assert (first / "01-single-gpu.log").read_text() == "the other tour's"


def test_two_tours_given_the_same_out_never_write_there_both(tmp_path, monkeypatch, capsys):
    """An --out named twice at once: each found it empty when it parsed its flags. The
    tour folder is claimed as a chapter's run folder is: the tour that comes second finds
    it locked (the first holds it while it runs), or no longer empty (the first wrote
    there and ended): one line, exit 2, nothing written."""
    out = tmp_path / "tour"
    out.mkdir()
    ran = []
    monkeypatch.setattr(tour, "run_step", lambda *a: ran.append(a) or 0)
    with run_folder_held(out) as holder:  # the first tour, in another process
        with pytest.raises(SystemExit) as stop:
            tour.main(["--chapters", "01", "--out", str(out), "--quiet"])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"error: run folder '{out}' is in use by pid {holder.pid} on {socket.gethostname()}, "
                       f"since {err.split('since ')[1].split(';')[0]}; wait for it to end or choose another --out")
    real_plan = tour.build_plan

    def plan_while_the_first_writes(args):  # the first tour wrote its log, then ended
        (out / "01-single-gpu.log").write_text("the first tour's")
        return real_plan(args)

    monkeypatch.setattr(tour, "build_plan", plan_while_the_first_writes)
    with pytest.raises(SystemExit) as stop:
        tour.main(["--chapters", "01", "--out", str(out), "--quiet"])
    assert stop.value.code == 2
    assert "already exists and is not empty; choose another --out" in capsys.readouterr().err
    assert not ran and (out / "01-single-gpu.log").read_text() == "the first tour's"


def test_failing_chapter_stops_the_tour_and_says_where(tmp_path, monkeypatch, capsys):
    """A failure names the chapter, its exit status, the command and its log, and later
    chapters do not run."""
    ok, bad = tmp_path / "ok.py", tmp_path / "bad.py"
    ok.write_text("print('first chapter ran')\n")
    bad.write_text("import sys\nprint('about to fail')\nsys.exit(3)\n")

    def fake_plan(args):
        return [tour.Step("01-single-gpu", "01-single-gpu", [sys.executable, str(ok)], "python ok.py"),
                tour.Step("02-data-parallel", "02-data-parallel", [sys.executable, str(bad)], "python bad.py"),
                tour.Step("03-ddp", "03-ddp", [sys.executable, str(ok)], "python ok.py")]

    monkeypatch.setattr(tour, "build_plan", fake_plan)
    out = tmp_path / "tour"
    assert tour.main(["--chapters", "01,02,03", "--out", str(out)]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[2].startswith("[1/3] 01-single-gpu: running ... done in ") and \
        lines[2].endswith("; 01-single-gpu.log")
    assert lines[3:] == ["[2/3] 02-data-parallel: running ... FAILED"]
    assert "first chapter ran" not in captured.out          # one line per chapter: the log has it
    assert "first chapter ran" in (out / "01-single-gpu.log").read_text()
    err = captured.err
    assert "chapter 02-data-parallel failed with exit status 3" in err
    assert "command: python bad.py" in err and "02-data-parallel.log" in err
    assert "about to fail" in err                            # the log's tail
    assert "about to fail" in (out / "02-data-parallel.log").read_text()
    assert not (out / "03-ddp.log").exists()



def test_a_failing_chapter_s_own_error_line_is_shown(tmp_path, monkeypatch, capsys):
    """Under torchrun the chapter's cause (its `error: ...` line) is followed by the
    launcher's own traceback, which does not say it: the tour's failure names it."""
    monkeypatch.setattr(tour, "build_plan", lambda args: [tour.Step(
        "03-ddp", "03-ddp", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=1", "03-ddp/train_llm.py", "--model-preset", "tiny",
                             "--seq-length", "100000"], "torchrun ... 03-ddp/train_llm.py")])
    out = tmp_path / "tour"
    assert tour.main(["--chapters", "03", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    said = next(i for i, line in enumerate(err) if line.startswith("error: chapter"))  # after the log's tail
    assert err[said].startswith("error: chapter 03-ddp failed with exit status 1 after ") and \
        err[said].endswith("; it said:"), err
    assert err[said + 1] == "  error: --seq-length 100000 exceeds the 'tiny' preset's max_position_embeddings=256"
    assert "ChildFailedError" in (out / "03-ddp.log").read_text()  # torchrun's report came after it


def scaling_runs(folder, load_01: float):
    """A tour's chapter 01 run, on a machine under `load_01`, and its chapter 03 run, on an
    idle one, each process as fast as chapter 01's one."""
    from test_report import fake_run
    phases = {"data": 0.01, "forward": 0.1, "backward": 0.2, "update": 0.05}
    for chapter, world, extra in (("01-single-gpu", 1, {"load_avg_max": load_01}),
                                  ("03-ddp", 2, {"load_avg_max": 1.0})):
        fake_run(folder / chapter, chapter, world=world, tokens=1024 * world, phases=phases,
                 final_loss=2.5, losses=[3.0], extra={"cpu_cores": 2, **extra})
    return report.load_runs(report.find_summaries([folder]))


def test_a_scaling_efficiency_from_a_busy_machine_is_not_printed(tmp_path, capsys):
    """One run of the comparison on a busy machine: the scaling efficiency is n/a, and
    the lines say which run and why; with every run on an idle machine, the figure."""
    args = tour.parse_args(["--out", str(tmp_path / "unused")], gpus=0)
    args.out_dir = tmp_path / "busy"
    scaling_runs(args.out_dir, load_01=9.0)
    tour.print_summary(args, [], time.perf_counter())
    printed = capsys.readouterr().out
    assert "100.0%" not in printed and "100.0%" not in (args.out_dir / "report.md").read_text()
    assert ("Scaling efficiency: n/a. The machine was busy during 01-single-gpu (load average up to "
            "9.0 on 2 cores): a busy machine slows") in printed
    assert tour.scaling(scaling_runs(tmp_path / "idle", load_01=1.5)) == (
        "Scaling efficiency (tokens/s per process over chapter 01's tokens/s): 03-ddp 100.0%.")


def test_the_terminal_gets_a_narrow_table_and_report_md_gets_everything(tmp_path, capsys):
    """The end of a tour, in this process, over a folder as a tour leaves it: the terminal
    shows tokens/s and loss in lines a terminal fits, then, last, where the report, the
    plots and the logs are; report.md holds the wide table, the explanations printed,
    chapter 05's tables (not printed: they were 150 lines after the comparison) and every
    file produced."""
    from test_report import fake_run
    args = tour.parse_args(["--out", str(tmp_path / "unused")], gpus=0)
    out = args.out_dir = tmp_path / "tour"
    phases = {"data": 0.01, "forward": 0.1, "backward": 0.2, "update": 0.05}
    for chapter, world in (("01-single-gpu", 1), ("03-ddp", 2), ("04-checkpointing", 2)):
        fake_run(out / chapter, chapter, world=world, tokens=1024 * world, phases=phases,
                 final_loss=2.5, losses=[3.0, 2.5], extra={"notes": [f"a note of {chapter}"]})
        (out / f"{chapter}.log").write_text("log\n")
    (out / "04-checkpointing" / "checkpoints" / "step-00000010").mkdir(parents=True)
    (out / "04-checkpointing" / "checkpoints" / "step-00000010" / "state.pt").write_bytes(b"x")
    for name, text in (("05-bench", "| size | all_reduce |"), ("05-sharded-from-scratch", "| mode | params MiB |")):
        (out / name).mkdir()
        (out / name / "tables.md").write_text(text + "\n")  # what a chapter's script leaves for the report
    steps = [tour.Step(c, c, [], "") for c in ("01-single-gpu", "03-ddp", "04-checkpointing")]
    tour.print_summary(args, steps, time.perf_counter())
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    ours = [l for l in lines if l.startswith("| ")]
    assert len(ours) == 2 + 3 and max(map(len, ours)) <= 100, ours
    # the comparison, its notes, then the paths: the terminal's last lines
    notes = lines.index("notes:")
    assert lines.index(ours[-1]) == notes - 2 and lines[notes + 1:notes + 4] == [
        f"{i}. a note of {c}" for i, c in enumerate(("01-single-gpu", "03-ddp", "04-checkpointing"), 1)]
    assert lines[-3].startswith(f"report (every column, chapter 05's 2 tables, the list of all ") and \
        lines[-3].endswith(f" files): {out / 'report.md'}")
    assert lines[-2] == f"plots: {', '.join(str(out / n) for n in report.PLOTS)}"
    assert lines[-1] == (f"logs: {out}/<name>.log, one per command (01-single-gpu.log, 03-ddp.log, "
                         f"04-checkpointing.log)")
    assert "tokens/s" in ours[0] and "final loss" in ours[0] and "notes" in ours[0]
    assert "1. a note of 01-single-gpu" in printed
    md = (out / "report.md").read_text()
    wide = next(l for l in md.splitlines() if l.startswith("| chapter"))
    assert "MFU" in wide and "peak memory" in wide                 # every column
    assert "Batch sizes: every process ran" in md and "On CPU the 2 processes" in md
    assert "Batch sizes: every process ran" in printed
    for name in ("05-bench", "05-sharded-from-scratch"):
        assert f"## {name}" in md
    assert "| mode | params MiB |" in md and "| size | all_reduce |" in md
    assert "| size | all_reduce |" not in printed
    for f in out.rglob("*"):
        if f.is_file():
            assert f"`{f.relative_to(out)}`" in md, f

@pytest.mark.launch
def test_short_real_tour(tmp_path):
    """Two chapters run for real, one launched with python and one with torchrun (tiny
    sizes, 2 steps), as a reader runs the tour: one line per chapter while it runs, the
    chapters' output in their logs, and at the end the comparison, then where the report,
    the plots and the logs are, last. Chapter 05's five scripts, each a torchrun job of its
    own, are not run here: the tests of each script check the tables.md it leaves, and
    test_the_terminal_gets_a_narrow_table_and_report_md_gets_everything the report around
    them."""
    out = tmp_path / "tour"
    proc = run([sys.executable, "-m", "tools.tour", "--chapters", "01,03",
                "--preset", "tiny", "--steps", "2", "--seq-length", "32", "--batch-size", "2",
                "--out", out], timeout=240)
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("[1/2] 01-single-gpu: running ... done in ") and "(tour at " in lines[2]
    assert lines[3].startswith("[2/2] 03-ddp: running ... done in ") and lines[3].endswith("; 03-ddp.log")
    assert lines[5].startswith("tour finished in ") and lines[5].endswith(" CPU-seconds)")
    assert "step 2/2" not in proc.stdout  # the chapters' output is in their logs
    table = [i for i, line in enumerate(lines) if line.startswith("| ")]
    assert len(table) == 2 + 2 and table[-1] < len(lines) - 3
    assert lines[-3].startswith("report (every column, the list of all ") and lines[-3].endswith("report.md")
    assert lines[-2].startswith("plots: ") and lines[-1].startswith("logs: ")
    logs = {name: (out / f"{name}.log").read_text() for name in ("01-single-gpu", "03-ddp")}
    assert logs["01-single-gpu"].startswith("$ python 01-single-gpu/train_llm.py")  # the command, as typed
    assert logs["03-ddp"].startswith("$ torchrun --standalone --nproc-per-node=2 03-ddp/train_llm.py")
    assert all("step 2/2" in log for log in logs.values())
    report_md = (out / "report.md").read_text()
    for chapter in ("01-single-gpu", "03-ddp"):
        rows = [l for l in report_md.splitlines() if l.startswith(f"| {chapter}")]
        assert len(rows) == 1 and "CPU" in rows[0], report_md
        assert f"`{chapter}.log`" in report_md
    for name in ("tokens_per_s.png", "step_time.png", "loss.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000
    recorded = json.loads((out / "tour.json").read_text())
    assert recorded["cpu_seconds"] > 0 and recorded["seconds"] > 0


def test_a_running_command_s_live_line_and_verbose_output(tmp_path, capfd):
    """While a command runs, the tour is called back about once a second (the live line a
    terminal rewrites in place); --verbose shows the command's output as it comes, the
    default only keeps it in the log."""
    step = tour.Step("01-single-gpu", "x", [sys.executable, "-c", "import time; print('out', flush=True); "
                                                                    "time.sleep(2.5)"], "python x")
    seconds = []
    assert tour.run_step(step, tmp_path / "quiet.log", stream=False, progress=seconds.append) == 0
    assert len(seconds) >= 2 and seconds == sorted(seconds) and seconds[-1] >= 2
    assert "out" not in capfd.readouterr().out and "out" in (tmp_path / "quiet.log").read_text()
    assert tour.run_step(step, tmp_path / "verbose.log", stream=True) == 0
    assert capfd.readouterr().out == "out\n"


@pytest.mark.launch
def test_a_chapter_added_to_the_list_is_in_the_tour_and_the_readme_checks(tmp_path):
    """A new chapter is its folder and one line in tools/chapters.py: in a copy of the
    repository with a throwaway chapter 99 (chapter 03's script, a README), the tour plans
    it and the README tests collect it, with no other change."""
    import shutil
    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", "outputs", "__pycache__", "*.egg-info"))
    (copy / "99-throwaway").mkdir()
    shutil.copy(copy / "03-ddp" / "train_llm.py", copy / "99-throwaway" / "train_llm.py")
    (copy / "99-throwaway" / "README.md").write_text("# 99\n")
    chapters = copy / "tools" / "chapters.py"
    chapters.write_text(chapters.read_text().replace(
        "\n)\nBY_FOLDER", '\n    Chapter("99-throwaway", "torchrun", "03-ddp", 0),\n)\nBY_FOLDER'))
    env = {"PYTHONPATH": str(copy)}
    plan = run([sys.executable, "-m", "tools.tour", "--dry-run", "--chapters", "99"], cwd=copy, env=env).stdout
    assert "torchrun --standalone --nproc-per-node=2 99-throwaway/train_llm.py" in plan
    collected = run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                     "tests/test_readmes.py", "tests/test_lessons.py"], cwd=copy, env=env).stdout
    assert "99-throwaway" in collected


def test_a_quoted_tilde_in_out_is_the_home_folder(tmp_path, monkeypatch):
    """--out '~/tour' (quoted, so the shell left it alone) means the home folder, as
    --save-dir does: the tour wrote into a folder named '~' in the current one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    args = tour.parse_args(["--out", "~/tour", "--chapters", "01"], gpus=0)
    assert args.out_dir == tmp_path / "tour" and not (tmp_path / "~").exists()
