"""Shared machinery for the baseline coders: result record, error metric, knob search, timing driver.

A baseline is described by a :class:`TensorCodec` (how to code one tensor at one knob value) and run by
:func:`run_codec`, which finds the knob for the requested error under the requested allocation, then times one
clean encode pass and one decode pass of the whole cache at the chosen knobs.

Error metric: NRMSE = ||X^ - X||_F / ||X||_F in float64, after the reconstruction is cast back to the source dtype.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

ALLOCS = ("tensor", "pooled")


@dataclass
class Result:
    method: str
    alloc: str
    eps_target: float | None
    bpv: float
    nrmse_pooled: float
    nrmse_max_tensor: float
    encode_s: float
    decode_s: float
    n_values: int
    extra: dict = field(default_factory=dict)


class Baseline(Protocol):
    name: str

    def run(self, cache: dict[str, np.ndarray], eps: float | None, alloc: str,
            calib: list[dict] | None = None) -> Result: ...


# --------------------------------------------------------------------------- error metric

def cast_back(y: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast a reconstruction to the source dtype (float32 detour for narrow float types, like a real store)."""
    dtype = np.dtype(dtype)
    if y.dtype == dtype:
        return y
    if dtype.itemsize < 4:
        return np.asarray(y, dtype=np.float32).astype(dtype)
    return np.asarray(y).astype(dtype)


def sq_err(x: np.ndarray, x_hat: np.ndarray) -> float:
    """Squared Frobenius error in float64 after casting ``x_hat`` to ``x``'s dtype."""
    d = cast_back(x_hat, x.dtype).astype(np.float64) - x.astype(np.float64)
    return float(np.einsum("i,i->", d.ravel(), d.ravel()))


def sq_norm(x: np.ndarray) -> float:
    v = x.astype(np.float64).ravel()
    return float(np.einsum("i,i->", v, v))


def error_stats(cache: dict[str, np.ndarray], recon: dict[str, np.ndarray]) -> tuple[float, float, dict[str, float]]:
    """(pooled NRMSE, max per-tensor NRMSE, per-tensor NRMSE) of ``recon`` against ``cache``."""
    tot_e = tot_n = 0.0
    per = {}
    for k, x in cache.items():
        e, n = sq_err(x, recon[k]), sq_norm(x)
        tot_e += e
        tot_n += n
        per[k] = math.sqrt(e / n) if n > 0 else 0.0
    pooled = math.sqrt(tot_e / tot_n) if tot_n > 0 else 0.0
    return pooled, max(per.values()) if per else 0.0, per


def n_values(cache: dict[str, np.ndarray]) -> int:
    return int(sum(x.size for x in cache.values()))


# --------------------------------------------------------------------------- knob search

def search_continuous(f: Callable[[float], float], k0: float, target: float, steps: int = 8,
                      tol: float = 0.02) -> tuple[float, float, bool, int]:
    """Find the largest knob ``k`` (error increasing in ``k``) with ``f(k) <= target``.

    Regula falsi in log-knob/log-error space inside a bracket, geometric extrapolation outside it. Stops early when
    the error is within ``tol`` (relative) below the target. Returns (knob, error, met, evaluations); when no
    evaluated knob met the target, the knob with the smallest error is returned with ``met=False``.
    """
    lo: tuple[float, float] | None = None  # feasible (k, err), largest k
    hi: tuple[float, float] | None = None  # infeasible (k, err), smallest k
    best_bad: tuple[float, float] | None = None
    k = float(k0)
    n = 0
    for n in range(1, steps + 1):  # noqa: B007 - n is the evaluation count returned below
        e = float(f(k))
        if e <= target:
            if lo is None or k > lo[0]:
                lo = (k, e)
            if e >= target * (1 - tol):
                break
        else:
            if hi is None or k < hi[0]:
                hi = (k, e)
            if best_bad is None or e < best_bad[1]:
                best_bad = (k, e)
        if lo is not None and hi is not None:
            a, b = math.log(lo[0]), math.log(hi[0])
            if lo[1] > 0:
                ea, eb = math.log(lo[1]), math.log(hi[1])
                t = (math.log(target * (1 - tol / 2)) - ea) / (eb - ea) if eb > ea else 0.5
            else:
                t = 0.5
            t = min(max(t, 0.15), 0.85)
            k = math.exp(a + t * (b - a))
        elif lo is not None:  # all feasible so far: grow
            k = lo[0] * (min(max(target / lo[1], 1.25), 16.0) if lo[1] > 0 else 16.0)
        else:  # all infeasible: shrink
            k = hi[0] * max(min(target / hi[1] * 0.97, 0.8), 1 / 16)
    if lo is not None:
        return lo[0], lo[1], True, n
    assert best_bad is not None
    return best_bad[0], best_bad[1], False, n


