"""The drafter's side of draft/verify decoding: the context it drafts on.

* :class:`DraftCache` — the drafter's context K/V: a lossy ``.kvz`` decoded once
  (:meth:`DraftCache.from_kvz`), or a token-dropped subset of the exact context
  (:meth:`DraftCache.token_dropped`);
* which positions a token-dropping drafter keeps: :func:`window_keep` (StreamingLLM-style sinks +
  recent window), :func:`snapkv_keep` (SnapKV-style, per layer, from the model's own attention).

The drafter can be anything: a poor drafter costs acceptance, never correctness.
"""
from __future__ import annotations

import math
import os

import numpy as np

from alignpred import KvzReader
from kvz.integrations.hf import build_cache, cache_kwarg
from kvz.integrations.pager import kv_bytes

__all__ = ["DraftCache", "window_keep", "snapkv_keep"]


class DraftCache:
    """The drafter's context: per layer ``(k, v)`` torch float32 ``[1, H, n_kept, D]`` (every layer
    keeps the same number of positions; keys carry their RoPE, so which positions were kept does
    not matter to the model, and new tokens get their true positions). ``resident_bytes``: what
    the drafter keeps resident for the context (file bytes of a .kvz, or the kept positions at the
    stored precision); ``dense_bytes``: the decoded tensors at the stored precision."""

    def __init__(self, layers_kv, n_context: int, *, kind: str, resident_bytes: int, dense_bytes: int,
                 info: dict | None = None):
        self.layers_kv = layers_kv
        self.n_context = int(n_context)
        self.kind = kind
        self.resident_bytes = int(resident_bytes)
        self.dense_bytes = int(dense_bytes)
        self.info = dict(info or {})

    @property
    def n_kept(self) -> int:
        return int(self.layers_kv[0][0].shape[-2])

    @classmethod
    def from_kvz(cls, source, *, bank=None, tier: str | None = None) -> DraftCache:
        """Decode a .kvz (path / bytes; ``tier="coarse"`` for a two-tier file) to float32."""
        import torch

        r = KvzReader(source, bank=bank)
        lay = r.layout
        out = []
        for _, k, v in r.layers(tier=tier):
            k = k[0] if k.ndim == 4 else k
            v = v[0] if v.ndim == 4 else v
            out.append((torch.from_numpy(np.asarray(k, np.float32))[None],
                        torch.from_numpy(np.asarray(v, np.float32))[None]))
        size = len(memoryview(source).cast("B")) if isinstance(source, (bytes, bytearray, memoryview)) \
            else os.path.getsize(source)
        tiers = tuple(r.tiers)
        if len(tiers) > 1 and tier == "coarse":  # the drafter keeps the coarse tier only
            tb = r.summary().get("tier_payload_bytes", {})
            if tb:
                size -= sum(v for k, v in tb.items() if k != "coarse")
        return cls(out, lay.n_tokens, kind="kvz", resident_bytes=size, dense_bytes=kv_bytes(lay),
                   info={"eps": r.eps, "tier": tier, "tiers": list(tiers), "bpv": 8.0 * size / lay.n_values})

    @classmethod
    def token_dropped(cls, context_kv, keep, *, dtype_bytes: int = 2, kind: str = "drop") -> DraftCache:
        """Keep positions ``keep`` (a 1-D index array for every layer, or a list of per-layer
        arrays of one length) of the context K/V ``[(k, v)]`` (``[H, n0, D]`` torch)."""
        import torch

        n0 = int(context_kv[0][0].shape[-2])
        per_layer = keep if isinstance(keep, (list, tuple)) else [keep] * len(context_kv)
        lens = {len(k) for k in per_layer}
        if len(lens) != 1:
            raise ValueError("every layer must keep the same number of positions")
        out = []
        for (k, v), idx in zip(context_kv, per_layer):
            idx_t = torch.as_tensor(np.sort(np.asarray(idx)), dtype=torch.long)
            k = k if k.dim() == 4 else k[None]
            v = v if v.dim() == 4 else v[None]
            out.append((k.index_select(-2, idx_t).float().contiguous(), v.index_select(-2, idx_t).float().contiguous()))
        H, D = out[0][0].shape[1], out[0][0].shape[-1]
        n_kept = lens.pop()
        dense = 2 * len(out) * H * n0 * D * dtype_bytes
        return cls(out, n0, kind=kind, resident_bytes=2 * len(out) * H * n_kept * D * dtype_bytes,
                   dense_bytes=dense, info={"keep_frac": n_kept / n0})


def window_keep(n0: int, frac: float, sinks: int = 4) -> np.ndarray:
    """StreamingLLM-style: the first ``sinks`` positions and the most recent ones, ``round(frac * n0)`` in all."""
    k = max(sinks + 1, int(round(frac * n0)))
    if k >= n0:
        return np.arange(n0)
    return np.concatenate([np.arange(sinks), np.arange(n0 - (k - sinks), n0)])


def snapkv_keep(model, context_ids, context_kv, frac: float, *, window: int = 16, sinks: int = 4,
                pool: int = 7) -> list:
    """SnapKV-style per-layer selection: score context positions by the attention the last
    ``window`` context tokens pay them (summed over query heads and those queries, max-pooled
    over ``pool`` neighbours), keep the top ones plus the sinks and the observation window,
    ``round(frac * n0)`` per layer. Attention probabilities are recomputed from the model's own
    queries (a forward hook on each attention module with the eager kernel)."""
    import torch

    n0 = len(context_ids)
    k_keep = max(sinks + window + 1, int(round(frac * n0)))
    if k_keep >= n0:
        return [np.arange(n0)] * len(context_kv)
    head = context_kv
    prev = getattr(model.config, "_attn_implementation", None)
    try:
        model.set_attn_implementation("eager")
        cache = build_cache(model, [(k[..., :n0 - window, :], v[..., :n0 - window, :]) for k, v in head])
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(context_ids[n0 - window:])]),
                        position_ids=torch.arange(n0 - window, n0)[None], use_cache=True,
                        output_attentions=True, **{cache_kwarg(model): cache})
        atts = out.attentions
    finally:
        if prev is not None:
            model.set_attn_implementation(prev)
    keep = []
    for a in atts:  # [1, heads, window, kv_len]
        a = a[0].float()
        kv_len = a.shape[-1]
        score = a.sum(dim=(0, 1))[: kv_len - window]  # the prefix positions (sliding layers: last part)
        full = torch.zeros(n0 - window)
        full[n0 - window - score.shape[0]:] = score
        if pool > 1:
            full = torch.nn.functional.max_pool1d(full[None, None], pool, stride=1, padding=pool // 2)[0, 0]
        full[:sinks] = math.inf
        extra = k_keep - window
        top = torch.topk(full, extra).indices.numpy()
        keep.append(np.sort(np.concatenate([top, np.arange(n0 - window, n0)])))
    return keep
