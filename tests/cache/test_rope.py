"""alignpred.cache.rope: deterministic cos/sin tables, accuracy, RopeTable/RopeSpec, the block cache."""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import threading
from fractions import Fraction

import numpy as np
import pytest

from alignpred.cache.rope import (
    MAX_ANGLE,
    RopeSpec,
    RopeTable,
    _BlockCache,
    apply_rope,
    set_table_cache_bytes,
    sincos_f32,
    table_cache_info,
)
from alignpred.errors import LayoutError
from alignpred.kernels.sincos import _PIO2_0, _PIO2_1, _PIO2_2, _PIO2_3, sincos_reference

# pi to 60 decimals (for checking the Cody-Waite constants)
PI = Fraction("3.141592653589793238462643383279502884197169399375105820974944")


def _adversarial(n_random=60_000, seed=0) -> np.ndarray:
    """Float32 angles that stress the argument reduction: the float32 values nearest to k·pi/2
    and k·pi/4 (± 2 ulp) for k up to 2**26, tiny angles, and random ones up to 2**20·pi."""
    rng = np.random.default_rng(seed)
    k = np.unique(np.concatenate([np.arange(1, 3000), rng.integers(1, 2 ** 26 - 1, 6000),
                                  np.geomspace(1, 2 ** 26 - 2, 400).astype(np.int64)]))
    out = [rng.uniform(0, 2 ** 20 * math.pi, n_random).astype(np.float32),
           rng.uniform(0, 4, n_random // 4).astype(np.float32),
           np.float32([0.0, 1e-45, 1e-38, 1e-20, 1e-8, 2.0 ** -27, 0.5, 1.0])]
    for m in (0.5, 0.25):
        v = (k.astype(np.float64) * (m * math.pi)).astype(np.float32)
        for step in range(-2, 3):
            w = v
            for _ in range(abs(step)):
                w = np.nextafter(w, np.float32(np.inf if step > 0 else -np.inf))
            out.append(w)
    a = np.concatenate(out)
    return a[np.abs(a) < MAX_ANGLE * (1 - 1e-7)]


def _ulp32(v: np.ndarray) -> np.ndarray:
    v = np.abs(v).astype(np.float32)
    return (np.nextafter(v, np.float32(np.inf)) - v).astype(np.float64)


# -- sin/cos ----------------------------------------------------------------------------------------------
def test_cody_waite_constants():
    parts = [Fraction(p) for p in (_PIO2_0, _PIO2_1, _PIO2_2, _PIO2_3)]
    assert abs(sum(parts) - PI / 2) < Fraction(1, 2 ** 140)
    for p in (_PIO2_0, _PIO2_1, _PIO2_2):  # at most 27 significant bits: k * p exact for |k| < 2**26
        m, _ = math.frexp(p)
        assert (m * 2 ** 27).is_integer()


def test_sincos_accuracy_half_ulp():
    """Max error against math.cos / math.sin, in float32 ulps, over adversarial + random angles."""
    a = _adversarial()
    c, s = sincos_f32(a)
    ad = a.astype(np.float64)
    mc = np.array([math.cos(x) for x in ad])
    ms = np.array([math.sin(x) for x in ad])
    ec = np.abs(c.astype(np.float64) - mc) / _ulp32(mc)
    es = np.abs(s.astype(np.float64) - ms) / _ulp32(ms)
    print(f"\n{a.size} angles: max error cos {ec.max():.8f} ulp, sin {es.max():.8f} ulp")
    assert ec.max() <= 0.5 + 1e-6 and es.max() <= 0.5 + 1e-6
    # i.e. the correctly rounded float32 of the double-precision value
    assert np.array_equal(c, mc.astype(np.float32)) and np.array_equal(s, ms.astype(np.float32))


def test_numba_kernel_matches_numpy_reference_bitwise():
    a = np.concatenate([_adversarial(20_000, seed=5), -_adversarial(2_000, seed=6)])
    c1, s1 = sincos_f32(a)
    c2, s2 = sincos_reference(a)
    assert np.array_equal(c1.view(np.uint32), c2.view(np.uint32))
    assert np.array_equal(s1.view(np.uint32), s2.view(np.uint32))
    c3, s3 = sincos_f32(a.reshape(-1, 2)[:7])  # shape kept
    assert c3.shape == (7, 2) and np.array_equal(c3.ravel(), c1[:14])


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 instruction check")
def test_kernel_has_no_fma():
    """Fused multiply-add would change the last bits depending on the CPU: the compiled kernel
    must have none (LLVM IR without contract/fast flags, machine code without vfmadd)."""
    import re

    from numba import njit

    from alignpred.kernels.sincos import _sincos_kernel

    k = njit(_sincos_kernel.py_func)  # fresh, uncached compile so it can be inspected
    a = np.float32(np.arange(64))
    k(a, np.empty_like(a), np.empty_like(a))
    ir = "\n".join(k.inspect_llvm().values())
    asm = "\n".join(k.inspect_asm().values())
    assert "fmul" in ir and not re.search(r"\b(contract|fast|reassoc)\b|fmuladd|llvm\.fma", ir)
    assert "mul" in asm and not re.search(r"vfn?m(add|sub)", asm)


def test_sincos_refuses_huge_or_nonfinite_angles():
    with pytest.raises(LayoutError, match="too large"):
        sincos_f32(np.float32([MAX_ANGLE * 1.01]))
    with pytest.raises(LayoutError, match="not finite"):
        sincos_f32(np.float32([1.0, np.nan]))
    c, s = sincos_f32(np.zeros(0, np.float32))
    assert c.shape == s.shape == (0,)


# -- determinism ------------------------------------------------------------------------------------------
def _fingerprint() -> str:
    """sha256 of tables a decoder would use (inv_freq from a base, large positions, odd tables)."""
    from alignpred.cache.rope import RopeTable, sincos_f32  # noqa: F811 - also run in a subprocess

    h = hashlib.sha256()
    t1 = RopeTable.from_theta(1e4, 128)
    t2 = RopeTable.from_theta(1e6, 256, rotary_dim=64)
    t3 = RopeTable(tuple(float(v) for v in np.float32([1.0, 0.5, 0.0, 2.0, 1e-4, 0.0033])), 1.25, "interleaved")
    h.update(np.float32(t1.inv_freq + t2.inv_freq + t3.inv_freq).tobytes())
    for t, start, n in ((t1, 0, 2048), (t1, 1_000_000, 700), (t2, 131_000, 300), (t3, 0, 512)):
        for arr in t.cos_sin(start, n):
            h.update(np.ascontiguousarray(arr).tobytes())
    k = np.arange(1, 2 ** 26, 9973, dtype=np.float64)
    for arr in sincos_f32((k * (math.pi / 2)).astype(np.float32)):
        h.update(arr.tobytes())
    return h.hexdigest()


FINGERPRINT = "ac8bb1c39afe0e81606707cd007986ee37e098dfafc16de2113e13977cf37338"


def test_tables_match_stored_hash():
    """The same bits as when this hash was stored (x86-64, AVX-512): a change of the table
    algorithm or a platform dependence would alter decoded files."""
    assert _fingerprint() == FINGERPRINT


def test_tables_identical_in_subprocess_without_simd(tmp_path):
    """A fresh interpreter with numba compiling for a generic x86-64 (SSE2 only) and numpy's SIMD
    dispatch off gives the same bytes."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), NPY_DISABLE_CPU_FEATURES="")
    if platform.machine().lower() in ("x86_64", "amd64"):
        env["NUMBA_CPU_NAME"] = "generic"
        try:  # numpy's dispatchable SIMD targets present on this CPU
            from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
            env["NPY_DISABLE_CPU_FEATURES"] = " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f))
        except ImportError:
            pass
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import test_rope; print(test_rope._fingerprint())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == _fingerprint() == FINGERPRINT


def test_blocks_do_not_depend_on_the_range_asked():
    t = RopeTable.from_theta(5e5, 64)
    cos, sin = t.cos_sin(0, 1500)
    rng = np.random.default_rng(2)
    for _ in range(30):
        a = int(rng.integers(0, 1400))
        n = int(rng.integers(1, 1500 - a))
        c2, s2 = t.cos_sin(a, n)
        assert np.array_equal(c2, cos[a:a + n]) and np.array_equal(s2, sin[a:a + n])
        assert np.array_equal(t.apply(np.ones((n, 64), np.float32), a), t.apply(np.ones((1500, 64), np.float32), 0)[a:a + n])



def test_joined_ranges_are_reused_while_their_blocks_are_cached():
    """A multi-block range asked again (every layer sharing a table, in one decode) is the same
    joined arrays; once the block cache no longer holds those blocks it is joined afresh, equal."""
    t = RopeTable.from_theta(1e4, 64)
    a = t.cos_sin(100, 900)
    b = t.cos_sin(100, 900)
    assert b[0] is a[0] and b[1] is a[1]
    set_table_cache_bytes(0)
    try:
        c = t.cos_sin(100, 900)
        assert c[0] is not a[0] and np.array_equal(c[0], a[0]) and np.array_equal(c[1], a[1])
        assert t.cos_sin(100, 900)[0] is not c[0]            # no block cache: nothing is kept
    finally:
        set_table_cache_bytes(64 << 20)

# -- RopeTable / RopeSpec -----------------------------------------------------------------------------------
def _variants():
    """Tables shaped like each transformers RoPE type (values as such models produce)."""
    d = 128
    base = np.asarray(RopeTable.from_theta(5e5, d).inv_freq, np.float32)
    i = np.arange(d // 2)
    ramp = np.clip((i - 10) / 20.0, 0, 1).astype(np.float32)
    return {
        "default": RopeTable(tuple(base)),
        "linear": RopeTable(tuple(base / np.float32(8))),
        "llama3": RopeTable(tuple(np.where(i > 40, base / np.float32(8), base).astype(np.float32))),
        "dynamic": RopeTable.from_theta(5e5 * 2.7, d),
        "yarn": RopeTable(tuple((base / 4 * (1 - ramp) + base * ramp).astype(np.float32)), float(np.float32(1.1386294))),
        "longrope": RopeTable(tuple((base / (1 + i / 16.0)).astype(np.float32)), float(np.float32(1.1902381))),
        "partial": RopeTable(tuple(np.asarray(RopeTable.from_theta(1e4, 32).inv_freq)), 1.0),  # 32 of 128 channels
        "proportional": RopeTable(tuple(np.concatenate([base[:16], np.zeros(48, np.float32)]))),
    }


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("name", list(_variants()))
def test_apply_inverse_roundtrip(name, pairing):
    t0 = _variants()[name]
    t = RopeTable(t0.inv_freq, t0.attention_scaling, pairing)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((2, 300, 128)) * 3 + 1).astype(np.float32)
    for start in (0, 1234, 100_003):
        y = t.apply(x, start)
        back = t.apply(y, start, inverse=True)
        rel = np.abs(back - x).max() / np.abs(x).max()
        assert rel < 1e-6, (name, pairing, start, rel)
        assert np.array_equal(y[..., t.rotary_dim:], x[..., t.rotary_dim:])  # partial: the rest untouched
        # forward = the exact rotation (float64 reference with math.cos) up to float32 rounding
        pos = np.arange(start, start + 300, dtype=np.float32)[:, None]
        ang = (pos * np.float32(t.inv_freq)).astype(np.float64)
        c, s = np.cos(ang) * t.attention_scaling, np.sin(ang) * t.attention_scaling
        r = t.rotary_dim
        xd = x.astype(np.float64)
        if pairing == "half":
            a, b = xd[..., :r // 2], xd[..., r // 2:r]
        else:
            a, b = xd[..., 0:r:2], xd[..., 1:r:2]
        ref1, ref2 = a * c - b * s, b * c + a * s
        got1, got2 = (y[..., :r // 2], y[..., r // 2:r]) if pairing == "half" else (y[..., 0:r:2], y[..., 1:r:2])
        assert max(np.abs(got1 - ref1).max(), np.abs(got2 - ref2).max()) / np.abs(x).max() < 2e-6


def test_validation_and_json():
    t = RopeTable((1.0, 0.25, 0.0), 1.5, "interleaved")
    assert RopeTable.from_json(json.loads(json.dumps(t.to_json()))) == t and t.rotary_dim == 6
    for bad in [dict(inv_freq=(1.0, -1.0)), dict(inv_freq=(0.1,)), dict(inv_freq=()), dict(inv_freq=(1.0, math.nan)),
                dict(inv_freq=(1.0,), attention_scaling=0.0), dict(inv_freq=(1.0,), attention_scaling=1.1),
                dict(inv_freq=(1.0,), pairing="odd"), dict(inv_freq=(1.0,), pairing=["half"]),
                dict(inv_freq=(10 ** 400,))]:
        with pytest.raises(LayoutError):
            RopeTable(**bad)
    for bad in [[], {"inv_freq": "x"}, {"inv_freq": [True]}, {"inv_freq": [1.0], "attention_scaling": "2"}]:
        with pytest.raises(LayoutError):
            RopeTable.from_json(bad)
    spec = RopeSpec((t, RopeTable.from_theta(1e4, 8)), (1, -1, 0, 1))
    assert RopeSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.table(1) is None and spec.table(2) == t and spec.num_layers == 4
    for bad in [{"tables": [], "layer_table": [0]}, {"tables": [], "layer_table": []},
                {"tables": [t.to_json()], "layer_table": [True]}, {"tables": {}, "layer_table": [0]}]:
        with pytest.raises(LayoutError):
            RopeSpec.from_json(bad)
    with pytest.raises(LayoutError):
        RopeTable.from_theta(1.0, 8)
    with pytest.raises(LayoutError):
        RopeTable.from_theta(1e4, 8, rotary_dim=10)
    with pytest.raises(LayoutError, match="exceeds head_dim"):
        RopeTable.from_theta(1e4, 16).apply(np.zeros((3, 8), np.float32), 0)
    with pytest.raises(LayoutError, match="negative"):
        t.cos_sin(-1, 3)


def test_from_theta_matches_transformers():
    """Default inverse frequencies: float32 like transformers (base and exponent in float32, the
    power rounded to float32, a float32 reciprocal), the power correctly rounded — equal to
    torch's values except where torch's powf is off by one ulp."""
    torch = pytest.importorskip("torch")
    same = total = 0
    for theta in (1e4, 1e6, 5e5, 1e5, 75e4):
        for d in (64, 128, 256, 96):
            want = (1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))).numpy()
            got = np.float32(RopeTable.from_theta(theta, d).inv_freq)
            ulps = np.abs(got.view(np.int32) - want.view(np.int32))
            assert ulps.max() <= 2
            same += int((ulps == 0).sum())
            total += got.size
    assert same / total > 0.97


def test_legacy_apply_rope_unchanged():
    """Format-1.0 files decode with kvz 0.1's tables (float64 angles, libm): values pinned."""
    x = np.arange(2 * 5 * 8, dtype=np.float32).reshape(2, 5, 8) / 7
    y = apply_rope(x, np.arange(3, 8), 1e4)
    assert np.allclose(apply_rope(y, np.arange(3, 8), 1e4, inverse=True), x, atol=1e-5)
    ang = np.arange(3, 8, dtype=np.float64)[:, None] / 1e4 ** (np.arange(0, 8, 2) / 8)
    ref = np.concatenate([x[..., :4] * np.cos(ang) - x[..., 4:] * np.sin(ang),
                          x[..., 4:] * np.cos(ang) + x[..., :4] * np.sin(ang)], -1)
    assert np.abs(y - ref).max() < 1e-5


# -- the block cache --------------------------------------------------------------------------------------
def test_cache_chunked_decode_computes_each_block_once():
    """A 16K-token cache decoded chunk by chunk (512 positions) through 18 layers with two tables
    (Gemma 3: 5 sliding + 1 full) and a position offset: every block is computed exactly once."""
    c = _BlockCache(64 << 20)
    ta, tb = RopeTable.from_theta(1e4, 256), RopeTable.from_theta(1e6, 256)
    seen = set()
    for a in range(100, 16384 + 100, 512):
        for layer in range(18):
            t = tb if layer % 6 == 5 else ta
            for k in range(a // 256, (a + 511) // 256 + 1):
                c.get(t, k)
                seen.add((t, k))
    info = c.info()
    assert info["misses"] == len(seen) == 130 and info["hits"] == 32 * 18 * 3 - 130
    assert info["bytes"] <= info["max_bytes"]


def test_cache_survives_sweeps_larger_than_itself():
    """Tensor-by-tensor decode of a 128K-token cache sweeps 512 blocks per layer; with room for
    ~200 blocks plain LRU would hit never — this keeps most of what fits."""
    t = RopeTable.from_theta(1e4, 128)
    per = 256 * 64 * 8
    c = _BlockCache(200 * per)
    for k in range(512):  # first sweep: all misses
        c.get(t, k)
    for _layer in range(5):
        for k in range(512):
            c.get(t, k)
    info = c.info()
    hit_rate = info["hits"] / (5 * 512)
    assert info["bytes"] <= 200 * per and info["blocks"] <= 200
    assert hit_rate > 0.25, info  # ≈ (200 - 64) / 512 (the optimum would be 199 / 512)


def test_cache_evicts_stale_tables():
    """Blocks of a table no longer used (another model) leave the cache eventually."""
    per = 256 * 8 * 8
    c = _BlockCache(100 * per)
    old, new = RopeTable.from_theta(1e4, 16), RopeTable.from_theta(2e4, 16)
    for k in range(100):
        c.get(old, k)
    for _ in range(12):
        for k in range(150):
            c.get(new, k)
    assert not any(key[0] == old for key in c._entries)


def test_cache_config_and_threads():
    t = RopeTable.from_theta(3e4, 64)
    try:
        set_table_cache_bytes(0)  # disabled: still correct
        ref = t.cos_sin(0, 3000)
        assert table_cache_info()["blocks"] == 0
        set_table_cache_bytes(1 << 20)
        res = []

        def work():
            res.append(t.cos_sin(0, 3000))

        th = [threading.Thread(target=work) for _ in range(4)]
        for x in th:
            x.start()
        for x in th:
            x.join()
        assert all(np.array_equal(r[0], ref[0]) and np.array_equal(r[1], ref[1]) for r in res)
        assert table_cache_info()["bytes"] <= 1 << 20
        with pytest.raises(ValueError):
            set_table_cache_bytes(-1)
    finally:
        set_table_cache_bytes(64 << 20)
