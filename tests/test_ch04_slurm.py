"""Chapter 04 under a scheduler's stop: SLURM, at a job's time limit or preemption, sends
SIGTERM to every process of the job step (the launcher, every trainer, every DataLoader
worker), not to one process group. With the default flags, on 3 ranks, the run saves a
checkpoint and stops, and the same command continues it exactly. The real torchrun runs
the stopped job: the process tree is what the signals meet. (Ctrl-C, SIGINT to torchrun's
group, and SIGTERM to torchrun alone: test_ch04_safety.py.)"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from ch04_runs import NAME, SCRIPT, THREADS, assert_same_as_uninterrupted, flags, resume, start_held, step_dir
from conftest import run, torchrun_cmd
from procs import children, kill_job

SIGNALLED_AFTER = 3  # steps logged before the signals go out


def job_processes(pid: int) -> list[int]:
    """pid and every process below it (torchrun, its trainers, their DataLoader workers)."""
    return [pid, *(p for child in children(pid) for p in job_processes(child))]


def as_slurm_does(pids: list[int], sig: int):
    """`sig` to each process by its pid, in a random order, up to 100 ms apart."""
    for pid in random.sample(pids, len(pids)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        time.sleep(random.uniform(0, 0.1))


@pytest.mark.launch
def test_sigterm_to_every_process_of_the_job_saves_and_the_rerun_continues_exactly(
        tmp_path, uninterrupted_on_3_ranks):
    nproc, reference = 3, uninterrupted_on_3_ranks
    save_dir = tmp_path / "stopped"
    cmd = torchrun_cmd(nproc, SCRIPT, *flags(save_dir, "--ckpt-freq", 100))
    metrics = save_dir / NAME / "metrics.jsonl"
    job, held = start_held(cmd, tmp_path / "job.log", metrics, SIGNALLED_AFTER)
    try:
        procs = job_processes(job.pid)
        # torchrun, its trainers and each trainer's DataLoader worker (the default --num-workers)
        assert len(procs) == 1 + 2 * nproc, procs
        as_slurm_does(procs, signal.SIGTERM)
        resume(held)
        job.wait(timeout=90)
    finally:
        kill_job(job.pid)
    out = (tmp_path / "job.log").read_text()
    assert job.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("interrupted at step")]
    assert len(lines) == 1, out[-3000:]
    line = lines[0]
    step = int(line.split()[3])
    assert f"checkpoint {step_dir(step)} saved; run the same command to resume" in line
    assert "error:" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    # torchrun reports the signal it got with its own SignalException; the trainers print none
    assert out.count("Traceback") <= 1 and "train_llm.py" not in out.split("Traceback")[-1], out[-3000:]
    assert (save_dir / NAME / "checkpoints" / "latest").read_text() == step_dir(step)

    proc = run(cmd, timeout=120, env=THREADS)
    assert f"resumed from {save_dir / NAME / 'checkpoints' / step_dir(step)}: step {step}" in proc.stdout
    assert_same_as_uninterrupted(save_dir / NAME, reference)
