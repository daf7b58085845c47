"""Files a run writes whole or not at all (`atomic_write`: a kill or a full disk leaves
the old file or the new one), and the checksums in `manifest.json` that prove them intact."""

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
    """Replace `path` with what `write(f)` writes: into a copy beside it (named by this
    process), forced to disk, renamed over it."""
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
    """A whole JSON file, or None if it is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return None


class HashingFile:
    """A file for writing that hashes every byte on its way out (never read back)."""

    def __init__(self, f, sha256):
        self.f, self.sha256 = f, sha256

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def hashed_write(path, write) -> str:
    """`fsync_write` through a `HashingFile`: returns the SHA-256 of what was written."""
    sha256 = hashlib.sha256()
    fsync_write(path, lambda f: write(HashingFile(f, sha256)))
    return sha256.hexdigest()


def sha256_of(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, meta: dict, known: dict[str, str] | None = None) -> None:
    """`meta` and a SHA-256 of every file under `folder` into manifest.json, written last
    (a folder without one was never finished). `known`: digests taken as written."""
    known = known or {}
    files = {name: known.get(name) or sha256_of(p)
             for p in sorted(Path(folder).rglob("*")) if p.is_file() and p.name != MANIFEST
             for name in [str(p.relative_to(folder))]}
    fsync_write(Path(folder) / MANIFEST, lambda f: f.write(json.dumps({**meta, "sha256": files}, indent=1).encode()))
    fsync_dir(folder)


def verify_manifest(folder: Path, names=None) -> dict:
    """The manifest's metadata, once the files `names` (default: all) match their
    checksums; else ValueError naming the first problem."""
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
    """ENOSPC or EDQUOT; or, where an error hides it (torch.save's RuntimeError), under
    8 MB left where the write went."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return where is not None and shutil.disk_usage(where).free < 8 * 2**20


def one_line(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
