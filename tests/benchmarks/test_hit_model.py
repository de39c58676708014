"""The on-paper hit model (``kvz.benchmarks.hit_model``): its algebra, and a table from measured inputs."""
import json
from pathlib import Path

from kvz.benchmarks.hit_model import hit_row, main


def test_needed_throughput_is_where_kvz_equals_raw():
    values, bpv, cores, bw, L = 537e6, 3.8, 32, 12.5e9, 32
    need = hit_row(values, bpv, 1.0, cores, bw, L)["needed_per_core"]
    at = hit_row(values, bpv, need, cores, bw, L)
    assert abs(at["kvz_s"] - at["raw_s"]) < 1e-9 * at["raw_s"]
    assert hit_row(values, bpv, need * 1.1, cores, bw, L)["x_raw"] < 1 < hit_row(values, bpv, need * 0.9, cores, bw, L)["x_raw"]


def test_table_from_the_committed_speed_results(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["--speed", str(Path(__file__).resolve().parents[2] / "benchmarks/results/speed.json"), "--hit", str(tmp_path / "none.json"),
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["raw_s"] > 0 and r["kvz_s"] > 0 for r in rows)
    assert "| Llama 3.1 8B | 100 GbE |" in capsys.readouterr().out
