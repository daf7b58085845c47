"""Chapter 02 on a machine without GPUs: DataParallel falls back to the plain module,
says so in the log, the summary and the table, and then computes exactly what chapter
01 computes (padded, with accumulation, over epochs too); its weights load into a plain
model; GPU-only flags are refused."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from common.model import LlamaForCausalLM, get_config
from conftest import CH01_STEPS, NO_GPU, REPO, SMALL_CORPUS_FLAGS, TINY, load_script, python_cmd, read_json, \
    read_jsonl, refused, run_warm, start
from procs import kill_job

SCRIPT = "02-data-parallel/train_llm.py"
STEPS = CH01_STEPS  # the flags of chapter 01's reference run (conftest's ch01_smoke)
# NO_GPU: the fallback is the lesson here, GPUs or not
NOTE = "DataParallel needs 2+ GPUs, found 0: trained the plain module"
RUNS = {"dp": [], "dp-loss-in-module": ["--loss-in-module"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ch01_smoke):
    """Chapter 02 (both loss placements) with the flags of chapter 01's reference run,
    which is the "ch01" entry."""
    save_dir = tmp_path_factory.mktemp("ch02")
    out = {"ch01": ch01_smoke[:2]}
    for name, extra in RUNS.items():
        proc = run_warm(python_cmd(SCRIPT, *TINY, "--max-steps", STEPS, "--save-dir", save_dir,
                                   "--experiment-name", name, *extra), env=NO_GPU)
        out[name] = (proc, save_dir / name)
    return out


@pytest.mark.parametrize("name", ["dp", "dp-loss-in-module"])
def test_without_gpus_it_trains_the_plain_module_and_says_so(runs, name):
    proc, run_dir = runs[name]
    summary = read_json(run_dir / "summary.json")
    log, table = proc.stdout.split("| metric", 1)
    assert f"WARNING {NOTE}" in log
    # a machine busy with other work adds its own note (the Tracker's load check)
    assert [n for n in summary["notes"] if not n.startswith("the machine was busy")] == [NOTE]
    assert "| note " in table and NOTE in table
    assert summary["num_devices"] == 1
    assert summary["args"]["loss_in_module"] is (name == "dp-loss-in-module")


@pytest.mark.parametrize("name", ["dp", "dp-loss-in-module"])
def test_same_losses_and_weights_as_chapter_01(runs, name):
    ch01, dp = runs["ch01"][1], runs[name][1]
    losses = [[r["loss"] for r in read_jsonl(d / "metrics.jsonl")] for d in (ch01, dp)]
    assert len(losses[1]) == STEPS and losses[1] == losses[0]
    ref = torch.load(ch01 / "model.pt", weights_only=True)
    got = torch.load(dp / "model.pt", weights_only=True)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.parametrize("name", ["dp", "dp-loss-in-module"])
def test_saved_weights_load_into_a_plain_model(runs, name):
    run_dir = runs[name][1]
    state = torch.load(run_dir / "model.pt", weights_only=True)
    assert not any(k.startswith(("module.", "model.")) for k in state)
    vocab = read_json(run_dir / "summary.json")["data"]["vocab_size"]
    LlamaForCausalLM(get_config("tiny", vocab)).load_state_dict(state, strict=True)


def test_padded_with_accumulation_over_epochs_equals_chapter_01(tmp_path):
    """--padded --grad-accum 2 --loss-in-module on 20 documents of different lengths (19
    to train on: 2 steps an epoch): each step's loss is the mean over the real targets
    of both micro-batches, which hold different numbers of them, and every epoch a new
    order: over 5 steps (3 epochs), loss for loss and weight for weight chapter 01's."""
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"doc{i:02d}.txt").write_text(f"def f{i}(x):\n" + "    x = x + 1\n" * (i % 7 + 1))
    flags = [*TINY, "--dataset-name", corpus, *SMALL_CORPUS_FLAGS, "--padded", "--grad-accum", 2,
             "--max-steps", 5, "--val-batches", 1, "--save-dir", tmp_path]
    run_warm(python_cmd("01-single-gpu/train_llm.py", *flags, "--experiment-name", "ch01"), env=NO_GPU)
    run_warm(python_cmd(SCRIPT, *flags, "--experiment-name", "ch02", "--loss-in-module"), env=NO_GPU)
    summary = read_json(tmp_path / "ch02" / "summary.json")
    assert (summary["data"]["form"], summary["data"]["train_samples"]) == ("padded", 19)
    losses = [[r["loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl")] for d in ("ch01", "ch02")]
    assert len(losses[1]) == 5 and losses[1] == losses[0]
    ref, got = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("ch01", "ch02"))
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)


def test_device_ids_without_gpus_are_refused(tmp_path, monkeypatch, capsys):
    for k, v in NO_GPU.items():
        monkeypatch.setenv(k, v)
    line = refused(capsys, load_script(SCRIPT).parse_args,
                   [*TINY, "--device-ids", "0,1", "--save-dir", tmp_path / "out"])
    assert line == "error: argument --device-ids: names GPUs, but CUDA is not available here (see --help)"
    assert not (tmp_path / "out").exists()


