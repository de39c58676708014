"""One corrupt-aware read for the engine adapters: :class:`CheckedReader`.

A backend verifies every entry it returns; one that fails its checksum is deleted and counted
(``stats()["corrupt_dropped"]``), and ``get`` returns None as for any miss. An engine adapter must
tell its operator about that, and must never let a store fault reach the engine: this reader turns
every exception of ``get`` into a miss, and warns once per corrupt entry dropped.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

__all__ = ["CheckedReader"]


class CheckedReader:
    """``get(key)`` on a :class:`~kvz.integrations.kvstore.ChunkBackend`: the bytes, or None — a
    miss, a failure (store down, timeout: a warning) or an entry the backend dropped as corrupt (a
    warning). ``what`` starts every message; ``warn(msg)`` issues it (default: a
    :class:`~kvz.integrations.kvstore.StoreWarning`); ``noun`` names an entry in messages.

    >>> import tempfile, warnings
    >>> from kvz.integrations.kvstore import CheckedReader, DirectoryBackend
    >>> be = DirectoryBackend(tempfile.mkdtemp())
    >>> be.put("k", b"chunk bytes")
    True
    >>> r = CheckedReader(be, "my adapter")
    >>> r.get("k"), r.get("other")
    (b'chunk bytes', None)
    """

    def __init__(self, backend, what: str, warn: Callable[[str], None] | None = None, noun: str = "entry"):
        self.backend, self.what, self.noun = backend, what, noun
        self._warn = warn or _store_warning
        self._dropped: int | None = None

    def _corrupt_count(self) -> int:
        try:
            return int(self.backend.stats().get("corrupt_dropped", 0))
        except Exception:  # noqa: BLE001 - statistics are advisory
            return 0

    def get(self, key: str):
        if self._dropped is None:
            self._dropped = self._corrupt_count()
        try:
            rec = self.backend.get(key)
        except Exception as e:  # noqa: BLE001 - any store fault is a miss, never an error in the engine
            self._warn(f"{self.what}: get failed ({type(e).__name__}: {e}); treated as a miss")
            return None
        if rec is None:
            n = self._corrupt_count()
            if n > self._dropped:
                self._warn(f"{self.what}: {self.noun} {key[:60]} failed its checksum; deleted, a miss")
            self._dropped = n
        return rec


def _store_warning(msg: str) -> None:
    from .errors import StoreWarning

    warnings.warn(StoreWarning(msg), stacklevel=3)
