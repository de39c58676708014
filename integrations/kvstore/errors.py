"""Errors and warnings of the chunk store."""
from alignpred.errors import KvzError


class StoreError(KvzError):
    """A bad argument or a misuse of a chunk store (a ValueError, under kvz's root KvzError)."""


class CorruptEntryError(StoreError):
    """A stored record failed verification. Internal: backends drop the entry and report a miss."""


class StoreReadError(StoreError):
    """A ranged read of an opened blob failed (the store went down, the entry was evicted or cut short
    under the reader): the caller's load fails and is recomputed, never half-used."""


class StoreWarning(RuntimeWarning):
    """A store operation failed and was answered as a miss / refusal instead of raising."""


class StoreUnavailableWarning(StoreWarning):
    """The store's server cannot be reached; calls return misses until it is back (warned once per outage)."""
