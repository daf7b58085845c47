"""Chapter 03: DDP's knobs, measured. The chapter's model trained a few steps under
several DDP settings, from the same weights on the same batches, one step of each in
turn (so a change in the machine's load hits them all alike):

    torchrun --standalone --nproc-per-node=2 03-ddp/ddp_knobs.py

- `bucket_cap_mb`: how many all-reduces a step makes, how large, and the tokens/s;
- `gradient_as_bucket_view`: the gradient memory it saves;
- `static_graph`: the tokens/s (and the same losses);
- a communication hook that sends bf16 instead of fp32: the bytes halved, and its losses
  beside the fp32 run's.

Every fp32 setting runs with `counting_allreduce` as its communication hook: DDP's own
averaging (divide by the world size, all-reduce the bucket) plus two counters, the calls
and the bytes of the tensor each one sends; the bf16 one with `bf16_allreduce`, counted
alike. So the counts are measured, not computed.
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from common.cli import positive_int
from common.data import IGNORE_INDEX, show_progress
from common.demos import fixed_batches, script_parser, start_group
from common.distributed import DDP_NO_BUFFER_SYNC, gc_and_destroy_process_group
from common.environment import device_name, environment_info, share_cpu_threads
from common.errors import MODEL_OOM_ADVICE, run_main
from common.files import write_json
from common.model import LlamaForCausalLM, get_config, num_parameters
from common.runfolder import claim_run_folder
from common.tables import markdown_table
from common.training import build_optimizer

MIB = 2**20


def bucket_caps(text: str) -> list[float]:
    """--bucket-caps 1,5,25: distinct sizes in MiB, > 0, in increasing order."""
    try:
        caps = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated sizes in MiB (got {text!r})") from None
    if not all(0 < c < 2**20 for c in caps) or caps != sorted(set(caps)):
        raise argparse.ArgumentTypeError(f"must be distinct sizes > 0 in increasing order (got {text!r})")
    return caps


def parse_args(argv=None):
    # Checked before any process group exists: bad input costs nothing and leaves nothing.
    p = script_parser("03-ddp-knobs", "DDP's settings measured on the chapter's model: "
                      "bucket_cap_mb, gradient_as_bucket_view, static_graph, a bf16 "
                      "communication hook. Launch with torchrun (2 or more processes).",
                      training=True)
    p.add_argument("--steps", type=positive_int, default=20, help="training steps of each setting")
    p.add_argument("--timing-warmup", type=positive_int, default=2,
                   help="first steps left out of the tokens/s (DDP rebuilds its buckets after the first)")
    p.add_argument("--bucket-caps", type=bucket_caps, default=[1.0, 5.0, 25.0, 100.0],
                   help="bucket_cap_mb values of the sweep, in MiB (DDP's default: 25)")
    return p.parse_args(argv)


# ---------------------------------------------------------------- the counting hook

@dataclass
class Traffic:
    """What one DDP model's hook saw: per step, the all-reduce calls and the bytes each
    sent; and the storages of the step's buckets (where gradients may live)."""
    calls: list = field(default_factory=list)
    bytes: list = field(default_factory=list)
    bucket_storages: set = field(default_factory=set)

    def new_step(self):
        self.calls.append(0)
        self.bytes.append([])
        self.bucket_storages = set()


def count(traffic: Traffic, tensor: torch.Tensor):
    traffic.calls[-1] += 1
    traffic.bytes[-1].append(tensor.numel() * tensor.element_size())


def counting_allreduce(traffic: Traffic, bucket: dist.GradBucket):
    """DDP's default averaging as a hook (`allreduce_hook`: divide the bucket's flat
    tensor by the world size, all-reduce it), counting the calls and the bytes sent."""
    tensor = bucket.buffer()
    count(traffic, tensor)
    traffic.bucket_storages.add(tensor.untyped_storage().data_ptr())
    return allreduce_hook(None, bucket)  # None: the default process group


