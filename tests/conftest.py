import os
import sys
from pathlib import Path

# Let the helpers module be imported by the tests (tests/ has no __init__.py).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

# The developers keep WikiText-103 in shared/ beside the checkout (so does CI): the final
# evaluations of the tests (and of the zosoma processes they start) score it, unless one is named.
SHARED_WIKITEXT = Path(__file__).resolve().parents[1].parent / "shared" / "wikitext-103"
if "ZOSOMA_WIKITEXT103" not in os.environ and (SHARED_WIKITEXT / "wiki.test.raw").is_file():
    os.environ["ZOSOMA_WIKITEXT103"] = str(SHARED_WIKITEXT)
# The folder the tests that need the real files read (the download's checksums, an archive built
# from them): the one named in $ZOSOMA_WIKITEXT103, where a user keeps them, or shared/'s.
WIKITEXT_FILES = Path(os.environ.get("ZOSOMA_WIKITEXT103", SHARED_WIKITEXT))


@pytest.fixture(scope="session")
def wikitext_files():
    """The folder holding WikiText-103's wiki.test.raw and wiki.valid.raw, or a skip that says how
    to provide them."""
    if not all((WIKITEXT_FILES / n).is_file() for n in ("wiki.test.raw", "wiki.valid.raw")):
        pytest.skip("WikiText-103's wiki.test.raw and wiki.valid.raw not found: name their folder in "
                    "ZOSOMA_WIKITEXT103 (zosoma data download wikitext-103 fetches them)")
    return WIKITEXT_FILES


@pytest.fixture(scope="session")
def ray_session():
    """Ray started once for the whole session on 2 CPUs (Ray's testing tips: one ray.init per
    session, not per test), shut down at its end."""
    from helpers import start_ray
    ray = start_ray()
    yield ray
    ray.shutdown()


@pytest.fixture
def ray_local(ray_session):
    """The session's Ray; started again if a test before replaced it with a cluster of its own."""
    from helpers import start_ray
    return start_ray()


@pytest.fixture(scope="session")
def two_domains(tmp_path_factory):
    """Prose and digits: two domains clustering can tell apart (prose.txt, digits.txt)."""
    import numpy as np
    root = tmp_path_factory.mktemp("domains")
    rng = np.random.default_rng(0)
    words = [b"river", b"stone", b"light", b"green", b"house", b"quiet"]
    (root / "prose.txt").write_bytes(b" ".join(words[i] for i in rng.integers(0, 6, 3000)))
    (root / "digits.txt").write_bytes(b",".join(b"%d" % v for v in rng.integers(0, 10**6, 3000)))
    return root


@pytest.fixture(scope="session")
def text(tmp_path_factory):
    """a.txt: 3,000 words and digit groups in lines, the tests' small training text."""
    import numpy as np
    root = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(1)
    words = [b"river", b"stone", b"light", b"green", b"0123", b"4567", b"\n"]
    (root / "a.txt").write_bytes(b" ".join(words[i] for i in rng.integers(0, 7, 3000)))
    return root / "a.txt"


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The porting kit, written afresh for each module that asks (it needs the onnx extra)."""
    from zosoma.porting.kit import write_kit
    out = tmp_path_factory.mktemp("kit") / "kit"
    write_kit(out)
    return out


@pytest.fixture
def scratch_cwd(tmp_path, monkeypatch):
    """Work from a scratch folder without the developers' WikiText-103, so final evaluations score
    the small held-out text only, and relative run folders land in tmp_path (subprocesses and
    workers inherit the working folder and the environment)."""
    if os.environ.get("ZOSOMA_WIKITEXT103") == str(SHARED_WIKITEXT):
        monkeypatch.delenv("ZOSOMA_WIKITEXT103")
    monkeypatch.chdir(tmp_path)
