"""Corpus, tokenizer and the two dataset forms (packed and padded).

Corpora (`--dataset-name`):
  stdlib            the Python standard library's own source files, one document per
                    file: real text that every machine with Python has, offline.
  a local path      a file, folder or glob of .txt / .md / .py / .jsonl files, read by
                    `datasets`' local builders ("text" one document per file, or per
                    paragraph for a lone file; "json" one per line).
  a hub id          anything else, through `datasets.load_dataset` (optional subset and
                    text column), e.g. roneneldan/TinyStories.

The tokenizer is a byte-level BPE trained with `tokenizers` on the corpus and cached as
JSON; the tokenized splits are cached as flat token files with document offsets
(`token_files`), memory-mapped by every rank. Both are keyed by the corpus's identity,
so the second run of any chapter starts in seconds and never reads the text.

Everything raises `DataError` with a one-line message; `local_rank0_first` turns it into
exit status 2.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import socket
import sys
import sysconfig
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

from .distributed import first_error, patient_group
from .durable import fsync_dir, fsync_write, is_disk_full
from .errors import fail, reachable

PAD, BOT, EOT = "[PAD]", "[BOT]", "[EOT]"
SPECIAL_TOKENS = [PAD, BOT, EOT]
DEFAULT_VOCAB_SIZE = 8192
LOCAL_SUFFIXES = (".txt", ".md", ".py", ".jsonl")
IGNORE_INDEX = -100  # targets the loss skips (padding)
log = logging.getLogger(__name__)  # INFO reaches rank 0's log only (cli.setup_logging)


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


@contextmanager
def datasets_logs_muted():
    """No `datasets` log lines (its JSON builder logs a parse error before raising it):
    the error that follows becomes the run's one line."""
    import datasets

    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def datasets_progress():
    """`datasets`' own progress bars where someone watches (`show_progress`), none in a
    log file."""
    return nullcontext() if show_progress() else quiet_datasets()


