"""The chapters in reading order: the one list that the tour, the tests and the README's
chapter table follow. A new chapter is its folder (a `train_llm.py` and a README), and one
line here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chapter:
    folder: str                  # "03-ddp"
    launcher: str                # "python" (one process) or "torchrun" (one per device)
    builds_on: str | None        # the chapter whose train_llm.py its README's diff is against
    diff_budget: int | None      # at most this many changed lines in that diff (the lesson's wiring)
    tour_flags: tuple[str, ...] = ()  # what the tour adds to the shared flags of train_llm.py

    @property
    def number(self) -> str:
        return self.folder[:2]

    def command(self, nproc: str = "N") -> str:
        """How its README launches train_llm.py."""
        if self.launcher == "python":
            return f"python {self.folder}/train_llm.py"
        return f"torchrun --standalone --nproc-per-node={nproc} {self.folder}/train_llm.py"


CHAPTERS = (
    Chapter("01-single-gpu", "python", None, None),
    Chapter("02-data-parallel", "python", "01-single-gpu", 60),  # a detour: 03 builds on 01
    Chapter("03-ddp", "torchrun", "01-single-gpu", 140),
    Chapter("04-checkpointing", "torchrun", "03-ddp", 160),
    Chapter("05-collectives", "torchrun", None, None),  # scripts, one per mechanism
    Chapter("06-model-parallel", "torchrun", "03-ddp", 260, tour_flags=("--pp", "2")),
    Chapter("07-3d-parallelism", "torchrun", "06-model-parallel", 380, tour_flags=("--tp", "2")),
    Chapter("08-context-parallel", "torchrun", "07-3d-parallelism", 125, tour_flags=("--cp", "2")),
)
BY_FOLDER = {c.folder: c for c in CHAPTERS}
