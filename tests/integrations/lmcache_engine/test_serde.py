# ruff: noqa: F811  (pytest fixtures imported from the test library are parameters of the tests)
"""kvz as a registered LMCache L2 serde, through LMCache's distributed StorageManager with its
MockL2Adapter (and the FS adapter's fixed-size limitation), on real Gemma 3 KV chunks."""
import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lmcache_testlib  # noqa: E402

lmcache_testlib.require_lmcache()
import torch  # noqa: E402
from lmcache_testlib import EPS, SAMPLE, D, H, L, chunk_errors, sample  # noqa: E402,F401,F811

KW = {"eps": EPS, "bank": "gemma-3-270m", "metadata_from": SAMPLE, "chunk_size": 64}


def wait_for(pred, timeout=120.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if pred():
            return True
        time.sleep(0.05)
    return False


def manager(adapter_cfg):
    from lmcache.v1.distributed.config import (
        EvictionConfig,
        L1ManagerConfig,
        L1MemoryManagerConfig,
        StorageManagerConfig,
    )
    from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig
    from lmcache.v1.distributed.storage_manager import StorageManager

    cfg = StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(memory_config=L1MemoryManagerConfig(
            size_in_bytes=256 << 20, use_lazy=False, init_size_in_bytes=64 << 20)),
        eviction_config=EvictionConfig(eviction_policy="LRU"),
        l2_adapter_config=L2AdaptersConfig(adapters=[adapter_cfg]))
    return StorageManager(cfg)


def roundtrip(sm, kv, starts, T=256, count=None):
    """Write chunks (tokens s:s+T of the sample) to L1, wait for L2, clear L1, prefetch; returns the
    prefetch hit count and the per-chunk worst NRMSE of what was read back."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec

    layout = MemoryLayoutDesc(shapes=[torch.Size([2, L, T, H * D])], dtypes=[torch.bfloat16])
    keys = [ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(1000 + i), model_name="gemma-3-270m", kv_rank=0)
            for i in range(len(starts))]
    ret = sm.reserve_write(keys, layout)
    assert len(ret) == len(keys)
    for k, s in zip(keys, starts):
        t = ret[k].tensor
        for i in range(L):
            t[:, i].copy_(kv[i][:, s:s + T].reshape(2, T, H * D))
    sm.finish_write(list(ret))

    def stored():
        st = sm.report_status()
        n = count() if count else sum(a["stored_object_count"] for a in st["l2_adapters"])
        return (n >= len(keys)
                and st["store_controller"]["in_flight_task_count"] == 0
                and st["store_controller"]["pending_keys_count"] == 0)

    assert wait_for(stored), "L2 store did not complete"

    def drained():
        sm.clear()
        return sm.report_status()["l1_manager"]["total_object_count"] == 0

    assert wait_for(drained, 30)
    handle = sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[
        GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]))
    t0 = time.monotonic()
    while (res := sm.query_prefetch_status(handle)) is None:
        assert time.monotonic() - t0 < 120
        time.sleep(0.05)
    hits = res.hit_cells[0].count_leading_ones()
    errs = []
    if hits:
        with sm.read_prefetched_results(keys[:hits]) as objs:
            for o, s in zip(objs, starts):
                out = [o.tensor[:, i].reshape(2, T, H, D) for i in range(L)]
                errs.append(chunk_errors([x[:, s:s + T] for x in kv], out, 0, T))
        sm.finish_read_prefetched(keys[:hits])
    return hits, errs


def test_registered():
    from lmcache.v1.distributed.serde import get_registered_serde_types

    import kvz.integrations.lmcache.serde  # noqa: F401

    assert "kvz" in get_registered_serde_types()
    assert {"fp8", "turboquant"} <= set(get_registered_serde_types())


def test_mock_l2_roundtrip(sample):
    from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2AdapterConfig
    from lmcache.v1.distributed.serde import SerdeConfig

    import kvz.integrations.lmcache.serde  # noqa: F401

    _, kv = sample
    cfg = MockL2AdapterConfig(max_size_gb=0.2, mock_bandwidth_gb=10.0)
    cfg.serde_config = SerdeConfig(type="kvz", kwargs=dict(KW))
    sm = manager(cfg)
    try:
        hits, errs = roundtrip(sm, kv, [0, 64, 192])
        assert hits == 3
        assert max(errs) <= EPS, errs
    finally:
        sm.close()


def test_fs_adapter_variable_size_is_detected_and_padding_works(tmp_path, sample):
    from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2AdapterConfig
    from lmcache.v1.distributed.serde import SerdeConfig

    import kvz.integrations.lmcache.serde as kserde

    _, kv = sample

    def files(path):
        return lambda: sum(1 for e in os.scandir(path) if e.is_file() and not e.name.endswith(".tmp"))

    def fs(path, **kw):
        os.makedirs(path, exist_ok=True)
        c = FSL2AdapterConfig(base_path=str(path), relative_tmp_dir=None, read_ahead_size=None, use_odirect=False)
        c.serde_config = SerdeConfig(type="kvz", kwargs=dict(KW, **kw))
        return c

    plain = fs(tmp_path / "a")
    with pytest.raises(ValueError, match="Incomplete read"):
        kserde.check_adapter_config(plain)
    # what LMCache itself does with it: the load fails its size check — a miss, not corrupt data
    sm = manager(plain)
    try:
        hits, _ = roundtrip(sm, kv, [0], count=files(tmp_path / "a"))
        assert hits == 0
    finally:
        sm.close()
    # the work-around: fixed-size slots (size_factor of the raw chunk), padded
    padded = fs(tmp_path / "b", pad_to_estimate=True, size_factor=0.4)
    kserde.check_adapter_config(padded)
    sm = manager(padded)
    try:
        hits, errs = roundtrip(sm, kv, [0, 192], count=files(tmp_path / "b"))
        assert hits == 2 and max(errs) <= EPS
    finally:
        sm.close()