def search_discrete(f: Callable[[Any], float], values: Sequence[Any], target: float, start: int | None = None,
                    predict: Callable[[int, float, float], int] | None = None) -> tuple[Any, float, bool, int]:
    """``values`` ordered by increasing error (decreasing rate): find the last index with ``f <= target``.

    Without ``start``: plain bisection. With ``start`` (a guessed index) and optionally ``predict(i, err, target)``
    (a model-based next index): probe there, then gallop (1, 2, 4, ... steps) to a bracket and bisect it.
    Returns (value, error, met, evaluations); if even ``values[0]`` misses the target it is returned, met=False.
    """
    cache: dict[int, float] = {}
    n = len(values)

    def g(i: int) -> float:
        if i not in cache:
            cache[i] = float(f(values[i]))
        return cache[i]

    lo, hi = -1, n  # invariant: g(lo) <= target (or lo=-1), g(hi) > target (or hi=n)
    if start is not None:
        i = min(max(int(start), 0), n - 1)
        e = g(i)
        if predict is not None:
            j = min(max(int(predict(i, e, target)), 0), n - 1)
            if j != i:
                (lo, hi) = (i, hi) if e <= target else (lo, i)
                i, e = j, g(j)
        step = 1
        while True:
            if e <= target:
                lo = max(lo, i)
                if i + 1 >= hi:
                    break
                i = min(i + step, hi - 1)
            else:
                hi = min(hi, i)
                if i - 1 <= lo:
                    break
                i = max(i - step, lo + 1)
            e = g(i)
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if g(mid) <= target:
            lo = mid
        else:
            hi = mid
    if lo >= 0:
        return values[lo], cache[lo], True, len(cache)
    g(0)
    return values[0], cache[0], False, len(cache)


# --------------------------------------------------------------------------- codec interface + driver

@dataclass
class Encoded:
    bits: int          # every bit the decoder needs for this tensor (payload + per-tensor metadata)
    payload: Any       # whatever decode() needs
    meta_bits: int = 0  # of which metadata (scales, headers, ...)
    pre_s: float = 0.0  # time of a deterministic pre-transform reused from an earlier encode (added to encode time)


class TensorCodec:
    """One method = how to code one tensor at a knob value.

    ``knob_kind``: "none" (fixed rate), "continuous" (positive real, error increasing in the knob; searched with
    :func:`search_continuous` from :meth:`knob_guess`) or "discrete" (:attr:`knob_values`, ordered by increasing
    error).
    """
    name: str = "?"
    knob_kind: str = "none"
    knob_name: str = ""
    knob_values: Sequence[Any] = ()
    uses_calib: bool = False
    max_steps: int = 8

    # -- to override
    def prepare(self, cache: dict[str, np.ndarray], calib: list[dict] | None) -> dict:
        """Per-run context (e.g. PCA banks from calibration caches). Not timed as encode."""
        return {}

    def encode(self, name: str, x: np.ndarray, knob: Any, ctx: dict) -> Encoded:
        raise NotImplementedError

    def decode(self, name: str, enc: Encoded, shape: tuple, ctx: dict) -> np.ndarray:
        raise NotImplementedError

    def trial(self, name: str, x: np.ndarray, knob: Any, ctx: dict) -> np.ndarray:
        """Reconstruction at ``knob`` (used by the search); default: encode then decode."""
        return self.decode(name, self.encode(name, x, knob, ctx), x.shape, ctx)

    def knob_guess(self, xs: list[np.ndarray], eps: float, ctx: dict) -> float:
        raise NotImplementedError

    def discrete_hint(self, xs: list[np.ndarray], eps: float, ctx: dict) -> tuple:
        """(start index, predict function) for :func:`search_discrete`, or () for plain bisection."""
        return ()

    def bank_info(self, ctx: dict) -> dict:
        return {}

    # -- driver
    def run(self, cache: dict[str, np.ndarray], eps: float | None, alloc: str = "tensor",
            calib: list[dict] | None = None) -> Result:
        return run_codec(self, cache, eps, alloc, calib)


