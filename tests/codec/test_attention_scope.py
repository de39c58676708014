"""The attention scope (format 1.3): per-channel step multipliers from the bank's attention
statistics, coarser steps for positions no later query of a sliding-window layer attends, and an
error measure weighted by ``1 / multiplier²`` that the encoder bounds by decoding."""
import copy

import numpy as np
import pytest
from kvz_testing import attention_setup, synthetic_cache

from alignpred import ErrorBudget, KvzError, KvzReader, compress, fit_bank
from alignpred.codec.attention_steps import MAX_STEP, STALE_SCALE, codes_for_weights, step_codes
from alignpred.codec.config import CodecConfig
from alignpred.errors import FormatError
from alignpred.format.header import check_header, tensor_metas

T, D, L, WINDOW = 600, 32, 3, 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A roped synthetic cache (sliding layers), its bank file and a sidecar with uneven weights."""
    tmp = tmp_path_factory.mktemp("att")
    c, bank_path, s, weights = attention_setup(tmp, n_layers=L, T=T, d=D, window=WINDOW, seeds=(3, 4, 0),
                                               key_sigma=1.5, top_weight=3.0)
    return c, bank_path, s, weights, tmp


def _measure(c, out, stats, cfg):
    """Per tensor ``(weighted squared error, weighted squared norm)`` as the scope defines them."""
    codes = step_codes(stats, c.layout, cfg)
    res = []
    for ti, name in enumerate(c.layout.tensor_names()):
        layer = ti // 2
        wc = (32.0 / codes[ti].astype(np.float64)) ** 2
        g = np.ones(T, np.float32)
        cfg.scale_sink(g, 0, 0)
        cfg.scale_stale(g, 0, c.layout, layer)
        wr = 1.0 / g.astype(np.float64) ** 2
        x = c.tensors[name][0].astype(np.float64)
        dlt = out[name][0].astype(np.float64) - x
        res.append((float(np.einsum("tc,tc,c,t->", dlt, dlt, wc, wr)), float(np.einsum("tc,tc,c,t->", x, x, wc, wr))))
    return res


def test_codes_follow_inverse_sqrt_weights():
    assert codes_for_weights(np.array([1.0, 4.0, 0.25, 0.0])).tolist() == [32, 16, 64, 255]
    w = np.geomspace(1e-4, 1e4, 9)
    g = codes_for_weights(w) / 32.0
    assert g.min() == pytest.approx(0.25) and g.max() == pytest.approx(MAX_STEP)
    assert np.all(np.diff(g) <= 0)  # heavier channel, finer step
    assert codes_for_weights(np.zeros(4)).tolist() == [32] * 4  # nothing measured: even steps


def test_attention_scope_bounds_its_measure_by_decoding(setup):
    c, bank_path, stats, weights, tmp = setup
    eps = 0.03
    info = compress(c, tmp / "a.kvz", budget=ErrorBudget(eps=eps, scope="attention", weights=weights), bank=bank_path)
    r = KvzReader(tmp / "a.kvz", bank=bank_path)
    assert r.version == (1, 3)
    cfg = r.config
    assert cfg.channel_steps and cfg.stale_window == WINDOW and cfg.stale_scale == STALE_SCALE
    out = r.read()
    m = _measure(c, out, stats, cfg)
    w = np.array([weights[n] for n in c.layout.tensor_names()])
    a2 = np.array([e / n for e, n in m])
    assert float(np.sum(w * a2)) <= eps ** 2 * float(w.sum())  # the joint budget, measured on the decode
    assert float(np.sum(w * a2)) > 0.8 * eps ** 2 * float(w.sum())  # and spent
    assert np.all(np.sqrt(a2) <= 3.0 * eps + 1e-12)  # the tensor cap
    for ti, name in enumerate(c.layout.tensor_names()):  # the header's statistics are the decoded ones
        assert np.sqrt(a2[ti]) == pytest.approx(info.nrmse_tensor[name], rel=1e-9)


def test_steps_follow_the_weights(setup):
    c, bank_path, stats, weights, tmp = setup
    compress(c, tmp / "b.kvz", budget=ErrorBudget(eps=0.03, scope="attention", weights=weights), bank=bank_path)
    out = KvzReader(tmp / "b.kvz", bank=bank_path).read()
    first_live = T - (WINDOW - 1)
    for name in c.layout.tensor_names():
        x = c.tensors[name][0].astype(np.float64)
        e = np.abs(out[name][0].astype(np.float64) - x)
        assert e[1:first_live].mean() > 3.0 * e[first_live:].mean()  # stale rows: coarser
    k = c.tensors["layers.1.key"][0].astype(np.float64)
    e = (out["layers.1.key"][0].astype(np.float64) - k)[T - WINDOW + 1:] ** 2  # live rows
    kw = stats.key_weights()[1, 0]
    heavy, light = kw >= np.quantile(kw, 0.75), kw <= np.quantile(kw, 0.25)
    assert e[:, heavy].mean() < 0.5 * e[:, light].mean()


def test_other_scopes_write_no_13_keys(setup, tmp_path):
    c, bank_path, _, weights, _ = setup
    compress(c, tmp_path / "w.kvz", budget=ErrorBudget(eps=0.03, scope="weighted", weights=weights), bank=bank_path)
    r = KvzReader(tmp_path / "w.kvz", bank=bank_path)
    assert r.version == (1, 1)
    cj = r.config.to_json()
    assert "channel_steps" not in cj and "stale_window" not in cj


def test_bank_without_statistics_is_a_one_line_error(tmp_path):
    c = synthetic_cache(n_layers=L, T=300, d=D, roped=True)
    bank = fit_bank([c], rank=4)
    bank.save(tmp_path / "plain.h5")
    with pytest.raises(KvzError, match="kvz calibrate.*--attention-stats") as e:
        compress(c, tmp_path / "x.kvz", budget=ErrorBudget(eps=0.03, scope="attention", weights={n: 1.0 for n in c.layout.tensor_names()}), bank=tmp_path / "plain.h5")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "x.kvz").exists()


def test_config_rejects_bad_switches():
    with pytest.raises(KvzError):
        CodecConfig(channel_steps=True, align=True)
    with pytest.raises(KvzError):
        CodecConfig(stale_window=-1)
    with pytest.raises(KvzError):
        CodecConfig(stale_window=8, stale_scale=0.5)
    cfg = CodecConfig(stale_window=8, stale_scale=float(STALE_SCALE))
    assert CodecConfig.from_json(cfg.to_json()) == cfg


def test_header_checks(setup):
    c, bank_path, _, weights, tmp = setup
    compress(c, tmp / "h.kvz", budget=ErrorBudget(eps=0.05, scope="attention", weights=weights), bank=bank_path)
    h = KvzReader(tmp / "h.kvz", bank=bank_path).header
    check_header(h)
    lay = KvzReader(tmp / "h.kvz", bank=bank_path).layout
    assert all(m.step_codes is not None for m in tensor_metas(h, lay))

    def bad(mutate, match):
        g = copy.deepcopy(h)
        mutate(g)
        with pytest.raises(FormatError, match=match):
            check_header(g)
            tensor_metas(g, lay)

    bad(lambda g: g["tensors"][0].pop("step_codes"), "step_codes")
    bad(lambda g: g["tensors"][1].__setitem__("step_codes", "AAAA"), "step_codes")
    import base64
    zero = base64.b64encode(bytes(D)).decode()
    bad(lambda g: g["tensors"][2].__setitem__("step_codes", zero), "zero step code")
    bad(lambda g: g["codec"]["config"].pop("stale_scale"), "stale_window/stale_scale")
    bad(lambda g: g["codec"]["config"].__setitem__("stale_scale", 0.5), "stale_window/stale_scale")


def test_written_header_matches_the_schema(setup):
    jsonschema = pytest.importorskip("jsonschema")
    import json
    import os
    c, bank_path, _, weights, tmp = setup
    compress(c, tmp / "s.kvz", budget=ErrorBudget(eps=0.05, scope="attention", weights=weights), bank=bank_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    schema = json.load(open(os.path.join(root, "format_spec", "header.schema.json")))
    jsonschema.validators.validator_for(schema)(schema).validate(KvzReader(tmp / "s.kvz", bank=bank_path).header)


def _capture(c, seed=5):
    """Uneven per-position attention statistics for the synthetic cache (its token ids 0..T-1)."""
    from alignpred.bank import CaptureStats, tokens_digest
    rng = np.random.default_rng(seed)
    mass = rng.lognormal(0.0, 1.5, (L, 1, T))
    mass /= mass.sum(-1, keepdims=True)
    return CaptureStats(model=c.layout.model, n_tokens=T, tokens_sha256=tokens_digest(range(T)),
                        layer_types=tuple(c.layout.layer_types), pairing="half", q_channel=np.ones((L, 1, D)),
                        mass=mass, sq=mass ** 2, value_gram=np.broadcast_to(np.eye(D), (L, 1, D, D)))


@pytest.fixture(scope="module")
def with_ids(setup):
    """The setup's cache with the token ids its capture statistics are tied to."""
    import json

    from alignpred.cache.cachefile import Cache
    c = setup[0]
    meta = dict(c.metadata, token_ids=json.dumps(list(range(T))))
    return Cache(c.tensors, meta, c.layout)


