"""kvstore.CheckedReader: the engine adapters' one corrupt-aware read (LMCache, SGLang)."""
import warnings

import pytest

from kvz.integrations.kvstore import CheckedReader, DirectoryBackend, StoreWarning


def _flip(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_corrupt_entry_is_a_miss_with_one_warning(tmp_path):
    be = DirectoryBackend(str(tmp_path))
    assert be.put("a", b"x" * 4096) and be.put("b", b"y" * 4096)
    said = []
    r = CheckedReader(be, "adapter", warn=said.append, noun="page")
    assert r.get("a") == b"x" * 4096 and said == []
    _flip(be.entry_path("a"))
    assert r.get("a") is None
    assert len(said) == 1 and said[0].startswith("adapter: page a failed its checksum"), said
    assert r.get("a") is None and r.get("missing") is None  # gone, and plain misses say nothing
    assert len(said) == 1 and r.get("b") == b"y" * 4096


class _Down:
    def get(self, key):
        raise ConnectionError("store down")

    def stats(self):
        raise ConnectionError("store down")


def test_a_failing_store_is_a_miss_and_a_store_warning():
    r = CheckedReader(_Down(), "adapter")
    with pytest.warns(StoreWarning, match="adapter: get failed .ConnectionError: store down.; treated as a miss"):
        assert r.get("k") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CheckedReader(_Down(), "quiet", warn=lambda m: None).get("k") is None
