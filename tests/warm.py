"""The client of tests/zygote.py: runs `python script ...` and `torchrun --standalone
--nproc-per-node=N script ...` command lines as forks of one warm interpreter, and
answers as subprocess.run does (a CompletedProcess, or TimeoutExpired), or, for a launch
the test acts on while it runs, as subprocess.Popen does (WarmJob)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# Variables torch or its libraries read when imported (TORCH_LOGS, thread settings...): a
# launch that sets them differently needs a fresh interpreter. Two of them a fork reads
# afresh: TORCH_DISTRIBUTED_DEBUG (zygote.become reads it again, as `import
# torch.distributed` does) and TORCHINDUCTOR_CACHE_DIR (read whenever inductor needs its
# cache; importing inductor sets it, so a test process has it once anything imported it).
READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS")
READ_AGAIN = ("TORCH_DISTRIBUTED_DEBUG", "TORCHINDUCTOR_CACHE_DIR")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_launch(cmd: list[str]) -> tuple[int, int, list[str]] | None:
    """(ranks, restarts, [script, args...]) when the zygote can run the command: plain
    `python script.py ...` or `python -m module ...` (0 ranks); `torchrun --standalone
    --nproc-per-node=N [--max-restarts=K] script ...` with no other torchrun flag, as N
    ranks; any other torchrun command as torchrun itself (`torchrun_itself`). None for
    anything else."""
    if len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1].endswith(".py"):
        return 0, 0, cmd[1:]
    if len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m" and cmd[2] != TORCHRUN[2]:
        return 0, 0, cmd[1:]  # `python -m module ...`: argv starts with "-m"
    if cmd[:4] != TORCHRUN or len(cmd) < 6 or not cmd[4].startswith("--nproc-per-node="):
        return torchrun_itself(cmd)
    ranks, rest, restarts = int(cmd[4].split("=", 1)[1]), cmd[5:], 0
    if rest[0].startswith("--max-restarts="):
        restarts, rest = int(rest[0].split("=", 1)[1]), rest[1:]
    return (ranks, restarts, rest) if rest and rest[0].endswith(".py") else torchrun_itself(cmd)


def torchrun_itself(cmd: list[str]) -> tuple[int, int, list[str]] | None:
    """A torchrun command as `python -m torch.distributed.run ...` in a fork of the zygote:
    the real torchrun (its agent, its rendezvous, restarts, signals and reports), whose
    interpreter has imported torch already, and so have its workers: each is a fork of
    torchrun's process (zygote.ForkedWorker) unless the launch asks for fresh ones. None
    for a command that is not torchrun."""
    return (0, 0, cmd[1:]) if cmd[:3] == TORCHRUN[:3] else None


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
    """The running processes of session `sid` (a launch started in a session of its own
    and all it started, unless one left it)."""
    return [p for p, fields in _processes() if int(fields[3]) == sid and fields[0] != "Z"]


def running(pid: int) -> bool:
    """Alive and not a zombie (what /proc says)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def kill_launch(pid: int) -> None:
    """SIGKILL a launch at once: the launcher's process group and each rank's (the ranks
    start sessions of their own, as torchrun's workers do, so the launcher's group alone
    would leave them running)."""
    for group in [pid, *children(pid)]:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass


def import_time_settings(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT) and k not in READ_AGAIN}


class Zygote:
    def __init__(self, repo: Path):
        self.settings = import_time_settings(os.environ)
        self.proc = subprocess.Popen([sys.executable, str(HERE / "zygote.py"), str(repo)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.statuses: dict[int, int] = {}
        self.pending = b""

    def _read(self, until: float | None) -> bool:
        """Read reply lines until `until` (monotonic); False on timeout."""
        fd = self.proc.stdout.fileno()
        while True:
            wait = None if until is None else max(0.0, until - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return False
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the zygote died")
            self.pending += chunk
            if b"\n" in self.pending:
                *lines, self.pending = self.pending.split(b"\n")
                for line in lines:
                    message = json.loads(line)
                    if "status" in message:
                        self.statuses[message["pid"]] = message["status"]
                    else:
                        self.started = message["started"]
                return True

    def can_run(self, env: dict) -> bool:
        return import_time_settings(env) == self.settings

    def start(self, nproc: int, restarts: int, argv: list[str], *, cwd, env: dict,
              stdout: Path, stderr: Path, fresh_workers: bool = False, netns: str | None = None) -> int:
        """Launch and return the launcher's pid at once; output appended to the files.
        fresh_workers: torchrun itself starts its workers as new interpreters. netns: in
        that network namespace, as `ip netns exec NETNS` would run it."""
        request = {"nproc": nproc, "max_restarts": restarts, "argv": argv, "cwd": str(cwd),
                   "env": env, "stdout": str(stdout), "stderr": str(stderr), "port": free_port(),
                   "fork_workers": not fresh_workers, "netns": netns}
        self.started = None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while self.started is None:
            self._read(None)
        return self.started

    def poll(self, pid: int) -> int | None:
        while pid not in self.statuses and self._read(time.monotonic()):
            pass
        return self.statuses.pop(pid, None)

    def wait(self, pid: int, timeout: float | None) -> int:
        """The launch's status; subprocess.TimeoutExpired after `timeout` s (it runs on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.statuses:
            if not self._read(deadline):
                raise subprocess.TimeoutExpired(str(pid), timeout)
        return self.statuses.pop(pid)

    def run(self, nproc: int, restarts: int, argv: list[str], *, cwd, env: dict, timeout: float | None,
            fresh_workers: bool = False):
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            pid = self.start(nproc, restarts, argv, cwd=cwd, env=env, stdout=out, stderr=err,
                             fresh_workers=fresh_workers)
            try:
                code, timed_out = self.wait(pid, timeout), False
            except subprocess.TimeoutExpired:
                kill_launch(pid)
                code, timed_out = self.wait(pid, None), True
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return code, stdout, stderr

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()


class WarmJob:
    """A launch of the zygote as far as a test uses subprocess.Popen: pid (the launcher's,
    the ranks are its children), poll(), wait(timeout), returncode, send_signal(sig),
    terminate(), kill()."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]):
        self.zygote, self.pid, self.args, self.returncode = zygote, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.poll(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.wait(self.pid, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
