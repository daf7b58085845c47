"""Chapter 05, part 5: the overlap timeline. One training step of each data-parallel
mode, recorded by torch.profiler on every rank, drawn as one picture.

The modes are the ones built beside this script: ddp_from_scratch.py's naive, bucketed
and overlapped all-reduces and torch's DDP (--bucket-mb, 25 MiB, every bucket);
sharded_from_scratch.py's ZeRO-1, ZeRO-3 and FSDP2 (fully_shard); and DDP as chapter
03 wraps it (ch03-ddp: DDP's default buckets, the first one 1 MiB). Each trains --warmup
steps untraced (DDP rebuilds its buckets after the first), then one step under the
profiler. From each rank's trace: when forward, backward, sync and optimizer ran
(record_function ranges in the two scripts' steps), when each collective really ran
(gloo: on its own threads; nccl: kernels on their own stream), and the overlap
fraction: the part of the collectives' time during which backward was computing.
Writes overlap_timeline.png, overlap_timeline.json and one Chrome trace per mode
(trace-<mode>.json, every rank in it: open it in https://ui.perfetto.dev).

    torchrun --standalone --nproc-per-node=2 05-collectives/overlap_timeline.py
    torchrun --standalone --nproc-per-node=2 05-collectives/overlap_timeline.py --modes naive,ddp,ch03-ddp
"""

import json
import os
import sys
import tempfile
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import profile, record_function
from tqdm import tqdm

from common.cli import comma_list, non_negative_int, positive_float
from common.data import show_progress
from common.demos import fixed_batches, profiler_activities, script_parser, start_group
from common.distributed import gc_and_destroy_process_group
from common.environment import device_name, environment_info
from common.errors import MODEL_OOM_ADVICE, run_main
from common.files import write_json
from common.model import get_config
from common.runfolder import claim_run_folder

import timeline  # the modes come from the scripts beside this one
from ddp_from_scratch import Replica
from sharded_from_scratch import TRAINERS

MODES = ("naive", "bucketed", "overlap", "ddp", "zero1", "zero3", "fsdp2", "ch03-ddp")


def parse_args(argv=None):
    p = script_parser("05-overlap-timeline", "One profiled training step of every data-parallel "
                      "mode: phases, collectives and their overlap with backward, per rank.",
                      training=True)
    p.add_argument("--modes", default=",".join(MODES), type=comma_list(*MODES), help="comma list")
    p.add_argument("--warmup", type=non_negative_int, default=2,
                   help="untraced steps before the traced one (DDP rebuilds its buckets after the first)")
    p.add_argument("--bucket-mb", type=positive_float, default=25.0,
                   help="bucket size in MiB of bucketed, overlap and ddp (ch03-ddp keeps DDP's default)")
    return p.parse_args(argv)


def mode_notes(args) -> list[str]:
    """The picture's legend lines for the two DDP modes, which differ only in their buckets."""
    notes = {"ddp": f"ddp: torch's DDP with bucket_cap_mb={args.bucket_mb:g} (--bucket-mb): every bucket up to "
                    f"{args.bucket_mb:g} MiB, the first too",
             "ch03-ddp": "ch03-ddp: torch's DDP as chapter 03 wraps it (no bucket_cap_mb): DDP's default buckets, "
                         "a first one of only 1 MiB (reduced while backward goes on), then 25 MiB"}
    return [notes[m] for m in args.modes if m in notes]


def build(mode, args, config, demo, autocast):
    """One mode's model and optimizer, with the `step(x, y)` of the script that teaches it."""
    if mode in ("naive", "bucketed", "overlap", "ddp"):
        return Replica(mode, args, config, demo.device, demo.rank, demo.world, torch.float32, autocast)
    if mode == "ch03-ddp":  # bucket_cap_mb=None: DDP's default buckets, as in chapter 03
        return Replica("ddp", Namespace(**{**vars(args), "bucket_mb": None}), config, demo.device,
                       demo.rank, demo.world, torch.float32, autocast)
    return TRAINERS[mode](mode, args, config, demo, torch.float32, autocast)


def trace_one_step(trainer, batches, demo) -> dict:
    """The untraced warm-up steps, then one step under the profiler; this rank's trace."""
    for x, y in batches[:-1]:
        trainer.step(x, y)
    # one cycle per profiler: acc_events=True only spares torch 2.11's warning that later
    # cycles would drop the events (it prints it on every first cycle)
    with profile(activities=profiler_activities(demo.device), acc_events=True) as prof:
        dist.barrier()  # every rank starts the step together, so the lanes line up
        with record_function(timeline.STEP):
            trainer.step(*batches[-1])
            if demo.device.type == "cuda":
                torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:  # the profiler writes its JSON to a file
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def main():
    args = parse_args()
    demo = start_group(args.timeout)
    try:
        return run(args, demo)
    finally:
        gc_and_destroy_process_group()


def run(args, demo):
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=demo.rank)
    data, batches = fixed_batches(args.dataset_name, args.seq_length, args.batch_size, args.warmup + 1,
                                  args.seed, demo.rank, demo.world, demo.device)
    config = get_config(args.model_preset, data.vocab_size)
    cuda = demo.device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else None  # as the chapters train
    if demo.rank == 0:
        print(f"{demo.world} ranks, {demo.backend}, {device_name(demo.device)}; {args.model_preset} preset, "
              f"batch {args.batch_size} x {args.seq_length} per rank; {args.warmup} untraced steps, "
              f"then one traced step, per mode", flush=True)
    steps = {}
    for mode in tqdm(args.modes, desc="modes", disable=demo.rank != 0 or not show_progress()):
        trace = trace_one_step(build(mode, args, config, demo, autocast), batches, demo)
        mine = timeline.read_step(trace, demo.rank)
        traces = [None] * demo.world if demo.rank == 0 else None
        dist.gather_object((trace, mine), traces, dst=0)
        if demo.rank == 0:
            write_json(run_dir / f"trace-{mode}.json", timeline.merge_traces([t for t, _ in traces]))
            steps[mode] = [r for _, r in traces]
            f = timeline.overlap(steps[mode])
            print(f"  {mode}: {f['overlap_fraction']:.0%} of the collectives' time during backward "
                  f"compute", flush=True)
    if demo.rank == 0:
        report(args, demo, steps, run_dir)
    dist.barrier()  # nobody leaves while rank 0 still writes
    return 0


def report(args, demo, steps, run_dir):
    """Rank 0: the table, overlap_timeline.json and overlap_timeline.png."""
    figures = {mode: timeline.overlap(ranks) for mode, ranks in steps.items()}
    tables = (timeline.table(figures) + "\n\ncollective ms: per rank, the time gloo's threads (or nccl's "
              "stream) were running a collective; overlap: the part of it while the same rank's "
              "backward was computing")
    print("\n" + tables, flush=True)
    (run_dir / "tables.md").write_text(tables + "\n")  # what the tour's report shows
    write_json(run_dir / "overlap_timeline.json", {
        "world_size": demo.world, "backend": demo.backend, "device_name": device_name(demo.device),
        "args": vars(args), "load_average": os.getloadavg()[0],
        "modes": {m: {**figures[m], "ranks": [r.as_dict() for r in steps[m]]} for m in steps},
        "environment": environment_info()})
    timeline.plot(steps, run_dir / "overlap_timeline.png",
                  f"one step per mode, {demo.world} ranks, {demo.backend}, {device_name(demo.device)}, "
                  f"{args.model_preset}, batch {args.batch_size} x {args.seq_length} per rank", mode_notes(args))
    print(f"outputs in {run_dir} (trace-<mode>.json: open in https://ui.perfetto.dev)", flush=True)


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
