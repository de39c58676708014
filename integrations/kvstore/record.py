"""The byte layout of one stored entry, shared by every backend.

One entry is one record, written and read as a whole (a file, or one Redis string)::

    offset  size  field
    0       4     magic b"KVZS"
    4       1     version (1)
    5       1     flags (0)
    6       2     key_len     u16 little-endian, bytes of the UTF-8 key
    8       4     meta_len    u32, bytes of the UTF-8 JSON meta (0: no meta)
    12      8     blob_len    u64
    20      8     importance  f64
    28      32    sha256 of bytes 0..27 + key + meta + blob
    60      ...   key, meta, blob (exactly key_len + meta_len + blob_len bytes, nothing after)

The checksum covers the blob *and* everything describing it, so a flipped byte anywhere (or a
record cut short, or one with bytes appended) is detected on read. The key is stored inside the
record so that an entry found under the wrong name (a renamed file, a misplaced value) is
rejected too. Meta is JSON, never a pickle.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import CorruptEntryError, ForeignEntryError, StoreError

MAGIC = b"KVZS"
VERSION = 1
_HEAD = struct.Struct("<4sBBHIQd")
DIGEST_SIZE = 32
HEADER_SIZE = _HEAD.size + DIGEST_SIZE  # 60
MAX_KEY_BYTES = 4096
MAX_META_BYTES = 1 << 20


@dataclass(frozen=True)
class Entry:
    """One entry read back from a store: the blob and what was put with it."""

    key: str
    blob: bytes = field(repr=False)
    meta: dict
    importance: float
    size: int  # bytes of the whole record: what the budget counts


def key_bytes(key: str) -> bytes:
    """Validate a key and return its UTF-8 bytes (any non-empty str of at most 4096 bytes)."""
    if not isinstance(key, str):
        raise StoreError(f"key must be a str, got {type(key).__name__}")
    if not key:
        raise StoreError("key must not be empty")
    try:
        kb = key.encode("utf-8")
    except UnicodeEncodeError as e:
        raise StoreError(f"key is not encodable as UTF-8: {e}") from None
    if len(kb) > MAX_KEY_BYTES:
        raise StoreError(f"key is {len(kb)} bytes, at most {MAX_KEY_BYTES} allowed")
    return kb


def meta_bytes(meta: dict | None) -> bytes:
    if meta is None:
        return b""
    if not isinstance(meta, dict):
        raise StoreError(f"meta must be a dict or None, got {type(meta).__name__}")
    try:
        mb = json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise StoreError(f"meta must be JSON-serialisable (str keys, finite numbers): {e}") from None
    if len(mb) > MAX_META_BYTES:
        raise StoreError(f"meta is {len(mb)} bytes as JSON, at most {MAX_META_BYTES} allowed")
    return mb


def blob_bytes(blob) -> bytes | memoryview:
    if isinstance(blob, bytes):
        return blob
    if isinstance(blob, (bytearray, memoryview)):
        return memoryview(blob).cast("B")
    raise StoreError(f"blob must be bytes, bytearray or memoryview, got {type(blob).__name__}")


def check_importance(importance) -> float:
    if isinstance(importance, bool) or not isinstance(importance, (int, float)):
        raise StoreError(f"importance must be a number, got {type(importance).__name__}")
    imp = float(importance)
    if not math.isfinite(imp) or imp < 0:
        raise StoreError(f"importance must be finite and >= 0, got {importance!r}")
    return imp


def entry_size(key: str, blob, meta: dict | None = None) -> int:
    """Bytes one entry takes in a store (the unit of ``budget_bytes``); ``blob`` may be a length."""
    n = blob if isinstance(blob, int) and not isinstance(blob, bool) else len(blob_bytes(blob))
    return HEADER_SIZE + len(key_bytes(key)) + len(meta_bytes(meta)) + n


def encode(kb: bytes, blob, mb: bytes, importance: float) -> list:
    """The record as a list of byte chunks (written in order; joined for Redis)."""
    head = _HEAD.pack(MAGIC, VERSION, 0, len(kb), len(mb), len(blob), importance)
    h = hashlib.sha256(head)
    h.update(kb)
    h.update(mb)
    h.update(blob)
    return [head, h.digest(), kb, mb, blob]


def parse_head(head: bytes) -> tuple[int, int, int, float]:
    """(key_len, meta_len, blob_len, importance) of a record's first 28+ bytes; CorruptEntryError if bad."""
    if len(head) < _HEAD.size:
        raise CorruptEntryError("record shorter than its header")
    magic, version, _flags, klen, mlen, blen, imp = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise CorruptEntryError("bad magic")
    if version != VERSION:
        raise ForeignEntryError(f"record version {version}, this kvz reads {VERSION}")
    return klen, mlen, blen, imp


