"""The run folder: one owner at a time, never overwritten, never deleted.

- `claim_run_folder`: rank 0 creates the folder and holds an exclusive lock on it for
  as long as its process lives (`.owner` says who). The kernel drops the lock when the
  process ends, however it ends, so a killed job never leaves the folder stuck; a second
  job with the same --experiment-name stops with one line naming the owner.
- Where `flock` does not lock across machines (Lustre mounted `noflock` answers ENOSYS;
  `localflock` locks per node only; some NFS and FUSE mounts answer EOPNOTSUPP or
  ENOLCK), the lock is `.owner` itself, created only if absent, naming host, pid and start
  time, and removed at exit. One line says so. A `.owner` left by a process that is gone
  from this host (killed) is stale and taken over, with one line; a holder elsewhere or
  alive refuses. On NFS with a working `flock`, a crashed client's lock lasts until its
  lease ends (about 90 s), and the refusal says so.
- `release_run_folders`: give them up (at exit, on its own).
- `archive_run`: move a previous run's files into `archive-<time>/` (chapter 04's --fresh).
- `save_weights`: the run's final `model.pt`, whole or absent, its failure heard by every rank.
- `outputs_complete`: a finished run's summary and weights are there and readable.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path

import torch

from .distributed import first_error
from .checkpoint_folder import commit_on_rank0
from .durable import atomic_write
from .errors import fail
from .jsonfiles import read_json_or_none

OWNER_FILE = ".owner"
MOUNTS = "/proc/mounts"
# what flock answers where the file system has no such lock
NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK)
_held = []  # folder descriptors kept open (hence locked), lock files: until the process exits
log = logging.getLogger(__name__)


def claim_run_folder(run_dir: Path, *, rank: int = 0, resumes: bool = False,
                     flag: str = "--experiment-name") -> Path:
    """Create and lock `run_dir` (rank 0); every rank hears a refusal and stops with it.
    Unless `resumes`, a folder already holding results is refused, as at parse time:
    the check is repeated under the lock, where no other job can race it. A refusal
    names `flag` as what to change."""
    error = None
    if rank == 0:
        try:
            error = _claim(Path(run_dir), resumes, flag)
        except OSError as e:
            error = f"cannot create the run folder {str(run_dir)!r}: {e.strerror or e}"
    error = first_error(error)
    if error:
        fail(error)
    return Path(run_dir)


def _claim(run_dir: Path, resumes: bool, flag: str) -> str | None:
    run_dir.mkdir(parents=True, exist_ok=True)
    fstype, options = mount_of(run_dir)
    unsafe = ("Lustre mounted with localflock locks per node only"
              if fstype == "lustre" and "localflock" in options else None)
    if not unsafe:
        # The lock is on the folder itself, so deleting `.owner` cannot lift it; `.owner`
        # only says who holds it.
        fd = os.open(run_dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            lease = " (on NFS a crashed job's lock lasts until its lease ends, about 90 s)" \
                if fstype.startswith("nfs") else ""
            return _in_use(run_dir, _owner(run_dir), flag) + lease
        except OSError as e:
            os.close(fd)
            if e.errno not in NO_FLOCK:
                raise
            unsafe = f"flock is not supported there ({errno.errorcode[e.errno]})"
        else:
            if not resumes and holds_results(run_dir):
                os.close(fd)
                return _not_empty(run_dir, flag)
            (run_dir / OWNER_FILE).write_text(_owner_line())
            _held.append(fd)
            return None
    log.warning("run folder %s: %s; its lock is %s instead, created only if absent and removed "
                "at exit", run_dir, unsafe, OWNER_FILE)
    return _claim_with_file(run_dir, resumes, flag)


def _claim_with_file(run_dir: Path, resumes: bool, flag: str) -> str | None:
    """The lock is `.owner` itself: made complete beside it, then hard-linked to its name,
    which fails if the name exists (atomic, NFS included). A stale one is taken over."""
    lock, mine = run_dir / OWNER_FILE, _owner_line()
    draft = run_dir / f"{OWNER_FILE}.{socket.gethostname()}.{os.getpid()}"
    draft.write_text(mine)
    try:
        for _ in range(3):  # a stale lock taken over, then a second try
            try:
                os.link(draft, lock)
                break
            except FileExistsError:
                holder = _owner(run_dir)
                why = _gone(holder)
                if why is None or not _take_over(lock, holder):
                    return _in_use(run_dir, holder, flag) + f"; if that job is gone, delete {lock}"
                log.warning("run folder %s: %s left by %s, which %s: taken over", run_dir,
                            OWNER_FILE, holder, why)
        else:
            return _in_use(run_dir, _owner(run_dir), flag)
    finally:
        draft.unlink(missing_ok=True)
    if not resumes and holds_results(run_dir):
        _release(lock, mine)
        return _not_empty(run_dir, flag)
    _held.append((lock, mine))
    return None


def _gone(holder: str) -> str | None:
    """Why the process named in `holder` (an owner line) no longer holds anything, or
    None if it may: only a process of this host can be looked up."""
    found = re.search(r"pid (\d+) on (\S+), since", holder)
    if not found or found[2] != socket.gethostname():
        return None
    try:
        os.kill(int(found[1]), 0)
    except ProcessLookupError:
        return "is no longer running on this host"
    except PermissionError:
        pass  # alive, another user's
    return None


def _take_over(lock: Path, holder: str) -> bool:
    """Move the stale lock aside (one rename: of two jobs taking it over, one wins) and
    check that what moved was the stale one, not a newer job's lock (put back if so)."""
    aside = lock.with_name(f"{OWNER_FILE}.stale.{socket.gethostname()}.{os.getpid()}")
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return True  # another job removed it: try again
    if aside.read_text().strip() != holder:
        try:
            os.link(aside, lock)  # a newer job's lock: give it back
        except FileExistsError:
            pass
        aside.unlink()
        return False
    aside.unlink()
    return True


def _not_in_forked_children():
    """In a forked child (a DataLoader worker): let go of this process's run folders. The
    child's copy of a lock descriptor would keep the folder locked for as long as the
    child lives: a worker whose trainer was killed lingers for seconds, and a rerun right
    away would be refused. Closing the copy leaves the trainer's lock in place (a flock
    belongs to the open file, which the trainer still holds open)."""
    for held in _held:
        if isinstance(held, int):
            os.close(held)
    _held.clear()


os.register_at_fork(after_in_child=_not_in_forked_children)


def release_run_folders():
    """Give up every run folder this process holds (at exit, however it exits but a kill:
    the kernel drops a flock then; a lock file stays, stale, and is taken over)."""
    while _held:
        held = _held.pop()
        if isinstance(held, int):
            os.close(held)
        else:
            _release(*held)


def _release(lock: Path, mine: str):
    """Remove the lock file if it is still this process's."""
    try:
        if lock.read_text() == mine:
            lock.unlink()
    except FileNotFoundError:
        pass


def mount_of(path: Path) -> tuple[str, set[str]]:
    """The file system type and mount options of the mount holding `path` ('' if unknown)."""
    path, best = str(Path(path).resolve()), ("", "", set())
    try:
        lines = Path(MOUNTS).read_text().splitlines()
    except OSError:
        return "", set()
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2], set(fields[3].split(",")))
    return best[1], best[2]


def _owner_line() -> str:
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    return (f"{'job ' + job + ', ' if job else ''}pid {os.getpid()} on {socket.gethostname()}, "
            f"since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")


def _owner(run_dir: Path) -> str:
    try:
        return (run_dir / OWNER_FILE).read_text().strip()
    except OSError:
        return ""


def outputs_complete(run_dir: Path) -> bool:
    """Whether a run's end left its outputs whole: a readable summary.json and a model.pt
    (chapter 04 runs the end of a run again where they are not)."""
    weights = Path(run_dir) / "model.pt"
    return (isinstance(read_json_or_none(Path(run_dir) / "summary.json"), dict)
            and weights.is_file() and weights.stat().st_size > 0)


def holds_results(run_dir: Path) -> bool:
    """Whether `run_dir` holds anything a run made: its lock files and empty files (the
    metrics file of a run stopped before its first logged step) do not count."""
    return run_dir.is_dir() and any(
        not p.name.startswith(OWNER_FILE) and not (p.is_file() and p.stat().st_size == 0)
        for p in run_dir.iterdir())


def _in_use(run_dir: Path, owner: str, flag: str) -> str:
    return (f"run folder {str(run_dir)!r} is in use by {owner or 'another job'}; wait for it to "
            f"end or choose another {flag}")


def _not_empty(run_dir: Path, flag: str) -> str:
    return (f"run folder {str(run_dir)!r} already exists and is not empty; choose another "
            f"{flag} or remove it")


atexit.register(release_run_folders)


def archive_run(run_dir: Path, keep: str | None = None) -> Path | None:
    """Move everything but earlier archives (and names matching the glob `keep`) into a
    new `archive-<time>` folder inside `run_dir`; returns it (None if nothing moved)."""
    items = [p for p in Path(run_dir).iterdir()
             if not p.name.startswith("archive-") and p.name != OWNER_FILE
             and not (keep and p.match(keep))]
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


def save_weights(path: Path, model: torch.nn.Module, *, writer: bool = True) -> None:
    """The run's final weights (`model.state_dict()`), written by `writer` (rank 0) whole
    or not at all, never a truncated file a later load would trust. A failed write (a full
    disk) stops every rank with its one line: a collective when a process group exists."""
    path = Path(path)

    def disk_full(folder: Path, _) -> str:
        return (f"disk full while saving {path} ({shutil.disk_usage(folder).free / 2**20:,.1f} MB free): "
                f"it was not written; free some space and run again")
    commit_on_rank0(lambda: atomic_write(path, lambda f: torch.save(model.state_dict(), f)),
                    0 if writer else 1, where=path.parent, disk_full=disk_full, status=1)
