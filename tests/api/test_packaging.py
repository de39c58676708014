"""Packaging: every package folder is installed, under namespaced import names only, except the
studies (``benchmarks/studies/``: run from the repository root, never installed)."""
import os

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STUDIES = os.path.join(ROOT, "benchmarks", "studies")


def _config():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]


def test_every_package_folder_is_listed():
    cfg = _config()
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    want = set()
    for name, folder in dirs.items():
        for here, subdirs, files in os.walk(os.path.join(ROOT, folder)):
            subdirs[:] = [d for d in subdirs if d != "__pycache__" and os.path.join(here, d) != STUDIES]
            if "__init__.py" in files:
                rel = os.path.relpath(here, os.path.join(ROOT, folder))
                want.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert want == listed, f"missing: {sorted(want - listed)}, extra: {sorted(listed - want)}"


def test_no_top_level_generic_names():
    for pkg in _config()["packages"]:
        assert pkg.split(".")[0] in ("alignpred", "kvz"), pkg


def test_the_studies_are_not_installed_and_each_has_its_entry_points():
    """``benchmarks/studies/<question>/<study>``: never in ``packages``; each study module (or package)
    defines ``run(args)`` and ``markdown(result)`` (read from its source: importing a study may need
    torch)."""
    import ast

    assert not [p for p in _config()["packages"] if p.startswith("kvz.benchmarks.studies")]
    questions = sorted(d for d in os.listdir(STUDIES) if os.path.isdir(os.path.join(STUDIES, d)) and d != "__pycache__")
    assert questions == ["rate", "robustness", "serving", "speed"]
    missing = []
    for q in questions:
        for name in sorted(os.listdir(os.path.join(STUDIES, q))):
            path = os.path.join(STUDIES, q, name)
            if os.path.isdir(path) and os.path.exists(os.path.join(path, "__init__.py")):
                path = os.path.join(path, "__init__.py")
            elif not name.endswith(".py") or name == "__init__.py":
                continue
            tree = ast.parse(open(path, encoding="utf-8").read())
            defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            if not {"run", "markdown", "main"} <= defs:
                missing.append(f"{q}/{name}: {sorted({'run', 'markdown', 'main'} - defs)}")
    assert not missing, "\n".join(missing)


def test_installed_benchmark_files_are_short():
    """Issue 41: no file of the installed benchmarks (``kvz.benchmarks``, the studies left out) over 500 lines."""
    cfg = _config()
    long = []
    for pkg in cfg["packages"]:
        if pkg == "kvz.benchmarks" or pkg.startswith("kvz.benchmarks."):
            folder = os.path.join(ROOT, "benchmarks", *pkg.split(".")[2:])
            for f in sorted(os.listdir(folder)):
                if f.endswith(".py"):
                    n = len(open(os.path.join(folder, f), encoding="utf-8").read().splitlines())
                    if n > 500:
                        long.append(f"{pkg}/{f}: {n} lines")
    assert not long, "\n".join(long)
