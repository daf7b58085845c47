"""The run folder: one owner at a time, never overwritten, never deleted; and the run's
final weights. Rank 0 holds a flock on the folder while its process lives (the kernel
drops it however the process ends); where the file system has none (some NFS mounts),
`.owner`, created only if absent, is the lock."""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import shutil
import socket
import time
from pathlib import Path

import torch

from .distributed import on_rank0, stop_on_any_error
from .files import atomic_write, is_disk_full, one_line, read_json

OWNER_FILE = ".owner"
NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)  # what flock says where it has none
_held = []  # open folder descriptors (their locks), or lock files: until the process exits


def claim_run_folder(run_dir: Path, *, rank: int = 0, resumes: bool = False,
                     flag: str = "--experiment-name") -> Path:
    """Create and lock `run_dir` (rank 0); every rank hears a refusal and stops with it.
    Unless `resumes`, a folder holding results is refused (checked again under the lock)."""
    error = None
    if rank == 0:
        try:
            error = _claim(Path(run_dir), resumes, flag)
        except OSError as e:
            error = f"cannot create the run folder {str(run_dir)!r}: {e.strerror or e}"
    stop_on_any_error(error)
    return Path(run_dir)


def _claim(run_dir: Path, resumes: bool, flag: str) -> str | None:
    run_dir.mkdir(parents=True, exist_ok=True)
    owner = (f"{'job ' + os.environ['TORCHELASTIC_RUN_ID'] + ', ' if 'TORCHELASTIC_RUN_ID' in os.environ else ''}"
             f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    # the lock is on the folder itself, so deleting `.owner` cannot lift it
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another job holds it
        os.close(fd)
        return _in_use(run_dir, flag)
    except OSError as e:
        os.close(fd)
        if e.errno not in NO_FLOCK:
            raise
        return _claim_with_file(run_dir, resumes, flag, owner)
    if not resumes and holds_results(run_dir):
        os.close(fd)
        return _not_empty(run_dir, flag)
    (run_dir / OWNER_FILE).write_text(owner)
    _held.append(fd)
    return None


def _claim_with_file(run_dir: Path, resumes: bool, flag: str, owner: str) -> str | None:
    """No flock here: `.owner` created exclusively is the lock (atomic on NFS too)."""
    try:
        with open(run_dir / OWNER_FILE, "x") as f:
            f.write(owner)
    except FileExistsError:
        return (_in_use(run_dir, flag) + f"; this file system has no flock, so a killed job's "
                f"{OWNER_FILE} stays: if that job is gone, delete {run_dir / OWNER_FILE}")
    if not resumes and holds_results(run_dir):
        (run_dir / OWNER_FILE).unlink()
        return _not_empty(run_dir, flag)
    _held.append(run_dir / OWNER_FILE)
    return None


def _in_use(run_dir: Path, flag: str) -> str:
    try:
        owner = (run_dir / OWNER_FILE).read_text().strip()
    except OSError:
        owner = ""
    return f"run folder {str(run_dir)!r} is in use by {owner or 'another job'}; wait for it to end or choose another {flag}"


def _not_empty(run_dir: Path, flag: str) -> str:
    return f"run folder {str(run_dir)!r} already exists and is not empty; choose another {flag} or remove it"


@atexit.register
def release_run_folders():
    """Give up the run folders this process holds (a kill releases a flock all the same)."""
    while _held:
        held = _held.pop()
        if isinstance(held, int):
            os.close(held)
        else:
            held.unlink(missing_ok=True)


def _not_in_forked_children():
    """A forked DataLoader worker closes its copy of the lock: one outliving its killed
    trainer would keep the folder locked against a rerun."""
    for held in [h for h in _held if isinstance(h, int)]:
        os.close(held)
        _held.remove(held)


os.register_at_fork(after_in_child=_not_in_forked_children)


def holds_results(run_dir: Path) -> bool:
    """Whether `run_dir` holds anything a run made (not its lock file nor empty files)."""
    return run_dir.is_dir() and any(
        p.name != OWNER_FILE and not (p.is_file() and p.stat().st_size == 0) for p in run_dir.iterdir())


def outputs_complete(run_dir: Path) -> bool:
    """Whether a run's end left its outputs whole: a readable summary.json and a model.pt."""
    weights = Path(run_dir) / "model.pt"
    return (isinstance(read_json(Path(run_dir) / "summary.json"), dict)
            and weights.is_file() and weights.stat().st_size > 0)


def archive_run(run_dir: Path, keep: str | None = None) -> Path | None:
    """Move everything but earlier archives (and the glob `keep`) into a new
    `archive-<time>` folder inside `run_dir`; returns it (None if nothing moved)."""
    items = [p for p in Path(run_dir).iterdir()
             if not p.name.startswith("archive-") and p.name != OWNER_FILE and not (keep and p.match(keep))]
    if not items:
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    archive = Path(run_dir) / f"archive-{stamp}"
    while archive.exists():  # two archives in one second
        archive, n = Path(run_dir) / f"archive-{stamp}-{n}", n + 1
    archive.mkdir()
    for item in items:
        os.rename(item, archive / item.name)
    return archive


def save_weights(path: Path, model: torch.nn.Module, *, writer: bool = True) -> None:
    """The run's final `state_dict`, written by `writer` whole or not at all; a failed
    write stops every rank with one line (a collective)."""
    path = Path(path)

    def explain(e) -> str | None:
        full = is_disk_full(e, path.parent)
        if isinstance(e, RuntimeError) and not full:
            return None  # not a failed write: its own traceback
        free = shutil.disk_usage(path.parent).free / 2**20
        return (f"{'disk full while saving' if full else 'saving'} {path} ({one_line(e)}; {free:,.1f} MB free): "
                f"it was not written; free some space and run again")
    on_rank0(lambda: atomic_write(path, lambda f: torch.save(model.state_dict(), f)), 0 if writer else 1,
             explain, status=1)
