import numpy as np
from kvz_testing import synthetic_cache

from alignpred import CodecConfig, fit_bank
from alignpred.cache.layout import Block
from alignpred.codec.chain import Chain
from alignpred.codec.predictors import MAP


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


def test_fit_bank_with_chosen_map_sources():
    """``sources=`` replaces the default map sources: the bank's maps take exactly those inputs,
    a file written with it decodes, and a source decoded after its block is refused."""
    import pytest

    from alignpred import KvzReader, compress_bytes
    from alignpred.errors import LayoutError

    c = synthetic_cache(n_layers=3, heads=1, T=200, d=32)
    src = {"K.1.0": ["K.0.0"], "V.1.0": ["K.1.0"], "K.2.0": ["K.1.0"], "V.2.0": ["V.1.0", "K.2.0"]}
    bank = fit_bank([c], rank=None, sources=src)
    assert bank.config["sources"] == src
    for b, s in src.items():
        W, _ = bank.map_factors(b)
        assert W.shape == (32 * len(s), 32) and bank.sources(b) == s
    assert bank.map_factors("V.0.0") is None
    blob = compress_bytes(c, budget=0.03, bank=bank)
    out = KvzReader(blob, bank=bank).read()
    assert set(out) == set(c.tensors)
    with pytest.raises(LayoutError, match="decoded before"):
        fit_bank([c], sources={"K.1.0": ["V.1.0"]})
