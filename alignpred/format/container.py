"""The .kvz container, pure over bytes: preamble, footer, index entries, header JSON.

File layout (all integers little-endian; see ``format_spec/kvz.md``)::

    preamble  16 B   magic(8) major:u16 minor:u16 flags:u32
    payloads         object payloads, in index order, no gaps
    bank             optional embedded calibration bank (canonical bytes)
    header           UTF-8 JSON
    index     64 B × n_objects
    footer    56 B   header_off:u64 header_len:u64 index_off:u64 index_len:u64
                     header_crc:u32 index_crc:u32 footer_crc:u32 reserved:u32 end_magic(8)

No function here allocates from an unchecked length: every length and offset is checked against
the buffer size (and the header against :data:`MAX_HEADER`) first.

>>> f = Footer(16, 2, 18, 64, 1, 2)
>>> Footer.unpack(f.pack(), 18 + 64 + FOOTER_SIZE) == f
True
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

try:  # zlib-ng: the same CRC-32 (zlib's polynomial and values) with PCLMULQDQ / VPCLMULQDQ folding
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - a platform without its wheel: the standard library's
    _crc32 = zlib.crc32

from alignpred.errors import ChecksumError, FormatError, TruncatedError, UnsupportedVersionError

MAGIC = b"\x89KVZ\r\n\x1a\n"
END_MAGIC = b"KVZ-END\x00"
MAJOR, MINOR = 1, 3  # MINOR: the newest minor version this writer writes (any 1.x is read, kvz.md §11.3)
FLAG_REFINE = 1  # the file holds a refinement tier (format 1.1): index entries after the coarse ones
KNOWN_FLAGS = FLAG_REFINE
PREAMBLE = struct.Struct("<8sHHI")
FOOTER = struct.Struct("<QQQQIIII8s")
ENTRY = struct.Struct("<IIIIQQdddI4x")
PREAMBLE_SIZE = PREAMBLE.size
FOOTER_SIZE = FOOTER.size
ENTRY_SIZE = ENTRY.size
MAX_HEADER = 64 << 20
MAX_OBJECTS = 1 << 26


def crc32(b) -> int:
    """CRC-32 of a bytes-like object, as ``zlib.crc32`` (kvz.md: every checksum in the format).
    Computed with zlib-ng where it is installed: 0.3 us for a 24 KB payload against the standard
    library's 4.9 us here, and a decode checks every payload it reads.

    >>> crc32(b"kvz") == zlib.crc32(b"kvz")
    True
    """
    return _crc32(b) & 0xFFFFFFFF


def pack_preamble(flags: int = 0, minor: int = MINOR) -> bytes:
    return PREAMBLE.pack(MAGIC, MAJOR, minor, flags)


def parse_preamble(buf) -> tuple[int, int, int]:
    """Check magic, major version and flags; returns ``(major, minor, flags)``."""
    if len(buf) < PREAMBLE_SIZE:
        if bytes(buf[:len(MAGIC)]) == MAGIC[:len(buf)]:
            raise TruncatedError("file is truncated (shorter than the 16-byte preamble)")
        raise FormatError("not a .kvz file (too short)")
    magic, major, minor, flags = PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FormatError("not a .kvz file (bad magic)")
    if major != MAJOR:
        raise UnsupportedVersionError(f"unsupported .kvz major version {major} (this reader reads {MAJOR}.x)")
    if flags & ~KNOWN_FLAGS:
        raise UnsupportedVersionError(f"unknown .kvz feature flags 0x{flags:08x}")
    return major, minor, flags


@dataclass(frozen=True)
class Footer:
    header_offset: int
    header_length: int
    index_offset: int
    index_length: int
    header_crc: int
    index_crc: int

    def pack(self) -> bytes:
        body = struct.pack("<QQQQII", self.header_offset, self.header_length, self.index_offset,
                           self.index_length, self.header_crc, self.index_crc)
        return FOOTER.pack(self.header_offset, self.header_length, self.index_offset, self.index_length,
                           self.header_crc, self.index_crc, crc32(body), 0, END_MAGIC)

    @classmethod
    def unpack(cls, b, file_size: int) -> Footer:
        if len(b) != FOOTER_SIZE:
            raise TruncatedError("file is truncated (no footer)")
        ho, hl, io, il, hc, ic, fc, reserved, end = FOOTER.unpack(b)
        if end != END_MAGIC or reserved != 0:
            raise TruncatedError("file is truncated or damaged (footer end marker missing)")
        if crc32(bytes(b[:40])) != fc:
            raise ChecksumError("footer checksum mismatch")
        body_end = file_size - FOOTER_SIZE
        if not (PREAMBLE_SIZE <= ho and hl <= MAX_HEADER and ho + hl == io and io + il == body_end
                and il % ENTRY_SIZE == 0 and il // ENTRY_SIZE <= MAX_OBJECTS):
            raise FormatError("footer offsets are inconsistent with the file size")
        return cls(ho, hl, io, il, hc, ic)


@dataclass(frozen=True)
class IndexEntry:
    """One object: which tensor and tokens, where its payload is, and its measured error."""

    tensor: int
    token_start: int
    n_tokens: int
    flags: int
    offset: int
    length: int
    delta: float
    sq_err: float
    sq_norm: float
    crc: int

    def pack(self) -> bytes:
        return ENTRY.pack(self.tensor, self.token_start, self.n_tokens, self.flags, self.offset, self.length,
                          self.delta, self.sq_err, self.sq_norm, self.crc)


def parse_index(b) -> list[IndexEntry]:
    if len(b) % ENTRY_SIZE:
        raise FormatError("index length is not a multiple of the entry size")
    if len(b) // ENTRY_SIZE > MAX_OBJECTS:
        raise FormatError("index has too many entries")
    b = bytes(b)
    if any(b[k + ENTRY_SIZE - 4:k + ENTRY_SIZE] != b"\0\0\0\0" for k in range(0, len(b), ENTRY_SIZE)):
        raise FormatError("index entry padding is not zero")
    return [IndexEntry(*ENTRY.unpack_from(b, k)) for k in range(0, len(b), ENTRY_SIZE)]


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def _no_duplicates(pairs):
    d = dict(pairs)
    if len(d) != len(pairs):
        raise ValueError("duplicate key")
    return d


def parse_header(b) -> dict:
    """Strict RFC 8259 JSON (no NaN/Infinity, no duplicate keys) holding an object with
    ``"format": "kvz"``."""
    if len(b) > MAX_HEADER:
        raise FormatError("header is too large")
    try:
        h = json.loads(bytes(b).decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FormatError("header is not valid UTF-8 JSON") from None
    if not isinstance(h, dict) or h.get("format") != "kvz":
        raise FormatError("header is not a kvz header")
    return h


def dump_header(h: dict) -> bytes:
    return json.dumps(h, separators=(",", ":"), sort_keys=True, allow_nan=False).encode("utf-8")


@dataclass(frozen=True)
class Parsed:
    """Preamble, header and index of a file, all checksums verified (payloads not read)."""

    version: tuple
    header: dict
    index: list
    footer: Footer


def parse_container(buf) -> Parsed:
    """Parse and verify everything but the object payloads."""
    mv = memoryview(buf)
    major, minor, flags = parse_preamble(mv)
    if len(mv) < PREAMBLE_SIZE + FOOTER_SIZE:
        raise TruncatedError("file is truncated (no footer)")
    ft = Footer.unpack(mv[len(mv) - FOOTER_SIZE:], len(mv))
    hb = mv[ft.header_offset:ft.header_offset + ft.header_length]
    if crc32(hb) != ft.header_crc:
        raise ChecksumError("header checksum mismatch")
    ib = mv[ft.index_offset:ft.index_offset + ft.index_length]
    if crc32(ib) != ft.index_crc:
        raise ChecksumError("index checksum mismatch")
    header = parse_header(hb)
    v, hf = header.get("version"), header.get("flags")
    if not (isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v) and type(hf) is int
            and v == [major, minor] and hf == flags):
        raise FormatError("preamble version/flags disagree with the header")
    index = parse_index(ib)
    for e in index:
        if e.offset < PREAMBLE_SIZE or e.offset + e.length > ft.header_offset:
            raise FormatError(f"object of tensor {e.tensor} at token {e.token_start}: payload out of range")
    return Parsed((major, minor), header, index, ft)
