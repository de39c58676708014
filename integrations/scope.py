"""The error budget of an engine's store (issue 37, item 2): what the vLLM connector, LMCache, SGLang and the
chunk store compress their lossy KV with.

An engine saving a prefix has no capture statistics of it (the prefill's attention weights are gone), so
the attention scope there weighs channels by the bank's attention statistics (``<bank>.attention.json``)
and positions alike. Two things beyond the sidecar's weights make that scope an engine default:

* **KL calibration.** The attention measure is not the weighted scope's: at the same ``eps`` it costs
  about twice the KL the sensitivity record predicts on 1,024-token contexts. The sidecar's
  :attr:`~alignpred.bank.AttentionStats.kl_per_eps2` (mean next-token KL per eps², measured for this
  mode: bank statistics, prefix-safe) turns a KL target into ``eps = sqrt(target_kl / kl_per_eps2)``.
* **Any block prefix is read.** A stored run is a later prompt's prefix at block granularity, not only
  continued after its end, so the positions a sliding-window layer would never attend again *after the
  run's end* are coded like the others (the stats are used with ``sliding_window = 0``).

``target_kl`` is a mean next-token KL or ``"fp8"`` (:data:`~alignpred.codec.budget.FP8_KL`: FP8 e4m3's
KL on 1,024-token contexts). A store given ``eps`` keeps the plain tensor scope it always used.

>>> b = StoreBudget.choose(None, eps=0.02)
>>> b.scope, b.eps, b.describe()
('tensor', 0.02, 'tensor scope, eps 0.02 (as configured)')
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["StoreBudget", "engine_budget", "parse_target_kl", "FALLBACK_EPS"]

FALLBACK_EPS = 0.0267  # a bank without attention statistics nor sensitivity record: the tensor scope at this eps


def parse_target_kl(value) -> float:
    """A KL target from configuration: a positive number, or ``"fp8"`` (FP8 e4m3's KL)."""
    from alignpred.codec import named_kl

    return named_kl(value)


@dataclass(frozen=True)
class StoreBudget:
    """The budget a store encodes with: ``scope`` (``attention``, ``weighted`` or ``tensor``), ``eps``
    (None: from ``target_kl`` by the writer), ``target_kl``, the statistics the attention scope uses and
    ``reason`` (a line for the log)."""

    scope: str
    eps: float | None
    target_kl: float | None
    attention_stats: Any = None
    reason: str = ""
    any_prefix: bool = True

    @classmethod
    def choose(cls, bank, *, eps=None, target_kl=None, scope: str | None = None,
               fallback_eps: float = FALLBACK_EPS, any_prefix: bool = True) -> StoreBudget:
        """The budget of a store's settings: ``eps`` alone keeps the plain scope (``scope`` or
        ``tensor``); otherwise ``target_kl`` (default ``"fp8"``) in the attention scope when ``bank``
        has attention statistics, else in the weighted scope when it has a sensitivity record, else
        the tensor scope at ``fallback_eps``. ``eps`` with ``scope="attention"``: that scope at
        that eps. ``any_prefix=False``: the stored KV is only ever continued after its end, so the
        positions a sliding-window layer never attends again are coded coarse (not for block stores
        whose runs are read as prefixes)."""
        from alignpred.errors import KvzError

        if eps is not None and target_kl is not None:
            raise KvzError("give the store eps or target_kl, not both")
        if eps is not None and not _attention(scope):
            e = _eps(eps)
            return cls(scope or "tensor", e, None, None, f"{scope or 'tensor'} scope, eps {e:g} (as configured)")
        stats = _engine_stats(bank, any_prefix)
        if eps is not None:
            if stats is None:
                raise KvzError("the attention scope needs the bank's attention statistics, and this bank has none")
            e = _eps(eps)
            return cls("attention", e, None, stats, f"attention scope (bank statistics), eps {e:g} (as configured)",
                       any_prefix=any_prefix)
        kl = parse_target_kl("fp8" if target_kl is None else target_kl)
        what = f"target KL {kl:.3g}" + (" (FP8 e4m3's)" if target_kl in (None, "fp8") else "")
        if stats is not None and stats.kl_per_eps2 > 0:
            c = stats.kl_per_eps2 if any_prefix else stats.meta.get("kl_per_eps2_stale", stats.kl_per_eps2)
            e = math.sqrt(kl / float(c))
            if not 0 < e < 1:
                raise KvzError(f"target_kl {kl:g} gives eps {e:.4g}, outside (0, 1)")
            return cls("attention", e, kl, stats, f"attention scope (bank statistics, no capture statistics"
                                                  f"{'' if any_prefix else ', stale rows coarse'}), {what} -> eps "
                                                  f"{e:.4g} ({float(c):.3g} KL per eps²)", any_prefix)
        if bank is not None and _has_sensitivity(bank):
            return cls("weighted", None, kl, None, f"weighted scope (bank sensitivity record), {what}"
                                                   + ("; the bank's attention statistics carry no KL calibration"
                                                      if stats is not None else ""))
        return cls("tensor", float(fallback_eps), None, None,
                   f"tensor scope, eps {fallback_eps:g}: no bank with calibrated attention statistics or a "
                   "sensitivity record")

    def budget(self, tensor_cap: float | None = None, lossless: bool = False):
        """The :class:`~alignpred.ErrorBudget` that :func:`alignpred.compress` takes (``target_kl``
        recorded in the header where it chose eps; the attention statistics it chose; ``lossless``:
        with the exact tier)."""
        from alignpred import ErrorBudget

        kw: dict[str, Any] = {} if tensor_cap is None else {"tensor_cap": tensor_cap}
        if self.target_kl is not None:
            kw.update(target_kl=self.target_kl, eps_from_kl=self.eps is not None)
        return ErrorBudget(eps=self.eps, scope=self.scope, attention_stats=self.attention_stats, lossless=lossless,
                           **kw)

    def binding(self) -> dict:
        """What a store's keys bind: a different budget never matches stale KV."""
        out = {"scope": self.scope, "eps": None if self.eps is None else round(self.eps, 6),
               "target_kl": self.target_kl}
        if _attention(self.scope) and not self.any_prefix:
            out["any_prefix"] = False
        return out

    def describe(self) -> str:
        return self.reason


def engine_budget(bank, *, eps=None, target_kl=None, scope: str | None = None):
    """:meth:`StoreBudget.choose`'s :class:`~alignpred.ErrorBudget` (``compress(..., budget=...)``)."""
    return StoreBudget.choose(bank, eps=eps, target_kl=target_kl, scope=scope).budget()


def _attention(scope) -> bool:
    """Whether ``scope`` (a name or None) measures as the attention scope does (its strategy,
    :func:`alignpred.codec.scope_of`; None or an unknown name does not)."""
    from alignpred.codec import SCOPES, scope_of

    return scope in SCOPES and scope_of(scope).attention


def _eps(v) -> float:
    from alignpred.errors import KvzError

    try:
        e = float(v)
    except (TypeError, ValueError):
        raise KvzError(f"eps must be a number in (0, 1), got {v!r}") from None
    if not 0 < e < 1:
        raise KvzError(f"eps must be a number in (0, 1), got {v!r}")
    return e


def _engine_stats(bank, any_prefix: bool = True):
    """The bank's attention statistics (``any_prefix``: made prefix-safe, ``sliding_window = 0``), or None."""
    if bank is None:
        return None
    from alignpred.bank import AttentionStats
    from alignpred.errors import KvzError

    try:
        stats = AttentionStats.find(bank)
    except KvzError:
        return None
    if stats is None or not stats.fits(bank):
        return None
    return replace(stats, sliding_window=0) if any_prefix else stats


def _has_sensitivity(bank) -> bool:
    from alignpred.bank import sensitivity

    return sensitivity(bank.id, bank.model) is not None
