"""A chunk store in Redis: one string per entry, bookkeeping beside it in the same hash slot, Lua scripts."""
from __future__ import annotations

import functools
import hashlib
import os
import re
import time
from urllib.parse import urlparse

from . import record
from .base import BlobRanges, ChunkBackend
from .errors import (
    PASSWORD_ENV,
    USERNAME_ENV,
    CorruptEntryError,
    ForeignEntryError,
    StoreError,
    StoreReadError,
    StoreUnavailableError,
    StoreUnavailableWarning,
    StoreWarning,
    describe_error,
    mask_url,
)
from .record import Entry
from .redis_maint import RedisMaintenance
from .scripts import _DELETE, _EVICT, _GC_MEMBER, _GC_TOTAL, _GET, _HEAD, _PUT

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_SCHEMES = ("redis", "rediss", "unix")


def _glob_escape(s: str) -> str:
    return re.sub(r"([\\*?\[\]])", r"\\\1", s)


class RedisBackend(RedisMaintenance, ChunkBackend):
    """A :class:`ChunkBackend` in a Redis server (needs the ``redis`` package: ``pip install 'kvz[store]'``).

    Layout under ``namespace``: every key of one *shard* shares its hash tag (``{ns}`` with the
    default one shard; :class:`~.cluster.RedisClusterBackend` spreads entries over many)::

        {ns}:e:<key>   the entry: one string holding the whole record (header, sha256, key, meta, blob)
        {ns}:lru       sorted set key -> eviction score (lowest evicted first)
        {ns}:size      hash key -> record bytes;   {ns}:base  hash key -> static part of the score
        {ns}:total     bytes of all records;       {ns}:stats hash: store-wide counters (puts, hits,
                       misses, corrupt, foreign, evicted, lost) of every client, for ``kvz store stats``

    A put is one Lua script: SET of the whole record, the bookkeeping, and the eviction down to
    ``budget_bytes`` run atomically, so an entry is never half-visible and the budget holds after
    every put (records only: Redis' own overhead is not counted). A get is a script too (GET + score
    touch); the checksum is verified here, and a corrupt value is deleted only if it is still the same
    value (compared by SHA-1 in the server). ``ttl_s``: every entry expires that long after its put.

    The server's own eviction (``maxmemory`` with ``allkeys-lru``, ``volatile-ttl`` …) and expiry remove
    whole entries: a read that finds an entry gone drops its bookkeeping and misses (counted ``lost``);
    bookkeeping evicted under ``allkeys-*`` leaves entries ``gc()`` removes. A record written by another
    record version (another kvz store format) is a miss with a :class:`StoreWarning`, left in place.

    Outages: every call returns (``get`` None, ``put``/``delete``/``contains`` False, ``keys()`` [],
    ``stats()`` with ``available`` False) and issues one :class:`StoreUnavailableWarning` per outage
    (:class:`StoreAccessWarning` for a wrong password or an ACL refusal). While down, calls within
    ``reconnect_interval`` seconds of the last failure do not touch the network; after that the next
    call tries again, and the connection pool reconnects by itself when the server is back (data of a
    restarted server without persistence is gone: misses). ``check()`` raises instead.

    Credentials: in the URL (``redis://user:password@host:6379/0``) or, where it has none, from the
    environment (``KVZ_REDIS_USERNAME``, ``KVZ_REDIS_PASSWORD``); messages and ``repr`` show the URL
    with the password masked (``url``).

    Known limits: all clients of one namespace must use the same policy and shard count; ``clear()``
    is not atomic with concurrent puts; counters in ``stats()`` are per object (``store_stats()``: of
    the whole store); one failed command is retried once.

    Example (needs a running server)::

        from kvz.integrations.kvstore import RedisBackend
        with RedisBackend("redis://127.0.0.1:6379/0", budget_bytes=1 << 30, namespace="kvz") as store:
            store.put("9f2c", b"kv bytes", meta={"tokens": 16}, importance=2.0)   # True
            store.get("9f2c")                                                     # b'kv bytes'
            store.get("missing")                                                  # None
    """

    kind = "redis"
    _retry_unavailable = False
    _url_schemes: tuple[str, ...] = _SCHEMES
    _url_hint = "redis://host:port/db, rediss://... or unix://path"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", budget_bytes: int | None = None,
                 policy: str = "lru", namespace: str = "kvz", *, half_life_s: float = 3600.0,
                 socket_timeout: float = 2.0, connect_timeout: float = 1.0, reconnect_interval: float = 1.0,
                 ttl_s: float | None = None, username: str | None = None, password: str | None = None,
                 ssl_options: dict | None = None):
        super().__init__(budget_bytes, policy, half_life_s)
        if not isinstance(url, str) or urlparse(url).scheme not in self._url_schemes:
            raise StoreError(f"bad Redis URL {mask_url(url) if isinstance(url, str) else url!r}: "
                             f"expected {self._url_hint}")
        if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
            raise StoreError(f"bad namespace {namespace!r}: 1-64 characters of A-Z a-z 0-9 _ . : -")
        for name, v in (("socket_timeout", socket_timeout), ("connect_timeout", connect_timeout),
                        ("reconnect_interval", reconnect_interval)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise StoreError(f"{name} must be a number >= 0, got {v!r}")
        if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0):
            raise StoreError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")
        try:
            import redis
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(f"{type(self).__name__} needs the redis package: pip install 'kvz[store]'") from e
        self.url = mask_url(url)
        self._raw_url = url
        p = urlparse(url)
        self._username = p.username or username or os.environ.get(USERNAME_ENV) or None
        self._password = p.password or password or os.environ.get(PASSWORD_ENV) or None
        self._ssl_options = dict(ssl_options or {})
        self.namespace = namespace
        self.ttl_s = None if ttl_s is None else float(ttl_s)
        self.socket_timeout, self.connect_timeout = float(socket_timeout), float(connect_timeout)
        self.reconnect_interval = float(reconnect_interval)
        rex = redis.exceptions
        self._errors = (rex.RedisError, OSError, rex.RedisClusterException)
        self._conn_errors = (rex.ConnectionError, rex.TimeoutError, OSError, rex.RedisClusterException,
                             rex.ClusterDownError) + tuple(
            getattr(rex, n) for n in ("SlotNotCoveredError", "MasterDownError") if hasattr(rex, n))
        self._auth_errors = (rex.AuthenticationError, rex.NoPermissionError)
        self._tags = self._shard_tags()
        self._client = None
        self._client = self._connect()
        self._failing_keys: set = set()  # shards (or "all") failing since their last success
        self._down_at: dict = {}  # shard (or "all") -> monotonic time of its last failure while unreachable
        self._last_t = 0.0

    # ---- layout ---------------------------------------------------------------------------------
    @property
    def shards(self) -> int:
        return len(self._tags)

    def _shard_tags(self) -> list[str]:
        return ["{" + self.namespace + "}"]

    def _shard_of(self, kb: bytes) -> int:
        if len(self._tags) == 1:
            return 0
        return int.from_bytes(hashlib.sha256(kb).digest()[:4], "big") % len(self._tags)

    def _keys_of(self, shard: int, member: bytes | None = None) -> list:
        """KEYS of a script on ``shard``: entry (of ``member``), zset, sizes, bases, total, stats."""
        t = self._tags[shard]
        ek = (t + ":e:").encode() + (member or b"")  # without a member: a key of the slot all the same
        return [ek, t + ":lru", t + ":size", t + ":base", t + ":total", t + ":stats"]

    def entry_key(self, key: str) -> bytes:
        """The Redis key holding ``key``'s entry."""
        kb = record.key_bytes(key)
        return self._keys_of(self._shard_of(kb), kb)[0]

    # ---- connection -----------------------------------------------------------------------------
    def _connect(self):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        kw = dict(socket_timeout=self.socket_timeout, socket_connect_timeout=self.connect_timeout,
                  retry=Retry(NoBackoff(), 1), decode_responses=False, **self._ssl_options)
        p = urlparse(self._raw_url)
        if p.password is None and self._password is not None:
            kw["password"] = self._password
            if p.username is None and self._username is not None:
                kw["username"] = self._username
        try:
            client = redis.Redis.from_url(self._raw_url, **kw)
        except (ValueError, TypeError) as e:
            raise StoreError(f"bad Redis URL {self.url!r}: {e}") from None
        self._register(client)
        return client

    def _register(self, client) -> None:
        self._scripts = {name: client.register_script(src) for name, src in (
            ("put", _PUT), ("get", _GET), ("head", _HEAD), ("delete", _DELETE), ("evict", _EVICT),
            ("gc_member", _GC_MEMBER), ("gc_total", _GC_TOTAL))}

    def _script(self, name: str):
        """The script ``name`` bound to the client (made first if it is not yet)."""
        c = self._get_client()
        return functools.partial(self._scripts[name], client=c)

    def _get_client(self):
        if self._client is None:
            self._client = self._connect()
        return self._client

    def _now(self) -> float:
        self._last_t = max(time.time(), self._last_t + 1e-6)
        return self._last_t

    def _call(self, what: str, fn, default, shard=None, every_shard: bool = False):
        """Run ``fn()``; on a Redis failure count it, warn once per outage and return (default, False).
        ``shard``: the one shard ``fn`` touches (None: several); an unreachable node makes calls on
        its shard (or on all, for a one-node store) answer without the network for a while.
        ``every_shard``: ``fn`` reaches every shard or fails (no node skipped), so its success ends
        every shard's outage (the next failure anywhere warns again)."""
        self._check_open()
        # the key of this call's health: its shard (a cluster), "multi" (a cluster call on many
        # shards), or "all" (one node: every call)
        k = "all" if self.shards == 1 else (shard if shard is not None else "multi")
        node = self._node_of(shard) if shard is not None and self.shards > 1 else None
        now = time.monotonic()
        for d in {"all", k, node}:
            t = self._down_at.get(d)
            if t is not None and now - t < self.reconnect_interval:
                self._counters["errors"] += 1
                return default, False
        try:
            try:
                out = fn()
            except self._conn_errors as e:
                # a cluster client's topology refresh (after another node failed) can fail a call on a
                # healthy shard once, naming the other node: that call is tried again
                if not self._retry_unavailable or shard is None or node is None or node in str(e) or \
                        isinstance(e, self._auth_errors):
                    raise
                out = fn()
        except self._errors as e:
            reason, category = describe_error(e)
            if category is StoreUnavailableWarning:
                t = time.monotonic()
                if k in ("all", "multi") or self._client is None:  # no client: no node was reached at all
                    self._down_at["all" if self._whole_store_down(e) else k] = t
                else:  # every shard of that node rests, not only this one
                    self._down_at[node if node is not None and node in str(e) else k] = t
            self._failed_reason(k, f"{what} at {self.url}", reason, category)
            return default, False
        self._down_at.pop(k, None)
        self._down_at.pop("all", None)
        if node is not None:
            self._down_at.pop(node, None)
        if k == "all" or every_shard:
            self._failing_keys.clear()
        else:  # a shard (or a call on many: it may have skipped a dead node's shards) works again
            self._failing_keys.discard(k)
        return out, True

    def _whole_store_down(self, exc) -> bool:
        return True

    def _node_of(self, shard: int) -> str | None:
        """``host:port`` of the node that serves ``shard`` now (a cluster), or None."""
        return None

    def _failed_reason(self, k, what: str, reason: str, category) -> None:
        """Count a failure; warn when the store goes from working to failing (one warning per outage:
        a shard that keeps failing while others work does not warn again until it has worked)."""
        import warnings

        self._counters["errors"] += 1
        if not self._failing_keys:
            warnings.warn(category(f"{type(self).__name__}: {what} failed: {reason}; "
                                   f"answering misses/False until it works again"), stacklevel=5)
        self._failing_keys.add(k)

    def check(self) -> dict:
        """Reach the store once (every node of a cluster) and return :meth:`store_stats`; raises
        :class:`StoreUnavailableError` with a one-line reason (unreachable, wrong password, ACL)."""
        self._check_open()
        try:
            self._ping()
            return self._store_stats()
        except self._errors as e:
            raise StoreUnavailableError(f"{type(self).__name__} at {self.url}: {describe_error(e)[0]}") from None

    def _ping(self) -> None:
        c = self._get_client()
        c.ping()
        # a key and a script of the store's own: an ACL that refuses them fails here
        ks = self._keys_of(0)
        c.exists(ks[1])
        c.eval("return redis.call('HLEN', KEYS[1])", 1, ks[5])

    # ---- backend operations -------------------------------------------------------------------
    def _put(self, key: str, parts: list, size: int, importance: float) -> bool:
        member = parts[2]
        shard = self._shard_of(member)
        base, rate = self._score_parts(size, importance)
        score = base + rate * self._now()
        value = b"".join(parts)
        local = self.shards == 1 and self.budget_bytes is not None
        budget = self.budget_bytes if local else -1
        ttl_ms = 0 if self.ttl_s is None else max(1, int(self.ttl_s * 1000))
        keys = self._keys_of(shard, member)
        evicted, ok = self._call("put", lambda: self._script("put")(
            keys=keys, args=[member, value, size, repr(base), repr(score), budget, keys[0][:-len(member)], ttl_ms],
            ), 0, shard)
        if ok:
            self._counters["evictions"] += int(evicted)
            if self.budget_bytes is not None and not local:
                self._evict_across_shards(shard, member)
        return ok

    def _get(self, key: str) -> Entry | None:
        member = record.key_bytes(key)
        shard = self._shard_of(member)
        keys = self._keys_of(shard, member)
        _, rate = self._score_parts(1, 1.0)
        raw, ok = self._call("get", lambda: self._script("get")(
            keys=keys, args=[member, repr(rate * self._now())]), None, shard)
        if not ok or raw is None or isinstance(raw, int):
            if ok and raw == 1:
                self._counters["lost"] += 1
            return None
        try:
            return record.decode(raw, expect_key=key)
        except ForeignEntryError as e:
            self._foreign(key, shard, e)
            return None
        except CorruptEntryError:
            self._counters["corrupt_dropped"] += 1
            sha1 = hashlib.sha1(raw).hexdigest()
            self._call("drop corrupt entry", lambda: self._script("delete")(
                keys=keys, args=[member, sha1, "corrupt"]), 0, shard)
            return None

    def _foreign(self, key: str, shard: int, exc: BaseException) -> None:
        """A record of another store format: a miss and a warning; the entry stays (its writer reads it)."""
        import warnings

        self._counters["foreign"] += 1
        warnings.warn(StoreWarning(f"{type(self).__name__} at {self.url}: entry {key[:40]!r} refused ({exc}): "
                                   f"written by another kvz store format; a miss"), stacklevel=4)

        def fix():
            pipe = self._get_client().pipeline(transaction=False)
            st = self._keys_of(shard)[5]
            pipe.hincrby(st, "foreign", 1)
            pipe.hincrby(st, "hits", -1)
            pipe.hincrby(st, "misses", 1)
            pipe.execute()
        self._call("stats", fix, None, shard)

    def open_blob(self, key: str) -> BlobRanges | None:
        """The entry read with ``GETRANGE`` (one round trip per range; the open touches the entry's
        LRU rank). An entry replaced, evicted or cut short while it is read gives other or fewer
        bytes, which the caller's own checksums catch (a ``.kvz`` payload's CRC-32)."""
        kb = record.key_bytes(key)
        shard = self._shard_of(kb)
        keys = self._keys_of(shard, kb)
        ek = keys[0]
        want = record.HEADER_SIZE + record.MAX_KEY_BYTES + 4096
        _, rate = self._score_parts(1, 1.0)
        got, ok = self._call("get", lambda: self._script("head")(
            keys=keys, args=[kb, repr(rate * self._now()), want]), None, shard)
        if not ok or not got or isinstance(got, int):
            self._counters["misses"] += 1
            if ok and got == 1:
                self._counters["lost"] += 1
            return None
        total, prefix = int(got[0]), got[1]
        try:
            klen, mlen, _, _ = record.parse_head(prefix)
            if record.HEADER_SIZE + klen + mlen > len(prefix):
                end = record.HEADER_SIZE + klen + mlen - 1
                prefix, ok = self._call("get", lambda: self._get_client().getrange(ek, 0, end), b"", shard)
            base, blen, meta, imp = record.parse_prefix(prefix, total, expect_key=key)
        except ForeignEntryError as e:
            self._counters["misses"] += 1
            self._foreign(key, shard, e)
            return None
        except CorruptEntryError:
            self._counters["misses"] += 1
            self._counters["corrupt_dropped"] += 1
            self._call("drop corrupt entry", lambda: self._script("delete")(
                keys=keys, args=[kb, "", "corrupt"]), 0, shard)
            return None
        self._counters["hits"] += 1

        def read(off: int, n: int) -> bytes:
            if n == 0:
                return b""
            out, ok = self._call("get range", lambda: self._get_client().getrange(ek, base + off, base + off + n - 1),
                                 None, shard)
            if not ok:
                raise StoreReadError(f"Redis at {self.url}: ranged read of {key[:40]} failed (store unavailable)")
            return out

        return BlobRanges(key, blen, meta, imp, read)

    def contains(self, key: str) -> bool:
        kb = record.key_bytes(key)
        shard = self._shard_of(kb)
        ek = self._keys_of(shard, kb)[0]
        n, ok = self._call("contains", lambda: self._get_client().exists(ek), 0, shard)
        return bool(ok and n)

    def delete(self, key: str) -> bool:
        member = record.key_bytes(key)
        shard = self._shard_of(member)
        n, ok = self._call("delete", lambda: self._script("delete")(
            keys=self._keys_of(shard, member), args=[member, "", ""]), 0, shard)
        return bool(ok and n)

    def keys(self) -> list[str]:
        def run():
            pipe = self._get_client().pipeline(transaction=False)
            for s in range(self.shards):
                pipe.zrange(self._keys_of(s)[1], 0, -1)
            return [m for rows in pipe.execute() for m in rows]
        members, ok = self._call("keys", run, [], every_shard=True)
        return [m.decode("utf-8") for m in members] if ok else []

    def _entry_pattern(self) -> str:
        return _glob_escape("{" + self.namespace + "}:e:") + "*"

    def _scan_entries(self, c):
        """Every entry key of this namespace (a SCAN of every master)."""
        return c.scan_iter(match=self._entry_pattern(), count=1000)

    def _member_of(self, entry_key: bytes) -> tuple[int, bytes] | None:
        """(shard, member) of an entry key of this namespace, or None."""
        for s, t in enumerate(self._tags):
            p = (t + ":e:").encode()
            if entry_key.startswith(p):
                return s, entry_key[len(p):]
        return None

    def _unlink(self, c, keys: list) -> None:
        if keys:
            c.unlink(*keys)

    def clear(self) -> None:
        def run():
            c = self._get_client()
            batch = []
            for k in self._scan_entries(c):
                batch.append(k)
                if len(batch) >= 1000:
                    self._unlink(c, batch)
                    batch = []
            self._unlink(c, batch)
            for s in range(self.shards):
                self._unlink(c, self._keys_of(s)[1:])
        self._call("clear", run, None)

    def _usage(self) -> dict:
        def run():
            pipe = self._get_client().pipeline(transaction=False)
            for s in range(self.shards):
                ks = self._keys_of(s)
                pipe.zcard(ks[1])
                pipe.get(ks[4])
            res = pipe.execute()
            return sum(int(x) for x in res[0::2]), sum(int(x or 0) for x in res[1::2])
        res, ok = self._call("stats", run, None, every_shard=True)
        if not ok:
            return {"entries": None, "bytes": None, "available": False, "url": self.url}
        return {"entries": res[0], "bytes": res[1], "available": True, "url": self.url}

    def close(self) -> None:
        if not self._closed and self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - closing a dead connection must not raise
                pass
        super().close()

    def __repr__(self):
        return (f"{type(self).__name__}({self.url!r}, budget_bytes={self.budget_bytes}, policy={self.policy!r}, "
                f"namespace={self.namespace!r})")
