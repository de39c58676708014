"""Whether an engine's adapter tests can run in this interpreter.

An engine counts as present only when the modules its tests use import: a package installed without
its dependencies (``pip install lmcache --no-deps``, say, for a benchmark) must not turn the main test
run red. Where the engine's own CI venv runs the tests (``.ci/<engine>.sh`` exports
``KVZ_REQUIRE_ENGINE=<engine>``), a missing or broken engine is an error instead of a skip, so CI never
passes by skipping the tests it exists to run."""
import importlib
import os

import pytest


def required(engine: str) -> bool:
    """True where ``KVZ_REQUIRE_ENGINE`` (comma-separated) names ``engine``."""
    return engine in os.environ.get("KVZ_REQUIRE_ENGINE", "").replace(" ", "").split(",")


def require(engine: str, modules: tuple[str, ...]) -> None:
    """Skip the calling test module unless every one of ``modules`` imports (raise where required)."""
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # an ImportError, or an engine that fails while importing on this machine
            if required(engine):
                raise
            pytest.skip(f"{engine} is not usable here ({name}: {type(e).__name__}: {e}); "
                        f".ci/{engine}.sh runs these tests in the engine's own venv", allow_module_level=True)
