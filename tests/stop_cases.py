"""How a run ends when it is stopped from outside, case by case: `python
tests/stop_cases.py FOLDER CASE...` runs each case in a process of its own (forked from
this one, which imported torch once, in a session of its own as a terminal gives a job),
and prints {case: {"status": exit status, "stderr": what it printed}} as JSON.
tests/test_stops.py says what each case must end with."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import common.errors
from common.errors import run_main

BOTH = [signal.SIGINT, signal.SIGCHLD]


class Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        time.sleep(0.01)
        return i


def unblock(worker_id=None):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, BOTH)


def block():
    """Hold SIGINT and SIGCHLD in this thread and every thread it starts (the case's
    process has one thread, forked): a signal sent to the process goes to a thread that
    does not hold it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, BOTH)


def ctrl_c_race():
    """A terminal's Ctrl-C (SIGINT to the process group) reaches the trainer and its
    DataLoader worker; the worker ends, and the trainer's SIGINT and SIGCHLD arrive
    together, which 3 in 6 real Ctrl-Cs of chapter 03 met: Python runs the SIGINT
    handler first, and the SIGCHLD's handler after it."""
    block()

    def main():
        block()  # (run_main let SIGINT in)
        batches = iter(DataLoader(Slow(), batch_size=1, num_workers=1, worker_init_fn=unblock))
        next(batches)  # the worker runs, and torch's SIGCHLD handler is in place
        os.killpg(0, signal.SIGINT)
        while signal.SIGCHLD not in signal.sigpending():  # the worker has ended
            time.sleep(0.01)
        try:
            unblock()  # both arrive at once
        finally:  # Python runs what is still pending at its next check (torch's backward makes one)
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    run_main(main)


def worker_sigint():
    """SIGINT to the DataLoader worker alone (`kill -INT`): an interrupt, not a lack of
    memory."""
    def main():
        batches = iter(DataLoader(Slow(), batch_size=1, num_workers=1))
        next(batches)
        worker, = multiprocessing.active_children()
        os.kill(worker.pid, signal.SIGINT)
        for _ in batches:
            pass
    run_main(main)


def unreaped_worker_signal():
    """A worker that died of SIGTERM while it handed a batch over: the broken pipe says
    nothing of why; the dead worker, not yet reaped, still does."""
    child = subprocess.Popen(["sleep", "60"])
    child.send_signal(signal.SIGTERM)
    signum = common.errors.worker_death_signal(EOFError())
    print(f"{signum}: {common.errors.worker_death_cause(signum)}", file=sys.stderr)
    child.wait()


def peer_rank(rank: int, port: int):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def main():
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
        if rank == 1:
            os._exit(130)  # rank 1 stops first
        dist.all_reduce(torch.ones(1))  # rank 0 waits for it in a collective
    run_main(main)


def two_ranks(ctrl_c: bool):
    """Rank 1 ends while rank 0 waits for it in a collective. `ctrl_c`: rank 0's own
    SIGINT follows 0.2 s later, as torchrun passes a Ctrl-C on to one rank after the
    other; else rank 1 failed, and rank 0 says so."""
    fork = multiprocessing.get_context("fork")
    with socket_port() as port:
        ranks = [fork.Process(target=peer_rank, args=(r, port)) for r in (0, 1)]
    for p in ranks:
        p.start()
    ranks[1].join()
    if ctrl_c:
        time.sleep(0.2)
        os.kill(ranks[0].pid, signal.SIGINT)
    ranks[0].join(60)
    sys.exit(ranks[0].exitcode)


def socket_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))

    class Port:
        def __enter__(self):
            return s.getsockname()[1]

        def __exit__(self, *exc):
            s.close()
    return Port()


CASES = {"ctrl-c-race": ctrl_c_race, "worker-sigint": worker_sigint,
         "unreaped-worker-signal": unreaped_worker_signal,
         "peer-then-ctrl-c": lambda: two_ranks(ctrl_c=True), "peer-failed": lambda: two_ranks(ctrl_c=False)}


def run_case(name: str, folder: str) -> dict:
    err = os.path.join(folder, f"{name}.err")
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
        try:
            CASES[name]()
            status = 0
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            status = 1
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    with open(err) as f:
        return {"status": os.waitstatus_to_exitcode(status), "stderr": f.read()}


if __name__ == "__main__":
    folder, names = sys.argv[1], sys.argv[2:]
    print(json.dumps({name: run_case(name, folder) for name in names}))
