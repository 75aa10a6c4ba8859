"""Yardsticks: the figures a byte model's nats/byte are read beside.

Byte n-gram models counted on the training split, and the standard library's compressors, each
scored on held-out text by the segment protocol every results table uses (zosoma.mixture.routing:
the n - 1 predicted bytes of a file, cut into segments of `segment` bytes, each read after at most
`context` bytes of context), per document name and overall, in nats/byte:

    witten-bell-3   interpolated Witten-Bell trigram down to an add-one unigram (Witten & Bell
                    1991): ngram_baselines, the figure `zosoma data show` prints
    kneser-ney-N    interpolated modified Kneser-Ney N-gram, N <= 8 (KneserNey)
    zlib-9, bz2-9, xz-9e
                    a segment costs what its bytes add to its compressed context:
                    8 (len C(context + segment) - len C(context)) bits

An n-gram reads only the last N - 1 bytes, so with context >= 7 the protocol gives it every byte
it can use except near the start of a file; the compressors read the whole context.

Results are cached under zosoma's cache folder, keyed by the bytes they were measured on, the
protocol and the orders (measure); the evaluation tables print them from there or, for the shipped
corpus by the default protocol, from the records shipped beside it (data/corpus/yardsticks/, written
by `zosoma data yardsticks --ship`), so every table has them without a minute of measuring (lookup).
"""

from __future__ import annotations

import bz2
import hashlib
import json
import lzma
import math
import warnings
import zlib
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from zosoma.atomic import atomic_write
from zosoma.corpus import Corpus, default_corpus_dir, describe, load_corpus, load_text
from zosoma.download import cache_root, check_wikitext103, find_wikitext103
from zosoma.errors import ConfigError, DataError, ZosomaError
from zosoma.model.evaluate import EvalResult
from zosoma.model.protocol import PROTOCOL

MAX_ORDER = 8  # an n-gram of at most 8 bytes packs into one uint64 key
ORDERS = (4, 5, 8)  # the Kneser-Ney orders reported by default
CACHE_VERSION = "zosoma.yardsticks/1"  # part of every cache key: change it when a figure's method changes
WIKITEXT = "WikiText-103"  # the document name of wiki.test.raw in the yardsticks


def _segment_bounds(n: int, segment: int, context: int):
    """zosoma.mixture.routing.segment_bounds, imported when first scored: routing imports the
    clusterer (Numba, SciPy), which `zosoma data show` has no use for."""
    from zosoma.mixture.routing import segment_bounds

    return segment_bounds(n, segment, context)


# --- Witten-Bell, add-one ------------------------------------------------------------------------

def ngram_baselines(train: Corpus, heldout: Corpus) -> dict[str, float]:
    """Held-out nats/byte of byte n-gram models counted on `train`: the yardsticks a trained
    LSTM should beat (untrained: ln 256 = 5.545). Unigram and bigram add-one smoothed; the
    trigram interpolated by Witten-Bell (Witten & Bell 1991): p(c | a b) = (n(abc) + t(ab)
    p_wb(c | b)) / (n(ab.) + t(ab)), t(ab) the distinct bytes seen after ab, down to the
    add-one unigram, so no trigram has probability 0."""
    tables = _baseline_tables(train)
    uni = bi = tri = 0.0
    for doc in heldout.docs:
        u, b, t = _baseline_nats(tables, doc)
        uni, bi, tri = uni + u, bi + b, tri + t
    n = sum(d.size - 1 for d in heldout.docs)
    return {"unigram": uni / n, "bigram": bi / n, "trigram": tri / n}


def _baseline_tables(train: Corpus) -> tuple:
    unigram = np.ones(256)
    bigram = np.zeros((256, 256))
    codes = []
    for doc in train.docs:
        d = doc.astype(np.int64)
        unigram += np.bincount(d, minlength=256)
        np.add.at(bigram, (d[:-1], d[1:]), 1)
        codes.append((d[:-2] << 16) | (d[1:-1] << 8) | d[2:])
    p1 = unigram / unigram.sum()
    n2, t2 = bigram.sum(axis=1, keepdims=True), (bigram > 0).sum(axis=1, keepdims=True)
    wb2 = np.where(n2 > 0, (bigram + t2 * p1) / np.maximum(n2 + t2, 1), p1)  # (256, 256) p_wb(c | b)
    seen, counts = np.unique(np.concatenate(codes), return_counts=True)  # the trigrams of train
    n3 = np.bincount(seen >> 8, weights=counts, minlength=1 << 16)  # per context ab
    t3 = np.bincount(seen >> 8, minlength=1 << 16)
    add_one = np.log((bigram + 1) / (bigram + 1).sum(axis=1, keepdims=True))
    return p1, wb2, seen, counts, n3, t3, add_one