def bf16_allreduce(traffic: Traffic, bucket: dist.GradBucket):
    """What torch's `bf16_compress_hook` does, counted: send a bf16 copy of the bucket
    (divided by the world size), and copy the sum back into the fp32 bucket. (DDP refuses
    torch's own hook, by its name, unless torch was built with CUDA and NCCL >= 2.10, or
    XPU and XCCL, whatever the group's backend; this one runs on a CPU-only build too.)"""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size())
    count(traffic, compressed)

    def decompress(fut):
        buffer.copy_(fut.value()[0])  # back to fp32, in place
        return buffer
    return dist.all_reduce(compressed, async_op=True).get_future().then(decompress)


# ------------------------------------------------------------------- the settings

def settings(args) -> dict:
    """name -> (DDP keyword arguments, the hook). The first is DDP's defaults, which each
    other setting changes in one place; chapter 03's own is "gradient_as_bucket_view"."""
    out = {"default": ({}, counting_allreduce)}
    out.update({f"bucket_cap_mb={c:g}": ({"bucket_cap_mb": c}, counting_allreduce) for c in args.bucket_caps})
    out["gradient_as_bucket_view"] = ({"gradient_as_bucket_view": True}, counting_allreduce)
    out["static_graph"] = ({"static_graph": True}, counting_allreduce)
    out["bf16 hook"] = ({}, bf16_allreduce)
    return out


class Replica:
    """One DDP model with its optimizer, its hook's traffic, its step times and losses."""

    def __init__(self, name, ddp_kwargs, hook, config, device, seed, lr):
        torch.manual_seed(seed)  # the same initial weights for every setting
        self.raw = LlamaForCausalLM(config).to(device)
        self.model = DDP(self.raw, device_ids=[device.index] if device.type == "cuda" else None,
                         **DDP_NO_BUFFER_SYNC, **ddp_kwargs)
        self.traffic = Traffic()
        self.model.register_comm_hook(self.traffic, hook)
        self.optimizer = build_optimizer(self.raw, lr, 0.1, device)
        self.name, self.device, self.times, self.losses = name, device, [], []
        self.grad_bytes_outside_buckets = None

    def step(self, x, y, autocast, last: bool):
        self.traffic.new_step()
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        with autocast:
            logits = self.model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)
        loss.backward()  # the all-reduces start in here, from DDP's hooks
        if last:
            self.grad_bytes_outside_buckets = grad_bytes_outside(self.raw, self.traffic.bucket_storages)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        self.times.append(time.perf_counter() - t0)
        self.losses.append(loss.detach().float())


def grad_bytes_outside(model, bucket_storages: set) -> int:
    """Bytes of the storages holding the gradients, except DDP's buckets: with
    gradient_as_bucket_view each gradient is a view into its bucket, so nothing is extra."""
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                for p in model.parameters() if p.grad is not None}
    return sum(n for ptr, n in storages.items() if ptr not in bucket_storages)


# ----------------------------------------------------------------------- the report

