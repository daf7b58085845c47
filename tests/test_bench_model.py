"""The benchmark's training step trains, and the benchmark reports MFU against the
device's peak. (Speed is a benchmark figure, printed by `python -m tools.bench_model`,
never asserted here. That torch.compile trains what eager trains is proven once, on the
path users run: test_ch01_single.py's --compile test, whose compiled function is, like
the benchmark's, the model and the loss as one graph.)"""

from __future__ import annotations

import errno
import os
import json
import sys
from pathlib import Path

import pytest
import torch

from tools.bench_model import loss_of, main, make_optimizer, train_step
from conftest import run_warm
from common.files import write_json
from common.model import LlamaForCausalLM, get_config

VOCAB = 97


def training_losses(loss_fn, steps: int = 20) -> list[float]:
    """`steps` training steps of the tiny preset on one fixed batch, from a fixed init."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(get_config("tiny", VOCAB))
    optimizer = make_optimizer(model, torch.device("cpu"))
    ids = torch.randint(0, VOCAB, (4, 65), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    return [train_step(loss_fn, model, optimizer, x, y).item() for _ in range(steps)]


def test_the_benchmarked_training_step_trains():
    """The step the benchmark times (loss_of, train_step, its optimizer) is a real
    training step: 20 of them on one batch move the loss down by more than 0.5, and the
    same seed gives the same losses."""
    eager = training_losses(loss_of)
    assert eager[-1] < eager[0] - 0.5
    assert training_losses(loss_of, steps=3) == eager[:3]


def test_benchmark_reports_mfu_against_the_measured_peak(capsys, tmp_path):
    """The table and its --json file hold the same rows; on a CPU no peak memory per step
    (the allocator's peak is CUDA's)."""
    main(["--presets", "tiny", "--seq-length", "32", "--batch-size", "2", "--iters", "1",
          "--warmup", "0", "--no-compile", "--device", "cpu", "--json", str(tmp_path / "bench.json")])
    out = capsys.readouterr().out
    assert "MFU against" in out and "(measured fp32 matmul peak)" in out
    assert "torch.compile took" not in out   # --no-compile: no compile, no compiled rows
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| tiny")]
    # preset, params, batch×seq, mode, step, median step, tokens/s, model FLOP/s, MFU, vs eager
    assert [(r[3], r[4]) for r in rows] == [("eager", "forward+backward"), ("eager", "training step")]
    for r in rows:
        assert r[7].endswith("FLOP/s") and r[8].endswith("%") and float(r[8][:-1]) > 0
        assert r[9] == "1.00x" and r[10] == "-"
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert (saved["device"], saved["dtype"], saved["peak_source"]) == ("cpu", "fp32", "measured")
    assert saved["torch_version"] == torch.__version__ and saved["compile_s"] == {}
    assert [(r["mode"], r["step"]) for r in saved["rows"]] == [(r[3], r[4]) for r in rows]
    for row, shown in zip(saved["rows"], rows):
        assert f"{100 * row['mfu']:.1f}%" == shown[8] and row["peak_memory_mb"] is None


def test_a_json_path_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """--json naming a folder, or a file in a read-only place: one line and exit 2 before
    the benchmark runs (it used to fail only after it, with two tracebacks)."""
    def refused(json_path) -> str:
        with pytest.raises(SystemExit) as stop:
            main(["--presets", "tiny", "--seq-length", "32", "--batch-size", "2", "--iters", "1",
                  "--warmup", "0", "--no-compile", "--device", "cpu", "--json", str(json_path)])
        out, err = capsys.readouterr()
        assert stop.value.code == 2 and out == "", out  # nothing measured
        assert len(err.splitlines()) == 1, err
        return err.strip()

    assert refused(tmp_path) == f"error: --json {str(tmp_path)!r} is a folder; name a file in it"

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr("common.cli.tempfile.mkstemp", read_only)
    line = refused(tmp_path / "bench.json")
    assert line.startswith("error: --json ") and line.endswith("(Read-only file system)"), line
    assert not list(tmp_path.iterdir())


def test_a_failed_write_is_not_hidden_by_its_cleanup(tmp_path, monkeypatch):
    """When writing a JSON file fails and removing the half-written copy fails too (a
    read-only place), the error raised is the write's, alone."""
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(os, "fsync", no_space)  # the copy's bytes do not reach the disk
    monkeypatch.setattr(Path, "unlink", read_only)
    with pytest.raises(OSError) as raised:
        write_json(tmp_path / "bench.json", {"rows": []})
    assert raised.value.errno == errno.ENOSPC and raised.value.__context__ is None


def test_running_out_of_memory_is_one_line():
    """A vocabulary or a batch too large for the machine (here its memory limited, as
    clusters limit it with ulimit -v) was a traceback: one line naming the flags to lower,
    exit status 1, as the chapters end."""
    code = """
import resource, runpy, sys
size = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (2 << 30), size + (2 << 30)))
sys.argv = ["bench_model", "--presets", "tiny", "--no-compile", "--device", "cpu", *sys.argv[1:]]
runpy.run_module("tools.bench_model", run_name="__main__")
"""
    for flags, tried in ((["--vocab-size", "4000000000"], 1024000000000), (["--batch-size", "100000000"], 205600000000)):
        proc = run_warm([sys.executable, "-c", code, *flags], check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
        assert proc.stderr.startswith("error: out of memory (") and f"you tried to allocate {tried} bytes" in \
            proc.stderr and proc.stderr.endswith(": try a smaller --batch-size, --seq-length, --vocab-size or "
                                                 "preset\n"), proc.stderr
