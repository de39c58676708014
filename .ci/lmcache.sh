#!/usr/bin/env bash
# kvz inside LMCache: a fresh venv with the CPU torch, LMCache 0.5.6 (full dependencies; it picks a
# StubCPUDevice on a machine without a GPU) and kvz editable, then the adapter tests against the real
# package. Called from .ci/run; the venv lives outside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVZ_CI_VENVS:-${TMPDIR:-/tmp}/kvz-ci-venvs}/lmcache"

. .ci/lib.sh
ensure_redis
torch_venv "$VENV"
$PIP install -q -c "$VENV/kvz-constraints.txt" lmcache==0.5.6
$PIP install -q -c "$VENV/kvz-constraints.txt" -e ".[store,test]"
check_torch "$VENV"
"$VENV/bin/python" -c "import lmcache"

OPENBLAS_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/integrations/lmcache_engine
