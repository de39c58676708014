import numpy as np

from alignpred.bank.gpa import fit_gpa, gpa_objective, normalise_rows


def _rot(rng, d):
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    return q * np.sign(np.diag(r))


def test_rotations_orthogonal_and_anchored():
    rng = np.random.default_rng(0)
    samples = [rng.standard_normal((500, 8)) @ rng.standard_normal((8, 8)) for _ in range(3)]
    _, rots = fit_gpa(samples)
    assert np.allclose(rots[0], np.eye(8))
    for a in rots:
        assert np.allclose(a.T @ a, np.eye(8), atol=1e-10)


def test_recovers_planted_rotations():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((800, 6)) * np.arange(1, 7)
    planted = [np.eye(6), _rot(rng, 6), _rot(rng, 6)]
    samples = [base @ a.T + 0.01 * rng.standard_normal(base.shape) for a in planted]
    _, rots = fit_gpa(samples)
    for a, p in zip(rots, planted):
        assert np.allclose(a, p, atol=2e-2)


def test_alignment_lowers_objective():
    rng = np.random.default_rng(2)
    base = rng.standard_normal((300, 5))
    samples = [base, base @ _rot(rng, 5).T]
    means, rots = fit_gpa(samples)
    bars = [normalise_rows(s, m) for s, m in zip(samples, means)]
    assert gpa_objective(bars, rots) < 1e-6 < gpa_objective(bars, [np.eye(5)] * 2)
