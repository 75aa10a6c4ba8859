"""Yardsticks: Kneser-Ney against a direct implementation, normalisation, Witten-Bell's figure,
the compressors' formula, the cache, and the tables that print them."""

import json
import lzma
import math
import zlib
from collections import Counter

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import one_line_error
from world import TINY_MODEL
from zosoma import yardsticks
from zosoma.cli.main import cli
from zosoma.corpus import Corpus, load_corpus
from zosoma.errors import ConfigError, DataError
from zosoma.yardsticks import (COMPRESSORS, KneserNey, compressed_nats, discounts, lookup, measure,
                               ngram_baselines, shipped)

TRAIN = (b"the cat sat on the mat. the cat ate the rat. a rat sat on a cat; the mat sat still. "
         b"that hat is the cat's hat, and the rat has no hat at all. ",
         b"at last the tall cat met the fat rat at the mat and sat.")
HELD = b"the rat sat on that cat's mat at last, and the fat hat sat on the cat. zebra!"


def as_corpus(*texts, names=None):
    return Corpus(tuple(names or [f"d{i}" for i in range(len(texts))]),
                  tuple(np.frombuffer(t, np.uint8) for t in texts))


# --- a direct, slow Kneser-Ney: dicts of byte strings, the textbook formulas ----------------------

class DirectKneserNey:
    """Interpolated modified Kneser-Ney as Chen & Goodman (1998) write it, one byte string at a time."""

    def __init__(self, docs, order):
        self.order = order
        raw = [Counter() for _ in range(order + 2)]  # raw[n][gram] for grams of n bytes
        for doc in docs:
            for n in range(1, order + 1):
                for i in range(len(doc) - n + 1):
                    raw[n][doc[i:i + n]] += 1
        self.counts = {order: raw[order]}
        for n in range(1, order):  # continuation: distinct bytes seen before the n-gram
            self.counts[n] = Counter(gram[1:] for gram in raw[n + 1])
        self.D = {}
        for n, c in self.counts.items():
            nk = {k: sum(1 for v in c.values() if v == k) for k in (1, 2, 3, 4)}
            y = nk[1] / (nk[1] + 2 * nk[2]) if nk[1] else 0.5
            estimate = {k: k - (k + 1) * y * nk[k + 1] / nk[k] if nk[k] else 0 for k in (1, 2, 3)}
            self.D[n] = {k: d if 0 < d <= k else y for k, d in estimate.items()}  # too few counts: Y

    def p(self, w: int, history: bytes, n=None) -> float:
        n = self.order if n is None else n
        if n == 0:
            return 1 / 256
        lower = self.p(w, history, n - 1)
        if len(history) < n - 1:
            return lower
        h = history[len(history) - (n - 1):]
        c, D = self.counts[n], self.D[n]
        in_context = {g: v for g, v in c.items() if g[:-1] == h}
        total = sum(in_context.values())
        if total == 0:
            return lower
        gamma = sum(D[min(v, 3)] for v in in_context.values()) / total
        v = in_context.get(h + bytes([w]), 0)
        return (max(v - D[min(v, 3)], 0) if v else 0) / total + gamma * lower


def direct_history(data: bytes, p: int, segment: int, context: int) -> bytes:
    """What the segment protocol lets position p read: the bytes from its segment's context start."""
    p0 = 1 + (p - 1) // segment * segment
    return data[max(p0 - context, 0):p]


@pytest.mark.parametrize("segment, context", [(256, 512), (5, 2)])
def test_kneser_ney_matches_a_direct_implementation(segment, context):
    orders = (1, 2, 3, 4)
    model = KneserNey(as_corpus(*TRAIN), orders)
    nats = model.nats(np.frombuffer(HELD, np.uint8), segment, context)
    for n in orders:
        direct = DirectKneserNey(TRAIN, n)
        expected = -sum(math.log(direct.p(HELD[p], direct_history(HELD, p, segment, context)))
                        for p in range(1, len(HELD)))
        assert nats[n].n_bytes == len(HELD) - 1
        assert nats[n].nats == pytest.approx(expected, rel=1e-12)
        for history in (b"", b"t", b"the", b" the c", b"zzz", HELD[:40]):
            every = [direct.p(w, history) for w in range(256)]
            np.testing.assert_allclose(model.distribution(history, n), every, rtol=1e-12, atol=0)


