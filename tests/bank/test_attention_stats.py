"""The attention-statistics sidecar of a bank (alignpred/bank/attention_stats.py, issue 20): round
trip, one named error for every malformed file, no sidecar = None, a stale one refused, the bundled
bank's own, and the water-filling gains."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from alignpred.bank import AttentionStats, AttentionStatsError, Bank, highrate_gain, waterfill_gain
from alignpred.bank.attention_stats import (
    find_attention_stats,
    load_attention_stats,
    save_attention_stats,
    sidecar_path,
)

BID = "sha256:" + "ab" * 32


def _stats(L=3, H=2, d=8, bank_id=BID, seed=0, frames=True):
    rng = np.random.default_rng(seed)
    pos = lambda *s: rng.random(s).astype(np.float32) + 0.01  # noqa: E731
    lv = (0.5, 0.9)
    return AttentionStats(model="toy", bank_id=bank_id, layer_types=["sliding_attention"] * L, pairing="half",
                          key_channel=pos(L, H, d), value_gram_eig=pos(L, H, d), value_gram_diag=pos(L, H, d),
                          token_prior=pos(L, H, 4), token_quantiles=pos(L, H, 2), quantile_levels=lv,
                          key_frame=pos(L, H, d) if frames else None, value_frame=pos(L, H, d) if frames else None,
                          meta={"texts": ["a.txt"]})


def _same(a, b):
    assert (a.model, a.bank_id, a.layer_types, a.pairing, a.quantile_levels, a.meta) == \
        (b.model, b.bank_id, b.layer_types, b.pairing, b.quantile_levels, b.meta)
    for n in ("key_channel", "value_gram_eig", "value_gram_diag", "token_prior", "token_quantiles", "key_frame",
              "value_frame", "token_prior_sq", "token_quantiles_sq"):
        x, y = getattr(a, n), getattr(b, n)
        assert (x is None) == (y is None), n
        if x is not None:
            assert x.dtype == y.dtype == np.float32 and np.array_equal(x, y), n


@pytest.mark.parametrize("frames", [True, False])
def test_roundtrip(tmp_path, frames):
    s = _stats(frames=frames)
    p = save_attention_stats(s, tmp_path / "b.attention.json")
    _same(load_attention_stats(p), s)
    _same(AttentionStats.load(s.save(tmp_path / "c.json")), s)
    assert not s.key_channel.flags.writeable  # frozen all the way down


def test_pair_and_key_weights():
    s = _stats(L=1, H=1, d=4)
    q = s.key_channel[0, 0].astype(np.float64)
    assert np.allclose(s.pair_weights()[0, 0], [q[0] + q[2], q[1] + q[3]])  # half pairing: j with j + d/2
    assert np.allclose(s.key_weights()[0, 0], [(q[0] + q[2]) / 2, (q[1] + q[3]) / 2] * 2)
    inter = AttentionStats(**{**s.__dict__, "pairing": "interleaved"})
    assert np.allclose(inter.pair_weights()[0, 0], [q[0] + q[1], q[2] + q[3]])


def _write(tmp_path, d):
    p = tmp_path / "bad.attention.json"
    p.write_text(d if isinstance(d, str) else json.dumps(d))
    return p


def _mutations():
    good = _stats().to_json()
    arr = good["arrays"]["key_channel"]

    def m(**kw):
        return {**good, **kw}

    yield "not json", "{this is not json"
    yield "a list", [1, 2]
    yield "format", m(format="other")
    yield "version", m(version=99)
    yield "bank id", m(bank_id="sha256:xyz")
    yield "pairing", m(pairing="diagonal")
    yield "layer types", m(layer_types=["full_attention"])
    yield "levels", m(quantile_levels=[0.9, 0.5])
    yield "missing array", m(arrays={k: v for k, v in good["arrays"].items() if k != "value_gram_eig"})
    yield "unknown array", m(arrays={**good["arrays"], "extra": arr})
    yield "shape", m(arrays={**good["arrays"], "value_gram_eig": {**arr, "shape": [3, 2, 4],
                                                                 "data": arr["data"][: len(arr["data"]) // 2]}})
    yield "length", m(arrays={**good["arrays"], "key_channel": {**arr, "shape": [3, 2, 9]}})
    yield "base64", m(arrays={**good["arrays"], "key_channel": {**arr, "data": "!!!"}})
    yield "dtype", m(arrays={**good["arrays"], "key_channel": {**arr, "dtype": "float64"}})
    neg = np.frombuffer(__import__("base64").b64decode(arr["data"]), "<f4").copy()
    neg[0] = -1
    yield "negative", m(arrays={**good["arrays"], "key_channel": {
        **arr, "data": __import__("base64").b64encode(neg.tobytes()).decode()}})
    neg[0] = np.nan
    yield "nan", m(arrays={**good["arrays"], "key_channel": {
        **arr, "data": __import__("base64").b64encode(neg.tobytes()).decode()}})
    yield "meta", m(meta=[1])


@pytest.mark.parametrize("what,doc", list(_mutations()), ids=[w for w, _ in _mutations()])
def test_malformed_file_is_one_named_error(tmp_path, what, doc):
    p = _write(tmp_path, doc)
    with pytest.raises(AttentionStatsError) as ei:
        load_attention_stats(p)
    assert str(p) in str(ei.value)


def test_missing_file_is_named_error(tmp_path):
    with pytest.raises(AttentionStatsError, match="no attention statistics file"):
        load_attention_stats(tmp_path / "none.attention.json")


def _bank(tmp_path, name="toy"):
    b = Bank(model="toy", signature={"num_layers": 3, "kv_heads": 2, "head_dim": 8},
             config={"groups": [], "sources": {}}, arrays={"mean/K.0.0": np.zeros(8, np.float32)})
    path = tmp_path / f"{name}.h5"
    b.save(path)
    return b, path


def test_sidecar_beside_bank(tmp_path):
    b, path = _bank(tmp_path)
    assert sidecar_path(path) == tmp_path / "toy.attention.json"
    assert find_attention_stats(path) is None  # a bank without statistics keeps working
    s = _stats(bank_id=b.id)
    s.save(sidecar_path(path))
    _same(find_attention_stats(str(path)), s)
    assert AttentionStats.find(path).fits(b)
    _stats(bank_id=BID).save(sidecar_path(path))  # stale: of another bank
    with pytest.raises(AttentionStatsError, match="refit"):
        find_attention_stats(path)


def test_sidecar_of_registered_bank(tmp_path, monkeypatch):
    b, path = _bank(tmp_path, "mybank")
    monkeypatch.setenv("KVZ_BANK_PATH", str(tmp_path))
    assert find_attention_stats("mybank") is None
    _stats(bank_id=b.id).save(sidecar_path(path))
    assert find_attention_stats("mybank").bank_id == b.id
    assert find_attention_stats(b).bank_id == b.id  # a loaded Bank, found by id
    from alignpred import BankMismatchError

    with pytest.raises(BankMismatchError):
        find_attention_stats("no-such-bank-name")


def test_bundled_bank_has_statistics():
    from alignpred import resolve_bank

    bank = resolve_bank("gemma-3-270m")
    s = AttentionStats.find("gemma-3-270m")
    assert s is not None and s.fits(bank)
    assert s.key_channel.shape == (18, 1, 256) and s.value_frame.shape == (18, 1, 256)
    pw = s.pair_weights()
    assert (pw > 0).mean() > 0.95  # a few pairs are never read (q_norm zeroes them), most are
    # GPA rotations mix pairs: frame weights keep the total and are never more spread than the pairs
    for i in range(18):
        assert math.isclose(float(s.key_frame[i, 0].sum()), float(s.key_weights()[i, 0].sum()), rel_tol=1e-4)
        assert highrate_gain(s.key_frame[i, 0]) <= highrate_gain(pw[i, 0]) + 1e-6
    assert np.allclose(s.value_gram_eig.sum(-1), s.value_gram_diag.sum(-1), rtol=1e-4)  # trace


def test_gains():
    assert highrate_gain([3.0, 3.0, 3.0]) == pytest.approx(0.0, abs=1e-12)
    assert math.isclose(highrate_gain([1.0, 4.0]), 0.5 * math.log2(2.5 / 2.0))
    assert highrate_gain([0.0, 1.0, 1.0]) == pytest.approx(0.0, abs=1e-12)  # zero weights need no bits and are left out
    w = np.array([1.0, 4.0, 0.25, 2.0])
    hi = waterfill_gain(w, np.full(4, 1e6), 1e-3)  # everything far above the water: the high-rate gain
    assert math.isclose(hi["bits"], highrate_gain(w), rel_tol=1e-6) and hi["zero_bits"] == 0
    lo = waterfill_gain([1.0, 1e-9], [1.0, 1.0], 1e-2)  # a nearly unread component is given no bits
    assert lo["zero_bits"] == 0.5 and lo["bits"] > 1.0
    assert waterfill_gain([1.0, 1.0], [1.0, 2.0], 1e-2)["bits"] == pytest.approx(0.0, abs=1e-9)
