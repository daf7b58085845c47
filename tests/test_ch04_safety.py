"""Chapter 04 never loses or corrupts what a run produced: another run's settings, broken
or tampered checkpoints, a torn metrics line, a second job on the same folder (with flock,
or with a lock file where flock does not work), a rollback,
--fresh under restarts, and Ctrl-C / SIGTERM each end in a clear state, and a rerun still
continues exactly."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import time

import pytest

from common import runfolder
from common.runfolder import claim_run_folder
from conftest import REPO, python_cmd, read_json, read_jsonl, run, run_folder_held, run_warm, torchrun_cmd
from procs import children, in_session, kill_job
from ch04_runs import (CRASH, FREQ, NAME, SCRIPT, STEPS, THREADS, assert_same_as_uninterrupted, copy_run, flags,
                       resume, snapshot, start_held, start_job, step_dir, train)

FORKSERVER_DEFAULT = REPO / "tests" / "forkserver_default.py"  # runs SCRIPT as Python 3.14 would


def test_another_preset_is_refused_before_anything_changes(tmp_path, crashed):
    run_dir = copy_run(crashed[1], tmp_path)
    before = snapshot(run_dir)
    proc = train(tmp_path, "--model-preset", "small", check=False)
    assert proc.returncode != 0
    assert "belongs to a run with other settings (--model-preset tiny -> small)" in proc.stderr
    assert snapshot(run_dir) == before


def test_another_corpus_or_tokenizer_is_refused(tmp_path, crashed):
    """The manifest records the data fingerprint; a machine whose corpus or tokenizer
    differs must not resume silently."""
    run_dir = copy_run(crashed[1], tmp_path)
    for manifest in run_dir.glob("checkpoints/step-*/manifest.json"):
        meta = json.loads(manifest.read_text())
        meta["settings"]["data fingerprint"] = "0123456789abcdef"
        manifest.write_text(json.dumps(meta))
    proc = train(tmp_path, "--crash-at-step", CRASH, check=False)
    assert proc.returncode != 0
    assert "(data fingerprint 0123456789abcdef ->" in proc.stderr


def test_a_flipped_byte_is_caught_and_the_previous_checkpoint_used(tmp_path, crashed, uninterrupted):
    run_dir = copy_run(crashed[1], tmp_path)
    state = run_dir / "checkpoints" / step_dir(6) / "state.pt"
    data = bytearray(state.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):  # inside the tensor data, same size
        data[i] ^= 0xFF
    state.write_bytes(bytes(data))
    proc = train(tmp_path, "--crash-at-step", CRASH)
    assert "state.pt does not match its checksum" in proc.stdout
    assert f"resumed from {run_dir / 'checkpoints' / step_dir(3)}: step 3" in proc.stdout
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])


def test_when_no_checkpoint_loads_the_run_stops_and_changes_nothing(tmp_path, crashed):
    run_dir = copy_run(crashed[1], tmp_path)
    for state in run_dir.glob("checkpoints/step-*/state.pt"):
        state.write_bytes(b"not a checkpoint")
    before = snapshot(run_dir)
    proc = train(tmp_path, "--crash-at-step", CRASH, check=False)
    assert proc.returncode != 0
    assert f"no checkpoint in {run_dir / 'checkpoints'} could be loaded" in proc.stderr
    assert snapshot(run_dir) == before


def test_a_folder_named_latest_stops_the_run_before_any_work(tmp_path, crashed):
    """`checkpoints/latest` made a folder (by hand, or by a tool that keeps a folder
    there): the run's first save could not write its pointer, and failed after its steps
    were trained, with "latest.tmp ... Is a directory". It stops now, with one line that
    says what to move, and touches nothing: the folder may hold someone's files. (One
    process of batch 8 keeps the global batch.)"""
    run_dir = copy_run(crashed[1], tmp_path)
    pointer = run_dir / "checkpoints" / "latest"
    pointer.unlink()
    pointer.mkdir()
    (pointer / "notes.txt").write_text("mine")
    before = snapshot(run_dir)
    proc = run_warm(python_cmd(SCRIPT, *flags(tmp_path, "--batch-size", 8)), check=False, env=THREADS)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {pointer} is a folder, where the file naming the last checkpoint belongs: nothing was "
        f"changed; move that folder out of {pointer.parent}, then run the same command"]
    assert snapshot(run_dir) == before


def test_a_torn_last_metrics_line_does_not_block_the_resume(tmp_path, crashed, uninterrupted):
    run_dir = copy_run(crashed[1], tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(f'{{"step": {CRASH + 1}, "loss": 7.1')  # a kill or a full disk in mid-write
    train(tmp_path, "--crash-at-step", CRASH)
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])


def test_a_second_job_on_the_same_folder_is_refused(tmp_path):
    """One owner at a time: the lock names the owner, holds without its note, and goes
    when the owner's process does."""
    with run_folder_held(tmp_path / NAME) as holder:
        proc = train(tmp_path, check=False)
        assert proc.returncode != 0
        assert f"run folder '{tmp_path / NAME}' is in use by pid {holder.pid}" in proc.stderr
        (tmp_path / NAME / ".owner").unlink()  # the note of who holds it, not the lock
        proc = train(tmp_path, check=False)
        assert proc.returncode != 0 and f"run folder '{tmp_path / NAME}' is in use by another job" in proc.stderr
    train(tmp_path)  # the holder is gone: so is its lock
    assert read_json(tmp_path / NAME / "summary.json")["chapter"] == "04-checkpointing"


