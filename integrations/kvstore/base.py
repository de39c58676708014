"""The abstract chunk store: byte blobs under string keys, verified on every read."""
from __future__ import annotations

import abc
import math
import warnings

from . import record
from .errors import StoreError, StoreReadError, StoreWarning
from .record import Entry

POLICIES = ("lru", "importance")
STAT_COUNTERS = ("hits", "misses", "puts", "refused", "evictions", "corrupt_dropped", "errors", "foreign", "lost")


class ChunkBackend(abc.ABC):
    """Byte blobs under string keys, with a checksum per entry and an optional byte budget.

    Contract of every backend:

    * ``put(key, blob, *, meta=None, importance=1.0) -> bool``: store (or replace) an entry; False
      when it is refused (its record is larger than ``budget_bytes``) or the store failed (then a
      ``StoreWarning`` is issued, once per run of failures). Another reader never sees it half-written.
    * ``get(key) -> bytes | None``: the blob, or None on a miss. An entry that fails its checksum
      (or is torn, truncated, or holds another key) is deleted and reported as a miss, never returned.
      ``get_entry(key)`` returns the blob with its meta and importance as an :class:`Entry`.
    * ``open_blob(key) -> BlobRanges | None``: the blob for reading by byte ranges without fetching it
      whole (a file read with ``pread``, a Redis string with ``GETRANGE``); a
      :class:`~alignpred.format.RangedSource`, so ``KvzReader(store.open_blob(key))`` reads a stored
      ``.kvz`` layer by layer. Lengths and key are checked on open; the record checksum is not
      (the ``.kvz`` checks its own); a ranged read that fails raises :class:`StoreReadError`.
    * ``contains(key)``, ``delete(key) -> bool`` (True if something was deleted), ``keys()`` (a
      snapshot list, unordered), ``stats() -> dict``, ``clear()``, ``close()``; a context manager.

    A ``budget_bytes`` bounds the sum of record sizes (blob + a 60-byte header + key + JSON meta;
    :func:`entry_size` computes it). Each put evicts until the store fits: ``policy="lru"`` evicts the
    least recently used (put or successful get) first; ``policy="importance"`` evicts the lowest
    ``importance * recency / size`` first, with ``recency = 2 ** (-age / half_life_s)``.

    Arguments are checked: a bad key, blob, meta, importance, budget or policy raises
    :class:`StoreError` (a ``ValueError``). Meta must be a JSON-serialisable dict.

    ``stats()`` has ``entries`` and ``bytes`` of the whole store (every process) and the counters
    ``hits, misses, puts, refused, evictions, corrupt_dropped, errors, foreign, lost`` of this object
    only (``foreign``: records of another store format, refused as misses; ``lost``: entries found
    gone under their bookkeeping, Redis only). ``store_stats()`` has the counters of every client
    where the backend keeps them; ``gc()`` removes orphaned parts; ``check()`` raises
    :class:`StoreUnavailableError` when the store cannot be used.
    """

    kind = "abstract"

    def __init__(self, budget_bytes: int | None = None, policy: str = "lru", half_life_s: float = 3600.0):
        if budget_bytes is not None:
            if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
                raise StoreError(f"budget_bytes must be an int or None, got {type(budget_bytes).__name__}")
            if budget_bytes <= 0:
                raise StoreError(f"budget_bytes must be positive (or None for no budget), got {budget_bytes}")
        if policy not in POLICIES:
            raise StoreError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if isinstance(half_life_s, bool) or not isinstance(half_life_s, (int, float)) or \
                not math.isfinite(half_life_s) or half_life_s <= 0:
            raise StoreError(f"half_life_s must be a positive number, got {half_life_s!r}")
        self.budget_bytes = budget_bytes
        self.policy = policy
        self.half_life_s = float(half_life_s)
        self._counters = dict.fromkeys(STAT_COUNTERS, 0)
        self._failing = False
        self._closed = False

    # ---- public API -------------------------------------------------------------------------
    def put(self, key: str, blob, *, meta: dict | None = None, importance: float = 1.0) -> bool:
        """Store ``blob`` under ``key`` (replacing any entry); True if stored, False if refused or failed."""
        self._check_open()
        kb = record.key_bytes(key)
        data = record.blob_bytes(blob)
        mb = record.meta_bytes(meta)
        imp = record.check_importance(importance)
        size = record.HEADER_SIZE + len(kb) + len(mb) + len(data)
        if self.budget_bytes is not None and size > self.budget_bytes:
            self._counters["refused"] += 1
            return False
        ok = self._put(key, record.encode(kb, data, mb, imp), size, imp)
        if ok:
            self._counters["puts"] += 1
        return ok

    def get(self, key: str) -> bytes | None:
        """The blob stored under ``key``, or None (missing, corrupt, or store unavailable)."""
        entry = self.get_entry(key)
        return None if entry is None else entry.blob

    def get_entry(self, key: str) -> Entry | None:
        """Like :meth:`get`, with the entry's meta and importance."""
        self._check_open()
        record.key_bytes(key)
        entry = self._get(key)
        self._counters["hits" if entry is not None else "misses"] += 1
        return entry

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether an entry exists (unverified: a later get may still find it corrupt and miss)."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove the entry; True if there was one."""

    @abc.abstractmethod
    def keys(self) -> list[str]:
        """A snapshot of the stored keys, in no particular order."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every entry of this store."""

    def stats(self) -> dict:
        """``entries``, ``bytes`` (whole store), this object's counters, and the configuration."""
        self._check_open()
        out = {"backend": self.kind, "policy": self.policy, "budget_bytes": self.budget_bytes}
        out.update(self._usage())
        out.update(self._counters)
        return out

    def open_blob(self, key: str) -> BlobRanges | None:
        """The blob under ``key`` for ranged reads (see the class docstring), or None on a miss.
        This default reads the entry whole and verified; backends that can read ranges override it."""
        entry = self.get_entry(key)
        if entry is None:
            return None
        blob = memoryview(entry.blob)
        return BlobRanges(key, len(blob), entry.meta, entry.importance, lambda off, n: blob[off:off + n])

    def store_stats(self) -> dict:
        """Whole-store figures (every client's counters where the backend keeps them); this default:
        :meth:`stats`."""
        return self.stats()

    def check(self) -> dict:
        """:meth:`store_stats`, raising :class:`StoreUnavailableError` where the store cannot be used."""
        return self.store_stats()

    def gc(self, verify: bool = False) -> dict:
        """Remove orphaned parts (backend-specific); returns what was removed."""
        self._check_open()
        return {"checked": 0, "orphans": 0, "stale": 0, "corrupt": 0, "total_fixed_bytes": 0}

    def close(self) -> None:
        """Release resources; later calls raise StoreError. Closing twice is fine."""
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- for subclasses ---------------------------------------------------------------------
    @abc.abstractmethod
    def _put(self, key: str, parts: list, size: int, importance: float) -> bool: ...

    @abc.abstractmethod
    def _get(self, key: str) -> Entry | None: ...

    @abc.abstractmethod
    def _usage(self) -> dict: ...

    def _check_open(self):
        if self._closed:
            raise StoreError(f"{type(self).__name__} is closed")

    def _failed(self, what: str, exc: BaseException, category=StoreWarning) -> None:
        """Count a failed operation; warn on the first failure after a success (not on every call)."""
        self._counters["errors"] += 1
        if not self._failing:
            self._failing = True
            warnings.warn(category(f"{type(self).__name__}: {what} failed ({type(exc).__name__}: {exc}); "
                                   f"answering misses/False until it works again"), stacklevel=4)

    def _succeeded(self) -> None:
        self._failing = False

    def _score_parts(self, size: int, importance: float) -> tuple[float, float]:
        """(base, rate): the eviction score is ``base + rate * access_time_s``; lowest goes first.

        LRU: base 0, rate 1. Importance: ``log(importance / size) + access_time * ln2 / half_life``,
        the log of ``importance * 2**(-age/half_life) / size`` plus a term equal for every entry.
        """
        if self.policy == "lru":
            return 0.0, 1.0
        return math.log(max(importance, 1e-300) / max(size, 1)), math.log(2.0) / self.half_life_s


class BlobRanges:
    """One stored blob, read by byte ranges (a :class:`~alignpred.format.RangedSource`): ``size``,
    ``meta``, ``importance``, ``read_range(offset, length)`` (bytes; fewer only where the entry was
    cut short under the reader; a failed read raises :class:`StoreReadError`), ``bytes_read``,
    ``close()``. Made by :meth:`ChunkBackend.open_blob`."""

    def __init__(self, key: str, size: int, meta: dict, importance: float, read, close=None):
        self.key = key
        self.name = f"<store entry {key[:40]}>"
        self.size = int(size)
        self.meta = meta
        self.importance = importance
        self.bytes_read = 0
        self._read = read
        self._close = close

    def read_range(self, offset: int, length: int):
        if offset < 0 or length < 0 or offset + length > self.size:
            raise StoreError(f"range {offset}+{length} outside a blob of {self.size} bytes")
        try:
            out = self._read(offset, length)
        except StoreReadError:
            raise
        except OSError as e:
            raise StoreReadError(f"{self.name}: read of {length} bytes at {offset} failed ({e})") from e
        self.bytes_read += len(out)
        return out

    def close(self) -> None:
        if self._close is not None:
            self._close()
            self._close = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - finaliser
            pass
