"""Run every chapter in order, then compare them: `python -m tools.tour`.

Each chapter is launched as a real subprocess, exactly as its README launches it (python
for 01 and 02, torchrun from 03 on), on the embedded dataset with a small model and short
runs; larger sizes on GPUs. The terminal shows one line per chapter (a live line with the
elapsed time while it runs); each chapter's whole output goes to `<out>/<name>.log`. At
the end come a narrow comparison (tokens/s, loss, notes) and where everything is:
`<out>/report.md` (`tools.report`'s table with every column, chapter 05's tables, the
explanations, a list of every file produced), the plots and the logs. `--verbose` shows
every chapter's output as it runs instead.

    python -m tools.tour                      # everything
    python -m tools.tour --chapters 01,03     # a subset
    python -m tools.tour --dry-run            # only print the commands
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import resource
import select
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import report
from .chapters import BY_FOLDER, CHAPTERS
from common.cli import DEFAULT_SAVE_DIR, REPO_ROOT, Parser, check_writable_folder, one_of, unused_name
from common.errors import UsageError
from common.files import write_json
from common.model import PRESETS
from common.runfolder import claim_run_folder, holds_results



@dataclass
class Step:
    chapter: str              # the chapter folder, e.g. "05-collectives"
    name: str                 # run / log name, e.g. "05-bench"
    argv: list[str]           # what is executed (cwd = repository root)
    display: str              # what a reader would type
    env: dict = field(default_factory=dict)   # extra environment variables
    note: str = ""            # why this step looks the way it does


@dataclass
class Sizes:
    """How big the tour's runs are, chosen for the hardware found."""
    preset: str
    seq_length: int
    batch_size: int
    steps: int
    nproc: int
    val_batches: int
    num_workers: int
    bench_max_bytes: int
    bench_iters: int


def default_sizes(gpus: int) -> Sizes:
    if gpus:
        # GPT-2-small class at a realistic sequence length; still about a minute a chapter
        return Sizes("base", 1024, 8, 100, gpus, 20, 2, 256 * 2**20, 20)
    # two processes, as a reader's laptop can; 20 steps (30 before): the loss falls, chapter
    # 04's crash lands between two checkpoints, for a third less time (tour.json records
    # the CPU-seconds a tour took)
    return Sizes("small", 128, 8, 20, 2, 4, 0, 4 * 2**20, 5)


def parse_chapters(text: str) -> list[str]:
    """'01,03' or '01-single-gpu,03-ddp' -> chapter folder names, in tour order."""
    wanted = set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        match = [c.folder for c in CHAPTERS if item in (c.folder, c.number, c.number.lstrip("0"))]
        if not match:
            raise UsageError(f"--chapters: unknown chapter {item!r}; choose from "
                             f"{', '.join(c.number for c in CHAPTERS)} (or the folder names)")
        wanted.add(match[0])
    if not wanted:
        raise UsageError("--chapters: name at least one chapter, e.g. --chapters 01,03")
    return [c.folder for c in CHAPTERS if c.folder in wanted]


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m tools.tour", description=__doc__.split("\n\n")[0])
    p.add_argument("--chapters", default=",".join(c.number for c in CHAPTERS),
                   help="comma-separated chapters to run, e.g. 01,03 (default: all)")
    # the chapters' names for the same settings; the short ones stay as aliases
    p.add_argument("--model-preset", "--preset", dest="preset", default=None, type=one_of(*PRESETS),
                   help=f"model preset ({', '.join(PRESETS)}); default: small on CPU, base on GPU")
    p.add_argument("--max-steps", "--steps", dest="steps", type=int, default=None,
                   help="optimizer steps per chapter (default: 20 on CPU, 100 on GPU)")
    p.add_argument("--seq-length", type=int, default=None, help="default: 128 on CPU, 1024 on GPU")
    p.add_argument("--batch-size", type=int, default=None, help="per process; default 8")
    p.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=int, default=None,
                   help="processes for every chapter torchrun launches, 03 on (default: the number of "
                        "GPUs, else 2)")
    p.add_argument("--out", default=None, help="tour folder (default: outputs/tour-<timestamp>)")
    p.add_argument("--verbose", action="store_true",
                   help="show every chapter's output as it runs (default: one line per chapter; the "
                        "output goes to its log)")
    p.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


