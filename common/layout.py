"""How chapter 06 lays out its ranks, world = dp x pp x tp, and the one rule of which
splits fit a model and a batch. The training script, its proof, its measurements and
`python -m tools.plan` all ask `layout_for` (or `every_layout`), so the rule is written
here only."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError
from .model import LlamaConfig

SCHEDULES = ("gpipe", "1f1b")
APIS = ("scratch", "torch")


@dataclass(frozen=True)
class Layout:
    """dp replicas of a model that is cut into pp pipeline stages of tp tensor-parallel
    ranks each. The pipeline cuts each replica's batch into `microbatches` and runs them
    in the order of `schedule`; `api` says who builds the split: this chapter's own
    modules ("scratch") or torch's ("torch")."""
    dp: int = 1
    pp: int = 1
    tp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    api: str = "scratch"

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def name(self) -> str:
        """For example dp2xpp2-1f1b-torch: the splits above 1, the schedule where there is
        a pipeline, then the API."""
        splits = "x".join(f"{k}{getattr(self, k)}" for k in ("dp", "pp", "tp") if getattr(self, k) > 1)
        return "-".join([splits or "dp1", *([self.schedule] if self.pp > 1 else []), self.api])


def vocabulary_rows(vocab_size: int, tp: int, rank: int) -> int:
    """The rows of the vocabulary that tp rank `rank` holds: ceil(vocab / tp) each, the
    last ranks fewer (torch.chunk's split, which DTensor's Shard uses too)."""
    per = -(-vocab_size // tp)
    return max(0, min(vocab_size - rank * per, per))


def check_vocabulary(vocab_size: int, tp: int) -> None:
    """Every tp rank must hold rows of the vocabulary (the embedding and the head are
    split by rows). Raises UsageError."""
    if vocabulary_rows(vocab_size, tp, tp - 1) == 0:
        raise UsageError(f"a vocabulary of {vocab_size} leaves tp rank {tp - 1} of {tp} no rows of it: "
                         f"each rank holds ceil(vocabulary / tp) rows")


def layout_for(world: int, config: LlamaConfig, batch_size: int, *, tp: int = 1, pp: int = 1,
               microbatches: int | None = None, schedule: str = "1f1b", api: str = "scratch",
               model: str = "the model's") -> Layout:
    """The layout of `world` ranks split --tp and --pp ways, each replica's batch of
    `batch_size` samples cut into `microbatches` (by default one sample each when there
    is a pipeline, else the whole batch), checked against `config`. Raises UsageError
    naming the first thing that does not fit; `model` names the model in that line."""
    layout = _fitting(world, config, batch_size, tp, pp, microbatches, schedule, api, model)
    check_vocabulary(config.vocab_size, tp)
    return layout


def _fitting(world, config, batch_size, tp, pp, microbatches, schedule, api, model) -> Layout:
    """layout_for's checks of the model's shape, the world and the batch."""
    for n, what in ((config.num_attention_heads, "attention heads"), (config.num_key_value_heads, "KV heads"),
                    (config.intermediate_size, "MLP features")):
        if n % tp:  # tp above the KV heads fails here too: each rank needs KV heads of its own
            raise UsageError(f"--tp {tp} does not divide {model} {n} {what}")
    if pp > config.num_hidden_layers:
        raise UsageError(f"--pp {pp} exceeds {model} {config.num_hidden_layers} layers: a stage needs one at least")
    if world % (tp * pp):
        raise UsageError(f"the world size {world} is not a multiple of --tp {tp} x --pp {pp}: data "
                         f"parallelism takes world / (tp x pp) replicas")
    m = microbatches or (batch_size if pp > 1 else 1)
    if batch_size % m:
        raise UsageError(f"--microbatches {m} does not divide the batch of {batch_size} per replica")
    if api == "torch" and schedule == "1f1b" and m < pp:
        raise UsageError(f"torch's Schedule1F1B needs --microbatches >= --pp ({m} < {pp})")
    return Layout(world // (tp * pp), pp, tp, m, schedule, api)


def every_layout(world: int, config: LlamaConfig, global_batch: int) -> list[Layout]:
    """Every layout of `world` ranks that splits the model (tp or pp above 1, dp beside
    them), from scratch and with torch's APIs, each pipeline in both schedules with one
    sample per micro-batch (the most micro-batches: the most reordering). Each replica
    takes global_batch / dp samples. A layout that fits but for the vocabulary raises
    UsageError: the vocabulary is the caller's to change."""
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            dp = world // (tp * pp)
            if world % (tp * pp) or tp * pp == 1 or global_batch % dp:
                continue
            for api in APIS:
                for schedule in SCHEDULES if pp > 1 else ("1f1b",):
                    try:
                        layout = _fitting(world, config, global_batch // dp, tp, pp, None, schedule, api,
                                          "the model's")
                    except UsageError:
                        continue  # this split does not fit the model or the batch
                    check_vocabulary(config.vocab_size, tp)
                    out.append(layout)
    return out