def _baseline_nats(tables: tuple, doc: np.ndarray) -> tuple[float, float, float]:
    """Nats of the predicted bytes of one document (positions 1 .. n-1): unigram, bigram, trigram."""
    p1, wb2, seen, counts, n3, t3, add_one = tables
    d = doc.astype(np.int64)
    uni = -np.log(p1[d[1:]]).sum()
    bi = -add_one[d[:-1], d[1:]].sum()
    x = (d[:-2] << 16) | (d[1:-1] << 8) | d[2:]
    at = np.minimum(np.searchsorted(seen, x), seen.size - 1)
    c = np.where(seen[at] == x, counts[at], 0)
    ab, back = x >> 8, wb2[d[1:-1], d[2:]]
    p3 = np.where(n3[ab] > 0, (c + t3[ab] * back) / np.maximum(n3[ab] + t3[ab], 1), back)
    tri = -(np.log(p1[d[1]]) + np.log(p3).sum())  # the first predicted byte by the unigram
    return float(uni), float(bi), float(tri)


# --- Kneser-Ney ----------------------------------------------------------------------------------

def grams(doc: np.ndarray, n: int) -> np.ndarray:
    """(len(doc) - n + 1,) uint64: the key of each n-gram of doc, its first byte in the highest
    bits, so that key >> 8 is its context and key & 255 the byte it predicts."""
    d = doc.astype(np.uint64)
    m = max(d.size - n + 1, 0)
    key = np.zeros(m, np.uint64)
    for j in range(n):
        key = (key << np.uint64(8)) | d[j:j + m]
    return key


def discounts(counts: np.ndarray) -> np.ndarray:
    """(3,) D1, D2, D3+ of modified Kneser-Ney from the counts' count-of-counts n1..n4 (Chen &
    Goodman 1998's estimates): Y = n1 / (n1 + 2 n2), D1 = 1 - 2 Y n2 / n1 = Y,
    Dk = k - (k + 1) Y n_{k+1} / n_k.
    Where too few counts leave an estimate undefined or outside (0, k], it is Y, the one discount
    of plain interpolated Kneser-Ney; and Y is 1/2 when no n-gram was seen once. So every discount
    lies in (0, k]: no count goes negative, and every context keeps mass for the bytes it never
    saw (no probability is 0)."""
    n = np.bincount(np.minimum(counts, 5), minlength=6)[1:5].astype(np.float64)  # n1 .. n4
    y = n[0] / (n[0] + 2 * n[1]) if n[0] > 0 else 0.5
    d = [y]
    for k in (2, 3):
        estimate = k - (k + 1) * y * n[k] / n[k - 1] if n[k - 1] > 0 else 0.0
        d.append(estimate if 0 < estimate <= k else y)
    return np.array(d)


@dataclass(frozen=True)
class _Table:
    """One order's n-grams with a positive count, and what interpolation needs of their contexts."""

    keys: np.ndarray  # (G,) uint64, sorted
    kept: np.ndarray  # (G,) float64: count minus its discount (D_k <= k: never negative)
    contexts: np.ndarray  # (C,) uint64, sorted: key >> 8 of the keys
    total: np.ndarray  # (C,) float64: the counts in the context, summed
    backoff: np.ndarray  # (C,) float64: the discounts taken in the context, the lower order's mass

    @classmethod
    def of(cls, keys: np.ndarray, counts: np.ndarray) -> "_Table":
        """From sorted unique keys and their positive counts."""
        if keys.size == 0:  # a text shorter than the order
            none = np.zeros(0)
            return cls(keys, none, keys, none, none)
        taken = discounts(counts)[np.minimum(counts, 3) - 1]  # (G,)
        ctx = keys >> np.uint64(8)
        first = np.flatnonzero(np.r_[True, ctx[1:] != ctx[:-1]])  # sorted keys: a context's n-grams are adjacent
        return cls(keys, counts - taken, ctx[first], np.add.reduceat(counts.astype(np.float64), first),
                   np.add.reduceat(taken, first))

    def interpolate(self, keys: np.ndarray, usable: np.ndarray, lower: np.ndarray) -> np.ndarray:
        """(M,) p(w | h) = (max(c(hw) - D, 0) + backoff(h) lower) / total(h) for each key hw whose
        context h was seen (and is `usable`, within the history); lower elsewhere."""
        if self.keys.size == 0:
            return lower
        ctx = keys >> np.uint64(8)
        ci = np.minimum(np.searchsorted(self.contexts, ctx), self.contexts.size - 1)
        seen = usable & (self.contexts[ci] == ctx)
        gi = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
        kept = np.where(self.keys[gi] == keys, self.kept[gi], 0.0)
        return np.where(seen, (kept + self.backoff[ci] * lower) / self.total[ci], lower)


