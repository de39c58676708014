"""Packaging: every package folder is installed, under namespaced import names only."""
import os

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(here, os.path.join(ROOT, folder))
                want.add(name if rel == "." else name + "." + rel.replace(os.sep, "."))
    assert want == listed, f"missing: {sorted(want - listed)}, extra: {sorted(listed - want)}"


def test_no_top_level_generic_names():
    for pkg in _config()["packages"]:
        assert pkg.split(".")[0] in ("alignpred", "kvz"), pkg
