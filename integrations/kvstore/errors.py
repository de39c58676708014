"""Errors and warnings of the chunk store."""
from urllib.parse import urlparse

from alignpred.errors import KvzError

USERNAME_ENV, PASSWORD_ENV = "KVZ_REDIS_USERNAME", "KVZ_REDIS_PASSWORD"


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


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (what every message and repr shows)."""
    try:
        p = urlparse(url)
    except ValueError:
        return "<unparseable URL>"
    if p.password is None:
        return url
    user = p.username or ""
    return url.replace(p.netloc, f"{user}:***@" + p.netloc.rsplit("@", 1)[1], 1)


def describe_error(exc: BaseException) -> tuple[str, type]:
    """A one-line reason for a failed Redis call, and the warning category it is reported with."""
    import redis.exceptions as rex

    text = " ".join(str(exc).split())  # one line, whatever the server or the client library wrote
    if isinstance(exc, rex.AuthenticationError) or \
            any(s in text for s in ("WRONGPASS", "NOAUTH", "invalid username", "Authentication required",
                                    "authenticate the client")):
        return (f"authentication failed: wrong user or password ({type(exc).__name__}; credentials come from "
                f"the URL or {USERNAME_ENV}/{PASSWORD_ENV})"), StoreAccessWarning
    if isinstance(exc, rex.NoPermissionError) or "NOPERM" in text:
        return (f"permission denied by the server's ACL ({text}); the user needs the store's keys "
                f"(~{{<namespace>*) and the commands +@read +@write +@scripting"), StoreAccessWarning
    if "certificate" in text or "SSL" in text or "TLS" in text:
        return (f"TLS connection failed ({type(exc).__name__}: {text}); the server's CA goes in the URL "
                f"(?ssl_ca_certs=PATH) or KVZ_REDIS_CA_CERTS"), StoreUnavailableWarning
    if isinstance(exc, (rex.ConnectionError, rex.TimeoutError, OSError)) or \
            type(exc).__name__ in ("RedisClusterUnreachableError", "ClusterDownError", "SlotNotCoveredError",
                                   "MasterDownError") or \
            (type(exc).__name__ == "RedisClusterException" and "connect" in text.lower()):
        return f"unreachable ({type(exc).__name__}: {text})", StoreUnavailableWarning
    return f"{type(exc).__name__}: {text}", StoreWarning
