"""The speed benchmark's pieces on a tiny synthetic cache (no model, no LMCache, no subprocesses)."""
import json
import math

import numpy as np
import pytest

from kvz.benchmarks import speed as S

ROW_KEYS = {"cache", "codec", "op", "threads", "n_values", "raw_bytes", "bytes", "bpv", "nrmse_pooled",
            "nrmse_max_tensor", "wall_s", "cpu_s", "wall_runs", "cpu_runs", "repeats", "vps", "vps_cpu"}


def test_break_even():
    # 100 raw bytes vs 25 compressed, decoded in 0.5 s: loading wins below (100 - 25) / 0.5 = 150 B/s
    assert S.break_even(100, 25, 0.5) == 150.0
    b = S.break_even(100, 25, 0.5)
    assert 25 / (b * 0.99) + 0.5 < 100 / (b * 0.99) and 25 / (b * 1.01) + 0.5 > 100 / (b * 1.01)
    assert S.break_even(100, 100, 0.1) is None and S.break_even(100, 120, 0.1) is None  # never worth it
    assert S.break_even(100, 10, 0.0) == math.inf


def test_interleaved_medians():
    calls = []
    ops = [S.Op("a", "decode", 1, lambda: calls.append("a")), S.Op("b", "decode", 1, lambda: calls.append("b")),
           S.Op("c", "encode", 1, lambda: calls.append("c"), rounds=1)]
    S.run_interleaved(ops, 3)
    assert calls.count("a") == 3 and calls.count("b") == 3 and calls.count("c") == 1
    assert calls[:3] != calls[3:5] + calls[5:6]  # order rotates between rounds
    t = S.timing([3.0, 1.0, 2.0], [0.5, 0.7, 0.6])
    assert t["wall_s"] == 2.0 and t["cpu_s"] == 0.6 and t["repeats"] == 3


