"""Base predictors, one module each, found by their mode id.

A channel's *mode* (one byte in the file header) is ``base | INTERP``: bits 0–1 hold the id of a
base predictor registered here (``ZERO``: the bank mean; ``MAP``: the bank's linear map from
already-decoded blocks — cross-layer and K→V; ``BLEND``: the paper's λ-blended aligned
predictor), bit 2 (``INTERP``) adds token interpolation of the base residual
(:mod:`alignpred.kernels.quantize_ref`). A new predictor is one new module here: a :class:`Predictor` with an
unused id, added to :data:`REGISTRY` below; nothing else in the codec names predictors.

>>> sorted(p.name for p in REGISTRY.values())
['blend', 'map', 'zero']
>>> from alignpred.codec.config import CodecConfig
>>> candidate_modes(CodecConfig(), {"map"})
[0, 1, 4, 5]
"""
from __future__ import annotations

from alignpred.codec.predictors.base import BASE_MASK, INTERP, Predictor
from alignpred.codec.predictors.blend import BLEND, Blend
from alignpred.codec.predictors.linmap import MAP, LinearMap
from alignpred.codec.predictors.zero import ZERO, Zero

REGISTRY: dict[int, Predictor] = {p.id: p for p in (Zero(), LinearMap(), Blend())}
MODE_NAMES = {i: p.name for i, p in REGISTRY.items()}


def candidate_modes(config, available: set[str]) -> list[int]:
    """Modes the encoder may choose for a block whose plan offers the predictors ``available``
    (names), under ``config``; the decoder accepts exactly these."""
    bases = [i for i, p in sorted(REGISTRY.items()) if p.enabled(config) and (i == ZERO or p.name in available)]
    return bases + ([b | INTERP for b in bases] if config.intra else [])


__all__ = ["REGISTRY", "MODE_NAMES", "Predictor", "candidate_modes", "ZERO", "MAP", "BLEND", "INTERP", "BASE_MASK"]
