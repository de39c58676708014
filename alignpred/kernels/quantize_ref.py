"""Residual quantisation on a uniform lattice, with optional token interpolation, and the
per-channel entropy estimate the encoder uses to choose predictors.

A channel with token interpolation quantises its even rows directly and its odd rows against the
mean of their reconstructed even neighbours (inside each object; the last odd row of an object
uses its left neighbour).

>>> import numpy as np
>>> w = np.array([[1.0], [2.0], [3.0], [5.0]], np.float32)
>>> q, wh = quantize_residual(w, np.full(4, 0.5, np.float32), np.array([True]), 256)
>>> q.ravel().tolist(), wh.ravel().tolist()
([2, 0, 6, 4], [1.0, 2.0, 3.0, 5.0])
"""
from __future__ import annotations

import numpy as np

from alignpred.errors import EncodeError


def _steps(delta_rows, chan, d: int) -> np.ndarray:
    """The step of every value ``[n, d]`` (or ``[n, 1]`` without ``chan``), float32."""
    dr = np.asarray(delta_rows, np.float32)[:, None]
    return dr if chan is None else dr * np.asarray(chan, np.float32).reshape(1, d)


def quantize_residual(w: np.ndarray, delta_rows: np.ndarray, interp: np.ndarray, object_size: int, chan=None):
    """Quantise the base residual ``w [n, d]`` (rows = positions from an object boundary, each
    row's step in ``delta_rows``, times ``chan[c]`` in channel ``c`` when given); channels with
    ``interp`` use token interpolation. Returns ``(q int32 [n, d], reconstructed residual [n, d])``."""
    dr = _steps(delta_rows, chan, w.shape[1])
    q = np.rint(w.astype(np.float32) / dr)
    wh = q * dr
    if interp.any():
        cols = np.nonzero(interp)[0]
        wi = w[:, cols]
        qi = q[:, cols]
        whi = wh[:, cols]
        dri = dr if chan is None else dr[:, cols]
        pred = interp_prediction(whi, object_size)
        odd = slice(1, None, 2)
        qo = np.rint((wi[odd] - pred) / dri[odd])
        qi[odd] = qo
        whi[odd] = pred + qo * dri[odd]
        q[:, cols] = qi
        wh[:, cols] = whi
    if q.size and float(np.max(np.abs(q))) >= 2.0 ** 30:
        raise EncodeError("quantisation step too small for the residuals (eps too small?)")
    return q.astype(np.int32), wh.astype(np.float32)


def interp_prediction(wh: np.ndarray, object_size: int) -> np.ndarray:
    """Prediction of the odd rows from the reconstructed even rows (within objects)."""
    n = wh.shape[0]
    left = wh[0:n - 1:2] if n > 1 else wh[:0]
    odd_t = np.arange(1, n, 2)
    right_t = odd_t + 1
    ok = (right_t < n) & (right_t % object_size != 0)
    right = wh[np.where(ok, right_t, odd_t - 1)]
    return np.where(ok[:, None], 0.5 * (left + right), left)


def dequantize_residual(q: np.ndarray, delta_rows: np.ndarray, interp: np.ndarray, object_size: int, chan=None):
    """Decoder side of :func:`quantize_residual`."""
    dr = _steps(delta_rows, chan, q.shape[1])
    q = q.astype(np.float32)
    wh = q * dr
    if interp.any():
        cols = np.nonzero(interp)[0]
        whi = wh[:, cols]
        dri = dr if chan is None else dr[:, cols]
        pred = interp_prediction(whi, object_size)
        whi[1::2] = pred + q[1::2][:, cols] * dri[1::2]
        wh[:, cols] = whi
    return wh.astype(np.float32)


def channel_entropy_bits(q: np.ndarray) -> np.ndarray:
    """Empirical zeroth-order entropy, in bits, of each column of ``q [n, d]`` (float64 ``[d]``):
    the cost proxy the encoder uses to choose a predictor per channel
    (:func:`alignpred.kernels.quantize.column_entropy_bits`, by histogram).

    >>> channel_entropy_bits(np.array([[0, 1], [0, 2], [0, 1], [0, 2]])).tolist()
    [0.0, 4.0]
    """
    from alignpred.kernels.quantize import column_entropy_bits

    return column_entropy_bits(q)