def test_clean_env(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env = S.clean_env(S.parse_env("OMP_NUM_THREADS=1"), "/x")
    assert "OPENBLAS_NUM_THREADS" not in env and env["OMP_NUM_THREADS"] == "1" and env["PYTHONPATH"] == "/x"


def _runs():
    def run(label, env, cache, enc, dec, bpv, digest="d"):
        return {"label": label, "env": env, "cache": cache, "round": 0, "n_values": 1000, "bpv": bpv,
                "encode": {k: {"wall": [v], "cpu": [v]} for k, v in enc.items()},
                "decode": {k: {"wall": [v], "cpu": [v]} for k, v in dec.items()},
                "digest": {k: digest for k in dec}}

    return [run("kvz 0.1", "default", "a", {"None": 8.0}, {"None": 2.0}, 3.700),
            run("kvz 0.1", S.BLAS1, "a", {"None": 4.0}, {"None": 3.0}, 3.701),
            run("kvz 0.2", "default", "a", {"1": 1.0, "2": 0.8}, {"1": 0.5, "2": 0.3}, 3.705),
            run("kvz 0.2", "OPENBLAS_NUM_THREADS=1", "a", {"1": 1.0, "2": 0.5}, {"1": 0.5, "2": 0.3}, 3.705)]


def test_version_and_env_summaries():
    runs = _runs()
    v = S.summarize_versions(runs)
    # against the better of 0.1's two environments (encode: single-thread BLAS, decode: default)
    assert v["encode_wall_speedup_t1"] == 4.0 and v["encode_wall_speedup_t2"] == 5.0
    assert v["encode_wall_speedup_vs_default_t1"] == 8.0
    assert v["decode_wall_speedup_t2"] == pytest.approx(2.0 / 0.3)
    assert v["bpv_diff_max"] == pytest.approx(0.005) and v["decode_identical_across_processes_and_threads"]
    e = S.summarize_env(runs)
    var = e["variants"]["OPENBLAS_NUM_THREADS=1"]
    assert var["encode_t2_wall"]["default_over_variant"] == pytest.approx(1.6)
    assert len(e["flags"]) == 1 and "encode threads=2" in e["flags"][0]  # the default was slower: flagged
    runs[-1]["encode"]["2"]["cpu"] = [0.8]  # slower by the wall clock only, same CPU time: noise, not flagged
    assert not S.summarize_env(runs)["flags"]


@pytest.fixture(scope="module")
def tiny():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from alignpred import Cache, fit_bank

    rng = np.random.default_rng(0)
    base = rng.standard_normal((1, 300, 32)).cumsum(axis=1) * 0.1
    kv = [((base + 0.1 * rng.standard_normal(base.shape)).astype(ml_dtypes.bfloat16),
           (base * 0.5 + 0.1 * rng.standard_normal(base.shape)).astype(ml_dtypes.bfloat16)) for _ in range(2)]
    cache = Cache.from_arrays(kv)
    return cache, fit_bank([cache], rank=None)


@pytest.mark.slow
def test_codec_section_rows_json_plot(tiny, tmp_path):
    pytest.importorskip("zstandard")
    cache, bank = tiny
    cs = S.codec_section([("tiny", cache)], bank, codecs=("kvz", "fp8_e4m3", "zstd-3"), threads=[1, 2], rounds=2,
                         enc_rounds=1, identity_threads=(1, 2), progress=False)
    rows = cs["rows"]
    ops = {(r["codec"], r["op"], r["threads"]) for r in rows}
    assert ops == {(c, o, t) for c, os_ in (("kvz", ("encode", "decode", "decode_into")),
                                            ("fp8_e4m3", ("encode", "decode")), ("zstd-3", ("encode", "decode")))
                   for o in os_ for t in (1, 2)}
    n = cache.layout.n_values
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["n_values"] == n and r["raw_bytes"] == 2 * n and r["vps"] > 0 and r["wall_s"] > 0
        assert r["repeats"] == (1 if r["op"] == "encode" else 2)
        if r["op"].startswith("decode"):
            want = S.break_even(r["raw_bytes"], r["bytes"], r["wall_s"])
            assert r["break_even_Bps"] == want
    kvz = [r for r in rows if r["codec"] == "kvz"]
    assert all(r["nrmse_max_tensor"] <= S.EPS * (1 + 1e-6) for r in kvz)
    assert {r["nrmse_max_tensor"] for r in rows if r["codec"] == "zstd-3"} == {0.0}
    assert cs["identity"]["tiny"]["identical"]

    agg = S.aggregate(rows)
    assert len(agg) == len(rows) and all(a["cache"] == "all" for a in agg)
    res = {"schema": S.SCHEMA, "command": "test", "quick": True, "created": "now", "machine": {"all_threads": 2},
           "settings": {"rounds": 2, "enc_rounds": 1}, "n_caches": 1, "tokens": 300, "rows": rows, "aggregate": agg,
           "identity": cs["identity"], "loadavg_start": None, "loadavg_end": None, "wall_s": 1.0, "notes": []}
    res["acceptance"] = S.acceptance(res)
    assert any(a["point"].startswith("decode bit-identical") and a["met"] for a in res["acceptance"])
    js = tmp_path / "speed.json"
    S.write_json(res, str(js))
    back = json.loads(js.read_text())
    assert back["schema"] == S.SCHEMA and len(back["rows"]) == len(rows)
    again = S.render(str(js))  # re-summarised from the raw rows: the same aggregate, md and png written
    assert again["aggregate"] == back["aggregate"] and (tmp_path / "speed.md").stat().st_size > 0
    md = S.markdown(res)
    assert "| kvz | decode |" in md and "## Acceptance" in md
    pytest.importorskip("matplotlib")
    S.write_plot(res, str(tmp_path / "speed.png"))
    assert (tmp_path / "speed.png").stat().st_size > 0


def test_profile(tiny):
    cache, bank = tiny
    c = S.KvzCodec(cache, bank)
    c.encode(1)
    p = S.profile_decode(c, top=5)
    assert len(p["top_own"]) == 5 and p["total_own_s"] > 0


def test_bound_counts_the_map_products(tiny):
    """The bound section times the prediction stage of a read with the decoder's StageTimer and counts
    the multiply-adds of its exact map products: 2 layers x K,V, one head of 32 channels, 300 rows;
    the blocks with bank sources are predicted from earlier blocks (padded to 32 outputs, even d_in)."""
    cache, bank = tiny
    c = S.KvzCodec(cache, bank)
    c.encode(1)
    b = S.bound_section(c, reps=1)
    assert set(b["stage_s"]) == {"fetch", "entropy", "predict", "post", "refine"}
    assert b["values"] == cache.layout.n_values and b["macs"] > 0 and 0 < b["map_products_s"] < b["read_s"]
    assert all(n == 300 and K2 % 2 == 0 and m % 16 == 0 for S_, n, K2, m in b["shapes"])
    assert b["macs"] == pytest.approx(b["macs_per_value"] * b["values"])
    if b["bf16_reference"] is not None:
        assert b["max_vps_maps_only"] == pytest.approx(b["values"] / b["map_floor_s"])


def test_bench_speed_only_without_eval_caches(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from kvz.cli.main import cli

    monkeypatch.setattr(S, "default_caches", lambda: [])
    res = CliRunner().invoke(cli, ["bench", "--speed-only", "--quick", "--out", str(tmp_path / "o"), "-q"])
    assert res.exit_code != 0 and "make_samples.py --what eval" in res.output


def test_cpu_probe():
    p = S.cpu_probe(0.05)
    assert p["1"]["cpu_over_wall"] > 0 and p["scaling"] > 0 and set(p) >= {"1", "scaling"}
