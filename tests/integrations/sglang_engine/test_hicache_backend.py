# ruff: noqa: F811  (pytest fixtures imported from the test library are parameters of the tests)
"""kvz's SGLang HiCache storage backend, factory-built (backend "dynamic"), with SGLang's real
MHATokenToKVPoolHost on the CPU, in all four page layouts, on real Gemma 3 KV."""
import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_testlib  # noqa: E402

sglang_testlib.require_sglang()
import torch  # noqa: E402
from sglang_testlib import EPS, PAGE, D, H, L, host_pool, kvz_extra, nrmse, sample, storage_config  # noqa: E402,F401,F811

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]


def canonical(k, v, t0, P=PAGE):
    """[2, L, P, H, D] of tokens t0:t0+P."""
    return torch.stack([k[:, t0:t0 + P], v[:, t0:t0 + P]])


def as_layout(c, layout):
    """The flat page SGLang's set_from_flat_data_page expects for this layout (its reshape conventions)."""
    if layout == "layer_first":
        return c.flatten()
    if layout == "page_first":
        return c.permute(0, 2, 1, 3, 4).flatten()
    if layout == "page_first_direct":
        return c.unsqueeze(1).flatten()
    return c.permute(0, 3, 2, 1, 4).unsqueeze(1).flatten()  # page_head: [2, 1, H, P, L, D]


def make_backend(pool, url, **kw):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    be = StorageBackendFactory.create_backend("dynamic", storage_config(kvz_extra(url, **kw)), pool)
    be.register_mem_pool_host(pool)
    return be


@pytest.mark.parametrize("lossless", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_roundtrip_all_layouts(tmp_path, sample, layout, lossless):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    from alignpred import KvzReader

    _, k, v = sample
    pool = host_pool(layout)
    be = make_backend(pool, str(tmp_path / "kvz"), kvz_lossless=lossless)
    assert type(be).__name__ == "KvzHiCacheStorage"
    n = 3  # pages 0..2 of the request; the batch starts after 2 prefix pages (positions 128, 192, 256)
    prefix = ["p0", "p1"]
    keys = [f"h{i}" for i in range(n)]
    src = torch.arange(PAGE, PAGE * (n + 1))  # host slots of the pages (page 1..3 of the pool)
    for i in range(n):
        pool.set_from_flat_data_page(int(src[i * PAGE]), as_layout(canonical(k, v, (2 + i) * PAGE), layout))
    ok = be.batch_set_v1(keys, src, HiCacheStorageExtraInfo(prefix_keys=prefix))
    assert ok == [True] * n
    assert be.batch_exists(keys + ["missing"], HiCacheStorageExtraInfo(prefix_keys=prefix)) == n
    # each page's position came from prefix_keys and is recorded in its file
    for i, key in enumerate(keys):
        meta = KvzReader(be.backend.get(be._key(key))).header["source_metadata"]
        assert int(meta["position_offset"]) == (2 + i) * PAGE and meta["kvz.position_source"] == "caller"
    dst = torch.arange(PAGE * 8, PAGE * (8 + n))
    got = be.batch_get_v1(keys, dst, HiCacheStorageExtraInfo(prefix_keys=prefix))
    assert got == [True] * n
    for i in range(n):
        want = as_layout(canonical(k, v, (2 + i) * PAGE), layout)
        have = pool.get_data_page(int(dst[i * PAGE]), flat=True)
        if lossless:
            assert torch.equal(have.view(torch.int16), want.view(torch.int16))
        else:
            c_have = have.float().reshape(-1)
            c_want = want.float().reshape(-1)
            assert nrmse(c_want.numpy(), c_have.numpy()) <= EPS
            # per tensor (layer, K/V) through the layout-independent view
            from kvz.integrations.sglang import page_to_pairs

            for (kw, vw), (kh, vh) in zip(page_to_pairs(want, layout, L, PAGE, H, D),
                                          page_to_pairs(have, layout, L, PAGE, H, D)):
                assert nrmse(kw.astype("float32"), kh.astype("float32")) <= EPS
                assert nrmse(vw.astype("float32"), vh.astype("float32")) <= EPS


def test_pages_are_layout_independent(tmp_path, sample):
    """A page stored from a page_first pool loads into a layer_first pool (same store, same key)."""
    _, k, v = sample
    a, b = host_pool("page_first"), host_pool("layer_first")
    url = str(tmp_path / "kvz")
    ba, bb = make_backend(a, url, kvz_lossless=True), make_backend(b, url, kvz_lossless=True)
    a.set_from_flat_data_page(PAGE, as_layout(canonical(k, v, 0), "page_first"))
    assert ba.batch_set_v1(["x"], torch.arange(PAGE, 2 * PAGE)) == [True]
    assert bb.batch_get_v1(["x"], torch.arange(3 * PAGE, 4 * PAGE)) == [True]
    assert torch.equal(b.get_data_page(3 * PAGE).view(torch.int16), as_layout(canonical(k, v, 0), "layer_first").view(torch.int16))


def test_v0_path_searches_the_position(tmp_path, sample):
    from alignpred import KvzReader

    _, k, v = sample
    pool = host_pool("page_first")
    be = make_backend(pool, str(tmp_path / "kvz"))
    t0 = 3 * PAGE
    pool.set_from_flat_data_page(PAGE, as_layout(canonical(k, v, t0), "page_first"))
    assert be.batch_set(["q"], [pool.get_data_page(PAGE)])
    meta = KvzReader(be.backend.get(be._key("q"))).header["source_metadata"]
    assert meta["kvz.position_source"] == "search"
    assert int(meta["position_offset"]) == t0
    out = be.batch_get(["q"], [pool.get_dummy_flat_data_page()])[0]
    assert out is not None
    assert nrmse(pool.get_data_page(PAGE).float().numpy(), out.float().numpy()) <= EPS


def test_redis_corrupt_and_down_are_misses(sample, redis_store):
    """One node or the 3-master cluster (tests/integrations/conftest.py): a damaged entry is a miss and
    gone; the store down (every node) makes reads misses and writes refusals, with a warning."""
    _, k, v = sample
    pool = host_pool("page_head")
    be = make_backend(pool, redis_store.url)
    for i in range(2):
        pool.set_from_flat_data_page(PAGE * (1 + i), as_layout(canonical(k, v, i * PAGE), "page_head"))
    assert be.batch_set_v1(["a", "b"], torch.arange(PAGE, 3 * PAGE)) == [True, True]
    assert be.batch_get_v1(["a", "b"], torch.arange(5 * PAGE, 7 * PAGE)) == [True, True]
    r = redis_store.raw()
    rk = be.backend.entry_key(be._key("a"))
    data = bytearray(r.get(rk))
    data[len(data) // 2] ^= 0x55
    r.set(rk, bytes(data))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert be.batch_get_v1(["a"], torch.arange(5 * PAGE, 6 * PAGE)) == [False]
    assert w and not be.exists("a")
    redis_store.stop()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert be.batch_exists(["b"]) == 0
        assert be.batch_get_v1(["b"], torch.arange(5 * PAGE, 6 * PAGE)) == [False]
        assert be.batch_set_v1(["c"], torch.arange(PAGE, 2 * PAGE)) == [False]
    assert w


def test_bad_config_is_a_clear_error(tmp_path):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = kvz_extra(str(tmp_path))
    del extra["kvz_metadata_from"]
    with pytest.raises(ValueError, match="metadata"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
