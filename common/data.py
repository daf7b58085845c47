"""Corpus, tokenizer and the two dataset forms (packed and padded).

Corpora (`--dataset-name`):
  stdlib            the Python standard library's own source files, one document per
                    file: real text that every machine with Python has, offline.
  a local path      a file, folder or glob of .txt / .md / .py / .jsonl files, read by
                    `datasets`' local builders ("text" one document per file, "json").
  a hub id          anything else, through `datasets.load_dataset` (optional subset and
                    text column), e.g. roneneldan/TinyStories.

The tokenizer is a byte-level BPE trained with `tokenizers` on the corpus and cached as
JSON; the tokenized corpus is cached with `save_to_disk`. Both are keyed by the corpus's
identity, so the second run of any chapter starts in seconds.

Everything raises `DataError` with a one-line message; `local_rank0_first` turns it into
exit status 2.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import os
import shutil
import socket
import sys
import sysconfig
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from .distributed import first_error, patient_group
from .errors import fail

PAD, BOT, EOT = "[PAD]", "[BOT]", "[EOT]"
SPECIAL_TOKENS = [PAD, BOT, EOT]
DEFAULT_VOCAB_SIZE = 8192
LOCAL_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
IGNORE_INDEX = -100  # targets the loss skips (padding)


class DataError(Exception):
    """A data problem the user can fix; its message is one line."""


@contextmanager
def quiet_datasets():
    """No `datasets` progress bars for steps that take well under a second."""
    import datasets

    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


def default_cache_dir() -> Path:
    """Where tokenizers and tokenized corpora are cached (LLM_GUIDE_CACHE overrides)."""
    env = os.environ.get("LLM_GUIDE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "llm-guide"


# --------------------------------------------------------------------------- corpus

class Corpus:
    """A corpus's name, its identity (changes whenever the text could have changed: the
    caches' key), and its text as a datasets.Dataset with a "text" column, built on first
    use: once the tokenizer and the tokenized corpus are cached, a run never reads it."""

    def __init__(self, name: str, identity: str, dataset=None, load=None):
        self.name, self.identity, self._dataset, self._load = name, identity, dataset, load

    @property
    def dataset(self):
        if self._dataset is None:
            self._dataset = self._load()
        return self._dataset

    @dataset.setter
    def dataset(self, value):
        self._dataset = value


def stdlib_files() -> list[Path]:
    """The standard library's .py files, without site-packages and its test suites."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files)


def _stdlib_corpus() -> Corpus:
    import datasets

    files = stdlib_files()
    if not files:
        raise DataError(f"no Python standard library sources found under "
                        f"{sysconfig.get_paths()['stdlib']}; use a local path or a hub id")
    size = sum(p.stat().st_size for p in files)  # the identity, without reading the text
    identity = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-{len(files)}-{size}b"

    def load():
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        return datasets.Dataset.from_dict({"text": [t for t in texts if t.strip()]})
    return Corpus("stdlib", identity, load=load)


def looks_local(name: str) -> bool:
    """A path or glob rather than a hub id (hub ids are `owner/name` or `name`)."""
    return (os.path.exists(name) or any(c in name for c in "*?[")
            or name.startswith((".", "/", "~")) or name.endswith(LOCAL_SUFFIXES))