class KneserNey:
    """Interpolated modified Kneser-Ney byte n-grams counted on `train` (Chen & Goodman 1998, "An
    Empirical Study of Smoothing Techniques for Language Modeling", Harvard TR-10-98), one model
    per order in `orders` (each at most MAX_ORDER):

        p_N(w | h) = (max(c(hw) - D(c(hw)), 0) + (D1 N1(h.) + D2 N2(h.) + D3+ N3+(h.)) p_{N-1}(w | h')) / c(h.)

    h the last N - 1 bytes, h' its last N - 2; a context never seen leaves p_{N-1}(w | h'). The
    top order counts occurrences; each lower order k counts, for a k-gram, the distinct bytes seen
    before it (the continuation count N1+(.hw)); each order has its own discounts D1, D2, D3+
    (`discounts`); below order 1 the uniform 1/256. Every conditional distribution sums to 1.
    Counting sorts uint64 keys (grams), never a Python object per byte. n-grams do not cross
    documents.
    """

    def __init__(self, train: Corpus, orders: Sequence[int] = ORDERS):
        self.orders = check_orders(orders)
        top = max(self.orders)
        counted = []  # (keys, counts) of every order 1 .. top, as counted in train
        for n in range(1, top + 1):
            keys = np.concatenate([grams(d, n) for d in train.docs] or [np.zeros(0, np.uint64)])
            counted.append(np.unique(keys, return_counts=True))
        self._raw = {n: _Table.of(*counted[n - 1]) for n in self.orders}
        self._continuation = {}
        for n in range(1, top):  # distinct bytes before each n-gram: the (n+1)-grams that end in it
            mask = np.uint64((1 << (8 * n)) - 1)
            self._continuation[n] = _Table.of(*np.unique(counted[n][0] & mask, return_counts=True))

    def probabilities(self, keys: Sequence[np.ndarray], history: np.ndarray) -> dict[int, np.ndarray]:
        """{order: (M,) p(w | h)} for M predicted bytes w: keys[k - 1] (M,) uint64 the k-gram
        (grams' keys) ending in each w, for k = 1 .. max(orders); history (M,) the number of bytes
        before w the model may read (a k-gram needs k - 1)."""
        lower = np.full(len(history), 1 / 256)
        out = {}
        for k in range(1, max(self.orders) + 1):
            usable = history >= k - 1
            if k in self._raw:
                out[k] = self._raw[k].interpolate(keys[k - 1], usable, lower)
            if k in self._continuation:
                lower = self._continuation[k].interpolate(keys[k - 1], usable, lower)
        return out

    def distribution(self, history: bytes, order: int) -> np.ndarray:
        """(256,) p(w | history) of every byte w under the model of `order`."""
        h = np.frombuffer(bytes(history), np.uint8)[-(MAX_ORDER - 1):].astype(np.uint64)
        w = np.arange(256, dtype=np.uint64)
        keys = []
        for k in range(1, max(self.orders) + 1):
            ctx = np.uint64(0)
            for b in h[len(h) - min(k - 1, len(h)):]:
                ctx = (ctx << np.uint64(8)) | b
            keys.append((ctx << np.uint64(8)) | w)
        return self.probabilities(keys, np.full(256, len(history)))[order]

    def nats(self, data: np.ndarray, segment: int = PROTOCOL.segment,
             context: int = PROTOCOL.context) -> dict[int, EvalResult]:
        """{order: nats of the predicted bytes of one file} by the segment protocol: position p of
        segment (c0, p0, p1) may read data[c0:p], at most its last order - 1 bytes."""
        c0, p0, p1 = _segment_bounds(data.size, segment, context)
        history = np.arange(1, data.size) - np.repeat(c0, p1 - p0)  # (n - 1,) bytes before each predicted one
        d = data.astype(np.uint64)
        key = d.copy()  # (n,) the k-gram ending at each position (zeros before the start of the file)
        keys = [key[1:]]
        for k in range(2, max(self.orders) + 1):
            older = np.zeros_like(key)
            older[k - 1:] = d[:max(d.size - k + 1, 0)] << np.uint64(8 * (k - 1))
            key = key | older
            keys.append(key[1:])
        return {k: EvalResult(float(-np.log(p).sum()), data.size - 1)
                for k, p in self.probabilities(keys, history).items()}


