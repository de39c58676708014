"""State shared by encoder and decoder: block plans, the coding frame, and which reconstructed
blocks are still referenced by later blocks (closed-loop prediction: both sides predict from the
same reconstructions, in the layout's block order)."""
from __future__ import annotations

import numpy as np

from alignpred import entropy
from alignpred.codec.frame import Frame
from alignpred.codec.plan import build_plans
from alignpred.errors import EncodeError

OBJ_ZERO = 1  # object flag: every value (or, for a refinement object, every symbol) is zero, no payload
OBJ_REFINE = 2  # object flag: a refinement-tier object (see alignpred.codec.refine)


def obj_sums(v: np.ndarray, size: int) -> np.ndarray:
    """Sum of ``v [n]`` over consecutive chunks of ``size``."""
    n = v.shape[0]
    k = -(-n // size)
    pad = np.zeros(k * size, v.dtype)
    pad[:n] = v
    return pad.reshape(k, size).sum(axis=1)


class Chain:
    """Plans, frame and reference pruning of one (layout, bank, config)."""

    def __init__(self, layout, bank, config, coder: str = "rans4", plans=None):
        if coder not in entropy.CODERS:
            raise EncodeError(f"unknown entropy coder {coder!r}; use one of {', '.join(entropy.CODERS)}")
        self.coder = coder
        self.layout = layout
        self.config = config
        self.plans = build_plans(layout, bank, config) if plans is None else plans
        self.frame = Frame(layout, config, self.plans)
        self.blocks = layout.blocks()
        self._order_idx = {b.name: k for k, b in enumerate(self.blocks)}
        last_use: dict[str, int] = {}
        for k, b in enumerate(self.blocks):
            for s in self.plans[b.name].sources:
                last_use[s] = k
        self._last_use = last_use

    def prune(self, recon: dict, done_block: str) -> list:
        """Drop the reconstructions no block after ``done_block`` reads; returns them."""
        k = self._order_idx[done_block]
        return [recon.pop(b) for b in [b for b in recon if self._last_use.get(b, -1) <= k]]

    def delta_rows(self, delta_obj, zero_obj, start: int, n_rows: int | None = None, layer: int = 0, rows=None):
        """Per-row steps (float32, sink rows and stale rows of ``layer`` scaled, then times the
        tensor's per-position multipliers ``rows`` [n_tokens] when given; zero objects' rows 1.0)
        and the zero-row mask for consecutive objects from file position ``start``."""
        S = self.config.object_size
        n = min(len(delta_obj) * S, self.layout.n_tokens - start) if n_rows is None else n_rows
        delta_rows = np.repeat(np.asarray(delta_obj, np.float32), S)[:n]
        self.config.scale_sink(delta_rows, start, self.layout.position_offset)
        self.config.scale_stale(delta_rows, start, self.layout, layer)
        if rows is not None:
            delta_rows *= rows[start:start + n]
        zero_rows = np.repeat(np.asarray(zero_obj, bool), S)[:n]
        delta_rows[zero_rows] = 1.0
        return delta_rows, zero_rows
