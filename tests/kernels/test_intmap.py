"""Exact integer map products (alignpred.kernels.intmap): exactness against int64/float64 references,
overflow bounds with worst-case inputs, determinism across thread settings and processes."""
import hashlib
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from alignpred.kernels import intmap as im

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ref_quantize_rows(x, shift):
    """numpy definition of quantize_rows (float64, exact scalings)."""
    x64 = np.ldexp(x.astype(np.float64), -shift.astype(np.int32)[None, :])
    m = np.abs(x64).max(axis=1, initial=0.0)
    e = np.where(m > 0, np.frexp(m)[1], 0).astype(np.int32) - np.int32(im.BX - 1)
    q = np.clip(np.rint(np.ldexp(x64, -e[:, None])), -im.XQ_MAX, im.XQ_MAX).astype(np.int16)
    pad = np.zeros((x.shape[0], x.shape[1] + (x.shape[1] & 1)), np.int16)
    pad[:, :x.shape[1]] = q
    return pad, e.astype(np.int32)


def _rand_map(rng, S, n, K, m, scale=1.0):
    W = (rng.standard_normal((S * K, m)) * rng.lognormal(0, 1, (S * K, 1))).astype(np.float32)
    xs = [(rng.standard_normal((n, K)) * rng.lognormal(0, 1, (1, K)) * scale).astype(np.float32) for _ in range(S)]
    return W, xs


def test_constants_overflow_proof():
    assert im.K_CHUNK * im.XQ_MAX * im.WQ_MAX <= 2 ** 31 - 1
    assert 2 * im.XQ_MAX * im.WQ_MAX <= 2 ** 31 - 1     # one pmaddwd pair
    assert im.XQ_MAX < 2 ** 15 and im.WQ_MAX < 2 ** 15


def test_quantize_weights_properties():
    rng = np.random.default_rng(0)
    W = (rng.standard_normal((96, 40)) * rng.lognormal(0, 3, (96, 1))).astype(np.float16)
    W[:, 3] = 0
    wq, we, sh = im.quantize_weights(W, n_src=2)
    assert wq.shape == (2, 40, 48) and wq.dtype == np.int16 and we.dtype == np.int32 and sh.shape == (2, 48)
    assert np.abs(wq).max() <= im.WQ_MAX
    assert (wq[:, 3] == 0).all()
    for s in range(2):
        Wp = np.ldexp(W[s * 48:(s + 1) * 48].astype(np.float64), sh[s][:, None])     # equalised
        rec = np.ldexp(wq[s].T.astype(np.float64), we[s][None, :])
        step = np.ldexp(1.0, we[s])[None, :]
        assert (np.abs(rec - Wp) <= step).all()            # half a step (one at a clipped maximum)
        # the column maxima use the top bit
        nz = np.abs(Wp).max(0) > 0
        assert (np.abs(wq[s]).max(1)[nz] >= 2 ** (im.BW - 2)).all()
    # round half to even, and repeatable
    top = 2 ** (im.BW - 2)                       # 1.0 maps to 2**(BW-2): ties at k + 1/2 below
    W2 = np.array([[1.0], [2.5 / top], [3.5 / top], [-2.5 / top], [0.5 / top]], np.float32)
    wq2, we2, _ = im.quantize_weights(W2, shift=np.zeros(5, np.int32))
    assert wq2[0, 0].tolist() == [top, 2, 4, -2, 0] and we2[0, 0] == -(im.BW - 2)
    a = im.quantize_weights(W, 2)
    b = im.quantize_weights(W.copy(), 2)
    assert all((u == v).all() for u, v in zip(a, b))