@pytest.mark.launch
def test_fresh_under_restarts_archives_once(tmp_path, crashed, uninterrupted):
    run_dir = copy_run(crashed[1], tmp_path)
    train(tmp_path, "--fresh", "--crash-at-step", 5, restarts=2)
    archives = list(run_dir.glob("archive-*"))
    assert len(archives) == 1, archives  # not one more at the restart after the crash
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])


def test_a_rollback_stays_rolled_back(tmp_path, uninterrupted):
    """--resume-from an older checkpoint makes it `latest` and moves the newer ones out of
    the resume path: interrupted and rerun plainly, the run continues the new timeline."""
    train(tmp_path, "--keep-last", 5)
    run_dir, ckpt = tmp_path / NAME, tmp_path / NAME / "checkpoints"
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "elsewhere" / "good-one"  # --resume-from through a symbolic link
    link.symlink_to(ckpt / step_dir(6))
    proc = train(tmp_path, "--keep-last", 5, "--resume-from", link, "--crash-at-step", CRASH, check=False)
    assert proc.returncode != 0 and f"resumed from {ckpt / step_dir(6)}: step 6" in proc.stdout
    assert (ckpt / "latest").read_text() == step_dir(6)
    assert sorted(p.name for p in (tmp_path / "elsewhere").iterdir()) == ["good-one"]  # no stray pointer
    assert sorted(p.name for p in (ckpt / "abandoned").iterdir()) == \
        [step_dir(9), step_dir(12)]
    proc = train(tmp_path, "--keep-last", 5, "--crash-at-step", CRASH)  # the plain command
    assert f"resumed from {ckpt / step_dir(6)}: step 6" in proc.stdout
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])


def test_a_run_stopped_after_its_last_checkpoint_is_finished_by_the_rerun(tmp_path, uninterrupted):
    """Killed during the final validation (the handlers are gone by then): the last step is
    committed, but model.pt and summary.json are missing. The rerun finishes the end."""
    run_dir = copy_run(uninterrupted[1], tmp_path)
    (run_dir / "summary.json").unlink()
    (run_dir / "model.pt").unlink()
    proc = train(tmp_path)
    assert f"training finished at step {STEPS}; its end (validation, sample, weights, summary) did not" in proc.stdout
    summary = read_json(run_dir / "summary.json")
    reference = read_json(uninterrupted[1] / "summary.json")
    assert summary["final_loss"] == reference["final_loss"] and summary["val_loss"] == reference["val_loss"]
    assert "no speed was measured" in summary["notes"][0]
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])  # model.pt too


@pytest.mark.launch
def test_resume_from_acts_once_per_job_under_restarts(tmp_path, crashed, uninterrupted):
    """--resume-from step 3, then a crash after step 10 under --max-restarts: the restart
    resumes from step 9, which this job saved, not from step 3 again; nor does it check
    --resume-from again, though --keep-last 2 has pruned step 3 by then."""
    run_dir = copy_run(crashed[1], tmp_path)
    ckpt = run_dir / "checkpoints"
    proc = train(tmp_path, "--resume-from", ckpt / step_dir(3), "--crash-at-step", 10, restarts=1)
    assert proc.stdout.count("resumed from") == 2 and not (ckpt / step_dir(3)).exists()
    assert f"resumed from {ckpt / step_dir(9)}: step 9" in proc.stdout.split("injected crash")[-1]
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])


def test_a_folder_of_another_chapters_run_is_archived_not_overwritten(tmp_path, uninterrupted):
    """The same --experiment-name as a chapter 03 run (results, no checkpoints): chapter 04
    starts fresh and moves those files into an archive, byte for byte, first."""
    run_dir = tmp_path / NAME
    run_dir.mkdir()
    earlier = {"metrics.jsonl": b'{"step": 1}\n', "summary.json": b'{"chapter": "03-ddp"}', "model.pt": b"weights"}
    for name, data in earlier.items():
        (run_dir / name).write_bytes(data)
    proc = train(tmp_path)
    [archive] = run_dir.glob("archive-*")
    assert {p.name: p.read_bytes() for p in archive.iterdir()} == earlier
    assert f"no checkpoint to resume from in {run_dir}: its earlier files moved to {archive}" in proc.stdout
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])


def test_a_crash_before_the_first_checkpoint_is_archived_and_not_injected_again(tmp_path):
    """The injected crash comes before any checkpoint: the same command again archives the
    first attempt's files but keeps the crash's marker, so it trains through to the end."""
    run_dir = tmp_path / NAME
    assert train(tmp_path, "--crash-at-step", 2, "--ckpt-freq", 0, check=False).returncode != 0
    train(tmp_path, "--crash-at-step", 2, "--ckpt-freq", 0)
    [archive] = run_dir.glob("archive-*")
    assert (archive / "metrics.jsonl").exists() and (run_dir / "crash-injected-at-step-2").exists()
    assert read_json(run_dir / "summary.json")["final_loss"] is not None


def test_without_a_latest_pointer_the_rerun_resumes_from_the_newest_checkpoint(tmp_path, crashed, uninterrupted):
    run_dir = copy_run(crashed[1], tmp_path)
    (run_dir / "checkpoints" / "latest").unlink()
    proc = train(tmp_path, "--crash-at-step", CRASH)
    assert "has checkpoints but no `latest` pointer" in proc.stdout
    assert f"resumed from {run_dir / 'checkpoints' / step_dir(6)}: step 6" in proc.stdout
    assert not (run_dir / "checkpoints" / "abandoned").exists()
    assert_same_as_uninterrupted(run_dir, uninterrupted[1])


@pytest.mark.launch
def test_sigterm_to_the_workers_under_restarts_says_what_happens_next(tmp_path, uninterrupted):
    """A signal to the workers alone (their process groups), under --max-restarts: they
    save and stop, torchrun restarts them, they resume; the line said so."""
    cmd = torchrun_cmd(2, SCRIPT, *flags(tmp_path, "--ckpt-freq", 100), extra=["--max-restarts=1"])
    metrics = tmp_path / NAME / "metrics.jsonl"
    job, held = start_held(cmd, tmp_path / "job.log", metrics, 5)
    try:
        for worker in children(job.pid):
            os.killpg(worker, signal.SIGTERM)  # each worker and its DataLoader process
        resume(held)
        job.wait(timeout=120)
    finally:
        kill_job(job.pid)
    out = (tmp_path / "job.log").read_text()
    assert job.returncode == 0, out[-3000:]
    [line] = [line for line in out.splitlines() if line.startswith("interrupted at step")]
    assert "torchrun restarts the workers from it" in line
    assert_same_as_uninterrupted(tmp_path / NAME, uninterrupted[1])


