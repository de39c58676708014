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


def test_projected_break_even_and_rows():
    # 1,000 raw bytes vs 200 compressed, 0.8 s on one thread: 16 cores -> 0.05 s, 800 / 0.05 = 16,000 B/s
    p = S.projected_break_even(1000, 200, 0.8)
    assert set(p) == {f"{k}_projected_{c}c" for k in ("decode_s", "break_even_Bps") for c in S.PROJECTED_CORES}
    assert p["decode_s_projected_16c"] == pytest.approx(0.05) and p["break_even_Bps_projected_16c"] == pytest.approx(16000)
    assert p["decode_s_projected_64c"] == pytest.approx(0.0125) and p["break_even_Bps_projected_64c"] == pytest.approx(64000)
    assert S.projected_break_even(100, 100, 0.8)["break_even_Bps_projected_64c"] is None  # never worth it
    q = {"bytes": 200, "nrmse_pooled": 0.01, "nrmse_max_tensor": 0.02}
    r1 = S.make_row("a", "kvz", "decode", 1, 500, 1000, q, S.timing([0.8], [0.7]))
    r2 = S.make_row("a", "kvz", "decode", 2, 500, 1000, q, S.timing([0.5], [0.9]))
    re = S.make_row("a", "kvz", "encode", 1, 500, 1000, q, S.timing([2.0], [2.0]))
    assert r1["break_even_Bps_projected_16c"] == S.break_even(1000, 200, 0.8 / 16)
    assert not any("projected" in k for k in r2) and not any("projected" in k for k in re)  # 1-thread decodes only
    rows = [r1, r2, re, S.make_row("b", "kvz", "decode", 1, 500, 1000, q, S.timing([1.2], [1.0])),
            S.make_row("a", "fp8", "decode", 1, 500, 1000, {**q, "bytes": 500}, S.timing([0.1], [0.1]))]
    agg = S.aggregate(rows)
    by = {r["codec"]: r for r in S.by_cores(agg)}
    assert set(by) == {"kvz", "fp8"}  # one row per decoder, none for encodes
    k = by["kvz"]  # caches a and b: 2,000 raw bytes, 400 compressed, 2.0 s on one thread
    assert k["decode_s_t1"] == pytest.approx(2.0) and k["break_even_Bps_t1"] == pytest.approx(1600 / 2.0)
    assert k["decode_s_t2"] == pytest.approx(0.5) and k["break_even_Bps_t2"] == pytest.approx(800 / 0.5)  # cache a only
    assert k["break_even_Bps_projected_64c"] == pytest.approx(1600 / (2.0 / 64))
    assert by["fp8"]["decode_s_t2"] is None and by["fp8"]["break_even_Bps_t2"] is None  # not run at 2 threads
    assert by["fp8"]["break_even_Bps_projected_16c"] == pytest.approx(500 / (0.1 / 16))


def test_ns_per_symbol_and_published_figures():
    assert S.ns_per_symbol(1 / 1.073741824) == pytest.approx(1.0)
    assert S.ns_per_symbol(3.0) == pytest.approx(0.3104, abs=1e-4)
    assert S.ns_per_symbol(2.5) == pytest.approx(1 / 2.684354560)
    assert S.ns_per_symbol(1.0, bytes_per_symbol=4) == pytest.approx(4 * S.ns_per_symbol(1.0))
    pub = S.published_entropy()
    assert [p["gib_per_s"] for p in pub] == [3.0, 1.8, 2.3, 2.5] and not any(p["measured_here"] for p in pub)
    assert {p["source"] for p in pub} == {"hypersonic-rANS", "htscodecs", "zstd"}
    from benchmarks.studies.speed.entropy_decode.lanes import PUBLISHED  # the same figures, given there in ns/symbol

    assert sorted(round(p["ns_per_symbol"], 2) for p in pub) == pytest.approx(sorted(PUBLISHED.values()), abs=0.011)
    assert S.spaced(list(range(10)), 3) == [0, 4, 9] and S.spaced([1, 2], 0) == [1, 2] and S.spaced([1, 2, 3], 1) == [2]


def test_entropy_timing_on_synthetic_objects():
    from alignpred import entropy
    from benchmarks.studies.speed.entropy_decode.coders import typical_object

    rng = np.random.default_rng(3)
    objs = [(q, entropy.choose_models(q)) for q in (typical_object(rng, 8, 256), typical_object(rng, 4, 256))]
    e = S.entropy_timing(objs, rounds=1)
    assert e["symbols"] == 8 * 256 + 4 * 256 and e["same_symbols"] and e["rans4_bits_per_symbol"] > 0
    assert {"rans4", "lanes32 vectorised", "lanes32 portable"} <= set(e["timing"])
    assert all(0 < t["ns_per_symbol_min"] <= t["ns_per_symbol_median"] for t in e["timing"].values())


