"""Fixtures of the LMCache adapter tests. They run against the real LMCache package (``.ci/lmcache.sh``
builds its venv); where LMCache is not importable (the main test venv) every test module here skips itself
(``require_lmcache``). Not named conftest.py: several runtimes' test folders would clash on that name."""
import importlib.util
import os
import sys
import warnings

import numpy as np
import pytest

from alignpred import nrmse

HAVE_LMCACHE = importlib.util.find_spec("lmcache") is not None and importlib.util.find_spec("torch") is not None

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import engine_gate  # noqa: E402

# What the adapter and its tests import from LMCache: an LMCache installed without its dependencies
# (aiofile, msgspec, ...) fails on these, and the tests skip instead of failing (engine_gate).
LMCACHE_MODULES = ("torch", "lmcache.utils", "lmcache.v1.cache_engine", "lmcache.v1.storage_backend.storage_manager",
                   "lmcache.v1.distributed.storage_manager", "lmcache.v1.distributed.serde.async_processor",
                   "lmcache.v1.distributed.l2_adapters.mock_l2_adapter",
                   "lmcache.v1.distributed.l2_adapters.fs_l2_adapter")


def require_lmcache() -> None:
    """Skip the calling test module unless LMCache imports completely (fail under ``.ci/lmcache.sh``)."""
    engine_gate.require("lmcache", LMCACHE_MODULES)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SAMPLES = os.path.join(ROOT, "samples", "gemma3-270m")
SAMPLE = os.path.join(SAMPLES, "english-prose.safetensors")
EPS = 0.0267
L, H, D = 18, 1, 256



@pytest.fixture(scope="session")
def sample():
    """(token ids, per-layer torch KV [2, T, H, D] bf16) of a real Gemma 3 270M cache."""
    return load_sample()


def load_sample():
    """What the ``sample`` fixture gives (also for the test's own worker processes)."""
    import json

    import torch

    from alignpred import load_cache

    c = load_cache(SAMPLE)
    ids = json.loads(c.metadata["token_ids"])
    kv = []
    for i in range(L):
        k = np.asarray(c.tensors[f"layers.{i}.key"]).view(np.uint16)  # [H, T, D]
        v = np.asarray(c.tensors[f"layers.{i}.value"]).view(np.uint16)
        t = torch.from_numpy(np.stack([k, v]).transpose(0, 2, 1, 3).copy()).view(torch.bfloat16)  # [2, T, H, D]
        kv.append(t)
    return ids, kv


def kvz_extra(prefix, **kw):
    d = {f"{prefix}.metadata_from": SAMPLE, f"{prefix}.eps": EPS, f"{prefix}.bank": "gemma-3-270m"}
    d.update({f"{prefix}.{k}": v for k, v in kw.items()})
    return d


def lm_metadata(chunk_size=256, model_name="gemma-3-270m"):
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name=model_name, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(L, 2, chunk_size, H, D))


def lm_config(chunk_size=256, **kw):
    from lmcache.v1.config import LMCacheEngineConfig

    extra = kw.pop("extra_config", None)
    plugins = kw.pop("storage_plugins", None)
    remote = kw.pop("remote_storage_plugins", None)
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=chunk_size, local_cpu=True, max_local_cpu_size=0.5,
                                            lmcache_instance_id=kw.pop("instance_id", "kvz-test"), **kw)
    if extra:
        cfg.extra_config = extra
    if plugins:
        cfg.storage_plugins = plugins
    if remote:
        cfg.remote_storage_plugins = remote
    return cfg


def chunk_errors(ref_kv, got_kv, start, end):
    """Worst per-tensor NRMSE over layers and K/V of tokens start:end (per-layer [2, T, H, D])."""
    worst = 0.0
    for r, g in zip(ref_kv, got_kv):
        for j in range(2):
            worst = max(worst, nrmse(r[j, start:end].float().numpy(), g[j, start:end].float().numpy()))
    return worst


@pytest.fixture
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield

