"""The shared command line: good defaults pass, every bad flag stops with one clear line
(exit status 2) before anything is created on disk; under torchrun that line is never
lost, whichever rank exits first."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import DistError

from common.cli import base_parser, check_args
from common.demos import script_parser
from common.distributed import BACKEND_ENV, backend_for, gpu_sharing_error
from common.errors import UsageError, fail, run_main
from conftest import REPO, TINY, chapter_module, load_script, python_cmd, refused, run, run_warm, start, torchrun_cmd
from procs import kill_job


def parse(save_dir, *argv, **kwargs):
    return base_parser("01-single-gpu", "test", **kwargs).parse_args(["--save-dir", str(save_dir), *argv])


def refusal(capsys, save_dir, *argv, **kwargs) -> str:
    """The one line a bad command line gets (and its exit status 2)."""
    with pytest.raises(SystemExit) as exit_:
        parse(save_dir, *argv, **kwargs)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err.strip()


def test_defaults_are_accepted_and_create_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    args = parse(tmp_path / "outputs")
    assert re.fullmatch(r"01-single-gpu-\d{8}-\d{6}", args.experiment_name)
    assert not (tmp_path / "outputs").exists()


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    """The default name is the second the run starts: a run that finds that folder taken
    (a short run just before, in the same second) takes -2, -3, ... instead of being
    refused a name it did not choose."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr("common.cli.time.strftime", lambda fmt: "20990101-000000")
    (tmp_path / "01-single-gpu-20990101-000000").mkdir(parents=True)
    assert parse(tmp_path).experiment_name == "01-single-gpu-20990101-000000-2"
    (tmp_path / "01-single-gpu-20990101-000000-2").mkdir()
    assert parse(tmp_path).experiment_name == "01-single-gpu-20990101-000000-3"


