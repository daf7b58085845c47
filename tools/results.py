"""The results document, docs/results.md: every figure the READMEs quote, with where and
how it was measured, written from the records the repository keeps (docs/results/*.json),
never typed by hand.

    python -m tools.tour --out outputs/tour                  # measure: the tour...
    python -m tools.results --record outputs/tour            # keep its figures in docs/results/
    python -m tools.results --record gpu-results             # ...or a GPU run's (python -m tools.gpu_check)
    python -m tools.results                                  # docs/results.md, again, from docs/results/

A record holds its provenance (machine, torch, Python, the command, the commit, the
date) beside the figures, and may be given a hand-written `source` note. A record is
never replaced: a second measurement of the same day is kept beside the first
(`<kind>-<date>-2.json`), and the same folder recorded twice is kept once. A folder, a
results.json or a record this command cannot read is one line and exit status 2, before
anything is written. tests/test_results.py fails when docs/results.md is not what this
command writes from the records.
"""

from __future__ import annotations

import platform
import re
import shlex
import sys
from pathlib import Path

from common.cli import REPO_ROOT, Parser
from common.errors import UsageError
from common.files import atomic_write, read_json, write_json
from common.tables import markdown_table

from .gpu_check import commit
from .report import busy, find_summaries, load_runs, step_wall_s

RECORDS = REPO_ROOT / "docs" / "results"
DOCUMENT = REPO_ROOT / "docs" / "results.md"
README = REPO_ROOT / "README.md"
BEGIN, END = "<!-- results: written by python -m tools.results -->", "<!-- end of results -->"


# ---- recording a measurement ---------------------------------------------------------------

def tour_record(folder: Path) -> dict:
    """The figures of a tour's folder (its runs' summary.json, the tables its scripts left,
    tour.json) and their provenance."""
    tour = read_json(folder / "tour.json")
    runs = load_runs(find_summaries([folder]))
    if not isinstance(tour, dict) or not runs:
        raise UsageError(f"{folder} holds no finished tour (tour.json and the runs' summary.json)")
    first = runs[0].summary
    return {"kind": "tour", "title": f"The tour on {first['device_name']}", "command": tour["command"],
            "date": tour["date"], "seconds": tour["seconds"], "cpu_seconds": tour.get("cpu_seconds"),
            "machine": first["device_name"],
            "torch": first["torch_version"], "python": platform.python_version(), "commit": commit(),
            "runs": [{"run": r.name, "processes": r.summary["world_size"],
                      "tokens_per_s": r.summary["tokens_per_s"],
                      "tokens_per_s_per_device": r.summary["tokens_per_s_per_device"],
                      "step_ms": 1e3 * step_wall_s(r.summary), "mfu": r.summary.get("mfu"),
                      "final_loss": r.summary.get("final_loss"), "val_loss": r.summary.get("val_loss"),
                      "busy": busy(r.summary)} for r in runs],
            "tables": {p.parent.name: p.read_text().strip() for p in sorted(folder.glob("*/tables.md"))}}


def shown_command(r: dict) -> str:
    """A record's command; a tour's without its --out folder, which changes no figure:
    the command a reader types."""
    command = r["command"]
    if r["kind"] != "tour":
        return command
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word == "--out" and i + 1 < len(words):
            return shlex.join(words[:i] + words[i + 2:])
        if word.startswith("--out="):
            return shlex.join(words[:i] + words[i + 1:])
    return command


def gpu_record(folder: Path) -> dict:
    """What `python -m tools.gpu_check --out folder` measured: results.json, whole."""
    results = read_json(folder / "results.json")
    if not isinstance(results, dict) or not isinstance(results.get("environment"), dict):
        raise UsageError(f"{folder} holds no results.json of python -m tools.gpu_check "
                         f"(its 'environment' is missing or not an object)")
    env = results["environment"]
    driver = (env.get("nvidia_smi") or {}).get("driver")
    details = ", ".join(filter(None, [driver and f"driver {driver}", env.get("cuda") and f"CUDA {env['cuda']}"]))
    return {"kind": "gpu", "title": f"The GPU suite and benchmark on {', '.join(env.get('cuda_devices') or ['?'])}",
            "command": "python -m tools.gpu_check --out " + folder.name, "date": str(env["date_utc"])[:10],
            "machine": ", ".join(env.get("cuda_devices") or []) + (f" ({details})" if details else ""),
            "torch": env["torch"],
            "python": env["python"], "commit": env.get("commit"), "results": results}


DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
# what a malformed record or measurement raises while it is read or written out
MALFORMED = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError)


def what_is_wrong(e: BaseException) -> str:
    return f"no {e.args[0]!r}" if isinstance(e, KeyError) and e.args else str(e) or type(e).__name__


