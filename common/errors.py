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
from contextlib import contextmanager, suppress

import torch
from torch.distributed import DistError
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
        os._exit(1)  # no atexit teardown: it would talk to the peer that is gone


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


def worker_death_cause(message: str) -> str:
    """A stop signal sent to the worker itself (SIGTERM, SIGINT, SIGHUP: a scheduler ending
    the job signals every process) is named; else the out-of-memory killer's SIGKILL."""
    stops = {signal.strsignal(s): s.name for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    name = stops.get(message.rsplit("killed by signal: ", 1)[-1].rstrip(". "))
    if name:
        return f"{name}, a stop signal, reached the worker itself (a job scheduler or `kill`): not a lack of memory"
    return ("the kernel's out-of-memory killer is the usual cause (`dmesg` says); free memory, "
            "or pass --num-workers 0")


def _interrupted(signum, frame):
    """SIGINT: kill the DataLoader workers first (a live one would print a traceback for
    the batch it was handing over), unheard by the DataLoader, then end main()."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()
    raise KeyboardInterrupt


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
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        except RuntimeError as in_torchs_words:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            e = in_torchs_words
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if dataloader_worker_died(e):
            # "exited unexpectedly" may carry the signal that killed it in its cause
            if "killed by signal" in str(e.__cause__):
                first = str(e.__cause__).strip().splitlines()[0]
            fail(f"a DataLoader worker died ({first[:200].rstrip('. ')}): {worker_death_cause(first)}",
                 status=1, skip_teardown=True)
        if not out_of_memory(e):
            raise
        fail(f"out of memory ({first[:200]}): {oom_advice}", status=1)
    except KeyboardInterrupt:
        if int(os.environ.get("RANK") or 0) == 0:
            # the terminal echoed ^C where the cursor was: a bar's close ends that line
            print(f"{'' if end_progress_bars() else chr(10)}interrupted (Ctrl-C): "
                  f"{INTERRUPTED_RESUMABLE if resumes else INTERRUPTED}", file=sys.stderr, flush=True)
        os._exit(130)  # no teardown: peers may be gone, and waiting for them would hang
    finally:
        signal.signal(signal.SIGINT, previous)
