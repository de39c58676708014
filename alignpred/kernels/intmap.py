"""Exact integer products for the linear-map predictor: the same bits on every machine.

The map prediction of a block is ``pred[t, j] = sum_s sum_k src_s[t, k] * W_s[k, j]`` over its
2-3 source blocks.  A float32 BLAS product rounds differently with the thread count, the CPU and
the library version; here every source row and every weight is rounded to a small integer times
a power of two, the products are summed *exactly* in integers (any order, any vector width: the
same integer), and only the final combination of the sources is rounded, in a fixed order:

    pred[t, j] = float32( sum_s float64(acc_s[t, j]) * 2**(x_exp_s[t] + w_exp_s[j]) )
    acc_s[t, j] = sum_k xq_s[t, k] * wq_s[j, k]          (exact integer)

summed over ``s`` in source order in float64, starting from +0.0.  Every step is an IEEE
operation with one defined result (integer sums, exact int->float64 conversions, products by
powers of two, float64 additions, one float64->float32 rounding), so the result is identical on
SSE2-only and AVX-512 machines, with any thread count and in any process.

**Quantisation.**  ``x`` rows: one power-of-two scale per row, from the row's max ``|x|``
(exactly, via frexp): ``|xq| <= XQ_MAX = 2**(BX-1) - 1``.  Weights: one power-of-two scale per
output column and source, ``|wq| <= WQ_MAX = 2**(BW-1) - 1``, round half to even.  Before that,
each source channel ``k`` is *equalised* by an exact power of two, ``x'_k = x_k * 2**-shift_k``,
``W'_kj = W_kj * 2**shift_k`` (so ``x' W' = x W``): ``shift_k`` brings the largest weight of every
row of ``W_s`` to the same octave (data independent, from the weights only).  The maps of a
calibrated bank put small weights on the channels with outliers (massive key channels), so this
moves those channels' dynamic range out of the per-row ``x`` scale.  On the Gemma 3 270M
samples (210 map objects) the integer rounding noise is, relative to the quantisation noise
``Delta/sqrt(12)`` at eps = 0.0267: median 2.1 %, max 3.8 % (without the equalisation: 4.1 %,
11 %; a numpy study with one x scale per call instead of per row gave ~3x more); float32 BLAS
is at 1e-5.  See ``benchmarks/studies/speed/kernels_bench.py``.

**Overflow (proof).**  ``BX = 14``, ``BW = 13``: one product is at most
``XQ_MAX * WQ_MAX = 8191 * 4095 = 33,542,145``.  Every partial sum of products, in any order,
is bounded by the sum of their absolute values.  (a) In general the kernel sums at most
``K_CHUNK = 64`` products in int32 before it widens the partial sum to float64, where sums of
chunk sums are exact (``|sum| < 2**31 * ceil(d_in / 64) < 2**53`` for any ``d_in < 2**27``):
``64 * 33,542,145 = 2,146,697,280 < 2**31 - 1 = 2,147,483,647``.  (b) For an 8-row block whose
rows all have ``sum_k |xq[t, k]| <= L1_ONE_CHUNK = floor((2**31 - 1) / 4095) = 524,416``
(checked at run time; ~98 % of the blocks of the Gemma samples), every partial sum of a whole
source is at most ``524,416 * 4095 = 2,147,483,520 < 2**31``, so one int32 accumulator per
source is exact.  Both paths give the same integer, so the result never depends on which ran.
``vpdpwssd``/``pmaddwd`` pair sums are at most ``2 * 33,542,145``.  Any ``d_in`` works.
(A plain int32 sum over d_in = 512 without any check would need ``BX = BW = 12``:
``2047**2 * 512 = 2,145,387,008``; about 3x the rounding noise of 14/13 on the samples.)

**Kernel.**  An outer-product micro-kernel written in LLVM vector IR (numba ``@intrinsic``): an
``R x C`` block of ``<16 x i32>`` accumulators, the weights packed ``[d_in/2, d_out, 2]`` so one
load holds 16 columns x 2 channels, a row's channel pair broadcast to all lanes; ``sext``, ``mul``
and an even/odd ``add`` form the pattern LLVM lowers to ``vpdpwssd`` (AVX512-VNNI),
``vpmaddwd`` (AVX2/AVX-512) or ``pmaddwd`` (SSE2).  The LLVM IR is portable: numba compiles it
for the host CPU (its on-disk cache is keyed by CPU name and features).

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> W = rng.standard_normal((64, 32)).astype(np.float32)
>>> x = [rng.standard_normal((5, 32)).astype(np.float32) for _ in range(2)]
>>> m = IntMap(W, n_src=2)
>>> y = m.predict(x)
>>> ref = x[0].astype(np.float64) @ W[:32] + x[1].astype(np.float64) @ W[32:]
>>> bool(np.abs(y - ref).max() < 1e-3 * np.abs(ref).max())
True
"""
from __future__ import annotations

