"""benchmarks.rate_quality: the interpolation (monotone, never extrapolated), the row schema and aggregation, the
baseline roster, the ``kvz bench --quality`` wiring, and a tiny end-to-end run on a random-weight Gemma-3-shaped model
(no model package needed)."""
import math

import numpy as np
import pytest

from kvz.benchmarks import rate_quality as R

# ---------------------------------------------------------------------------- interpolation

def test_pareto_keeps_only_points_not_beaten_by_cheaper_ones():
    pts = [(3.0, 4e-3), (1.0, 5e-2), (2.0, 1e-2), (2.5, 2e-2), (4.0, 1e-3), (4.0, 5e-4), (5.0, 0.0), (6.0, None)]
    fr = R.pareto(pts)
    assert fr == [(1.0, 5e-2), (2.0, 1e-2), (3.0, 4e-3), (4.0, 5e-4)]
    assert all(b0 < b1 and k0 > k1 for (b0, k0), (b1, k1) in zip(fr, fr[1:]))


def test_bpv_at_kl_interpolates_in_log_kl():
    pts = [(2.0, 1e-2), (3.0, 1e-3), (4.0, 1e-4)]
    e = R.bpv_at_kl(pts, 10 ** -2.5)
    assert e["status"] == "interpolated" and e["bpv"] == pytest.approx(2.5)
    assert R.bpv_at_kl(pts, 1e-3) == {"bpv": 3.0, "status": "measured", "bound": None}
    # a dominated point (more bits, worse KL) does not bend the curve
    assert R.bpv_at_kl(pts + [(3.5, 5e-3)], 10 ** -3.5)["bpv"] == pytest.approx(3.5)


def test_bpv_at_kl_never_extrapolates():
    pts = [(2.0, 1e-2), (3.0, 1e-3)]
    above = R.bpv_at_kl(pts, 5e-2)  # even the cheapest point is better than the target
    assert above == {"bpv": None, "status": "above range", "bound": 2.0}
    below = R.bpv_at_kl(pts, 1e-4)  # no point reaches the target
    assert below == {"bpv": None, "status": "below range", "bound": 3.0}
    assert R.bpv_at_kl([], 1e-3)["status"] == "no points"
    assert R.bpv_at_kl(pts, 0.0)["bpv"] is None
    assert R.bpv_at_kl([(2.0, 1e-2)], 1e-2)["bpv"] == 2.0


def test_bpv_at_kl_is_monotone_in_the_target():
    rng = np.random.default_rng(1)
    for _ in range(20):
        b = np.sort(rng.uniform(1, 8, 6))
        k = np.exp(-b + rng.normal(0, 0.5, 6))  # noisy, not monotone
        pts = list(zip(b, k))
        targets = np.exp(np.linspace(np.log(k.min()), np.log(k.max()), 40))[::-1]  # decreasing KL target
        vals = [R.bpv_at_kl(pts, t)["bpv"] for t in targets]
        vals = [v for v in vals if v is not None]
        assert vals and all(v1 >= v0 - 1e-12 for v0, v1 in zip(vals, vals[1:]))
        assert all(b.min() - 1e-12 <= v <= b.max() + 1e-12 for v in vals)


# ---------------------------------------------------------------------------- aggregation and report

def _rows():
    rows = []
    curves = {"fp8": [("e4m3", 8.0, 2e-3)], "kvz-tensor": [("eps=0.05", 3.0, 8e-3), ("eps=0.02", 4.0, 1e-3)],
              "tq": [("3 bit", 3.06, 5e-2), ("4 bit", 4.06, 1.5e-2)], "bf16": [("bf16", 16.0, 1e-5)]}
    for doc, f in (("a", 1.0), ("b", 2.0)):
        for start in (0, 100):
            for m, pts in curves.items():
                for s, b, k in pts:
                    rows.append({"method": m, "setting": s, "doc": doc, "prompt": start // 100, "start": start,
                                 "bpv": b, "kl_mean": k * f, "kl_max": 3 * k * f, "top1": 0.99, "nll_ref": 2.0,
                                 "nll": 2.0 + k * f, "ppl_rel_change": math.expm1(k * f), "nrmse_pooled": 0.02,
                                 "nrmse_max": 0.03})
    return rows


