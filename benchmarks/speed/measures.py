"""Small measures of the speed benchmark: the break-even link speed (measured and projected to more
cores), GiB/s of 8-bit symbols as ns/symbol, and a digest of decoded arrays."""
from __future__ import annotations

import hashlib
import math

import numpy as np

from .config import PROJECTED_CORES


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


def projected_break_even(size_raw: float, size_c: float, t1: float, cores=PROJECTED_CORES) -> dict:
    """The break-even link speed projected to more cores by linear scaling of the 1-thread decode time
    ``t1`` (``t_decode = t1 / cores``; an assumption, not a measurement): ``{"decode_s_projected_<c>c",
    "break_even_Bps_projected_<c>c"}`` for every ``c`` in ``cores``."""
    out: dict = {}
    for c in cores:
        t = t1 / c
        out[f"decode_s_projected_{c}c"] = t
        out[f"break_even_Bps_projected_{c}c"] = break_even(size_raw, size_c, t)
    return out


GIB_IN_1E9 = 2 ** 30 / 1e9  # 1 GiB = 1.073741824e9 bytes


def ns_per_symbol(gib_per_s: float, bytes_per_symbol: float = 1.0) -> float:
    """ns per symbol of a decoder producing ``gib_per_s`` GiB/s of ``bytes_per_symbol``-byte symbols:
    ``ns = bytes_per_symbol / (GiB/s x 1.073741824)`` (1 GiB/s = 1.073741824 bytes per ns)."""
    return bytes_per_symbol / (gib_per_s * GIB_IN_1E9)


def arrays_digest(arrays: dict) -> str:
    """sha256 over the arrays' bytes in name order (names, shapes and dtypes included)."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(np.asarray(arrays[k]))
        h.update(f"{k}:{a.shape}:{a.dtype}".encode())
        h.update(a.view(np.uint8).reshape(-1).data)
    return h.hexdigest()
