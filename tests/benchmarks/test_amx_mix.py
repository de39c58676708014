"""The AMX instruction-mix probe (benchmarks/amx_mix.py) runs and reports every way."""
import json

import pytest

from alignpred.kernels import amx_enabled


@pytest.mark.skipif(not amx_enabled(), reason="needs AMX (amx-tile + amx-int8 and the tile state)")
def test_probe_runs_and_writes_its_rows(tmp_path):
    from kvz.benchmarks import amx_mix

    speed = tmp_path / "speed.json"
    speed.write_text(json.dumps({"bound": {"int_peak": {"peak_gmacs": 800.0}}}))
    out = tmp_path / "mix.json"
    res = amx_mix.main(["--sources", "2", "--rows", "64", "--rounds", "2", "--out", str(out),
                        "--peak-from", str(speed)])
    assert [r["way"] for r in res["results"]] == ["kernel", "tiles", "products", "products, 4 tiles"]
    assert all(r["ms"] > 0 and r["gmacs"] > 0 for r in res["results"])
    assert res["peak_gmacs"] == 800.0 and json.loads(out.read_text())["macs"] == 2 * 64 * 256 * 256
    assert "share of peak" in (tmp_path / "mix.md").read_text()


def test_bad_arguments_are_usage_errors():
    from kvz.benchmarks import amx_mix

    with pytest.raises(SystemExit):
        amx_mix.main(["--rows", "8"])


def test_refused_where_amx_does_not_run(monkeypatch):
    from alignpred.kernels import amx_mix
    from kvz.benchmarks import amx_mix as bench

    monkeypatch.setenv("KVZ_AMX", "0")
    with pytest.raises(RuntimeError, match="AMX"):
        amx_mix(1, 16, 1)
    with pytest.raises(SystemExit, match="AMX"):
        bench.main(["--rows", "16", "--rounds", "1"])