def test_row_steps_follow_the_prefill_attention(setup, with_ids):
    from alignpred.codec.attention_steps import row_codes
    c, bank_path, stats, weights, tmp = setup
    cap = _capture(with_ids)
    compress(with_ids, tmp / "r.kvz", budget=ErrorBudget(eps=0.03, scope="attention", weights=weights, capture_stats=cap), bank=bank_path)
    r = KvzReader(tmp / "r.kvz", bank=bank_path)
    assert r.config.row_steps and r.version == (1, 3)
    want = row_codes(cap, with_ids.layout, r.config)
    first_live = T - (WINDOW - 1)
    for m, w in zip(r.metas, want):
        assert np.array_equal(m.row_codes, w)
        assert np.all(m.row_codes[:first_live] == 32)  # stale rows (and the sink) keep their own factors
        assert len(set(m.row_codes[first_live:].tolist())) > 4
    out = r.read()
    m = _measure_rows(with_ids, out, stats, r.config, [m.row_codes for m in r.metas])
    wt = np.array([weights[n] for n in c.layout.tensor_names()])
    a2 = np.array([e / n for e, n in m])
    assert float(np.sum(wt * a2)) <= 0.03 ** 2 * float(wt.sum())  # the budget holds in the measure with rows
    # a position that received more attention gets a finer step: smaller errors where the weight is high
    x = c.tensors["layers.2.key"][0].astype(np.float64)
    e = ((out["layers.2.key"][0].astype(np.float64) - x) ** 2).mean(axis=1)[first_live:]
    code = r.metas[4].row_codes[first_live:]
    assert e[code <= 16].mean() < 0.5 * e[code >= 64].mean()


