"""WikiText-103 download (offline, through file:// URLs of zips built here) and lookup."""

import hashlib
import os
import zipfile

import pytest

from zosoma.download import (
    WIKITEXT103_FILES,
    download_wikitext103,
    find_wikitext103,
    wikitext103_cache_dir,
)
from zosoma.errors import DataError

NAMES = ("wiki.test.raw", "wiki.valid.raw")


@pytest.fixture(scope="module")
def reference(wikitext_files):
    return {n: (wikitext_files / n).read_bytes() for n in NAMES}


def make_zip(path, members):
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def official_layout(reference, **overrides):
    members = {f"wikitext-103-raw/{n}": data for n, data in reference.items()}
    members["wikitext-103-raw/wiki.train.raw"] = b" = Title = \n training text \n"
    members.update(overrides)
    return members


def test_download_from_file_url(tmp_path, reference):
    archive = make_zip(tmp_path / "wikitext-103-raw-v1.zip", official_layout(reference))
    dest = tmp_path / "out"
    calls = []
    paths = download_wikitext103(dest, url=archive.as_uri(), progress=lambda *a: calls.append(a))
    assert set(paths) == set(NAMES)
    for name in NAMES:
        assert paths[name] == dest / name and paths[name].read_bytes() == reference[name]
    assert sorted(p.name for p in dest.iterdir()) == sorted(NAMES)  # no temporaries left
    assert calls and calls[-1] == (archive.stat().st_size, archive.stat().st_size)

    # Already there and correct: nothing is fetched (the URL does not even exist).
    again = download_wikitext103(dest, url=(tmp_path / "gone.zip").as_uri())
    assert again == paths


def test_local_path_and_train_flag(tmp_path, reference):
    archive = make_zip(tmp_path / "a.zip", official_layout(reference))
    paths = download_wikitext103(tmp_path / "out", url=str(archive), train=True)
    assert paths["wiki.train.raw"].read_bytes() == b" = Title = \n training text \n"


def test_damaged_existing_file_is_replaced(tmp_path, reference):
    archive = make_zip(tmp_path / "a.zip", official_layout(reference))
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "wiki.test.raw").write_bytes(b"partial")
    download_wikitext103(dest, url=archive.as_uri())
    assert (dest / "wiki.test.raw").read_bytes() == reference["wiki.test.raw"]


def test_corrupted_member_leaves_nothing(tmp_path, reference):
    bad = bytearray(reference["wiki.valid.raw"])
    bad[1000] ^= 0x20
    members = official_layout(reference, **{"wikitext-103-raw/wiki.valid.raw": bytes(bad)})
    archive = make_zip(tmp_path / "a.zip", members)
    dest = tmp_path / "out"
    with pytest.raises(DataError, match="wiki.valid.raw.*sha256") as err:
        download_wikitext103(dest, url=archive.as_uri())
    assert "\n" not in str(err.value) and str(archive) in str(err.value)
    assert list(dest.iterdir()) == []  # not even the good wiki.test.raw: all or nothing


def test_missing_member(tmp_path, reference):
    members = official_layout(reference)
    del members["wikitext-103-raw/wiki.test.raw"]
    archive = make_zip(tmp_path / "a.zip", members)
    dest = tmp_path / "out"
    with pytest.raises(DataError, match="no wiki.test.raw"):
        download_wikitext103(dest, url=archive.as_uri())
    assert list(dest.iterdir()) == []


def test_not_a_zip(tmp_path):
    fake = tmp_path / "page.zip"
    fake.write_bytes(b"<html>Access Denied</html>")
    dest = tmp_path / "out"
    with pytest.raises(DataError, match="not a valid zip") as err:
        download_wikitext103(dest, url=fake.as_uri())
    assert str(fake) in str(err.value)
    assert list(dest.iterdir()) == []


@pytest.mark.parametrize("as_uri", [True, False])
def test_missing_url(tmp_path, as_uri):
    missing = tmp_path / "nowhere.zip"
    dest = tmp_path / "out"
    with pytest.raises(DataError) as err:
        download_wikitext103(dest, url=missing.as_uri() if as_uri else str(missing))
    assert str(missing) in str(err.value)
    assert list(dest.iterdir()) == []


def test_unsupported_url(tmp_path):
    with pytest.raises(DataError, match="cannot download"):
        download_wikitext103(tmp_path / "out", url="ftp-ish://example.invalid/x.zip")


def test_checksum_constants_match_reference(reference):
    for name, data in reference.items():
        assert WIKITEXT103_FILES[name] == (len(data), hashlib.sha256(data).hexdigest())


# --- find_wikitext103 --------------------------------------------------------------------------

@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """No env var, an empty home and cache, and a working directory of its own."""
    monkeypatch.delenv("ZOSOMA_WIKITEXT103", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "work" / "repo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work" / "repo")
    return tmp_path


def put(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wiki.test.raw").write_bytes(b" = T = \n")
    return folder / "wiki.test.raw"


def test_find_order(isolated, monkeypatch):
    assert find_wikitext103() is None
    put(isolated / "work" / "shared" / "wikitext-103")  # a development folder is not the library's business
    assert find_wikitext103() is None
    cached = put(isolated / "home" / ".cache" / "zosoma" / "wikitext-103")
    assert wikitext103_cache_dir() == cached.parent
    assert find_wikitext103() == cached
    env = put(isolated / "env")
    monkeypatch.setenv("ZOSOMA_WIKITEXT103", str(env.parent))
    assert find_wikitext103() == env
    explicit = put(isolated / "explicit")
    assert find_wikitext103(explicit.parent) == explicit
    assert find_wikitext103(str(explicit)) == explicit


def test_find_bad_explicit_or_env(isolated, monkeypatch):
    with pytest.raises(DataError, match="no wiki.test.raw"):
        find_wikitext103(isolated / "nothing")
    monkeypatch.setenv("ZOSOMA_WIKITEXT103", str(isolated / "nothing"))
    with pytest.raises(DataError, match="ZOSOMA_WIKITEXT103"):
        find_wikitext103()


def test_xdg_cache_home(isolated, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(isolated / "xdg"))
    found = put(isolated / "xdg" / "zosoma" / "wikitext-103")
    assert find_wikitext103() == found


def test_scratch_cwd_hides_the_developers_wikitext(monkeypatch, request):
    """conftest names ../shared/wikitext-103 in $ZOSOMA_WIKITEXT103 when it is there; a test that
    works from a scratch folder does not see it (its final evaluations stay small)."""
    import conftest

    monkeypatch.setenv("ZOSOMA_WIKITEXT103", str(conftest.SHARED_WIKITEXT))
    request.getfixturevalue("scratch_cwd")
    assert "ZOSOMA_WIKITEXT103" not in os.environ
