"""The parts of a training run every chapter shares unchanged (chapter 01's README walks
through each): the optimizer, the learning-rate schedule, validation and a text sample."""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .data import IGNORE_INDEX
from .masks import build_attention_mask


def build_optimizer(model, lr: float, weight_decay: float, device) -> torch.optim.AdamW:
    """AdamW with betas (0.9, 0.95), no weight decay on the 1-D norm weights; fused on
    CUDA (a few kernels for the whole update; on a CPU the update costs little)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=torch.device(device).type == "cuda")


def lr_lambda(warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warmup to the peak, then cosine decay that reaches min_ratio × peak after
    the last step (f(step) is the factor of the optimizer step after `step` are done)."""
    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


@torch.no_grad()
def evaluate(model, loader, data, device, autocast, max_batches: int):
    """(mean loss per target token, batches evaluated) over at most max_batches; under a
    process group each rank evaluates its own loader and the sums are all-reduced."""
    model.eval()
    total, count, batches = 0.0, 0, 0
    for x, y in itertools.islice(loader, max_batches):
        x, y = x.to(device), y.to(device)
        mask = None if data.packed else build_attention_mask(x, data.pad_id)
        with autocast:
            logits = model(x, mask)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=IGNORE_INDEX)
        n = int((y != IGNORE_INDEX).sum())
        total, count, batches = total + loss.item() * n, count + n, batches + 1
    if dist.is_initialized():
        sums = torch.tensor([total, count, batches], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        total, count, batches = sums[0].item(), int(sums[1].item()), int(sums[2].item())
    model.train()
    return (total / count if count else None), batches


@torch.no_grad()
def sample(model, data, device, autocast, seed: int, prompt: str = "def ", max_new_tokens: int = 48) -> str:
    """What the model writes after `prompt` (seeded: the same text in every run); a padded
    model's documents start with the BOT token."""
    ids = ([] if data.packed else [data.bot_id]) + data.tokenizer.encode(prompt).ids
    model.eval()
    with autocast:
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                             generator=torch.Generator(device).manual_seed(seed), eos_id=data.eot_id)
    return data.tokenizer.decode(out[0].tolist())
