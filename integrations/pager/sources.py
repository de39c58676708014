"""Page sources: where the pager's pages come from.

A source has ``layout``, ``object_size``, ``chained`` (decoding layer L needs layers < L),
``tiers`` / ``tier``, ``file_bytes``, ``objects_decoded`` and ``decode(j0, j1, layers, count)``,
a generator of ``(layer, key, value)`` for objects ``j0..j1-1``.

* :class:`KvzSource` — a ``.kvz`` file (path, bytes or mmap) at a tier, decoded by
  :class:`alignpred.KvzReader`;
* :class:`ArraySource` — an uncompressed :class:`alignpred.Cache` (or dict / list of arrays): exact
  by definition, "decoding" copies rows.
"""
from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from alignpred import Cache, DecoderSession, KvzError, KvzReader
from alignpred.io import map_file
from kvz.integrations.pager.budget import kv_bytes

__all__ = ["KvzSource", "ArraySource", "OBJECT_SIZE"]

OBJECT_SIZE = 256  # positions per .kvz object (ArraySource pages use the same size)


class _Counted:
    """``objects_decoded``, counted under a lock (sources are decoded on several threads at once)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.objects_decoded = 0

    def _count(self, n, count):
        if n:
            with self._lock:
                self.objects_decoded += n
            if count is not None:
                count(n)


class KvzSource(_Counted):
    """A .kvz file as a page source. ``source``: a path (memory-mapped once), bytes or mmap;
    ``tier``: None (the best tier the file holds) or a tier name (``"coarse"``, ``"exact"``).
    Each decode uses its own :class:`KvzReader` (one thread: one object per decode, the reader's
    own pool would have nothing to split) over the one shared buffer and one shared
    :class:`DecoderSession`, so concurrent decodes on the pool never share a reader."""

    chained = True  # decoding layer L needs layers < L of the same positions

    def __init__(self, source, *, bank=None, tier: str | None = None, session: DecoderSession | None = None):
        super().__init__()
        if isinstance(source, (str, os.PathLike)):
            self.path = os.fspath(source)
            self._buf: Any = map_file(self.path)  # or the caller's bytes; b"" once closed
            self._mapped = True
        else:
            self.path = "<bytes>"
            self._buf = source
            self._mapped = False
        self.bank = bank
        self.session = session or DecoderSession()
        head = self.reader()
        self.layout = head.layout
        self.object_size = int(head.config.object_size)
        self.eps = head.eps
        self.tiers = tuple(head.tiers)
        if tier is not None and tier not in self.tiers:
            raise KvzError(f"{self.path}: tier {tier!r} not available (file tiers: {', '.join(self.tiers)})")
        self.tier = tier
        self.file_bytes = len(self._buf)

    def reader(self) -> KvzReader:
        return KvzReader(self._buf, bank=self.bank, session=self.session, threads=1)

    def decode(self, j0: int, j1: int, layers, count=None):
        """Yield ``(layer, key, value)`` (new arrays ``[kv_heads, rows, head_dim]``) for objects
        ``j0..j1-1`` of ``layers`` (ascending); ``count(n)`` is told of every object fetched."""
        r = self.reader()
        S, n = self.object_size, self.layout.n_tokens
        seen = 0
        for layer, k, v in r.layers(tokens=(j0 * S, min(j1 * S, n)), layers=sorted(layers), tier=self.tier):
            done = r.objects_decoded - seen
            seen = r.objects_decoded
            self._count(done, count)
            yield layer, (k[0] if k.ndim == 4 else k), (v[0] if v.ndim == 4 else v)
        self._count(r.objects_decoded - seen, count)

    def close(self):
        """Let go of a path's mapping (it is unmapped once no reader holds a view of it)."""
        if self._mapped:
            self._buf, self._mapped = b"", False


class ArraySource(_Counted):
    """An uncompressed cache (an :class:`alignpred.Cache`, a dict ``layers.{i}.key|value ->
    array`` or a list of ``(key, value)`` pairs; numpy or CPU torch) as a page source: exact by
    definition. "Decoding" an object copies its rows; ``objects_decoded`` counts tensor-objects
    served, as for a .kvz source (but layers are independent: ``chained = False``)."""

    chained = False

    def __init__(self, cache, metadata: dict | None = None):
        super().__init__()
        if not isinstance(cache, Cache):
            cache = Cache.from_arrays(cache, metadata)
        self.cache = cache
        self.layout = cache.layout
        self.object_size = OBJECT_SIZE
        self.tiers = ("exact",)
        self.tier = "exact"
        self.file_bytes = kv_bytes(self.layout)

    def decode(self, j0: int, j1: int, layers, count=None):
        S, n = self.object_size, self.layout.n_tokens
        a, b = j0 * S, min(j1 * S, n)
        for layer in sorted(layers):
            kv = []
            for kind in ("key", "value"):
                x = self.cache.tensors[f"layers.{layer}.{kind}"]
                x = x[0] if x.ndim == 4 else x
                kv.append(np.array(x[:, a:b], copy=True))
            self._count(2 * (j1 - j0), count)
            yield layer, kv[0], kv[1]

    def close(self):
        pass
