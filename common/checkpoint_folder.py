"""Housekeeping around chapter 04's checkpoints: what a reader may skip.

- `commit_on_rank0`: run the commit on rank 0 while the others wait; a failure (a full
  disk) stops every rank with one line, and leaves no half-written folder behind.
- `prune_checkpoints`: keep the newest few; move abandoned ones out of the resume path.
- `run_settings` / `settings_mismatch`: what defines a run, and the line that refuses a
  checkpoint of another run.
- `unchanged_on_error`: a failed load leaves model and optimizer as they were.
"""

from __future__ import annotations

import copy
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from .errors import fail
from .distributed import first_error
from .durable import dir_size_mb, disk_full_message, is_disk_full


def commit_on_rank0(commit, rank: int, tmp: Path | None = None, *, where: Path | None = None,
                    disk_full=disk_full_message, status: int = 2):
    """`commit()` on rank 0; every rank returns once it is done (a collective). If it
    fails, the half-written `tmp` folder is removed and every rank stops with one line
    (exit `status`): `disk_full(folder, MB written)` for a full disk in `where` (default:
    tmp's folder), else the error's own."""
    error = None
    if rank == 0:
        try:
            commit()
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError
            size = dir_size_mb(tmp) if tmp and tmp.exists() else 0
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)  # never leave a full disk fuller
            where = where or (tmp.parent if tmp else Path(getattr(e, "filename", None) or ".").parent)
            if is_disk_full(e, where):
                error = disk_full(where, size)
            elif isinstance(e, OSError):
                error = f"writing {e.filename or where} failed: {e.strerror or e}"
            else:
                raise
    error = first_error(error)
    if error:
        fail(error, status=status)


def prune_checkpoints(ckpt_dir: Path, newest: Path, keep_last: int):
    """Keep the `keep_last` newest checkpoints up to `newest`. Those beyond it were left
    by a rollback (--resume-from) or never committed: they move into `abandoned/`, out
    of the resume path, not deleted."""
    folders = sorted(p for p in Path(ckpt_dir).glob("step-*") if p.is_dir())
    for old in [p for p in folders if p.name <= newest.name][:-keep_last]:
        shutil.rmtree(old)
    for future in [p for p in folders if p.name > newest.name]:
        (ckpt_dir / "abandoned").mkdir(exist_ok=True)
        shutil.rmtree(ckpt_dir / "abandoned" / future.name, ignore_errors=True)
        os.rename(future, ckpt_dir / "abandoned" / future.name)


# The flags that change what a run trains (and so what its checkpoints can continue).
RUN_DEFINING_FLAGS = ("dataset_name", "dataset_subset", "text_column", "tokenizer", "vocab_size",
                      "padded", "model_preset", "seq_length", "lr", "weight_decay",
                      "warmup_steps", "num_epochs", "max_steps", "seed")


def run_settings(args, dtype: str, global_batch: int, data_fingerprint: str, format_version: int) -> dict:
    """What a checkpoint records and a resume compares (see `settings_mismatch`): the
    flags, the dtype the math runs in (--dtype resolved: `auto` is fp32 on a CPU), the
    global batch, the corpus and tokenizer, and the checkpoint format."""
    return {**{k: getattr(args, k) for k in RUN_DEFINING_FLAGS}, "dtype": dtype, "global batch": global_batch,
            "data fingerprint": data_fingerprint, "format version": format_version}


def settings_mismatch(saved: dict, now: dict, path) -> str | None:
    """None if checkpoint `path`, saved with `saved` settings, continues this run; else
    the line that refuses it, naming each difference."""
    def name(k):
        return k if " " in k else f"--{k.replace('_', '-')}"
    # a setting the checkpoint does not record was recorded only later (dtype): not compared
    changed = [f"{name(k)} {saved[k]} -> {v}" for k, v in now.items() if k in saved and saved[k] != v]
    return changed and (f"checkpoint {path} belongs to a run with other settings ({', '.join(changed)}); "
                        f"use the same flags and data, --fresh, or another --experiment-name") or None


@contextmanager
def unchanged_on_error(model, optimizer):
    """If the block raises, model and optimizer go back to what they were before it."""
    model_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    optimizer_state = copy.deepcopy(optimizer.state_dict())
    try:
        yield
    except BaseException:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)  # replaces the whole state
        raise
