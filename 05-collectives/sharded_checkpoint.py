"""Chapter 05, part 5: a sharded checkpoint (torch.distributed.checkpoint, DCP): save a
training state that no rank holds whole, and load it back on a different number of ranks.

With FSDP2 (`fully_shard`) each rank holds 1/W of every parameter and of AdamW's two
moments. To save them, no rank gathers anything: `get_state_dict` hands each rank its
shards (DTensors, which know where they sit in the global tensor), and `dcp.save` has
every rank write its own file, in parallel, plus one `.metadata` file that maps each
tensor's pieces (global offsets and sizes) to the files and byte ranges holding them.
Loading on W' ranks (resharding): each new rank asks for its own new shards, and DCP
reads the saved pieces that overlap them (each piece's byte range of its file) and
copies the overlapping rows in.

Steps: train --steps steps on the torchrun world (FSDP2 on each decoder layer, then the
root; AdamW), save model and optimizer with DCP into <save-dir>/<experiment-name>/step-N,
committed as chapter 04 commits (a temporary folder, a manifest of checksums, a rename,
then the `latest` pointer; each rank checksums its own file), and print how many bytes
each rank wrote. --load a checkpoint
(a run folder, which names its newest in `latest`, or one step-N folder) first: on any
number of ranks, check that every parameter and moment equals what was saved, then train
on and save again. The proof compares with a full copy of the state that the saving run
gathered onto rank 0 beside the checkpoint (`reference-step-N.pt`: for the proof only;
it is exactly what a sharded checkpoint avoids). Any difference: exit status 1.

    torchrun --standalone --nproc-per-node=2 05-collectives/sharded_checkpoint.py --experiment-name dcp-demo
    torchrun --standalone --nproc-per-node=3 05-collectives/sharded_checkpoint.py --load outputs/dcp-demo

Caveats:
- Every rank writes into and reads from the same folder: on several machines it must be
  on a shared file system (NFS, Lustre, a mounted bucket), or the ranks' files end up on
  different disks. The commit checks that every rank's file arrived.
- DCP's `.metadata` is a pickle that `dcp.load` unpickles without `weights_only`: loading
  runs whatever code a crafted file holds. Load only checkpoints you trust. (The
  manifest's checksums catch damage, not a forger who rewrites the manifest too.)
- DCP reports a missing or broken file as `CheckpointException`, a BaseException: an
  `except Exception` does not catch it. This script catches it by name.
"""

import gc
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from common.cli import positive_int
from common.data import IGNORE_INDEX
from common.demos import fixed_batches, script_parser, start_group
from common.distributed import first_error, gc_and_destroy_process_group, on_rank0
from common.files import (atomic_write, fsync_dir, fsync_write, is_disk_full, one_line, sha256_of,
                          verify_manifest, write_manifest)
from common.errors import MODEL_OOM_ADVICE, UsageError, fail, run_main
from common.model import LlamaForCausalLM, get_config
from common.runfolder import claim_run_folder
from common.tables import markdown_table
from common.training import build_optimizer

from proof import exact_kernels, full_state


def parse_args(argv=None):
    p = script_parser("05-sharded-checkpoint", "Save an FSDP2 training state with DCP, each "
                      "rank its own shards, and load it on another number of ranks.",
                      min_world=1, training=True)
    p.add_argument("--steps", type=positive_int, default=4, help="optimizer steps of this run")
    p.add_argument("--load", default=None, metavar="FOLDER",
                   help="start from this checkpoint: a run folder (its `latest`) or a step-N folder")

    def check_load(args):  # before any process group: a wrong folder costs nothing
        args.load_step_dir = None
        if args.load is None:
            return
        folder = Path(args.load)
        latest = folder / "latest"
        step_dir = folder / latest.read_text().strip() if latest.is_file() else folder
        if not ((step_dir / "manifest.json").is_file() and (step_dir / ".metadata").is_file()):
            raise UsageError(f"--load {args.load!r} is not a sharded checkpoint (a run folder with "
                             f"`latest`, or a step-N folder holding manifest.json and .metadata)")
        try:
            meta = verify_manifest(step_dir, names=())  # its metadata; the files are checked below
            saved = meta["settings"]
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"--load {args.load!r}: its manifest.json is unreadable") from None
        for flag in ("model_preset", "dataset_name"):  # they decide the tensors' shapes
            if saved.get(flag) != getattr(args, flag):
                raise UsageError(f"--load {args.load!r} was saved with --{flag.replace('_', '-')} "
                                 f"{saved.get(flag)}, this run has {getattr(args, flag)}: pass the same")
        if not reference_path(step_dir).is_file():
            raise UsageError(f"--load {args.load!r}: {reference_path(step_dir).name} (the full "
                             f"state the proof compares with) is missing beside it")
        args.load_step_dir, args.load_meta = step_dir, meta
    p.checks.insert(0, check_load)
    return p.parse_args(argv)


