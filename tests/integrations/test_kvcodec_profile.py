"""The engines' chunk codec (shared by the LMCache and SGLang adapters) takes a speed profile
(``<prefix>.profile`` / ``kvz_profile``): the blob is written with that profile's coder and
predictors, within the same error bound; an unknown profile is a configuration error."""
import numpy as np
import pytest
from kvz_test_helpers import sample_paths

from alignpred import KvzReader
from kvz.integrations.lmcache.kvcodec import KvzChunkCodec, codec_from_options, metadata_from_file


def _pairs(path, tokens=(0, 96)):
    from alignpred import load_cache

    c = load_cache(path)
    a, b = tokens
    n = c.layout.num_layers
    return [(np.asarray(c.tensors[f"layers.{i}.key"])[:, a:b], np.asarray(c.tensors[f"layers.{i}.value"])[:, a:b])
            for i in range(n)]


def test_chunk_codec_profile():
    path = sample_paths()[0]
    pairs = _pairs(path)
    codec = codec_from_options({"metadata_from": path, "profile": "fast", "eps": "0.03"})
    assert codec.profile == "fast"
    blob = codec.encode(pairs, position_offset=0)
    s = KvzReader(blob).summary()
    assert s["coder"] == "lanes32" and s["config"]["inter_map"] is False
    back, _ = codec.decode(blob)
    for (k, v), (k2, v2) in zip(pairs, back):
        for x, y in ((k, k2), (v, v2)):
            x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)
            assert np.linalg.norm(y64 - x64) <= 0.03 * (1 + 1e-6) * np.linalg.norm(x64)
    plain = codec_from_options({"metadata_from": path, "eps": "0.03"})
    assert plain.profile == "default" and KvzReader(plain.encode(pairs, position_offset=0)).summary()["coder"] == "rans4"
    with pytest.raises(ValueError, match="profile must be one of default, balanced, fast"):
        KvzChunkCodec(cache_metadata=metadata_from_file(path), profile="tiny")
