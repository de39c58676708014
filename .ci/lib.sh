# Shared steps of the engine CI scripts (sourced, not run): a redis-server for the store tests, and a
# fresh venv with the CPU torch whose version every later install is held to.
ensure_redis() {
    if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
        local sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
        $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server >/dev/null
    fi
    export KVZ_REQUIRE_REDIS=1
}

# torch_venv DIR: python3 -m venv DIR with pip upgraded and torch==2.13.0 (CPU); sets PIP and writes
# DIR/kvz-constraints.txt (pass it with -c to keep the CPU torch through what follows).
torch_venv() {
    python3 -m venv "$1"
    PIP="$1/bin/python -m pip"
    $PIP install -q --upgrade pip
    $PIP install -q torch==2.13.0
    echo "torch==2.13.0" > "$1/kvz-constraints.txt"
}

# check_torch DIR: the venv still has the CPU torch 2.13.0.
check_torch() {
    "$1/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
}

# The two phases of an engine script: KVZ_CI_PHASE=install (make the venv, nothing else), test (run
# the tests in the venv an earlier install phase made), or unset (both, one after the other: what a
# developer runs). .ci/run installs every engine in the background while the main suite runs.
installing() { [ "${KVZ_CI_PHASE:-all}" != test ]; }
testing() { [ "${KVZ_CI_PHASE:-all}" != install ]; }
