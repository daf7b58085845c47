"""Throughput and MFU of the model presets on this machine, eager and torch.compile'd.

    python -m tools.bench_model                       # tiny and small, cuda if present
    python -m tools.bench_model --presets small --no-compile
    python -m tools.bench_model --presets base --batch-size 16 --seq-length 1024
    python -m tools.bench_model --presets small base medium --seq-length 1024 --json bench.json

For each preset, two kinds of step on random tokens: forward + cross-entropy +
backward (the model alone), and a full training step as chapter 01 takes it (that,
then gradient clipping, AdamW and zero_grad). Each runs eager, and with the loss
function (model and cross-entropy together) compiled by `torch.compile` (inductor).
The first compiled step compiles: its time is reported apart, as the compile time.
Then every variant runs `--warmup` untimed steps and `--iters` timed ones, eager and
compiled taking turns; the table reports the median step as tokens/s, model FLOP/s
and MFU against the device's peak (`python -m tools.peak`: the datasheet's where
known, else measured), and on CUDA the peak memory of a step. On CUDA bf16 autocast, as
the chapters by default, each step timed by CUDA events on an idle device (the call's
device time, host launch gaps included); on CPU fp32, by the host clock. `--json` also
writes every row, with the device, torch version and peak, to a file.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from common.cli import Parser, check_device, check_writable_folder, non_negative_int, positive_int
from common.data import DEFAULT_VOCAB_SIZE
from common.environment import device_name
from common.errors import UsageError, run_main
from common.files import write_json
from common.model import PRESETS, LlamaForCausalLM, attention_flops_per_token, flops_per_token, get_config, num_parameters
from common.peak_flops import Peak, device_peak, sync
from .step_profile import OPTIMIZER, profile_step
from .step_profile import table as profile_table
from common.tables import format_flops, markdown_table
from common.timing import CudaEventClock, WallClock


def loss_of(model, x, y, bf16: bool = False):
    """Mean next-token cross-entropy, as the chapters compute it (bf16 autocast for the
    model on CUDA by default). This whole function is what gets compiled: the loss
    fused with the model, not the model alone."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))  # fp32 logits


def make_optimizer(model, device: torch.device) -> torch.optim.Optimizer:
    # chapter 01's settings (weight-decay groups aside: they do not change the cost)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                             fused=device.type == "cuda")


def forward_backward(loss_fn, model, x, y, bf16: bool = False):
    """The loss and its gradients (left in .grad); returns the loss."""
    loss = loss_fn(model, x, y, bf16)
    loss.backward()
    return loss


def train_step(loss_fn, model, optimizer, x, y, bf16: bool = False):
    """One training step as chapter 01 takes it; returns the loss."""
    loss = forward_backward(loss_fn, model, x, y, bf16)
    with record_function(OPTIMIZER):  # for --profile: the optimizer's share of the step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss


def step_times(steps: dict, iters: int, warmup: int, device: torch.device) -> tuple[dict, dict]:
    """Seconds of each of `iters` timed calls of every step function, after `warmup`
    untimed ones, and each function's peak memory in MB (CUDA: the allocator's peak over
    its calls; None on CPU). The functions take turns, so that a machine shared with
    other work slows them alike and their ratio stays fair. Each call starts on an idle
    device and is timed by the device's clock: CUDA events recorded just before and after
    it (read after a synchronize), the host's clock on a CPU."""
    cuda = device.type == "cuda"
    clock = CudaEventClock(device) if cuda else WallClock()
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    peak_mb = dict.fromkeys(steps, 0.0 if cuda else None)
    for _ in range(iters):
        for name, step in steps.items():
            clock.sync()  # the previous call's kernels are done: this call starts alone
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            start = clock.mark()
            step()
            end = clock.mark()
            clock.sync()
            times[name].append(clock.seconds(start, end))
            if cuda:
                peak_mb[name] = max(peak_mb[name], torch.cuda.max_memory_allocated(device) / 2**20)
    return times, peak_mb


