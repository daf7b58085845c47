"""The command line every chapter shares (DESIGN.md, "Shared command line").

A chapter builds its parser with `base_parser` (the chapter 05 scripts with
`script_parser`), adds the flags of its own lesson with a validating `type=`, and calls
`parse_args`: every check runs inside it, so bad input stops with one line on stderr and
exit status 2, before any work, and nothing is created on disk.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from .data import DataError, check_dataset_name, load_tokenizer
from .distributed import BACKEND_ENV, gpu_sharing_error
from .environment import threads_override
from .errors import UsageError, fail
from .model import PRESETS
from .runfolder import holds_results
from .metrics import baseline_problem

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SAVE_DIR = REPO_ROOT / "outputs" if (REPO_ROOT / "pyproject.toml").exists() \
    else Path.cwd() / "outputs"
DTYPES = ("auto", "fp32", "bf16")  # fp16 would also need a GradScaler: not this lesson
# The CUBLAS_WORKSPACE_CONFIG values with which cuBLAS sums in a fixed order (NVIDIA's cuBLAS
# docs, "Results reproducibility"); torch's deterministic mode refuses cuBLAS without one.
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


# ---- validators for `type=`: argparse reports their message as "argument --x: ..." ----

def _number(cast, ok, requirement):
    def parse(text: str):
        try:
            value = cast(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"must be {requirement} (got {text!r})") from None
        if (isinstance(value, float) and not math.isfinite(value)) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {requirement} (got {text!r})")
        return value
    parse.__name__ = requirement
    return parse


positive_int = _number(int, lambda v: v >= 1, "a whole number >= 1")
non_negative_int = _number(int, lambda v: v >= 0, "a whole number >= 0")
positive_float = _number(float, lambda v: v > 0, "a finite number > 0")
non_negative_float = _number(float, lambda v: v >= 0, "a finite number >= 0")
seconds = _number(float, lambda v: 0 < v <= 7 * 86400, "a number of seconds in (0, 604800]")
seed_value = _number(int, lambda v: 0 <= v < 2**63, "a whole number in [0, 2**63)")
# DataLoader workers: at most the cores this process may use, where torch's DataLoader
# starts to warn; more only wait for a core (and 10,000 would fork for minutes)
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
worker_count = _number(int, lambda v: 0 <= v <= CORES, f"a whole number from 0 to {CORES}, the cores here")


def existing_file(text: str) -> str:
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist or is not a file")
    return text


def baseline_file(text: str) -> str:
    """--baseline: a summary.json the scaling efficiency can divide by, checked now, not
    when the run ends."""
    existing_file(text)
    try:
        problem = baseline_problem(json.loads(Path(text).read_text()))
    except (OSError, ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested too deep
        problem = f"not readable as JSON ({type(e).__name__})"
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} is not a run's summary.json: {problem}")
    return text


def one_of(*choices):
    """Like choices=, but the message lists the choices on one line."""
    def parse(text: str):
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown {text!r}; choose one of: {', '.join(choices)}")
        return text
    parse.__name__ = "choice"
    return parse


def comma_list(*choices):
    """A comma-separated list of distinct choices, e.g. --modes naive,ddp."""
    def parse(text: str):
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"unknown {','.join(unknown) or '(empty)'}; "
                                             f"choose from: {', '.join(choices)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"lists an item twice: {text}")
        return items
    parse.__name__ = "list"
    return parse


# ---- the parser ------------------------------------------------------------------------

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default once: not for switches and empty defaults, nor where the help
    text already says it."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag gives one line (not the usage block) and exit 2, and the
    checks that need several flags at once (`self.checks`) run inside parse_args."""

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


