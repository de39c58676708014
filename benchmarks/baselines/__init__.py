"""Baseline coders for the rate-distortion benchmark, each run at matched measured error.

``BASELINES[name].run(cache, eps, alloc, calib=None) -> Result``; ``eps=None`` means the method's natural setting.
Optional codec packages (pysz, zfpy, av, zstandard, pcodec) are imported only when a method runs; use
:func:`available` to list the methods whose packages import here.
"""
from __future__ import annotations

import importlib

from . import covrot, fp8, hevc, kivi, kvquant, kvtc, lossless, sz3, turboquant, zfp
from ._core import (
    ALLOCS,
    Baseline,
    Encoded,
    Result,
    TensorCodec,
    cast_back,
    error_stats,
    n_values,
    run_codec,
    search_continuous,
    search_discrete,
)

BASELINES: dict[str, TensorCodec] = {}
for _m in (fp8, kivi, sz3, zfp, kvtc, hevc, lossless, turboquant, kvquant, covrot):
    BASELINES.update(_m.baselines())

REQUIRES: dict[str, tuple[str, ...]] = {
    "sz3": ("pysz",), "sz3_lorenzo": ("pysz",), "sz3_aligned": ("pysz",),
    "zfp": ("zfpy",), "kvtc": ("zstandard",), "hevc": ("av",), "hevc_chnorm": ("av",),
    "zstd": ("zstandard",), "zstd_shuffle": ("zstandard",), "pcodec": ("pcodec",),
}
# The field's KV quantisers (turboquant_*, kivi*_r128, kvquant*) need only numpy/scipy (core dependencies); the
# pre-RoPE key path of kvquant* also imports alignpred.cache.rope.
REQUIRES.update({name: () for name in BASELINES if name.startswith(("turboquant", "kvquant"))})
REQUIRES.update({"kivi2_r128": (), "kivi4_r128": ()})


def available() -> list[str]:
    """Names of the baselines whose optional packages import in this environment."""
    out = []
    for name in BASELINES:
        try:
            for mod in REQUIRES.get(name, ()):
                importlib.import_module(mod)
        except Exception:
            continue
        out.append(name)
    return out


def get(name: str) -> TensorCodec:
    return BASELINES[name]


__all__ = ["ALLOCS", "BASELINES", "Baseline", "Encoded", "REQUIRES", "Result", "TensorCodec", "available",
           "cast_back", "error_stats", "get", "n_values", "run_codec", "search_continuous",
           "search_discrete"]
