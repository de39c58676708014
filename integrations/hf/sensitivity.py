"""Measure a bank's downstream-sensitivity record: how much each tensor's K/V error costs in next-token KL.

The library form of ``benchmarks/studies/rate/sensitivity.py`` (codec error model, no checks beyond additivity): on
calibration windows, ``context`` tokens are prefilled and their float32 K/V recorded; the cache is compressed
once at ``eps`` in tensor scope with the bank and restored, and tensor t gets exactly its reconstruction
error ``restored_t - bf16_t`` (added to the float32 K/V, everything else exact). The next ``score_tokens``
tokens are scored teacher-forced against the exact cache: mean next-token KL(exact || perturbed), float64.

``w_t = mean KL_t / mean NRMSE_t²`` (KL per unit of squared NRMSE), so ``KL ≈ sum_t w_t NRMSE_t²``; the
record (``tensor_weights``, ``kl_per_nrmse2 = sum_t w_t``) is what :func:`alignpred.bank.sensitivity`
reads for the weighted scope and ``target_kl``. ``check`` holds the all-tensors-at-once KL against the
prediction (additivity).
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from alignpred import nrmse

__all__ = ["measure_sensitivity", "write_sensitivity", "DEFAULT_CONTEXT", "DEFAULT_SCORE_TOKENS"]

DEFAULT_CONTEXT = 256
DEFAULT_SCORE_TOKENS = 16
METRIC = "mean next-token KL(exact || perturbed), teacher-forced, float64"


def _log_probs(model, kv: dict, feed: Sequence[int], start: int) -> np.ndarray:
    import torch

    from kvz.integrations.hf.bridge import cache_from_kv, forward_logits

    with torch.inference_mode():
        logits = forward_logits(model, cache_from_kv(model, kv), feed, start)
    return torch.log_softmax(logits.double(), dim=-1).cpu().numpy()


def _kl(ref: np.ndarray, other: np.ndarray) -> float:
    return float(np.mean(np.sum(np.exp(ref) * (ref - other), axis=-1)))


def _codec_error(tensors32: dict, meta: dict, bank, eps: float) -> tuple[dict, dict, float]:
    """(error ``restored - bf16`` as float32 per tensor, the bf16 tensors as float32, bpv) of kvz at eps."""
    import torch

    from alignpred import ErrorBudget, KvzReader, compress, load_cache
    from kvz.integrations.hf.capture import write_cache_atomic

    bf = {k: v.to(torch.bfloat16) for k, v in tensors32.items()}
    with tempfile.TemporaryDirectory(prefix="kvz-sens-") as d:
        src = write_cache_atomic(bf, meta, os.path.join(d, "c.safetensors"))
        info = compress(load_cache(src), os.path.join(d, "c.kvz"), budget=ErrorBudget(eps=eps, scope="tensor"),
                        bank=bank, threads=1)
        restored = KvzReader(os.path.join(d, "c.kvz"), bank=bank).read()
        rec = {k: np.array(v, dtype=np.float32) for k, v in restored.items()}
    base = {k: v.float().numpy() for k, v in bf.items()}
    return {k: rec[k] - base[k] for k in base}, base, float(info.bpv)


def measure_sensitivity(model, windows: Sequence[tuple[str, Sequence[int]]], bank, *, model_id: str,
                        eps: float = 0.0267, context: int = DEFAULT_CONTEXT, score_tokens: int = DEFAULT_SCORE_TOKENS,
                        progress: Callable[[int], None] | None = None) -> dict:
    """The sensitivity record of ``bank`` for ``model``. ``windows``: ``(source, token ids)`` with at least
    ``context + score_tokens`` ids each (the first ``context`` are cached, the next ``score_tokens`` scored).
    ``progress(1)`` is called after every scored forward pass (``2 * layers + 2`` per window)."""
    from kvz.integrations.hf.capture import cache_metadata, record_kv
    from kvz.integrations.hf.rope import rope_thetas

    if not windows:
        raise ValueError("sensitivity needs at least one window of calibration tokens")
    t0 = time.perf_counter()
    per_kl: dict[str, list[float]] = {}
    per_n2: dict[str, list[float]] = {}
    checks, docs, bpvs = [], [], []
    for source, ids in windows:
        ids = [int(t) for t in ids]
        if len(ids) < context + score_tokens:
            raise ValueError(f"{source}: {len(ids)} tokens, a window needs {context + score_tokens}")
        ctx, feed = ids[:context], ids[context:context + score_tokens]
        tensors, spec, info = record_kv(model, ctx, dtype="float32")
        meta = cache_metadata(info["layer_types"], rope_thetas(model, spec), ctx, source, model=model_id, rope=spec)
        err, base, bpv = _codec_error(tensors, meta, bank, eps)
        fp32 = {k: v.numpy() for k, v in tensors.items()}
        ref = _log_probs(model, fp32, feed, context)
        if progress:
            progress(1)
        kls = {}
        for name in sorted(fp32, key=lambda n: (int(n.split(".")[1]), n.split(".")[2] != "key")):
            kls[name] = _kl(ref, _log_probs(model, {**fp32, name: fp32[name] + err[name]}, feed, context))
            per_kl.setdefault(name, []).append(kls[name])
            per_n2.setdefault(name, []).append(nrmse(base[name], base[name].astype(np.float64) + err[name]) ** 2)
            if progress:
                progress(1)
        all_kl = _kl(ref, _log_probs(model, {k: v + err[k] for k, v in fp32.items()}, feed, context))
        if progress:
            progress(1)
        checks.append({"source": source, "all_at_once": all_kl, "sum_of_singles": float(sum(kls.values()))})
        docs.append(source)
        bpvs.append(bpv)
        del tensors
    weights = {k: float(np.mean(per_kl[k])) / max(float(np.mean(per_n2[k])), 1e-30) for k in per_kl}
    weights = {k: max(w, 1e-12) for k, w in weights.items()}  # the weighted scope needs w > 0
    pred = [sum(weights[k] * per_n2[k][i] for k in weights) for i in range(len(windows))]
    for c, p in zip(checks, pred):
        c["predicted"] = float(p)
    return {"model": model_id, "bank_id": bank.id, "tensor_weights": weights,
            "kl_per_nrmse2": float(sum(weights.values())),
            "method": f"kvz's own error: cache compressed at eps={eps} (tensor scope, this bank, default codec "
                      "config), one tensor's reconstruction error at a time added to the float32 K/V",
            "metric": METRIC, "eps": eps, "context": context, "score_tokens": score_tokens,
            "n_prompts": len(windows), "docs": docs, "codec_bpv": bpvs, "check": checks,
            "seconds": round(time.perf_counter() - t0, 2)}


def write_sensitivity(record: dict, path: str | os.PathLike) -> Path:
    """Write a sensitivity record as JSON, atomically."""
    from alignpred import atomic_write

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, [json.dumps(record, indent=1, sort_keys=True).encode("utf-8") + b"\n"])
    return out