def base_parser(chapter: str, description: str, *, distributed: bool = False,
                resumes: bool = False) -> Parser:
    """The chapters' shared flags. `distributed`: launched by torchrun, one process per
    device (adds --timeout and --baseline). `resumes`: the run folder may hold an earlier
    run of the same job (chapter 04)."""
    p = Parser(description=description)
    p.set_defaults(chapter=chapter)
    p.add_argument("--experiment-name", default=None,
                   help="run id and output folder name (default: <chapter>-<timestamp>; under "
                        "torchrun <chapter>-<job id>, the same on every rank and restart)")
    g = p.add_argument_group("data")
    g.add_argument("--dataset-name", default="stdlib",
                   help="'stdlib' (embedded, offline), a Hugging Face hub id, or a local "
                        "file/folder/glob of .txt/.md/.py/.jsonl")
    g.add_argument("--dataset-subset", default=None, help="hub dataset configuration name")
    g.add_argument("--text-column", default="text", help="column holding the text")
    g.add_argument("--tokenizer", default=None,
                   help="existing tokenizers JSON file (default: train one on the corpus, cached)")
    g.add_argument("--vocab-size", type=positive_int, default=8192,
                   help="vocabulary of a newly trained tokenizer")
    g.add_argument("--padded", action="store_true",
                   help="one document per sample, padded, with attention masks "
                        "(default: packed sequences, no masks)")
    g.add_argument("--cache-dir", default=None,
                   help="tokenizer and tokenized-corpus cache (default: $LLM_GUIDE_CACHE "
                        "or ~/.cache/llm-guide)")
    g = p.add_argument_group("model and training")
    g.add_argument("--model-preset", default="small", type=one_of(*PRESETS),
                   help=f"model size: {', '.join(PRESETS)}")
    g.add_argument("--seq-length", type=positive_int, default=256, help="tokens per sample")
    g.add_argument("--batch-size", type=positive_int, default=8, help="samples per step, per process")
    g.add_argument("--lr", type=positive_float, default=1e-3, help="peak learning rate")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.1,
                   help="AdamW weight decay of the matrices (norm weights get none)")
    g.add_argument("--warmup-steps", type=non_negative_int, default=10,
                   help="steps of linear learning-rate warmup before the cosine decay")
    g.add_argument("--num-epochs", type=positive_int, default=1,
                   help="passes over the training set; read only with --max-steps 0")
    g.add_argument("--max-steps", type=non_negative_int, default=100,
                   help="stop after this many optimizer steps; 0 = run all epochs")
    g.add_argument("--seed", type=seed_value, default=0,
                   help="seed of the initial weights and of the data order")
    g = p.add_argument_group("run")
    g.add_argument("--log-freq", type=positive_int, default=10, help="log every N steps")
    g.add_argument("--val-batches", type=non_negative_int, default=20,
                   help="batches in the final validation (at most)")
    g.add_argument("--save-dir", default=str(DEFAULT_SAVE_DIR), help="parent of the run folder")
    g.add_argument("--device", default="auto",
                   help="auto, cpu, cuda" + ("" if distributed else ", cuda:N"))
    g.add_argument("--dtype", default="auto", type=one_of(*DTYPES),
                   help="auto = bf16 autocast on CUDA, fp32 on CPU; fp32 = no autocast (on CUDA, "
                        "matmuls in TF32); bf16 = bf16 autocast")
    g.add_argument("--num-workers", type=worker_count, default=1,
                   help=f"DataLoader worker processes, at most the {CORES} cores this process may use: "
                        f"each worker is a process, and more would only wait for a core")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model and loss (the first step compiles: slow)")
    g.add_argument("--activation-checkpointing", action="store_true",
                   help="keep only each layer's input for backward and recompute the rest "
                        "there: much less activation memory for about one more forward")
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels only (torch.use_deterministic_algorithms): the same "
                        "bits in every rerun and resume on GPUs too, at the slower kernels' cost")
    if distributed:
        g.add_argument("--timeout", type=seconds, default=600,
                       help="seconds a collective may wait for the other ranks before failing")
        g.add_argument("--baseline", type=baseline_file, default=None,
                       help="chapter 01 summary.json for the scaling efficiency (default: the "
                            "latest matching one under --save-dir)")
    p.checks.append(lambda args: check_args(args, run_dir_must_be_new=not resumes))
    p.checks.append(check_launch_many if distributed else check_launch_one)
    return p


