"""Tests of the ``lanes32`` coder (format 1.2's entropy stage): alignpred.entropy with
``coder="lanes32"`` and its decoders (vectorised, portable, torch reference)."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvz_testing import synthetic_cache

from alignpred import entropy as E
from alignpred.entropy import lanes, lanes_simd
from alignpred.entropy import models as tables
from alignpred.errors import FormatError

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
HSET = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
CODER = "lanes32"


def _mixed(rng, C, N):
    """Channels of very different statistics, including int32 extremes."""
    q = np.empty((C, N), np.int32)
    for c in range(C):
        s = float(np.exp(rng.uniform(np.log(0.05), np.log(3e5))))
        x = [lambda: rng.laplace(0, s, N), lambda: rng.normal(0.3 * s, s, N),
             lambda: s * rng.standard_t(3, N), lambda: np.zeros(N),
             lambda: rng.integers(I32_MIN, I32_MAX, N, endpoint=True).astype(np.float64)][c % 5]()
        q[c] = np.clip(np.rint(x), I32_MIN, I32_MAX).astype(np.int32)
    return q


def _all_paths(buf, ids, shape):
    """The values of every decoder (they must agree)."""
    outs = {p: lanes.decode(buf, ids, shape, path=p) for p in ("simd", "portable")}
    try:
        from alignpred.entropy import lanes_torch
    except ImportError:
        return outs
    outs["torch"] = lanes_torch.decode(buf, ids, shape)
    return outs


def _roundtrip(q, ids):
    buf = E.encode(q, ids, coder=CODER)
    for path, out in _all_paths(buf, ids, q.shape).items():
        assert out.dtype == np.int32 and out.shape == q.shape, path
        np.testing.assert_array_equal(out, q, err_msg=path)
    np.testing.assert_array_equal(E.decode(buf, ids, q.shape, coder=CODER), q)
    return buf


# --- tables --------------------------------------------------------------------------------

def test_quantised_tables_follow_the_rule_and_are_pinned():
    packed, dtab = lanes.tables()
    freq = packed >> 16
    assert freq.shape == (E.N_MODELS, E.N_TOKENS)
    assert np.all(freq.sum(axis=1) == 1 << lanes.LANES_PREC) and freq.min() >= 1
    np.testing.assert_array_equal(freq, lanes.quantize_freq(tables.load().freq, lanes.LANES_PREC))
    # every slot decodes to the token whose interval holds it
    m = 17
    e = dtab.reshape(E.N_MODELS, -1)[m]
    tok = e & 0xFF
    cum = packed[m] & 0xFFFF
    s = np.arange(1 << lanes.LANES_PREC)
    assert np.all(cum[tok] + ((e >> 8) & 0xFFF) == s) and np.all((e >> 20) == freq[m][tok])
    digest = hashlib.sha256(np.ascontiguousarray(freq, "<u2").tobytes()).hexdigest()
    assert digest == "6bcfd40c0169ec5e089c99bc1682ae82040a7d6aaec4ce8fca072a38702c7771"


def test_quantize_rule_small_example():
    f = np.array([[32768 - 127] + [1] * 127, [256] * 128])
    g = lanes.quantize_freq(f, 12)
    assert g[0, 0] == 4096 - 127 and g[1].tolist() == [32] * 128


# --- round trips ---------------------------------------------------------------------------

@HSET
@given(C=st.integers(1, 5), N=st.integers(1, 70), seed=st.integers(0, 2**32 - 1))
def test_roundtrip_hypothesis_all_paths(C, N, seed):
    rng = np.random.default_rng(seed)
    q = _mixed(rng, C, N)
    ids = rng.integers(0, E.N_MODELS, C) if seed % 2 else E.choose_models(q)
    _roundtrip(q, ids)


@pytest.mark.parametrize("shape", [(1, 1), (1, 31), (1, 32), (1, 33), (3, 11), (2, 64), (5, 100), (40, 32)])
def test_tiny_and_boundary_shapes(shape):
    rng = np.random.default_rng(sum(shape))
    q = _mixed(rng, *shape)
    buf = _roundtrip(q, E.choose_models(q))
    assert len(buf) >= 2 * lanes.header_words(q.size)


def test_empty_object():
    for shape in ((0, 5), (4, 0), (0, 0)):
        q = np.zeros(shape, np.int32)
        ids = np.zeros(shape[0], np.uint8)
        assert E.encode(q, ids, coder=CODER) == b""
        assert E.decode(b"", ids, shape, coder=CODER).shape == shape
        with pytest.raises(FormatError):
            E.decode(b"\0\0", ids, shape, coder=CODER)


def test_extremes_and_every_token():
    vals = []
    for n in range(4, 32):
        for u in (1 << n, (1 << n) + 1, (3 << (n - 1)) if n < 31 else (1 << 31) + 7, (1 << (n + 1)) - 1):
            u &= 0xFFFFFFFF
            vals.append((u >> 1) ^ -(u & 1))
    vals += list(range(-8, 8)) + [I32_MIN, I32_MAX]
    q = np.array(vals, np.int64).astype(np.int32).reshape(1, -1)
    for m in (0, 1, 120, E.N_MODELS - 1):
        _roundtrip(q, np.array([m]))


@pytest.mark.parametrize("dist,scale", [("laplace", 0.5), ("laplace", 4.0), ("gauss", 12.0), ("t3", 2.0),
                                        ("laplace", 300.0)])
def test_real_like_distributions_cost_close_to_rans4(dist, scale):
    rng = np.random.default_rng(2026)
    shape = (64, 256)
    x = {"laplace": lambda: rng.laplace(0, scale, shape), "gauss": lambda: rng.normal(0, scale, shape),
         "t3": lambda: scale * rng.standard_t(3, shape)}[dist]()
    q = np.rint(x).astype(np.int32)
    ids = E.choose_models(q)
    buf = _roundtrip(q, ids)
    r4 = len(E.encode(q, ids))
    # 12-bit probabilities and 32 lane headers: a few percent at most on these sizes
    assert len(buf) <= 1.03 * r4 + 192, (len(buf), r4)


def test_wide_lane_table():
    n = 32 * (lanes.WIDE_LANE_SYMBOLS + 1)
    assert lanes.header_words(n) == 128 and lanes.header_words(n - 32) == 96
    rng = np.random.default_rng(3)
    q = np.rint(rng.laplace(0, 2.0, (1, n))).astype(np.int32)
    ids = E.choose_models(q)
    buf = E.encode(q, ids, coder=CODER)
    for path in ("simd", "portable"):
        np.testing.assert_array_equal(lanes.decode(buf, ids, q.shape, path=path), q)
        with pytest.raises(FormatError):
            lanes.decode(buf[:-2], ids, q.shape, path=path)


def test_decode_into_views():
    rng = np.random.default_rng(7)
    q = rng.integers(-40, 40, (6, 100)).astype(np.int32)
    ids = rng.integers(0, E.N_MODELS, 6).astype(np.uint8)
    buf = E.encode(q, ids, CODER)
    for path in ("simd", "portable"):
        big = np.full((6, 300), -7, np.int32)
        got = lanes.decode(buf, ids, q.shape, out=big[:, 50:150], path=path)     # rows contiguous
        assert np.array_equal(got, q) and (big[:, :50] == -7).all() and (big[:, 150:] == -7).all()
        got = lanes.decode(buf, ids, q.shape, out=big[:, ::3][:, :100], path=path)  # strided rows
        assert np.array_equal(big[:, ::3][:, :100], q)


# --- exact bytes (golden pin) --------------------------------------------------------------

PIN_Q = np.array([[0, 1, -1, 7, -8, 16, -17, 1000],
                  [I32_MAX, I32_MIN, 3, 0, 0, 0, 5, -5],
                  [0, 0, 0, 0, 0, 0, 0, 1]], np.int32)
PIN_IDS = np.array([1, 120, 0], np.uint8)


def _pin_big():
    rng = np.random.default_rng(12345)
    q = _mixed(rng, 10, 77)
    return q, E.choose_models(q)


def test_golden_pin():
    buf = E.encode(PIN_Q, PIN_IDS, coder=CODER)
    assert hashlib.sha256(buf).hexdigest() == PIN_SHA_SMALL
    np.testing.assert_array_equal(E.decode(buf, PIN_IDS, PIN_Q.shape, coder=CODER), PIN_Q)
    q, ids = _pin_big()
    buf = E.encode(q, ids, coder=CODER)
    assert (len(buf), hashlib.sha256(buf).hexdigest()) == PIN_BIG


PIN_SHA_SMALL = "2c292d0eee314f0fef3431f10ea723b8202d7ec31448c3ed7cca94b72d1c0e23"
PIN_BIG = (1398, "9d90dc8638b01372d88aebb2d3827cb6736f820026bc812fe922fd387b0fb7e1")


# --- validation ----------------------------------------------------------------------------

def _obj(seed=11, C=6, N=45):
    rng = np.random.default_rng(seed)
    q = _mixed(rng, C, N)
    return q, E.choose_models(q)


@pytest.mark.parametrize("path", ["simd", "portable"])
def test_truncation_extension_and_header_damage_raise(path):
    q, ids = _obj()
    buf = E.encode(q, ids, coder=CODER)
    for cut in range(1, len(buf) + 1):
        with pytest.raises(FormatError):
            lanes.decode(buf[:-cut], ids, q.shape, path=path)
    for extra in (b"\0", b"\0\0", b"\1\0", b"\0" * 8):
        with pytest.raises(FormatError):
            lanes.decode(buf + extra, ids, q.shape, path=path)
    with pytest.raises(FormatError):
        lanes.decode(buf, ids, (q.shape[0], q.shape[1] + 1), path=path)
    bad = bytearray(buf)
    bad[2:4] = b"\0\0"                       # lane 0 state < 2**16
    with pytest.raises(FormatError, match="state below"):
        lanes.decode(bytes(bad), ids, q.shape, path=path)
    bad = bytearray(buf)
    bad[128] += 1                             # lane 0 count: the table no longer tiles
    with pytest.raises(FormatError, match="tile"):
        lanes.decode(bytes(bad), ids, q.shape, path=path)
    bad = bytearray(buf)
    bad[128] += 1
    bad[130] -= 1                             # counts tile, but lanes 0/1 split the words wrongly
    with pytest.raises(FormatError, match="own words|final state"):
        lanes.decode(bytes(bad), ids, q.shape, path=path)


@HSET
@given(data=st.data())
def test_corruption_paths_agree(data):
    """On damaged payloads every decoder raises, or all return the same values."""
    q, ids = _obj(seed=data.draw(st.integers(0, 40)), C=3, N=data.draw(st.sampled_from([20, 64, 77])))
    buf = bytearray(E.encode(q, ids, coder=CODER))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    payload = bytes(buf)
    decoders = {p: (lambda p=p: lanes.decode(payload, ids, q.shape, path=p)) for p in ("simd", "portable")}
    try:
        from alignpred.entropy import lanes_torch
    except ImportError:   # torch is optional
        pass
    else:
        decoders["torch"] = lambda: lanes_torch.decode(payload, ids, q.shape)
    results = {}
    for path, dec in decoders.items():
        try:
            results[path] = dec()
        except FormatError as e:
            results[path] = str(e)
    first = results["simd"]
    for path, r in results.items():
        if isinstance(first, str):
            assert r == first, path
        else:
            assert not isinstance(r, str) and np.array_equal(r, first), path


@HSET
@given(blob=st.binary(min_size=0, max_size=300), N=st.integers(1, 40))
def test_garbage_never_crashes(blob, N):
    ids = np.array([0, 100, 239], np.uint8)
    for path in ("simd", "portable"):
        try:
            out = lanes.decode(blob, ids, (3, N), path=path)
        except FormatError:
            continue
        assert out.shape == (3, N)


def test_path_argument_and_environment(monkeypatch):
    q, ids = _obj()
    buf = E.encode(q, ids, coder=CODER)
    monkeypatch.setenv("KVZ_LANES_PATH", "portable")
    np.testing.assert_array_equal(E.decode(buf, ids, q.shape, coder=CODER), q)
    monkeypatch.setenv("KVZ_LANES_PATH", "nope")
    with pytest.raises(ValueError):
        E.decode(buf, ids, q.shape, coder=CODER)


# --- forced targets: AVX2-only and portable code on any machine -----------------------------

_CHILD = """
import hashlib, json, numpy as np
from alignpred import entropy as E
from alignpred.entropy import lanes, lanes_simd
rng = np.random.default_rng(99)
out = {"isa": lanes_simd.target_isa()}
for C, N in ((7, 256), (5, 77), (3, 20)):
    q = np.rint(rng.laplace(0, 30.0, (C, N))).astype(np.int32)
    q[0, :5] = [2**31 - 1, -2**31, 1 << 20, -(1 << 18), 0]
    ids = E.choose_models(q)
    buf = E.encode(q, ids, coder="lanes32")
    for path in ("simd", "portable"):
        d = lanes.decode(buf, ids, q.shape, path=path)
        out[f"{C}x{N}-{path}"] = [hashlib.sha256(buf).hexdigest(), bool(np.array_equal(d, q))]
        if N % 64 == 0:   # objects decoded in lock-step (decode_simd_objects' groups)
            bufs = [E.encode(np.ascontiguousarray(q[:, a:a + 64]), ids, coder="lanes32") for a in range(0, N, 64)]
            d = lanes.decode_objects(bufs, ids, C, [64] * (N // 64), np.empty_like(q), path=path)
            out[f"{C}x{N}-{path}-objects"] = ["", bool(np.array_equal(d, q))]
print(json.dumps(out))
"""

_TARGETS = {
    "avx2": {"NUMBA_CPU_NAME": "haswell",
             "NUMBA_CPU_FEATURES": "+64bit,+sse2,+sse4.2,+popcnt,+avx,+avx2,+fma,+bmi,+bmi2,+f16c,+lzcnt,-avx512f"},
    "none": {"NUMBA_CPU_NAME": "generic"},
}


def _host_isa() -> str:
    from llvmlite import binding as ll

    f = ll.get_host_cpu_features()
    return lanes_simd.isa_of(",".join(("+" if v else "-") + k for k, v in f.items()))


@pytest.mark.slow  # a subprocess per target ISA, compiling cold
@pytest.mark.parametrize("target", ["avx2", "none"])
def test_forced_targets_decode_the_same_bits(target):
    if target == "avx2" and _host_isa() == "none":
        pytest.skip("the host cannot run AVX2 code")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    env.update(_TARGETS[target])
    child = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-2000:]
    forced = json.loads(child.stdout.strip().splitlines()[-1])
    here = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")})
    assert here.returncode == 0, here.stderr[-2000:]
    native = json.loads(here.stdout.strip().splitlines()[-1])
    assert forced.pop("isa") == target
    native.pop("isa")
    assert forced == native and all(ok for _, ok in forced.values())


def test_isa_of():
    assert lanes_simd.isa_of("+avx2,+avx512f,+avx512vl") == "avx512"
    assert lanes_simd.isa_of("+avx2,-avx512f") == "avx2"
    assert lanes_simd.isa_of("") == "none"


# --- torch reference -----------------------------------------------------------------------

def test_torch_reference_decodes_an_object_in_lock_step():
    lanes_torch = pytest.importorskip("alignpred.entropy.lanes_torch")
    rng = np.random.default_rng(8)
    q = np.rint(rng.laplace(0, 6.0, (16, 128))).astype(np.int32)
    q[3, 7] = I32_MIN
    ids = E.choose_models(q)
    buf = E.encode(q, ids, coder=CODER)
    np.testing.assert_array_equal(lanes_torch.decode(buf, ids, q.shape), q)
    with pytest.raises(FormatError):
        lanes_torch.decode(buf[:-2], ids, q.shape)
    with pytest.raises(FormatError):
        lanes_torch.decode(buf + b"\0\0", ids, q.shape)


_AVX512_CHILD = """
import numba, numpy as np
from alignpred.entropy import lanes, lanes_simd
q = np.zeros((6, 100), np.int32)       # nothing jitted runs here: the code is for another CPU
args = (np.zeros(300, np.uint16), 298, 96, np.arange(6, dtype=np.int64), lanes.tables()[1], 12, q)
sig = tuple(numba.typeof(a) for a in args)
lanes_simd.decode_simd.compile(sig)
asm = lanes_simd.decode_simd.inspect_asm(sig)
print(lanes_simd.target_isa(), sum("vpgatherdd" in ln and "%k" in ln for ln in asm.splitlines()))
"""


@pytest.mark.slow  # compiles the AVX-512 kernel in a subprocess
def test_avx512_target_compiles_to_masked_gathers(tmp_path):
    """The AVX-512 flavour is generated (not run: the machine may lack AVX-512) with mask-register
    gathers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env.update({"NUMBA_CPU_NAME": "znver4", "NUMBA_CACHE_DIR": str(tmp_path),
                "NUMBA_CPU_FEATURES": "+64bit,+sse2,+sse4.2,+popcnt,+avx,+avx2,+fma,+bmi,+bmi2,+f16c,+lzcnt,"
                                      "+avx512f,+avx512vl,+avx512bw,+avx512dq,+avx512cd"})
    child = subprocess.run([sys.executable, "-c", _AVX512_CHILD], env=env, capture_output=True, text=True,
                           timeout=600)
    assert child.returncode == 0, child.stderr[-2000:]
    isa, n_gathers = child.stdout.split()[-2:]
    assert isa == "avx512" and int(n_gathers) >= 8


def test_a_lanes32_file_is_format_1_2_and_decodes_like_rans4():
    """The coder's wiring in the container (issue 19): a lanes32 file says 1.2 and prec 12, decodes
    to the same bits as the rans4 file of the same cache; a lanes32 header that claims 1.1 is refused."""
    import json
    import struct

    from alignpred import FormatError, KvzReader, compress_bytes, fit_bank
    from alignpred.codec import Profile

    c = synthetic_cache(n_layers=2, T=300, d=32)
    bank = fit_bank([c], rank=None)
    a = KvzReader(compress_bytes(c, budget=0.03, bank=bank), bank=bank)
    raw = compress_bytes(c, budget=0.03, bank=bank, profile=Profile(coder="lanes32"))
    b = KvzReader(raw, bank=bank)
    assert a.version == (1, 1) and b.version == (1, 2)
    assert b.header["codec"]["entropy"] == {"coder": "lanes32", "model_set": "kvz-models-v1", "prec": 12}
    da, db = a.read(), b.read()
    assert all(np.array_equal(da[k].view(np.uint8), db[k].view(np.uint8)) for k in da)
    # the same file relabelled 1.1 (preamble minor and header version) is refused
    from alignpred.format import parse_container
    p = parse_container(raw)
    assert p.version == (1, 2)
    bad = bytearray(raw)
    struct.pack_into("<H", bad, 10, 1)
    hdr = json.loads(bytes(raw[p.footer.header_offset:p.footer.header_offset + p.footer.header_length]))
    assert hdr["version"] == [1, 2]
    with pytest.raises(FormatError):
        KvzReader(bytes(bad), bank=bank)


# --- several objects in one call (what the decoder does per tensor) -----------------------
def _objects(widths, C=5, seed=3):
    q = _mixed(np.random.default_rng(seed), C, sum(widths))
    ids = E.choose_models(q)
    cols = np.cumsum([0] + list(widths))
    bufs = [E.encode(np.ascontiguousarray(q[:, a:b]), ids, coder=CODER) for a, b in zip(cols[:-1], cols[1:])]
    return q, ids, bufs


@pytest.mark.parametrize("path", ["simd", "portable"])
@pytest.mark.parametrize("widths", [[256], [256, 256, 97], [31, 1, 64, 33], [0, 40, 0, 7]])
def test_decode_objects_equals_one_decode_per_object(widths, path):
    q, ids, bufs = _objects(widths)
    big = np.full((q.shape[0], q.shape[1] + 9), -7, np.int32)
    out = big[:, 4:4 + q.shape[1]]                    # strided columns of a larger array
    nonzero = [(b, w) for b, w in zip(bufs, widths) if w]
    lanes.decode_objects([b for b, _ in nonzero], ids, q.shape[0], [w for _, w in nonzero], out, path=path)
    np.testing.assert_array_equal(out, q)
    assert (big[:, :4] == -7).all() and (big[:, 4 + q.shape[1]:] == -7).all()
    got = E.decode_objects(bufs, ids, q.shape[0], widths, CODER, np.empty(q.shape, np.int32))
    np.testing.assert_array_equal(got, q)


@pytest.mark.parametrize("path", ["simd", "portable"])
def test_decode_objects_in_lock_step_and_strided_columns(path):
    """Equal-width objects go through the lock-step kernel in groups (a leftover object and other
    widths one at a time); columns of any stride decode the same symbols."""
    widths = [96, 96, 96, 96, 96, 64, 64, 32]
    q, ids, bufs = _objects(widths, C=9, seed=11)
    for out in (np.empty(q.shape, np.int32), np.full((q.shape[0], 2 * q.shape[1]), 5, np.int32)[:, ::2],
                np.full((2 * q.shape[0], q.shape[1] + 3), 5, np.int32)[::2, 3:]):
        lanes.decode_objects(bufs, ids, q.shape[0], widths, out, path=path)
        np.testing.assert_array_equal(out, q)


@pytest.mark.parametrize("path", ["simd", "portable"])
def test_decode_objects_reports_the_first_damaged_object_of_a_group(path):
    """A lane stream damaged inside a group of lock-step objects: the error of that object (the one
    a single decode gives), never another object's, and the first in order when two are damaged."""
    q, ids, bufs = _objects([128] * 4, C=6, seed=5)
    hdr = lanes.header_words(6 * 128) * 2
    for j in (1, 2, 3):
        bad = bytearray(bufs[j])
        bad[hdr + 5] ^= 0x5A                          # inside lane 0's word stream
        damaged = list(bufs)
        damaged[j] = bytes(bad)
        with pytest.raises(FormatError) as one:
            lanes.decode(damaged[j], ids, (6, 128), path=path)
        with pytest.raises(FormatError) as many:
            lanes.decode_objects(damaged, ids, 6, [128] * 4, np.empty(q.shape, np.int32), path=path)
        assert str(many.value) == str(one.value)
    two = list(bufs)
    two[3] = bufs[3][:-2]                              # a tiling error after a stream error
    bad = bytearray(bufs[1])
    bad[hdr + 5] ^= 0x5A
    two[1] = bytes(bad)
    with pytest.raises(FormatError) as first:
        lanes.decode(two[1], ids, (6, 128), path=path)
    with pytest.raises(FormatError) as many:
        lanes.decode_objects(two, ids, 6, [128] * 4, np.empty(q.shape, np.int32), path=path)
    assert str(many.value) == str(first.value)


@pytest.mark.parametrize("path", ["simd", "portable"])
def test_decode_objects_raises_the_error_of_the_damaged_object(path):
    q, ids, bufs = _objects([64, 64, 64])
    for j in range(3):
        for cut in (1, 2, 7):
            damaged = list(bufs)
            damaged[j] = bufs[j][:-cut]
            with pytest.raises(FormatError) as one:
                lanes.decode(damaged[j], ids, (q.shape[0], 64), path=path)
            with pytest.raises(FormatError) as many:
                lanes.decode_objects(damaged, ids, q.shape[0], [64] * 3, np.empty(q.shape, np.int32), path=path)
            assert str(many.value) == str(one.value)
    for bad in (b"", b"\1", bufs[2][:-2]):    # empty, odd length, truncated
        with pytest.raises(FormatError) as one:
            E.decode(bad, ids, (q.shape[0], 64), CODER)
        with pytest.raises(FormatError) as many:
            E.decode_objects([bufs[0], bad], ids, q.shape[0], [64, 64], CODER, np.empty((q.shape[0], 128), np.int32))
        assert str(many.value) == str(one.value)
    with pytest.raises(FormatError, match="non-empty payload"):
        E.decode_objects([bufs[0], b"\0\0"], ids, q.shape[0], [64, 0], CODER, np.empty((q.shape[0], 64), np.int32))
    with pytest.raises(FormatError, match="model id"):
        E.decode_objects(bufs, np.full(q.shape[0], 10**6), q.shape[0], [64] * 3, CODER, np.empty(q.shape, np.int32))
    with pytest.raises(ValueError, match="out must be"):
        lanes.decode_objects(bufs, ids, q.shape[0], [64] * 3, np.empty((q.shape[0], 190), np.int32))


def test_decode_objects_of_other_coders_decode_one_by_one():
    q, ids, _ = _objects([50, 30], C=3)
    bufs = [E.encode(np.ascontiguousarray(q[:, :50]), ids, coder="rans4"),
            E.encode(np.ascontiguousarray(q[:, 50:]), ids, coder="rans4")]
    got = E.decode_objects(bufs, ids, 3, [50, 30], "rans4", np.empty((3, 80), np.int32))
    np.testing.assert_array_equal(got, q)