import threading

import numpy as np

from alignpred.kernels.intmap_amx import (
    AMX_K_MAX,
    amx_enabled,
    amx_from_panels,
    map_predict_amx,
    predict_amx,
    stack_scales,
)
from alignpred.kernels.intmap_block import (  # noqa: F401
    _MAGIC32,
    _MAGIC64,
    BW,
    BX,
    C_BLK,
    COL_BLK,
    K_CHUNK,
    KP_CHUNK,
    L1_ONE_CHUNK,
    R_BLK,
    SHIFT_MAX,
    WQ_MAX,
    XQ_MAX,
    _f64_bits,
    _i32_as_f32,
    _map_predict,
    _pow2,
    block_weights,
    unblock_weights,
)
from alignpred.kernels.intmap_rows import _quantize_rows, _row_scales, quantize_rows  # noqa: F401
from alignpred.kernels.intmap_weights import (  # noqa: F401  (re-exported: the public names of this module)
    _check_weights,
    channel_shifts,
    pack_weights,
    prepare_weights,
    quantize_weights,
)
from alignpred.threads import pool, row_threads

# rows per thread below which a split row range is not worth a hand-off (split_rows)
SPLIT_MIN_ROWS = 64
# rows per AMX call in IntMap.predict: their byte planes (S x rows x d_in x 2 bytes: 768 KiB for
# three 256-channel sources) stay in L2 (128-100,000 rows measured within noise on a 2,048-row decode)
AMX_ROWS = 512

def map_predict(xq: np.ndarray, x_exp: np.ndarray, wp: np.ndarray, w_exp: np.ndarray,
                out: np.ndarray | None = None, n_out: int | None = None, amx: tuple | None = None) -> np.ndarray:
    """The map prediction from quantised sources.

    ``xq int16 [S, n, d_pad]`` (C-contiguous; source ``s`` from :func:`quantize_rows` with that
    source's shift), ``x_exp int32 [S, n]``, ``wp`` from :func:`pack_weights` (``[S, d_pad/2,
    d_out_pad, 2]``, converted at each call) or :func:`block_weights` (``[S, panels, d_pad/2, 32,
    2]``, what the kernel reads: :attr:`IntMap.panels`), ``w_exp int32
    [S, d_out]``.  ``out``: float32 ``[n, d_out]`` with unit column stride and any row stride
    (e.g. a row slice of a larger array); allocated if None.  ``amx``: the same weights for the AMX
    kernel (:func:`~alignpred.kernels.intmap_amx.amx_weights`, :attr:`IntMap.amx`), used where
    :func:`~alignpred.kernels.intmap_amx.amx_enabled` (the same bits).
    Returns ``out``: ``float32(sum_s float64(xq_s @ wq_s.T) * 2**(x_exp_s[t] + w_exp_s[j]))``,
    the integer products exact, the sources added in order in float64 (the same with either
    weight layout).
    """
    S, n, K2 = xq.shape
    m = w_exp.shape[1] if n_out is None else n_out
    if not (xq.dtype == np.int16 and wp.dtype == np.int16 and xq.flags.c_contiguous and wp.flags.c_contiguous):
        raise TypeError("map_predict: xq and wp must be C-contiguous int16")
    if wp.ndim == 4:  # pack_weights' layout: the kernel reads panels
        wp = block_weights(wp)
    if (wp.ndim != 5 or wp.shape[0] != S or 2 * wp.shape[2] != K2 or x_exp.shape != (S, n)
            or wp.shape[1] * 32 < m or wp.shape[3:] != (32, 2)):
        raise ValueError("map_predict: inconsistent shapes")
    if out is None:
        out = np.empty((n, m), np.float32)
    elif out.shape != (n, m) or out.dtype != np.float32:
        raise ValueError("map_predict: out must be float32 [n, d_out]")
    target = _kernel_out(out)
    we = _padded_exp(w_exp, target.shape[1])
    if amx is not None and amx_enabled():
        map_predict_amx(xq, np.ascontiguousarray(x_exp, np.int32), amx, we, target)
    else:
        _map_predict(xq, np.ascontiguousarray(x_exp, np.int32), wp, we, target)
    if target is not out:
        out[:] = target[:, :m]
    return out


