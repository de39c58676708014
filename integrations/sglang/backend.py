"""kvz as an SGLang HiCache storage backend (L3: host pool <-> storage), over the kvz chunk store's
directory or Redis backend.

SGLang loads it as the ``dynamic`` backend::

    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvz",
        "module_path": "kvz.integrations.sglang", "class_name": "KvzHiCacheStorage",
        "kvz_url": "redis://10.0.0.5:6379/0", "kvz_target_kl": "fp8", "kvz_bank": "gemma-3-270m",
        "kvz_metadata_from": "/path/cache.safetensors", "interface_v1": 1}'

``kvz_url``: ``redis://...`` or a directory (``file://`` optional); ``kvz_max_size_gb``: a byte
budget (LRU); ``kvz_target_kl``: a mean next-token KL or ``fp8`` (the default: FP8 e4m3's KL, in the
attention scope from the bank's statistics; the codec logs the scope it chose), or ``kvz_eps`` for
the tensor scope at that eps (docs/engine-scope.md); ``kvz_lossless``: bit-exact pages;
``kvz_profile``: ``default``, ``balanced`` or ``fast`` (a faster page-in at more bits);
``kvz_metadata`` (JSON model fields) or ``kvz_metadata_from`` (a kvz-cache file) give the model's
RoPE; ``kvz_position``: ``search`` (default) or ``zero`` for callers without a position.

A page (``2 * layers * page_size * heads * head_dim`` values, in any of the host pool's layouts
``layer_first``, ``page_first``, ``page_first_direct``, ``page_head``) is stored as one ``.kvz``
file of its tokens, per layer ``[heads, page_size, head_dim]`` — independent of the pool layout.
On the v1 path (``batch_set_v1``/``batch_get_v1``) the page's first token position is
``len(extra_info.prefix_keys) * page_size`` plus its index in the batch; the v0 path
(``set``/``get`` of flat pages) knows no position and searches it. A store that is down or an
entry that is corrupt is a miss and a :class:`KvzHiCacheWarning`.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvz.integrations.fingerprint import weights_fingerprint
from kvz.integrations.kvstore import CheckedReader, open_url
from kvz.integrations.lmcache import (  # the engine-free chunk codec (imports no LMCache)
    as_numpy,
    codec_from_options,
)

__all__ = ["KvzHiCacheStorage", "KvzHiCacheWarning", "page_to_pairs", "pairs_to_page", "LAYOUTS"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
logger = logging.getLogger("kvz.integrations.sglang")


class KvzHiCacheWarning(RuntimeWarning):
    """The kvz HiCache backend answered a miss instead of failing (store down, corrupt entry)."""


def _warn(msg: str) -> None:
    warnings.warn(msg, KvzHiCacheWarning, stacklevel=3)
    logger.warning(msg)


# ---------------------------------------------------------------------------- page layouts
def page_to_pairs(flat, layout: str, L: int, P: int, H: int, D: int) -> list:
    """Per-layer ``(k, v)`` numpy views ``[H, P, D]`` of one flat host-pool page."""
    a = as_numpy(flat)
    if layout == "layer_first":
        a = a.reshape(2, L, P, H, D)
        return [(a[0, i].transpose(1, 0, 2), a[1, i].transpose(1, 0, 2)) for i in range(L)]
    if layout == "page_first":
        a = a.reshape(2, P, L, H, D)
        return [(a[0, :, i].transpose(1, 0, 2), a[1, :, i].transpose(1, 0, 2)) for i in range(L)]
    if layout == "page_first_direct":
        a = a.reshape(2, L, P, H, D)  # [2, 1, L, P, H, D]
        return [(a[0, i].transpose(1, 0, 2), a[1, i].transpose(1, 0, 2)) for i in range(L)]
    if layout == "page_head":
        a = a.reshape(2, H, P, L, D)  # [2, 1, H, P, L, D]
        return [(a[0, :, :, i], a[1, :, :, i]) for i in range(L)]
    raise ValueError(f"unsupported HiCache page layout {layout!r}; kvz handles {', '.join(LAYOUTS)}")


def pairs_to_page(pairs, layout: str, out: np.ndarray) -> np.ndarray:
    """Write per-layer ``(k, v)`` ``[H, P, D]`` into a flat page ``out`` (numpy, the pool's dtype)."""
    L = len(pairs)
    H, P, D = pairs[0][0].shape
    if layout in ("layer_first", "page_first_direct"):
        a = out.reshape(2, L, P, H, D)
        for i, (k, v) in enumerate(pairs):
            a[0, i] = np.asarray(k).transpose(1, 0, 2)
            a[1, i] = np.asarray(v).transpose(1, 0, 2)
    elif layout == "page_first":
        a = out.reshape(2, P, L, H, D)
        for i, (k, v) in enumerate(pairs):
            a[0, :, i] = np.asarray(k).transpose(1, 0, 2)
            a[1, :, i] = np.asarray(v).transpose(1, 0, 2)
    elif layout == "page_head":
        a = out.reshape(2, H, P, L, D)
        for i, (k, v) in enumerate(pairs):
            a[0, :, :, i] = k
            a[1, :, :, i] = v
    else:
        raise ValueError(f"unsupported HiCache page layout {layout!r}")
    return out


# ---------------------------------------------------------------------------- the backend
class KvzHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config, kwargs=None, backend=None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        if getattr(storage_config, "is_mla_model", False):
            raise ValueError("KvzHiCacheStorage codes MHA pages; MLA models are not supported")
        opts = {k[len("kvz_"):]: v for k, v in extra.items() if k.startswith("kvz_")}
        opts.setdefault("threads", 1)
        try:
            self.codec = codec_from_options(opts)
        except ValueError as e:
            raise ValueError(f"KvzHiCacheStorage: {e} (HiCache extra config keys kvz_metadata / "
                             "kvz_metadata_from)") from None
        if backend is None:
            url = extra.get("kvz_url")
            if not url:
                raise ValueError("set kvz_url in the HiCache extra config (redis://host:port/db or a directory)")
            backend = open_url(str(url), budget_gb=extra.get("kvz_max_size_gb"))
        self.backend = backend
        model = "-".join((storage_config.model_name or "").split("/"))
        suffix = f"_{model}_{storage_config.tp_rank}_{storage_config.tp_size}"
        fingerprint = weights_fingerprint(storage_config.model_name)  # the checkpoint, not only its name
        if fingerprint:
            suffix += f"_{fingerprint}"
        if getattr(storage_config, "pp_size", 1) > 1:
            suffix += f"_{storage_config.pp_size}_{storage_config.pp_rank}"
        self.suffix = suffix
        self.mem_pool_host: Any = None  # set by register_mem_pool_host
        self._reader = CheckedReader(self.backend, "kvz HiCache", warn=_warn, noun="page")
        self.stats = {"set": 0, "get_hit": 0, "get_miss": 0, "searched_positions": 0}

    # ------------------------------------------------------------------ geometry
    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        if mem_pool_host.layout not in LAYOUTS:
            raise ValueError(f"KvzHiCacheStorage: host pool layout {mem_pool_host.layout!r} is not supported "
                             f"({', '.join(LAYOUTS)})")

    def _geom(self):
        p = self.mem_pool_host
        if p is None:
            raise RuntimeError("KvzHiCacheStorage: no host pool registered")
        return p.layout, p.layer_num, p.page_size, p.head_num, p.head_dim

    def _key(self, key: str) -> str:
        return key + self.suffix

    # ------------------------------------------------------------------ store / load one page
    def _encode(self, key: str, flat, position) -> bool:
        layout, L, P, H, D = self._geom()
        try:
            pairs = page_to_pairs(flat.contiguous(), layout, L, P, H, D)
            if position is None:
                self.stats["searched_positions"] += 1
            blob = self.codec.encode(pairs, position, step=P)
        except Exception as e:
            _warn(f"kvz HiCache: encoding page {key[:40]} failed ({type(e).__name__}: {e}); not stored")
            return False
        try:
            ok = bool(self.backend.put(self._key(key), blob, meta={"tokens": P}))
        except Exception as e:
            _warn(f"kvz HiCache: put failed ({type(e).__name__}: {e})")
            return False
        if ok:
            self.stats["set"] += 1
        return ok

    def _decode_into(self, key: str, out: torch.Tensor) -> bool:
        """Decode page ``key`` into the flat tensor ``out`` (the pool's dtype); False on a miss."""
        layout, L, P, H, D = self._geom()
        k = self._key(key)
        blob = self._reader.get(k)
        if blob is None:
            self.stats["get_miss"] += 1
            return False
        try:
            pairs, _ = self.codec.decode(blob)
            if len(pairs) != L or tuple(pairs[0][0].shape) != (H, P, D):
                raise ValueError(f"stored page is {len(pairs)} x {tuple(pairs[0][0].shape)}, the pool's is "
                                 f"{L} x {(H, P, D)}")
            stage = torch.empty(out.numel(), dtype=out.dtype)
            pairs_to_page(pairs, layout, as_numpy(stage, writable=True))
            out.view(-1).copy_(stage)
        except Exception as e:
            _warn(f"kvz HiCache: page {key[:40]} is corrupt or foreign ({type(e).__name__}: {e}); deleted, a miss")
            try:
                self.backend.delete(k)
            except Exception:
                pass
            self.stats["get_miss"] += 1
            return False
        self.stats["get_hit"] += 1
        return True

    # ------------------------------------------------------------------ v1 (positions from prefix_keys)
    def _first_position(self, extra_info):
        pk = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return None if pk is None else len(pk) * self.mem_pool_host.page_size

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        P = self.mem_pool_host.page_size
        base = self._first_position(extra_info)
        out = []
        for i, key in enumerate(keys):
            if self.exists(key):
                out.append(True)
                continue
            page = self.mem_pool_host.get_data_page(int(host_indices[i * P]), flat=True)
            out.append(self._encode(key, page, None if base is None else base + i * P))
        return out

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        P = self.mem_pool_host.page_size
        out = []
        for i, key in enumerate(keys):
            stage = self.mem_pool_host.get_dummy_flat_data_page()
            ok = self._decode_into(key, stage)
            if ok:
                self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * P]), stage)
            out.append(ok)
        return out

    # ------------------------------------------------------------------ v0 (flat pages, no position)
    def get(self, key, target_location=None, target_sizes=None):
        if target_location is None:
            target_location = self.mem_pool_host.get_dummy_flat_data_page()
        return target_location if self._decode_into(key, target_location) else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        locs = target_locations or [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, locs)]

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        if self.exists(key):
            return True
        return self._encode(key, value, None)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        return all([self.set(k, v) for k, v in zip(keys, values)])

    def exists(self, key) -> bool:
        try:
            return bool(self.backend.contains(self._key(key)))
        except Exception as e:
            _warn(f"kvz HiCache: exists failed ({type(e).__name__}: {e}); a miss")
            return False

    def batch_exists(self, keys, extra_info=None) -> int:
        for i, k in enumerate(keys):
            if not self.exists(k):
                return i
        return len(keys)

    def clear(self) -> None:
        try:
            self.backend.clear()
        except Exception as e:
            _warn(f"kvz HiCache: clear failed ({e})")

    def get_stats(self):
        st = dict(self.stats)
        st.update({f"codec_{k}": v for k, v in self.codec.stats.items()})
        return st

    def close(self) -> None:
        try:
            self.backend.close()
        except Exception:
            pass
