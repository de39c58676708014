"""kvz's error measure: the normalised RMS error that ``eps`` bounds.

>>> nrmse([3.0, 4.0], [3.0, 4.0])
0.0
>>> round(nrmse([3.0, 4.0], [3.0, 4.5]), 12)
0.1
>>> nrmse([0.0, 0.0], [0.0, 0.0]), nrmse([0.0, 0.0], [0.0, 1e-9])
(0.0, inf)
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["nrmse"]


def nrmse(ref, got) -> float:
    """Normalised RMS error of ``got`` against ``ref``: ``||got - ref|| / ||ref||`` over all their
    values, computed in float64 (the measure a tensor's ``eps`` bounds). ``ref`` and ``got``: numpy
    arrays (ml_dtypes' bfloat16 included) or anything ``np.asarray`` takes, of one shape; convert a
    torch tensor first (:func:`alignpred.cache.as_numpy`).

    Zero-norm rule: when ``ref`` is all zeros the result is ``0.0`` if ``got`` is all zeros too and
    ``inf`` otherwise (any error is unbounded relative to nothing; kvz's encoder, whose budget is
    ``eps * ||ref||``, reproduces an all-zero tensor exactly)."""
    r, g = np.asarray(ref), np.asarray(got)
    if r.shape != g.shape:
        raise ValueError(f"nrmse of arrays of shapes {r.shape} and {g.shape} (they must match)")
    r = r.astype(np.float64, copy=False).ravel()
    d = g.astype(np.float64, copy=False).ravel() - r
    err, norm = float(d.dot(d)), float(r.dot(r))
    if norm > 0:
        return math.sqrt(err) / math.sqrt(norm)
    return 0.0 if err == 0 else math.inf
