"""Lay many runs side by side: `python -m tools.report [RUN_DIR ...]`.

Reads every `summary.json` under the given folders (default: `outputs/`), prints one
Markdown comparison table and writes, into `--out`:

  report.md          the same table, with warnings and notes
  tokens_per_s.png   tokens/s per run (horizontal bars coloured by device; a --padded
                     run's real tokens/s inside its bar; `! busy` on runs whose machine
                     was loaded over its cores, as the table's `!`)
  step_time.png      mean step time (wall), in parts: data / forward / backward / update,
                     and the rest (other: waiting for other ranks or pipeline stages)
  loss.png           the loss curve of every run (from its metrics.jsonl), at most
                     8 curves per panel so each keeps its own colour

The plots stay readable with many runs: one bar row per run, a fixed width and font,
the height growing with the number of runs.

Numbers measured on different hardware are not comparable as equals, so the device is
part of every row, and a warning line precedes the table when the runs come from more
than one device. The threads and machine-load columns say whether a CPU run shared its
cores (load marked `!` when it went above the machine's core count).

A run whose figures cannot be read (a summary that is not JSON, incomplete, nested too
deep, or with a non-finite tokens/s or step time) is left out with one warning line, and
so is a summary.json that is not a regular file (a FIFO is never opened); a metrics line
that is not JSON, or whose step or loss is no finite number, is skipped. An --out that
cannot be written, or that holds a report.md or plot this command did not write (a plot
it wrote carries a `Source` note in its PNG), is refused before any work.

Archived runs (chapter 04's --fresh moves an earlier run into `<run>/archive-<time>/`)
are left out by default, with one line saying how many; `--include-archived` adds them,
labelled `<run> (archived <time>)`. A folder named directly is always read, archive or not.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common.cli import DEFAULT_SAVE_DIR, Parser, check_writable_folder
from common.files import atomic_write
from common.errors import UsageError
from common.metrics import busy as machine_busy, read_metrics
from common.tables import format_flops, markdown_table
from common.timing import PHASES

# Keys without which a summary cannot be placed in the table.
REQUIRED_KEYS = ("chapter", "experiment_name", "launcher", "world_size", "num_devices",
                 "device_name", "dtype", "tokens_per_s", "tokens_per_s_per_device",
                 "step_time_s", "peak_memory_mb")
PLOTS = ("tokens_per_s.png", "step_time.png", "loss.png")
TITLE = "# Run comparison"  # report.md's first line: how a report.md this command wrote is known
SOURCE = "python -m tools.report"  # each plot's PNG `Source` note: how a plot this command wrote is known
PNG_SOURCE = b"tEXtSource\x00" + SOURCE.encode()  # (a text chunk, before the image data)
ARCHIVE_PREFIX = "archive-"   # common.runfolder.archive_run's folder names
CURVES_PER_PANEL = 8


@dataclass
class Run:
    path: Path                 # the summary.json
    summary: dict
    metrics: list[dict] = field(default_factory=list)  # metrics.jsonl beside it, if any

    @property
    def name(self) -> str:
        """The experiment name; an archived run's says so: 'run (archived 20261122-010203)'."""
        folder = self.path.parent.name
        if folder.startswith(ARCHIVE_PREFIX):
            return f"{self.summary['experiment_name']} (archived {folder[len(ARCHIVE_PREFIX):]})"
        return str(self.summary["experiment_name"])

    @property
    def device(self) -> str:
        return f"{self.summary['device_name']} × {self.summary['num_devices']}"


def find_summaries(paths, include_archived: bool = False) -> list[Path]:
    """Every summary.json named or found (recursively) under the given paths, once each;
    those in an `archive-*` folder below a given path only with `include_archived`.
    A path that does not exist raises FileNotFoundError."""
    found: dict[Path, None] = {}  # ordered set
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{str(p)!r} does not exist")
        candidates = [p] if p.is_file() else sorted(p.rglob("summary.json"))
        for c in candidates:
            archived = any(part.startswith(ARCHIVE_PREFIX)
                           for part in c.relative_to(p).parts[:-1]) if c != p else False
            if include_archived or not archived:
                found.setdefault(c.resolve(), None)
    return list(found)


