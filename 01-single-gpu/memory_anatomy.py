"""Chapter 01, where one training step's memory goes: parameters, gradients, AdamW
state, activations, measured over the step and set against the textbook arithmetic,
with and without activation checkpointing.

    python 01-single-gpu/memory_anatomy.py                     # small preset, CPU ok
    python 01-single-gpu/memory_anatomy.py --model-preset base --seq-length 1024   # a GPU

The step is chapter 01's (its `setup` and `compute_loss`, AdamW, clipping), on random
tokens: memory and time do not depend on which tokens. torch's MemTracker (a dispatch
mode that sees every tensor an operation creates) files each tensor under a category;
after every operation this script reads the running totals, so the plot is memory over
the step's operations, in the order they ran. Timing runs apart, untracked.
"""

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from common.cli import DEFAULT_SAVE_DIR, DTYPES, Parser, check_device, check_launch_one, check_run_folder, \
    one_of, positive_int, seed_value
from common.data import show_progress
from common.errors import MODEL_OOM_ADVICE, UsageError, run_main
from common.files import write_json
from common.model import PRESETS, LlamaForCausalLM, flops_per_token, get_config, non_matmul_params, \
    num_parameters, shares_kv_heads
from common.runfolder import claim_run_folder
from common.tables import markdown_table
from common.training import build_optimizer
from train_llm import compute_loss, setup

NAME = "memory-anatomy"
# MemTracker's categories (its _MemRefType values) gathered into the ones plotted
CATEGORIES = {"parameters": ("Parameter", "Buffer"), "gradients": ("Gradient",),
              "AdamW state": ("Optstate",), "activations": ("Activation",),
              "backward temporaries": ("Temp",), "other": ("Other",)}
STATE = ("parameters", "gradients", "AdamW state")
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:gray")
MiB = 2**20


def parse_args(argv=None):
    p = Parser(description="Chapter 01: one training step's memory by category, with and "
                           "without activation checkpointing.")
    p.add_argument("--model-preset", default="small", type=one_of(*PRESETS), help="model size")
    p.add_argument("--seq-length", type=positive_int, default=256, help="tokens per sample")
    p.add_argument("--batch-size", type=positive_int, default=8, help="samples per step")
    p.add_argument("--vocab-size", type=positive_int, default=8192, help="vocabulary (chapter 01's default)")
    p.add_argument("--steps", type=positive_int, default=3,
                   help="timed steps per setting (the median is reported)")
    p.add_argument("--seed", type=seed_value, default=0, help="initial weights and tokens")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", type=one_of(*DTYPES),
                   help="auto = bf16 autocast on CUDA, fp32 on CPU; bf16 = bf16 autocast")
    p.add_argument("--save-dir", default=str(DEFAULT_SAVE_DIR), help="parent of the run folder")
    p.add_argument("--experiment-name", default=None, help=f"run folder name (default: {NAME}-<timestamp>)")
    # chapter 01's setup() reads deterministic: no flag for a memory count
    p.set_defaults(deterministic=False, chapter="01-single-gpu")

    def check(args):
        check_launch_one(args)  # one process: under torchrun each rank would claim the run folder
        max_pos = PRESETS[args.model_preset]["max_position_embeddings"]
        if args.seq_length > max_pos:
            raise UsageError(f"--seq-length {args.seq_length} exceeds the {args.model_preset!r} "
                             f"preset's max_position_embeddings={max_pos}")
        check_device(args.device)
        check_run_folder(args, NAME)
    p.checks.append(check)
    return p.parse_args(argv)


# ---- the textbook -------------------------------------------------------------------

def state_bytes(num_params: int) -> dict:
    """What AdamW training holds per parameter in this guide, on every device and dtype:
    the fp32 weight (4 bytes), its fp32 gradient (4), and AdamW's two fp32 moments (8):
    16 bytes. (The ZeRO paper's mixed precision also comes to 16: 2 + 2 + 12.)"""
    return {"parameters": 4 * num_params, "gradients": 4 * num_params, "AdamW state": 8 * num_params}


