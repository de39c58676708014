"""Round trips on the bundled real Gemma 3 270M caches with the bundled bank (fitted on other documents)."""
import numpy as np
import pytest
from kvz_testing import sample_paths

from alignpred import ErrorBudget, KvzReader, compress, load_cache

EPS = 0.0267


def _nrmse(x, y):
    x = np.asarray(x, np.float64)
    return np.linalg.norm(np.asarray(y, np.float64) - x) / np.linalg.norm(x)


@pytest.fixture(scope="module")
def prose():
    paths = [p for p in sample_paths() if p.endswith("english-prose.safetensors")]
    if not paths:
        pytest.skip("bundled samples missing")
    return load_cache(paths[0])


def test_samples_are_real_gemma_caches():
    paths = sample_paths()
    assert len(paths) >= 3
    for p in paths:
        c = load_cache(p)
        lay = c.layout
        assert (lay.num_layers, lay.kv_heads, lay.head_dim, lay.dtype) == (18, 1, 256, "bfloat16")
        assert lay.keys_roped and lay.rope_theta[5] == 1e6 and lay.rope_theta[0] == 1e4
        assert len(c.metadata["token_ids"]) > 10


@pytest.mark.parametrize("scope", ["object", "tensor", "pooled"])
def test_real_sample_meets_eps(tmp_path, prose, real_bank, scope):
    info = compress(prose, tmp_path / "s.kvz", budget=ErrorBudget(eps=EPS, scope=scope), bank=real_bank)
    out = KvzReader(tmp_path / "s.kvz").read()  # the bundled bank is found by its id
    S = 256
    num = den = 0.0
    for name, x in prose.tensors.items():
        y = out[name]
        assert y.dtype == x.dtype and y.shape == x.shape
        num += float(np.sum((y.astype(np.float64) - x.astype(np.float64)) ** 2))
        den += float(np.sum(x.astype(np.float64) ** 2))
        if scope == "tensor":
            assert _nrmse(x, y) <= EPS
        if scope == "object":
            for a in range(0, x.shape[1], S):
                assert _nrmse(x[:, a:a + S], y[:, a:a + S]) <= EPS
    assert np.sqrt(num / den) <= EPS
    # the bank does its job: well below FP8's 8 bits per value at FP8's error
    assert info.bpv < {"object": 4.6, "tensor": 4.3, "pooled": 3.7}[scope]


def test_random_access_matches_full_decode(tmp_path, prose, real_bank):
    compress(prose, tmp_path / "s.kvz", budget=0.05, bank=real_bank)
    r = KvzReader(tmp_path / "s.kvz", bank=real_bank)
    full = r.read()
    part = r.read(tokens=(260, 448), layers=3)
    assert len(part) == 6
    for name, arr in part.items():
        np.testing.assert_array_equal(arr, full[name][:, 260:448])
