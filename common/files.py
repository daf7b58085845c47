"""Files a run writes whole or not at all, and the checksums that prove them intact.

- `atomic_write`: replace a file whole or not at all: write beside it, force it to disk,
  rename it over the old one, force the folder to disk. A kill or a full disk at any
  moment leaves the old file or the new one, never half of one.
- `write_json`, `read_json`: summary.json, caches and results, through `atomic_write`.
- `write_manifest`, `verify_manifest`: `manifest.json` holds a folder's metadata and a
  SHA-256 of every file in it (`hashed_write` takes it as the bytes go out).
- `is_disk_full`, `one_line`: for the one-line errors.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

MANIFEST = "manifest.json"


def fsync_write(path, write) -> None:
    """Write a file through `write(f)` (binary) and force it to disk."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path) -> None:
    """Force a folder's entries to disk: a rename inside it survives a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, write) -> None:
    """Replace `path` with what `write(f)` writes (a binary file), whole or not at all.
    The copy beside it is named by this process, so two writers never share one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fsync_write(tmp, write)
        os.replace(tmp, path)
    finally:
        try:  # a full disk must not leave the half-written copy, nor hide the error
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    fsync_dir(path.parent)


def write_json(path, obj) -> None:
    text = json.dumps(obj, indent=2) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def read_json(path):
    """A whole JSON file, or None if it is missing, unreadable, not JSON or nested too
    deep for the parser (a crafted or damaged file is never fatal)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return None


class HashingFile:
    """A file opened for writing that hashes every byte on its way out: what torch.save
    sends through it is digested in memory, never read back."""

    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def hashed_write(path, write) -> str:
    """`fsync_write` through a `HashingFile`: returns the SHA-256 of what was written."""
    hashing = []

    def through_hasher(f):
        hashing.append(HashingFile(f))
        write(hashing[0])
    fsync_write(path, through_hasher)
    return hashing[0].sha256.hexdigest()


def sha256_of(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, meta: dict, known: dict[str, str] | None = None) -> None:
    """`meta` and a SHA-256 of every file under `folder` into manifest.json, written last
    (a folder without one was never finished). `known`: digests taken as the files were
    written; only the others are read back and hashed here."""
    known = known or {}
    files = {name: known.get(name) or sha256_of(p)
             for p in sorted(Path(folder).rglob("*")) if p.is_file() and p.name != MANIFEST
             for name in [str(p.relative_to(folder))]}
    fsync_write(Path(folder) / MANIFEST, lambda f: f.write(json.dumps({**meta, "sha256": files}, indent=1).encode()))
    fsync_dir(folder)


def verify_manifest(folder: Path, names=None) -> dict:
    """The manifest's metadata, after checking the files `names` (default: all it lists)
    against their checksums. ValueError naming the first problem."""
    meta = read_json(Path(folder) / MANIFEST)
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), dict):
        raise ValueError(f"no readable {MANIFEST}")
    for name in meta["sha256"] if names is None else names:
        path = Path(folder) / name
        if not path.is_file():
            raise ValueError(f"{name} is missing")
        if sha256_of(path) != meta["sha256"].get(name):
            raise ValueError(f"{name} does not match its checksum (corrupted)")
    return meta


def folder_mb(path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


def is_disk_full(e: BaseException, where=None) -> bool:
    """ENOSPC or EDQUOT; or, for errors that hide it (torch.save's zip writer raises a
    RuntimeError), less than 8 MB left where the write went."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return where is not None and shutil.disk_usage(where).free < 8 * 2**20


def one_line(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