def _assert_prepared_like_reference(W, n, shift=None):
    wq, we, sh = im.quantize_weights(W, n, shift)
    got = im.prepare_weights(W, n, shift)
    for want, have in zip((im.pack_weights(wq), we, sh), got):
        assert want.shape == have.shape and want.dtype == have.dtype
        assert np.array_equal(want, have)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_prepare_weights_matches_numpy_definition(dtype):
    """The compiled one-pass weight preparation gives the integers of channel_shifts +
    quantize_weights + pack_weights (their numpy code is the definition), with and without
    given shifts, over odd sizes and a wide range of row scales."""
    rng = np.random.default_rng(3)
    for n in (1, 2, 3):
        for K, m in ((5, 3), (6, 17), (33, 48), (64, 32)):
            with np.errstate(over="ignore"):
                W = (rng.standard_normal((n * K, m)) * np.exp(rng.uniform(-20, 20, (n * K, 1)))).astype(dtype)
            _assert_prepared_like_reference(W, n)
            _assert_prepared_like_reference(W, n, rng.integers(-im.SHIFT_MAX, im.SHIFT_MAX + 1, (n, K)))


def test_prepare_weights_degenerate_inputs():
    rng = np.random.default_rng(4)
    _assert_prepared_like_reference(np.zeros((8, 16)), 2)
    W = rng.standard_normal((8, 16))
    W[1, 3], W[5, 5] = np.nan, -np.inf
    W[2, :] = np.inf
    _assert_prepared_like_reference(W, 2)
    _assert_prepared_like_reference(W.astype(np.float32), 1)
    _assert_prepared_like_reference(rng.standard_normal((8, 16)) * 1e-310, 2)   # subnormal weights
    W = rng.standard_normal((8, 16)) * 1e300
    W[0, 0] = 1e-300
    _assert_prepared_like_reference(W, 1)
    W = rng.standard_normal((8, 16))
    W[:, 4] *= 1e-320                                  # a column whose scale 2**-e is not a float64
    _assert_prepared_like_reference(W, 1)
    with pytest.raises(ValueError):
        im.prepare_weights(np.zeros((5, 4), np.float32), 2)


def test_prepare_weights_on_the_bundled_bank():
    """Every map of the bundled bank prepares to the reference integers."""
    from alignpred import Bank

    bank = Bank.load(os.path.join(ROOT, "alignpred", "bank", "data", "gemma-3-270m.h5"))
    n = 0
    for name in bank.config["sources"]:
        f = bank.map_factors(name)
        if f is not None and f[1] is None:
            _assert_prepared_like_reference(f[0], len(bank.sources(name)))
            n += 1
    assert n >= 30


def test_channel_shifts_balance_rows():
    W = np.ones((4, 3), np.float32) * np.array([[1.0], [1 / 64], [8.0], [0.0]], np.float32)
    assert im.channel_shifts(W).tolist() == [[0, 6, -3, 0]]


@pytest.mark.parametrize("n,d", [(1, 1), (3, 5), (17, 64), (256, 256), (9, 300)])
def test_quantize_rows_matches_reference(n, d):
    rng = np.random.default_rng(n * 1000 + d)
    x = (rng.standard_normal((n, d)) * rng.lognormal(0, 3, (n, 1))).astype(np.float32)
    if n > 2:
        x[1] = 0.0
        x[2] *= np.float32(1e-38)     # tiny rows: the float64 path
    sh = rng.integers(-6, 7, d).astype(np.int32)
    for shift in (np.zeros(d, np.int32), sh):
        xq, xe = im.quantize_rows(x, shift)
        rq, re_ = _ref_quantize_rows(x, shift)
        assert (xq == rq).all() and (xe == re_).all()
        assert np.abs(xq).max() <= im.XQ_MAX


def test_quantize_rows_nonfinite_is_defined():
    x = np.array([[np.inf, 1.0, -2.0], [np.nan, 0.5, 0.0], [1e30, -1e30, 3.0]], np.float32)
    a = im.quantize_rows(x)
    b = im.quantize_rows(x.copy())
    assert (a[0] == b[0]).all() and (a[1] == b[1]).all()
    assert np.abs(a[0]).max() <= im.XQ_MAX


