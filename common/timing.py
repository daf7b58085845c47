"""Phase timers and the run's tokens/s, without waiting for the device at each phase:
on CUDA a boundary records an event, and the events are read once per logging window.
Tokens/s is the wall time of whole windows; the phase split is an estimate (device time
between boundaries). Both leave out the first `warmup` steps (allocator growth, kernel
selection)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

PHASES = ("data", "forward", "backward", "update")


class WallClock:
    """Phase boundaries as host time: where the work is done when a call returns (CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def sync(self):
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaEventClock:
    """Phase boundaries as CUDA events in the current stream. Recording does not wait: the
    host runs ahead and queues the next kernels; an event is read only after `sync`."""

    def __init__(self, device):
        self.device = torch.device(device)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def sync(self):
        torch.cuda.synchronize(self.device)

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3  # milliseconds


def phase_seconds(clock, marks) -> dict[str, float]:
    """Seconds per phase from (phase, start mark, end mark), after a sync; a phase entered
    twice in a step (gradient accumulation) adds up."""
    times = dict.fromkeys(PHASES, 0.0)
    for name, start, end in marks:
        times[name] = times.get(name, 0.0) + clock.seconds(start, end)
    return times


class PhaseTimer:
    """Marks the phases of the current step and when the open logging window began."""

    def __init__(self, device="cpu", clock=None):
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

    def end_window(self) -> float:
        """Wall seconds since the window began, after the device finished its work (the
        window's one wait); the next `reset` opens a new window."""
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
    """The run's steps (phase times, tokens) and logging windows. A step's marks stay
    unread until `end_window()` reads them all with one wait for the device."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.steps: list[tuple[dict, int]] = []
        self.windows: list[tuple[int, Window]] = []   # (index of its first step, window)
        self.timer: PhaseTimer | None = None
        self.unread: list[tuple[dict, list]] = []     # (times to fill in, marks)
        self.window_first = 0

    def add(self, timer: PhaseTimer, tokens: int):
        self.timer, times = timer, {}
        self.unread.append((times, timer.marks))
        self.steps.append((times, tokens))
        if len(self.steps) == self.warmup:
            self.end_window()  # one extra wait: no window mixes warm-up and measured steps

    def read_times(self, synced: bool = False):
        if self.unread:
            if not synced:
                self.timer.clock.sync()
            for times, marks in self.unread:
                times.update(phase_seconds(self.timer.clock, marks))
            self.unread = []

    def end_window(self) -> Window:
        """Close the window of the steps added since the last call: its wall time and
        mean phase times."""
        steps = self.steps[self.window_first:]
        if not steps:
            # closed already at the end of the warm-up, or no step at all
            return self.windows[-1][1] if self.windows else Window(0, 0, 0.0, mean_times(steps))
        wall = self.timer.end_window()
        self.read_times(synced=True)
        window = Window(len(steps), sum(n for _, n in steps), wall, mean_times(steps))
        self.windows.append((self.window_first, window))
        self.window_first = len(self.steps)
        return window

    def measured(self):
        """The steps after the warm-up, unless that would leave none."""
        self.read_times()
        return self.steps[self.warmup:] if len(self.steps) > self.warmup else self.steps

    def measured_windows(self) -> list[Window]:
        late = [w for first, w in self.windows if first >= self.warmup]
        return late or [w for _, w in self.windows]

    def mean_phase_times(self) -> dict:
        out = mean_times(self.measured())
        out["total"] = sum(out.values())
        return out

    def wall_time_per_step(self) -> float:
        windows = self.measured_windows()
        steps = sum(w.steps for w in windows)
        return sum(w.wall_s for w in windows) / steps if steps else 0.0

    def tokens_per_s(self) -> float:
        windows = self.measured_windows()
        wall = sum(w.wall_s for w in windows)
        return sum(w.tokens for w in windows) / wall if wall > 0 else 0.0


def mean_times(steps) -> dict[str, float]:
    """Mean seconds per phase over (times, tokens) steps; zeros for no steps."""
    if not steps:
        return dict.fromkeys(PHASES, 0.0)
    return {p: sum(t.get(p, 0.0) for t, _ in steps) / len(steps) for p in PHASES}
