"""kvz inside LMCache: a compressed local-disk tier (storage plugin), a remote connector over the
kvz chunk store's backends (directory, Redis), and an L2 serde (``"type": "kvz"``).

Configured with LMCache's own keys (see ``docs/lmcache.md``)::

    storage_plugin.kvz.module_path: kvz.integrations.lmcache      class_name: KvzStoragePlugin
    remote_storage_plugin.kvzr.module_path: kvz.integrations.lmcache   class_name: KvzRemoteConnector
    import kvz.integrations.lmcache.serde   # registers the "kvz" L2 serde with register_serde_factory

The codec and the position search import no engine: :mod:`.kvcodec`, :mod:`.position`.
Names are imported lazily, so ``import kvz.integrations.lmcache`` does not import LMCache.
"""
from __future__ import annotations

from kvz.integrations import lazy_exports

_EXPORTS = {
    "KvzStoragePlugin": ".storage_plugin",
    "KvzRemoteConnector": ".connector",
    "KvzSerializer": ".serde",
    "KvzDeserializer": ".serde",
    "create_kvz_serde": ".serde",
    "CPUBufferConnector": ".cpu_connector",
    "KvzChunkCodec": ".kvcodec",
    "metadata_from_file": ".kvcodec",
    "model_metadata": ".kvcodec",
    "as_numpy": ("alignpred.cache", "as_numpy"),  # the one as_numpy (kept here for the adapters)
    "as_bool": ".kvcodec",
    "codec_from_options": ".kvcodec",
    "kv_pairs": "._common",
    "write_pairs": "._common",
    "find_position_offset": ".position",
    "PositionGuess": ".position",
    "KvzLMCacheWarning": "._common",
}
__all__ = list(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS)
