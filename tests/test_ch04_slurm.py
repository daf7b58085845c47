"""Chapter 04 under a scheduler's stop: SLURM, at a job's time limit or preemption, sends
SIGTERM to every process of the job step (the launcher, every trainer, every DataLoader
worker), not to one process group; a terminal's Ctrl-C sends SIGINT to torchrun's group.
Either way, with the default flags (3 ranks under SLURM's signal, 2 under Ctrl-C; torchrun
alone signalled: test_ch04_safety.py), the run saves a checkpoint and stops, and the same
command continues it exactly. The real torchrun runs the stopped job:
the process tree is what the signals meet."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from ch04_runs import NAME, SCRIPT, SPARE_CORES, assert_same_as_uninterrupted, flags, kill_job, start_job, step_dir
from conftest import run, torchrun_cmd
from warm import children

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


@pytest.mark.parametrize("how, nproc", [("SIGTERM-to-every-process", 3),  # SLURM
                                         ("SIGINT-to-the-group", 2)])  # a terminal's Ctrl-C
@pytest.mark.long
def test_a_stop_signal_to_the_whole_job_saves_and_the_rerun_continues_exactly(tmp_path, request, how, nproc):
    reference = request.getfixturevalue("uninterrupted")[1] if nproc == 2 else \
        request.getfixturevalue("uninterrupted_on_3_ranks")
    save_dir = tmp_path / "stopped"
    cmd = torchrun_cmd(nproc, SCRIPT, *flags(save_dir, "--ckpt-freq", 100))
    metrics = save_dir / NAME / "metrics.jsonl"
    job = start_job(cmd, tmp_path / "job.log", warm=False, env=SPARE_CORES,
                    until=lambda: metrics.exists() and metrics.read_text().count("\n") >= SIGNALLED_AFTER)
    try:
        assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
        procs = job_processes(job.pid)
        # torchrun, its trainers and each trainer's DataLoader worker (the default --num-workers)
        assert len(procs) == 1 + 2 * nproc, procs
        if how.startswith("SIGTERM"):
            as_slurm_does(procs, signal.SIGTERM)
        else:
            os.killpg(job.pid, signal.SIGINT)  # a terminal's Ctrl-C
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

    proc = run(cmd, timeout=120)
    assert f"resumed from {save_dir / NAME / 'checkpoints' / step_dir(step)}: step {step}" in proc.stdout
    assert_same_as_uninterrupted(save_dir / NAME, reference)
