"""RoPE metadata is checked against the keys, not trusted (issue 16): on a real Gemma 3 cache a
wrong base is a warning or an error that names the likely base and the fix."""
from __future__ import annotations

import os
import warnings

import pytest

from alignpred import Cache, KvzWarning, LayoutError, compress_bytes, load_cache
from alignpred.cache import check_rope_theta
from alignpred.codec import Profile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLE = os.path.join(ROOT, "samples", "gemma3-270m", "python-code.safetensors")


@pytest.fixture(scope="module")
def real():
    return load_cache(SAMPLE)


def _with_theta(c, theta):
    kv = [(c.tensors[f"layers.{i}.key"], c.tensors[f"layers.{i}.value"]) for i in range(c.layout.num_layers)]
    return Cache.from_arrays(kv, keys_roped=True, rope_theta=[theta] * c.layout.num_layers,
                             layer_types=list(c.layout.layer_types))


def test_the_models_own_rope_passes(real):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_rope_theta(real.layout, real.tensors)


def test_global_base_on_sliding_layers_warns_with_the_right_base(real):
    c = _with_theta(real, 1e6)
    with pytest.warns(KvzWarning, match=r"sliding_attention layers 0, 1, 2, 3, 4, 6.*base near 10000.*rope_theta="):
        check_rope_theta(c.layout, c.tensors)


@pytest.mark.parametrize("theta, named", [(1e4, "full_attention layers .*17.* near 1e\\+06"), (1234.0, "near 10000")])
def test_a_base_worse_than_none_is_an_error_unless_trusted(real, theta, named):
    c = _with_theta(real, theta)
    with pytest.raises(LayoutError, match=f"worse than undoing none.*{named}.*trust_rope=True"):
        check_rope_theta(c.layout, c.tensors)
    with pytest.raises(LayoutError, match="worse than undoing none"):
        compress_bytes(c, budget=0.05, bank="gemma-3-270m")
    assert len(compress_bytes(c, budget=0.05, bank="gemma-3-270m", profile=Profile(trust_rope=True))) > 0