def finite(v) -> bool:
    """A number a float can hold, not NaN or infinite (an integer of 400 digits is not)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def read_loss_curve(path: Path) -> list[dict]:
    """Records of metrics.jsonl that carry a loss, one per step. A resumed run (chapter 04)
    logs the steps between its last checkpoint and the crash twice; the later record
    (the run that survived) wins. A torn or unreadable line, or a non-finite loss (a
    diverged step), is left out rather than fatal."""
    by_step: dict[int, dict] = {}
    for rec in read_metrics(path):  # lines that are not JSON (torn, binary) are skipped
        if finite(rec.get("step")) and finite(rec.get("loss")):
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def load_runs(summary_paths) -> list[Run]:
    """Parse each summary; a corrupt or incomplete one is skipped with a warning line.
    Sorted by chapter, then experiment name."""
    runs = []
    for path in map(Path, summary_paths):
        try:
            if not path.is_file():  # a FIFO, socket or device: reading it could block forever
                raise ValueError("not a regular file, not opened")
            summary = json.loads(path.read_text())
            if not isinstance(summary, dict):
                raise ValueError("not a JSON object")
            if "diverged_at_step" in summary or ("tokens_per_s" not in summary and summary.get("notes")):
                why = (f"the run diverged at step {summary['diverged_at_step']}" if "diverged_at_step" in summary
                       else str(summary["notes"][0]))
                print(f"note: leaving out {path}: no speeds to compare ({why})", file=sys.stderr)
                continue
            missing = [k for k in REQUIRED_KEYS if k not in summary]
            if missing:
                raise ValueError(f"missing keys {', '.join(missing)}")
            numbers = [summary["tokens_per_s"], *(summary["step_time_s"].get(p) for p in PHASES)]
            if not all(map(finite, numbers)) or not finite(step_wall_s(summary)):
                raise ValueError("tokens_per_s, the step time or one of its phases is not a number, or not finite")
            run = Run(path, summary)
            table_rows([run])  # every cell must format: fail here, not halfway through
            row_labels([run]), tokens_labels([run])  # and every plot label (the device type)
        except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError) as e:
            print(f"warning: skipping {path}: {e}", file=sys.stderr)
            continue
        metrics_path = path.with_name("metrics.jsonl")
        run.metrics = read_loss_curve(metrics_path) if metrics_path.is_file() else []
        runs.append(run)
    runs.sort(key=lambda r: (str(r.summary["chapter"]), str(r.name)))
    return runs


def step_wall_s(s: dict) -> float:
    """A step's wall time, what tokens/s is measured over (the sum of the phases in a
    summary older than the wall time's field)."""
    st = s["step_time_s"]
    return s.get("step_wall_s", st.get("total", sum(st[p] for p in PHASES)))


def step_parts_s(s: dict) -> dict[str, float]:
    """The wall time of a step in parts: its timed phases, and `other`, the rest (waiting
    for other ranks or pipeline stages, logging). On a GPU the phases are device time,
    which can add up to a little more than the wall: other is then 0."""
    parts = {p: s["step_time_s"][p] for p in PHASES}
    parts["other"] = max(0.0, step_wall_s(s) - sum(parts.values()))
    return parts


def _num(v, digits=1, scale=1.0, suffix=""):
    return "n/a" if v is None else f"{v * scale:,.{digits}f}{suffix}"


def _real(s: dict) -> str:
    """A --padded run's real tokens/s; '-' for a packed run (every token is real)."""
    v = s.get("real_tokens_per_s")
    return "-" if v is None else _num(v, 0)


def _flops(v):
    return "n/a" if v is None else format_flops(v)


def _dict(v) -> dict:
    return v if isinstance(v, dict) else {}


def _cell(v) -> str:
    """A setting that older summaries may lack: '-' when missing."""
    return "-" if v is None else str(v)


def _threads(s: dict) -> str:
    """'2 × 2': threads per process × processes on the machine."""
    t, procs = s.get("threads_per_process"), s.get("processes_per_machine")
    if t is None:
        return "-"
    return f"{t} × {procs}" if procs is not None else str(t)


def busy(s: dict) -> bool:
    """The machine was busy during the run (common.peak_flops.busy): other work took CPU
    time from it, so its speed is not comparable."""
    load, cores = s.get("load_avg_max"), s.get("cpu_cores")
    return isinstance(load, (int, float)) and isinstance(cores, int) and machine_busy(load, cores)


