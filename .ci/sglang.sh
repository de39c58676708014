#!/usr/bin/env bash
# kvz inside SGLang HiCache: a fresh venv with the CPU torch, SGLang 0.5.23 without its dependencies
# (they pin a CUDA torch 2.14.1) plus the pure-Python ones its KV-cache modules import, and kvz
# editable; then the adapter tests against the real package, and the README's
# `python -m kvz.benchmarks.engines --engines sglang`. torchvision is not installed (PyPI's build needs
# CUDA): the tests and the benchmark put a stand-in on SGLang's import path
# (kvz.integrations.sglang.install_torchvision_stub). Called from .ci/run; the venv lives outside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVZ_CI_VENVS:-${TMPDIR:-/tmp}/kvz-ci-venvs}/sglang"

. .ci/lib.sh
ensure_redis
if installing; then
torch_venv "$VENV"
$PIP install -q --no-deps sglang==0.5.23
# what `import sglang.srt.mem_cache.hicache_storage` and the MHA host pool need (found one by one)
# (the versions the adapter was tested with)
$PIP install -q -c "$VENV/kvz-constraints.txt" orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2 \
    triton==3.8.0 pillow==13.0.0 starlette==1.10.0 msgspec==0.23.0 pydantic==2.14.4 pyzmq==27.3.0 ipython==9.18.1 \
    aiohttp==3.14.5 transformers==5.24.0 dill==0.4.1 apache-tvm-ffi==0.1.15.post2 sentencepiece==0.2.3 \
    compressed-tensors==0.20.1 gguf==0.19.0
$PIP install -q -c "$VENV/kvz-constraints.txt" -e ".[store,test]"
check_torch "$VENV"
fi
testing || exit 0

KVZ_REQUIRE_ENGINE=sglang OPENBLAS_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/integrations/sglang_engine