def reference_path(step_dir: Path) -> Path:
    """The full state a saving run also wrote, beside its checkpoint, for the proof only."""
    return step_dir.parent / f"reference-{step_dir.name}.pt"


def settings(args, vocab_size: int) -> dict:
    return {"model_preset": args.model_preset, "dataset_name": args.dataset_name, "vocab_size": vocab_size}


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


# ------------------------------------------------------------------------------ main

def main():
    args = parse_args()
    demo = start_group(args.timeout)
    try:
        with exact_kernels():  # deterministic kernels, no TF32: the loaded state must match to the bit
            return run(args, demo)
    finally:
        gc_and_destroy_process_group()


def say(demo, *lines):
    if demo.rank == 0:
        print(*lines, sep="\n", flush=True)


def shown(path: Path) -> str:
    """A path as a reader would type it: relative to the working folder when inside it."""
    path = Path(path)
    return str(path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path)


def run(args, demo):
    start = 0
    if args.load_step_dir:
        # Damage first (a deleted or truncated file, a flipped byte), before any work:
        # each rank checks its share of the files against the manifest (rank r every
        # W-th, at once: no rank waits for one reading them all), every rank hears the verdict.
        error, names = None, sorted(args.load_meta["sha256"])
        try:
            verify_manifest(args.load_step_dir, names[demo.rank::demo.world])
        except ValueError as e:
            error = f"checkpoint {args.load_step_dir} is damaged: {e}; nothing was loaded"
        error = first_error(error)
        if error:
            fail(error)
        start = args.load_meta["step"]
    # ours alone from here (a damaged --load above leaves nothing): a second job with this
    # --experiment-name is refused, not left to write the same .tmp- folders
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=demo.rank)

    # this rank's batches of one shared shuffle; a resumed run takes the ones after `start`
    data, batches = fixed_batches(args.dataset_name, args.seq_length, args.batch_size, start + args.steps,
                                  args.seed, demo.rank, demo.world, demo.device)
    batches = batches[start:]
    config = get_config(args.model_preset, data.vocab_size)

    model, optimizer = sharded_model(config, args.seed, args.lr, demo.device)
    say(demo, f"{ranks(demo.world)}, {demo.backend}; {args.model_preset} preset, FSDP2 "
              f"(each rank holds 1/{demo.world} of every parameter and AdamW moment)")

    verdict = None
    if args.load_step_dir:
        saved_world = args.load_meta["world_size"]
        load_sharded(model, optimizer, args.load_step_dir, demo)
        say(demo, f"loaded {args.load_step_dir} (step {start}, written by {ranks(saved_world)}) "
                  f"on {ranks(demo.world)}")
        say(demo, *where_pieces_come_from(model, args.load_step_dir, demo))
        worst, compared, mismatches = prove_equal(model, optimizer, reference_path(args.load_step_dir), demo)
        if mismatches:  # stop here: training on, or saving, a wrong state helps nobody
            if demo.rank == 0:
                print(f"FAILED: loaded a checkpoint written by {ranks(saved_world)} on {ranks(demo.world)}, "
                      f"but {len(mismatches)} tensor(s) differ from the saved state, e.g. {mismatches[0]}",
                      file=sys.stderr, flush=True)
            return 1
        verdict = (f"OK: loaded a checkpoint written by {ranks(saved_world)} on {ranks(demo.world)}: "
                   f"every parameter and AdamW moment equals the saved state (max difference {worst:g}, "
                   f"{compared} tensors compared)")

    losses = train(model, optimizer, batches)
    say(demo, "loss per step: " + ", ".join(f"{start + i + 1}: {loss:.4f}" for i, loss in enumerate(losses)))

    step_dir = run_dir / f"step-{start + args.steps:08d}"
    seconds, reference_s = save_sharded(model, optimizer, step_dir, settings(args, data.vocab_size),
                                        start + args.steps, demo)
    say(demo, "", f"saved {shown(step_dir)} in {seconds:.2f} s (the proof's reference, gathered and "
                  f"written by rank 0 alone: {reference_s:.2f} s more); its files:", "",
        file_table(step_dir, demo.world))
    if verdict:
        say(demo, "", verdict)
    return 0


