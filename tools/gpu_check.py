"""Everything this guide measures on a GPU, in one command, into one folder.

    python -m tools.gpu_check --download-wheels     # here, online: the wheels a GPU machine lacks
    python -m tools.gpu_check --out gpu-results     # on the GPU machine, offline
    python -m tools.gpu_check --out gpu-results --dry-run   # the steps, without running them
    python -m tools.gpu_check --out suite --no-bench -k "not chapter_05"   # a part of it
    python -m tools.gpu_check --out rehearsal --rehearsal   # no GPU here: the same steps on the CPU

On the GPU machine it (1) installs what cannot be imported there (`datasets`, say) from
the wheels brought along in `.whl/` (no registry needed; into a folder of its own, see
`plan`), (2) runs the GPU test suite (`python -m pytest -q -m gpu tests/test_gpu.py`,
the one file that holds it, so that pytest imports no other; JUnit XML and log), (3)
runs the model benchmark in bf16 (`python -m tools.bench_model`, presets small, base
and medium at sequence 1024, eager and compiled), and (4) writes `results.json`: the
device, driver, torch and CUDA versions, the date, each step's outcome and time, and the
throughput targets met or not. Every file lands in the folder given, which must be new or
empty. `--rehearsal`, on a machine without a GPU, runs the same steps at sizes a CPU
runs in minutes (the suite with LLM_GUIDE_GPU_REHEARSAL=1, the benchmark's tiny preset
eager), so that the runner and the suite can be tried before GPU time is spent.
`--download-wheels` is its companion, run where PyPI is reachable: it downloads
the wheels for the GPU machine's Python into `.whl/` (ignored by git), with an older
`datasets` beside the newest for an image whose pyarrow the newest does not accept.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.cli import check_writable_folder
from common.errors import UsageError, fail
from common.files import read_json, write_json

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl"
# Where the missing packages are installed (see `plan`), and pip's plan for them.
SITE = Path(tempfile.gettempdir()) / f"llm-guide-site-{os.getuid()}"
INSTALL_PLAN = "install_plan.json"
# What the guide needs beyond what a GPU image with torch usually has; installed only
# where it cannot be imported.
NEEDED = ("datasets", "pytest")
# The GPU machine's image holds these (and recent versions): leaving their wheels out
# keeps what travels with the repository small.
ALREADY_THERE = ("pyarrow", "numpy", "pandas")
# Downloaded too, for an image whose pyarrow is older than the newest `datasets` needs
# (5.1 and later need pyarrow >= 24; 5.0 takes 21 and later): pip's resolver, offered
# both, installs the newest that the installed pyarrow satisfies.
FALLBACKS = ("datasets>=4,<5.1",)
BENCH_ARGS = ["--presets", "small", "base", "medium", "--seq-length", "1024", "--batch-size", "16",
              "--iters", "10", "--warmup", "3", "--profile", "3"]
# --rehearsal, on a CPU: the benchmark's steps at a size that takes seconds.
REHEARSAL_BENCH_ARGS = ["--presets", "tiny", "--seq-length", "64", "--batch-size", "2", "--iters", "2",
                        "--warmup", "1", "--no-compile", "--profile", "1"]
# (what, where in the results, at least): the targets on one H100 in bf16, at the GPU
# suite's size (tests/test_gpu.py, BASE).
TARGETS = [
    ("chapter 01, base, seq 1024, batch 32, compiled: MFU", ("gpu_tests", "ch01_base_compiled", "mfu"), 0.40),
    ("chapter 01, base, seq 1024, batch 32, eager: MFU", ("gpu_tests", "ch01_base_eager", "mfu"), 0.25),
    ("chapter 03 at world size 1 on nccl: tokens/s vs chapter 01",
     ("gpu_tests", "ch03_base_nccl_1", "tokens_per_s_vs_ch01"), 0.97),
]


@dataclass
class Step:
    name: str
    argv: list[str]
    log: str                       # file name in the output folder
    env: dict = field(default_factory=dict)
    timeout_s: float = 3600


def missing_modules(names=NEEDED, site: Path | None = None) -> list[str]:
    """The modules of `names` this Python cannot import (nor, where given, import from
    the folder `site`, into which an earlier run on this machine installed them: tried
    in a fresh interpreter, so that an install cut short there counts as missing)."""
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if site is None or not site.is_dir():
        return missing
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    return [n for n in missing if subprocess.run([sys.executable, "-c", f"import {n}"], env=env,
                                                 capture_output=True).returncode != 0]


def plan(out: Path, missing: list[str], wheels: Path = WHEELS, tests: bool = True,
         bench: bool = True, select: str | None = None, site: Path | None = None,
         rehearsal: bool = False) -> list[Step]:
    """The steps of a run, in order: install what is missing, the GPU suite (only its tests
    that pytest's `-k select` picks, if given), the benchmark; rehearsed on a CPU, the
    suite's rehearsal and the benchmark at CPU sizes.

    The install is two steps, so that it works where the Python environment cannot be
    written (an image's environment owned by another user): pip resolves what is missing
    against what is installed, without installing (`--dry-run --report`), and then
    installs just the wheels that report names into `site` (`--target`), a folder the
    later steps find through PYTHONPATH, ahead of the environment's own packages."""
    py = sys.executable
    steps = []
    if missing:
        steps.append(Step("resolve", [py, "-m", "pip", "install", "--dry-run", "--quiet", "--report",
                                      str(out / INSTALL_PLAN), "--no-index", "--find-links", str(wheels),
                                      *missing], "resolve.log", timeout_s=900))
        # the wheel files install_plan.json names are appended when it has been written
        steps.append(Step("install", [py, "-m", "pip", "install", "--no-deps", "--no-index", "--upgrade",
                                      "--target", str(site or SITE)], "install.log", timeout_s=900))
    if tests:
        steps.append(Step("gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py",
                                        f"--junitxml={out / 'gpu_tests.xml'}",
                                        *(["-k", select] if select else [])], "gpu_tests.log",
                          env={"LLM_GUIDE_GPU_RESULTS": str(out),
                               **({"LLM_GUIDE_GPU_REHEARSAL": "1"} if rehearsal else {})}))
    if bench:
        steps.append(Step("bench_model", [py, "-m", "tools.bench_model",
                                          *(REHEARSAL_BENCH_ARGS if rehearsal else BENCH_ARGS),
                                          "--json", str(out / "bench_model.json")], "bench_model.log"))
    return steps


def planned_wheels(report: Path) -> list[str]:
    """The wheel files a `pip install --dry-run --report` chose (local files, from
    --find-links), in its order."""
    from urllib.parse import unquote, urlparse
    items = json.loads(report.read_text())["install"]
    return [unquote(urlparse(item["download_info"]["url"]).path) for item in items]


def shown(step: Step) -> str:
    """The step as a shell command line, its own environment variables first."""
    return "".join(f"{k}={shlex.quote(v)} " for k, v in step.env.items()) + shlex.join(step.argv)


def run_step(step: Step, out: Path, site: Path | None = None) -> dict:
    """Run one step from the repo root, its output into its log; its outcome and time.
    The repo and `site` (the installed missing packages) come first on PYTHONPATH."""
    path = [str(REPO), str(site) if site else None, os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)), "PYTHONUNBUFFERED": "1", **step.env}
    print(f"== {step.name}: {shown(step)}  (log: {out / step.log})", flush=True)
    t0 = time.perf_counter()
    with open(out / step.log, "w") as log:
        try:
            status = subprocess.run(step.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=step.timeout_s).returncode
        except subprocess.TimeoutExpired:
            status = "timed out"
    seconds = time.perf_counter() - t0
    print(f"   {step.name}: {'ok' if status == 0 else f'FAILED ({status})'} in {seconds:,.0f} s", flush=True)
    return {"name": step.name, "command": shown(step), "log": step.log, "status": status,
            "seconds": seconds}


