"""The installed package's sources (every package pyproject installs: the library, the CLI, the
integrations and the installed benchmarks): one definition of each shared helper (issue 41, item 5)."""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def installed_sources() -> list[Path]:
    """The ``.py`` files of every package ``pyproject.toml`` installs (its folder per ``package-dir``)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    out: list[Path] = []
    for pkg in cfg["packages"]:
        base = max((n for n in dirs if pkg == n or pkg.startswith(n + ".")), key=len)
        folder = ROOT / dirs[base] / Path(*pkg[len(base):].split(".")[1:])
        out += sorted(folder.glob("*.py"))
    return out


def _definitions() -> dict[str, list[str]]:
    """Every function or method name defined in the installed sources -> where (``path:line``)."""
    defs: dict[str, list[str]] = {}
    for p in installed_sources():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defs.setdefault(node.name, []).append(f"{p.relative_to(ROOT)}:{node.lineno}")
    return defs


# one helper -> (the names its copies went by, the one file that defines it)
ONE_OF_EACH = {
    "nrmse": (("nrmse", "_nrmse"), "alignpred/metrics.py"),
    "as_numpy": (("as_numpy", "_as_numpy", "to_numpy", "_to_numpy", "_np_view"), "alignpred/cache/arrays.py"),
    "tokens_digest": (("tokens_digest",), "alignpred/bank/capture_stats.py"),
    "load_cache": (("load_cache",), "alignpred/cache/cachefile.py"),
}


def test_sources_found():
    files = {str(p.relative_to(ROOT)) for p in installed_sources()}
    assert {"alignpred/metrics.py", "cli/main.py", "integrations/hf/bridge.py", "benchmarks/engines.py"} <= files


@pytest.mark.parametrize("helper", sorted(ONE_OF_EACH))
def test_one_definition(helper):
    names, home = ONE_OF_EACH[helper]
    defs = _definitions()
    where = [w for n in names for w in defs.get(n, [])]
    assert len(where) == 1 and where[0].startswith(home + ":"), f"{helper}: defined at {where} (want one, in {home})"


def test_hf_load_cache_is_a_deprecated_alias():
    import kvz.integrations.hf as hf

    with pytest.warns(DeprecationWarning, match="load_kvz_cache"):
        old = hf.load_cache
    assert old is hf.load_kvz_cache
    assert "load_cache" not in hf.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from kvz.integrations.hf import load_kvz_cache  # noqa: F401  (the new name warns nothing)


def test_nrmse_zero_norm_rule():
    import numpy as np

    from alignpred import nrmse

    z = np.zeros((2, 3), np.float32)
    assert nrmse(z, z) == 0.0 and nrmse(z, z + 1e-30) == float("inf")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert nrmse(x, x) == 0.0
    assert nrmse(x, x * 1.5) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        nrmse(x, x.ravel())


# ---------------------------------------------------------------------------- no tests/ in the package
def _docstrings(tree) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_installed_package_never_reaches_into_tests():
    """No installed module builds a path into ``tests/`` (a string ``"tests"`` or ``"tests/..."`` in its
    code; docstrings may name test files) or imports a module that lives there (issue 41, item 8:
    the engines benchmark put ``tests/integrations/sglang`` on ``sys.path`` for SGLang's helpers)."""
    test_modules = {p.stem for p in (ROOT / "tests").rglob("*.py")}
    bad = []
    for p in installed_sources():
        tree = ast.parse(p.read_text(), str(p))
        docs = _docstrings(tree)
        where = p.relative_to(ROOT)
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                if n.value.strip("/\\") == "tests" or "tests/" in n.value or "tests\\" in n.value:
                    bad.append(f"{where}:{n.lineno}: {n.value[:80]!r}")
            elif isinstance(n, ast.Import):
                bad += [f"{where}:{n.lineno}: import {a.name}" for a in n.names if a.name.split(".")[0] in test_modules]
            elif isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] in test_modules:
                bad.append(f"{where}:{n.lineno}: from {n.module} import ...")
    assert not bad, "\n".join(bad)


def _readme_engine_commands() -> list[list[str]]:
    """The engine-benchmark commands the README and the docs pages name."""
    import re
    import shlex

    text = "".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    cmds = sorted(set(re.findall(r"`(python -m kvz\.benchmarks\.engines[^`]*)`", text)))
    return [shlex.split(c)[1:] for c in cmds]  # without "python"


def test_readme_names_the_engine_commands():
    cmds = _readme_engine_commands()
    assert ["-m", "kvz.benchmarks.engines", "--engines", "sglang"] in cmds and len(cmds) >= 2, cmds


@pytest.mark.parametrize("args", _readme_engine_commands(), ids=" ".join)
def test_readme_engine_command_parses(args):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, *args, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "--engines" in r.stdout, r.stderr


@pytest.mark.parametrize("args", _readme_engine_commands(), ids=" ".join)
def test_readme_engine_command_needs_only_the_engine(args, tmp_path):
    """Run as the README writes it, in a venv without the engine: it stops on the engine's own
    import (exit 2, the message names the engine), not on anything of kvz's (it stopped on
    ``No module named '_torchvision_shim'``). The engine venvs run it for real
    (``tests/integrations/sglang_engine/test_engines_benchmark.py``)."""
    import importlib.util
    import subprocess
    import sys

    engine = args[args.index("--engines") + 1] if "--engines" in args else "lmcache"
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here: its engine tests run the command")
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and f"No module named '{engine}" in r.stderr, (r.returncode, r.stderr[-2000:])