def parse_prefix(prefix: bytes, total: int, expect_key: str | None = None) -> tuple[int, int, dict, float]:
    """``(blob_offset, blob_len, meta, importance)`` from a record's first ``HEADER_SIZE + key_len +
    meta_len`` bytes (or more), for reading the blob by ranges. Checks the lengths against the
    record's ``total`` size (a record cut short is refused here) and the key; the checksum over the
    whole record cannot be checked without reading it all: ranged readers check their own (a ``.kvz``
    verifies its header, index and every payload)."""
    klen, mlen, blen, imp = parse_head(prefix)
    base = HEADER_SIZE + klen + mlen
    if base + blen != total:
        raise CorruptEntryError("record length does not match its header")
    if len(prefix) < base:
        raise CorruptEntryError("record shorter than its header")
    kb, mb = bytes(prefix[HEADER_SIZE:HEADER_SIZE + klen]), bytes(prefix[HEADER_SIZE + klen:base])
    try:
        key = kb.decode("utf-8")
        meta = json.loads(mb) if mb else {}
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptEntryError(f"undecodable key or meta: {e}") from None
    if not isinstance(meta, dict):
        raise CorruptEntryError("meta is not a JSON object")
    if expect_key is not None and key != expect_key:
        raise CorruptEntryError("record holds another key")
    return base, blen, meta, imp


def decode_from(read: Callable[[int], bytes], total: int, expect_key: str | None = None) -> Entry:
    """Read one record of ``total`` bytes through ``read(n)`` (a file's read) and verify it completely.

    Raises CorruptEntryError for anything but an intact record of ``expect_key``. The lengths in
    the header are checked against ``total`` before anything is read, so a damaged length field
    never makes it allocate more than the record's size.
    """
    head = read(HEADER_SIZE)
    if len(head) != HEADER_SIZE:
        raise CorruptEntryError("record shorter than its header")
    klen, mlen, blen, imp = parse_head(head)
    if HEADER_SIZE + klen + mlen + blen != total:
        raise CorruptEntryError("record length does not match its header")
    kb = read(klen)
    mb = read(mlen)
    blob = read(blen)
    if len(kb) != klen or len(mb) != mlen or len(blob) != blen:
        raise CorruptEntryError("record truncated")
    if read(1):
        raise CorruptEntryError("trailing bytes after the record")
    h = hashlib.sha256(head[:_HEAD.size])
    h.update(kb)
    h.update(mb)
    h.update(blob)
    if h.digest() != head[_HEAD.size:]:
        raise CorruptEntryError("checksum mismatch")
    try:
        key = kb.decode("utf-8")
        meta = json.loads(mb) if mb else {}
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptEntryError(f"undecodable key or meta: {e}") from None
    if not isinstance(meta, dict):
        raise CorruptEntryError("meta is not a JSON object")
    if expect_key is not None and key != expect_key:
        raise CorruptEntryError("record holds another key")
    return Entry(key=key, blob=blob, meta=meta, importance=imp, size=HEADER_SIZE + klen + mlen + blen)


def decode(buf: bytes, expect_key: str | None = None) -> Entry:
    """Verify and decode a whole record held in memory."""
    mv = memoryview(buf)
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        out = bytes(mv[pos:pos + n])
        pos += len(out)
        return out

    return decode_from(read, len(mv), expect_key)
