"""The README's LMCache benchmark command, run as written (issue 41, item 8: the engine
benchmarks run from the installed package alone)."""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lmcache_testlib  # noqa: E402

lmcache_testlib.require_lmcache()


def test_readme_lmcache_command_runs(tmp_path):
    out = tmp_path / "engines.json"
    # the README's `python -m kvz.benchmarks.engines`; --quick, --reps 1 and --json only keep it short
    # and its results out of the repository
    r = subprocess.run([sys.executable, "-m", "kvz.benchmarks.engines", "--quick", "--reps", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    methods = {row["method"] for row in rows}
    assert {"raw-bf16", "kvz-lossless", "lmcache-fp8"} <= methods and all(row["engine"] == "lmcache" for row in rows)
    assert all(row["bit_exact"] for row in rows if row["method"] == "kvz-lossless")
