# ruff: noqa: F811  (pytest fixtures imported from the test library are parameters of the tests)
"""kvz's LMCache storage plugin through LMCache's own StorageManager and LMCacheEngine, on real Gemma 3 KV."""
import os
import sys
import time
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lmcache_testlib  # noqa: E402

lmcache_testlib.require_lmcache()
import torch  # noqa: E402
from lmcache_testlib import EPS, D, H, L, chunk_errors, kvz_extra, lm_config, lm_metadata, sample  # noqa: E402,F401,F811

PLUGIN = {"storage_plugin.kvz.module_path": "kvz.integrations.lmcache",
          "storage_plugin.kvz.class_name": "KvzStoragePlugin"}


def plugin_config(path, chunk_size=256, **kw):
    extra = dict(PLUGIN, **kvz_extra("storage_plugin.kvz", path=str(path), **kw))
    return lm_config(chunk_size, extra_config=extra, storage_plugins=["kvz"])


def key(i):
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(model_name="gemma-3-270m", world_size=1, worker_id=0, chunk_hash=i, dtype=torch.bfloat16)


def chunk_obj(sm, kv, a, b):
    """A KV_2LTD memory object of tokens a:b from the storage manager's allocator."""
    from lmcache.v1.memory_management import MemoryFormat

    obj = sm.allocate(torch.Size([2, L, b - a, H * D]), torch.bfloat16, fmt=MemoryFormat.KV_2LTD)
    for i in range(L):
        obj.tensor[:, i].copy_(kv[i][:, a:b].reshape(2, b - a, H * D))
    return obj


def wait_for(pred, timeout=120):
    t0 = time.time()
    while not pred():
        if time.time() - t0 > timeout:
            raise TimeoutError("timed out")
        time.sleep(0.05)


def test_storage_manager_roundtrip_and_position(tmp_path, sample):
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    _, kv = sample
    sm = StorageManager(config=plugin_config(tmp_path / "kvz", chunk_size=128), metadata=lm_metadata(128),
                        event_manager=EventManager())
    try:
        plugin = sm.storage_backends["kvz"]
        assert type(plugin).__name__ == "KvzStoragePlugin"
        keys = [key(100 + j) for j in range(3)]
        objs = [chunk_obj(sm, kv, 128 * j, 128 * (j + 1)) for j in range(3)]
        sm.batched_put(keys, objs)  # drops the caller's references itself (LMCache's contract)
        plugin.wait()
        for k in keys:
            assert plugin.contains(k)
        # drop the CPU copies so the reads come from the kvz tier
        for k in keys:
            sm.storage_backends["LocalCPUBackend"].remove(k)
        for j, k in enumerate(keys):
            assert sm.contains(k) == "kvz"
            got = sm.get(k)
            assert got is not None
            t = got.tensor
            ref = [x[:, 128 * j:128 * (j + 1)] for x in kv]
            out = [t[:, i].reshape(2, 128, H, D) for i in range(L)]
            assert chunk_errors(ref, out, 0, 128) <= EPS
        # the rotary phase of each chunk was found by the search and recorded in its file
        from alignpred import KvzReader
        from kvz.integrations.lmcache._common import unpack

        for j, k in enumerate(keys):
            _, blob = unpack(plugin.backend.get(k.to_string()))
            sm_meta = KvzReader(blob).header["source_metadata"]
            assert int(sm_meta["position_offset"]) == 128 * j
            assert sm_meta["kvz.position_source"] == "search"
        assert sm.remove(keys[0]) >= 1 and not plugin.contains(keys[0])
    finally:
        sm.close()


