"""The architecture, enforced: imports inside ``alignpred/`` only point down the pipeline, and
``integrations/``, ``benchmarks/`` and ``cli/`` use public names only (issue 22).

Public means: a name of ``alignpred`` itself, or a name in the ``__all__`` of one of its
sub-packages (``alignpred.cache``, ``.bank``, ``.codec``, ``.entropy``, ``.kernels``, ``.format``,
``.api``, ``.gpu``),
or of the leaf modules ``alignpred.io``, ``alignpred.threads``, ``alignpred.errors``, ``alignpred.metrics``; never a
module inside a sub-package, never a name starting with ``_``. Between integrations packages the
same holds one level down: ``kvz.integrations.chunkstore`` is public, ``...chunkstore.core`` is
not (the transformers adapter ``kvz.integrations.hf`` is a package of public modules)."""
from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# alignpred's layers, lowest first: a module may import its own layer and the ones below it.
LAYERS = [("errors", "_version", "io", "threads", "metrics"), ("kernels",), ("entropy",), ("cache",), ("bank",), ("codec",),
          ("format",), ("api",), ("gpu",)]
RANK = {name: i for i, group in enumerate(LAYERS) for name in group}
PUBLIC_PACKAGES = ("cache", "bank", "codec", "entropy", "kernels", "format", "api", "gpu")
PUBLIC_LEAVES = ("io", "threads", "errors", "metrics")


def _py_files(folder: str):
    for p in sorted((ROOT / folder).rglob("*.py")):
        if "__pycache__" not in p.parts:
            yield p


def _imports(path: Path):
    """``(module, [names], lineno)`` of every absolute import in a file (relative ones resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).with_suffix("")
    pkg = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                mod = ".".join(base + ([mod] if mod else []))
            yield mod, [a.name for a in node.names], node.lineno


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "alignpred" or len(parts) < 2:
        return None
    return RANK.get(parts[1])


def test_alignpred_imports_point_down():
    bad = []
    for p in _py_files("alignpred"):
        rel = p.relative_to(ROOT / "alignpred").parts
        if rel[0] == "__init__.py":
            continue
        own = RANK.get(rel[0].removesuffix(".py"))
        assert own is not None, f"{p}: not in a known layer ({rel[0]}); add it to LAYERS"
        for mod, names, line in _imports(p):
            targets = [mod] if mod != "alignpred" else [f"alignpred.{n}" for n in names]
            for t in targets:
                if t == "alignpred" or (t.startswith("alignpred.") and _layer(t) is None
                                        and t.split(".")[1] not in RANK):
                    bad.append(f"{p.relative_to(ROOT)}:{line} imports {t} (the package root: an upward import)")
                    continue
                lt = _layer(t)
                if lt is not None and lt > own:
                    bad.append(f"{p.relative_to(ROOT)}:{line} imports {t} (layer {lt} above {own})")
    assert not bad, "\n".join(bad)


def _public_names(module: str) -> set[str]:
    m = importlib.import_module(module)
    return set(getattr(m, "__all__", [n for n in dir(m) if not n.startswith("_")]))


@pytest.mark.parametrize("folder", ["integrations", "benchmarks", "cli"])
def test_outer_folders_use_public_names_only(folder):
    allowed_alignpred = {"alignpred"} | {f"alignpred.{p}" for p in PUBLIC_PACKAGES + PUBLIC_LEAVES}
    bad = []
    for p in _py_files(folder):
        own_pkg = p.relative_to(ROOT / folder).parts[0] if folder == "integrations" else None
        for mod, names, line in _imports(p):
            where = f"{p.relative_to(ROOT)}:{line}"
            if mod == "alignpred" or mod.startswith("alignpred."):
                if mod not in allowed_alignpred:
                    bad.append(f"{where} imports from {mod} (a module inside a package: use its package)")
                    continue
                public = _public_names(mod) | ({*PUBLIC_PACKAGES, *PUBLIC_LEAVES} if mod == "alignpred" else set())
                for n in names:
                    if n.startswith("_") or (n != "*" and n not in public):
                        bad.append(f"{where} imports {mod}.{n}, which is not public")
            elif mod.startswith("kvz.integrations."):
                parts = mod.split(".")
                if len(parts) > 3 and parts[2] != own_pkg and parts[2] != "hf":
                    bad.append(f"{where} imports {mod} (use kvz.integrations.{parts[2]}'s package-level names)")
                for n in names:
                    if n.startswith("_") and parts[2] != own_pkg:
                        bad.append(f"{where} imports private {mod}.{n}")
    assert not bad, "\n".join(bad)


def test_every_public_name_resolves():
    import alignpred

    for name in alignpred.__all__:
        assert getattr(alignpred, name) is not None, name
    for pkg in PUBLIC_PACKAGES:
        m = importlib.import_module(f"alignpred.{pkg}")
        for name in m.__all__:
            assert hasattr(m, name), f"alignpred.{pkg}.{name}"


def test_no_file_too_long():
    limits = {"alignpred": 500, "integrations": 500, "cli": 500, "benchmarks": 700}
    long = [f"{p.relative_to(ROOT)}: {n} lines (limit {lim})" for folder, lim in limits.items()
            for p in _py_files(folder) if (n := len(p.read_text().splitlines())) > lim]
    assert not long, "\n".join(long)


def test_import_alignpred_is_light():
    """``import alignpred`` loads no numba/numpy-heavy module until a name is used (PEP 562)."""
    import subprocess
    import sys

    code = ("import sys, alignpred; import kvz; print(sorted(m for m in ('numba', 'numpy', 'h5py', 'scipy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_container_imports_nothing_of_the_api():
    """Issue 41: ``alignpred.format`` is the container alone (bytes <-> records); what compresses
    and reads sits above it in ``alignpred.api``. No module of format imports api, in its code or
    at run time (docstring examples use the top-level names, which load lazily)."""
    import subprocess
    import sys

    bad = [f"{p.relative_to(ROOT)}:{line} imports {mod}" for p in _py_files("alignpred/format")
           for mod, names, line in _imports(p)
           if mod == "alignpred.api" or mod.startswith("alignpred.api.") or (mod == "alignpred" and "api" in names)]
    assert not bad, "\n".join(bad)
    code = ("import sys, alignpred.format, alignpred.format.container, alignpred.format.header, "
            "alignpred.format.index, alignpred.format.ranged; print(sorted(m for m in sys.modules "
            "if m.startswith('alignpred.api')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
