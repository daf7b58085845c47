"""How long each phase of a step takes, and the run's tokens/s.

- `PhaseTimer`: how long data / forward / backward / update take in each step. It never
  waits for the device at a phase boundary: on CUDA each boundary records an event in
  the stream, and the events are read once per logging window (`StepStats.end_window`).
- `StepStats`: the steps and the logging windows of a run. The headline tokens/s is
  uninstrumented wall time over whole windows; the phase split is an estimate (on a GPU
  the device time between boundaries, which overlaps the host's work). Both leave out
  the first `warmup` steps: allocator growth, kernel selection and caches make them
  unrepresentative.

A chapter's loop (through `common.tracker.Tracker`):

    timer, stats = PhaseTimer(device), StepStats()
    for ...:
        timer.reset()                      # a step starts
        with timer.phase("data"): ...      # likewise forward, backward, update
        stats.add(timer, tokens_per_step)  # no wait for the device
        if logging:
            window = stats.end_window()    # one wait for the device per window
            window.tokens_per_s, window.phase_s
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

PHASES = ("data", "forward", "backward", "update")


class WallClock:
    """Phase boundaries as host time: right where the work is done when a call returns
    (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def sync(self):
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """Phase boundaries as CUDA events recorded in the current stream. Recording does
    not wait: the host runs ahead and queues the next kernels. An event's time can be
    read once the device has passed it, so `seconds` is called only after `sync`."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def sync(self):
        torch.cuda.synchronize(self.device)

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3  # milliseconds


def phase_seconds(clock, marks: list[tuple[str, object, object]]) -> dict[str, float]:
    """Seconds per phase from (phase, start mark, end mark); a phase entered twice in a
    step (gradient accumulation) adds up. The clock must have been synced."""
    times = dict.fromkeys(PHASES, 0.0)
    for name, start, end in marks:
        times[name] = times.get(name, 0.0) + clock.seconds(start, end)
    return times


class PhaseTimer:
    """Marks the phases of the current step and when the open logging window began.
    `clock` defaults to CUDA events on a CUDA device, host time elsewhere."""

    def __init__(self, device: torch.device | str = "cpu", clock=None):
        cuda = torch.device(device).type == "cuda"
        self.clock = clock or (CudaEventClock(device) if cuda else WallClock())
        self.marks: list[tuple[str, object, object]] = []
        self.window_start: float | None = None

    def reset(self):
        """A step starts; so does a window, if none is open."""
        if self.window_start is None:
            self.window_start = time.perf_counter()
        self.marks = []

    @contextmanager
    def phase(self, name: str):
        start = self.clock.mark()
        try:
            yield
        finally:
            self.marks.append((name, start, self.clock.mark()))

    @property
    def times(self) -> dict[str, float]:
        """This step's seconds per phase. On CUDA this waits for the device: once per
        logged step at most (`StepStats.end_window` reads a whole window with one wait)."""
        self.clock.sync()
        return phase_seconds(self.clock, self.marks)

    def end_window(self) -> float:
        """Wall seconds since the window began, after the device has finished the
        window's work (the one wait); the next `reset` opens a new window."""
        self.clock.sync()
        start, self.window_start = self.window_start, None
        return 0.0 if start is None else time.perf_counter() - start


@dataclass
class Window:
    """The steps between two logs: wall time and the mean phase split of a step."""
    steps: int
    tokens: int
    wall_s: float
    phase_s: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


class StepStats:
    """Per-step phase times and token counts, and the logging windows' wall times.

    `add(timer, tokens)` keeps the step's marks unread; `end_window()` reads them all
    with one wait for the device and times the window. `add(times_dict, tokens)` (phase
    seconds already read) still works; without windows, tokens/s falls back to the sum
    of phase times."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.steps: list[tuple[dict, int]] = []
        self.windows: list[tuple[int, Window]] = []   # (index of its first step, window)
        self.timer: PhaseTimer | None = None
        self.unread: list[tuple[dict, list]] = []     # (times to fill in, marks)
        self.window_first = 0                         # index of the open window's first step

    def add(self, timer_or_times, tokens: int):
        if isinstance(timer_or_times, PhaseTimer):
            self.timer, times = timer_or_times, {}
            self.unread.append((times, timer_or_times.marks))
        else:
            times = dict(timer_or_times)
        self.steps.append((times, tokens))
        if self.timer is not None and len(self.steps) == self.warmup:
            self.end_window()  # one extra wait, so that no window mixes warm-up and measured steps

    def read_times(self, synced: bool = False):
        """Fill in the phase times of steps added from the timer (waits for the device
        unless it was just synced)."""
        if self.unread:
            if not synced:
                self.timer.clock.sync()
            for times, marks in self.unread:
                times.update(phase_seconds(self.timer.clock, marks))
            self.unread = []

    def end_window(self) -> Window:
        """Close the window of steps added since the last call: its wall time (one wait
        for the device) and mean phase times. Call it at every logged step and after
        the last step: steps of a window never closed count in the phase split only."""
        steps = self.steps[self.window_first:]
        if not steps and self.windows:
            return self.windows[-1][1]  # closed already, at the end of the warm-up
        if self.timer is None:          # steps added as dicts: no wall time, phase sums
            return Window(len(steps), sum(n for _, n in steps),
                          sum(sum(t.values()) for t, _ in steps), mean_times(steps))
        wall = self.timer.end_window()
        self.read_times(synced=True)
        window = Window(len(steps), sum(n for _, n in steps), wall, mean_times(steps))
        if steps:
            self.windows.append((self.window_first, window))
        self.window_first = len(self.steps)
        return window

    def measured(self):
        # leave warm-up steps out, unless that would leave nothing
        self.read_times()
        return self.steps[self.warmup:] if len(self.steps) > self.warmup else self.steps

    def measured_windows(self) -> list[Window]:
        """Windows that hold no warm-up step, unless that would leave nothing."""
        late = [w for first, w in self.windows if first >= self.warmup]
        return late or [w for _, w in self.windows]

    def mean_phase_times(self) -> dict:
        out = mean_times(self.measured())
        out["total"] = sum(out.values())
        return out

    def wall_time_per_step(self) -> float:
        """Mean wall seconds of a measured step; the phase sum when no window closed."""
        windows = self.measured_windows()
        steps = sum(w.steps for w in windows)
        if steps:
            return sum(w.wall_s for w in windows) / steps
        return self.mean_phase_times()["total"]

    def tokens_per_s(self) -> float:
        windows = self.measured_windows()
        if windows:
            wall = sum(w.wall_s for w in windows)
            return sum(w.tokens for w in windows) / wall if wall > 0 else 0.0
        steps = self.measured()
        total_time = sum(sum(t.values()) for t, _ in steps)
        return sum(n for _, n in steps) / total_time if total_time > 0 else 0.0


def mean_times(steps: list[tuple[dict, int]]) -> dict[str, float]:
    """Mean seconds per phase over (times, tokens) steps; zeros for no steps."""
    if not steps:
        return dict.fromkeys(PHASES, 0.0)
    return {p: sum(t.get(p, 0.0) for t, _ in steps) / len(steps) for p in PHASES}
