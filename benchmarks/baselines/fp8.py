"""Fixed-rate float casts: FP8 e4m3 / e5m2 with a per-tensor scale, and plain FP16 / BF16 casts as references.

FP8: scale = amax / max_finite (stored as float32, 32 bits per tensor), values clipped to +-max_finite before the
cast (overflow would become NaN in e4m3fn). No knob: at a requested eps the coder reports the error it reaches and
``extra["meets_target"]`` says whether that is within the target.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ._core import Encoded, TensorCodec

HEADER_BITS = 32  # float32 per-tensor scale


class FloatCast(TensorCodec):
    knob_kind = "none"

    def __init__(self, name: str, dtype, scaled: bool):
        self.name = name
        self.dtype = np.dtype(dtype)
        self.scaled = scaled
        self.maxval = float(ml_dtypes.finfo(self.dtype).max)

    def encode(self, name, x, knob, ctx):
        x32 = x.astype(np.float32)
        if self.scaled:
            amax = float(np.max(np.abs(x32))) if x32.size else 0.0
            scale = np.float32(amax / self.maxval if amax > 0 else 1.0)
            q = np.clip(x32 / scale, -self.maxval, self.maxval).astype(self.dtype)
            return Encoded(q.size * self.dtype.itemsize * 8 + HEADER_BITS, (q, scale), HEADER_BITS)
        q = np.clip(x32, -self.maxval, self.maxval).astype(self.dtype)
        return Encoded(q.size * self.dtype.itemsize * 8, (q, np.float32(1.0)), 0)

    def decode(self, name, enc, shape, ctx):
        q, scale = enc.payload
        return q.astype(np.float32) * scale


def baselines() -> dict[str, TensorCodec]:
    return {
        "fp8_e4m3": FloatCast("fp8_e4m3", ml_dtypes.float8_e4m3fn, scaled=True),
        "fp8_e5m2": FloatCast("fp8_e5m2", ml_dtypes.float8_e5m2, scaled=True),
        "fp16": FloatCast("fp16", np.float16, scaled=False),
        "bf16": FloatCast("bf16", ml_dtypes.bfloat16, scaled=False),
    }
