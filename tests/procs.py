"""The processes of a job, as /proc shows them: what the tests of signals and kills act on.
torchrun starts each worker in a session of its own, so a job is torchrun's process group
plus one session per worker."""

from __future__ import annotations

import os
import signal


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state, ppid, pgrp, session, ...),
    or None for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _processes():
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(entry)) is not None:
            yield int(entry), fields


def children(pid: int) -> list[int]:
    """The processes whose parent is pid (what `pgrep -P pid` lists)."""
    return [p for p, fields in _processes() if int(fields[1]) == pid]


def in_session(sid: int) -> list[int]:
    """The running processes of session `sid` (a process that started a session of its own,
    and all it started, unless one left it)."""
    return [p for p, fields in _processes() if int(fields[3]) == sid and fields[0] != "Z"]


def running(pid: int) -> bool:
    """Alive and not a zombie (what /proc says)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def kill_job(pid: int) -> None:
    """SIGKILL a job at once, as a lost machine would: the launcher's process group and
    each of its children's (torchrun's workers lead sessions of their own)."""
    for group in [pid, *children(pid)]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
