"""How a run stops on an error: one line on stderr, not a traceback from every rank.
`fail` for bad input (exit status 2); `run_main` around a chapter's main() for Ctrl-C, a
lost peer, memory that runs out and a DataLoader worker that died."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
import traceback
import warnings
from contextlib import contextmanager, suppress

import torch
from torch.distributed import DistError
from torch.utils.data import get_worker_info
from tqdm import tqdm


class UsageError(Exception):
    """Bad flags or an impossible configuration."""


def end_progress_bars() -> bool:
    """Close every progress bar shown (whether there was one): what follows starts a line."""
    shown = [bar for bar in list(getattr(tqdm, "_instances", ())) if not bar.disable]
    for bar in shown:
        bar.close()
    return bool(shown)


def say_error(line: str) -> None:
    """One line on stderr, on a line of its own even under a progress bar."""
    end_progress_bars()
    print(line, file=sys.stderr, flush=True)


def quit_on_stop_signals() -> None:
    """SIGTERM and SIGINT end this process silently again (not chapter 04's handlers)."""
    with suppress(ValueError):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)


def fail(message: str, status: int = 2, *, skip_teardown: bool = False):
    """One line on stderr, then exit with `status` (2: bad input). Other ranks wait a
    moment first: torchrun ends the job when one worker exits, and rank 0 should have
    said the line. `skip_teardown`: os._exit, where the teardown would say more."""
    rank = int(os.environ.get("RANK") or 0)
    if rank != 0:
        quit_on_stop_signals()  # torchrun's SIGTERM during the wait ends this rank unheard
        time.sleep(3.0)
    say_error(f"error: {'' if rank == 0 else f'[rank {rank}] '}{message}")
    if skip_teardown:
        sys.stdout.flush()
        os._exit(status)
    sys.exit(status)


# What a failed collective says (gloo, and the c10d store), and what it means.
TIMED_OUT = ("timed out", "timeout")
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe",
             "connection refused", "failed to recv, got 0 bytes")
# gloo's plain RuntimeError, without its name, for an operation waiting on one that timed out
GLOO_UNNAMED = ("application timeout caused pair closure",)
# A Ctrl-C reaches the ranks one after another (torchrun passes it on to each in turn): the
# first to stop closes its connections, and the others may see that before their own
# signal. A rank that finds its peer gone waits this long for a Ctrl-C of its own.
CTRL_C_GRACE_S = 1.0


@contextmanager
def explain_peer_failures(resumes: bool = False):
    """A collective that times out or finds its peer gone ends this process with one
    line and exit status 1 (`resumes`: the line says that a rerun resumes)."""
    try:
        yield
    except RuntimeError as e:  # gloo and store errors are RuntimeError subclasses
        text = str(e).lower()
        collective = isinstance(e, DistError) or "gloo" in text or any(k in text for k in GLOO_UNNAMED)
        if "RANK" not in os.environ or not collective:
            raise  # not a collective's error: the usual traceback
        if any(k in text for k in TIMED_OUT):
            what = "a peer stopped answering: a collective timed out (--timeout)"
        elif any(k in text for k in PEER_GONE):
            time.sleep(CTRL_C_GRACE_S)  # a SIGINT now ends the sleep as a KeyboardInterrupt
            what = "a peer closed its connection: another rank failed first (its error is in its own log)"
        else:
            raise
        first = str(e).strip().splitlines()[0]
        first = first.split("] ", 1)[-1] if first.startswith("[") else first  # no source location
        left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) - int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        resume = "; they resume from the last checkpoint" if resumes else ""
        if left > 0:  # torchrun --max-restarts: it starts the workers again itself
            hint = f"; torchrun starts the workers again ({left} restart{'s' if left > 1 else ''} left{resume})"
        else:
            hint = ("; check that every machine is up and the network between them works, then rerun"
                    + (" the same command: it resumes from the last checkpoint" if resumes else ""))
        say_error(f"error: rank {os.environ['RANK']}: {what} ({first}){hint}")
        sys.stdout.flush()
        stop_the_launcher_if_it_hangs()
        os._exit(1)  # no atexit teardown: it would talk to the peer that is gone


# torchrun notices a worker's exit within a fraction of a second, unless its own question to
# the rendezvous is stuck on the connection to a machine that is gone: TCP then retries for
# about 15 minutes (Linux's default) before it gives up, and no signal but SIGKILL ends it.
LAUNCHER_STUCK_S = 10.0


