"""kvz as an LMCache L2 serde (``lmcache.v1.distributed.serde``), registered as ``"kvz"``.

Importing this module registers the factory with ``register_serde_factory("kvz", ...)``; then an L2
adapter spec selects it like LMCache's ``fp8``::

    {"type": "mock", "max_size_gb": 4, "mock_bandwidth_gb": 10,
     "serde": {"type": "kvz", "target_kl": "fp8", "bank": "gemma-3-270m",
               "metadata_from": "/path/cache.safetensors", "chunk_size": 256}}

kwargs: ``target_kl`` (a mean next-token KL or ``fp8``, the default: the attention scope from the bank's
statistics) or ``eps`` (the tensor scope at that eps, as before; docs/engine-scope.md), ``bank``, ``scope``,
``lossless``, ``metadata`` (JSON model fields) or
``metadata_from`` (a kvz-cache file), ``chunk_size`` (the position-search grid, LMCache's chunk
size), ``num_heads`` (KV heads in the ``H*D`` axis; default: the bank's), ``position``
(``search``|``zero``), ``max_workers``, ``pad_to_estimate`` and ``size_factor`` (below).

The serde sees ``[2, L, T, H*D]`` (``KV_2LTD``) chunks and an ``ObjectKey`` without a token
position: the rotary phase is searched (:mod:`.position`) and recorded in the file. The output is
``KVZL2\\0\\0\\0`` + u64 length + the ``.kvz`` bytes, its length returned to LMCache (variable size).

**Fixed-size adapters.** LMCache 0.5.6's FS L2 adapter reads back exactly
``estimate_serialized_size`` bytes and fails any shorter file ("Incomplete read ...": a miss, never
corrupt data). :func:`check_adapter_config` refuses that combination with a clear error. The
work-around is ``pad_to_estimate: true`` with a ``size_factor`` (the slot size as a fraction of the
raw chunk, e.g. 0.4 for kvz at ~4 bpv of bf16): every chunk is padded to its slot, and a chunk that
does not fit fails its store (a later miss) instead of writing a truncated file.
"""
from __future__ import annotations

import struct

import numpy as np
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory

from . import _common as C
from .kvcodec import as_bool, codec_from_options

__all__ = ["KvzSerializer", "KvzDeserializer", "create_kvz_serde", "check_adapter_config", "SERDE_NAME"]

SERDE_NAME = "kvz"
MAGIC = b"KVZL2\0\0\0"
HEADER = len(MAGIC) + 8
MARGIN = 64 << 10


def _raw_bytes(layout_desc) -> int:
    total = 0
    for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes):
        n = 1
        for s in shape:
            n *= int(s)
        total += n * int(getattr(dtype, "itemsize", 2))
    return total


class _Base:
    def __init__(self, opts: dict):
        self.opts = dict(opts)
        self.chunk_size = int(self.opts.get("chunk_size", 256))
        self.codec = codec_from_options(self.opts, default_step=self.chunk_size)
        nh = self.opts.get("num_heads")
        if nh is None:
            from .position import _bank

            nh = _bank(self.codec.bank).signature.get("kv_heads", 1)
        self.num_heads = int(nh)
        self.pad = as_bool(self.opts.get("pad_to_estimate", False))
        self.size_factor = float(self.opts.get("size_factor", 1.0))


class KvzSerializer(_Base, Serializer):
    def serialize(self, src, dst, key) -> int:
        t = src.tensor
        out = dst.tensor
        if t is None or out is None:
            raise ValueError("kvz serde needs src and dst tensors")
        if t.dim() != 4:
            raise ValueError(f"kvz serde codes KV_2LTD chunks [2, L, T, H*D]; got shape {tuple(t.shape)}")
        blob = self.codec.encode(C.kv_pairs(t.cpu(), self.num_heads), None, step=self.chunk_size)
        n = HEADER + len(blob)
        cap = out.numel() * out.element_size()
        if n > cap:
            raise ValueError(f"kvz serde: {n} bytes do not fit the {cap}-byte buffer (size_factor "
                             f"{self.size_factor}); the chunk is not stored")
        mv = C.as_numpy(out).reshape(-1).view(np.uint8).data
        mv[:HEADER] = MAGIC + struct.pack("<Q", len(blob))
        mv[HEADER:n] = blob
        if self.pad:
            mv[n:cap] = bytes(cap - n)
            return cap
        return n

    def estimate_serialized_size(self, layout_desc) -> int:
        return int(_raw_bytes(layout_desc) * self.size_factor) + MARGIN


class KvzDeserializer(_Base, Deserializer):
    def deserialize(self, src, dst, key) -> None:
        buf = C.as_numpy(src.tensor).reshape(-1).view(np.uint8)
        if buf.size < HEADER or bytes(buf[:len(MAGIC)]) != MAGIC:
            C.warn("kvz serde: the L2 payload is not a kvz record (torn or foreign); a miss")
            raise ValueError("not a kvz L2 record")
        (n,) = struct.unpack("<Q", bytes(buf[len(MAGIC):HEADER]))
        if HEADER + n > buf.size:
            C.warn("kvz serde: the L2 payload is truncated; a miss")
            raise ValueError("truncated kvz L2 record")
        try:
            pairs, _ = self.codec.decode(buf[HEADER:HEADER + n].data)
        except Exception as e:
            C.warn(f"kvz serde: corrupt L2 payload ({type(e).__name__}: {e}); a miss")
            raise
        t = dst.tensor
        want = (2, len(pairs), pairs[0][0].shape[1], pairs[0][0].shape[0] * pairs[0][0].shape[2])
        if tuple(t.shape) != want:
            raise ValueError(f"kvz serde: the record holds {want}, the destination is {tuple(t.shape)}")
        C.write_pairs(t, pairs)


def create_kvz_serde(kwargs: dict):
    """The factory registered as ``"kvz"``: an ``AsyncSerdeProcessor`` over kvz's serializer pair."""
    kw = dict(kwargs or {})
    workers = int(kw.pop("max_workers", 1))
    return AsyncSerdeProcessor(KvzSerializer(kw), KvzDeserializer(kw), max_workers=workers)


def check_adapter_config(adapter_config) -> None:
    """Raise a clear ``ValueError`` for an L2 adapter that cannot hold variable-size kvz payloads
    (LMCache 0.5.6's FS adapter, unless ``pad_to_estimate`` is set)."""
    serde = getattr(adapter_config, "serde_config", None)
    if serde is None or getattr(serde, "type", None) != SERDE_NAME:
        return
    fixed = type(adapter_config).__name__ in ("FSL2AdapterConfig",)
    if fixed and not as_bool(serde.kwargs.get("pad_to_estimate", False)):
        raise ValueError(f"{type(adapter_config).__name__}: LMCache's FS L2 adapter reads back exactly "
                         "estimate_serialized_size bytes, so it cannot hold kvz's variable-size payloads (every "
                         "load would fail 'Incomplete read'); set serde kwargs pad_to_estimate: true with a "
                         "size_factor (e.g. 0.4), or use an adapter that keeps the stored size")


if SERDE_NAME not in get_registered_serde_types():
    register_serde_factory(SERDE_NAME, create_kvz_serde)
