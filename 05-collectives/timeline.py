"""Reading a profiler trace of one training step (05-collectives/overlap_timeline.py);
not the lesson itself.

- `read_step`: from one rank's Chrome trace (what `torch.profiler` exports), the step's
  phases (the `record_function` ranges forward, backward, sync, optimizer), its
  collectives as they really ran (gloo: the `gloo:*` ranges on gloo's own threads; nccl:
  the nccl kernels on their stream) and the computation (ATen operators on the other
  threads; on a GPU, the other kernels), all in ms from the start of the step.
- `overlap`: how much of the collectives' time ran while backward was computing.
- `merge_traces`: the ranks' traces as one Chrome trace, one process per rank, for
  Perfetto (https://ui.perfetto.dev) or chrome://tracing.
- `table`: the modes' figures side by side; `plot`: one lane pair per rank (phases;
  collectives), one panel per mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.tables import markdown_table

STEP = "step"  # the record_function range around the traced step
PHASES = ("forward", "backward", "sync", "optimizer")  # the ranges inside it
PHASE_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "sync": "tab:gray",
                "optimizer": "tab:green"}

Interval = tuple[float, float]


def union(intervals) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same time."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        elif e > s:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def intersection(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The time covered by both of two unions."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def length(intervals) -> float:
    return sum(e - s for s, e in intervals)


@dataclass
class RankStep:
    """One rank's traced step; times in ms from the step's start."""
    rank: int
    step_ms: float
    phases: list[tuple[str, float, float]]       # (name, start, end)
    collectives: list[tuple[str, float, float]]  # (name, start, end), as they ran
    compute: dict[str, list[Interval]] = field(default_factory=dict)  # phase -> union

    @property
    def collective_ms(self) -> float:
        return length(union((s, e) for _, s, e in self.collectives))

    def overlapped(self) -> list[Interval]:
        """The collective time during which backward was computing."""
        return intersection(union((s, e) for _, s, e in self.collectives), self.compute.get("backward", []))

    def as_dict(self) -> dict:
        return {"rank": self.rank, "step_ms": self.step_ms, "phases": self.phases,
                "collectives": self.collectives, "compute": self.compute,
                "collective_ms": self.collective_ms,
                "overlapped_with_backward_ms": length(self.overlapped())}


def _end(e) -> float:
    return e["ts"] + e.get("dur", 0.0)


def _inside(e, ranges) -> bool:
    return any(s <= e["ts"] and _end(e) <= end for s, end in ranges)


def _phase_at(t: float, phases) -> str | None:
    return next((name for name, s, e in phases if s <= t < e), None)


def collective_name(name: str) -> str:
    """'gloo:all_reduce' -> 'all_reduce'; 'ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)'
    -> 'AllReduce'."""
    if name.startswith("gloo:"):
        return name[5:]
    if "nccl" in name.lower():
        parts = name.split("(")[0].split("_")
        return parts[1] if len(parts) > 1 else parts[0]
    return name


def read_step(trace: dict, rank: int = 0) -> RankStep:
    """One rank's step from its Chrome trace (the JSON `export_chrome_trace` writes).

    Collectives, as the profiler records them: on CPUs, gloo runs each collective on one
    of its own threads ("pt_gloo_runloop") inside a `gloo:<name>` range, from the moment
    the thread starts it (it may first wait for the other ranks) until it completes (so
    on GPUs too, with LLM_GUIDE_BACKEND=gloo); on GPUs, nccl runs each as a kernel on its
    own stream. Computation: ATen operators on
    any other thread, except those inside a `c10d::` call (a collective's own copies);
    on GPUs, the kernels that are not nccl's. Each is charged to the phase it started in
    (a GPU kernel: the phase that launched it)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "ts" in e]
    steps = [e for e in events if e["name"] == STEP and e.get("cat") == "user_annotation"]
    if not steps:
        raise ValueError(f"no '{STEP}' range in the trace: was the step run inside record_function('{STEP}')?")
    step = steps[-1]
    t0, t1 = step["ts"], _end(step)
    ms = lambda t: (t - t0) / 1e3  # noqa: E731  (trace times are in microseconds)
    in_step = [e for e in events if t0 <= e["ts"] <= t1]
    phases = sorted(((e["name"], ms(e["ts"]), ms(_end(e))) for e in in_step
                     if e.get("cat") == "user_annotation" and e["name"] in PHASES), key=lambda p: p[1])
    kernels = [e for e in events if e.get("cat") == "kernel"]
    comm_threads = {e["tid"] for e in events if e["name"].startswith("gloo:")}
    compute: dict[str, list[Interval]] = {}
    if kernels:  # CUDA: nccl kernels vs the rest, each charged to the phase that launched it
        launched = {e["args"]["correlation"]: e["ts"] for e in events
                    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        collectives, ops = [], []
        for k in kernels:
            launch = launched.get(k.get("args", {}).get("correlation"))
            if launch is None or not t0 <= launch <= t1:
                continue
            if "nccl" in k["name"].lower():
                collectives.append((collective_name(k["name"]), ms(k["ts"]), ms(_end(k))))
            else:
                ops.append((_phase_at(ms(launch), phases), ms(k["ts"]), ms(_end(k))))
    else:  # CPU: ATen operators on the threads that are not gloo's
        c10d = {}
        for e in in_step:
            if e["name"].startswith("c10d::"):
                c10d.setdefault(e["tid"], []).append((e["ts"], _end(e)))
        ops = [(_phase_at(ms(e["ts"]), phases), ms(e["ts"]), ms(_end(e))) for e in in_step
               if e.get("cat") == "cpu_op" and e["name"].startswith("aten::")
               and e["tid"] not in comm_threads and not _inside(e, c10d.get(e["tid"], []))]
    if comm_threads:  # gloo, on CPUs or on GPUs (LLM_GUIDE_BACKEND=gloo): its ranges on its threads
        collectives = [(collective_name(e["name"]), ms(e["ts"]), ms(_end(e))) for e in in_step
                       if e["name"].startswith("gloo:")]
    for phase in PHASES:
        compute[phase] = union((s, e) for p, s, e in ops if p == phase)
    return RankStep(rank, ms(t1), phases, sorted(collectives, key=lambda c: c[1]), compute)


def overlap(ranks: list[RankStep]) -> dict:
    """A mode's figures over all its ranks: collective time (each rank's collectives,
    their union, summed over ranks), the part of it during backward's computation, and
    the fraction."""
    total = sum(r.collective_ms for r in ranks)
    during = sum(length(r.overlapped()) for r in ranks)
    return {"collectives": sum(len(r.collectives) for r in ranks) / len(ranks),
            "collective_ms": total / len(ranks), "overlapped_with_backward_ms": during / len(ranks),
            "overlap_fraction": during / total if total else 0.0,
            "step_ms": max(r.step_ms for r in ranks)}


COLUMNS = ("mode", "collectives/rank", "collective ms", "during backward compute ms", "overlap",
           "step ms")


def table(figures: dict) -> str:
    """`overlap` of every mode (a dict mode -> figures), as a Markdown table."""
    rows = [(m, f"{f['collectives']:g}", f"{f['collective_ms']:,.1f}", f"{f['overlapped_with_backward_ms']:,.1f}",
             f"{f['overlap_fraction']:.0%}", f"{f['step_ms']:,.1f}") for m, f in figures.items()]
    return markdown_table(COLUMNS, rows, right=range(1, len(COLUMNS)))


def merge_traces(traces: list[dict]) -> dict:
    """The ranks' Chrome traces as one: each rank's processes (CPU, GPU) renamed
    "rank r ...", and its clock shifted so that its step starts at 0."""
    merged = []
    for rank, trace in enumerate(traces):
        events = trace["traceEvents"]
        step = [e for e in events if e.get("name") == STEP and e.get("cat") == "user_annotation"]
        shift = step[-1]["ts"] if step else 0.0
        pids: dict = {}
        for e in events:
            if "pid" not in e or isinstance(e["pid"], str):
                continue  # the profiler's own "Spans" track
            e = dict(e)
            new_pid = pids.setdefault(e["pid"], rank * 100 + len(pids))
            e["pid"] = new_pid
            if "ts" in e:
                e["ts"] = e["ts"] - shift
            if e.get("ph") == "M" and e["name"] == "process_name":
                e["args"] = {"name": f"rank {rank}: {e['args'].get('name', '')}"}
            if e.get("ph") == "M" and e["name"] == "process_sort_index":
                e["args"] = {"sort_index": new_pid}
            merged.append(e)
    return {"traceEvents": merged, "displayTimeUnit": "ms"}


OVERLAP_MEANS = ("%: the share of a mode's collective time (every kind listed, all-gathers too) during which "
                 "the same rank's backward was computing;\n    a collective the rank waits for overlaps "
                 "nothing, even inside the backward bar")


def panel_title(mode: str, ranks: list[RankStep]) -> str:
    """A mode's figures, naming the collectives its percentage counts (as the trace names
    them: gloo's reduce-scatter is an all_reduce)."""
    f = overlap(ranks)
    kinds = ", ".join(sorted({name for r in ranks for name, _, _ in r.collectives})) or "none"
    return (f"{mode}: {f['overlap_fraction']:.0%} of {f['collective_ms']:,.1f} ms of collectives ({kinds}) "
            f"ran while backward computed; step {f['step_ms']:,.1f} ms")


def plot(modes: dict[str, list[RankStep]], path, title: str, notes=()) -> None:
    """One panel per mode, two lanes per rank: the phases of its main thread, and its
    collectives (darker where backward was computing meanwhile). Below, in the legend,
    what the percentage counts and `notes` (a line each)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    world = max(len(r) for r in modes.values())
    lines = [OVERLAP_MEANS, *notes]  # text only, under the panels
    below = 0.1 + 0.14 * sum(line.count("\n") + 1 for line in lines)  # inches they take
    fig, axes = plt.subplots(len(modes), 1, sharex=True, squeeze=False,
                             figsize=(11, 0.9 + below + (0.45 + 0.42 * world) * len(modes)))
    for ax, (mode, ranks) in zip(axes[:, 0], modes.items()):
        labels = []
        for r in ranks:
            y = 2 * (world - 1 - r.rank)
            for name, s, e in r.phases:
                ax.broken_barh([(s, e - s)], (y + 1.05, 0.8), color=PHASE_COLORS[name])
            ax.broken_barh([(s, e - s) for _, s, e in r.collectives], (y + 0.1, 0.8),
                           color="tab:red", alpha=0.35, edgecolor="tab:red", linewidth=0.4)
            ax.broken_barh([(s, e - s) for s, e in r.overlapped()], (y + 0.1, 0.8), color="darkred")
            labels += [(y + 0.5, f"rank {r.rank} comm"), (y + 1.45, f"rank {r.rank} main")]
        ys, names = zip(*sorted(labels))
        ax.set_yticks(ys, names, fontsize=7)
        ax.set_ylim(0, 2 * world)
        ax.set_title(panel_title(mode, ranks), fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("ms since the step began (each rank's own clock, after a barrier)")
    handles = [Patch(color=c, label=n) for n, c in PHASE_COLORS.items()]
    handles += [Patch(color="tab:red", alpha=0.35, label="collective"),
                Patch(color="darkred", label="collective during backward compute")]
    height = fig.get_figheight()
    fig.suptitle(title, fontsize=9, x=0.01, y=0.995, ha="left")
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.01, 1 - 0.25 / height),
               ncol=6, fontsize=7, frameon=False)
    fig.legend(handles=[Patch(color="none", label=line) for line in lines], loc="lower left",
               bbox_to_anchor=(0.01, 0.0), fontsize=7, frameon=False, handlelength=0, handletextpad=0)
    fig.tight_layout(rect=(0, below / height, 1, 1 - 0.55 / height))  # room for the legends
    fig.savefig(path, dpi=110)
    plt.close(fig)