def stop_the_launcher_if_it_hangs() -> None:
    """Under torchrun, as this worker exits on a lost peer: a watcher process stays behind.
    If torchrun has not noticed the exit (the worker still unreaped) LAUNCHER_STUCK_S
    later, it is stuck on the lost machine's rendezvous: the watcher kills it, with one
    line, so that every process of the job ends. Linux only (it reads /proc)."""
    launcher, worker = os.getppid(), os.getpid()
    if "LOCAL_RANK" not in os.environ or launcher == 1 or not os.path.isdir(f"/proc/{worker}"):
        return
    with warnings.catch_warnings():  # Python 3.12+ warns about fork with threads; the child uses none
        warnings.simplefilter("ignore", DeprecationWarning)
        if os.fork() != 0:
            return
    try:  # the watcher: the worker's handlers and files are not its own
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.closerange(3, 1 << 16)
        unreaped_since = None
        while True:
            time.sleep(0.2)
            try:
                with open(f"/proc/{worker}/stat") as f:
                    exited = f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                os._exit(0)  # reaped: torchrun is at work
            unreaped_since = (unreaped_since or time.monotonic()) if exited else None
            if unreaped_since and time.monotonic() - unreaped_since > LAUNCHER_STUCK_S:
                break
        os.kill(launcher, signal.SIGKILL)
        os.write(2, (f"error: torchrun (pid {launcher}) did not notice its worker's exit for "
                     f"{LAUNCHER_STUCK_S:.0f} s: it waits on the lost machine's rendezvous (TCP gives "
                     f"up after about 15 minutes); stopped it\n").encode())
    except OSError:
        pass
    os._exit(0)


# CUDA raises OutOfMemoryError; the CPU allocator a RuntimeError with one of these
OUT_OF_MEMORY = ("out of memory", "not enough memory", "can't allocate memory")
# What the DataLoader says when a worker process died under it
WORKER_DIED = ("killed by signal", "exited unexpectedly")


def dataloader_worker_died(e: BaseException) -> bool:
    text = str(e).lower()
    if isinstance(e, RuntimeError) and "dataloader worker (pid" in text and any(k in text for k in WORKER_DIED):
        return True
    # a worker that died handing a batch over breaks the pipe before the DataLoader sees it
    return isinstance(e, (ConnectionError, EOFError)) and any(
        "torch/utils/data/" in frame.filename.replace(os.sep, "/") for frame in traceback.extract_tb(e.__traceback__))


def out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and any(k in str(e).lower() for k in OUT_OF_MEMORY))


TRAINING_OOM_ADVICE = ("try a smaller --batch-size (per process), and a larger --grad-accum "
                       "to keep the global batch")
MODEL_OOM_ADVICE = "try a smaller --batch-size, --seq-length or --model-preset"

INTERRUPTED = "stopped where it was; what it logged so far stays, nothing else was saved"
# chapter 04 outside its training loop (inside it, the loop saves a checkpoint first)
INTERRUPTED_RESUMABLE = ("stopped where it was; the checkpoints saved so far stay, and the same "
                         "command resumes from the last one")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def dead_child_signal(wait_s: float = 1.0) -> int | None:
    """The signal that ended a child process (a DataLoader worker) no one has reaped yet,
    waiting up to `wait_s` for one to end; None when none died of a signal. The child
    stays unreaped (WNOWAIT), for torch's own checks."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # no child left
            return None
        if info is not None:
            return info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def worker_death_signal(e: BaseException) -> int | None:
    """The signal that ended the DataLoader worker of error `e`: torch names it when its
    SIGCHLD handler saw the death first; else the dead worker may still be there to ask."""
    for text in (str(e), str(e.__cause__)):  # "exited unexpectedly" may hold it in its cause
        named = text.split("killed by signal: ", 1)[1:]
        if named:
            by_name = {signal.strsignal(s): s for s in signal.valid_signals() if signal.strsignal(s)}
            return by_name.get(named[0].splitlines()[0].rstrip(". "))
    return dead_child_signal() if hasattr(os, "waitid") else None


def worker_death_cause(signum: int | None) -> str:
    """What a worker's death by `signum` means: a stop signal sent to the worker itself
    (SIGTERM, SIGHUP: a scheduler ending the job signals every process); SIGKILL, the
    out-of-memory killer's usual way; unknown (the worker was reaped first): either."""
    if signum in STOP_SIGNALS:
        return (f"{signal.Signals(signum).name}, a stop signal, reached the worker itself "
                f"(a job scheduler or `kill`): not a lack of memory")
    if signum == signal.SIGKILL:
        return ("SIGKILL: the kernel's out-of-memory killer is the usual cause (`dmesg` says); "
                "free memory, or pass --num-workers 0")
    return ("unless a job scheduler or `kill` signalled it, the kernel's out-of-memory killer is "
            "the usual cause (`dmesg` says); free memory, or pass --num-workers 0")