def test_every_distribution_sums_to_one():
    train = load_corpus(None, "train")
    train = Corpus(train.names, tuple(d[:50_000] for d in train.docs))  # every domain, quickly
    model = KneserNey(train, range(1, 9))
    rng = np.random.default_rng(0)
    held = load_corpus(None, "heldout").docs
    histories = [bytes(held[i][s:s + rng.integers(0, 12)]) for i, s in
                 zip(rng.integers(0, len(held), 40), rng.integers(0, 20_000, 40))]  # contexts the model has seen
    histories += [rng.integers(0, 256, rng.integers(0, 12)).astype(np.uint8).tobytes() for _ in range(20)]
    for history in histories:
        for n in range(1, 9):
            p = model.distribution(history, n)
            assert abs(p.sum() - 1) < 1e-9 and (p > 0).all(), (history, n, p.sum())


def test_discounts():
    counts = np.repeat([1, 2, 3, 4, 9], [10, 4, 3, 2, 1])  # n1..n4 = 10, 4, 3, 2
    y = 10 / (10 + 8)
    np.testing.assert_allclose(discounts(counts), [1 - 2 * y * 4 / 10, 2 - 3 * y * 3 / 4, 3 - 4 * y * 2 / 3])
    assert discounts(np.array([1, 1, 5])).tolist() == [1.0, 1.0, 1.0]  # no twos, no threes: Y = 1
    assert discounts(np.array([2, 2, 3])).tolist() == [0.5, 2 - 3 * 0.5 / 2, 3.0]  # no singletons: Y = 1/2
    low = discounts(np.repeat([1, 2, 3, 4], [4, 2, 1, 2]))  # D3+ = 3 - 4 (1/2) 2 / 1 = -1: Y
    assert low.tolist() == [0.5, 2 - 3 * 0.5 * 1 / 2, 0.5]


def test_bad_orders_and_texts():
    for orders in ([], [0], [9], [True]):
        with pytest.raises(ConfigError):
            KneserNey(as_corpus(*TRAIN), orders)
    with pytest.raises(DataError):
        measure(as_corpus(*TRAIN), as_corpus(b"a"), cache=False)
    with pytest.raises(DataError):
        measure(as_corpus(b"ab"), as_corpus(HELD), cache=False)


# --- Witten-Bell, unchanged -----------------------------------------------------------------------

def test_ngram_baselines():
    train = Corpus(("t",), (np.frombuffer(b"abababab", np.uint8),))
    held = Corpus(("h",), (np.frombuffer(b"abab", np.uint8),))
    base = ngram_baselines(train, held)
    # unigram: a and b each counted 4 (+1 smoothing) out of 8 + 256
    assert base["unigram"] == pytest.approx(-math.log(5 / 264))
    # bigram: a->b seen 4 times (+1) of 4 + 256; b->a seen 3 times (+1) of 3 + 256
    expected = -(2 * math.log(5 / 260) + math.log(4 / 259)) / 3
    assert base["bigram"] == pytest.approx(expected)
    # trigram (Witten-Bell): after "ab", a seen 3 times (one distinct byte); after "ba", b 3 times;
    # each backs off to the Witten-Bell bigram, which backs off to the add-one unigram
    p_a, p_b = 5 / 264, 5 / 264
    a_after_b, b_after_a = (3 + p_a) / 4, (4 + p_b) / 5
    expected = -(math.log(p_b) + math.log((3 + a_after_b) / 4) + math.log((3 + b_after_a) / 4)) / 3
    assert base["trigram"] == pytest.approx(expected)


@pytest.mark.slow
def test_witten_bell_figure_of_the_shipped_corpus_is_unchanged():
    base = ngram_baselines(load_corpus(None, "train"), load_corpus(None, "heldout"))
    # what zosoma.model.evaluate.ngram_baselines gave before it moved here
    assert base == pytest.approx({"unigram": 3.349440285870445, "bigram": 2.741232534495536,
                                  "trigram": 2.220644774937308}, rel=1e-12)


