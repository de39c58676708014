"""The attention scope as an engine's store has it (issue 37, item 2): the bank's attention statistics only,
no capture statistics of the prompt (an engine saving a prefix has none), against the rate study's
``kvz-attention`` curve, which weighs positions by the prefill's own attention. Two curves are added to
:mod:`.rate_quality` and measured on the same prompts:

* ``kvz-bank``: ``compress(scope="attention")`` without capture statistics: channels by the bank, no row
  steps, the positions a sliding-window layer never attends again coarse (what ``kvz compress --target-kl``
  does on a cache without a ``.capture-stats.json``);
* ``kvz-engine``: the engines' default (:func:`kvz.integrations.scope.engine_budget`): the same,
  with the stale positions coded like the others, since an engine may read any block prefix of what it
  stored.

    python -m kvz.benchmarks.engine_scope --long --json OUT.json --methods kvz-attention,kvz-bank,kvz-engine,fp8 \\
        --kvz kvz-bank:0.0188,0.0267 --kvz kvz-engine:0.0188,0.0267

Every other option is :mod:`.rate_quality`'s. ``--vllm`` first: :mod:`.vllm_reuse` (its options, in the
vLLM venv) with two more stores, ``kvz-default`` (the connector given no eps: its default budget) and
``kvz-stale`` (the same, ``any_prefix: false``); ``--profile NAME`` pins every kvz store's profile::

    python -m kvz.benchmarks.engine_scope --vllm --quick --stores kvz,kvz-default,kvz-stale --json OUT.json
"""
from __future__ import annotations

import sys

import numpy as np

from . import rate_quality
from .rate_methods import add_kvz_variant

BANK = "gemma-3-270m"


def _restore(engine: bool):
    """``fn(kv, eps) -> (restored, bits)`` of a curve (see the module docstring)."""
    from alignpred import Cache, ErrorBudget, KvzReader, compress_bytes, resolve_bank
    from alignpred.cache import infer_layout

    bank = resolve_bank(BANK)

    def fn(kv, eps):
        tensors = {k: np.ascontiguousarray(v) for k, v in kv.items()}
        meta = dict(kv.metadata or {})
        cache = Cache(tensors, meta, infer_layout(tensors, meta))
        if engine:  # the stores' budget (tensor cap 3, the default)
            from kvz.integrations.scope import engine_budget

            budget = engine_budget(bank, eps=eps, scope="attention")
        else:
            budget = ErrorBudget(eps=eps, scope="attention", tensor_cap=3.0)
        blob = compress_bytes(cache, budget=budget, bank=bank)
        out = KvzReader(memoryview(blob), bank=bank).read()
        return {k: np.array(v) for k, v in out.items()}, 8 * len(blob)

    return fn


# --vllm: vllm_reuse's stores plus the connector's default (no eps given) and the same with the stale rows coarse
VLLM_STORES = {"kvz-default": {}, "kvz-stale": {"any_prefix": False}}


def vllm_main(argv) -> int:
    """:mod:`.vllm_reuse` (its options) with the stores of :data:`VLLM_STORES` too (``--stores``): its ``kvz``
    store's settings without ``eps``, plus the store's entry."""
    from . import vllm_reuse

    plain = vllm_reuse._store_cfg
    profile = None
    if "--profile" in argv:  # every kvz store in this profile (default: the connector's auto choice)
        i = argv.index("--profile")
        profile, argv = argv[i + 1], argv[:i] + argv[i + 2:]

    def store_cfg(store, root, *args):
        cfg = _store_cfg(store, root, *args)
        if profile is not None and isinstance(cfg, dict) and store.startswith("kvz"):
            cfg["profile"] = profile
        return cfg

    def _store_cfg(store, root, *args):
        if store not in VLLM_STORES:
            return plain(store, root, *args)
        cfg = {k: v for k, v in plain("kvz", root, *args).items() if k != "eps"}
        if cfg.get("store") == str(root / "kvz"):
            cfg["store"] = str(root / store)
        else:  # a shared server: a namespace of its own
            cfg["namespace"] = store
        return {**cfg, **VLLM_STORES[store]}

    vllm_reuse._store_cfg = store_cfg
    return vllm_reuse.main(argv)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--vllm"]:
        return vllm_main(argv[1:])
    add_kvz_variant("kvz-bank", fn=_restore(engine=False))
    add_kvz_variant("kvz-engine", fn=_restore(engine=True))
    return rate_quality.main(argv)


if __name__ == "__main__":
    sys.exit(main())
