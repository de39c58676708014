"""integrations.pager: bit-exact paging of token ranges x layers into caller buffers, only the objects
asked for (counted), the memory budget (peak never above it, any budget down to 0), prefetch on
the pool, layer-by-layer overlap, errors, concurrency."""
import threading
import time

import numpy as np
import pytest
from kvz_test_helpers import synthetic_cache

from alignpred import ChecksumError, ErrorBudget, KvzError, KvzReader, compress_bytes, fit_bank
from kvz.integrations.pager import ArraySource, KvPager, KvzSource, kv_bytes

T, L, H, D = 700, 4, 2, 16  # 3 objects: 256, 256, 188 positions


@pytest.fixture(scope="module")
def kvz():
    cache = synthetic_cache(n_layers=L, heads=H, T=T, d=D, seed=3)
    bank = fit_bank([cache], rank=None)
    blob = compress_bytes(cache, budget=0.05, bank=bank)
    return cache, bank, blob, KvzReader(blob, bank=bank).read()


def _page_bytes(rows):
    return 2 * H * rows * D * 2  # float16


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


RANGES = [(0, 700), (10, 20), (250, 260), (255, 513), (600, 700), (256, 512), (699, 700)]
LAYERS = [None, [0], [2], [1, 3], [3, 0]]


@pytest.mark.parametrize("workers", [1, 2, 4])
def test_matches_reader_bit_exactly(kvz, workers):
    cache, bank, blob, full = kvz
    with KvPager(budget_bytes=1 << 22, workers=workers) as p:
        p.add("a", KvzSource(blob, bank=bank))
        for tokens in RANGES:
            for layers in LAYERS:
                got = p.read("a", tokens, layers)
                want = KvzReader(blob, bank=bank).read(tokens=tokens, layers=sorted(layers) if layers else None)
                assert sorted(got) == sorted(want)
                for k in want:
                    assert _same(got[k], want[k]), (tokens, layers, k)
                    assert _same(got[k], full[k][:, tokens[0]:tokens[1]])


def test_array_source_is_exact_and_counts(kvz):
    cache = kvz[0]
    with KvPager(budget_bytes=1 << 22) as p:
        p.add("raw", ArraySource(cache))
        got = p.read("raw", (300, 650), [1, 2])
        for k, v in got.items():
            assert _same(v, cache.tensors[k][:, 300:650])
        assert p.source("raw").objects_decoded == 2 * 2 * 2  # 2 objects x 2 layers x (K, V): layers independent


def test_decodes_only_requested_objects(kvz):
    _, bank, blob, _ = kvz
    with KvPager(budget_bytes=1 << 22, workers=2) as p:
        src = KvzSource(blob, bank=bank)
        p.add("a", src)
        p.load("a", (300, 400), [2])  # object 1; layers 0..2 are decoded (prediction chain), layer 2 kept
        assert src.objects_decoded == 1 * 2 * 3 == p.stats["objects_decoded"]
        p.load("a", (300, 400), [2])  # resident: a copy, no decode
        assert src.objects_decoded == 6 and p.stats["page_hits"] == 1
        p.load("a", (260, 500), [3])  # same object, layer 3: the chain 0..3 again
        assert src.objects_decoded == 6 + 8
        p.load("a", (0, 700), [0])  # three objects of layer 0
        assert src.objects_decoded == 14 + 6
        p.load("a", (0, 700), [0, 2, 3])  # object 1 fully resident; objects 0, 2 need layers 2, 3
        assert src.objects_decoded == 20 + 2 * (2 * 4)
        st = p.stats
        assert st["pages_decoded"] == 1 + 1 + 3 + 4 and st["page_misses"] == st["pages_decoded"]


def test_prefetch_then_load_is_all_hits(kvz):
    _, bank, blob, full = kvz
    with KvPager(budget_bytes=1 << 22, workers=2) as p:
        p.add("a", KvzSource(blob, bank=bank))
        h = p.prefetch("a")
        assert h.pages == 3 * L and h.skipped == 0
        h.wait(timeout=60)
        n = p.stats["objects_decoded"]
        assert n == 3 * 2 * L
        got = p.read("a")
        assert p.stats["objects_decoded"] == n and p.stats["page_hits"] == 3 * L and p.stats["page_misses"] == 0
        for k in full:
            assert _same(got[k], full[k])
        assert p.prefetch("a").resident == 3 * L  # nothing left to queue