def check_record(r) -> None:
    """Raise ValueError (or what reading it raises) unless `r` is a record this command
    can write out: a kind, a date, and every field its sections read."""
    if not isinstance(r, dict) or r.get("kind") not in ("tour", "gpu"):
        raise ValueError("its kind is not 'tour' or 'gpu'")
    if not (isinstance(r.get("date"), str) and DATE.fullmatch(r["date"])):
        raise ValueError(f"its date {r.get('date')!r} is not YYYY-MM-DD")
    document([r]), readme_block([r])


def same_measurement(a: dict, b: dict) -> bool:
    """The same folder recorded twice: equal but for when and by what it was recorded."""
    later = ("commit", "python", "source")
    return {k: v for k, v in a.items() if k not in later} == {k: v for k, v in b.items() if k not in later}


def shown(path: Path) -> str:
    """A path as typed at the repository root."""
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def record(folder: Path) -> Path:
    """Keep a measurement's figures in docs/results/<kind>-<date>.json (-2, -3, ... when
    the day has a record already); returns the file. Nothing is written unless the
    measurement reads whole; an earlier record is never replaced."""
    if not folder.is_dir():
        raise UsageError(f"--record {str(folder)!r}: no such folder (a tour's --out, or a GPU run's)")
    try:
        made = gpu_record(folder) if (folder / "results.json").is_file() else tour_record(folder)
        check_record(made)
    except MALFORMED as e:
        raise UsageError(f"{folder} holds a measurement this command cannot read ({what_is_wrong(e)}); "
                         f"nothing was recorded") from None
    RECORDS.mkdir(parents=True, exist_ok=True)
    for n in range(1, 1000):
        path = RECORDS / f"{made['kind']}-{made['date']}{'' if n == 1 else f'-{n}'}.json"
        if not path.exists():
            break
        if same_measurement(read_json(path) or {}, made):
            raise UsageError(f"{folder} is recorded already, in {shown(path)}")
    write_json(path, made)
    return path


# ---- the document ----------------------------------------------------------------------------

def _num(v, digits=0, scale=1.0, suffix="") -> str:
    return "n/a" if not isinstance(v, (int, float)) else f"{v * scale:,.{digits}f}{suffix}"


def provenance(r: dict) -> str:
    lines = [f"- measured on {r['machine']}, torch {r['torch']}, Python {r['python']}, on {r['date']}",
             f"- command: `{shown_command(r)}`" + (f" ({took(r)} in all)" if r.get("seconds") else ""),
             f"- code: commit `{r['commit']}`" if r.get("commit") else "- code: commit unknown"]
    if r.get("source"):
        lines.append(f"- source: {r['source']}")
    return "\n".join(lines)


def took(r: dict) -> str:
    """'389 s', or '389 s, 586 CPU-seconds' where the record has them."""
    return f"{r['seconds']} s{cpu_seconds(r)}"


def cpu_seconds(r: dict) -> str:
    """', 586 CPU-seconds', or nothing where the record has none."""
    cpu = r.get("cpu_seconds")
    return f", {cpu:,} CPU-seconds" if isinstance(cpu, int) else ""


def tour_section(r: dict) -> str:
    rows = [[x["run"], str(x["processes"]), _num(x["tokens_per_s"]), _num(x["tokens_per_s_per_device"]),
             _num(x["step_ms"], 1), _num(x["mfu"], 1, 100, "%"), _num(x["final_loss"], 4),
             _num(x["val_loss"], 4), "busy machine" if x["busy"] else ""] for x in r["runs"]]
    header = ["run", "processes", "tokens/s", "per device", "step ms", "MFU", "final loss", "val loss", "note"]
    parts = [markdown_table(header, rows, right=set(range(1, 8)))]
    parts += [f"#### {name}\n\n{table}" for name, table in r["tables"].items()]
    return "\n\n".join(parts)


def gpu_section(r: dict) -> str:
    res, parts = r["results"], []
    targets = [[t["target"], f"{t['at_least']:g}", _num(t["value"], 3),
                {True: "met", False: "NOT met"}.get(t["met"], "-")] for t in res.get("targets", [])]
    if targets:
        parts.append(markdown_table(["target", "at least", "measured", ""], targets, right={1, 2}))
    shown = ("tokens_per_s", "mfu", "peak_memory_mb", "checked")  # a test that measured none of them: no row
    tests = {k: v for k, v in (res.get("gpu_tests") or {}).items()
             if isinstance(v, dict) and any(v.get(key) is not None for key in shown)}
    if tests:
        checked = any(t.get("checked") for t in tests.values())  # (a column only where some test says)
        rows = [[name, _num(t.get("tokens_per_s")), _num(t.get("mfu"), 1, 100, "%"),
                 _num(t.get("peak_memory_mb"), 0, 1, " MB"), *([t.get("checked", "")] if checked else [])]
                for name, t in tests.items()]
        header = ["GPU test", "tokens/s", "MFU", "peak memory", *(["what it checked"] if checked else [])]
        parts.append(markdown_table(header, rows, right={1, 2, 3}))
    bench = (res.get("bench_model") or {}).get("rows") or []
    if bench:
        rows = [[b["preset"], b["mode"], b["step"], _num(b["tokens_per_s"]), _num(b["mfu"], 1, 100, "%")]
                for b in bench]
        parts.append(markdown_table(["preset", "mode", "step", "tokens/s", "MFU"], rows, right={3, 4}))
    return "\n\n".join(parts)


