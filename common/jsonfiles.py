"""A run's JSON files: `metrics.jsonl` (one object per logged step) and whole JSON files
(`summary.json`, caches), written so that a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path


class MetricsWriter:
    """Appends one JSON line per logged step; line-buffered so a crash loses nothing."""

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.f = open(self.path, "a" if append else "w", buffering=1)

    def write(self, record: dict):
        self.f.write(json.dumps(record) + "\n")

    def close(self):
        self.f.close()

    def discard(self):
        """Close after a failed write (a full disk): what is still buffered is dropped,
        not retried at exit, where it would fail again as an 'Exception ignored' report."""
        try:
            self.f.close()
        except OSError:
            pass


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl; a line that is not one JSON object (torn by a kill
    or a full disk mid-write, not UTF-8, nested past the parser's depth) is skipped, not
    fatal: one bad line must not block a resume or a report."""
    records = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record = json.loads(line.decode("utf-8"))
            except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def read_json_or_none(path: str | os.PathLike) -> dict | list | None:
    """A whole JSON file, or None if it is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def write_jsonl(path: str | os.PathLike, records: list[dict]):
    """Rewrite a JSON-lines file atomically (a resumed run drops lines it will redo)."""
    _write_whole(Path(path), "".join(json.dumps(r) + "\n" for r in records))


def write_json(path: str | os.PathLike, obj: dict):
    """Write beside the target and rename, so readers never see half a file."""
    _write_whole(Path(path), json.dumps(obj, indent=2) + "\n")


def _write_whole(path: Path, text: str):
    """`text` beside `path`, then renamed over it: the old file or the new one, whole."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # concurrent writers: one each
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:  # a full disk must not leave the half-written copy behind; a cleanup that
        with suppress(OSError):  # fails too (a read-only place) must not hide the first error
            tmp.unlink(missing_ok=True)