def _child_ended(signum, frame):
    """SIGCHLD once the DataLoader's handler is off: nothing to do. A Python function,
    not SIG_DFL: Python runs a signal's handler a moment after the signal arrives, and a
    SIGCHLD that arrived before the switch, handled after it, would find SIG_DFL there
    and print a traceback ("OSError: Signal 17 ignored due to race condition")."""


def stop_watching_workers() -> None:
    """Turn the DataLoader's SIGCHLD handler off. Python runs pending handlers at the start
    of `signal.signal`: torch's may raise there for a worker that just died (of this very
    Ctrl-C, or of what is being reported); it is off all the same."""
    try:
        signal.signal(signal.SIGCHLD, _child_ended)
    except RuntimeError:
        signal.signal(signal.SIGCHLD, _child_ended)


def _interrupted(signum, frame):
    """SIGINT: kill the DataLoader workers first (a live one would print a traceback for
    the batch it was handing over), unheard by the DataLoader, then end main(). A forked
    DataLoader worker has this handler too: it dies of the SIGINT, which its trainer then
    reads as the Ctrl-C it is."""
    if get_worker_info() is not None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    stop_watching_workers()
    for child in multiprocessing.active_children():
        child.kill()
    raise KeyboardInterrupt


def say_interrupted(resumes: bool):
    """Ctrl-C: one line (rank 0), exit status 130, no teardown (peers may be gone, and
    waiting for them would hang)."""
    if int(os.environ.get("RANK") or 0) == 0:
        # the terminal echoed ^C where the cursor was: a bar's close ends that line
        print(f"{'' if end_progress_bars() else chr(10)}interrupted (Ctrl-C): "
              f"{INTERRUPTED_RESUMABLE if resumes else INTERRUPTED}", file=sys.stderr, flush=True)
    os._exit(130)


def run_main(main, oom_advice: str = TRAINING_OOM_ADVICE, resumes: bool = False):
    """main(), with each failure above as one line instead of a traceback on every rank.
    `oom_advice`: the flags to lower; `resumes`: the script resumes from its checkpoints."""
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        # a chapter script holds SIGINT while it imports (its first lines): a Ctrl-C then
        # arrives here, as a KeyboardInterrupt
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
        with explain_peer_failures(resumes):
            return main()
    except (torch.OutOfMemoryError, RuntimeError, ConnectionError, EOFError) as raised:
        # A DataLoader's SIGCHLD handler raises anywhere once it sees its dead worker: not any
        # more (at this very call, maybe: then it says the same death, in torch's words)
        e = raised
        try:
            with suppress(ValueError):  # (the main thread only)
                signal.signal(signal.SIGCHLD, _child_ended)
        except RuntimeError as in_torchs_words:
            signal.signal(signal.SIGCHLD, _child_ended)
            e = in_torchs_words
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if dataloader_worker_died(e):
            signum = worker_death_signal(e)
            if signum == signal.SIGINT:  # a Ctrl-C, which reached the worker first
                say_interrupted(resumes)
            if "killed by signal" in str(e.__cause__):
                first = str(e.__cause__).strip().splitlines()[0]
            fail(f"a DataLoader worker died ({first[:200].rstrip('. ')}): {worker_death_cause(signum)}",
                 status=1, skip_teardown=True)
        if not out_of_memory(e):
            raise
        fail(f"out of memory ({first[:200]}): {oom_advice}", status=1)
    except KeyboardInterrupt:
        say_interrupted(resumes)
    finally:
        signal.signal(signal.SIGINT, previous)