@pytest.mark.parametrize("S,n,K,m", [(3, 256, 256, 256), (2, 37, 64, 64), (1, 1, 5, 16), (2, 9, 300, 48),
                                     (3, 17, 7, 3), (2, 19, 128, 40), (1, 8, 2, 32)])
def test_map_predict_exact(S, n, K, m):
    rng = np.random.default_rng(S * 7 + n + K + m)
    W, xs = _rand_map(rng, S, n, K, m)
    M = im.IntMap(W, S)
    xq, xe = M.quantize(xs)
    wq, we, _ = im.quantize_weights(W, S)
    ref = im.reference_predict(xq, xe, wq, we)
    out = M.predict(xs)
    assert out.dtype == np.float32 and out.shape == (n, m)
    assert (out.view(np.uint32) == ref.view(np.uint32)).all()
    # into a row slice of a larger [heads, T, d] array, and into a column-strided view
    big = np.full((3, n + 5, m), np.nan, np.float32)
    M.predict(xs, out=big[1, 2:2 + n])
    assert (big[1, 2:2 + n].view(np.uint32) == ref.view(np.uint32)).all()
    assert np.isnan(big[1, :2]).all() and np.isnan(big[0]).all()
    wide = np.zeros((n, 2 * m), np.float32)
    M.predict(xs, out=wide[:, ::2])
    assert (wide[:, ::2].view(np.uint32) == ref.view(np.uint32)).all()
    # close to the float64 product
    exact = sum(x.astype(np.float64) @ W[s * K:(s + 1) * K].astype(np.float64) for s, x in enumerate(xs))
    rel = np.sqrt(np.mean((out - exact) ** 2) / np.mean(exact ** 2))
    assert rel < 2e-3


def test_rows_are_independent():
    """Per-row scales: any split of the rows gives the same bits (range decoding)."""
    rng = np.random.default_rng(5)
    W, xs = _rand_map(rng, 2, 300, 64, 64)
    M = im.IntMap(W, 2)
    full = M.predict(xs)
    parts = np.concatenate([M.predict([x[a:b] for x in xs]) for a, b in ((0, 1), (1, 77), (77, 256), (256, 300))])
    assert (full.view(np.uint32) == parts.view(np.uint32)).all()


@pytest.mark.parametrize("K", [64, 512, 1024])
def test_overflow_worst_case(K):
    """All products at +-XQ_MAX * WQ_MAX: the int32 sum of one row would overflow without the
    chunked widening; the result must equal the int64 reference."""
    S, n, m = 2, 10, 48
    xq = np.full((S, n, K), im.XQ_MAX, np.int16)
    xq[:, 1::2] = -im.XQ_MAX
    xq[:, 2, ::2] = im.XQ_MAX
    xq[:, 2, 1::2] = -im.XQ_MAX
    wq = np.full((S, m, K), im.WQ_MAX, np.int16)
    wq[:, 1::3] = -im.WQ_MAX
    xe = np.zeros((S, n), np.int32)
    xe[1] = 7
    we = np.zeros((S, m), np.int32)
    we[:, 5] = -3
    out = im.map_predict(xq, xe, im.pack_weights(wq), we)
    ref = im.reference_predict(xq, xe, wq, we)
    assert (out.view(np.uint32) == ref.view(np.uint32)).all()
    top = K * im.XQ_MAX * im.WQ_MAX
    assert float(np.abs(out).max()) == float(np.float32(2.0 ** 7 * top + top))
    if K >= 128:
        assert K * im.XQ_MAX * im.WQ_MAX > 2 ** 31   # the test does exercise the widening


def test_all_zero_and_zero_sources():
    M = im.IntMap(np.zeros((64, 32), np.float16), 2)
    out = M.predict([np.zeros((5, 32), np.float32)] * 2)
    assert (out == 0).all() and not np.signbit(out).any()


def _hash_case():
    rng = np.random.default_rng(1234)
    W, xs = _rand_map(rng, 3, 200, 256, 256)
    out = im.IntMap(W.astype(np.float16), 3).predict(xs)
    return hashlib.sha256(out.tobytes()).hexdigest()