def _load(s: dict) -> str:
    """'5.3/2 !': the highest load average during the run over the machine's cores;
    '!' when it went over the cores by more than half a core (the run shared its CPU)."""
    load, cores = s.get("load_avg_max"), s.get("cpu_cores")
    if load is None:
        return "-"
    if cores is None:
        return f"{load:.1f}"
    return f"{load:.1f}/{cores}" + (" !" if busy(s) else "")


def table_rows(runs: list[Run]) -> list[dict]:
    """One dict of formatted cells per run, in table order."""
    rows = []
    for r in runs:
        s = r.summary
        ck = s.get("checkpoint") or {}
        kind = {"cuda_max_allocated": "CUDA", "process_peak_rss": "RSS"}.get(
            s.get("peak_memory_kind"), s.get("peak_memory_kind") or "")
        args = _dict(s.get("args"))
        rows.append({
            "chapter": str(s["chapter"]),
            "run": str(r.name),
            "launcher": str(s["launcher"]),
            "world size": str(s["world_size"]),
            "device": r.device,
            "threads": _threads(s),
            "load/cores": _load(s),
            "dtype": str(s["dtype"]),
            "preset": str(s.get("preset", "n/a")),
            "seq": _cell(s.get("seq_length", args.get("seq_length"))),
            "batch": _cell(s.get("batch_size", args.get("batch_size"))),
            "accum": _cell(s.get("grad_accum", args.get("grad_accum"))),
            "data": _cell(_dict(s.get("data")).get("form")),
            "tokens/step": _num(s.get("tokens_per_step"), 0),
            "tokens/s": _num(s["tokens_per_s"], 0),
            "real tokens/s": _real(s),
            "tokens/s/device": _num(s["tokens_per_s_per_device"], 0),
            **{f"{p} ms": _num(v, 1, 1e3) for p, v in step_parts_s(s).items()},
            "step ms": _num(step_wall_s(s), 1, 1e3),
            "peak memory": f"{_num(s['peak_memory_mb'], 0)} MB {kind}".rstrip(),
            "model FLOP/s": _flops(s.get("model_flops_per_s")),
            "MFU": _num(s.get("mfu"), 1, 100, "%"),
            "peak FLOP/s": (f"{_flops(s.get('peak_flops'))} ({s['peak_source']})"
                            if s.get("peak_source") else "n/a"),
            "final loss": _num(s.get("final_loss"), 4),
            "ckpt save ms": _num(ck.get("save_s"), 0, 1e3) if ck else "-",
        })
    return rows


def comparison_table(runs: list[Run]) -> str:
    """A Markdown table, one row per run, columns aligned for reading in a terminal."""
    rows = table_rows(runs)
    cols = list(rows[0])
    left = {"chapter", "run", "launcher", "device", "threads", "dtype", "preset", "data",
            "peak memory", "peak FLOP/s"}  # text
    return markdown_table(cols, [[r[c] for c in cols] for r in rows],
                          right={i for i, c in enumerate(cols) if c not in left})


def device_warning(runs: list[Run]) -> str | None:
    names = sorted({str(r.summary["device_name"]) for r in runs})
    if len(names) > 1:
        return (f"warning: these runs come from {len(names)} different devices "
                f"({'; '.join(names)}): compare numbers only between rows of the same device.")
    return None


def run_notes(r: Run) -> list[str]:
    """A run's notes: a list of lines; a lone string (a hand-edited summary) is one note."""
    n = r.summary.get("notes") or []
    return [n] if isinstance(n, str) else [str(x) for x in n]


def notes_section(runs: list[Run]) -> list[str]:
    return [f"- {r.name}: {note}" for r in runs for note in run_notes(r)]


def narrow_table(runs: list[Run]) -> tuple[str, list[str]]:
    """For a terminal: the figures a reader compares first (tokens/s, loss) in a table a
    line fits, and the runs' notes numbered below it. report.md has every column."""
    notes, rows = [], []
    padded = any(r.summary.get("real_tokens_per_s") is not None for r in runs)
    for r in runs:
        s = r.summary
        refs = []
        for note in run_notes(r):  # the Tracker's own say when the machine was busy
            if note not in notes:
                notes.append(note)
            refs.append(str(notes.index(note) + 1))
        rows.append([_short(str(r.name), 32), str(s["world_size"]), _num(s["tokens_per_s"], 0),
                     *([_real(s)] if padded else []),
                     _num(s["tokens_per_s_per_device"], 0), _num(s.get("final_loss"), 4),
                     _num(s.get("val_loss"), 4), ", ".join(refs) or "-"])
    header = ["run", "processes", "tokens/s", *(["real tokens/s"] if padded else []),
              "per device", "final loss", "val loss", "notes"]
    table = markdown_table(header, rows, right=set(range(1, len(header) - 1)))
    return table, [f"{i}. {n}" for i, n in enumerate(notes, 1)]


