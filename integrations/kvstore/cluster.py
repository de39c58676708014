"""The chunk store on a Redis Cluster: entries spread over hash-tagged shards, each shard one slot."""
from __future__ import annotations

from urllib.parse import urlparse

from .errors import StoreError
from .redis_backend import RedisBackend, _glob_escape, mask_url

N_SLOTS = 16384
DEFAULT_SHARDS = 16


def parse_nodes(url: str) -> list[tuple[str, int]]:
    """The ``(host, port)`` list of ``redis+cluster://[user:pw@]host:port,host:port/...``."""
    p = urlparse(url)
    netloc = p.netloc.rsplit("@", 1)[-1]
    nodes = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):  # [ipv6]:port
            host, _, port = part[1:].partition("]")
            port = port.lstrip(":")
        else:
            host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        try:
            nodes.append((host or "127.0.0.1", int(port) if port else 6379))
        except ValueError:
            raise StoreError(f"bad Redis Cluster URL {mask_url(url)!r}: port of {part!r} is not a number") from None
    if not nodes:
        raise StoreError(f"bad Redis Cluster URL {mask_url(url)!r}: no host:port")
    return nodes


def shard_tags(namespace: str, shards: int) -> list[str]:
    """The hash tags of ``shards`` shards of ``namespace``: ``{ns/i.j}``, the smallest ``j`` whose slot
    falls in the ``i``-th of ``shards`` equal slot ranges, so shards spread over masters in proportion
    to the slots each serves (an evenly split cluster gets an even share of entries per master)."""
    from redis.crc import key_slot

    tags = []
    for i in range(shards):
        lo, hi = i * N_SLOTS // shards, (i + 1) * N_SLOTS // shards
        j = 0
        while True:
            body = f"{namespace}/{i:x}.{j:x}"
            if lo <= key_slot(body.encode()) < hi:
                break
            j += 1
        tags.append("{" + body + "}")
    return tags


