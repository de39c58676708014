"""``kvz bench --quick``: every importable method at FP8's error on one sample; JSON rows, report and plot."""
import json
import math
import os

import pytest
from click.testing import CliRunner

from kvz.benchmarks.harness import SAMPLES, bundled_bank
from kvz.benchmarks.report import interp_loglog
from kvz.benchmarks.run import summarize

BUNDLED_BANK = bundled_bank()

SAMPLE = os.path.join(SAMPLES, "english-prose.safetensors")


def test_interp_loglog():
    pts = [(0.01, 8.0), (0.04, 2.0)]
    assert math.isclose(interp_loglog(pts, 0.02), 4.0)  # bpv ~ 1/err: halfway in log-log
    assert interp_loglog(pts, 0.005) is None and interp_loglog(pts, 0.05) is None


def test_summarize_pools_bits_and_errors():
    rows = [{"method": "m", "alloc": "pooled", "eps_target": 0.1, "bpv": b, "nrmse_pooled": e, "nrmse_max_tensor": w,
             "encode_s": 1.0, "decode_s": 0.5, "n_values": n, "cache": c, "study": "main",
             "extra": {"sq_norm": s, "meets_target": True}}
            for b, e, w, n, c, s in ((2.0, 0.1, 0.2, 100, "a", 1.0), (4.0, 0.0, 0.1, 300, "b", 3.0))]
    (r,) = summarize(rows)
    assert r["n_values"] == 400 and math.isclose(r["bpv"], 3.5) and r["nrmse_max_tensor"] == 0.2
    assert math.isclose(r["nrmse_pooled"], math.sqrt(0.01 * 1.0 / 4.0)) and r["encode_s"] == 2.0
    assert r["extra"]["meets_target"] is True and r["cache"] == "all"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(SAMPLE), reason="bundled samples absent")
def test_bench_quick(tmp_path):
    import kvz.benchmarks.baselines as B
    from kvz.cli.main import cli

    args = ["bench", "--quick", "--out", str(tmp_path / "out"), "-q"]
    if not os.path.exists(BUNDLED_BANK):  # fit a small bank on another sample instead
        from alignpred import fit_bank, load_cache
        from kvz.benchmarks.run import slice_cache

        other = slice_cache(load_cache(os.path.join(SAMPLES, "python-code.safetensors")), 256)
        fit_bank([other], rank=None).save(tmp_path / "bank.h5")
        args += ["--bank", str(tmp_path / "bank.h5")]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    out = tmp_path / "out"
    for f in ("results.json", "RESULTS.md", "rd.png"):
        assert (out / f).stat().st_size > 0, f
    r = json.loads((out / "results.json").read_text())
    assert r["quick"] and len(r["caches"]) == 1 and r["caches"][0]["n_tokens"] == 256
    keys = {"method", "alloc", "eps_target", "bpv", "nrmse_pooled", "nrmse_max_tensor", "encode_s", "decode_s",
            "n_values", "cache", "extra"}
    for row in r["rows"]:
        assert keys <= set(row), set(row) ^ keys
        assert row["bpv"] > 0 and row["n_values"] == r["caches"][0]["n_values"]
    ran = {row["method"] for row in r["rows"]}
    assert set(B.available()) | {"kvz"} <= ran
    assert set(B.BASELINES) - set(B.available()) <= set(r["skipped"])
    e8 = r["eps_fp8"]
    assert 0.02 < e8["tensor"] < 0.04 and 0.02 < e8["pooled"] < 0.04
    kvz = [row for row in r["rows"] if row["method"] == "kvz"]
    assert {row["alloc"] for row in kvz} == {"tensor", "pooled"}
    for row in kvz:  # measured by decoding, each at FP8's error under its allocation
        err = row["nrmse_max_tensor"] if row["alloc"] == "tensor" else row["nrmse_pooled"]
        assert row["eps_target"] == e8[row["alloc"]]
        assert err <= row["eps_target"] * (1 + 1e-9) and row["extra"]["meets_target"]
        assert row["bpv"] < 8.0  # beats FP8's rate at FP8's error
    for m in ("sz3", "zfp", "kvtc"):  # searchable baselines were run exactly at FP8's error
        if m in B.available():
            assert any(row["method"] == m and row["eps_target"] == e8["tensor"] for row in r["rows"])
    md = (out / "RESULTS.md").read_text()
    assert "At FP8 e4m3's measured error" in md and "## (d) Speed" in md and "kvz bench" in md


def test_map_source_variants_and_their_multiply_adds():
    """The map-source study's variants drop exactly the named sources, and the multiply-adds per
    value count every map's sources x d_in x d_out over all values (Gemma 3 270M: 612)."""
    from alignpred import CacheLayout
    from benchmarks.studies.speed.map_sources import macs_per_value, variants

    lay = CacheLayout(num_layers=18, kv_heads=1, head_dim=256, n_tokens=2048, dtype="bfloat16")
    v = variants(lay)
    assert set(v) == {"default", "v_no_prev_k", "v_no_prev_v", "k_prev_k_only"}
    assert v["default"]["V.5.0"] == ["V.4.0", "K.5.0", "K.4.0"] and v["default"]["K.5.0"] == ["K.4.0", "V.4.0"]
    assert v["v_no_prev_k"]["V.5.0"] == ["V.4.0", "K.5.0"] and v["v_no_prev_k"]["K.5.0"] == ["K.4.0", "V.4.0"]
    assert v["v_no_prev_v"]["V.5.0"] == ["K.5.0", "K.4.0"]
    assert v["k_prev_k_only"]["K.5.0"] == ["K.4.0"] and v["k_prev_k_only"]["V.5.0"] == ["V.4.0", "K.5.0"]
    assert v["default"]["V.0.0"] == ["K.0.0"] and "K.0.0" not in v["default"]
    # 17 K maps x 2 sources + 17 V maps x 3 + V.0 x 1 = 86 products of 256 x 256 per token, over 36 x 256 values
    assert round(macs_per_value(lay, v["default"])) == round(86 * 256 * 256 / (36 * 256)) == 612
