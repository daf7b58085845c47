"""The command line every chapter shares (DESIGN.md, "Shared command line").

A chapter script builds its parser with `base_parser`, adds the flags of its own lesson,
and calls `check_args` before doing any work: bad input stops with one line on stderr
and exit status 2, and nothing is created on disk.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from pathlib import Path

import torch

from .data import DataError, check_dataset_name, load_tokenizer
from .model import PRESETS

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SAVE_DIR = REPO_ROOT / "outputs" if (REPO_ROOT / "pyproject.toml").exists() \
    else Path.cwd() / "outputs"
DTYPES = ("auto", "fp32", "bf16")  # fp16 would also need a GradScaler: not this lesson


class UsageError(Exception):
    """Bad flags or an impossible configuration."""


def fail(message: str, status: int = 2):
    """One line on stderr and exit status 2. Under torchrun every rank sees the same
    bad input; only rank 0 says so."""
    if int(os.environ.get("RANK") or 0) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag gives one line (not the usage block) and exit 2."""

    def error(self, message):
        fail(f"{message} (see --help)")


def base_parser(chapter: str, description: str) -> argparse.ArgumentParser:
    p = Parser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.set_defaults(chapter=chapter)
    p.add_argument("--experiment-name", default=None,
                   help="run id and output folder name (default: <chapter>-<timestamp>)")
    g = p.add_argument_group("data")
    g.add_argument("--dataset-name", default="stdlib",
                   help="'stdlib' (embedded, offline), a Hugging Face hub id, or a local "
                        "file/folder/glob of .txt/.md/.py/.jsonl")
    g.add_argument("--dataset-subset", default=None, help="hub dataset configuration name")
    g.add_argument("--text-column", default="text", help="column holding the text")
    g.add_argument("--tokenizer", default=None,
                   help="existing tokenizers JSON file (default: train one on the corpus, cached)")
    g.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of a newly trained tokenizer")
    g.add_argument("--padded", action="store_true",
                   help="one document per sample, padded, with attention masks "
                        "(default: packed sequences, no masks)")
    g.add_argument("--cache-dir", default=None,
                   help="tokenizer and tokenized-corpus cache (default: $LLM_GUIDE_CACHE "
                        "or ~/.cache/llm-guide)")
    g = p.add_argument_group("model and training")
    g.add_argument("--model-preset", default="small", help=f"one of: {', '.join(PRESETS)}")
    g.add_argument("--seq-length", type=int, default=256, help="tokens per sample")
    g.add_argument("--batch-size", type=int, default=8, help="samples per step, per process")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--warmup-steps", type=int, default=10)
    g.add_argument("--num-epochs", type=int, default=1)
    g.add_argument("--max-steps", type=int, default=100,
                   help="stop after this many optimizer steps; 0 = run all epochs")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("run")
    g.add_argument("--log-freq", type=int, default=10, help="log every N steps")
    g.add_argument("--val-batches", type=int, default=20, help="batches in the final validation")
    g.add_argument("--save-dir", default=str(DEFAULT_SAVE_DIR), help="parent of the run folder")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto = bf16 autocast on CUDA, fp32 on CPU")
    g.add_argument("--num-workers", type=int, default=1, help="DataLoader worker processes")
    return p


def check_args(args, *, run_dir_must_be_new: bool = True) -> None:
    """Everything that can be checked before any work. Raises UsageError."""
    check_run_folder(args, args.chapter, must_be_new=run_dir_must_be_new)
    if args.model_preset not in PRESETS:
        raise UsageError(f"unknown --model-preset {args.model_preset!r}; choose one of "
                         f"{', '.join(PRESETS)}")
    for name in ("batch_size", "seq_length", "num_epochs", "log_freq", "vocab_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    for name in ("max_steps", "warmup_steps", "val_batches", "num_workers"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must not be negative (got {getattr(args, name)})")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive (got {args.lr})")
    if args.weight_decay < 0:
        raise UsageError(f"--weight-decay must not be negative (got {args.weight_decay})")
    max_pos = PRESETS[args.model_preset]["max_position_embeddings"]
    if args.seq_length > max_pos:
        raise UsageError(f"--seq-length {args.seq_length} exceeds the {args.model_preset!r} "
                         f"preset's max_position_embeddings={max_pos}")
    if args.vocab_size < 260:
        raise UsageError(f"--vocab-size {args.vocab_size} is below the 256 bytes plus 3 special tokens")
    try:
        check_dataset_name(args.dataset_name)
        if args.tokenizer:
            load_tokenizer(args.tokenizer)
    except DataError as e:
        raise UsageError(str(e)) from None
    check_device(args.device, args.dtype)


def check_run_folder(args, name_prefix: str, *, must_be_new: bool = True) -> None:
    """--experiment-name (default `<name_prefix>-<timestamp>`) and --save-dir: a safe
    folder name, a save dir that is a folder, and (unless resuming) no earlier results
    in <save-dir>/<experiment-name> to overwrite. Raises UsageError."""
    if args.experiment_name is None:
        args.experiment_name = f"{name_prefix}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.experiment_name) or args.experiment_name in (".", ".."):
        raise UsageError(f"--experiment-name {args.experiment_name!r} must use only letters, "
                         f"digits, '.', '_' and '-'")
    save_dir = Path(args.save_dir)
    if save_dir.exists() and not save_dir.is_dir():
        raise UsageError(f"--save-dir {str(save_dir)!r} exists and is not a folder")
    run_dir = save_dir / args.experiment_name
    if must_be_new and run_dir.exists() and any(run_dir.iterdir()):
        raise UsageError(f"run folder {str(run_dir)!r} already exists and is not empty; "
                         f"choose another --experiment-name or remove it")


def check_device(device: str, dtype: str) -> None:
    if device != "auto":
        try:
            d = torch.device(device)
        except RuntimeError:
            raise UsageError(f"--device {device!r} is not a device (auto, cpu, cuda, cuda:N)") from None
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise UsageError(f"--device {device} asked for, but CUDA is not available here")
            if d.index is not None and d.index >= torch.cuda.device_count():
                raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
        elif d.type not in ("cpu", "mps"):
            raise UsageError(f"--device {device!r} is not supported (auto, cpu, cuda, cuda:N)")
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if dtype == "bf16" and not on_cuda:
        raise UsageError(f"--dtype {dtype} needs a CUDA device; use fp32 (or auto) on CPU")


def setup_logging(rank: int = 0) -> logging.Logger:
    """Rank 0 logs at INFO; other ranks only warnings and errors, tagged with their rank."""
    prefix = "" if rank == 0 else f"[rank {rank}] "
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s {prefix}%(levelname)s %(message)s",
                        datefmt="%H:%M:%S", force=True, stream=sys.stdout)
    return logging.getLogger("train")
