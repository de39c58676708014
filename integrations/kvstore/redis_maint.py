"""The budget across shards, whole-store statistics and garbage collection of the Redis backends (a
mixin of RedisBackend)."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from . import record
from .errors import CorruptEntryError, ForeignEntryError, StoreUnavailableError

STORE_COUNTERS = ("puts", "hits", "misses", "corrupt", "foreign", "evicted", "lost")


class RedisMaintenance:
    """``store_stats()`` and ``gc()`` over every shard of a :class:`~.redis_backend.RedisBackend`."""

    if TYPE_CHECKING:  # what RedisBackend provides
        kind: str
        url: str
        namespace: str

        @property
        def shards(self) -> int: ...

        _call: Any
        _counters: dict
        budget_bytes: int | None
        _node_of: Any
        _conn_errors: tuple
        _get_client: Any
        _keys_of: Any
        _script: Any
        _scan_entries: Any
        _member_of: Any

    def _evict_across_shards(self, shard: int, member: bytes) -> None:
        """Evict the lowest-scoring entries of all shards until their total fits the budget (not
        atomic with other clients' puts: the budget can be exceeded by the puts in flight, until
        the next put)."""
        def each_shard(cmd):
            """``cmd(pipe, shard)`` on every shard; the replies, None for a shard that failed (its node down:
            the budget is kept over the shards that answer)."""
            c = self._get_client()
            pipe = c.pipeline(transaction=False)
            for s in range(self.shards):
                cmd(pipe, s)
            try:
                return [None if isinstance(v, Exception) else v for v in pipe.execute(raise_on_error=False)]
            except self._conn_errors:  # one node down fails the pipeline: shard by shard, that node's skipped
                out, dead = [], set()
                for s in range(self.shards):
                    node = self._node_of(s)
                    try:
                        out.append(None if node in dead else cmd(c, s))
                    except self._conn_errors:
                        dead.add(node)
                        out.append(None)
                return out

        total, ok = self._call("eviction", lambda: sum(int(v or 0) for v in each_shard(
            lambda p, s: p.get(self._keys_of(s)[4]))), 0)
        rounds = 0
        while ok and total > self.budget_bytes and rounds < 8:
            rounds += 1
            lows, ok = self._call("eviction", lambda: each_shard(
                lambda p, s: p.zrange(self._keys_of(s)[1], 0, 3, withscores=True)), [])
            cands = sorted((sc, s, m) for s, rows in enumerate(lows) for m, sc in (rows or [])
                           if not (s == shard and m == member))
            if not cands:
                return
            for sc, s, m in cands:
                if total <= self.budget_bytes:
                    return
                freed, ok = self._call("eviction", lambda: self._script("evict")(
                    keys=self._keys_of(s, m), args=[m, repr(sc)]), -1, s)
                if not ok:
                    ok = True
                    continue
                if int(freed) >= 0:
                    total -= int(freed)
                    self._counters["evictions"] += 1

    def _store_stats(self) -> dict:
        c = self._get_client()
        pipe = c.pipeline(transaction=False)
        for s in range(self.shards):
            ks = self._keys_of(s)
            pipe.zcard(ks[1])
            pipe.get(ks[4])
            pipe.hgetall(ks[5])
        res = pipe.execute()
        out = {"backend": self.kind, "url": self.url, "namespace": self.namespace, "shards": self.shards,
               "entries": sum(int(x) for x in res[0::3]), "bytes": sum(int(x or 0) for x in res[1::3])}
        counters = dict.fromkeys(STORE_COUNTERS, 0)
        for h in res[2::3]:
            for k, v in h.items():
                name = k.decode() if isinstance(k, bytes) else str(k)
                if name in counters:
                    counters[name] += int(v)
        out.update(counters)
        out["server"] = self._server_info(c)
        return out

    def _server_info(self, c) -> dict:
        """Summed INFO of the server(s): memory used, keys the server itself evicted or expired."""
        info = c.info()
        infos = list(info.values()) if info and isinstance(next(iter(info.values())), dict) else [info]
        out: dict = {"nodes": len(infos)}
        for k in ("used_memory", "evicted_keys", "expired_keys"):
            out[k] = sum(int(i.get(k, 0)) for i in infos)
        out["maxmemory_policy"] = sorted({str(i.get("maxmemory_policy", "?")) for i in infos})
        return out

    def store_stats(self) -> dict:
        """Whole-store figures from the server (every client's counters): ``entries``, ``bytes``, ``puts``,
        ``hits``, ``misses``, ``corrupt``, ``foreign``, ``evicted`` (by the budget), ``lost`` (indexed
        entries found gone: the server's maxmemory eviction, expiry, a node lost) and ``server`` (INFO).
        ``available`` False (and the reason) when the store cannot be reached."""
        out, ok = self._call("stats", self._store_stats, None)
        if not ok:
            return {"backend": self.kind, "url": self.url, "available": False}
        out["available"] = True
        return out

    def gc(self, verify: bool = False) -> dict:
        """Remove orphaned parts: entries without bookkeeping (left when the server evicted the
        bookkeeping keys under ``allkeys-*``), bookkeeping of entries that are gone, and recompute each
        shard's byte total; with a budget, evict down to it (puts during an outage can leave the store
        over it). ``verify``: also read every entry and drop those that fail their checksum. Returns
        counts (``orphans``, ``stale``, ``corrupt``, ``checked``, ``total_fixed_bytes``, ``evicted``)."""
        def run():
            c = self._get_client()
            seen: dict[int, set] = {s: set() for s in range(self.shards)}
            out = {"checked": 0, "orphans": 0, "stale": 0, "corrupt": 0, "total_fixed_bytes": 0}
            for k in self._scan_entries(c):
                sm = self._member_of(bytes(k))
                if sm is None:
                    continue
                seen[sm[0]].add(sm[1])
            for s in range(self.shards):
                ks = self._keys_of(s)
                pipe = c.pipeline(transaction=False)
                pipe.zrange(ks[1], 0, -1)
                pipe.hkeys(ks[2])
                pipe.hkeys(ks[3])
                z, h1, h2 = pipe.execute()
                for m in seen[s] | set(z) | set(h1) | set(h2):
                    out["checked"] += 1
                    r = self._script("gc_member")(keys=self._keys_of(s, m), args=[m])
                    r = r.decode() if isinstance(r, bytes) else str(r)
                    if r in ("orphan", "stale"):
                        out[r + "s" if r == "orphan" else r] += 1
                    elif verify and m in seen[s]:
                        raw = c.get(self._keys_of(s, m)[0])
                        if raw is None:
                            continue
                        try:
                            record.decode(raw, expect_key=m.decode("utf-8", "replace"))
                        except ForeignEntryError:
                            continue
                        except CorruptEntryError:
                            self._script("delete")(keys=self._keys_of(s, m), args=[m, hashlib.sha1(raw).hexdigest(),
                                                                                 "corrupt"])
                            out["corrupt"] += 1
                old, new = self._script("gc_total")(keys=ks, args=[])
                out["total_fixed_bytes"] += abs(int(old) - int(new))
            return out
        res, ok = self._call("gc", run, None)
        if not ok:
            raise StoreUnavailableError(f"{type(self).__name__} at {self.url}: gc failed (store unavailable)")
        if self.budget_bytes is not None:  # puts during an outage can leave the store over its budget
            before = self._counters["evictions"]
            self._evict_across_shards(-1, b"")
            res["evicted"] = self._counters["evictions"] - before
        return res
