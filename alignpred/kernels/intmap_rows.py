"""Quantising source rows for the exact map products (:mod:`alignpred.kernels.intmap`): one
power-of-two scale per row, exactly.  One row's code (:func:`_quantize_row`) serves the int16
rows of the vector kernel and the byte planes of the AMX kernel, so both read the same integers."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from alignpred.kernels.intmap_block import _MAGIC32, _MAGIC64, BX, XQ_MAX, _f64_bits, _i32_as_f32

_XQ_MAX_F = float(XQ_MAX)
_NONFINITE = np.int64(0x7FF0000000000000)


@njit(cache=True, nogil=True, inline="always")
def _quantize_row(xr, pscale, p32, smin, smax, qr):
    """One row: ``xr`` float32 [d] into ``qr`` int16 [>= d] (columns beyond d zeroed); returns
    the row's exponent.  ``pscale`` float64 [d] = 2**-shift, ``p32`` the same in float32;
    ``smin``/``smax``: the shift range."""
    d = xr.shape[0]
    dp = qr.shape[0]
    # max |x'| exactly (float64 products by powers of two), as bits: for non-negative
    # doubles the integer order is the numeric order; inf/nan have the largest patterns.
    mb = np.int64(0)
    for k in range(d):
        b = _f64_bits(abs(np.float64(xr[k])) * pscale[k])
        mb = b if b > mb else mb
    finite = mb < _NONFINITE
    e = 0
    if finite and mb > 0:
        e = np.int64(mb >> 52) - 1022     # frexp exponent: x' max < 2**e (x' >= 2**-173: normal)
    e -= BX - 1
    # scale c = 2**-e; float32 path when every 2**(-shift_k - e) is a normal float32 (then
    # x * (p32 * c) is exact up to values that round to 0, and |v| <= 2**(BX-1): no clamp
    # before the conversion is needed), else float64 with clamps.
    if finite and -126 <= -e <= 127 and -smax - e >= -126 and -smin - e <= 127:
        c = _i32_as_f32(np.int32((127 - e) << 23))
        for k in range(d):
            v = (xr[k] * (p32[k] * c) + _MAGIC32) - _MAGIC32
            i = np.int32(v)
            i = min(i, np.int32(XQ_MAX))
            i = max(i, np.int32(-XQ_MAX))
            qr[k] = np.int16(i)
    else:
        c64 = math.ldexp(1.0, -e)
        for k in range(d):
            w = np.float64(xr[k]) * pscale[k] * c64
            w = w if w < _XQ_MAX_F else _XQ_MAX_F      # nan -> XQ_MAX: garbage, but defined
            w = w if w > -_XQ_MAX_F else -_XQ_MAX_F
            w = (w + _MAGIC64) - _MAGIC64
            qr[k] = np.int16(np.int32(w))
    for k in range(d, dp):
        qr[k] = 0
    return e


@njit(cache=True, nogil=True)
def _quantize_rows(x, pscale, p32, smin, smax, xq, x_exp):
    """x float32 [n, d]; the scales as :func:`_quantize_row`'s; xq int16 [n, >= d]; x_exp int32 [n]."""
    for t in range(x.shape[0]):
        x_exp[t] = _quantize_row(x[t], pscale, p32, smin, smax, xq[t])


def quantize_rows(x: np.ndarray, shift: np.ndarray | None = None, out: np.ndarray | None = None):
    """Quantise rows ``x float32 [n, d]`` (one source block): ``x[t, k] * 2**-shift[k] ~=
    xq[t, k] * 2**x_exp[t]``, one power-of-two scale per row from the row's max (exactly, via
    frexp), ``|xq| <= XQ_MAX``, round half to even.  Returns ``(xq int16 [n, d_pad], x_exp int32
    [n])``, ``d_pad`` = ``d`` rounded up to even (a zero column).  All-zero rows give zeros;
    rows with inf/nan give clipped garbage (never undefined behaviour).  ``out``: an int16
    ``[n, d_pad]`` C-contiguous buffer to write into.

    >>> xq, xe = quantize_rows(np.array([[1.0, -0.5, 0.0], [0.0, 0.0, 0.0]], np.float32))
    >>> xq.tolist(), xe.tolist()
    ([[4096, -2048, 0, 0], [0, 0, 0, 0]], [-12, -13])
    """
    x = np.ascontiguousarray(x, np.float32)
    n, d = x.shape
    dp = d + (d & 1)
    sh = np.zeros(d, np.int32) if shift is None else np.asarray(shift, np.int32).reshape(d)
    xq = np.empty((n, dp), np.int16) if out is None else out
    x_exp = np.empty(n, np.int32)
    _quantize_rows(x, *_row_scales(sh), xq, x_exp)
    return xq, x_exp


def _row_scales(shift: np.ndarray):
    """Arguments of :func:`_quantize_rows` for one source's shifts ``int32 [d]``."""
    pscale = np.ldexp(1.0, -shift.astype(np.int32))
    lo, hi = (int(shift.min()), int(shift.max())) if shift.size else (0, 0)
    return pscale, pscale.astype(np.float32), lo, hi
