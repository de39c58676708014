"""The AMX instruction-mix probe (benchmarks/studies/speed/amx_mix.py) runs and reports every way."""
import json

import pytest

from alignpred.kernels import amx_enabled


@pytest.mark.skipif(not amx_enabled(), reason="needs AMX (amx-tile + amx-int8 and the tile state)")
def test_probe_runs_and_writes_its_rows(tmp_path):
    from benchmarks.studies.speed import amx_mix

    out = tmp_path / "mix.json"
    res = amx_mix.main(["--sources", "2", "--rows", "64", "--rounds", "2", "--out", str(out)])
    assert [r["way"] for r in res["results"]] == [
        "kernel", "tiles", "products", "products, 4 tiles", "tiles, sources joined", "products, sources joined",
        "tiles, sources joined, operands in L1"]
    assert all(r["ms"] > 0 and r["gmacs"] > 0 for r in res["results"])
    assert json.loads(out.read_text())["macs"] == 2 * 64 * 256 * 256
    md = (tmp_path / "mix.md").read_text()
    if res["peak_gmacs"]:   # measured in the same run (needs a C compiler for the register-only probe)
        assert res["peak_gmacs"] == max(p for p in res["peak_before_after"] if p)
        assert "share of peak" in md and "measured in this run" in md
    else:
        assert "not measured" in md


def test_bad_arguments_are_usage_errors():
    from benchmarks.studies.speed import amx_mix

    with pytest.raises(SystemExit):
        amx_mix.main(["--rows", "8"])


def test_refused_where_amx_does_not_run(monkeypatch):
    from alignpred.kernels import amx_mix
    from benchmarks.studies.speed import amx_mix as bench

    monkeypatch.setenv("KVZ_AMX", "0")
    with pytest.raises(RuntimeError, match="AMX"):
        amx_mix(1, 16, 1)
    with pytest.raises(SystemExit, match="AMX"):
        bench.main(["--rows", "16", "--rounds", "1"])
