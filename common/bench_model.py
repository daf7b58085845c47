"""Forward + backward throughput of the model presets on this machine.

    python -m common.bench_model                       # tiny and small, cuda if present
    python -m common.bench_model --presets base --batch-size 16 --seq-length 1024

Each preset runs a few warm-up steps (allocator, kernel selection), then `--iters`
timed steps of forward, cross-entropy loss and backward on random tokens; the table
reports the median step as tokens/s, and MFU where the device's peak is known. No
optimizer step: this measures the model alone. On CUDA it uses bf16 autocast, as the
chapters do by default; on CPU fp32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from .data import DEFAULT_VOCAB_SIZE
from .metrics import device_name, markdown_table
from .model import PRESETS, LlamaForCausalLM, flops_per_token, get_config, mfu, num_parameters


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_preset(preset: str, batch_size: int, seq_len: int, iters: int, warmup: int,
                 device: torch.device, vocab_size: int) -> dict:
    config = get_config(preset, vocab_size)
    seq_len = min(seq_len, config.max_position_embeddings)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    n_params = num_parameters(model)
    ids = torch.randint(0, vocab_size, (batch_size, seq_len + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]
    use_bf16 = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().view(-1, vocab_size), y.reshape(-1))
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    tokens_per_s = batch_size * seq_len / median
    fpt = flops_per_token(config, n_params, seq_len)
    return {"preset": preset, "params": n_params, "batch": batch_size, "seq": seq_len,
            "step_s": median, "tokens_per_s": tokens_per_s,
            "mfu": mfu(tokens_per_s, fpt, device_name(device)),
            "tflops": tokens_per_s * fpt / 1e12}


def table(rows: list[dict]) -> str:
    header = ["preset", "params", "batch×seq", "median step", "tokens/s", "TFLOP/s", "MFU"]
    body = [[r["preset"], f"{r['params'] / 1e6:.2f} M", f"{r['batch']}×{r['seq']}",
             f"{r['step_s'] * 1e3:,.1f} ms", f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.3f}",
             "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"] for r in rows]
    return markdown_table(header, body, right=range(1, len(header)))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m common.bench_model",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "small"], choices=list(PRESETS))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=256,
                   help="tokens per sample (capped at the preset's max_position_embeddings)")
    p.add_argument("--iters", type=int, default=5, help="timed steps (the median is reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--device", default="auto",
                   help="auto (cuda if available, else cpu), cpu, cuda:N")
    args = p.parse_args(argv)
    for name in ("batch_size", "seq_length", "iters", "vocab_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must not be negative")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here")

    print(f"device: {device_name(device)}; dtype: "
          f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}; torch {torch.__version__}"
          f" ({torch.get_num_threads()} threads); forward+backward, median of {args.iters}"
          f" steps after {args.warmup} warm-up", flush=True)
    rows = [bench_preset(preset, args.batch_size, args.seq_length, args.iters, args.warmup,
                         device, args.vocab_size) for preset in args.presets]
    print(table(rows))


if __name__ == "__main__":
    main()
