"""`python -m tools.results --record`: a record is never replaced, and a folder, a
results.json or a record it cannot read is one line and exit status 2, with nothing
written and every later run still working."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO
from test_report import fake_run
from tools import results

ENVIRONMENT = {"date_utc": "2026-01-03 10:00:00", "python": "3.12.3", "torch": "2.11.0+cu130",
               "cuda": "13.0", "cuda_devices": ["NVIDIA H200"], "commit": "abc"}
TARGET = {"target": "chapter 01: MFU", "at_least": 0.25, "value": 0.31, "met": True}


@pytest.fixture
def docs(tmp_path, monkeypatch):
    """tools.results writing into a copy of the README and a records folder of its own."""
    monkeypatch.setattr(results, "RECORDS", tmp_path / "records")
    monkeypatch.setattr(results, "DOCUMENT", tmp_path / "results.md")
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    monkeypatch.setattr(results, "README", tmp_path / "README.md")
    return tmp_path


def gpu_run(folder, value=0.31, environment=None, targets=None):
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({
        "environment": ENVIRONMENT if environment is None else environment, "gpu_tests": {},
        "targets": [{**TARGET, "value": value}] if targets is None else targets}))
    return folder


def test_a_second_record_of_the_same_day_is_kept_beside_the_first(docs, capsys):
    """Records were keyed by kind and date: a second GPU run of the day replaced the
    first, and the hand-written `source` note of the first was gone."""
    assert results.main(["--record", str(gpu_run(docs / "morning"))]) == 0
    first = docs / "records" / "gpu-2026-01-03.json"
    noted = {**json.loads(first.read_text()), "source": "the morning's run, by hand"}
    first.write_text(json.dumps(noted))
    assert results.main(["--record", str(gpu_run(docs / "evening", value=0.35))]) == 0
    assert json.loads(first.read_text()) == noted
    second = json.loads((docs / "records" / "gpu-2026-01-03-2.json").read_text())
    assert second["results"]["targets"][0]["value"] == 0.35
    # the README quotes the newest of the day
    assert "| 0.350 |" in (docs / "README.md").read_text().replace("  ", " ")
    assert "source: the morning's run, by hand" in (docs / "results.md").read_text()
    capsys.readouterr()
    # the same folder recorded again: kept once
    assert results.main(["--record", str(docs / "evening")]) == 2
    assert capsys.readouterr().err == (f"error: {docs / 'evening'} is recorded already, in "
                                       f"{docs / 'records' / 'gpu-2026-01-03-2.json'}\n")
    assert sorted(p.name for p in (docs / "records").iterdir()) == ["gpu-2026-01-03-2.json", "gpu-2026-01-03.json"]


def tour_without_date(folder):
    fake_run(folder / "01-single-gpu", "01-single-gpu", world=1, tokens=1024, final_loss=2.5,
             losses=[3.0], phases={"data": 0.01, "forward": 0.1, "backward": 0.2, "update": 0.05})
    (folder / "tour.json").write_text(json.dumps({"command": "python -m tools.tour", "seconds": 9}))
    return folder


BAD_MEASUREMENTS = {  # each once a traceback, and the first three wrote a broken record
    "no such folder": (lambda d: d / "missing", "no such folder"),
    "environment a string": (lambda d: gpu_run(d / "g", environment="H200"), "'environment' is missing or not an object"),
    "environment empty": (lambda d: gpu_run(d / "g", environment={}), "no 'date_utc'"),
    "a target without at_least": (lambda d: gpu_run(d / "g", targets=[{"target": "x", "value": 1.0, "met": True}]),
                                  "no 'at_least'"),
    "a date that is a path": (lambda d: gpu_run(d / "g", environment={**ENVIRONMENT, "date_utc": "../../../x/y"}),
                              "its date '../../../x' is not YYYY-MM-DD"),
    "tour.json without a date": (lambda d: tour_without_date(d / "t"), "no 'date'"),
}


@pytest.mark.parametrize("case", sorted(BAD_MEASUREMENTS))
def test_a_measurement_it_cannot_read_is_one_line_and_writes_nothing(docs, capsys, case):
    make, says = BAD_MEASUREMENTS[case]
    folder = make(docs)
    readme = (docs / "README.md").read_text()
    assert results.main(["--record", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err, err
    assert not (docs / "records").exists() or not any((docs / "records").iterdir())
    assert not (docs / "results.md").exists() and (docs / "README.md").read_text() == readme
    assert results.main([]) == 0  # and the next run still works


@pytest.mark.parametrize("content, says", [("{}", "its kind is not 'tour' or 'gpu'"),
                                           ('{"kind": "gpu", "date": "2026-01-03"}', "no 'results'")])
def test_a_stray_file_among_the_records_is_named(docs, capsys, content, says):
    (docs / "records").mkdir()
    (docs / "records" / "notes.json").write_text(content)
    assert results.main([]) == 2
    assert capsys.readouterr().err == (f"error: not a record: notes.json in {docs / 'records'} ({says}); "
                                       f"fix it or move it away\n")
    assert not (docs / "results.md").exists()
