"""The command line chapters 01-04 share: each flag checked by its `type=`, the checks of
several flags inside `parse_args`: bad input is one line, exit status 2, before any work."""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from .data import check_dataset_name, load_tokenizer
from .distributed import BACKEND_ENV, gpu_sharing_error
from .environment import threads_override
from .errors import UsageError, fail
from .model import PRESETS
from .runfolder import holds_results

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SAVE_DIR = (REPO_ROOT if (REPO_ROOT / "pyproject.toml").exists() else Path.cwd()) / "outputs"
DTYPES = ("auto", "fp32", "bf16")  # fp16 would also need a GradScaler: not this lesson
# cuBLAS sums in a fixed order with these (its docs, "Results reproducibility"); torch requires one
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def _number(cast, ok, requirement):
    """A `type=` validator: argparse prints "argument --x: must be ..."."""
    def parse(text: str):
        try:
            value = cast(text)
            fine = ok(value) and (cast is int or math.isfinite(value))
        except (TypeError, ValueError):
            fine = False
        if not fine:
            raise argparse.ArgumentTypeError(f"must be {requirement} (got {text!r})")
        return value
    return parse


positive_int = _number(int, lambda v: v >= 1, "a whole number >= 1")
non_negative_int = _number(int, lambda v: v >= 0, "a whole number >= 0")
positive_float = _number(float, lambda v: v > 0, "a finite number > 0")
non_negative_float = _number(float, lambda v: v >= 0, "a finite number >= 0")
seconds = _number(float, lambda v: 0 < v <= 7 * 86400, "a number of seconds in (0, 604800]")
seed_value = _number(int, lambda v: 0 <= v < 2**63, "a whole number in [0, 2**63)")
# 256 bytes and 3 special tokens leave room for one learned token; BPE learns at most 2**20 here
vocab_size = _number(int, lambda v: 260 <= v <= 2**20, "a whole number from 260 to 1048576")
# DataLoader workers: at most the cores here (torch warns above); more only wait (10,000 fork for minutes)
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
worker_count = _number(int, lambda v: 0 <= v <= CORES, f"a whole number from 0 to {CORES}, the cores here")


def one_of(*choices):
    """Like choices=, but the message lists the choices on one line."""
    def parse(text: str):
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {text!r}; choose one of: {', '.join(choices)}")
        return text
    return parse


def comma_list(*choices):
    """A comma-separated list of distinct choices, e.g. --modes naive,ddp."""
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items or set(items) - set(choices):
            unknown = ",".join(t for t in items if t not in choices) or "(empty)"
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from: {', '.join(choices)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"lists an item twice: {text}")
        return items
    return parse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default once: not for switches, empty defaults, or where the help says it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (no usage block), exit 2; `checks` run in parse_args."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)  # --max-step is a typo, not --max-steps
        super().__init__(*args, **kwargs)
        self.checks = []

    def error(self, message):
        fail(f"{message} (see --help)")

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        try:
            for check in self.checks:
                check(parsed)
        except UsageError as e:
            fail(str(e))
        return parsed


