"""Stopping cleanly (chapter 04): Ctrl-C and a scheduler's SIGTERM.

- `crash_once`: chapter 04's fault injection.
- `StopRequest`: chapter 04's handlers for SIGINT/SIGTERM that only take note; the
  training loop asks `agreed()` after every step, and all ranks stop at the same step.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

class StopRequest:
    """SIGINT (Ctrl-C) and SIGTERM (schedulers, torchrun passing one on) set a flag
    instead of ending the process mid-step."""

    def __init__(self):
        self.signal = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)
        # The ranks agree over a CPU (gloo) group: on GPUs that costs no device sync.
        self.group = (dist.new_group(backend="gloo")
                      if dist.is_initialized() and dist.get_backend() != "gloo" else None)

    def _note(self, signum, frame):
        self.signal = self.signal or signal.Signals(signum).name

    def leave(self, step: int, checkpoint: Path):
        """After the checkpoint: one line (rank 0), leave the group, exit 128 + signal."""
        if int(os.environ.get("RANK") or 0) == 0:
            print(f"\ninterrupted at step {step} ({self.signal or 'a signal to another rank'}); "
                  f"checkpoint {Path(checkpoint).name} saved; run the same command to resume "
                  f"(with --experiment-name {Path(checkpoint).parent.parent.name})",
                  file=sys.stderr, flush=True)
        if dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()
        sys.exit(128 + getattr(signal.Signals, self.signal or "SIGTERM"))

    def agreed(self) -> str | None:
        """The signal's name once any rank got one, on every rank at the same step (a
        collective when distributed), else None."""
        if not dist.is_initialized():
            return self.signal
        flag = torch.tensor([self.signal is not None], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return (self.signal or "a signal to another rank") if flag.item() else None


def crash_once(run_dir, step: int, crash_at_step: int | None, this_rank: bool):
    """Fault injection (--crash-at-step): `this_rank` raises after step `crash_at_step`,
    once per run folder (a marker file remembers it), so a restarted run goes on."""
    marker = Path(run_dir) / f"crash-injected-at-step-{step}"
    if step == crash_at_step and this_rank and not marker.exists():
        marker.touch()
        raise RuntimeError(f"injected crash after step {step} (--crash-at-step)")
