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
from numba import njit


@njit(cache=True)
def _dequant_add(base, q, delta, out):
    n, d = base.shape
    for t0 in range(0, n, 16):  # 16-token tiles: q rows read contiguously, the tile stays in cache
        t1 = min(n, t0 + 16)
        for c in range(d):
            for t in range(t0, t1):
                out[t, c] = base[t, c] + np.float32(q[c, t]) * delta[t]


def dequant_add(base: np.ndarray, q_cm: np.ndarray, delta_rows: np.ndarray) -> np.ndarray:
    """``base [n, d] + q_cm.T * delta_rows[:, None]`` in float32, reading ``q`` channel-major."""
    out = np.empty(base.shape, np.float32)
    _dequant_add(np.ascontiguousarray(base, np.float32), np.ascontiguousarray(q_cm, np.int32),
                 np.ascontiguousarray(delta_rows, np.float32), out)
    return out