def test_chunk_range():
    assert S.chunk_range(2048, 256) == (1024, 1280)
    assert S.chunk_range(300, 256) == (256, 300) and S.chunk_range(200, 256) == (0, 200)


def test_one_chunk_section(tiny):
    cache, bank = tiny
    ch = S.chunk_section("tiny", cache, bank, threads=(1, 2), rounds=2, progress=False)
    a, b = ch["tokens"]
    assert (a, b) == S.chunk_range(300, ch["object_size"]) and ch["identical"]
    assert ch["n_values"] == cache.layout.n_values * (b - a) // 300
    assert set(ch["ms_per_chunk"]) == {"1", "2"} and all(v > 0 for v in ch["ms_per_chunk"].values())
    assert ch["speedup"]["1"] == 1.0
    assert ch["speedup"]["2"] == pytest.approx(ch["times"]["1"]["wall_s"] / ch["times"]["2"]["wall_s"])
    assert ch["times"]["2"]["repeats"] == 2


def _report_res():
    q = {"bytes": 200, "nrmse_pooled": 0.01, "nrmse_max_tensor": 0.02}
    rows = [S.make_row("a", "kvz", "decode", 1, 500, 1000, q, S.timing([0.8], [0.7])),
            S.make_row("a", "kvz", "decode", 2, 500, 1000, q, S.timing([0.5], [0.9])),
            S.make_row("a", "zstd-3", "decode", 1, 500, 1000, {**q, "bytes": 900}, S.timing([0.1], [0.1]))]
    agg = S.aggregate(rows)
    t = {"ns_per_symbol_min": 4.25, "ns_per_symbol_median": 4.5}
    return {"command": "test", "quick": True, "created": "now", "machine": {"all_threads": 2},
            "settings": {"rounds": 1, "enc_rounds": 1}, "n_caches": 1, "tokens": 300, "rows": rows,
            "aggregate": agg, "break_even_by_cores": S.by_cores(agg), "wall_s": 1.0, "notes": [],
            "entropy": {"cache": "a", "objects": 10, "timed_objects": 2, "symbols": 1024, "rounds": 1,
                        "rans4_bits_per_symbol": 3.5, "isa": "avx2", "same_symbols": True,
                        "timing": {"rans4": t}, "published": S.published_entropy()},
            "chunk": {"cache": "a", "tokens": [256, 512], "object_size": 256, "n_values": 123456, "rounds": 3,
                      "identical": True, "ms_per_chunk": {"1": 144.0, "2": 98.5},
                      "ms_per_chunk_cpu": {"1": 140.0, "2": 190.0}, "speedup": {"1": 1.0, "2": 144.0 / 98.5}}}


def test_markdown_break_even_entropy_and_chunk_tables():
    md = S.markdown(_report_res())
    lines = md.splitlines()
    head = next(x for x in lines if x.startswith("| codec | op | bpv | 1 thread (measured)"))
    assert "2 threads (measured)" in head and "16 cores (projected" in head and "64 cores (projected" in head
    kvz = next(x for x in lines if x.startswith("| kvz | decode | 3.200 | ") and "projected" not in x
               and x.count("|") == head.count("|"))
    assert len(kvz.split(" | ")) == 7 and kvz.endswith(" Gbit/s |")  # 1, 2 threads, 16, 64 cores (values below)
    zs = next(x for x in lines if x.startswith("| zstd-3 | decode | 14.400 | ") and x.count("|") == head.count("|"))
    assert zs.split(" | ")[4] == "-"  # not run at 2 threads
    assert "| rans4 | kvz (this run) | - | 4.25 (4.50) | measured here |" in md
    assert "| 32x64 lanes, 10-12-bit probabilities | hypersonic-rANS | 3 | 0.31 | published, not measured here |" in md
    assert "| Huff0 | zstd | 2.5 | 0.37 | published, not measured here |" in md
    assert "| 1 | 144.0 | 140.0 | 1.00x |" in md and "| 2 | 98.5 | 190.0 | 1.46x |" in md