def check_args(args, *, run_dir_must_be_new: bool = True) -> None:
    """The checks that involve several flags, files or the machine. Raises UsageError."""
    check_run_folder(args, args.chapter, must_be_new=run_dir_must_be_new)
    check_seq_length(args)
    if args.vocab_size < 260:
        raise UsageError(f"--vocab-size {args.vocab_size} is below 260: the 256 bytes and 3 special tokens "
                         f"would leave no room for a single learned token")
    if args.vocab_size > 2**20:
        raise UsageError(f"--vocab-size {args.vocab_size} is above {2**20:,}, more than a BPE "
                         f"tokenizer can learn here")
    check_data(args.dataset_name, args.tokenizer)
    check_device(args.device)
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if args.deterministic and workspace not in (None, *CUBLAS_DETERMINISTIC):
        raise UsageError(f"--deterministic: CUBLAS_WORKSPACE_CONFIG={workspace!r} lets cuBLAS vary its "
                         f"sums; unset it or use {' or '.join(CUBLAS_DETERMINISTIC)}")
    threads_override()  # LLM_GUIDE_THREADS, if set, is a thread count
    if args.cache_dir:  # '~/cache' quoted, as the shell would (not a folder named '~' here)
        args.cache_dir = os.path.expanduser(args.cache_dir)
    if args.cache_dir and os.path.exists(args.cache_dir) and not os.path.isdir(args.cache_dir):
        raise UsageError(f"--cache-dir {args.cache_dir!r} exists and is not a folder")


def check_seq_length(args) -> None:
    max_pos = PRESETS[args.model_preset]["max_position_embeddings"]
    if args.seq_length > max_pos:
        raise UsageError(f"--seq-length {args.seq_length} exceeds the {args.model_preset!r} "
                         f"preset's max_position_embeddings={max_pos}")


def check_data(dataset_name: str, tokenizer: str | None = None) -> None:
    """--dataset-name (and --tokenizer, if given) checked without loading the corpus."""
    try:
        check_dataset_name(dataset_name)
        if tokenizer:
            load_tokenizer(tokenizer)
    except DataError as e:
        raise UsageError(str(e)) from None


def check_launch_one(args) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UsageError(f"{args.chapter} trains in one process; launch it with "
                         f"`python {args.chapter}/train_llm.py` (several processes are chapter 03)")


def check_launch_many(args) -> None:
    if args.device not in ("auto", "cpu", "cuda"):
        raise UsageError(f"--device {args.device}: each process takes the GPU of its LOCAL_RANK; "
                         f"use auto, cuda or cpu (CUDA_VISIBLE_DEVICES chooses which GPUs)")
    check_backend_choice(cuda=torch.cuda.is_available() and args.device != "cpu")


def check_backend_choice(cuda: bool) -> None:
    """LLM_GUIDE_BACKEND (nccl, gloo or unset) against this machine's processes (torchrun's
    LOCAL_WORLD_SIZE) and GPUs. Raises UsageError."""
    error = gpu_sharing_error(os.environ.get(BACKEND_ENV, ""), cuda,
                              int(os.environ.get("LOCAL_WORLD_SIZE") or 1),
                              torch.cuda.device_count() if cuda else 0)
    if error:
        raise UsageError(error)


def check_run_folder(args, name_prefix: str, *, must_be_new: bool = True) -> None:
    """--experiment-name (default `<name_prefix>-<timestamp>`) and --save-dir: a safe
    folder name, a save dir that is a folder, and (unless resuming) no earlier results
    in <save-dir>/<experiment-name> to overwrite. Raises UsageError."""
    if args.experiment_name is None:
        args.experiment_name = default_run_name(name_prefix, Path(os.path.expanduser(args.save_dir)))
    if not re.fullmatch(r"[A-Za-z0-9._-]+", args.experiment_name) or args.experiment_name in (".", ".."):
        raise UsageError(f"--experiment-name {args.experiment_name!r} must use only letters, "
                         f"digits, '.', '_' and '-'")
    if len(args.experiment_name) > 200:  # a folder name, and file systems stop at 255 bytes
        raise UsageError(f"--experiment-name is {len(args.experiment_name)} characters long; "
                         f"200 at most")
    args.save_dir = os.path.expanduser(args.save_dir)  # '~/runs' quoted, as the shell would
    save_dir = Path(args.save_dir)
    if save_dir.exists() and not save_dir.is_dir():
        raise UsageError(f"--save-dir {str(save_dir)!r} exists and is not a folder")
    run_dir = save_dir / args.experiment_name
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"run folder {str(run_dir)!r} exists and is a file; choose another --experiment-name")
    check_writable_folder(save_dir, "--save-dir")  # a read-only or full place: now, not after the data
    if must_be_new and holds_results(run_dir):
        raise UsageError(f"run folder {str(run_dir)!r} already exists and is not empty; "
                         f"choose another --experiment-name or remove it")


