import numpy as np

from alignpred import CodecConfig, fit_bank
from alignpred.chain import Chain
from alignpred.layout import Block
from alignpred.predictors import MAP
from conftest import synthetic_cache


def test_aligned_map_predicts_the_same_residual_energy():
    """The map moved into the aligned frame must predict exactly what it predicts natively."""
    c = synthetic_cache(n_layers=3, T=200, roped=True)
    bank = fit_bank([c], rank=None)
    energies = []
    for align in (False, True):
        ch = Chain(c.layout, bank, CodecConfig(align=align))
        rec = {}
        for layer in range(3):
            for kind in ("K", "V"):
                t = c.tensors[f"layers.{layer}.{'key' if kind == 'K' else 'value'}"]
                rec[f"{kind}.{layer}.0"] = ch.frame.to_frame(t[0], Block(layer, kind, 0), 0)
        e = []
        for b in ("K.1.0", "V.1.0", "K.2.0", "V.2.0"):
            r = rec[b] - ch.plans[b].base(MAP, rec)
            e.append(float(np.sum(r.astype(np.float64) ** 2)))
        energies.append(e)
    np.testing.assert_allclose(energies[0], energies[1], rtol=1e-3)
    signal = sum(float(np.sum(rec[b].astype(np.float64) ** 2)) for b in ("K.1.0", "V.1.0", "K.2.0", "V.2.0"))
    assert sum(energies[0]) < 0.5 * signal  # the map predicts something on correlated data
