"""Attention statistics recorded during a prefill (integrations/hf/querystats.py, issue 20): checked
against the model's own attention weights and projections on a tiny random Gemma 3 (two KV groups,
so the GQA grouping is exercised); the real Gemma 3 270M in a slow test."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvz.integrations.hf.capture import record_kv  # noqa: E402
from kvz.integrations.hf.querystats import (  # noqa: E402
    capture_with_stats,
    group_heads,
    pair_index,
    pair_weights,
    record_query_stats,
    value_grams,
)


def tiny_gemma(seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=32,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"][:layers],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1e4),
                         "full_attention": dict(rope_type="default", rope_theta=1e6)})
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # norms that are not all ones, so the gains are checked
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(-0.5, 0.5)
            layer.post_attention_layernorm.weight.uniform_(-0.5, 0.5)
    return model


@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma()


IDS = [1] + list(range(3, 42))


def _hand_queries(model, ids):
    """Pre-RoPE queries after q_norm, ``[layers, H, T, D]``, from the layers' inputs (by hooks on the
    attention modules' inputs, then q_proj and q_norm called by hand)."""
    inputs = {}
    hs = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, kw, i=i: inputs.__setitem__(i, kw.get("hidden_states", a[0] if a else None)), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode():
            model.model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hs:
            h.remove()
    out = []
    with torch.inference_mode():
        for i, layer in enumerate(model.model.layers):
            at = layer.self_attn
            x = inputs[i]
            q = at.q_proj(x).view(1, x.shape[1], -1, at.head_dim).transpose(1, 2)
            out.append(at.q_norm(q)[0].double().numpy())
    return np.stack(out)


def test_queries_and_attention_match_the_model(tiny):
    impl = tiny.config._attn_implementation
    st = record_query_stats(tiny, IDS)
    assert tiny.config._attn_implementation == impl  # restored
    T = len(IDS)
    q = _hand_queries(tiny, IDS)
    for g, heads in enumerate(group_heads(4, 2)):
        want = (q[:, heads] ** 2).sum(axis=1).mean(axis=1)  # [layers, D]
        assert np.allclose(st.q_channel[:, g], want, rtol=1e-5)
    tiny.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            att = tiny(input_ids=torch.tensor([IDS]), output_attentions=True).attentions
    finally:
        tiny.set_attn_implementation(impl)
    for i, a in enumerate(att):
        a = a[0].double().numpy()  # [H, T, T]
        for g, heads in enumerate(group_heads(4, 2)):
            assert np.allclose(st.mass[i, g], a[heads].sum(axis=(0, 1)) / (len(heads) * T), atol=1e-7)
            assert np.allclose(st.sq[i, g], (a[heads] ** 2).sum(axis=(0, 1)) / (len(heads) * T), atol=1e-7)
            f = a[heads].reshape(len(heads), -1)
            assert np.allclose(st.overlap[i, g], f @ f.T / T, rtol=1e-6)
    assert np.allclose(st.mass.sum(-1), 1.0)


def test_capture_with_stats_is_record_kv_plus_stats(tiny):
    tensors, spec, info, st = capture_with_stats(tiny, IDS)
    plain, _, _ = record_kv(tiny, IDS, chunk=len(IDS))
    for k in plain:
        assert torch.allclose(tensors[k], plain[k], atol=1e-5), k
    assert st.n_tokens == len(IDS) and st.mass.shape == (2, 2, len(IDS))
    assert np.allclose(st.q_channel, record_query_stats(tiny, IDS).q_channel, rtol=1e-6)
    no_att = record_query_stats(tiny, IDS, attention=False)
    assert no_att.mass is None and np.allclose(no_att.q_channel, st.q_channel, rtol=1e-6)


def test_value_grams(tiny):
    g = value_grams(tiny)
    assert g["gram"].shape == (2, 2, 32, 32) and g["gram_norm"].shape == (2, 2, 32, 32)
    for i, layer in enumerate(tiny.model.layers):
        W = layer.self_attn.o_proj.weight.detach().double().numpy()
        gamma = 1.0 + layer.post_attention_layernorm.weight.detach().double().numpy()  # Gemma's RMSNorm
        assert np.allclose(g["norm_gain"][i], gamma, rtol=1e-4, atol=1e-6)
        for grp, heads in enumerate(group_heads(4, 2)):
            blocks = [W[:, h * 32:(h + 1) * 32] for h in heads]
            assert np.allclose(g["gram"][i, grp], sum(b.T @ b for b in blocks))
            assert np.allclose(g["gram_norm"][i, grp], sum((gamma[:, None] * b).T @ (gamma[:, None] * b)
                                                           for b in blocks), rtol=1e-4)


def test_pairs():
    a, b = pair_index(8, "half")
    assert a.tolist() == [0, 1, 2, 3] and b.tolist() == [4, 5, 6, 7]
    a, b = pair_index(8, "interleaved")
    assert a.tolist() == [0, 2, 4, 6] and b.tolist() == [1, 3, 5, 7]
    assert pair_weights(np.arange(8.0))[..., 0] == 4.0
    with pytest.raises(ValueError):
        pair_index(8, "other")
    with pytest.raises(ValueError):
        group_heads(4, 3)


@pytest.mark.model
def test_real_gemma_prefill(gemma):
    m, tok = gemma
    from kvz.integrations.hf.capture import tokenize

    ids = tokenize(tok, "The river was measured every morning by the people of the town. " * 8)[:64]
    st = record_query_stats(m, ids)
    assert st.q_channel.shape == (18, 1, 256) and st.mass.shape == (18, 1, len(ids))
    assert np.allclose(st.mass.sum(-1), 1.0)
    assert (st.mass[:, 0, 0] > 5.0 / len(ids)).all()  # the sink takes far more than a uniform share
    pw = st.pairs()
    assert np.isfinite(pw).all() and (pw >= 0).all() and (pw > 0).mean() > 0.95
    g = value_grams(m)
    assert g["gram_norm"] is not None and np.isfinite(g["gram_norm"]).all()