def test_threads_give_same_bits():
    h0 = _hash_case()
    res = []
    ts = [threading.Thread(target=lambda: res.append(_hash_case())) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert res == [h0] * 3


@pytest.mark.slow  # subprocesses that compile the kernels cold (~20 s CPU); CI's slow pass runs it
def test_same_bits_in_other_processes(tmp_path):
    """Fresh processes give the same bits (also for the fused post-processing kernel): one with
    NUMBA_NUM_THREADS / OPENBLAS_NUM_THREADS = 2, and one compiled for the generic x86-64 target
    (SSE2 only: ``pmaddwd`` on xmm instead of ``vpdpwssd``) with the thread counts at 1."""
    code = ("import json, sys; sys.path.insert(0, {!r}); import test_intmap as t, test_fused as f; "
            "print(json.dumps([t._hash_case(), f._hash_case()]))".format(os.path.join(ROOT, "tests", "kernels")))
    from test_fused import _hash_case as fused_hash

    here = [_hash_case(), fused_hash()]
    for threads, extra in (("2", {}), ("1", {"NUMBA_CPU_NAME": "generic", "NUMBA_CACHE_DIR": str(tmp_path)})):
        env = dict(os.environ, NUMBA_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads,
                   **extra)
        r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.strip().splitlines()[-1]) == here


def test_real_map_precision():
    """On a real Gemma 3 map (K.5.0, two sources): the integer rounding noise is a small
    fraction of the quantisation noise at eps = 0.0267 (Delta / sqrt(12) = eps * rms(x))."""
    path = os.path.join(ROOT, "samples", "gemma3-270m")
    from alignpred import Bank, load_cache
    from alignpred.bank.calibrate import block_samples

    bank = Bank.load(os.path.join(ROOT, "alignpred", "bank", "data", "gemma-3-270m.h5"))  # the bundled bank
    cache = load_cache(os.path.join(path, "english-prose.safetensors"))
    blk = "K.5.0"
    W, _ = bank.map_factors(blk)
    srcs = bank.sources(blk)
    xs = [np.ascontiguousarray(block_samples(cache, s)[:256] - bank.mean(s), np.float32) for s in srcs]
    y = im.IntMap(W, len(srcs)).predict(xs)
    d = W.shape[0] // len(srcs)
    ref = sum(x.astype(np.float64) @ W[k * d:(k + 1) * d].astype(np.float64) for k, x in enumerate(xs))
    noise = 0.0267 * np.sqrt(np.mean(block_samples(cache, blk).astype(np.float64) ** 2))
    rel = np.sqrt(np.mean((y - ref) ** 2)) / noise
    assert rel < 0.05