def first_call_seconds(step, device: torch.device) -> float:
    """Wall time of one call: for a freshly compiled model, the compile time (plus one
    step, small beside it)."""
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def bench_preset(preset: str, batch_size: int, seq_len: int, iters: int, warmup: int,
                 device: torch.device, vocab_size: int, peak: Peak, compile: bool,
                 profile_steps: int = 0) -> dict:
    """One row per (mode, step kind), and the compile time (None without compile). With
    `profile_steps`, each mode's training-step row also says where its time went
    (tools.step_profile), from that many profiled steps after the timed ones."""
    config = get_config(preset, vocab_size)
    seq_len = min(seq_len, config.max_position_embeddings)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    n_params = num_parameters(model)
    fpt = flops_per_token(config, n_params, seq_len)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]
    bf16 = device.type == "cuda"
    optimizer = make_optimizer(model, device)

    def steps_of(loss_fn):
        def fwd_bwd():
            forward_backward(loss_fn, model, x, y, bf16)
            model.zero_grad(set_to_none=True)
        return {"forward+backward": fwd_bwd,
                "training step": lambda: train_step(loss_fn, model, optimizer, x, y, bf16)}

    modes = {"eager": loss_of}
    compile_s = None
    if compile:
        compiled = torch.compile(loss_of)
        compile_s = first_call_seconds(steps_of(compiled)["forward+backward"], device)
        modes["compiled"] = compiled
    rows = []
    for kind in ("forward+backward", "training step"):
        times, peak_mb = step_times({mode: steps_of(loss_fn)[kind] for mode, loss_fn in modes.items()},
                                    iters, warmup, device)
        for mode, seconds in times.items():
            median = statistics.median(seconds)
            tokens_per_s = batch_size * seq_len / median
            rows.append({"preset": preset, "params": n_params, "batch": batch_size,
                         "seq": seq_len, "mode": mode, "step": kind, "step_s": median,
                         "tokens_per_s": tokens_per_s, "model_flops_per_s": tokens_per_s * fpt,
                         "mfu": tokens_per_s * fpt / peak.flops, "peak_memory_mb": peak_mb[mode]})
    for row in rows:
        eager = next(r for r in rows if r["step"] == row["step"] and r["mode"] == "eager")
        row["speedup"] = row["tokens_per_s"] / eager["tokens_per_s"]
        if profile_steps and row["step"] == "training step":
            tokens = batch_size * seq_len
            attention = tokens * attention_flops_per_token(config, seq_len)
            row["profile"] = profile_step(steps_of(modes[row["mode"]])["training step"], device, profile_steps,
                                          row["step_s"], tokens * fpt - attention, attention)
    return {"rows": rows, "compile_s": compile_s}


def table(rows: list[dict]) -> str:
    header = ["preset", "params", "batch×seq", "mode", "step", "median step", "tokens/s",
              "model FLOP/s", "MFU", "vs eager", "peak memory"]
    body = [[r["preset"], f"{r['params'] / 1e6:.2f} M", f"{r['batch']}×{r['seq']}", r["mode"],
             r["step"], f"{r['step_s'] * 1e3:,.1f} ms", f"{r['tokens_per_s']:,.0f}",
             format_flops(r["model_flops_per_s"]), f"{100 * r['mfu']:.1f}%",
             f"{r['speedup']:.2f}x",
             "-" if r["peak_memory_mb"] is None else f"{r['peak_memory_mb']:,.0f} MB"] for r in rows]
    return markdown_table(header, body, right={1, 2, 5, 6, 7, 8, 9, 10})


