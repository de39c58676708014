"""The engines' stores default to the attention scope at FP8's KL from the bank's statistics (issue 37,
item 2; :mod:`kvz.integrations.scope`): the vLLM block store, the LMCache/SGLang chunk codec and the
chunk store; an ``eps`` given keeps the tensor scope and the keys the stores always had."""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from alignpred import ErrorBudget, KvzError, KvzReader, load_cache
from alignpred.bank import AttentionStats
from alignpred.codec.budget import FP8_KL, named_kl
from kvz.integrations.scope import StoreBudget


@pytest.fixture(scope="module")
def sample(sample_files):
    return load_cache(sample_files[0])


def _pairs(cache, n=None):
    out = []
    for i in range(cache.layout.num_layers):
        k, v = (np.asarray(cache.tensors[f"layers.{i}.{x}"]) for x in ("key", "value"))
        out.append((k[:, :n], v[:, :n]))
    return out


def test_named_kl():
    assert named_kl("fp8") == named_kl("FP8") == FP8_KL and named_kl("2e-3") == 2e-3 and named_kl(0.001) == 0.001
    for bad in ("fp16", 0, -1e-3, float("nan"), True, None):
        with pytest.raises(KvzError, match="target_kl"):
            named_kl(bad)


def test_bundled_sidecar_is_calibrated(real_bank):
    stats = AttentionStats.find(real_bank)
    assert stats is not None and stats.kl_per_eps2 > 0 and stats.sliding_window == 512
    assert "kl_per_eps2" in stats.meta  # how it was measured


def test_choose(real_bank):
    b = StoreBudget.choose(real_bank)
    stats = AttentionStats.find(real_bank)
    assert b.scope == "attention" and b.target_kl == FP8_KL
    assert math.isclose(b.eps, math.sqrt(FP8_KL / stats.kl_per_eps2))
    assert b.attention_stats.sliding_window == 0  # any block prefix is read: no stale rows
    assert "attention scope" in b.describe() and "FP8" in b.describe()
    half = StoreBudget.choose(real_bank, target_kl=FP8_KL / 4)
    assert math.isclose(half.eps, b.eps / 2)
    plain = StoreBudget.choose(real_bank, eps=0.02)
    assert (plain.scope, plain.eps, plain.target_kl, plain.attention_stats) == ("tensor", 0.02, None, None)
    assert StoreBudget.choose(None).scope == "tensor"  # no bank: the fallback eps
    with pytest.raises(KvzError, match="not both"):
        StoreBudget.choose(real_bank, eps=0.02, target_kl="fp8")
    bud = b.budget()
    assert isinstance(bud, ErrorBudget) and bud.scope == "attention" and bud.eps == b.eps and bud.target_kl == FP8_KL


def test_vllm_block_store_default_and_eps(tmp_path, real_bank, sample, caplog):
    from kvz.integrations.kvstore import DirectoryBackend
    from kvz.integrations.vllm.store import DEFAULT_EPS, BlockStore

    lay = sample.layout
    kw = dict(model_id="gemma-3-270m", block_size=64, layer_types=json.loads(sample.metadata["layer_types"]),
              rope_theta=json.loads(sample.metadata["rope_theta"]), shape=(lay.num_layers, lay.kv_heads, lay.head_dim),
              dtype="bfloat16", bank=real_bank)
    with caplog.at_level(logging.INFO, logger="kvz.vllm"):
        st = BlockStore(DirectoryBackend(str(tmp_path / "a")), **kw)
    assert st.scope == "attention" and "attention scope" in caplog.text
    old = BlockStore(DirectoryBackend(str(tmp_path / "b")), eps=DEFAULT_EPS, **kw)
    assert old.scope == "tensor" and set(old.binding) == {"scheme", "model", "block_size", "dtype", "shape",
                                                          "format_major", "bank", "eps", "lossless"}
    assert old.binding["eps"] == DEFAULT_EPS and st.block_hashes([1] * 64, 1) != old.block_hashes([1] * 64, 1)
    ids = [int(t) for t in range(128)]
    sizes = {}
    for name, s in (("attention", st), ("tensor", old)):
        pairs = _pairs(sample, 128)
        n = s.put_run(ids, 0, pairs, s.block_hashes(ids, 2))
        assert n > 0
        blob = s.backend.get(s.run_key(s.block_hashes(ids, 2)[-1]))
        r = KvzReader(memoryview(blob), bank=real_bank)
        codec = r.header["codec"]
        assert codec["eps_scope"] == name and codec["eps"] == s.eps
        assert codec.get("target_kl") == (FP8_KL if name == "attention" else None)
        assert codec["config"].get("stale_window", 0) == 0  # prefix-safe: no position coded as never read
        sizes[name] = n
    n_hit, segs = st.lookup(ids, 2)
    assert n_hit == 2 and segs
    assert sizes["attention"] < sizes["tensor"]  # FP8's KL in the attention scope is cheaper than eps 0.02


def test_chunk_codec_default_and_eps(real_bank, sample):
    from kvz.integrations.lmcache.kvcodec import KvzChunkCodec, codec_from_options, model_metadata

    meta = model_metadata(sample.metadata)
    c = KvzChunkCodec(bank=real_bank, cache_metadata=meta)
    assert c.scope == "attention" and c.budget.target_kl == FP8_KL
    old = codec_from_options({"metadata": meta, "eps": "0.0267"})
    assert (old.scope, old.eps) == ("tensor", 0.0267)
    kl = codec_from_options({"metadata": meta, "target_kl": "1e-3"})
    assert kl.scope == "attention" and kl.budget.target_kl == 1e-3 and kl.eps < c.eps
    pairs = _pairs(sample, 128)
    blob = c.encode(pairs, position_offset=0)
    hdr = c.reader(blob).header["codec"]
    assert hdr["eps_scope"] == "attention" and hdr["target_kl"] == FP8_KL
    assert len(blob) < len(old.encode(pairs, position_offset=0))
    with pytest.raises(ValueError, match="not both"):
        KvzChunkCodec(bank=real_bank, cache_metadata=meta, eps=0.02, target_kl="fp8")


def test_chunkstore_serde_default_and_eps(real_bank):
    from kvz.integrations.chunkstore import KvzSerde

    d = KvzSerde(None, real_bank)
    assert d.scope == "attention" and d.binding()["target_kl"] == FP8_KL
    e = KvzSerde(0.02, real_bank)
    assert e.scope == "tensor" and "target_kl" not in e.binding() and e.binding()["eps"] == 0.02
