"""Chapter 04's lesson, part 1: what a checkpoint holds, and how it is saved and loaded.

- `TrainState`: the model, the optimizer, the schedule, the data position and every
  rank's random generators, as one object; `state_dict()` and `load_state_dict()` mirror
  each other, as they do on every torch module and optimizer.
- `ResumableSampler`: the DistributedSampler's order, started in the middle of an epoch.
- `rebuild_ddp_buckets`: DDP's gradient buckets, before a resumed run's first step, as an
  uninterrupted run has them by then (on 3 or more ranks, the order its sums add in).
- `save_checkpoint`: write into a temporary folder, rename it, then repoint `latest`
  (`point_latest_to`): a kill at any moment leaves the previous checkpoint intact.
- `load_latest`: rank 0 reads the newest checkpoint that verifies and loads it, then
  sends it to the other ranks tensor by tensor: no other machine needs the file.

Beside them, what a checkpoint is checked against: the settings that define a run
(`run_settings`, `settings_mismatch`) and the checksums of its files (`common.files`).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import random
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from common.distributed import on_rank0, patient_group, stop_on_any_error
from common.files import (folder_mb, fsync_dir, fsync_write, hashed_write, is_disk_full, one_line,
                          verify_manifest, write_manifest)

FORMAT_VERSION = 3  # of state.pt; part of the settings, so another format is refused by name
# The flags that change what a run trains, and so what its checkpoints can continue.
RUN_DEFINING_FLAGS = ("dataset_name", "dataset_subset", "text_column", "tokenizer", "vocab_size",
                      "padded", "model_preset", "seq_length", "lr", "weight_decay",
                      "warmup_steps", "num_epochs", "max_steps", "seed")


# ---- the state ----------------------------------------------------------------------------

class TrainState:
    """Everything the next step depends on. Weights alone are not enough: AdamW's moments
    and step count set the next update, the scheduler the learning rate, the epoch and
    the steps done in it the next batch, and the generators any random draw."""

    def __init__(self, model, optimizer, scheduler, device):
        self.model, self.optimizer, self.scheduler, self.device = model, optimizer, scheduler, device
        self.step = 0           # optimizer steps done
        self.epoch = 0          # the epoch they ended in: it fixes the shuffle
        self.step_in_epoch = 0  # steps of that epoch done: where its data continues
        self.saved_rng = None   # after a load: every rank's generators, as saved

    def state_dict(self) -> dict:
        """What `state.pt` holds. A collective: every rank's generators are gathered."""
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "rng": gather_rng_states(self.device)}

    def load_state_dict(self, state: dict, rank: int = 0):
        """The mirror of `state_dict()`: each rank takes its own generators (rank r the
        r-th; a run resumed on more ranks than saved it reuses them in turn)."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.step_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
        self.saved_rng = state["rng"]  # every rank's: rank 0 sends them on
        set_rng_states(self.saved_rng[rank % len(self.saved_rng)], self.device)

    def broadcast_from_rank0(self, rank: int):
        """Rank 0 has loaded a checkpoint: give every rank the same state. The small parts
        (position, schedule, generators, the optimizer's layout) go as one object; every
        tensor goes by itself, in place (DDP's constructor, by contrast, sends rank 0's
        weights coalesced into buckets of up to 250 MiB). No rank needs the file, and none
        holds more than one tensor in flight."""
        small = [None]
        if rank == 0:
            small = [{"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                      "scheduler": self.scheduler.state_dict(), "rng": self.saved_rng,
                      "optimizer": _layout(self.optimizer.state_dict())}]
        dist.broadcast_object_list(small, src=0)
        small = small[0]
        if rank != 0:
            self.step, self.epoch, self.step_in_epoch = small["step"], small["epoch"], small["step_in_epoch"]
            self.scheduler.load_state_dict(small["scheduler"])
            # empty tensors of the right shapes, filled by the broadcasts below
            self.optimizer.load_state_dict(_empty_like_layout(small["optimizer"]))
            set_rng_states(small["rng"][rank % len(small["rng"])], self.device)
        for tensor in self.tensors():
            broadcast_in_place(tensor, self.device)

    def tensors(self):
        """Model and optimizer tensors in one order that every rank agrees on."""
        yield from self.model.state_dict().values()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                for key in sorted(state):
                    if torch.is_tensor(state[key]):
                        yield state[key]


def _layout(tree):
    """`tree` with every tensor replaced by its (shape, dtype): what an empty copy needs."""
    if torch.is_tensor(tree):
        return ("tensor", tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {k: _layout(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_layout(v) for v in tree]
    return tree


def _empty_like_layout(tree):
    if isinstance(tree, tuple) and len(tree) == 3 and tree[0] == "tensor":
        return torch.empty(tree[1], dtype=tree[2])
    if isinstance(tree, dict):
        return {k: _empty_like_layout(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_empty_like_layout(v) for v in tree]
    return tree


def broadcast_in_place(tensor: torch.Tensor, device: torch.device):
    """dist.broadcast from rank 0 into `tensor`. nccl moves only CUDA tensors: a CPU tensor
    (an unfused AdamW keeps its step counts there; the fused one this guide uses on CUDA
    keeps them on the GPU) travels through a copy on this rank's `device`."""
    if tensor.device.type == "cpu" and dist.get_backend() == "nccl":
        on_device = tensor.to(device)
        dist.broadcast(on_device, src=0)
        tensor.copy_(on_device)
    else:
        dist.broadcast(tensor, src=0)


def gather_rng_states(device) -> list[dict]:
    """Every rank's generators (Python, torch CPU, CUDA), gathered into a list indexed by
    rank, the same on every rank (a collective). Here every rank's are equal (one seed,
    nothing drawn after initialisation), but a checkpoint must not rely on that staying true."""
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


def checkpoint_folder(text: str) -> str:
    """--resume-from: a checkpoint folder, checked where it is read (rank 0, first attempt)."""
    elsewhere = os.environ.get("RANK", "0") != "0" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if not elsewhere and not os.path.isfile(os.path.join(text, "manifest.json")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint folder (no manifest.json)")
    return text


class ResumableSampler(Sampler):
    """Wraps a sampler (DistributedSampler): the same order, starting `start` samples in,
    so a resumed run skips what it already trained on without loading it."""

    def __init__(self, sampler):
        self.sampler, self.start = sampler, 0

    def set_epoch(self, epoch: int, start: int = 0):
        self.sampler.set_epoch(epoch)  # the shuffle of this epoch: seed + epoch
        self.start = start

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self):
        return len(self.sampler) - self.start


def rebuild_ddp_buckets(model, batch_shape: tuple[int, int], device, autocast):
    """Before a resumed run's first step: one backward of a zero loss through the DDP
    model, so that DDP sums each gradient in the order an uninterrupted run does by then.

    DDP first puts the gradients into buckets in the reverse order of the parameters; after
    its first backward it rebuilds them, once, in the order the gradients became ready.
    An all-reduce over 3 or more ranks adds each element in an order that depends on where
    the element sits in its bucket, so without this a resumed run's first step would round
    differently from the same step of the uninterrupted run. Every gradient of the zero
    loss is zero and is dropped: the weights, optimizer, data and random generators are
    left as they were."""
    x = torch.zeros(batch_shape, dtype=torch.long, device=device)
    with autocast:
        loss = model(x, None).float().sum() * 0
    loss.backward()
    model.zero_grad(set_to_none=True)


# ---- saving: write aside, rename, repoint ----------------------------------------------------

def save_checkpoint(ckpt_dir: Path, train_state: TrainState, settings: dict, *, keep_last: int,
                    rank: int) -> tuple[Path, float]:
    """Write the state into .tmp-step-N, rename that to step-N, then repoint `latest`: the
    commit. A kill at any moment leaves the previous checkpoint and pointer untouched.
    Every rank calls it (the generators are gathered). Returns (folder, seconds)."""
    t0 = time.perf_counter()
    state = train_state.state_dict()  # DDP replicas are identical: rank 0's is everyone's
    name = f"step-{train_state.step:08d}"
    tmp, final = ckpt_dir / f".tmp-{name}", ckpt_dir / name

    def commit():  # on rank 0, while the others wait
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier kill
        tmp.mkdir(parents=True)
        # on disk, not in a cache; its checksum taken from the bytes on their way out
        digest = hashed_write(tmp / "state.pt", lambda f: torch.save(state, f))
        write_manifest(tmp, {"settings": settings}, {"state.pt": digest})  # written last
        shutil.rmtree(final, ignore_errors=True)  # the same step, saved before a crash
        os.rename(tmp, final)  # atomic: the folder is there whole, or not at all
        point_latest_to(final)  # the commit point
        prune_checkpoints(ckpt_dir, final, keep_last)

    def explain(e) -> str | None:  # a failed commit: every rank stops with this line
        written = folder_mb(tmp) if tmp.exists() else 0.0
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a full disk fuller
        if is_disk_full(e, ckpt_dir):
            return disk_full(ckpt_dir, written)
        return f"writing {getattr(e, 'filename', None) or ckpt_dir} failed: {one_line(e)}" \
            if isinstance(e, OSError) else None
    on_rank0(commit, rank, explain)
    return final, time.perf_counter() - t0


def disk_full(ckpt_dir: Path, written_mb: float) -> str:
    """The line for a checkpoint that did not fit: what one needs (the size of a checkpoint
    already there, else more than the failed save wrote) and what is free."""
    saved = [folder_mb(p) for p in Path(ckpt_dir).glob("step-*") if p.is_dir()]
    needed = f"about {max(saved):,.0f} MB" if saved else f"more than {written_mb:,.0f} MB"
    return (f"disk full while saving into {ckpt_dir}: a checkpoint needs {needed} and "
            f"{shutil.disk_usage(ckpt_dir).free / 2**20:,.0f} MB are free; free some space (step-* "
            f"folders older than the one `latest` names may go: --keep-last prunes only after a "
            f"save succeeds), then run the same command to resume")


def prune_checkpoints(ckpt_dir: Path, newest: Path, keep_last: int):
    """Keep the `keep_last` newest checkpoints up to `newest`. Those beyond it were left by
    a rollback (--resume-from) or never committed: moved into `abandoned/`, not deleted."""
    folders = sorted(p for p in Path(ckpt_dir).glob("step-*") if p.is_dir())
    for old in [p for p in folders if p.name <= newest.name][:-keep_last]:
        shutil.rmtree(old)
    for future in [p for p in folders if p.name > newest.name]:
        (ckpt_dir / "abandoned").mkdir(exist_ok=True)
        shutil.rmtree(ckpt_dir / "abandoned" / future.name, ignore_errors=True)
        os.rename(future, ckpt_dir / "abandoned" / future.name)


def roll_back_to(path: Path):
    """--resume-from an older checkpoint of this run: it becomes `latest`, and the newer
    ones move to `abandoned/`, out of the resume path (a later rerun continues from here)."""
    prune_checkpoints(path.parent, path, keep_last=len(list(path.parent.glob("step-*"))))
    point_latest_to(path)


def point_latest_to(path: Path):
    """Make `latest` (beside checkpoint `path`) name it: write the new pointer beside the
    old, force it to disk, rename it over the old one (atomic), and force the folder to
    disk so that both renames survive a power cut."""
    ckpt_dir = Path(path).parent
    fsync_write(ckpt_dir / "latest.tmp", lambda f: f.write(Path(path).name.encode()))
    os.replace(ckpt_dir / "latest.tmp", ckpt_dir / "latest")
    fsync_dir(ckpt_dir)


# ---- loading: rank 0 reads, everyone receives -----------------------------------------------

def checkpoint_candidates(ckpt_dir: Path, log) -> list[Path]:
    """The checkpoints to try, newest first: the one `latest` names, then older ones.
    Folders beyond `latest` (and .tmp-*) were never committed. Without a `latest` (deleted
    by hand, or lost), every complete folder is a candidate, and the log says so."""
    folders = sorted((p for p in Path(ckpt_dir).glob("step-*") if p.is_dir()), reverse=True)
    latest = Path(ckpt_dir) / "latest"
    if latest.is_file():
        name = latest.read_text(errors="replace").strip()
        if re.fullmatch(r"step-\d{8}", name):
            return [p for p in folders if p.name <= name]
        # emptied or overwritten by hand: it names nothing, which must not read as
        # "nothing was committed" (a fresh start would then replace the checkpoints)
        if folders:
            log.warning("%s/latest names no checkpoint (%r): trying the newest that verifies",
                        ckpt_dir, name[:40])
        return folders
    if folders:
        log.warning("%s has checkpoints but no `latest` pointer: trying the newest that verifies",
                    ckpt_dir)
    return folders


def load_latest(candidates: list[Path], train_state: TrainState, settings: dict, *, rank: int, log,
                roll_back: bool = False, pointer: Path | None = None) -> Path | None:
    """Load the first of `candidates` (rank 0's list: its disk holds them) that verifies
    and loads, on rank 0; then every rank receives it. Returns its path, or None if there
    were none. Per candidate, rank 0 checks every file against the manifest and the saved
    settings against `settings` (a mismatch stops the run: it is another run's checkpoint),
    then loads it with `weights_only=True`: tensors and plain containers, never code. A
    candidate that fails leaves model and optimizer as they were; the next one is tried.
    `roll_back` (--resume-from): the chosen checkpoint becomes its folder's `latest`.
    `pointer`: the `latest` this run will write; a folder there (made by hand) stops the
    run now, not at its first save, and is left as it is."""
    path, error, refusal = None, None, None
    # Rank 0 reads the whole checkpoint twice (checksums, then the load) while the others
    # wait: disk time that grows with the model, so they wait on a group that --timeout
    # (meant for collectives) does not cut short. A collective: every rank creates it
    # (None without a process group).
    waiting = patient_group()
    if rank == 0 and pointer and pointer.is_dir() and not pointer.is_symlink():
        refusal = (f"{pointer} is a folder, where the file naming the last checkpoint belongs: nothing "
                   f"was changed; move that folder out of {pointer.parent}, then run the same command")
    elif rank == 0:
        for candidate in candidates:
            try:
                refusal = settings_mismatch(verify_manifest(candidate)["settings"], settings, candidate)
                if refusal:
                    break
                # mmap: tensors are read from the file as they are copied, not all at once
                state = torch.load(candidate / "state.pt", map_location="cpu", weights_only=True, mmap=True)
                with unchanged_on_error(train_state.model, train_state.optimizer):
                    train_state.load_state_dict(state, rank)
                path = candidate
                break
            except Exception as e:  # truncated, corrupted, another format, a crafted pickle
                error = one_line(e)
                log.warning("checkpoint %s cannot be used (%s); trying the one before", candidate, error)
    # every rank learns what rank 0 found (only rank 0 knows whether it had candidates, and
    # only its disk says where a link leads), and stops with it or receives the state
    found = [str(path) if path else None, refusal, error,
             str(Path(candidates[0]).parent) if candidates else None, roll_back]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0, group=waiting)
    path, refusal, error, tried, roll_back = Path(found[0]) if found[0] else None, *found[1:]
    if tried and path is None and not refusal:
        refusal = (f"no checkpoint in {tried} could be loaded (the last: {error}); nothing was "
                   f"changed: move the broken ones away, or start over with --fresh")
    stop_on_any_error(refusal if rank == 0 else None)  # every rank stops with rank 0's line
    if path and dist.is_initialized():
        train_state.broadcast_from_rank0(rank)
    if path and roll_back:
        on_rank0(lambda: roll_back_to(path), rank, lambda e: f"rolling back to {path} failed: {one_line(e)}")
    return path


# ---- what a checkpoint continues -------------------------------------------------------------

def run_settings(args, dtype: str, global_batch: int, data_fingerprint: str) -> dict:
    """What a checkpoint records and a resume compares: the flags that change what is
    trained, the dtype the math runs in (--dtype resolved: `auto` is fp32 on a CPU), the
    global batch, the corpus and tokenizer, and the checkpoint format."""
    return {**{k: getattr(args, k) for k in RUN_DEFINING_FLAGS}, "dtype": dtype, "global batch": global_batch,
            "data fingerprint": data_fingerprint, "format version": FORMAT_VERSION}


def settings_mismatch(saved: dict, now: dict, path) -> str | None:
    """None if checkpoint `path`, saved with `saved` settings, continues this run; else the
    line that refuses it, naming each difference. A setting the checkpoint does not record
    was recorded only later (the dtype): not compared."""
    def name(k):
        return k if " " in k else f"--{k.replace('_', '-')}"
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
