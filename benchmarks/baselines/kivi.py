"""KIVI-style asymmetric integer quantization (INT8 / INT4 / INT2), with KIVI's full-precision residual window.

Keys are quantized per channel (a group = G consecutive tokens of one channel), values per token (a group = G
consecutive channels of one token). Each group stores an fp16 scale and an fp16 zero (= group min), i.e. 32 bits
per group, counted in bpv; codes are b bits each (bit-packed size is counted). The bit width is fixed; the knob
for matched error is the group size G (smaller G, lower error, more metadata); a target the smallest G cannot
reach is reported with ``extra["meets_target"] = False``. Keys are quantized as the cache holds them, i.e.
post-RoPE, as KIVI does.

``kivi_int8`` / ``kivi_int4`` / ``kivi_int2``: the whole cache is quantized (no recent-token window).

``kivi2_r128`` / ``kivi4_r128`` - KIVI proper (Liu et al., arXiv 2402.02750; re-implemented from the paper and
the prefill split of its reference code, no code copied): 2/4 bits, G = 32, and a residual of R = 128 recent tokens
kept in full precision. As in KIVI's prefill, for a cache of L tokens the **values** keep the last ``min(R, L)``
tokens in full precision and quantize the rest per token; the **keys** are quantized in whole blocks of R tokens
and keep the ``L mod R`` trailing tokens in full precision (all L when L < R): in KIVI the key residual is the
not-yet-full block, flushed into per-channel groups when it reaches R tokens. ``window="last"`` instead keeps the
last R tokens of both keys and values (the simpler reading of "recent-token window"). The window is stored
at 16 bits per value: as the source dtype when that is 16-bit (bf16/fp16, exact), as fp16 otherwise; counted.
R is a parameter (``KIVI(bits, residual=R)``).
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

    def __init__(self, bits: int, default_group: int = 32, residual: int | None = None, window: str = "kivi",
                 name: str | None = None):
        if window not in ("kivi", "last"):
            raise ValueError("window must be 'kivi' or 'last'")
        self.bits = bits
        self.residual = residual
        self.window = window
        self.name = name or (f"kivi_int{bits}" if residual is None else f"kivi{bits}_r{residual}")
        self.default_knob = default_group

    @staticmethod
    def _is_key(name: str) -> bool:
        return name.endswith("key")

    def n_full(self, name: str, T: int) -> int:
        """How many trailing tokens this tensor keeps in full precision."""
        R = self.residual
        if not R:
            return 0
        if self._is_key(name) and self.window == "kivi":
            return T if T < R else T % R
        return min(R, T)

    def _quant(self, name, x, G):
        # keys: group along tokens -> put T last; values: group along channels (already last)
        xt = np.swapaxes(x, -1, -2) if self._is_key(name) else x
        G_eff = min(G, xt.shape[-1])
        q, scale, zero, n = quantize_groups(xt, self.bits, G_eff)
        return (q, scale, zero, n), x.size * self.bits + 32 * scale.size, 32 * scale.size

    def encode(self, name, x, G, ctx):
        G = self.default_knob if G is None else G
        T = x.shape[-2]
        nf = self.n_full(name, T)
        if nf == 0:
            payload, bits, meta = self._quant(name, x, G)
            return Encoded(bits, (payload, None), meta)
        full = x[..., T - nf:, :]
        full = full if full.dtype.itemsize == 2 else full.astype(np.float16)
        payload, bits, meta = self._quant(name, x[..., :T - nf, :], G) if nf < T else (None, 0, 0)
        return Encoded(bits + 16 * full.size, (payload, full.copy()), meta)

    def decode(self, name, enc, shape, ctx):
        payload, full = enc.payload
        parts = []
        if payload is not None:
            y = dequantize_groups(*payload)
            parts.append(np.swapaxes(y, -1, -2) if self._is_key(name) else y)
        if full is not None:
            parts.append(full.astype(np.float32))
        return np.concatenate(parts, axis=-2).reshape(shape) if len(parts) > 1 else parts[0].reshape(shape)


def baselines() -> dict[str, TensorCodec]:
    return {"kivi_int8": KIVI(8), "kivi_int4": KIVI(4), "kivi_int2": KIVI(2),
            "kivi2_r128": KIVI(2, residual=128), "kivi4_r128": KIVI(4, residual=128)}