def _measure_rows(c, out, stats, cfg, rcodes):
    codes = step_codes(stats, c.layout, cfg)
    res = []
    for ti, name in enumerate(c.layout.tensor_names()):
        wc = (32.0 / codes[ti].astype(np.float64)) ** 2
        g = np.ones(T, np.float32)
        cfg.scale_sink(g, 0, 0)
        cfg.scale_stale(g, 0, c.layout, ti // 2)
        g *= rcodes[ti].astype(np.float32) / np.float32(32)
        wr = 1.0 / g.astype(np.float64) ** 2
        x = c.tensors[name][0].astype(np.float64)
        dlt = out[name][0].astype(np.float64) - x
        res.append((float(np.einsum("tc,tc,c,t->", dlt, dlt, wc, wr)), float(np.einsum("tc,tc,c,t->", x, x, wc, wr))))
    return res


def test_capture_stats_of_another_prefill_are_refused(setup, with_ids):
    import json

    from alignpred.cache.cachefile import Cache
    c, bank_path, _, weights, tmp = setup
    other = Cache(c.tensors, dict(c.metadata, token_ids=json.dumps(list(range(1, T + 1)))), c.layout)
    with pytest.raises(KvzError, match="token"):
        compress(other, tmp / "o.kvz", budget=ErrorBudget(eps=0.03, scope="attention", weights=weights, capture_stats=_capture(with_ids)), bank=bank_path)
    with pytest.raises(KvzError, match="attention scope only"):
        compress(with_ids, tmp / "o2.kvz", budget=ErrorBudget(eps=0.03, scope="weighted", weights=weights, capture_stats=_capture(with_ids)), bank=bank_path)


def test_row_code_field_checks(setup, with_ids):
    import base64
    import zlib
    c, bank_path, _, weights, tmp = setup
    compress(with_ids, tmp / "rc.kvz", budget=ErrorBudget(eps=0.05, scope="attention", weights=weights, capture_stats=_capture(with_ids)), bank=bank_path)
    rd = KvzReader(tmp / "rc.kvz", bank=bank_path)
    h, lay = rd.header, rd.layout

    def bad(value, match):
        g = copy.deepcopy(h)
        g["tensors"][3]["row_codes"] = value
        with pytest.raises(FormatError, match=match):
            check_header(g)
            tensor_metas(g, lay)

    enc = lambda b: base64.b64encode(b).decode()  # noqa: E731
    bad(enc(zlib.compress(bytes([32]) * (T - 1))), "exactly")
    bad(enc(zlib.compress(bytes([32]) * (T + 1))), "exactly")
    bad(enc(zlib.compress(bytes([0]) + bytes([32]) * (T - 1))), "zero step code")
    bad(enc(b"not zlib at all"), "zlib")
    bad("%%%", "base64")
    g = copy.deepcopy(h)
    g["tensors"][0].pop("row_codes")
    with pytest.raises(FormatError, match="row_codes"):
        check_header(g)


def test_target_kl_takes_the_best_scope_the_bank_supports(setup, tmp_path):
    from alignpred import ErrorBudget
    c, bank_path, _, weights, _ = setup
    assert ErrorBudget.from_options(target_kl=1e-3).auto_scope
    assert not ErrorBudget.from_options(target_kl=1e-3, scope="weighted").auto_scope
    a = compress(c, tmp_path / "a.kvz", budget=ErrorBudget.from_options(weights=weights, target_kl=1e-3), bank=bank_path)
    assert a.scope == "attention"  # the bank has attention statistics
    w = compress(c, tmp_path / "w.kvz", budget=ErrorBudget(scope="weighted", weights=weights, target_kl=1e-3), bank=bank_path)
    assert w.scope == "weighted" and w.eps == a.eps
    plain = fit_bank([c], rank=4)
    plain.save(tmp_path / "plain.h5")
    p = compress(c, tmp_path / "p.kvz", budget=ErrorBudget.from_options(weights=weights, target_kl=1e-3),
                 bank=tmp_path / "plain.h5")
    assert p.scope == "weighted"  # no statistics: the weighted scope, as before


def _plain_read(c, out, name, layer_sliding=True):
    """Plain NRMSE of a tensor over the positions a later query reads (not the stale rows)."""
    x = c.tensors[name][0].astype(np.float64)
    d = out[name][0].astype(np.float64) - x
    first = T - (WINDOW - 1) if layer_sliding else 0
    return float(np.sqrt((d[first:] ** 2).sum() / (x[first:] ** 2).sum()))


@pytest.mark.parametrize("cap", [0.0, 0.06])
def test_plain_cap_holds_by_decoding(setup, with_ids, cap):
    from alignpred import ErrorBudget
    c, bank_path, _, weights, tmp = setup
    b = ErrorBudget(eps=0.05, scope="attention", weights=weights, plain_cap=cap, capture_stats=_capture(with_ids))
    info = compress(with_ids, tmp / f"pc{cap}.kvz", budget=b, bank=bank_path)
    r = KvzReader(tmp / f"pc{cap}.kvz", bank=bank_path)
    out = r.read()
    plain = [_plain_read(c, out, n) for n in c.layout.tensor_names()]
    if cap:
        assert max(plain) <= cap * (1 + 1e-9)
        assert r.header["codec"]["plain_cap"] == cap
        for m, p in zip(r.metas, plain):  # the header holds the decoded plain statistics
            assert np.sqrt(m.plain_sq_err / m.plain_sq_norm) == pytest.approx(p, rel=1e-9)
    else:
        assert max(plain) > 0.06  # the cap above binds: without it some tensor passes it
        assert "plain_cap" not in r.header["codec"] and r.metas[0].plain_sq_err is None
    assert info.nrmse_weighted <= 0.05 * (1 + 1e-9)
