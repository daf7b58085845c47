"""The client of tests/zygote.py: runs `python script ...` and `torchrun --standalone
--nproc-per-node=N script ...` command lines as forks of one warm interpreter, and
answers as subprocess.run does (a CompletedProcess, or TimeoutExpired)."""

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
# Variables torch or its libraries read when imported (TORCH_DISTRIBUTED_DEBUG, TORCH_LOGS,
# thread settings...): a launch that sets them differently needs a fresh interpreter.
READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_launch(cmd: list[str]) -> tuple[int, int, list[str]] | None:
    """(ranks, restarts, [script, args...]) when the command is one the zygote can run as
    is: plain `python script.py ...` (0 ranks) or `torchrun --standalone
    --nproc-per-node=N [--max-restarts=K] script ...` with no other torchrun flag; None
    for anything else."""
    if len(cmd) >= 2 and cmd[0] == sys.executable and cmd[1].endswith(".py"):
        return 0, 0, cmd[1:]
    if cmd[:4] != TORCHRUN or len(cmd) < 6 or not cmd[4].startswith("--nproc-per-node="):
        return None
    ranks, rest, restarts = int(cmd[4].split("=", 1)[1]), cmd[5:], 0
    if rest[0].startswith("--max-restarts="):
        restarts, rest = int(rest[0].split("=", 1)[1]), rest[1:]
    return (ranks, restarts, rest) if rest and rest[0].endswith(".py") else None


def import_time_settings(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT)}


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

    def run(self, nproc: int, restarts: int, argv: list[str], *, cwd, env: dict, timeout: float | None):
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"nproc": nproc, "max_restarts": restarts, "argv": argv, "cwd": str(cwd),
                       "env": env, "stdout": str(out), "stderr": str(err), "port": free_port()}
            self.started = None
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            while self.started is None:
                self._read(None)
            pid = self.started
            deadline = None if timeout is None else time.monotonic() + timeout
            timed_out = False
            while pid not in self.statuses:
                if not self._read(deadline) and not timed_out:
                    timed_out = True
                    os.killpg(pid, signal.SIGKILL)
                    deadline = None
            code = self.statuses.pop(pid)
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        return code, stdout, stderr

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
