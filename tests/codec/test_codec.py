"""Round trips of the codec on synthetic caches (the real-sample tests are in test_samples.py)."""
import numpy as np
import pytest
from kvz_testing import synthetic_cache

from alignpred import CodecConfig, ErrorBudget, KvzReader, NonFiniteError, compress, fit_bank
from alignpred.cache.cachefile import Cache
from alignpred.cache.layout import infer_layout
from alignpred.codec import Profile


def nrmse(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(a)


@pytest.mark.parametrize("scope", ["object", "tensor", "pooled"])
def test_scopes_meet_eps(tmp_path, scope):
    c = synthetic_cache(T=600)
    bank = fit_bank([synthetic_cache(T=600, seed=0)], rank=8)
    eps = 0.02
    info = compress(c, tmp_path / "c.kvz", budget=ErrorBudget(eps=eps, scope=scope), bank=bank)
    out = KvzReader(tmp_path / "c.kvz", bank=bank).read()
    S = 256
    if scope == "pooled":
        num = sum(np.sum((out[n].astype(np.float64) - c.tensors[n].astype(np.float64)) ** 2) for n in out)
        den = sum(np.sum(c.tensors[n].astype(np.float64) ** 2) for n in out)
        assert np.sqrt(num / den) <= eps
        assert abs(np.sqrt(num / den) - info.nrmse_pooled) < 1e-9
    for n, x in c.tensors.items():
        assert out[n].dtype == x.dtype and out[n].shape == x.shape
        if scope == "tensor":
            assert nrmse(x, out[n]) <= eps
            assert nrmse(x, out[n]) > 0.8 * eps  # the search spends the budget
        if scope == "object":
            for a in range(0, x.shape[1], S):
                assert nrmse(x[:, a:a + S], out[n][:, a:a + S]) <= eps


@pytest.mark.parametrize("dtype", [np.float16, np.float32, "bfloat16"])
def test_dtype_round_trips(tmp_path, dtype):
    import ml_dtypes
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    c = synthetic_cache(T=100, dtype=dt)
    bank = fit_bank([c], rank=None)
    compress(c, tmp_path / "c.kvz", budget=0.01, bank=bank)
    out = KvzReader(tmp_path / "c.kvz", bank=bank).read()
    for n, x in c.tensors.items():
        assert out[n].dtype == np.dtype(dt)
        assert nrmse(x, out[n]) <= 0.01


def test_token_range_and_layers_match_full_decode(tmp_path):
    c = synthetic_cache(n_layers=4, T=700, roped=True)
    bank = fit_bank([c], rank=4)
    compress(c, tmp_path / "c.kvz", budget=0.03, bank=bank)
    r = KvzReader(tmp_path / "c.kvz", bank=bank)
    full = r.read()
    part = r.read(tokens=(300, 650), layers=2)
    assert sorted(part) == ["layers.0.key", "layers.0.value", "layers.1.key", "layers.1.value"]
    for n, a in part.items():
        np.testing.assert_array_equal(a, full[n][:, 300:650])


@pytest.mark.parametrize("profile", ["default", "fast"])
def test_recycled_block_buffers_change_no_bit(tmp_path, profile):
    """The decoder writes predictions into reconstructions no later block reads (its block buffers):
    on a real Gemma cache (cross-layer maps: reconstructions kept for later layers) every way of
    running the chain — all layers, the first layers only, one token tile, two threads — gives the
    same bits, and every tensor meets the error target."""
    from pathlib import Path

    from alignpred import load_cache

    c = load_cache(Path(__file__).parents[2] / "samples" / "gemma3-270m" / "english-prose.safetensors")
    compress(c, tmp_path / "c.kvz", budget=ErrorBudget(eps=0.03, scope="tensor"), bank="gemma-3-270m", profile=profile)
    r = KvzReader(tmp_path / "c.kvz", bank="gemma-3-270m")
    full = r.read()
    two = KvzReader(tmp_path / "c.kvz", bank="gemma-3-270m", threads=2).read()
    first = r.read(layers=5)
    tile = r.read(tokens=(256, 448))
    for n, a in full.items():
        np.testing.assert_array_equal(a.view(np.uint8), two[n].view(np.uint8))
        if n in first:
            np.testing.assert_array_equal(a.view(np.uint8), first[n].view(np.uint8))
        np.testing.assert_array_equal(a[:, 256:448].view(np.uint8), tile[n].view(np.uint8))
        x = np.asarray(c.tensors[n], np.float64)
        err = np.linalg.norm((a.astype(np.float64) - x).ravel()) / np.linalg.norm(x.ravel())
        assert err <= 0.03 * 1.0001, (n, err)


@pytest.mark.parametrize("cfg", [CodecConfig(align=True, blend=True), CodecConfig(inter_map=False),
                                 CodecConfig(intra=False, channel_choice=False), CodecConfig(rope_undo=False)])
def test_ablation_configs_round_trip(tmp_path, cfg):
    c = synthetic_cache(T=300, roped=True, heads=2)
    bank = fit_bank([c], rank=8)
    compress(c, tmp_path / "c.kvz", budget=0.02, bank=bank, config=cfg)
    out = KvzReader(tmp_path / "c.kvz", bank=bank).read()
    for n, x in c.tensors.items():
        assert nrmse(x, out[n]) <= 0.02


def test_zero_tensor_and_zero_channel(tmp_path):
    c = synthetic_cache(T=300)
    t = dict(c.tensors)
    t["layers.1.key"] = np.zeros_like(t["layers.1.key"])
    v = t["layers.2.value"].copy()
    v[..., 3] = 7.0  # zero-variance channel
    t["layers.2.value"] = v
    c2 = Cache(t, {}, infer_layout(t))
    bank = fit_bank([c], rank=4)
    compress(c2, tmp_path / "c.kvz", budget=0.02, bank=bank)
    out = KvzReader(tmp_path / "c.kvz", bank=bank).read()
    assert not out["layers.1.key"].any()
    assert nrmse(v, out["layers.2.value"]) <= 0.02


def test_batch_dim_round_trips(tmp_path):
    c = synthetic_cache(T=50)
    t = {n: a[None] for n, a in c.tensors.items()}
    c2 = Cache(t, {}, infer_layout(t))
    bank = fit_bank([c], rank=4)
    compress(c2, tmp_path / "c.kvz", budget=0.05, bank=bank)
    out = KvzReader(tmp_path / "c.kvz", bank=bank).read()
    assert out["layers.0.key"].shape == (1, 1, 50, 32)


def test_nan_refused_with_location(tmp_path):
    c = synthetic_cache(T=50, dtype=np.float32)
    t = dict(c.tensors)
    v = t["layers.1.value"].copy()
    v[0, 7, 3] = np.nan
    t["layers.1.value"] = v
    bank = fit_bank([c], rank=4)
    with pytest.raises(NonFiniteError, match=r"layers.1.value.*token 7, channel 3"):
        compress(Cache(t, {}, infer_layout(t)), tmp_path / "c.kvz", budget=0.05, bank=bank)
    assert not (tmp_path / "c.kvz").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary left behind


def test_constriction_coder_round_trips(tmp_path):
    c = synthetic_cache(T=300)
    bank = fit_bank([c], rank=4)
    a = compress(c, tmp_path / "a.kvz", budget=0.02, bank=bank)
    b = compress(c, tmp_path / "b.kvz", budget=0.02, bank=bank, profile=Profile(coder="constriction"))
    ra, rb = KvzReader(tmp_path / "a.kvz", bank=bank), KvzReader(tmp_path / "b.kvz", bank=bank)
    assert rb.header["codec"]["entropy"]["coder"] == "constriction"
    oa, ob = ra.read(), rb.read()
    for n in oa:  # same symbols, different coder: identical reconstruction
        np.testing.assert_array_equal(oa[n], ob[n])
    assert abs(a.bpv - b.bpv) < 0.1


def test_decompress_to_matches_read(tmp_path):
    from alignpred import load_cache
    c = synthetic_cache(n_layers=3, T=700, roped=True, heads=2)
    bank = fit_bank([c], rank=4)
    compress(c, tmp_path / "c.kvz", budget=0.03, bank=bank)
    r = KvzReader(tmp_path / "c.kvz", bank=bank)
    full = r.read()
    r.decompress_to(tmp_path / "all.safetensors")
    r.decompress_to(tmp_path / "part.safetensors", tokens=(100, 650), layers=2, chunk_objects=1)
    a, p = load_cache(tmp_path / "all.safetensors"), load_cache(tmp_path / "part.safetensors")
    for n in full:
        np.testing.assert_array_equal(a.tensors[n], full[n])
    assert sorted(p.tensors) == sorted(list(full)[:4])
    assert p.layout.position_offset == 100 and len(p.layout.rope_theta) == 2  # RoPE positions stay right
    for n in p.tensors:
        np.testing.assert_array_equal(p.tensors[n], full[n][:, 100:650])


def test_sink_token_gets_a_finer_step(tmp_path):
    c = synthetic_cache(T=300)
    bank = fit_bank([c], rank=4)
    compress(c, tmp_path / "s.kvz", budget=0.05, bank=bank)  # default: 1 sink token, step / 16
    compress(c, tmp_path / "n.kvz", budget=0.05, bank=bank, config=CodecConfig(sink_tokens=0))
    s, n = KvzReader(tmp_path / "s.kvz", bank=bank), KvzReader(tmp_path / "n.kvz", bank=bank)
    assert s.config.sink_tokens == 1 and n.config.sink_tokens == 0
    os_, on = s.read(), n.read()
    for name, x in c.tensors.items():
        e_s = np.abs(os_[name][:, 0].astype(np.float64) - x[:, 0])
        e_n = np.abs(on[name][:, 0].astype(np.float64) - x[:, 0])
        assert e_s.mean() < 0.25 * e_n.mean()
        assert nrmse(x, os_[name]) <= 0.05


def test_header_without_sink_keys_means_off():
    d = CodecConfig().to_json()
    del d["sink_tokens"], d["sink_scale"]
    cfg = CodecConfig.from_json(d)
    assert cfg.sink_tokens == 0 and cfg.sink_scale == 1.0
