"""Chapter 04's test runs: its command as a user types it, and what the tests compare."""

from __future__ import annotations

import os
import shutil
import signal
import time

import torch

from conftest import TINY, read_jsonl, run, run_warm, start, torchrun_cmd
from procs import children

SCRIPT = "04-checkpointing/train_llm.py"
NAME = "run"
STEPS, FREQ, KEEP = 12, 3, 2
CRASH = 7  # after the checkpoints of steps 3 and 6


# The tiny settings of every chapter test (conftest.TINY) with the DataLoader's default
# worker process (a stop signal must find the run as a user runs it) and 16-token
# sequences (a checkpoint holds the same; a step costs less; argparse: the last one wins).
FLAGS = [*TINY[:TINY.index("--num-workers")], *TINY[TINY.index("--num-workers") + 2:],
         "--seq-length", "16"]

# Every run of chapter 04 in the suite, the reference included, runs two intra-op threads
# per trainer, as on a machine with cores to spare, whatever this machine's share
# (conftest: 1 on 2 cores): each DataLoader worker then starts threads of its own before
# its worker_init_fn, which a stop signal must not kill (preemption.holding_sigterm). The
# number of threads is the same everywhere because it can change the bits of a sum (on
# some CPUs 1 and 2 threads give losses 1e-7 apart): runs compared bit for bit must agree.
THREADS = {"LLM_GUIDE_THREADS": "2"}


def flags(save_dir, *extra):
    """The chapter's flags in the tests; save_dir None: no --save-dir (the two-hosts test
    gives each host its own)."""
    return [*FLAGS, "--max-steps", STEPS, "--ckpt-freq", FREQ, "--keep-last", KEEP,
            *(["--save-dir", save_dir] if save_dir else []), "--experiment-name", NAME, *extra]


def train(save_dir, *extra, restarts=0, check=True, nproc=2, env=None):
    """The chapter's command: torchrun, 2 processes (or `nproc`) on the CPU (gloo), its
    ranks started warm (conftest.run_warm); with `restarts`, the real torchrun with
    --max-restarts, which restarts a crashed job (a test marked launch). A run takes
    seconds; the short timeout turns a hang into a failure soon."""
    env = {**THREADS, **(env or {})}
    if restarts:
        cmd = torchrun_cmd(nproc, SCRIPT, *flags(save_dir, *extra), extra=[f"--max-restarts={restarts}"])
        return run(cmd, check=check, timeout=120, env=env)
    return run_warm(torchrun_cmd(nproc, SCRIPT, *flags(save_dir, *extra)), check=check, timeout=120, env=env)


def start_job(cmd, log, until, timeout=240, env=None):
    """The real torchrun job `cmd`, which the test acts on while it runs (conftest.start),
    its output into the file `log`; returns once `until()` holds (or the job ended, or
    `timeout` passed)."""
    job = start(cmd, log, env={**THREADS, **(env or {})})
    deadline = time.monotonic() + timeout
    while job.poll() is None and time.monotonic() < deadline and not until():
        time.sleep(0.01)
    return job


def descendants(pid: int) -> list[int]:
    """Every process below pid."""
    return [p for child in children(pid) for p in (child, *descendants(child))]


def steps_logged(metrics) -> int:
    return metrics.read_text().count("\n") if metrics.exists() else 0


def start_held(cmd, log, metrics, step, timeout=240):
    """The real torchrun job `cmd` (conftest.start), its output into the file `log`,
    returned with `step` steps in `metrics` and every process its trainers started (their
    DataLoader workers, found after the first step) stopped with SIGSTOP: a trainer then
    waits for its next batch once it has used the ones fetched ahead, so the run cannot
    finish before a stop signal the test sends now, however busy the machine. A signal
    sent to a stopped process waits; `resume(held)` lets them go on. (job, held pids)"""
    job = start(cmd, log, env=THREADS)
    deadline, held = time.monotonic() + timeout, []
    while job.poll() is None and time.monotonic() < deadline:
        logged = steps_logged(metrics)
        if logged >= 1 and not held:
            held = [p for trainer in children(job.pid) for p in descendants(trainer)]
        if logged >= step and held:
            for pid in held:
                os.kill(pid, signal.SIGSTOP)
            return job, held
        time.sleep(0.01)
    raise AssertionError(f"the job ended or stalled before step {step}:\n{log.read_text()[-3000:]}")


def resume(held) -> None:
    for pid in held:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def copy_run(src_run_dir, save_dir):
    """A private copy of a finished run (same experiment name, another --save-dir)."""
    shutil.copytree(src_run_dir, save_dir / NAME)
    return save_dir / NAME


def snapshot(folder) -> dict:
    """Every file's size and modification time, but the lock file (.owner names whoever
    holds the folder now, so each run rewrites it)."""
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.name != ".owner"}


def assert_same_as_uninterrupted(run_dir, reference):
    """Steps 1..STEPS each logged once, with exactly the uninterrupted run's losses, and
    exactly its final weights."""
    got, ref = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in ref]
    a = torch.load(run_dir / "model.pt", weights_only=True)
    b = torch.load(reference / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)
