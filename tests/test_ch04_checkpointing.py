"""Chapter 04: a run that crashes, is killed, or is restarted continues with exactly the
losses and weights of an uninterrupted run (bit for bit on CPU); a corrupt checkpoint falls back to the one before; old checkpoints are pruned;
loading never unpickles code; a resume with other settings is refused; --fresh archives;
a finished run is left alone."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from ch04_runs import (CRASH, FREQ, NAME, SCRIPT, STEPS, THREADS, assert_same_as_uninterrupted, copy_run, flags,
                       snapshot, start_held, step_dir, steps_logged, train)
from common.data import build_datasets
from common.files import write_manifest
from conftest import SMALL_CORPUS_FLAGS, load_script, python_cmd, read_json, read_jsonl, run, run_warm, \
    shuffled_epochs, small_corpus, torchrun_cmd, training_order
from procs import kill_job
from pages import readme_command


def test_uninterrupted_run_keeps_the_last_k_checkpoints(uninterrupted):
    _, run_dir = uninterrupted
    ckpt = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", step_dir(9), step_dir(12)]
    assert (ckpt / "latest").read_text() == step_dir(12)
    assert not list(run_dir.rglob(".tmp-*")) and not list(run_dir.rglob("*.tmp"))
    assert sorted(p.name for p in (ckpt / step_dir(12)).iterdir()) == ["manifest.json", "state.pt"]


def test_summary_reports_the_checkpoint_cost(uninterrupted):
    proc, run_dir = uninterrupted
    summary = read_json(run_dir / "summary.json")
    ck = summary["checkpoint"]
    assert ck["count"] == STEPS // FREQ
    folder = run_dir / "checkpoints" / step_dir(12)
    assert ck["size_mb"] == pytest.approx(sum(f.stat().st_size for f in folder.iterdir()) / 2**20)
    assert ck["save_s"] > 0 and ck["save_mb_per_s"] == pytest.approx(ck["size_mb"] / ck["save_s"])
    assert summary["resumed_at_step"] == 0 and summary["restart_count"] == 0
    assert "| checkpoint size" in proc.stdout and "| checkpoint save" in proc.stdout


@pytest.mark.launch
def test_torchrun_restart_after_a_crash_continues_exactly(tmp_path, uninterrupted):
    """The README's crash demo, under the real torchrun (its own restart)."""
    proc = run([*readme_command("04-checkpointing/README.md", "--max-restarts=3"),
                *flags(tmp_path, "--crash-at-step", CRASH)], timeout=120, env=THREADS)
    run_dir = tmp_path / NAME
    assert f"injected crash after step {CRASH}" in proc.stdout + proc.stderr
    assert (run_dir / f"crash-injected-at-step-{CRASH}").exists()
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])
    summary = read_json(run_dir / "summary.json")
    assert f"resumed from {run_dir / 'checkpoints' / step_dir(6)}: step 6" in proc.stdout
    assert summary["resumed_at_step"] == 6 and summary["restart_count"] == 1


def test_on_3_ranks_a_resume_continues_exactly_too(tmp_path, uninterrupted_on_3_ranks):
    """On 3 ranks an all-reduce's sums depend on where each gradient sits in DDP's
    buckets, which DDP rebuilds after its first backward. A resumed run rebuilds them
    before its first step (checkpoint.rebuild_ddp_buckets), so a rerun after a crash
    still ends with exactly the losses and weights of an uninterrupted 3-rank run.
    (Without it the weights differed from step 8 on, by 6e-8.)"""
    assert train(tmp_path / "restarted", "--crash-at-step", CRASH, nproc=3, check=False).returncode != 0
    proc = train(tmp_path / "restarted", "--crash-at-step", CRASH, nproc=3)
    assert f"resumed from {tmp_path / 'restarted' / NAME / 'checkpoints' / step_dir(6)}: step 6" in proc.stdout
    assert_same_as_uninterrupted(tmp_path / "restarted" / NAME, uninterrupted_on_3_ranks)
    assert "over 2 batches" in proc.stdout  # --val-batches 2 in all, not one per rank