def render_report(runs: list[Run]) -> str:
    """What is printed and saved as report.md (without the image links)."""
    parts = []
    warning = device_warning(runs)
    if warning:
        parts.append(warning)
    parts.append(comparison_table(runs))
    parts.append("tokens/s counts tokens of the whole global batch (all processes); "
                 "step times are means over measured steps (warm-up left out). "
                 "seq, batch (per process), accum (gradient accumulation steps) and data "
                 "(packed/padded) are the run's settings; threads = threads per process × "
                 "processes on the machine; load/cores = the highest load average during "
                 "the run over the machine's cores, ! when above them (a busy machine: "
                 "speeds not comparable). real tokens/s (--padded runs) leaves the padding "
                 "out: what the padding costs. "
                 "Peak memory: CUDA = allocator peak per GPU, RSS = peak resident set of "
                 "one process. MFU = model FLOP/s per device over the peak FLOP/s: a "
                 "known GPU's datasheet peak, else the matmul peak measured on the device "
                 "(`python -m tools.peak`).")
    notes = notes_section(runs)
    if notes:
        parts.append("Notes:\n" + "\n".join(notes))
    return "\n\n".join(parts)


# --- plots -----------------------------------------------------------------------------
# Fixed width and font; the height grows with the number of runs, so labels never shrink
# or overlap however many runs there are.

FIG_WIDTH_IN, DPI, FONT_SIZE = 10, 110, 9
ROW_IN = 0.32  # height of one bar row


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; works without a display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> Path:
    """Whole or not at all: a full disk leaves the previous report's image as it was."""
    try:
        atomic_write(path, lambda f: fig.savefig(f, dpi=DPI, format="png", metadata={"Source": SOURCE}))
    finally:
        plt.close(fig)
    return path


BUSY_MARK = "! busy"


def row_labels(runs: list[Run]) -> list[str]:
    """A bar row's label: the run, its device and, where the machine was busy during the
    run (as the table's `!`), a mark saying its speed is not comparable."""
    return [f"{_short(r.name)} ({r.summary['device']} × {r.summary['num_devices']})"
            + (f" {BUSY_MARK}" if busy(r.summary) else "") for r in runs]


def tokens_labels(runs: list[Run]) -> list[str]:
    """The value beside a tokens/s bar: '12,345', '12,345 (8,765 real)' for a --padded run,
    and the busy mark where the run shared its machine."""
    labels = []
    for r in runs:
        s = r.summary
        text = f"{s['tokens_per_s']:,.0f}"
        if isinstance(s.get("real_tokens_per_s"), (int, float)):
            text += f" ({s['real_tokens_per_s']:,.0f} real)"
        labels.append(text + (f"  {BUSY_MARK}: not comparable" if busy(s) else ""))
    return labels


def _bar_figure(plt, runs, title: str, xlabel: str):
    """One horizontal bar row per run, the first run on top; labels = run names."""
    fig, ax = plt.subplots(figsize=(FIG_WIDTH_IN, 1.6 + ROW_IN * len(runs)),
                           layout="constrained")
    ax.set_yticks(range(len(runs)), row_labels(runs))
    ax.set_ylim(len(runs) - 0.5, -0.5)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    return fig, ax


def _short(label: str, limit: int = 72) -> str:
    """Long labels lose their middle: the start and the end (an archive's time) stay."""
    if len(label) <= limit:
        return label
    head = (limit - 1) // 2
    return label[:head] + "…" + label[len(label) - (limit - 1 - head):]


