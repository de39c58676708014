"""Rate-control scopes: one frozen strategy per scope, behind one :class:`Scope` contract, and
their registry (:func:`scope_of`). A scope says in which units ``eps`` is met (every object,
every tensor, or the whole cache) and how the error is measured; the encoder, the budget, the
measure and the header ask the strategy instead of comparing scope names. The bitstream and the
JSON metadata record the scope's :attr:`~Scope.name` (``ErrorBudget.scope`` stays a string).

>>> [s.name for s in SCOPE_REGISTRY]
['object', 'tensor', 'pooled', 'weighted', 'attention']
>>> s = scope_of("weighted")
>>> s.joint, s.weighted, s.attention, s.measure
(True, True, False, 'plain')
>>> scope_of("tensor").units(2, 3).tolist()
[[0, 0, 0], [1, 1, 1]]
>>> scope_of("objects")
Traceback (most recent call last):
...
alignpred.errors.KvzError: unknown eps scope 'objects'; use one of object, tensor, pooled, weighted, attention
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from alignpred.codec.ratesearch import bracket_search
from alignpred.errors import KvzError

__all__ = ["Scope", "ObjectScope", "TensorScope", "PooledScope", "WeightedScope", "AttentionScope",
           "SCOPE_REGISTRY", "scope_of"]


@dataclass(frozen=True)
class Scope:
    """The contract of a rate-control scope (the base is the tensor scope's behaviour: one unit per
    tensor, each meeting ``eps`` on its own, plain NRMSE).

    Flags: ``joint`` — the budget spans the whole cache (one joint search over the tensors' steps,
    every tensor within ``tensor_cap × eps``); ``weighted`` — tensors count by a weight (the
    budget needs weights, the header records them); ``attention`` — the error is measured as the
    attention scope defines it (per-channel and per-position steps, the plain cap); ``default`` —
    the scope a budget has when none is named (a store keeps the keys it always had);
    ``stats_scope`` — the scope a KL target with no named scope moves to when the bank has
    attention statistics (None: it stays).

    >>> s = scope_of("object")
    >>> s.units(2, 2).tolist()
    [[0, 1], [2, 3]]
    >>> t, d0 = s.sample_units(0.1, np.array([4.0, 16.0]), np.array([12, 12]))
    >>> t.tolist(), d0.tolist()
    ([0.04000000000000001, 0.16000000000000003], [0.2, 0.4])
    """

    name: ClassVar[str] = ""
    joint: ClassVar[bool] = False
    weighted: ClassVar[bool] = False
    attention: ClassVar[bool] = False
    default: ClassVar[bool] = False
    stats_scope: ClassVar[str | None] = None

    @property
    def measure(self) -> str:
        """The error measure's name (``describe()``'s ``error_measure``): attention or plain."""
        return "attention" if self.attention else "plain"

    def units(self, n_tensors: int, n_obj: int) -> np.ndarray:
        """Scope unit of every object ``[n_tensors, n_obj]`` (int; units ``0..n_units-1``)."""
        return np.repeat(np.arange(n_tensors)[:, None], n_obj, axis=1)

    # -- the sample search of one tensor (scopes that are not joint) ------------------------------
    def sample_units(self, eps: float, norms, rows) -> tuple[np.ndarray, np.ndarray]:
        """``(target squared errors, initial steps)`` of one tensor's units over sampled objects of
        squared norms ``norms`` and ``rows`` values each."""
        norm = norms.sum()
        return np.array([eps ** 2 * norm]), np.array([eps * np.sqrt(12.0 * norm / rows.sum())])

    def expand(self, dl, n: int) -> np.ndarray:
        """Steps of the ``n`` sampled objects from the steps of the tensor's units."""
        return np.full(n, dl[0])

    def unit_errors(self, err) -> np.ndarray:
        """Squared errors of the tensor's units from those of its sampled objects."""
        return np.array([err.sum()])

    def spread(self, dl, d0, objs, first):
        """Steps of every object of the tensor (an array ``[n_obj]``, or one step for them all)
        from the sample's steps ``dl`` (at objects ``objs``; the search began at ``d0``);
        ``first()`` gives every object's initial step."""
        return dl[0]

    # -- the search over the whole cache -----------------------------------------------------------
    def search(self, evaluate, first, norms, unit, eps: float, pooled, aim: float, widen: int):
        """Steps per unit (``first``: where to start) whose measured errors meet the budget:
        ``evaluate(steps per unit) -> (squared errors per unit, result)``; ``norms [n_tensors,
        n_obj]`` squared norms, ``unit`` their units; ``pooled(evaluate, d0, norms per tensor,
        aim=, widen=)`` is the joint search the joint scopes run. Returns ``(steps, result)``."""
        target = eps ** 2 * np.bincount(unit.ravel(), norms.ravel(), len(first))
        return bracket_search(evaluate, first, target, "", aim=aim, widen=widen)


@dataclass(frozen=True)
class ObjectScope(Scope):
    """``eps`` in every object: one unit, and one step, per object."""

    name: ClassVar[str] = "object"

    def units(self, n_tensors, n_obj):
        return np.arange(n_tensors * n_obj).reshape(n_tensors, n_obj)

    def sample_units(self, eps, norms, rows):
        return eps ** 2 * norms, eps * np.sqrt(12.0 * norms / rows)

    def expand(self, dl, n):
        return dl

    def unit_errors(self, err):
        return err

    def spread(self, dl, d0, objs, first):
        """Unsampled objects: their initial step scaled like the sample's."""
        out = first() * float(np.median(dl / d0))
        out[objs] = dl
        return out


@dataclass(frozen=True)
class TensorScope(Scope):
    """``eps`` in every tensor (the default scope)."""

    name: ClassVar[str] = "tensor"
    default: ClassVar[bool] = True


@dataclass(frozen=True)
class PooledScope(Scope):
    """``eps`` over the whole cache: one joint search, every tensor within its cap."""

    name: ClassVar[str] = "pooled"
    joint: ClassVar[bool] = True

    def search(self, evaluate, first, norms, unit, eps, pooled, aim, widen):
        return pooled(evaluate, first, norms.sum(axis=1), aim=aim, widen=widen)


@dataclass(frozen=True)
class WeightedScope(PooledScope):
    """A pooled budget in which each tensor's error counts by a weight (its effect on the model)."""

    name: ClassVar[str] = "weighted"
    weighted: ClassVar[bool] = True
    stats_scope: ClassVar[str | None] = "attention"


@dataclass(frozen=True)
class AttentionScope(WeightedScope):
    """The weighted budget in the attention measure (bank statistics weigh channels and positions),
    with every tensor's plain NRMSE over the positions a later query reads within the plain cap."""

    name: ClassVar[str] = "attention"
    attention: ClassVar[bool] = True
    stats_scope: ClassVar[str | None] = None


SCOPE_REGISTRY: tuple[Scope, ...] = (ObjectScope(), TensorScope(), PooledScope(), WeightedScope(), AttentionScope())
_BY_NAME = {s.name: s for s in SCOPE_REGISTRY}
_NAMES = tuple(_BY_NAME)


def scope_of(name) -> Scope:
    """The strategy of scope ``name`` (a :class:`~alignpred.errors.KvzError` for an unknown one)."""
    s = _BY_NAME.get(name) if isinstance(name, str) else None
    if s is None:
        raise KvzError(f"unknown eps scope {name!r}; use one of {', '.join(_NAMES)}")
    return s
