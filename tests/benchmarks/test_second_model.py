"""benchmarks.second_model: argument handling, the attention / weighted ratio at FP8's KL (values and bounds), and
the report assembled from rows (no model is loaded)."""
import math

import pytest

from benchmarks.studies.rate import second_model as S


def _row(method, setting, doc, bpv, kl, start=0, top1=1.0, dnll=0.0):
    return {"method": method, "setting": setting, "doc": doc, "start": start, "prompt": 0, "bpv": bpv,
            "kl_mean": kl, "top1": top1, "nll_ref": 1.0, "nll": 1.0 + dnll, "nrmse_pooled": 0.02,
            "nrmse_max": 0.05, "greedy_identical": 1.0}


def _rows(doc, fp8_kl, weighted, attention):
    """FP8 at 8 bpv and ``fp8_kl``; the kvz curves as [(bpv, kl)] per eps."""
    rows = [_row("fp8", "e4m3", doc, 8.0, fp8_kl, dnll=0.01)]
    for m, pts in ((S.WEIGHTED, weighted), (S.ATTENTION, attention)):
        rows += [_row(m, f"eps={i}", doc, b, k) for i, (b, k) in enumerate(pts)]
    return rows


def test_parse_args_lists_and_checks():
    a = S.parse_args(["--model", "m.gguf", "--bank", "b.h5", "--json", "o.json", "--contexts", "256, 1024",
                      "--eps", "0.0134,0.0534", "--docs", "python-code,json-records"])
    assert a.contexts == [256, 1024] and a.eps == [0.0134, 0.0534]
    assert a.docs == ("python-code", "json-records") and a.per_doc == 1 and a.score_tokens == 32
    assert S.parse_args(["--model", "m", "--bank", "b", "--json", "o", "--docs", "all"]).docs == "all"
    assert S.parse_args(["--model", "m", "--bank", "b", "--json", "o"]).eps == list(S.DEFAULT_EPS)
    for bad in (["--contexts", "1"], ["--contexts", "x"], ["--eps", "0"], ["--per-doc", "0"]):
        with pytest.raises(SystemExit):
            S.parse_args(["--model", "m", "--bank", "b", "--json", "o", *bad])


def test_ratio_of_values_and_bounds():
    val = {"bpv": 3.0, "status": "interpolated", "bound": None}
    assert S.ratio_of({"bpv": 2.1, "status": "interpolated", "bound": None}, val) == pytest.approx(
        {"ratio": 0.7, "kind": "="})
    # attention already better than the target at its cheapest point: an upper bound on the ratio
    above = {"bpv": None, "status": "above range", "bound": 2.4}
    assert S.ratio_of(above, val) == pytest.approx({"ratio": 0.8, "kind": "<"})
    # attention never reached the target: a lower bound
    below = {"bpv": None, "status": "below range", "bound": 3.3}
    assert S.ratio_of(below, val) == pytest.approx({"ratio": 1.1, "kind": ">"})
    # weighted never reached it (its bpv is > bound): the ratio is below attention / bound
    assert S.ratio_of({"bpv": 2.0, "status": "measured", "bound": None}, below)["kind"] == "<"
    # both bounds in the same direction say nothing
    assert S.ratio_of(above, above) == {"ratio": None, "kind": None}
    assert S.ratio_of(None, val) == {"ratio": None, "kind": None}


def test_meets_decides_only_what_follows():
    assert S.meets({"ratio": 0.75, "kind": "="}) is True
    assert S.meets({"ratio": 0.85, "kind": "="}) is False
    assert S.meets({"ratio": 0.7, "kind": "<"}) is True
    assert S.meets({"ratio": 0.9, "kind": "<"}) is None  # < 0.9 does not decide <= 0.8
    assert S.meets({"ratio": 0.9, "kind": ">"}) is False
    assert S.meets({"ratio": 0.5, "kind": ">"}) is None
    assert S.meets({"ratio": None, "kind": None}) is None


