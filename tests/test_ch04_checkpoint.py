"""Chapter 04's checkpoint module (04-checkpointing/checkpoint.py) on real process groups
(2 gloo ranks, this file their script): the training state saves and loads symmetrically;
rank 0 alone reads the file and the other ranks receive every tensor in place, never a pickle of
the state; a candidate that fails leaves model and optimizer exactly as they were; a
missing `latest` pointer falls back to the newest checkpoint that verifies; another run's
settings are refused by name; a resumed epoch starts mid-way."""

from __future__ import annotations

import argparse
import ctypes
import io
import json
import multiprocessing
import os
import pickle
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common.data import worker_start_method
from common.files import sha256_of, verify_manifest
from conftest import REPO, load_script, run_warm, torchrun_cmd
from procs import children, running

ch04 = load_script("04-checkpointing/train_llm.py")  # puts its folder on sys.path
import checkpoint  # noqa: E402  the chapter's lesson module, beside the script
import preemption  # noqa: E402
from checkpoint import RUN_DEFINING_FLAGS, run_settings, settings_mismatch, unchanged_on_error  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36  # prctl: orphaned descendants are adopted by this process

SETTINGS = {"lr": 1.0}


class Log:
    def __init__(self):
        self.lines = []

    def warning(self, fmt, *args):
        self.lines.append(fmt % args)

    info = warning


def train_state(seed: int, steps: int = 0, width: int = 16) -> checkpoint.TrainState:
    """A small model, AdamW and a schedule after `steps` updates: a state worth saving."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    for _ in range(steps):
        model(torch.randn(5, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    state = checkpoint.TrainState(model, optimizer, scheduler, torch.device("cpu"))
    state.step, state.epoch, state.step_in_epoch = steps, 1, steps
    return state


def save(state, ckpt_dir, rank=0, settings=SETTINGS):
    return checkpoint.save_checkpoint(ckpt_dir, state, settings, keep_last=5, rank=rank)[0]


def same_tensors(a: checkpoint.TrainState, b: checkpoint.TrainState) -> bool:
    ta, tb = list(a.tensors()), list(b.tensors())
    return len(ta) == len(tb) > 0 and all(torch.equal(x, y) for x, y in zip(ta, tb))


def test_state_dict_and_load_state_dict_mirror_each_other():
    saved = train_state(0, steps=3)
    random.seed(7)
    torch.manual_seed(7)
    snapshot = saved.state_dict()
    expected = (random.random(), torch.rand(3))  # the draws after the save
    fresh = train_state(1)
    fresh.load_state_dict(snapshot)
    assert (fresh.step, fresh.epoch, fresh.step_in_epoch) == (3, 1, 3)
    assert same_tensors(fresh, saved)
    assert fresh.scheduler.state_dict() == saved.scheduler.state_dict()
    assert random.random() == expected[0] and torch.equal(torch.rand(3), expected[1])


def test_a_saved_checkpoint_loads_back_exactly(tmp_path):
    saved = train_state(0, steps=3)
    path = save(saved, tmp_path)
    assert (tmp_path / "latest").read_text() == path.name == "step-00000003"
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "state.pt"]
    fresh, log = train_state(1), Log()
    assert checkpoint.load_latest(checkpoint.checkpoint_candidates(tmp_path, log), fresh, SETTINGS,
                                  rank=0, log=log) == path
    assert same_tensors(fresh, saved) and fresh.step == 3 and not log.lines


def bytes_read() -> int:
    """What this process has read so far through read() calls, from any file (Linux)."""
    return int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["rchar"])


def test_a_save_reads_nothing_back_and_its_checksum_is_the_files(tmp_path):
    """state.pt's checksum is taken from the bytes as torch.save writes them (a hashing
    file between the two), so a save reads nothing back; the manifest still holds the
    file's SHA-256, which a resume checks."""
    state = train_state(0, steps=1, width=4096)
    torch.save(state.state_dict(), io.BytesIO())  # a first torch.save imports what it needs
    before = bytes_read()
    path = save(state, tmp_path)
    read, size = bytes_read() - before, (path / "state.pt").stat().st_size
    assert size > 300_000 and read < size / 100, (read, size)
    assert verify_manifest(path, names=())["sha256"] == {"state.pt": sha256_of(path / "state.pt")}