def document(records: list[dict]) -> str:
    parts = ["# Measured results",
             "Written by `python -m tools.results` from the records in [results/](results/); do not edit "
             "by hand. Each section says where, when and with which command its figures were measured. "
             "Speeds on a CPU depend on the machine and on what else runs on it: a run on a busy "
             "machine says so."]
    for r in records:
        body = tour_section(r) if r["kind"] == "tour" else gpu_section(r)
        parts.append(f"## {r['title']}, {r['date']}\n\n{provenance(r)}\n\n{body}")
    return "\n\n".join(parts) + "\n"


def readme_block(records: list[dict]) -> str:
    """The README's small results table: the newest tour's chapters, and the newest GPU
    run's targets, each linking to its section of docs/results.md."""
    parts = [BEGIN]
    tours = [r for r in records if r["kind"] == "tour"]
    if tours:
        t = tours[-1]
        rows = [[x["run"], str(x["processes"]), _num(x["tokens_per_s"]), _num(x["final_loss"], 4)]
                for x in t["runs"] if x["run"][:2] != "05"]
        busy = " (a busy machine: its speeds are not comparable)" if any(x["busy"] for x in t["runs"]) else ""
        minutes = f"{t['seconds'] // 60} min {t['seconds'] % 60:02d} s" if isinstance(t.get("seconds"), int) else "?"
        parts.append(f"The tour (`{shown_command(t)}`) on {t['machine']}{busy}, torch {t['torch']}, {t['date']}: "
                     f"{minutes}{cpu_seconds(t)}.\n\n"
                     + markdown_table(["run", "processes", "tokens/s", "final loss"], rows, right={1, 2, 3}))
    gpus = [r for r in records if r["kind"] == "gpu"]
    if gpus:
        g = gpus[-1]
        rows = [[t["target"], _num(t["value"], 3), f"{t['at_least']:g}"] for t in g["results"].get("targets", [])]
        parts.append(f"On {g['machine'].split(' (')[0]}, torch {g['torch']}, {g['date']}:\n\n"
                     + markdown_table(["measured", "value", "target, at least"], rows, right={1, 2}))
    parts.append("Every figure, with where, when and how it was measured: [docs/results.md](docs/results.md).")
    return "\n\n".join(parts + [END])


def with_readme_block(text: str, block: str) -> str:
    """`text` (the README) with its results block replaced by `block`."""
    if BEGIN not in text or END not in text:
        raise UsageError(f"README.md has no results block ({BEGIN} ... {END})")
    head, rest = text.split(BEGIN, 1)
    return head + block + rest.split(END, 1)[1]


def load_records(folder: Path | None = None) -> list[dict]:
    """Every record in `folder` (default RECORDS), oldest first by kind and date; one that
    is not a record this command can read raises UsageError naming it."""
    folder = RECORDS if folder is None else folder
    records = []
    for path in sorted(folder.glob("*.json")):
        r = read_json(path)
        try:
            check_record(r)
        except MALFORMED as e:
            why = "not JSON" if r is None else what_is_wrong(e)
            raise UsageError(f"not a record: {path.name} in {folder} ({why}); fix it or move it away") from None
        n = path.stem.rsplit("-", 1)[-1]  # the day's second record (-2) after its first
        records.append(((r["kind"], r["date"], int(n) if path.stem.count("-") == 4 and n.isdigit() else 1), r))
    return [r for _, r in sorted(records, key=lambda kr: kr[0])]


def main(argv=None) -> int:
    p = Parser(prog="python -m tools.results", description=__doc__.split("\n\n")[0])
    p.add_argument("--record", type=Path, help="a tour's folder or a GPU run's --out folder to keep first")
    args = p.parse_args(argv)
    try:
        load_records()  # every record kept so far reads, before one is added
        if args.record:
            print(f"recorded {shown(record(args.record))}")
        records = load_records()
        text = document(records)
        readme = with_readme_block(README.read_text(), readme_block(records))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    atomic_write(DOCUMENT, lambda f: f.write(text.encode()))
    atomic_write(README, lambda f: f.write(readme.encode()))
    print(f"wrote {shown(DOCUMENT)} and README.md's results from {len(records)} record(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
