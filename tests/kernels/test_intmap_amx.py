"""The AMX map kernel (alignpred.kernels.intmap_amx): the same bits as the vector kernel and the
int64 reference on every shape and at the integer bounds, its weight layout, the ``KVZ_AMX``
switch, and threads.  The kernel tests skip on CPUs (or kernels) without AMX; the layout and switch
tests run everywhere."""
import os
import threading

import numpy as np
import pytest

from alignpred.kernels import intmap as im
from alignpred.kernels import intmap_amx as ax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _amx_or_skip():
    if os.environ.get("KVZ_AMX") == "0" or not ax.amx_enabled():
        pytest.skip("this CPU / kernel / numba target has no AMX (or KVZ_AMX=0): the vector kernel runs")


def _both(xq, xe, wq, we):
    """(AMX, vector, reference) predictions of one problem, as uint32 bit patterns."""
    wp = im.pack_weights(wq)
    amx = ax.amx_weights(wq.transpose(0, 2, 1))
    a = im.map_predict(xq, xe, wp, we, amx=amx)
    v = im.map_predict(xq, xe, wp, we)
    r = im.reference_predict(xq, xe, wq, we)
    return a.view(np.uint32), v.view(np.uint32), r.view(np.uint32)


def test_weight_layout_reassembles():
    """``256 wh + wl`` at AMX's B positions is the integer weight; the padding is zero."""
    rng = np.random.default_rng(0)
    S, K, m = 2, 70, 20
    wq = rng.integers(-im.WQ_MAX, im.WQ_MAX + 1, (S, K, m)).astype(np.int16)
    wh, wl = ax.amx_weights(wq)
    assert wh.dtype == np.int8 and wl.dtype == np.uint8 and wh.shape == wl.shape == (S, 2, 32, 64)
    assert wh.ctypes.data % 64 == 0 and wl.ctypes.data % 64 == 0
    w = 256 * wh.astype(np.int32) + wl                                  # [S, group, k4, 4n + i]
    full = w.reshape(S, 2, 32, 16, 4).transpose(0, 2, 4, 1, 3).reshape(S, 128, 32)
    assert (full[:, :K, :m] == wq).all()
    assert not full[:, K:].any() and not full[:, :, m:].any()
    # the same from the vector kernel's panels
    panels = im.block_weights(im.pack_weights(wq.transpose(0, 2, 1)))
    wh2, wl2 = ax.amx_from_panels(panels, m)
    assert (wh2[:, :, :wh.shape[2]] == wh).all() and (wl2[:, :, :wl.shape[2]] == wl).all()
    assert not wh2[:, :, wh.shape[2]:].any() and not wl2[:, :, wl.shape[2]:].any()


def test_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("KVZ_AMX", "0")
    assert not ax.amx_enabled()
    M = im.IntMap(np.ones((32, 16), np.float32), 1)
    assert M.amx is None


@pytest.mark.parametrize("S,n,K,m", [(3, 448, 256, 256), (3, 256, 256, 256), (2, 37, 64, 64), (1, 1, 5, 16),
                                     (2, 9, 300, 48), (3, 17, 7, 3), (2, 19, 128, 40), (1, 8, 2, 32),
                                     (1, 31, 512, 512), (2, 16, 130, 17)])
def test_same_bits_as_the_vector_kernel(S, n, K, m):
    _amx_or_skip()
    rng = np.random.default_rng(S * 131 + n + K + m)
    wq = rng.integers(-im.WQ_MAX, im.WQ_MAX + 1, (S, m, K)).astype(np.int16)
    xq = np.zeros((S, n, K + (K & 1)), np.int16)
    xq[..., :K] = rng.integers(-im.XQ_MAX, im.XQ_MAX + 1, (S, n, K))
    xe = rng.integers(-30, 5, (S, n)).astype(np.int32)
    we = rng.integers(-30, 5, (S, m)).astype(np.int32)
    a, v, r = _both(xq, xe, wq, we)
    assert (a == r).all() and (v == r).all()


@pytest.mark.parametrize("K", [64, 1024, 4096])
def test_integer_bounds(K):
    """Every product at +-XQ_MAX * WQ_MAX (the byte planes at their extremes: high bytes -32 / 31
    and -16 / 15, low bytes 0 / 255): the three int32 tiles stay exact and the combined sums are
    the int64 reference's."""
    _amx_or_skip()
    S, n, m = 2, 20, 48
    xq = np.full((S, n, K), im.XQ_MAX, np.int16)
    xq[:, 1::2] = -im.XQ_MAX
    xq[:, 2, ::2] = im.XQ_MAX
    xq[:, 2, 1::2] = -im.XQ_MAX
    xq[:, 3] = -256                                   # high byte -1, low byte 0
    xq[:, 4] = 255
    wq = np.full((S, m, K), im.WQ_MAX, np.int16)
    wq[:, 1::3] = -im.WQ_MAX
    wq[:, 2::3] = -1                                  # high byte -1, low byte 255
    xe = np.zeros((S, n), np.int32)
    xe[1] = 7
    we = np.zeros((S, m), np.int32)
    we[:, 5] = -3
    a, v, r = _both(xq, xe, wq, we)
    assert (a == r).all() and (v == r).all()
    assert K * 65025 < 2 ** 31                       # the low-byte tile's bound
    if K >= 128:
        assert K * im.XQ_MAX * im.WQ_MAX > 2 ** 31   # one int32 sum of whole products would overflow


