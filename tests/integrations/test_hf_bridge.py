"""The transformers cache bridge (integrations/hf/bridge.py): capture every position of every layer,
save as .kvz, load back as a DynamicCache that generation continues from.

CI tests use a tiny random-weight Gemma 3 (sliding window 24, no download); the ``model`` test runs
the real Gemma 3 270M.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from alignpred import Cache, KvzError, KvzReader, fit_bank  # noqa: E402
from kvz.integrations.hf.bridge import cache_from_kv, cache_kwarg, capture_prefill, kv_metadata, load_kvz_cache, save_kv  # noqa: E402

WINDOW = 24


def tiny_gemma(seed: int = 0, layers: int = 4):
    torch.manual_seed(seed)
    types = ["sliding_attention", "full_attention"] * (layers // 2)
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=32,
        sliding_window=WINDOW, layer_types=types,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=1e4),
                         "full_attention": dict(rope_type="default", rope_theta=1e6)})
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # a shared embedding component, as trained models have (structure for the codec)
        e = model.model.embed_tokens.weight
        e.mul_(0.25).add_(torch.randn(1, e.shape[1]))
    return model


@pytest.fixture(scope="module")
def tiny():
    return tiny_gemma()


@pytest.fixture(scope="module")
def tiny_bank(tiny):
    ids = torch.randint(3, 256, (300,), generator=torch.Generator().manual_seed(7)).tolist()
    _, _, kv = capture_prefill(tiny, ids)
    cache = Cache.from_arrays([(k.numpy(), v.numpy()) for k, v in kv], kv_metadata(tiny, len(ids)))
    return fit_bank([cache], rank=None)


def _greedy(model, cache, ids, n):
    """Greedy decode after a cache holding ids[:-1]: returns (tokens, stacked logits)."""
    kw = cache_kwarg(model)
    toks, logits, cur, pos = [], [], ids[-1], len(ids) - 1
    with torch.inference_mode():
        for _ in range(n):
            out = model(input_ids=torch.tensor([[cur]]), position_ids=torch.tensor([[pos]]), use_cache=True,
                        **{kw: cache})
            lg = out.logits[0, -1]
            logits.append(lg.clone())
            cur = int(lg.argmax())
            toks.append(cur)
            pos += 1
    return toks, torch.stack(logits)


def test_capture_prefill_keeps_every_position(tiny):
    ids = list(range(3, 103))
    logits, cache, kv = capture_prefill(tiny, ids)
    assert logits.shape == (1, 1, 256)
    assert len(kv) == 4
    for i, (k, v) in enumerate(kv):
        assert k.shape == v.shape == (2, 100, 32)
        layer = cache.layers[i]
        if i % 2 == 0:  # sliding: the cache keeps the last window - 1, the capture all
            assert layer.keys.shape[-2] == WINDOW - 1
            assert torch.equal(layer.keys[0], k[:, -(WINDOW - 1):])
        else:
            assert torch.equal(layer.keys[0], k) and torch.equal(layer.values[0], v)
    # continuing a recording cache records only the new positions
    _, cache2, kv2 = capture_prefill(tiny, ids[:60])
    _, _, kv3 = capture_prefill(tiny, ids[60:], cache=cache2)
    assert kv3[1][0].shape[-2] == 40
    assert torch.allclose(torch.cat([kv2[1][0], kv3[1][0]], -2), kv[1][0], atol=1e-5)


def test_save_load_generate_matches_hand_injection(tiny, tiny_bank, tmp_path):
    ids = torch.randint(3, 256, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    _, _, kv = capture_prefill(tiny, ids[:-1])
    path = tmp_path / "p.kvz"
    info = save_kv(kv, path, model=tiny, eps=0.02, bank=tiny_bank, token_ids=ids[:-1])
    assert info.nrmse_max_tensor <= 0.02 + 1e-6
    r = KvzReader(path, bank=tiny_bank)
    meta = r.header["source_metadata"]
    assert meta["keys_roped"] == "true" and meta["model"]
    assert r.layout.keys_roped and r.layout.rope is not None  # the model's exact RoPE, in the layout
    assert r.layout.layer_types == ("sliding_attention", "full_attention") * 2
    # the decoded cache vs the same decoded values injected by hand
    cache = load_kvz_cache(path, tiny, bank=tiny_bank)
    dec = r.read()
    hand = transformers.DynamicCache(config=tiny.config)
    for i in range(4):
        hand.update(torch.from_numpy(np.array(dec[f"layers.{i}.key"]))[None],
                    torch.from_numpy(np.array(dec[f"layers.{i}.value"]))[None], i)
    for i in range(4):
        assert cache.layers[i].keys.shape == hand.layers[i].keys.shape
        assert cache.layers[i].keys.shape[-2] == (WINDOW - 1 if i % 2 == 0 else 89)
    t1, l1 = _greedy(tiny, cache, ids, 12)
    t2, l2 = _greedy(tiny, hand, ids, 12)
    assert t1 == t2 and torch.equal(l1, l2)
    # and model.generate continues from the loaded cache
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = tiny.generate(torch.tensor([ids]), past_key_values=load_kvz_cache(path, tiny, bank=tiny_bank),
                            max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out[0, len(ids):].tolist() == t1
    # close to the uncompressed continuation's logits
    _, l0 = _greedy(tiny, cache_from_kv(tiny, kv), ids, 1)
    assert float((l0[0] - l1[0]).abs().max()) < 0.5


def test_load_cache_token_range_and_checks(tiny, tiny_bank, tmp_path):
    ids = list(range(10, 70))
    _, _, kv = capture_prefill(tiny, ids)
    path = tmp_path / "c.kvz"
    save_kv(kv, path, model=tiny, eps=0.01, bank=tiny_bank)
    c = load_kvz_cache(path, tiny, tokens=(0, 40), bank=tiny_bank)
    assert c.get_seq_length() == 40
    with pytest.raises(KvzError, match="cannot start a cache"):
        load_kvz_cache(path, tiny, tokens=(10, 40), bank=tiny_bank)
    off = tmp_path / "off.kvz"
    save_kv(kv, off, model=tiny, eps=0.01, bank=tiny_bank, position_offset=100)
    with pytest.raises(KvzError, match="cannot start a cache"):
        load_kvz_cache(off, tiny, bank=tiny_bank)
    other = tiny_gemma(layers=2)
    with pytest.raises(KvzError, match="layers"):
        load_kvz_cache(path, other, bank=tiny_bank)


def test_load_cache_rejects_other_rope(tiny, tiny_bank, tmp_path):
    ids = list(range(10, 50))
    _, _, kv = capture_prefill(tiny, ids)
    path = tmp_path / "c.kvz"
    save_kv(kv, path, model=tiny, eps=0.01, bank=tiny_bank)
    cfg = tiny.config.to_dict()
    cfg["rope_parameters"] = {"sliding_attention": dict(rope_type="default", rope_theta=5e3),
                              "full_attention": dict(rope_type="default", rope_theta=1e6)}
    other = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{k: v for k, v in cfg.items()
                                                                            if k not in ("architectures",)})).eval()
    with pytest.raises(KvzError, match="another RoPE"):
        load_kvz_cache(path, other, bank=tiny_bank)


# --------------------------------------------------------------------------- real model

@pytest.mark.slow
@pytest.mark.model
def test_gemma_generate_from_decoded_cache(gemma, tmp_path):
    """600 positions (past the 512 window): generation from load_kvz_cache equals generation from the same
    decoded values injected by hand (tokens and logits bit for bit), and stays close to the model's own."""
    model, tok = gemma
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "samples" / "texts" / "english-prose.txt").read_text()
    ids = tok(text)["input_ids"][:601]
    _, _, kv = capture_prefill(model, ids[:-1])
    path = tmp_path / "g.kvz"
    info = save_kv(kv, path, model=model, eps=0.02, bank="gemma-3-270m", token_ids=ids[:-1], model_id="gemma-3-270m")
    assert info.bpv < 6
    cache = load_kvz_cache(path, model)
    assert cache.layers[0].keys.shape[-2] == 511 and cache.layers[5].keys.shape[-2] == 600
    dec = KvzReader(path).read()
    hand = cache_from_kv(model, dec)
    t1, l1 = _greedy(model, cache, ids, 16)
    t2, l2 = _greedy(model, hand, ids, 16)
    assert t1 == t2 and torch.equal(l1, l2)
    t0, l0 = _greedy(model, cache_from_kv(model, kv), ids, 16)
    p0, p1 = l0[0].double().log_softmax(-1), l1[0].double().log_softmax(-1)
    assert float((p0.exp() * (p0 - p1)).sum()) < 0.05


