"""The benchmark harness: paths, cache discovery, output writing, the common flags, threads."""
import json
import os
import subprocess
import sys

import numpy as np

from kvz.benchmarks import harness as H


def test_paths_and_discovery(tmp_path):
    assert os.path.isdir(os.path.join(H.ROOT, "alignpred")) and os.path.isdir(H.SAMPLES)
    assert os.path.isfile(H.bundled_bank()) and H.bank_file(H.BANK_NAME) == H.bundled_bank()
    assert H.resolve_bank().id == H.resolve_bank(H.bundled_bank()).id
    samples = H.sample_caches()
    assert samples and all(p.endswith(".safetensors") for p in samples) and H.WARM_SAMPLE in samples
    assert H.default_caches(["x.safetensors"]) == ["x.safetensors"]
    assert H.default_caches() == (H.eval_caches() or samples)
    assert H.default_caches(fallback=False) == H.eval_caches()
    (tmp_path / "b.safetensors").write_bytes(b"")
    (tmp_path / "a.safetensors").write_bytes(b"")
    (tmp_path / "c.txt").write_bytes(b"")
    assert [os.path.basename(p) for p in H.caches_in(str(tmp_path))] == ["a.safetensors", "b.safetensors"]
    assert H.display_path(H.WARM_SAMPLE) == os.path.join("samples", "gemma3-270m", "english-prose.safetensors")
    assert H.display_path(str(tmp_path / "a.safetensors")) == "a.safetensors"  # outside the repository: the name
    assert H.stem("/x/y/english-prose.safetensors") == "english-prose"


def test_write_json_and_text(tmp_path):
    p = tmp_path / "deep" / "r.json"
    H.write_json({"f": np.float32(0.5), "i": np.int64(3), "b": np.bool_(True), "t": (1, 2), "s": {4}}, p)
    text = p.read_text()
    assert text.endswith("\n") and json.loads(text) == {"f": 0.5, "i": 3, "b": True, "t": [1, 2], "s": [4]}
    assert H.read_json(p)["i"] == 3 and not list(p.parent.glob("*.tmp"))
    H.write_text(tmp_path / "r.md", "# x\n")
    assert (tmp_path / "r.md").read_text() == "# x\n"


def test_common_flags():
    ap = H.parser("First paragraph.\n\nMore.", caches="caches", quick="small", json="out", json_default="d.json",
                  out="folder", out_default="o", quiet=True)
    a = ap.parse_args(["c1", "c2", "--quick", "-q"])
    assert a.caches == ["c1", "c2"] and a.quick and a.quiet and a.json == "d.json" and a.out == "o"
    assert ap.description == "First paragraph."
    assert H.command_line("speed", ["--quick", "a b"]) == "python -m kvz.benchmarks.speed --quick 'a b'"


def test_threads(monkeypatch):
    for k in H.THREAD_VARS:
        monkeypatch.delenv(k, raising=False)
    H.pin_threads(3)
    assert all(os.environ[k] == "3" for k in H.THREAD_VARS)
    assert H.thread_counts(1) == [1] and H.thread_counts(4) == [1, 4]
    m = H.machine_info(packages=("numpy",))
    assert m["usable_cores"] >= 1 and m["packages"]["numpy"] == np.__version__


def test_importing_the_harness_loads_no_numpy():
    code = "import sys, kvz.benchmarks.harness; print('numpy' in sys.modules, 'numba' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_median_time_and_logged_rounds():
    assert H.median_time(lambda: None, 3) >= 0
    seen = []
    ops = [H.Op("a", "decode", 1, lambda: None), H.Op("b", "decode", 1, lambda: None)]
    H.run_interleaved(ops, 2, label="x", log=seen.append)
    assert len(seen) == 2 and all(len(o.walls) == 2 and len(o.cpus) == 2 for o in ops)
