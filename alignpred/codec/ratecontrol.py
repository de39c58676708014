"""Rate control of the joint scopes (pooled, weighted): the steps per tensor that spend the whole
cache's error budget, every tensor within its cap. The per-unit step search is
:mod:`~alignpred.codec.ratesearch`; the budget itself is :class:`~alignpred.codec.budget.ErrorBudget`."""
from __future__ import annotations

import numpy as np

from alignpred.codec.ratesearch import BAND
from alignpred.errors import EncodeError

__all__ = ["step_shape", "joint_search"]


def step_shape(norm_t, weights=None) -> np.ndarray:
    """Relative steps per tensor that minimise bits for the scope's budget: equal steps for
    the pooled scope; ``||X_t|| / sqrt(w_t)`` for the weighted one (normalised to max 1)."""
    if weights is None:
        return np.ones(len(norm_t))
    s = np.sqrt(np.maximum(norm_t, 1e-300) / weights)
    return s / s.max()

def joint_search(evaluate, d0, norm_t, eps: float, tensor_cap: float, weights=None, scope: str = "pooled",
                 aim: float = 0.997, widen: int = 0, plain=None, plain_cap: float = 0.0):
    """Pooled and weighted scopes: the largest steps with the cache's (weighted) error within
    ``eps`` and, with a cap, every tensor's NRMSE within ``tensor_cap × eps``. Steps are
    ``g × shape_t`` (:func:`step_shape`), except that a tensor that would pass its cap gets
    the step that holds it at the cap.

    Model-based: each tensor's squared error is close to ``c_t · step_t²``; after every pass
    ``c_t`` is re-measured, the cap steps follow, and ``g`` solves ``Σ u_t c_t min(g shape_t,
    cap_t)² = aim · target`` (bisection; ``u_t = w_t / ||X_t||²``, 1 when pooled); it stops
    when both constraints hold and the budget is used to within the band below its target
    (0.6 %, doubling per pass from the ``widen``-th pass on). ``evaluate(steps per tensor)``
    returns ``(squared errors per tensor, result)``; returns ``(steps, result)``.

    ``plain`` (the attention scope): a callable giving ``(plain squared errors, plain squared
    norms)`` per tensor of the last evaluation; every tensor's plain NRMSE must then also stay
    within ``plain_cap``. It is held as a cap in the scope's measure, re-derived after every pass
    from the measured ratio of the two errors (which hardly moves with the step)."""
    norm_t = np.asarray(norm_t, np.float64)
    if weights is None:
        u = np.ones(len(norm_t))
        target = eps ** 2 * float(norm_t.sum())
    else:  # zero tensors have no error to weigh
        u = np.where(norm_t > 0, weights / np.maximum(norm_t, 1e-300), 0.0)
        target = eps ** 2 * float(weights[norm_t > 0].sum())
    shape = step_shape(norm_t, weights)
    cap_base = (tensor_cap * eps) ** 2 * norm_t if tensor_cap else np.full(len(norm_t), np.inf)
    cap_t = cap_base

    def caps(e):  # the scope's cap per tensor, tightened where the plain error would pass plain_cap
        if plain is None or not plain_cap:
            return cap_base
        pe, pn = plain()
        with np.errstate(divide="ignore", invalid="ignore"):
            held = np.where(pe > 0, e * (plain_cap ** 2 * pn) / np.maximum(pe, 1e-300), np.inf)
        return np.minimum(cap_base, held)

    d = np.asarray(d0, np.float64).copy()
    best = None
    cap_hi = np.full(len(d), np.inf)  # smallest step seen above the cap, per tensor
    cap_lo = np.zeros(len(d))  # largest step seen within it
    capped = np.isfinite(cap_t)
    for it in range(16):
        e, res = evaluate(d.astype(np.float32))
        cap_t = caps(e)
        capped = np.isfinite(cap_t)
        tot = float(np.sum(u * e))
        over = e > cap_t
        caps_ok = not over.any()
        band = BAND * (2.0 ** max(0, it + 1 - widen) if widen else 1.0)
        if tot <= target and caps_ok:
            if best is None or tot > best[0]:
                best = (tot, d.copy(), res)
            if tot >= target * (1.0 - band):
                return d, res
        cap_hi = np.where(over, np.minimum(cap_hi, d), cap_hi)
        cap_lo = np.where(capped & ~over, np.maximum(cap_lo, d), cap_lo)
        c = np.where(e > 0, e / np.maximum(d, 1e-300) ** 2, 0.0)
        # a cap is a bound, not a target: aim 2 % below it, and keep each tensor's cap step inside
        # the bracket its own measurements give (errors are only roughly quadratic in the step)
        cap_step = np.where(c > 0, np.sqrt(0.98 * cap_t / np.maximum(c, 1e-300)), np.inf)
        bracket = np.isfinite(cap_hi) & (cap_lo > 0)
        outside = bracket & ((cap_step <= cap_lo) | (cap_step >= cap_hi))
        cap_step = np.where(outside, np.sqrt(cap_lo * np.where(bracket, cap_hi, 1.0)), cap_step)
        cap_step = np.where(np.isfinite(cap_hi), np.minimum(cap_step, cap_hi * 0.995), cap_step)
        live = (c > 0) & (u > 0)

        def budget(g):
            return float(np.sum(u * c * np.minimum(g * shape, cap_step) ** 2))

        g_lo = 0.0
        g_hi = float(np.max(np.where(np.isfinite(cap_step), cap_step, d) / shape)) * 4.0 + 1e-30
        while budget(g_hi) < aim * target and g_hi < 1e30 and np.any(~np.isfinite(cap_step) & live):
            g_hi *= 4.0
        for _ in range(60):
            g = 0.5 * (g_lo + g_hi)
            if budget(g) <= aim * target:
                g_lo = g
            else:
                g_hi = g
        new = np.minimum(g_lo * shape, cap_step)
        new = np.where(np.isfinite(new) & (new > 0), new, d)
        if not (tot <= target and caps_ok):  # infeasible: never move a failing unit up
            failing = (e > cap_t) | ((u * e) > 0) & (tot > target)
            new = np.where(failing, np.minimum(new, d * 0.999), new)
        d = new
    if best is not None and best[0] >= target * 0.9:
        return best[1], best[2]
    # The model did not settle: from the last steps, shrink what fails until both constraints
    # hold (a feasible point far below the budget, e.g. the first guess, is kept only if this
    # does worse).
    for _ in range(100):
        e, res = evaluate(d.astype(np.float32))
        cap_t = caps(e)
        tot = float(np.sum(u * e))
        if tot <= target and np.all(e <= cap_t):
            if best is not None and best[0] > tot:
                return best[1], best[2]
            return d, res
        d = d * (0.99 if tot > target else 1.0)
        d = np.where(e > cap_t, d * 0.99, d)
    if best is not None:
        return best[1], best[2]
    raise EncodeError(f"cannot meet the {scope} error budget and the tensor cap together")
