"""The porting kit's host-side data stages: the seeded initialisation, the batch draw and the
learning-rate schedule, and the small corpus the training-loop stages (kit_loop) draw from.
PORTING.md (stages 0 and 4) is the specification these vectors serve.
"""

from __future__ import annotations

import math

import numpy as np

from zosoma.config import ModelConfig
from zosoma.corpus import BatchSampler, Corpus, load_corpus
from zosoma.model.params import Layout, init_params
from zosoma.porting.stage import Out, Stage
from zosoma.strategies.base import learning_rate

# --- corpus and batches ----------------------------------------------------------------------------

T_LOOP, B_LOOP = 16, 4  # the training loop's windows: T + 1 bytes, B of them


def small_corpus() -> Corpus:
    """Four documents of the shipped corpus, cut short; one shorter than a window (it has no
    windows) and one exactly a window long (it has one)."""
    train = load_corpus(None, split="train")
    lengths = (900, T_LOOP, 1500, T_LOOP + 1)
    return Corpus(tuple(train.names[:4]), tuple(np.array(d[:n]) for d, n in zip(train.docs, lengths)))


def text_inputs(corpus: Corpus) -> dict:
    offsets = np.cumsum([0] + [len(d) for d in corpus.docs]).astype(np.int64)
    return {"text": (np.concatenate(corpus.docs), "(total,) uint8 the documents back to back"),
            "offsets": (offsets, "(n_docs + 1,) int64 document i is text[offsets[i]:offsets[i+1]]")}


def _draws(sampler: BatchSampler, seed, stream_, step, B) -> np.ndarray:
    """(B,) the global window indices BatchSampler.positions draws (the same generator call)."""
    return np.random.default_rng([seed, stream_, step]).integers(0, sampler.n_windows, size=B)


def batch_stage(seed: int) -> Stage:
    corpus = small_corpus()
    sampler = BatchSampler(corpus, T_LOOP + 1)
    seed_b, stream_, steps = 2**40 + seed, 5, np.array([0, 1, 7, 4321], np.int64)
    draws = np.stack([_draws(sampler, seed_b, stream_, int(s), B_LOOP) for s in steps])
    doc, start = (np.stack(a) for a in zip(*(sampler.positions(seed_b, stream_, int(s), B_LOOP) for s in steps)))
    ends = np.cumsum(np.maximum(corpus.lengths - T_LOOP, 0))
    assert np.array_equal(draws, ends[doc] - np.maximum(corpus.lengths - T_LOOP, 0)[doc] + start)
    batches = np.stack([sampler.batch(seed_b, stream_, int(s), B_LOOP) for s in steps])
    text = np.concatenate(corpus.docs)
    flat = np.stack([np.random.default_rng([seed_b, stream_, int(s)]).integers(0, text.size - T_LOOP, size=B_LOOP)
                     for s in steps])
    swapped = np.stack([np.random.default_rng([seed_b, int(s), stream_]).integers(0, sampler.n_windows, size=B_LOOP)
                        for s in steps])
    inputs = {**text_inputs(corpus), "T": (np.int64(T_LOOP), "int64 a window is T + 1 bytes"),
              "B": (np.int64(B_LOOP), "int64 windows per batch"),
              "seed": (np.uint64(seed_b), "the run's seed"), "stream": (np.int64(stream_), "expert + 65536 restarts"),
              "steps": (steps, "(S,) int64 step counters")}
    hint = ("default_rng([seed, stream, step]).integers(0, n_windows, size=B), n_windows = sum over documents of "
            "max(0, len - T); a document shorter than T + 1 bytes has none")
    outputs = {
        "draws": Out(draws, "exact", ("seed", "stream", "steps", "offsets", "T", "B"), hint),
        "doc": Out(doc.astype(np.int64), "exact", ("draws (kit's)", "offsets", "T"),
                   "documents in order, each with max(0, len - T) windows: doc = the one holding window g"),
        "start": Out(start.astype(np.int64), "exact", ("draws (kit's)", "offsets", "T"),
                     "start = g minus the windows of the documents before it"),
        "batches": Out(batches, "exact", ("doc (kit's)", "start (kit's)", "text"),
                       "batch[b] = document doc[b] bytes start .. start + T (T + 1 bytes); never across documents"),
    }
    misreadings = {"draws": [("windows counted over the concatenated text (crossing documents)", flat),
                             ("generator seeded [seed, step, stream] (the order is seed, stream, step)", swapped)]}
    return Stage("batches", "the batch draw: generator call, window indices, documents, start offsets, bytes",
                 inputs, outputs, misreadings=misreadings)


# --- schedule and initialisation ---------------------------------------------------------------------

