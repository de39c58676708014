"""Numba kernels for the decoder's hot loops (no fastmath: results equal the numpy expressions
the encoder uses, value for value).

>>> import numpy as np
>>> base = np.zeros((3, 2), np.float32)
>>> q = np.array([[1, 2, 3], [-1, 0, 4]], np.int32)       # channel-major
>>> dequant_add(base, q, np.full(3, 0.5, np.float32)).tolist()
[[0.5, -0.5], [1.0, 0.0], [1.5, 2.0]]
"""
from __future__ import annotations

import numpy as np

from alignpred.kernels._jit import njit


@njit(cache=True)
def _dequant_add(base, q, delta, chan, out):
    n, d = base.shape
    for t0 in range(0, n, 16):  # 16-token tiles: q rows read contiguously, the tile stays in cache
        t1 = min(n, t0 + 16)
        for c in range(d):
            for t in range(t0, t1):
                out[t, c] = base[t, c] + np.float32(q[c, t]) * (delta[t] * chan[c])


def channel_steps(chan, d: int) -> np.ndarray:
    """The per-channel step multipliers ``[d]`` (float32; ones when ``chan`` is None): a row's
    step in channel ``c`` is ``float32(delta_rows[t] * chan[c])``, exact when ``chan[c] = 1``."""
    if chan is None:
        return np.ones(d, np.float32)
    chan = np.ascontiguousarray(chan, np.float32)
    if chan.shape != (d,):
        raise ValueError(f"chan must be float32 [{d}]")
    return chan


def dequant_add(base: np.ndarray, q_cm: np.ndarray, delta_rows: np.ndarray, chan=None) -> np.ndarray:
    """``base [n, d] + q_cm.T * (delta_rows[:, None] * chan)`` in float32, reading ``q``
    channel-major (``chan``: per-channel step multipliers, :func:`channel_steps`)."""
    out = np.empty(base.shape, np.float32)
    _dequant_add(np.ascontiguousarray(base, np.float32), np.ascontiguousarray(q_cm, np.int32),
                 np.ascontiguousarray(delta_rows, np.float32), channel_steps(chan, base.shape[1]), out)
    return out


@njit(cache=True, nogil=True)
def _entropy_bits(v):
    """``n log2 n - sum_x c_x log2 c_x`` for the value counts ``c_x`` of ``v`` (int64 [n], n > 0):
    by histogram, or by runs of the sorted values when ``v`` spans more than 65,536 values."""
    n = v.shape[0]
    lo = v[0]
    hi = v[0]
    for t in range(1, n):
        if v[t] < lo:
            lo = v[t]
        elif v[t] > hi:
            hi = v[t]
    acc = 0.0
    if hi - lo < 1 << 16:
        counts = np.zeros(hi - lo + 1, np.int64)
        for t in range(n):
            counts[v[t] - lo] += 1
        for k in range(counts.shape[0]):
            m = counts[k]
            if m > 0:
                acc += m * np.log2(np.float64(m))
    else:
        s = np.sort(v)
        run = 1
        for t in range(1, n + 1):
            if t < n and s[t] == s[t - 1]:
                run += 1
            else:
                acc += run * np.log2(np.float64(run))
                run = 1
    return n * np.log2(np.float64(n)) - acc


@njit(cache=True, nogil=True)
def _column_entropy(q, out):
    n, d = q.shape
    v = np.empty(n, np.int64)
    for c in range(d):
        for t in range(n):
            v[t] = q[t, c]
        out[c] = _entropy_bits(v)


def column_entropy_bits(q: np.ndarray) -> np.ndarray:
    """Empirical zeroth-order entropy in bits of each column of the integer array ``q [n, d]``
    (float64 ``[d]``): ``n log2 n - sum_v c_v log2 c_v`` over the value counts ``c_v``, by
    histogram (no sorting unless a column spans more than 65,536 values).

    >>> column_entropy_bits(np.array([[0, 1], [0, 2], [0, 1], [0, 2]], np.int32)).tolist()
    [0.0, 4.0]
    """
    q = np.asarray(q)
    out = np.zeros(q.shape[1])
    if q.shape[0]:
        _column_entropy(q.astype(np.int32, copy=False), out)
    return out


