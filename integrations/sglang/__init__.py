"""kvz inside SGLang HiCache: a ``HiCacheStorage`` backend (directory or Redis, via the kvz chunk
store's backends) for the four MHA host-pool page layouts, loaded as SGLang's ``dynamic`` backend
(``module_path: kvz.integrations.sglang``, ``class_name: KvzHiCacheStorage``). See
``docs/sglang.md``. :mod:`.cpu` builds SGLang's classes without CUDA (a torchvision
stand-in, a CPU host pool: the engines benchmark and the tests use it). Names are imported lazily
(``import kvz.integrations.sglang`` does not import SGLang)."""
from __future__ import annotations

from kvz.integrations import lazy_exports

_EXPORTS = {"KvzHiCacheStorage": ".backend", "KvzHiCacheWarning": ".backend", "page_to_pairs": ".backend",
            "pairs_to_page": ".backend", "LAYOUTS": ".backend",
            "install_torchvision_stub": ".cpu", "cpu_host_pool": ".cpu", "storage_config": ".cpu",
            "hicache_extra": ".cpu"}
__all__ = list(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