def local_files(name: str) -> list[str]:
    """Files a local dataset name refers to; DataError if there are none."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        files = [str(p) for p in sorted(Path(path).rglob("*"))
                 if p.is_file() and p.suffix in LOCAL_SUFFIXES]
    elif os.path.isfile(path):
        files = [path]
    else:
        files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"local dataset {name!r} does not exist")
    files = [f for f in files if f.endswith(LOCAL_SUFFIXES)]
    if not files:
        raise DataError(f"local dataset {name!r} holds no {'/'.join(LOCAL_SUFFIXES)} files")
    kinds = {"json" if f.endswith(".jsonl") else "text" for f in files}
    if len(kinds) > 1:
        raise DataError(f"local dataset {name!r} mixes .jsonl with text files; use one kind")
    return files


def _local_corpus(name: str, text_column: str) -> Corpus:
    import datasets

    files = local_files(name)
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    if files[0].endswith(".jsonl"):
        ds = datasets.load_dataset("json", data_files=files, split="train")
        if text_column not in ds.column_names:
            raise DataError(f"{name!r} has no column {text_column!r} (columns: "
                            f"{', '.join(ds.column_names)}); pass --text-column")
        ds = ds.select_columns([text_column]).rename_column(text_column, "text") \
            if text_column != "text" else ds.select_columns(["text"])
    else:
        # one document per file, like the stdlib corpus
        ds = datasets.load_dataset("text", data_files=files, split="train", sample_by="document")
    return Corpus(name, f"local-{h.hexdigest()[:16]}", ds)


def hub_reachable(timeout: float = 5.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
        socket.create_connection((url.hostname, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def _hub_corpus(name: str, subset: str | None, text_column: str) -> Corpus:
    import datasets

    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
    # Fail at once rather than after the hub client's retries.
    if not offline and not hub_reachable():
        raise DataError(f"cannot reach the Hugging Face hub to load {name!r}; use "
                        f"--dataset-name stdlib or a local path (or HF_HUB_OFFLINE=1 "
                        f"if it is already in your cache)")
    try:
        ds = datasets.load_dataset(name, subset, split="train")
    except Exception as e:  # the hub client raises many types; one line for all
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"could not load {name!r} from the hub: {msg}") from None
    if text_column not in ds.column_names:
        raise DataError(f"{name!r} has no column {text_column!r} (columns: "
                        f"{', '.join(ds.column_names)}); pass --text-column")
    ds = ds.select_columns([text_column])
    if text_column != "text":
        ds = ds.rename_column(text_column, "text")
    return Corpus(name, f"hub-{name}-{subset}-{ds._fingerprint}", ds)


def check_dataset_name(name: str) -> None:
    """Cheap checks that need no loading (run before any work)."""
    if not name:
        raise DataError("--dataset-name is empty")
    if name != "stdlib" and looks_local(name):
        local_files(name)


def load_corpus(name: str, subset: str | None = None, text_column: str = "text") -> Corpus:
    check_dataset_name(name)
    if name == "stdlib":
        return _stdlib_corpus()  # text files of Python's own: read only when needed
    if looks_local(name):
        try:
            corpus = _local_corpus(name, text_column)
        except DataError:
            raise
        except Exception as e:  # datasets' builders: not text, not JSON lines, ...
            cause = e.__cause__ or e
            first = str(cause).strip().splitlines()[0][:160] if str(cause).strip() else ""
            raise DataError(f"could not read {name!r} as text or JSON lines "
                            f"({type(cause).__name__}: {first})") from None
    else:
        corpus = _hub_corpus(name, subset, text_column)
    bad = next((t for t in corpus.dataset[:1000]["text"] if t is not None and not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"column {text_column!r} of {name!r} holds {type(bad).__name__} values "
                        f"(e.g. {bad!r}), not text; pick the text column with --text-column")
    with quiet_datasets():  # a fast filter needs no bar
        corpus.dataset = corpus.dataset.filter(
            lambda b: [bool(t and t.strip()) for t in b["text"]], batched=True)
    if len(corpus.dataset) == 0:
        raise DataError(f"dataset {name!r} is empty (no non-blank documents)")
    return corpus


# ----------------------------------------------------------------------- tokenizer

def _atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def train_tokenizer(texts, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Byte-level BPE: every byte is in the alphabet, so no text is ever unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # the trainer's own progress bars, where someone watches: training takes ~15 s here
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=show_progress())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | os.PathLike):
    from tokenizers import Tokenizer

    if not os.path.isfile(path):
        raise DataError(f"tokenizer file {str(path)!r} does not exist")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise DataError(f"{str(path)!r} is not a tokenizers JSON file: {e}") from None
    missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise DataError(f"tokenizer {str(path)!r} lacks special tokens {missing}")
    return tok


def get_tokenizer(corpus: Corpus, vocab_size: int = DEFAULT_VOCAB_SIZE,
                  cache_dir: Path | None = None, tokenizer_path: str | None = None):
    """An existing tokenizer (tokenizer_path), the cached one for this corpus and
    vocabulary size, or a new one trained now and cached."""
    if tokenizer_path:
        return load_tokenizer(tokenizer_path), str(tokenizer_path)
    cache_dir = Path(cache_dir or default_cache_dir())
    key = hashlib.sha256(f"{corpus.identity}|{vocab_size}".encode()).hexdigest()[:16]
    path = cache_dir / f"tokenizer-{key}.json"
    if path.exists():
        return load_tokenizer(path), str(path)
    tok = train_tokenizer((corpus.dataset[i:i + 1000]["text"]
                           for i in range(0, len(corpus.dataset), 1000)), vocab_size)
    _atomic_write_text(path, tok.to_str())
    return tok, str(path)


def special_ids(tok) -> dict[str, int]:
    return {"pad": tok.token_to_id(PAD), "bot": tok.token_to_id(BOT), "eot": tok.token_to_id(EOT)}


# ----------------------------------------------------------------- tokenize once

def tokenize_corpus(corpus: Corpus, tok, cache_dir: Path | None = None):
    """A datasets.Dataset with one `ids` list per document (no special tokens), made
    once with a batched `map` and reused from disk afterwards."""

    cache_dir = Path(cache_dir or default_cache_dir())
    tok_hash = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]
    key = hashlib.sha256(f"{corpus.identity}|{tok_hash}".encode()).hexdigest()[:16]
    path = cache_dir / f"tokenized-{key}"
    if (path / "dataset_info.json").exists():
        return _load_cached(path)

    def encode(batch):
        return {"ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

    ds = corpus.dataset.map(encode, batched=True, batch_size=256,
                            remove_columns=corpus.dataset.column_names,
                            desc=f"tokenizing {corpus.name}")
    # Write beside the final place and rename: a killed run leaves no half cache.
    tmp = cache_dir / f".tmp-{key}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp))
    try:
        os.replace(tmp, path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_cached(path)


def _load_cached(path: Path):
    """The tokenized corpus from the cache; a damaged one is a one-line DataError."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"the tokenized cache {path} cannot be read ({type(e).__name__}); delete "
                        f"it (rm -r {path}) and run again to rebuild it") from None


