"""Where a training step's time goes, read from `torch.profiler`: what bounds its MFU.

`profile_step` runs a step function a few times under the profiler and sorts the time
of what ran into kinds: the matrix multiplications, attention, the optimizer (with
gradient clipping: everything inside a `record_function("optimizer")` range), and the
rest (elementwise work, norms, softmax and cross-entropy, copies). On CUDA the time is
the kernels' own time on the device, and what is left of the step is time the GPU sat
idle, waiting for the host to launch work; on a CPU it is each operator's own time on
the calling thread. The matmuls' and attention's FLOP/s inside their own kernels say
whether those kernels are slow or just a small part of the step.
`python -m tools.bench_model --profile` prints it and saves it with the benchmark.
"""

from __future__ import annotations

import re

import torch
from torch.autograd import DeviceType
from torch.profiler import profile

from common.demos import profiler_activities
from common.tables import format_flops, markdown_table

OPTIMIZER = "optimizer"  # the record_function range around clipping, step and zero_grad
KINDS = ("matmul", "attention", "optimizer", "other")
# By name: cuBLAS/CUTLASS kernels (gemm, xmma, nvjet), inductor's matmul templates
# (..._mm), ATen's mm/addmm/bmm on a CPU; flash / memory-efficient / cuDNN attention.
ATTENTION = re.compile(r"flash|fmha|attention|scaled_dot_product|sdpa", re.I)
MATMUL = re.compile(r"gemm|matmul|cutlass|xmma|nvjet|cublas|(?<![a-z])(add|b)?mm(?![a-z])", re.I)
ADAM = re.compile(r"adam", re.I)  # the fused AdamW kernel, should its launch go unrecorded


def kind_of(name: str, in_optimizer: bool) -> str:
    """The kind of an operator or kernel, by where it ran or else by its name."""
    if in_optimizer or ADAM.search(name):
        return "optimizer"
    if ATTENTION.search(name):
        return "attention"
    return "matmul" if MATMUL.search(name) else "other"


def _inside(event, name: str) -> bool:
    parent = event
    while parent is not None:
        if parent.name == name:
            return True
        parent = parent.cpu_parent
    return False


def work_by_name(events, cuda: bool) -> dict[str, list]:
    """{name: [calls, seconds, seconds of them inside the optimizer range]} of what did
    work. On a CPU: each operator's own time (its children's taken out), inside the range
    or not. On CUDA: every kernel (and copy) the device ran; a name's optimizer seconds
    are its share of launches that came from host operators inside the range (a kernel
    is linked to its host operator only where one was recording: counted, not required)."""
    work: dict[str, list] = {}
    launched_in_optimizer: dict[str, int] = {}
    for e in events:
        if cuda and e.device_type == DeviceType.CUDA:
            # A record_function range shows on the device too (a "gpu_user_annotation" as
            # long as the kernels it launched): no work of its own, and counted it would
            # count those kernels twice (the optimizer range, torch.compile's regions).
            if getattr(e, "is_user_annotation", False):
                continue
            entry = work.setdefault(e.name, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time_total / 1e6
        elif e.device_type == DeviceType.CPU:
            inside = _inside(e, OPTIMIZER)
            if cuda:
                for k in e.kernels if inside else ():
                    launched_in_optimizer[k.name] = launched_in_optimizer.get(k.name, 0) + 1
            else:
                entry = work.setdefault(e.name, [0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += e.self_cpu_time_total / 1e6
                entry[2] += e.self_cpu_time_total / 1e6 if inside else 0.0
    for name, n in launched_in_optimizer.items():
        if name in work:
            work[name][2] = work[name][1] * min(1.0, n / work[name][0])
    return work


def profile_step(step, device: torch.device, steps: int, step_s: float, matmul_flops: float,
                 attention_flops: float, top: int = 8) -> dict:
    """Profile `steps` calls of `step` (already warmed up) and say per step where the
    time went. `step_s` is the step's time measured without the profiler (the profiled
    calls run slower: every operator is recorded); `matmul_flops` and `attention_flops`
    are the model FLOPs of one step in each (common.model.flops_per_token's two terms)."""
    cuda = device.type == "cuda"
    activities = profiler_activities(device)
    if cuda:
        torch.cuda.synchronize(device)
    # one profiling cycle: acc_events only spares the warning that later cycles would drop it
    with profile(activities=activities, acc_events=True) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    seconds = dict.fromkeys(KINDS, 0.0)
    rows = []
    for name, (calls, s, in_optimizer) in work_by_name(prof.events(), cuda).items():
        seconds["optimizer"] += in_optimizer / steps
        seconds[kind_of(name, in_optimizer=False)] += (s - in_optimizer) / steps
        rows.append({"name": name, "kind": kind_of(name, in_optimizer > s / 2),
                     "calls_per_step": calls / steps, "s": s / steps})
    busy = sum(seconds.values())
    return {
        "profiled_steps": steps, "step_s": step_s, "busy_s": busy,
        "seconds": seconds, "idle_s": max(0.0, step_s - busy),
        "matmul_flops_per_s": matmul_flops / seconds["matmul"] if seconds["matmul"] else None,
        "attention_flops_per_s": attention_flops / seconds["attention"] if seconds["attention"] else None,
        "busiest": sorted(rows, key=lambda r: -r["s"])[:top],
    }


def table(rows: list[dict], peak_flops: float) -> str:
    """One line per profiled step: each kind's share of the step, idle time, and the
    FLOP/s the matmul and attention kernels reached while they ran."""
    def share(p, s):
        return f"{100 * s / max(p['step_s'], p['busy_s']):.0f}%"

    def rate(v):
        return "-" if v is None else f"{format_flops(v)} ({100 * v / peak_flops:.0f}%)"
    body = [[r["preset"], r["mode"], f"{r['profile']['step_s'] * 1e3:,.1f} ms",
             *(share(r["profile"], r["profile"]["seconds"][k]) for k in KINDS),
             share(r["profile"], r["profile"]["idle_s"]),
             rate(r["profile"]["matmul_flops_per_s"]), rate(r["profile"]["attention_flops_per_s"])]
            for r in rows]
    return markdown_table(["preset", "mode", "step", *KINDS, "idle", "matmul kernels", "attention kernels"],
                          body, right=set(range(2, 10)))
