"""docs/results.md is what `python -m tools.results` writes from the records kept in
docs/results/ (never a hand edit), and a tour's folder or a GPU run's results become a
record with their provenance."""

from __future__ import annotations

import json
import re

import pytest

from conftest import REPO
from test_report import fake_run
from tools import results


def test_the_results_document_is_what_the_records_give():
    """Edited by hand, or a record added without running the command: stale. The top
    README's results block too."""
    records = results.load_records()
    assert (REPO / "docs" / "results.md").read_text() == results.document(records), \
        "docs/results.md is stale: run `python -m tools.results`"
    readme = (REPO / "README.md").read_text()
    assert results.with_readme_block(readme, results.readme_block(records)) == readme, \
        "README.md's results are stale: run `python -m tools.results`"


def test_a_tour_becomes_a_record_with_its_provenance_and_tables(tmp_path, monkeypatch):
    tour = tmp_path / "tour"
    phases = {"data": 0.01, "forward": 0.1, "backward": 0.2, "update": 0.05}
    for chapter, world in (("01-single-gpu", 1), ("03-ddp", 2)):
        fake_run(tour / chapter, chapter, world=world, tokens=1024 * world, phases=phases,
                 final_loss=2.5, losses=[3.0, 2.5])
    (tour / "05-bench").mkdir()
    (tour / "05-bench" / "tables.md").write_text("| size | all_reduce |\n")
    (tour / "tour.json").write_text(json.dumps({"command": "python -m tools.tour --chapters 01,03",
                                                "date": "2026-01-02", "seconds": 61}))
    monkeypatch.setattr(results, "RECORDS", tmp_path / "records")
    path = results.record(tour)
    assert path == tmp_path / "records" / "tour-2026-01-02.json"
    text = results.document(results.load_records(tmp_path / "records"))
    assert "command: `python -m tools.tour --chapters 01,03` (61 s in all)" in text
    assert "torch " in text and "Python " in text and "commit" in text
    rows = [line for line in text.splitlines() if line.startswith("| 0")]
    assert [r.split("|")[1].strip() for r in rows] == ["01-single-gpu", "03-ddp"]
    assert "#### 05-bench" in text and "| size | all_reduce |" in text


def test_a_folder_with_no_measurement_is_one_line(tmp_path, capsys):
    assert results.main(["--record", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no finished tour" in err, err


@pytest.mark.parametrize("content", ["[1, 2]", "not json"])
def test_a_broken_record_is_named(tmp_path, monkeypatch, content):
    (tmp_path / "x.json").write_text(content)
    with pytest.raises(results.UsageError, match="not a record: x.json"):
        results.load_records(tmp_path)


def test_a_gpu_run_becomes_a_record_with_its_driver_targets_and_measured_tests(tmp_path, monkeypatch):
    """tools.gpu_check's results.json: the machine line names the GPU, driver and CUDA;
    each target and each test that measured something is a row; a test that recorded no
    figure (a pass or fail only) is none."""
    run = tmp_path / "gpu-results"
    run.mkdir()
    (run / "results.json").write_text(json.dumps({
        "environment": {"date_utc": "2026-01-03 10:00:00", "python": "3.12.3", "torch": "2.11.0+cu130",
                        "cuda": "13.0", "cuda_devices": ["NVIDIA H200"], "commit": "abc",
                        "nvidia_smi": {"driver": "580.1"}},
        "steps": [], "gpu_tests": {"ch01_base_eager": {"tokens_per_s": 1000.0, "mfu": 0.31, "peak_memory_mb": 5.0},
                                   "ch05_bench_gloo_2": {"tokens_per_s": None}, "device_name": "NVIDIA H200"},
        "targets": [{"target": "chapter 01: MFU", "at_least": 0.25, "value": 0.31, "met": True}]}))
    monkeypatch.setattr(results, "RECORDS", tmp_path / "records")
    assert results.record(run) == tmp_path / "records" / "gpu-2026-01-03.json"
    text = results.document(results.load_records(tmp_path / "records"))
    assert "measured on NVIDIA H200 (driver 580.1, CUDA 13.0), torch 2.11.0+cu130" in text
    assert "| chapter 01: MFU | 0.25 | 0.310 | met |" in re.sub(" +", " ", text)
    assert "ch01_base_eager" in text and "31.0%" in text and "ch05_bench_gloo_2" not in text
    assert "what it checked" not in text  # no test said
