"""Tests for integrations/hf/gemma.py and ``kvz capture``.

The ``model`` tests load Gemma 3 270M on the CPU (about 15 s with the cached
dequantized copy, about 60 s the first time) and check that the recorded K/V
are exactly what the model hands to its cache.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from alignpred.cache.rope import RopeSpec

ROOT = Path(__file__).resolve().parents[2]
PROSE = ROOT / "samples" / "texts" / "english-prose.txt"


# --------------------------------------------------------------------------- no model needed

def test_cli_without_model_extra(monkeypatch):
    """Missing torch/transformers: one clear line, no traceback."""
    from click.testing import CliRunner

    from kvz.cli.capture_cmd import capture

    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    res = CliRunner().invoke(capture, ["some text", "--tokens", "4", "-o", "x.safetensors"])
    assert res.exit_code == 1
    assert "pip install -e '.[model]'" in res.output
    assert "Traceback" not in res.output


def test_cli_missing_file(tmp_path):
    from click.testing import CliRunner

    from kvz.cli.capture_cmd import capture

    res = CliRunner().invoke(capture, [str(tmp_path / "nope.txt"), "--file", "-o", str(tmp_path / "o.safetensors")])
    assert res.exit_code == 1 and "no such file" in res.output


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_metadata_and_atomic_write(tmp_path, dtype):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from kvz.integrations.hf.gemma import cache_metadata, write_cache_atomic

    meta = cache_metadata(["sliding_attention", "full_attention"], [1e4, 1e6], [2, 5, 7], "unit-test")
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["format"] == "kvz-cache" and meta["kvz.version"] == "1" and meta["rope_pairing"] == "half"
    assert json.loads(meta["rope_theta"]) == [10000.0, 1000000.0]
    g = torch.Generator().manual_seed(0)
    t = {f"layers.{i}.{k}": torch.randn(1, 3, 8, generator=g).to(getattr(torch, dtype))
         for i in (1, 0) for k in ("value", "key")}
    out = write_cache_atomic(t, meta, tmp_path / "sub" / "c.safetensors")
    assert [p.name for p in out.parent.iterdir()] == ["c.safetensors"]  # no temp file left behind
    assert out.stat().st_mode & 0o044  # not the 0600 of mkstemp
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == meta
        assert sorted(f.keys()) == sorted(t)
        for k in t:
            assert torch.equal(f.get_tensor(k), t[k]) and f.get_tensor(k).dtype == t[k].dtype
    again = write_cache_atomic(dict(reversed(list(t.items()))), dict(reversed(list(meta.items()))),
                               tmp_path / "again.safetensors")
    assert again.read_bytes() == out.read_bytes()  # deterministic bytes
    from alignpred import load_cache

    c = load_cache(str(out))
    assert (c.layout.num_layers, c.layout.n_tokens, c.layout.head_dim, c.layout.dtype) == (2, 3, 8, dtype)


def test_metadata_with_rope_spec(tmp_path):
    torch = pytest.importorskip("torch")
    from alignpred import load_cache
    from kvz.integrations.hf.gemma import cache_metadata, write_cache_atomic

    spec = RopeSpec.from_thetas([1e4, 1e6], head_dim=8)
    meta = cache_metadata(["sliding_attention", "full_attention"], None, [2, 5, 7], "unit", rope=spec)
    assert "rope_theta" not in meta and meta["keys_roped"] == "true"
    assert RopeSpec.from_json(json.loads(meta["rope"])) == spec
    t = {f"layers.{i}.{k}": torch.zeros(2, 3, 8) for i in (0, 1) for k in ("key", "value")}
    out = write_cache_atomic(t, meta, tmp_path / "r.safetensors")
    lay = load_cache(str(out)).layout
    assert lay.keys_roped and getattr(lay, "rope", spec) == spec


# --------------------------------------------------------------------------- real model

def _rope_half(x, positions, theta):
    import torch

    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = positions[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _by_hand(attn, hidden, theta):
    """k_proj -> k_norm -> RoPE (half pairing) and v_proj, from a layer's normed input."""
    import torch

    T = hidden.shape[1]
    k = attn.k_proj(hidden).view(1, T, -1, attn.head_dim).transpose(1, 2)[0]
    v = attn.v_proj(hidden).view(1, T, -1, attn.head_dim).transpose(1, 2)[0]
    return _rope_half(attn.k_norm(k), torch.arange(T), theta), v


