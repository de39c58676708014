# ruff: noqa: F811  (pytest fixtures imported from the test library are parameters of the tests)
"""kvz's LMCache remote connector (kvz over the chunk store's Redis and directory backends), through
LMCache's StorageManager / RemoteBackend and LMCacheEngine, on real Gemma 3 KV."""
import os
import sys
import time
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lmcache_testlib  # noqa: E402

lmcache_testlib.require_lmcache()
import torch  # noqa: E402
from lmcache_testlib import EPS, SAMPLE, D, H, L, chunk_errors, kvz_extra, lm_config, lm_metadata, sample  # noqa: E402,F401,F811

CONN = {"remote_storage_plugin.kvzr.module_path": "kvz.integrations.lmcache",
        "remote_storage_plugin.kvzr.class_name": "KvzRemoteConnector"}


def remote_config(url, chunk_size=256, **kw):
    extra = dict(CONN, **kvz_extra("remote_storage_plugin.kvzr", url=url, **kw))
    return lm_config(chunk_size, extra_config=extra, remote_storage_plugins=["kvzr"], remote_serde="naive")


def key(i):
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(model_name="gemma-3-270m", world_size=1, worker_id=0, chunk_hash=i, dtype=torch.bfloat16)


def put_chunk(sm, kv, k, a, b):
    from lmcache.v1.memory_management import MemoryFormat

    obj = sm.allocate(torch.Size([2, L, b - a, H * D]), torch.bfloat16, fmt=MemoryFormat.KV_2LTD)
    for i in range(L):
        obj.tensor[:, i].copy_(kv[i][:, a:b].reshape(2, b - a, H * D))
    sm.batched_put([k], [obj])  # batched_put drops the caller's reference itself (LMCache's contract)


def wait_stored(remote, k, timeout=120):
    t0 = time.time()
    while remote.exists_in_put_tasks(k) or not remote.contains(k):
        if time.time() - t0 > timeout:
            raise TimeoutError("put did not land")
        time.sleep(0.05)


def warm_decoder():
    """Compile the decode kernels before a read that LMCache waits at most 10 s for (on a fresh
    machine numba's first compile takes longer; the connector warms up in the background too)."""
    from kvz.integrations.lmcache import KvzChunkCodec, metadata_from_file

    KvzChunkCodec(eps=EPS, cache_metadata=metadata_from_file(SAMPLE)).warmup(L, H, D)


def storage_manager(cfg, chunk_size=256):
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    return StorageManager(config=cfg, metadata=lm_metadata(chunk_size), event_manager=EventManager())


@pytest.mark.parametrize("store", ["directory", "redis", "redis-cluster"])
def test_storage_manager_remote_roundtrip(tmp_path, sample, store, store_url):
    url = store_url(store)  # a fresh store (tests/integrations/conftest.py)
    _, kv = sample
    sm = storage_manager(remote_config(url))
    try:
        remote = sm.storage_backends["RemoteBackend-kvzr"]
        k = key(42)
        put_chunk(sm, kv, k, 192, 448)  # a chunk at position 192 (the sample's last 256 tokens)
        wait_stored(remote, k)
        warm_decoder()
        sm.storage_backends["LocalCPUBackend"].remove(k)
        got = sm.get(k)
        assert got is not None
        out = [got.tensor[:, i].reshape(2, 256, H, D) for i in range(L)]
        assert chunk_errors([x[:, 192:448] for x in kv], out, 0, 256) <= EPS
    finally:
        sm.close()


def test_engine_store_retrieve_over_redis(sample, redis_store):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from kvz.integrations.lmcache import CPUBufferConnector

    ids, kv = sample
    cfg = remote_config(redis_store.url, lossless=True)
    cfg.local_cpu = False
    name = "kvz-remote-engine"
    engine = LMCacheEngineBuilder.get_or_create(name, cfg, lm_metadata(), CPUBufferConnector(L, H, D, 256),
                                                lambda t, s: None, lambda o, s: o)
    try:
        engine.post_init()
        tokens = torch.tensor(ids, dtype=torch.long)
        engine.store(tokens, kvcaches=kv)
        t0 = time.time()
        while engine.lookup(tokens) < 256:
            assert time.time() - t0 < 120
            time.sleep(0.05)
        out = [torch.zeros_like(x) for x in kv]
        mask = engine.retrieve(tokens, kvcaches=out)
        assert int(mask.sum()) == 256
        assert all(torch.equal(a[:, :256], b[:, :256]) for a, b in zip(kv, out))  # lossless: bit-exact
    finally:
        LMCacheEngineBuilder.destroy(name)


