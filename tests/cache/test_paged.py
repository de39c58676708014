"""Paged KV in and out: Cache.from_paged gathers a sequence from block pools, KvzReader.read_paged
writes it back into the caller's pools (bit-exact with a lossless file)."""
from __future__ import annotations

import numpy as np
import pytest

from alignpred import Cache, ErrorBudget, KvzReader, LayoutError, compress_bytes, fit_bank
from alignpred.codec import Profile


def _pools(L=3, nb=9, bs=16, h=2, d=32, dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((nb, bs, h, d)).cumsum(axis=1) * 0.1
    k = np.stack([latent @ rng.standard_normal((d, d)) / np.sqrt(d) + 0.1 * rng.standard_normal((nb, bs, h, d))
                  for _ in range(L)]).astype(dtype)
    v = np.stack([latent @ rng.standard_normal((d, d)) / np.sqrt(d) for _ in range(L)]).astype(dtype)
    return k, v


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_paged_round_trip_lossless_is_bit_exact(dtype):
    k, v = _pools(dtype=dtype)
    table = [7, 2, 5, 0, 8]                      # 80 positions, blocks out of order
    cache = Cache.from_paged(k, v, table, n_tokens=75)
    assert cache.layout.n_tokens == 75
    bank = fit_bank([cache], rank=None)
    blob = compress_bytes(cache, budget=ErrorBudget(eps=0.05, lossless=True), bank=bank, profile=Profile(embed_bank=True))
    ko, vo = np.zeros_like(k), np.zeros_like(v)
    KvzReader(blob).read_paged(ko, vo, table)
    for t, blk in enumerate(table):
        n = min(16, 75 - 16 * t)
        assert np.array_equal(ko[:, blk, :n].view(np.uint8), k[:, blk, :n].view(np.uint8))
        assert np.array_equal(vo[:, blk, :n].view(np.uint8), v[:, blk, :n].view(np.uint8))
    untouched = [b for b in range(k.shape[1]) if b not in table]
    assert not ko[:, untouched].any() and not vo[:, untouched].any()


def test_paged_chunk_with_offset_lands_at_its_positions():
    k, v = _pools()
    table = [3, 1, 4, 6]
    cache = Cache.from_paged(k, v, table, n_tokens=32, start=16)      # positions 16..47
    assert cache.layout.position_offset == 16
    bank = fit_bank([cache], rank=None)
    r = KvzReader(compress_bytes(cache, budget=0.02, bank=bank, profile=Profile(embed_bank=True)))
    ko, vo = np.zeros_like(k), np.zeros_like(v)
    r.read_paged(ko, vo, table)
    assert not ko[:, 3].any()                                         # block 0 (positions 0..15) untouched
    err = np.linalg.norm((ko[:, [1, 4]] - k[:, [1, 4]]).astype(np.float64)) / np.linalg.norm(k[:, [1, 4]].astype(np.float64))
    assert err <= 0.02 * 1.01


def test_paged_bad_input_is_a_clear_error():
    k, v = _pools()
    with pytest.raises(LayoutError, match="outside the pool"):
        Cache.from_paged(k, v, [0, 99])
    with pytest.raises(LayoutError, match="outside the 32"):
        Cache.from_paged(k, v, [0, 1], n_tokens=40)
    with pytest.raises(LayoutError, match="num_blocks, block_size"):
        Cache.from_paged([k[0, 0]], [v[0, 0]], [0])
    with pytest.raises(LayoutError, match="key pools"):
        Cache.from_paged(k, v[:2], [0])
