"""The .kvz container: corrupt, truncated and foreign input raise the library's errors."""
import struct

import numpy as np
import pytest
from kvz_testing import synthetic_cache

from alignpred import (
    BankMismatchError,
    ChecksumError,
    FormatError,
    KvzError,
    KvzReader,
    TruncatedError,
    UnsupportedVersionError,
    compress,
    fit_bank,
)
from alignpred.format.container import FOOTER_SIZE, MAGIC, parse_container


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("kvz")
    c = synthetic_cache(n_layers=2, T=40, d=16)
    bank = fit_bank([c], rank=4)
    p = d / "c.kvz"
    compress(c, p, budget=0.05, bank=bank)
    return p, bank, p.read_bytes()


def _decode(path, bank):
    return KvzReader(path, bank=bank).read()


def test_truncation_at_every_offset(small, tmp_path):
    p, bank, raw = small
    q = tmp_path / "t.kvz"
    for n in range(0, len(raw), max(1, len(raw) // 300)):
        q.write_bytes(raw[:n])
        with pytest.raises(FormatError):
            _decode(q, bank)


def test_every_byte_flip_detected(small, tmp_path):
    p, bank, raw = small
    ref = _decode(p, bank)
    q = tmp_path / "f.kvz"
    for i in range(len(raw)):
        b = bytearray(raw)
        b[i] ^= 0x5A
        q.write_bytes(bytes(b))
        with pytest.raises(KvzError):
            out = _decode(q, bank)
            # a flip that decodes must not change a single value (there is none: every byte is covered)
            assert all(np.array_equal(out[k], ref[k]) for k in ref)
            raise AssertionError(f"flip at byte {i} went undetected")


def test_unknown_major_and_flags(small, tmp_path):
    p, bank, raw = small
    q = tmp_path / "v.kvz"
    q.write_bytes(raw[:8] + struct.pack("<H", 2) + raw[10:])
    with pytest.raises(UnsupportedVersionError):
        KvzReader(q)
    q.write_bytes(raw[:12] + struct.pack("<I", 4) + raw[16:])
    with pytest.raises(UnsupportedVersionError):
        KvzReader(q)


def test_not_a_kvz_file(tmp_path):
    q = tmp_path / "x.kvz"
    q.write_bytes(b"hello world, this is not a kvz file at all" * 3)
    with pytest.raises(FormatError, match="not a .kvz file"):
        KvzReader(q)
    q.write_bytes(MAGIC)
    with pytest.raises(TruncatedError):
        KvzReader(q)
    with pytest.raises(KvzError, match="no such file"):
        KvzReader(tmp_path / "missing.kvz")


def test_wrong_bank(small):
    p, bank, raw = small
    other = fit_bank([synthetic_cache(n_layers=2, T=40, d=16, seed=5)], rank=4)
    with pytest.raises(BankMismatchError, match="needs bank"):
        KvzReader(p, bank=other).read()


def test_parse_is_pure_and_checks_checksums(small):
    _, _, raw = small
    parsed = parse_container(raw)
    assert parsed.header["format"] == "kvz" and len(parsed.index) == 4
    b = bytearray(raw)
    b[parsed.footer.header_offset + 3] ^= 1
    with pytest.raises(ChecksumError):
        parse_container(bytes(b))
    assert len(raw) > FOOTER_SIZE


def test_crc32_is_zlibs_on_every_buffer_kind():
    """kvz's checksum (zlib-ng where installed) gives zlib's CRC-32 on bytes, memoryviews and
    numpy slices, empty included: files written with either read with either."""
    import zlib

    from alignpred.format.container import crc32

    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, 100_003, dtype=np.uint8)
    for a, b in ((0, 0), (0, 1), (5, 77), (1, 65_537), (3, raw.size)):
        for buf in (raw[a:b], memoryview(raw.tobytes())[a:b], raw.tobytes()[a:b]):
            assert crc32(buf) == zlib.crc32(raw[a:b].tobytes()) & 0xFFFFFFFF
