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