def check_writable_folder(path: str | os.PathLike, flag: str) -> None:
    """An output folder that can be created and written: its nearest existing part must be
    a folder that takes a file (read-only or full file systems do not). Probes with a file
    it removes at once, so nothing is left behind. Raises UsageError."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: {str(existing)!r} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write-test-")
        try:  # a byte forced to disk: a full file system refuses it (an empty file it takes)
            os.write(fd, b"\0")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise UsageError(f"{flag} {str(path)!r}: cannot write in {str(existing)!r} "
                         f"({e.strerror or e})") from None


def default_run_name(prefix: str, save_dir: Path) -> str:
    """`<prefix>-<timestamp>` (-2, -3, ... after it when a run of the same second has that
    folder in `save_dir`); under torchrun `<prefix>-<job id>` instead, which every rank
    of every machine agrees on and which stays the same across restarts (--standalone
    makes a random id per job; --rdzv-id names it)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if job and job != "none":
        return f"{prefix}-{re.sub(r'[^A-Za-z0-9._-]+', '-', job)[:36].strip('-.') or 'job'}"
    return unused_name(save_dir, f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}")


def unused_name(folder: Path, stem: str) -> str:
    """`stem`, or `stem-2`, `stem-3`, ...: the first name `folder` does not hold yet."""
    name, n = stem, 1
    while (folder / name).exists():
        n += 1
        name = f"{stem}-{n}"
    return name


def check_device(device: str) -> None:
    if device == "auto":
        return
    try:
        d = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device} asked for, but CUDA is not available here")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
    elif d.type != "cpu":
        raise UsageError(f"--device {device!r} is not supported (auto, cpu, cuda, cuda:N)")


def setup_logging(rank: int = 0) -> logging.Logger:
    """Rank 0 logs at INFO; other ranks only warnings and errors, tagged with their rank."""
    prefix = "" if rank == 0 else f"[rank {rank}] "
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s {prefix}%(levelname)s %(message)s",
                        datefmt="%H:%M:%S", force=True, stream=sys.stdout)
    return logging.getLogger("train")


def cuda_device_ids(text: str) -> list[int]:
    """--device-ids 0,1,3: distinct indices of visible GPUs."""
    try:
        ids = [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated GPU indices (got {text!r})") from None
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("names GPUs, but CUDA is not available here")
    if len(set(ids)) != len(ids) or not all(0 <= i < torch.cuda.device_count() for i in ids):
        raise argparse.ArgumentTypeError(f"{text}: indices must be distinct and below "
                                         f"{torch.cuda.device_count()} (the visible GPUs)")
    return ids


def no_compile_under_data_parallel(args) -> None:
    """Chapter 02: --compile where DataParallel runs (2+ GPUs) is refused, not dropped in
    silence: DataParallel copies the module to its GPUs every step. Raises UsageError."""
    cuda = torch.cuda.is_available() and not args.device.startswith("cpu")
    gpus = len(args.device_ids or range(torch.cuda.device_count())) if cuda else 0
    if args.compile and gpus >= 2:
        raise UsageError(f"--compile does not apply under nn.DataParallel ({gpus} GPUs): drop it, or "
                         f"train on one GPU (--device-ids 0); chapter 03 compiles under DDP")


def checkpoint_folder(text: str) -> str:
    """--resume-from: a chapter 04 checkpoint folder (it holds manifest.json). Checked where
    and when it is read: by rank 0 (the other machines may not share its disk; rank 0's
    verdict reaches them), on a job's first attempt (a torchrun restart resumes from the
    latest checkpoint, and --keep-last may have pruned this one since)."""
    elsewhere = os.environ.get("RANK", "0") != "0" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if not elsewhere and not os.path.isfile(os.path.join(text, "manifest.json")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint folder (no manifest.json)")
    return text