def run_steps(steps: list[Step], out: Path, site: Path | None, results: dict) -> None:
    """Run the steps in order into `results["steps"]`, saving results.json after each;
    the install's wheels are those the resolve step's plan names. A failed resolve or
    install ends the run: nothing after it could import what it needs."""
    for step in steps:
        if step.name == "install":
            step.argv += planned_wheels(out / INSTALL_PLAN)
        results["steps"].append(run_step(step, out, site))
        write_json(out / "results.json", results)
        if step.name in ("resolve", "install") and results["steps"][-1]["status"] != 0:
            break


def nvidia_smi() -> dict:
    """The GPUs and driver as nvidia-smi reports them ({} where it is not there)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
    return {"gpus": [r[0] for r in rows], "driver": rows[0][1] if rows and len(rows[0]) > 1 else None,
            "memory_total": rows[0][2] if rows and len(rows[0]) > 2 else None}


def commit() -> str | None:
    """The repository's commit, where this is a git checkout with git installed, with
    "-dirty" after it where the files differ from it (a copy of a working tree, say)."""
    try:
        git = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40", "--exclude=*"], cwd=REPO,
                             capture_output=True, text=True)
    except OSError:
        return None
    return git.stdout.strip() if git.returncode == 0 else None


def environment() -> dict:
    return {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "host": socket.gethostname(),
            "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "nvidia_smi": nvidia_smi(), "commit": commit()}


def targets(results: dict) -> list[dict]:
    """Each target with its measured value (None where the run did not produce it) and
    whether it is met (None in a rehearsal: a CPU is not what the targets are for)."""
    out = []
    for what, path, at_least in TARGETS:
        value = results
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        out.append({"target": what, "at_least": at_least, "value": value,
                    "met": None if value is None or results.get("rehearsal") else value >= at_least})
    return out


def download_wheels(dest: Path, python_version: str, packages: list[str], exclude: list[str],
                    fallbacks=FALLBACKS) -> int:
    """pip download the packages and their dependencies as wheels for CPython
    `python_version` on x86-64 Linux into `dest`, then each fallback requirement with its
    own (one pip call each: one call resolves one version of a project), then drop the
    excluded projects' wheels."""
    dest.mkdir(parents=True, exist_ok=True)
    for requirements in ([*packages], *([f] for f in fallbacks)):
        argv = [sys.executable, "-m", "pip", "download", "--dest", str(dest), "--only-binary=:all:",
                "--python-version", python_version, "--implementation", "cp",
                *[a for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "any")
                  for a in ("--platform", p)], *requirements]
        print(shlex.join(argv), flush=True)
        status = subprocess.run(argv).returncode
        if status != 0:
            return status
    dropped = [w for w in dest.glob("*.whl") if w.name.split("-")[0].lower().replace("_", "-") in exclude]
    for wheel in dropped:
        wheel.unlink()
    size = sum(w.stat().st_size for w in dest.glob("*.whl")) / 2**20
    print(f"{len(list(dest.glob('*.whl')))} wheels, {size:.1f} MB, in {dest}"
          + (f" (left out, the GPU machine has them: {', '.join(w.name for w in dropped)})" if dropped else ""))
    return 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--out", type=Path, help="the folder every result goes into (new or empty)")
    p.add_argument("--dry-run", action="store_true", help="print the steps; run and create nothing")
    p.add_argument("--wheels", type=Path, default=WHEELS, help="the wheels to install from")
    p.add_argument("--no-tests", action="store_true", help="skip the GPU test suite")
    p.add_argument("--no-bench", action="store_true", help="skip the model benchmark")
    p.add_argument("--rehearsal", action="store_true",
                   help="on a machine without a GPU: the same steps on the CPU at small sizes, to try the "
                        "runner and the suite before GPU time is spent (its figures meet no target)")
    p.add_argument("-k", dest="select", default=None,
                   help="only the GPU tests this pytest -k expression selects (e.g. 'chapter_05')")
    p.add_argument("--download-wheels", action="store_true",
                   help="instead: download the wheels for the GPU machine into --wheels (needs PyPI)")
    p.add_argument("--python-version", default="3.12", help="with --download-wheels: the GPU machine's Python")
    p.add_argument("--exclude", default=",".join(ALREADY_THERE),
                   help="with --download-wheels: projects whose wheels to leave out (comma-separated)")
    p.error = lambda message: fail(f"{message} (see --help)")  # one line, not the usage block
    args = p.parse_args(argv)
    if args.download_wheels:
        return args
    if args.out is None:
        fail("--out is required (the folder the results go into), or --download-wheels")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        fail(f"--out {str(args.out)!r} exists and is not an empty folder; choose a new one")
    try:  # under a file, or where nothing can be written: said now, not at the first result
        check_writable_folder(args.out, "--out")
    except UsageError as e:
        fail(str(e))
    if args.rehearsal and torch.cuda.is_available():
        fail("--rehearsal is for a machine without a GPU: here, run without it")
    if not args.dry_run and not args.rehearsal and not torch.cuda.is_available():
        fail("no CUDA GPU here: this runs the GPU suite and benchmark (--dry-run shows the steps; "
             "--rehearsal runs them on the CPU at small sizes)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.download_wheels:
        exclude = [e.strip().lower().replace("_", "-") for e in args.exclude.split(",") if e.strip()]
        return download_wheels(args.wheels, args.python_version, list(NEEDED), exclude)
    out = args.out.resolve()
    # what this Python lacks comes from SITE; what SITE lacks too is installed there first
    from_site, missing = missing_modules(), missing_modules(site=SITE)
    steps = plan(out, missing, args.wheels, tests=not args.no_tests, bench=not args.no_bench,
                 select=args.select, rehearsal=args.rehearsal)
    if missing and not args.wheels.is_dir():
        fail(f"cannot import {', '.join(missing)}, and there are no wheels in {args.wheels} to install "
             f"from (python -m tools.gpu_check --download-wheels, where PyPI is reachable)")
    if args.dry_run:
        print(f"would write into {out}:")
        if not missing:
            print(f"   ({', '.join(NEEDED)} already importable{f' (from {SITE})' if from_site else ''}: "
                  f"nothing to install)")
        for step in steps:
            more = f" <the wheels {INSTALL_PLAN} names>" if step.name == "install" else ""
            print(f"== {step.name}: {shown(step)}{more}  (log: {step.log})")
        print("then results.json: device, driver, torch, date, each step, the targets")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(), "rehearsal": args.rehearsal, "steps": []}
    where = ("a rehearsal on the CPU" if args.rehearsal else
             f"{results['environment']['cuda_devices']}, driver {results['environment']['nvidia_smi'].get('driver')}")
    print(f"{where}, torch {torch.__version__}: results into {out}", flush=True)
    run_steps(steps, out, SITE if from_site else None, results)
    results["gpu_tests"] = read_json(out / "gpu_tests.json")
    results["bench_model"] = read_json(out / "bench_model.json")
    results["targets"] = targets(results)
    write_json(out / "results.json", results)
    for t in results["targets"]:
        value = "not measured" if t["value"] is None else f"{t['value']:.3f}"
        print(f"target: {t['target']} >= {t['at_least']}: {value}"
              + ("" if t["met"] is None else (" (met)" if t["met"] else " (NOT met)"))
              + (" (rehearsed on the CPU: not what the target is for)" if args.rehearsal else ""))
    failed = [s["name"] for s in results["steps"] if s["status"] != 0]
    print(f"{'FAILED: ' + ', '.join(failed) if failed else 'every step passed'}; results in {out / 'results.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
