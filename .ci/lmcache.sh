#!/usr/bin/env bash
# kvz inside LMCache: a fresh venv with the CPU torch, LMCache 0.5.6 (full dependencies; it picks a
# StubCPUDevice on a machine without a GPU) and kvz editable, then the adapter tests against the real
# package. Called from .ci/run; the venv lives outside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVZ_CI_VENVS:-${TMPDIR:-/tmp}/kvz-ci-venvs}/lmcache"

. .ci/lib.sh
ensure_redis
SRC="$VENV/lmcache-src"
if installing; then
torch_venv "$VENV"
$PIP install -q -c "$VENV/kvz-constraints.txt" lmcache==0.5.6
$PIP install -q -c "$VENV/kvz-constraints.txt" -e ".[store,test]"
check_torch "$VENV"
"$VENV/bin/python" -c "import lmcache"

# LMCache's own test suite is only in its sdist: fetch it (sha256 pinned) and unpack tests/, which
# tests/integrations/lmcache_engine/test_lmcache_suite.py runs against kvz's plugin and connector.
if [ ! -d "$SRC/lmcache-0.5.6/tests/v1" ]; then
    "$VENV/bin/python" - "$SRC" <<'PY'
import hashlib, io, sys, tarfile, urllib.request
url = ("https://files.pythonhosted.org/packages/84/25/"
       "3ccd46844c94e08897aa8d72716a538c07e4583410d84dbc6cd12cb60dc1/lmcache-0.5.6.tar.gz")
sha = "d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e"
data = urllib.request.urlopen(url, timeout=300).read()
got = hashlib.sha256(data).hexdigest()
if got != sha:
    sys.exit(f"lmcache-0.5.6.tar.gz: sha256 {got}, expected {sha}")
with tarfile.open(fileobj=io.BytesIO(data)) as t:
    t.extractall(sys.argv[1], members=[m for m in t.getmembers() if m.name.startswith("lmcache-0.5.6/tests/")],
                 filter="data")
PY
fi
fi
testing || exit 0
export KVZ_LMCACHE_TESTS="$SRC/lmcache-0.5.6" KVZ_REQUIRE_LMCACHE_SUITE=1 KVZ_REQUIRE_ENGINE=lmcache

OPENBLAS_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/integrations/lmcache_engine