def sharded_model(config, seed: int, lr: float, device):
    """The model sharded as in sharded_from_scratch.py: a unit per decoder layer, then the
    root. Every parameter becomes a DTensor: rank r keeps its 1/W of the rows. AdamW's
    moments, created like the parameters, are DTensors too."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, build_optimizer(model, lr, 0.1, device)


def train(model, optimizer, batches) -> list[float]:
    """The loop of chapter 03; FSDP2 gathers, frees and reduce-scatters inside it. Returns
    each step's loss, averaged over the ranks (the global batch's loss)."""
    losses = []
    for x, y in batches:
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    mean = torch.stack(losses).double()
    dist.all_reduce(mean)
    return (mean / dist.get_world_size()).tolist()


# ---------------------------------------------------------------------- the lesson

def save_sharded(model, optimizer, step_dir: Path, run_settings: dict, step: int, demo) -> tuple[float, float]:
    """Every rank writes its own shards into `.tmp-step-N`; then rank 0 commits it as
    chapter 04 does: checksums, rename, `latest`. Every rank calls it. Returns the seconds
    of the sharded save and, apart, of the proof's reference (no part of a sharded save)."""
    t0 = time.perf_counter()
    run_dir, tmp = step_dir.parent, step_dir.parent / f".tmp-{step_dir.name}"
    # This rank's view: DTensor shards, keyed by the parameter's name (an FQN), never a
    # gathered tensor. The optimizer's state is keyed by names too (not by the numbers
    # torch.optim uses), so it can be matched to the parameters on any number of ranks.
    model_state, optim_state = get_state_dict(model, optimizer)

    error = None
    t_reference = time.perf_counter()
    try:
        write_reference(model, optimizer, reference_path(step_dir), demo)  # for the proof only
        if demo.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier kill
            tmp.mkdir()
    except (OSError, RuntimeError) as e:  # torch.save says "disk full" as a RuntimeError
        error = write_failure(e, run_dir)
    # every rank hears of a failure; and the folder exists (on the shared file system)
    # before anyone writes into it
    error = first_error(error)
    reference_s = time.perf_counter() - t_reference

    # The sharded save: each rank writes __<rank>_0.distcp with its own pieces, all at once;
    # rank 0 (the coordinator) then writes .metadata: tensor -> pieces -> file, offset, length.
    # A tensor every rank holds whole (AdamW's step count) is written once, by one rank.
    if error is None:
        try:
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        except CheckpointException as e:  # raised on every rank when any rank's write failed
            error = write_failure(e, run_dir)
    if error:
        collect_failed_streams()  # now that the failure is no longer being handled
        if demo.rank == 0:  # never leave a full disk fuller, nor a reference without its checkpoint
            shutil.rmtree(tmp, ignore_errors=True)
            if not step_dir.exists():
                reference_path(step_dir).unlink(missing_ok=True)
        fail(f"{error}; nothing was saved: free some space (or fix the folder), then run again",
             status=1)
    # Each rank checksums the file it wrote, all at once (1/W of the bytes each); rank 0
    # gets them all, and hashes only the small .metadata itself.
    digests = [None] * demo.world
    dist.all_gather_object(digests, {p.name: sha256_of(p) for p in tmp.glob(f"__{demo.rank}_*.distcp")})

    def commit():  # rank 0, once every rank has written (dcp.save ends with a collective)
        missing = [r for r in range(demo.world) if not any(tmp.glob(f"__{r}_*.distcp"))]
        if missing:
            raise OSError(f"rank {missing[0]}'s file is not in {tmp}: do all ranks see the same "
                          f"folder (a shared file system)?")
        write_manifest(tmp, {"settings": run_settings, "step": step, "world_size": demo.world},
                       {name: digest for mine in digests for name, digest in mine.items()})
        shutil.rmtree(step_dir, ignore_errors=True)  # the same step, saved before a crash
        os.rename(tmp, step_dir)  # atomic: the folder is there whole, or not at all
        fsync_write(run_dir / "latest.tmp", lambda f: f.write(step_dir.name.encode()))
        os.replace(run_dir / "latest.tmp", run_dir / "latest")  # the commit point
        fsync_dir(run_dir)

    def explain(e):  # a failed commit: no half folder left, every rank stops with the line
        shutil.rmtree(tmp, ignore_errors=True)
        return write_failure(e, run_dir) if isinstance(e, OSError) or is_disk_full(e, run_dir) else None
    on_rank0(commit, demo.rank, explain)
    return time.perf_counter() - t0 - reference_s, reference_s


