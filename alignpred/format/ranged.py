"""Random access to a ``.kvz`` held somewhere else: a *ranged source* gives byte ranges of a file
that is not in this process's memory (a store entry read with ``GETRANGE``, a file read with
``pread``, an object store's ranged GET), and :class:`~alignpred.api.reader.KvzReader` reads
from it only what a decode needs: on open, the preamble and the tail (header, index, footer), all
verified as for a whole file; then each object's payload when it is decoded, checked against its
CRC-32 as always. A layer-by-layer decode of a long cache thus reads layer by layer.

>>> import numpy as np
>>> from alignpred import Cache, KvzReader, compress_bytes, fit_bank
>>> rng = np.random.default_rng(0)
>>> cache = Cache.from_arrays([(rng.standard_normal((1, 300, 16)).astype(np.float16),) * 2 for _ in range(2)])
>>> bank = fit_bank([cache], rank=None)
>>> blob = compress_bytes(cache, budget=0.05, bank=bank)
>>> src = BytesRanges(blob)
>>> r = KvzReader(src, bank=bank)
>>> src.bytes_read < len(blob)                      # the payloads are not read on open
True
>>> bool(np.array_equal(r.read()["layers.1.key"], KvzReader(blob, bank=bank).read()["layers.1.key"]))
True
"""
from __future__ import annotations

import mmap
from typing import Protocol, runtime_checkable

from alignpred.errors import TruncatedError
from alignpred.format.container import FOOTER_SIZE, PREAMBLE_SIZE, Footer

__all__ = ["RangedSource", "BytesRanges", "sparse_copy"]


@runtime_checkable
class RangedSource(Protocol):
    """``size``: the file's length in bytes; ``read_range(offset, length)``: those bytes (a
    bytes-like object; fewer than ``length`` only at a truncated source, which the reader reports
    as :class:`~alignpred.errors.TruncatedError`). It may raise its own errors (a store that is
    down): they reach the caller of the decode unchanged."""

    size: int

    def read_range(self, offset: int, length: int): ...


class BytesRanges:
    """A :class:`RangedSource` over bytes in memory (tests, examples); counts the bytes read."""

    def __init__(self, data):
        self._mv = memoryview(data).cast("B")
        self.size = len(self._mv)
        self.bytes_read = 0

    def read_range(self, offset: int, length: int):
        out = self._mv[offset:offset + length]
        self.bytes_read += len(out)
        return out


def _exact(src: RangedSource, offset: int, length: int):
    b = src.read_range(offset, length)
    if len(b) != length:
        raise TruncatedError(f"source gave {len(b)} of {length} bytes at offset {offset} (truncated)")
    return b


def sparse_copy(src: RangedSource) -> memoryview:
    """A buffer of ``src.size`` bytes (an anonymous mapping: pages never written cost no memory)
    holding the preamble and everything from the header to the end; the payloads (and an embedded
    bank) are left as zeros, for the reader to fetch by range. Only lengths the footer gives and
    the source's size allows are read."""
    size = int(src.size)
    if size < PREAMBLE_SIZE + FOOTER_SIZE:
        raise TruncatedError("file is truncated (no footer)")
    buf = mmap.mmap(-1, size)
    mv = memoryview(buf)
    mv[:PREAMBLE_SIZE] = _exact(src, 0, PREAMBLE_SIZE)
    foot = _exact(src, size - FOOTER_SIZE, FOOTER_SIZE)
    ft = Footer.unpack(foot, size)  # checks its own CRC and that the regions lie inside the file
    lo = max(PREAMBLE_SIZE, min(ft.header_offset, ft.index_offset))
    mv[lo:size] = _exact(src, lo, size - lo)
    return mv