def split_documents(tokenized, val_fraction: float = 0.05, split_seed: int = 0):
    """Train/validation split by document, fixed by split_seed (not the training seed),
    so every run and every chapter validates on the same documents."""
    n = len(tokenized)
    if n < 2:
        return tokenized, tokenized.select([]).flatten_indices()
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed)).tolist()
    # flatten_indices: materialise the selection, so .data holds only these rows
    with quiet_datasets():
        return (tokenized.select(sorted(perm[n_val:])).flatten_indices(),
                tokenized.select(sorted(perm[:n_val])).flatten_indices())


# ------------------------------------------------------------------ dataset forms

def _documents(tokenized) -> tuple[np.ndarray, np.ndarray]:
    """(every document's ids end to end, each document's length), read straight from
    the Arrow column: no Python list per document."""
    import pyarrow.compute as pc

    if tokenized._indices is not None:  # a selection not yet materialised
        with quiet_datasets():
            tokenized = tokenized.flatten_indices()
    col = tokenized.data.column("ids")
    flat = pc.list_flatten(col).to_numpy().astype(np.int32, copy=False)
    return flat, pc.list_value_length(col).to_numpy().astype(np.int64, copy=False)


class PackedDataset(torch.utils.data.Dataset):
    """Documents joined with [EOT] into one token stream, cut into windows of
    seq_len + 1 tokens with stride seq_len: inputs are window[:-1], targets window[1:].
    Consecutive windows share one token, so every token but the first is a target
    exactly once. No padding anywhere, so attention needs no mask tensor."""

    def __init__(self, tokenized, seq_len: int, eot_id: int):
        self.seq_len = seq_len
        flat, lengths = _documents(tokenized)
        # an [EOT] after every document: inserted at each document's end offset
        self.tokens = torch.from_numpy(np.insert(flat, np.cumsum(lengths), eot_id))
        self.num_tokens = len(self.tokens)

    def __len__(self):
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        w = self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1].long()
        return w[:-1], w[1:]


