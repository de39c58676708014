"""A ``.kvz`` read through a ranged source (``KvzReader(RangedSource)``): the same bits as from
memory, only the tail read on open, each layer's payloads read when it is decoded, and a source that
is cut short or flipped gives the named errors of a bad file."""
import numpy as np
import pytest
from kvz_testing import sample_paths

from alignpred import ErrorBudget, KvzReader, compress, load_cache
from alignpred.errors import ChecksumError, TruncatedError
from alignpred.format import BytesRanges


@pytest.fixture(scope="module")
def blobs(real_bank):
    cache = load_cache(sample_paths()[0])
    lossy = compress(cache, None, budget=0.03, bank=real_bank).data
    lossless = compress(cache, None, budget=ErrorBudget(eps=0.03, lossless=True), bank=real_bank).data
    return {"lossy": lossy, "lossless": lossless}, real_bank


@pytest.mark.parametrize("kind", ["lossy", "lossless"])
def test_same_bits_as_from_memory(blobs, kind):
    data, bank = blobs
    blob = data[kind]
    want = KvzReader(blob, bank=bank).read(tokens=(10, 300))
    src = BytesRanges(blob)
    r = KvzReader(src, bank=bank)
    opened = src.bytes_read
    assert opened < len(blob) // 10  # header, index, footer only
    got = r.read(tokens=(10, 300))
    for k in want:
        assert np.array_equal(want[k].view(np.uint16), got[k].view(np.uint16)), k


def test_layer_by_layer_reads_each_layer(blobs):
    data, bank = blobs
    blob = data["lossy"]
    src = BytesRanges(blob)
    r = KvzReader(src, bank=bank, threads=1)
    seen = [src.bytes_read]
    spans = [r.payload_spans(i) for i in range(r.layout.num_layers)]
    flat = [s for sp in spans for s in sp]
    assert all(a[0] + a[1] == b[0] for a, b in zip(flat, flat[1:]))  # key, value, next layer: in order, no gaps
    for i, _k, _v in r.layers():
        seen.append(src.bytes_read)
        assert seen[-1] - seen[-2] == sum(n for _, n in spans[i]), i  # exactly that layer's payloads
    part = r.payload_spans(3, tokens=(300, 400))  # the second object of each tensor only
    assert len(part) == 2 and part[0][1] < spans[3][0][1] / 2


def test_truncated_source(blobs):
    data, bank = blobs
    blob = data["lossy"]

    class Short(BytesRanges):  # the tail intact, payloads cut: a store entry evicted half-way
        def read_range(self, offset, length):
            return super().read_range(offset, length)[:length // 2] if 16 <= offset < len(blob) // 2 else \
                super().read_range(offset, length)

    r = KvzReader(Short(blob), bank=bank)
    with pytest.raises(TruncatedError):
        r.read()
    with pytest.raises(TruncatedError):
        KvzReader(BytesRanges(blob[:-100]), bank=bank)


def test_flipped_payload_is_a_checksum_error_at_its_layer(blobs):
    data, bank = blobs
    blob = bytearray(data["lossy"])
    r0 = KvzReader(bytes(blob), bank=bank)
    off, n = r0.payload_spans(7)[0]
    blob[off + n // 2] ^= 0xFF
    r = KvzReader(BytesRanges(bytes(blob)), bank=bank, threads=1)
    done = []
    with pytest.raises(ChecksumError, match="layers.7"):
        for i, _k, _v in r.layers():
            done.append(i)
    assert done == list(range(7))
