"""What the kvz connector needs to know of the served model, from vLLM's config (no vLLM import)."""
from __future__ import annotations

import os

from kvz.integrations.fingerprint import weights_fingerprint

__all__ = ["GEMMA3_270M", "model_info"]

GEMMA3_270M = "gemma-3-270m"


def model_info(vllm_config) -> dict:
    """Layer types, per-layer RoPE bases, ``(layers, kv_heads, head_dim)``, KV dtype, the default
    bank and the weights fingerprint (:func:`~kvz.integrations.fingerprint.weights_fingerprint`) of
    the served model, from vLLM's config."""
    mc = vllm_config.model_config
    cfg = mc.hf_text_config
    n = int(cfg.num_hidden_layers)
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    params = getattr(cfg, "rope_parameters", None)
    thetas = []
    for t in types:
        if isinstance(params, dict) and isinstance(params.get(t), dict):
            p = params[t]
        elif isinstance(params, dict) and "rope_theta" in params:
            p = params
        else:
            base = getattr(cfg, "rope_local_base_freq", None) if t == "sliding_attention" else None
            p = {"rope_theta": base or getattr(cfg, "rope_theta", 10000.0), "rope_type": "default"}
        if p.get("rope_type", "default") != "default":
            raise NotImplementedError(f"kvz connector: RoPE type {p.get('rope_type')!r} is not supported yet")
        thetas.append(float(p["rope_theta"]))
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    bank = None
    if getattr(cfg, "model_type", "") in ("gemma3_text", "gemma3") and (n, kv_heads, head_dim) == (18, 1, 256):
        bank = GEMMA3_270M
    name = mc.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0]
    model_id = os.path.basename(str(name).rstrip("/")) or str(name)
    dtype = str(mc.dtype).replace("torch.", "")
    return {"layer_types": types, "rope_theta": thetas, "shape": (n, kv_heads, head_dim), "dtype": dtype,
            "bank": bank, "model_id": model_id, "weights": weights_fingerprint(getattr(mc, "model", None))}
