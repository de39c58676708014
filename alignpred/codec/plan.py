"""Block plans: everything needed to predict one block in its coding frame (bank mean, optional
GPA rotation, and each predictor's data), built once per layout, bank and configuration.

>>> import numpy as np
>>> from alignpred.bank.bank import Bank
>>> from alignpred.codec.config import CodecConfig
>>> from alignpred.cache.layout import CacheLayout
>>> lay = CacheLayout(num_layers=1, kv_heads=1, head_dim=2, n_tokens=4, dtype="float32")
>>> bank = Bank(model="", signature=lay.signature(), config={"groups": [], "sources": {}},
...             arrays={"mean/K.0.0": np.zeros(2, np.float32), "mean/V.0.0": np.ones(2, np.float32)})
>>> plans = build_plans(lay, bank, CodecConfig())
>>> plans["V.0.0"].mean.tolist(), plans["V.0.0"].modes()
([1.0, 1.0], [0, 4])
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from alignpred.codec.predictors import BASE_MASK, REGISTRY, ZERO, candidate_modes
from alignpred.errors import BankMismatchError


@dataclass
class BlockPlan:
    """Prediction plan of one block (coding frame)."""

    block: str
    mean: np.ndarray
    rot: np.ndarray | None
    config: object
    object_size: int = 256
    data: dict = field(default_factory=dict)  # predictor name -> its data
    sources: set = field(default_factory=set)  # blocks this block's predictions read
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # _kinds by modes

    def modes(self) -> list[int]:
        """The modes a channel of this block may use."""
        return candidate_modes(self.config, set(self.data))

    def _kinds(self, modes: np.ndarray) -> tuple:
        """``(modes & BASE_MASK, its sorted distinct predictor ids, the ZERO channels' indices)``,
        kept per distinct ``modes`` (a file's modes are fixed: a decode asks the same again)."""
        key = (modes.dtype.str, modes.shape, modes.tobytes())
        hit = self._memo.get(key)
        if hit is None:
            ids = modes & BASE_MASK
            ids.setflags(write=False)
            hit = (ids, np.unique(ids).tolist(), np.flatnonzero(ids == ZERO))
            if len(self._memo) < 64:
                self._memo[key] = hit
        return hit

    def base(self, mode: int, recon: dict, out: np.ndarray | None = None) -> np.ndarray | None:
        """Base prediction ``[n, d]`` of ``mode``'s predictor (None for ``ZERO``), written into
        ``out`` where the predictor can."""
        return REGISTRY[mode & BASE_MASK].base(self, recon, out)

    def predict(self, modes: np.ndarray, recon: dict, n: int, bases: dict | None = None,
                out: np.ndarray | None = None) -> np.ndarray:
        """Base prediction ``[n, d]`` with each channel's own mode (float32). ``bases`` may hold
        base predictions already computed from the same ``recon`` (by predictor id). ``out``:
        float32 ``[n, d]`` (C-contiguous) to write the prediction into where possible (the
        result is ``out`` or a new array; the values are the same)."""
        ids, kinds, zero_cols = self._kinds(modes)
        if kinds == [ZERO]:
            if out is None:
                return np.zeros((n, self.mean.shape[0]), np.float32)
            out.fill(0.0)
            return out

        def base(bb, into=None):
            return bases[bb] if bases is not None and bb in bases else self.base(bb, recon, into)

        if len(kinds) == 1:
            return np.asarray(base(kinds[0], out), np.float32)
        if len(kinds) == 2 and kinds[0] == ZERO and (bases is None or kinds[1] not in bases):
            # one predictor and some ZERO channels: zero those columns of its fresh prediction
            # (the values np.where below would give, without a second [n, d] pass)
            out = np.asarray(base(kinds[1], out), np.float32)
            out[:, zero_cols] = 0.0
            return out
        out = np.zeros((n, self.mean.shape[0]), np.float32)
        for bb in kinds:
            if bb != ZERO:
                out = np.where(ids == bb, base(bb), out)
        return out.astype(np.float32, copy=False)


def build_plans(layout, bank, config) -> dict[str, BlockPlan]:
    """Per-block plans from the bank, in block order (predictors moved into the coding frame)."""
    bank.check_layout(layout)
    plans = {}
    for blk in layout.blocks():
        b = blk.name
        try:
            mean = bank.mean(b)
        except KeyError:
            raise BankMismatchError(f"bank has no mean for block {b}") from None
        rot = bank.rotation(b) if config.align else None
        if config.align and rot is None:
            raise BankMismatchError("alignment requested but the bank has no rotations")
        plans[b] = BlockPlan(block=b, mean=mean, rot=rot, config=config, object_size=config.object_size)
    for p in REGISTRY.values():
        if p.enabled(config):
            p.attach(plans, bank, config)
    return plans