def check_orders(orders: Sequence[int]) -> tuple[int, ...]:
    """Sorted distinct orders, each 1 .. MAX_ORDER; ConfigError otherwise."""
    if not len(orders) or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_ORDER
                              for n in orders):
        raise ConfigError(f"n-gram orders {list(orders)}: each must be 1 to {MAX_ORDER} (a key of 8 bytes)")
    return tuple(sorted({int(n) for n in orders}))


# --- compressors ---------------------------------------------------------------------------------

def _xz(data: bytes) -> bytes:
    """xz -9e: preset 9 | PRESET_EXTREME, with the 64 MiB dictionary cut to the smallest power of
    two (at least 4 KiB) that holds the input. The dictionary only bounds how far back a match
    reaches, so the output has the same length (the tests compare), without the ~0.4 s each call
    spends setting up the 64 MiB one."""
    size = max(1 << 12, 1 << (len(data) - 1).bit_length())
    return lzma.compress(data, filters=[{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME,
                                         "dict_size": size}])


COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "zlib-9": lambda b: zlib.compress(b, 9),
    "bz2-9": lambda b: bz2.compress(b, 9),
    "xz-9e": _xz,
}


def compressed_nats(compress: Callable[[bytes], bytes], data: np.ndarray, segment: int = PROTOCOL.segment,
                    context: int = PROTOCOL.context) -> EvalResult:
    """Nats of the predicted bytes of one file by the segment protocol, a segment costing what its
    bytes add to its compressed context: 8 (len C(data[c0:p1]) - len C(data[c0:p0])) bits."""
    raw = bytes(data)
    added = sum(len(compress(raw[a:c])) - len(compress(raw[a:b]))
                for a, b, c in zip(*(x.tolist() for x in _segment_bounds(len(raw), segment, context))))
    return EvalResult(8 * math.log(2) * added, len(raw) - 1)


# --- the record, measured or cached --------------------------------------------------------------

LABELS = {"witten-bell-3": "Witten-Bell 3-gram", "zlib-9": "zlib -9", "bz2-9": "bz2 -9", "xz-9e": "xz -9e"}


def label(key: str) -> str:
    """'kneser-ney-8' -> 'Kneser-Ney 8-gram', 'xz-9e' -> 'xz -9e'."""
    return LABELS.get(key) or f"Kneser-Ney {key.rsplit('-', 1)[1]}-gram"


@dataclass(frozen=True)
class Yardsticks:
    """Nats/byte of each yardstick on one set of texts: nats[yardstick][document name or
    "overall"]. Yardsticks in order: "witten-bell-3", "kneser-ney-N" for each of `orders`, then
    COMPRESSORS' keys."""

    nats: dict
    segment: int
    context: int
    orders: tuple
    train: str  # the training text the n-grams counted, described

    def overall(self, key: str) -> float:
        return self.nats[key]["overall"]

    @property
    def best_compressor(self) -> str:
        return min(COMPRESSORS, key=self.overall)


def measure(train: Corpus, texts: Corpus, orders: Sequence[int] = ORDERS, segment: int = PROTOCOL.segment,
            context: int = PROTOCOL.context, cache: bool = True) -> Yardsticks:
    """The yardsticks of n-grams counted on `train` and of the compressors, on `texts` (each
    document at least 2 bytes), per document name (documents sharing a name pooled) and overall.
    With `cache`, read from zosoma's cache when measured before on the same bytes, and stored
    there when not (a cache that cannot be written is a warning)."""
    orders = check_orders(orders)
    if len(texts) == 0 or all(d.size < 3 for d in train.docs):
        raise DataError("yardsticks need texts to score and a training text of at least 3 bytes")
    for doc in texts.docs:
        _segment_bounds(doc.size, segment, context)  # bad settings or a file too short: one line, now
    entry = _key(train, texts, orders, segment, context)
    if cache and (found := _find(entry)) is not None:
        return found
    wb, kn = _baseline_tables(train), KneserNey(train, orders)
    per_doc: dict[str, list[EvalResult]] = {}
    for doc in texts.docs:
        per_doc.setdefault("witten-bell-3", []).append(EvalResult(_baseline_nats(wb, doc)[2], doc.size - 1))
        for n, r in kn.nats(doc, segment, context).items():
            per_doc.setdefault(f"kneser-ney-{n}", []).append(r)
        for key, compress in COMPRESSORS.items():
            per_doc.setdefault(key, []).append(compressed_nats(compress, doc, segment, context))
    nats = {key: {name: r.nats_per_byte for name, r in _pooled(texts.names, results).items()}
            for key, results in per_doc.items()}
    record = Yardsticks(nats, segment, context, orders, describe(train))
    if cache:
        _write(cache_root() / "yardsticks" / entry, record)
    return record


