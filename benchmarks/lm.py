"""The language-model side of the quality benchmarks (:mod:`.quality`, :mod:`.rate_quality`,
:mod:`.sensitivity`, :mod:`.verify`): Gemma 3 270M loaded once, a prefill into a fresh model cache,
its K/V as numpy, teacher-forced logits, greedy decoding, and the K/V error of a reconstruction.
The transformers cache plumbing itself is :mod:`kvz.integrations.hf.bridge` (the one adapter)."""
from __future__ import annotations

import math
import os

import numpy as np

_MODEL: list = []


def model():
    """``(model, tokenizer)`` of Gemma 3 270M on the CPU, loaded once per process (torch threads:
    ``KVZ_THREADS`` if set, else at most 2)."""
    if not _MODEL:
        import torch

        from kvz.integrations.hf.gemma import load_gemma

        torch.set_num_threads(min(2, os.cpu_count() or 1) if "KVZ_THREADS" not in os.environ
                              else int(os.environ["KVZ_THREADS"]))
        _MODEL.append(load_gemma("cpu"))
    return _MODEL[0]


def bf16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def to_bf16(y) -> np.ndarray:
    """Cast a reconstruction to bfloat16 the way a real store would (float32 detour)."""
    y = np.asarray(y)
    return y if y.dtype == bf16() else y.astype(np.float32).astype(bf16())


def extract(cache, n_layers) -> dict:
    """float32 numpy K/V ``{layers.i.key: [kv_heads, T, head_dim]}`` of a (non-overflowed) DynamicCache."""
    out = {}
    for i in range(n_layers):
        layer = cache.layers[i]
        out[f"layers.{i}.key"] = layer.keys[0].detach().to("cpu").float().numpy().copy()
        out[f"layers.{i}.value"] = layer.values[0].detach().to("cpu").float().numpy().copy()
    return out


def prefill(m, ids):
    """A fresh model cache after running the base model over ``ids``."""
    import torch

    from kvz.integrations.hf.bridge import cache_kwarg, new_cache

    cache = new_cache(m)
    base = getattr(m, "model", m)
    base(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True, **{cache_kwarg(base): cache})
    return cache


def forward_logits(m, cache, ids):
    """Logits ``[len(ids), vocab]`` of feeding ``ids`` after ``cache`` (which it extends)."""
    import torch

    from kvz.integrations.hf.bridge import cache_kwarg

    out = m(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True, **{cache_kwarg(m): cache})
    return out.logits[0]


def greedy(m, cache, first, n, stop_at=None):
    """Greedy decode ``n`` tokens after feeding ``first``; with ``stop_at`` (the reference continuation) stop at
    the first token that differs.  Returns the generated tokens."""
    toks, cur = [], first
    for t in range(n):
        logits = forward_logits(m, cache, [cur])[-1]
        cur = int(logits.argmax())
        toks.append(cur)
        if stop_at is not None and cur != stop_at[t]:
            break
    return toks


def log_softmax64(logits):
    """log-softmax in float64 (float32 shows a false KL floor near 1.5e-5)."""
    return logits.double().log_softmax(-1)


def kv_nrmse(ref: dict, rec: dict) -> tuple[float, float]:
    """``(pooled NRMSE, worst tensor NRMSE)`` of ``rec`` against ``ref`` (float64)."""
    te = tn = 0.0
    mx = 0.0
    for k, x in ref.items():
        x64 = np.asarray(x, dtype=np.float64)
        d = np.asarray(rec[k], dtype=np.float64) - x64
        e, n = float(np.vdot(d, d)), float(np.vdot(x64, x64))
        te, tn = te + e, tn + n
        mx = max(mx, math.sqrt(e / n) if n > 0 else 0.0)
    return (math.sqrt(te / tn) if tn > 0 else 0.0), mx
