"""Corpus, tokenizer, tokenization cache and both dataset forms; every failure is a
one-line DataError. Small temporary corpora and a 300-token vocabulary keep it fast."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

import common.data as data
from common.data import (BOT, EOT, IGNORE_INDEX, PAD, SPECIAL_TOKENS, DataError, Documents, PackedDataset,
                         PaddedDataset, build_datasets, check_enough_samples, get_tokenizer,
                         load_tokenizer, open_corpus, split_mask, stdlib_files, token_cache_path,
                         token_dtype, token_files)
from conftest import TINY, free_port, python_cmd, run_warm

VOCAB = 300
DOCS = {  # relative path -> text; one document per file, several lines each
    "a.txt": "The quick brown fox jumps over the lazy dog.\nThe dog sleeps.\n" * 3,
    "b.md": "# Notes\n\nPacked sequences need no padding; padded ones need masks.\n",
    "c.py": "def add(a, b):\n    return a + b\n\n\nprint(add(2, 3))\n",
    "sub/d.txt": "Distributed data parallel averages gradients across ranks.\n" * 2,
}


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg
    return msg


def write_files(root, files: dict[str, str]):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def docs_of(ids: list[list[int]], eot: int = 0) -> Documents:
    """In memory, each document followed by `eot`."""
    tokens = np.array([t for d in ids for t in [*d, eot]], dtype=np.int64)
    return Documents(tokens, np.cumsum([0] + [len(d) + 1 for d in ids]).astype(np.int64))


def load_corpus(name: str, **kwargs):
    """The corpus with its text read and checked now."""
    corpus = open_corpus(name, **kwargs)
    corpus.dataset  # noqa: B018 (reads it)
    return corpus


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    root = write_files(tmp_path_factory.mktemp("corpus"), DOCS)
    (root / "blank.txt").write_text("  \n\n")   # blank: dropped
    (root / "image.bin").write_bytes(b"\x00\x01")  # not a text suffix: ignored
    return root


@pytest.fixture(scope="module")
def corpus(corpus_dir):
    return load_corpus(str(corpus_dir))


@pytest.fixture(scope="module")
def tokenizer(corpus, tmp_path_factory):
    return get_tokenizer(corpus, VOCAB, cache_dir=tmp_path_factory.mktemp("tok-cache"))


# --------------------------------------------------------------------------- corpora

def test_stdlib_corpus_is_offline_one_document_per_file(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    files = stdlib_files()
    assert len(files) > 100
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in files:
        assert f.is_file() and f.suffix == ".py"
        parts = set(f.relative_to(root).parts)
        assert not {"site-packages", "dist-packages", "test", "tests"} & parts
    corpus = load_corpus("stdlib")
    texts = [t for t in (f.read_text(encoding="utf-8", errors="replace") for f in files)
             if t.strip()]
    assert corpus.dataset["text"] == texts
    assert corpus.identity.startswith("stdlib-py")


def test_local_folder_one_document_per_file(corpus):
    assert sorted(corpus.dataset["text"]) == sorted(DOCS.values())
    assert corpus.dataset.column_names == ["text"]


def test_local_glob_and_single_file(corpus_dir):
    # a lone file: one document per paragraph (see the test of validation on a lone file)
    assert load_corpus(str(corpus_dir / "*.md")).dataset["text"] == DOCS["b.md"].split("\n\n")
    assert load_corpus(str(corpus_dir / "**" / "*.txt")).dataset.num_rows == 2
    assert load_corpus(str(corpus_dir / "c.py")).dataset["text"] == DOCS["c.py"].split("\n\n")


def test_local_jsonl_and_text_column(tmp_path):
    rows = [{"body": f"story number {i} is short", "id": i} for i in range(4)]
    path = tmp_path / "stories.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as err:
        load_corpus(str(path))                       # default column "text" is absent
    assert "body" in one_line(err) and "--text-column" in one_line(err)
    ds = load_corpus(str(path), text_column="body").dataset
    assert ds.column_names == ["text"]
    assert ds["text"] == [r["body"] for r in rows]


def test_local_corpus_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist") as err:
        load_corpus(str(tmp_path / "missing" / "*.txt"))
    one_line(err)
    write_files(tmp_path / "bin", {"x.bin": "data"})
    with pytest.raises(DataError, match="holds no") as err:
        load_corpus(str(tmp_path / "bin"))
    one_line(err)
    write_files(tmp_path / "mixed", {"a.txt": "hello", "b.jsonl": '{"text": "hi"}\n'})
    with pytest.raises(DataError, match="mixes") as err:
        load_corpus(str(tmp_path / "mixed"))
    one_line(err)
    write_files(tmp_path / "blank", {"a.txt": "\n  \n", "b.md": " "})
    with pytest.raises(DataError, match="empty") as err:
        load_corpus(str(tmp_path / "blank"))
    one_line(err)


def test_an_edited_local_corpus_is_another_corpus(tmp_path):
    """The caches are keyed by the corpus's identity: a file edited in place (to the same
    size, too) or a file added makes another one, so the new text is tokenized rather
    than the old text's cache read; an untouched corpus keeps its identity."""
    root = write_files(tmp_path / "c", {"a.txt": "first text\n", "b.txt": "other\n"})

    def identity():
        return open_corpus(str(root)).identity
    before = identity()
    assert identity() == before
    edited = root / "a.txt"
    mtime = edited.stat().st_mtime_ns
    edited.write_text("FIRST TEXT\n")
    os.utime(edited, ns=(mtime, mtime + 1_000_000))  # a later mtime, whatever the clock's grain
    assert identity() != before
    after_edit = identity()
    (root / "c.txt").write_text("a third\n")
    assert identity() not in (before, after_edit)


