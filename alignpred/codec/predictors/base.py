"""The contract of a base predictor (see :mod:`alignpred.codec.predictors`)."""
from __future__ import annotations

import numpy as np

INTERP = 4  # mode bit: token interpolation of the base residual
BASE_MASK = 3  # mode bits holding the base predictor id


class Predictor:
    """A base predictor. ``id`` is stored in the file (bits 0–1 of a channel's mode).

    ``enabled(config)`` — the codec configuration allows it; ``attach(plans, bank, config)`` —
    put what it needs into the block plans (``plan.data[name]``; called once per cache layout,
    after means/rotations are set); ``base(plan, recon)`` — its prediction ``[n, d]`` (float32,
    coding frame) for a block from the reconstructed coding-frame rows ``recon[block_name]`` of
    earlier blocks (all the same rows).
    """

    id: int = -1
    name: str = ""

    def enabled(self, config) -> bool:
        return True

    def attach(self, plans: dict, bank, config) -> None:
        pass

    def base(self, plan, recon: dict, out: np.ndarray | None = None) -> np.ndarray | None:
        """The base prediction ``[n, d]`` of ``plan``'s block from the reconstructions ``recon``:
        a new array, which the caller may modify (never a view of ``recon`` or of plan data), or
        ``out`` (float32 ``[n, d]``, C-contiguous) written and returned where the predictor can
        write into it (it may ignore ``out``)."""
        raise NotImplementedError