def test_store_down_and_corrupt_entry_are_misses(sample, redis_store):
    from kvz.integrations.lmcache import KvzRemoteConnector

    _, kv = sample
    sm = storage_manager(remote_config(redis_store.url))
    try:
        remote = sm.storage_backends["RemoteBackend-kvzr"]
        k = key(5)
        put_chunk(sm, kv, k, 0, 256)
        wait_stored(remote, k)
        sm.storage_backends["LocalCPUBackend"].remove(k)
        conn = KvzRemoteConnector(sm.loop if hasattr(sm, "loop") else None, sm.storage_backends["LocalCPUBackend"],
                                  sm.config if hasattr(sm, "config") else remote.config)
        assert conn.codec.wait_ready(300) and conn.codec.warmup_s > 0  # compiled at start-up, in the background
        # corrupt the stored entry in Redis (one node or the cluster): a miss and a warning, the entry is gone
        r = redis_store.raw()
        rk = conn.backend.entry_key(k.to_string())
        data = bytearray(r.get(rk))
        data[len(data) // 2] ^= 0xFF
        r.set(rk, bytes(data))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert conn._get_sync(k) is None
        assert w and not conn.exists_sync(k)
        # the server (every node of the cluster) goes away: contains/get are misses with a warning, nothing raises
        put_chunk(sm, kv, key(6), 0, 256)
        wait_stored(remote, key(6))
        redis_store.stop()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert conn._get_sync(key(6)) is None
            assert conn.exists_sync(key(6)) is False
        assert w
    finally:
        sm.close()


def test_read_lmcache_gave_up_on_releases_its_buffer(tmp_path, sample):
    """LMCache cancels a read that outlasts its blocking timeout; the decode still lands in a buffer
    of LMCache's allocator, which the connector then releases (not left to LMCache's garbage-collector
    safety net, which warns of a missed ref_count_down)."""
    import asyncio
    import gc
    import logging
    import threading

    from kvz.integrations.kvstore import DirectoryBackend
    from kvz.integrations.lmcache import KvzRemoteConnector

    class HeldBackend(DirectoryBackend):  # a read that waits, so LMCache's cancel comes mid-read
        started, go = threading.Event(), threading.Event()

        def get(self, key):
            self.started.set()
            self.go.wait(60)
            return super().get(key)

    _, kv = sample
    sm = storage_manager(remote_config("file://" + str(tmp_path / "remote")))
    loop = asyncio.new_event_loop()
    try:
        local = sm.storage_backends["LocalCPUBackend"]
        backend = HeldBackend(str(tmp_path / "mine"))
        conn = KvzRemoteConnector(loop, local, sm.config if hasattr(sm, "config") else None, backend=backend)
        assert conn.codec.wait_ready(300)
        obj = sm.allocate(torch.Size([2, L, 256, H * D]), torch.bfloat16)
        for i in range(L):
            obj.tensor[:, i].copy_(kv[i][:, :256].reshape(2, 256, H * D))
        loop.run_until_complete(conn.put(key(7), obj))
        obj.ref_count_down()
        alloc = getattr(local.memory_allocator, "pin_allocator", local.memory_allocator)  # LMCache's CPU pool
        before = alloc.total_allocated_size
        seen: list = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda r: seen.append(r.getMessage())  # LMCache's loggers do not propagate to the root
        logging.getLogger("lmcache.v1.memory_management").addHandler(handler)
        task = loop.create_task(conn.get(key(7)))
        while not backend.started.is_set():
            loop.run_until_complete(asyncio.sleep(0.01))
        task.cancel()  # what LMCache's get_blocking does on its timeout
        with pytest.raises(asyncio.CancelledError):
            loop.run_until_complete(task)
        backend.go.set()
        t0 = time.time()
        while alloc.total_allocated_size == before and time.time() - t0 < 30:  # the late read allocates ...
            loop.run_until_complete(asyncio.sleep(0.01))
        while alloc.total_allocated_size != before:  # ... decodes, and is released
            assert time.time() - t0 < 60, "the buffer of a cancelled read was not released"
            loop.run_until_complete(asyncio.sleep(0.01))
            gc.collect()
        logging.getLogger("lmcache.v1.memory_management").removeHandler(handler)
        assert not [m for m in seen if "garbage collected" in m], seen
        got = loop.run_until_complete(conn.get(key(7)))  # an uncancelled read still hits
        assert got is not None
        got.ref_count_down()
    finally:
        loop.close()
        sm.close()