@njit(cache=True, nogil=True)
def _quantize_column(w, base, c, dr, g, interp, S, qcol, whcol):
    """Quantise column ``c`` of ``w - base`` (``base`` may be empty: zero) with steps
    ``dr[t] * g`` (``g``: the channel's step multiplier); returns max |q|. Float32 operations in
    the order of :func:`alignpred.kernels.quantize_ref.quantize_residual`."""
    n = w.shape[0]
    has_base = base.shape[0] > 0
    big = np.float32(0.0)
    for t in range(n):
        x = w[t, c] - base[t, c] if has_base else w[t, c]
        st = dr[t] * g
        v = np.float32(np.rint(x / st))
        qcol[t] = v
        whcol[t] = v * st
    if interp:
        for t in range(1, n, 2):
            left = whcol[t - 1]
            rt = t + 1
            if rt < n and rt % S != 0:
                pred = np.float32(0.5) * (left + whcol[rt])
            else:
                pred = left
            x = w[t, c] - base[t, c] if has_base else w[t, c]
            st = dr[t] * g
            v = np.float32(np.rint((x - pred) / st))
            qcol[t] = v
            whcol[t] = pred + v * st
    for t in range(n):
        a = abs(qcol[t])
        if a > big:
            big = a
    return big


@njit(cache=True, nogil=True)
def _quantize(w, base, dr, chan, interp, S, q, wh):
    n, d = w.shape
    qcol = np.empty(n, np.float32)
    whcol = np.empty(n, np.float32)
    big = np.float32(0.0)
    for c in range(d):
        b = _quantize_column(w, base, c, dr, chan[c], interp[c], S, qcol, whcol)
        if b > big:
            big = b
        if b < np.float32(2.0 ** 30):
            for t in range(n):
                q[t, c] = np.int32(qcol[t])
                wh[t, c] = whcol[t]
    return big


@njit(cache=True, nogil=True)
def _candidate_bits(w, base, dr, chan, interp, S, out):
    """Per channel: the zeroth-order entropy (bits) of the symbols quantising ``w - base``."""
    n, d = w.shape
    qcol = np.empty(n, np.float32)
    whcol = np.empty(n, np.float32)
    qi = np.empty(n, np.int64)
    for c in range(d):
        b = _quantize_column(w, base, c, dr, chan[c], interp, S, qcol, whcol)
        if b >= np.float32(2.0 ** 30):
            out[c] = np.inf
            continue
        for t in range(n):
            qi[t] = np.int64(qcol[t])
        out[c] = _entropy_bits(qi)


_EMPTY = np.zeros((0, 0), np.float32)


def quantize(w, delta_rows, interp, object_size: int, base=None, chan=None):
    """``quantize_residual(w - base, ...)`` in one pass: ``(q int32 [n, d], wh float32 [n, d],
    max |q|)``; values equal the numpy definition bit for bit. ``chan``: per-channel step
    multipliers (:func:`channel_steps`)."""
    w = np.ascontiguousarray(w, np.float32)
    b = _EMPTY if base is None else np.ascontiguousarray(base, np.float32)
    q = np.zeros(w.shape, np.int32)
    wh = np.empty(w.shape, np.float32)
    big = _quantize(w, b, np.ascontiguousarray(delta_rows, np.float32), channel_steps(chan, w.shape[1]),
                    np.ascontiguousarray(interp, np.bool_), int(object_size), q, wh)
    return q, wh, float(big)


def candidate_bits(w, delta_rows, interp: bool, object_size: int, base=None, chan=None) -> np.ndarray:
    """Estimated bits per channel (zeroth-order entropy of the symbols) of coding ``w - base``
    with or without token interpolation: the encoder's cost for choosing predictor modes."""
    w = np.ascontiguousarray(w, np.float32)
    b = _EMPTY if base is None else np.ascontiguousarray(base, np.float32)
    out = np.empty(w.shape[1])
    _candidate_bits(w, b, np.ascontiguousarray(delta_rows, np.float32), channel_steps(chan, w.shape[1]),
                    bool(interp), int(object_size), out)
    return out
