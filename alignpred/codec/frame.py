"""The coding frame of a block: native rows -> (RoPE undone for keys) -> bank mean removed ->
(optional GPA rotation), and back, cast to the cache's dtype.

RoPE: files of format 1.0 (``arith = "float"`` and no exact RoPE spec in the layout) use the
RoPE tables of kvz 0.1 (:func:`alignpred.cache.rope.apply_rope`); everything else uses the layout's
:class:`~alignpred.cache.rope.RopeSpec`. Positions are absolute (``start + position_offset``).
"""
from __future__ import annotations

import numpy as np

from alignpred.cache.layout import numpy_dtype
from alignpred.cache.rope import apply_rope


def check_rope_range(layout, config) -> None:
    """Refuse (LayoutError) a layout whose RoPE angles would pass the platform-independent
    tables' limit (kvz.md §8.3.2): checked when a file is opened or a cache compressed, not
    halfway through a decode."""
    if not (layout.keys_roped and config.rope_undo) or (layout.rope is None and config.arith == "float"):
        return
    from alignpred.errors import LayoutError
    from alignpred.kernels.sincos import ANGLE_LIMIT as _ANGLE_LIMIT

    last = np.float32(layout.position_offset + max(layout.n_tokens, 1) - 1)
    for t in layout.rope_spec.tables:
        angle = float(np.float32(last * np.float32(max(t.inv_freq))))
        if angle >= _ANGLE_LIMIT:
            raise LayoutError(f"RoPE angles reach {angle:.4g} at position {int(last)}, beyond what kvz's "
                              f"platform-independent tables cover ({_ANGLE_LIMIT:.4g}); positions this far out "
                              "cannot be coded with RoPE undone (use rope_undo=False)")


class Frame:
    """Forward and inverse coding-frame transforms of every block of a layout."""

    def __init__(self, layout, config, plans):
        import ml_dtypes

        self.layout = layout
        self.config = config
        self.plans = plans
        self.out_dtype = numpy_dtype(layout.dtype)
        self.fmax = float(ml_dtypes.finfo(self.out_dtype).max)
        self.rope_on = layout.keys_roped and config.rope_undo
        self.legacy_rope = layout.rope is None and config.arith == "float"
        self._zero: dict = {}
        self._rope_args: dict = {}   # (table index, start, n) -> rope_args' tuple

    def _rope(self, x, blk, start: int, inverse: bool):
        lay = self.layout
        if blk.kind != "K" or not self.rope_on:
            return x
        pos = start + lay.position_offset
        if self.legacy_rope:
            return apply_rope(x, np.arange(x.shape[0]) + pos, lay.rope_theta[blk.layer], inverse=inverse,
                              pairing=lay.rope_pairing)
        table = lay.rope_spec.table(blk.layer)
        return x if table is None else table.apply(x, pos, inverse=inverse)

    def rope_args(self, blk, start: int, n: int):
        """``(cos, sin, rotary_dim, pairing)`` as :func:`alignpred.kernels.fused.fused_post` takes them
        (attention scaling multiplied in, float32, as :meth:`RopeTable.apply` does), or None when
        the block's rows are not rotated. Exact arithmetic only."""
        if blk.kind != "K" or not self.rope_on:
            return None
        spec = self.layout.rope_spec
        ix = spec.layer_table[blk.layer]
        if ix < 0:
            return None
        key = (ix, start, n)   # layers sharing a table ask for the same rows: made once per range
        hit = self._rope_args.get(key)
        if hit is None:
            table = spec.tables[ix]
            cos, sin = table.cos_sin(start + self.layout.position_offset, n)
            s = np.float32(table.attention_scaling)
            if s != 1:
                cos, sin = cos * s, sin * s
            hit = (cos, sin, table.rotary_dim, table.pairing)
            if len(self._rope_args) >= 64:
                self._rope_args.clear()
            self._rope_args[key] = hit
        return hit

    def to_frame(self, x: np.ndarray, blk, start: int) -> np.ndarray:
        """Native block rows ``[n, d]`` (file positions from ``start``) -> coding frame (float32)."""
        p = self.plans[blk.name]
        z = self._rope(np.asarray(x, np.float32), blk, start, inverse=True) - p.mean
        return z @ p.rot if p.rot is not None else z

    def zero_image(self, blk) -> np.ndarray:
        """Coding-frame image ``[d]`` of a zero row (RoPE(0) = 0 at every position); encoder and
        decoder compute it the same way, on one row."""
        z = self._zero.get(blk.name)
        if z is None:
            z = self._zero[blk.name] = self.to_frame(np.zeros((1, self.layout.head_dim), np.float32), blk, 0)[0]
        return z

    def to_native(self, z: np.ndarray, blk, start: int) -> np.ndarray:
        """Coding-frame rows -> native rows, cast to the source dtype (clipped to its range)."""
        p = self.plans[blk.name]
        if p.rot is not None:  # per object, so the product has the same shape on every path
            S = self.config.object_size
            x = np.concatenate([z[a:a + S] @ p.rot.T for a in range(0, z.shape[0], S)]) if len(z) else z
        else:
            x = z
        x = self._rope(x + p.mean, blk, start, inverse=False)
        return np.clip(x, -self.fmax, self.fmax).astype(self.out_dtype)
