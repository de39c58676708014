"""Tests of the entropy-coding stage: alignpred.entropy / alignpred.entropy.rans / alignpred.entropy.models."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignpred import entropy as E
from alignpred.entropy import models as tables
from alignpred.entropy import rans
from alignpred.errors import EncodeError, FormatError

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
HSET = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def _mixed(rng, C, N):
    """Channels of very different statistics, including int32 extremes."""
    q = np.empty((C, N), np.int32)
    for c in range(C):
        kind = c % 5
        s = float(np.exp(rng.uniform(np.log(0.05), np.log(3000.0))))
        if kind == 0:
            x = rng.laplace(0, s, N)
        elif kind == 1:
            x = rng.normal(0.3 * s, s, N)
        elif kind == 2:
            x = s * rng.standard_t(3, N)
        elif kind == 3:
            x = np.zeros(N)
        else:
            x = rng.integers(I32_MIN, I32_MAX, N, endpoint=True).astype(np.float64)
        q[c] = np.clip(np.rint(x), I32_MIN, I32_MAX).astype(np.int32)
    return q


def _roundtrip(q, ids, coder="rans4"):
    buf = E.encode(q, ids, coder=coder)
    assert isinstance(buf, bytes)
    out = E.decode(buf, ids, q.shape, coder=coder)
    assert out.dtype == np.int32 and out.shape == q.shape
    np.testing.assert_array_equal(out, q)
    return buf


# --- tables ------------------------------------------------------------------------------

def test_tables_valid_and_pinned():
    t = tables.load()
    assert E.MODEL_SET_ID == "kvz-models-v1"
    assert E.PREC == rans.PREC == 15
    assert 100 <= E.N_MODELS <= 256
    assert t.freq.shape == (E.N_MODELS, E.N_TOKENS) == (E.N_MODELS, 128)
    assert np.all(t.freq.sum(axis=1) == 1 << E.PREC)
    assert t.freq.min() >= 1
    digest = hashlib.sha256(tables.canonical_bytes(t.freq, t.cost_fx)).hexdigest()
    assert digest == tables.TABLES_SHA256
    # derived decoder tables are consistent
    for m in (0, 1, E.N_MODELS // 2, E.N_MODELS - 1):
        np.testing.assert_array_equal(np.bincount(t.slot2tok[m], minlength=128), t.freq[m])
        np.testing.assert_array_equal(t.coarse[m], t.slot2tok[m, ::1 << rans.COARSE_SHIFT])
    assert not t.freq.flags.writeable
    # model 0 is the all-zero model
    assert t.freq[0, 0] == (1 << E.PREC) - 127
    with np.load(tables.TABLE_PATH, allow_pickle=False) as z:
        assert str(z["set_id"]) == E.MODEL_SET_ID
    assert tables.TABLE_PATH.stat().st_size < 300_000


def test_token_mapping_extremes():
    vals = np.array([0, -1, 1, 7, -8, 8, -9, 1000, -1000, 2**30, -(2**30), I32_MAX, I32_MIN],
                    np.int32)
    toks, nbs = rans.tokenize_array(vals)
    assert toks.max() < 128
    assert toks[0] == 0 and toks[1] == 1 and toks[2] == 2 and toks[3] == 14 and toks[4] == 15
    assert nbs[-1] == 29 and nbs[-2] == 29 and nbs[:5].max() == 0
    # intervals of the generator agree with the tokenizer
    lo, hi = tables.token_intervals()
    assert np.all(toks == [np.flatnonzero((lo <= v) & (v <= hi))[0] for v in vals.tolist()])
    assert lo.min() == I32_MIN and hi.max() == I32_MAX


# --- round trips ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (3, 1), (5, 4), (7, 255), (16, 256), (2, 3)])
def test_roundtrip_shapes(shape):
    rng = np.random.default_rng(hash(shape) % 2**32)
    q = _mixed(rng, *shape)
    ids = E.choose_models(q)
    _roundtrip(q, ids)
    _roundtrip(q, ids, coder="constriction")


def test_roundtrip_zeros_and_extremes():
    q = np.zeros((8, 256), np.int32)
    buf = _roundtrip(q, E.choose_models(q))
    assert len(buf) <= 32 + 8          # states + at most a word or two
    q[3, ::2] = I32_MIN
    q[5, 1::3] = I32_MAX
    q[6] = np.arange(256) * 8_388_607 - 2**30
    _roundtrip(q, E.choose_models(q))
    _roundtrip(q, np.zeros(8, np.uint8))
    _roundtrip(q, np.zeros(8, np.uint8), coder="constriction")


def test_roundtrip_every_model_id():
    rng = np.random.default_rng(7)
    M = E.N_MODELS
    q = _mixed(rng, M, 12)
    q[:, 0] = I32_MIN
    q[:, 1] = I32_MAX
    ids = np.arange(M, dtype=np.uint16)       # ids may come as uint16 too
    _roundtrip(q, ids)
    _roundtrip(q, ids, coder="constriction")
    _roundtrip(q[:, :7], ids)                 # general (N % 4 != 0) path


def test_empty_object():
    for shape in [(0, 5), (4, 0), (0, 0)]:
        q = np.zeros(shape, np.int32)
        ids = np.zeros(shape[0], np.uint8)
        assert E.encode(q, ids) == b""
        assert E.decode(b"", ids, shape).shape == shape
        with pytest.raises(FormatError):
            E.decode(b"\0\0\0\0", ids, shape)


def test_payload_is_shape_independent_and_paths_agree():
    # with one model for every channel, the symbol stream is the same for any C x N split:
    # the N % 4 == 0 lock-step decoder and the general decoder must agree bit for bit
    rng = np.random.default_rng(3)
    flat = np.rint(rng.laplace(0, 40, 240)).astype(np.int32)
    bufs = set()
    for shape in [(1, 240), (3, 80), (4, 60), (5, 48), (16, 15), (240, 1), (80, 3)]:
        ids = np.full(shape[0], 77, np.uint8)
        bufs.add(_roundtrip(flat.reshape(shape), ids))
    assert len(bufs) == 1


@HSET
@given(C=st.integers(1, 6), N=st.integers(1, 40), seed=st.integers(0, 2**32 - 1),
       coder=st.sampled_from(E.CODERS))
def test_roundtrip_hypothesis(C, N, seed, coder):
    rng = np.random.default_rng(seed)
    q = _mixed(rng, C, N)
    ids = rng.integers(0, E.N_MODELS, C) if seed % 2 else E.choose_models(q)
    _roundtrip(q, ids, coder=coder)


def test_input_types():
    q = np.array([[1, -2, 300]], np.int64)
    ids = [4]
    buf = E.encode(q, ids)
    np.testing.assert_array_equal(E.decode(memoryview(buf), ids, (1, 3)), q)
    np.testing.assert_array_equal(E.decode(np.frombuffer(buf, np.uint8), ids, (1, 3)), q)
    np.testing.assert_array_equal(E.decode(bytearray(buf), np.array(ids), [1, 3]), q)


# --- exact bytes -----------------------------------------------------------------------------

PIN_Q = np.array([[0, 1, -1, 7, -8, 16, -17, 1000],
                  [I32_MAX, I32_MIN, 3, 0, 0, 0, 5, -5],
                  [0, 0, 0, 0, 0, 0, 0, 1]], np.int32)
PIN_IDS = np.array([1, 120, 0], np.uint8)
PIN_HEX = ("bd04e1ac019a5a6bb0ee242801000000a4596ba243b022008e7fd5ff6659b31294ffffff"
           "867fc5bf192038d3ff000000ffffffff00faffff")
PIN_HEX_N5 = ("ce833c2de0d500005c69edfcfd4d020099d924890ec18a008e7fc3ff20bf3f40ffffff03"
              "ffffffff")


def test_pinned_bytes():
    assert E.encode(PIN_Q, PIN_IDS).hex() == PIN_HEX
    assert E.encode(PIN_Q[:, :5], PIN_IDS).hex() == PIN_HEX_N5
    np.testing.assert_array_equal(E.decode(bytes.fromhex(PIN_HEX), PIN_IDS, (3, 8)), PIN_Q)
    np.testing.assert_array_equal(E.decode(bytes.fromhex(PIN_HEX_N5), PIN_IDS, (3, 5)),
                                  PIN_Q[:, :5])


# --- corrupt input ---------------------------------------------------------------------------

def _object(seed=11, C=6, N=32):
    rng = np.random.default_rng(seed)
    q = _mixed(rng, C, N)
    ids = E.choose_models(q)
    return q, ids


@pytest.mark.parametrize("coder", E.CODERS)
def test_truncation_and_extension_raise(coder):
    q, ids = _object()
    buf = E.encode(q, ids, coder=coder)
    for cut in range(1, len(buf) + 1):
        with pytest.raises(FormatError):
            E.decode(buf[:-cut], ids, q.shape, coder=coder)
    for extra in (b"\0", b"\0\0\0\0", b"\1\0\0\0", b"\0" * 8):
        with pytest.raises(FormatError):
            E.decode(buf + extra, ids, q.shape, coder=coder)
    with pytest.raises(FormatError):
        E.decode(buf, ids, (q.shape[0], q.shape[1] + 1), coder=coder)


def test_bad_state_and_final_state_raise():
    q, ids = _object()
    buf = bytearray(E.encode(q, ids))
    bad = bytearray(buf)
    bad[4:8] = b"\0\0\0\0"            # lane-0 state < 2**32
    with pytest.raises(FormatError, match="state"):
        E.decode(bytes(bad), ids, q.shape)
    with pytest.raises(FormatError):
        E.decode(b"\0" * 32, ids, q.shape)
    with pytest.raises(FormatError):
        E.decode(b"\xff" * 64, ids, q.shape)


@HSET
@given(data=st.data(), coder=st.sampled_from(E.CODERS))
def test_random_corruption_never_crashes(data, coder):
    q, ids = _object(seed=data.draw(st.integers(0, 50)), C=4, N=data.draw(st.sampled_from([8, 13])))
    buf = bytearray(E.encode(q, ids, coder=coder))
    n_flips = data.draw(st.integers(1, 4))
    for _ in range(n_flips):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, 8))
    payload = bytes(buf[:len(buf) - cut])
    try:
        out = E.decode(payload, ids, q.shape, coder=coder)
    except FormatError:
        return
    # a flip inside the raw-bit region can give another valid payload; it must still be sane
    assert cut == 0 and out.shape == q.shape and out.dtype == np.int32


@HSET
@given(blob=st.binary(min_size=0, max_size=200), N=st.integers(1, 20),
       coder=st.sampled_from(E.CODERS))
def test_garbage_never_crashes(blob, N, coder):
    ids = np.array([0, 100, 239], np.uint8)
    try:
        out = E.decode(blob, ids, (3, N), coder=coder)
    except FormatError:
        return
    assert out.shape == (3, N)


def test_bad_arguments():
    q, ids = _object()
    with pytest.raises(EncodeError):
        E.encode(q, ids[:-1])
    with pytest.raises(EncodeError):
        E.encode(q, np.full(q.shape[0], E.N_MODELS))
    with pytest.raises(EncodeError):
        E.encode(q.astype(np.int64) * 2**32, ids)
    with pytest.raises(EncodeError):
        E.encode(q.astype(np.float32), ids)
    with pytest.raises(EncodeError):
        E.encode(q, ids, coder="zstd")
    buf = E.encode(q, ids)
    with pytest.raises(FormatError):
        E.decode(buf, np.full(q.shape[0], 255), q.shape)
    with pytest.raises(FormatError):
        E.decode(buf, ids, (q.shape[0] + 1, q.shape[1]))
    with pytest.raises(FormatError):
        E.decode(buf, ids, (-1, 3))
    with pytest.raises(FormatError):
        E.decode(buf, ids, q.shape, coder="nope")
    with pytest.raises(FormatError, match="too short"):   # no giant allocation
        E.decode(buf, np.zeros(1 << 16, np.uint8), (1 << 16, 1 << 15))


# --- compression -----------------------------------------------------------------------------

def _plugin_entropy(a):
    _, counts = np.unique(a, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


@pytest.mark.parametrize("dist,scale", [("laplace", 0.5), ("laplace", 4.0), ("gauss", 1.0),
                                        ("gauss", 12.0), ("t3", 2.0), ("t3", 0.3)])
def test_compression_close_to_entropy(dist, scale):
    rng = np.random.default_rng(2024)
    shape = (64, 256)
    x = {"laplace": lambda: rng.laplace(0, scale, shape),
         "gauss": lambda: rng.normal(0, scale, shape),
         "t3": lambda: scale * rng.standard_t(3, shape)}[dist]()
    q = np.rint(x).astype(np.int32)
    ids = E.choose_models(q)
    h = _plugin_entropy(q)                       # pooled over 16384 symbols: small bias here
    n = q.size
    bits = 8 * len(E.encode(q, ids)) / n
    est = E.estimate_bits(q, ids).sum() / n
    assert bits <= h * 1.025 + 0.03, (bits, h)
    assert abs(bits - (est + 256 / n)) < 0.01    # estimate is the payload less the states
    cbits = 8 * len(E.encode(q, ids, coder="constriction")) / n
    assert cbits <= h * 1.025 + 0.03


def test_near_zero_channels_are_cheap():
    rng = np.random.default_rng(5)
    q = np.rint(rng.laplace(0, 0.05, (256, 256))).astype(np.int32)
    ids = E.choose_models(q)
    assert 8 * len(E.encode(q, ids)) / q.size < 0.012


def test_choose_models_is_argmin_and_deterministic():
    rng = np.random.default_rng(9)
    q = _mixed(rng, 20, 64)
    ids = E.choose_models(q)
    assert ids.dtype == np.uint8 and ids.shape == (20,)
    best = E.estimate_bits(q, ids)
    for m in rng.integers(0, E.N_MODELS, 10):
        assert np.all(best <= E.estimate_bits(q, np.full(20, m)) + 1e-9)
    np.testing.assert_array_equal(ids, E.choose_models(q.copy()))
    # histograms of a tensor's objects add up
    h1, r1 = E.histogram(q[:, :30])
    h2, r2 = E.histogram(q[:, 30:])
    h, r = E.histogram(q)
    np.testing.assert_array_equal(h, h1 + h2)
    np.testing.assert_array_equal(r, r1 + r2)


@pytest.mark.parametrize("coder", ["rans4", "constriction"])
def test_decode_into_a_column_slice(coder):
    """decode(out=) writes a strided view (an object's columns of a tensor's symbol array) with
    the values decode() returns, and leaves the other columns alone."""
    rng = np.random.default_rng(7)
    q = rng.integers(-40, 40, (6, 12)).astype(np.int32)
    ids = rng.integers(0, E.N_MODELS, 6).astype(np.uint8)
    buf = E.encode(q, ids, coder)
    big = np.full((6, 30), -7, np.int32)
    got = E.decode(buf, ids, (6, 12), coder, out=big[:, 9:21])
    assert np.array_equal(got, q) and np.array_equal(big[:, 9:21], q)
    assert (big[:, :9] == -7).all() and (big[:, 21:] == -7).all()
    with pytest.raises(ValueError):
        E.decode(buf, ids, (6, 12), coder, out=np.empty((6, 11), np.int32))
