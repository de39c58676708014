"""KIVI-style asymmetric integer quantization (INT8 / INT4 / INT2).

Keys are quantized per channel (a group = G consecutive tokens of one channel), values per token (a group = G
consecutive channels of one token). Each group stores an fp16 scale and an fp16 zero (= group min), i.e. 32 bits
per group, counted in bpv; codes are b bits each (bit-packed size is counted). The bit width is fixed; the knob
for matched error is the group size G (smaller G, lower error, more metadata); a target the smallest G cannot
reach is reported with ``extra["meets_target"] = False``. Unlike KIVI proper, no recent-token window is kept in
full precision (the whole cache is quantized).
"""
from __future__ import annotations

import numpy as np

from ._core import Encoded, TensorCodec

GROUP_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)  # increasing error


def _groups_last(x: np.ndarray, G: int) -> tuple[np.ndarray, int]:
    """[..., n] -> [..., ceil(n/G), G] padding by edge replication (does not change group min/max)."""
    n = x.shape[-1]
    pad = (-n) % G
    if pad:
        x = np.concatenate([x, np.repeat(x[..., -1:], pad, axis=-1)], axis=-1)
    return x.reshape(*x.shape[:-1], -1, G), n


def quantize_groups(x: np.ndarray, bits: int, G: int):
    """Asymmetric min/max quantization along the last axis in groups of G; returns codes, scale, zero (fp16)."""
    g, n = _groups_last(x.astype(np.float32), G)
    mn = g.min(-1, keepdims=True)
    mx = g.max(-1, keepdims=True)
    levels = (1 << bits) - 1
    zero = mn.astype(np.float16)
    scale = ((mx - mn) / levels).astype(np.float16)
    s32 = scale.astype(np.float32)
    safe = np.where(s32 > 0, s32, 1.0)
    q = np.clip(np.rint((g - zero.astype(np.float32)) / safe), 0, levels).astype(np.uint8 if bits <= 8 else np.uint16)
    return q, scale, zero, n


def dequantize_groups(q, scale, zero, n):
    y = q.astype(np.float32) * scale.astype(np.float32) + zero.astype(np.float32)
    y = y.reshape(*y.shape[:-2], -1)
    return y[..., :n]


class KIVI(TensorCodec):
    knob_kind = "discrete"
    knob_name = "group_size"
    knob_values = GROUP_SIZES

    def __init__(self, bits: int, default_group: int = 32):
        self.bits = bits
        self.name = f"kivi_int{bits}"
        self.default_knob = default_group

    @staticmethod
    def _is_key(name: str) -> bool:
        return name.endswith("key")

    def encode(self, name, x, G, ctx):
        # keys: group along tokens -> put T last; values: group along channels (already last)
        xt = np.swapaxes(x, -1, -2) if self._is_key(name) else x
        G_eff = min(G, xt.shape[-1])
        q, scale, zero, n = quantize_groups(xt, self.bits, G_eff)
        n_groups = scale.size
        meta = 32 * n_groups
        return Encoded(x.size * self.bits + meta, (q, scale, zero, n), meta)

    def decode(self, name, enc, shape, ctx):
        y = dequantize_groups(*enc.payload)
        return np.swapaxes(y, -1, -2) if self._is_key(name) else y


def baselines() -> dict[str, TensorCodec]:
    return {"kivi_int8": KIVI(8), "kivi_int4": KIVI(4), "kivi_int2": KIVI(2)}
