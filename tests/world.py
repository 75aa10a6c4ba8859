"""The tests' one tiny world, defined once: the tiny model (as a ModelConfig and as command-line
options), a corpus of three byte domains, and the published test vectors. Its training text is
conftest's `text` fixture."""

import numpy as np

from zosoma.config import ModelConfig
from zosoma.corpus import Corpus

# The tiny model the training, resume, SOMA and CLI tests train: E=8 H=16, one layer (two where a
# test needs a layer's output feeding the next).
TINY_MODEL = ModelConfig(embed=8, hidden=16, layers=1)
TINY_MODEL_L2 = ModelConfig(embed=8, hidden=16, layers=2)
TINY_MODEL_ARGS = ["--embed", "8", "--hidden", "16", "--layers", "1"]  # TINY_MODEL on the command line


def tiny_args(batch: int, perturbations: int | None = None, **options) -> list[str]:
    """`zosoma train`'s options for TINY_MODEL on sequences of 16 bytes, `batch` of them, with -P
    `perturbations` and any more options given by name (checkpoint_every=3 is --checkpoint-every 3)."""
    args = [*TINY_MODEL_ARGS, "--batch", str(batch), "--seq-len", "16"]
    if perturbations is not None:
        args += ["-P", str(perturbations)]
    for name, value in options.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return args


# Three unmistakable byte domains: lowercase words, digit groups and punctuation runs.
ALPHABETS = {"letters": b"abcdefghij ", "digits": b"0123456789 ", "marks": b"!?.,;:-+*/ "}


def synthetic_corpus(per_domain=12, size=200, seed=0) -> Corpus:
    """`per_domain` documents of `size` bytes from each of ALPHABETS, named by their domain."""
    rng = np.random.default_rng(seed)
    names, docs = [], []
    for name, alphabet in ALPHABETS.items():
        for _ in range(per_domain):
            names.append(name)
            docs.append(np.frombuffer(alphabet, np.uint8)[rng.integers(0, len(alphabet), size)])
    return Corpus(tuple(names), tuple(docs))


M32 = 0xFFFFFFFF

# Random123's kat_vectors for philox4x32_10: (counter, key, expected output)
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

