"""An LMCache ``GPUConnectorInterface`` over CPU buffers, so ``LMCacheEngine.store``/``retrieve`` run
without a GPU (LMCache 0.5.6 has no CPU connector for serving; this is what the tests and
``kvz.benchmarks.engines`` use).

The "KV cache" it moves is a list of per-layer tensors ``[2, n_slots, H, D]`` passed as
``kvcaches=``; tokens ``start:end`` of a request live at ``slot_mapping[start:end]`` (default:
slot = token index). ``from_gpu`` fills a ``KV_2LTD`` memory object ``[2, L, T, H*D]`` from them,
``to_gpu`` writes one back.
"""
from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

__all__ = ["CPUBufferConnector"]


class CPUBufferConnector(GPUConnectorInterface):
    def __init__(self, num_layers: int, num_heads: int, head_dim: int, chunk_size: int = 256):
        self.num_layers, self.num_heads, self.head_dim = num_layers, num_heads, head_dim
        self.chunk_size = chunk_size
        self.kvcaches: Any = None  # the per-layer tensors, when not passed as kvcaches=

    def _slots(self, start: int, end: int, kwargs):
        sm = kwargs.get("slot_mapping")
        if sm is None:
            return torch.arange(start, end)
        return sm[start:end].long()

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs):
        kv = kwargs.get("kvcaches", self.kvcaches)
        t = memory_obj.tensor
        slots = self._slots(start, end, kwargs)
        for i in range(self.num_layers):
            t[:, i, : end - start].copy_(kv[i][:, slots].reshape(2, end - start, -1).to(t.dtype))

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs):
        kv = kwargs.get("kvcaches", self.kvcaches)
        t = memory_obj.tensor
        slots = self._slots(start, end, kwargs)
        for i in range(self.num_layers):
            kv[i][:, slots] = t[:, i, : end - start].reshape(2, end - start, self.num_heads, self.head_dim).to(
                kv[i].dtype)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for o, s, e in zip(memory_objs, starts, ends):
            self.from_gpu(o, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        for o, s, e in zip(memory_objs or [], starts or [], ends or []):
            self.to_gpu(o, s, e, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.num_heads * self.head_dim])
