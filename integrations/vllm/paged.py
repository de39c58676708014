"""vLLM's paged KV cache on the CPU attention backend, as the kvz connector reads and writes it.

Each layer's cache is one tensor ``[blocks, kv_heads, block_size, 2 * head_dim]``. Writes go
through vLLM's own ``cpu_attn_reshape_and_cache`` (the op the attention layer uses), so the
element order inside a block is whatever the attention kernels want; reads invert that order,
found once by writing a known pattern with the same op (:meth:`PagedLayout.perm`).
"""
from __future__ import annotations

import os

import torch

__all__ = ["PagedLayout", "save_kv"]


class PagedLayout:
    """The paged KV caches of one worker: ``kv`` is ``[(layer name, cache tensor)]`` in layer order,
    ``shape`` ``(layers, kv_heads, head_dim)``, ``cache_dtype`` vLLM's ``cache_config.cache_dtype``."""

    def __init__(self, kv: list, block_size: int, shape: tuple, cache_dtype: str):
        L, H, d = shape
        if len(kv) != L:
            raise ValueError(f"kvz connector: {len(kv)} KV caches for a {L}-layer model")
        for name, t in kv:
            if t.dim() != 4 or t.shape[1] != H or t.shape[2] != block_size or t.shape[3] != 2 * d:
                raise ValueError(f"kvz connector: KV cache {name} has shape {tuple(t.shape)}; expected "
                                 f"[blocks, {H}, {block_size}, {2 * d}] (the CPU attention backend)")
        self.kv = kv
        self.block_size = int(block_size)
        self.heads, self.head_dim = H, d
        self.dtype = kv[0][1].dtype
        self.cache_dtype = cache_dtype
        self._isa: str | None = None
        self._perm: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.kv)

    def _get_isa(self) -> str:
        if self._isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            self._isa = _get_attn_isa(self.dtype, self.block_size, self.head_dim, self.cache_dtype)
        return self._isa

    @staticmethod
    def _split(cache: torch.Tensor):
        nb, h, bs, _ = cache.shape
        return cache.view(nb, h, bs * 2, -1).chunk(2, dim=2)

    def write_to(self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[n, kv_heads, head_dim]``) into ``cache`` at ``slots`` with vLLM's op."""
        from vllm import _custom_ops as ops

        kc, vc = self._split(cache)
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, self._get_isa())

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[n, kv_heads, head_dim]``) into layer ``layer`` at ``slots``."""
        self.write_to(self.kv[layer][1], k, v, slots)

    def perm(self) -> torch.Tensor:
        """For each element of a (block, head) slab, its flat index in ``[K | V] x [bs, head_dim]``
        order: probed by writing a known pattern with the same op the attention layer uses."""
        if self._perm is None:
            H, d, bs, dt = self.heads, self.head_dim, self.block_size, self.dtype
            n = 2 * bs * d
            idx = torch.arange(n, dtype=torch.int64).view(2, bs, d)
            found = []
            for part in (idx % 256, idx // 256):  # small integers: exact in bf16/fp16
                scratch = torch.zeros((1, H, bs, 2 * d), dtype=dt)
                k = part[0][:, None, :].expand(bs, H, d).to(dt).contiguous()
                v = part[1][:, None, :].expand(bs, H, d).to(dt).contiguous()
                self.write_to(scratch, k, v, torch.arange(bs, dtype=torch.int64))
                found.append(scratch[0, 0].reshape(-1).to(torch.int64))
            perm = found[0] + 256 * found[1]
            if not torch.equal(torch.sort(perm).values, torch.arange(n)):
                raise RuntimeError("kvz connector: the KV cache layout is not a permutation of K and V")
            self._perm = perm
        return self._perm

    def read_blocks(self, block_ids) -> list:
        """``[(K, V)]`` per layer, ``[kv_heads, n*bs, head_dim]`` (copies), of ``block_ids``."""
        H, d, bs = self.heads, self.head_dim, self.block_size
        perm = self.perm()
        b = torch.as_tensor(block_ids, dtype=torch.int64)
        out = []
        for _, cache in self.kv:
            slabs = cache.index_select(0, b).reshape(len(block_ids), H, -1)
            lin = torch.empty_like(slabs)
            lin[:, :, perm] = slabs
            lin = lin.view(len(block_ids), H, 2, bs, d).permute(2, 1, 0, 3, 4).reshape(2, H, len(block_ids) * bs, d)
            out.append((lin[0].contiguous(), lin[1].contiguous()))
        return out


def save_kv(path: str, kv: list, metadata: dict) -> None:
    """Write ``[(K, V)]`` per layer as ``layers.{i}.key`` / ``layers.{i}.value`` (float32) to a
    safetensors file (the connector's ``debug_dir`` dumps, for tests)."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tensors = {}
    for i, (k, v) in enumerate(kv):
        tensors[f"layers.{i}.key"] = k.float().contiguous()
        tensors[f"layers.{i}.value"] = v.float().contiguous()
    save_file(tensors, path, metadata=metadata)


def debug_dump(debug_dir: str, what: str, req_id, kv, first_block: int, block_size: int, warn=print) -> None:
    """The connector's ``debug_dir`` dump of one request's KV (``{what}-{req_id}.safetensors``;
    ``kv``: ``[(K, V)]`` or a function giving it); a failure is a warning, never an engine error."""
    import re

    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(req_id))
    try:
        kv = kv() if callable(kv) else kv
        save_kv(os.path.join(debug_dir, f"{what}-{safe}.safetensors"), kv,
                {"first_block": str(first_block), "block_size": str(block_size)})
    except Exception as e:  # noqa: BLE001
        warn(f"kvz: debug dump failed ({e})")