@pytest.mark.slow
@pytest.mark.model
def test_capture_matches_model_cache(gemma, tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import DynamicCache

    from alignpred import load_cache
    from kvz.integrations.hf.gemma import capture, tokenize

    model, tok = gemma
    text = PROSE.read_text(encoding="utf-8")
    T = 600  # > sliding window (512), several chunks of 256
    out = tmp_path / "c.safetensors"
    pre = {0: [], 5: []}  # keys before RoPE (k_norm outputs), chunk by chunk, during the capture itself
    hooks = [model.model.layers[i].self_attn.k_norm.register_forward_hook(
        (lambda i: lambda mod, args, o: pre[i].append(o.detach()[0].clone()))(i)) for i in pre]  # [kv_heads, t, d]
    try:
        s = capture(text, T, out, dtype="float32", chunk=256, progress=False, source="english-prose",
                    model=model, tokenizer=tok)
    finally:
        for h in hooks:
            h.remove()
    assert (s["tokens"], s["layers"], s["kv_heads"], s["head_dim"]) == (T, 18, 1, 256)

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        rec = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(rec) == sorted(f"layers.{i}.{k}" for i in range(18) for k in ("key", "value"))
    assert all(v.shape == (1, T, 256) and v.dtype == torch.float32 for v in rec.values())
    ids = json.loads(meta["token_ids"])
    assert ids == tokenize(tok, text)[:T] and ids[0] == tok.bos_token_id
    types, thetas = json.loads(meta["layer_types"]), json.loads(meta["rope_theta"])
    assert types.count("full_attention") == 3 and types[5] == types[11] == types[17] == "full_attention"
    assert all(th == (1e6 if t == "full_attention" else 1e4) for t, th in zip(types, thetas))
    assert (meta["format"], meta["model"], meta["keys_roped"], meta["position_offset"], meta["source"]) == (
        "kvz-cache", "gemma-3-270m", "true", "0", "english-prose")
    lay = load_cache(str(out)).layout  # the library's own reader accepts it
    assert (lay.num_layers, lay.n_tokens, lay.rope_pairing, lay.keys_roped) == (18, T, "half", True)

    # 0) The exact RoPE spec: the model's own float32 inv_freq per layer type, and undoing it with
    #    the recorded spec gives the pre-RoPE keys of this very prefill to float32 rounding.
    spec = RopeSpec.from_json(json.loads(meta["rope"]))
    assert spec == s["rope"] and getattr(lay, "rope", spec) == spec
    rot = model.model.rotary_emb
    assert len(spec.tables) == 2 and spec.layer_table == tuple(int(t == "full_attention") for t in types)
    assert spec.tables[0].inv_freq == tuple(rot.sliding_attention_inv_freq.tolist())
    assert spec.tables[1].inv_freq == tuple(rot.full_attention_inv_freq.tolist())
    assert all(t.attention_scaling == 1.0 and t.pairing == "half" and t.rotary_dim == 256 for t in spec.tables)
    for i in pre:
        want = torch.cat(pre[i], dim=-2).numpy()
        got = spec.table(i).apply(rec[f"layers.{i}.key"].numpy(), 0, inverse=True)
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-6, i

    # 1) Reference: one unchunked pass with the default cache; capture layer inputs on the way.
    inputs = {}
    hooks = [model.model.layers[i].self_attn.register_forward_pre_hook(
        (lambda i: lambda mod, args, kw: inputs.__setitem__(i, (kw.get("hidden_states", args[0] if args else None))))(i),
        with_kwargs=True) for i in (0, 5)]
    try:
        with torch.inference_mode():
            ref = model.model(input_ids=torch.tensor([ids]), use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    cache = ref.past_key_values if hasattr(ref, "past_key_values") else ref.cache
    assert isinstance(cache, DynamicCache)
    for i, t in enumerate(types):
        kept_k, kept_v = cache.layers[i].keys[0], cache.layers[i].values[0]
        n = kept_k.shape[-2]
        assert n == (511 if t == "sliding_attention" else T)  # the default cache drops old window positions
        for name, kept in (("key", kept_k), ("value", kept_v)):
            mine = rec[f"layers.{i}.{name}"][:, -n:]
            err = (mine - kept).abs().max() / kept.abs().max()
            assert err < 1e-4, (i, name, float(err))  # chunked vs single pass: fp32 rounding only

    # 2) Keys/values re-derived by hand from the layer inputs (theta from the metadata).
    for i in (0, 5):
        with torch.inference_mode():
            k, v = _by_hand(model.model.layers[i].self_attn, inputs[i], thetas[i])
        for name, want in (("key", k), ("value", v)):
            got = rec[f"layers.{i}.{name}"]
            err = (got - want).abs().max() / want.abs().max()
            assert err < 1e-4, (i, name, float(err))
    # Wrong theta must not match (the check above is sensitive to it).
    with torch.inference_mode():
        k_bad, _ = _by_hand(model.model.layers[5].self_attn, inputs[5], 1e4)
    assert (rec["layers.5.key"] - k_bad).abs().max() > 0.1 * k_bad.abs().max()


@pytest.mark.model
def test_capture_bf16_and_too_short(gemma, tmp_path):
    import torch
    from safetensors import safe_open

    from kvz.integrations.hf.gemma import capture

    model, tok = gemma
    text = PROSE.read_text(encoding="utf-8")
    s = capture(text, 64, tmp_path / "b.safetensors", progress=False, model=model, tokenizer=tok)
    assert s["dtype"] == "bfloat16" and s["tokens"] == 64
    with safe_open(str(tmp_path / "b.safetensors"), "pt") as f:
        k = f.get_tensor("layers.17.key")
        assert k.dtype == torch.bfloat16 and k.shape == (1, 64, 256)
        assert torch.isfinite(k.float()).all()
    with pytest.raises(ValueError, match="too short"):
        capture("Only a few words.", 100, tmp_path / "x.safetensors", progress=False, model=model, tokenizer=tok)
    assert not (tmp_path / "x.safetensors").exists()
