"""Small measures of the speed benchmark: the break-even link speed and a digest of decoded arrays."""
from __future__ import annotations

import hashlib
import math

import numpy as np


def break_even(size_raw: float, size_c: float, t_decode: float) -> float | None:
    """Link speed (bytes/s) below which loading ``size_c`` bytes and decoding them in ``t_decode`` s
    beats loading ``size_raw`` bytes: ``size_c/B + t_decode < size_raw/B`` <=> ``B < (size_raw -
    size_c) / t_decode``. None when the compressed file is not smaller (never worth it); inf for a
    free decode."""
    if size_c >= size_raw:
        return None
    if t_decode <= 0:
        return math.inf
    return (size_raw - size_c) / t_decode


def arrays_digest(arrays: dict) -> str:
    """sha256 over the arrays' bytes in name order (names, shapes and dtypes included)."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(np.asarray(arrays[k]))
        h.update(f"{k}:{a.shape}:{a.dtype}".encode())
        h.update(a.view(np.uint8).reshape(-1).data)
    return h.hexdigest()
