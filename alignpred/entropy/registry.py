"""The entropy coders a ``.kvz`` file may name, one :class:`Coder` record each, in one registry.

A coder is a pure bitstream: ``encode(q, ids) -> bytes`` of an object ``q`` (int32 ``[C, N]``)
with one model id per channel, and its inverse over the payload's bytes. What the record carries
beyond the two functions is what the container needs to know of it: the name the header writes
(``entropy.coder``), its numeric id, the probability precision of its tables (the header's
``entropy.prec``, checked on read), the oldest format minor that may name it, and its own error
table (the texts its kernels' error codes stand for). Everything that used to be an if-chain over
coder names (:func:`alignpred.entropy.encode` / :func:`~alignpred.entropy.decode` /
:func:`~alignpred.entropy.decode_objects`, :func:`alignpred.format.header.minor_for` /
:func:`~alignpred.format.header.coder_prec`) looks the record up here.

Adding a coder changes what files may contain: it needs a format minor of its own, a section in
``format_spec/kvz.md``, golden vectors, and a record here; the contract tests
(``tests/entropy/test_coder_contract.py``) run every registered coder through the same checks.

>>> [c.name for c in coders()]
['rans4', 'constriction', 'lanes32']
>>> get("lanes32").min_minor, get("lanes32").precision
(2, 12)
>>> get("zstd")
Traceback (most recent call last):
...
alignpred.errors.FormatError: unknown entropy coder 'zstd' (have rans4, constriction, lanes32)
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from alignpred.errors import FormatError

__all__ = ["Coder", "register", "get", "coders"]


@dataclass(frozen=True)
class Coder:
    """One entropy coder (see the module docstring).

    ``encode(q, ids) -> bytes``: ``q`` int32 ``[C, N]`` C-contiguous with ``C*N > 0``, ``ids``
    int64 ``[C]`` already checked. ``decode(raw, ids, C, N, out) -> array``: ``raw`` the payload as
    uint8, ``C*N > 0``, ``out`` None or an int32 ``[C, N]`` array (any strides) to decode into;
    raises :class:`~alignpred.errors.FormatError` on any inconsistency. ``decode_objects(raws, ids,
    C, widths, out)``: several payloads of one tensor into consecutive column ranges of ``out`` in
    one call (None: one ``decode`` per payload). ``errors``: the coder's error codes and texts."""

    id: int
    name: str
    precision: int
    min_minor: int
    summary: str
    encode: Callable[[np.ndarray, np.ndarray], bytes]
    decode: Callable[..., np.ndarray]
    decode_objects: Callable[..., np.ndarray] | None = None
    errors: Mapping[int, str] | None = None


_REGISTRY: dict[str, Coder] = {}


def register(coder: Coder) -> Coder:
    """Add ``coder`` (its name and id must be new). Returns it."""
    if coder.name in _REGISTRY or any(c.id == coder.id for c in _REGISTRY.values()):
        raise ValueError(f"entropy coder {coder.name!r} (id {coder.id}) is registered already")
    _REGISTRY[coder.name] = coder
    return coder


def coders() -> list[Coder]:
    """Every registered coder, in id order."""
    _load()
    return sorted(_REGISTRY.values(), key=lambda c: c.id)


def get(name, error: type[Exception] = FormatError) -> Coder:
    """The coder called ``name``, or ``error`` (default :class:`FormatError`: a file naming a coder
    this kvz does not know) saying which exist."""
    _load()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        have = ", ".join(c.name for c in coders())
        raise error(f"unknown entropy coder {name!r} (have {have})") from None


def _load() -> None:
    """Register the built-in coders (once; their module imports this one)."""
    if not _REGISTRY:
        import alignpred.entropy.coder  # noqa: F401  (registers rans4, constriction, lanes32)
