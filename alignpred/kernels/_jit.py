"""``njit`` for kvz's kernels: :func:`numba.njit`, except that a kernel asking for numba's on-disk
cache (``cache=True``) where the cache has nowhere to go is compiled uncached instead of failing.

numba caches a kernel next to its source (``__pycache__``), else in ``$NUMBA_CACHE_DIR`` when set
(tried first), else in the user's cache folder (``~/.cache/numba``), each only where it can write
(numba tries to create a file there). With none of them writable (a read-only install run by a
user without a writable home) ``numba.njit(cache=True)`` raises ``RuntimeError: cannot cache
function ...: no locator available`` when the kernel is *defined*, i.e. at ``import`` of kvz's
kernel modules, so nothing of kvz would run. Here such a kernel is compiled in every process
instead (tens of seconds on a fresh process), :data:`UNCACHED` names it and one
:class:`~alignpred.errors.KvzWarning` says how to fix it (``NUMBA_CACHE_DIR``);
:func:`alignpred.warmup` reports it too.

A cache written earlier into a folder this process cannot write (a read-only ``site-packages``
whose ``__pycache__`` was filled at install time) is not read either: numba only uses folders it
can write. Point ``NUMBA_CACHE_DIR`` at a writable folder and fill it with ``kvz warmup``.
"""
from __future__ import annotations

import warnings

import numba

from alignpred.errors import KvzWarning

__all__ = ["njit", "UNCACHED"]

#: ``module.function`` of every kernel of this process that asked for the cache and got none
UNCACHED: list[str] = []


def njit(*args, **options):
    """:func:`numba.njit` with the same arguments (see the module notes for ``cache=True``)."""
    if args or not options.get("cache"):
        return numba.njit(*args, **options)

    def decorate(fn):
        try:
            return numba.njit(**options)(fn)
        except RuntimeError as e:
            if "no locator available" not in str(e):
                raise
            if not UNCACHED:
                warnings.warn("numba has no writable cache folder for kvz's kernels (read-only install, no "
                              "writable ~/.cache and no NUMBA_CACHE_DIR): every process compiles them again "
                              "(tens of seconds). Set NUMBA_CACHE_DIR to a writable folder (and run `kvz warmup` "
                              "once to fill it)", KvzWarning, stacklevel=2)
            UNCACHED.append(f"{fn.__module__}.{fn.__qualname__}")
            return numba.njit(**{**options, "cache": False})(fn)

    return decorate
