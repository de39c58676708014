"""``ZERO``: predict the bank mean (zero in the coding frame, where the mean is removed)."""
from __future__ import annotations

from alignpred.codec.predictors.base import Predictor

ZERO = 0


class Zero(Predictor):
    id = ZERO
    name = "zero"

    def base(self, plan, recon, out=None):
        return None  # no prediction: the residual is the coding-frame value itself