class PaddedDataset(torch.utils.data.Dataset):
    """One document per sample: [BOT] + tokens + [EOT], clipped or right-padded with
    [PAD] to seq_len + 1. Targets at pad positions are IGNORE_INDEX (the loss skips
    them); attention needs a key-padding mask (masks.build_attention_mask)."""

    def __init__(self, tokenized, seq_len: int, bot_id: int, eot_id: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        rows = np.full((len(tokenized), seq_len + 1), pad_id, dtype=np.int32)
        for r, ids in enumerate(tokenized["ids"]):
            doc = [bot_id, *ids[:seq_len], eot_id][:seq_len + 1]
            rows[r, :len(doc)] = doc
        self.rows = torch.from_numpy(rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        w = self.rows[i].long()
        x, y = w[:-1], w[1:].clone()
        y[y == self.pad_id] = IGNORE_INDEX
        return x, y


@dataclass
class Data:
    train: torch.utils.data.Dataset
    val: torch.utils.data.Dataset
    tokenizer: object
    tokenizer_path: str
    vocab_size: int
    pad_id: int
    bot_id: int
    eot_id: int
    packed: bool
    corpus_name: str
    num_documents: int
    fingerprint: str  # of the corpus and the tokenizer: a checkpoint resumes only the same


def build_datasets(dataset_name: str = "stdlib", seq_len: int = 256, packed: bool = True,
                   vocab_size: int = DEFAULT_VOCAB_SIZE, tokenizer_path: str | None = None,
                   subset: str | None = None, text_column: str = "text",
                   cache_dir: Path | None = None, val_fraction: float = 0.05) -> Data:
    """Corpus -> tokenizer -> tokenized (cached) -> train/val datasets of one form."""
    if seq_len < 1:
        raise DataError(f"sequence length must be at least 1 (got {seq_len})")
    corpus = load_corpus(dataset_name, subset, text_column)
    tok, tok_path = get_tokenizer(corpus, vocab_size, cache_dir, tokenizer_path)
    ids = special_ids(tok)
    tokenized = tokenize_corpus(corpus, tok, cache_dir)
    train_docs, val_docs = split_documents(tokenized, val_fraction)
    if packed:
        train = PackedDataset(train_docs, seq_len, ids["eot"])
        val = PackedDataset(val_docs, seq_len, ids["eot"])
    else:
        train = PaddedDataset(train_docs, seq_len, ids["bot"], ids["eot"], ids["pad"])
        val = PaddedDataset(val_docs, seq_len, ids["bot"], ids["eot"], ids["pad"])
    if len(train) == 0:
        raise DataError(f"dataset {dataset_name!r} is too small for one sample of "
                        f"{seq_len + 1} tokens")
    fingerprint = hashlib.sha256(f"{corpus.identity}|{tok.to_str()}".encode()).hexdigest()[:16]
    return Data(train, val, tok, tok_path, tok.get_vocab_size(), ids["pad"], ids["bot"],
                ids["eot"], packed, dataset_name, len(tokenized), fingerprint)


def check_enough_samples(dataset, global_batch: int, what: str = "training") -> None:
    if len(dataset) < global_batch:
        raise DataError(f"the {what} set has {len(dataset)} samples, fewer than one global "
                        f"batch of {global_batch}; lower --batch-size or --seq-length")


def dataset_info(data: Data) -> dict:
    return {"dataset": data.corpus_name, "documents": data.num_documents,
            "train_samples": len(data.train), "val_samples": len(data.val),
            "form": "packed" if data.packed else "padded", "vocab_size": data.vocab_size,
            "tokenizer": data.tokenizer_path, "fingerprint": data.fingerprint}


__all__ = ["DataError", "Corpus", "Data", "PackedDataset", "PaddedDataset", "build_datasets",
           "check_dataset_name", "check_enough_samples", "dataset_info", "default_cache_dir",
           "get_tokenizer", "load_corpus", "load_tokenizer", "looks_local", "local_files",
           "special_ids", "split_documents", "stdlib_files", "tokenize_corpus",
           "train_tokenizer", "IGNORE_INDEX", "PAD", "BOT", "EOT", "SPECIAL_TOKENS"]


def local_rank0_first(load, errors=(DataError,)):
    """Run `load()` (it trains the tokenizer and tokenizes once, into the cache) and
    return its result; a DataError stops the run with one line and exit status 2.
    Under torchrun, local rank 0 of every machine goes first and fills its machine's
    cache, then the other ranks read it (machines need not share a disk), and an error
    on any rank stops every rank with that message instead of leaving peers waiting."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    result, group = None, patient_group()  # waits for the data are not bounded by --timeout
    for turn in (0, 1):  # turn 0: local rank 0 of each machine; turn 1: the others
        error = None
        if (local_rank == 0) == (turn == 0):
            try:
                result = load()
            except errors as e:
                error = str(e)
        error = first_error(error, group)
        if error:
            fail(error)
    return result


def fixed_batches(dataset_name: str, seq_len: int, batch_size: int, count: int, seed: int,
                  rank: int, world: int, device) -> tuple[Data, list]:
    """`count` packed training batches of this rank's shard of one shared shuffle (the
    DistributedSampler order of chapter 03), loaded onto `device` before any timing, for
    the chapter 05 scripts that run several methods on the very same data."""
    def build():
        data = build_datasets(dataset_name, seq_len, packed=True)
        check_enough_samples(data.train, batch_size * world)
        return data
    data = local_rank0_first(build)
    sampler = DistributedSampler(data.train, num_replicas=world, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    loader = DataLoader(data.train, batch_size=batch_size, sampler=sampler, drop_last=True)
    batches, epoch = [], 0
    while len(batches) < count:
        sampler.set_epoch(epoch)
        batches += [(x.to(device), y.to(device)) for x, y in itertools.islice(loader, count - len(batches))]
        epoch += 1
    return data, batches


def show_progress() -> bool:
    """Progress bars for long quiet work: in a terminal, or when the tour asks for them
    (LLM_GUIDE_PROGRESS=1: it shows its children's output in a terminal through a pipe)."""
    return os.environ.get("LLM_GUIDE_PROGRESS") == "1" or sys.stderr.isatty()
