"""Chapter 04's test runs: its command as a user types it, and what the tests compare."""

from __future__ import annotations

import shutil
import time

import torch

from conftest import TINY, read_jsonl, run, start, torchrun_cmd
from warm import kill_launch

SCRIPT = "04-checkpointing/train_llm.py"
NAME = "run"
STEPS, FREQ, KEEP = 12, 3, 2
CRASH = 7  # after the checkpoints of steps 3 and 6


# The tiny settings of every chapter test (conftest.TINY) with the DataLoader's default
# worker process (a stop signal must find the run as a user runs it) and 16-token
# sequences (a checkpoint holds the same; a step costs less; argparse: the last one wins).
FLAGS = [*TINY[:TINY.index("--num-workers")], *TINY[TINY.index("--num-workers") + 2:],
         "--seq-length", "16"]

# A stopped job's trainers run two intra-op threads each, as on a machine with cores to
# spare, whatever this machine's share (conftest: 1 on 2 cores): each DataLoader worker
# then starts threads of its own before its worker_init_fn, which a stop signal must not
# kill (preemption.holding_sigterm). The losses are the same bits with 1 thread or 2.
SPARE_CORES = {"LLM_GUIDE_THREADS": "2"}


def flags(save_dir, *extra):
    """The chapter's flags in the tests; save_dir None: no --save-dir (the two-hosts test
    gives each host its own)."""
    return [*FLAGS, "--max-steps", STEPS, "--ckpt-freq", FREQ, "--keep-last", KEEP,
            *(["--save-dir", save_dir] if save_dir else []), "--experiment-name", NAME, *extra]


def train(save_dir, *extra, restarts=0, check=True, env=None, warm=True, nproc=2):
    """The chapter's command: torchrun, 2 processes (or `nproc`) on the CPU (gloo). A run
    takes seconds; the short timeout turns a hang into a failure soon. With `restarts`, a
    crashed job starts again as torchrun would start it (conftest.run: the suite's warm
    launcher counts TORCHELASTIC_RESTART_COUNT up; warm=False: torchrun itself)."""
    cmd = torchrun_cmd(nproc, SCRIPT, *flags(save_dir, *extra),
                       extra=[f"--max-restarts={restarts}"] if restarts else [])
    return run(cmd, check=check, timeout=120, env=env, warm=warm)


def start_job(cmd, log, until, timeout=240, env=None, warm=True):
    """A torchrun job the test acts on while it runs (conftest.start: through the warm
    launcher unless warm=False), its output into the file `log`; returns once `until()`
    holds (or the job ended, or `timeout` passed)."""
    job = start(cmd, log, env=env, warm=warm)
    deadline = time.monotonic() + timeout
    while job.poll() is None and time.monotonic() < deadline and not until():
        time.sleep(0.01)
    return job


def kill_job(launcher_pid: int):
    """SIGKILL a torchrun job, launcher and workers at once, as a lost machine would.
    torchrun starts each worker in a session of its own (so does the warm launcher), so
    the launcher's process group alone would leave the workers running."""
    kill_launch(launcher_pid)


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
