"""The error budget: one frozen, validated value that the CLI, the writer, the encoder and the
header all read (eps, scope, tensor cap, tensor weights, target KL, the statistics the attention
scope weighs by, and whether the exact tier is added). :func:`~alignpred.compress` takes it as
``budget=``; :meth:`ErrorBudget.from_options` is the one place loose options become one.

>>> b = ErrorBudget(eps=0.03)
>>> b.scope, b.cap
('tensor', 0.0)
>>> ErrorBudget(eps=0.03, scope="pooled").cap
3.0
>>> ErrorBudget(target_kl=1e-3).scope
'weighted'
>>> ErrorBudget(eps=0)
Traceback (most recent call last):
...
alignpred.errors.KvzError: eps must be a number in (0, 1), got 0
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from alignpred.codec.scopes import SCOPE_REGISTRY, Scope, scope_of
from alignpred.errors import KvzError

__all__ = ["ErrorBudget", "SCOPES", "JOINT", "WEIGHTED", "TENSOR_CAP", "PLAIN_CAP", "DEFAULT_EPS", "STEP_UNIT",
           "TensorMeta", "FP8_KL", "named_kl"]

# the scope names (alignpred.codec.scopes), in registry order
SCOPES = tuple(s.name for s in SCOPE_REGISTRY)
JOINT = tuple(s.name for s in SCOPE_REGISTRY if s.joint)  # scopes whose budget spans the whole cache
WEIGHTED = tuple(s.name for s in SCOPE_REGISTRY if s.weighted)  # budget weighs tensors by their effect on the model
TENSOR_CAP = 3.0  # joint scopes: default cap of every tensor's NRMSE, in multiples of eps
PLAIN_CAP = 0.5  # attention scope: every tensor's plain NRMSE over the positions a later query reads
DEFAULT_EPS = 0.03  # what `kvz compress` uses when neither --eps nor --target-kl is given
# FP8 e4m3's mean next-token KL on Gemma 3 270M's 1,024-token contexts (8 prompts of the rate study's held-out
# documents, 32 teacher-forced tokens; `python -m kvz.benchmarks.rate_quality --long`,
# benchmarks/results/rate_quality-long.md): what target_kl="fp8" means (docs/engine-scope.md)
FP8_KL = 2.02e-3
STEP_UNIT = 32  # tensors[].step_codes: a channel's step multiplier is code / STEP_UNIT (code 1..255)


def named_kl(value) -> float:
    """A KL target: a positive number, or ``"fp8"`` (:data:`FP8_KL`).

    >>> named_kl("fp8"), named_kl("1e-3"), named_kl(0.002)
    (0.00202, 0.001, 0.002)
    """
    if isinstance(value, str):
        if value.strip().lower() == "fp8":
            return FP8_KL
        try:
            value = float(value)
        except ValueError:
            raise KvzError(f"target_kl must be a positive number or 'fp8', got {value!r}") from None
    if not (_number(value) and value > 0):
        raise KvzError(f"target_kl must be a positive number or 'fp8', got {value!r}")
    return float(value)


def _number(v) -> bool:
    return isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class ErrorBudget:
    """What the encoder must meet, measured by decoding.

    ``eps``: the NRMSE bound in every unit of ``scope`` (``object``, ``tensor``, ``pooled`` or
    ``weighted``). ``tensor_cap``: joint scopes bound every tensor's NRMSE by ``tensor_cap × eps``
    (0 = no cap; ignored by the other scopes, see :attr:`cap`). ``weights``: the weighted scope's
    per-tensor weights ``{tensor name: w > 0}`` (None: the bank's sensitivity record).
    ``target_kl`` instead of ``eps``: a mean next-token KL; it implies the weighted scope (or
    the attention scope, given as such — or chosen by the writer when no scope was given,
    ``auto_scope``, and the bank has attention statistics) and becomes ``eps = sqrt(target_kl /
    sum w)`` once the weights are known (:meth:`resolved`).
    ``plain_cap`` (attention scope; 0 = none): every tensor's plain NRMSE over the positions a
    later query reads stays within it, so no component is silently destroyed.
    ``attention_stats`` (attention scope): the :class:`~alignpred.bank.AttentionStats` of the
    bank (None: the bank's sidecar, which ``kvz calibrate`` fits from captures made with
    ``--attention-stats``); ``capture_stats``: the :class:`~alignpred.bank.CaptureStats` of the
    prefill that made the cache, for per-position weights (None: the ``.capture-stats.json``
    beside the cache file, as ``kvz capture --attention-stats`` writes it; without one,
    positions get no weights of their own).
    ``lossless``: the file also carries the refinement tier (:mod:`alignpred.codec.refine`) and
    decodes to the original bits exactly; ``eps`` then bounds its coarse tier, which stays
    readable alone (``KvzReader(..., tier="coarse")``), e.g. as a drafter's cache.

    >>> ErrorBudget(eps=0.03, lossless=True).lossless
    True
    >>> ErrorBudget(eps=0.03, capture_stats=object())
    Traceback (most recent call last):
    ...
    alignpred.errors.KvzError: attention_stats and capture_stats are used by the attention scope only
    """

    eps: float | None = None
    scope: str = "tensor"
    tensor_cap: float = TENSOR_CAP
    weights: dict | None = field(default=None, compare=False)
    target_kl: float | None = None
    eps_from_kl: bool = False  # set by resolved(): eps was derived from target_kl
    auto_scope: bool = False  # target_kl without a scope: the writer takes the best scope the bank supports
    plain_cap: float = PLAIN_CAP  # attention scope: cap of every tensor's plain NRMSE over the positions read
    lossless: bool = False  # add the refinement tier: the file decodes to the original bits
    attention_stats: Any = field(default=None, compare=False, repr=False)  # attention scope: bank statistics
    capture_stats: Any = field(default=None, compare=False, repr=False)  # attention scope: the prefill's

    def __post_init__(self):
        scope_of(self.scope)  # an unknown scope is a KvzError
        if self.target_kl is not None:
            if self.eps is not None and not self.eps_from_kl:
                raise KvzError("give eps or target_kl, not both")
            if not (_number(self.target_kl) and self.target_kl > 0):
                raise KvzError(f"target_kl must be a positive number, got {self.target_kl!r}")
            if not self.strategy.weighted:
                object.__setattr__(self, "scope", "weighted")
        elif self.eps is None:
            raise KvzError("give the error bound eps (e.g. eps=0.03) or a quality target target_kl")
        if self.eps is not None and not (_number(self.eps) and 0 < self.eps < 1):
            raise KvzError(f"eps must be a number in (0, 1), got {self.eps!r}")
        if not (_number(self.plain_cap) and 0 <= self.plain_cap <= 10):
            raise KvzError(f"plain_cap must be 0 (no cap) or a number in (0, 10], got {self.plain_cap!r}")
        if not (_number(self.tensor_cap) and (self.tensor_cap == 0 or 1.0 <= self.tensor_cap < 1e6)):
            raise KvzError(f"tensor_cap must be 0 (no cap) or a number >= 1, got {self.tensor_cap!r}")
        if self.weights is not None:
            if not self.strategy.weighted:
                raise KvzError("tensor weights are used by the weighted and attention scopes only")
            if not isinstance(self.weights, dict):
                raise KvzError("weights must be a mapping {tensor name: positive weight}")
        if not isinstance(self.lossless, bool):
            raise KvzError(f"lossless must be True or False, got {self.lossless!r}")
        if (self.attention_stats is not None or self.capture_stats is not None) and not (
                self.strategy.attention or self.auto_scope):
            raise KvzError("attention_stats and capture_stats are used by the attention scope only")

    @classmethod
    def from_options(cls, eps=None, scope: str | None = None, tensor_cap=None, weights=None, target_kl=None,
                     plain_cap=None, lossless: bool = False, attention_stats=None, capture_stats=None):
        """The budget of loose options, as the CLI's flags give them (the one place they are
        taken): ``None`` means the default; ``target_kl`` without a ``scope`` lets the writer
        take the best scope the bank supports (``auto_scope``). The CLI defaults ``eps`` to
        :data:`DEFAULT_EPS` when neither it nor ``target_kl`` is given; the library asks for one.

        >>> ErrorBudget.from_options(eps=0.03, scope="pooled", tensor_cap=0).cap
        0.0
        >>> b = ErrorBudget.from_options(target_kl=1e-3)
        >>> b.scope, b.auto_scope
        ('weighted', True)
        """
        auto = scope is None and target_kl is not None
        return cls(eps=eps, scope=scope or ("weighted" if auto else "tensor"),
                   tensor_cap=TENSOR_CAP if tensor_cap is None else tensor_cap, weights=weights, target_kl=target_kl,
                   auto_scope=auto, plain_cap=PLAIN_CAP if plain_cap is None else plain_cap, lossless=bool(lossless),
                   attention_stats=attention_stats, capture_stats=capture_stats)

    @classmethod
    def of(cls, budget) -> ErrorBudget:
        """``budget`` as :func:`~alignpred.compress` takes it: an :class:`ErrorBudget`, or a
        number (``eps`` in the tensor scope).

        >>> ErrorBudget.of(0.03) == ErrorBudget(eps=0.03)
        True
        >>> ErrorBudget.of(None)
        Traceback (most recent call last):
        ...
        alignpred.errors.KvzError: give the error budget: budget=0.03 (eps, tensor scope) or an ErrorBudget(...)
        """
        if isinstance(budget, ErrorBudget):
            return budget
        if _number(budget):
            return cls.from_options(eps=float(budget))
        if budget is None:
            raise KvzError("give the error budget: budget=0.03 (eps, tensor scope) or an ErrorBudget(...)")
        raise KvzError(f"budget must be an ErrorBudget or a number (eps, tensor scope), not {budget!r}")

    @property
    def strategy(self) -> Scope:
        """The scope's strategy (:func:`~alignpred.codec.scopes.scope_of`)."""
        return scope_of(self.scope)

    @property
    def joint(self) -> bool:
        return self.strategy.joint

    @property
    def cap(self) -> float:
        """The effective tensor cap (0 for the object and tensor scopes)."""
        return float(self.tensor_cap) if self.joint else 0.0

    def tensor_weights(self, names, bank) -> np.ndarray | None:
        """Per-tensor weights in ``names`` order (weighted scope; from the bank's sensitivity
        record when none were given), or None for the other scopes."""
        if not self.strategy.weighted:
            return None
        from alignpred.bank.registry import sensitivity

        weights, src = self.weights, "given"
        if weights is None:
            rec = sensitivity(bank.id, bank.model)
            if rec is None:
                raise KvzError("the weighted scope and target_kl need tensor weights: pass weights={tensor: w}, or "
                               "measure them for this bank with `kvz calibrate --sensitivity` or "
                               f"benchmarks/studies/rate/sensitivity.py (no record for bank {bank.id[:19]}…)")
            weights, src = rec["tensor_weights"], "bank sensitivity record"
        missing = [n for n in names if n not in weights]
        if missing:
            raise KvzError(f"weights ({src}) lack {missing[0]} (and {len(missing) - 1} more)")
        w = np.array([float(weights[n]) for n in names])
        if not (np.all(np.isfinite(w)) and np.all(w > 0)):
            raise KvzError("tensor weights must be positive finite numbers")
        return w

    def resolved(self, w: np.ndarray | None) -> ErrorBudget:
        """The budget with ``eps`` known: from ``target_kl`` and the weights ``w`` if asked for a KL."""
        if self.target_kl is None or self.eps is not None:
            return self
        if w is None:
            raise KvzError("target_kl needs tensor weights")
        eps = math.sqrt(self.target_kl / float(w.sum()))
        if not 0 < eps < 1:
            raise KvzError(f"target_kl {self.target_kl} gives eps {eps:.4g}, outside (0, 1)")
        return replace(self, eps=eps, eps_from_kl=True)


