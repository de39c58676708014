"""kvz as an LMCache remote connector: chunks coded as ``.kvz`` in a kvz chunk-store backend
(:class:`~kvz.integrations.kvstore.RedisBackend` or :class:`~kvz.integrations.kvstore.DirectoryBackend`).

LMCache configuration::

    remote_storage_plugins: ["kvzr"]
    remote_serde: naive                     # kvz compresses; LMCache's own serde stays the identity
    extra_config:
      remote_storage_plugin.kvzr.module_path: kvz.integrations.lmcache
      remote_storage_plugin.kvzr.class_name: KvzRemoteConnector
      remote_storage_plugin.kvzr.url: redis://10.0.0.5:6379/0    # or file:///shared/kvz, or a directory
      remote_storage_plugin.kvzr.max_size_gb: 200                # optional budget (LRU eviction)
      remote_storage_plugin.kvzr.eps: 0.0267
      remote_storage_plugin.kvzr.bank: gemma-3-270m
      remote_storage_plugin.kvzr.metadata_from: /path/cache.safetensors
      remote_storage_plugin.kvzr.warmup: true      # compile kernels at start-up (background)

LMCache builds it as ``cls(loop=, local_cpu_backend=, config=)`` (no plugin name: it is found from the
config by class name). Encode and decode run in the event loop's executor. Entries are checksummed
by the backend; a store that is down or an entry that is corrupt is a miss and a warning.
"""
from __future__ import annotations

import asyncio

from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from . import _common as C
from .kvcodec import codec_from_options

__all__ = ["KvzRemoteConnector"]


def _release_late_result(fut) -> None:
    if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
        fut.result().ref_count_down()


class KvzRemoteConnector(RemoteConnector):
    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend, config, backend=None):
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        meta = local_cpu_backend.metadata
        if getattr(meta, "use_mla", False):
            raise ValueError("KvzRemoteConnector stores KV_2LTD chunks: MLA is not supported")
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.config = config
        self.name = C.plugin_name(config, "remote_storage_plugin", type(self))
        opts = C.options(config, f"remote_storage_plugin.{self.name}")
        self.chunk_size = int(meta.chunk_size)
        self.codec = codec_from_options(opts, default_step=self.chunk_size)
        self.num_heads = C.num_heads_of(meta)
        if backend is None:
            backend = C.backend_from_options(opts, "url", f"remote_storage_plugin.{self.name}",
                                             "redis://host:port/db or a directory")
        self.backend = backend
        self._binding = C.key_binding(meta)  # the weights: LMCache's keys name the model only
        self._reader = C.backend_reader(backend, f"kvz remote connector {self.name}")
        C.start_warmup(self.codec, meta, opts, f"kvz remote connector {self.name}")

    def __repr__(self):
        return f"<KvzRemoteConnector {self.name} {self.backend!r}>"

    def _key(self, key) -> str:
        return self._binding + key.to_string()

    # ------------------------------------------------------------------ sync helpers
    def exists_sync(self, key) -> bool:
        try:
            return bool(self.backend.contains(self._key(key)))
        except Exception as e:
            C.warn(f"kvz remote connector: contains failed ({e}); a miss")
            return False

    def _put_sync(self, key, memory_obj) -> None:
        t = memory_obj.tensor
        blob = self.codec.encode(C.kv_pairs(t, self.num_heads), None, step=self.chunk_size)
        rec = C.pack(blob, t.shape, t.dtype, memory_obj.get_memory_format())
        if not self.backend.put(self._key(key), rec, meta={"tokens": int(t.shape[2])}):
            C.warn(f"kvz remote connector: put of {key.to_string()[:60]} refused or failed; not stored")

    def _get_sync(self, key):
        k = self._key(key)
        rec = self._reader.get(k)
        if rec is None:
            return None
        return C.load_entry(rec, k, allocator=self.local_cpu_backend, codec=self.codec, backend=self.backend,
                            who="kvz remote connector")

    # ------------------------------------------------------------------ RemoteConnector
    async def exists(self, key) -> bool:
        return self.exists_sync(key)

    async def get(self, key):
        fut = self.loop.run_in_executor(None, self._get_sync, key)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # LMCache gave up waiting (its blocking timeout): the decode still finishes into a buffer
            # of LMCache's allocator that nobody will take now; release it when it arrives.
            fut.add_done_callback(_release_late_result)
            raise

    async def put(self, key, memory_obj):
        try:
            await self.loop.run_in_executor(None, self._put_sync, key, memory_obj)
        except Exception as e:
            C.warn(f"kvz remote connector: encoding failed ({type(e).__name__}: {e}); not stored")

    async def list(self):
        try:
            return list(self.backend.keys())
        except Exception as e:
            C.warn(f"kvz remote connector: list failed ({e})")
            return []

    def remove_sync(self, key) -> bool:
        try:
            return bool(self.backend.delete(self._key(key)))
        except Exception:
            return False

    async def close(self):
        try:
            self.backend.close()
        except Exception:
            pass