def test_verdict_from_rows_per_doc_and_overall():
    # doc a: weighted crosses FP8's KL 1e-3 at 3.0 bpv, attention at 2.0 -> ratio 2/3
    # doc b: both cross 1e-3 at 4.0 and 3.8 -> 0.95
    rows = _rows("a", 1e-3, [(2.0, 1e-2), (4.0, 1e-4)], [(1.0, 1e-2), (3.0, 1e-4)])
    rows += _rows("b", 1e-3, [(3.0, 1e-2), (5.0, 1e-4)], [(2.8, 1e-2), (4.8, 1e-4)])
    res = S.assemble("tiny", {"docs": ["a", "b"], "per_doc": 1, "score_tokens": 4, "eps": [0.01, 0.02],
                              "commands": ["kvz calibrate x", "python -m benchmarks.studies.rate.second_model y"]},
                     {"64": {"rows": rows, "prompts": []}})
    v = {r["scope"]: r for r in res["verdict"]["64"]}
    assert set(v) == {"overall", "a", "b"}
    assert v["a"][S.WEIGHTED]["at_fp8"]["bpv"] == pytest.approx(3.0)
    assert v["a"]["ratio"] == pytest.approx(2.0 / 3.0) and v["a"]["meets"] is True
    assert v["b"]["ratio"] == pytest.approx(3.8 / 4.0) and v["b"]["meets"] is False
    # overall: the curves averaged over both docs (bpv 2.5/4.5, 1.9/3.9 at KL 1e-2/1e-4) -> 2.9 / 3.5
    assert v["overall"]["ratio"] == pytest.approx(2.9 / 3.5) and v["overall"]["meets"] is False
    assert v["overall"]["fp8_ppl_rel_change"] == pytest.approx(math.expm1(0.01))
    assert v["a"][S.ATTENTION]["nearest"]["setting"] in ("eps=0", "eps=1")
    md = S.markdown(res)
    assert "## Verdict at context 64" in md and "| a | 1.00e-03 | 8.00 |" in md and "0.667" in md
    assert "    kvz calibrate x" in md and "`python -m benchmarks.studies.rate.second_model y`" in md


def test_verdict_with_attention_out_of_range():
    # attention's cheapest point already beats FP8's KL: only an upper bound on the ratio
    rows = _rows("a", 1e-3, [(2.0, 1e-2), (4.0, 1e-4)], [(2.2, 5e-4), (3.0, 1e-4)])
    res = S.assemble("tiny", {"docs": ["a"], "per_doc": 1, "score_tokens": 4, "eps": [0.01]},
                     {"256": {"rows": rows, "prompts": []}})
    r = res["verdict"]["256"][0]
    assert r["ratio_kind"] == "<" and r["ratio"] == pytest.approx(2.2 / 3.0) and r["meets"] is True
    assert "< 2.20" in "\n".join(S.verdict_table(res["verdict"]["256"]))


def test_ablation_curve_gets_its_ratio_to_weighted():
    rows = _rows("a", 1e-3, [(2.0, 1e-2), (4.0, 1e-4)], [(1.0, 1e-2), (3.0, 1e-4)])
    rows += [_row(S.NO_POSITIONS, f"eps={i}", "a", b, k) for i, (b, k) in enumerate([(1.5, 1e-2), (3.3, 1e-4)])]
    res = S.assemble("tiny", {"docs": ["a"], "per_doc": 1, "score_tokens": 4, "eps": [0.01]},
                     {"256": {"rows": rows, "prompts": []}})
    r = res["verdict"]["256"][0]
    assert r[S.NO_POSITIONS]["ratio_to_weighted"]["ratio"] == pytest.approx(2.4 / 3.0)
    assert r["ratio"] == pytest.approx(2.0 / 3.0)  # the main verdict is still attention / weighted
    assert f"Ablation {S.NO_POSITIONS}" in S.markdown(res)
    plain = S.assemble("tiny", {"docs": ["a"], "per_doc": 1, "score_tokens": 4, "eps": [0.01]},
                       {"256": {"rows": [x for x in rows if x["method"] != S.NO_POSITIONS], "prompts": []}})
    assert S.NO_POSITIONS not in plain["verdict"]["256"][0] and "Ablation" not in S.markdown(plain)


def test_settings_fp8_both_scopes_and_the_ablation():
    from alignpred.bank import resolve_bank

    bank = resolve_bank("gemma-3-270m")  # any bank: settings are only built here, nothing is compressed
    keys = set(S.settings_for(bank, [0.01, 0.02]))
    assert keys == {f"{m} | eps={e}" for m in (S.WEIGHTED, S.ATTENTION) for e in ("0.01", "0.02")} | {"fp8 | e4m3"}
    ab = S.settings_for(bank, [0.01], ablation=True)
    assert set(ab) == {f"{S.WEIGHTED} | eps=0.01", f"{S.ATTENTION} | eps=0.01", "fp8 | e4m3",
                       f"{S.NO_POSITIONS} | eps=0.01"}
    assert ab[f"{S.ATTENTION} | eps=0.01"].desc["scope"] == "attention"
    assert ab[f"{S.NO_POSITIONS} | eps=0.01"].curve == S.NO_POSITIONS


def test_shortfall_says_by_how_much():
    rows = _rows("a", 1e-3, [(2.0, 1e-2), (4.0, 1e-4)], [(1.6, 1e-2), (3.6, 1e-4)])  # 2.6 against 0.8 x 3.0
    res = S.assemble("tiny", {"docs": ["a"], "per_doc": 1, "score_tokens": 4, "eps": [0.01]},
                     {"256": {"rows": rows, "prompts": []}})
    line = S.shortfall(res["verdict"]["256"][0])
    assert "ratio 0.867" in line and "short by 0.20 bpv" in line and "2.40" in line
    assert "By how much (overall): overall: ratio 0.867" in S.markdown(res)