def shipped(orders: Sequence[int] = ORDERS, segment: int = PROTOCOL.segment, context: int = PROTOCOL.context,
            wikitext=None, cache: bool = True, ship: bool = False) -> dict[str, Yardsticks]:
    """`measure` of the shipped training split on the shipped held-out split and on WikiText-103
    when found (zosoma.download.check_wikitext103, as `eval` checks it: `wikitext`,
    $ZOSOMA_WIKITEXT103, the download folder; a file that is not the official one is scored with a
    NotOfficial warning, one that is not text refused): {"heldout": ..., "wikitext103": ...}, the
    second only when found. With `ship`, also write the records into shipped_dir() (a source
    checkout's data/, for the repository)."""
    train, wiki = load_corpus(None, "train"), check_wikitext103(wikitext)
    texts = {"heldout": load_corpus(None, "heldout"), "wikitext103": wiki and wikitext_texts(wiki)}
    found = {key: measure(train, t, orders, segment, context, cache) for key, t in texts.items() if t is not None}
    for name, record in found.items() if ship else ():
        path = shipped_dir() / _key(train, texts[name], record.orders, segment, context)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(asdict(record), indent=1) + "\n", "shipped yardsticks")
    return found


def lookup(heldout: Corpus | None, wikitext=None, segment: int = PROTOCOL.segment, context: int = PROTOCOL.context,
           orders: Sequence[int] = ORDERS) -> dict[str, Yardsticks]:
    """What `shipped` cached for the shipped training split on these held-out texts and on
    WikiText-103 (found as `shipped` finds it): {"heldout": ..., "wikitext103": ...}, each key only
    when measured before. Never measures, so that an evaluation table can afford to call it."""
    try:
        train, wiki = load_corpus(None, "train"), find_wikitext103(wikitext)
        texts = {"heldout": heldout, "wikitext103": wiki and wikitext_texts(wiki)}
        found = {key: _find(_key(train, t, check_orders(orders), segment, context))
                 for key, t in texts.items() if t is not None}
    except ZosomaError:  # a damaged shipped corpus or a missing file: no yardsticks, not a failed evaluation
        return {}
    return {key: y for key, y in found.items() if y is not None}


def wikitext_texts(path) -> Corpus:
    """wiki.test.raw as the one document WIKITEXT (the name its yardsticks are cached under)."""
    return Corpus((WIKITEXT,), (load_text(path),))


def _pooled(names: Sequence[str], results: Sequence[EvalResult]) -> dict[str, EvalResult]:
    pooled: dict[str, EvalResult] = {}
    for name, r in zip(names, results):
        prev = pooled.get(name, EvalResult(0.0, 0))
        pooled[name] = EvalResult(prev.nats + r.nats, prev.n_bytes + r.n_bytes)
    pooled["overall"] = EvalResult(sum(r.nats for r in results), sum(r.n_bytes for r in results))
    return pooled


def shipped_dir():
    """The folder of the records shipped with the corpus (lookup reads them before the cache)."""
    return default_corpus_dir() / "yardsticks"


def _find(key: str) -> Yardsticks | None:
    """The record of `key`, shipped with the corpus or cached on this machine."""
    return _read(shipped_dir() / key) or _read(cache_root() / "yardsticks" / key)


def _key(train: Corpus, texts: Corpus, orders: tuple, segment: int, context: int) -> str:
    h = hashlib.sha256(json.dumps([CACHE_VERSION, list(orders), segment, context]).encode())
    for corpus in (train, texts):
        h.update(json.dumps(list(corpus.names)).encode())
        for doc in corpus.docs:
            h.update(doc.size.to_bytes(8, "little"))
            h.update(doc)
    return f"{h.hexdigest()}.json"


def _read(path) -> Yardsticks | None:
    """The cached record, or None when there is none or it cannot be read (it is measured again)."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        return Yardsticks(d["nats"], int(d["segment"]), int(d["context"]), tuple(d["orders"]), d["train"])
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _write(path, record: Yardsticks) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(asdict(record)), "yardsticks cache")  # in order: the table's
    except (OSError, ZosomaError) as err:
        warnings.warn(f"yardsticks not cached: {err}", stacklevel=3)
