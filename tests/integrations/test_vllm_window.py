"""Windowed loads (kvz.integrations.vllm.window): a sliding-window layer's load decodes and reads only
from the positions the rest of the prompt can attend to, writes zeros before them, and leaves every
other layer whole; the decoder then reconstructs nothing it does not need (Decoder.needed). A file
with linear maps is decoded whole (its layers need other layers' reconstructions)."""
import os
import time

import numpy as np
import pytest
from test_vllm_loader import BS, N_BLOCKS, _settings, _store, sample  # noqa: F401  (sample: a fixture)

from alignpred import KvzReader
from kvz.integrations.kvstore import DirectoryBackend
from kvz.integrations.vllm.window import layer_windows, segment_starts, skips_work, windowed_layers

W = 128  # a window that a 3-block sample can show: sliding layers decode from block 1


def _windows(types):
    return layer_windows(types, W)


def test_segment_starts():
    w = [512, None, 512]
    # 8K hit: the sliding layers start one block and one window before the first new position
    assert segment_starts(w, first_block=0, count=64, hit_blocks=64, block_size=128) == {0: 7552, 2: 7552}
    # a segment wholly before the window: nothing to decode there; one within it: everything
    assert segment_starts(w, first_block=0, count=8, hit_blocks=64, block_size=128) == {0: 1024, 2: 1024}
    assert segment_starts(w, first_block=60, count=4, hit_blocks=64, block_size=128) == {}
    # a short hit: every position is within the window
    assert segment_starts(w, first_block=0, count=4, hit_blocks=4, block_size=128) == {}
    assert layer_windows(["sliding_attention", "full_attention"], None) == [None, None]


def _filled(store, smp):
    ids, kv, _, _ = smp
    assert store.put_run(ids, 0, kv, store.block_hashes(ids, N_BLOCKS)) > 0
    return ids


def _reference(store):
    r = KvzReader(store.backend.get(store.runs[0]["key"]), bank=store.bank)
    return r, r.read()


def _lossless_fast(tmp_path, smp):
    """A lossless fast store of the sample: ``(store, whole read, segments of a lookup)``."""
    store = _store(DirectoryBackend(str(tmp_path)), smp, lossless=True, profile="fast")
    ids = _filled(store, smp)
    _, want = _reference(store)
    return store, want, store.lookup(ids, N_BLOCKS)[1]


def _check_bits(bits: np.ndarray, want: dict, name: str, start: int) -> None:
    """``bits`` (int16 view of one decoded tensor): zeros before ``start``, the whole read's after."""
    exp = want[name].view(np.int16).reshape(bits.shape)
    assert not bits[:, :start].any(), name
    assert np.array_equal(bits[:, start:], exp[:, start:]), name


def _out(n):
    bufs = {}
    return bufs, lambda i: bufs.setdefault(i, (np.full((1, n, 256), np.nan, np.float32),
                                               np.full((1, n, 256), np.nan, np.float32)))


def test_fast_file_windowed(tmp_path, sample):  # noqa: F811
    store = _store(DirectoryBackend(str(tmp_path)), sample, lossless=True, profile="fast")
    ids = _filled(store, sample)
    r, want = _reference(store)
    assert skips_work(r)
    assert sorted(r.decoder.needed({17})) == [34, 35]  # no maps: a layer needs only its own tensors
    windows = _windows(sample[2])
    _, segs = store.lookup(ids, N_BLOCKS)
    starts = segment_starts(windows, first_block=0, count=N_BLOCKS, hit_blocks=N_BLOCKS, block_size=BS)
    assert set(starts) == {i for i, w in enumerate(windows) if w} and set(starts.values()) == {BS}
    # positions count in whole objects (256 tokens): start the sliding layers at the second object
    starts = {i: 2 * BS for i in starts}
    n = N_BLOCKS * BS
    reader, tokens, src = store.open_segment(segs[0], time.monotonic() + 30, starts=starts)
    whole, _, src2 = store.open_segment(segs[0], time.monotonic() + 30)
    try:  # the windowed open fetches fewer bytes ahead
        assert sum(ln for _, ln in src.spans) < sum(ln for _, ln in src2.spans)
        _, out = _out(n)
        got = {i: (k.copy(), v.copy()) for i, k, v in windowed_layers(reader, tokens, starts, out)}
    finally:
        src.close()
        src2.close()
    assert sorted(got) == list(range(18))
    for i, (k, v) in got.items():
        for kind, x in (("key", k), ("value", v)):
            exp = np.asarray(want[f"layers.{i}.{kind}"], np.float32).reshape(x.shape)
            s = starts.get(i, 0)
            assert not x[:, :s].any(), (i, kind)
            assert np.array_equal(x[:, s:], exp[:, s:]), (i, kind)


