"""Chunk serdes: how a chunk's per-layer K/V becomes the bytes a backend stores, and back.

A serde has ``kind``, ``binding()`` (the part of the chunk keys' binding it owns, see
:mod:`kvz.integrations.chunkstore.keys`), ``encode(kv, meta) -> bytes`` (``kv``: ``[(k, v)]`` per
layer, numpy ``[kv_heads, n, d]``; ``meta``: the cache metadata) and ``decode_into(blob, out) ->
metadata`` (``out(layer) -> (k_view, v_view)``: decode straight into the caller's buffers).

* :class:`KvzSerde` — a normal ``.kvz`` of the chunk's positions at ``eps`` (the tensor scope, as
  before) or, with neither eps nor ``target_kl`` given, at FP8's KL in the attention scope from the
  bank's statistics (:class:`~kvz.integrations.scope.StoreBudget`; docs/engine-scope.md) with a bank (all layers
  coded together: the inter-layer maps read earlier layers), decoded with one
  :class:`alignpred.DecoderSession`;
* :class:`RawSerde` — uncompressed safetensors bytes in ``float16``/``bfloat16``/``float32``: the
  lossless reference.
"""
from __future__ import annotations

import json

import numpy as np

__all__ = ["KvzSerde", "RawSerde", "DEFAULT_EPS", "RAW_DTYPES"]

DEFAULT_EPS = 0.02
RAW_DTYPES = ("float16", "bfloat16", "float32")


class KvzSerde:
    """Chunks as ``.kvz`` bytes: ``eps`` / ``scope`` or ``target_kl`` (the error budget, :attr:`budget`;
    neither: ``target_kl="fp8"``), ``bank`` (any bank
    reference :func:`alignpred.resolve_bank` takes, or None for the encoder's own choice),
    ``config`` (a :class:`alignpred.CodecConfig`), ``session`` (a :class:`alignpred.DecoderSession`
    shared by every decode; default: one holding the bank)."""

    kind = "kvz"

    def __init__(self, eps: float | None, bank, config=None, scope: str | None = None, session=None,
                 target_kl=None):
        import logging

        from alignpred import CodecConfig, DecoderSession, resolve_bank
        from kvz.integrations.scope import StoreBudget

        self.config = config or CodecConfig()
        self.bank = resolve_bank(bank) if bank is not None else None
        self.budget = StoreBudget.choose(self.bank, eps=eps, target_kl=target_kl, scope=scope,
                                         fallback_eps=DEFAULT_EPS)
        self.eps, self.scope = self.budget.eps, self.budget.scope
        logging.getLogger("kvz.integrations.chunkstore").info("kvz chunk store: %s", self.budget.describe())
        self.session = session or DecoderSession(banks=[self.bank] if self.bank is not None else ())

    def binding(self) -> dict:
        from alignpred.format import MAJOR

        out = {"codec": "kvz", "format_major": MAJOR, "config": self.config.to_json(),
               "bank": self.bank.id if self.bank is not None else None, "eps": self.eps, "scope": self.scope}
        if self.budget.target_kl is not None:  # an eps-only serde keeps the keys it always had
            out["target_kl"] = self.budget.target_kl
        return out

    def encode(self, kv, meta) -> bytes:
        from alignpred import Cache, compress_bytes

        return compress_bytes(Cache.from_arrays(kv, meta), budget=self.budget.budget(), bank=self.bank,
                              config=self.config)

    def decode_into(self, blob, out) -> dict:
        """Decode every layer into ``out(layer) -> (k_view, v_view)``; returns the source metadata."""
        from alignpred import KvzReader

        r = KvzReader(memoryview(blob), bank=self.bank, session=self.session)
        for _ in r.layers(out=out):
            pass
        return r.source_metadata


class RawSerde:
    """Chunks as uncompressed safetensors bytes in ``dtype`` (one of :data:`RAW_DTYPES`)."""

    kind = "raw"

    def __init__(self, dtype: str = "float16"):
        if dtype not in RAW_DTYPES:
            raise ValueError(f"raw dtype must be one of {RAW_DTYPES}")
        self.dtype = dtype

    def binding(self) -> dict:
        return {"codec": "raw", "dtype": self.dtype}

    def encode(self, kv, meta) -> bytes:
        from alignpred.cache import cache_bytes, numpy_dtype

        dt = numpy_dtype(self.dtype)
        tensors = {}
        for i, (k, v) in enumerate(kv):
            tensors[f"layers.{i}.key"] = np.asarray(k, np.float32).astype(dt)
            tensors[f"layers.{i}.value"] = np.asarray(v, np.float32).astype(dt)
        return b"".join(cache_bytes(tensors, {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}))

    def decode_into(self, blob, out) -> dict:
        """Copy every layer into ``out(layer) -> (k_view, v_view)``; returns the stored metadata."""
        from alignpred.cache import as_numpy, parse_safetensors

        tensors, meta = parse_safetensors(memoryview(blob))
        for i in range(len(tensors) // 2):
            k, v = out(i)
            as_numpy(k, writable=True)[...] = tensors[f"layers.{i}.key"]
            as_numpy(v, writable=True)[...] = tensors[f"layers.{i}.value"]
        return meta
