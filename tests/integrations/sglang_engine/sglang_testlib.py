"""Fixtures of the SGLang HiCache adapter tests. They run against the real SGLang package
(``.ci/sglang.sh`` builds its venv); where SGLang is not importable every test module here skips itself
(``require_sglang``). Not named conftest.py: several runtimes' test folders would clash on that name."""
import importlib.util
import os
import sys

import numpy as np
import pytest

from alignpred import nrmse  # noqa: F401  (the tests import it from here)
from kvz.integrations.sglang import cpu_host_pool as host_pool  # noqa: F401
from kvz.integrations.sglang import hicache_extra, install_torchvision_stub, storage_config  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torch") is not None
if HAVE_SGLANG:
    install_torchvision_stub()  # PyPI's torchvision needs CUDA; SGLang imports it on the pools' path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SAMPLE = os.path.join(ROOT, "samples", "gemma3-270m", "english-prose.safetensors")
EPS = 0.0267
L, H, D = 18, 1, 256
PAGE = 64

sys.path.insert(0, os.path.dirname(HERE))
import engine_gate  # noqa: E402

# What the adapter and its tests import from SGLang (after the torchvision shim above).
SGLANG_MODULES = ("torch", "sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.storage.backend_factory",
                  "sglang.srt.mem_cache.pool_host.base", "sglang.srt.mem_cache.pool_host.mha",
                  "sglang.srt.mem_cache.device_pool_info")


def require_sglang() -> None:
    """Skip the calling test module unless SGLang imports completely (fail under ``.ci/sglang.sh``)."""
    engine_gate.require("sglang", SGLANG_MODULES)


@pytest.fixture(scope="session")
def sample():
    """(token ids, K [L, T, H, D], V [L, T, H, D]) torch bf16 of a real Gemma 3 270M cache."""
    import json

    import torch

    from alignpred import load_cache

    c = load_cache(SAMPLE)
    ids = json.loads(c.metadata["token_ids"])
    k = np.stack([np.asarray(c.tensors[f"layers.{i}.key"]).view(np.uint16).transpose(1, 0, 2) for i in range(L)])
    v = np.stack([np.asarray(c.tensors[f"layers.{i}.value"]).view(np.uint16).transpose(1, 0, 2) for i in range(L)])
    return ids, torch.from_numpy(k.copy()).view(torch.bfloat16), torch.from_numpy(v.copy()).view(torch.bfloat16)


def kvz_extra(url, **kw):
    return hicache_extra(url, SAMPLE, eps=EPS, **kw)

