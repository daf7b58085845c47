"""Chapter 04's preemption.py, unchanged: a stop signal becomes one step that every rank
stops at (chapter 04's README explains it).

Ctrl-C sends SIGINT to every process of the terminal's job; a scheduler preempts with
SIGTERM (SLURM's --signal, Kubernetes); torchrun passes both on to its workers. A
process that dies at once loses everything since the last checkpoint, and a rank that
stops alone leaves the others waiting in a collective. So:

- `StopRequest`: the handlers only take note. After every step the ranks vote (an
  all-reduce of "did anyone get a signal?") without waiting for it, and read that vote
  after the next step, when it has long arrived: no step waits on the other hosts for
  it, and all ranks still stop after the same step (one step later than a blocking
  vote would), save, and leave.
- `data_worker_ignores_stops` and `holding_sigterm`: the DataLoader's worker processes
  ignore both signals, but their trainer's SIGTERM. SLURM signals every process of a
  job, Ctrl-C and torchrun a whole process group; a worker that dies of the signal takes
  its trainer down with it ("DataLoader worker is killed by signal"), before the trainer
  can save.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from common.distributed import gc_and_destroy_process_group
from common.environment import end_with_parent

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def data_worker_ignores_stops(worker_id: int):
    """DataLoader(worker_init_fn=...): the worker ignores SIGINT and SIGTERM, however they
    come (to its pid, as SLURM sends them, or to its trainer's process group: Ctrl-C,
    torchrun); the trainer handles them. Only its trainer's own SIGTERM ends it, at once,
    as torch's handler in the worker does (which lets any other SIGTERM kill it): the
    DataLoader, and multiprocessing at the trainer's exit, end a worker so. The worker
    also ends with its trainer: one that dies first (killed, or gone at once after a peer
    stopped answering) takes it along at that moment (the kernel's parent-death signal
    on Linux, where the chapters fork their workers: see `worker_start_method`), not at
    the DataLoader's next check (every 5 s). Forked by `holding_sigterm`, the worker has
    held SIGTERM since its birth, in every thread it started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "sigwaitinfo"):  # a thread takes each SIGTERM, with its sender (Linux)
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # and in the threads started later
        threading.Thread(target=_end_at_the_trainers_sigterm, daemon=True).start()
    trainer = multiprocessing.parent_process()
    if end_with_parent(signal.SIGKILL) and trainer is not None and not trainer.is_alive():
        # The trainer died before the request took hold. (The orphan's new parent is not
        # always init, pid 1: a desktop's systemd user manager adopts it, for one.)
        os._exit(0)


def holding_sigterm(start_method):
    """DataLoader(multiprocessing_context=...): for "fork" (the chapters' start method on
    Linux), a fork whose worker is born with SIGTERM blocked, and with it every thread the
    worker starts. Blocking it in `data_worker_ignores_stops` alone comes too late: by then
    torch has started the worker's thread pool (`torch.set_num_threads(1)` rebuilds a pool
    as large as the trainer's: 4 threads for each of 2 ranks on 8 cores), and a SIGTERM
    that one of those threads takes kills the worker. Another start method: unchanged."""
    return _SigtermHeldFork() if start_method == "fork" else start_method


if hasattr(multiprocessing.context, "ForkProcess"):  # (not on Windows)
    class _ForkedHoldingSigterm(multiprocessing.context.ForkProcess):
        def start(self):
            held = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # the child inherits it
            try:
                super().start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)

    class _SigtermHeldFork(multiprocessing.context.ForkContext):
        Process = _ForkedHoldingSigterm


def _end_at_the_trainers_sigterm():
    while True:
        if signal.sigwaitinfo([signal.SIGTERM]).si_pid == os.getppid():
            os._exit(0)


class StopRequest:
    """While installed, SIGINT and SIGTERM set a flag instead of ending the process."""

    def __init__(self):
        self.signal = None
        self.previous = {sig: signal.signal(sig, self._note) for sig in STOP_SIGNALS}
        # The vote travels over a CPU (gloo) group of its own: on GPUs it costs no device
        # sync, and the vote in flight never queues behind (or ahead of) other collectives.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.vote = None  # the all-reduce in flight since the previous step, and its flag

    def _note(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name

    def agreed(self, last_step: bool = False) -> str | None:
        """The signal's name once any rank got one, on every rank after the same step, else
        None. A collective that every rank joins after every step: it reads the vote
        started after the previous step (all ranks get the same answer), then starts this
        step's, read after the next step. So a signal stops the run one step after the
        step it arrived in; the last step waits for its own vote."""
        if not dist.is_initialized():
            return self.signal
        anyone = self._read_vote()
        if not anyone:  # the same decision on every rank: all start the next vote, or none
            flag = torch.tensor([self.signal is not None], dtype=torch.int32)
            self.vote = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
            if last_step:
                anyone = self._read_vote()
        return (self.signal or "a signal to another rank") if anyone else None

    def _read_vote(self) -> bool:
        """Wait for the vote in flight (started a step ago: done by now) and take it."""
        if self.vote is None:
            return False
        work, flag = self.vote
        work.wait()
        self.vote = None
        return bool(flag.item())

    def uninstall(self):
        """After the loop: the signals act as before (the last checkpoint is committed;
        a rerun finishes what is left)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def leave(self, step: int, checkpoint: Path):
        """After the checkpoint: one line (rank 0), leave the group, exit 128 + signal."""
        if int(os.environ.get("RANK") or 0) == 0:
            restarts_left = (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)
                             - int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0))
            then = ("torchrun restarts the workers from it unless torchrun itself was stopped "
                    "(--max-restarts); to resume later, run the same command" if restarts_left > 0
                    else "run the same command to resume")
            print(f"\ninterrupted at step {step} ({self.signal or 'a signal to another rank'}); "
                  f"checkpoint {Path(checkpoint).name} saved; {then} "
                  f"(with --experiment-name {Path(checkpoint).parent.parent.name})",
                  file=sys.stderr, flush=True)
        gc_and_destroy_process_group()
        sys.exit(128 + getattr(signal.Signals, self.signal or "SIGTERM"))