def test_unreachable_hub_fails_fast_with_one_line(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="cannot reach") as err:
        load_corpus("someone/some-dataset")
    assert time.perf_counter() - t0 < 5
    assert "someone/some-dataset" in one_line(err)


# ------------------------------------------------------------------------- tokenizer

def test_tokenizer_has_special_tokens_and_round_trips(tokenizer):
    tok, path = tokenizer
    ids = dict(zip(("pad", "bot", "eot"), (tok.token_to_id(t) for t in SPECIAL_TOKENS)))
    assert len(set(ids.values())) == 3 and None not in ids.values()
    assert tok.id_to_token(ids["pad"]) == PAD and tok.id_to_token(ids["eot"]) == EOT
    assert tok.get_vocab_size() <= VOCAB
    text = "def f(x):\n    return 'ünïcödé' + x  # bytes never unknown\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text


def test_tokenizer_is_cached_and_reused(corpus, tmp_path, monkeypatch):
    tok, path = get_tokenizer(corpus, VOCAB, cache_dir=tmp_path)
    assert path.startswith(str(tmp_path)) and path.endswith(".json")
    mtime = (tmp_path / path.rsplit("/", 1)[-1]).stat().st_mtime_ns

    def no_training(*a, **k):
        raise AssertionError("retrained a cached tokenizer")

    monkeypatch.setattr(data, "train_tokenizer", no_training)
    tok2, path2 = get_tokenizer(corpus, VOCAB, cache_dir=tmp_path)
    assert path2 == path and tok2.to_str() == tok.to_str()
    assert (tmp_path / path.rsplit("/", 1)[-1]).stat().st_mtime_ns == mtime
    # another vocabulary size is another tokenizer: it must train (and here cannot)
    with pytest.raises(AssertionError, match="retrained"):
        get_tokenizer(corpus, VOCAB + 10, cache_dir=tmp_path)


