"""Not a test: run by tests/test_ch06_pipeline.py with torchrun (4 ranks), this records the
order of every rank's point-to-point operations in chapter 06's from-scratch Pipeline:
each call of dist.batch_isend_irecv (and of a blocking dist.send or dist.recv, were the
pipeline to make one) as a batch of ("send", peer) and ("recv", peer). Pipelines of 2, 3
and 4 stages (the first p ranks; the others wait) run each schedule for several
micro-batch counts on a tiny stand-in model; rank r writes `p2p-<r>.json` into the
output folder: {"<schedule> p<p> m<m>": [batch, ...]}.

    torchrun --nproc-per-node=4 tests/ch06_p2p_order.py <folder of pipeline_parallel.py> <output folder>
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, sys.argv[1])  # the chapter's folder, or a copy of it with a bug in it
from pipeline_parallel import Pipeline  # noqa: E402

HIDDEN, VOCAB, TOKENS = 4, 5, 2
RECORD = []


def recorded(kind_of, real):
    """`real`, each call recorded as one batch first."""
    def call(ops, *args, **kwargs):
        RECORD.append([[kind_of(op), op.peer] for op in ops])
        return real(ops, *args, **kwargs)
    return call


dist.batch_isend_irecv = recorded(lambda op: "send" if op.op is dist.isend else "recv", dist.batch_isend_irecv)
for name in ("send", "recv"):
    real = getattr(dist, name)
    setattr(dist, name, lambda tensor, peer, *a, name=name, real=real, **k: (
        RECORD.append([[name, peer]]), real(tensor, peer, *a, **k))[1])


class Stage(nn.Module):
    """A stand-in stage: token ids in on the first stage, logits out on the last."""

    def __init__(self, first: bool, last: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN) if first else None
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB) if last else None

    def forward(self, x, mask=None):
        x = self.body(self.embed(x) if self.embed is not None else x)
        return self.head(x) if self.head is not None else x


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    out = {}
    for p in (2, 3, 4):
        for schedule in ("gpipe", "1f1b"):
            for m in (1, 2, 3, 5):
                if rank < p:
                    torch.manual_seed(0)
                    pipeline = Pipeline(Stage(rank == 0, rank == p - 1), stage=rank, stages=p,
                                        prev_rank=rank - 1 if rank else None,
                                        next_rank=rank + 1 if rank < p - 1 else None, schedule=schedule,
                                        hidden_size=HIDDEN, dtype=torch.float32, device=torch.device("cpu"))
                    ids = torch.randint(0, VOCAB, (m, TOKENS + 1))
                    RECORD.clear()
                    pipeline.step(list(zip(ids[:, :-1].chunk(m), ids[:, 1:].chunk(m), [None] * m)),
                                  lambda logits, y: nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
                    out[f"{schedule} p{p} m{m}"] = list(RECORD)
                dist.barrier()
    Path(sys.argv[2], f"p2p-{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