def summarize(args, replicas, group, tokens_per_step) -> dict:
    """Per setting: the last step's all-reduces and bytes (the buckets are rebuilt after
    step 1), tokens/s of the slowest rank's median step, the global batch's losses."""
    out = {}
    for name, r in replicas.items():
        times = torch.tensor(r.times, dtype=torch.float64, device=group.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        losses = torch.stack(r.losses).to(group.device)
        dist.all_reduce(losses)  # the global batch's loss: the sum of the ranks' means / world
        skip = min(args.timing_warmup, args.steps - 1)  # keep at least one measured step
        step = statistics.median(times[skip:].tolist())
        sent = r.traffic.bytes[-1]
        out[name] = {"allreduces_per_step": r.traffic.calls[-1], "bytes_per_step": sum(sent),
                     "bucket_mib": [round(b / MIB, 3) for b in sent],
                     "allreduces_first_step": r.traffic.calls[0],
                     "tokens_per_s": tokens_per_step / step, "step_time_s_median": step,
                     "grad_bytes_outside_buckets": r.grad_bytes_outside_buckets,
                     "losses": (losses / group.world).tolist()}
    return out


def tables(results, args) -> str:
    base = results["default"]
    mib = lambda b: f"{b / MIB:,.2f}"  # noqa: E731
    tps = lambda r: f"{r['tokens_per_s']:,.0f}"  # noqa: E731
    sweep = [n for n in results if n.startswith("bucket_cap_mb=")]
    t1 = markdown_table(("bucket_cap_mb", "all-reduces per step", "MiB per step", "largest (MiB)", "tokens/s"),
                        [(n.split("=")[1], results[n]["allreduces_per_step"], mib(results[n]["bytes_per_step"]),
                          f"{max(results[n]['bucket_mib']):,.2f}", tps(results[n])) for n in sweep], right=range(5))
    t2 = markdown_table(("gradient_as_bucket_view", "gradient MiB outside the buckets", "tokens/s"),
                        [(v, mib(results[n]["grad_bytes_outside_buckets"]), tps(results[n]))
                         for v, n in (("False", "default"), ("True", "gradient_as_bucket_view"))], right=(1, 2))
    t3 = markdown_table(("static_graph", "all-reduces per step", "tokens/s", "final loss"),
                        [(v, results[n]["allreduces_per_step"], tps(results[n]), f"{results[n]['losses'][-1]:.6f}")
                         for v, n in (("False", "default"), ("True", "static_graph"))], right=(1, 2, 3))
    bf = results["bf16 hook"]
    t4 = markdown_table(("hook", "MiB sent per step", "tokens/s", "final loss"),
                        [(h, mib(r["bytes_per_step"]), tps(r), f"{r['losses'][-1]:.6f}")
                         for h, r in (("fp32 (default)", base), ("bf16", bf))], right=(1, 2, 3))
    shown = sorted({0, *range(4, args.steps, 5), args.steps - 1})
    t5 = markdown_table(("step", "loss fp32", "loss bf16 hook", "difference"),
                        [(s + 1, f"{base['losses'][s]:.6f}", f"{bf['losses'][s]:.6f}",
                          f"{bf['losses'][s] - base['losses'][s]:+.2e}") for s in shown], right=range(4))
    return "\n\n".join([t1, t2, t3, t4, t5])


def main():
    args = parse_args()
    group = start_group(args.timeout)
    rank, world, device = group.rank, group.world, group.device
    share_cpu_threads(device)  # the machine's cores split among its processes (a collective)
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name, rank=rank)
    data, batches = fixed_batches(args.dataset_name, args.seq_length, args.batch_size, args.steps,
                                  args.seed, rank, world, device)
    config = get_config(args.model_preset, data.vocab_size)
    tokens_per_step = world * args.batch_size * args.seq_length
    # bf16 autocast on GPUs as in the chapter (weights and gradients stay fp32), fp32 on CPUs
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    replicas = {name: Replica(name, kwargs, hook, config, device, args.seed, args.lr)
                for name, (kwargs, hook) in settings(args).items()}
    n_params = num_parameters(replicas["default"].raw)
    if rank == 0:
        print(f"{world} ranks, {group.backend}, {device_name(device)}; {args.model_preset} preset, "
              f"{n_params / 1e6:.2f} M parameters ({n_params * 4 / MIB:,.1f} MiB of fp32 gradients); "
              f"{len(replicas)} settings x {args.steps} steps of {tokens_per_step:,} tokens", flush=True)
    for i, (x, y) in enumerate(tqdm(batches, desc="steps", disable=rank != 0 or not show_progress())):
        for r in replicas.values():  # one step of each in turn
            r.step(x, y, autocast, last=i == len(batches) - 1)
    results = summarize(args, replicas, group, tokens_per_step)
    if rank == 0:
        print(f"\n{tables(results, args)}\n\ntokens/s: the slowest rank's median step after the "
              f"first {min(args.timing_warmup, args.steps - 1)}; counts and bytes: the last step",
              flush=True)
        write_json(run_dir / "ddp_knobs.json", {
            **vars(args), "world_size": world, "backend": group.backend, "device_name": device_name(device),
            "num_params": n_params, "tokens_per_step": tokens_per_step, "settings": results,
            "environment": environment_info()})
        print(f"outputs in {run_dir}", flush=True)
    dist.barrier()  # nobody leaves while rank 0 still writes
    del replicas  # DDP's reducers hold the group: free them first
    gc_and_destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, MODEL_OOM_ADVICE))