def test_keys_bind_the_served_weights(tmp_path, sample):
    """Two checkpoints served under one name (LMCache's keys carry the name only) never read each
    other's chunks from one kvz store; the same checkpoint in another folder does (issue 38 item 4)."""
    import shutil

    import numpy as np
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    def model(d, seed):
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write('{"model_type": "gemma3_text"}')
        with open(os.path.join(d, "model.safetensors"), "wb") as f:
            f.write(np.random.default_rng(seed).bytes(1 << 20))
        return str(d)

    a, b = model(tmp_path / "a" / "gemma", 0), model(tmp_path / "b" / "gemma", 1)
    a2 = str(tmp_path / "a2" / "gemma")
    shutil.copytree(a, a2)
    _, kv = sample
    found = {}
    for name, folder in (("a", a), ("b", b), ("a2", a2)):
        sm = StorageManager(config=plugin_config(tmp_path / "kvz", warmup=False), event_manager=EventManager(),
                            metadata=lm_metadata(model_name=folder))
        try:
            plugin = sm.storage_backends["kvz"]
            if name == "a":
                sm.batched_put([key(5)], [chunk_obj(sm, kv, 0, 256)])
                plugin.wait()
            found[name] = plugin.contains(key(5))
        finally:
            sm.close()
    assert found == {"a": True, "b": False, "a2": True}, found


def test_corrupt_entry_and_store_down_are_misses(tmp_path, sample):
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    _, kv = sample
    sm = StorageManager(config=plugin_config(tmp_path / "kvz"), metadata=lm_metadata(),
                        event_manager=EventManager())
    try:
        plugin = sm.storage_backends["kvz"]
        k = key(7)
        sm.batched_put([k], [chunk_obj(sm, kv, 0, 256)])
        plugin.wait()
        sm.storage_backends["LocalCPUBackend"].remove(k)
        path = plugin.backend.entry_path(k.to_string())
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert plugin.get_blocking(k) is None
        assert w, "a corrupt entry must warn"
        assert not plugin.contains(k)
        # a store that is down (its directory gone and unwritable): puts and gets are misses with a warning
        plugin.backend.close()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert plugin.get_blocking(k) is None
            assert plugin.contains(k) is False
        assert w
    finally:
        sm.close()


@pytest.mark.parametrize("lossless", [False, True])
def test_engine_store_retrieve(tmp_path, sample, lossless):
    """LMCacheEngineBuilder.get_or_create + store + retrieve on CPU through the kvz tier only."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    from kvz.integrations.lmcache import CPUBufferConnector

    ids, kv = sample
    # 448 tokens: one full 256-token chunk and a 192-token partial one (not saved)
    cfg = plugin_config(tmp_path / "kvz", lossless=lossless)
    cfg.local_cpu = False  # the CPU tier is only a buffer: hits must come from kvz
    name = f"kvz-engine-{int(lossless)}"
    conn = CPUBufferConnector(L, H, D, 256)
    engine = LMCacheEngineBuilder.get_or_create(name, cfg, lm_metadata(), conn, lambda t, s: None, lambda o, s: o)
    try:
        engine.post_init()
        tokens = torch.tensor(ids, dtype=torch.long)
        engine.store(tokens, kvcaches=kv)
        plugin = engine.storage_manager.storage_backends["kvz"]
        plugin.wait()
        wait_for(lambda: engine.lookup(tokens) >= 256)
        out = [torch.zeros_like(x) for x in kv]
        mask = engine.retrieve(tokens, kvcaches=out)
        n = int(mask.sum())
        assert n == 256, n
        worst = chunk_errors(kv, out, 0, 256)
        if lossless:
            assert all(torch.equal(a[:, :256], b[:, :256]) for a, b in zip(kv, out))
        else:
            assert worst <= EPS
        assert all(int(torch.count_nonzero(o[:, 256:])) == 0 for o in out)  # the partial chunk was not stored
        st = plugin.codec.stats
        assert st["encoded"] == 1 and st["decoded"] >= 1
    finally:
        LMCacheEngineBuilder.destroy(name)


def test_bad_config_is_a_clear_error(tmp_path):
    from kvz.integrations.lmcache import KvzStoragePlugin

    cfg = lm_config(extra_config=dict(PLUGIN, **{"storage_plugin.kvz.path": str(tmp_path)}), storage_plugins=["kvz"])
    with pytest.raises(ValueError, match="metadata"):
        KvzStoragePlugin(config=cfg, metadata=lm_metadata(), local_cpu_backend=None, loop=None)
    assert os.path.isdir(tmp_path)
