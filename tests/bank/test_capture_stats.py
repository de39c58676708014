"""Attention statistics recorded with a capture (alignpred/bank/capture_stats.py, issue 20): the
record's round trip and its tie to one prefill, the fit of a bank's AttentionStats from several
records, and the registry's view of a bank's sidecar (found, absent, corrupt)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from alignpred.bank import (
    AttentionStats,
    AttentionStatsError,
    Bank,
    CaptureStats,
    capture_stats_path,
    find_capture_stats,
    fit_attention_stats,
    fit_bank,
    lookup,
    tokens_digest,
)
from alignpred.cache import Cache, infer_layout, save_cache

L, H, D = 3, 2, 8


def _cache(T=12, seed=0, ids=None, model="toy"):
    rng = np.random.default_rng(seed)
    t = {f"layers.{i}.{k}": rng.standard_normal((H, T, D)).astype(np.float32) for i in range(L)
         for k in ("key", "value")}
    ids = list(range(5, 5 + T)) if ids is None else ids
    meta = {"model": model, "token_ids": json.dumps(ids), "layer_types": json.dumps(["sliding_attention"] * L)}
    return Cache(t, meta, infer_layout(t, meta)), ids


def _record(T=12, seed=0, ids=None, model="toy", gram=None):
    rng = np.random.default_rng(seed)
    mass = rng.random((L, H, T)) + 0.01
    mass /= mass.sum(-1, keepdims=True)
    if gram is None:
        w = np.random.default_rng(99).standard_normal((L, H, 16, D))
        gram = np.einsum("lhkc,lhkd->lhcd", w, w)
    ids = list(range(5, 5 + T)) if ids is None else ids
    return CaptureStats(model=model, n_tokens=T, tokens_sha256=tokens_digest(ids),
                        layer_types=["sliding_attention"] * L, pairing="half",
                        q_channel=rng.random((L, H, D)) + 0.1, mass=mass, sq=mass ** 2 * 3, value_gram=gram,
                        value_gram_kind="o_proj")


def test_record_roundtrip_and_path(tmp_path):
    r = _record()
    p = r.save(tmp_path / "x.capture-stats.json")
    back = CaptureStats.load(p)
    for n in ("q_channel", "mass", "sq", "value_gram"):
        assert np.array_equal(getattr(back, n), getattr(r, n)), n  # the Gram comes back whole from its triangle
    assert (back.model, back.n_tokens, back.tokens_sha256, back.layer_types) == \
        (r.model, r.n_tokens, r.tokens_sha256, r.layer_types)
    assert capture_stats_path(tmp_path / "a.safetensors") == tmp_path / "a.capture-stats.json"
    assert not r.q_channel.flags.writeable


def test_record_is_tied_to_its_prefill(tmp_path):
    cache, ids = _cache()
    path = tmp_path / "c.safetensors"
    save_cache(cache, path)
    from alignpred import load_cache

    loaded = load_cache(path)
    assert find_capture_stats(loaded) is None  # no statistics: None, no error
    _record(ids=ids).save(capture_stats_path(path))
    assert find_capture_stats(loaded).n_tokens == 12
    _record(ids=[3] + ids[1:]).save(capture_stats_path(path))  # another text of the same length
    with pytest.raises(AttentionStatsError, match="another prefill"):
        find_capture_stats(loaded)
    _record(ids=ids, model="other").save(capture_stats_path(path))
    with pytest.raises(AttentionStatsError, match="model 'other'"):
        find_capture_stats(loaded)
    _record(T=11, ids=ids[:11]).save(capture_stats_path(path))
    with pytest.raises(AttentionStatsError, match="11 tokens"):
        find_capture_stats(loaded)


@pytest.mark.parametrize("what", ["not json", "format", "no triangle", "short mass", "negative"])
def test_corrupt_record_is_one_line(tmp_path, what):
    good = _record().to_json()
    doc = {"not json": "{oops", "format": {**good, "format": "x"},
           "no triangle": {**good, "arrays": {k: v for k, v in good["arrays"].items() if k != "value_gram_triu"}},
           "short mass": {**good, "n_tokens": 13},
           "negative": {**good, "arrays": {**good["arrays"], "q_channel": {
               **good["arrays"]["q_channel"],
               "data": __import__("base64").b64encode((-np.ones(L * H * D, "<f4")).tobytes()).decode()}}}}[what]
    p = tmp_path / "bad.capture-stats.json"
    p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(AttentionStatsError) as ei:
        CaptureStats.load(p)
    assert str(p) in str(ei.value) and "\n" not in str(ei.value)


def _bank(rotations=True):
    caches = [_cache(T=40, seed=s)[0] for s in range(2)]
    return fit_bank(caches, rotations=rotations, maps=False)


@pytest.mark.parametrize("rotations", [False, True])
def test_fit_aggregates_over_captures(rotations):
    bank = _bank(rotations)
    a, b = _record(T=12, seed=1), _record(T=30, seed=2, ids=list(range(30)))
    s = fit_attention_stats([a, b], bank, prior=4, levels=(0.5, 0.9))
    assert s.bank_id == bank.id and s.fits(bank)
    want_q = (a.q_channel.astype(np.float64) * 12 + b.q_channel.astype(np.float64) * 30) / 42  # weighted by tokens
    assert np.allclose(s.key_channel, want_q, rtol=1e-6)
    rel = [a.mass.astype(np.float64) * 12, b.mass.astype(np.float64) * 30]
    assert np.allclose(s.token_prior, (rel[0][..., :4] + rel[1][..., :4]) / 2, rtol=1e-5)
    pooled = np.concatenate([rel[0][..., 4:], rel[1][..., 4:]], -1)
    assert np.allclose(s.token_quantiles[..., 1], np.quantile(pooled, 0.9, axis=-1), rtol=1e-5)
    G = a.value_gram.astype(np.float64)
    assert np.allclose(s.value_gram_eig.sum(-1), np.trace(G, axis1=-2, axis2=-1), rtol=1e-4)
    assert (np.diff(s.value_gram_eig, axis=-1) <= 1e-3).all()  # descending
    # the coding frame keeps each block's total weight (R orthonormal); without rotations it is the weights
    assert np.allclose(s.key_frame.sum(-1), s.key_weights().sum(-1), rtol=1e-4)
    assert np.allclose(s.value_frame.sum(-1), s.value_gram_diag.sum(-1), rtol=1e-4)
    if not rotations:
        assert np.allclose(s.key_frame, s.key_weights(), rtol=1e-5)
    assert s.meta["tokens"] == [12, 30] and s.meta["prior_positions"] == 4


def test_fit_prior_is_cut_to_the_shortest_capture_and_refuses_mixtures():
    bank = _bank(False)
    s = fit_attention_stats([_record(T=6)], bank)  # default prior 16 > 6 tokens
    assert s.token_prior.shape == (L, H, 5)
    other = _record(gram=np.ones((L, H, D, D)) * 7.0)
    with pytest.raises(AttentionStatsError, match="W_o Grams differ"):
        fit_attention_stats([_record(), other], bank)
    with pytest.raises(AttentionStatsError, match="no capture statistics"):
        fit_attention_stats([], bank)
    wrong = Bank(model="toy", signature={"num_layers": 2, "kv_heads": H, "head_dim": D}, config={}, arrays={})
    with pytest.raises(AttentionStatsError, match="the bank is of 2"):
        fit_attention_stats([_record()], wrong)


# -- the registry's view --------------------------------------------------------------------------------
def test_registry_finds_the_bundled_sidecar():
    e = lookup("gemma-3-270m")
    assert e.has_attention_stats and e.attention_stats_path.name == "gemma-3-270m.attention.json"
    s = e.attention_stats()
    assert isinstance(s, AttentionStats) and s.bank_id == e.id and s.num_layers == 18


def test_registry_entry_without_and_with_a_corrupt_sidecar(tmp_path, monkeypatch):
    bank = _bank(False)
    bank.save(tmp_path / "mine.h5")
    monkeypatch.setenv("KVZ_BANK_PATH", str(tmp_path))
    e = lookup("mine")
    assert e is not None and not e.has_attention_stats and e.attention_stats() is None  # keeps working
    e.attention_stats_path.write_text('{"format": "kvz-attention-stats", "version": 1, "arrays": [')
    assert e.has_attention_stats
    with pytest.raises(AttentionStatsError) as ei:
        e.attention_stats()
    assert "mine.attention.json" in str(ei.value) and "\n" not in str(ei.value)
    fit_attention_stats([_record()], _bank(True)).save(e.attention_stats_path)  # of another bank: stale
    with pytest.raises(AttentionStatsError, match="refit"):
        e.attention_stats()


def test_bank_add_carries_the_sidecar(tmp_path, monkeypatch):
    from alignpred.bank import add

    monkeypatch.setenv("KVZ_BANK_DIR", str(tmp_path / "user"))
    bank = _bank(False)
    src = tmp_path / "b.h5"
    bank.save(src)
    fit_attention_stats([_record()], bank).save(AttentionStats.path_for(src))
    e = add(src, name="carried")
    assert e.has_attention_stats and e.attention_stats().bank_id == bank.id
    other = _bank(True)
    other.save(tmp_path / "o.h5")
    e2 = add(tmp_path / "o.h5", name="carried", force=True)  # replaced by a bank without statistics
    assert not e2.has_attention_stats