def write_reference(model, optimizer, path: Path, demo):
    """The proof's reference: the same state gathered whole onto rank 0's CPU (a
    collective), written with torch.save beside the checkpoint, before it is committed."""
    full_model, full_optim = full_state(model, optimizer)
    if demo.rank == 0:  # the only rank whose copy is whole on every backend
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save({"model": full_model, "optim": full_optim}, f))


def load_sharded(model, optimizer, step_dir: Path, demo):
    """The mirror of `save_sharded`, on any number of ranks: each rank builds its own
    (new) shards, asks DCP to fill them, and hands them to model and optimizer. Reading
    `.metadata`, DCP finds which saved pieces overlap each new shard, reads those pieces
    (their byte ranges of the files) and copies the overlapping rows in."""
    model_state, optim_state = get_state_dict(model, optimizer)  # the shapes to fill, this world's
    state = {"model": model_state, "optim": optim_state}
    error = None
    try:
        dcp.load(state, checkpoint_id=step_dir)  # in place, into this rank's shards
    except CheckpointException as e:  # a BaseException: `except Exception` would miss it
        error = f"checkpoint {step_dir} cannot be loaded: {dcp_failure(e)}"
    error = first_error(error)
    if error:
        fail(error)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def write_failure(e: BaseException, where: Path) -> str:
    """A failed save as one line. A full disk is named as such (torch.save's zip writer
    says it as "unexpected pos"); an error that is no write error is raised again."""
    inner = first_failure(e)[1] if isinstance(e, CheckpointException) else e
    if is_disk_full(inner, where):
        return f"disk full while saving into {where} ({shutil.disk_usage(where).free / 2**20:,.1f} MB free)"
    if isinstance(e, CheckpointException):
        return f"the sharded save into {where} failed: {dcp_failure(e)}"
    if isinstance(e, OSError):
        return f"writing into {where} failed ({one_line(e)})"
    raise e


def collect_failed_streams():
    """DCP wraps each file it writes in a stream whose close() flushes the file again, and
    closes it again when collected. The ones a failed save's traceback holds are collected
    after their files were closed, and Python would print "Exception ignored ... flush of
    closed file" under the run's one line (seen at exit on Python 3.13): collect them now,
    with that one message left out."""
    def hook(unraisable, report=sys.unraisablehook):
        if not (isinstance(unraisable.exc_value, ValueError) and "closed file" in str(unraisable.exc_value)):
            report(unraisable)
    previous, sys.unraisablehook = sys.unraisablehook, hook
    try:
        gc.collect()
    finally:
        sys.unraisablehook = previous


def first_failure(e: CheckpointException) -> tuple[int | None, object]:
    """The first failed rank and its error inside DCP's exception, whose str() is a
    traceback per failed rank; `failures` maps each rank to (exception, traceback)."""
    failures = getattr(e, "failures", None) or {}
    for rank in sorted(failures):
        return rank, failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
    return None, e


def dcp_failure(e: CheckpointException) -> str:
    rank, inner = first_failure(e)
    if rank is None:
        return type(e).__name__
    return f"rank {rank}: {one_line(inner) if isinstance(inner, BaseException) else inner}"


# ------------------------------------------------------------------------- showing it

