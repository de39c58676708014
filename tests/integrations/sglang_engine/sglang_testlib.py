"""Fixtures of the SGLang HiCache adapter tests. They run against the real SGLang package
(``.ci/sglang.sh`` builds its venv); where SGLang is not importable every test module here skips itself
(``require_sglang``). Not named conftest.py: several runtimes' test folders would clash on that name."""
import importlib.util
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torch") is not None
if HAVE_SGLANG:
    sys.path.insert(0, HERE)
    import _torchvision_shim  # noqa: E402

    _torchvision_shim.install()

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


def host_pool(layout, page=PAGE, ratio=4.0, dev_tokens=512):
    """SGLang's real MHATokenToKVPoolHost on the CPU (device buffers are CPU tensors too)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(dev_tokens, H, D, dtype=torch.bfloat16) for _ in range(L))
    v = tuple(torch.zeros(dev_tokens, H, D, dtype=torch.bfloat16) for _ in range(L))

    def ptrs(ts):
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD),
                         page_size=page, head_num=H, head_dim=D, v_head_dim=D, dtype=torch.bfloat16,
                         device=torch.device("cpu"))
    # SGLang sizes host pools against the machine's free memory; book this small pool explicitly
    with host_memory_budget_scope(1 << 30):
        return MHATokenToKVPoolHost(info, host_to_device_ratio=ratio, host_size=0, page_size=page, layout=layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev_tokens,
                                    start_layer=0, end_layer=L)


def storage_config(extra, model="gemma-3-270m"):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model, extra_config=extra)


def kvz_extra(url, **kw):
    d = {"backend_name": "kvz", "module_path": "kvz.integrations.sglang", "class_name": "KvzHiCacheStorage",
         "kvz_url": url, "kvz_eps": EPS, "kvz_bank": "gemma-3-270m", "kvz_metadata_from": SAMPLE, "interface_v1": 1}
    d.update(kw)
    return d


def nrmse(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(a * a)))


@pytest.fixture
def redis_server():
    from kvz.integrations.kvstore.server import redis_server_fixture

    yield from redis_server_fixture()
