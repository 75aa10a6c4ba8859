"""The byte corpus: shipped data and checksums, user inputs, error messages, batches, chunks."""

import gzip
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from zosoma.corpus import (
    BatchSampler,
    Corpus,
    chunk,
    chunk_spans,
    default_corpus_dir,
    describe,
    load_corpus,
    load_text,
)
from zosoma.errors import ConfigError, DataError

DOMAINS = {"drama", "scripture", "legal", "code_python", "code_c", "tech_docs", "dictionary",
           "multilingual"}


def manifest():
    return json.loads((default_corpus_dir() / "MANIFEST.json").read_text())


@pytest.fixture(scope="module")
def train():
    return load_corpus()


def small_corpus(*texts):
    docs = tuple(np.frombuffer(t, dtype=np.uint8) for t in texts)
    return Corpus(tuple(f"d{i}" for i in range(len(texts))), docs)


# --- the shipped corpus ------------------------------------------------------------------------

def test_default_dir_has_manifest():
    assert (default_corpus_dir() / "MANIFEST.json").is_file()


def test_shipped_corpus_matches_manifest():
    heldout = load_corpus(split="heldout")
    entries = [e for e in manifest() if e["split"] == "heldout"]
    assert set(heldout.names) == DOMAINS and len(heldout) == 8
    assert heldout.names == tuple(e["domain"] for e in entries)
    for doc, e in zip(heldout.docs, entries):
        assert doc.dtype == np.uint8 and doc.ndim == 1 and len(doc) == e["bytes"]


def test_validation_is_the_tail_training_never_sees(train):
    """Each training file splits into train (the head) and validation (the last min(64 KiB, n/8)
    bytes): together exactly the file, never overlapping, so tuning on validation is honest."""
    validation = load_corpus(split="validation")
    entries = [e for e in manifest() if e["split"] == "train"]
    assert train.names == validation.names == tuple(e["domain"] for e in entries)
    for head, tail, e in zip(train.docs, validation.docs, entries):
        assert len(tail) == min(1 << 16, e["bytes"] // 8) and len(head) + len(tail) == e["bytes"]
        whole = load_text(default_corpus_dir() / e["file"])
        assert head.tobytes() + tail.tobytes() == whole.tobytes()


def test_train_and_heldout_differ(train):
    heldout = load_corpus(split="heldout")
    assert train.docs[0][:1000].tobytes() != heldout.docs[0][:1000].tobytes()


def test_unknown_split():
    with pytest.raises(DataError, match="split"):
        load_corpus(split="test")


@pytest.fixture
def corpus_copy(tmp_path):
    root = tmp_path / "corpus"
    shutil.copytree(default_corpus_dir(), root)
    return root


def test_copy_loads_like_the_shipped_corpus(corpus_copy, train):
    copy = load_corpus(corpus_copy)
    assert copy.names == train.names and copy.n_bytes == train.n_bytes
    heldout = load_corpus(split="heldout")
    assert load_corpus([corpus_copy], split="heldout").n_bytes == heldout.n_bytes


def test_tampered_file_fails_checksum(corpus_copy):
    path = corpus_copy / "train" / "legal.txt.gz"
    data = bytearray(gzip.decompress(path.read_bytes()))
    data[1234] ^= 0x01  # still valid gzip, same size, different bytes
    path.write_bytes(gzip.compress(bytes(data)))
    with pytest.raises(DataError, match="sha256") as err:
        load_corpus(corpus_copy)
    assert str(path) in str(err.value)
    assert len(load_corpus(corpus_copy, verify=False)) == 8
    load_corpus(corpus_copy, split="heldout")  # the other split is untouched


def test_truncated_file_fails_size(corpus_copy):
    path = corpus_copy / "heldout" / "drama.txt.gz"
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes())[:-10]))
    with pytest.raises(DataError, match="bytes") as err:
        load_corpus(corpus_copy, split="heldout")
    assert str(path) in str(err.value)


def test_corrupt_gzip_stream(corpus_copy):
    path = corpus_copy / "train" / "code_c.txt.gz"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="gzip") as err:
        load_corpus(corpus_copy)
    assert str(path) in str(err.value)


def test_missing_member_and_bad_manifest(corpus_copy):
    (corpus_copy / "train" / "dictionary.txt.gz").unlink()
    with pytest.raises(DataError, match="dictionary.txt.gz"):
        load_corpus(corpus_copy)
    (corpus_copy / "MANIFEST.json").write_text("{not json")
    with pytest.raises(DataError, match="MANIFEST.json"):
        load_corpus(corpus_copy)


