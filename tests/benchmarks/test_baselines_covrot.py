"""The covariance-rotation baseline (benchmarks/baselines/covrot.py, OSCAR / AQUA-KV style): quantiser tables, bit
allocation, round trip, exact bpv accounting, error falling with bits, query weighting, fitting only on calibration.
"""
from __future__ import annotations

import glob
import os

import ml_dtypes
import numpy as np
import pytest

from alignpred import nrmse
from kvz.benchmarks.baselines import BASELINES, cast_back, error_stats
from kvz.benchmarks.baselines._io import synthetic_cache
from kvz.benchmarks.baselines.covrot import CovRot, allocate_bits, gaussian_uniform
from kvz.benchmarks.baselines.kvquant import with_metadata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = sorted(glob.glob(os.path.join(ROOT, "samples", "gemma3-270m", "*.safetensors")))


def _code(codec, cache, calib, bits):
    ctx = codec.prepare(cache, calib)
    encs = {k: codec.encode(k, x, bits, ctx) for k, x in cache.items()}
    rec = {k: cast_back(codec.decode(k, encs[k], x.shape, ctx), x.dtype) for k, x in cache.items()}
    return ctx, encs, rec


@pytest.fixture(scope="module")
def syn():
    cache = synthetic_cache(n_layers=2, kv_heads=2, T=160, D=32, seed=3)
    calib = [synthetic_cache(n_layers=2, kv_heads=2, T=200, D=32, seed=4)]
    return cache, calib


@pytest.fixture(scope="module")
def real():
    if len(SAMPLES) < 3:
        pytest.skip("no sample caches")
    import alignpred
    layers = (0, 1, 5, 11)
    out = []
    for p in SAMPLES:
        c = alignpred.load_cache(p)
        out.append(with_metadata({k: v for k, v in c.tensors.items() if int(k.split(".")[1]) in layers},
                                 c.metadata))
    return out[-1], out[:-1]  # code the last sample, calibrate on the others


def test_registered():
    for n in ("covrot", "covrot2", "covrot3", "covrot4", "covrot_pre"):
        assert n in BASELINES and BASELINES[n].name == n and BASELINES[n].uses_calib
    assert BASELINES["covrot"].knob_kind == "discrete" and BASELINES["covrot"].knob_name == "bits"
    assert BASELINES["covrot3"].knob_kind == "none" and BASELINES["covrot3"].default_knob == 3
    assert BASELINES["covrot"].frame == "post" and BASELINES["covrot_pre"].frame == "pre"


def test_gaussian_uniform_quantiser_table():
    # Max (1960): optimal uniform quantisers of a unit Gaussian, 2 / 4 / 8 levels
    assert gaussian_uniform(1) == pytest.approx((1.5958, 0.3634), abs=2e-4)
    assert gaussian_uniform(2) == pytest.approx((0.9957, 0.1188), abs=2e-4)
    assert gaussian_uniform(3) == pytest.approx((0.5860, 0.03744), abs=2e-4)
    mses = [gaussian_uniform(b)[1] for b in range(9)]
    assert all(a > b for a, b in zip(mses, mses[1:]))


def test_allocate_bits_waterfilling():
    var = np.array([16.0, 4.0, 1.0, 0.25, 1e-3, 0.0])
    b = allocate_bits(var, 12)
    assert b.sum() == 12 and np.all(np.diff(b) <= 0)  # more variance, never fewer bits
    assert b[-1] == 0 and b[-2] == 0  # below the water level: no bits
    assert b[0] - b[1] in (0, 1, 2)  # 4x the variance ~ one more bit
    assert allocate_bits(np.zeros(4), 8).sum() == 0  # nothing to code


@pytest.mark.parametrize("name", ["covrot", "covrot_pre"])
def test_roundtrip_shape_dtype(name, syn):
    cache, calib = syn
    codec = BASELINES[name]
    _, encs, rec = _code(codec, cache, calib, 4)
    for k, x in cache.items():
        assert rec[k].shape == x.shape and rec[k].dtype == x.dtype and np.isfinite(rec[k].astype(np.float32)).all()
        # the sink token is stored exactly
        assert np.array_equal(rec[k][:, :1], x[:, :1])
    x = cache["layers.0.key"][None]  # a batch dimension in front of the heads
    ctx = codec.prepare({"layers.0.key": x}, calib)
    y = codec.decode("layers.0.key", codec.encode("layers.0.key", x, 3, ctx), x.shape, ctx)
    assert y.shape == x.shape


def test_bpv_counts_every_bit(syn):
    cache, calib = syn
    H, T, D = cache["layers.0.key"].shape
    for bits in (2, 3, 4):
        # fully offline, no per-token scales: sink + codes, nothing else
        _, encs, _ = _code(CovRot(adapt="calib", token_scale=False), cache, calib, bits)
        for e in encs.values():
            assert e.bits == 16 * H * D + bits * D * H * (T - 1) and e.meta_bits == 0
        # default: + fp16 scale per coefficient (adaptive allocation) + mode byte [+ fp16 scale per token]
        codec = CovRot()
        _, encs, _ = _code(codec, cache, calib, bits)
        for e in encs.values():
            meta = 16 * H * D + 8 + (16 * H * (T - 1) if e.payload["ts"] else 0)
            assert e.meta_bits == meta
            assert e.bits == 16 * H * D + bits * D * H * (T - 1) + meta
        r = BASELINES[f"covrot{bits}"].run(cache, None, "tensor", calib)
        nv = sum(x.size for x in cache.values())
        assert r.extra["total_bits"] == sum(e.bits for e in encs.values()) == pytest.approx(r.bpv * nv)
        # sink (16 - b) / T, coefficient scales 16 / T, per-token scales 16 / D when used
        assert bits + (16 - bits + 16) / T < r.bpv <= bits + (16 - bits + 16 + 1) / T + 16 / D
        assert r.extra["bank_excluded_from_bpv"] and r.extra["bank_bits"] > 0