def parse_args(argv=None, gpus: int | None = None) -> argparse.Namespace:
    """Parse and check everything before any work; raises UsageError. `gpus` (default:
    the CUDA devices here) picks the sizes; tests pass it to plan for other machines."""
    args = build_parser().parse_args(argv)
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    args.gpus = gpus
    args.chapter_list = parse_chapters(args.chapters)
    sizes = default_sizes(gpus)
    for name in ("preset", "steps", "seq_length", "batch_size", "nproc"):
        if getattr(args, name) is not None:
            setattr(sizes, name, getattr(args, name))
    args.sizes = sizes
    flags = {"steps": "--max-steps", "seq_length": "--seq-length", "batch_size": "--batch-size",
             "nproc": "--nproc-per-node"}
    for name, flag in flags.items():
        if getattr(sizes, name) < 1:
            raise UsageError(f"{flag} must be at least 1 (got {getattr(sizes, name)})")
    max_pos = PRESETS[sizes.preset]["max_position_embeddings"]
    if sizes.seq_length > max_pos:
        raise UsageError(f"--seq-length {sizes.seq_length} exceeds the {sizes.preset!r} preset's "
                         f"max_position_embeddings={max_pos}")
    if gpus and sizes.nproc > gpus:
        raise UsageError(f"--nproc-per-node {sizes.nproc}: only {gpus} GPU(s) here, and NCCL needs one "
                         f"GPU per process")
    cores = os.cpu_count() or 1
    if not gpus and sizes.nproc > max(4, cores):
        raise UsageError(f"--nproc-per-node {sizes.nproc}: this machine has {cores} CPU cores; more than "
                         f"{max(4, cores)} processes would only share them")
    if args.nproc is not None:  # the reader's choice: every chapter torchrun launches must take it
        for chapter in args.chapter_list:
            multiple, flags = world_multiple(chapter)
            if sizes.nproc % multiple:
                raise UsageError(f"--nproc-per-node {sizes.nproc}: the tour runs chapter {chapter} with "
                                 f"{' '.join(flags)}, so its world size must be a multiple of {multiple}; "
                                 f"choose a multiple of {multiple}, or leave {chapter[:2]} out with --chapters")
    if "04-checkpointing" in args.chapter_list and sizes.steps < 3:
        raise UsageError(f"--max-steps {sizes.steps}: chapter 04 needs at least 3 (a checkpoint, "
                         f"then a crash, then the resumed run)")
    # '~/tour' quoted means the home folder, as the shell would (not a folder named '~')
    out = Path(args.out).expanduser() if args.out else unused_default_out()
    if out.exists() and (not out.is_dir() or holds_results(out)):  # its lock file does not count
        raise UsageError(f"--out {str(out)!r} already exists and is not an empty folder; "
                         f"choose another or remove it")
    check_writable_folder(out, "--out")  # read-only or under a file: say so now, not at the end
    args.out_dir = out.resolve()
    return args


def world_multiple(chapter: str) -> tuple[int, list[str]]:
    """(m, flags): a torchrun chapter's world size must be a multiple of m, the product of
    the model-parallel sizes the tour passes it (--tp, --pp, --cp among its tour flags:
    2 for chapter 06's --pp 2); 1 and no flags for the others."""
    flags, m, said = list(BY_FOLDER[chapter].tour_flags), 1, []
    for name in ("--tp", "--pp", "--cp"):
        if name in flags and BY_FOLDER[chapter].launcher == "torchrun":
            value = int(flags[flags.index(name) + 1])
            m, said = m * value, [*said, name, str(value)]
    return m, said


def unused_default_out() -> Path:
    """outputs/tour-<timestamp>, or -2, -3, ... after it when a tour started in the same
    second has that name."""
    return DEFAULT_SAVE_DIR / unused_name(DEFAULT_SAVE_DIR, f"tour-{time.strftime('%Y%m%d-%H%M%S')}")


