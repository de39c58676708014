"""kvz / AlignPred: error-bounded KV-cache compression and the .kvz container.

The public API (what a serving loader calls)::

    from alignpred import Cache, KvzReader, compress, compress_bytes, load_cache
    cache = load_cache("samples/gemma3-270m/english-prose.safetensors")   # or Cache.from_arrays(...)
    info = compress(cache, "out.kvz", budget=0.03, bank="gemma-3-270m")    # eps 0.03; bank by registry name
    r = KvzReader("out.kvz")                                                # or KvzReader(bytes / mmap)
    tensors = r.read(tokens=(0, 128))
    for layer, k, v in r.layers(tokens=(0, 128), out=lambda i: (kbuf[i], vbuf[i])):  # into your buffers
        ...
    warmup(profiles=("default", "fast"))   # at engine start-up: no numba compile on a request path

The pipeline, one sub-package per stage (imports only point down this list):

* :mod:`alignpred.errors`, :mod:`alignpred.io` (the only module that opens files),
  :mod:`alignpred.threads` (kvz's own worker pools), :mod:`alignpred.metrics` (:func:`nrmse`,
  the error measure eps bounds) — the base;
* :mod:`alignpred.kernels` — compiled kernels, each next to the numpy reference it must equal;
* :mod:`alignpred.entropy` — static probability models apart from the rANS coders;
* :mod:`alignpred.cache` — what a cache is: layout, metadata, safetensors, RoPE;
* :mod:`alignpred.bank` — calibration banks, their registry, calibration (GPA, ridge maps);
* :mod:`alignpred.codec` — config, error budget, frame, predictors, plan, rate control, encoder, decoder;
* :mod:`alignpred.format` — the ``.kvz`` container: bytes <-> records, header, index, byte-range sources;
* :mod:`alignpred.api` — what a user calls: compress, the reader, decoder sessions, warm-up, summaries;
* :mod:`alignpred.gpu` — the GPU decoder of a reader's coarse tier (optional: torch and triton).

Names are imported lazily (PEP 562): ``import alignpred`` costs almost nothing until a name is used.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from alignpred._version import __version__

# public name -> module that defines it
_EXPORTS = {
    "Bank": "alignpred.bank.bank",
    "fit_bank": "alignpred.bank.calibrate",
    "BankRegistry": "alignpred.bank.registry",
    "resolve_bank": "alignpred.bank.registry",
    "Cache": "alignpred.cache.cachefile",
    "load_cache": "alignpred.cache.cachefile",
    "save_cache": "alignpred.cache.cachefile",
    "CacheLayout": "alignpred.cache.layout",
    "RopeSpec": "alignpred.cache.rope",
    "RopeTable": "alignpred.cache.rope",
    "CodecConfig": "alignpred.codec.config",
    "ErrorBudget": "alignpred.codec.budget",
    "StageTimer": "alignpred.codec.decoder",
    "KvzReader": "alignpred.api.reader",
    "DecoderSession": "alignpred.api.session",
    "CompressInfo": "alignpred.api.writer",
    "compress": "alignpred.api.writer",
    "compress_bytes": "alignpred.api.writer",
    "warmup": "alignpred.api.warmup",
    "atomic_write": "alignpred.io",
    "atomic_file": "alignpred.io",
    "nrmse": "alignpred.metrics",
}
_ERRORS = ("KvzError", "KvzWarning", "FormatError", "TruncatedError", "ChecksumError", "UnsupportedVersionError",
           "BankMismatchError", "LayoutError", "MetadataError", "NonFiniteError", "EncodeError", "OutputExistsError")
_EXPORTS.update({name: "alignpred.errors" for name in _ERRORS})

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'alignpred' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers see the eager imports
    from alignpred.api.reader import KvzReader
    from alignpred.api.session import DecoderSession
    from alignpred.api.warmup import warmup
    from alignpred.api.writer import CompressInfo, compress, compress_bytes
    from alignpred.bank.bank import Bank
    from alignpred.bank.calibrate import fit_bank
    from alignpred.bank.registry import BankRegistry, resolve_bank
    from alignpred.cache.cachefile import Cache, load_cache, save_cache
    from alignpred.cache.layout import CacheLayout
    from alignpred.cache.rope import RopeSpec, RopeTable
    from alignpred.codec.budget import ErrorBudget
    from alignpred.codec.config import CodecConfig
    from alignpred.codec.decoder import StageTimer
    from alignpred.errors import (
        BankMismatchError,
        ChecksumError,
        EncodeError,
        FormatError,
        KvzError,
        KvzWarning,
        LayoutError,
        MetadataError,
        NonFiniteError,
        OutputExistsError,
        TruncatedError,
        UnsupportedVersionError,
    )
    from alignpred.io import atomic_file, atomic_write
    from alignpred.metrics import nrmse