def test_a_resume_in_a_later_epoch_continues_exactly(tmp_path):
    """The suite's other runs never leave epoch 0. On a 13-sample corpus, 2 ranks x batch
    2 take 3 steps an epoch: the 12 steps run four epochs, each on its own shuffle
    (randperm(seed + epoch), every second sample per rank), and a crash after step 5,
    resumed from step 4's checkpoint (one step into epoch 1), continues exactly."""
    seed, whole = 5, tmp_path / "whole"
    small = ["--dataset-name", small_corpus(tmp_path), *SMALL_CORPUS_FLAGS, "--batch-size", 2,
             "--seed", seed, "--ckpt-freq", 4, "--num-workers", 0]  # the probe reads in-process
    whole.mkdir()
    orders = training_order(whole, lambda *a: torchrun_cmd(2, *a), SCRIPT, *flags(whole, *small), env=THREADS)
    n = read_json(whole / NAME / "summary.json")["data"]["train_samples"]
    assert n == 13 and orders == shuffled_epochs(n, seed, epochs=4, batch=2, world=2)
    assert train(tmp_path / "crashed", *small, "--crash-at-step", 5, check=False).returncode != 0
    proc = train(tmp_path / "crashed", *small, "--crash-at-step", 5)
    assert f"resumed from {tmp_path / 'crashed' / NAME / 'checkpoints' / step_dir(4)}: step 4" in proc.stdout
    assert_same_as_uninterrupted(tmp_path / "crashed" / NAME, whole / NAME)


@pytest.mark.launch
def test_rerun_after_sigkill_of_the_whole_job_continues_exactly(tmp_path, uninterrupted):
    """SIGKILL to every process of the job (no cleanup, no atexit) at whatever moment
    the run has passed its first checkpoint; then the same command again."""
    cmd = torchrun_cmd(2, SCRIPT, *flags(tmp_path))
    metrics = tmp_path / NAME / "metrics.jsonl"
    job, _ = start_held(cmd, tmp_path / "killed.log", metrics, FREQ + 2)
    kill_job(job.pid)
    job.wait()
    killed_at = steps_logged(metrics)
    assert FREQ < killed_at < STEPS, f"killed after step {killed_at}"
    assert not (tmp_path / NAME / "summary.json").exists()

    proc = run(cmd, timeout=120, env=THREADS)
    assert "resumed from" in proc.stdout
    assert_same_as_uninterrupted(tmp_path / NAME, uninterrupted[1])


def test_crash_without_restarts_fails_and_keeps_its_checkpoints(crashed):
    proc, run_dir = crashed
    assert proc.returncode != 0
    assert f"injected crash after step {CRASH}" in proc.stdout + proc.stderr
    assert (run_dir / "checkpoints" / "latest").read_text() == step_dir(6)
    assert CRASH <= len(read_jsonl(run_dir / "metrics.jsonl")) < STEPS
    assert not (run_dir / "summary.json").exists()


def test_rerun_falls_back_past_a_corrupt_latest_checkpoint(tmp_path, crashed, uninterrupted):
    """The newest checkpoint is cut in half (a disk that filled up, say): the rerun
    warns, resumes from the one before, and still ends exactly as the reference."""
    run_dir = copy_run(crashed[1], tmp_path)
    newest = run_dir / "checkpoints" / step_dir(6) / "state.pt"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    proc = train(tmp_path, "--crash-at-step", CRASH)  # the same command again
    assert f"checkpoint {newest.parent} cannot be used (ValueError: state.pt does not match" in proc.stdout
    assert f"resumed from {run_dir / 'checkpoints' / step_dir(3)}: step 3" in proc.stdout
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])


def test_rerun_of_a_finished_run_changes_nothing(tmp_path, uninterrupted):
    run_dir = copy_run(uninterrupted[1], tmp_path)
    before, summary = snapshot(run_dir), (run_dir / "summary.json").read_bytes()
    proc = train(tmp_path)
    assert f"this run already finished (step {STEPS} of {STEPS}); nothing to do" in proc.stdout
    assert snapshot(run_dir) == before and (run_dir / "summary.json").read_bytes() == summary


def test_rerun_of_a_finished_run_with_a_damaged_end_finishes_it_again(tmp_path, uninterrupted):
    """A finished run whose summary.json was cut short and whose model.pt is gone is not
    'already finished': the rerun runs its end again (validation, sample, weights,
    summary) from the last checkpoint, and trains nothing."""
    run_dir = copy_run(uninterrupted[1], tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text((run_dir / "summary.json").read_text()[:100])
    (run_dir / "model.pt").unlink()
    proc = train(tmp_path)
    assert "already finished" not in proc.stdout
    assert f"training finished at step {STEPS}; its end" in proc.stdout and "finishing it now" in proc.stdout
    again = json.loads((run_dir / "summary.json").read_text())
    assert again["val_loss"] == summary["val_loss"] and (run_dir / "model.pt").stat().st_size > 0


def test_resume_with_a_different_flag_is_refused(tmp_path, uninterrupted):
    """One process of batch 8 keeps the global batch of 2 x 4: only --lr differs."""
    run_dir = copy_run(uninterrupted[1], tmp_path)
    before = snapshot(run_dir)
    proc = run_warm(python_cmd(SCRIPT, *flags(tmp_path, "--batch-size", 8, "--lr", 2e-3)), check=False, env=THREADS)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: checkpoint {run_dir / 'checkpoints' / step_dir(12)} belongs "
                           f"to a run with other settings (--lr 0.001 -> 0.002)")
    assert snapshot(run_dir) == before