def test_compile_where_data_parallel_runs_is_refused_not_dropped(tmp_path, monkeypatch, capsys):
    """On a machine with 2 GPUs (as torch.cuda reports them here) --compile is refused,
    before any work; on one GPU or the CPU, where the plain module trains, it is taken."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    parse = load_script(SCRIPT).parse_args
    base = [*TINY, "--save-dir", tmp_path / "out", "--compile"]
    line = refused(capsys, parse, base)
    assert line == ("error: --compile does not apply under nn.DataParallel (2 GPUs): drop it, or train "
                    "on one GPU (--device-ids 0); chapter 03 compiles under DDP")
    assert parse([*map(str, base), "--device-ids", "0"]).compile
    assert parse([*map(str, base), "--device", "cpu"]).compile
    assert not (tmp_path / "out").exists()


def test_a_replica_computes_in_the_chosen_dtype_in_a_fresh_thread():
    """DataParallel runs each replica in a new thread and re-enters autocast there with the
    on/off flag only (parallel_apply), so the thread gets autocast's default dtype. The
    Replica enters autocast itself with the chosen one. On CPU the default is bf16, so the
    test chooses fp16 and does in a thread exactly what parallel_apply does. (The dtype
    is the head's matmul's: the model widens the logits it returns to fp32.)"""
    import threading

    ch02 = load_script(SCRIPT)
    model = LlamaForCausalLM(get_config("tiny", 300))
    x = torch.randint(0, 300, (1, 8))
    dtypes, head = {}, []
    model.lm_head.register_forward_hook(lambda module, args, out: head.append(out.dtype))

    def like_parallel_apply(name, module, *inputs):
        with torch.autocast("cpu", enabled=True):  # no dtype: the thread's default
            module(*inputs)
            dtypes[name] = head.pop()

    cases = {"bare": (model, x, None), "replica": (ch02.Replica(model, torch.float16, False), x, None, x)}
    for name, (module, *inputs) in cases.items():
        t = threading.Thread(target=like_parallel_apply, args=(name, module, *inputs))
        t.start()
        t.join()
    assert dtypes == {"bare": torch.bfloat16, "replica": torch.float16}


# Runs a chapter script (its path and arguments follow) with the race below made likely:
# the trainer takes its time over each batch a DataLoader worker hands it (multiprocessing
# passes each tensor's file descriptor over a connection of its own), and the worker is
# slow to act on Ctrl-C, as on a busy machine.
SLOW_HANDOVER = """
import multiprocessing.connection, runpy, signal, sys, time
from torch.utils.data._utils import worker

answer, loop = multiprocessing.connection.answer_challenge, worker._worker_loop
def slow_answer(*args):
    time.sleep(0.05)
    return answer(*args)
def late_loop(*args):
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    return loop(*args)
multiprocessing.connection.answer_challenge, worker._worker_loop = slow_answer, late_loop
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.launch
def test_ctrl_c_while_a_worker_hands_a_batch_over_is_one_line(tmp_path):
    """Ctrl-C (SIGINT to the process group) while the trainer takes a batch over from its
    DataLoader worker: the trainer left in the middle of the handover, and the worker,
    still alive, printed multiprocessing's traceback (resource_sharer.py, EOFError or
    ConnectionResetError) after the Ctrl-C line, in some runs; with the race made likely
    (SLOW_HANDOVER), in most. run_main kills the workers before the trainer lets go.
    Several runs, each stopped after its first step: one line each, no traceback."""
    probe = tmp_path / "slow_handover.py"
    probe.write_text(SLOW_HANDOVER)
    workers = TINY.index("--num-workers")  # the default --num-workers: one worker
    flags = [*TINY[:workers], *TINY[workers + 2:], "--max-steps", 1000, "--save-dir", tmp_path]
    for attempt in range(3):
        log, metrics = tmp_path / f"run-{attempt}.log", tmp_path / f"r{attempt}" / "metrics.jsonl"
        job = start(python_cmd(probe, REPO / SCRIPT, *flags, "--experiment-name", f"r{attempt}"), log, env=NO_GPU)
        deadline = time.monotonic() + 120
        while job.poll() is None and time.monotonic() < deadline and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.01)
        os.killpg(job.pid, signal.SIGINT)  # a terminal's Ctrl-C: the trainer and its worker
        try:
            status = job.wait(timeout=60)
        finally:
            kill_job(job.pid)
        out = log.read_text()
        assert status == 130 and "Traceback" not in out, out[-3000:]
        assert [line for line in out.splitlines() if "interrupted (Ctrl-C)" in line] == [
            "interrupted (Ctrl-C): stopped where it was; what it logged so far stays, nothing else was saved"]
