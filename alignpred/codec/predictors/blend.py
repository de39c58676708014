"""``BLEND``: the AlignPred paper's aligned inter-block predictor, ``λ_v · mean`` of the earlier
reconstructed blocks of the GPA group (``λ_2 = 0.5``, ``λ_{v≥3} = 0.75``; config ``lambdas``)."""
from __future__ import annotations

from alignpred.codec.predictors.base import Predictor

BLEND = 2


class Blend(Predictor):
    id = BLEND
    name = "blend"

    def enabled(self, config) -> bool:
        return config.blend

    def attach(self, plans, bank, config):
        for b, p in plans.items():
            g = bank.group_of(b)
            k = g.index(b)
            if k > 0:
                p.data[self.name] = (tuple(g[:k]), float(config.lambdas[0] if k == 1 else config.lambdas[1]))
                p.sources.update(g[:k])

    def base(self, plan, recon, out=None):
        refs, lam = plan.data[self.name]
        return (lam / len(refs)) * sum(recon[s] for s in refs)
