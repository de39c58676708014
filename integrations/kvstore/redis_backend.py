"""A chunk store in Redis: one string per entry, bookkeeping in a sorted set, eviction in Lua."""
from __future__ import annotations

import hashlib
import re
import time
from urllib.parse import urlparse

from . import record
from .base import BlobRanges, ChunkBackend
from .errors import CorruptEntryError, StoreError, StoreReadError, StoreUnavailableWarning
from .record import Entry

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_SCHEMES = ("redis", "rediss", "unix")

# KEYS: entry, zset, sizes, bases, total. ARGV: member, record, size, base, score, budget (-1: none),
# entry-key prefix. Sets the entry, then evicts lowest-score members (never ARGV[1]) until total <= budget.
_PUT = """
local old = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('SET', KEYS[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[1])
local total = redis.call('INCRBY', KEYS[5], tonumber(ARGV[3]) - old)
local budget = tonumber(ARGV[6])
local evicted = 0
if budget >= 0 then
  while total > budget do
    local low = redis.call('ZRANGE', KEYS[2], 0, 1)
    local victim = low[1]
    if victim == ARGV[1] then victim = low[2] end
    if not victim then break end
    local sz = tonumber(redis.call('HGET', KEYS[3], victim) or '0')
    redis.call('DEL', ARGV[7] .. victim)
    redis.call('HDEL', KEYS[3], victim)
    redis.call('HDEL', KEYS[4], victim)
    redis.call('ZREM', KEYS[2], victim)
    total = redis.call('DECRBY', KEYS[5], sz)
    evicted = evicted + 1
  end
end
return evicted
"""

# KEYS: entry, zset, bases. ARGV: member, time term. Returns the record and touches its score.
_GET = """
local v = redis.call('GET', KEYS[1])
if v then
  local b = redis.call('HGET', KEYS[3], ARGV[1])
  if b then redis.call('ZADD', KEYS[2], 'XX', tonumber(b) + tonumber(ARGV[2]), ARGV[1]) end
end
return v
"""

# KEYS: entry, zset, sizes, bases, total. ARGV: member, sha1 hex of the value to drop or '' (any).
_DELETE = """
local v = redis.call('GET', KEYS[1])
if ARGV[2] ~= '' and (not v or redis.sha1hex(v) ~= ARGV[2]) then return 0 end
local sz = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
local n = redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if sz > 0 then redis.call('DECRBY', KEYS[5], sz) end
return n
"""


