"""Property: whatever happens to a checkpoint or router file on disk (random bytes, truncation, bit
flips, spliced garbage), reading it is either a one-line CheckpointError naming the file or a read
of exactly what was written. Never another exception, never wrong values."""

import tempfile
from pathlib import Path

import numpy as np
import pytest

from zosoma.config import ModelConfig, TrainConfig
from zosoma.corpus import Corpus
from zosoma.errors import CheckpointError
from zosoma.formats.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from zosoma.model.params import init_params
from zosoma.config import ClusterConfig
from zosoma.mixture.cluster import fit_clusters, load_clustering, save_clustering

pytest.importorskip("hypothesis", reason="property tests need hypothesis (the test extra)")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

MODEL = ModelConfig(embed=4, hidden=6, layers=1)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("originals")
    ckpt = Checkpoint(MODEL, TrainConfig(optimizer="adam"), init_params(MODEL, 3), 7,
                      optimizer={"m": np.ones(init_params(MODEL, 0).size, np.float32),
                                 "v": np.zeros(init_params(MODEL, 0).size, np.float32)},
                      extra={"seed": 3}, metrics_records=7, metrics_sha256="5e" * 32)
    save_checkpoint(root / "c.h5", ckpt)
    rng = np.random.default_rng(0)
    docs = tuple(np.frombuffer(bytes(rng.choice(list(b"abcdef 0123"), 300)), np.uint8) for _ in range(12))
    clustering, _ = fit_clusters(Corpus(tuple("d" for _ in docs), docs),
                                 ClusterConfig(n_clusters=3, n_features=2**8, svd_dim=4, svd_oversample=2, seed=1))
    save_clustering(root / "r.h5", clustering)
    return {"checkpoint": ((root / "c.h5").read_bytes(), ckpt), "router": ((root / "r.h5").read_bytes(), clustering)}


def damaged(data, raw: bytes) -> bytes:
    how = data.draw(st.sampled_from(["truncate", "flip", "random", "splice", "zero run"]))
    n = len(raw)
    if how == "truncate":
        return raw[:data.draw(st.integers(0, n - 1))]
    if how == "random":
        return data.draw(st.binary(min_size=0, max_size=4096))
    out = bytearray(raw)
    if how == "flip":
        for at in data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=8)):
            out[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "splice":
        at = data.draw(st.integers(0, n - 1))
        out[at:at] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        at, size = data.draw(st.integers(0, n - 1)), data.draw(st.integers(1, 512))
        out[at:at + size] = bytes(len(out[at:at + size]))
    return bytes(out)


def check(read, name: str, raw: bytes, same):
    """Write `raw` to a fresh file `name` and read it back: a one-line error naming the file, or
    values that `same` accepts."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_bytes(raw)
        try:
            got = read(path)
        except CheckpointError as e:
            assert str(path) in str(e) and "\n" not in str(e), str(e)
            return
        assert same(got), "a damaged file was read as different values"


SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(data=st.data())
def test_damaged_checkpoints_are_one_line_errors_or_exact_reads(originals, data):
    raw, want = originals["checkpoint"]
    check(load_checkpoint, "checkpoint.h5", damaged(data, raw),
          lambda c: (np.array_equal(c.theta, want.theta) and c.step == want.step
                     and all(np.array_equal(c.optimizer[k], want.optimizer[k]) for k in want.optimizer)
                     and (c.metrics_records, c.metrics_sha256) == (want.metrics_records, want.metrics_sha256)))


@SETTINGS
@given(data=st.data())
def test_damaged_routers_are_one_line_errors_or_exact_reads(originals, data):
    raw, want = originals["router"]
    check(load_clustering, "router.h5", damaged(data, raw),
          lambda c: np.array_equal(c.centroids, want.centroids) and np.array_equal(c.idf, want.idf))