@pytest.mark.parametrize("budget_pages", [0, 1, 3, 5, 12])
def test_budget_is_honoured(kvz, budget_pages):
    _, bank, blob, full = kvz
    budget = budget_pages * _page_bytes(256)
    with KvPager(budget_bytes=budget, workers=2) as p:
        p.add("a", KvzSource(blob, bank=bank))
        for _ in range(2):
            p.prefetch("a", (0, 700))
            got = p.read("a", (100, 650))
            for k in full:
                assert _same(got[k], full[k][:, 100:650])
        st = p.stats
        assert st["peak_bytes"] <= budget and st["resident_bytes"] + st["reserved_bytes"] <= budget
        if budget_pages < 4:  # a stripe of 4 layers does not fit: decoded straight into the caller's buffers
            assert st["direct_pages"] > 0
        if budget_pages == 0:
            assert st["peak_bytes"] == 0 and st["pages_decoded"] == 0


def test_lru_eviction(kvz):
    _, bank, blob, _ = kvz
    budget = 2 * L * _page_bytes(256)  # two objects' worth of pages
    with KvPager(budget_bytes=budget, workers=1) as p:
        p.add("a", KvzSource(blob, bank=bank))
        p.load("a", (0, 256))
        p.load("a", (256, 512))
        assert p.stats["evictions"] == 0
        p.load("a", (512, 700))  # 188-row pages: evicts the oldest pages of object 0 (layers 0, 1, 2), no more
        st = p.stats
        assert st["evictions"] == 3 and st["resident_bytes"] <= budget
        assert sorted(k[1:] for k in p.resident_pages() if k[1] == 0) == [(0, 3)]
        n = st["objects_decoded"]
        p.load("a", (256, 512))  # still resident
        assert p.stats["objects_decoded"] == n
        p.load("a", (0, 10))  # layers 0..2 were evicted: decoded again (layer 3 is a hit)
        assert p.stats["objects_decoded"] == n + 2 * 3


def test_torch_buffers_and_cast(kvz):
    torch = pytest.importorskip("torch")
    _, bank, blob, full = kvz
    with KvPager(budget_bytes=1 << 22) as p:
        p.add("a", KvzSource(blob, bank=bank))
        bufs = {i: (torch.zeros(1, H, 400, D), torch.zeros(1, H, 400, D)) for i in range(L)}
        seen = [i for i, _, _ in p.layers("a", (200, 600), out=lambda i: bufs[i])]
        assert seen == list(range(L))
        for i in range(L):
            assert np.array_equal(bufs[i][0][0].numpy(), full[f"layers.{i}.key"][:, 200:600].astype(np.float32))
            assert np.array_equal(bufs[i][1][0].numpy(), full[f"layers.{i}.value"][:, 200:600].astype(np.float32))
        with pytest.raises(KvzError, match="shape"):
            p.load("a", (0, 10), [0], out=lambda i: (np.zeros((H, 11, D)), np.zeros((H, 11, D))))
        with pytest.raises(KvzError, match="outside"):
            p.load("a", (0, 701))
        with pytest.raises(KvzError, match="layers"):
            p.load("a", (0, 10), [L])


class _SlowSource(ArraySource):
    """An ArraySource whose decode takes time per layer and logs when each layer is done."""

    def __init__(self, cache, delay, log):
        super().__init__(cache)
        self.delay, self.log = delay, log

    def decode(self, j0, j1, layers, count=None):
        for item in super().decode(j0, j1, layers, count):
            time.sleep(self.delay)
            self.log.append(("decoded", j0, item[0], time.perf_counter()))
            yield item


def test_layer_by_layer_overlap():
    cache = synthetic_cache(n_layers=6, heads=1, T=600, d=8, seed=1)
    log = []
    with KvPager(budget_bytes=1 << 22, workers=3) as p:
        p.add("s", _SlowSource(cache, 0.02, log))
        for layer, _, _ in p.layers("s"):
            log.append(("yield", None, layer, time.perf_counter()))
    first_yield = next(t for kind, _, layer, t in log if kind == "yield")
    last_decode = max(t for kind, _, _, t in log if kind == "decoded")
    assert first_yield < last_decode  # layer 0 reached the caller while higher layers were still decoding
    # the pool advances the stripes layer by layer: every stripe's layer 0 before any stripe's layer 5
    order = [(j, layer) for kind, j, layer, _ in log if kind == "decoded"]
    assert max(order.index((j, 0)) for j in range(3)) < min(order.index((j, 5)) for j in range(3))


