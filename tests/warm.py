"""Warm ranks for the tests of computation: a chapter's command, its ranks started from
multiprocessing's forkserver instead of torchrun and fresh interpreters.

The forkserver is one process that imported torch and the guide's library once
(`set_forkserver_preload`); each rank is a fork of it, so a rank costs a fork instead of
the seconds of CPU that `import torch` takes in a new interpreter. A rank gets the
environment torchrun gives its workers (RANK, WORLD_SIZE, MASTER_ADDR...), the command's
arguments and folder, and runs the script as `python script` would (runpy, as
`__main__`); its output goes to the files the test reads.

It is for tests of what a computation gives (proofs, equal losses, counted bytes), never
for tests of launching: signals, restarts, lost peers, rendezvous and hosts are tested
with the real torchrun and fresh interpreters (conftest.run, conftest.start). The same
`python`/`torchrun --standalone --nproc-per-node=N` command lines run either way.
"""

from __future__ import annotations

import gc
import multiprocessing.connection
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
# (torch.distributed.pipelining brings in the compiler, which torch.optim's optimizers
# import when first built: 1.5-2 s of CPU in every rank otherwise)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
           "torch.distributed.pipelining", "torch.utils.data", "numpy", "tokenizers",
           "common.data", "common.demos", "common.metrics", "common.model", "common.training",
           "common.cli", "common.runfolder", "common.environment", "common.errors", "common.distributed"]
# What torch and its libraries read when they are imported: a rank inherits the values the
# forkserver had when it imported them, so a command that sets others needs fresh
# interpreters (a test marked launch). TORCHINDUCTOR_CACHE_DIR is read when used.
READ_AT_IMPORT = ("TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS")
_context, _imported_with = None, {}


def import_settings(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT) and k != "TORCHINDUCTOR_CACHE_DIR"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def forkserver():
    """The forkserver context, its preloads set before its first use starts it."""
    global _context, _imported_with
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        _imported_with = import_settings(os.environ)
    return _context


def parse(cmd: list[str]) -> tuple[int, list[str]]:
    """(ranks, argv) of `python script|-m module|-c code ...` (0 ranks: no torchrun
    variables) or `torchrun --standalone --nproc-per-node=N script ...` (N ranks)."""
    if cmd[:4] == TORCHRUN and len(cmd) >= 6 and cmd[4].startswith("--nproc-per-node=") \
            and cmd[5].endswith(".py"):
        return int(cmd[4].split("=", 1)[1]), cmd[5:]
    if len(cmd) >= 2 and cmd[0] == sys.executable and (cmd[1].endswith(".py") or cmd[1] in ("-m", "-c")) \
            and cmd[1:3] != TORCHRUN[1:3]:
        return 0, cmd[1:]
    raise ValueError(f"not a plain python or torchrun --standalone command: {cmd}")


def rank_main(argv: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    """In the forked rank: the process `python script args` would be, then the script."""
    gc.freeze()  # what the forkserver imported: never walked by this process's collections
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        elif argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.realpath(os.path.join(cwd, argv[0]))
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    except Exception:  # as python reports it (torch.distributed's hook prefixes the rank)
        sys.excepthook(*sys.exc_info())
        sys.exit(1)


def run_warm(cmd: list[str], *, timeout: float = 300, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """Run `cmd` with its ranks forked warm; as subprocess.run with capture_output (all
    ranks' output together, as torchrun shows it). When a rank fails, the others are
    stopped (as torchrun does); the status is the first failing rank's. Past `timeout`,
    every rank is killed and subprocess.TimeoutExpired raised."""
    cmd = [str(c) for c in cmd]
    ranks, argv = parse(cmd)
    forkserver()
    if import_settings(env) != _imported_with:
        raise ValueError(f"{cmd}: its environment changes what torch reads when imported "
                         f"({import_settings(env)} != {_imported_with}): run it with conftest.run")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        procs = []
        for rank in range(max(ranks, 1)):
            rank_env = dict(env)
            if ranks:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                                LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0")
            proc = forkserver().Process(target=rank_main, args=(argv, rank_env, str(cwd), out, err))
            proc.start()
            procs.append(proc)
        code, deadline = None, time.monotonic() + timeout
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            multiprocessing.connection.wait([p.sentinel for p in procs if p.exitcode is None],
                                            timeout=max(0.0, deadline - time.monotonic()))
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed and code is None:
                code = failed[0]
                for p in procs:
                    p.terminate()  # the others may wait on the failed rank forever
        timed_out = any(p.exitcode is None for p in procs)
        for p in procs:
            p.kill()
            p.join()
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, code or 0, stdout, stderr)
