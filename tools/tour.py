"""Run every chapter in order, then compare them: `python -m tools.tour`.

Each chapter is launched as a real subprocess, exactly as its README launches it (python
for 01 and 02, torchrun for 03, 04 and 05), on the embedded dataset with a small model
and short runs: a few minutes on a laptop CPU, larger sizes on GPUs. Every chapter's full
output is saved to `<out>/<name>.log`; at the end the terminal shows a narrow comparison
(tokens/s, loss, notes) and chapter 05's tables (its overlap timeline too), and
`<out>/report.md` holds everything: `tools.report`'s table with every column and its
plots, chapter 05's tables, the explanations, and a list of every file produced.

    python -m tools.tour                      # everything
    python -m tools.tour --chapters 01,03     # a subset
    python -m tools.tour --dry-run            # only print the commands
"""

from __future__ import annotations

import argparse
import os
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
    # about 20-40 s a chapter on a 2-core CPU; two processes, as a reader's laptop can
    return Sizes("small", 128, 8, 30, 2, 4, 0, 4 * 2**20, 5)


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
                   help="optimizer steps per chapter (default: 30 on CPU, 100 on GPU)")
    p.add_argument("--seq-length", type=int, default=None, help="default: 128 on CPU, 1024 on GPU")
    p.add_argument("--batch-size", type=int, default=None, help="per process; default 8")
    p.add_argument("--nproc-per-node", "--nproc", dest="nproc", type=int, default=None,
                   help="processes for 03/04/05 (default: the number of GPUs, else 2)")
    p.add_argument("--out", default=None, help="tour folder (default: outputs/tour-<timestamp>)")
    p.add_argument("--quiet", action="store_true", help="one line per chapter instead of its output")
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

    def train_flags(name):
        return ["--experiment-name", name, "--save-dir", out, "--dataset-name", "stdlib",
                "--model-preset", s.preset, "--seq-length", str(s.seq_length),
                "--batch-size", str(s.batch_size), "--max-steps", str(s.steps),
                # --max-steps decides the length; enough epochs that the small corpus
                # never ends a run first
                "--num-epochs", "100", "--warmup-steps", str(max(1, s.steps // 10)),
                "--log-freq", str(max(1, s.steps // 10)), "--val-batches", str(s.val_batches),
                "--num-workers", str(s.num_workers)]

    plan = []
    for chapter in args.chapter_list:
        c, script = BY_FOLDER[chapter], f"{chapter}/train_llm.py"
        launch = (py_exec, py_show) if c.launcher == "python" else torchrun(s.nproc)
        flags, note = [script, *train_flags(chapter), *c.tour_flags], ""
        if chapter == "02-data-parallel":
            note = ("one process; DataParallel splits each batch over the visible GPUs"
                    if args.gpus > 1 else
                    "one process; with fewer than 2 GPUs DataParallel has nothing to split "
                    "over, so the script trains the plain module and says so")
        elif chapter == "04-checkpointing":  # a crash on purpose, and torchrun's restart
            freq, crash = crash_plan(s.steps)
            launch = tuple(prefix + ["--max-restarts=3"] for prefix in launch)
            flags += ["--ckpt-freq", str(freq), "--crash-at-step", str(crash)]
            note = (f"checkpoints every {freq} steps and crashes on purpose at step {crash}; "
                    f"torchrun restarts it and it resumes from step {freq}")
        elif chapter == "03-ddp":
            note = f"{s.nproc} process(es) of batch {s.batch_size}: global batch {s.nproc * s.batch_size}"
        if chapter == "05-collectives":
            plan += collectives_steps(args, out, step, torchrun)
        else:
            plan.append(step(chapter, chapter, launch, flags, note=note))
    return plan


def collectives_steps(args, out, step, torchrun) -> list[Step]:
    """Chapter 05 needs two or more processes. With fewer GPUs than that, it runs two CPU
    processes over gloo (CUDA hidden), which shows the same collectives, just slower."""
    s: Sizes = args.sizes
    env, note, n = {}, "", s.nproc
    sizes = s
    if n < 2:
        n = 2
        if args.gpus:
            env = {"CUDA_VISIBLE_DEVICES": ""}
            # CPU sizes, except where the reader chose them
            sizes = default_sizes(0)
            for name in ("preset", "steps", "seq_length", "batch_size"):
                if getattr(args, name) is not None:
                    setattr(sizes, name, getattr(args, name))
        note = ("collectives need two or more processes: running 2 CPU processes (gloo)"
                + (" with CUDA hidden" if args.gpus else ""))
    # each mode of ddp_from_scratch trains from scratch: a few steps show it equals DDP
    scratch_steps = max(2, sizes.steps // 5)
    # on GPUs also the overlapped mode (what DDP does); on CPU it only adds minutes
    modes = ["--modes", "naive,bucketed,overlap,ddp"] if args.gpus and not env else []
    # the overlap timeline of every mode on GPUs; on CPU four (all eight would make it the
    # tour's slowest step): naive, DDP with one big bucket, DDP with chapter 03's buckets, FSDP2
    timeline_modes = [] if args.gpus and not env else ["--modes", "naive,ddp,ch03-ddp,fsdp2"]
    d = "05-collectives"
    return [
        step(d, "05-collectives-demo", torchrun(n), [f"{d}/collectives_demo.py"], env, note),
        step(d, "05-bench", torchrun(n),
             [f"{d}/bench_collectives.py", "--max-bytes", str(sizes.bench_max_bytes),
              "--iters", str(sizes.bench_iters), "--save-dir", out,
              "--experiment-name", "05-bench"], env, note),
        step(d, "05-ddp-from-scratch", torchrun(n),
             [f"{d}/ddp_from_scratch.py", "--model-preset", sizes.preset,
              "--seq-length", str(sizes.seq_length), "--batch-size", str(sizes.batch_size),
              "--steps", str(scratch_steps), *modes, "--save-dir", out,
              "--experiment-name", "05-ddp-from-scratch"], env, note),
        # sharded training rebuilt from collectives (ZeRO-1, ZeRO-3, FSDP2)
        step(d, "05-sharded-from-scratch", torchrun(n),
             [f"{d}/sharded_from_scratch.py", "--model-preset", sizes.preset,
              "--seq-length", str(sizes.seq_length), "--batch-size", str(sizes.batch_size),
              "--steps", str(scratch_steps), "--timing-warmup", str(min(2, scratch_steps - 1)),
              "--save-dir", out, "--experiment-name", "05-sharded-from-scratch"], env, note),
        step(d, "05-overlap-timeline", torchrun(n),
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


def run_step(step: Step, log_path: Path, quiet: bool) -> int:
    """Run one command, its output streamed live (unless quiet) and saved to the log.
    Raw bytes pass through, so progress bars keep working in a terminal."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **step.env}
    if not quiet and sys.stdout.isatty():  # the children see a pipe: ask them for bars anyway
        env["LLM_GUIDE_PROGRESS"] = "1"
    with open(log_path, "wb") as log:
        log.write(f"$ {step.display}\n".encode())
        log.flush()
        proc = subprocess.Popen(step.argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
        try:
            while chunk := os.read(proc.stdout.fileno(), 65536):
                log.write(chunk)
                if not quiet:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.flush()
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


def print_summary(args, steps_run: list[Step], started: float):
    """A narrow table in the terminal (tokens/s, loss, notes), the explanations and
    chapter 05's tables; report.md holds all of that, the wide table, the plots and a
    list of every file the tour produced."""
    out = args.out_dir
    print(f"\n=== tour finished in {_clock(time.perf_counter() - started)}: comparison ===\n", flush=True)
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
    if runs:
        table, notes = report.narrow_table(runs)
        print(table)
        if notes:
            print("\nnotes:\n" + "\n".join(notes))
        warning = report.device_warning(runs)
        if warning:
            print(f"\n{warning}")
    for text in said:
        print(f"\n{text}")
    for path, table in tables:
        print(f"\n{path.parent.name} ({_rel(path)}):\n\n{table}")
    print(f"\nthe full comparison (every column), the chapters' tables and the list of all "
          f"{len(produced)} files: {_rel(md)}; beside it:")
    for f in files[1:]:
        print(f"  {_rel(f)}")
    for st in steps_run:
        print(f"  {_rel(out / (st.name + '.log'))}")


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
    print(f"tour of {total} chapter(s) into {_rel(args.out_dir)}: preset {args.sizes.preset}, "
          f"seq {args.sizes.seq_length}, batch {args.sizes.batch_size} per process, "
          f"{args.sizes.steps} steps, {args.sizes.nproc} process(es) for torchrun chapters"
          + (f", {args.gpus} GPU(s)" if args.gpus else ", CPU"), flush=True)
    started = time.perf_counter()
    done = []
    for st in plan:
        tag = f"[{index[st.chapter]}/{total}] {st.chapter}"
        log_path = args.out_dir / f"{st.name}.log"
        t0 = time.perf_counter()
        if args.quiet:
            print(f"{tag}: {Path(script_of(st)).name} ...", end=" ", flush=True)
        else:
            print(f"\n=== {tag}: {Path(script_of(st)).name} "
                  f"(tour at {_clock(t0 - started)}) ===", flush=True)
            if st.note:
                print(f"# {st.note}")
            print(f"$ {st.display}\n", flush=True)
        try:
            status = run_step(st, log_path, args.quiet)
        except KeyboardInterrupt:
            print(f"\ninterrupted during {st.chapter}; its output so far is in {_rel(log_path)}",
                  file=sys.stderr)
            return 130
        took = _clock(time.perf_counter() - t0)
        if status != 0:
            if args.quiet:
                print("FAILED", flush=True)
                print(log_tail(log_path), file=sys.stderr)
            cause = chapter_error(log_path)
            print(f"\nerror: chapter {st.chapter} failed with exit status {status} after {took}"
                  + (f"; it said:\n  {cause}" if cause else "") +
                  f"\n  command: {st.display}\n  full output: {_rel(log_path)}", file=sys.stderr)
            return 1
        done.append(st)
        if args.quiet:
            print(f"ok ({took})", flush=True)
        else:
            print(f"\n=== {tag}: done in {took} ===", flush=True)
    print_summary(args, done, started)
    # what `python -m tools.results --record` keeps of a tour: how it was run, and when
    write_json(args.out_dir / "tour.json", {
        "command": shlex.join(["python", "-m", "tools.tour", *(sys.argv[1:] if argv is None else argv)]),
        "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - started),
        "chapters": args.chapter_list, "gpus": args.gpus, "sizes": vars(args.sizes)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