def _panels(runs: list[Run]) -> list[list[Run]]:
    """Runs in groups of at most CURVES_PER_PANEL, a chapter's runs together where they fit
    (runs are sorted by chapter)."""
    chapters: dict[str, list[Run]] = {}
    for r in runs:
        chapters.setdefault(str(r.summary["chapter"]), []).append(r)
    panels: list[list[Run]] = []
    for group in chapters.values():
        for i in range(0, len(group), CURVES_PER_PANEL):
            chunk = group[i:i + CURVES_PER_PANEL]
            if panels and len(panels[-1]) + len(chunk) <= CURVES_PER_PANEL:
                panels[-1].extend(chunk)
            else:
                panels.append(chunk)
    return panels


def _device_colours(runs):
    names = list(dict.fromkeys(str(r.summary["device_name"]) for r in runs))
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    return {n: palette[i % len(palette)] for i, n in enumerate(names)}


def plot_tokens_per_s(runs: list[Run], path: Path) -> Path:
    plt = _pyplot()
    colours = _device_colours(runs)
    values = [r.summary["tokens_per_s"] for r in runs]
    with plt.rc_context({"font.size": FONT_SIZE}):
        fig, ax = _bar_figure(plt, runs, "Training throughput", "tokens/s (whole global batch)")
        bars = ax.barh(range(len(runs)), values,
                       color=[colours[str(r.summary["device_name"])] for r in runs],
                       hatch=["//" if busy(r.summary) else "" for r in runs])
        # a --padded run's real tokens: a thin dark bar inside its bar
        real = [r.summary.get("real_tokens_per_s") for r in runs]
        rows = [i for i, v in enumerate(real) if isinstance(v, (int, float))]
        if rows:
            ax.barh(rows, [real[i] for i in rows], height=0.3, color="black", alpha=0.55,
                    label="real tokens (padding left out)")
            ax.legend(loc="lower right")
        ax.bar_label(bars, labels=tokens_labels(runs), padding=3)
        ax.set_xlim(0, 1.6 * max(max(values), 1e-9))  # room for the value labels
        # one legend entry per device, so bars of different hardware are not read as equals
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
        fig.legend(handles, list(colours), loc="outside lower center",
                   ncols=min(3, len(colours)))
        return _save(plt, fig, path)


def plot_step_time(runs: list[Run], path: Path) -> Path:
    plt = _pyplot()
    with plt.rc_context({"font.size": FONT_SIZE}):
        fig, ax = _bar_figure(plt, runs, "Where a step's time goes", "mean step time, wall (ms)")
        y = range(len(runs))
        left = [0.0] * len(runs)
        parts = [step_parts_s(r.summary) for r in runs]
        for part in (*PHASES, "other"):
            ms = [p[part] * 1e3 for p in parts]
            ax.barh(y, ms, left=left, label="other (waits, untimed)" if part == "other" else part,
                    color="lightgrey" if part == "other" else None, hatch="//" if part == "other" else "")
            left = [a + m for a, m in zip(left, ms)]
        walls = [step_wall_s(r.summary) * 1e3 for r in runs]
        for i, (total, wall) in enumerate(zip(left, walls)):
            ax.annotate(f"{wall:,.1f}", (total, i), xytext=(3, 0),
                        textcoords="offset points", va="center")
        ax.set_xlim(0, 1.15 * max(max(left), 1e-9))
        fig.legend(loc="outside lower center", ncols=len(PHASES) + 1)
        return _save(plt, fig, path)


def plot_loss(runs: list[Run], path: Path) -> Path | None:
    """Loss curves, at most CURVES_PER_PANEL per panel (panels stacked, shared axes, a
    chapter's runs together), so every curve in a panel has its own colour; None (nothing
    written) when no run has metrics."""
    with_metrics = [r for r in runs if r.metrics]
    if not with_metrics:
        return None
    plt = _pyplot()
    groups = _panels(with_metrics)
    colours = plt.get_cmap("tab10").colors
    # runs that should coincide (01 and 02, 03 and 04) do: varied line styles keep the
    # curve underneath visible
    styles = ["-", "--", ":", "-."]
    with plt.rc_context({"font.size": FONT_SIZE}):
        fig, axes = plt.subplots(len(groups), 1, figsize=(FIG_WIDTH_IN, 0.6 + 3.2 * len(groups)),
                                 sharex=True, sharey=True, layout="constrained", squeeze=False)
        for ax, group in zip(axes[:, 0], groups):
            for i, r in enumerate(group):
                ax.plot([m["step"] for m in r.metrics], [m["loss"] for m in r.metrics],
                        color=colours[i], linestyle=styles[i % len(styles)],
                        linewidth=2.2 - 0.3 * (i % len(styles)),
                        marker="." if len(r.metrics) < 30 else None, label=_short(r.name, 64))
            ax.set_ylabel("training loss")
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=FONT_SIZE - 1)
            chapters = sorted({str(r.summary["chapter"]) for r in group})
            ax.set_title(", ".join(chapters), fontsize=FONT_SIZE)
        axes[-1, 0].set_xlabel("step")
        fig.suptitle("Loss (a step of a W-process run covers W times the samples)")
        return _save(plt, fig, path)