def base_parser(chapter: str, description: str, *, distributed: bool = False, resumes: bool = False) -> Parser:
    """The chapters' shared flags. `distributed`: under torchrun; `resumes`: the run
    folder may hold an earlier run of the same job (chapter 04)."""
    p = Parser(description=description)
    p.set_defaults(chapter=chapter)
    p.add_argument("--experiment-name", default=None,
                   help="run folder name (default: <chapter>-<timestamp>; under torchrun <chapter>-<job id>)")
    g = p.add_argument_group("data")
    g.add_argument("--dataset-name", default="stdlib", help="'stdlib' (offline), a hub id, or a local file/folder/glob")
    g.add_argument("--dataset-subset", default=None, help="hub dataset configuration name")
    g.add_argument("--text-column", default="text", help="column holding the text")
    g.add_argument("--tokenizer", default=None, help="tokenizers JSON file (default: one trained on the corpus)")
    g.add_argument("--vocab-size", type=vocab_size, default=8192, help="vocabulary of a newly trained tokenizer")
    g.add_argument("--padded", action="store_true", help="one document per sample, padded (default: packed)")
    g.add_argument("--cache-dir", default=None, help="data cache (default: $LLM_GUIDE_CACHE or ~/.cache/llm-guide)")
    g = p.add_argument_group("model and training")
    g.add_argument("--model-preset", default="small", type=one_of(*PRESETS), help=f"model size: {', '.join(PRESETS)}")
    g.add_argument("--seq-length", type=positive_int, default=256, help="tokens per sample")
    g.add_argument("--batch-size", type=positive_int, default=8, help="samples per step, per process")
    g.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="AdamW weight decay of the matrices")
    g.add_argument("--warmup-steps", type=non_negative_int, default=10, help="steps of linear warmup before the cosine")
    g.add_argument("--num-epochs", type=positive_int, default=1, help="passes over the data; read with --max-steps 0")
    g.add_argument("--max-steps", type=non_negative_int, default=100, help="optimizer steps; 0 = run all epochs")
    g.add_argument("--seed", type=seed_value, default=0, help="seed of the initial weights and of the data order")
    g = p.add_argument_group("run")
    g.add_argument("--log-freq", type=positive_int, default=10, help="log every N steps")
    g.add_argument("--val-batches", type=non_negative_int, default=20, help="batches in the final validation (at most)")
    g.add_argument("--save-dir", default=str(DEFAULT_SAVE_DIR), help="parent of the run folder")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda" + ("" if distributed else ", cuda:N"))
    g.add_argument("--dtype", default="auto", type=one_of(*DTYPES), help="auto: bf16 autocast on CUDA, else fp32")
    g.add_argument("--num-workers", type=worker_count, default=1, help=f"DataLoader processes, at most {CORES} (cores)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model and loss (the first step is slow)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each layer's activations in backward: much less memory, one more forward")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels only: the same bits in every rerun and resume, GPUs too, slower")
    if distributed:
        g.add_argument("--timeout", type=seconds, default=600, help="seconds a collective waits for the other ranks")
    p.checks.append(lambda args: check_args(args, run_dir_must_be_new=not resumes))
    p.checks.append(check_launch_many if distributed else check_launch_one)
    return p


def check_args(args, *, run_dir_must_be_new: bool = True) -> None:
    """The checks that involve several flags, files or the machine. Raises UsageError."""
    check_run_folder(args, args.chapter, must_be_new=run_dir_must_be_new)
    check_seq_length(args)
    check_dataset_name(args.dataset_name)
    if args.tokenizer:
        load_tokenizer(args.tokenizer)
    check_device(args.device)
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if args.deterministic and workspace not in (None, *CUBLAS_DETERMINISTIC):
        raise UsageError(f"--deterministic: CUBLAS_WORKSPACE_CONFIG={workspace!r} lets cuBLAS vary its "
                         f"sums; unset it or use {' or '.join(CUBLAS_DETERMINISTIC)}")
    threads_override()  # LLM_GUIDE_THREADS, if set, is a thread count
    args.cache_dir = args.cache_dir and os.path.expanduser(args.cache_dir)  # '~/cache' quoted, as a shell would


def check_seq_length(args) -> None:
    max_pos = PRESETS[args.model_preset]["max_position_embeddings"]
    if args.seq_length > max_pos:
        raise UsageError(f"--seq-length {args.seq_length} exceeds the {args.model_preset!r} preset's "
                         f"max_position_embeddings={max_pos}")


def script_path() -> str:
    """The script this process runs, as a command from the repo's root would name it."""
    script = Path(sys.argv[0]).resolve()
    return str(script.relative_to(REPO_ROOT) if script.is_relative_to(REPO_ROOT) else sys.argv[0])


def check_launch_one(args) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(f"{args.chapter} trains in one process; launch it with `python {script_path()}` "
                         f"(several processes are chapter 03)")


def check_launch_many(args) -> None:
    if args.device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {args.device}: each process takes the GPU of its LOCAL_RANK; "
                         f"use auto, cuda or cpu (CUDA_VISIBLE_DEVICES chooses which GPUs)")
    check_backend_choice(cuda=torch.cuda.is_available() and args.device != "cpu")


def check_backend_choice(cuda: bool) -> None:
    if error := gpu_sharing_error(os.environ.get(BACKEND_ENV, ""), cuda, int(os.environ.get("LOCAL_WORLD_SIZE") or 1),
                                  torch.cuda.device_count() if cuda else 0):
        raise UsageError(error)