# --- user files --------------------------------------------------------------------------------

def test_user_directory_file_and_list(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "b.txt").write_bytes(b"hello world\n")
    (d / "a.txt.gz").write_bytes(gzip.compress(b"compressed text"))
    (d / "notes.md").write_bytes(b"ignored: not .txt or .gz")
    (d / "sub").mkdir()
    (d / "sub" / "c.txt").write_bytes(b"not recursive")

    corpus = load_corpus(d)
    assert corpus.names == ("a", "b")  # sorted by file name, .gz looked through
    assert [doc.tobytes() for doc in corpus.docs] == [b"compressed text", b"hello world\n"]

    raw = tmp_path / "wiki.test.raw"
    raw.write_bytes(b"raw bytes \xff\x00")
    single = load_corpus(str(raw))
    assert single.names == ("wiki.test",) and single.docs[0].tobytes() == b"raw bytes \xff\x00"

    both = load_corpus([d, raw, d / "notes.md"])
    assert both.names == ("a", "b", "wiki.test", "notes")
    assert both.n_bytes == len(b"compressed text") + 12 + 12 + 24


def test_load_text(tmp_path):
    (tmp_path / "x.gz").write_bytes(gzip.compress(b"abc"))
    out = load_text(tmp_path / "x.gz")
    assert out.dtype == np.uint8 and out.tobytes() == b"abc"


def test_a_gzip_too_large_is_refused_while_streaming_and_one_that_fits_is_read_once(tmp_path, monkeypatch):
    """A .gz past the limit was decompressed up to the limit in memory before it was refused (4.3 GB
    for a 5 GiB file), and one within it was held twice over (2.2 GB for 1 GiB of zeros)."""
    import tracemalloc

    import zosoma.corpus as corpus
    monkeypatch.setattr(corpus, "MAX_BYTES", 32 << 20)
    monkeypatch.setattr(corpus, "GZIP_BLOCK", 1 << 20)
    (tmp_path / "big.gz").write_bytes(gzip.compress(bytes(64 << 20)))
    (tmp_path / "fits.gz").write_bytes(gzip.compress(bytes(range(256)) * (96 << 10)))  # 24 MiB
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="big.gz: decompresses to more than 0 GiB"):
            load_text(tmp_path / "big.gz")
        refused = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        out = load_text(tmp_path / "fits.gz")
        read = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert refused < 8 << 20  # a few blocks, not the 32 MiB the limit allows
    assert out.tobytes() == bytes(range(256)) * (96 << 10) and not out.flags.writeable
    assert read < (24 << 20) + (8 << 20)  # the array and a few blocks, not twice the text


def _missing(tmp_path):
    return tmp_path / "nope.txt", ()


def _file(tmp_path, name, data):
    """A file `name` holding `data`, loaded on its own."""
    p = tmp_path / name
    p.write_bytes(data)
    return p, ()


def _empty_file(tmp_path):
    return _file(tmp_path, "empty.txt", b"")


def _empty_dir(tmp_path):
    p = tmp_path / "emptydir"
    p.mkdir()
    (p / "readme.md").write_text("no text files")
    return p, ()


def _fake_gzip(tmp_path):
    return _file(tmp_path, "plain.txt.gz", b"this is not gzip")


def _truncated_gzip(tmp_path):
    return _file(tmp_path, "cut.gz", gzip.compress(b"x" * 10000)[:-12])


def _empty_gzip(tmp_path):
    return _file(tmp_path, "nothing.gz", gzip.compress(b""))


def _empty_in_dir(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.txt").write_bytes(b"fine")
    (d / "b.txt").write_bytes(b"")
    return d / "b.txt", (d,)


@pytest.mark.parametrize("make", [_missing, _empty_file, _empty_dir, _fake_gzip, _truncated_gzip,
                                  _empty_gzip, _empty_in_dir])
def test_errors_name_the_path(tmp_path, make):
    path, load_args = make(tmp_path)
    with pytest.raises(DataError) as err:
        load_corpus(*(load_args or (path,)))
    message = str(err.value)
    assert str(path) in message and "\n" not in message


def test_unreadable_file(tmp_path, monkeypatch):
    p = tmp_path / "secret.txt"
    p.write_bytes(b"data")

    def denied(self):  # chmod 0 would not stop root, so fake the refusal
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(DataError, match="cannot read") as err:
        load_corpus(p)
    assert str(p) in str(err.value)


def test_load_text_of_directory_and_empty_list(tmp_path):
    with pytest.raises(DataError, match=str(tmp_path)):
        load_text(tmp_path)
    with pytest.raises(DataError):
        load_corpus([])


def test_corpus_basics(train):
    sub = train.subset([2, 0])
    assert sub.names == (train.names[2], train.names[0]) and sub.docs[1] is train.docs[0]
    assert len(sub) == 2 and sub.n_bytes == len(train.docs[2]) + len(train.docs[0])
    assert describe(train).startswith(f"8 documents, {train.n_bytes:,} bytes")
    with pytest.raises(ValueError):
        Corpus(("a",), ())


# --- batches -----------------------------------------------------------------------------------

def test_batches_are_a_pure_function_of_seed_stream_step(train):
    sampler = BatchSampler(train, 65)
    a = sampler.batch(seed=7, stream=0, step=3, B=32)
    assert a.shape == (32, 65) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, BatchSampler(train, 65).batch(7, 0, 3, 32))
    for other in [(7, 0, 4), (7, 1, 3), (8, 0, 3)]:
        assert not np.array_equal(a, sampler.batch(*other, 32))