@dataclass
class TensorMeta:
    """Per-tensor coding parameters (stored in the file header)."""

    name: str
    modes: np.ndarray  # uint8 [kv_heads, head_dim]
    models: np.ndarray  # uint8 [kv_heads * head_dim]
    sq_err: float = 0.0
    sq_norm: float = 0.0
    objects: list = field(default_factory=list, repr=False)
    refine_models: np.ndarray | None = None  # uint8 [kv_heads * head_dim]: refinement tier's models
    step_codes: np.ndarray | None = None  # uint8 [kv_heads * head_dim] in 1..255 (config.channel_steps)
    row_codes: np.ndarray | None = None  # uint8 [n_tokens] in 1..255 (config.row_steps)
    plain_sq_err: float | None = None  # attention scope: plain squared error over the positions a query reads
    plain_sq_norm: float | None = None

    def row_steps(self) -> np.ndarray | None:
        """Per-position step multipliers ``row_codes / 32`` (float32 [n_tokens], exact), or None."""
        return None if self.row_codes is None else code_steps(self.row_codes)

    def channel_steps(self, head: int, head_dim: int) -> np.ndarray | None:
        """Head ``head``'s per-channel step multipliers ``step_codes / 32`` (float32 [head_dim],
        exact), or None when the tensor has none."""
        return None if self.step_codes is None else code_steps(self.step_codes[head * head_dim:(head + 1) * head_dim])


def code_steps(codes) -> np.ndarray:
    """Step multipliers of step codes (1..255): ``code / STEP_UNIT`` in float32, exact."""
    return np.asarray(codes).astype(np.float32) / np.float32(STEP_UNIT)