def test_decode_error_reaches_the_loader_and_pager_recovers(kvz):
    _, bank, blob, full = kvz
    r = KvzReader(blob, bank=bank)
    e = r.index[1]  # layer 0 key, object 1
    bad = bytearray(blob)
    bad[e.offset + e.length // 2] ^= 0xFF
    with KvPager(budget_bytes=1 << 22, workers=2) as p:
        p.add("bad", KvzSource(bytes(bad), bank=bank))
        p.add("good", KvzSource(blob, bank=bank))
        with pytest.raises(ChecksumError):
            p.load("bad", (0, 700))
        with pytest.raises(ChecksumError):
            p.prefetch("bad", (256, 300)).wait(timeout=60)
        assert p.wait_idle(timeout=60)  # the other stripes' jobs finish on the pool
        st = p.stats
        assert st["reserved_bytes"] == 0 and not p._inflight
        assert all(pins == 0 for pins in p.resident_pages().values())
        got = p.read("good")
        assert all(_same(got[k], full[k]) for k in full)
        assert _same(p.read("bad", (0, 256))["layers.3.value"], full["layers.3.value"][:, :256])  # object 0 is fine


def test_early_close_releases_pins(kvz):
    _, bank, blob, _ = kvz
    with KvPager(budget_bytes=1 << 22, workers=2) as p:
        p.add("a", KvzSource(blob, bank=bank))
        p.prefetch("a").wait(timeout=60)
        g = p.layers("a", (0, 700))
        next(g)
        g.close()
        assert p.wait_idle(timeout=60)
        assert all(pins == 0 for pins in p.resident_pages().values())


def test_concurrent_loads_under_a_small_budget(kvz):
    _, bank, blob, full = kvz
    budget = 6 * _page_bytes(256)
    errors = []
    with KvPager(budget_bytes=budget, workers=3) as p:
        for i in range(4):
            p.add(i, KvzSource(blob, bank=bank))

        def worker(i):
            try:
                rng = np.random.default_rng(i)
                for _ in range(6):
                    a = int(rng.integers(0, 650))
                    b = int(rng.integers(a + 1, 701))
                    layers = sorted(rng.choice(L, size=int(rng.integers(1, L + 1)), replace=False).tolist())
                    if rng.random() < 0.5:
                        p.prefetch(i, (a, b), layers)
                    got = p.read(i, (a, b), layers)
                    for k, v in got.items():
                        if not _same(v, full[k][:, a:b]):
                            errors.append((i, a, b, k))
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=300)
        assert not errors
        assert p.stats["peak_bytes"] <= budget


def test_drop_and_tiers(kvz, tmp_path):
    cache, bank, blob, full = kvz
    path = tmp_path / "a.kvz"
    path.write_bytes(blob)
    with KvPager(budget_bytes=1 << 22) as p:
        p.add("f", KvzSource(path, bank=bank))
        assert _same(p.read("f", (5, 6))["layers.1.key"], full["layers.1.key"][:, 5:6])
        assert p.stats["resident_pages"] == L
        p.drop("f")
        assert p.stats["resident_pages"] == 0 and p.stats["resident_bytes"] == 0
        with pytest.raises(KeyError):
            p.read("f")
    with pytest.raises(KvzError, match="tier"):
        KvzSource(blob, bank=bank, tier="exact")  # a one-tier file (or a reader without tiers)
    assert kv_bytes(cache.layout) == 2 * L * H * T * D * 2


def test_two_tier_file(kvz):
    """A lossless two-tier file: the exact tier pages the original bits, the coarse tier the lossy
    ones; the exact tier fetches the refinement objects of the layers asked for, on top of the chain."""
    cache, bank, _, _ = kvz
    from alignpred import KvzError as _E

    try:
        blob = compress_bytes(cache, budget=ErrorBudget(eps=0.05, lossless=True), bank=bank)
    except (TypeError, _E) as e:
        pytest.skip(f"no lossless tier in this codec ({e})")
    if "exact" not in getattr(KvzReader(blob, bank=bank), "tiers", ()):
        pytest.skip("no tiers")
    coarse = KvzReader(blob, bank=bank).read(tier="coarse")
    with KvPager(budget_bytes=1 << 22, workers=2) as p:
        ex, co = KvzSource(blob, bank=bank, tier="exact"), KvzSource(blob, bank=bank, tier="coarse")
        p.add("exact", ex)
        p.add("coarse", co)
        p.load("exact", (300, 400), [2])
        p.load("coarse", (300, 400), [2])
        assert co.objects_decoded == 1 * 2 * 3 and ex.objects_decoded == 1 * 2 * 3 + 1 * 2
        for tokens in [(0, 700), (255, 513)]:
            got = p.read("exact", tokens)
            assert all(_same(v, cache.tensors[k][:, tokens[0]:tokens[1]]) for k, v in got.items())
            got = p.read("coarse", tokens)
            assert all(_same(v, coarse[k][:, tokens[0]:tokens[1]]) for k, v in got.items())
        assert not all(_same(coarse[k], cache.tensors[k]) for k in coarse)
    assert KvzSource(blob, bank=bank).tier is None  # default: the best tier the file has
    assert KvzSource(blob, bank=bank).tiers == ("coarse", "exact")