@pytest.mark.launch
@pytest.mark.parametrize("sig, extra", [(signal.SIGTERM, []), (signal.SIGINT, ["--deterministic"])],
                         ids=["SIGTERM", "SIGINT-deterministic"])
def test_a_signal_saves_a_checkpoint_and_the_rerun_continues_exactly(tmp_path, uninterrupted, sig, extra):
    """What a scheduler (SIGTERM) or Ctrl-C (SIGINT) does, with the default DataLoader
    worker: torchrun passes the signal on to each worker's process group; the current
    step ends, a checkpoint is written, one line says so, the job exits non-zero within
    seconds. SIGTERM with forkserver as the default start method (Python 3.14's: its
    server, in the trainer's group, would die of the signal and take the worker along);
    SIGINT with Python's default. The SIGINT job runs with
    --deterministic, as the GPU test of exact resume does: on a CPU, whose kernels are
    deterministic anyway, it changes no number, and the resumed run says it ran so."""
    script = [FORKSERVER_DEFAULT, SCRIPT] if sig == signal.SIGTERM else [SCRIPT]
    cmd = [str(c) for c in torchrun_cmd(2, *script, *flags(tmp_path, "--ckpt-freq", 100, *extra))]
    metrics = tmp_path / NAME / "metrics.jsonl"
    job, held = start_held(cmd, tmp_path / "job.log", metrics, 5)
    t0 = time.monotonic()
    try:
        os.killpg(job.pid, sig)  # torchrun's process group, as a terminal's Ctrl-C does
        resume(held)
        job.wait(timeout=60)
    finally:
        kill_job(job.pid)
    seconds = time.monotonic() - t0
    out = (tmp_path / "job.log").read_text()
    assert job.returncode != 0 and seconds < 60, (job.returncode, seconds)  # a step and a save, on a busy machine too
    lines = [line for line in out.splitlines() if line.startswith("interrupted at step")]
    assert len(lines) == 1, out[-3000:]
    step = int(lines[0].split()[3])
    assert f"checkpoint {step_dir(step)} saved; run the same command to resume " \
           f"(with --experiment-name {NAME})" in lines[0]
    # no traceback from the workers; torchrun reports the signal it got with its own
    # (SignalException), which no training script can silence
    assert "KeyboardInterrupt" not in out and "train_llm.py" not in out.split("Traceback")[-1] \
        and out.count("Traceback") <= 1, out[-3000:]
    assert (tmp_path / NAME / "checkpoints" / "latest").read_text() == step_dir(step)
    proc = run(cmd, timeout=120, env=THREADS)
    assert f"step {step}" in proc.stdout
    assert_same_as_uninterrupted(tmp_path / NAME, uninterrupted[1])
    deterministic = bool(extra)
    assert read_json(tmp_path / NAME / "summary.json")["deterministic"] == deterministic
    assert ("| deterministic kernels " in proc.stdout) == deterministic
    assert f'"deterministic_algorithms": {str(deterministic).lower()}' in proc.stdout