def test_a_generate_cache_saves_in_one_call_and_continues_identically(tiny, tiny_bank, tmp_path):
    """The cache ``generate`` returns — sliding layers already cropped to their window — goes to
    save_kv as it is (issue 16): lossless, the continuation from the loaded file is identical to the
    continuation from the original cache; lossy, it stays close."""
    ids = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        out = tiny.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    dc = out.past_key_values
    lens = {int(layer.keys.shape[-2]) for layer in dc.layers}
    assert len(lens) == 2, "the sliding layers should hold fewer positions than the full ones"
    seq = out.sequences[0].tolist()
    import copy

    ref, _ = _greedy(tiny, copy.deepcopy(dc), seq, 8)
    p = tmp_path / "gen.kvz"
    save_kv(dc, p, model=tiny, eps=0.05, bank=tiny_bank, lossless=True)
    r = KvzReader(p, bank=tiny_bank)
    assert r.layout.n_tokens == max(lens) == len(seq) - 1
    got, _ = _greedy(tiny, load_kvz_cache(p, tiny, bank=tiny_bank), seq, 8)
    assert got == ref
    legacy = [(layer.keys, layer.values) for layer in dc.layers]      # the same as legacy tuples
    assert len(save_kv(legacy, None, model=tiny, eps=0.05, bank=tiny_bank).data) > 0
    with pytest.raises(ValueError, match="holds 5 positions but others hold"):
        save_kv([(k[..., :5, :], v[..., :5, :]) if i == 1 else (k, v) for i, (k, v) in enumerate(legacy)], None,
                model=tiny, eps=0.05, bank=tiny_bank)
