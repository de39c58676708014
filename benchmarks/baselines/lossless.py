"""Lossless references (error 0): zstd and pcodec on the raw source-dtype data.

* ``zstd``: ``zstandard`` at level 19 (long-distance matching off) on the raw little-endian bytes of each tensor.
* ``zstd_shuffle``: same, after a byte shuffle (all high bytes, then all low bytes), as Blosc/HDF5 filters do.
* ``pcodec``: ``pcodec`` standalone format on each tensor; 16-bit sources (bf16/f16) as their uint16 bit patterns,
  float32 as float32.
Each tensor is one independent frame; bpv counts the frames (their headers included).
"""
from __future__ import annotations

import numpy as np

from ._core import Encoded, TensorCodec


class Zstd(TensorCodec):
    knob_kind = "none"

    def __init__(self, name: str = "zstd", level: int = 19, shuffle: bool = False):
        self.name = name
        self.level = level
        self.shuffle = shuffle

    def encode(self, name, x, knob, ctx):
        import zstandard
        raw = np.ascontiguousarray(x)
        b = raw.view(np.uint8).reshape(-1, raw.dtype.itemsize)
        data = np.ascontiguousarray(b.T).tobytes() if self.shuffle else b.tobytes()
        z = zstandard.ZstdCompressor(level=self.level).compress(data)
        return Encoded(8 * len(z), (z, x.dtype), 0)

    def decode(self, name, enc, shape, ctx):
        import zstandard
        z, dtype = enc.payload
        b = np.frombuffer(zstandard.ZstdDecompressor().decompress(z), np.uint8)
        if self.shuffle:
            b = np.ascontiguousarray(b.reshape(dtype.itemsize, -1).T)
        return b.view(dtype).reshape(shape)


class Pcodec(TensorCodec):
    knob_kind = "none"
    name = "pcodec"

    def encode(self, name, x, knob, ctx):
        from pcodec import ChunkConfig, standalone
        flat = np.ascontiguousarray(x).ravel()
        v = flat.view(np.uint16) if flat.dtype.itemsize == 2 else flat
        z = standalone.simple_compress(v, ChunkConfig())
        return Encoded(8 * len(z), (z, x.dtype), 0)

    def decode(self, name, enc, shape, ctx):
        from pcodec import standalone
        z, dtype = enc.payload
        return np.asarray(standalone.simple_decompress(z)).view(dtype).reshape(shape)


def baselines():
    return {"zstd": Zstd(), "zstd_shuffle": Zstd("zstd_shuffle", shuffle=True), "pcodec": Pcodec()}
