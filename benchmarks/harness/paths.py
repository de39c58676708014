"""Where the benchmarks find their inputs and put their outputs: the repository root, the bundled
samples, the held-out and calibration caches, the results folder and the bundled bank."""
from __future__ import annotations

import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = os.path.join(ROOT, "samples", "gemma3-270m")
TEXTS = os.path.join(ROOT, "samples", "texts")
EVAL_DIR = os.path.join(ROOT, "data", "eval")
CALIB_DIR = os.path.join(ROOT, "data", "calib")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
BANK_NAME = "gemma-3-270m"
WARM_SAMPLE = os.path.join(SAMPLES, "english-prose.safetensors")


def bundled_bank() -> str:
    """The file of the bundled Gemma 3 270M bank (``alignpred.bank.PACKAGE_DIR``)."""
    from alignpred.bank import PACKAGE_DIR

    return os.path.join(str(PACKAGE_DIR), f"{BANK_NAME}.h5")


def resolve_bank(ref=None, layout=None):
    """A :class:`~alignpred.Bank` from a reference (default: the bundled bank) through the library's one
    resolver, :func:`alignpred.bank.resolve_bank`."""
    from alignpred.bank import resolve_bank as resolve

    return resolve(BANK_NAME if ref is None else ref, layout)


def bank_file(ref: str) -> str:
    """A file holding the bank ``ref`` (a path, or a registry name or id); the bundled bank when the
    registry entry has no file (worker processes load banks by path)."""
    from alignpred.bank import lookup

    if os.path.isfile(ref):
        return ref
    e = lookup(ref)
    p = getattr(e, "path", None) if e is not None else None
    if p and os.path.isfile(str(p)):
        return str(p)
    return bundled_bank()


def caches_in(folder: str) -> list[str]:
    """The ``*.safetensors`` caches of ``folder``, sorted."""
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def sample_caches() -> list[str]:
    """The bundled sample caches (448 tokens each)."""
    return caches_in(SAMPLES)


def eval_caches() -> list[str]:
    """The 2,048-token held-out caches (``data/eval``; made by ``samples/make_samples.py --what eval``)."""
    return caches_in(EVAL_DIR)


def default_caches(given=None, *, fallback: bool = True) -> list[str]:
    """``given`` if any, else the held-out caches, else (with ``fallback``) the bundled samples."""
    if given:
        return list(given)
    return eval_caches() or (sample_caches() if fallback else [])


NO_EVAL = ("no held-out caches in data/eval: make them with `python samples/make_samples.py --what eval`, "
           "or pass cache paths")


def display_path(p: str) -> str:
    """A path as it may appear in committed output: relative to the repository, else just its file name."""
    ap = os.path.abspath(p)
    if ap == ROOT or ap.startswith(ROOT + os.sep):
        return os.path.relpath(ap, ROOT)
    return os.path.basename(ap)


def stem(p) -> str:
    """A cache's name: its file name without the extension."""
    return os.path.splitext(os.path.basename(str(p)))[0]
