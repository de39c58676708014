"""The verifier's side of draft/verify decoding: the full context K/V, paged in on every verify.

:class:`PagedFullKV` pages the context through a :class:`~kvz.integrations.pager.KvPager` into
float32 staging buffers (as a serving runtime pages it into HBM), all layers before the forward
(:meth:`PagedFullKV.page_in`) or layer by layer as the forward reaches them
(:meth:`PagedFullKV.lazy_cache`).
"""
from __future__ import annotations

import contextlib
import time

from kvz.integrations.hf import decoder_of, new_cache
from kvz.integrations.pager import KvPager, kv_bytes

__all__ = ["PagedFullKV"]


class PagedFullKV:
    """The verifier's context K/V: paged in through ``pager`` (source registered under ``key``)
    into float32 staging buffers on every verify, as a serving runtime would page it into HBM."""

    def __init__(self, pager: KvPager, key, *, prefetch: bool = True, overlap: bool = False):
        import torch

        self.pager, self.key = pager, key
        self.overlap = bool(overlap)
        src = pager.source(key)
        lay = src.layout
        self.layout = lay
        self.n_context = lay.n_tokens
        shape = (1, lay.kv_heads, lay.n_tokens, lay.head_dim)
        self.staging = [(torch.empty(shape), torch.empty(shape)) for _ in range(lay.num_layers)]
        self.bytes_per_load = kv_bytes(lay)  # at the stored precision
        self.loads = 0
        self.seconds = 0.0
        self.prefetch = prefetch

    def page_in(self):
        t0 = time.perf_counter()
        for _ in self.pager.layers(self.key, (0, self.n_context), out=lambda i: self.staging[i]):
            pass
        self.loads += 1
        self.seconds += time.perf_counter() - t0
        return self.staging

    @contextlib.contextmanager
    def lazy_cache(self, model, tail_kv):
        """A verifier cache whose layers are filled from the pager as the forward pass reaches them
        (a forward pre-hook on every decoder layer), so paging overlaps the forward of the layers
        below. The layers the attention masks are sized from (the first of each kind) are filled
        before the forward starts. ``tail_kv``: per layer the exact tail ``(k, v)`` or None."""
        import torch

        cache = new_cache(model)
        dtype = next(model.parameters()).dtype
        gen = self.pager.layers(self.key, (0, self.n_context), out=lambda i: self.staging[i])
        staged, filled = set(), set()
        t_start = time.perf_counter()
        wait = 0.0

        def fill(L):
            nonlocal wait
            if L in filled:
                return
            t0 = time.perf_counter()
            while L not in staged:
                staged.add(next(gen)[0])
            wait += time.perf_counter() - t0
            k, v = self.staging[L]
            if tail_kv[L] is not None:
                k, v = torch.cat([k, tail_kv[L][0]], dim=-2), torch.cat([v, tail_kv[L][1]], dim=-2)
            cache.update(k.to(dtype), v.to(dtype), L)
            filled.add(L)

        kinds = list(getattr(cache, "is_sliding", []) or [])
        first = {0} | {kinds.index(b) for b in (True, False) if b in kinds}
        for L in sorted(first):
            fill(L)
        hooks = [layer.register_forward_pre_hook(lambda mod, args, L=i: fill(L))
                 for i, layer in enumerate(decoder_of(model).layers)]
        try:
            yield cache
        finally:
            for h in hooks:
                h.remove()
            gen.close()
            self.loads += 1
            self.seconds += time.perf_counter() - t_start
            self.last_wait = wait

    def prefetch_next(self):
        """Ask the pager to bring the context's pages in ahead of the next verify."""
        if self.prefetch:
            return self.pager.prefetch(self.key, (0, self.n_context))
        return None
