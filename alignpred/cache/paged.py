"""Paged KV (what serving engines hold): per layer a pool of fixed-size blocks
``[num_blocks, block_size, kv_heads, head_dim]`` and, per sequence, a *block table* — the block
ids that hold its positions ``0, block_size, 2·block_size, ...`` in order.

:func:`gather` copies a sequence's positions out of the pools into ``[kv_heads, T, head_dim]``
arrays (what :meth:`alignpred.Cache.from_paged` encodes); :func:`scatter` writes decoded
``[kv_heads, T, head_dim]`` arrays back into the caller's pools (what
:meth:`alignpred.KvzReader.read_paged` does). Other engine layouts (vLLM's CPU slabs, SGLang's
host pages) are the engine adapters' business; this is the common one.

>>> import numpy as np
>>> pool_k = np.arange(4 * 2 * 1 * 3, dtype=np.float32).reshape(4, 2, 1, 3)   # 4 blocks of 2 positions
>>> k = gather(pool_k, [2, 0], n_tokens=3)                                   # positions 0..2
>>> k.shape, k[0, :, 0].tolist()
((1, 3, 3), [12.0, 15.0, 0.0])
>>> out = np.zeros_like(pool_k); scatter(k, out, [2, 0]); bool(np.array_equal(out[2], pool_k[2]))
True
"""
from __future__ import annotations

import numpy as np

from alignpred.cache.arrays import as_numpy
from alignpred.errors import LayoutError

__all__ = ["gather", "scatter", "check_pool", "blocks_for"]


def check_pool(pool, what: str = "block pool") -> np.ndarray:
    """The pool as a numpy view ``[num_blocks, block_size, kv_heads, head_dim]`` (torch CPU
    tensors viewed without a copy), or a :class:`LayoutError` naming what is wrong."""
    a = as_numpy(pool)
    if a.ndim != 4:
        raise LayoutError(f"{what} has shape {tuple(a.shape)}; expected [num_blocks, block_size, kv_heads, head_dim]")
    return a


def _table(block_table, num_blocks: int) -> np.ndarray:
    t = np.asarray(as_numpy(block_table) if not isinstance(block_table, (list, tuple)) else block_table)
    if t.ndim != 1 or not (t.size == 0 or np.issubdtype(t.dtype, np.integer)):
        raise LayoutError("block_table must be a 1-D sequence of integer block ids")
    t = t.astype(np.int64)
    if t.size and (t.min() < 0 or t.max() >= num_blocks):
        raise LayoutError(f"block_table names block {int(t.max() if t.max() >= num_blocks else t.min())}, "
                          f"outside the pool's {num_blocks} blocks")
    return t


def blocks_for(n_tokens: int, block_size: int, start: int = 0) -> range:
    """Indices into a block table of the blocks covering positions ``[start, start + n_tokens)``."""
    return range(start // block_size, -(-(start + n_tokens) // block_size))


def gather(pool, block_table, n_tokens: int | None = None, start: int = 0) -> np.ndarray:
    """Positions ``[start, start + n_tokens)`` of a sequence as ``[kv_heads, n_tokens, head_dim]``
    (a copy, in the pool's dtype). ``n_tokens`` defaults to every position the table covers."""
    a = check_pool(pool)
    nb, bs, h, d = a.shape
    t = _table(block_table, nb)
    cover = len(t) * bs
    n = cover - start if n_tokens is None else int(n_tokens)
    if start < 0 or n < 0 or start + n > cover:
        raise LayoutError(f"positions {start}..{start + n} are outside the {cover} the block table covers "
                          f"({len(t)} blocks of {bs})")
    out = np.empty((h, n, d), a.dtype)
    for i in blocks_for(n, bs, start):
        lo, hi = max(start, i * bs), min(start + n, (i + 1) * bs)
        out[:, lo - start:hi - start] = a[t[i], lo - i * bs:hi - i * bs].transpose(1, 0, 2)
    return out


def scatter(x, pool, block_table, start: int = 0) -> None:
    """Write ``x [kv_heads, n, head_dim]`` (positions ``start ..``) into ``pool`` at the blocks
    of ``block_table`` (cast to the pool's dtype)."""
    a = check_pool(pool)
    nb, bs, h, d = a.shape
    x = as_numpy(x)
    if x.ndim != 3 or x.shape[0] != h or x.shape[2] != d:
        raise LayoutError(f"cannot write {tuple(x.shape)} into blocks of [{bs}, {h}, {d}] "
                          "(expected [kv_heads, positions, head_dim])")
    t = _table(block_table, nb)
    n = x.shape[1]
    if start < 0 or start + n > len(t) * bs:
        raise LayoutError(f"positions {start}..{start + n} are outside the {len(t) * bs} the block table covers")
    for i in blocks_for(n, bs, start):
        lo, hi = max(start, i * bs), min(start + n, (i + 1) * bs)
        a[t[i], lo - i * bs:hi - i * bs] = x[:, lo - start:hi - start].transpose(1, 0, 2)
