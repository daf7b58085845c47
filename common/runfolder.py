"""The run folder: one owner at a time, never overwritten, never deleted.

- `claim_run_folder`: rank 0 creates the folder and holds an exclusive lock on it for
  as long as its process lives (`.owner` says who). The kernel drops the lock when the
  process ends, however it ends, so a killed job never leaves the folder stuck; a second
  job with the same --experiment-name stops with one line naming the owner.
- `archive_run`: move a previous run's files into `archive-<time>/` (chapter 04's --fresh).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from .distributed import first_error
from .errors import fail

OWNER_FILE = ".owner"
_held = []  # folder descriptors kept open, hence locked, until the process exits


def claim_run_folder(run_dir: Path, *, rank: int = 0, resumes: bool = False) -> Path:
    """Create and lock `run_dir` (rank 0); every rank hears a refusal and stops with it.
    Unless `resumes`, a folder already holding results is refused, as at parse time:
    the check is repeated under the lock, where no other job can race it."""
    error = None
    if rank == 0:
        try:
            error = _claim(Path(run_dir), resumes)
        except OSError as e:
            error = f"cannot create the run folder {str(run_dir)!r}: {e.strerror or e}"
    error = first_error(error)
    if error:
        fail(error)
    return Path(run_dir)


def _claim(run_dir: Path, resumes: bool) -> str | None:
    run_dir.mkdir(parents=True, exist_ok=True)
    # The lock is on the folder itself, so deleting `.owner` cannot lift it; `.owner` only
    # says who holds it.
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        owner = (run_dir / OWNER_FILE).read_text().strip() if (run_dir / OWNER_FILE).is_file() else ""
        return (f"run folder {str(run_dir)!r} is in use by {owner or 'another job'}; wait for it to "
                f"end or choose another --experiment-name")
    if not resumes and any(p.name != OWNER_FILE for p in run_dir.iterdir()):
        os.close(fd)
        return (f"run folder {str(run_dir)!r} already exists and is not empty; choose another "
                f"--experiment-name or remove it")
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    (run_dir / OWNER_FILE).write_text(f"{'job ' + job + ', ' if job else ''}pid {os.getpid()} on "
                                      f"{socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    _held.append(fd)
    return None


def archive_run(run_dir: Path) -> Path | None:
    """Move everything but earlier archives into a new `archive-<time>` folder inside
    `run_dir`; returns it (None if there was nothing to move)."""
    items = [p for p in Path(run_dir).iterdir()
             if not p.name.startswith("archive-") and p.name != OWNER_FILE]
    if not items:
        return None
    archive = Path(run_dir) / f"archive-{time.strftime('%Y%m%d-%H%M%S')}"
    n = 1
    while archive.exists():  # two archives in one second
        archive = archive.with_name(f"archive-{time.strftime('%Y%m%d-%H%M%S')}-{n}")
        n += 1
    archive.mkdir()
    for item in items:
        os.rename(item, archive / item.name)
    return archive