def check_run_folder(args, name_prefix: str, *, must_be_new: bool = True) -> None:
    """--experiment-name (default `<name_prefix>-<timestamp>`) in a writable --save-dir,
    holding (unless `must_be_new` is False) no earlier results to overwrite."""
    args.save_dir = os.path.expanduser(args.save_dir)  # '~/runs' quoted, as the shell would
    save_dir, job = Path(args.save_dir), os.environ.get("TORCHELASTIC_RUN_ID", "")
    if args.experiment_name is None and job not in ("", "none"):  # every rank and restart agrees on it
        args.experiment_name = f"{name_prefix}-{re.sub(r'[^A-Za-z0-9._-]+', '-', job)[:36].strip('-.') or 'job'}"
    elif args.experiment_name is None:  # then -2, -3, ... if a run of the same second took it
        args.experiment_name = unused_name(save_dir, f"{name_prefix}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.experiment_name) or args.experiment_name in (".", ".."):
        raise UsageError(f"--experiment-name {args.experiment_name!r} must use only letters, digits, '.', '_' and '-'")
    if len(args.experiment_name) > 200:  # a folder name, and file systems stop at 255 bytes
        raise UsageError(f"--experiment-name is {len(args.experiment_name)} characters long; 200 at most")
    run_dir = save_dir / args.experiment_name
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"run folder {str(run_dir)!r} exists and is a file; choose another --experiment-name")
    check_writable_folder(save_dir, "--save-dir")  # a read-only or full place: now, not after the data
    if must_be_new and holds_results(run_dir):
        raise UsageError(f"run folder {str(run_dir)!r} already exists and is not empty; "
                         f"choose another --experiment-name or remove it")


def check_writable_folder(path: str | os.PathLike, flag: str) -> None:
    """An output folder that can be made and written: its nearest existing part takes a byte."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: {'it' if existing == path else repr(str(existing))} "
                         f"is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write-test-")
        os.unlink(probe)  # nothing left behind, whatever follows
        with open(fd, "wb", buffering=0) as f:  # a byte forced to disk: a full file system refuses it
            f.write(b"\0")
            os.fsync(fd)
    except OSError as e:
        raise UsageError(f"{flag} {str(path)!r}: cannot write in {str(existing)!r} ({e.strerror or e})") from None


def unused_name(folder: Path, stem: str) -> str:
    """`stem`, or `stem-2`, `stem-3`, ...: the first name `folder` does not hold yet."""
    name, n = stem, 1
    while (folder / name).exists():
        n += 1
        name = f"{stem}-{n}"
    return name


def check_device(device: str) -> None:
    if device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise UsageError(f"--device {device!r} is not supported (auto, cpu, cuda, cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device} asked for, but CUDA is not available here")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")


def setup_logging(rank: int = 0) -> logging.Logger:
    """Rank 0 logs at INFO; other ranks only warnings and errors, tagged with their rank."""
    prefix = "" if rank == 0 else f"[rank {rank}] "
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, force=True, stream=sys.stdout,
                        format=f"%(asctime)s {prefix}%(levelname)s %(message)s", datefmt="%H:%M:%S")
    return logging.getLogger("train")


def cuda_device_ids(text: str) -> list[int]:
    """--device-ids 0,1,3: distinct indices of visible GPUs."""
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("names GPUs, but CUDA is not available here")
    ids = [int(i) if i.strip().isdigit() else -1 for i in text.split(",")]
    if len(set(ids)) != len(ids) or not all(0 <= i < torch.cuda.device_count() for i in ids):
        raise argparse.ArgumentTypeError(f"{text}: must be distinct indices of the {torch.cuda.device_count()} GPUs")
    return ids


def no_compile_under_data_parallel(args) -> None:
    """--compile under DataParallel (2+ GPUs), which copies the module every step: refused."""
    cuda = torch.cuda.is_available() and not args.device.startswith("cpu")
    gpus = len(args.device_ids or range(torch.cuda.device_count())) if cuda else 0
    if args.compile and gpus >= 2:
        raise UsageError(f"--compile does not apply under nn.DataParallel ({gpus} GPUs): drop it, or "
                         f"train on one GPU (--device-ids 0); chapter 03 compiles under DDP")

