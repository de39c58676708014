"""Generalized Procrustes Analysis: orthogonal rotations that align related blocks.

Given calibration samples ``S_v`` (same positions for every block ``v`` of a group), rows are
centred and normalised, and rotations ``A_v`` minimise ``sum_{u<v} ||S_u A_u - S_v A_v||_F^2``
with ``A_1 = I``. Alternating update: ``M_v = sum_{u != v} C_vu A_u`` with ``C_vu = S_v^T S_u``,
``M_v = U S W^T`` and ``A_v = U W^T``.

>>> import numpy as np
>>> rng = np.random.default_rng(1)
>>> s = rng.standard_normal((400, 6))
>>> q, _ = np.linalg.qr(rng.standard_normal((6, 6)))
>>> means, rots = fit_gpa([s, s @ q.T])
>>> bool(np.allclose(rots[0], np.eye(6))), bool(np.allclose(rots[1], q, atol=1e-6))
(True, True)
"""
from __future__ import annotations

import numpy as np


def normalise_rows(s: np.ndarray, mean: np.ndarray) -> np.ndarray:
    c = s - mean
    n = np.linalg.norm(c, axis=1, keepdims=True)
    return c / np.maximum(n, 1e-8)


def fit_gpa(samples: list[np.ndarray], max_iter: int = 100, tol: float = 1e-6):
    """Return ``(means, rotations)`` for a group of blocks ``samples[v]`` of shape ``[n, d]``."""
    m = len(samples)
    means = [np.asarray(s, np.float64).mean(axis=0) for s in samples]
    d = samples[0].shape[1]
    rots = [np.eye(d) for _ in range(m)]
    if m == 1:
        return means, rots
    bars = [normalise_rows(np.asarray(s, np.float64), mu) for s, mu in zip(samples, means)]
    cross = {(v, u): bars[v].T @ bars[u] for v in range(m) for u in range(m) if u != v}
    sq = [float(np.sum(b * b)) for b in bars]
    prev = None
    for _ in range(max_iter):
        for v in range(1, m):
            mv = sum(cross[(v, u)] @ rots[u] for u in range(m) if u != v)
            u_, _, wt = np.linalg.svd(mv)
            rots[v] = u_ @ wt
        # objective from the cross-products: sum_{u<v} |S_u|^2 + |S_v|^2 - 2 tr(A_u^T C_uv A_v)
        obj = (m - 1) * sum(sq) - 2.0 * sum(float(np.sum((cross[(u, v)] @ rots[v]) * rots[u]))
                                            for u in range(m) for v in range(u + 1, m))
        if prev is not None and abs(prev - obj) <= tol * max(abs(prev), 1e-30):
            break
        prev = obj
    return means, rots


def gpa_objective(bars, rots) -> float:
    """The GPA objective evaluated directly (for tests)."""
    z = [b @ a for b, a in zip(bars, rots)]
    return float(sum(np.sum((z[u] - z[v]) ** 2) for u in range(len(z)) for v in range(u + 1, len(z))))
