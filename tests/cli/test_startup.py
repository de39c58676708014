"""Start-up of the ``kvz`` process, measured rather than forced (issue 41, item 9): ``kvz --version``
and ``kvz --help`` load no numba; ``kvz decompress --verbose`` reports where its time went; a
command that has to compile kvz's kernels says so, once, on stderr."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "gemma3-270m" / "python-code.safetensors"
HEAVY = ("numba", "llvmlite", "numpy", "scipy", "h5py", "torch")


def _kvz(*args, env=None, pre: str = "") -> subprocess.CompletedProcess:
    """``kvz ARGS`` in a fresh process (the console script's main)."""
    code = pre + f"import sys\nfrom kvz.cli.main import main\nsys.argv = ['kvz', *{list(args)!r}]\nmain()\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("arg", ["--version", "--help"])
def test_version_and_help_load_no_numba(arg):
    pre = ("import atexit, sys\n"
           f"atexit.register(lambda: print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules)))\n")
    r = _kvz(arg, pre=pre)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "HEAVY []", r.stdout[-500:]


@pytest.fixture(scope="module")
def small_kvz(tmp_path_factory):
    from alignpred import compress, load_cache

    p = tmp_path_factory.mktemp("startup") / "c.kvz"
    compress(load_cache(SAMPLE), p, budget=0.03, bank="gemma-3-270m", threads=1)
    return p


def test_decompress_verbose_reports_start_up(small_kvz, tmp_path):
    out = tmp_path / "d.safetensors"
    r = _kvz("decompress", str(small_kvz), "-o", str(out), "--verbose")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{out}: 36 tensors\n"  # stdout as without --verbose
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("kvz decompress: start-up ")]
    assert len(line) == 1, r.stderr
    for part in ("imports", "open", "bank", "then decode", "compile", "total"):  # compiled / N compiles
        assert part in line[0], line[0]
    if sys.platform.startswith("linux"):
        assert "Python and the CLI" in line[0]
    quiet = _kvz("decompress", str(small_kvz), "-o", str(out), "--force")
    assert quiet.returncode == 0 and "start-up" not in quiet.stderr


def test_compile_note_once(tmp_path):
    """The note comes when the first of kvz's kernels starts compiling (in any thread), once, and
    nothing is said for code that is not kvz's."""
    code = (
        "import threading\n"
        "from kvz.cli.startup import COMPILE_NOTE, announce_compiles\n"
        "watch = announce_compiles()\n"
        "import numba\n"
        "def other(x):\n    return x + 1\n"
        "numba.njit(other)(1)\n"
        "print('after other', flush=True)\n"
        "def a(x):\n    return x * 2\n"
        "def b(x):\n    return x * 3\n"
        "a.__module__ = b.__module__ = 'alignpred.fake'\n"
        "t = threading.Thread(target=lambda: numba.njit(a)(2.0))\n"
        "t.start(); t.join()\n"
        "numba.njit(b)(3)\n"
        "print('compiled', sorted(watch.compiled), flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    from kvz.cli.startup import COMPILE_NOTE

    assert r.stderr.count(COMPILE_NOTE) == 1 and "kvz warmup" in COMPILE_NOTE
    assert r.stdout.splitlines() == ["after other", "compiled ['alignpred.fake.a', 'alignpred.fake.b']"]


@pytest.mark.slow
def test_first_decompress_says_it_compiles(small_kvz, tmp_path):
    """With numba's cache empty (a fresh NUMBA_CACHE_DIR) `kvz decompress` says once that it compiles
    and --verbose counts the compiles; the second run loads them and says nothing."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    from kvz.cli.startup import COMPILE_NOTE

    first = _kvz("decompress", str(small_kvz), "-o", str(tmp_path / "a.safetensors"), "-v", env=env)
    assert first.returncode == 0, first.stderr
    assert first.stderr.count(COMPILE_NOTE) == 1 and "kernel compiles in it" in first.stderr
    second = _kvz("decompress", str(small_kvz), "-o", str(tmp_path / "b.safetensors"), "-v", env=env)
    assert second.returncode == 0, second.stderr
    assert COMPILE_NOTE not in second.stderr and "none compiled" in second.stderr