def activation_bytes(config, num_params: int, batch: int, seq: int, bf16: bool, checkpointed: bool,
                     grouped_kv: bool = True, fused_norm: bool = False) -> int:
    """The bytes autograd keeps for backward when the forward pass ends, counted from
    the model's code (common/model.py) tensor by tensor. Per token of a decoder layer,
    with h the hidden size, k the width of K and V (h where they are repeated per query
    head, `grouped_kv` False), i the MLP width, H the heads, e the bytes of a matmul's
    output (4 in fp32, 2 under bf16 autocast):
      the residual stream, twice (the layer's input, and after attention), fp32: 8h
      each of the two RMSNorms keeps 1/rms and the normalised x, fp32: 8h + 8 (on CUDA,
        `fused_norm`, F.rms_norm is one kernel, whose backward needs only its input,
        already counted, and 1/rms: 8)
      the projections' inputs: the two norms' outputs, each kept once (fp32, 8h; under
        autocast the norms hand them over in bf16, 4h)
      attention: rotated q and k, v and SDPA's output (e(2h + 2k)), its logsumexp (4H)
      SwiGLU: gate, silu(gate), up and their product (4ie)
    Then the final norm (12h + 4 in fp32; 10h + 4 under autocast; 4h less fused), the
    log-softmax over the vocabulary that the cross-entropy keeps (4V: the model hands
    back fp32 logits) and the token ids (8). Autocast's bf16 copies of the matmul
    weights (2 bytes per weight) stay alive until backward has used them. Activation checkpointing keeps of each layer only
    its input (4h): the rest is computed again in backward, one layer at a time, weight
    copies included."""
    h, i, V, L = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    k = config.num_key_value_heads * config.head_dim if grouped_kv else h
    H, e = config.num_attention_heads, (2 if bf16 else 4)
    if checkpointed:
        layer = 4 * h
    else:
        norms = 8 if fused_norm else 8 * h + 8
        layer = 8 * h + norms + (4 * h if bf16 else 8 * h) + e * (2 * h + 2 * k) + 4 * H + 4 * i * e
    head = (10 * h if bf16 else 12 * h) - (4 * h if fused_norm else 0) + 4 + 4 * V + 8
    weight_copies = 0
    if bf16:
        lm_head = V * h
        layers = num_params - non_matmul_params(config) - lm_head  # the layers' projections
        weight_copies = 2 * (lm_head + (0 if checkpointed else layers))
    return batch * seq * (L * layer + head) + weight_copies


def recompute_flops_per_token(config, num_params: int, seq: int) -> int:
    """What checkpointing adds to a step's 6 FLOPs per weight (common.model.flops_per_token):
    the layers' forward once more, 2 FLOPs per layer weight plus attention's 4·L·H·Q·T."""
    layers = num_params - non_matmul_params(config) - config.vocab_size * config.hidden_size
    L, H, Q = config.num_hidden_layers, config.num_attention_heads, config.head_dim
    return 2 * layers + 4 * L * H * Q * seq


def textbook(config, num_params: int, batch: int, seq: int, device_type: str, bf16: bool) -> dict:
    """The arithmetic, in bytes and FLOPs, for the plot and the table."""
    state = state_bytes(num_params)
    grouped = shares_kv_heads(device_type, torch.bfloat16 if bf16 else torch.float32, masked=False)
    fused = device_type == "cuda"  # F.rms_norm's fused kernel (torch >= 2.9)
    tokens = batch * seq
    return {**state, "state": sum(state.values()),
            "activations_off": activation_bytes(config, num_params, batch, seq, bf16, False, grouped, fused),
            "activations_on": activation_bytes(config, num_params, batch, seq, bf16, True, grouped, fused),
            "step_flops": flops_per_token(config, num_params, seq) * tokens,
            "recompute_flops": recompute_flops_per_token(config, num_params, seq) * tokens}


# ---- the measurement ----------------------------------------------------------------

class Timeline(TorchDispatchMode):
    """After every operation, the tracker's running totals by category (on `device`),
    with the phase of the step it ran in. Entered inside the MemTracker, it sees each
    operation's result after the tracker has filed it."""

    def __init__(self, tracker: MemTracker, device: torch.device):
        super().__init__()
        self.tracker, self.device, self.phase = tracker, device, "start"
        self.samples, self.phases = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.record()
        return out

    def record(self):
        totals = dict.fromkeys(CATEGORIES, 0)
        for dev, snap in self.tracker.get_tracker_snapshot("current").items():
            if torch.device(dev).type != self.device.type:
                continue
            for key, value in snap.items():
                name = getattr(key, "value", key)
                for cat, kinds in CATEGORIES.items():
                    if name in kinds:
                        totals[cat] += value
        self.samples.append(totals)
        self.phases.append(self.phase)


def train_step(model, optimizer, x, y, autocast, timeline=None):
    """Chapter 01's step with one micro-batch: forward, backward, clip, AdamW, zero."""
    def phase(name):
        if timeline is not None:
            timeline.phase = name
    phase("forward")
    with autocast:
        loss = compute_loss(model, x, y, None) / y.numel()
    phase("backward")
    loss.backward()
    phase("update")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    phase("end")


def tracked_step(model, optimizer, x, y, autocast, device) -> Timeline:
    """One step under the MemTracker: the model's parameters and AdamW's state exist
    already (registered with track_external); everything else is created inside."""
    tracker = MemTracker()
    with warnings.catch_warnings():  # it warns about every parameter whose .grad is None
        warnings.simplefilter("ignore", UserWarning)
        tracker.track_external(model, optimizer)
    timeline = Timeline(tracker, device)
    with tracker, timeline:
        train_step(model, optimizer, x, y, autocast, timeline)
    return timeline


