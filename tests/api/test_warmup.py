"""``alignpred.warmup`` / ``kvz warmup``: every kernel a request needs is compiled or loaded at start-up,
a second warm-up (same process, or a later process on the same numba cache) compiles nothing, and a
machine where numba cannot cache gets a warning, not a crash (the issue: a compile on the request path)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import alignpred
from alignpred import KvzError, KvzReader, compress
from alignpred.api.warmup import CompileWatch, _synthetic, kernel_dispatchers

SMALL = (18, 1, 16, 256)  # the bundled bank's layout, 16 positions
KEYS = {"how", "total_s", "steps", "compiled", "compile_count", "cache_loads", "cache_dirs", "uncached", "manifest",
        "warnings", "numba", "shape", "bank"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def test_warmup_returns_its_report_and_a_second_call_compiles_nothing():
    r1 = alignpred.warmup(profiles=("fast",), lossless=False, shape=SMALL)
    assert KEYS <= set(r1)
    assert r1["how"] in ("run", "loaded") and r1["shape"] == list(SMALL) and r1["bank"].startswith("sha256:")
    assert r1["steps"][0]["step"] == "import"
    assert all({"step", "seconds", "compiled"} <= set(s) for s in r1["steps"])
    if r1["how"] == "run":
        assert [s["step"] for s in r1["steps"][1:]] == ["fast lossy bfloat16"]
        assert r1["steps"][1]["compress_s"] > 0 and r1["steps"][1]["read_s"] > 0
    assert r1["compile_count"] >= len(r1["compiled"]) and r1["uncached"] == []
    for again in (alignpred.warmup(profiles=("fast",), lossless=False, shape=SMALL),
                  alignpred.warmup(profiles=("fast",), lossless=False, shape=SMALL, full=True)):
        assert again["compile_count"] == 0 and again["compiled"] == []
    assert alignpred.warmup(profiles=("fast",), lossless=False, shape=SMALL, full=True)["how"] == "run"


def test_warmup_on_a_thread_leaves_the_main_threads_warning_capture_alone():
    """An engine warms kvz up on kvz's load thread while the engine's main thread records warnings
    (vLLM's harness did): the warm-up's exit must not wipe that capture (it did: warnings.catch_warnings
    on the thread restored the state it saved at entry, and later warnings went to stderr instead)."""
    import threading
    import warnings

    inside, entered = threading.Event(), threading.Event()
    out = {}

    def step(_):  # called inside the warm-up's run: hold it there until the main thread captures
        inside.set()
        entered.wait(30)

    t = threading.Thread(target=lambda: out.update(r=alignpred.warmup(profiles=("fast",), lossless=False,
                                                                      shape=SMALL, full=True, progress=step)))
    t.start()
    assert inside.wait(120)
    with warnings.catch_warnings(record=True) as caught:  # entered while the warm-up runs on its thread
        warnings.simplefilter("always")
        entered.set()
        t.join(120)
        warnings.warn("after the warm-up", UserWarning, stacklevel=1)
    assert not t.is_alive() and out["r"]["how"] == "run"
    assert [str(w.message) for w in caught if str(w.message) == "after the warm-up"] == ["after the warm-up"]


def test_after_warmup_a_request_of_another_size_compiles_nothing():
    alignpred.warmup(profiles=("fast",), lossless=False, shape=SMALL)
    hits = sum(sum(d.stats.cache_hits.values()) for d in kernel_dispatchers())
    cache = _synthetic((18, 1, 100, 256), "bfloat16", seed=5)
    with CompileWatch() as w:
        blob = compress(cache, None, budget=0.02, bank="gemma-3-270m", profile="fast").data
        out = KvzReader(blob).read(tokens=(3, 97))
    assert w.compiled == []
    assert sum(sum(d.stats.cache_hits.values()) for d in kernel_dispatchers()) == hits  # nothing left to load either
    assert out["layers.0.key"].shape == (1, 94, 256)


def test_warmup_refuses_an_unknown_profile():
    with pytest.raises(KvzError, match="unknown profile"):
        alignpred.warmup(profiles=("tiny",), shape=SMALL)


def test_kvz_warmup_prints_the_report():
    from click.testing import CliRunner

    from kvz.cli.main import cli

    res = CliRunner().invoke(cli, ["warmup", "--profile", "fast", "--no-lossless", "--tokens", "16", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{"):])
    assert rep["shape"] == list(SMALL) and KEYS <= set(rep)
    text = CliRunner().invoke(cli, ["warmup", "--profile", "fast", "--no-lossless", "--tokens", "16"])
    assert text.exit_code == 0 and "nothing compiled" in text.output, text.output


def test_a_kernel_numba_cannot_cache_compiles_uncached_with_a_warning(tmp_path):
    """No writable cache folder at all (read-only install, home not writable, no NUMBA_CACHE_DIR):
    numba.njit(cache=True) raises when the kernel is defined; kvz's njit compiles it uncached."""
    blocked = tmp_path / "file"
    blocked.write_text("")  # folders "under" a regular file cannot be made
    mod = tmp_path / "pkg"
    mod.mkdir()
    (mod / "__pycache__").write_text("")  # the in-tree cache folder is a file: not writable
    (mod / "kern.py").write_text(textwrap.dedent("""
        from alignpred.kernels._jit import njit

        @njit(cache=True, nogil=True)
        def twice(x):
            return 2 * x
    """))
    code = textwrap.dedent("""
        import sys, warnings
        sys.dont_write_bytecode = True
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as w:
            import kern
        from alignpred.kernels._jit import UNCACHED
        print(kern.twice(21), UNCACHED, [str(x.message)[:40] for x in w], kern.twice.stats.cache_path)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=mod,
                       env=_env(NUMBA_CACHE_DIR=str(blocked / "numba"), HOME=str(blocked / "home"),
                                XDG_CACHE_HOME=str(blocked / "cache"), PYTHONPATH=ROOT + os.pathsep + str(mod)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.split(" ", 1)[0] == "42"
    assert "['kern.twice']" in p.stdout and "numba has no writable cache folder" in p.stdout
    assert p.stdout.strip().endswith("None")


_CHILD = ("import json, alignpred; r = alignpred.warmup(profiles=('fast',), lossless=False, shape=(18, 1, 16, 256),"
          " full={full}); print('REPORT', json.dumps(r))")


def _start(cache_dir, full=False, **env):
    p = subprocess.run([sys.executable, "-c", _CHILD.format(full=full)], capture_output=True, text=True, timeout=500,
                       env=_env(NUMBA_CACHE_DIR=str(cache_dir), **env), cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return json.loads(next(x for x in p.stdout.splitlines() if x.startswith("REPORT "))[7:])


@pytest.mark.slow
def test_a_second_process_on_the_same_numba_cache_compiles_nothing(tmp_path):
    first = _start(tmp_path / "numba")
    assert first["how"] == "run" and first["compile_count"] > 0 and first["cache_loads"] == 0
    assert first["manifest"] and os.path.exists(first["manifest"]) and first["uncached"] == []
    assert all(d.startswith(str(tmp_path)) for d in first["cache_dirs"])
    second = _start(tmp_path / "numba")
    assert second["how"] == "loaded" and second["compile_count"] == 0 and second["cache_loads"] > 0
    third = _start(tmp_path / "numba", full=True)  # compress and read again: all of it is on disk
    assert third["how"] == "run" and third["compile_count"] == 0
    assert second["cache_loads"] == third["cache_loads"]  # the manifest lists what the codec calls, no more


@pytest.mark.slow
def test_warmup_without_a_writable_numba_cache_warns_and_still_warms(tmp_path):
    """Only NUMBA_CACHE_DIR is tried, and it cannot be made: kvz's kernels compile uncached."""
    blocked = tmp_path / "file"
    blocked.write_text("")
    r = _start(blocked / "numba", NUMBA_CACHE_LOCATOR_CLASSES="UserProvidedCacheLocator")
    assert r["how"] == "run" and r["manifest"] is None and r["cache_dirs"] == []
    assert r["uncached"] and r["compile_count"] > 0
    assert any("no writable cache folder" in w for w in r["warnings"])
    assert np.isfinite(r["total_s"])