def test_identical_greedy_is_aggregated_and_reported():
    rows = _rows()
    for r in rows:
        r["greedy_identical"] = float(r["method"] != "tq" or r["doc"] == "a")
    agg = R.aggregate(rows)
    tq = {p["setting"]: p["identical"] for p in agg["curves"]["tq"]["overall"]}
    assert set(tq.values()) == {0.5} and agg["curves"]["fp8"]["overall"][0]["identical"] == 1.0
    md = R.format_report({"model": "m", "aggregate": agg, "config": {"per_doc": 2, "context": 8, "score_tokens": 4,
                                                                     "greedy_tokens": 16}, "timing": {}})
    assert "| identical greedy |" in md and "| 50% |" in md
    del rows[0]["greedy_identical"]  # rows of a run that did not measure it: no number, not a wrong one
    assert R.aggregate(rows)["curves"]["fp8"]["overall"][0]["identical"] is None


def test_long_preset_has_long_contexts():
    assert R.PRESETS["long"]["context"] >= 1024 and "kvz-attention" in R.PRESETS["long"]["kvz_eps"]
    ws = R.windows(R.documents("eval", ["licence-text"]), 1, 1024, 8, _Tok())
    assert len(ws[0]["token_ids"]) == 1024 + 8 + 1
    with pytest.raises(ValueError, match="context"):
        R.windows(R.documents("eval", ["licence-text"]), 1, R.MAX_CONTEXT + 1, 8, _Tok())