def clock(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()  # GPU work is asynchronous: wait before reading the clock
    return time.perf_counter()


def measure(model, optimizer, x, y, autocast, device, steps: int) -> dict:
    """Per setting (activation checkpointing off, on): the step's median time over
    `steps` untracked steps, the settings taking turns; the CUDA allocator's peak in one
    untracked step (GPUs); then one step under the tracker."""
    settings = {"off": False, "on": True}
    times = {s: [] for s in settings}
    for s, on in settings.items():  # a first step each: AdamW makes its state, kernels warm up
        model.activation_checkpointing = on
        train_step(model, optimizer, x, y, autocast)
    for _ in tqdm(range(steps), desc="timed steps (off, on)", file=sys.stderr, leave=False,
                  disable=not show_progress()):
        for s, on in settings.items():
            model.activation_checkpointing = on
            t0 = clock(device)
            train_step(model, optimizer, x, y, autocast)
            times[s].append(clock(device) - t0)
    results = {}
    for s, on in settings.items():
        model.activation_checkpointing = on
        allocator_peak = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            train_step(model, optimizer, x, y, autocast)
            allocator_peak = torch.cuda.max_memory_allocated(device)
        timeline = tracked_step(model, optimizer, x, y, autocast, device)
        results[s] = summarize(timeline, times[s], allocator_peak)
    model.activation_checkpointing = False
    return results


def summarize(timeline: Timeline, times: list, allocator_peak) -> dict:
    samples, phases = timeline.samples, timeline.phases
    totals = [sum(s.values()) for s in samples]
    peak_at = max(range(len(totals)), key=totals.__getitem__)
    # what backward starts from (autocast's cache of weight copies is gone by then)
    backward_starts = phases.index("backward")
    tracker_peak = sum(snap["Total"] for dev, snap in timeline.tracker.get_tracker_snapshot("peak").items()
                       if torch.device(dev).type == timeline.device.type)
    return {"step_s_median": statistics.median(times), "step_s": times, "tracker_peak_bytes": tracker_peak,
            "peak_bytes": totals[peak_at], "peak_phase": phases[peak_at], "peak_by_category": samples[peak_at],
            "state": {"parameters": samples[0]["parameters"], "gradients": max(s["gradients"] for s in samples),
                      "AdamW state": samples[0]["AdamW state"]},  # weights and moments held from the start
            "max_by_category": {c: max(s[c] for s in samples) for c in CATEGORIES},
            "activations_kept_for_backward": samples[backward_starts]["activations"],
            "cuda_max_allocated": allocator_peak,
            "timeline": {"phases": phases, **{c: [s[c] for s in samples] for c in CATEGORIES}}}


# ---- the report ---------------------------------------------------------------------

def report_rows(facts: dict, results: dict) -> list:
    """One row per quantity: textbook and measured, without and with checkpointing."""
    off, on, book = results["off"], results["on"], facts["textbook"]

    def mib(n):
        return f"{n / MiB:,.1f}"
    rows = [(cat, mib(book[cat]), mib(off["state"][cat]), mib(book[cat]), mib(on["state"][cat]))
            for cat in STATE]
    rows.append(("state: 16 bytes per parameter", mib(book["state"]), mib(sum(off["state"].values())),
                 mib(book["state"]), mib(sum(on["state"].values()))))
    rows.append(("activations kept for backward", mib(book["activations_off"]),
                 mib(off["activations_kept_for_backward"]), mib(book["activations_on"]),
                 mib(on["activations_kept_for_backward"])))
    rows.append(("peak of the step (MemTracker)", mib(book["state"] + book["activations_off"]),
                 f"{mib(off['peak_bytes'])} ({off['peak_phase']})", mib(book["state"] + book["activations_on"]),
                 f"{mib(on['peak_bytes'])} ({on['peak_phase']})"))
    if off["cuda_max_allocated"] is not None:
        rows.append(("peak of the step (CUDA allocator)", "", mib(off["cuda_max_allocated"]), "",
                     mib(on["cuda_max_allocated"])))
    rows.append(("operations in the step (dispatched)", "", f"{len(off['timeline']['phases']):,}", "",
                 f"{len(on['timeline']['phases']):,}"))
    rows.append(("step time, ms (median, untracked)", "", f"{off['step_s_median'] * 1e3:,.1f}", "",
                 f"{on['step_s_median'] * 1e3:,.1f}"))
    return rows


def plot(facts: dict, results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    book = facts["textbook"]
    for ax, (setting, label) in zip(axes, (("off", "without activation checkpointing"),
                                           ("on", "with activation checkpointing"))):
        tl = results[setting]["timeline"]
        xs = range(len(tl["phases"]))
        ax.stackplot(xs, *[[v / MiB for v in tl[c]] for c in CATEGORIES], labels=list(CATEGORIES),
                     colors=COLORS, alpha=0.85)
        ax.axhline(book["state"] / MiB, color="black", ls="--", lw=1, label="textbook: 16 B x parameters")
        act = book[f"activations_{setting}"]
        ax.axhline((book["state"] + act) / MiB, color="black", ls=":", lw=1,
                   label="textbook: 16 B x parameters + activations")
        start = 0
        for i in range(1, len(tl["phases"]) + 1):  # the phases as labelled bands
            if i == len(tl["phases"]) or tl["phases"][i] != tl["phases"][start]:
                if tl["phases"][start] in ("forward", "backward", "update"):
                    ax.axvline(start, color="gray", lw=0.6)
                    ax.text((start + i) / 2, 0.98, tl["phases"][start], transform=ax.get_xaxis_transform(),
                            ha="center", va="top", fontsize=8)
                start = i
        r = results[setting]
        ax.set_title(f"{label}\npeak {r['peak_bytes'] / MiB:,.0f} MiB, step "
                     f"{r['step_s_median'] * 1e3:,.0f} ms", fontsize=9)
        ax.set_xlabel("operations of one training step, in the order they ran")
    axes[0].set_ylabel("MiB of live tensors (MemTracker)")
    axes[1].legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 0.9))
    fig.suptitle(f"{facts['preset']} preset ({facts['num_params'] / 1e6:.2f} M parameters), batch "
                 f"{facts['batch_size']} x {facts['seq_length']} tokens, {facts['device_name']}, "
                 f"{facts['dtype']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    args = parse_args()
    device, dtype, autocast, _ = setup(args)
    config = get_config(args.model_preset, args.vocab_size)
    model = LlamaForCausalLM(config).to(device)
    optimizer = build_optimizer(model, 1e-4, 0.1, device)
    gen = torch.Generator().manual_seed(args.seed)
    x, y = (torch.randint(0, args.vocab_size, (args.batch_size, args.seq_length), generator=gen).to(device)
            for _ in range(2))
    n = num_parameters(model)
    facts = {"preset": args.model_preset, "num_params": n, "batch_size": args.batch_size,
             "seq_length": args.seq_length, "vocab_size": args.vocab_size, "device": device.type,
             "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
             "dtype": dtype, "load_average_before": os.getloadavg()[0],
             "textbook": textbook(config, n, args.batch_size, args.seq_length, device.type, dtype == "bf16")}
    print(f"{args.model_preset} preset, {n / 1e6:.2f} M parameters, batch {args.batch_size} x "
          f"{args.seq_length} tokens, {device.type}, {dtype}: one step tracked per setting, "
          f"{args.steps} timed", flush=True)
    # Held while it measures: a second job with this --experiment-name is refused, not
    # left to overwrite these results with its own.
    run_dir = claim_run_folder(Path(args.save_dir) / args.experiment_name)
    results = measure(model, optimizer, x, y, autocast, device, args.steps)
    write_json(run_dir / "memory_anatomy.json", {**facts, "results": results, "args": vars(args),
                                                  "torch_version": torch.__version__})
    plot(facts, results, run_dir / "memory_anatomy.png")
    off, on, book = results["off"], results["on"], facts["textbook"]
    print("\n" + markdown_table(("MiB", "textbook", "measured", "textbook, checkpointed",
                                 "measured, checkpointed"), report_rows(facts, results), right=(1, 2, 3, 4)))
    print(f"\nactivation checkpointing: peak {off['peak_bytes'] / MiB:,.1f} -> {on['peak_bytes'] / MiB:,.1f} "
          f"MiB ({100 * (1 - on['peak_bytes'] / off['peak_bytes']):.0f}% less), step "
          f"{off['step_s_median'] * 1e3:,.1f} -> {on['step_s_median'] * 1e3:,.1f} ms "
          f"({100 * (on['step_s_median'] / off['step_s_median'] - 1):+.0f}%; textbook: "
          f"{100 * book['recompute_flops'] / book['step_flops']:+.0f}% FLOPs)")
    load = max(facts["load_average_before"], os.getloadavg()[0])
    if load > (os.cpu_count() or 1):
        print(f"the machine was busy (load average up to {load:.1f} on {os.cpu_count()} cores): other "
              f"programs slowed the timed steps; the memory and the operation counts do not depend on it")
    print(f"\noutputs in {run_dir}", flush=True)


if __name__ == "__main__":
    run_main(main, MODEL_OOM_ADVICE)