def test_under_torchrun_the_default_name_is_the_job_id(tmp_path, monkeypatch):
    """Every rank, and every restart of the job, agrees on it (a timestamp would not)."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "llm run/1")
    assert parse(tmp_path).experiment_name == "01-single-gpu-llm-run-1"


def test_the_help_gives_the_default_name_under_torchrun():
    """--help says what a torchrun launch is named by default, as the READMEs do: the job
    id, not a timestamp (chapters 03-05 always run under torchrun)."""
    for parser in (base_parser("03-ddp", "test", distributed=True), script_parser("05-bench", "test")):
        name = next(a for a in parser._actions if "--experiment-name" in a.option_strings)
        assert "-<job id>" in name.help, name.help


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "argument --batch-size: must be a whole number >= 1 (got '0')"),
    (["--model-preset", "tiny", "--seq-length", "257"],
     "--seq-length 257 exceeds the 'tiny' preset's max_position_embeddings=256"),
    (["--lr", "-0.001"], "argument --lr: must be a finite number > 0 (got '-0.001')"),
    (["--lr", "0"], "argument --lr: must be a finite number > 0"),
    (["--lr", "inf"], "argument --lr: must be a finite number > 0 (got 'inf')"),
    (["--lr", "1e400"], "argument --lr: must be a finite number > 0"),
    (["--weight-decay", "nan"], "argument --weight-decay: must be a finite number >= 0 (got 'nan')"),
    (["--seed", "1e23"], "argument --seed: must be a whole number in [0, 2**63)"),
    (["--seed", str(2**64)], "argument --seed: must be a whole number in [0, 2**63)"),
    (["--max-steps", "-1"], "argument --max-steps: must be a whole number >= 0 (got '-1')"),
    (["--warmup-steps", "-5"], "argument --warmup-steps: must be a whole number >= 0"),
    (["--num-epochs", "0"], "argument --num-epochs: must be a whole number >= 1"),
    (["--model-preset", "huge"], "argument --model-preset: unknown 'huge'; choose one of: tiny"),
    (["--experiment-name", "../escape"], "--experiment-name '../escape' must use only"),
    (["--experiment-name", "a b"], "must use only letters"),
    (["--experiment-name", "a" * 300], "--experiment-name is 300 characters long; 200 at most"),
    (["--vocab-size", "259"], "argument --vocab-size: must be a whole number from 260 to 1048576 (got '259')"),
    (["--vocab-size", "2000000000"], "argument --vocab-size: must be a whole number from 260 to 1048576"),
    (["--dtype", "fp16"], "argument --dtype: unknown 'fp16'; choose one of: auto, fp32, bf16"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--device", "mps"], "--device 'mps' is not supported"),
    (["--nonsense"], "unrecognized arguments: --nonsense"),
    (["--max-step", "5"], "unrecognized arguments: --max-step 5"),  # a typo, not an abbreviation
])
def test_bad_flags_are_refused_with_one_line(tmp_path, capsys, argv, message):
    assert message in refusal(capsys, tmp_path, *argv)
    assert not tmp_path.joinpath("01-single-gpu").exists()


# `python -m tools.X`: every module that runs as a command
TOOLS = sorted(p.stem for p in (REPO / "tools").glob("*.py") if '__name__ == "__main__"' in p.read_text())


@pytest.mark.parametrize("tool", TOOLS)
def test_every_command_line_tool_refuses_an_unknown_flag_with_one_line(tool, capsys):
    """Not argparse's usage block: one line naming the flag, exit status 2. A flag cut
    short (`--hel`, argparse's abbreviation of --help) is refused too: an abbreviation
    that works today would change meaning when a flag with the same start is added."""
    for flag in ("--no-such-flag", "--hel"):
        with pytest.raises(SystemExit) as exit_:
            importlib.import_module(f"tools.{tool}").main([flag])
        assert exit_.value.code == 2, flag
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and flag in err and len(err.splitlines()) == 1, err


def test_a_quoted_tilde_in_save_dir_is_the_home_folder(tmp_path, monkeypatch):
    """--save-dir '~/runs' (quoted, so the shell left it alone) means the home folder,
    not a folder named '~' in the current one."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    args = base_parser("01-single-gpu", "test").parse_args(["--save-dir", "~/runs"])
    assert args.save_dir == str(tmp_path / "runs") and not (tmp_path / "~").exists()


def test_a_quoted_tilde_in_the_cache_folder_is_the_home_folder(tmp_path, monkeypatch):
    """--cache-dir '~/cache' and LLM_GUIDE_CACHE='~/cache' (quoted, as a shell script or a
    job file leaves them) mean the home folder too: the caches were written into a folder
    named '~' in the current one."""
    from common.data import default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    args = base_parser("01-single-gpu", "test").parse_args(["--cache-dir", "~/cache"])
    assert args.cache_dir == str(tmp_path / "cache")
    monkeypatch.setenv("LLM_GUIDE_CACHE", "~/cache")
    assert default_cache_dir() == tmp_path / "cache" and not (tmp_path / "~").exists()


@pytest.mark.parametrize("workspace", [None, ":4096:8", ":16:8", ":0:0", ""])
def test_deterministic_refuses_a_cublas_workspace_that_varies_its_sums(tmp_path, capsys, monkeypatch,
                                                                       workspace):
    """--deterministic sets CUBLAS_WORKSPACE_CONFIG where it is unset; one that cuBLAS
    cannot sum in a fixed order with would stop the run at its first GPU matmul, so it
    stops here instead. Without the flag any value passes."""
    if workspace is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", workspace)
    assert not parse(tmp_path).deterministic
    if workspace in (None, ":4096:8", ":16:8"):
        assert parse(tmp_path, "--deterministic").deterministic
    else:
        assert refusal(capsys, tmp_path, "--deterministic") == (
            f"error: --deterministic: CUBLAS_WORKSPACE_CONFIG={workspace!r} lets cuBLAS vary its sums; "
            f"unset it or use :4096:8 or :16:8")


def test_bf16_autocast_is_allowed_on_cpu(tmp_path):
    assert parse(tmp_path, "--device", "cpu", "--dtype", "bf16").dtype == "bf16"


def test_every_flag_has_help_and_each_default_is_shown_once(tmp_path, capsys):
    parser = base_parser("04-checkpointing", "test", distributed=True, resumes=True)
    for action in parser._actions:
        assert action.help, action.option_strings
    text = parser.format_help()
    assert text.count("(default: 8)") == 1  # --batch-size
    # a default of 0 is shown too (--seed); a switch's False is not
    flat = " ".join(text.split())
    assert "of the data order (default: 0)" in flat and "(default: False)" not in flat
    assert "default: <chapter>-<timestamp>) (default" not in text


def test_missing_local_dataset_and_tokenizer(tmp_path, capsys):
    assert "does not exist" in refusal(capsys, tmp_path, "--dataset-name",
                                       str(tmp_path / "nowhere" / "*.txt"))
    assert "does not exist" in refusal(capsys, tmp_path, "--tokenizer", str(tmp_path / "tok.json"))
    # a mistyped folder is a path, not a hub id (`owner/name`): refused at parse time
    for name in ("my_corpus/", "data/my/corpus"):
        assert f"local dataset {name!r} does not exist" in refusal(capsys, tmp_path, "--dataset-name", name)


def test_existing_run_folder_is_never_overwritten(tmp_path, capsys):
    run_dir = tmp_path / "exp"
    run_dir.mkdir()
    parse(tmp_path, "--experiment-name", "exp")     # empty folder: fine
    (run_dir / ".owner").write_text("pid 1")
    parse(tmp_path, "--experiment-name", "exp")     # only a lock file: still empty
    (run_dir / "metrics.jsonl").write_text("")      # a run stopped before its first log line
    parse(tmp_path, "--experiment-name", "exp")     # made nothing: reused
    (run_dir / "metrics.jsonl").write_text('{"step": 10}\n')
    assert "already exists and is not empty" in refusal(capsys, tmp_path, "--experiment-name", "exp")
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "summary.json").write_text("{}")
    assert "already exists and is not empty" in refusal(capsys, tmp_path, "--experiment-name", "exp")
    # a resuming run (chapter 04) may reuse its own folder
    parse(tmp_path, "--experiment-name", "exp", resumes=True)
    assert (run_dir / "summary.json").read_text() == "{}"


