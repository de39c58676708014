"""The suite-wide helpers of tests/conftest.py, for test modules here (this folder's own conftest.py
shadows the name ``conftest``)."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("kvz_root_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
_root = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_root)
sample_paths = _root.sample_paths
synthetic_cache = _root.synthetic_cache