def test_measure_pools_documents_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    texts = as_corpus(HELD, HELD[::-1], HELD[:30], names=["x", "y", "x"])
    y = measure(as_corpus(*TRAIN), texts, orders=(2, 4), cache=False)
    assert list(y.nats) == ["witten-bell-3", "kneser-ney-2", "kneser-ney-4", "zlib-9", "bz2-9", "xz-9e"]
    assert list(y.nats["zlib-9"]) == ["x", "y", "overall"]
    assert y.overall("witten-bell-3") == pytest.approx(ngram_baselines(as_corpus(*TRAIN), texts)["trigram"], rel=1e-14)
    kn = KneserNey(as_corpus(*TRAIN), (4,))
    x = [kn.nats(d)[4] for d in (texts.docs[0], texts.docs[2])]
    assert y.nats["kneser-ney-4"]["x"] == pytest.approx(sum(r.nats for r in x) / sum(r.n_bytes for r in x), rel=1e-14)
    assert y.best_compressor in COMPRESSORS and y.overall(y.best_compressor) == min(y.overall(k) for k in COMPRESSORS)
    assert not (tmp_path / "zosoma").exists()  # cache=False writes nothing


# --- compressors ----------------------------------------------------------------------------------

def test_compressor_cost_is_the_direct_formula():
    data = (b"In the beginning was the word, and the word was with the text. " * 9)[:517]
    segment, context = 100, 50
    for name, compress in COMPRESSORS.items():
        added, p0 = 0, 1
        while p0 < len(data):  # segments predict positions 1.., each after at most `context` bytes
            c0, p1 = max(p0 - context, 0), min(p0 + segment, len(data))
            added += len(compress(data[c0:p1])) - len(compress(data[c0:p0]))
            p0 = p1
        r = compressed_nats(compress, np.frombuffer(data, np.uint8), segment, context)
        assert r.n_bytes == len(data) - 1
        assert r.nats == pytest.approx(8 * math.log(2) * added, rel=1e-15), name
    one = compressed_nats(COMPRESSORS["zlib-9"], np.frombuffer(data[:300], np.uint8))  # one segment of 256
    expected = 8 * (len(zlib.compress(data[:257], 9)) - len(zlib.compress(data[:1], 9))) * math.log(2)
    assert one.nats == pytest.approx(expected) and one.n_bytes == 299


def test_xz_with_the_small_dictionary_is_xz_9e():
    text = bytes(load_corpus(None, "heldout").docs[0][:5000])
    for piece in (text[:768], text[1000:1512], text[3000:3256]):
        assert len(COMPRESSORS["xz-9e"](piece)) == len(lzma.compress(piece, preset=9 | lzma.PRESET_EXTREME))


# --- the cache and lookup -------------------------------------------------------------------------

def test_cache_is_read_back_and_a_damaged_one_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    train, texts = as_corpus(*TRAIN), as_corpus(HELD)
    first = measure(train, texts, orders=(3,))
    [path] = (tmp_path / "zosoma" / "yardsticks").iterdir()
    with monkeypatch.context() as m:
        m.setattr(yardsticks, "KneserNey", None)  # a cache hit counts nothing
        assert measure(train, texts, orders=(3,)) == first
    assert measure(train, texts, orders=(3, 4)).orders == (3, 4)  # other orders: another entry
    assert measure(train, as_corpus(HELD[:-1]), orders=(3,)) != first  # other bytes: another entry
    path.write_text("{not json")
    assert measure(train, texts, orders=(3,)) == first
    assert json.loads(path.read_text())["nats"] == first.nats  # measured again and cached again


def test_a_cache_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch):
    (tmp_path / "zosoma").write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.warns(UserWarning, match="yardsticks not cached"):
        y = measure(as_corpus(*TRAIN), as_corpus(HELD), orders=(3,))
    assert y.overall("kneser-ney-3") > 0


