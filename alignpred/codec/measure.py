"""The encoder's error measure and step multipliers (format 1.3): what the attention scope bounds.

:class:`Measure` holds, for one cache, the per-channel step codes (``config.channel_steps``) and
per-position row codes (``config.row_steps``) the encoder quantises with, and measures errors the
way the scope defines them:

* every scope but ``attention``: the plain squared error;
* ``attention``: every value's squared error (and norm) weighted by ``1 / s²``, ``s`` its step
  multiplier (channel code, sink, stale-row and row factors) — what the multipliers encode as
  the model's weights; and, with ``plain_cap``, each object's plain squared error over the
  positions a later query reads, kept per (tensor, object, head) for the search's plain cap.

>>> import numpy as np
>>> from alignpred.cache.layout import CacheLayout
>>> from alignpred.codec.budget import ErrorBudget
>>> from alignpred.codec.config import CodecConfig
>>> lay = CacheLayout(num_layers=1, kv_heads=1, head_dim=2, n_tokens=4, dtype="float32")
>>> m = Measure(lay, CodecConfig(channel_steps=True, sink_tokens=0), ErrorBudget(eps=0.1, scope="attention",
...             weights={"layers.0.key": 1.0, "layers.0.value": 1.0}),
...             step_codes=[np.array([32, 64], np.uint8)] * 2)
>>> m.chan(0, 0).tolist(), m.row_sq(np.ones((1, 2)), 0, 0, 0).tolist()    # 1 + 1/4
([1.0, 2.0], [1.25])
"""
from __future__ import annotations

import numpy as np

from alignpred.codec.budget import STEP_UNIT, code_steps
from alignpred.errors import EncodeError

__all__ = ["Measure"]


def _codes(codes, n: int, size: int, what: str) -> list[np.ndarray]:
    out = list(codes) if codes is not None else []
    if len(out) != n or not all(np.asarray(c).shape == (size,) and np.asarray(c).dtype == np.uint8
                                and int(np.asarray(c).min()) >= 1 for c in out):
        raise EncodeError(f"{what} needs {n} uint8 code arrays [{size}] in 1..255")
    return [np.asarray(c, np.uint8) for c in out]


class Measure:
    """Step multipliers and the error measure of one (layout, config, budget); see the module
    docstring. ``step_codes`` / ``row_codes``: per tensor (layout order), required exactly when
    ``config.channel_steps`` / ``config.row_steps``."""

    def __init__(self, layout, config, budget, step_codes=None, row_codes=None):
        self.layout = layout
        self.config = config
        self.tensors = layout.tensors()
        n_t, H, d = len(self.tensors), layout.kv_heads, layout.head_dim
        if config.channel_steps:
            self.step_codes: list | None = _codes(step_codes, n_t, H * d, "channel_steps")
        elif step_codes is not None:
            raise EncodeError("step codes need config.channel_steps")
        else:
            self.step_codes = None
        self.row_codes: list | None = None
        self.rows: list = [None] * n_t  # per tensor: float32 [n_tokens] row multipliers, or None
        if config.row_steps:
            self.row_codes = _codes(row_codes, n_t, layout.n_tokens, "row_steps")
            self.rows = [code_steps(c) for c in self.row_codes]
        elif row_codes is not None:
            raise EncodeError("row codes need config.row_steps")
        self.weighted = budget.strategy.attention  # the attention measure
        self._wc = None
        if self.weighted and self.step_codes is not None:
            self._wc = [((np.float64(STEP_UNIT) / c.astype(np.float64)) ** 2).reshape(H, d) for c in self.step_codes]
        self.plain_cap = float(budget.plain_cap) if self.weighted else 0.0
        S = config.object_size
        n_obj = -(-layout.n_tokens // S)
        self.plain_err = np.zeros((n_t, n_obj, H))  # plain squared error over read rows, last pass
        self.plain_norm = np.zeros((n_t, n_obj))

    def chan(self, ti: int, h: int) -> np.ndarray | None:
        """Per-channel step multipliers of head ``h`` of tensor ``ti`` (None: all ones)."""
        if self.step_codes is None:
            return None
        d = self.layout.head_dim
        return code_steps(self.step_codes[ti][h * d:(h + 1) * d])

    def row_sq(self, d: np.ndarray, ti: int, h: int, start: int) -> np.ndarray:
        """Squared norm of every row of ``d [n, head_dim]`` (float64, native frame, file rows
        from ``start``) in the scope's measure."""
        if not self.weighted:
            return np.einsum("ij,ij->i", d, d)
        e = np.einsum("ij,ij,j->i", d, d, self._wc[ti][h]) if self._wc is not None else np.einsum("ij,ij->i", d, d)
        steps = np.ones(len(e), np.float32)
        self.config.scale_sink(steps, start, self.layout.position_offset)
        self.config.scale_stale(steps, start, self.layout, self.tensors[ti][0])
        if self.rows[ti] is not None:
            steps *= self.rows[ti][start:start + len(e)]
        return e / np.square(steps.astype(np.float64))

    def read_rows(self, ti: int, start: int, n: int) -> np.ndarray:
        """Which of ``n`` rows from file position ``start`` a query after the file's end reads
        (all but the stale rows of a sliding-window layer)."""
        read = np.ones(n, bool)
        read[:min(n, self.config.stale_rows(start, self.layout, self.tensors[ti][0]))] = False
        return read

    def keep_plain_norms(self, x: np.ndarray, ti: int, j0: int, j1: int, start: int) -> None:
        """With a plain cap: the plain squared norms over read rows of objects ``j0..j1-1`` of
        tensor ``ti`` from its rows ``x [heads, n, d]`` (file rows from ``start``)."""
        if not self.plain_cap:
            return
        from alignpred.codec.chain import obj_sums

        read = self.read_rows(ti, start, x.shape[1])
        self.plain_norm[ti, j0:j1] = sum(obj_sums(np.where(read, np.einsum("ij,ij->i", xh, xh), 0.0),
                                                  self.config.object_size) for xh in x.astype(np.float64))

    def keep_plain_error(self, d: np.ndarray, ti: int, h: int, start: int) -> None:
        """With a plain cap: the plain squared error over read rows of one object's block
        difference ``d`` (its first row at file position ``start``). One (tensor, object, head)
        per call, so no two threads write one cell."""
        if self.plain_cap:
            p = np.einsum("ij,ij->i", d, d)
            self.plain_err[ti, start // self.config.object_size, h] = float(p[self.read_rows(ti, start, len(p))].sum())

    def plain(self, objs=None):
        """``(plain squared errors, plain squared norms)`` per tensor over ``objs`` (default all)."""
        sel = slice(None) if objs is None else objs
        return self.plain_err[:, sel].sum(axis=(1, 2)), self.plain_norm[:, sel].sum(axis=1)

    def tensor_plain(self, ti: int) -> tuple[float | None, float | None]:
        """The plain statistics recorded for tensor ``ti`` in the header (None without a cap)."""
        if not self.plain_cap:
            return None, None
        return float(self.plain_err[ti].sum()), float(self.plain_norm[ti].sum())