def default_cache_dir() -> Path:
    """Where tokenizers and tokenized corpora are cached (LLM_GUIDE_CACHE overrides)."""
    env = os.environ.get("LLM_GUIDE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "llm-guide"


# --------------------------------------------------------------------------- corpus

class Corpus:
    """A corpus's name, its identity (changes whenever the text could have changed: the
    caches' key), and its text as a datasets.Dataset with a "text" column, loaded and
    checked on first use: once the tokenizer and the token files are cached, a run never
    reads it."""

    def __init__(self, name: str, identity: str, load):
        self.name, self.identity, self._dataset, self._load = name, identity, None, load

    @property
    def dataset(self):
        if self._dataset is None:
            self._dataset = self._load()
        return self._dataset


def stdlib_files() -> list[Path]:
    """The standard library's .py files, without site-packages and its test suites. The
    skipped folders are never entered (site-packages alone can hold 100,000 files), so
    listing takes milliseconds: every run lists them, for the cache key."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for folder, subfolders, names in os.walk(root):
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
        import datasets  # a second to import: only when the text is read

        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
        return datasets.Dataset.from_dict({"text": [t for t in texts if t.strip()]})
    return Corpus("stdlib", identity, load=load)


def looks_local(name: str) -> bool:
    """A path or glob rather than a hub id (hub ids are `owner/name` or `name`: one slash
    at most, none at the end)."""
    return (os.path.exists(name) or any(c in name for c in "*?[") or name.count("/") > 1
            or name.startswith((".", "/", "~")) or name.endswith((*LOCAL_SUFFIXES, "/")))


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
    files = local_files(name)
    # one document per file, like the stdlib corpus; but one text file alone is cut at its
    # blank lines, so that the split (whole documents) can set some of it aside for validation
    sample_by = "paragraph" if len(files) == 1 and not files[0].endswith(".jsonl") else "document"
    h = hashlib.sha256()
    for f in files:
        st = os.stat(f)
        h.update(f"{os.path.abspath(f)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    identity = f"local-{h.hexdigest()[:16]}" + ("-paragraphs" if sample_by == "paragraph" else "")
    return Corpus(name, identity, load=lambda: _checked(
        name, _read_local(name, files, text_column, sample_by), text_column))


def _read_local(name: str, files: list[str], text_column: str, sample_by: str):
    import datasets

    try:
        # datasets' "Downloading data" bar copies local files (no network)
        with datasets_progress(), datasets_logs_muted():
            if not files[0].endswith(".jsonl"):
                return datasets.load_dataset("text", data_files=files, split="train",
                                             sample_by=sample_by)
            ds = datasets.load_dataset("json", data_files=files, split="train")
    except Exception as e:  # datasets' builders: not text, not JSON lines, ...
        cause = e.__cause__ or e
        first = str(cause).strip().splitlines()[0][:160] if str(cause).strip() else ""
        raise DataError(f"could not read {_first_unreadable(files) or name!r} as text or JSON "
                        f"lines ({type(cause).__name__}: {first})") from None
    return _text_column(name, ds, text_column)


def _first_unreadable(files: list[str]) -> str | None:
    """The first of `files` that is not UTF-8 text (for .jsonl: a JSON value a line), to
    name in the error (datasets' own errors name no file)."""
    for f in files:
        try:
            with open(f, encoding="utf-8") as text:
                for line in text:
                    if f.endswith(".jsonl") and line.strip():
                        json.loads(line)
        except (OSError, ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError
            return f
    return None


def _text_column(name: str, ds, text_column: str):
    """`ds` with only its `text_column`, named "text"; DataError if it has none."""
    if text_column not in ds.column_names:
        raise DataError(f"{name!r} has no column {text_column!r} (columns: "
                        f"{', '.join(ds.column_names)}); pass --text-column")
    ds = ds.select_columns([text_column])
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def hub_reachable() -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    return reachable(url.hostname, url.port or (80 if url.scheme == "http" else 443), timeout=5.0)


def _hub_corpus(name: str, subset: str | None, text_column: str) -> Corpus:
    import datasets

    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
    # Fail at once rather than after the hub client's retries.
    if not offline and not hub_reachable():
        raise DataError(f"cannot reach the Hugging Face hub to load {name!r} (nor is it a local "
                        f"path here); use --dataset-name stdlib or a local path (or HF_HUB_OFFLINE=1 "
                        f"if it is already in your cache)")
    try:
        ds = datasets.load_dataset(name, subset, split="train")
    except Exception as e:  # the hub client raises many types; one line for all
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"could not load {name!r} from the hub: {msg}") from None
    ds = _text_column(name, ds, text_column)
    return Corpus(name, f"hub-{name}-{subset}-{ds._fingerprint}",
                  load=lambda: _checked(name, ds, text_column))


def check_dataset_name(name: str) -> None:
    """Cheap checks that need no loading (run before any work)."""
    if not name:
        raise DataError("--dataset-name is empty")
    if name != "stdlib" and looks_local(name):
        local_files(name)


def open_corpus(name: str, subset: str | None = None, text_column: str = "text") -> Corpus:
    """The corpus's identity at once; its text (read, checked, blank documents dropped)
    on first use of `.dataset`."""
    check_dataset_name(name)
    if name == "stdlib":
        return _stdlib_corpus()  # text files of Python's own: read only when needed
    if looks_local(name):
        return _local_corpus(name, text_column)
    return _hub_corpus(name, subset, text_column)


def load_corpus(name: str, subset: str | None = None, text_column: str = "text") -> Corpus:
    """The corpus with its text read and checked now (DataError if it is unusable)."""
    corpus = open_corpus(name, subset, text_column)
    corpus.dataset  # noqa: B018 (reads and checks it)
    return corpus


def _checked(name: str, dataset, text_column: str):
    """The text column checked for strings, blank documents dropped, not empty."""
    bad = next((t for t in dataset[:1000]["text"] if t is not None and not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"column {text_column!r} of {name!r} holds {type(bad).__name__} values "
                        f"(e.g. {bad!r}), not text; pick the text column with --text-column")
    with quiet_datasets():  # a fast filter needs no bar
        dataset = dataset.filter(lambda b: [bool(t and t.strip()) for t in b["text"]], batched=True)
    if len(dataset) == 0:
        raise DataError(f"dataset {name!r} is empty (no non-blank documents)")
    return dataset


# ----------------------------------------------------------------------- tokenizer

def cache_unwritable(folder: Path, e: OSError) -> DataError:
    """The one line for a cache folder that cannot take a file (read-only, full, not a
    folder): what failed, and the two ways out."""
    why = e.strerror or type(e).__name__
    if Path(folder).exists() and not Path(folder).is_dir():
        return DataError(f"the cache folder {folder} is a file, not a folder; point --cache-dir "
                         f"(or $LLM_GUIDE_CACHE) at a folder")
    return DataError(f"the cache folder {folder} cannot be written ({why}); free space there, "
                     f"or point --cache-dir (or $LLM_GUIDE_CACHE) at a writable folder")


def as_if_created(path, folder: bool = False) -> None:
    """Give a file or folder from `tempfile` (private to its owner: 0600, 0700) the mode
    a plain open() or mkdir() would, as the umask allows (0644, 0755 under the usual 022):
    a cache shared by several users or jobs stays readable by all of them."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if folder else 0o666) & ~mask)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
        as_if_created(tmp)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise cache_unwritable(path.parent, e) from None


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

    if os.path.isdir(path):
        raise DataError(f"tokenizer file {str(path)!r} is a folder, not a tokenizers JSON file")
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
        try:
            return load_tokenizer(path), str(path)
        except DataError as e:  # the cache's own file: say it is one, and how to rebuild it
            raise DataError(f"the cached tokenizer cannot be read ({e}); delete it (rm {path}) "
                            f"and run again to retrain it") from None
    tok = train_tokenizer((corpus.dataset[i:i + 1000]["text"]
                           for i in range(0, len(corpus.dataset), 1000)), vocab_size)
    _atomic_write_text(path, tok.to_str())
    return tok, str(path)


def special_ids(tok) -> dict[str, int]:
    return {"pad": tok.token_to_id(PAD), "bot": tok.token_to_id(BOT), "eot": tok.token_to_id(EOT)}


# ------------------------------------------------------- token files, made once

TOKEN_FORMAT = 1  # bump when the files' layout changes: old caches are then ignored
SPLITS = ("train", "val")
TEXT_PER_PROCESS = 32 << 20  # bytes of text that make another tokenizing process worth it


def token_dtype(vocab_size: int) -> np.dtype:
    """2 bytes a token where every id fits (vocabularies up to 65,536), else 4."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def tokenize_corpus(corpus: Corpus, tok, scratch: Path | None = None, num_proc: int | None = None):
    """A datasets.Dataset with one `ids` list per document (no special tokens), made with
    a batched `map` and a progress bar. A corpus read from files is tokenized by up to
    `num_proc` processes (default: every core; one per TEXT_PER_PROCESS), writing into
    `scratch`; the small in-memory stdlib corpus in this process (tokenizers' own threads)."""
    ds = corpus.dataset

    def encode(batch):
        return {"ids": [e.ids for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

    on_disk = bool(ds.cache_files) and scratch is not None
    # a process per TEXT_PER_PROCESS of text, up to one per core: a small corpus is not
    # worth the forks
    procs = min(num_proc or os.cpu_count() or 1, len(ds), 1 + ds.data.nbytes // TEXT_PER_PROCESS)
    procs = procs if on_disk and procs > 1 else None
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    if procs:  # one process a core: tokenizers' threads would only compete (and warn at fork)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with datasets_progress():
            return ds.map(encode, batched=True, batch_size=256, remove_columns=ds.column_names,
                          num_proc=procs, desc=f"tokenizing {corpus.name}",
                          cache_file_name=str(Path(scratch) / "ids.arrow") if on_disk else None)
    finally:
        if procs and parallelism is None:
            os.environ.pop("TOKENIZERS_PARALLELISM")
        elif procs:
            os.environ["TOKENIZERS_PARALLELISM"] = parallelism


VAL_FRACTION = 0.05  # the share of documents set aside for validation


def split_mask(n: int, val_fraction: float = VAL_FRACTION, split_seed: int = 0) -> np.ndarray:
    """Which documents are validation documents: a fixed share chosen by split_seed (not
    the training seed), so every run and every chapter validates on the same ones. The
    documents keep their corpus order inside each split."""
    is_val = np.zeros(n, dtype=bool)
    if n >= 2:
        n_val = min(n - 1, max(1, round(n * val_fraction)))
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(split_seed)).numpy()
        is_val[perm[:n_val]] = True
    return is_val


class Documents:
    """One split as documents end to end, each followed by [EOT], in a flat token array
    (`tokens`), and where each one starts (`offsets`, one more than the documents: the
    last is the token count). Opened from the cache, both are memory-maps: every rank
    reads the same file pages and holds none of it in its own memory."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, prefix: Path | None = None):
        self.tokens, self.offsets, self.prefix = tokens, offsets, prefix

    @classmethod
    def from_lists(cls, docs, eot_id: int) -> "Documents":
        """In memory, from lists of ids (small corpora, tests)."""
        tokens = np.array([t for d in docs for t in [*d, eot_id]], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum([len(d) + 1 for d in docs])]).astype(np.int64)
        return cls(tokens, offsets)

    @classmethod
    def open(cls, prefix: Path, dtype: np.dtype, num_docs: int, num_tokens: int) -> "Documents":
        """`<prefix>.bin` and `<prefix>.idx` as memory-maps, after checking their sizes and
        ends against the counts meta.json holds (ValueError if they do not match)."""
        prefix = Path(prefix)
        bin_, idx = prefix.with_suffix(".bin"), prefix.with_suffix(".idx")
        for path, want in ((bin_, num_tokens * dtype.itemsize), (idx, (num_docs + 1) * 8)):
            have = path.stat().st_size if path.exists() else None
            if have != want:
                raise ValueError(f"{path.name} holds {have} bytes, not {want}")
        tokens = np.memmap(bin_, dtype=dtype, mode="r") if num_tokens else np.zeros(0, dtype)
        offsets = np.memmap(idx, dtype=np.int64, mode="r")
        if offsets[0] != 0 or offsets[-1] != num_tokens:
            raise ValueError(f"{idx.name} does not span {bin_.name}")
        return cls(tokens, offsets, prefix)

    def __len__(self):
        return len(self.offsets) - 1

    def document(self, i: int) -> np.ndarray:
        """Document i's ids, without its [EOT]."""
        return self.tokens[self.offsets[i]: self.offsets[i + 1] - 1]

    def __getstate__(self):
        # DataLoader workers that are spawned (not forked) get the file names, not a copy
        if self.prefix is None:
            return self.__dict__
        return {"prefix": self.prefix, "dtype": self.tokens.dtype, "n": (len(self), len(self.tokens))}

    def __setstate__(self, state):
        if "n" not in state:
            self.__dict__.update(state)
            return
        self.__dict__.update(Documents.open(state["prefix"], state["dtype"], *state["n"]).__dict__)


def _write_split_files(tokenized, is_val: np.ndarray, eot_id: int, dtype: np.dtype, folder: Path) -> dict:
    """Stream the tokenized corpus into <split>.bin (documents each followed by [EOT]) and
    <split>.idx (int64 offsets), a batch of documents at a time, forced to disk. Returns
    each split's document and token counts."""
    import pyarrow.compute as pc
    from tqdm.auto import tqdm

    limit = np.iinfo(dtype).max
    files = {s: open(folder / f"{s}.bin", "wb") for s in SPLITS}
    lengths = {s: [] for s in SPLITS}
    done = 0
    with tqdm(total=len(tokenized), desc="writing token files", unit="doc", file=sys.stderr,
              disable=not show_progress()) as bar:
        for batch in tokenized.with_format("arrow").iter(batch_size=10_000):
            col = batch.column("ids")
            flat = pc.list_flatten(col).to_numpy()
            n = pc.list_value_length(col).to_numpy().astype(np.int64)
            if flat.size and flat.max() > limit:
                raise DataError(f"token id {flat.max()} does not fit {dtype.name}")
            stream = np.insert(flat, np.cumsum(n), eot_id).astype(dtype)  # [EOT] after each
            val = is_val[done: done + len(n)]
            in_val = np.repeat(val, n + 1)
            for s, keep, docs in (("train", ~in_val, ~val), ("val", in_val, val)):
                files[s].write(stream[keep].tobytes())
                lengths[s].append(n[docs] + 1)
            done += len(n)
            bar.update(len(n))
    counts = {}
    for s in SPLITS:
        files[s].flush()
        os.fsync(files[s].fileno())
        files[s].close()
        offsets = np.concatenate([[0], *lengths[s]]).cumsum().astype(np.int64)
        fsync_write(folder / f"{s}.idx", lambda f: f.write(offsets.tobytes()))
        counts[s] = {"documents": len(offsets) - 1, "tokens": int(offsets[-1])}
    return counts


def _tokenizer_hash(tok) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def token_cache_path(corpus: Corpus, tok, cache_dir: Path | None = None,
                     val_fraction: float = VAL_FRACTION, split_seed: int = 0) -> Path:
    """The cache folder of this corpus's splits under this tokenizer."""
    key = hashlib.sha256(f"{corpus.identity}|{_tokenizer_hash(tok)}|{val_fraction}|{split_seed}|"
                         f"{TOKEN_FORMAT}".encode()).hexdigest()[:16]
    return Path(cache_dir or default_cache_dir()) / f"tokens-{key}"


def token_files(corpus: Corpus, tok, cache_dir: Path | None = None, val_fraction: float = VAL_FRACTION,
                split_seed: int = 0) -> tuple[Documents, Documents]:
    """The train and validation splits as memory-mapped token files, written once per
    machine into the cache folder `tokens-<key>/` (train.bin, train.idx, val.bin,
    val.idx, meta.json) and opened from there by every later call."""
    path = token_cache_path(corpus, tok, cache_dir, val_fraction, split_seed)
    if not (path / "meta.json").exists():
        write_token_files(path, lambda scratch: tokenize_corpus(corpus, tok, scratch), tok,
                          {"corpus": corpus.identity}, val_fraction, split_seed)
    return _open_token_files(path, tok.get_vocab_size())


def write_token_files(path: Path, tokenize, tok, meta: dict, val_fraction: float = VAL_FRACTION,
                      split_seed: int = 0) -> None:
    """Build the cache folder `path` from `tokenize(scratch)` (a datasets.Dataset of `ids`;
    `scratch` is a folder for its files, removed afterwards).

    The folder is built under a temporary name and renamed into place whole (every file
    forced to disk first), so a killed run leaves no half cache and two jobs that build
    it at once both end up reading one complete copy."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_builds(path.parent)
        # named by host and pid, so that a later run can tell a killed build's leftovers
        tmp = Path(tempfile.mkdtemp(dir=path.parent,
                                    prefix=f".tmp-{path.name}-{socket.gethostname()}-{os.getpid()}-"))
        as_if_created(tmp, folder=True)
        (tmp / "scratch").mkdir()
    except OSError as e:
        raise cache_unwritable(path.parent, e) from None
    try:
        try:  # a corpus read from files is tokenized into scratch: the cache's disk too
            tokenized = tokenize(tmp / "scratch")
        except OSError as e:
            if not is_disk_full(e):
                raise
            raise cache_unwritable(path.parent, e) from None
        dtype, eot_id = token_dtype(tok.get_vocab_size()), tok.token_to_id(EOT)
        try:  # a full disk here is the cache's problem, not the corpus's
            counts = _write_split_files(tokenized, split_mask(len(tokenized), val_fraction,
                                                              split_seed), eot_id, dtype, tmp)
            del tokenized
            shutil.rmtree(tmp / "scratch", ignore_errors=True)
            meta = {"format": TOKEN_FORMAT, "dtype": dtype.name, **meta,
                    "tokenizer_sha256": _tokenizer_hash(tok), "eot_id": eot_id,
                    "val_fraction": val_fraction, "split_seed": split_seed, **counts}
            fsync_write(tmp / "meta.json", lambda f: f.write(json.dumps(meta, indent=1).encode()))
        except OSError as e:
            raise cache_unwritable(path.parent, e) from None
        try:
            os.rename(tmp, path)  # atomic; fails if another job's copy is already there
            fsync_dir(path.parent)
        except OSError:
            if not (path / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_builds(cache_dir: Path) -> None:
    """Remove the temporary folders of token-file builds that were killed (SIGKILL, a
    SIGTERM's default end: no `finally` ran), by processes of this host that are gone: a
    big corpus's scratch would otherwise stay in the cache for good. A build elsewhere
    (a shared cache) or alive is left alone."""
    host = socket.gethostname()
    for tmp in cache_dir.glob(".tmp-tokens-*"):
        found = re.fullmatch(r"\.tmp-tokens-[0-9a-f]+-(.+)-(\d+)-[^-]+", tmp.name)
        if not found or found[1] != host:
            continue
        try:
            os.kill(int(found[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (PermissionError, OverflowError):
            pass  # alive (another user's), or no pid at all


def _largest_token(path: Path, dtype: np.dtype, count: int) -> int:
    """The largest id in a token file, read through a memory-map per chunk: each is
    unmapped after its chunk, so the pass leaves none of the file in this process."""
    largest, chunk = 0, 1 << 26
    for start in range(0, count, chunk):
        part = np.memmap(path, dtype, mode="r", offset=start * dtype.itemsize,
                         shape=(min(chunk, count - start),))
        largest = max(largest, int(part.max()))
    return largest


def _open_token_files(path: Path, vocab_size: int) -> tuple[Documents, Documents]:
    """Both splits from a cache folder; a damaged one is a one-line DataError."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        splits = [Documents.open(path / s, dtype, meta[s]["documents"], meta[s]["tokens"])
                  for s in SPLITS]
        for s, docs in zip(SPLITS, splits):  # every document ends with [EOT]: checks the last token read
            if len(docs) and docs.tokens[-1] != meta["eot_id"]:
                raise ValueError("the last token is not [EOT]")
            # an id beyond the embedding would stop training with a traceback (on a GPU, a
            # device-side assert); numpy's max runs at memory speed, so every run checks
            largest = _largest_token(path / f"{s}.bin", dtype, len(docs.tokens))
            if largest >= vocab_size:
                raise ValueError(f"{s}.bin holds token id {largest}, outside the vocabulary of {vocab_size}")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:  # JSON nested too deep
        raise DataError(f"the token cache {path} cannot be read ({type(e).__name__}: {e}); "
                        f"delete it (rm -r {path}) and run again to rebuild it") from None
    return splits[0], splits[1]


# ------------------------------------------------------------------ dataset forms

class PackedDataset(torch.utils.data.Dataset):
    """Documents joined with [EOT] into one token stream, cut into windows of
    seq_len + 1 tokens with stride seq_len: inputs are window[:-1], targets window[1:].
    Consecutive windows share one token, so every token but the first is a target
    exactly once, except the tail too short for a whole window (fewer than seq_len
    tokens), which is dropped. No padding anywhere, so attention needs no mask tensor.
    The stream is the split's token file itself: a sample reads seq_len + 1 tokens of
    the memory-map."""

    def __init__(self, documents: Documents, seq_len: int):
        self.seq_len, self.documents = seq_len, documents
        self.num_tokens = len(documents.tokens)

    @property
    def tokens(self) -> np.ndarray:
        return self.documents.tokens

    def __len__(self):
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.seq_len
        w = torch.from_numpy(self.tokens[start: start + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


class PaddedDataset(torch.utils.data.Dataset):
    """One document per sample: [BOT] + tokens + [EOT], clipped or right-padded with
    [PAD] to seq_len + 1. Targets at pad positions are IGNORE_INDEX (the loss skips
    them); attention needs a key-padding mask (masks.build_attention_mask). A sample is
    built when it is read, from the document's slice of the memory-mapped token file."""

    def __init__(self, documents: Documents, seq_len: int, bot_id: int, eot_id: int, pad_id: int):
        self.documents, self.seq_len = documents, seq_len
        self.bot_id, self.eot_id, self.pad_id = bot_id, eot_id, pad_id

    def __len__(self):
        return len(self.documents)

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        doc = self.documents.document(i)[:self.seq_len]
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
    """Corpus -> tokenizer -> token files (cached, memory-mapped) -> train/val datasets
    of one form."""
    if seq_len < 1:
        raise DataError(f"sequence length must be at least 1 (got {seq_len})")
    corpus = open_corpus(dataset_name, subset, text_column)  # its text read only if needed
    tok, tok_path = get_tokenizer(corpus, vocab_size, cache_dir, tokenizer_path)
    if not tokenizer_path and tok.get_vocab_size() < vocab_size:
        log.info("the tokenizer learned %d tokens, fewer than --vocab-size %d: this corpus is too small "
                 "to fill it (BPE ran out of pairs to merge); the model's vocabulary is %d",
                 tok.get_vocab_size(), vocab_size, tok.get_vocab_size())
    ids = special_ids(tok)
    train_docs, val_docs = token_files(corpus, tok, cache_dir, val_fraction)
    if packed:
        train = PackedDataset(train_docs, seq_len)
        val = PackedDataset(val_docs, seq_len)
    else:
        train = PaddedDataset(train_docs, seq_len, ids["bot"], ids["eot"], ids["pad"])
        val = PaddedDataset(val_docs, seq_len, ids["bot"], ids["eot"], ids["pad"])
    if len(train) == 0:
        raise DataError(f"dataset {dataset_name!r} is too small for one sample of "
                        f"{seq_len + 1} tokens")
    fingerprint = hashlib.sha256(f"{corpus.identity}|{tok.to_str()}".encode()).hexdigest()[:16]
    return Data(train, val, tok, tok_path, tok.get_vocab_size(), ids["pad"], ids["bot"],
                ids["eot"], packed, dataset_name, len(train_docs) + len(val_docs), fingerprint)


def check_enough_samples(dataset, global_batch: int) -> None:
    if len(dataset) < global_batch:
        raise DataError(f"the training set has {len(dataset)} samples, fewer than one global "
                        f"batch of {global_batch}; lower --batch-size or --seq-length")


def dataset_info(data: Data) -> dict:
    """What the run logs about its data. A corpus of few documents gets a note when its
    validation split, whole documents, came out far larger than VAL_FRACTION of it."""
    info = {"dataset": data.corpus_name, "documents": data.num_documents,
            "train_samples": len(data.train), "val_samples": len(data.val),
            "form": "packed" if data.packed else "padded", "vocab_size": data.vocab_size,
            "tokenizer": data.tokenizer_path, "fingerprint": data.fingerprint}
    share = len(data.val) / max(1, len(data.train) + len(data.val))
    if len(data.val) == 0:
        why = ("the corpus is one document; a lone file is cut only at blank lines" if data.num_documents == 1
               else "the documents set aside for it are shorter than one sample")
        info["note"] = f"no validation samples ({why}): the validation loss will be n/a"
    if share > 3 * VAL_FRACTION:
        info["note"] = (f"validation holds {share:.0%} of the samples: the split sets whole documents "
                        f"aside ({VAL_FRACTION:.0%} of them, at least one), and this corpus has "
                        f"{data.num_documents}; training sees the rest")
    return info


__all__ = ["DataError", "Corpus", "Data", "Documents", "PackedDataset", "PaddedDataset",
           "build_datasets", "check_dataset_name", "check_enough_samples", "dataset_info",
           "default_cache_dir", "fixed_batches", "get_tokenizer", "load_corpus", "load_tokenizer",
           "local_rank0_first", "looks_local", "local_files", "open_corpus", "show_progress",
           "special_ids", "split_mask", "stdlib_files", "token_cache_path", "token_dtype",
           "token_files", "write_token_files", "tokenize_corpus", "train_tokenizer", "worker_start_method",
           "DEFAULT_VOCAB_SIZE", "IGNORE_INDEX", "PAD", "BOT", "EOT", "SPECIAL_TOKENS"]


def worker_start_method(num_workers: int) -> str | None:
    """How the chapters' DataLoader workers start: by fork on Linux (its default through
    Python 3.13), so a worker shares the trainer's memory and dies with it. Python 3.14's
    default, forkserver, starts them from a server process instead: a trainer killed by
    SIGKILL then leaves its workers and the server running for good (torch's workers
    watch their parent, the server, which each worker keeps alive), and a stop signal to
    the trainer's process group ends the server and with it the workers that chapter 04
    keeps out of that group. Elsewhere (macOS, Windows), and without workers (where the
    DataLoader takes none), the default."""
    return "fork" if num_workers > 0 and sys.platform.startswith("linux") else None


def local_rank0_first(load):
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
            except DataError as e:
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