def test_exact_tier_into_float32_buffers(tmp_path, sample):  # noqa: F811
    """A lossless file read into buffers of another dtype than its own is still exact (the refinement
    works on the native bits; it used to refine float32 values as if they were bfloat16)."""
    store = _store(DirectoryBackend(str(tmp_path)), sample, lossless=True, profile="fast")
    _filled(store, sample)
    r, want = _reference(store)
    assert r.tiers == ("coarse", "exact")
    _, out = _out(N_BLOCKS * BS)
    for i, k, _v in r.layers(out=out):
        assert np.array_equal(k, np.asarray(want[f"layers.{i}.key"], np.float32).reshape(k.shape)), i


def test_maps_file_decoded_whole(tmp_path, sample):  # noqa: F811
    store = _store(DirectoryBackend(str(tmp_path)), sample, profile="default")
    _filled(store, sample)
    r, want = _reference(store)
    if skips_work(r):
        pytest.skip("this bank's default profile uses no linear maps")
    assert len(r.decoder.needed({17})) > 2  # predicted from other layers' reconstructions
    n = N_BLOCKS * BS
    starts = segment_starts(_windows(sample[2]), first_block=0, count=N_BLOCKS, hit_blocks=N_BLOCKS,
                            block_size=BS)
    _, out = _out(n)
    for i, k, v in windowed_layers(r, (0, n), starts, out):
        assert np.array_equal(k, np.asarray(want[f"layers.{i}.key"], np.float32).reshape(k.shape)), i
        assert np.array_equal(v, np.asarray(want[f"layers.{i}.value"], np.float32).reshape(v.shape)), i


def test_decoder_needed_same_bits(tmp_path, sample):  # noqa: F811
    """Decoding some layers alone gives the bits of a whole decode, maps or not."""
    for profile in ("fast", "default"):
        store = _store(DirectoryBackend(str(tmp_path / profile)), sample, profile=profile)
        _filled(store, sample)
        r, want = _reference(store)
        for name, x in r.read(layers=[5, 11]).items():
            assert np.array_equal(x, want[name]), (profile, name)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux")
def test_decode_process_windowed(tmp_path, sample):  # noqa: F811
    torch = pytest.importorskip("torch")
    from kvz.integrations.vllm.decode_worker import DecodeWorker

    store, want, segs = _lossless_fast(tmp_path, sample)
    starts = {i: 2 * BS for i, w in enumerate(_windows(sample[2])) if w}
    cpus = sorted(os.sched_getaffinity(0))
    w = DecodeWorker(str(tmp_path), {}, _settings(sample), cpus[-1:], 1, idle_cores=[])
    try:
        proc = w.submit([(segs[0], N_BLOCKS * BS, starts)], time.monotonic() + 60)
        for i, k, v in proc.layers(0, 18):
            for kind, got in (("key", k), ("value", v)):
                _check_bits(got.view(torch.int16).numpy(), want, f"layers.{i}.{kind}", starts.get(i, 0))
        proc.close()
    finally:
        w.close()


def test_windowed_into_torch_bf16_staging(tmp_path, sample):  # noqa: F811
    """The load thread's path: the connector's staging tensors are torch bf16 (sliced views)."""
    torch = pytest.importorskip("torch")
    store, want, segs = _lossless_fast(tmp_path, sample)
    starts = {0: 2 * BS, 1: 2 * BS}
    n = N_BLOCKS * BS
    reader, tokens, src = store.open_segment(segs[0], time.monotonic() + 30, starts=starts)
    bufs: dict = {}

    def out(i):
        return bufs.setdefault(i, (torch.empty((1, n, 256), dtype=torch.bfloat16),
                                   torch.empty((1, n, 256), dtype=torch.bfloat16)))
    try:
        got = {i: k.clone() for i, k, _ in windowed_layers(reader, tokens, starts, out)}
    finally:
        src.close()
    for i, k in got.items():
        _check_bits(k.view(torch.int16).numpy(), want, f"layers.{i}.key", starts.get(i, 0))
