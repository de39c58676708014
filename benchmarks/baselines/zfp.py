"""ZFP (``zfpy==1.0.1``) in fixed-accuracy mode on 2-D float32 [T, head_dim] arrays (one per KV head).

ZFP only honours tolerances that are powers of two (it keeps bit planes down to floor(log2 tol)), which would make
the error jump in factors of ~2. To get a continuous knob, a tolerance t is applied as tolerance 2^ceil(log2 t) on
the data pre-multiplied by s = 2^ceil(log2 t) / t in [1, 2); s is stored per tensor as float32 (32 bits, counted).
The stored size is the zfpy stream with its header (write_header=True) plus that scale.
"""
from __future__ import annotations

import math

import numpy as np

from ._core import Encoded, TensorCodec


class ZFP(TensorCodec):
    knob_kind = "continuous"
    knob_name = "tolerance"

    def __init__(self, name: str = "zfp"):
        self.name = name

    def encode(self, name, x, tol, ctx):
        import zfpy
        p2 = 2.0 ** math.ceil(math.log2(tol))
        s = np.float32(p2 / tol)
        x32 = x.astype(np.float32) * s
        bufs = [zfpy.compress_numpy(np.ascontiguousarray(x32[h]), tolerance=p2) for h in range(x32.shape[0])]
        meta = 32
        return Encoded(8 * sum(len(b) for b in bufs) + meta, (bufs, s), meta)

    def decode(self, name, enc, shape, ctx):
        import zfpy
        bufs, s = enc.payload
        y = np.stack([zfpy.decompress_numpy(b) for b in bufs])
        return y.reshape(shape) / s

    def knob_guess(self, xs, eps, ctx):
        ss = sum(float(np.sum(np.square(x.astype(np.float64)))) for x in xs)
        n = sum(x.size for x in xs)
        return 4.0 * eps * (math.sqrt(ss / max(n, 1)) or 1e-30)


def baselines():
    return {"zfp": ZFP()}