def test_another_runs_settings_are_refused_by_name_before_loading(tmp_path, capsys):
    path = save(train_state(0, steps=1), tmp_path)
    fresh = train_state(1)
    before = [t.clone() for t in fresh.tensors()]
    with pytest.raises(SystemExit) as stop:
        checkpoint.load_latest([path], fresh, {"lr": 2.0}, rank=0, log=Log())
    assert stop.value.code == 2
    assert f"checkpoint {path} belongs to a run with other settings (--lr 1.0 -> 2.0)" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(fresh.tensors(), before))


def test_a_load_that_fails_halfway_leaves_model_and_optimizer_as_they_were():
    """unchanged_on_error: the model loaded, AdamW's moments overwritten in place, then a
    failure (the state of an optimizer over other parameters), and both are back to what
    they held before, to the bit."""
    state = train_state(0, steps=2)
    other = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    before = [t.clone() for t in state.tensors()]
    with pytest.raises(ValueError), unchanged_on_error(state.model, state.optimizer):
        state.model.load_state_dict(train_state(2, steps=1).model.state_dict())
        for moments in state.optimizer.state.values():
            moments["exp_avg"].zero_()
        state.optimizer.load_state_dict(other.state_dict())  # 2 parameters, not 4: refused
    after = list(state.tensors())
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def test_without_a_latest_pointer_the_newest_checkpoint_that_verifies_is_used(tmp_path):
    state = train_state(0, steps=1)
    save(state, tmp_path)
    state.step = 2
    newest = save(state, tmp_path)
    (newest / "state.pt").write_bytes(b"torn")  # and its manifest now disagrees
    (tmp_path / "latest").unlink()
    log = Log()
    candidates = checkpoint.checkpoint_candidates(tmp_path, log)
    assert [p.name for p in candidates] == ["step-00000002", "step-00000001"]
    assert "no `latest` pointer" in log.lines[0]
    fresh = train_state(1)
    assert checkpoint.load_latest(candidates, fresh, SETTINGS, rank=0, log=log).name == "step-00000001"
    assert "state.pt does not match its checksum" in log.lines[1]


@pytest.mark.parametrize("pointer", ["", "garbage\n", "step-2"])
def test_a_latest_that_names_no_checkpoint_makes_every_folder_a_candidate(tmp_path, pointer):
    """`latest` emptied or overwritten by hand must not read as "nothing committed":
    the run would start over and its saves would replace the checkpoints."""
    state = train_state(0, steps=1)
    save(state, tmp_path)
    state.step = 2
    save(state, tmp_path)
    (tmp_path / "latest").write_text(pointer)
    log = Log()
    assert [p.name for p in checkpoint.checkpoint_candidates(tmp_path, log)] == ["step-00000002", "step-00000001"]
    assert "latest names no checkpoint" in log.lines[0]


def test_uncommitted_folders_beyond_latest_are_not_candidates(tmp_path):
    state = train_state(0, steps=1)
    first = save(state, tmp_path)
    state.step = 2
    save(state, tmp_path)
    checkpoint.point_latest_to(first)  # as if the kill came before the pointer moved
    assert checkpoint.checkpoint_candidates(tmp_path, Log()) == [first]


def test_an_atomic_write_that_fails_leaves_the_old_file_whole(tmp_path):
    """model.pt and the other final files: a failed write (a full disk) keeps the old
    file, and leaves no temporary file behind."""
    from common.files import atomic_write

    target = tmp_path / "model.pt"
    atomic_write(target, lambda f: f.write(b"old"))

    def fails(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        atomic_write(target, fails)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_the_resumable_sampler_starts_mid_epoch_in_the_same_order():
    sampler = torch.utils.data.DistributedSampler(range(40), num_replicas=2, rank=1, shuffle=True, seed=3)
    resumable = checkpoint.ResumableSampler(sampler)
    resumable.set_epoch(2)
    whole = list(resumable)
    resumable.set_epoch(2, start=6)
    assert list(resumable) == whole[6:] and len(resumable) == len(whole) - 6


def test_run_settings_name_the_flags_the_data_and_the_format():
    args = argparse.Namespace(**{k: k for k in RUN_DEFINING_FLAGS})
    s = run_settings(args, "bf16", 16, "abc")
    assert s["global batch"] == 16 and s["data fingerprint"] == "abc" and s["dtype"] == "bf16"
    assert s["format version"] == checkpoint.FORMAT_VERSION
    # the README's list: lr, preset, vocabulary, sequence length, dataset, seed, schedule length
    assert {"lr", "model_preset", "vocab_size", "seq_length", "dataset_name", "seed",
            "warmup_steps", "max_steps", "num_epochs"} <= set(s)



def test_a_checkpoint_saved_before_the_dtype_was_recorded_still_resumes():
    """Checkpoints of format 3 written before the dtype was part of the settings record
    none: the dtype is not compared for them (refusing them would strand their runs);
    their next save records it. Every setting they do record is compared as before."""
    now = {"lr": 1.0, "dtype": "bf16", "format version": checkpoint.FORMAT_VERSION}
    older = {"lr": 1.0, "format version": checkpoint.FORMAT_VERSION}
    assert settings_mismatch(older, now, "old") is None
    assert "(--dtype fp32 -> bf16)" in settings_mismatch({**older, "dtype": "fp32"}, now, "new")
    assert "(--lr 2.0 -> 1.0)" in settings_mismatch({**older, "lr": 2.0}, now, "old")


class WorkerPids(torch.utils.data.Dataset):
    """Each sample is the pid of the worker that read it, after SIGTERM and SIGINT were
    sent to that pid."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        for sig in preemption.STOP_SIGNALS:
            os.kill(os.getpid(), sig)
        return torch.tensor([os.getpid()])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_data_worker_ignores_stop_signals_and_dies_with_its_trainer():
    """data_worker_ignores_stops: the DataLoader's worker lives through SIGTERM and SIGINT
    sent to its own pid (as SLURM signals every process of a job), and a trainer that dies
    without stopping it (os._exit, as after a peer stopped answering) takes it along at
    once: the DataLoader's own check would notice only within 5 s. With the chapters'
    start method (fork on Linux), also where forkserver is the default (Python 3.14): the
    worker is the trainer's child, not a fork server's."""
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    trainer = os.fork()
    if trainer == 0:
        try:
            multiprocessing.set_start_method("forkserver", force=True)
            loader = torch.utils.data.DataLoader(WorkerPids(), num_workers=1, batch_size=None,
                                                 multiprocessing_context=preemption.holding_sigterm(
                                                     worker_start_method(1)),
                                                 worker_init_fn=preemption.data_worker_ignores_stops)
            batches = iter(loader)
            os.write(ready_w, str(next(batches).item()).encode())  # the worker got the signals and ran on
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)  # a trainer that fails ends the read below, not blocks it
    try:
        worker = int(os.read(ready_r, 64) or 0)
        assert worker and running(worker) and worker in children(trainer)
    finally:
        os.write(go_w, b"1")
        os.waitpid(trainer, 0)
    died = time.monotonic()
    while running(worker) and time.monotonic() - died < 10:
        time.sleep(0.01)
    gone_after = time.monotonic() - died
    if running(worker):
        os.kill(worker, signal.SIGKILL)
    assert gone_after < 2.5, f"the worker outlived its trainer by {gone_after:.1f} s"


def _masks_at_birth(answer):
    """What a worker finds as it starts: its signal mask, and that of a thread it starts."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    thread.start()
    thread.join()
    answer.put((signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []), signal.SIGTERM in seen[0]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the chapters fork their workers on Linux")
def test_a_data_worker_is_born_holding_sigterm_and_so_is_every_thread_it_starts():
    """holding_sigterm's fork: the worker holds SIGTERM from its first instruction, before
    worker_init_fn runs, when torch has already started threads in it (its intra-op pool,
    rebuilt as large as the trainer's: test_ch04_safety's stopped jobs run two threads per
    rank, and fail without this); each thread inherits the mask. The trainer's own mask is
    as it was; another start method passes through."""
    fork = preemption.holding_sigterm("fork")
    answer = fork.Queue()  # (a worker that broke before answering: a failure in 60 s, not a hang)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    worker = fork.Process(target=_masks_at_birth, args=(answer,))
    worker.start()
    try:
        assert answer.get(timeout=60) == (True, True)
    finally:
        worker.join(10)
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before and signal.SIGTERM not in before
    plain = multiprocessing.get_context("fork").Process(target=_masks_at_birth, args=(answer,))
    plain.start()
    assert answer.get(timeout=60) == (False, False)  # what a worker of the plain fork starts with
    plain.join(10)
    assert preemption.holding_sigterm("spawn") == "spawn" and preemption.holding_sigterm(None) is None


def _a_worker_that_waits(ready):
    preemption.data_worker_ignores_stops(0)
    ready.set()
    time.sleep(60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sender of a signal is read on Linux")
def test_a_data_worker_still_ends_at_its_trainers_sigterm():
    """The worker ignores a SIGTERM from anyone else (here `kill`, as SLURM's), but its
    trainer's ends it at once, with status 0, as torch's own handler did: the DataLoader
    and multiprocessing end workers so (multiprocessing waits for them as the trainer's
    interpreter exits: a worker deaf to it would hang that exit)."""
    fork = multiprocessing.get_context("fork")
    ready = fork.Event()
    worker = fork.Process(target=_a_worker_that_waits, args=(ready,), daemon=True)
    worker.start()
    try:
        assert ready.wait(60)
        subprocess.run(["kill", "-TERM", str(worker.pid)], check=True)
        worker.join(1.0)
        assert worker.is_alive(), worker.exitcode
        worker.terminate()  # SIGTERM from its parent
        worker.join(10)
        assert worker.exitcode == 0
    finally:
        worker.kill()


def _a_worker_started_late(trainer_gone):
    os.read(trainer_gone, 1)  # its trainer has died: data_worker_ignores_stops comes too late
    preemption.data_worker_ignores_stops(0)
    os._exit(3)  # it would have lived on


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="subreapers and the parent-death signal are Linux's")
def test_a_data_worker_whose_trainer_died_before_it_asked_exits_whoever_adopts_it():
    """The trainer may die between starting a worker and the worker's request for the
    parent-death signal; the worker then sees that its trainer is gone and exits. The
    orphan's new parent need not be init (pid 1): here, as under a desktop's systemd user
    manager, a subreaper adopts it."""
    libc = ctypes.CDLL(None, use_errno=True)
    status_r, status_w = os.pipe()
    reaper = os.fork()
    if reaper == 0:
        try:
            assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
            gone_r, gone_w = os.pipe()
            trainer = os.fork()
            if trainer == 0:  # starts its worker and dies at once
                multiprocessing.get_context("fork").Process(target=_a_worker_started_late,
                                                            args=(gone_r,)).start()
                os._exit(0)
            os.waitpid(trainer, 0)
            os.write(gone_w, b"1")
            _, status = os.wait()  # the orphaned worker: this process adopted it
            os.write(status_w, str(os.waitstatus_to_exitcode(status)).encode())
        finally:
            os._exit(0)
    try:
        assert os.read(status_r, 16) == b"0", "the orphaned worker lived on"
    finally:
        os.waitpid(reaper, 0)


def test_iterating_the_loader_leaves_the_global_generator_alone():
    """Each iter() over a DataLoader draws a base seed; the chapters give it its own
    generator, so a resumed run's global RNG stream is not shifted by one draw."""
    data = list(range(16))
    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(torch.utils.data.DataLoader(data, batch_size=4, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(torch.get_rng_state(), before)
    iter(torch.utils.data.DataLoader(data, batch_size=4))  # without one, the global generator moves
    assert not torch.equal(torch.get_rng_state(), before)


# ---- two ranks ------------------------------------------------------------------------------

def two_ranks(root):
    """One rank of the `spawned` job: this file run as a script on two ranks started warm
    (conftest.run_warm), its results into rank-<r>.json."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    sent = {"objects": [], "tensors": 0}
    broadcast_object_list, broadcast = dist.broadcast_object_list, dist.broadcast

    def record_objects(objects, *args, **kwargs):
        sent["objects"].append(len(pickle.dumps(objects)))
        return broadcast_object_list(objects, *args, **kwargs)

    def record_tensor(tensor, *args, **kwargs):
        sent["tensors"] += 1
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast_object_list, dist.broadcast = record_objects, record_tensor
    # each rank has its own generators; the saved checkpoint holds both
    random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    saved = train_state(0, steps=3, width=2048)  # 0.4 MB of state: far more than the small parts
    path = save(saved, root, rank=rank)
    draws_after_save = torch.rand(2)
    sent.update(objects=[], tensors=0)
    # rank 1 starts from other weights and no optimizer state; only rank 0 lists candidates
    fresh, log = train_state(rank + 10, width=2048), Log()
    candidates = [root / "step-99", path] if rank == 0 else []
    (root / "step-99").mkdir(exist_ok=True)  # no manifest: a broken candidate, skipped
    got = checkpoint.load_latest(candidates, fresh, SETTINGS, rank=rank, log=log)
    result = {"path": str(got), "equal": same_tensors(fresh, saved), "step": fresh.step,
              "scheduler": fresh.scheduler.state_dict() == saved.scheduler.state_dict(),
              "draws": torch.equal(torch.rand(2), draws_after_save),
              "objects": list(sent["objects"]), "tensors": sent["tensors"],
              "n_tensors": len(list(saved.tensors())), "warnings": log.lines,
              "state_bytes": (path / "state.pt").stat().st_size}
    # --resume-from through a link only rank 0's machine can follow: rank 0's view of
    # whether it is a rollback (one more collective) is every rank's
    again = checkpoint.load_latest([path], train_state(rank + 30, width=2048), SETTINGS, rank=rank,
                                   log=Log(), roll_back=rank == 0)
    result["rolled back"] = str(again)
    votes = stop_votes(rank)
    # only rank 0 has candidates, and none loads: every rank must stop, not rank 0 alone
    try:
        checkpoint.load_latest([root / "step-99"] if rank == 0 else [], train_state(rank + 20), SETTINGS,
                               rank=rank, log=Log())
        result["none loads"] = "went on"
    except SystemExit as e:
        result["none loads"] = e.code
    # --crash-at-step without a shared disk: rank 1's machine has no run folder
    crashes = []
    for _ in range(2):  # the job, then its restart
        try:
            ch04.crash_once(root if rank == 0 else root / "not-on-this-machine", 5, 5, rank, 2)
            crashes.append(False)
        except RuntimeError:
            crashes.append(True)
    result["crashes"] = crashes
    # a rerun of a finished job: only rank 0's machine holds its summary and weights
    if rank == 0:
        (root / "summary.json").write_text("{}")
        (root / "model.pt").write_bytes(b"weights")
    dist.barrier()
    here = root if rank == 0 else root / "not-on-this-machine"
    result["finished"] = [ch04.finished_before(here, 5, 5, rank), ch04.finished_before(here, 4, 5, rank)]
    (root / f"rank-{rank}.json").write_text(json.dumps({"result": result, "votes": votes}))
    dist.destroy_process_group()


def stop_votes(rank) -> dict:
    """Two runs of the stop vote, every all-reduce counted: rank 1 gets SIGTERM in step 3
    of 8; then rank 0 gets one in the last step (3 of 3)."""
    counts = {"blocking": 0, "async": 0}
    all_reduce = dist.all_reduce

    def counting(tensor, *args, async_op=False, **kwargs):
        counts["async" if async_op else "blocking"] += 1
        return all_reduce(tensor, *args, async_op=async_op, **kwargs)

    dist.all_reduce = counting
    runs = []
    for signalled_rank, signal_step, last in ((1, 3, 8), (0, 3, 3)):
        stop, answers = preemption.StopRequest(), []
        counts.update({"blocking": 0, "async": 0})
        try:
            for step in range(1, last + 1):
                if rank == signalled_rank and step == signal_step:
                    os.kill(os.getpid(), signal.SIGTERM)  # arrives during this step
                answers.append(stop.agreed(last_step=step == last))
                if answers[-1]:
                    break
        finally:
            stop.uninstall()
        runs.append({"answers": answers, "in flight": stop.vote is not None, **counts})
    dist.all_reduce = all_reduce
    return runs


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One launch of two ranks for the tests below: (results by rank, checkpoint folder)."""
    root, results = tmp_path_factory.mktemp("two-ranks"), {}
    run_warm(torchrun_cmd(2, "tests/test_ch04_checkpoint.py", root), timeout=120)
    for rank in (0, 1):
        saved = json.loads((root / f"rank-{rank}.json").read_text())
        results[rank], results[f"votes {rank}"] = saved["result"], saved["votes"]
    return results, root


def test_rank_0_reads_and_every_rank_receives_each_tensor_in_place(spawned):
    results, tmp_path = spawned
    for rank in (0, 1):
        r = results[rank]
        assert r["path"] == str(tmp_path / "step-00000003") and r["step"] == 3
        assert r["equal"] and r["scheduler"]
        assert r["draws"], f"rank {rank} did not get its own generators back"
        # one broadcast per tensor (weights, moments, step counts), and the objects sent
        # are small: the position, the schedule, the generators and the layout, no state
        assert r["tensors"] == r["n_tensors"]
        assert sum(r["objects"]) < r["state_bytes"] / 10, (r["objects"], r["state_bytes"])
    assert "step-99 cannot be used" in results[0]["warnings"][0]


def test_a_rollback_is_rank_0s_decision(spawned):
    """Whether --resume-from is a rollback of this run is rank 0's to say (its disk
    resolves the link); every rank then joins the commit's collective, so the vote that
    follows (the next collectives) still pairs up."""
    results, root = spawned
    assert results[0]["rolled back"] == results[1]["rolled back"] == str(root / "step-00000003")
    assert (root / "latest").read_text() == "step-00000003"


def test_when_no_candidate_loads_every_rank_stops_not_rank_0_alone(spawned):
    """Only rank 0 lists candidates (its disk holds them); its verdict reaches the others,
    which would otherwise start fresh and wait forever in the first collective."""
    results, _ = spawned
    assert results[0]["none loads"] == results[1]["none loads"] == 2


def test_the_injected_crash_happens_once_on_the_last_rank_without_a_shared_disk(spawned):
    """Rank 0 keeps the marker in the run folder and tells the others: the last rank
    crashes once even where it cannot see the folder, and a restart goes on."""
    results, root = spawned
    assert results[1]["crashes"] == [True, False] and results[0]["crashes"] == [False, False]
    assert (root / "crash-injected-at-step-5").exists() and not (root / "not-on-this-machine").exists()


def test_a_finished_run_is_recognised_by_every_rank_from_rank_0s_disk(spawned):
    """Rerunning a finished job: every rank returns at once, not rank 0 alone (the others
    would go on to validate and wait for it in a collective)."""
    results, _ = spawned
    assert results[0]["finished"] == results[1]["finished"] == [True, False]


def test_the_stop_vote_never_blocks_a_step_and_every_rank_stops_at_the_same_one(spawned):
    """Each step starts its vote without waiting (async all-reduce) and reads the previous
    step's: no blocking collective per step. A signal during step 3 stops every rank
    after step 4, the one after it; in the last step the run waits for its own vote,
    and nothing is left in flight."""
    results, _ = spawned
    for rank in (0, 1):
        mid, last = results[f"votes {rank}"]
        other = "a signal to another rank"
        assert mid["answers"] == [None, None, None, "SIGTERM" if rank == 1 else other]
        assert (mid["blocking"], mid["async"]) == (0, 3)  # steps 1-3 voted; step 4 read a stop
        assert last["answers"] == [None, None, "SIGTERM" if rank == 0 else other]
        assert (last["blocking"], last["async"]) == (0, 3)
        assert not mid["in flight"] and not last["in flight"]


if __name__ == "__main__":  # a rank of the `spawned` fixture's job
    two_ranks(Path(sys.argv[1]))


def test_the_readme_quotes_the_lost_peer_line_the_code_prints(capsys, monkeypatch):
    """The README's excerpt of the crash-and-restart run (`--max-restarts=3`, rank 1's
    injected crash) shows rank 0's line about its lost peer: made here by run_main, called
    as the chapter calls it, from gloo's error in that run."""
    import ast
    from torch.distributed import DistError
    from common.errors import run_main

    script = ast.parse((REPO / "04-checkpointing" / "train_llm.py").read_text())
    [call] = [n for n in ast.walk(script) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "run_main"]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    for name, value in {"RANK": "0", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("common.errors.os._exit", lambda status: sys.exit(status))
    gloo = DistError("Connection closed by peer [127.0.0.1]:38602. This is typically caused by a remote worker "
                     "crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️")
    with pytest.raises(SystemExit):
        run_main(lambda: (_ for _ in ()).throw(gloo), **kwargs)
    [line] = capsys.readouterr().err.strip().splitlines()
    shown = [re.escape(s).replace(re.escape("..."), ".*") for s in (REPO / "04-checkpointing" / "README.md")
             .read_text().splitlines() if s.startswith("error: rank 0: a peer")]  # `...`: words left out
    assert shown and any(re.fullmatch(pattern, line) for pattern in shown), (line, shown)
