"""A kvz-compressed local-disk tier for LMCache, loaded as a storage plugin.

LMCache configuration (its own keys; YAML or ``LMCacheEngineConfig``)::

    storage_plugins: ["kvz"]
    extra_config:
      storage_plugin.kvz.module_path: kvz.integrations.lmcache
      storage_plugin.kvz.class_name: KvzStoragePlugin
      storage_plugin.kvz.path: /var/cache/lmcache-kvz        # a kvz DirectoryBackend
      storage_plugin.kvz.max_size_gb: 50                     # optional byte budget (LRU)
      storage_plugin.kvz.eps: 0.0267                         # NRMSE bound per tensor (FP8's error)
      storage_plugin.kvz.bank: gemma-3-270m                  # calibration bank (name, id or path)
      storage_plugin.kvz.lossless: false                     # true: bit-exact
      storage_plugin.kvz.metadata_from: /path/cache.safetensors  # or .metadata: {"rope_theta": ..., ...}
      storage_plugin.kvz.warmup: true              # compile kernels at start-up (background)

LMCache's keys carry a chunk hash, not a token position, so each chunk's rotary phase is searched
over chunk-aligned offsets (:mod:`.position`) and recorded in the file. Writes run on a worker
thread (encode takes ~0.3 s per 256-token chunk of an 18-layer model on one core); a chunk is
visible to ``contains`` once written. A store failure or an entry that fails its checksum or
decode is a miss and a :class:`KvzLMCacheWarning`, never an exception into LMCache.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from . import _common as C
from .kvcodec import codec_from_options

__all__ = ["KvzStoragePlugin"]


class KvzStoragePlugin(StoragePluginInterface):
    """LMCache storage plugin: chunks as ``.kvz`` blobs in a :class:`kvz.integrations.kvstore.ChunkBackend`."""

    def __init__(self, config=None, metadata=None, local_cpu_backend=None, loop=None, dst_device: str = "cpu",
                 backend=None):
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        if config is None or metadata is None:
            raise ValueError("KvzStoragePlugin needs LMCache's config and metadata")
        if getattr(metadata, "use_mla", False) or getattr(config, "use_layerwise", False):
            raise ValueError("KvzStoragePlugin stores KV_2LTD chunks: MLA and layerwise mode are not supported")
        self.name = C.plugin_name(config, "storage_plugin", type(self))
        opts = C.options(config, f"storage_plugin.{self.name}")
        self.codec = codec_from_options(opts, default_step=int(config.chunk_size))
        self.num_heads = C.num_heads_of(metadata)
        if backend is None:
            backend = C.backend_from_options(opts, "path", f"storage_plugin.{self.name}", "the kvz chunk directory")
        self.backend = backend
        self._binding = C.key_binding(metadata)  # the weights: LMCache's keys name the model only
        self._reader = C.backend_reader(backend, "kvz storage plugin")
        self._lock = threading.Lock()
        self._inflight: set = set()
        self._pool = ThreadPoolExecutor(max_workers=int(opts.get("workers", 1)), thread_name_prefix="kvz-put")
        C.start_warmup(self.codec, metadata, opts, "kvz storage plugin")

    def __str__(self):
        return f"KvzStoragePlugin({self.name})"

    # ------------------------------------------------------------------ lookups
    def _key(self, key) -> str:
        return self._binding + key.to_string()

    def contains(self, key, pin: bool = False) -> bool:
        try:
            return self.backend.contains(self._key(key))
        except Exception as e:  # a backend that is down answers misses
            C.warn(f"kvz storage plugin: contains failed ({e}); treated as a miss")
            return False

    def exists_in_put_tasks(self, key) -> bool:
        with self._lock:
            return self._key(key) in self._inflight

    def pin(self, key) -> bool:
        return self.contains(key)

    def unpin(self, key) -> bool:
        return self.contains(key)

    def remove(self, key, force: bool = True) -> bool:
        try:
            return bool(self.backend.delete(self._key(key)))
        except Exception as e:
            C.warn(f"kvz storage plugin: remove failed ({e})")
            return False

    # ------------------------------------------------------------------ writes
    def batched_submit_put_task(self, keys, objs, transfer_spec=None, on_complete_callback=None):
        for key, obj in zip(keys, objs):
            k = self._key(key)
            with self._lock:
                if k in self._inflight:
                    continue
                self._inflight.add(k)
            obj.ref_count_up()
            self._pool.submit(self._put, key, k, obj, on_complete_callback)

    def submit_put_task(self, key, obj, on_complete_callback=None):
        self.batched_submit_put_task([key], [obj], on_complete_callback=on_complete_callback)

    def _put(self, key, k: str, obj, callback) -> None:
        try:
            t = obj.tensor
            rec = C.pack(self.codec.encode(C.kv_pairs(t, self.num_heads), None, step=int(self.config.chunk_size)),
                         t.shape, t.dtype, obj.meta.fmt)
            if not self.backend.put(k, rec, meta={"tokens": int(t.shape[2])}):
                C.warn(f"kvz storage plugin: put of {k[:60]} refused or failed; the chunk is not stored")
        except Exception as e:
            C.warn(f"kvz storage plugin: encoding {k[:60]} failed ({type(e).__name__}: {e}); not stored")
        finally:
            obj.ref_count_down()
            with self._lock:
                self._inflight.discard(k)
            if callback is not None:
                try:
                    callback(key)
                except Exception as e:  # pragma: no cover
                    C.warn(f"kvz storage plugin: completion callback failed ({e})")

    def wait(self) -> None:
        """Block until every submitted write has finished (tests, shutdown)."""
        self._pool.submit(lambda: None).result()

    # ------------------------------------------------------------------ reads
    def get_blocking(self, key):
        k = self._key(key)
        rec = self._reader.get(k)
        if rec is None:
            return None
        return C.load_entry(rec, k, allocator=self.local_cpu_backend, codec=self.codec, backend=self.backend,
                            who="kvz storage plugin")

    def get_allocator_backend(self):
        if self.local_cpu_backend is None:
            raise RuntimeError("KvzStoragePlugin needs LMCache's LocalCPUBackend (local_cpu / max_local_cpu_size > 0)")
        return self.local_cpu_backend

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        try:
            self.backend.close()
        except Exception:
            pass