def test_resume_with_another_world_size_but_the_same_global_batch(tmp_path, crashed, uninterrupted):
    """Saved by 2 processes x batch 4, resumed by 1 process x batch 8: global batch k is
    the same samples either way, so the run continues where it stopped. One process
    averages the gradient in one sum instead of two, so the match is to float rounding,
    not to the bit."""
    run_dir = copy_run(crashed[1], tmp_path)
    proc = run_warm(python_cmd(SCRIPT, *flags(tmp_path, "--batch-size", 8)), env=THREADS)
    assert f"resumed from {run_dir / 'checkpoints' / step_dir(6)}: step 6" in proc.stdout
    got, ref = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(uninterrupted[1] / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in ref], rel=1e-5, abs=0)


def test_resume_with_another_dtype_is_refused_and_auto_is_the_dtype_it_resolves_to(tmp_path, uninterrupted):
    """The reference run trained with --dtype auto, fp32 on a CPU: bf16 autocast would
    continue it with other losses, so it is refused by name; an explicit fp32 is the
    same run (here: already finished). One process of batch 8 keeps the global batch."""
    run_dir = copy_run(uninterrupted[1], tmp_path)
    before = snapshot(run_dir)
    proc = run_warm(python_cmd(SCRIPT, *flags(tmp_path, "--batch-size", 8, "--dtype", "bf16")), check=False,
                    env=THREADS)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: checkpoint {run_dir / 'checkpoints' / step_dir(12)} belongs "
                           f"to a run with other settings (--dtype fp32 -> bf16)")
    assert snapshot(run_dir) == before
    proc = run_warm(python_cmd(SCRIPT, *flags(tmp_path, "--batch-size", 8, "--dtype", "fp32")), env=THREADS)
    assert f"this run already finished (step {STEPS} of {STEPS})" in proc.stdout


def test_resume_with_another_global_batch_is_refused(tmp_path, crashed):
    run_dir = copy_run(crashed[1], tmp_path)
    before = snapshot(run_dir)
    proc = run_warm(python_cmd(SCRIPT, *flags(tmp_path)), check=False, env=THREADS)  # 1 process x 4
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "(global batch 8 -> 4)" in line
    assert snapshot(run_dir) == before


def test_fresh_archives_the_old_run_and_starts_at_step_1(tmp_path, uninterrupted):
    run_dir = copy_run(uninterrupted[1], tmp_path)
    old = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "summary.json")}
    proc = train(tmp_path, "--fresh")
    [archive] = run_dir.glob("archive-*")
    assert f"--fresh: earlier files moved to {archive}" in proc.stdout
    assert sorted(p.name for p in archive.iterdir()) == \
        ["checkpoints", "metrics.jsonl", "model.pt", "summary.json"]
    assert {name: (archive / name).read_bytes() for name in old} == old
    assert "resumed from" not in proc.stdout
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])


class RunsCode:
    """Unpickling this runs a shell command: what a malicious checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_loading_never_unpickles_code(tmp_path):
    """A checkpoint whose state.pt carries code, with a manifest that vouches for it (an
    attacker can write both): weights_only=True refuses to run it."""
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    torch.save({"step": 1, "payload": RunsCode(marker)}, evil / "state.pt")
    ch04 = load_script(SCRIPT)
    from checkpoint import run_settings  # beside the script, on the path since it was loaded
    args = ch04.parse_args([*map(str, flags(tmp_path / "out"))])
    data = build_datasets("stdlib", 64)  # the cached corpus: the settings match
    write_manifest(evil, {"settings": run_settings(args, "fp32", 4, data.fingerprint)})

    proc = run_warm(python_cmd(SCRIPT, *flags(tmp_path / "out", "--resume-from", evil)), check=False)
    assert proc.returncode == 2
    assert f"checkpoint {evil} cannot be used (UnpicklingError" in proc.stdout
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: no checkpoint in {tmp_path}")
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError):  # what the chapter's load does
        torch.load(evil / "state.pt", map_location="cpu", weights_only=True, mmap=True)
    assert not marker.exists()
    torch.load(evil / "state.pt", weights_only=False)  # the payload is live: unsafe loading runs it
    assert marker.exists()
