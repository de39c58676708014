"""Errors and warnings of the chunk store."""
from alignpred.errors import KvzError


class StoreError(KvzError):
    """A bad argument or a misuse of a chunk store (a ValueError, under kvz's root KvzError)."""


class CorruptEntryError(StoreError):
    """A stored record failed verification. Internal: backends drop the entry and report a miss."""


class ForeignEntryError(CorruptEntryError):
    """A record written by another version of kvz's store format. Internal: backends report a miss with a
    warning and leave the entry (its writer can read it)."""


class StoreUnavailableError(StoreError):
    """The store cannot be used (unreachable, wrong password, refused by an ACL): raised only by
    ``check()`` and the ``kvz store`` commands; every other call answers misses and warns."""


class StoreReadError(StoreError):
    """A ranged read of an opened blob failed (the store went down, the entry was evicted or cut short
    under the reader): the caller's load fails and is recomputed, never half-used."""


class StoreWarning(RuntimeWarning):
    """A store operation failed and was answered as a miss / refusal instead of raising."""


class StoreUnavailableWarning(StoreWarning):
    """The store's server cannot be reached; calls return misses until it is back (warned once per outage)."""


class StoreAccessWarning(StoreWarning):
    """The store refused the client: a wrong user or password, or an ACL without the store's keys or commands."""
