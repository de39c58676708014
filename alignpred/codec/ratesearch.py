"""The step search: the largest quantisation steps whose *measured* errors meet their budgets.

>>> import numpy as np
>>> f = lambda d: (d ** 2, None)                   # error grows as the step squared
>>> d, _ = bracket_search(f, np.array([1.0]), np.array([0.25]))
>>> bool(0.25 * 0.994 <= d[0] ** 2 <= 0.25)
True
"""
from __future__ import annotations

import numpy as np

from alignpred.errors import EncodeError

BAND = 0.006  # a unit is done when its error is within 0.6 % below its budget


def bracket_search(evaluate, d0, target, what: str = "", aim: float = 1.0, iters: int = 14, widen: int = 0):
    """Largest steps ``d`` (one per unit) with ``evaluate(d)[0] <= target``, each within 0.6 % of
    its target where possible. ``evaluate(d)`` returns ``(errors per unit, result)``; returns
    ``(d, result at d)``. Errors grow with the step (about as its square); the next try scales
    each step by ``sqrt(aim * target / error)`` inside the bracket of feasible/infeasible
    steps seen so far. Units interact only weakly, so each keeps its own bracket. With
    ``widen = k``, the 0.6 % band doubles after every try from the k-th on (whole-cache passes
    are expensive; a unit a little under its budget costs a few thousandths of a bit)."""
    lo = np.zeros_like(d0)
    hi = np.full_like(d0, np.inf)
    best = None
    delta = d0.copy()
    e = None
    for it in range(iters):
        e, res = evaluate(delta)
        ok = e <= target
        lo = np.where(ok, np.maximum(lo, delta), lo)
        hi = np.where(ok, hi, np.minimum(hi, delta))
        band = BAND * (2.0 ** max(0, it + 1 - widen) if widen else 1.0)
        if ok.all():
            best = (delta.copy(), res)
            if np.all(e >= target * (1.0 - band)):
                return best
        ratio = np.sqrt(np.where(e > 0, aim * target / np.maximum(e, 1e-300), 4.0))
        nxt = delta * np.clip(ratio, 0.5, 2.0) * np.where(ok, 1.0, 0.999)
        bracket = np.isfinite(hi) & (lo > 0)
        outside = (nxt <= lo) | (nxt >= hi)
        nxt = np.where(bracket & outside, np.sqrt(np.maximum(lo, 1e-300) * np.where(np.isfinite(hi), hi, 1.0)), nxt)
        # Units already inside the band below their target keep their step.
        done = ok & (e >= target * (1.0 - band))
        delta = np.where(done, delta, np.where(ok, nxt, np.minimum(nxt, delta * 0.999)))
    if best is not None and np.allclose(best[0], lo):
        return best
    # Each unit's largest feasible step, tried together; if that fails (units interacting), the
    # last all-feasible try is kept; without one, failing units halve until all are met.
    cand = np.where(lo > 0, lo, delta * 0.5)
    e, res = evaluate(cand)
    while not (e <= target).all():
        if best is not None:
            return best
        cand = np.where(e <= target, cand, cand * 0.5)
        if np.any(cand[e > target] < 1e-30):
            raise EncodeError(f"{what}cannot meet the error budget (eps too small for this data?)")
        e, res = evaluate(cand)
    return cand, res
