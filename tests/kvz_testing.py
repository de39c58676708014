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


def attention_setup(tmp, *, n_layers, T, d, window, seeds, key_sigma, top_weight):
    """``(cache, bank_path, stats, weights)``: a roped synthetic cache of sliding-window layers, a
    bank fitted on another one (``seeds``: the cache's, the bank cache's, the statistics'), saved in
    ``tmp`` with an attention-statistics sidecar (pair-constant lognormal key channels of spread
    ``key_sigma``, as queries' phase-averaged moments are; lognormal value channels; ``window``), and
    uneven tensor weights from 1 to ``top_weight``."""
    from dataclasses import replace

    from alignpred import fit_bank
    from alignpred.bank import AttentionStats

    c = synthetic_cache(n_layers=n_layers, T=T, d=d, roped=True, seed=seeds[0])
    bank = fit_bank([synthetic_cache(n_layers=n_layers, T=T, d=d, roped=True, seed=seeds[1])], rank=8)
    bank_path = tmp / "b.h5"
    bank.save(bank_path)
    rng = np.random.default_rng(seeds[2])
    s = AttentionStats.empty("synthetic", bank.id, ["sliding_attention"] * n_layers, kv_heads=1, head_dim=d)
    half = rng.lognormal(0.0, key_sigma, (n_layers, 1, d // 2))
    s = replace(s, key_channel=np.concatenate([half, half], axis=-1),
                value_gram_diag=rng.lognormal(0.0, 0.5, (n_layers, 1, d)), sliding_window=window)
    s.save(AttentionStats.path_for(bank_path))
    weights = {n: w for n, w in zip(c.layout.tensor_names(), np.linspace(1.0, top_weight, 2 * n_layers))}
    return c, bank_path, s, weights
