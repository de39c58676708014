"""The integer weights of :mod:`alignpred.kernels.intmap`: per-channel equalisation exponents
(:func:`channel_shifts`), quantisation (:func:`quantize_weights`), the vector kernel's packing
(:func:`pack_weights`) and all three in one compiled pass (:func:`prepare_weights`, what
:class:`~alignpred.kernels.intmap.IntMap` uses).  See that module for the arithmetic."""
from __future__ import annotations

import math

import numpy as np

from alignpred.kernels._jit import njit
from alignpred.kernels.intmap_block import BW, SHIFT_MAX, WQ_MAX, _pow2

_WQ_MAX_F = float(WQ_MAX)


def channel_shifts(W: np.ndarray, n_src: int = 1) -> np.ndarray:
    """Equalisation exponents ``int32 [n_src, d_in]`` of the rows of ``W [n_src*d_in, d_out]``:
    per source, ``shift_k = median_k(E_k) - E_k`` with ``E_k`` the frexp exponent of the row's
    largest ``|W|`` (rows of zeros: 0), clipped to ``+-SHIFT_MAX``.  Exact integer arithmetic.

    >>> channel_shifts(np.array([[1.0], [0.01], [3.0]], np.float32)).tolist()
    [[0, 7, -1]]
    """
    W = np.asarray(W)
    d_in = W.shape[0] // n_src
    if d_in * n_src != W.shape[0]:
        raise ValueError(f"W has {W.shape[0]} rows, not a multiple of n_src={n_src}")
    out = np.zeros((n_src, d_in), np.int32)
    for s in range(n_src):
        rm = np.abs(W[s * d_in:(s + 1) * d_in].astype(np.float64)).max(axis=1, initial=0.0)
        e = np.frexp(rm)[1].astype(np.int64)
        nz = (rm > 0) & np.isfinite(rm)
        if nz.any():
            srt = np.sort(e[nz])
            med = int(srt[(len(srt) - 1) // 2])
            out[s] = np.where(nz, np.clip(med - e, -SHIFT_MAX, SHIFT_MAX), 0)
    return out


def quantize_weights(W: np.ndarray, n_src: int = 1, shift: np.ndarray | None = None):
    """Quantise a map ``W [n_src*d_in, d_out]`` (float16/float32/float64, sources stacked along
    rows) per source and output column.

    Returns ``(wq int16 [n_src, d_out, d_in], w_exp int32 [n_src, d_out], shift int32
    [n_src, d_in])`` with ``W[s*d_in + k, j] ~= wq[s, j, k] * 2.0**(w_exp[s, j] - shift[s, k])``,
    ``|wq| <= WQ_MAX``, round half to even (``shift=None``: :func:`channel_shifts`; pass zeros
    for no equalisation).  Only exact operations (scaling by powers of two, rint): the same
    integers on every machine.

    >>> wq, we, sh = quantize_weights(np.array([[1.0, 0.5], [-0.25, 3.0]], np.float32))
    >>> wq.tolist(), we.tolist(), sh.tolist()
    ([[[2048, -256], [1024, 3072]]], [[-11, -11]], [[0, -1]])
    """
    W = np.asarray(W)
    if W.ndim != 2 or W.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError("W must be a 2-D float16/float32/float64 array")
    d_in = W.shape[0] // n_src
    d_out = W.shape[1]
    shift = channel_shifts(W, n_src) if shift is None else np.asarray(shift, np.int32).reshape(n_src, d_in)
    wq = np.zeros((n_src, d_out, d_in), np.int16)
    w_exp = np.zeros((n_src, d_out), np.int32)
    for s in range(n_src):
        w = np.ldexp(W[s * d_in:(s + 1) * d_in].astype(np.float64), shift[s][:, None].astype(np.int32))
        w = np.where(np.isfinite(w), w, 0.0)
        cm = np.abs(w).max(axis=0, initial=0.0)
        e = np.frexp(cm)[1].astype(np.int32) - np.int32(BW - 1)      # |w| * 2**-e < 2**(BW-1)
        q = np.rint(np.ldexp(w, -e[None, :]))
        q = np.clip(q, -WQ_MAX, WQ_MAX)
        wq[s] = q.T.astype(np.int16)
        w_exp[s] = e
    return wq, w_exp, shift


def pack_weights(wq: np.ndarray) -> np.ndarray:
    """``wq int16 [n_src, d_out, d_in]`` -> the kernel layout ``int16 [n_src, ceil(d_in/2),
    d_out_pad, 2]`` (channel pairs interleaved, columns padded with zeros to a multiple of 16)."""
    S, m, K = wq.shape
    kp = (K + 1) // 2
    mp = -(-m // 16) * 16
    wp = np.zeros((S, kp, mp, 2), np.int16)
    full = np.zeros((S, 2 * kp, mp), np.int16)
    full[:, :K, :m] = wq.transpose(0, 2, 1)
    wp[:] = full.reshape(S, kp, 2, mp).transpose(0, 1, 3, 2)
    return wp


@njit(cache=True, nogil=True)
def _prepare_weights(W, n_src, shift_in, use_shift, shift, wp, w_exp):
    """:func:`channel_shifts` + :func:`quantize_weights` + :func:`pack_weights` in one pass (the
    same integers: every step is exact or one correctly rounded IEEE operation, as in numpy).

    ``W [n_src*d_in, d_out]`` float32/float64; ``shift_in`` int32 [n_src, d_in] used when
    ``use_shift``; writes ``shift`` int32 [n_src, d_in], ``wp`` int16 [n_src, KP, mp, 2] (zeroed
    by the caller) and ``w_exp`` int32 [n_src, d_out]."""
    d_in = W.shape[0] // n_src
    m = W.shape[1]
    cm = np.empty(m, np.float64)
    scale = np.empty(m, np.float64)
    exps = np.empty(d_in, np.int64)
    for s in range(n_src):
        r0 = s * d_in
        if use_shift:
            for k in range(d_in):
                shift[s, k] = shift_in[s, k]
        else:
            # channel_shifts: frexp exponent of each row's max |W| (rows with a nan/inf or all
            # zeros: shift 0), median over the others, clipped
            nn = 0
            for k in range(d_in):
                rm = 0.0
                bad = False
                for j in range(m):
                    a = abs(np.float64(W[r0 + k, j]))
                    if a != a:
                        bad = True
                    elif a > rm:
                        rm = a
                if bad or not (0.0 < rm < np.inf):
                    shift[s, k] = 1 << 30          # marker: no shift
                else:
                    e = math.frexp(rm)[1]
                    shift[s, k] = e
                    exps[nn] = e
                    nn += 1
            med = 0
            if nn:
                srt = np.sort(exps[:nn])
                med = srt[(nn - 1) // 2]
            for k in range(d_in):
                e = shift[s, k]
                shift[s, k] = 0 if e == 1 << 30 else min(max(med - e, -SHIFT_MAX), SHIFT_MAX)
        # per column: the largest |w| (w = W * 2**shift exactly; non-finite -> 0)
        for j in range(m):
            cm[j] = 0.0
        for k in range(d_in):
            p = _pow2(np.int64(shift[s, k]))
            for j in range(m):
                a = abs(np.float64(W[r0 + k, j]) * p)
                if a < np.inf and a > cm[j]:
                    cm[j] = a
        for j in range(m):
            e = math.frexp(cm[j])[1] - (BW - 1)
            w_exp[s, j] = e
            scale[j] = _pow2(np.int64(-e)) if -1022 <= -e <= 1023 else 0.0
        for k in range(d_in):
            p = _pow2(np.int64(shift[s, k]))
            kp = k >> 1
            e2 = k & 1
            for j in range(m):
                w = np.float64(W[r0 + k, j]) * p
                if not abs(w) < np.inf:
                    w = 0.0
                sc = scale[j]
                v = w * sc if sc != 0.0 else math.ldexp(w, -w_exp[s, j])
                q = np.rint(v)
                q = min(max(q, -_WQ_MAX_F), _WQ_MAX_F)
                wp[s, kp, j, e2] = np.int16(q)


def _check_weights(W, n_src: int, shift):
    """``(W, shift int32 [n_src, d_in])`` of :func:`prepare_weights`'s arguments, or its
    TypeError/ValueError (zeros for no ``shift``)."""
    W = np.asarray(W)
    if W.ndim != 2 or W.dtype not in (np.float16, np.float32, np.float64):
        raise TypeError("W must be a 2-D float16/float32/float64 array")
    d_in = W.shape[0] // n_src
    if d_in * n_src != W.shape[0]:
        raise ValueError(f"W has {W.shape[0]} rows, not a multiple of n_src={n_src}")
    sh_in = np.asarray(shift, np.int32).reshape(n_src, d_in) if shift is not None else np.zeros((n_src, d_in), np.int32)
    return W, sh_in


def prepare_weights(W: np.ndarray, n_src: int = 1, shift: np.ndarray | None = None):
    """``(wp, w_exp, shift)``: :func:`pack_weights` of :func:`quantize_weights` in one compiled
    pass (the bundled bank's 35 maps: 0.03 s instead of 0.1 s, paid when a file is opened; the
    same integers — tests compare the two on random, degenerate and real maps).

    >>> W = np.array([[1.0, 0.5], [-0.25, 3.0]], np.float32)
    >>> wp, we, sh = prepare_weights(W)
    >>> wq, we2, sh2 = quantize_weights(W)
    >>> bool((wp == pack_weights(wq)).all() and (we == we2).all() and (sh == sh2).all())
    True
    """
    W, sh_in = _check_weights(W, n_src, shift)
    d_in, d_out = sh_in.shape[1], W.shape[1]
    Wc = np.ascontiguousarray(W, np.float64 if W.dtype == np.float64 else np.float32)  # exact
    use = shift is not None
    sh = np.empty((n_src, d_in), np.int32)
    wp = np.zeros((n_src, (d_in + 1) // 2, -(-d_out // 16) * 16, 2), np.int16)
    w_exp = np.empty((n_src, d_out), np.int32)
    _prepare_weights(Wc, n_src, sh_in, use, sh, wp, w_exp)
    return wp, w_exp, sh