def test_tokenizer_path_is_used_and_bad_files_refused(corpus, tokenizer, tmp_path, monkeypatch):
    tok, path = tokenizer
    monkeypatch.setattr(data, "train_tokenizer", None)  # a given file needs no training
    got, got_path = get_tokenizer(corpus, VOCAB, cache_dir=tmp_path, tokenizer_path=path)
    assert got_path == path and got.to_str() == tok.to_str()

    with pytest.raises(DataError, match="does not exist") as err:
        load_tokenizer(tmp_path / "nope.json")
    one_line(err)
    with pytest.raises(DataError, match="is a folder, not a tokenizers JSON file") as err:
        load_tokenizer(tmp_path)
    one_line(err)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{ not json")
    with pytest.raises(DataError, match="not a tokenizers JSON") as err:
        load_tokenizer(garbage)
    one_line(err)
    from tokenizers import Tokenizer, models
    plain = tmp_path / "plain.json"
    Tokenizer(models.BPE()).save(str(plain))
    with pytest.raises(DataError, match="lacks special tokens") as err:
        load_tokenizer(plain)
    assert BOT in one_line(err)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_files_hold_each_split_in_corpus_order_and_are_reused(corpus, tokenizer, tmp_path,
                                                                    monkeypatch, dtype):
    tok, _ = tokenizer
    eot = tok.token_to_id(EOT)
    monkeypatch.setattr(data, "token_dtype", lambda vocab: np.dtype(dtype))  # both widths
    train, val = token_files(corpus, tok, cache_dir=tmp_path, val_fraction=0.25)
    folder = token_cache_path(corpus, tok, tmp_path, val_fraction=0.25)
    assert sorted(p.name for p in folder.iterdir()) == [
        "meta.json", "train.bin", "train.idx", "val.bin", "val.idx"]
    assert not list(tmp_path.glob(".tmp-*"))  # the scratch folder is gone
    texts = corpus.dataset["text"]
    is_val = split_mask(len(texts), 0.25)
    for docs, want in ((train, [t for t, v in zip(texts, is_val) if not v]),
                       (val, [t for t, v in zip(texts, is_val) if v])):
        assert isinstance(docs.tokens, np.memmap) and docs.tokens.dtype == np.dtype(dtype)
        assert isinstance(docs.offsets, np.memmap) and docs.offsets.dtype == np.int64
        assert [tok.decode(docs.tokens[a: b - 1].tolist()) for a, b in zip(docs.offsets, docs.offsets[1:])] == want
        assert (docs.tokens[docs.offsets[1:] - 1] == eot).all()  # [EOT] closes every document
        assert (folder / f"{'val' if docs is val else 'train'}.bin").stat().st_size == \
            len(docs.tokens) * np.dtype(dtype).itemsize

    def no_map(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(datasets.Dataset, "map", no_map)
    again, _ = token_files(open_corpus(corpus.name), tok, cache_dir=tmp_path, val_fraction=0.25)
    assert np.array_equal(again.tokens, train.tokens)


def test_token_dtype_is_the_narrowest_that_holds_every_id():
    assert token_dtype(300) == token_dtype(65536) == np.uint16  # ids 0 .. 65535
    assert token_dtype(65537) == token_dtype(128_256) == np.uint32


def test_a_cached_corpus_is_not_read_again(corpus_dir, tmp_path, monkeypatch):
    build_datasets(str(corpus_dir), seq_len=16, vocab_size=VOCAB, cache_dir=tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", None)  # any read of the text fails
    d = build_datasets(str(corpus_dir), seq_len=16, vocab_size=VOCAB, cache_dir=tmp_path)
    assert d.num_documents == len(DOCS)


def test_split_is_by_document_and_fixed():
    torch.manual_seed(123)  # the training seed must not matter
    is_val = split_mask(40, val_fraction=0.1)
    torch.manual_seed(456)
    assert np.array_equal(split_mask(40, val_fraction=0.1), is_val) and is_val.sum() == 4
    # the documents are drawn by split_seed: another one draws others
    assert not np.array_equal(split_mask(40, val_fraction=0.1, split_seed=1), is_val)
    assert not split_mask(1).any() and split_mask(2).sum() == 1  # at least one of each


# ---------------------------------------------------------------------- packed form

def test_packed_windows_cover_the_stream_with_eot_between_documents():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
    eot = 99
    stream = [1, 2, 3, eot, 4, 5, eot, 6, 7, 8, 9, 10, eot]  # 13 tokens = 1 + 4 * 3
    ds = PackedDataset(docs_of(docs, eot), seq_len=3)
    assert len(ds) == 4
    xs, ys = zip(*(ds[i] for i in range(len(ds))))
    for x, y in zip(xs, ys):
        assert x.shape == y.shape == (3,) and x.dtype == y.dtype == torch.long
        assert torch.equal(y[:-1], x[1:])          # targets are inputs shifted by one
    # every token but the first is a target exactly once, in order
    assert torch.cat(ys).tolist() == stream[1:]
    assert torch.cat([xs[0][:1], *ys]).tolist() == stream
    with pytest.raises(IndexError):
        ds[len(ds)]
    # a stream one token short of another window: no short last sample (a DataLoader could
    # not stack it with the others)
    short = PackedDataset(docs_of(docs[:2] + [[6, 7, 8, 9]], eot), seq_len=3)  # 12 tokens
    assert len(short) == 3 and all(x.shape == y.shape == (3,) for x, y in short)


# ---------------------------------------------------------------------- padded form

def test_padded_rows_bot_eot_pad_and_ignored_targets():
    bot, eot, pad = 1, 2, 0
    docs = [[5, 6, 7], [5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10, 11, 12]]
    ds = PaddedDataset(docs_of(docs, eot), seq_len=6, bot_id=bot, eot_id=eot, pad_id=pad)
    assert len(ds) == 3
    (x0, y0), (x1, y1), (x2, y2) = ds[0], ds[1], ds[2]
    assert x0.shape == y0.shape == (6,)
    # short document: [BOT] doc [EOT] then padding; pad targets are ignored
    assert x0.tolist() == [bot, 5, 6, 7, eot, pad]
    assert y0.tolist() == [5, 6, 7, eot, IGNORE_INDEX, IGNORE_INDEX]
    # exactly fits: [EOT] is the last target
    assert x1.tolist() == [bot, 5, 6, 7, 8, 9] and y1.tolist() == [5, 6, 7, 8, 9, eot]
    # too long: clipped, no [EOT], no padding
    assert x2.tolist() == [bot, 5, 6, 7, 8, 9] and y2.tolist() == [5, 6, 7, 8, 9, 10]


# -------------------------------------------------------------- the whole pipeline

@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_build_datasets_offline_from_a_local_folder(corpus_dir, tmp_path, packed):
    d = build_datasets(str(corpus_dir), seq_len=16, packed=packed, vocab_size=VOCAB,
                       cache_dir=tmp_path, val_fraction=0.25)
    assert d.vocab_size == d.tokenizer.get_vocab_size() <= VOCAB
    assert d.num_documents == len(DOCS)
    assert [d.pad_id, d.bot_id, d.eot_id] == [d.tokenizer.token_to_id(t) for t in (PAD, BOT, EOT)]
    x, y = d.train[0]
    assert x.shape == y.shape == (16,)
    if packed:
        assert (x != d.pad_id).all()
    else:
        assert x[0] == d.bot_id and len(d.train) + len(d.val) == len(DOCS)


def test_too_small_datasets_are_refused(corpus_dir, tmp_path):
    with pytest.raises(DataError, match="too small") as err:
        build_datasets(str(corpus_dir / "c.py"), seq_len=4096, vocab_size=VOCAB,
                       cache_dir=tmp_path)
    one_line(err)
    ds = PackedDataset(docs_of([list(range(1, 29))]), seq_len=4)  # 29 tokens: 7 samples
    check_enough_samples(ds, 7)
    with pytest.raises(DataError, match=r"7 samples.*global batch of 8") as err:
        check_enough_samples(ds, 8)
    one_line(err)


@pytest.mark.parametrize("name, content, message", [
    ("bin.txt", bytes(range(128, 256)) * 20, "could not read"),
    ("bad.jsonl", b'{"text": "a"}\n{bad json\n', "could not read"),
    ("bad-only.jsonl", b"{bad json\n", "could not read"),
    ("num.jsonl", b'{"text": 5}\n{"text": 7}\n', "holds int values"),
])
def test_unreadable_local_files_are_one_line_data_errors(tmp_path, name, content, message):
    """The DataError is the only word: `datasets` logs nothing of its own before it (its
    JSON builder logged 'Failed to load JSON from file ...' on stderr)."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        load_corpus(str(path))
    assert message in str(err.value) and "\n" not in str(err.value)
    if name.endswith(".jsonl"):  # datasets' own log handler, as a chapter's process has it
        script = tmp_path / "open_it.py"
        script.write_text(f"from common.data import DataError, open_corpus\ntry:\n    open_corpus({str(path)!r}).dataset\n"
                          f"except DataError:\n    pass\n")
        proc = run_warm([sys.executable, script])  # a process of its own, as a chapter's
        assert proc.stderr == "", proc.stderr


def test_a_cache_that_cannot_be_written_is_one_line_and_leaves_nothing(corpus_dir, tmp_path, monkeypatch):
    """A cache folder where a file stands, a read-only one (the tokenizer's write), and a
    disk that fills while the token files are written: one DataError line that names
    the folder and the flag, and no temporary file left behind."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(DataError, match=r"cache folder .*a-file/cache cannot be written .*--cache-dir") as err:
        build_datasets(str(corpus_dir), 16, vocab_size=VOCAB, cache_dir=blocked / "cache")
    one_line(err)
    with pytest.raises(DataError, match=r"cache folder .*a-file is a file, not a folder; point --cache-dir") as err:
        build_datasets(str(corpus_dir), 16, vocab_size=VOCAB, cache_dir=blocked)  # $LLM_GUIDE_CACHE, say
    one_line(err)

    def read_only(*a, **k):
        raise OSError(30, "Read-only file system")
    with monkeypatch.context() as m:
        m.setattr("common.files.fsync_write", read_only)  # the tokenizer's atomic write
        with pytest.raises(DataError, match="cannot be written .Read-only file system.") as err:
            build_datasets(str(corpus_dir), 16, vocab_size=VOCAB, cache_dir=tmp_path / "ro")
        one_line(err)
    assert not list((tmp_path / "ro").iterdir())

    real_fsync = data.os.fsync
    def disk_full(fd):
        raise OSError(28, "No space left on device")
    get_tokenizer(open_corpus(str(corpus_dir)), VOCAB, cache_dir=tmp_path / "full")  # in place before
    with monkeypatch.context() as m:
        m.setattr(data.os, "fsync", disk_full)   # the token files' own fsync fails
        with pytest.raises(DataError, match="cannot be written .No space left on device.") as err:
            build_datasets(str(corpus_dir), 16, vocab_size=VOCAB, cache_dir=tmp_path / "full")
        one_line(err)
    assert data.os.fsync is real_fsync
    left = sorted(p.name for p in (tmp_path / "full").iterdir())
    assert len(left) == 1 and left[0].startswith("tokenizer-"), left  # no half token folder


def test_a_disk_that_fills_while_a_local_corpus_is_tokenized_is_one_line(tmp_path, small_disk):
    """A corpus read from files is tokenized into the cache folder's scratch (datasets'
    map writes its arrow file there): a disk that fills then is the same one line as a
    full disk during the token files, and leaves no half token folder."""
    words = [f"{w}{i}" for w in ("alpha", "beta", "gamma", "delta") for i in range(50)]
    rng = np.random.default_rng(0)
    root = write_files(tmp_path / "big", {f"d{i}.txt": " ".join(rng.choice(words, 60_000)) for i in range(4)})
    cache = small_disk(1 << 20)
    with pytest.raises(DataError, match="cannot be written .No space left on device.") as err:
        build_datasets(str(root), 16, vocab_size=VOCAB, cache_dir=cache)
    one_line(err)
    left = sorted(p.name for p in cache.iterdir())
    assert len(left) == 1 and left[0].startswith("tokenizer-"), left


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_cache_has_the_modes_the_umask_gives(tmp_path, umask):
    """Built under temporary names, the tokenizer and the token folder end with the modes
    a plain write gives them: under umask 022 another user sharing the cache reads them;
    under 077 nobody else does."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 50)
    before = os.umask(umask)
    try:
        build_datasets(str(corpus), 16, vocab_size=300, cache_dir=tmp_path / "cache")
    finally:
        os.umask(before)
    made = sorted((tmp_path / "cache").rglob("*"))
    assert any(p.name.startswith("tokenizer-") for p in made) and any(p.name == "meta.json" for p in made)
    for p in made:
        want = (0o777 if p.is_dir() else 0o666) & ~umask
        assert p.stat().st_mode & 0o777 == want, (p, oct(p.stat().st_mode))


@pytest.mark.parametrize("damage", ["truncated", "a-document-short", "offsets", "meta"])
def test_a_damaged_token_cache_says_how_to_rebuild_it(tmp_path, damage):
    corpus = write_files(tmp_path / "c", {f"{i}.txt": "def f(x):\n    return x + 1\n" * 50 for i in range(3)})
    build_datasets(str(corpus), 16, vocab_size=300, cache_dir=tmp_path / "cache")
    [cached] = (tmp_path / "cache").glob("tokens-*")
    if damage == "truncated":  # a copy cut short
        with open(cached / "train.bin", "r+b") as f:
            f.truncate(f.seek(0, 2) - 2)
    elif damage == "a-document-short":  # cut where a document ends: the last token is [EOT]
        offsets = np.fromfile(cached / "train.idx", dtype=np.int64)
        with open(cached / "train.bin", "r+b") as f:
            f.truncate(int(offsets[-2]) * 2)  # uint16 tokens
    elif damage == "offsets":  # right size, wrong content
        (cached / "train.idx").write_bytes(b"\xff" * (cached / "train.idx").stat().st_size)
    else:
        (cached / "meta.json").write_text("{ not json")
    for packed in (True, False):
        with pytest.raises(DataError, match=r"token cache .*cannot be read .*rm -r .*run again") as err:
            build_datasets(str(corpus), 16, packed=packed, vocab_size=300, cache_dir=tmp_path / "cache")
        one_line(err)


@pytest.mark.parametrize("damage", ["truncated", "no-special-tokens"])
def test_a_damaged_cached_tokenizer_is_one_line_naming_it(tmp_path, damage):
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 50)
    build_datasets(str(corpus), 16, vocab_size=300, cache_dir=tmp_path / "cache")
    [cached] = (tmp_path / "cache").glob("tokenizer-*.json")
    text = cached.read_text()
    cached.write_text(text[:len(text) // 2] if damage == "truncated" else text.replace("[EOT]", "[END]"))
    with pytest.raises(DataError, match=r"tokenizer-\w+\.json") as err:
        build_datasets(str(corpus), 16, vocab_size=300, cache_dir=tmp_path / "cache")
    one_line(err)


def test_datasets_memory_map_the_token_files_and_hold_no_copy(tmp_path):
    """Both forms over ~20 M synthetic tokens (40 MB of token files): the datasets hold
    memory-maps and nothing per document, this process's resident memory grows by a
    small fraction of the files, and a DataLoader worker that is spawned gets the file
    names, not the tokens. (python -m tools.data_memory measures whole runs.)"""
    import pickle

    from tools.data_memory import current_rss_mb, synthetic_corpus

    corpus_file, tok_file = synthetic_corpus(tmp_path, 20_000_000)
    files_mb = sum(p.stat().st_size for p in tmp_path.glob("cache/tokens-*/*.bin")) / 2**20
    assert files_mb > 35
    before = current_rss_mb()
    for packed in (True, False):
        d = build_datasets(str(corpus_file), seq_len=256, packed=packed, tokenizer_path=str(tok_file),
                           cache_dir=tmp_path / "cache")
        for ds in (d.train, d.val):
            assert isinstance(ds.documents.tokens, np.memmap) and isinstance(ds.documents.offsets, np.memmap)
            assert not [k for k, v in vars(ds).items() if isinstance(v, (list, dict, torch.Tensor, np.ndarray))]
            last = ds[len(ds) - 1]
            copy = pickle.loads(pickle.dumps(ds))
            assert len(pickle.dumps(ds)) < 4096 and isinstance(copy.documents.tokens, np.memmap)
            assert all(torch.equal(a, b) for a, b in zip(copy[len(ds) - 1], last))
    assert d.num_documents > 20_000_000 / 1000
    # an in-memory int32 stream alone would be 76 MB, a padded table of rows 83 MB
    growth = current_rss_mb() - before
    assert growth < files_mb / 4, (growth, files_mb)


def test_a_workers_own_memory_is_told_apart_from_the_file_pages_it_maps(tmp_path):
    """python -m tools.data_memory's poller on two forked children, as it follows
    DataLoader workers: one reads a 64 MB file through a memory-map, the other allocates
    64 MB. Both peaks grow; only the second's own (anonymous) memory does."""
    import mmap
    import os
    import threading

    from tools.data_memory import _workers_peak
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8).tobytes())

    def read_the_file():
        with open(tokens, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        sum(m[i] for i in range(0, len(m), 4096))
        return m

    def allocate():
        b = bytearray(64 << 20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        return b

    def in_a_child(work):
        pid = os.fork()
        if pid == 0:
            try:
                held = work()  # noqa: F841 (held while the poller looks)
                time.sleep(0.5)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        return str(pid)
    peaks, stop = {}, threading.Event()
    poller = threading.Thread(target=_workers_peak, args=(peaks, stop))
    poller.start()
    try:
        reader, owner = in_a_child(read_the_file), in_a_child(allocate)
    finally:
        stop.set()
        poller.join()
    r, o = peaks[reader], peaks[owner]
    assert r["rss"] - r["anon"] > o["rss"] - o["anon"] + 50, (r, o)  # the file's pages: in the peak alone
    assert o["anon"] > r["anon"] + 50, (r, o)                        # the allocation: its own


def test_a_local_corpus_is_tokenized_into_the_scratch_folder_with_a_bar_where_watched(
        corpus, tokenizer, tmp_path, monkeypatch, capfd):
    """One batched map in this process (tokenizers' encode_batch spreads a batch over the
    cores; its `_fast` form, where tokenizers has one, skips the offsets): encode_batch's
    ids in corpus order, written into the scratch folder on the cache's disk, not into
    datasets' own cache; a progress bar only where someone watches."""
    tok, _ = tokenizer
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    one = data.tokenize_corpus(corpus, tok, tmp_path / "one")
    assert "tokenizing" not in capfd.readouterr().err               # nobody watches: no bar
    monkeypatch.setenv("LLM_GUIDE_PROGRESS", "1")                   # as the tour asks
    two = data.tokenize_corpus(corpus, tok, tmp_path / "two")
    assert "tokenizing" in capfd.readouterr().err                   # tqdm's bar, on stderr
    want = [e.ids for e in tok.encode_batch(corpus.dataset["text"], add_special_tokens=False)]
    assert one["ids"] == two["ids"] == want
    assert [p.name for p in (tmp_path / "two").iterdir()] == ["ids.arrow"]


@pytest.mark.parametrize("argv, said", [
    (["--work-dir", "{tmp}/nowhere"], "argument --work-dir"),
    (["--tokens", "19999"], "--tokens 19,999: at least 20,000 with --nproc-per-node 4"),
    (["--tokens", "1000000", "9999", "--nproc-per-node", "2"], "at least 10,000"),
    (["--steps", "0"], "argument --steps"),
    (["--nproc-per-node", "0"], "argument --nproc-per-node"),
])
def test_data_memory_refuses_bad_input_before_any_run(tmp_path, capsys, argv, said):
    """python -m tools.data_memory: a missing --work-dir, a corpus too small for chapter
    03's batch on every rank, no steps or no ranks stop at parsing (one line, exit status
    2), not with a traceback or a failed torchrun after the first corpus was written."""
    from tools.data_memory import main
    with pytest.raises(SystemExit) as exit_:
        main([a.format(tmp=tmp_path) for a in argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_a_validation_split_of_few_documents_gets_a_note(tmp_path):
    """Whole documents go to validation: with few, one of them holds far more than 5% of
    the samples (here one of 5 alike, 20%), and the logged data line says so. The
    embedded corpus gets no note."""
    words = " ".join(f"w{i % 97}" for i in range(2000))
    root = write_files(tmp_path / "few", {f"d{i}.txt": words for i in range(5)})
    info = data.dataset_info(data.build_datasets(str(root) + "/", seq_len=16, vocab_size=300,
                                                 cache_dir=tmp_path / "cache"))
    assert info["documents"] == 5 and info["val_samples"] > 0.15 * (info["train_samples"] + info["val_samples"])
    assert info["note"].startswith("validation holds ") and "of the 5" in info["note"]
    stdlib = data.dataset_info(data.build_datasets("stdlib", seq_len=64))
    assert "note" not in stdlib and stdlib["val_samples"] < 0.1 * stdlib["train_samples"]


def stdlib_cache_copy(cache: Path, dest: Path) -> Path:
    """A copy in `dest` of the session cache's stdlib tokenizer (default vocabulary) and
    token folder, as the chapters' defaults read them; returns the copied token folder."""
    corpus = open_corpus("stdlib")
    tok, tok_path = get_tokenizer(corpus, cache_dir=cache)
    dest.mkdir()
    shutil.copy(tok_path, dest)
    folder = token_cache_path(corpus, tok, cache)
    shutil.copytree(folder, dest / folder.name)
    return dest / folder.name


@pytest.mark.parametrize("split", ["train", "val"])
def test_token_ids_beyond_the_vocabulary_stop_the_chapter_with_one_line(guide_cache, tmp_path, split):
    """A token cache whose sizes are intact but whose ids are damaged
    (every 50th is 60000, beyond the 8,192 tokens) ended in the embedding's IndexError, in
    training or, for val.bin, after it: now chapter 01 stops before any work with the
    cache's one line (exit status 2) naming the folder to delete."""
    folder = stdlib_cache_copy(guide_cache, tmp_path / "cache")
    tokens = np.memmap(folder / f"{split}.bin", dtype=np.uint16, mode="r+")
    tokens[:-1:50] = 60000
    tokens.flush()
    del tokens
    proc = run_warm(python_cmd("01-single-gpu/train_llm.py", *TINY, "--max-steps", 2, "--cache-dir",
                          tmp_path / "cache", "--save-dir", tmp_path / "out"), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: the token cache {folder} cannot be read (ValueError: {split}.bin holds token id "
        f"60000, outside the vocabulary of 8192); delete it (rm -r {folder}) and run again to rebuild it"]
    assert not (tmp_path / "out").exists()


def test_a_meta_json_nested_too_deep_is_the_caches_one_line(guide_cache, tmp_path):
    """json.loads of a meta.json nested 100,000 deep raises RecursionError: the same one
    line as any other damage to the cache."""
    folder = stdlib_cache_copy(guide_cache, tmp_path / "cache")
    (folder / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match=r"token cache .* cannot be read \(RecursionError: .*rm -r") as err:
        build_datasets("stdlib", seq_len=64, cache_dir=tmp_path / "cache")
    one_line(err)


def test_a_lone_file_gets_validation_and_says_when_its_vocabulary_is_smaller(tmp_path, caplog):
    """One .txt file is cut at its blank lines into documents, so that the split by
    document gives validation its share; a file without blank lines stays one document and
    the data line says why validation is empty. A corpus too small to fill --vocab-size
    says so in one line."""
    words = " ".join(f"w{i % 97}" for i in range(60))
    book = tmp_path / "book.txt"
    book.write_text("\n\n".join(f"Paragraph {i}: {words}" for i in range(40)) + "\n")
    with caplog.at_level(logging.INFO, logger="common.data"):
        d = build_datasets(str(book), seq_len=16, cache_dir=tmp_path / "cache")
    info = data.dataset_info(d)
    assert info["documents"] == 40 and info["val_samples"] > 0 and "note" not in info, info
    assert d.vocab_size < 8192
    said = [r.getMessage() for r in caplog.records if "--vocab-size" in r.getMessage()]
    assert said == [f"the tokenizer learned {d.vocab_size} tokens, fewer than --vocab-size 8192: this "
                    f"corpus is too small to fill it; the model's vocabulary is {d.vocab_size}"]
    book.write_text(f"{words}\n" * 40)  # no blank line: one document, nothing to set aside
    info = data.dataset_info(build_datasets(str(book), 16, vocab_size=VOCAB, cache_dir=tmp_path / "cache"))
    assert info["documents"] == 1 and info["val_samples"] == 0
    assert info["note"].startswith("validation holds 0% of the samples: the split sets whole documents"), info


@pytest.mark.parametrize("suffix, good, bad", [(".txt", "fine\n", bytes(range(128, 256)) * 20),
                                               (".jsonl", '{"text": "fine"}\n', b'{"text": "a"}\n{bad\n'),
                                               (".jsonl", '{"text": "fine"}\n', b'{"text": "\xff\xfe"}\n')],
                         ids=["txt", "jsonl", "jsonl-not-utf8"])
def test_an_unreadable_file_of_a_folder_is_named(tmp_path, suffix, good, bad):
    """A folder with one file that is not text (or not JSON lines) among good ones: the
    line names that file, not only the folder (datasets' own errors name none). Invalid
    UTF-8 inside a JSON string loads, and failed later with a UnicodeDecodeError traceback."""
    root = write_files(tmp_path / "corpus", {f"a{suffix}": good, f"c{suffix}": good})
    (root / f"b{suffix}").write_bytes(bad)
    with pytest.raises(DataError) as err:
        load_corpus(str(root))
    assert one_line(err).startswith(f"could not read {str(root / f'b{suffix}')!r} as text or JSON lines (")


def test_empty_files_a_fifo_and_a_line_without_whitespace(tmp_path, caplog):
    """A folder (or file) whose files are all empty was datasets' SchemaInferenceError
    ("Please pass features"), a flag no one has: it is the empty dataset's line. A FIFO
    named as the dataset was "does not exist", and is never opened (reading it blocks).
    A 300,000-character line without whitespace (minified JSON, base64) took BPE's
    training minutes (its time grows with the square of a word's length): the training
    cuts such runs into 1,000-character pieces, says so, and tokenizes the text whole."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    for name in (tmp_path / "empty", tmp_path / "empty" / "a.txt"):
        with pytest.raises(DataError) as err:
            load_corpus(str(name))
        assert one_line(err) == f"dataset {str(name)!r} is empty (no non-blank documents: its file is empty)"
    os.mkfifo(tmp_path / "fifo.txt")
    for name in (tmp_path / "fifo.txt", tmp_path / "fif*"):
        with pytest.raises(DataError) as err:
            data.check_dataset_name(str(name))  # before any work: only named, never opened
        assert one_line(err) == (f"local dataset {str(name)!r} is not a regular file or a folder (a FIFO, "
                                 f"socket or device is not read); name a file, folder or glob of files")

    text = "def f(x):\n    return x\n\n" * 20
    run = "".join(chr(ord("a") + (i * 7919) % 26) for i in range(300_000))  # letters only: one word
    cuts = [0]
    pieces = [piece for batch in data.long_runs_cut([[text + run + "\n" + text]], cuts) for piece in batch]
    assert [len(piece) for piece in pieces] == [len(text), *[data.LONGEST_WORD] * 300, len("\n" + text)]
    assert cuts == [1] and "".join(next(data.long_runs_cut([[text + run]], [0]))) == text + run
    (tmp_path / "minified").mkdir()
    (tmp_path / "minified" / "a.txt").write_text(text + run + "\n")
    started = time.process_time()
    with caplog.at_level(logging.INFO, logger="common.data"):
        tok, _ = data.get_tokenizer(open_corpus(str(tmp_path / "minified")), 400, cache_dir=tmp_path / "cache")
    assert time.process_time() - started < 30  # minutes, before
    assert [r.getMessage() for r in caplog.records if "without whitespace" in r.getMessage()] == [
        "the tokenizer's training cut 1 run(s) of more than 1000 characters without whitespace (minified "
        "JSON, base64, ...) into pieces of 1000: BPE's time grows with the square of a word's length; the "
        "corpus itself is tokenized whole"]
    assert tok.decode(tok.encode(run).ids) == run
