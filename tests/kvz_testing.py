"""Helpers the test modules import (``from kvz_testing import synthetic_cache``): the repository root,
the bundled samples and bank, and a small synthetic cache. They live here, not in ``conftest.py``:
``from kvz_testing import`` resolves to whichever ``conftest`` was imported first, and
``tests/integrations`` has its own, so a run that collects both folders failed at collection."""
import glob
import os

import numpy as np

from alignpred.cache.cachefile import Cache
from alignpred.cache.layout import infer_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "samples", "gemma3-270m")
BANK = os.path.join(ROOT, "alignpred", "bank", "data", "gemma-3-270m.h5")


def sample_paths():
    return sorted(glob.glob(os.path.join(SAMPLES, "*.safetensors")))


def synthetic_cache(n_layers=3, heads=1, T=300, d=32, dtype=np.float16, seed=0, roped=False):
    """Correlated synthetic cache (unit tests only): layers share a latent signal."""
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((heads, T, d)).cumsum(axis=1) * 0.1 + rng.standard_normal((heads, T, d))
    t = {}
    for i in range(n_layers):
        mk = rng.standard_normal((d, d)) / np.sqrt(d)
        mv = rng.standard_normal((d, d)) / np.sqrt(d)
        key = latent @ mk + 0.3 * rng.standard_normal((heads, T, d)) + 0.5
        if roped:  # keys said to carry RoPE do carry it (kvz checks the metadata against them)
            from alignpred.cache import RopeTable

            key = RopeTable.from_theta(1e4, d).apply(key.astype(np.float32), 0)
        t[f"layers.{i}.key"] = key.astype(dtype)
        t[f"layers.{i}.value"] = (latent @ mv + 0.3 * rng.standard_normal((heads, T, d))).astype(dtype)
    meta = {}
    if roped:
        import json
        meta = {"keys_roped": "true", "rope_theta": json.dumps([1e4] * n_layers), "rope_pairing": "half",
                "layer_types": json.dumps(["sliding_attention"] * n_layers)}
    return Cache(t, meta, infer_layout(t, meta))