def main(argv=None):
    p = Parser(prog="python -m tools.bench_model", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=list(PRESETS),
                   help="model presets to measure, one after another")
    p.add_argument("--batch-size", type=positive_int, default=8, help="samples per step")
    p.add_argument("--seq-length", type=positive_int, default=256,
                   help="tokens per sample (capped at the preset's max_position_embeddings)")
    p.add_argument("--iters", type=positive_int, default=5, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first")
    p.add_argument("--vocab-size", type=positive_int, default=DEFAULT_VOCAB_SIZE,
                   help="the embedding's and output layer's size (random token ids below it)")
    p.add_argument("--no-compile", action="store_true",
                   help="eager only: skip torch.compile (and its compile time)")
    p.add_argument("--device", default="auto",
                   help="auto (cuda if available, else cpu), cpu, cuda:N")
    p.add_argument("--json", type=Path, default=None,
                   help="also write the rows, device, torch version and peak to this file")
    p.add_argument("--profile", type=non_negative_int, default=0, metavar="STEPS",
                   help="then profile this many training steps per mode: where the time went "
                        "(matmul, attention, optimizer, other, idle) and the busiest kernels")

    def check(args):
        check_device(args.device)
        if args.json is not None:  # refused now, not after the whole benchmark has run
            if args.json.is_dir():
                raise UsageError(f"--json {str(args.json)!r} is a folder; name a file in it")
            if not args.json.parent.is_dir():
                raise UsageError(f"--json {str(args.json)!r}: its folder does not exist")
            check_writable_folder(args.json.parent, "--json")
    p.checks.append(check)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)

    dtype = "bf16" if device.type == "cuda" else "fp32"
    peak = device_peak(device, dtype)
    print(f"device: {device_name(device)}; dtype: "
          f"{'bf16 autocast' if dtype == 'bf16' else 'fp32'}; torch {torch.__version__}"
          f" ({torch.get_num_threads()} threads); median of {args.iters} steps after"
          f" {args.warmup} warm-up; MFU against {peak.label()}", flush=True)
    rows, compile_s = [], {}
    for preset in args.presets:
        result = bench_preset(preset, args.batch_size, args.seq_length, args.iters,
                              args.warmup, device, args.vocab_size, peak, not args.no_compile,
                              args.profile)
        rows += result["rows"]
        if result["compile_s"] is not None:
            compile_s[preset] = result["compile_s"]
            print(f"{preset}: torch.compile took {result['compile_s']:.1f} s "
                  f"(its first forward+backward; not in the table)", flush=True)
    print(table(rows))
    if max(r["mfu"] for r in rows) > 1.0:
        print(f"note: MFU over 100%: the {peak.label()} is too low"
              + (" (measured while the machine was busy?): python -m tools.peak --remeasure"
                 if peak.source == "measured" else ""))
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        print(f"\nwhere a training step's time went ({args.profile} profiled steps per mode; "
              f"{'kernel time on the GPU' if device.type == 'cuda' else 'operator time on the CPU'}; "
              f"matmul and attention FLOP/s inside their kernels, against the peak):")
        print(profile_table(profiled, peak.flops))
        for r in profiled:
            print(f"\n{r['preset']}, {r['mode']}: the busiest, per step")
            print(markdown_table(["kernel" if device.type == "cuda" else "operator", "kind", "calls", "time"],
                                 [[b["name"][:90], b["kind"], f"{b['calls_per_step']:g}", f"{b['s'] * 1e3:,.2f} ms"]
                                  for b in r["profile"]["busiest"]], right={2, 3}))
    if args.json is not None:
        write_json(args.json, {
            "device": device.type, "device_name": device_name(device), "dtype": dtype,
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
            "threads": torch.get_num_threads(), "iters": args.iters, "warmup": args.warmup,
            "peak_flops": peak.flops, "peak_source": peak.source, "peak_precision": peak.precision,
            "compile_s": compile_s, "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")})


if __name__ == "__main__":
    # out of memory (a preset, batch or vocabulary too large), Ctrl-C: one line
    sys.exit(run_main(main, "try a smaller --batch-size, --seq-length, --vocab-size or preset"))