def where_pieces_come_from(model, step_dir: Path, demo, name="model.layers.0.mlp.up_proj.weight") -> list[str]:
    """One tensor's story: its saved pieces (rows, file) and the rows each rank of this
    run holds now, which DCP read from whichever pieces overlap them. A collective."""
    meta = dcp.FileSystemReader(str(step_dir)).read_metadata()  # the pickle of the caveat
    fqn = name.removeprefix("model.")
    local = dict(model.named_parameters())[fqn].to_local()
    rows_here = local.shape[0]
    all_rows = [None] * demo.world
    dist.all_gather_object(all_rows, rows_here)
    saved = meta.state_dict_metadata[name]  # global size, and the pieces (offsets, sizes) saved
    lines = [f"{name} {tuple(saved.size)}: saved as"]
    for piece in sorted(saved.chunks, key=lambda c: c.offsets[0]):
        where = meta.storage_data[MetadataIndex(name, piece.offsets)]  # file, byte offset, length
        first = piece.offsets[0]
        lines.append(f"    rows {first}..{first + piece.sizes[0] - 1} in {where.relative_path}")
    lo, here = 0, []
    for r, n in enumerate(all_rows):
        here.append(f"rank {r} rows {lo}..{lo + n - 1}")
        lo += n
    lines.append("  loaded as: " + "; ".join(here))
    return lines


def prove_equal(model, optimizer, reference: Path, demo):
    """Gather the loaded state whole onto rank 0 and compare it, tensor by tensor, with
    the full state the saving run wrote. Returns (max difference, tensors compared, a
    list of mismatches), the same on every rank. A collective."""
    full_model, full_optim = full_state(model, optimizer)
    result = [None]
    if demo.rank == 0:
        saved = torch.load(reference, map_location="cpu", weights_only=True)
        result = [compare({"model": full_model, "optim": full_optim}, saved)]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def compare(loaded: dict, saved: dict):
    """(max |a - b| over all tensors, tensors compared, mismatches): every key, shape,
    dtype and value must agree (values exactly: loading is a copy); non-tensors equal."""
    a, b = flatten(loaded), flatten(saved)
    mismatches = [f"{k}: missing after loading" for k in sorted(b.keys() - a.keys())]
    mismatches += [f"{k}: not in the saved state" for k in sorted(a.keys() - b.keys())]
    worst, compared = 0.0, 0
    for k in sorted(a.keys() & b.keys()):
        x, y = a[k], b[k]
        if torch.is_tensor(x) and torch.is_tensor(y):
            if x.shape != y.shape or x.dtype != y.dtype:
                mismatches.append(f"{k}: {tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}")
                continue
            diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
            compared += 1
            worst = max(worst, diff)
            if diff != 0.0:
                mismatches.append(f"{k}: max difference {diff:.3g}")
        elif x != y:
            mismatches.append(f"{k}: {x!r} vs {y!r}")
    return worst, compared, mismatches


def flatten(tree, prefix="") -> dict:
    """{"a.b.0": leaf} for nested dicts and lists."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)) and not all(isinstance(v, (int, float, str)) for v in tree):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def file_table(step_dir: Path, world: int) -> str:
    """Rank 0: every file of the checkpoint, who wrote it, its share of the tensors' bytes.
    DCP names rank r's file __<r>_<n>.distcp."""
    rows, shards = [], sorted(step_dir.glob("__*.distcp"), key=lambda p: int(p.name.split("_")[2]))
    total = sum(p.stat().st_size for p in shards)
    for p in shards:
        size = p.stat().st_size
        rows.append((p.name, f"rank {p.name.split('_')[2]}", f"{size:,}", f"{100 * size / total:.1f}%"))
    for name, who in ((".metadata", "rank 0 (coordinator)"), ("manifest.json", "rank 0 (commit)")):
        rows.append((name, who, f"{(step_dir / name).stat().st_size:,}", ""))
    full = reference_path(step_dir).stat().st_size
    table = markdown_table(("file", "written by", "bytes", "share of the shards"), rows, right=(2, 3))
    return (f"{table}\n\n{world} rank file(s), {total:,} bytes in all; the same state as one "
            f"torch.save file (the proof's reference) takes {full:,} bytes")


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
