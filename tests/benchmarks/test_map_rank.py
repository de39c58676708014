"""The map-rank study's pieces: cost formulas and reduced-rank maps (the measurement itself is
``python -m benchmarks.studies.speed.map_rank``)."""
import numpy as np

from benchmarks.studies.speed import map_rank as M


def _stats(rank_true=4, n=400, d=16, d_out=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 2 * d))
    w = rng.standard_normal((2 * d, rank_true)) @ rng.standard_normal((rank_true, d_out))
    y = x @ w + 0.01 * rng.standard_normal((n, d_out))
    w_fit = np.linalg.lstsq(x, y, rcond=None)[0]
    return M.MapStats("V.1", ["K.0", "V.0"], w_fit, x, y, np.full(2 * d, 1e-4)), x, y


def test_costs():
    assert M.dense_macs(3, 256, 256) == 3 * 256 * 256
    assert M.dense_macs(1, 5, 17) == 6 * 32          # d_in to even, d_out to 16
    assert M.factored_macs(2, 256, 256, 64) == 2 * 256 * 64 + 64 * 256


def test_reduced_rank_regression_keeps_what_the_map_predicts():
    st, x, y = _stats()
    full = np.sum((y - x @ st.w) ** 2)
    errs = {r: np.sum((y - x @ st.reduced("rrr", r)) ** 2) for r in (1, 2, 4, 8)}
    assert errs[1] > errs[2] > errs[4] and errs[4] < 1.1 * full and errs[8] < 1.1 * full
    assert np.sum((y - x @ st.reduced("svd", 2)) ** 2) >= errs[2] * (1 - 1e-9)   # rrr is the optimal rank-r fit
    assert st.rank_for_energy(0.999999) == 16 and st.discarded(4) < 1e-3 * st.discarded(0)
    assert not st.reduces(None) and not st.reduces(st.full_rank)