SCHEDULES = (("cosine", 20, 100, 1.0), ("constant", 20, 100, 1.0), ("cosine", 0, 100, 0.25), ("cosine", 150, 100, 1.0))


def schedule_stage() -> Stage:
    peak, n = 0.15, 100
    kinds = np.array([s for s, *_ in SCHEDULES])
    warmups, totals, scales = (np.array([c[i] for c in SCHEDULES]) for i in (1, 2, 3))
    lr = np.array([[learning_rate(t, peak, int(total), int(w), k) * f for t in range(n)]
                   for k, w, total, f in SCHEDULES])

    def variant(fn):
        return np.array([[fn(t, int(w), int(total), k) * f for t in range(n)] for k, w, total, f in SCHEDULES])

    def zero_at_last(t, w, total, k):  # cosine reaching 0 at the last step, total - 1
        if t < w:
            return peak * (t + 1) / w
        return peak if k == "constant" else peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (t - w) / max(1, total - 1 - w))))

    def from_zero(t, w, total, k):  # warm-up starting at 0 (t / warmup)
        return learning_rate(t, peak, total, w, k) if t >= w else peak * t / w

    inputs = {"lr": (np.float64(peak), "float64 the peak rate"), "schedule": (kinds, "(n,) 'cosine' or 'constant'"),
              "warmup": (warmups.astype(np.int64), "(n,) warm-up steps (zosoma's default is 20)"),
              "total": (totals.astype(np.int64), "(n,) the run's length in steps"),
              "factor": (scales, "(n,) the restart factor: restart_lr_factor ** restarts"),
              "count": (np.int64(n), "evaluate steps 0 .. count - 1")}
    outputs = {"rates": Out(lr, "rate", tuple(inputs),
                            "warm-up lr (t+1)/warmup for t < warmup; cosine progress (t - warmup) / max(1, total - "
                            "warmup), clamped at 1: 0 is reached at t = total (never taken), not at the last step")}
    return Stage("schedule", "the learning-rate schedule: warm-up, cosine or constant, its end point, the restart "
                             "factor", inputs, outputs,
                 misreadings={"rates": [("cosine reaching 0 at the last step (total - 1)", variant(zero_at_last)),
                                        ("warm-up t / warmup (starting at 0)", variant(from_zero))]})


def init_stage(config: ModelConfig, seed: int) -> Stage:
    expert = 2
    theta = init_params(config, seed, expert)
    layout = Layout(config)
    fan_in = np.empty(layout.size, np.float32)
    rng = np.random.default_rng([seed, expert, 0x1D1])
    for e in layout.entries:  # a misreading: bounds 1/sqrt(fan-in) instead of 1/sqrt(H)
        bound = 1.0 / math.sqrt(e.shape[0]) if len(e.shape) == 2 else 1.0 / math.sqrt(config.hidden)
        values = (rng.standard_normal(e.size) if e.name == "embed" else np.zeros(e.size) if e.name == "out.b"
                  else rng.uniform(-bound, bound, e.size))
        fan_in[e.offset:e.offset + e.size] = values
    inputs = {"embed": (np.int64(config.embed), "E"), "hidden": (np.int64(config.hidden), "H"),
              "layers": (np.int64(config.layers), "L"), "seed": (np.uint64(seed), "the run's seed"),
              "expert": (np.int64(expert), "the expert (0 for a single model); not the restart stream")}
    outputs = {"theta": Out(theta, "exact", tuple(inputs),
                            "default_rng([seed, expert, 0x1D1]); tensors in layout order: embed standard_normal(V*E), "
                            "the LSTM's and out.w uniform(-1/sqrt(H), 1/sqrt(H), size), out.b zeros (no draw); "
                            "each drawn in float64, rounded to float32")}
    return Stage("init", "the seeded initialisation: generator, draw order, distributions", inputs, outputs,
                 misreadings={"theta": [("bounds 1/sqrt(fan-in) instead of 1/sqrt(H)", fan_in),
                                        ("seeded without the expert ([seed, 0x1D1])",
                                         _init_without_expert(config, seed))]})


def _init_without_expert(config: ModelConfig, seed: int) -> np.ndarray:
    layout = Layout(config)
    rng = np.random.default_rng([seed, 0x1D1])
    out = np.empty(layout.size, np.float32)
    bound = 1.0 / math.sqrt(config.hidden)
    for e in layout.entries:
        out[e.offset:e.offset + e.size] = (rng.standard_normal(e.size) if e.name == "embed" else np.zeros(e.size)
                                           if e.name == "out.b" else rng.uniform(-bound, bound, e.size))
    return out
