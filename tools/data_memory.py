"""Each rank's peak resident memory against the size of the corpus: the token files are
memory-mapped, so a rank's memory should not grow with the corpus.

    python -m tools.data_memory                                   # 1 M and 200 M tokens, 4 ranks
    python -m tools.data_memory --tokens 1000000 20000000 --nproc-per-node 2

For each size it writes a synthetic tokenized corpus into a scratch cache (random ids in
documents of random lengths, written by `common.data.write_token_files`, the writer a
tokenized text corpus goes through, under the cache key of a small stand-in text file),
then runs chapter 03 on it with torchrun (tiny preset, a few steps, the default
--num-workers). Every rank goes through the same path as with a real corpus whose cache
is warm: the corpus's identity, the tokenizer, the token files memory-mapped. Each rank
reads its own peak resident set (VmHWM) as it exits. The figures include the pages of
the memory-maps a rank has read: the model, the batches, and the sampler's index list
(a Python list of every sample's index) are what grows. A DataLoader worker's resident
set is followed while it runs, split into its own (anonymous) memory and the pages of
files mapped into it (the token files' pages it has read, which live in the page cache
that every process reading the file shares): the limit is on a rank's peak and on a
worker's own memory.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from common.cli import Parser, non_negative_float, positive_int
from common.data import open_corpus, token_cache_path, train_tokenizer, write_token_files
from common.errors import UsageError
from common.tables import markdown_table

REPO = Path(__file__).resolve().parents[1]
MIN_TOKENS_PER_RANK = 5_000  # see enough_tokens
STAND_IN = "A stand-in corpus: its tokens are written straight into the cache.\n"


def status_mb(field: str, pid: int | str = "self") -> float:
    """A memory figure of a process (this one by default) from /proc/PID/status (Linux),
    in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise OSError(f"no {field} in /proc/{pid}/status")


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), in MB."""
    return status_mb("VmHWM")


def current_rss_mb() -> float:
    """This process's resident set now (VmRSS), in MB."""
    return status_mb("VmRSS")


