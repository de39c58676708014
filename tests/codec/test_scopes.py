"""Contract tests of the rate-control scopes (alignpred.codec.scopes): every strategy of the registry,
on the same synthetic cache, meets its budget as its own flags and units define it, measured by
decoding; its units are well formed; what the header records follows its flags."""

import numpy as np
import pytest
from kvz_testing import attention_setup

from alignpred import CodecConfig, ErrorBudget, KvzError, KvzReader, compress
from alignpred.api.describe import summarize
from alignpred.bank import AttentionStats
from alignpred.codec import JOINT, SCOPE_REGISTRY, SCOPES, Scope, scope_of
from alignpred.codec.attention_steps import step_codes
from alignpred.codec.budget import WEIGHTED
from alignpred.codec.chain import obj_sums

T, D, L, WINDOW, EPS = 600, 32, 2, 64, 0.03
NAMES = [s.name for s in SCOPE_REGISTRY]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A roped synthetic cache (sliding layers), its bank with an attention-statistics sidecar, and
    uneven tensor weights."""
    tmp = tmp_path_factory.mktemp("scopes")
    c, bank_path, _, weights = attention_setup(tmp, n_layers=L, T=T, d=D, window=WINDOW, seeds=(5, 6, 1),
                                               key_sigma=1.0, top_weight=2.0)
    return c, bank_path, weights, tmp


def _budget(s: Scope, weights) -> ErrorBudget:
    return ErrorBudget(eps=EPS, scope=s.name, weights=weights if s.weighted else None)


def _object_errors(c, out, r, strategy):
    """Squared error and norm of every object ``[n_tensors, n_obj]``, in the strategy's measure."""
    cfg, S = r.config, r.config.object_size
    codes = step_codes(AttentionStats.find(r._resolve_bank()), c.layout, cfg) if strategy.attention else None
    err, norm = [], []
    for ti, name in enumerate(c.layout.tensor_names()):
        x = c.tensors[name][0].astype(np.float64)
        dlt = out[name][0].astype(np.float64) - x
        wc = np.ones(D) if codes is None else (32.0 / codes[ti].astype(np.float64)) ** 2
        wr = np.ones(T)
        if strategy.attention:
            g = np.ones(T, np.float32)
            cfg.scale_sink(g, 0, 0)
            cfg.scale_stale(g, 0, c.layout, ti // 2)
            wr = 1.0 / g.astype(np.float64) ** 2
        err.append(obj_sums(np.einsum("tc,tc,c,t->t", dlt, dlt, wc, wr), S))
        norm.append(obj_sums(np.einsum("tc,tc,c,t->t", x, x, wc, wr), S))
    return np.array(err), np.array(norm)


def test_registry_is_the_scope_names():
    assert SCOPES == ("object", "tensor", "pooled", "weighted", "attention") == tuple(NAMES)
    assert JOINT == tuple(s.name for s in SCOPE_REGISTRY if s.joint) == ("pooled", "weighted", "attention")
    assert WEIGHTED == tuple(s.name for s in SCOPE_REGISTRY if s.weighted) == ("weighted", "attention")
    assert [s.name for s in SCOPE_REGISTRY if s.default] == ["tensor"]
    assert ErrorBudget(eps=EPS).strategy.default
    for s in SCOPE_REGISTRY:
        assert scope_of(s.name) is s and isinstance(s, Scope)
        assert ErrorBudget(eps=EPS, scope=s.name, weights={} if s.weighted else None).strategy is s
        assert not s.attention or s.weighted  # the attention scope is a weighted one
        assert not s.weighted or s.joint  # weights are a joint budget's
        assert s.stats_scope is None or scope_of(s.stats_scope).attention


@pytest.mark.parametrize("name", ["objects", "", "Tensor", None, 3])
def test_unknown_scope_is_the_same_error(name):
    msg = f"unknown eps scope {name!r}; use one of object, tensor, pooled, weighted, attention"
    with pytest.raises(KvzError) as e:
        ErrorBudget(eps=EPS, scope=name)
    assert str(e.value) == msg
    with pytest.raises(KvzError) as e:
        scope_of(name)
    assert str(e.value) == msg


@pytest.mark.parametrize("s", SCOPE_REGISTRY, ids=NAMES)
def test_units_are_well_formed(s):
    for n_t, n_obj in ((1, 1), (4, 3), (6, 10)):
        u = s.units(n_t, n_obj)
        assert u.shape == (n_t, n_obj) and u.dtype.kind == "i"
        n_u = int(u.max()) + 1
        assert sorted(set(u.ravel().tolist())) == list(range(n_u))  # units 0..n_u-1, all used
        for ti in range(n_t):  # a unit never spans tensors
            assert not set(u[ti].tolist()) & set(np.delete(u, ti, axis=0).ravel().tolist())
        if s.joint:
            assert n_u == n_t  # the joint search ties the tensors' steps together, one unit each
    norms, rows = np.array([4.0, 9.0, 1.0]), np.array([100, 100, 50])
    target, d0 = s.sample_units(EPS, norms, rows)
    n_u = int(s.units(1, 3).max()) + 1
    assert target.shape == d0.shape == (n_u,)
    assert np.sum(target) == pytest.approx(EPS ** 2 * norms.sum())  # the budget of the tensor's units
    assert s.expand(d0, 3).shape == (3,)
    assert s.unit_errors(np.ones(3)).shape == (n_u,)
    steps = np.broadcast_to(s.spread(d0, d0, np.arange(3), lambda: np.full(3, 7.0)), (3,))
    assert np.array_equal(steps, s.expand(d0, 3))  # the sampled objects keep the sample's steps


@pytest.mark.parametrize("object_size", [256, 64], ids=["sample-is-the-cache", "whole-cache-search"])
@pytest.mark.parametrize("s", SCOPE_REGISTRY, ids=NAMES)
def test_budget_is_met_as_the_scope_defines_it(setup, s, object_size):
    c, bank_path, weights, tmp = setup
    p = tmp / f"{s.name}-{object_size}.kvz"
    info = compress(c, p, budget=_budget(s, weights), bank=bank_path, config=CodecConfig(object_size=object_size))
    r = KvzReader(p, bank=bank_path)
    out = r.read()
    for n, x in c.tensors.items():
        assert out[n].dtype == x.dtype and out[n].shape == x.shape
    err, norm = _object_errors(c, out, r, s)
    assert err.shape[1] == -(-T // object_size) and (object_size == 256) == (err.shape[1] <= 8)
    unit = s.units(*err.shape)
    e_u, n_u = np.bincount(unit.ravel(), err.ravel()), np.bincount(unit.ravel(), norm.ravel())
    if s.joint:  # one budget over the cache, every tensor within its cap
        nrmse2 = e_u / n_u
        if s.weighted:  # sum_t w_t NRMSE_t^2 <= eps^2 sum_t w_t
            w = np.array([weights[n] for n in c.layout.tensor_names()])
            spent, budget = float(np.sum(w * nrmse2)), EPS ** 2 * float(w.sum())
        else:  # the pooled NRMSE
            spent, budget = float(np.sum(e_u)), EPS ** 2 * float(np.sum(n_u))
        assert budget * 0.8 < spent <= budget * (1 + 1e-9)  # met, and spent
        assert np.all(np.sqrt(nrmse2) <= 3.0 * EPS * (1 + 1e-9))
    else:  # every unit on its own
        assert np.all(e_u <= EPS ** 2 * n_u * (1 + 1e-9))
        assert np.sum(e_u) > 0.8 * EPS ** 2 * np.sum(n_u)
    plain = {n: float(np.linalg.norm(out[n].astype(np.float64) - x) / np.linalg.norm(x.astype(np.float64)))
             for n, x in c.tensors.items()}
    if not s.attention:  # the header's statistics are the decoded ones (attention: in its measure)
        for n in plain:
            assert plain[n] == pytest.approx(info.nrmse_tensor[n], rel=1e-6)


@pytest.mark.parametrize("s", SCOPE_REGISTRY, ids=NAMES)
def test_header_records_what_the_flags_say(setup, s):
    c, bank_path, weights, tmp = setup
    p = tmp / f"h-{s.name}.kvz"
    compress(c, p, budget=_budget(s, weights), bank=bank_path)
    r = KvzReader(p, bank=bank_path)
    codec = r.header["codec"]
    assert codec["eps_scope"] == r.scope == s.name
    assert ("tensor_weights" in codec) == s.weighted
    assert ("tensor_cap" in codec) == s.joint  # the cap is the joint scopes' (0 for the others)
    assert ("plain_cap" in codec) == s.attention
    assert bool(r.config.channel_steps) == s.attention
    assert summarize(r)["error_measure"] == s.measure == ("attention" if s.attention else "plain")
    if s.weighted:
        assert r.version >= (1, 1)