class RedisClusterBackend(RedisBackend):
    """A :class:`~.redis_backend.RedisBackend` on a Redis Cluster (redis-py's ``RedisCluster``), URL
    ``redis+cluster://[user:password@]host:port[,host:port…][/]`` (``rediss+cluster://`` for TLS); any
    reachable node is enough to find the others.

    Layout: the namespace is split into ``shards`` (default 16) shards with hash tags ``{ns/i.j}``
    chosen to fall into evenly spaced slots; an entry goes to shard ``sha256(key) mod shards``. Every
    key of a shard — the entries (one string each: header, checksum, key, meta, blob) and the shard's
    bookkeeping (LRU sorted set, size and score hashes, byte total, counters) — carries the shard's
    tag, so it lives in one slot on one master, and every put, get, delete and eviction is one Lua
    script in that slot: an entry is never half-written, half-read or counted without being there.

    Budget: ``budget_bytes`` bounds the sum over all shards. A put that takes the total over it
    evicts the lowest-scoring entries of all shards (each eviction a script in its shard that checks
    the entry was not touched since it was chosen); with concurrent writers the total can exceed the
    budget by the puts in flight, until the next put. ``ttl_s``, ``policy`` and the server-side
    counters are as for one node.

    Faults: a master that dies takes its shards with it until a replica takes over (the cluster's
    ``cluster-node-timeout``, plus about a second); meanwhile reads of those shards are misses and
    puts are refused (one :class:`StoreUnavailableWarning` per outage), other shards keep working.
    Entries the dead master had not replicated yet are gone: misses. Timeouts default to 1 s
    (``socket_timeout``) and 0.5 s (``connect_timeout``), one retry, so no call blocks much longer
    than a couple of seconds on a node that stopped answering.
    """

    kind = "redis-cluster"
    _retry_unavailable = True
    _url_schemes: tuple[str, ...] = ("redis+cluster", "rediss+cluster")
    _url_hint = "redis+cluster://host:port,host:port/ or rediss+cluster://..."

    def __init__(self, url: str, budget_bytes: int | None = None, policy: str = "lru", namespace: str = "kvz", *,
                 shards: int = DEFAULT_SHARDS, socket_timeout: float = 1.0, connect_timeout: float = 0.5,
                 **kw):
        if isinstance(shards, bool) or not isinstance(shards, int) or not 1 <= shards <= 1024:
            raise StoreError(f"shards must be an int in 1..1024, got {shards!r}")
        self._n_shards = shards
        if isinstance(url, str):
            parse_nodes(url)  # a bad host list fails here, with the URL masked
        super().__init__(url, budget_bytes, policy, namespace, socket_timeout=socket_timeout,
                         connect_timeout=connect_timeout, **kw)

    def _shard_tags(self) -> list[str]:
        return shard_tags(self.namespace, self._n_shards)

    def _connect(self):
        """The RedisCluster client is made on first use (it reaches the cluster when made: a store that is
        down at start-up must answer misses, not raise)."""
        return None

    def _get_client(self):
        if self._client is None:
            from redis.backoff import NoBackoff
            from redis.cluster import ClusterNode, RedisCluster
            from redis.retry import Retry

            kw = dict(socket_timeout=self.socket_timeout, socket_connect_timeout=self.connect_timeout,
                      decode_responses=False, retry=Retry(NoBackoff(), 1), require_full_coverage=False,
                      **self._ssl_options)
            if urlparse(self._raw_url).scheme == "rediss+cluster":
                kw["ssl"] = True
            if self._password is not None:
                kw["password"] = self._password
            if self._username is not None:
                kw["username"] = self._username
            nodes = [ClusterNode(h, p) for h, p in parse_nodes(self._raw_url)]
            try:
                client = RedisCluster(startup_nodes=nodes, **kw)
            except Exception as e:  # noqa: BLE001 - redis-py words a refusal as "cluster mode is not enabled"
                self._diagnose(kw, e)
                raise
            self._register(client)
            self._client = client
        return self._client

    def _diagnose(self, kw: dict, exc: BaseException) -> None:
        """Why no startup node would give its slot map: raise the first node's own error (a wrong
        password, an ACL refusal) when it has one; return when every node is just unreachable."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        plain = {k: v for k, v in kw.items() if k not in ("retry", "require_full_coverage")}
        for h, p in parse_nodes(self._raw_url):
            c = redis.Redis(h, p, retry=Retry(NoBackoff(), 0), **plain)
            try:
                c.execute_command("CLUSTER", "SLOTS")
            except (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError):
                raise
            except redis.exceptions.ResponseError as e:
                if any(s in str(e) for s in ("NOPERM", "WRONGPASS", "NOAUTH")):
                    raise
            except (redis.exceptions.RedisError, OSError):
                continue
            finally:
                c.close()

    def _whole_store_down(self, exc) -> bool:
        import redis.exceptions as rex

        return self._client is None or isinstance(exc, rex.RedisClusterException) or \
            type(exc).__name__ == "RedisClusterUnreachableError"

    def _node_of(self, shard: int) -> str | None:
        if self._client is None:
            return None
        try:
            return self._client.get_node_from_key(self._tags[shard]).name
        except Exception:  # noqa: BLE001 - no slot map yet
            return None

    def _entry_pattern(self) -> str:
        return _glob_escape("{" + self.namespace + "/") + "*}:e:*"

    def _ping(self) -> None:
        from redis.cluster import RedisCluster

        c = self._get_client()
        c.ping(target_nodes=RedisCluster.ALL_NODES)
        for s in range(self.shards):  # every master that holds a shard, with the store's own keys and scripts
            ks = self._keys_of(s)
            c.exists(ks[1])
            c.eval("return redis.call('HLEN', KEYS[1])", 1, ks[5])

    def _unlink(self, c, keys: list) -> None:
        if keys:
            pipe = c.pipeline(transaction=False)
            for k in keys:
                pipe.unlink(k)
            pipe.execute()

    def _server_info(self, c) -> dict:
        from redis.cluster import RedisCluster

        infos = list(c.info(target_nodes=RedisCluster.PRIMARIES).values())
        out: dict = {"nodes": len(infos)}
        for k in ("used_memory", "evicted_keys", "expired_keys"):
            out[k] = sum(int(i.get(k, 0)) for i in infos)
        out["maxmemory_policy"] = sorted({str(i.get("maxmemory_policy", "?")) for i in infos})
        try:
            info = c.cluster_info()
            out["cluster_state"] = info.get("cluster_state") if isinstance(info, dict) else None
        except Exception:  # noqa: BLE001 - informative only
            pass
        return out