def _kernel_out(out: np.ndarray) -> np.ndarray:
    """``out`` where the kernels can write it (columns a multiple of 16, unit column stride), else
    a scratch of 16-padded columns to copy from."""
    n, m = out.shape
    if m % 16 or (out.strides[1] != 4 and m > 1) or out.strides[0] % 4:
        return np.empty((n, -(-m // 16) * 16), np.float32)
    return out


def _padded_exp(w_exp: np.ndarray, width: int) -> np.ndarray:
    """``w_exp int32 [S, d_out]`` with zero columns up to ``width``."""
    we = np.ascontiguousarray(w_exp, np.int32)
    if we.shape[1] < width:
        we = np.concatenate([we, np.zeros((we.shape[0], width - we.shape[1]), np.int32)], axis=1)
    return we


class IntMap:
    """A bank map prepared for exact integer prediction.

    ``IntMap(W, n_src)``: ``W [n_src*d_in, d_out]`` (float16/32, sources stacked along rows in
    the bank's order).  :meth:`predict` takes the source rows (float32 ``[n, d_in]`` each, in the
    coding frame) and returns/writes float32 ``[n, d_out]``.  Rows are independent (per-row
    scales): any split of the rows into calls gives the same bits.  The arguments are checked at
    construction; the integer weights (:func:`prepare_weights`: 0.7 ms for a 512 x 256 map) are
    made at first use, under a lock (start-up: a decoder that reads some layers prepares only
    their maps; ``W`` must not change until then).  Immutable after that; ``predict`` allocates
    its own scratch, so one ``IntMap`` can serve several threads.
    """

    def __init__(self, W: np.ndarray, n_src: int = 1, shift: np.ndarray | None = None):
        W, sh = _check_weights(W, n_src, shift)
        self.n_src, self.d_in, self.d_out = n_src, sh.shape[1], W.shape[1]
        self._args: tuple | None = (W, shift)
        self._ready: tuple | None = None
        self._amx: tuple | None = None
        self._lock = threading.Lock()

    def _prepared(self) -> tuple:
        r = self._ready
        if r is None:
            with self._lock:
                r = self._ready
                if r is None and self._args is not None:
                    wp, w_exp, sh = prepare_weights(self._args[0], self.n_src, self._args[1])
                    scales = [_row_scales(sh[s]) for s in range(self.n_src)]
                    r = self._ready = (block_weights(wp), w_exp, sh, scales, stack_scales(scales))
                    self._args = None
        assert r is not None
        return r

    @property
    def panels(self) -> np.ndarray:
        """The integer weights as the kernel reads them (:func:`block_weights`; not a copy)."""
        return self._prepared()[0]

    @property
    def amx(self) -> tuple | None:
        """The integer weights in the AMX kernel's layout (:func:`~alignpred.kernels.intmap_amx.amx_weights`,
        made at first use), or None where that kernel does not run (the same bits either way)."""
        if not amx_enabled() or 2 * self.panels.shape[2] > AMX_K_MAX:
            return None
        if self._amx is None:
            with self._lock:
                if self._amx is None:
                    self._amx = amx_from_panels(self.panels, self.d_out)
        return self._amx

    @property
    def wp(self) -> np.ndarray:
        """The integer weights in :func:`pack_weights`'s layout (a copy; the map keeps them in
        :func:`block_weights`'s)."""
        return unblock_weights(self._prepared()[0], self.d_out)

    @property
    def w_exp(self) -> np.ndarray:
        return self._prepared()[1]

    @property
    def shift(self) -> np.ndarray:
        return self._prepared()[2]

    def quantize(self, srcs, xq: np.ndarray | None = None):
        """Quantise the sources: ``(xq int16 [S, n, d_pad], x_exp int32 [S, n])``."""
        n = srcs[0].shape[0]
        wb, _, _, scales, _ = self._prepared()
        kp2 = 2 * wb.shape[2]
        if xq is None:
            xq = np.empty((self.n_src, n, kp2), np.int16)
        x_exp = np.empty((self.n_src, n), np.int32)
        for s in range(self.n_src):
            x = srcs[s]
            if x.shape != (n, self.d_in):
                raise ValueError(f"source {s} has shape {x.shape}, expected ({n}, {self.d_in})")
            pscale, p32, lo, hi = scales[s]
            _quantize_rows(np.ascontiguousarray(x, np.float32), pscale, p32, lo, hi, xq[s], x_exp[s])
        return xq, x_exp

    def _predict_amx(self, xs: list, out: np.ndarray, amx: tuple) -> None:
        """Rows ``xs`` (checked) through :func:`~alignpred.kernels.intmap_amx.predict_amx` into ``out``."""
        wb, w_exp, _, _, stacked = self._prepared()
        n = out.shape[0]
        for k, x in enumerate(xs):
            if x.shape != (n, self.d_in):
                raise ValueError(f"source {k} has shape {x.shape}, expected ({n}, {self.d_in})")
        target = _kernel_out(out)
        predict_amx(xs, stacked, 2 * wb.shape[2], amx, _padded_exp(w_exp, target.shape[1]), target,
                    AMX_ROWS)
        if target is not out:
            out[:] = target[:, :self.d_out]

    def predict(self, srcs, out: np.ndarray | None = None) -> np.ndarray:
        """The prediction ``float32 [n, d_out]`` from the source rows; inside
        :func:`alignpred.threads.split_rows` the rows are split over kvz's threads (the same bits)."""
        if len(srcs) != self.n_src:
            raise ValueError(f"expected {self.n_src} sources, got {len(srcs)}")
        wp, w_exp = self._prepared()[:2]
        n = srcs[0].shape[0]
        k = min(row_threads(), n // SPLIT_MIN_ROWS)
        if out is None:
            out = np.empty((n, self.d_out), np.float32)
        elif out.shape != (n, self.d_out) or out.dtype != np.float32:
            raise ValueError("IntMap.predict: out must be float32 [n, d_out]")
        o, amx = out, self.amx

        def part(a: int, b: int) -> None:
            if amx is None:
                xq, x_exp = self.quantize([x[a:b] for x in srcs], _xq_scratch(self.n_src, b - a, 2 * wp.shape[2]))
                map_predict(xq, x_exp, wp, w_exp, o[a:b], self.d_out)
                return
            self._predict_amx([x[a:b] for x in srcs], o[a:b], amx)   # AMX_ROWS rows at a time

        if k <= 1:
            part(0, n)
            return out
        edges = [n * i // k for i in range(k + 1)]
        rest = [pool(k).submit(part, edges[i], edges[i + 1]) for i in range(1, k)]
        part(edges[0], edges[1])
        for f in rest:
            f.result()
        return out


_local = threading.local()
_XQ_KEEP = 1 << 23          # int16 values (16 MiB) a thread keeps for the next call


def _xq_scratch(S: int, n: int, kp2: int) -> np.ndarray:
    """This thread's int16 ``[S, n, kp2]`` buffer for the quantised sources of one product (reused
    across calls: fresh memory costs a page fault per 4 KiB on first touch, ~1.7 us each on a
    2-core VM, more than quantising into it)."""
    need = S * n * kp2
    if need > _XQ_KEEP:   # a long range's sources: not kept for the thread's lifetime
        return np.empty((S, n, kp2), np.int16)
    buf = getattr(_local, "xq", None)
    if buf is None or buf.size < need:
        buf = _local.xq = np.empty(max(need, 1), np.int16)
    return buf[:need].reshape(S, n, kp2)


def reference_predict(xq: np.ndarray, x_exp: np.ndarray, wq: np.ndarray, w_exp: np.ndarray) -> np.ndarray:
    """Pure-numpy definition of :func:`map_predict` (int64 products) for tests:
    ``xq [S, n, >= d_in]``, ``wq [S, d_out, d_in]`` (unpacked)."""
    S, m, K = wq.shape
    y = np.zeros((xq.shape[1], m), np.float64)
    for s in range(S):
        acc = xq[s, :, :K].astype(np.int64) @ wq[s].T.astype(np.int64)
        y = y + acc.astype(np.float64) * np.ldexp(1.0, (x_exp[s][:, None] + w_exp[s][None, :]).astype(np.int32))
    return y.astype(np.float32)
