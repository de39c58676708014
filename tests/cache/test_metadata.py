"""Cache metadata is validated up front: one KvzError naming the field, never a traceback or a hang."""
import json
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alignpred import Cache, KvzError, MetadataError, compress, fit_bank
from alignpred.cache.metadata import parse_metadata

L = 4


def kv(T=20, d=8):
    return {f"layers.{i}.{k}": np.ones((1, T, d), np.float16) for i in range(L) for k in ("key", "value")}


def parse(meta, T=20, d=8):
    return parse_metadata(meta, num_layers=L, head_dim=d, n_tokens=T)


@pytest.mark.parametrize("value, field, fix", [
    ('"null"', "rope_theta", "as a number"),           # the JSON string "null" is not a number
    ("null", "rope_theta", "remove the field"),
    ('["a", "b", "c", "d"]', "rope_theta[0]", "as a number"),
    ("Infinity", "rope_theta", "finite number > 1"),
    ("NaN", "rope_theta", "finite number > 1"),
    ("0", "rope_theta", "finite number > 1"),
    ("-10000", "rope_theta", "finite number > 1"),
    ("[10000, 10000]", "rope_theta", "one base per layer"),
    ('{"full_attention": 1e6}', "rope_theta", "needs layer_types"),
])
def test_bad_rope_theta(value, field, fix):
    with pytest.raises(MetadataError, match=fix) as e:
        parse({"rope_theta": value, "keys_roped": "true"})
    assert f"'{field}'" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("value, want", [
    ("500000.0", (500000.0,) * L),
    ('"500000.0"', (500000.0,) * L),                    # a number written as a JSON string
    ("[1e4, 1e4, 1e6, 1e4]", (1e4, 1e4, 1e6, 1e4)),
])
def test_good_rope_theta(value, want):
    assert parse({"rope_theta": value, "keys_roped": "true"})["rope_theta"] == want


def test_rope_theta_keyed_by_layer_type():
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    got = parse({"rope_theta": json.dumps({"full_attention": 1e6, "sliding_attention": 1e4}),
                 "layer_types": json.dumps(types), "keys_roped": "true"})
    assert got["rope_theta"] == (1e4, 1e4, 1e6, 1e4)
    with pytest.raises(MetadataError, match="no base for layer type 'full_attention'"):
        parse({"rope_theta": json.dumps({"sliding_attention": 1e4}), "layer_types": json.dumps(types),
               "keys_roped": "true"})


@pytest.mark.parametrize("meta, match", [
    ({"keys_roped": "maybe"}, "'keys_roped': 'maybe' is not a boolean"),
    ({"layer_types": "[1, 2, 3, 4]"}, "'layer_types': must be a list of non-empty strings"),
    ({"layer_types": '["a", "b"]'}, "2 entries for 4 layers"),
    ({"position_offset": "-1"}, "'position_offset'"),
    ({"position_offset": "1.5"}, "'position_offset'"),
    ({"rope_pairing": "diagonal"}, "'rope_pairing'"),
    ({"keys_roped": "true"}, "no RoPE parameters"),
    ({"rope_theta": "10000"}, "'keys_roped': missing"),
    ({"token_ids": "[1, 2]"}, "2 ids for 20 positions"),
    ({"token_ids": '["x"]'}, "'token_ids'"),
    ({"rope": '{"tables": []}'}, "'rope'"),
    ({"model": 5}, "'model'"),
])
def test_bad_fields(meta, match):
    with pytest.raises(MetadataError, match=match):
        parse(meta)


def test_bad_theta_fails_before_any_work():
    """NaN/0/negative θ used to flood warnings for minutes, Infinity to fail after 20 s."""
    bank = fit_bank([Cache.from_arrays(kv())], rank=None)
    for theta in ("NaN", "0", "-1", "Infinity"):
        t0 = time.perf_counter()
        with pytest.raises(KvzError):
            compress(Cache.from_arrays(kv(), {"rope_theta": theta, "keys_roped": "true"}), None, budget=0.05, bank=bank)
        assert time.perf_counter() - t0 < 1.0


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
_fields = st.sampled_from(["model", "layer_types", "rope_theta", "rope_pairing", "keys_roped", "position_offset",
                           "token_ids", "rope", "format", "kvz.version", "source"])
_values = st.one_of(_json_values.map(lambda v: json.dumps(v, allow_nan=True)), st.text(max_size=30), _json_values)


@pytest.mark.slow  # 400 fuzzed metadata dicts through the codec
@settings(max_examples=400, deadline=1000, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_fields, _values, max_size=6))
def test_metadata_fuzz_only_kvz_errors(meta):
    """Any metadata: a layout, or a KvzError, each under a second."""
    t0 = time.perf_counter()
    try:
        Cache.from_arrays(kv(), meta)
    except KvzError:
        pass
    assert time.perf_counter() - t0 < 1.0