def test_a_run_folder_that_is_a_file_or_a_save_dir_that_takes_no_file(tmp_path, capsys):
    (tmp_path / "exp").write_text("mine")
    assert "run folder" in refusal(capsys, tmp_path, "--experiment-name", "exp") and \
        (tmp_path / "exp").read_text() == "mine"
    message = refusal(capsys, tmp_path, "--save-dir", "/proc/guide-runs")
    assert message.startswith("error: --save-dir '/proc/guide-runs': cannot write in '/proc'"), message


def test_save_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert refusal(capsys, tmp_path / "file").endswith(f"--save-dir '{tmp_path / 'file'}': it is a file, not a folder")


def test_check_args_raises_usage_error(tmp_path):
    args = base_parser("01-single-gpu", "test").parse_args(["--save-dir", str(tmp_path)])
    args.seq_length = 10_000
    with pytest.raises(UsageError, match="exceeds"):
        check_args(args)


def test_fail_prints_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        fail("--batch-size must be at least 1 (got 0)")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: --batch-size must be at least 1 (got 0)\n"


def test_other_ranks_wait_then_speak_for_themselves(capsys, monkeypatch):
    """Rank 0 speaks at once; another rank first gives rank 0 time to speak (torchrun ends
    the job when the first worker exits), then says its own line, tagged."""
    monkeypatch.setenv("RANK", "1")
    sleeps = []
    monkeypatch.setattr("common.errors.time.sleep", sleeps.append)
    with pytest.raises(SystemExit):
        fail("same message")
    assert sleeps == [3.0]
    assert capsys.readouterr().err == "error: [rank 1] same message\n"