def test_markdown_break_even_values_in_gbit():
    res = _report_res()
    for r in res["break_even_by_cores"]:  # scale the sizes so the figures print with digits
        for k in list(r):
            if k.startswith("break_even_Bps") and r[k] is not None:
                r[k] *= 1e9
    lines = S.markdown(res).splitlines()
    head = next(x for x in lines if x.startswith("| codec | op | bpv | 1 thread (measured)"))
    kvz = next(x for x in lines if x.startswith("| kvz | decode | 3.200 | ") and x.count("|") == head.count("|"))
    # 1e9 x (1,000 - 200) B / 0.8 s = 1e12 B/s = 8,000 Gbit/s; 2 threads / 0.5 s; x16; x64
    assert kvz.split(" | ")[3:] == ["8000.00 Gbit/s", "12800.00 Gbit/s", "128000.00 Gbit/s", "512000.00 Gbit/s |"]


def test_profile_codecs_and_the_decode_points(tiny):
    """``kvz-balanced`` / ``kvz-fast`` time ``compress(profile=)`` files; the decode points take the
    fastest variant within +0.05 bpv of the default, and state the fast profile's bpv cost."""
    cache, bank = tiny
    cs = S.codec_section([("tiny", cache)], bank, codecs=("kvz", "kvz-fast"), threads=[1], rounds=1,
                         enc_rounds=1, identity_threads=(1, 2), progress=False)
    ops = {(r["codec"], r["op"]) for r in cs["rows"]}
    assert ops == {("kvz", "encode"), ("kvz", "decode"), ("kvz", "decode_into"), ("kvz-fast", "encode"),
                   ("kvz-fast", "decode")}
    assert set(cs["identity"]) == {"tiny", "tiny (kvz-fast)"} and all(v["identical"] for v in cs["identity"].values())
    fast = [r for r in cs["rows"] if r["codec"] == "kvz-fast"]
    assert all(r["nrmse_max_tensor"] <= S.EPS * (1 + 1e-6) for r in fast)

    def row(codec, th, vps, bpv):
        return {"cache": "all", "codec": codec, "op": "decode", "threads": th, "vps": vps, "vps_cpu": vps, "bpv": bpv}

    rows = [row("sz3", 1, 100e6, 5.0), row("kvz", 1, 60e6, 3.80), row("kvz-balanced", 1, 110e6, 3.84),
            row("kvz-fast", 1, 200e6, 4.6), row("kvz", 2, 90e6, 3.80), row("kvz-balanced", 2, 170e6, 3.86)]
    from kvz.benchmarks.speed.acceptance import acceptance

    acc = {a["point"]: a for a in acceptance({"aggregate": rows, "machine": {"all_threads": 2}})}
    one = acc["decode 1 thread >= 1x SZ3 1 thread at <= +0.05 bpv"]
    assert one["met"] and one["value"] == pytest.approx(1.1) and one["detail"].startswith("kvz-balanced")
    two = acc["decode 2 threads >= 1.8x SZ3 1 thread at <= +0.05 bpv"]  # balanced is +0.06 here: not eligible
    assert not two["met"] and two["detail"].startswith("kvz 90.0")
    f = acc["--profile fast: decode 1 thread >= 1.5x SZ3 1 thread (bpv cost stated)"]
    assert f["met"] and "+0.800 vs the default's 3.800" in f["detail"]


def test_entropy_and_peak_points():
    e = {"timing": {"rans4": {"ns_per_symbol_min": 3.0}, "lanes32 vectorised": {"ns_per_symbol_min": 0.9},
                    "lanes32 vectorised, 10-bit tables": {"ns_per_symbol_min": 0.5}},
         "same_symbols": True, "symbols": 10, "cache": "c", "isa": "x"}
    bd = {"kernel_share_of_int_peak": 0.5, "map_kernel_gmacs": 100.0, "kernel_gmacs": 80.0,
          "int_peak": {"peak_gmacs": 200.0, "instruction": "vpdpwssd zmm (AVX512-VNNI)"}}
    from kvz.benchmarks.speed.acceptance import acceptance

    acc = {a["point"]: a for a in acceptance({"aggregate": [], "machine": {"all_threads": 1}, "entropy": e,
                                              "bound": bd})}
    ent = acc["entropy stage <= 1 ns/symbol"]
    assert ent["met"] and ent["value"] == 0.9   # the format's own 12-bit tables, not the measurement-only ones
    peak = acc["map products >= 85% of the core's integer dot-product peak"]
    assert not peak["met"] and "50%" in peak["detail"]


def test_dot_peak_probe():
    from kvz.benchmarks.speed.dot_peak import dot_peak

    p = dot_peak(reps=2, iters=20_000)
    if "error" in p and "peak_gmacs" not in p:
        pytest.skip(p["error"])
    assert p["peak_gmacs"] > 1 and p["instruction"] in p["probes"]
