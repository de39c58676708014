#!/usr/bin/env bash
# kvz inside LMCache: a fresh venv with the CPU torch, LMCache 0.5.6 (full dependencies; it picks a
# StubCPUDevice on a machine without a GPU) and kvz editable, then the adapter tests against the real
# package. Called from .ci/run; the venv lives outside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVZ_CI_VENVS:-${TMPDIR:-/tmp}/kvz-ci-venvs}/lmcache"

if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
export KVZ_REQUIRE_REDIS=1

python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
$PIP install -q torch==2.13.0
# keep the CPU torch through everything that follows
echo "torch==2.13.0" > "$VENV/kvz-constraints.txt"
$PIP install -q -c "$VENV/kvz-constraints.txt" lmcache==0.5.6
$PIP install -q -c "$VENV/kvz-constraints.txt" -e ".[store,test]"
"$VENV/bin/python" -c "import torch, lmcache; assert torch.__version__.startswith('2.13.0'), torch.__version__"

OPENBLAS_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/integrations/lmcache_engine
