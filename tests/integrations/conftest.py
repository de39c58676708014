"""The Redis stores every test folder under ``tests/integrations`` shares (the main suite and each
engine's own venv: ``lmcache_engine``, ``sglang_engine``, ``vllm_engine``):

* ``redis_server``: one real ``redis-server`` on a free loopback port, per test module;
* ``redis_cluster``: one real Redis Cluster of 3 masters with a replica each, per session
  (:class:`~kvz.integrations.kvstore.RedisClusterServer`, ~2 s to start);
* ``redis_store``: either of them behind one face (:class:`RedisStore`), parametrized ``redis`` /
  ``redis-cluster``: a test written against "a Redis store" runs on one node and on the cluster;
* ``store_url``: ``store_url(kind)`` for kinds ``directory``, ``redis``, ``redis-cluster``, a URL of a
  fresh, empty store (a new folder, or a namespace of its own on the shared server / cluster).

Every test gets a namespace of its own, so the shared servers never show one test another's
entries. A test that stops a store (``redis_store.stop()``) gets it started again at its teardown
(empty: no persistence). Missing ``redis-server`` skips, and fails under ``KVZ_REQUIRE_REDIS=1``.
Stores that a test breaks beyond a stop (a killed master, a migrated slot left half-way) are the
test's own (``RedisClusterServer(...)`` in the test), not these.
"""
from __future__ import annotations

import uuid

import pytest

REDIS_KINDS = ("redis", "redis-cluster")
STORE_KINDS = ("directory",) + REDIS_KINDS


@pytest.fixture(scope="module")
def redis_server():
    from kvz.integrations.kvstore.server import redis_server_fixture

    yield from redis_server_fixture()


@pytest.fixture(scope="session")
def redis_cluster():
    from kvz.integrations.kvstore.server import redis_cluster_fixture

    yield from redis_cluster_fixture()


class RedisStore:
    """One Redis node or the cluster, as a store test sees it.

    ``url``: the store's URL with this test's ``namespace`` in it (what ``open_url`` and every engine
    adapter take); ``server_url``: without it; ``raw()``: a plain redis-py client (``Redis`` or
    ``RedisCluster``) that reaches every key, to damage entries under the store; ``stop()`` /
    ``start()``: every node down / up again (the cluster's nodes come back with their slots, empty)."""

    def __init__(self, kind: str, server):
        self.kind = kind
        self.server = server
        self.namespace = "t" + uuid.uuid4().hex[:12]
        self._raw: list = []

    @property
    def cluster(self) -> bool:
        return self.kind == "redis-cluster"

    @property
    def server_url(self) -> str:
        return self.server.url

    @property
    def url(self) -> str:
        return f"{self.server.url}?namespace={self.namespace}"

    def raw(self):
        import redis

        if self.cluster:
            host, port = self.server.addresses[0].rsplit(":", 1)
            c = redis.RedisCluster(host=host, port=int(port), password=self.server.password)
        else:
            c = redis.Redis.from_url(self.server.url)
        self._raw.append(c)
        return c

    @property
    def running(self) -> bool:
        nodes = self.server.nodes if self.cluster else [self.server]
        return all(n.running for n in nodes)

    def stop(self) -> None:
        for c in self._raw:
            c.close()
        if self.cluster:
            for n in self.server.nodes:
                n.stop()
        else:
            self.server.stop()

    def start(self) -> None:
        if not self.running:
            self.server.start()  # the cluster: every node, then waits for cluster_state:ok

    def close(self) -> None:
        for c in self._raw:
            c.close()
        self.start()


@pytest.fixture(params=REDIS_KINDS)
def redis_store(request):
    """A :class:`RedisStore`: one node, then the 3-master cluster."""
    st = RedisStore(request.param, request.getfixturevalue("redis_server" if request.param == "redis"
                                                             else "redis_cluster"))
    yield st
    st.close()


@pytest.fixture
def store_url(request, tmp_path):
    """``store_url(kind) -> URL`` of a fresh store of ``kind`` (``directory``, ``redis``, ``redis-cluster``)."""
    def make(kind: str) -> str:
        if kind == "directory":
            return str(tmp_path / ("store-" + uuid.uuid4().hex[:6]))
        if kind not in REDIS_KINDS:
            raise ValueError(f"store kind {kind!r}: one of {STORE_KINDS}")
        srv = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster")
        return f"{srv.url}?namespace=t{uuid.uuid4().hex[:12]}"

    return make
