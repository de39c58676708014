"""The README's SGLang benchmark command, run as written (issue 41, item 8: it failed with
``No module named '_torchvision_shim'``, a helper it took from ``tests/``)."""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_testlib  # noqa: E402

sglang_testlib.require_sglang()


def test_readme_sglang_command_runs(tmp_path):
    out = tmp_path / "engines.json"
    # the README's command; --reps 1 and --json only keep it short and its results out of the repository
    r = subprocess.run([sys.executable, "-m", "kvz.benchmarks.engines", "--engines", "sglang", "--reps", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 8 and all(row["engine"] == "sglang" and row["roundtrip"] for row in rows)
    assert all(row["bit_exact"] for row in rows if row["method"] == "kvz-lossless")
    assert "SGLang HiCache backend" in r.stdout