@pytest.fixture
def small_shipped(tmp_path, monkeypatch):
    """The shipped splits replaced by small texts (yardsticks reads them through load_corpus),
    WikiText-103 by a small file, the cache by an empty folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    wiki = tmp_path / "wiki.test.raw"
    wiki.write_bytes(HELD[::-1] * 3)
    monkeypatch.setenv("ZOSOMA_WIKITEXT103", str(wiki))
    splits = {"train": as_corpus(*TRAIN), "heldout": as_corpus(HELD, HELD[5:], names=["prose", "more"])}
    monkeypatch.setattr(yardsticks, "load_corpus", lambda paths=None, split="train", verify=True: splits[split])
    return splits


def test_lookup_finds_what_shipped_measured(small_shipped):
    held = small_shipped["heldout"]
    assert lookup(held) == {}
    measured = shipped(orders=(2, 3))
    assert set(measured) == {"heldout", "wikitext103"}
    assert lookup(held, orders=(2, 3)) == measured
    assert lookup(held) == {}  # the default orders were not measured
    assert lookup(as_corpus(HELD), orders=(2, 3)) == {"wikitext103": measured["wikitext103"]}
    assert lookup(held, segment=128, orders=(2, 3)) == {}


def test_data_yardsticks_command(small_shipped):
    result = CliRunner().invoke(cli, ["data", "yardsticks", "--orders", "3,2", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "is not the official wiki.test.raw" in result.stderr  # the fixture's small file, said as eval says it
    out = json.loads(result.stdout)
    expected = shipped(orders=(2, 3))
    assert out["schema"] == "zosoma.data-yardsticks/1" and out["orders"] == [2, 3]
    assert out["heldout"] == expected["heldout"].nats
    assert out["wikitext103"] == {k: v["overall"] for k, v in expected["wikitext103"].nats.items()}
    text = CliRunner().invoke(cli, ["data", "yardsticks", "--orders", "2,3"], catch_exceptions=False).output
    assert "KN 3-gram" in text and f"{expected['heldout'].overall('xz-9e'):.3f}" in text.splitlines()[-3]
    for bad in ("9", "4,x", ""):
        assert "--orders" in one_line_error(CliRunner().invoke(cli, ["data", "yardsticks", "--orders", bad]), code=2)


def test_eval_prints_the_yardsticks_beside_its_table(small_shipped, tmp_path):
    from zosoma.config import TrainConfig
    from zosoma.formats.checkpoint import Checkpoint, save_checkpoint
    from zosoma.model.params import init_params

    model = TINY_MODEL
    ckpt = tmp_path / "model.h5"
    save_checkpoint(ckpt, Checkpoint(model=model, train=TrainConfig(optimizer="sgd"), theta=init_params(model, seed=0), step=0))
    held = tmp_path / "held"
    held.mkdir()
    (held / "prose.txt").write_bytes(HELD)

    def shown(*args):
        result = CliRunner().invoke(cli, ["eval", str(ckpt), "--data", str(held), *args], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return [line for line in result.output.splitlines() if line.startswith("yardsticks")]

    assert shown() == []
    y = measure(small_shipped["train"], load_corpus([held], "heldout"))  # as zosoma data yardsticks caches it
    wiki = shipped()["wikitext103"]
    line = (f"yardsticks, held-out (zosoma data yardsticks): Witten-Bell 3-gram {y.overall('witten-bell-3'):.3f}; "
            f"Kneser-Ney 4-gram {y.overall('kneser-ney-4'):.3f}, 5-gram {y.overall('kneser-ney-5'):.3f}, "
            f"8-gram {y.overall('kneser-ney-8'):.3f}; best compressor")
    lines = shown()
    assert len(lines) == 2 and lines[0].startswith(line) and lines[1].startswith("yardsticks, WikiText-103")
    assert f"{wiki.overall('kneser-ney-8'):.3f}" in lines[1]
    assert shown("--streams", "1") == []  # another protocol: nothing to compare with
    assert shown("--segment", "128") == []



def test_ship_writes_records_that_lookup_reads_without_a_cache(small_shipped, tmp_path, monkeypatch):
    monkeypatch.setattr(yardsticks, "shipped_dir", lambda: tmp_path / "shipped")
    result = CliRunner().invoke(cli, ["data", "yardsticks", "--orders", "2,3", "--ship", "--no-cache"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "shipped").glob("*.json"))) == 2
    assert not (tmp_path / "cache").exists()  # --no-cache: nothing cached, only shipped
    found = lookup(small_shipped["heldout"], orders=(2, 3))
    assert set(found) == {"heldout", "wikitext103"} and found["heldout"].orders == (2, 3)


@pytest.mark.slow
def test_the_shipped_corpus_ships_its_heldout_yardsticks(tmp_path, monkeypatch):
    """Every machine's tables have the shipped corpus's yardsticks (no cache here), and they are
    what measuring again gives."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    held = load_corpus(None, "heldout")
    found = lookup(held)["heldout"]
    assert found == measure(load_corpus(None, "train"), held, cache=False)
    assert round(found.overall("kneser-ney-8"), 3) == 1.475