@pytest.mark.launch
def test_workers_stop_when_their_launcher_is_killed(tmp_path):
    """kill -9 of torchrun (the OOM killer's choice, say) and of one of its workers: the
    other worker notices and stops, instead of training on as an orphan that a rerun
    would collide with, and no process either started (their DataLoader workers)
    outlives them, also with forkserver as the default start method (Python 3.14's),
    whose server and workers would outlive a killed trainer for good."""
    cmd = torchrun_cmd(2, FORKSERVER_DEFAULT, SCRIPT, *flags(tmp_path, "--max-steps", 400))
    metrics = tmp_path / NAME / "metrics.jsonl"
    job = start_job(cmd, tmp_path / "job.log", until=lambda: metrics.exists() and bool(metrics.read_text()))
    workers = children(job.pid)
    assert len(workers) == 2
    started = {w: in_session(w) for w in workers}  # each rank leads a session of its own
    assert all(len(procs) >= 2 for procs in started.values()), started  # its DataLoader worker
    os.kill(job.pid, signal.SIGKILL)
    os.kill(workers[0], signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 30
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [p for w in workers for p in in_session(w)]
        time.sleep(0.1)
    for p in alive:  # cleanup before the verdict
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not alive, f"still running: {alive} of {started}"
    assert len(read_jsonl(metrics)) < 400


def test_a_full_disk_stops_the_run_with_one_line_and_leaves_no_debris(tmp_path):
    """A 20 MB file system (tmpfs) holds one 13 MB checkpoint, not two: the second save
    fails with ENOSPC. Every rank stops with the same line, the half-written folder is
    gone, and the first checkpoint is still `latest`."""
    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        proc = train(disk, check=False)
        assert proc.returncode != 0
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert errors and all("disk full while saving into" in e for e in errors), proc.stderr[-3000:]
        ckpt = disk / NAME / "checkpoints"
        size = sum(f.stat().st_size for f in (ckpt / step_dir(FREQ)).iterdir()) / 2**20
        assert f"a checkpoint needs about {size:,.0f} MB and " in errors[0], errors  # the real size
        assert not list(ckpt.glob(".tmp-*"))
        assert (ckpt / "latest").read_text() == step_dir(FREQ)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# ---- the run folder's lock where flock does not work (in this process) ------------------------

@pytest.fixture
def lock_file_only(request, monkeypatch):
    """flock answers as on a file system without it (Lustre mounted `noflock`: ENOSYS, or
    the errno a test names); what was claimed is given back at the end."""
    code = getattr(request, "param", errno.ENOSYS)

    def no_flock(fd, operation):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(runfolder.fcntl, "flock", no_flock)
    yield
    runfolder.release_run_folders()


def refused_claim(capsys, run_dir) -> str:
    with pytest.raises(SystemExit) as stop:
        claim_run_folder(run_dir)
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("lock_file_only", [errno.ENOSYS, errno.EOPNOTSUPP], indirect=True,
                         ids=["ENOSYS", "EOPNOTSUPP"])
def test_without_flock_the_lock_is_owner_created_only_if_absent(tmp_path, lock_file_only, capsys):
    """A second claim is refused with one line and exit status 2, naming the owner and what
    to do if that job was killed (its .owner stays); at exit the lock goes."""
    run_dir = tmp_path / NAME
    claim_run_folder(run_dir)
    owner = (run_dir / ".owner").read_text().strip()
    assert owner.startswith(f"pid {os.getpid()} on {socket.gethostname()}, since ")
    assert refused_claim(capsys, run_dir) == (
        f"error: run folder '{run_dir}' is in use by {owner}; wait for it to end or choose another "
        f"--experiment-name; this file system has no flock, so a killed job's .owner stays: if that "
        f"job is gone, delete {run_dir / '.owner'}")
    assert (run_dir / ".owner").read_text().strip() == owner  # the refusal touched nothing
    runfolder.release_run_folders()  # what exit does
    assert not (run_dir / ".owner").exists()
    claim_run_folder(run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [".owner"]


def test_a_worker_that_outlives_its_trainer_does_not_hold_the_run_folder(tmp_path):
    """A trainer claims the folder, forks a child (as the DataLoader forks its workers)
    and dies at once (os._exit: no cleanup, as a killed rank): the child lives on for
    seconds, and a rerun claiming the folder at once is not refused."""
    run_dir = tmp_path / NAME
    read_end, write_end = os.pipe()
    trainer = os.fork()
    if trainer == 0:
        try:
            claim_run_folder(run_dir)
            worker = os.fork()
            if worker == 0:
                time.sleep(60)
                os._exit(0)
            os.write(write_end, f"{worker}\n".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    os.waitpid(trainer, 0)
    worker = int(os.read(read_end, 64))
    os.close(read_end)
    try:
        assert os.path.exists(f"/proc/{worker}")  # alive, with its copy of the descriptors
        claim_run_folder(run_dir, resumes=True)   # refused before: "in use by pid <trainer>"
    finally:
        os.kill(worker, signal.SIGKILL)
        runfolder.release_run_folders()
