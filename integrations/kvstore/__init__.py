"""Storage layer of the KV chunk store: byte blobs under string keys, verified, with a byte budget.

Two backends with one interface (:class:`ChunkBackend`)::

    from kvz.integrations.kvstore import DirectoryBackend, RedisBackend
    store = DirectoryBackend("/var/cache/kvz", budget_bytes=10 << 30, policy="lru")
    store.put(key, blob, meta={"tokens": 256}, importance=1.0)   # -> bool
    store.get(key)                                               # -> bytes | None

The layers above (hashing, encoding, model integration) only need that interface. ``server``
starts a throw-away redis-server for tests. Nothing stored is pickled: meta is JSON.
"""
from .base import BlobRanges, ChunkBackend
from .directory import DirectoryBackend
from .errors import StoreError, StoreReadError, StoreUnavailableWarning, StoreWarning
from .record import Entry, entry_size
from .redis_backend import RedisBackend
from .server import RedisServer

__all__ = ["BlobRanges", "ChunkBackend", "DirectoryBackend", "RedisBackend", "Entry", "entry_size", "StoreError",
           "StoreReadError",
           "StoreWarning", "StoreUnavailableWarning", "RedisServer"]