def test_recent_window_exact_and_counted(syn):
    cache, calib = syn
    H, T, D = cache["layers.0.value"].shape
    codec = CovRot(recent=16, adapt="calib", token_scale=False)
    _, encs, rec = _code(codec, cache, calib, 2)
    x = cache["layers.0.value"]
    assert np.array_equal(rec["layers.0.value"][:, T - 16:], x[:, T - 16:])
    assert encs["layers.0.value"].bits == 16 * H * D * 17 + 2 * D * H * (T - 17)


@pytest.mark.parametrize("name", ["covrot", "covrot_pre"])
def test_error_falls_with_bits(name, syn, real):
    for cache, calib in (syn, real):
        errs = []
        for bits in (2, 3, 4, 6):
            _, _, rec = _code(BASELINES[name], cache, calib, bits)
            errs.append(error_stats(cache, rec)[0])
        assert all(a > b for a, b in zip(errs, errs[1:])), errs
        assert errs[0] < 0.5 and errs[-1] < 0.1


def test_pre_rope_frame_roundtrip(real):
    cache, calib = real
    _, _, rec = _code(BASELINES["covrot_pre"], cache, calib, 8)
    _, _, rec_post = _code(BASELINES["covrot"], cache, calib, 8)
    for k, x in cache.items():  # 8 bits in the de-RoPE frame, RoPE re-applied at the right positions
        if k.endswith("key"):
            e, e_post = nrmse(x, cast_back(rec[k], x.dtype)), nrmse(x, cast_back(rec_post[k], x.dtype))
            assert e < 0.02 and e < 1.5 * e_post, k
        else:  # values have no RoPE: both frames code them alike
            assert np.array_equal(rec[k], rec_post[k])


def test_query_weighting_lowers_the_weighted_key_error(real):
    from alignpred.bank import AttentionStats

    cache, calib = real
    stats = AttentionStats.find("gemma-3-270m")
    if stats is None:
        pytest.skip("no attention statistics beside the bundled bank")
    W = stats.key_weights()

    def werr(rec):
        num = den = 0.0
        for k, x in cache.items():
            if k.endswith("key"):
                w = W[int(k.split(".")[1])][:, None, :]
                d = rec[k].astype(np.float64) - x.astype(np.float64)
                num += float((w * d * d).sum())
                den += float((w * x.astype(np.float64) ** 2).sum())
        return (num / den) ** 0.5

    for frame in ("post", "pre"):
        ctx, _, rec_w = _code(CovRot(frame=frame), cache, calib, 3)
        assert ctx["weighted"]["layers.5.key"] and not ctx["weighted"]["layers.5.value"]
        assert CovRot(frame=frame).bank_info(ctx)["covrot_key_weights"].startswith("query second moments")
        _, _, rec_u = _code(CovRot(frame=frame, weight_keys=False), cache, calib, 3)
        assert werr(rec_w) < 0.9 * werr(rec_u)


def test_synthetic_shapes_fall_back_to_unweighted(syn):
    cache, calib = syn
    codec = CovRot()
    ctx = codec.prepare(cache, calib)  # D=32, 2 heads: not Gemma's statistics
    assert not any(ctx["weighted"].values())
    assert codec.bank_info(ctx)["covrot_key_weights"] == "none (unweighted)"


def test_fits_only_on_calibration(syn):
    cache, calib = syn
    codec = CovRot()
    with pytest.raises(ValueError, match="calibration"):
        codec.prepare(cache, None)
    rng = np.random.default_rng(0)
    noise = {k: (rng.standard_normal(x.shape) * 50).astype(ml_dtypes.bfloat16) for k, x in cache.items()}
    a, b = codec.prepare(cache, calib), codec.prepare(noise, calib)
    for k in cache:  # the bank depends on the calibration caches only, not on what is coded
        for f in ("mu", "a", "U", "sigma"):
            assert np.array_equal(a["bank"][k][f], b["bank"][k][f])
    other = codec.prepare(cache, [synthetic_cache(n_layers=2, kv_heads=2, T=200, D=32, seed=9)])
    assert not np.allclose(other["bank"]["layers.0.key"]["U"], a["bank"]["layers.0.key"]["U"])
    # and the coded result follows the calibration: another calibration set, another reconstruction
    x = cache["layers.0.key"]
    y1 = codec.decode("layers.0.key", codec.encode("layers.0.key", x, 3, a), x.shape, a)
    y2 = codec.decode("layers.0.key", codec.encode("layers.0.key", x, 3, other), x.shape, other)
    assert not np.allclose(y1, y2)


def test_matched_error_search(syn):
    cache, calib = syn
    r = BASELINES["covrot"].run(cache, 0.1, "tensor", calib)
    assert r.extra["meets_target"] and r.nrmse_max_tensor <= 0.1
    assert set(r.extra["knobs"].values()) <= set(BASELINES["covrot"].knob_values)