def test_windows_are_substrings(train):
    T1 = 129
    sampler = BatchSampler(train, T1)
    batch = sampler.batch(0, 2, 11, 256)
    doc, start = sampler.positions(0, 2, 11, 256)
    assert np.all(start >= 0)
    for b in range(len(batch)):
        assert start[b] + T1 <= len(train.docs[doc[b]])
        np.testing.assert_array_equal(batch[b], train.docs[doc[b]][start[b] : start[b] + T1])


def test_window_bounds_and_weights_on_a_tiny_corpus():
    # 'abcdef' holds 3 windows of 4 bytes, 'xyzw' 1, 'no' none: doc 0 should come up about 3/4.
    corpus = small_corpus(b"abcdef", b"xyzw", b"no")
    sampler = BatchSampler(corpus, 4)
    assert sampler.n_windows == 4
    batch = sampler.batch(1, 0, 0, 4000)
    seen = {row.tobytes() for row in batch}
    assert seen == {b"abcd", b"bcde", b"cdef", b"xyzw"}
    share = np.mean([row.tobytes() != b"xyzw" for row in batch])
    assert abs(share - 0.75) < 0.03


def test_corpus_too_small():
    with pytest.raises(DataError, match="largest document has 6 bytes"):
        BatchSampler(small_corpus(b"abcdef", b"xy"), 7)
    with pytest.raises(ConfigError):
        BatchSampler(small_corpus(b"abcdef"), 1)


# --- chunks ------------------------------------------------------------------------------------

def test_chunks_are_views_with_source_names():
    text = bytes(range(256)) * 4  # 1024 bytes
    docs = (np.frombuffer(text, np.uint8), np.frombuffer(text[:70], np.uint8))
    corpus = Corpus(("drama", "legal"), docs)
    chunks = chunk(corpus, 100)
    # 1024 -> 10 full + 24-byte tail (dropped, < 50); 70 -> a 70-byte partial chunk (kept, >= 50).
    assert chunks.names == ("drama",) * 10 + ("legal",)
    assert [len(c) for c in chunks.docs] == [100] * 10 + [70]
    assert all(np.shares_memory(c, corpus.docs[0]) for c in chunks.docs[:10])
    np.testing.assert_array_equal(chunks.docs[3], corpus.docs[0][300:400])
    assert chunk_spans(corpus, 100)[-1] == (1, 0, 70)
    assert [len(c) for c in chunk(corpus, 512).docs] == [512, 512]  # 70 < 256 dropped


def test_chunk_partial_threshold_and_errors():
    corpus = small_corpus(b"abcdefg")
    assert [c.tobytes() for c in chunk(corpus, 4).docs] == [b"abcd", b"efg"]  # 3 >= 2 kept
    assert [c.tobytes() for c in chunk(corpus, 1).docs] == [bytes([c]) for c in b"abcdefg"]
    assert [c.tobytes() for c in chunk(small_corpus(b"abcdefghi"), 4).docs] == [b"abcd", b"efgh"]
    with pytest.raises(DataError):
        chunk(small_corpus(b"abc"), 100)
    with pytest.raises(ConfigError):
        chunk(corpus, 0)


def test_chunk_shipped_corpus_covers_the_bytes(train):
    chunks = chunk(train, 4096)
    assert set(chunks.names) == DOMAINS
    assert train.n_bytes - chunks.n_bytes < 8 * 2048
    digest = hashlib.sha256(b"".join(c.tobytes() for c in chunks.docs[:3])).hexdigest()
    assert digest == hashlib.sha256(train.docs[0][: 3 * 4096].tobytes()).hexdigest()