def test_aggregate_targets_and_schema():
    rows = _rows()
    for r in rows:
        assert set(R.ROW_KEYS) <= set(r)
    rows.append({**rows[0], "doc": "c", "start": 0})  # an incomplete prompt (one setting only): left out
    agg = R.aggregate(rows)
    assert agg["docs"] == ["a", "b"] and agg["n_prompts"] == 4
    t = agg["targets"]
    assert t["overall"]["fp8_kl"] == pytest.approx(3e-3) and t["a"]["fp8_kl"] == pytest.approx(2e-3)
    assert t["overall"]["2x_fp8_kl"] == pytest.approx(6e-3)
    kt = agg["at_target"]["kvz-tensor"]
    # overall kvz KL: 1.2e-2 at 3 bpv, 1.5e-3 at 4 bpv
    want = 3.0 + math.log(1.2e-2 / 3e-3) / math.log(1.2e-2 / 1.5e-3)
    assert kt["overall"]["fp8_kl"]["bpv"] == pytest.approx(want)
    assert agg["at_target"]["tq"]["overall"]["fp8_kl"]["status"] == "below range"
    p = agg["curves"]["kvz-tensor"]["overall"][0]
    assert p["n"] == 4 and p["ppl_rel_change"] == pytest.approx(math.expm1(np.mean([8e-3, 8e-3, 1.6e-2, 1.6e-2])))
    md = R.format_report({"model": "m", "aggregate": agg, "rows": rows,
                          "config": {"per_doc": 2, "context": 256, "score_tokens": 64, "command": "x"},
                          "timing": {"total_s": 60}})
    assert "bpv at FP8 e4m3's KL" in md and "> 4.06" in md and "kvz-tensor" in md
    v = "\n".join(R.verdict(agg))
    assert "kvz-tensor at FP8's KL" in v and "fewer" in v


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    agg = R.aggregate(_rows())
    R.plot({"model": "m", "aggregate": agg}, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_baseline_roster():
    import kvz.benchmarks.baselines as B

    specs = R.baseline_specs(R.PRESETS["full"]["baselines"], (0.02, 0.04))
    names = {s["name"] for s in specs}
    assert "fp8_e4m3" in names and {s["curve"] for s in specs if s["name"] == "fp8_e4m3"} == {R.REFERENCE_METHOD}
    for s in specs:
        assert s["name"] in B.BASELINES
        if s["name"].startswith("turboquant_mse"):
            assert s["curve"] == "turboquant_mse"
    assert sum(s["name"] == "kvtc" for s in specs) == (2 if "kvtc" in B.available() else 0)
    assert R.codec_points("turboquant_prod_2p5") == ("turboquant_prod", "2.5 bit")
    assert R.codec_points("kivi2_r128") == ("kivi_r128", "2 bit")
    assert R.codec_points("kvquant3_calib") == ("kvquant_calib", "3 bit")
    assert R.codec_points("zfp") is None


def test_covrot_points():
    """The covariance-rotation peer (covrot post-RoPE, covrot_pre pre-RoPE) runs at 2 to 5 bits in the full
    preset (3 bits in the quick one), as a calibrated coder, and ``--methods covrot`` selects it."""
    want = {(c, f"{b} bit") for c in ("covrot", "covrot_pre") for b in (2, 3, 4, 5)}
    full = {(s["curve"], s["label"]) for s in R.baseline_specs(R.PRESETS["full"]["baselines"])}
    assert want <= full
    quick = {(s["curve"], s["label"]) for s in R.baseline_specs(R.PRESETS["quick"]["baselines"])}
    assert {("covrot", "3 bit"), ("covrot_pre", "3 bit")} <= quick
    assert R.codec_points("covrot3") == ("covrot", "3 bit")  # the fixed-rate coder is the same point as covrot@3
    s = R.build_settings(R.PRESETS["full"], bank=None, methods=["covrot", "covrot_pre"])
    assert {(st.curve, st.label) for st in s.values()} == want and R.needs_calib(s)
    from kvz.benchmarks.quality import KV

    with pytest.raises(ValueError, match="calibration"):  # never coded without calibration caches
        next(iter(s.values()))(KV({"layers.0.key": np.ones((1, 4, 8), np.float32)}))


def test_kvz_variant_is_one_line(monkeypatch):
    monkeypatch.setitem(R.KVZ_VARIANTS, "kvz-custom", {"fn": lambda kv, eps: ({k: v for k, v in kv.items()},
                                                                             4 * sum(v.size for v in kv.values()))})
    pre = {"kvz_eps": {"*": (0.03,)}, "baselines": (), "error_eps": ()}
    s = R.build_settings(pre, bank=None, methods=["kvz-custom"])
    (name, st), = s.items()
    assert name == "kvz-custom | eps=0.03" and st.curve == "kvz-custom"
    kv = {"layers.0.key": np.ones((1, 4, 8), np.float32)}
    from kvz.benchmarks.quality import KV

    out = st(KV(kv))
    assert st.info["bpv"] == 4.0 and np.array_equal(out["layers.0.key"], kv["layers.0.key"])


def test_bench_quality_wiring(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from kvz.cli.main import cli

    seen = {}

    def fake_run(preset, **kw):
        seen.update(kw, preset=preset)
        return {"rows": [], "aggregate": R.aggregate(_rows())}

    monkeypatch.setattr(R, "run", fake_run)
    res = CliRunner().invoke(cli, ["bench", "--quality-only", "--quick", "--out", str(tmp_path), "-q"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert seen["preset"] == "quick" and seen["json_out"].endswith("rate_quality.json")
    assert seen["plot_out"].endswith("rate_quality.png") and "--quality-only" in seen["command"]


# ---------------------------------------------------------------------------- tiny end-to-end

class _Tok:
    bos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (ord(c) % 200) for c in text]}


def _tiny_gemma():
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    from kvz.integrations.hf.bridge import text_config  # noqa: F401  (same config access as the benchmark)

    types = ["sliding_attention"] * 5 + ["full_attention"]
    cfg = tr.Gemma3TextConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=18,
                              num_attention_heads=1, num_key_value_heads=1, head_dim=256, sliding_window=512,
                              layer_types=types * 3, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = tr.Gemma3ForCausalLM(cfg).float().eval()
    return model


@pytest.mark.slow
def test_tiny_end_to_end(tmp_path):
    """Random-weight model shaped like Gemma 3 270M's cache (18 layers, 1 KV head, head_dim 256): every metric
    comes from decoding and running the model; the bf16 floor is tiny, FP8 costs more, bits are counted."""
    model = _tiny_gemma()
    from alignpred.bank import find

    bank = find("gemma-3-270m")
    tok = _Tok()
    ps = R.windows(R.documents("eval", ["python-code"]), 1, 24, 6, tok)
    assert len(ps) == 1 and len(ps[0]["token_ids"]) == 24 + 6 + 1 - 1 + 1
    pre = {"kvz_eps": {"kvz-tensor": (0.05,), "kvz-attention": (0.05,), "*": ()}, "error_eps": (),
           "baselines": ("fp8_e4m3", "bf16", "kivi4_r128")}
    settings = R.build_settings(pre, bank)
    out = R.run_rate_quality(settings, ps, context=24, score_tokens=6, model=model, progress=False)
    rows = {(r["method"], r["setting"]): r for r in out["rows"]}
    assert len(rows) == len(settings)
    for r in rows.values():
        assert set(R.ROW_KEYS) <= set(r) and r["bpv"] > 0 and 0 <= r["top1"] <= 1 and r["kl_mean"] >= 0
        assert r["greedy_identical"] in (0.0, 1.0)
    assert rows[("bf16", "bf16")]["greedy_identical"] == 1.0  # the storage precision continues as the exact cache
    assert rows[("kvz-attention", "eps=0.05")]["bpv"] < 16  # the scope ran (bank statistics, the prefill's attention)
    assert out["prompts"][0]["inject_check_max_abs_logprob"] < 1e-5
    assert rows[("bf16", "bf16")]["kl_mean"] < rows[("fp8", "e4m3")]["kl_mean"]
    assert rows[("fp8", "e4m3")]["bpv"] == pytest.approx(8.0, abs=0.1)
    k = rows[("kvz-tensor", "eps=0.05")]
    assert k["nrmse_max"] <= 0.05 * 1.001 and k["bpv"] < 16
    agg = R.aggregate(out["rows"])
    assert agg["n_prompts"] == 1 and "overall" in agg["targets"]


# ---------------------------------------------------------------------------- sensitivity summary

def test_sensitivity_summary_recovers_an_additive_model():
    from benchmarks.studies.rate import sensitivity as S

    names = S._names(2)
    true_w = dict(zip(names, (0.5, 0.01, 2.0, 0.02)))
    T, eps = 16, 0.02
    rng = np.random.default_rng(0)

    def prompt():
        nr = {k: eps * rng.uniform(0.8, 1.2) for k in names}
        pos = {str(p): (10.0 if p == 0 else 0.5) * S.POSITION_SCALE ** 2 * 1e-3 / T for p in (0, 1, 7, 9, 15)}
        pos.update({"0.key": pos["0"] * 0.7, "0.value": pos["0"] * 0.3})
        return {"doc": "d", "start": 0, "single": {"codec": {k: true_w[k] * nr[k] ** 2 for k in names}},
                "nrmse": {"codec": nr}, "all": {"codec": sum(true_w[k] * nr[k] ** 2 for k in names)},
                "checks": {"kvz pooled nocap eps": {"kl": sum(true_w[k] * (2 * nr[k]) ** 2 for k in names),
                                                    "bpv": 3.0, "nrmse": {k: 2 * nr[k] for k in names}}},
                "pos_uniform_kl": 1e-3, "pos": pos, "attention": np.full((2, T), 1 / (2 * T)).tolist()}

    raw = {"prompts": [prompt(), prompt()], "names": names, "eps": eps, "context": T, "score_tokens": 8,
           "modes": ["codec"], "seconds": 1.0}
    s = S.summarize(raw)
    assert s["weights"]["codec"] == pytest.approx(true_w, rel=1e-9)
    c = s["checks"]["codec: all tensors at eps"]
    assert c["measured"] == pytest.approx(c["predicted"]) == pytest.approx(c["sum_of_singles"])
    assert s["checks"]["kvz pooled nocap eps"]["ratio_measured_to_predicted"] == pytest.approx(1.0)
    tw = s["token_weights"]
    assert tw["per_position"]["0"] == pytest.approx(10.0) and tw["per_position"]["9"] == pytest.approx(0.5)
    assert tw["profile"]["sink"] == pytest.approx(10.0) and tw["profile"]["recent"] == pytest.approx(0.5)
    res = {"model": "m", "summary": s, "tensor_weights": s["weights"]["codec"], "n_prompts": 2, "docs": ["d"],
           "context": T, "score_tokens": 8, "method": "codec", "eps": eps, "kl_per_nrmse2": sum(true_w.values()),
           "command": "c", "seconds": 1.0, "token_weights": tw, "layer_types": ["full_attention"] * 2}
    md = S.format_report(res)
    assert "Keys carry" in md and "measured / predicted" in md


def test_bundled_sensitivity_file():
    """The shipped weights: one per tensor of the bundled bank's model, positive, summing to kl_per_nrmse2."""
    import json
    from pathlib import Path

    p = Path(R.ROOT) / "alignpred" / "bank" / "data" / "gemma-3-270m.sensitivity.json"
    if not p.exists():
        pytest.skip("no sensitivity file")
    d = json.loads(p.read_text())
    from alignpred.bank import find

    assert d["model"] == "gemma-3-270m" and d["bank_id"] == find("gemma-3-270m").id
    w = d["tensor_weights"]
    assert len(w) == 36 and all(v > 0 for v in w.values())
    assert d["kl_per_nrmse2"] == pytest.approx(sum(w.values()))
    assert d["token_weights"]["profile"]["sink"] > 1 and d["method"] and d["command"]