def crash_plan(steps: int) -> tuple[int, int]:
    """(checkpoint every K steps, crash at step S): S falls between the first and second
    checkpoint, so the resumed run has to redo a few steps."""
    ckpt_freq = max(1, steps // 3)
    return ckpt_freq, ckpt_freq + max(1, ckpt_freq // 2)


def _rel(path: Path) -> str:
    """Paths as a reader at the repository root would type them."""
    try:
        return str(path.relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def launch_for(args, chapter: str) -> tuple[int, dict, Sizes, str]:
    """(processes, environment, sizes, note) of a chapter torchrun launches. Chapter 05
    needs two processes or more, and a chapter run with model-parallel flags a multiple
    of their product: where the GPUs here do not give that (one GPU, say), it runs on
    that many CPU processes over gloo (CUDA hidden), at the CPU sizes except where the
    reader chose them: the same lesson, slower. (A --nproc-per-node chosen that does not
    fit was refused in parse_args.)"""
    s = args.sizes
    multiple, flags = world_multiple(chapter)
    need = max(2, multiple) if chapter == "05-collectives" else multiple
    if s.nproc >= need and s.nproc % multiple == 0:
        return s.nproc, {}, s, ""
    sizes = default_sizes(0) if args.gpus else dataclasses.replace(s)
    for name in ("preset", "steps", "seq_length", "batch_size"):
        if getattr(args, name) is not None:
            setattr(sizes, name, getattr(args, name))
    why = "collectives need two or more processes" if chapter == "05-collectives" else \
        f"{' '.join(flags)} needs a multiple of {multiple} processes"
    note = (f"{why}: running {need} CPU processes (gloo)" + (" with CUDA hidden" if args.gpus else ""))
    return need, ({"CUDA_VISIBLE_DEVICES": ""} if args.gpus else {}), sizes, note


def build_plan(args) -> list[Step]:
    """The commands of the tour, in order."""
    s: Sizes = args.sizes
    out = _rel(args.out_dir)
    py_exec, py_show = [sys.executable], ["python"]

    def torchrun(n):
        opts = ["--standalone", f"--nproc-per-node={n}"]
        # python -m torch.distributed.run is torchrun, without needing it on PATH
        return [sys.executable, "-m", "torch.distributed.run", *opts], ["torchrun", *opts]

    def step(chapter, name, launch, rest, env=None, note=""):
        exec_prefix, show_prefix = launch
        env = env or {}
        shown = " ".join(f"{k}={v}" for k, v in env.items())
        display = (shown + " " if shown else "") + shlex.join(show_prefix + rest)
        return Step(chapter, name, exec_prefix + rest, display, env, note)

    def train_flags(name, sizes):
        return ["--experiment-name", name, "--save-dir", out, "--dataset-name", "stdlib",
                "--model-preset", sizes.preset, "--seq-length", str(sizes.seq_length),
                "--batch-size", str(sizes.batch_size), "--max-steps", str(sizes.steps),
                # --max-steps decides the length; enough epochs that the small corpus
                # never ends a run first
                "--num-epochs", "100", "--warmup-steps", str(max(1, sizes.steps // 10)),
                "--log-freq", str(max(1, sizes.steps // 10)), "--val-batches", str(sizes.val_batches),
                "--num-workers", str(sizes.num_workers)]

    plan = []
    for chapter in args.chapter_list:
        c, script = BY_FOLDER[chapter], f"{chapter}/train_llm.py"
        n, env, sizes, note = (1, {}, s, "") if c.launcher == "python" else launch_for(args, chapter)
        launch = (py_exec, py_show) if c.launcher == "python" else torchrun(n)
        flags = [script, *train_flags(chapter, sizes), *c.tour_flags]
        if chapter == "02-data-parallel":
            note = ("one process; DataParallel splits each batch over the visible GPUs"
                    if args.gpus > 1 else
                    "one process; with fewer than 2 GPUs DataParallel has nothing to split "
                    "over, so the script trains the plain module and says so")
        elif chapter == "04-checkpointing":  # a crash on purpose, and torchrun's restart
            freq, crash = crash_plan(sizes.steps)
            launch = tuple(prefix + ["--max-restarts=3"] for prefix in launch)
            flags += ["--ckpt-freq", str(freq), "--crash-at-step", str(crash)]
            note = (f"checkpoints every {freq} steps and crashes on purpose at step {crash}; "
                    f"torchrun restarts it and it resumes from step {freq}")
        elif chapter == "03-ddp":
            note = f"{n} process(es) of batch {sizes.batch_size}: global batch {n * sizes.batch_size}"
        if chapter == "05-collectives":
            plan += collectives_steps(args, out, step, torchrun(n), env, sizes, note)
        else:
            plan.append(step(chapter, chapter, launch, flags, env, note))
    return plan


def collectives_steps(args, out, step, launch, env, sizes, note) -> list[Step]:
    """Chapter 05's scripts, one after another, on `launch` (torchrun of two or more
    processes: launch_for)."""
    # each mode of ddp_from_scratch trains from scratch: a few steps show it equals DDP
    scratch_steps = max(2, sizes.steps // 5)
    # on GPUs also the overlapped mode (what DDP does); on CPU it only adds minutes
    modes = ["--modes", "naive,bucketed,overlap,ddp"] if args.gpus and not env else []
    # the overlap timeline of every mode on GPUs; on CPU four (all eight would make it the
    # tour's slowest step): naive, DDP with one big bucket, DDP with chapter 03's buckets, FSDP2
    timeline_modes = [] if args.gpus and not env else ["--modes", "naive,ddp,ch03-ddp,fsdp2"]
    d = "05-collectives"
    return [
        step(d, "05-collectives-demo", launch, [f"{d}/collectives_demo.py"], env, note),
        step(d, "05-bench", launch,
             [f"{d}/bench_collectives.py", "--max-bytes", str(sizes.bench_max_bytes),
              "--iters", str(sizes.bench_iters), "--save-dir", out,
              "--experiment-name", "05-bench"], env, note),
        step(d, "05-ddp-from-scratch", launch,
             [f"{d}/ddp_from_scratch.py", "--model-preset", sizes.preset,
              "--seq-length", str(sizes.seq_length), "--batch-size", str(sizes.batch_size),
              "--steps", str(scratch_steps), *modes, "--save-dir", out,
              "--experiment-name", "05-ddp-from-scratch"], env, note),
        # sharded training rebuilt from collectives (ZeRO-1, ZeRO-3, FSDP2)
        step(d, "05-sharded-from-scratch", launch,
             [f"{d}/sharded_from_scratch.py", "--model-preset", sizes.preset,
              "--seq-length", str(sizes.seq_length), "--batch-size", str(sizes.batch_size),
              "--steps", str(scratch_steps), "--timing-warmup", str(min(2, scratch_steps - 1)),
              "--save-dir", out, "--experiment-name", "05-sharded-from-scratch"], env, note),
        step(d, "05-overlap-timeline", launch,
             [f"{d}/overlap_timeline.py", "--model-preset", sizes.preset,
              "--seq-length", str(sizes.seq_length), "--batch-size", str(sizes.batch_size),
              *timeline_modes, "--save-dir", out, "--experiment-name", "05-overlap-timeline"], env, note),
    ]


def script_of(step: Step) -> str:
    return next((a for a in step.argv if a.endswith(".py")), step.argv[0])


# --- running ---------------------------------------------------------------------------

def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def run_step(step: Step, log_path: Path, stream: bool, progress=None) -> int:
    """Run one command, its output saved to the log, and streamed live with `stream`
    (raw bytes, so progress bars keep working in a terminal). `progress(seconds)` is
    called about once a second while it runs: the live line."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    if stream and sys.stdout.isatty():  # the children see a pipe: ask them for bars anyway
        env["LLM_GUIDE_PROGRESS"] = "1"
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        log.write(f"$ {step.display}\n".encode())
        log.flush()
        proc = subprocess.Popen(step.argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        out = proc.stdout.fileno()
        try:
            while True:
                if select.select([out], [], [], 1.0)[0]:
                    chunk = os.read(out, 65536)
                    if not chunk:
                        break
                    log.write(chunk)
                    if stream:
                        sys.stdout.buffer.write(chunk)
                        sys.stdout.flush()
                if progress:
                    progress(time.perf_counter() - started)
        except KeyboardInterrupt:
            proc.wait()  # the child got the same Ctrl-C; let it finish its cleanup
            raise
        return proc.wait()


def log_lines(path: Path) -> list[str]:
    return path.read_bytes().decode(errors="replace").replace("\r", "\n").splitlines()


def log_tail(path: Path, lines: int = 25) -> str:
    return "\n".join(log_lines(path)[-lines:])


def chapter_error(path: Path) -> str | None:
    """The first `error: ...` line a chapter printed (rank 0's, under torchrun): the cause,
    which the launcher's own report after it does not say."""
    return next((line for line in log_lines(path) if line.startswith("error: ")), None)


def scaling(runs: list[report.Run]) -> str | None:
    """The scaling efficiency of each run of several processes: its tokens/s per process
    over chapter 01's tokens/s in this tour (the same per-process batch; 1.0 = linear).
    n/a and why when any run of the comparison shared a busy machine: load slows a
    one-process run and a two-process run unequally (a one-thread process far more), so
    their ratio measures the load, not the scaling."""
    base = next((r for r in runs if r.summary.get("chapter") == "01-single-gpu"), None)
    scaled = [r for r in runs if (r.summary.get("world_size") or 1) > 1]
    if base is None or not scaled:
        return None
    busy = [r for r in (base, *scaled) if report.busy(r.summary)]
    if busy:
        return ("Scaling efficiency: n/a. The machine was busy during " +
                ", ".join(f"{r.name} (load average up to {r.summary['load_avg_max']:.1f} on "
                          f"{r.summary['cpu_cores']} cores)" for r in busy) +
                ": a busy machine slows runs of different process counts unequally, so their "
                "ratio is no scaling figure; rerun on an idle machine.")
    return ("Scaling efficiency (tokens/s per process over chapter 01's tokens/s): " +
            ", ".join(f"{r.name} {100 * r.summary['tokens_per_s_per_device'] / base.summary['tokens_per_s']:.1f}%"
                      for r in scaled) + ".")


def explanations(args, runs) -> list[str]:
    """What the comparison needs said: the scaling efficiency, the batch each chapter ran,
    and why CPU processes do not speed up."""
    s, said = args.sizes, []
    efficiency = scaling(runs)
    if efficiency:
        said.append(efficiency)
    if any(c[:2] in ("03", "04", "06") for c in args.chapter_list):
        said.append(f"Batch sizes: every process ran a batch of {s.batch_size} x {s.seq_length} "
                    f"tokens. 01 and 02 are one process (02's DataParallel splits its batch over "
                    f"the GPUs), so their step covers {s.batch_size} samples; 03 and 04 run "
                    f"{s.nproc} process(es), so their step covers {s.nproc} x {s.batch_size} = "
                    f"{s.nproc * s.batch_size} samples. tokens/s counts them all; compare tokens/s "
                    f"per device across chapters."
                    + (f" 06 splits each replica of the model over 2 processes (--pp 2), so its step "
                       f"covers {max(1, s.nproc // 2)} x {s.batch_size} samples."
                       if "06-model-parallel" in args.chapter_list else ""))
        if not args.gpus and s.nproc > 1:
            said.append(f"On CPU the {s.nproc} processes share the same {os.cpu_count()} cores: "
                        f"more processes add no compute, so expect no speed-up here. The mechanics "
                        f"are the lesson; GPUs show the scaling.")
    return said


def cpu_seconds() -> float:
    """CPU time of this process and of every process it started (torchrun's workers too)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def print_summary(args, steps_run: list[Step], started: float) -> None:
    """report.md (the wide table, the explanations, chapter 05's tables, the plots, a list
    of every file the tour produced); then, in the terminal, the explanations, a narrow
    table a terminal fits (tokens/s, loss, notes) and, last, where everything is."""
    out = args.out_dir
    runs = report.load_runs(report.find_summaries([out]))
    said = explanations(args, runs) if runs else []
    # what a chapter's scripts want in the report beyond their summary.json (chapter 05's
    # benchmark and proofs): a tables.md in their run folder
    tables = [(path, path.read_text().strip()) for path in sorted(out.glob("*/tables.md"))]
    sections = [*said, *(f"## {path.parent.name}\n\nfrom `{path.relative_to(out)}`\n\n{table}"
                         for path, table in tables)]
    _, files = report.write_report(runs, out, sections)
    md = out / "report.md"
    produced = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    with open(md, "a") as f:
        f.write("\n## Files\n\n" + "".join(f"- `{p}`\n" for p in produced))
    print(f"\ntour finished in {_clock(time.perf_counter() - started)} ({cpu_seconds():,.0f} CPU-seconds)")
    for text in said:
        print(f"\n{text}")
    if runs:
        table, notes = report.narrow_table(runs)
        warning = report.device_warning(runs)
        if warning:
            print(f"\n{warning}")
        print(f"\n{table}")
        if notes:
            print("\nnotes:\n" + "\n".join(notes))
    chapter05 = f", chapter 05's {len(tables)} tables" if tables else ""
    print(f"\nreport (every column{chapter05}, the list of all {len(produced)} files): {_rel(md)}")
    if files[1:]:
        print(f"plots: {', '.join(_rel(f) for f in files[1:])}")
    if steps_run:
        print(f"logs: {_rel(out)}/<name>.log, one per command "
              f"({', '.join(st.name + '.log' for st in steps_run)})")


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        plan = build_plan(args)
        missing = sorted({script_of(st) for st in plan if not (REPO_ROOT / script_of(st)).is_file()})
        if missing and not args.dry_run:
            raise UsageError(f"not found: {', '.join(missing)} (is this the repository root?)")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    total = len(args.chapter_list)
    index = {c: i for i, c in enumerate(args.chapter_list, 1)}
    if args.dry_run:
        print(f"# the tour would run, from {REPO_ROOT}:")
        for st in plan:
            flag = "  # missing" if script_of(st) in missing else ""
            print(f"[{index[st.chapter]}/{total}] {st.chapter}: {st.display}{flag}")
        return 0

    while True:
        try:  # a default name is created here or not at all: two tours never share one
            args.out_dir.mkdir(parents=True, exist_ok=args.out is not None)
            break
        except FileExistsError:  # another tour took it since parse_args: the next free one
            if args.out is not None:
                raise
            args.out_dir = unused_default_out().resolve()
            plan = build_plan(args)
    # locked while the tour runs, as a chapter's run folder: an --out given to two tours
    # at once is refused to the second (one line, exit 2), not written by both
    claim_run_folder(args.out_dir, flag="--out")
    s = args.sizes
    print(f"tour of {total} chapter(s) into {_rel(args.out_dir)}: preset {s.preset}, seq {s.seq_length}, "
          f"batch {s.batch_size} per process, {s.steps} steps, {s.nproc} process(es) for the chapters "
          f"torchrun launches" + (f", {args.gpus} GPU(s)" if args.gpus else ", CPU"), flush=True)
    if not args.verbose:
        print(f"each chapter's output goes to its log in {_rel(args.out_dir)}/ (--verbose shows it here)",
              flush=True)
    started = time.perf_counter()
    done = []
    live = sys.stdout.isatty() and not args.verbose  # a line that counts the seconds, rewritten in place
    for chapter in args.chapter_list:
        steps = [st for st in plan if st.chapter == chapter]
        tag, t0 = f"[{index[chapter]}/{total}] {chapter}", time.perf_counter()
        if not args.verbose and not live:
            print(f"{tag}: running ...", end=" ", flush=True)
        for k, st in enumerate(steps, 1):
            log_path = args.out_dir / f"{st.name}.log"
            what = Path(script_of(st)).name + (f" ({k} of {len(steps)})" if len(steps) > 1 else "")
            if args.verbose:
                print(f"\n=== {tag}: {what} (tour at {_clock(time.perf_counter() - started)}) ===", flush=True)
                if st.note:
                    print(f"# {st.note}")
                print(f"$ {st.display}\n", flush=True)

            def progress(seconds, what=what):
                print(f"\r{tag}: {what}, {_clock(time.perf_counter() - t0)} (tour at "
                      f"{_clock(time.perf_counter() - started)})\x1b[K", end="", flush=True)
            try:
                status = run_step(st, log_path, stream=args.verbose, progress=progress if live else None)
            except KeyboardInterrupt:
                print(f"\ninterrupted during {st.chapter}; its output so far is in {_rel(log_path)}",
                      file=sys.stderr)
                return 130
            if status != 0:
                took = _clock(time.perf_counter() - t0)
                print(f"\r{tag}: FAILED\x1b[K" if live else "FAILED", flush=True)
                if not args.verbose:
                    print(log_tail(log_path), file=sys.stderr)
                cause = chapter_error(log_path)
                print(f"\nerror: chapter {st.chapter} failed with exit status {status} after {took}"
                      + (f"; it said:\n  {cause}" if cause else "") +
                      f"\n  command: {st.display}\n  full output: {_rel(log_path)}", file=sys.stderr)
                return 1
            done.append(st)
        took, at = _clock(time.perf_counter() - t0), _clock(time.perf_counter() - started)
        logs = ", ".join(f"{st.name}.log" for st in steps)
        if args.verbose:
            print(f"\n=== {tag}: done in {took} ===", flush=True)
        else:
            print(f"\r{tag}: done in {took} (tour at {at}); {logs}\x1b[K" if live else
                  f"done in {took} (tour at {at}); {logs}", flush=True)
    print_summary(args, done, started)
    # what `python -m tools.results --record` keeps of a tour: how it was run, and when
    write_json(args.out_dir / "tour.json", {
        "command": shlex.join(["python", "-m", "tools.tour", *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - started),
        "cpu_seconds": round(cpu_seconds()), "cpu_cores": os.cpu_count(),
        "chapters": args.chapter_list, "gpus": args.gpus, "sizes": vars(args.sizes)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