@pytest.mark.parametrize("error, says", [
    (RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                  "8000ms for recv operation to complete"), "a peer stopped answering"),
    # gloo's words, without "gloo", for an operation that waited on the one that timed out
    # (DDP's all-reduce in backward, seen on the two-hosts test's cut cable)
    (RuntimeError("Application timeout caused pair closure"), "a peer stopped answering"),
    (DistError("Connection closed by peer [10.77.0.1]:41097"), "a peer closed its connection"),
])
def test_a_lost_peer_is_one_line_per_rank(capsys, monkeypatch, error, says):
    """A collective that timed out or lost its peer ends the rank with one line naming the
    cause and exit status 1 (os._exit: no teardown talking to the peer that is gone)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr("common.errors.os._exit", lambda status: sys.exit(status))
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: (_ for _ in ()).throw(error))
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: rank 1: {says}") and str(error)[-20:] in err, err
    assert err.rstrip().endswith("the network between them works, then rerun"), err
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")  # torchrun --max-restarts=3, first restart
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(SystemExit):
        run_main(lambda: (_ for _ in ()).throw(error))
    assert capsys.readouterr().err.rstrip().endswith("; torchrun starts the workers again (2 restarts left)")
    with pytest.raises(RuntimeError, match="DataLoader timed out"):  # not a collective: its traceback
        run_main(lambda: (_ for _ in ()).throw(RuntimeError("DataLoader timed out after 5 seconds")))


@pytest.mark.parametrize("error, starts", [
    (RuntimeError("[gloo] Timed out waiting 8000ms for send operation to complete"), "error: rank 0: "),
    (KeyboardInterrupt(), "interrupted (Ctrl-C)"),
])
def test_an_error_under_a_progress_bar_starts_its_own_line(capsys, monkeypatch, error, starts):
    """In a terminal, rank 0 draws a progress bar that leaves the cursor at the end of
    its line. A run that stops there says its one line on a line of its own, under the
    bar's last state, not glued to the bar (the tracker's bar is still open when a peer
    stops answering or Ctrl-C comes)."""
    from tqdm import tqdm
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("common.errors.os._exit", lambda status: sys.exit(status))
    bar = tqdm(total=12, desc="04-checkpointing")

    def main():
        bar.update(6)
        raise error
    with pytest.raises(SystemExit):
        run_main(main)
    drawn, line, end = capsys.readouterr().err.rsplit("\n", 2)
    assert "04-checkpointing:  50%" in drawn.rsplit("\r", 1)[-1] and line.startswith(starts), (drawn, line)
    assert end == "" and bar.disable                                # the bar was closed


def test_out_of_memory_is_one_line_naming_the_batch_size(capsys, monkeypatch):
    """CUDA's OutOfMemoryError, raised in the middle of a step, ends the run with one
    line that says which flag to lower (exit status 1), not a traceback."""
    monkeypatch.delenv("RANK", raising=False)

    def main():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
    with pytest.raises(SystemExit) as exit_:
        run_main(main)
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Tried to allocate 2.00 GiB" in err and "--batch-size" in err, err
    with pytest.raises(RuntimeError, match="an unrelated"):  # other errors keep their traceback
        run_main(lambda: (_ for _ in ()).throw(RuntimeError("an unrelated bug")))


def test_out_of_memory_in_a_chapter_step(tmp_path, capsys, monkeypatch):
    """Chapter 01 in this process, its forward made to fail as the CPU allocator does
    when the batch does not fit: the run stops with the one line."""
    ch01 = load_script("01-single-gpu/train_llm.py")

    def no_memory(*_):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: not enough "
                           "memory: you tried to allocate 1073741824 bytes.")
    monkeypatch.setattr(ch01, "compute_loss", no_memory)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(sys, "argv", ["train_llm.py", "--save-dir", str(tmp_path), "--max-steps", "2",
                                      *TINY])
    with pytest.raises(SystemExit) as exit_:
        run_main(ch01.main)
    assert exit_.value.code == 1
    err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error")]
    assert len(err) == 1 and "not enough memory" in err[0] and "--batch-size" in err[0], err

# Each a real failure, in a process of its own: the words torch itself uses.
REAL_FAILURES = {
    # Linux refuses the allocation (an address-space limit, as clusters set with ulimit -v)
    "cpu-allocator": ("""
import resource, torch
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
run_main(lambda: torch.empty(8 << 30, dtype=torch.uint8))
""", "error: out of memory ([enforce fail", "can't allocate memory"),
    # the kernel's out-of-memory killer takes a DataLoader worker (SIGKILL)
    "killed-worker": ("""
