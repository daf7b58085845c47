"""Chapter 04's plumbing around its checkpoints: what a reader may skip.

- `ResumableSampler`: a sampler's order, starting a given number of samples in.
- `all_rng_states` / `set_rng_states`: every random generator each rank could draw from.
- `checkpoint_candidates`: the committed checkpoints, newest first.
- `commit_on_rank0`: run the commit on rank 0 while the others wait; a failure (a full
  disk) stops every rank with one line, and leaves no half-written folder behind.
- `load_newest`: try checkpoints newest first until one loads on every rank; rank 0
  decides the list, checks checksums and settings, and sends what it read to the others.
- `point_latest_to`: the atomic commit of a checkpoint (the `latest` pointer).
- `prune_checkpoints`: keep the newest few; move abandoned ones out of the resume path.
- `run_settings` / `settings_changes`: what defines a run, and what differs.
"""

from __future__ import annotations

import copy
import itertools
import os
import random
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.utils.data import Sampler

from .distributed import first_error
from .errors import fail
from .durable import (dir_size_mb, disk_full_message, fsync_dir, fsync_write, is_disk_full, one_line,
                      verify_manifest)


class ResumableSampler(Sampler):
    """Wraps a sampler (DistributedSampler): the same order, starting `start` samples
    in, so a resumed run skips what it already trained on without loading it."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def set_epoch(self, epoch: int, start: int = 0):
        self.sampler.set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self):
        return len(self.sampler) - self.start


def all_rng_states(device) -> list[dict]:
    """Every rank's generators (Python, torch CPU, CUDA), gathered: a list indexed by rank,
    the same on every rank (a collective)."""
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    if not dist.is_initialized():
        return [states]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, states)
    return gathered


def set_rng_states(states: dict, device):
    random.setstate(states["python"])
    torch.set_rng_state(states["torch"].cpu())
    if torch.device(device).type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)


def checkpoint_candidates(ckpt_dir: Path) -> list[Path]:
    """Committed checkpoints, newest first: the one `latest` names, then older ones to
    fall back on. Folders beyond `latest` (and .tmp-*) were never committed."""
    latest = Path(ckpt_dir) / "latest"
    name = latest.read_text().strip() if latest.is_file() else ""
    return [p for p in sorted(Path(ckpt_dir).glob("step-*"), reverse=True) if p.name <= name]


def commit_on_rank0(commit, rank: int, tmp: Path | None = None):
    """`commit()` on rank 0; every rank returns once it is done (a collective). If it
    fails, the half-written `tmp` folder is removed and every rank stops with one line."""
    error = None
    if rank == 0:
        try:
            commit()
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as RuntimeError
            size = dir_size_mb(tmp) if tmp and tmp.exists() else 0
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)  # never leave a full disk fuller
            where = tmp.parent if tmp else Path(getattr(e, "filename", None) or ".").parent
            if is_disk_full(e, where):
                error = disk_full_message(where, size)
            elif isinstance(e, OSError):
                error = f"writing {e.filename or where} failed: {e.strerror or e}"
            else:
                raise
    error = first_error(error)
    if error:
        fail(error)


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


def run_settings(args, global_batch: int, data_fingerprint: str, format_version: int) -> dict:
    """What a checkpoint records and a resume compares (see `settings_changes`): the flags,
    the global batch, the corpus and tokenizer, and the checkpoint format."""
    return {**{k: getattr(args, k) for k in RUN_DEFINING_FLAGS}, "global batch": global_batch,
            "data fingerprint": data_fingerprint, "format version": format_version}


def sharded_folder(path: Path) -> Path:
    """`path`/sharded, the parts DCP reads; every rank must see it (the plain format needs
    no shared disk, this one does). A collective: every rank calls it."""
    folder = Path(path) / "sharded"
    error = None if (folder / ".metadata").is_file() else (
        f"rank {dist.get_rank() if dist.is_initialized() else 0} cannot see {folder}: sharded "
        f"checkpoints need a --save-dir on storage every machine shares")
    error = first_error(error)  # all ranks go on to dcp.load's collectives, or none does
    if error:
        raise FileNotFoundError(error)
    return folder


def point_latest_to(path: Path):
    """Point `latest` (beside checkpoint `path`) at it: written beside, fsynced, renamed
    over the old pointer (atomic), and the folder fsynced so the renames last."""
    ckpt_dir = Path(path).parent
    fsync_write(ckpt_dir / "latest.tmp", lambda f: f.write(Path(path).name.encode()))
    os.replace(ckpt_dir / "latest.tmp", ckpt_dir / "latest")
    fsync_dir(ckpt_dir)


def roll_back_to(path: Path):
    """Make checkpoint `path` the latest of its folder: newer ones go to `abandoned/`."""
    prune_checkpoints(path.parent, path, keep_last=len(list(path.parent.glob("step-*"))))
    point_latest_to(path)


def settings_changes(saved: dict, now: dict) -> list[str]:
    """What differs between a checkpoint's settings and this run's, one phrase each."""
    def name(k):
        return k if " " in k else f"--{k.replace('_', '-')}"
    return [f"{name(k)} {saved.get(k)} -> {v}" for k, v in now.items() if saved.get(k) != v]


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


def load_newest(candidates, read, load, model, optimizer, *, rank: int, settings: dict, log,
                rollback_in: Path | None = None):
    """The first of `candidates` (rank 0's list, newest first) that loads on every rank:
    (state, path), or (None, None) if there are none. Per candidate, rank 0 checks every
    file against the manifest's checksums and the saved settings against `settings` (a
    mismatch stops the run: it is another run's checkpoint), then `read(path)`s the state;
    every rank receives it and calls `load(state, path, model, optimizer)`. If any rank
    fails, every rank puts model and optimizer back and tries the next. If none loads, the
    run stops with one line, before anything on disk changed. `rollback_in` (--resume-from
    gave the checkpoint): if the checkpoint lies in that folder, it becomes its `latest`
    and the newer ones move out of the resume path."""
    box = [candidates]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)  # rank 0 decides: its disk holds them
    candidates = box[0]
    for path in candidates:
        changed, error, state = [], None, None
        if rank == 0:
            try:
                changed = settings_changes(verify_manifest(path)["settings"], settings)
                state = None if changed else read(path)
            except Exception as e:  # truncated, corrupt, another format
                error = one_line(e)
        box = [changed, error, state]
        if dist.is_initialized():
            dist.broadcast_object_list(box, src=0)
        changed, error, state = box
        if changed:
            fail(f"checkpoint {path} belongs to a run with other settings ({', '.join(changed)}); "
                 f"use the same flags and data, --fresh, or another --experiment-name")
        try:
            with unchanged_on_error(model, optimizer):
                try:
                    if error is None:
                        load(state, path, model, optimizer)
                except (Exception, CheckpointException) as e:  # DCP's is a BaseException
                    error = one_line(e)
                error = first_error(error)  # every rank loads it, or none does
                if error:
                    raise ValueError(error)
        except ValueError:
            log.warning("checkpoint %s cannot be used (%s); trying the one before", path, error)
            continue
        if rollback_in and Path(path).resolve().parent == Path(rollback_in).resolve():
            commit_on_rank0(lambda: roll_back_to(Path(path)), rank)
        return state, path
    if candidates:
        fail(f"no checkpoint in {Path(candidates[0]).parent} could be loaded (the last: {error}); "
             f"nothing was changed: move the broken ones away, or start over with --fresh")
    return None, None
