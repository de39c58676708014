"""A one-object range read on several threads decodes its symbols ahead on another thread
(codec.decoder._SymbolsAhead): the same bits as one thread, errors raised at the tensor they
belong to, and no buffer shared by two decodes at once."""
import numpy as np
import pytest
from kvz_testing import sample_paths

from alignpred import ChecksumError, KvzReader, compress, load_cache
from alignpred.codec import decoder as decoder_mod


@pytest.fixture(scope="module")
def files(real_bank):
    caches = [load_cache(p) for p in sample_paths()[:2]]
    return [compress(c, None, budget=0.03, bank=real_bank, profile="balanced").data for c in caches], real_bank


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k].view(np.uint16), b[k].view(np.uint16)) for k in a)


@pytest.mark.parametrize("tokens, layers", [((0, 256), None), ((256, 448), None), ((3, 200), None),
                                            ((300, 301), [0, 5, 17]), ((0, 256), 4)])
def test_same_bits_as_one_thread(files, tokens, layers):
    (data, _), bank = files[0], files[1]
    one = KvzReader(data, bank=bank, threads=1).read(tokens=tokens, layers=layers)
    for t in (2, 4):
        assert _same(KvzReader(data, bank=bank, threads=t).read(tokens=tokens, layers=layers), one)


def test_same_bits_when_the_range_is_too_large_to_decode_ahead(files, monkeypatch):
    (data, _), bank = files[0], files[1]
    one = KvzReader(data, bank=bank, threads=1).read(tokens=(0, 256))
    monkeypatch.setattr(decoder_mod, "_AHEAD_MAX_BYTES", 1024)
    assert _same(KvzReader(data, bank=bank, threads=2).read(tokens=(0, 256)), one)


def test_interleaved_streams_in_one_thread_and_an_abandoned_one(files):
    """Two one-object streams advanced alternately in one thread, then one left half-read: each
    decode has its own buffer, and the next decode is unaffected."""
    (d0, d1), bank = files
    want0 = KvzReader(d0, bank=bank, threads=1).read(tokens=(256, 448))
    want1 = KvzReader(d1, bank=bank, threads=1).read(tokens=(256, 448))
    s0 = KvzReader(d0, bank=bank, threads=2).iter_layers(tokens=(256, 448))
    s1 = KvzReader(d1, bank=bank, threads=2).iter_layers(tokens=(256, 448))
    got0, got1 = {}, {}
    for (n0, a0), (n1, a1) in zip(s0, s1):
        got0[n0], got1[n1] = a0.copy(), a1.copy()
    assert _same(got0, want0) and _same(got1, want1)
    half = KvzReader(d0, bank=bank, threads=2).iter_layers(tokens=(0, 256))
    next(half)
    half.close()
    assert _same(KvzReader(d1, bank=bank, threads=2).read(tokens=(256, 448)), want1)


def test_a_corrupt_payload_fails_at_its_tensor(files):
    """A flipped byte in tensor k's object: the tensors before k come out (streaming), then the
    ChecksumError naming tensor k, as with one thread; the reader then reads other ranges."""
    (data, _), bank = files[0], files[1]
    r = KvzReader(data, bank=bank, threads=1)
    n_obj = r.n_objects_per_tensor
    k = 7
    e = r.index[k * n_obj]     # tensor k, object 0
    bad = bytearray(data)
    bad[e.offset + e.length // 2] ^= 0x40
    for t in (1, 2):
        names = []
        with pytest.raises(ChecksumError, match=r.metas[k].name):
            for name, _ in KvzReader(bytes(bad), bank=bank, threads=t).iter_layers(tokens=(0, 256)):
                names.append(name)
        assert names == [m.name for m in r.metas[:k]]
    good = KvzReader(data, bank=bank, threads=1).read(tokens=(256, 448))
    assert _same(KvzReader(bytes(bad), bank=bank, threads=2).read(tokens=(256, 448)), good)


def test_split_ranges_same_bits_layer_by_layer(files):
    """``split``: a range cut into threads x split parts taken as threads come free decodes the same
    bits, layer by layer (what the vLLM connector's decode process reads), as one thread."""
    from alignpred import CodecConfig

    bank = files[1]
    # 64-token objects: 7 of them in the 448-token sample, cut into 7 parts for 2 threads
    data = compress(load_cache(sample_paths()[0]), None, budget=0.03, bank=bank, profile="fast",
                    config=CodecConfig(object_size=64)).data
    one = KvzReader(data, bank=bank, threads=1).read()
    r = KvzReader(data, bank=bank, threads=2, split=4)
    assert r.split == 4 and r.config.object_size == 64
    n = 0
    for i, k, v in r.layers():
        for kind, arr in (("key", k), ("value", v)):
            assert np.array_equal(arr.view(np.uint16), one[f"layers.{i}.{kind}"].view(np.uint16))
        n += 1
    assert n == r.layout.num_layers
