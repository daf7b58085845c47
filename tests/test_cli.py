"""The shared command line: good defaults pass, every bad flag stops with one clear
UsageError before anything is created on disk."""

from __future__ import annotations

import re

import pytest

from common.cli import UsageError, base_parser, check_args, fail


def parse(save_dir, *argv):
    return base_parser("01-single-gpu", "test").parse_args(["--save-dir", str(save_dir), *argv])


def test_defaults_are_accepted_and_create_nothing(tmp_path):
    args = parse(tmp_path / "outputs")
    check_args(args)
    assert re.fullmatch(r"01-single-gpu-\d{8}-\d{6}", args.experiment_name)
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "0"], "--batch-size must be at least 1 (got 0)"),
    (["--model-preset", "tiny", "--seq-length", "257"],
     "--seq-length 257 exceeds the 'tiny' preset's max_position_embeddings=256"),
    (["--lr", "-0.001"], "--lr must be positive (got -0.001)"),
    (["--lr", "0"], "--lr must be positive"),
    (["--max-steps", "-1"], "--max-steps must not be negative (got -1)"),
    (["--warmup-steps", "-5"], "--warmup-steps must not be negative"),
    (["--num-epochs", "0"], "--num-epochs must be at least 1"),
    (["--model-preset", "huge"], "unknown --model-preset 'huge'"),
    (["--experiment-name", "../escape"], "--experiment-name '../escape' must use only"),
    (["--experiment-name", "a b"], "must use only letters"),
    (["--vocab-size", "100"], "--vocab-size 100 is below"),
    (["--device", "cpu", "--dtype", "bf16"], "--dtype bf16 needs a CUDA device"),
    (["--device", "tpu"], "--device 'tpu'"),
])
def test_bad_flags_are_refused(tmp_path, argv, message):
    with pytest.raises(UsageError) as err:
        check_args(parse(tmp_path, *argv))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_local_dataset_and_tokenizer(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        check_args(parse(tmp_path, "--dataset-name", str(tmp_path / "nowhere" / "*.txt")))
    with pytest.raises(UsageError, match="does not exist"):
        check_args(parse(tmp_path, "--tokenizer", str(tmp_path / "tok.json")))


def test_existing_run_folder_is_never_overwritten(tmp_path):
    run_dir = tmp_path / "exp"
    run_dir.mkdir()
    check_args(parse(tmp_path, "--experiment-name", "exp"))     # empty folder: fine
    (run_dir / "summary.json").write_text("{}")
    with pytest.raises(UsageError, match="already exists and is not empty"):
        check_args(parse(tmp_path, "--experiment-name", "exp"))
    # a resuming run (chapter 04) may reuse its own folder
    check_args(parse(tmp_path, "--experiment-name", "exp"), run_dir_must_be_new=False)
    assert (run_dir / "summary.json").read_text() == "{}"


def test_save_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="is not a folder"):
        check_args(parse(tmp_path / "file"))


def test_fail_prints_one_line_and_exits_2(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        fail("--batch-size must be at least 1 (got 0)")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: --batch-size must be at least 1 (got 0)\n"
    monkeypatch.setenv("RANK", "1")          # under torchrun only rank 0 says it
    with pytest.raises(SystemExit):
        fail("same message")
    assert capsys.readouterr().err == ""