def write_report(runs: list[Run], out: Path, sections=()) -> tuple[str, list[Path]]:
    """Write report.md and the plots into `out`; return the report text and the files.
    `sections` (Markdown) follow the table in report.md; with no runs, report.md holds
    them alone."""
    out.mkdir(parents=True, exist_ok=True)
    text = render_report(runs) if runs else ""
    written = [plot_tokens_per_s(runs, out / "tokens_per_s.png"),
               plot_step_time(runs, out / "step_time.png")] if runs else []
    loss = plot_loss(runs, out / "loss.png")
    if loss:
        written.append(loss)
    images = "\n".join(f"![{p.stem}]({p.name})" for p in written)
    md = out / "report.md"
    body = "\n\n".join(filter(None, [TITLE, text, *sections, images])) + "\n"
    atomic_write(md, lambda f: f.write(body.encode()))
    return text, [md, *written]


def written_here(path: Path) -> bool:
    """Whether `path` is a file this command wrote: report.md whose first line is TITLE,
    a plot whose PNG carries the Source note. Only a regular file is read (a FIFO could
    block)."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        if path.suffix == ".md":
            return f.readline(len(TITLE) + 2).rstrip(b"\r\n") == TITLE.encode()
        return PNG_SOURCE in f.read(4096)


def check_not_theirs(out: Path) -> None:
    """report.md and the plots in the output folder are replaced only if this command
    wrote them: a user's own notes or images of those names are not. Raises UsageError."""
    for path in (out / "report.md", *(out / name for name in PLOTS)):
        if (path.exists() or path.is_symlink()) and not written_here(path):
            why = (f"its first line is not {TITLE!r}" if path.suffix == ".md" else
                   f"its PNG has no Source note {SOURCE!r}")
            raise UsageError(f"{str(path)!r} exists and was not written by this command ({why}); "
                             f"move it, or choose another --out")


def main(argv=None) -> int:
    p = Parser(prog="python -m tools.report", description="Compare runs: Markdown table and PNG plots.")
    p.add_argument("run_dirs", nargs="*", metavar="RUN_DIR",
                   help=f"run folders or their parents (default: {DEFAULT_SAVE_DIR})")
    p.add_argument("--include-archived", action="store_true",
                   help="also report earlier runs kept in <run>/archive-*/ folders "
                        "(labelled 'archived')")
    p.add_argument("--out", default=None,
                   help="output folder (default: the RUN_DIR when one is given, "
                        "else outputs/report)")
    args = p.parse_args(argv)
    paths = args.run_dirs or [str(DEFAULT_SAVE_DIR)]
    if args.out:
        out = Path(args.out).expanduser()  # '~/report' quoted: the home folder, as the shell would
    elif len(args.run_dirs) == 1:
        out = Path(args.run_dirs[0])
        out = out.parent if out.is_file() else out
    else:
        out = DEFAULT_SAVE_DIR / "report"
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {str(out)!r} exists and is not a folder")
        check_writable_folder(out, "--out")
        check_not_theirs(out)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        summaries = find_summaries(paths, include_archived=args.include_archived)
        left_out = len(find_summaries(paths, include_archived=True)) - len(summaries)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = load_runs(summaries)
    if not runs:
        print(f"error: no readable summary.json under {', '.join(paths)}", file=sys.stderr)
        return 2
    try:
        text, files = write_report(runs, out)
    except OSError as e:  # the disk filled up, or the folder changed meanwhile
        print(f"error: writing the report into {out} failed: {e.strerror or e}", file=sys.stderr)
        return 1
    print(text)
    print(f"\nwrote {', '.join(f.name for f in files)} to {out}")
    if left_out:
        print(f"left out {left_out} archived run(s) (in <run>/archive-*/); "
              f"--include-archived adds them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