def run_codec(codec: TensorCodec, cache: dict[str, np.ndarray], eps: float | None, alloc: str,
              calib: list[dict] | None = None) -> Result:
    if alloc not in ALLOCS:
        raise ValueError(f"alloc must be one of {ALLOCS}, got {alloc!r}")
    if codec.uses_calib and not calib:
        raise ValueError(f"{codec.name} needs calibration caches (calib=[...])")
    names = list(cache)
    t0 = time.perf_counter()
    ctx = codec.prepare(cache, calib)
    # Encodings made during the search (default trial = encode + decode) are kept with their encode time, so the
    # final pass reuses them instead of encoding again; the decode pass is always run afresh.
    memo: dict[tuple, tuple[Encoded, float]] = {}
    default_trial = type(codec).trial is TensorCodec.trial
    if default_trial:
        def trial(k, x, q, ctx):
            key = (k, _hashable(q))
            if key not in memo:
                t = time.perf_counter()
                memo[key] = (codec.encode(k, x, q, ctx), time.perf_counter() - t)
            return codec.decode(k, memo[key][0], x.shape, ctx)
    else:
        trial = codec.trial
    prepare_s = time.perf_counter() - t0

    # ---- choose knobs
    t0 = time.perf_counter()
    knobs: dict[str, Any] = {}
    met_all = True
    evals = 0
    if codec.knob_kind == "none" or eps is None:
        default = getattr(codec, "default_knob", None)
        if codec.knob_kind != "none" and default is None:
            raise ValueError(f"{codec.name} has no natural setting: give eps")
        knobs = {k: default for k in names}
        met_all = None  # decided after measuring
    else:
        norms = {k: sq_norm(cache[k]) for k in names}
        if alloc == "tensor":
            for k in names:
                x = cache[k]

                def f(q, k=k, x=x):
                    return math.sqrt(sq_err(x, trial(k, x, q, ctx)) / norms[k]) if norms[k] > 0 else 0.0

                if codec.knob_kind == "continuous":
                    q, _, met, n = search_continuous(f, codec.knob_guess([x], eps, ctx), eps, codec.max_steps)
                else:
                    q, _, met, n = search_discrete(f, codec.knob_values, eps, *codec.discrete_hint([x], eps, ctx))
                knobs[k] = q
                met_all &= met
                evals += n
        else:
            tot_n = sum(norms.values())

            def f(q):
                tot = sum(sq_err(cache[k], trial(k, cache[k], q, ctx)) for k in names)
                return math.sqrt(tot / tot_n) if tot_n > 0 else 0.0

            if codec.knob_kind == "continuous":
                q, _, met_all, evals = search_continuous(f, codec.knob_guess([cache[k] for k in names], eps, ctx),
                                                         eps, codec.max_steps)
            else:
                q, _, met_all, evals = search_discrete(f, codec.knob_values, eps,
                                                       *codec.discrete_hint([cache[k] for k in names], eps, ctx))
            knobs = {k: q for k in names}
    search_s = time.perf_counter() - t0

    # ---- one timed encode pass, one timed decode pass
    encs = {}
    encode_s = 0.0
    for k in names:
        hit = memo.get((k, _hashable(knobs[k])))
        if hit is None:
            t0 = time.perf_counter()
            encs[k] = codec.encode(k, cache[k], knobs[k], ctx)
            encode_s += time.perf_counter() - t0 + encs[k].pre_s
        else:
            encs[k], dt = hit
            encode_s += dt + encs[k].pre_s
    memo.clear()
    t0 = time.perf_counter()
    recon = {k: cast_back(codec.decode(k, encs[k], cache[k].shape, ctx), cache[k].dtype) for k in names}
    decode_s = time.perf_counter() - t0

    pooled, worst, per = error_stats(cache, recon)
    nv = n_values(cache)
    bits = sum(e.bits for e in encs.values())
    meta = sum(e.meta_bits for e in encs.values())
    if met_all is None:  # fixed rate: report what it reaches
        met_all = None if eps is None else bool((worst if alloc == "tensor" else pooled) <= eps)
    extra = {
        "knob": codec.knob_name or None,
        "knobs": {k: _jsonable(v) for k, v in knobs.items()},
        "meets_target": met_all,
        "fixed_rate": codec.knob_kind == "none",
        "search_s": search_s,
        "search_evals": evals,
        "prepare_s": prepare_s,
        "meta_bits": meta,
        "total_bits": bits,
        "per_tensor_nrmse": per,
    }
    extra.update(codec.bank_info(ctx))
    return Result(codec.name, alloc, eps, bits / nv, pooled, worst, encode_s, decode_s, nv, extra)


def _hashable(v):
    return v.item() if isinstance(v, (np.floating, np.integer)) else v


def _jsonable(v):
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    return v
