"""The GPU runner's logic, on a CPU: the steps it plans (install only what cannot be
imported, from the wheels brought along, offline; the GPU suite with its JUnit XML; the
bf16 benchmark), its refusals, how it runs a step and logs it, and how it reads the
targets from the results. (The GPU steps themselves run only on a GPU machine.)"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from tools import gpu_check
from conftest import refused


def test_dry_run_lists_the_steps_and_creates_nothing(tmp_path, capsys):
    out = tmp_path / "results"
    assert gpu_check.main(["--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    lines = [line for line in text.splitlines() if line.startswith("== ")]
    assert [line.split(":")[0] for line in lines] == ["== gpu tests", "== bench_model"]  # all importable here
    assert "-m pytest -q -m gpu tests/test_gpu.py --junitxml=" + str(out / "gpu_tests.xml") in lines[0]
    assert ("-m tools.bench_model --presets small base medium --seq-length 1024" in lines[1]
            and "--json " + str(out / "bench_model.json") in lines[1])
    assert "datasets, pytest already importable" in text


def test_only_what_cannot_be_imported_is_installed_offline(tmp_path):
    assert gpu_check.missing_modules(("json", "no_such_module_here")) == ["no_such_module_here"]
    # a second run on the same machine: what the first installed into its site is not
    # missing, unless it cannot be imported from there (an install cut short)
    site = tmp_path / "site"
    for name, code in (("no_such_module_here", ""), ("half_installed_here", "import its_missing_part")):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(code)
    assert gpu_check.missing_modules(("json", "no_such_module_here", "half_installed_here"), site=site) == \
        ["half_installed_here"]
    steps = gpu_check.plan(tmp_path, ["datasets"], wheels=tmp_path / "w", tests=False, site=tmp_path / "site")
    assert [s.name for s in steps] == ["resolve", "install", "bench_model"]
    assert steps[0].argv[1:] == ["-m", "pip", "install", "--dry-run", "--quiet", "--report",
                                 str(tmp_path / "install_plan.json"), "--no-index", "--find-links",
                                 str(tmp_path / "w"), "datasets"]
    assert steps[1].argv[1:] == ["-m", "pip", "install", "--no-deps", "--no-index", "--upgrade",
                                 "--target", str(tmp_path / "site")]  # + the wheels the plan names
    gpu_tests = gpu_check.plan(tmp_path, [], bench=False)[0]
    assert gpu_tests.env == {"LLM_GUIDE_GPU_RESULTS": str(tmp_path)}  # where the tests record
    [some] = gpu_check.plan(tmp_path, [], bench=False, select="ch05")
    assert some.argv[-2:] == ["-k", "ch05"] and "-k" not in gpu_tests.argv


def test_refusals_are_one_line_before_anything_is_made(tmp_path, capsys):
    line = refused(capsys, gpu_check.parse_args, ["--out", tmp_path / "new"])  # no GPU here
    assert "no CUDA GPU here" in line and not (tmp_path / "new").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("mine")
    line = refused(capsys, gpu_check.parse_args, ["--out", tmp_path / "used", "--dry-run"])
    assert "is not an empty folder" in line
    assert "--out is required" in refused(capsys, gpu_check.parse_args, [])
    # under a file: was NotADirectoryError at the first result, after the checks
    (tmp_path / "a-file").write_text("")
    line = refused(capsys, gpu_check.parse_args, ["--out", tmp_path / "a-file" / "sub", "--rehearsal"])
    assert line == (f"error: --out {str(tmp_path / 'a-file' / 'sub')!r}: {str(tmp_path / 'a-file')!r} "
                    f"is a file, not a folder")


def test_a_step_runs_from_the_repo_with_its_log_and_status(tmp_path, capsys):
    ok = gpu_check.run_step(gpu_check.Step("hello", [sys.executable, "-c", "import os; print(os.getcwd())"],
                                           "hello.log"), tmp_path)
    bad = gpu_check.run_step(gpu_check.Step("bad", [sys.executable, "-c", "raise SystemExit(3)"], "bad.log"),
                             tmp_path)
    assert ok["status"] == 0 and (tmp_path / "hello.log").read_text().strip() == str(gpu_check.REPO)
    assert bad["status"] == 3 and "FAILED (3)" in capsys.readouterr().out


def test_targets_are_read_from_the_results():
    results = {"gpu_tests": {"ch01_base_compiled": {"mfu": 0.43}, "ch01_base_eager": {"mfu": 0.21}}}
    got = {t["target"].split(": ")[0]: (t["value"], t["met"]) for t in gpu_check.targets(results)}
    assert got == {"chapter 01, base, seq 1024, batch 32, compiled": (0.43, True),
                   "chapter 01, base, seq 1024, batch 32, eager": (0.21, False),
                   "chapter 03 at world size 1 on nccl": (None, None)}  # not measured


def test_each_target_is_a_figure_the_gpu_suite_records():
    """The GPU suite names what it records (record("ch03_base_nccl_1", {...})), and a
    target reads one of those names: a renamed figure must fail here, not on the GPU."""
    source = (gpu_check.REPO / "tests" / "test_gpu.py").read_text()
    keys = set(re.findall(r'"(\w+)"', source))  # every quoted name (figures, summary keys)
    records = set(re.findall(r'record\("(\w+)"', source))
    for _, (section, name, figure), _ in gpu_check.TARGETS:
        assert section == "gpu_tests" and name in records and figure in keys, (name, figure)


def test_every_gpu_test_is_in_the_one_file_the_runner_runs():
    """The runner runs `pytest -m gpu tests/test_gpu.py` (collecting the whole suite only
    to deselect it cost a GPU machine 10-15 s of CPU): a test marked gpu in another file
    would never run there."""
    elsewhere = [p.name for p in Path(__file__).parent.glob("test_*.py")
                 if p.name != "test_gpu.py" and re.search(r"^(pytestmark\b|@pytest\.mark\.gpu\b)", p.read_text(), re.M)]
    assert elsewhere == []


def test_the_environment_says_what_ran_where():
    env = gpu_check.environment()
    assert env["torch"] == gpu_check.torch.__version__ and env["python"] == sys.version.split()[0]
    assert env["date_utc"][:2] == "20" and env["cuda_devices"] == []  # no GPU here
    # the commit, and whether the files differ from it (the GPU machine gets a copy of them)
    assert env["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", env["commit"])


def test_the_wheels_are_the_newest_plus_a_fallback_less_what_the_gpu_image_has(tmp_path, monkeypatch, capsys):
    """One pip download for what the guide needs, one more for each fallback requirement
    (an older `datasets` for an older pyarrow), for the GPU machine's Python; the wheels
    of projects the image has are dropped afterwards, the others kept."""
    calls = []

    def fake_pip(argv):
        calls.append(argv)
        dest = argv[argv.index("--dest") + 1]
        for name in ("datasets-5.2.0-py3-none-any.whl", "pyarrow-26.0.1-cp312-cp312-x.whl",
                     "huggingface_hub-1.33.0-py3-none-any.whl"):
            (tmp_path / "w" / name).write_bytes(b"wheel")
        assert dest == str(tmp_path / "w")
        return type("Done", (), {"returncode": 0})()
    monkeypatch.setattr(gpu_check.subprocess, "run", fake_pip)
    assert gpu_check.download_wheels(tmp_path / "w", "3.12", ["datasets", "pytest"], ["pyarrow"],
                                     fallbacks=("datasets>=4,<5.1",)) == 0
    assert len(calls) == 2 and calls[0][-2:] == ["datasets", "pytest"] and calls[1][-1] == "datasets>=4,<5.1"
    assert all(c[c.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in c for c in calls)
    assert sorted(w.name for w in (tmp_path / "w").iterdir()) == [
        "datasets-5.2.0-py3-none-any.whl", "huggingface_hub-1.33.0-py3-none-any.whl"]
    assert "left out, the GPU machine has them: pyarrow-26.0.1" in capsys.readouterr().out

    calls.clear()
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda argv: calls.append(argv) or
                        type("Failed", (), {"returncode": 1})())
    assert gpu_check.download_wheels(tmp_path / "w", "3.12", ["datasets"], [], fallbacks=("x<2",)) == 1
    assert len(calls) == 1  # a failed download stops there


def wheel(folder, name: str, requires: list[str]):
    """A pure-Python wheel of one module `name` (version 1.0) that requires `requires`."""
    import base64
    import hashlib
    import zipfile
    files = {f"{name}/__init__.py": f"NAME = {name!r}\n",
             f"{name}-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: " + name + "\nVersion: 1.0\n"
             + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{name}-1.0.dist-info/RECORD"] = "\n".join(record + [f"{name}-1.0.dist-info/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def test_the_install_resolves_against_what_is_installed_and_writes_only_into_its_site(tmp_path):
    """Offline, as on the GPU machine: pip plans against the installed packages (pytest,
    installed here, is not in the plan although required), and installs the planned
    wheels into the site folder alone; the next step imports them through PYTHONPATH,
    and this environment has not changed."""
    wheels, out, site = tmp_path / "wheels", tmp_path / "out", tmp_path / "site"
    wheels.mkdir(), out.mkdir()
    wheel(wheels, "guide_probe", ["guide_probe_dep", "pytest"])
    wheel(wheels, "guide_probe_dep", [])
    steps = gpu_check.plan(out, ["guide_probe"], wheels, tests=False, bench=False, site=site)
    steps.append(gpu_check.Step("use", [sys.executable, "-c", "import guide_probe, guide_probe_dep, pytest"],
                                "use.log"))
    results = {"steps": []}
    gpu_check.run_steps(steps, out, site, results)
    assert [(s["name"], s["status"]) for s in results["steps"]] == [("resolve", 0), ("install", 0), ("use", 0)], \
        [(out / s["log"]).read_text()[-2000:] for s in results["steps"]]
    assert sorted(p.name.split("-")[0] for p in map(Path, gpu_check.planned_wheels(out / "install_plan.json"))) \
        == ["guide_probe", "guide_probe_dep"]
    assert (site / "guide_probe" / "__init__.py").exists() and (site / "guide_probe_dep").is_dir()
    assert importlib.util.find_spec("guide_probe") is None  # this environment untouched
    assert gpu_check.read_json(out / "results.json")["steps"][-1]["name"] == "use"


def test_a_failed_resolve_ends_the_run(tmp_path):
    (tmp_path / "wheels").mkdir()
    steps = gpu_check.plan(tmp_path, ["no_such_project_here"], tmp_path / "wheels", tests=False, site=tmp_path / "s")
    results = {"steps": []}
    gpu_check.run_steps(steps, tmp_path, tmp_path / "s", results)
    assert [s["name"] for s in results["steps"]] == ["resolve"] and results["steps"][0]["status"] != 0
    assert not (tmp_path / "s").exists()


@pytest.mark.long
def test_the_rehearsal_runs_the_runner_end_to_end_on_the_cpu(tmp_path, monkeypatch, capsys):
    """--rehearsal, where there is no GPU: the runner's own steps as on a GPU machine (one
    test of the suite, picked with -k; the benchmark at CPU sizes) into one folder, the
    suite's figures and the benchmark's rows in results.json, and no target judged."""
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)  # the suite inside is a pytest run of its own
    out = tmp_path / "rehearsal"
    assert "no CUDA GPU here" in refused(capsys, gpu_check.parse_args, ["--out", out])
    status = gpu_check.main(["--out", str(out), "--rehearsal", "-k", "chapter_05_collectives"])
    results = gpu_check.read_json(out / "results.json")
    assert status == 0, [(out / s["log"]).read_text()[-3000:] for s in results["steps"]]
    assert results["rehearsal"] and [s["name"] for s in results["steps"]] == ["gpu tests", "bench_model"]
    assert results["steps"][0]["command"].startswith(f"LLM_GUIDE_GPU_RESULTS={out} LLM_GUIDE_GPU_REHEARSAL=1 ")
    assert results["gpu_tests"]["rehearsal_on_cpu"] and results["gpu_tests"]["ch05_collectives_gloo_2"] == "ok"
    assert "1 passed" in (out / "gpu_tests.log").read_text() and (out / "gpu_tests.xml").is_file()
    [row] = [r for r in results["bench_model"]["rows"] if r["step"] == "training step"]
    assert (row["preset"], row["mode"]) == ("tiny", "eager") and row["tokens_per_s"] > 0
    assert all(t["met"] is None for t in results["targets"])
    assert sorted(p.name for p in out.iterdir()) == ["bench_model.json", "bench_model.log", "gpu_tests.json",
                                                      "gpu_tests.log", "gpu_tests.xml", "results.json"]
