"""Corpus, tokenizer, token files and the two dataset forms (packed and padded).

`--dataset-name` is `stdlib` (the standard library's .py files: offline), a local file,
folder or glob of .txt/.md/.py/.jsonl files, or a hub id. The tokenizer and the token
files are cached under the corpus's identity: a second run never reads the text.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import sysconfig
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch

from .distributed import patient_group, stop_on_any_error
from .errors import UsageError
from .files import atomic_write, fsync_dir, fsync_write, one_line

PAD, BOT, EOT = "[PAD]", "[BOT]", "[EOT]"
SPECIAL_TOKENS = [PAD, BOT, EOT]
DEFAULT_VOCAB_SIZE = 8192
LOCAL_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
IGNORE_INDEX = -100  # targets the loss skips (padding)
VAL_FRACTION = 0.05  # the share of documents set aside for validation
TOKEN_FORMAT = 1  # bump when the token files' layout changes: old caches are then ignored


class DataError(UsageError):
    """A data problem the user can fix: one line, exit status 2."""


def import_datasets():
    """`datasets` (imported late: a second), its bars only where watched, its logs muted."""
    import datasets

    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    (datasets.enable_progress_bars if show_progress() else datasets.disable_progress_bars)()
    return datasets


def default_cache_dir() -> Path:
    """Where tokenizers and tokenized corpora are cached (LLM_GUIDE_CACHE overrides)."""
    env = os.environ.get("LLM_GUIDE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llm-guide"


class Corpus:
    """A corpus's name, identity (the caches' key: it changes whenever the text could) and
    text (`dataset`), read on first use."""

    def __init__(self, name: str, identity: str, load):
        self.name, self.identity, self._load = name, identity, load

    @cached_property
    def dataset(self):
        return self._load()


def stdlib_files() -> list[Path]:
    """The standard library's .py files but tests and installed packages (never entered)."""
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [d for d in subfolders if d not in skip]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def _stdlib_corpus() -> Corpus:
    files = stdlib_files()
    if not files:
        raise DataError(f"no Python standard library sources found under "
                        f"{sysconfig.get_paths()['stdlib']}; use a local path or a hub id")
    size = sum(p.stat().st_size for p in files)  # the identity, without reading the text
    identity = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-{len(files)}-{size}b"

    def load():
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        return import_datasets().Dataset.from_dict({"text": [t for t in texts if t.strip()]})
    return Corpus("stdlib", identity, load)


def looks_local(name: str) -> bool:
    """A path or glob rather than a hub id (`owner/name` or `name`: one slash, not last)."""
    return (os.path.exists(name) or any(c in name for c in "*?[") or name.count("/") > 1
            or name.startswith((".", "/", "~")) or name.endswith((*LOCAL_SUFFIXES, "/")))


def local_files(name: str) -> list[str]:
    """Files a local dataset name refers to; DataError if there are none."""
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        files = [str(p) for p in sorted(Path(path).rglob("*")) if p.is_file()]
    elif os.path.isfile(path):
        files = [path]
    else:
        matches = glob.glob(path, recursive=True)
        files = sorted(f for f in matches if os.path.isfile(f))
        if not files and (os.path.exists(path) or matches):  # never opened: reading could block
            raise DataError(f"local dataset {name!r} is not a regular file or a folder (a FIFO, socket "
                            f"or device is not read); name a file, folder or glob of files")
        if not files:
            raise DataError(f"local dataset {name!r} does not exist")
    files = [f for f in files if f.endswith(LOCAL_SUFFIXES)]
    if not files:
        raise DataError(f"local dataset {name!r} holds no {'/'.join(LOCAL_SUFFIXES)} files")
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"dataset {name!r} is empty (no non-blank documents: its "
                        f"{'file is' if len(files) == 1 else f'{len(files)} files are'} empty)")
    if len({f.endswith(".jsonl") for f in files}) > 1:
        raise DataError(f"local dataset {name!r} mixes .jsonl with text files; use one kind")
    return files


