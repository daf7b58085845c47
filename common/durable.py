"""Files that survive crashes, and proof that they are intact (chapter 04's helpers).

- `fsync_write`, `fsync_dir`: a rename is only as durable as what it renames.
- `atomic_write`: a file replaced whole or not at all (the final weights, the summary).
- `hashed_write`: `fsync_write` that also returns the SHA-256 of the bytes as they are
  written (`HashingFile`), so a checksum never costs reading the file back.
- `write_manifest`, `verify_manifest`: `manifest.json` holds a checkpoint's metadata and a
  SHA-256 of every file in it; a flipped byte anywhere fails the check. `sha256_of`,
  `check_files`: the checksums of some files, for ranks that each hash their own share.
- `read_manifest`: the metadata alone, to check a checkpoint's settings before loading it.
- `disk_full_message`: the one line for ENOSPC; `one_line`: any exception, briefly.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

MANIFEST = "manifest.json"


def fsync_write(path, write):
    """Write a file through `write(f)` and force it to disk."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


class HashingFile:
    """A file opened for writing that hashes every byte on its way to the file: what a
    writer (torch.save) sends through it is digested once, in memory, never read back.
    torch.save writes a file object strictly in order, which a running hash needs."""

    def __init__(self, f):
        self.f, self.sha256 = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def hashed_write(path, write) -> str:
    """`fsync_write` through a `HashingFile`: returns the SHA-256 of what was written."""
    digest = None

    def through_hasher(f):
        nonlocal digest
        hashing = HashingFile(f)
        write(hashing)
        digest = hashing.sha256.hexdigest()
    fsync_write(path, through_hasher)
    return digest


def atomic_write(path, write):
    """Write a file so that a kill or a full disk at any moment leaves either the old file
    or the new one, whole: write beside it, force to disk, rename over it, force the
    folder to disk (chapter 04's `latest` pointer shows the same steps)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fsync_write(tmp, write)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # makes the renames inside it durable
    finally:
        os.close(fd)


def sha256_of(path: Path) -> str:
    """The SHA-256 of a file, read in 1 MB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, meta: dict, known: dict[str, str] | None = None):
    """Write `meta` and a SHA-256 of every file under `folder` into manifest.json (written
    last: a folder without one was never finished). `known`: digests taken as the files
    were written (`hashed_write`) or by the ranks that wrote them; only the files missing
    from it are read and hashed here."""
    known = known or {}
    files = {name: known.get(name) or sha256_of(p)
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST
             for name in [str(p.relative_to(folder))]}
    fsync_write(folder / MANIFEST, lambda f: f.write(json.dumps({**meta, "sha256": files}, indent=1).encode()))
    fsync_dir(folder)  # the files' names too, before the folder is renamed into place


def read_manifest(folder: Path) -> dict:
    """The metadata; raises ValueError if it is missing or unreadable."""
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"no readable {MANIFEST} ({type(e).__name__})") from None


def verify_manifest(folder: Path) -> dict:
    """The metadata, after checking every file against its checksum (ValueError if not)."""
    meta = read_manifest(folder)
    check_files(folder, meta, meta["sha256"])
    return meta


def check_files(folder: Path, meta: dict, names) -> None:
    """Check the files `names` of `folder` against the checksums in `meta` (a manifest):
    ValueError naming the first that is missing or differs."""
    for name in names:
        path = Path(folder) / name
        if not path.is_file():
            raise ValueError(f"{name} is missing")
        if sha256_of(path) != meta["sha256"][name]:
            raise ValueError(f"{name} does not match its checksum (corrupted)")


def dir_size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 2**20


def is_disk_full(e: BaseException, where: Path | None = None) -> bool:
    """ENOSPC or EDQUOT; or, for errors that hide it (torch.save's zip writer raises a
    RuntimeError), less than 8 MB left where the write went."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return where is not None and shutil.disk_usage(where).free < 8 * 2**20


def disk_full_message(folder: Path, written_mb: float) -> str:
    """The one line for a checkpoint that did not fit. `written_mb` is what the failed
    save wrote before the disk filled (about the space that was free); a checkpoint
    already in `folder` (`step-*`) tells the size one really needs."""
    saved = [dir_size_mb(p) for p in Path(folder).glob("step-*") if p.is_dir()]
    needed = f"about {max(saved):,.0f} MB" if saved else f"more than {written_mb:,.0f} MB"
    free_mb = shutil.disk_usage(folder).free / 2**20
    return (f"disk full while saving into {folder}: a checkpoint needs {needed} and {free_mb:,.0f} MB "
            f"are free; free some space (step-* folders older than the one `latest` names may go: "
            f"--keep-last prunes only after a save succeeds), then run the same command to resume")


def one_line(e: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