def synthetic_ids(folder: Path, tokens: int, vocab_size: int, seed: int = 0, chunk: int = 1 << 23):
    """A datasets.Dataset of `ids` (as a tokenized corpus) with about `tokens` ids in
    documents of 50 to 1,000 tokens, written chunk by chunk into `folder`."""
    import datasets
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    path = Path(folder) / "ids.arrow"
    schema = pa.schema([("ids", pa.list_(pa.int32()))])
    written = 0
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as out:
        while written < tokens:
            lengths = rng.integers(50, 1001, size=max(1, chunk // 525))
            lengths = lengths[: max(1, int(np.searchsorted(np.cumsum(lengths), tokens - written)) + 1)]
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            values = rng.integers(3, vocab_size, size=int(offsets[-1]), dtype=np.int32)  # no specials
            out.write_batch(pa.record_batch([pa.ListArray.from_arrays(offsets, values)], schema=schema))
            written += int(offsets[-1])
    return datasets.Dataset.from_file(str(path))


def synthetic_corpus(root: Path, tokens: int, vocab_size: int = 1024) -> tuple[Path, Path]:
    """(stand-in corpus file, tokenizer file) whose cache under `root/cache` holds about
    `tokens` synthetic tokens: chapter 03 given both reads exactly those."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    corpus_file, tok_file = root / "corpus.txt", root / "tokenizer.json"
    corpus_file.write_text(STAND_IN)
    if not tok_file.exists():
        texts = [p.read_text() for p in sorted((REPO / "common").glob("*.py"))]
        tok_file.write_text(train_tokenizer(texts, vocab_size).to_str())
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    corpus = open_corpus(str(corpus_file))
    write_token_files(token_cache_path(corpus, tok, root / "cache"),
                      lambda scratch: synthetic_ids(scratch, tokens, tok.get_vocab_size()),
                      tok, {"corpus": corpus.identity, "synthetic": True})
    return corpus_file, tok_file


def _workers_peak(peaks: dict, stop) -> None:
    """Poll this process's children that run the same program (its DataLoader workers,
    forked) and keep, in MB, each one's peak resident set (VmHWM) in `peaks[pid]["rss"]`
    and the largest of its own memory seen (RssAnon, polled: the kernel keeps no peak of
    it) in `peaks[pid]["anon"]`; the rest is pages of mapped files. A child counts from
    its second sighting: one that runs another program (a helper started with fork and
    exec) shows this program's name, and a copy of this process's memory, only for the
    instant before its exec."""
    me = Path("/proc/self/cmdline").read_bytes()
    seen = {}
    while not stop.wait(0.05):
        for tid in Path("/proc/self/task").iterdir():
            try:
                children = (tid / "children").read_text().split()
            except OSError:
                continue
            for pid in children:
                try:
                    if Path(f"/proc/{pid}/cmdline").read_bytes() != me:
                        continue  # a helper program, not a worker
                    seen[pid] = seen.get(pid, 0) + 1
                    if seen[pid] > 1:
                        now = {"rss": status_mb("VmHWM", pid), "anon": status_mb("RssAnon", pid)}
                        peaks[pid] = {k: max(v, peaks.get(pid, now)[k]) for k, v in now.items()}
                except OSError:
                    pass  # it ended meanwhile


def report_rank(folder: str, script: str, args: list[str]) -> None:
    """Run `script` as this rank's program, and write its peak RSS (and its DataLoader
    workers') into `folder` at exit."""
    import threading

    peaks, stop = {}, threading.Event()
    threading.Thread(target=_workers_peak, args=(peaks, stop), daemon=True).start()

    def write():
        stop.set()
        Path(folder, f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(
            {"peak_rss_mb": peak_rss_mb(),
             "workers_peak_rss_mb": max((p["rss"] for p in peaks.values()), default=0.0),
             "workers_peak_anon_mb": max((p["anon"] for p in peaks.values()), default=0.0)}))
    atexit.register(write)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def measure(tokens: int, nproc: int, root: Path, steps: int) -> list[dict]:
    """Every rank's peak RSS (and its DataLoader workers') in a chapter 03 run on a
    synthetic corpus of `tokens` tokens."""
    folder = Path(root) / f"tokens-{tokens}"
    corpus_file, tok_file = synthetic_corpus(folder, tokens)
    ranks = folder / "ranks"
    ranks.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "tools.data_memory", "--rank-report", str(ranks), "03-ddp/train_llm.py",
           "--dataset-name", str(corpus_file), "--tokenizer", str(tok_file),
           "--cache-dir", str(folder / "cache"), "--model-preset", "tiny", "--max-steps", str(steps),
           "--val-batches", "1", "--log-freq", "1", "--save-dir", str(folder / "outputs"),
           "--experiment-name", "run"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the run on {tokens:,} tokens failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    meta = json.loads(next((folder / "cache").glob("tokens-*/meta.json")).read_text())
    size_mb = sum(p.stat().st_size for p in (folder / "cache").glob("tokens-*/*.bin")) / 2**20
    return [{"tokens": meta["train"]["tokens"] + meta["val"]["tokens"], "files_mb": size_mb,
             **json.loads((ranks / f"rank-{r}.json").read_text())} for r in range(nproc)]


def existing_folder(text: str) -> str:
    """--work-dir: checked as it is parsed, not after the first measurement started."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing folder")
    return text


def enough_tokens(args) -> None:
    """Chapter 03's default global batch (8 samples of 257 tokens per rank) must fit in
    the training split, which the validation documents (5%, each up to 1,000 tokens)
    make smaller: 5,000 tokens per rank leaves room for both."""
    least = MIN_TOKENS_PER_RANK * args.nproc_per_node
    if min(args.tokens) < least:
        raise UsageError(f"--tokens {min(args.tokens):,}: at least {least:,} with "
                         f"--nproc-per-node {args.nproc_per_node} ({MIN_TOKENS_PER_RANK:,} per rank)")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-report"]:  # inside a rank, started by measure()
        return report_rank(argv[1], argv[2], argv[3:])
    p = Parser(prog="python -m tools.data_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=positive_int, nargs="+", default=[1_000_000, 200_000_000],
                   help=f"corpus sizes in tokens, each at least {MIN_TOKENS_PER_RANK:,} per rank; the first is "
                        "the baseline")
    p.add_argument("--nproc-per-node", type=positive_int, default=4, help="chapter 03's ranks")
    p.add_argument("--steps", type=positive_int, default=5, help="training steps of each run")
    p.add_argument("--limit-mb", type=non_negative_float, default=100.0,
                   help="exit 1 if any rank's peak, or a worker's own memory, grows more than this "
                        "from the baseline")
    p.add_argument("--work-dir", default=None, type=existing_folder,
                   help="an existing folder to hold the scratch folder (default: the system's "
                        "temporary folder)")
    p.checks.append(enough_tokens)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as root:
        results = [measure(t, args.nproc_per_node, Path(root), args.steps) for t in args.tokens]
    base = [r["peak_rss_mb"] for r in results[0]]
    base_workers = {k: max(r[k] for r in results[0]) for k in ("workers_peak_rss_mb", "workers_peak_anon_mb")}
    rows, worst = [], 0.0
    for res in results:
        growth = max(r["peak_rss_mb"] - b for r, b in zip(res, base))
        workers = {k: max(r[k] for r in res) for k in base_workers}
        grew = {k: workers[k] - base_workers[k] for k in workers}
        worst = max(worst, growth, grew["workers_peak_anon_mb"])
        rows.append([f"{res[0]['tokens']:,}", f"{res[0]['files_mb']:,.0f}",
                     *(f"{r['peak_rss_mb']:,.0f}" for r in res), f"{round(growth):+,}",
                     *(f"{workers[k]:,.0f}" for k in workers), *(f"{round(grew[k]):+,}" for k in workers)])
    header = ["tokens", "token files MB", *(f"rank {r} MB" for r in range(args.nproc_per_node)),
              "ranks' growth MB", "workers' peak MB", "workers' own MB", "workers' growth MB",
              "workers' own growth MB"]
    print(markdown_table(header, rows, right=range(len(header))))
    print("(a worker's peak counts the token files' pages it has read, shared page cache; its own "
          "memory (RssAnon) does not)")
    print(f"largest growth of a rank's peak RSS or a DataLoader worker's own memory over the "
          f"{results[0][0]['tokens']:,}-token run: {round(worst):+} MB (limit {args.limit_mb:.0f} MB)")
    return 0 if worst <= args.limit_mb else 1


if __name__ == "__main__":
    sys.exit(main())