def _glob_escape(s: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", s)


class RedisBackend(ChunkBackend):
    """A :class:`ChunkBackend` in a Redis server (needs the ``redis`` package: ``pip install 'kvz[store]'``).

    Layout under ``namespace`` (every key shares the hash tag ``{namespace}``)::

        {ns}:e:<key>   the entry: one string holding the whole record (header, sha256, key, meta, blob)
        {ns}:lru       sorted set key -> eviction score (lowest evicted first)
        {ns}:size      hash key -> record bytes;   {ns}:base  hash key -> static part of the score
        {ns}:total     bytes of all records

    A put is one Lua script: SET of the whole record, the bookkeeping, and the eviction down to
    ``budget_bytes`` run atomically, so an entry is never half-visible and the budget holds after
    every put (records only: Redis' own overhead is not counted; ``maxmemory`` is not used). A get is
    a script too (GET + score touch); the checksum is verified here, and a corrupt value is deleted
    only if it is still the same value (compared by SHA-1 in the server).

    Outages: every call returns (``get`` None, ``put``/``delete``/``contains`` False, ``keys()`` [],
    ``stats()`` with ``available`` False) and issues one :class:`StoreUnavailableWarning` per outage.
    While down, calls within ``reconnect_interval`` seconds of the last failure do not touch the
    network; after that the next call tries again, and the connection pool reconnects by itself
    when the server is back (data of a restarted server without persistence is gone: misses).

    Known limits: all clients of one namespace must use the same policy; ``clear()`` is not atomic
    with concurrent puts; counters in ``stats()`` are per object; one failed command is retried once.

    Example (needs a running server)::

        from kvz.integrations.kvstore import RedisBackend
        with RedisBackend("redis://127.0.0.1:6379/0", budget_bytes=1 << 30, namespace="kvz") as store:
            store.put("9f2c", b"kv bytes", meta={"tokens": 16}, importance=2.0)   # True
            store.get("9f2c")                                                     # b'kv bytes'
            store.get("missing")                                                  # None
    """

    kind = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", budget_bytes: int | None = None,
                 policy: str = "lru", namespace: str = "kvz", *, half_life_s: float = 3600.0,
                 socket_timeout: float = 2.0, connect_timeout: float = 1.0, reconnect_interval: float = 1.0):
        super().__init__(budget_bytes, policy, half_life_s)
        if not isinstance(url, str) or urlparse(url).scheme not in _SCHEMES:
            raise StoreError(f"bad Redis URL {url!r}: expected redis://host:port/db, rediss://... or unix://path")
        if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
            raise StoreError(f"bad namespace {namespace!r}: 1-64 characters of A-Z a-z 0-9 _ . : -")
        for name, v in (("socket_timeout", socket_timeout), ("connect_timeout", connect_timeout),
                        ("reconnect_interval", reconnect_interval)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise StoreError(f"{name} must be a number >= 0, got {v!r}")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("RedisBackend needs the redis package: pip install 'kvz[store]'") from e
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                retry=Retry(NoBackoff(), 1), decode_responses=False)
        except ValueError as e:
            raise StoreError(f"bad Redis URL {url!r}: {e}") from None
        self.url = url
        self.namespace = namespace
        self.reconnect_interval = float(reconnect_interval)
        self._errors = (redis.exceptions.RedisError, OSError)
        self._conn_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        p = "{" + namespace + "}:"
        self._entry_prefix = (p + "e:").encode()
        self._zset, self._sizes, self._bases, self._total = (p + s for s in ("lru", "size", "base", "total"))
        self._put_script = self._client.register_script(_PUT)
        self._get_script = self._client.register_script(_GET)
        self._delete_script = self._client.register_script(_DELETE)
        self._down_at = None  # monotonic time of the last failure while the server is unreachable
        self._last_t = 0.0

    # ---- helpers ------------------------------------------------------------------------------
    def entry_key(self, key: str) -> bytes:
        """The Redis key holding ``key``'s entry."""
        return self._entry_prefix + record.key_bytes(key)

    def _now(self) -> float:
        self._last_t = max(time.time(), self._last_t + 1e-6)
        return self._last_t

    def _call(self, what: str, fn, default):
        """Run ``fn()``; on a Redis failure count it, warn once per outage and return (default, False)."""
        self._check_open()
        if self._down_at is not None and time.monotonic() - self._down_at < self.reconnect_interval:
            self._counters["errors"] += 1
            return default, False
        try:
            out = fn()
        except self._errors as e:
            if isinstance(e, self._conn_errors):
                self._down_at = time.monotonic()
                self._failed(f"{what} at {self.url}", e, StoreUnavailableWarning)
            else:
                self._failed(f"{what} at {self.url}", e)
            return default, False
        self._down_at = None
        self._succeeded()
        return out, True

    # ---- backend operations -------------------------------------------------------------------
    def _put(self, key: str, parts: list, size: int, importance: float) -> bool:
        member = parts[2]
        base, rate = self._score_parts(size, importance)
        score = base + rate * self._now()
        value = b"".join(parts)
        budget = -1 if self.budget_bytes is None else self.budget_bytes
        evicted, ok = self._call("put", lambda: self._put_script(
            keys=[self._entry_prefix + member, self._zset, self._sizes, self._bases, self._total],
            args=[member, value, size, repr(base), repr(score), budget, self._entry_prefix]), 0)
        if ok:
            self._counters["evictions"] += int(evicted)
        return ok

    def _get(self, key: str) -> Entry | None:
        member = record.key_bytes(key)
        ek = self._entry_prefix + member
        _, rate = self._score_parts(1, 1.0)
        raw, ok = self._call("get", lambda: self._get_script(
            keys=[ek, self._zset, self._bases], args=[member, repr(rate * self._now())]), None)
        if not ok or raw is None:
            return None
        try:
            return record.decode(raw, expect_key=key)
        except CorruptEntryError:
            self._counters["corrupt_dropped"] += 1
            sha1 = hashlib.sha1(raw).hexdigest()
            self._call("drop corrupt entry", lambda: self._delete_script(
                keys=[ek, self._zset, self._sizes, self._bases, self._total], args=[member, sha1]), 0)
            return None

    def open_blob(self, key: str) -> BlobRanges | None:
        """The entry read with ``GETRANGE`` (one round trip per range; the entry's LRU rank is not
        touched by ranged reads). An entry replaced, evicted or cut short while it is read gives other
        or fewer bytes, which the caller's own checksums catch (a ``.kvz`` payload's CRC-32)."""
        ek = self.entry_key(key)
        want = record.HEADER_SIZE + record.MAX_KEY_BYTES + 4096

        def head():
            pipe = self._client.pipeline(transaction=False)
            pipe.strlen(ek)
            pipe.getrange(ek, 0, want - 1)
            return pipe.execute()

        got, ok = self._call("get", head, None)
        if not ok or not got or not got[0]:
            self._counters["misses"] += 1
            return None
        total, prefix = int(got[0]), got[1]
        try:
            klen, mlen, _, _ = record.parse_head(prefix)
            if record.HEADER_SIZE + klen + mlen > len(prefix):
                end = record.HEADER_SIZE + klen + mlen - 1
                prefix, ok = self._call("get", lambda: self._client.getrange(ek, 0, end), b"")
            base, blen, meta, imp = record.parse_prefix(prefix, total, expect_key=key)
        except CorruptEntryError:
            self._counters["misses"] += 1
            self._counters["corrupt_dropped"] += 1
            self.delete(key)
            return None
        self._counters["hits"] += 1

        def read(off: int, n: int) -> bytes:
            if n == 0:
                return b""
            out, ok = self._call("get range", lambda: self._client.getrange(ek, base + off, base + off + n - 1), None)
            if not ok:
                raise StoreReadError(f"Redis at {self.url}: ranged read of {key[:40]} failed (store unavailable)")
            return out

        return BlobRanges(key, blen, meta, imp, read)

    def contains(self, key: str) -> bool:
        ek = self.entry_key(key)
        n, ok = self._call("contains", lambda: self._client.exists(ek), 0)
        return bool(ok and n)

    def delete(self, key: str) -> bool:
        member = record.key_bytes(key)
        n, ok = self._call("delete", lambda: self._delete_script(
            keys=[self._entry_prefix + member, self._zset, self._sizes, self._bases, self._total],
            args=[member, ""]), 0)
        return bool(ok and n)

    def keys(self) -> list[str]:
        members, ok = self._call("keys", lambda: self._client.zrange(self._zset, 0, -1), [])
        return [m.decode("utf-8") for m in members] if ok else []

    def clear(self) -> None:
        def run():
            c = self._client
            pattern = _glob_escape(self._entry_prefix.decode()) + "*"
            batch = []
            for k in c.scan_iter(match=pattern, count=1000):
                batch.append(k)
                if len(batch) >= 1000:
                    c.unlink(*batch)
                    batch = []
            if batch:
                c.unlink(*batch)
            c.delete(self._zset, self._sizes, self._bases, self._total)
        self._call("clear", run, None)

    def _usage(self) -> dict:
        def run():
            pipe = self._client.pipeline(transaction=False)
            pipe.zcard(self._zset)
            pipe.get(self._total)
            return pipe.execute()
        res, ok = self._call("stats", run, None)
        if not ok:
            return {"entries": None, "bytes": None, "available": False, "url": self.url}
        return {"entries": int(res[0]), "bytes": int(res[1] or 0), "available": True, "url": self.url}

    def close(self) -> None:
        if not self._closed:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                pass
        super().close()

    def __repr__(self):
        return (f"RedisBackend({self.url!r}, budget_bytes={self.budget_bytes}, policy={self.policy!r}, "
                f"namespace={self.namespace!r})")
