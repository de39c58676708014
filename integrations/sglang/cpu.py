"""SGLang's KV-cache classes on a machine without CUDA: what ``kvz.benchmarks.engines --engines
sglang`` and the adapter's tests (``tests/integrations/sglang_engine``) build SGLang with.

* :func:`install_torchvision_stub` — a stand-in for ``torchvision`` where only its CUDA build
  exists (PyPI's Linux wheels cannot load on the CPU torch: ``operator torchvision::nms does not
  exist``). SGLang 0.5.23 imports ``torchvision.transforms`` at module level on the import path of
  its memory pools (``srt.configs`` -> a multimodal model's image utilities, and transformers'
  processors); nothing on the KV-cache path calls it. Every ``torchvision.*`` module resolves to a
  placeholder whose attributes raise when used. Call it before importing SGLang.
* :func:`cpu_host_pool` — SGLang's real ``MHATokenToKVPoolHost`` over CPU tensors;
* :func:`storage_config` — a ``HiCacheStorageConfig`` for one rank;
* :func:`hicache_extra` — the extra config that loads kvz's backend as SGLang's ``dynamic`` one.

SGLang is imported only inside the functions.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__all__ = ["install_torchvision_stub", "cpu_host_pool", "storage_config", "hicache_extra"]


class _Unavailable:
    def __init__(self, name):
        self._name = name

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self._name} is unavailable (CPU stand-in for torchvision)")

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Unavailable(f"{self._name}.{item}")

    def __mro_entries__(self, bases):  # usable as a base class at import time
        return (object,)


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__file__ = f"<torchvision stand-in: {spec.name}>"
        m.__path__ = []
        m.__version__ = "0.0.0+cpu-stand-in"  # type: ignore[attr-defined]

        def getattr_(item, _n=spec.name):
            if item.startswith("__"):
                raise AttributeError(item)
            return _Unavailable(f"{_n}.{item}")

        m.__getattr__ = getattr_  # type: ignore[method-assign]
        return m

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, _Loader(), is_package=True)
        return None


def install_torchvision_stub() -> bool:
    """Install the stand-in unless a working torchvision is importable; True if installed."""
    try:
        import torchvision  # noqa: F401

        return False
    except Exception:
        for k in [k for k in sys.modules if k == "torchvision" or k.startswith("torchvision.")]:
            del sys.modules[k]
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True


def cpu_host_pool(layout: str, *, layers: int = 18, heads: int = 1, head_dim: int = 256, page: int = 64,
                  ratio: float = 4.0, dev_tokens: int = 512):
    """SGLang's real ``MHATokenToKVPoolHost`` on the CPU (its device buffers are CPU tensors too),
    bfloat16, in page ``layout``; the defaults are Gemma 3 270M's shape."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))
    v = tuple(torch.zeros(dev_tokens, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers))

    def ptrs(ts):
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim,
                         dtype=torch.bfloat16, device=torch.device("cpu"))
    # SGLang sizes host pools against the machine's free memory; book this small pool explicitly
    with host_memory_budget_scope(1 << 30):
        return MHATokenToKVPoolHost(info, host_to_device_ratio=ratio, host_size=0, page_size=page, layout=layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev_tokens,
                                    start_layer=0, end_layer=layers)


def storage_config(extra: dict, model: str = "gemma-3-270m"):
    """A ``HiCacheStorageConfig`` of rank 0 of 1 (MHA, page-first) with ``extra`` as its extra config."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model, extra_config=extra)


def hicache_extra(url: str, metadata_from: str, *, eps: float | None = None, bank: str = "gemma-3-270m",
                  **kw) -> dict:
    """The HiCache extra config of kvz's backend (``dynamic``, interface v1) storing at ``url``, with
    the model metadata of the cache file ``metadata_from``; ``eps``: the tensor scope at that eps (None:
    the codec's default, FP8's KL in the attention scope); ``kw``: more ``kvz_*`` keys."""
    d = {"backend_name": "kvz", "module_path": "kvz.integrations.sglang", "class_name": "KvzHiCacheStorage",
         "kvz_url": url, "kvz_bank": bank, "kvz_metadata_from": metadata_from, "interface_v1": 1}
    if eps is not None:
        d["kvz_eps"] = eps
    d.update(kw)
    return d