import os, signal, torch
from torch.utils.data import DataLoader
class Dies(torch.utils.data.Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        if i == 5: os.kill(os.getpid(), signal.SIGKILL)
        return i
run_main(lambda: [b for b in DataLoader(Dies(), batch_size=1, num_workers=1)])
""", "error: a DataLoader worker died (", "the kernel's out-of-memory killer is the usual cause"),
    # (torch says "is killed by signal: Killed" or "exited unexpectedly", as its SIGCHLD
    # handler or its queue sees the death first)
}


@pytest.mark.parametrize("case", sorted(REAL_FAILURES))
def test_real_memory_failures_are_one_line(case):
    """What torch really raises, not a message written here: the CPU allocator refused by
    Linux, and a DataLoader worker killed, end the run with one line and exit status 1."""
    code, starts, says = REAL_FAILURES[case]
    proc = subprocess.run([sys.executable, "-c", "from common.errors import run_main\n" + code],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(starts) and says in proc.stderr, proc.stderr


def test_a_worker_death_torch_says_while_its_handler_is_turned_off_is_one_line(tmp_path):
    """torch's SIGCHLD handler raises wherever the main thread is when it sees the dead
    worker: once (in the real case above, in one run of the suite) at the very call of
    run_main's that turns it off. Its error is the line then, exit status 1."""
    script = tmp_path / "dies.py"
    script.write_text("""
import signal
from common.errors import run_main
real = signal.signal
def turning_off(sig, handler):  # the handler gets in at this call
    if sig == signal.SIGCHLD:  # run_main turning the DataLoader's handler off
        signal.signal = real
        raise RuntimeError("DataLoader worker (pid 12345) is killed by signal: Killed. ")
    return real(sig, handler)
signal.signal = turning_off
def main():
    raise EOFError  # the pipe the worker held, as in the real case
run_main(main)
""")
    proc = run_warm([sys.executable, script], check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: a DataLoader worker died (DataLoader worker (pid 12345) is killed "
                                  "by signal: Killed)"), proc.stderr


def test_a_rank_told_to_stop_while_it_waits_to_speak_stays_silent(tmp_path):
    """Rank 1 failing waits before it speaks (`fail`); torchrun, which saw rank 0 fail,
    sends it SIGTERM then. Even with chapter 04's handler installed, which only notes a
    SIGTERM, the rank ends at once without its copy of rank 0's line."""
    code = """
import os, signal, sys
os.environ["RANK"] = "1"
signal.signal(signal.SIGTERM, lambda *_: None)  # as chapter 04's StopRequest notes it
from common.errors import fail
print("waiting", flush=True)
fail("the same line rank 0 said")
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "waiting\n"
    time.sleep(0.5)
    proc.send_signal(subprocess.signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -15 and err == "", (proc.returncode, err)


# The hang demo shows what a failed collective prints: its own report is the lesson.
SHOWS_ITS_OWN_FAILURE = {"03-ddp/debug_hang.py"}


def test_every_script_a_reader_runs_goes_through_run_main():
    """Ctrl-C, a lost peer and a batch too large for memory are one line in every script
    (the tests above prove what run_main does with them), not only in train_llm.py."""
    import ast
    checked = 0
    for path in sorted(REPO.glob("0*/*.py")):
        script = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text())
        main_block = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        if not main_block:
            continue  # a chapter's module (checkpoint.py...), not a script
        checked += 1
        calls = {node.func.id for block in main_block for node in ast.walk(block)
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert ("run_main" in calls) == (script not in SHOWS_ITS_OWN_FAILURE), script
    assert checked == 23  # the scripts of chapters 01-08


SCRIPTS_AND_BAD_FLAGS = [
    ("03-ddp/train_llm.py", ["--batch-size", "0"], "--batch-size"),
    ("04-checkpointing/train_llm.py", ["--keep-last", "0"], "--keep-last"),
    ("05-collectives/collectives_demo.py", ["--op", "nope"], "--op"),
    ("05-collectives/bench_collectives.py", ["--iters", "0"], "--iters"),
    ("05-collectives/ddp_from_scratch.py", ["--modes", "bogus"], "--modes"),
]


@pytest.mark.parametrize("script, argv, flag", SCRIPTS_AND_BAD_FLAGS,
                         ids=[s.split("/")[1] for s, _, _ in SCRIPTS_AND_BAD_FLAGS])
def test_bad_flags_of_torchrun_scripts_are_refused_with_one_line(tmp_path, capsys, monkeypatch,
                                                                  script, argv, flag):
    """Each torchrun script's parser, in this process as rank 0 of 2: exit status 2, one
    line naming the flag, nothing on disk. (Rank 1's wait is
    test_other_ranks_wait_then_speak_for_themselves; the real torchrun path is below.)"""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    line = refused(capsys, load_script(script).parse_args, [*argv, "--save-dir", tmp_path])
    assert f"argument {flag}" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.launch
def test_bad_flag_under_torchrun_always_shows_its_line(tmp_path):
    """End to end, under torchrun with 2 processes: whichever rank exits first, the error
    line is there (rank 1 waits for rank 0 to speak). Tried 20 times by hand; once here."""
    proc = run(torchrun_cmd(2, "03-ddp/train_llm.py", "--batch-size", 0, "--save-dir", tmp_path),
               check=False, timeout=120)  # the real torchrun
    assert "exitcode  : 2" in proc.stderr  # rank 0 exits with status 2; torchrun stops the other
    # the shell gets torchrun's own status, after its report (what the READMEs say)
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert lines and "argument --batch-size" in lines[0], proc.stderr[-2000:]
    assert not any(tmp_path.iterdir())


def test_script_parser_needs_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit):
        script_parser("05-x", "test").parse_args(["--save-dir", str(tmp_path)])
    assert "launch with torchrun" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit):
        script_parser("05-x", "test").parse_args(["--save-dir", str(tmp_path)])
    assert "at least 2 processes" in capsys.readouterr().err


# ---- the backend: nccl for GPUs, gloo for CPUs, or gloo on GPUs when asked ----------

@pytest.mark.parametrize("choice, cuda, processes, gpus, message", [
    ("", False, 2, 0, None),        # CPUs: gloo, any number of processes
    ("gloo", False, 2, 0, None),
    ("", True, 1, 1, None),         # a GPU per process: nccl
    ("nccl", True, 2, 2, None),
    ("gloo", True, 2, 1, None),     # two ranks sharing one GPU: only gloo can
    ("", True, 2, 1, "2 processes on this machine but 1 GPU(s): nccl needs a GPU per process"),
    ("nccl", True, 3, 2, "3 processes on this machine but 2 GPU(s)"),
    ("nccl", False, 1, 0, "LLM_GUIDE_BACKEND=nccl needs GPUs"),
    ("mpi", True, 1, 1, "LLM_GUIDE_BACKEND='mpi': choose nccl or gloo"),
], ids=["cpu", "cpu-gloo", "gpu", "gpus-nccl", "shared-gloo", "shared-nccl", "3-on-2", "nccl-cpu", "mpi"])
def test_backend_choice(choice, cuda, processes, gpus, message):
    error = gpu_sharing_error(choice, cuda, processes, gpus)
    assert error is None if message is None else message in error


def test_backend_follows_the_device_unless_gloo_is_asked_for(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert (backend_for("cpu"), backend_for("cuda:1")) == ("gloo", "nccl")
    monkeypatch.setenv(BACKEND_ENV, "gloo")
    assert (backend_for("cpu"), backend_for("cuda:1")) == ("gloo", "gloo")


def test_a_backend_that_cannot_work_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """Chapters 03-04 and the chapter 05 scripts check LLM_GUIDE_BACKEND with their flags."""
    monkeypatch.setenv(BACKEND_ENV, "nccl")  # and no GPU here
    line = refusal(capsys, tmp_path, distributed=True)
    assert "LLM_GUIDE_BACKEND=nccl needs GPUs" in line
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv(BACKEND_ENV, "ncl")
    line = refused(capsys, script_parser("05-x", "test").parse_args, ["--save-dir", tmp_path])
    assert "LLM_GUIDE_BACKEND='ncl': choose nccl or gloo" in line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("env, refused", [({}, True), ({"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, True),
                                          ({"RANK": "1"}, False), ({"TORCHELASTIC_RESTART_COUNT": "1"}, False)])
def test_resume_from_is_checked_where_and_when_it_is_read(tmp_path, monkeypatch, env, refused):
    """--resume-from is read by rank 0 on a job's first attempt: there a folder without a
    manifest is refused at once. Another machine may not see rank 0's disk, and a restart
    ignores the flag (--keep-last may have pruned the folder): neither refuses it."""
    for name in ("RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    missing = str(tmp_path / "step-00000003")
    checkpoint_folder = chapter_module("04-checkpointing", "checkpoint").checkpoint_folder
    if refused:
        with pytest.raises(argparse.ArgumentTypeError, match="is not a checkpoint folder"):
            checkpoint_folder(missing)
    else:
        assert checkpoint_folder(missing) == missing


# ---- DataLoader workers: bounded by the cores ------------------------------------------

def test_absurd_num_workers_are_refused_before_any_work(tmp_path, capsys):
    """--num-workers 10000 forked workers for minutes: more workers than the cores this
    process may use is refused at parsing (one line, exit status 2, nothing created), and
    a worker per core still passes."""
    import os

    cores = len(os.sched_getaffinity(0))
    line = refusal(capsys, tmp_path / "out", "--num-workers", "10000")
    assert line == (f"error: argument --num-workers: must be a whole number from 0 to {cores}, the cores "
                    f"here (got '10000') (see --help)")
    assert not (tmp_path / "out").exists()
    assert parse(tmp_path / "out", "--num-workers", str(cores)).num_workers == cores


# ---- Ctrl-C while a chapter script starts -----------------------------------------------

CHAPTER_SCRIPTS = ["01-single-gpu/train_llm.py", "02-data-parallel/train_llm.py", "03-ddp/train_llm.py",
                   "04-checkpointing/train_llm.py"]


def loading_torch(pid: int) -> bool:
    """Whether process `pid` is inside `import torch` or past it (its library is mapped)."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.launch
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_torch_is_imported_stops_the_run_as_python_does(tmp_path):
    """Ctrl-C within the first seconds, while `import torch` runs (before any output): the
    scripts import plainly, with nothing that holds the signal, so the run stops at once
    as any Python program does, with Python's KeyboardInterrupt and status -SIGINT (or,
    where the signal comes after the imports, with run_main's one line and status 130),
    and leaves nothing on disk."""
    job = start(python_cmd(CHAPTER_SCRIPTS[0], *TINY, "--save-dir", tmp_path / "out"), tmp_path / "log")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not loading_torch(job.pid):
            time.sleep(0.005)
        os.killpg(job.pid, signal.SIGINT)  # a terminal's Ctrl-C
        job.wait(timeout=60)
    finally:
        kill_job(job.pid)
    out = (tmp_path / "log").read_text()
    said = [line for line in out.splitlines() if line.startswith("interrupted (Ctrl-C): ")]
    assert (job.returncode == -signal.SIGINT and out.rstrip().endswith("KeyboardInterrupt")) or \
        (job.returncode == 130 and len(said) == 1), (job.returncode, out[-3000:])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("restarts", [0, 3])
def test_only_a_script_that_resumes_says_that_a_rerun_resumes(capsys, monkeypatch, restarts):
    """A lost peer's line promised "chapter 04 resumes from its last checkpoint" in every
    script, chapter 05's too, which keep no checkpoint. Only run_main(resumes=True), which
    only the scripts that checkpoint pass (chapters 04, 07 and 08), says it now: after the
    rerun, or torchrun's restart."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(restarts))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr("common.errors.os._exit", lambda status: sys.exit(status))
    lines = {}
    for resumes in (False, True):
        with pytest.raises(SystemExit):
            run_main(lambda: (_ for _ in ()).throw(DistError("Connection closed by peer [10.0.0.1]:1")),
                     resumes=resumes)
        [lines[resumes]] = capsys.readouterr().err.strip().splitlines()
    assert "resume" not in lines[False] and "chapter 04" not in lines[False], lines
    assert lines[True].endswith("they resume from the last checkpoint)" if restarts else
                                "then rerun the same command: it resumes from the last checkpoint"), lines
    callers = {}
    for path in sorted(REPO.glob("0*/*.py")):
        for call in re.findall(r"run_main\((.*)\)", path.read_text()):
            callers[path.relative_to(REPO).as_posix()] = "resumes=True" in call
    assert {script for script, resumes in callers.items() if resumes} == {
        "04-checkpointing/train_llm.py", "07-3d-parallelism/train_llm.py", "08-context-parallel/train_llm.py"}
    assert any(script.startswith("05-collectives/") for script in callers), callers


def test_a_data_worker_killed_by_a_stop_signal_is_not_blamed_on_memory():
    """A DataLoader worker that dies of SIGTERM sent to its own pid (as SLURM signals each
    process of a job it ends), while its trainer waits for a batch: the line names the
    signal, not the out-of-memory killer, whose SIGKILL the line keeps its advice for
    (test_real_memory_failures_are_one_line). (A worker that dies while it hands a batch
    over breaks the connection first: torch then cannot say what killed it.)"""
    code = """
import os, signal, time, torch
from torch.utils.data import DataLoader
from common.errors import run_main
class Stopped(torch.utils.data.Dataset):
    def __len__(self): return 100
    def __getitem__(self, i):
        if i == 5:
            time.sleep(0.5)  # the batches before are handed over
            os.kill(os.getpid(), signal.SIGTERM)
        return i
run_main(lambda: [b for b in DataLoader(Stopped(), batch_size=1, num_workers=1)])
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: a DataLoader worker died (DataLoader worker (pid ") and \
        "is killed by signal: Terminated): SIGTERM, a stop signal, reached the worker itself" in proc.stderr \
        and "memory" not in proc.stderr.replace("not a lack of memory", ""), proc.stderr
