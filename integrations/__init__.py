"""Bridges between kvz and real model runtimes (optional ``model`` extra), one folder per runtime or layer.

* :mod:`kvz.integrations.hf` — the transformers adapter (capture, RoPE, cache bridge, cache classes):
  the only package that touches transformers;
* :mod:`kvz.integrations.kvstore` — byte blobs under string keys (directory, Redis) with a byte budget;
* :mod:`kvz.integrations.chunkstore` — KV chunk reuse across prompts on a kvstore backend;
* :mod:`kvz.integrations.pager` — paging full KV in from ``.kvz`` files under a memory budget;
* :mod:`kvz.integrations.verify` — draft on compressed KV, verify on the full KV (lossless decoding);
* the serving engines' connectors (:mod:`kvz.integrations.vllm`, ``lmcache``, ``sglang``).

Packages use each other through package-level names only (``from kvz.integrations.hf import kv_shape``).
"""
from __future__ import annotations

import importlib

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: dict):
    """The PEP 562 ``__getattr__`` of a package whose public names load on first use:
    ``exports`` maps a name to its module (``".serde"``, relative to ``package``) or to
    ``(module, attribute)`` when the attribute has another name. A name is cached in the package
    once loaded; an unknown one is an ``AttributeError``. Engine packages use it so that importing
    them imports no engine.

    >>> __getattr__ = lazy_exports("kvz.integrations", {"dumps": ("json", "dumps")})
    >>> __getattr__("dumps")([1])
    '[1]'
    """
    def __getattr__(name: str):
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        mod, attr = (target, name) if isinstance(target, str) else target
        value = getattr(importlib.import_module(mod, package), attr)
        importlib.import_module(package).__dict__[name] = value
        return value

    return __getattr__
