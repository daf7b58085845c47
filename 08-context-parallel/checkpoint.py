"""Chapter 04's checkpoint, sharded and free of the layout: every rank writes its own
pieces (torch.distributed.checkpoint, DCP), and any layout can load them.

- `TrainState`: model, optimizer, schedule and data position as one object, as in
  chapter 04. Its state dict is this rank's view: each weight and AdamW moment a
  DTensor named as in chapter 01's model, which knows where its piece sits in the whole
  tensor (`get_state_dict`; the optimizer's state flattened to one entry per parameter
  name, so that stages cut differently still find their own).
- `save_checkpoint`: every rank writes its pieces into `.tmp-step-N` (DCP: a file per
  rank, plus `.metadata`: each tensor's pieces, their offsets and where they lie), each
  rank checksums its file, then rank 0 commits as chapter 04 does: manifest, rename,
  `latest`. A kill at any moment leaves the previous checkpoint intact.
- `load_checkpoint`: each rank checks its share of the files against the manifest and
  the settings against this run's; then every rank asks DCP for the pieces it holds in
  *this* layout. DCP reads, for each of them, the saved pieces that overlap it: the
  checkpoint of a dp 2 x tp 2 run loads into tp 2 x pp 2, into dp 4, or onto 2 ranks.
- The data position is the global batch's: the samples of this epoch already trained
  on, counted over all replicas. Each replica of the new layout skips its share of
  them (`ResumableSampler`): dp replicas that each take every dp-th sample of one
  shuffle read, step for step, the same global batches whatever dp is.

DCP's `.metadata` is a pickle that `dcp.load` unpickles: load only checkpoints you trust
(the manifest's checksums catch damage, not a forger). Every rank reads and writes the
same folder: on several machines it must be on a shared file system.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.utils.data import Sampler

from common.distributed import first_error, on_rank0
from common.errors import fail
from common.files import fsync_dir, fsync_write, is_disk_full, one_line, sha256_of, verify_manifest, write_manifest

FORMAT_VERSION = 1  # of this checkpoint; part of the settings, so another format is refused by name
# The flags that change what a run trains, and so what its checkpoints can continue. Not
# the layout: --tp, --pp, the world size may change between a save and a resume.
RUN_DEFINING_FLAGS = ("dataset_name", "dataset_subset", "text_column", "tokenizer", "vocab_size",
                      "padded", "model_preset", "seq_length", "lr", "weight_decay",
                      "warmup_steps", "num_epochs", "max_steps", "seed")
# One optimizer entry per parameter name ("state.layers.0.mlp.up_proj.weight.exp_avg"),
# not torch.optim's numbered lists: a stage of another layout finds its parameters by name.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainState:
    """Everything the next step depends on (chapter 04's), for this rank's part of the
    model (`part`: its stages, named as chapter 01's model). The generators are not in
    it: nothing random is drawn while training (no dropout; the sample has its own)."""

    def __init__(self, part, optimizer, scheduler):
        self.part, self.optimizer, self.scheduler = part, optimizer, scheduler
        self.step = 0              # optimizer steps done
        self.epoch = 0             # the epoch they ended in: it fixes the shuffle
        self.samples_in_epoch = 0  # samples of that epoch trained on, over all replicas

    def state_dict(self) -> dict:
        """This rank's pieces, and the small parts every rank holds alike."""
        model, optim = get_state_dict(self.part, self.optimizer, options=OPTIONS)
        return {"model": model, "optim": optim, "scheduler": self.scheduler.state_dict(),
                "position": {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch}}

    def load_state_dict(self, state: dict):
        set_state_dict(self.part, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=OPTIONS)
        self.scheduler.load_state_dict(state["scheduler"])
        position = state["position"]
        self.step, self.epoch, self.samples_in_epoch = position["step"], position["epoch"], position["samples_in_epoch"]


class ResumableSampler(Sampler):
    """Chapter 04's: wraps a DistributedSampler, the same order, starting `start`
    samples into this replica's share, so a resumed run skips what it trained on."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def set_epoch(self, epoch: int, start: int = 0):
        self.sampler.set_epoch(epoch)  # the shuffle of this epoch: seed + epoch
        self.start = start

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self):
        return len(self.sampler) - self.start


def replica_start(samples_in_epoch: int, dp: int) -> int:
    """Where each of dp replicas resumes in its share of the epoch. Replica r reads
    samples r, r + dp, r + 2 dp, ... of the shuffle: after the first n samples of the
    shuffle, each replica has read n / dp of its own (n is whole global batches)."""
    return samples_in_epoch // dp


# ---- saving: write aside, rename, repoint ----------------------------------------------------

def save_checkpoint(ckpt_dir: Path, train_state: TrainState, settings: dict, layout: str, *, keep_last: int,
                    rank: int, world: int, extras: dict[str, bytes] | None = None) -> tuple[Path, float]:
    """Every rank writes its pieces of the state into .tmp-step-N, checksums its file,
    then rank 0 commits: `extras` (file name -> bytes: the model's shape and the
    tokenizer, which tools/export.py reads), the manifest, rename to step-N, repoint
    `latest`. Every rank calls it. Returns (folder, seconds)."""
    t0 = time.perf_counter()
    name = f"step-{train_state.step:08d}"
    tmp, final = ckpt_dir / f".tmp-{name}", ckpt_dir / name
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier kill
            tmp.mkdir(parents=True)
        except OSError as e:
            error = write_failure(e, ckpt_dir)
    error = first_error(error)  # and the folder exists before anyone writes into it
    if error is None:
        try:
            # each rank writes __<rank>_0.distcp with its pieces, all at once; rank 0 then
            # writes .metadata. A piece several ranks hold alike is written once.
            dcp.save(train_state.state_dict(), checkpoint_id=tmp)
        except CheckpointException as e:  # raised on every rank when any rank's write failed
            error = write_failure(e, ckpt_dir)
    if error:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave a full disk fuller
        fail(f"{error}; nothing was saved: free some space (or fix the folder), then run again", status=1)
    # each rank checksums what it wrote (1/world of the bytes each, all at once)
    digests = [None] * world
    dist.all_gather_object(digests, {p.name: sha256_of(p) for p in tmp.glob(f"__{rank}_*.distcp")})

    def commit():  # rank 0, once every rank has written (dcp.save ends with a collective)
        for mine in digests:
            for file in mine:
                if not (tmp / file).is_file():
                    raise OSError(f"{file} is not in {tmp}: do all ranks see the same folder (a shared file system)?")
        for file, content in (extras or {}).items():
            fsync_write(tmp / file, lambda f, c=content: f.write(c))
        write_manifest(tmp, {"settings": settings, "step": train_state.step, "layout": layout, "world_size": world},
                       {file: digest for mine in digests for file, digest in mine.items()})
        shutil.rmtree(final, ignore_errors=True)  # the same step, saved before a crash
        os.rename(tmp, final)  # atomic: the folder is there whole, or not at all
        point_latest_to(final)  # the commit point
        prune_checkpoints(ckpt_dir, final, keep_last)

    def explain(e):  # a failed commit: no half folder left, every rank stops with the line
        shutil.rmtree(tmp, ignore_errors=True)
        return write_failure(e, ckpt_dir) if isinstance(e, OSError) or is_disk_full(e, ckpt_dir) else None
    on_rank0(commit, rank, explain)
    return final, time.perf_counter() - t0


def write_failure(e: BaseException, where: Path) -> str:
    """A failed save as one line; a full disk named as such."""
    inner = e
    if isinstance(e, CheckpointException):
        failures = getattr(e, "failures", None) or {}
        inner = next((f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())), e)
    if is_disk_full(inner, where):
        return f"disk full while saving into {where} ({shutil.disk_usage(where).free / 2**20:,.1f} MB free)"
    return f"the sharded save into {where} failed: {one_line(inner) if isinstance(inner, BaseException) else inner}"


def point_latest_to(path: Path):
    """Chapter 04's: write the new pointer beside the old, force it to disk, rename it over
    the old one (atomic), force the folder to disk."""
    ckpt_dir = Path(path).parent
    fsync_write(ckpt_dir / "latest.tmp", lambda f: f.write(Path(path).name.encode()))
    os.replace(ckpt_dir / "latest.tmp", ckpt_dir / "latest")
    fsync_dir(ckpt_dir)


def prune_checkpoints(ckpt_dir: Path, newest: Path, keep_last: int):
    """Keep the `keep_last` newest checkpoints up to `newest`."""
    folders = sorted(p for p in Path(ckpt_dir).glob("step-*") if p.is_dir() and p.name <= newest.name)
    for old in folders[:-keep_last]:
        shutil.rmtree(old)


# ---- loading: every rank reads its own pieces ---------------------------------------------

def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint `latest` names; without a `latest` (deleted by hand), the newest
    step-N folder; None if there is none. A `latest` that names no folder is refused
    (the checkpoint it named is gone: a fresh start would train over it)."""
    latest = Path(ckpt_dir) / "latest"
    if latest.is_file():
        name = latest.read_text(errors="replace").strip()
        if not re.fullmatch(r"step-\d{8}", name) or not (Path(ckpt_dir) / name).is_dir():
            fail(f"{latest} names {name[:40]!r}, which is not a checkpoint here; nothing was loaded: "
                 f"remove {latest} to resume from the newest step-N folder, or start over with --fresh")
        return Path(ckpt_dir) / name
    folders = sorted(p for p in Path(ckpt_dir).glob("step-*") if p.is_dir())
    return folders[-1] if folders else None


def load_checkpoint(path: Path, train_state: TrainState, settings: dict, *, rank: int, world: int) -> dict:
    """Load checkpoint `path` into this rank's part of the model, in this layout. Every
    rank calls it. Damage (a file missing, truncated or changed), a checkpoint never
    committed, or another run's settings stop every rank with one line, before anything
    is loaded. Returns the manifest's metadata (the step, the layout that saved it)."""
    error, meta = None, None
    try:
        meta = verify_manifest(path, names=())  # its metadata; the files are checked below
        names = sorted(meta["sha256"])
        verify_manifest(path, names[rank::world])  # this rank's share of the files, all ranks at once
        error = settings_mismatch(meta["settings"], settings, path)
    except (ValueError, KeyError, TypeError) as e:
        error = f"checkpoint {path} is damaged ({e}); nothing was loaded: move it away to resume " \
                f"from the one before, or start over with --fresh"
    error = first_error(error)
    if error:
        fail(error)
    state = train_state.state_dict()  # the pieces this layout holds, to be filled in place
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as e:  # a BaseException: `except Exception` would miss it
        error = f"checkpoint {path} cannot be loaded ({write_failure(e, path).split(': ', 1)[-1]})"
    error = first_error(error)
    if error:
        fail(error)
    train_state.load_state_dict(state)
    return meta


def run_settings(args, dtype: str, global_batch: int, data_fingerprint: str) -> dict:
    """What a checkpoint records and a resume compares (chapter 04's): the flags that
    change what is trained, the dtype, the global batch (not how it is cut), the corpus
    and tokenizer, and the checkpoint format."""
    return {**{k: getattr(args, k) for k in RUN_DEFINING_FLAGS}, "dtype": dtype, "global batch": global_batch,
            "data fingerprint": data_fingerprint, "format version": FORMAT_VERSION}


def settings_mismatch(saved: dict, now: dict, path) -> str | None:
    """None if checkpoint `path`, saved with `saved` settings, continues this run; else the
    line that refuses it, naming each difference."""
    def name(k):
        return k if " " in k else f"--{k.replace('_', '-')}"
    changed = [f"{name(k)} {saved[k]} -> {v}" for k, v in now.items() if saved.get(k) != v]
    if not changed:
        return None
    hint = ("; another layout keeps the global batch with --batch-size = global batch / (dp x --grad-accum)"
            if saved.get("global batch") != now["global batch"] else "")
    return (f"checkpoint {path} belongs to a run with other settings ({', '.join(changed)}){hint}; "
            f"use the same flags and data, --fresh, or another --experiment-name")