def test_intmap_same_bits_with_and_without_amx(monkeypatch):
    """:meth:`IntMap.predict` on a real Gemma 3 map (bundled bank, real cache rows) with AMX on and
    off, whole and split over threads (``split_rows``)."""
    _amx_or_skip()
    from alignpred import Bank, load_cache
    from alignpred.bank.calibrate import block_samples
    from alignpred.threads import split_rows

    bank = Bank.load(os.path.join(ROOT, "alignpred", "bank", "data", "gemma-3-270m.h5"))
    cache = load_cache(os.path.join(ROOT, "samples", "gemma3-270m", "english-prose.safetensors"))
    blk = "V.7.0"
    W, _ = bank.map_factors(blk)
    srcs = bank.sources(blk)
    xs = [np.ascontiguousarray(block_samples(cache, s)[:300] - bank.mean(s), np.float32) for s in srcs]
    M = im.IntMap(W, len(srcs))
    assert M.amx is not None
    on = M.predict(xs)
    with split_rows(2):
        on2 = M.predict(xs)
    monkeypatch.setenv("KVZ_AMX", "0")
    assert M.amx is None
    off = M.predict(xs)
    xq, xe = M.quantize(xs)
    wq, we, _ = im.quantize_weights(W, len(srcs))
    ref = im.reference_predict(xq, xe, wq, we).view(np.uint32)
    for y in (on, on2, off):
        assert (y.view(np.uint32) == ref).all()


def test_threads_each_configure_their_tiles():
    """Tile configuration is per thread: the kernel run in several threads at once gives the same bits."""
    _amx_or_skip()
    rng = np.random.default_rng(9)
    S, n, K, m = 3, 200, 256, 256
    wq = rng.integers(-im.WQ_MAX, im.WQ_MAX + 1, (S, m, K)).astype(np.int16)
    xq = rng.integers(-im.XQ_MAX, im.XQ_MAX + 1, (S, n, K)).astype(np.int16)
    xe = np.zeros((S, n), np.int32)
    we = np.zeros((S, m), np.int32)
    wp, amx = im.pack_weights(wq), ax.amx_weights(wq.transpose(0, 2, 1))
    want = im.reference_predict(xq, xe, wq, we).view(np.uint32)
    got = []

    def run():
        for _ in range(5):
            got.append(im.map_predict(xq, xe, wp, we, amx=amx).view(np.uint32).copy())

    ts = [threading.Thread(target=run) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(got) == 15 and all((g == want).all() for g in got)


def test_bad_shapes_are_errors():
    wq = np.ones((1, 64, 16), np.int16)
    amx = ax.amx_weights(wq)
    xq = np.ones((1, 4, 64), np.int16)
    with pytest.raises(ValueError, match="inconsistent"):
        ax.map_predict_amx(xq, np.zeros((1, 4), np.int32), amx, np.zeros((1, 16), np.int32),
                           np.empty((4, 32), np.float32))
    with pytest.raises(ValueError, match="inconsistent"):
        ax.map_predict_amx(np.ones((2, 4, 64), np.int16), np.zeros((2, 4), np.int32), amx,
                           np.zeros((2, 16), np.int32), np.empty((4, 16), np.float32))


def test_plane_padding_may_hold_anything():
    """The kernel's scratch is reused without clearing: padded channels and rows left from an earlier
    call (here: filled with -1 / 255 bytes) never reach the result."""
    _amx_or_skip()
    rng = np.random.default_rng(4)
    S, n, K, m = 2, 21, 70, 40
    W = rng.standard_normal((S * K, m)).astype(np.float32)
    xs = [rng.standard_normal((n, K)).astype(np.float32) for _ in range(S)]
    M = im.IntMap(W, S)
    clean = M.predict(xs)
    xh, xl, acc = ax._scratch(S, 4096, 512)
    xh[:] = -1
    xl[:] = 255
    acc[:] = -1
    dirty = M.predict(xs)
    xq, xe = M.quantize(xs)
    wq, we, _ = im.quantize_weights(W, S)
    ref = im.reference_predict(xq, xe, wq, we).view(np.uint32)
    assert (clean.view(np.uint32) == ref).all() and (dirty.view(np.uint32) == ref).all()
    with pytest.raises(ValueError, match="shape"):
        M.predict([xs[0], xs[1][:, :-1]])
