"""Storage layer of the KV chunk store: byte blobs under string keys, verified, with a byte budget.

Three backends with one interface (:class:`ChunkBackend`), opened from a URL by :func:`open_url`
(a directory, ``redis://``, ``redis+cluster://host:port,host:port/``)::

    from kvz.integrations.kvstore import open_url
    store = open_url("/var/cache/kvz", budget_bytes=10 << 30, policy="lru")
    store.put(key, blob, meta={"tokens": 256}, importance=1.0)   # -> bool
    store.get(key)                                               # -> bytes | None

The layers above (hashing, encoding, model integration) only need that interface. ``server``
starts a throw-away redis-server for tests. Nothing stored is pickled: meta is JSON.
"""
from .base import BlobRanges, ChunkBackend
from .checked import CheckedReader
from .cluster import RedisClusterBackend
from .directory import DirectoryBackend
from .errors import (
    StoreAccessWarning,
    StoreError,
    StoreReadError,
    StoreUnavailableError,
    StoreUnavailableWarning,
    StoreWarning,
)
from .record import Entry, entry_size
from .redis_backend import RedisBackend
from .server import RedisClusterServer, RedisServer
from .urls import open_url, scheme_of

__all__ = ["BlobRanges", "ChunkBackend", "CheckedReader", "DirectoryBackend", "RedisBackend", "RedisClusterBackend",
           "Entry", "entry_size", "open_url", "scheme_of", "StoreError", "StoreReadError", "StoreUnavailableError",
           "StoreWarning", "StoreUnavailableWarning", "StoreAccessWarning", "RedisServer", "RedisClusterServer"]