def test_single_accumulator_bound():
    """Rows at the run-time bound (sum |xq| = L1_ONE_CHUNK, one int32 accumulator per source)
    and just above it (chunked), with all weights at +WQ_MAX: the exact sums reach 2**31 - 128."""
    K, m = 256, 32
    L = im.L1_ONE_CHUNK
    rows = []
    for total in (L, L + 1, L - 7):
        r = np.zeros(K, np.int64)
        r[:total // im.XQ_MAX] = im.XQ_MAX
        r[total // im.XQ_MAX] = total % im.XQ_MAX
        assert np.abs(r).sum() == total
        rows.append(r)
    xq = np.array(rows * 3, np.int16)[None]                       # 9 rows: a full block + a tail
    wq = np.full((1, m, K), im.WQ_MAX, np.int16)
    xe = np.zeros((1, 9), np.int32)
    we = np.zeros((1, m), np.int32)
    out = im.map_predict(xq, xe, im.pack_weights(wq), we)
    ref = im.reference_predict(xq, xe, wq, we)
    assert (out.view(np.uint32) == ref.view(np.uint32)).all()
    assert float(ref[0, 0]) == float(np.float32(L * im.WQ_MAX)) and L * im.WQ_MAX < 2 ** 31
    assert (L + 1) * im.WQ_MAX >= 2 ** 31


@pytest.mark.parametrize("n", [1, 63, 128, 257, 1000])
def test_rows_split_over_threads_give_the_same_bits(n):
    """split_rows: one object's map products on several threads (issue 19, point 3), same bits
    for any split, including ranges too short to split and row counts not divisible by it."""
    from alignpred.kernels.intmap import SPLIT_MIN_ROWS
    from alignpred.threads import row_threads, split_rows

    rng = np.random.default_rng(n)
    W = (rng.standard_normal((2 * 96, 48)) * 0.1).astype(np.float32)
    m = im.IntMap(W, 2)
    srcs = [rng.standard_normal((n, 96)).astype(np.float32) * s for s in (1.0, 30.0)]
    want = m.predict(srcs)
    for k in (2, 3, 4):
        with split_rows(k):
            assert row_threads() == k
            got = m.predict(srcs)
            out = np.full((n, 48), np.nan, np.float32)
            m.predict(srcs, out=out)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (n, k)
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), (n, k)
    assert row_threads() == 1
    assert SPLIT_MIN_ROWS >= 8  # a hand-off per part must be worth it


@pytest.mark.parametrize("m", [16, 48, 64, 40])
def test_panel_layout_gives_the_same_bits(m):
    """:class:`IntMap` keeps its weights in 32-column panels (:func:`block_weights`); the kernel
    gives the same bits from either layout, on the one-accumulator and the chunked paths."""
    rng = np.random.default_rng(m)
    S, n, K = 2, 21, 300
    wq = rng.integers(-im.WQ_MAX, im.WQ_MAX + 1, (S, m, K)).astype(np.int16)
    wp = im.pack_weights(wq)
    wb = im.block_weights(wp)
    assert wb.shape == (S, -(-m // 32), (K + 1) // 2, 32, 2)
    assert (im.unblock_weights(wb, m) == wp).all()
    we = rng.integers(-20, 0, (S, m)).astype(np.int32)
    for big in (False, True):    # big: every row's sum |xq| above L1_ONE_CHUNK (the chunked path)
        lim = im.XQ_MAX if big else 300
        xq = rng.integers(-lim, lim + 1, (S, n, 2 * wp.shape[1])).astype(np.int16)
        xe = rng.integers(-20, 0, (S, n)).astype(np.int32)
        ref = im.reference_predict(xq, xe, wq, we)
        for w in (wp, wb):
            out = im.map_predict(xq, xe, w, we)
            assert (out.view(np.uint32) == ref.view(np.uint32)).all()
    with pytest.raises(ValueError, match="inconsistent"):
        im.map_predict(xq, xe, wb[:, :, :-1].copy(), we)


def test_panels_start_on_a_cache_line():
    for m in (16, 256):
        wb = im.block_weights(im.pack_weights(np.ones((3, m, 256), np.int16)))
        assert wb.ctypes.data % 64 == 0 and wb.flags.c_contiguous and (wb.reshape(-1)[:8] == 1).all()


def test_long_ranges_skip_the_thread_scratch_and_agree():
    """Sources too long for the per-thread scratch of quantised rows (over 16 MiB) get their own
    buffer; rows are independent, so the whole range equals its halves (which use the scratch)."""
    rng = np.random.default_rng(7)
    S, d_in, d_out = 3, 64, 16
    n = im._XQ_KEEP // (S * d_in) + 100
    m = im.IntMap((rng.standard_normal((S * d_in, d_out)) * 0.1).astype(np.float32), S)
    srcs = [rng.standard_normal((n, d_in)).astype(np.float32) for _ in range(S)]
    whole = m.predict(srcs)
    h = n // 2
    halves = np.concatenate([m.predict([x[:h] for x in srcs]), m.predict([x[h:] for x in srcs])])
    np.testing.assert_array_equal(whole.view(np.int32), halves.view(np.int32))