def _local_corpus(name: str, text_column: str) -> Corpus:
    files = local_files(name)
    jsonl = files[0].endswith(".jsonl")
    # one document per file, like stdlib; but a lone text file is cut at its blank lines,
    # so that the split (whole documents) can set some of it aside for validation
    sample_by = "paragraph" if len(files) == 1 and not jsonl else "document"
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    identity = f"local-{h.hexdigest()[:16]}" + ("-paragraphs" if sample_by == "paragraph" else "")

    def load():
        load_dataset = import_datasets().load_dataset  # its "Downloading data" bar copies the files
        try:
            ds = (_text_column(name, load_dataset("json", data_files=files, split="train"), text_column)
                  if jsonl else load_dataset("text", data_files=files, split="train", sample_by=sample_by))
            return _checked(name, ds, text_column)  # invalid UTF-8 inside a JSON string fails here
        except DataError:
            raise
        except Exception as e:  # datasets' builders and pyarrow: not text, not JSON lines, ...
            bad = next((f for f in files if not _readable(f)), name)  # datasets' errors name no file
            raise DataError(f"could not read {bad!r} as text or JSON lines ({one_line(e.__cause__ or e)})") from None
    return Corpus(name, identity, load)


def _readable(path: str) -> bool:
    """Whether a file is UTF-8 text (a .jsonl: a JSON value a line)."""
    try:
        for line in Path(path).read_text(encoding="utf-8").split("\n"):
            if path.endswith(".jsonl") and line.strip():
                json.loads(line)
        return True
    except (OSError, ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError
        return False


def _text_column(name: str, ds, text_column: str):
    """`ds` with only its `text_column`, named "text"; DataError if it has none."""
    if text_column not in ds.column_names:
        raise DataError(f"{name!r} has no column {text_column!r} (columns: "
                        f"{', '.join(ds.column_names)}); pass --text-column")
    ds = ds.select_columns([text_column])
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def _hub_corpus(name: str, subset: str | None, text_column: str) -> Corpus:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:  # fail at once rather than after the hub client's retries
        if os.environ.get("HF_HUB_OFFLINE") != "1" and os.environ.get("HF_DATASETS_OFFLINE") != "1":
            socket.create_connection((url.hostname, url.port or (80 if url.scheme == "http" else 443)), 5).close()
    except OSError:
        raise DataError(f"cannot reach the Hugging Face hub to load {name!r} (nor is it a local "
                        f"path here); use --dataset-name stdlib or a local path (or HF_HUB_OFFLINE=1 "
                        f"if it is already in your cache)") from None
    try:
        ds = import_datasets().load_dataset(name, subset, split="train")
    except Exception as e:  # the hub client raises many types; one line for all
        raise DataError(f"could not load {name!r} from the hub: {one_line(e)}") from None
    ds = _text_column(name, ds, text_column)
    return Corpus(name, f"hub-{name}-{subset}-{ds._fingerprint}", lambda: _checked(name, ds, text_column))


def check_dataset_name(name: str) -> None:
    """Cheap checks that need no loading (run before any work)."""
    if not name:
        raise DataError("--dataset-name is empty")
    if name != "stdlib" and looks_local(name):
        local_files(name)


def open_corpus(name: str, subset: str | None = None, text_column: str = "text") -> Corpus:
    """The corpus: its identity now, its text (blank documents dropped) on first use."""
    check_dataset_name(name)
    if name == "stdlib":
        return _stdlib_corpus()
    return _local_corpus(name, text_column) if looks_local(name) else _hub_corpus(name, subset, text_column)


def _checked(name: str, dataset, text_column: str):
    """The text column checked for strings, blank documents dropped, not empty."""
    bad = next((t for t in dataset[:1000]["text"] if t is not None and not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"column {text_column!r} of {name!r} holds {type(bad).__name__} values "
                        f"(e.g. {bad!r}), not text; pick the text column with --text-column")
    dataset = dataset.filter(lambda b: [bool(t and t.strip()) for t in b["text"]], batched=True)
    if len(dataset) == 0:
        raise DataError(f"dataset {name!r} is empty (no non-blank documents)")
    return dataset


def cache_unwritable(folder: Path, e: OSError) -> DataError:
    """The one line for a cache folder that takes no file (read-only, full, not a folder)."""
    if Path(folder).exists() and not Path(folder).is_dir():
        return DataError(f"the cache folder {folder} is a file, not a folder; point --cache-dir "
                         f"(or $LLM_GUIDE_CACHE) at a folder")
    return DataError(f"the cache folder {folder} cannot be written ({e.strerror or type(e).__name__}); "
                     f"free space there, or point --cache-dir (or $LLM_GUIDE_CACHE) at a writable folder")


# BPE training takes a run of characters without whitespace as one word, and its time grows
# with the square of a word's length: a 300,000-character line of minified JSON or base64
# took minutes, a 3 MB one hours. Such runs are cut into pieces this long for the training
# (the tokenized corpus keeps them whole); no token worth learning is longer.
LONGEST_WORD = 1000
LONG_RUN = re.compile(rf"\S{{{LONGEST_WORD + 1},}}")


def long_runs_cut(batches, cuts: list[int]):
    """Each batch of texts for the tokenizer's training, every run of more than
    LONGEST_WORD characters without whitespace cut into pieces, each a text of its own
    (a space would add a token that was not in the text). Counts the runs in cuts[0]."""
    for texts in batches:
        out = []
        for text in texts:
            start = 0
            for run in LONG_RUN.finditer(text):
                out.append(text[start:run.start()])
                out += [run[0][i:i + LONGEST_WORD] for i in range(0, len(run[0]), LONGEST_WORD)]
                start, cuts[0] = run.end(), cuts[0] + 1
            out.append(text[start:] if start else text)
        yield out


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
        raise DataError(f"tokenizer file {str(path)!r} " + ("is a folder, not a tokenizers JSON file"
                                                          if os.path.isdir(path) else "does not exist"))
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
    """(tokenizer, path): `tokenizer_path`'s, the one cached for this corpus and size, or a new one."""
    if tokenizer_path:
        return load_tokenizer(tokenizer_path), str(tokenizer_path)
    key = hashlib.sha256(f"{corpus.identity}|{vocab_size}".encode()).hexdigest()[:16]
    path = Path(cache_dir or default_cache_dir()) / f"tokenizer-{key}.json"
    if path.exists():
        return load_tokenizer(path), str(path)
    cuts = [0]
    tok = train_tokenizer(long_runs_cut((corpus.dataset[i:i + 1000]["text"]
                                         for i in range(0, len(corpus.dataset), 1000)), cuts), vocab_size)
    if cuts[0]:
        logging.getLogger(__name__).info(
            "the tokenizer's training cut %d run(s) of more than %d characters without whitespace (minified "
            "JSON, base64, ...) into pieces of %d: BPE's time grows with the square of a word's length; the "
            "corpus itself is tokenized whole", cuts[0], LONGEST_WORD, LONGEST_WORD)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(tok.to_str().encode()))
    except OSError as e:
        raise cache_unwritable(path.parent, e) from None
    return tok, str(path)


def token_dtype(vocab_size: int) -> np.dtype:
    """2 bytes a token where every id fits (vocabularies up to 65,536), else 4."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def tokenize_corpus(corpus: Corpus, tok, scratch: Path | None = None):
    """A datasets.Dataset of one `ids` list per document (`encode_batch` uses every core;
    its `_fast` form in tokenizers 0.20+ gives the same ids without character offsets, for
    a third less CPU). A corpus read from files is tokenized into `scratch`."""
    ds, encode_batch = corpus.dataset, getattr(tok, "encode_batch_fast", tok.encode_batch)

    def encode(batch):
        return {"ids": [e.ids for e in encode_batch(batch["text"], add_special_tokens=False)]}
    import_datasets()  # the map's bar only where someone watches
    return ds.map(encode, batched=True, batch_size=256, remove_columns=ds.column_names, desc=f"tokenizing {corpus.name}",
                  cache_file_name=str(Path(scratch) / "ids.arrow") if ds.cache_files and scratch else None)


def split_mask(n: int, val_fraction: float = VAL_FRACTION, split_seed: int = 0) -> np.ndarray:
    """Which documents are validation documents: a fixed share chosen by split_seed (not
    the training seed), so every run and every chapter validates on the same ones."""
    is_val = np.zeros(n, dtype=bool)
    if n >= 2:
        n_val = min(n - 1, max(1, round(n * val_fraction)))
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed)).numpy()
        is_val[perm[:n_val]] = True
    return is_val


class Documents:
    """One split: its documents end to end, each followed by [EOT] (`tokens`), and where each
    starts (`offsets`, one more). Memory-maps: every rank reads the same file pages."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, opened_from: tuple | None = None):
        self.tokens, self.offsets, self.opened_from = tokens, offsets, opened_from  # open()'s arguments

    @classmethod
    def open(cls, prefix: Path, dtype: np.dtype, num_docs: int, num_tokens: int) -> "Documents":
        """`<prefix>.bin` and `.idx` mapped, checked against meta.json's counts (else ValueError)."""
        bin_, idx = Path(prefix).with_suffix(".bin"), Path(prefix).with_suffix(".idx")
        for path, want in ((bin_, num_tokens * dtype.itemsize), (idx, (num_docs + 1) * 8)):
            if path.stat().st_size != want:
                raise ValueError(f"{path.name} holds {path.stat().st_size} bytes, not {want}")
        tokens = np.memmap(bin_, dtype=dtype, mode="r") if num_tokens else np.zeros(0, dtype)
        offsets = np.memmap(idx, dtype=np.int64, mode="r")
        if offsets[0] != 0 or offsets[-1] != num_tokens:
            raise ValueError(f"{idx.name} does not span {bin_.name}")
        return cls(tokens, offsets, (prefix, dtype, num_docs, num_tokens))

    def __len__(self):
        return len(self.offsets) - 1

    def __reduce__(self):
        # a DataLoader worker that is spawned (not forked) gets the file names, not a copy
        return (Documents.open, self.opened_from) if self.opened_from else (Documents, (self.tokens, self.offsets))


def token_cache_path(corpus: Corpus, tok, cache_dir: Path | None = None,
                     val_fraction: float = VAL_FRACTION, split_seed: int = 0) -> Path:
    """The cache folder of this corpus's splits under this tokenizer."""
    key = hashlib.sha256(f"{corpus.identity}|{hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]}|"
                         f"{val_fraction}|{split_seed}|{TOKEN_FORMAT}".encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / f"tokens-{key}"


def token_files(corpus: Corpus, tok, cache_dir: Path | None = None, val_fraction: float = VAL_FRACTION,
                split_seed: int = 0) -> tuple[Documents, Documents]:
    """The train and validation splits, written once per machine into the cache, then mapped."""
    path = token_cache_path(corpus, tok, cache_dir, val_fraction, split_seed)
    if not (path / "meta.json").exists():
        write_token_files(path, lambda scratch: tokenize_corpus(corpus, tok, scratch), tok,
                          {"corpus": corpus.identity}, val_fraction, split_seed)
    return _open_token_files(path, tok.get_vocab_size())


def write_token_files(path: Path, tokenize, tok, meta: dict, val_fraction: float = VAL_FRACTION,
                      split_seed: int = 0) -> None:
    """The cache folder `path` (<split>.bin: ids, [EOT] after each document; <split>.idx: int64
    offsets; meta.json) from `tokenize(scratch)`. Built under a temporary name and renamed
    into place whole: a killed run leaves no half cache, and two jobs end up with one copy."""
    import pyarrow.compute as pc
    from tqdm.auto import tqdm

    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{os.urandom(4).hex()}")  # mkdir: the umask's modes
    dtype, eot_id = token_dtype(tok.get_vocab_size()), tok.token_to_id(EOT)
    meta = {"format": TOKEN_FORMAT, "dtype": dtype.name, "eot_id": eot_id, "val_fraction": val_fraction,
            "split_seed": split_seed, **meta}
    try:
        (tmp / "scratch").mkdir(parents=True)
        tokenized = tokenize(tmp / "scratch")
        is_val = split_mask(len(tokenized), val_fraction, split_seed)
        for s, rows in (("train", np.flatnonzero(~is_val)), ("val", np.flatnonzero(is_val))):
            lengths = [np.zeros(1, np.int64)]
            with open(tmp / f"{s}.bin", "wb") as f:
                for batch in tqdm(tokenized.select(rows).with_format("arrow").iter(batch_size=10_000),
                                  desc=f"writing {s}.bin", total=-(-len(rows) // 10_000), unit="batch",
                                  file=sys.stderr, disable=not show_progress()):
                    n = pc.list_value_length(batch["ids"]).to_numpy().astype(np.int64)
                    f.write(np.insert(pc.list_flatten(batch["ids"]).to_numpy(), np.cumsum(n), eot_id)
                            .astype(dtype).tobytes())
                    lengths.append(n + 1)
                f.flush()
                os.fsync(f.fileno())
            offsets = np.concatenate(lengths).cumsum()
            fsync_write(tmp / f"{s}.idx", lambda f: f.write(offsets.tobytes()))
            meta[s] = {"documents": len(offsets) - 1, "tokens": int(offsets[-1])}
        del tokenized
        shutil.rmtree(tmp / "scratch")
        fsync_write(tmp / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
        try:
            os.rename(tmp, path)  # atomic; fails if another job's copy is already there
            fsync_dir(path.parent)
        except OSError:
            if not (path / "meta.json").exists():
                raise
    except OSError as e:  # the cache's disk: reading the corpus fails with a DataError
        raise cache_unwritable(path.parent, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _open_token_files(path: Path, vocab_size: int) -> tuple[Documents, Documents]:
    """Both splits from a cache folder; a damaged one is a one-line DataError."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        splits = [Documents.open(path / s, dtype, meta[s]["documents"], meta[s]["tokens"]) for s in ("train", "val")]
        # an id beyond the embedding stops training with a traceback (a device-side assert on
        # GPUs); max runs at memory speed, a chunk a map (~25 ms per 100 M tokens)
        for s, docs in zip(("train", "val"), splits):
            for start in range(0, len(docs.tokens), 1 << 26):
                largest = np.memmap(path / f"{s}.bin", dtype, "r", start * dtype.itemsize,
                                    (min(1 << 26, len(docs.tokens) - start),)).max()
                if largest >= vocab_size:
                    raise ValueError(f"{s}.bin holds token id {largest}, outside the vocabulary of {vocab_size}")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # JSON nested too deep
        raise DataError(f"the token cache {path} cannot be read ({type(e).__name__}: {e}); "
                        f"delete it (rm -r {path}) and run again to rebuild it") from None
    return splits[0], splits[1]


class PackedDataset(torch.utils.data.Dataset):
    """The split's token stream cut into windows of seq_len + 1 tokens, stride seq_len: inputs
    window[:-1], targets window[1:]. Every token but the first is a target once (a tail too
    short for a window is dropped). No padding, so attention needs no mask tensor."""

    def __init__(self, documents: Documents, seq_len: int):
        self.seq_len, self.documents = seq_len, documents

    def __len__(self):
        return max(0, (len(self.documents.tokens) - 1) // self.seq_len)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        w = torch.from_numpy(self.documents.tokens[start: start + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


class PaddedDataset(torch.utils.data.Dataset):
    """One document per sample: [BOT] + tokens + [EOT], clipped or right-padded with
    [PAD] to seq_len + 1; pad targets are IGNORE_INDEX. Attention needs a key-padding mask."""

    def __init__(self, documents: Documents, seq_len: int, bot_id: int, eot_id: int, pad_id: int):
        self.documents, self.seq_len = documents, seq_len
        self.bot_id, self.eot_id, self.pad_id = bot_id, eot_id, pad_id

    def __len__(self):
        return len(self.documents)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        start, end = self.documents.offsets[i: i + 2]
        doc = self.documents.tokens[start: min(end - 1, start + self.seq_len)]  # without its [EOT]
        w = torch.full((self.seq_len + 1,), self.pad_id, dtype=torch.long)
        w[0] = self.bot_id
        w[1:1 + len(doc)] = torch.from_numpy(doc.astype(np.int64))
        if len(doc) < self.seq_len:
            w[1 + len(doc)] = self.eot_id
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
                   cache_dir: Path | None = None, val_fraction: float = VAL_FRACTION) -> Data:
    """Corpus -> tokenizer -> token files (cached, memory-mapped) -> train/val datasets."""
    corpus = open_corpus(dataset_name, subset, text_column)  # its text read only if needed
    tok, tok_path = get_tokenizer(corpus, vocab_size, cache_dir, tokenizer_path)
    if not tokenizer_path and tok.get_vocab_size() < vocab_size:  # BPE ran out of pairs to merge
        logging.getLogger(__name__).info(
            "the tokenizer learned %d tokens, fewer than --vocab-size %d: this corpus is too small to fill it; "
            "the model's vocabulary is %d", tok.get_vocab_size(), vocab_size, tok.get_vocab_size())
    pad, bot, eot = (tok.token_to_id(t) for t in SPECIAL_TOKENS)
    docs = token_files(corpus, tok, cache_dir, val_fraction)
    train, val = (PackedDataset(d, seq_len) if packed else PaddedDataset(d, seq_len, bot, eot, pad) for d in docs)
    if len(train) == 0:
        raise DataError(f"dataset {dataset_name!r} is too small for one sample of {seq_len + 1} tokens")
    fingerprint = hashlib.sha256(f"{corpus.identity}|{tok.to_str()}".encode()).hexdigest()[:16]
    return Data(train, val, tok, tok_path, tok.get_vocab_size(), pad, bot, eot, packed, dataset_name,
                len(docs[0]) + len(docs[1]), fingerprint)


def check_enough_samples(dataset, global_batch: int) -> None:
    if len(dataset) < global_batch:
        raise DataError(f"the training set has {len(dataset)} samples, fewer than one global "
                        f"batch of {global_batch}; lower --batch-size or --seq-length")


def dataset_info(data: Data) -> dict:
    """What the run logs about its data; a note when validation came out empty or large."""
    info = {"dataset": data.corpus_name, "documents": data.num_documents,
            "train_samples": len(data.train), "val_samples": len(data.val),
            "form": "packed" if data.packed else "padded", "vocab_size": data.vocab_size,
            "tokenizer": data.tokenizer_path, "fingerprint": data.fingerprint}
    share = len(data.val) / max(1, len(data.train) + len(data.val))
    if share == 0 or share > 3 * VAL_FRACTION:  # whole documents: a few make a lopsided split
        info["note"] = (f"validation holds {share:.0%} of the samples: the split sets whole documents "
                        f"aside ({VAL_FRACTION:.0%} of the {data.num_documents}, at least one of two)")
    return info


def worker_start_method(num_workers: int) -> str | None:
    """Fork on Linux: a worker shares the trainer's memory and dies with it (3.14's
    forkserver workers outlive a trainer killed by SIGKILL)."""
    return "fork" if num_workers > 0 and sys.platform.startswith("linux") else None


def local_rank0_first(load):
    """`load()`'s result: local rank 0 of each machine fills its cache first, then the
    others read it; a DataError on any rank stops every rank with one line, exit status 2."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    result, group = None, patient_group()  # waits for the data are not bounded by --timeout
    for turn in (0, 1):  # turn 0: local rank 0 of each machine; turn 1: the others
        error = None
        if (local_rank == 0) == (turn == 0):
            try:
                result = load()
            except DataError as e:
                error = str(e)
        stop_on_any_error(error, group=group)
    return result


def show_progress() -> bool:
    """Bars in a terminal, or when the tour asks (LLM_GUIDE_PROGRESS=1: it shows them through a pipe)."""
    return os.environ.get("LLM_GUIDE_PROGRESS") == "1" or sys.stderr.isatty()
