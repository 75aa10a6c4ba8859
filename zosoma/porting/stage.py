"""One stage of the porting kit: its inputs, its outputs with their tolerances, and the wrong readings
the checker recognises (zosoma.porting.kit assembles the stages into the kit).

An output is an array the port must reproduce, computed from named inputs of the stage (or from
other outputs of the KIT, read from the kit's file, so that each output is checked in isolation).
Its tolerance is |port - kit| <= atol + rtol |kit| elementwise; with `ulps`, values of a 16-bit
float format that are at most that many representable values apart; integers within atol
(0: exactly); the kit's non-finite values are matched exactly (NaN by NaN). A misreading is the
output as one plausible wrong reading of the specification computes it: when a port fails an
output and matches a misreading instead, the checker names that reading.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# (atol, rtol, why) of each kind of output, for a port in float32 against the kit's float64
# reference (or exact, where the specification leaves no freedom). zosoma's own paths run as a
# port stay well inside every one (tests/test_porting.py).
F32_SUMS = "float32 rounding of dot products over E + H terms (about sqrt(n) ulps for n terms) and of exp/tanh"
TOL = {
    "exact": (0.0, 0.0, "the specification leaves no freedom: bit for bit"),
    "embedded": (0.0, 0.0, "a row gather of the float32 weights: exact"),
    "gates": (2e-5, 1e-5, F32_SUMS),
    "activations": (1e-5, 1e-5, "sigmoid/tanh of the gates: bounded by the gates' error"),
    "cells": (2e-5, 1e-5, "f c + i g accumulated over the steps; a few ulps per step"),
    "hidden": (1e-5, 1e-5, "o tanh(c): bounded by c's error"),
    "logits": (5e-5, 1e-5, "a dot product over H terms plus the bias, then carried error of h"),
    "state": (2e-5, 1e-5, "the last step's h and c"),
    "nll": (1e-4, 1e-5, "log-softmax over 256 logits in float32 (the log-sum-exp's rounding)"),
    "loss": (2e-5, 1e-6, "the mean of the per-byte nats; accumulate it in float64 or pairwise"),
    "bits": (0, 0, "integers: Philox words and Rademacher signs must match bit for bit"),
    "gaussian": (5e-4, 1e-6, "Box-Muller in float32 agrees to a few ulps except where u1 rounds to 1 "
                             "(first word within 128 of 2^32): r = 0 instead of up to 2.4e-4; "
                             "float64 rounded to float32 agrees to 1e-6 everywhere"),
    "scalars": (2e-2, 1e-5, "(L+ - L-) / (2 eps): the losses' atol 2e-5 times 2 / (2 eps) = 1000; "
                            "this is why eps must stay well above the loss's rounding noise"),
    "update": (1e-6, 1e-6, "theta - lr (1/P) sum_k g_k delta_k from the kit's scalars: float32 rounding"),
    "direction": (1e-6, 1e-6, "(1/P) sum_k g_k delta_k and the moments: float32 rounding of P terms"),
    "adam": (2e-6, 1e-5, "m_hat / (sqrt(v_hat) + 1e-8) in float32: a few ulps of a ratio near 1"),
    "trajectory": (2e-5, 1e-5, "float32 rounding of every step's update, over the steps (no compounding: "
                               "each step uses the kit's scalars)"),
    "rate": (1e-9, 1e-7, "the schedule in float64 (float32 agrees to 1e-7 relative)"),
    "host64": (1e-12, 1e-9, "host arithmetic on a few float64 values (shaping, z-scores, ranks)"),
    "counts": (0, 0, "hashed n-gram counts (FNV-1a, integers): exact"),
    "features": (1e-6, 1e-5, "tf-idf rows, L2-normalised, float32"),
    "embeddings": (1e-5, 1e-5, "a sparse dot product over the n-grams of the context, normalised"),
    "distances": (2e-5, 1e-5, "squared distances of unit vectors to the centroids"),
    "experts": (0, 0, "the top-k nearest first, ties to the lower index (the kit's contexts have no "
                      "near-ties)"),
    "weights": (1e-5, 1e-5, "softmax(-d / tau) over the top-k, tau = 0.1: d's error times 10"),
    "format": (0.0, 0.0, "a value of the format, rounded as specified: exact"),
    "format_ulp": (0.0, 0.0, "a value of the format: exact, or one representable value apart where the "
                             "float32 accumulation of the dot product (in any order) straddles a rounding "
                             "point of the format"),
    "int_lsb": (1, 0, "an integer of the fixed-point format: exact with the float64 rescale of the "
                      "specification, within one LSB with a fixed-point rescale"),
    "scale": (0.0, 1e-6, "a float64 scale max|W| / 127 (a float32 computation agrees to 1e-7)"),
    "dequant": (1e-6, 1e-6, "an integer accumulator times a float64 scale, rounded to float32"),
    "perturbation": (2e-5, 1e-5, "(sigma / sqrt(r)) A B^T from float32 Gaussian factors (Box-Muller's "
                                 "float32 worst case, 2.4e-4, times sigma and a factor)"),
}


@dataclass
class Out:
    """One output: the kit's values, its tolerance's key in TOL, what it is computed from (input
    names, or other outputs: the kit's values of them), the hint printed when it fails, and for a
    16-bit float format the format its ulps are counted in (with TOL "format_ulp")."""
    values: np.ndarray
    tol: str
    needs: tuple
    hint: str
    ulps: int = 0
    fmt: str = ""

    def manifest(self, extra_tol: dict | None = None) -> dict:
        atol, rtol, why = (extra_tol or TOL)[self.tol]
        entry = {"atol": atol, "rtol": rtol, "why": why, "from": list(self.needs), "hint": self.hint}
        if self.fmt:
            entry.update(ulps=self.ulps, format=self.fmt)
        return entry


@dataclass
class Stage:
    """A stage's vectors. inputs: name -> (array, one line saying what it is); settings: the
    named constants a port must use (also stored in the file); misreadings: output name -> [(what
    the wrong reading is, its values)], or (what, a matrix M, input name, factor) for a reading
    whose values are the kit's + factor (the port's input - the kit's) @ M."""
    name: str
    what: str
    inputs: dict
    outputs: dict
    settings: dict = field(default_factory=dict)
    misreadings: dict = field(default_factory=dict)
    tol: dict = field(default_factory=dict)  # stage-specific tolerances (key -> (atol, rtol, why))
    optional: str = ""  # for some devices only (why): a port that does not write it still passes --strict

    def arrays(self) -> dict:
        return {**{k: np.asarray(v) for k, (v, _) in self.inputs.items()},
                **{k: np.asarray(o.values) for k, o in self.outputs.items()}}
