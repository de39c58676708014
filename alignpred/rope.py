"""Rotary position embedding (RoPE): apply and undo, so keys can be coded without it.

Keys are cached after RoPE; the rotation angle depends on the position, which hides the
correlation between neighbouring layers and between K and V. Undoing it is an orthogonal
map per token, so squared error is the same in both frames.

>>> import numpy as np
>>> x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
>>> y = apply_rope(x, np.arange(5), 1e4)
>>> bool(np.allclose(apply_rope(y, np.arange(5), 1e4, inverse=True), x, atol=1e-5))
True
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


_BLOCK = 256


@lru_cache(maxsize=16)  # 4 MiB at d = 256: the blocks of one 2,048-position chunk, for two thetas
def _block(theta: float, d: int, k: int):
    """cos/sin for positions ``[k*256, (k+1)*256)``: always computed in the same aligned blocks,
    so a position's value never depends on which range was asked for."""
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = np.arange(k * _BLOCK, (k + 1) * _BLOCK, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _tables(theta: float, d: int, start: int, n: int):
    ks = range(start // _BLOCK, (start + n - 1) // _BLOCK + 1) if n else range(0)
    if not n:
        return np.zeros((0, d // 2), np.float32), np.zeros((0, d // 2), np.float32)
    cos = np.concatenate([_block(theta, d, k)[0] for k in ks])
    sin = np.concatenate([_block(theta, d, k)[1] for k in ks])
    off = start - ks[0] * _BLOCK
    return cos[off:off + n], sin[off:off + n]


def apply_rope(x: np.ndarray, positions, theta: float, inverse: bool = False,
               pairing: str = "half") -> np.ndarray:
    """Rotate ``x[..., T, d]`` by RoPE at consecutive ``positions`` (float32 result).

    ``pairing='half'`` pairs channel ``i`` with ``i + d/2`` (Llama/Gemma ``rotate_half``);
    ``'interleaved'`` pairs ``2i`` with ``2i+1``.
    """
    positions = np.asarray(positions)
    n = x.shape[-2]
    d = x.shape[-1]
    start = int(positions[0]) if n else 0
    cos, sin = _tables(float(theta), d, start, n)
    if inverse:
        sin = -sin
    x = np.asarray(x, dtype=np.float32)
    if pairing == "half":
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x2 * cos + x1 * sin
    return out
