"""LMCache-side helpers of the kvz adapters: configuration from LMCache's ``extra_config``, the
``KV_2LTD`` chunk tensor <-> per-layer ``(k, v)`` views, the on-store record of a chunk."""
from __future__ import annotations

import json
import struct
import warnings

import numpy as np

from alignpred.cache import as_numpy
from kvz.integrations.kvstore import CheckedReader, open_url

from .kvcodec import KvzChunkCodec, as_bool


class KvzLMCacheWarning(RuntimeWarning):
    """A kvz tier answered a miss instead of failing a request (store down, corrupt entry)."""


def warn(msg: str) -> None:
    warnings.warn(msg, KvzLMCacheWarning, stacklevel=3)
    try:
        from lmcache.logging import init_logger

        init_logger("kvz.integrations.lmcache").warning(msg)
    except Exception:  # pragma: no cover - logging must never fail a request
        pass


def plugin_name(config, kind: str, cls) -> str:
    """The name this class was configured under (``storage_plugin.<name>.class_name`` /
    ``remote_storage_plugin.<name>.class_name``): LMCache does not pass it to the constructor."""
    extra = getattr(config, "extra_config", None) or {}
    names = (config.storage_plugins if kind == "storage_plugin" else config.remote_storage_plugins) or []
    for n in names:
        if extra.get(f"{kind}.{n}.class_name") == cls.__name__:
            return n
    raise ValueError(f"{cls.__name__}: no {kind}.<name>.class_name = {cls.__name__} in extra_config "
                     f"(configured {kind}s: {list(names)})")


def options(config, prefix: str) -> dict:
    """``extra_config`` values under ``prefix.`` (``storage_plugin.kvz.eps`` -> ``eps``), falling back to
    global ``kvz.<key>`` values."""
    extra = getattr(config, "extra_config", None) or {}
    out = {k[len("kvz."):]: v for k, v in extra.items() if k.startswith("kvz.")}
    out.update({k[len(prefix) + 1:]: v for k, v in extra.items() if k.startswith(prefix + ".")})
    return out


# ---------------------------------------------------------------------------- chunk tensors
def kv_pairs(t, num_heads: int) -> list:
    """Per-layer ``(k, v)`` numpy views ``[H, T, D]`` of a ``KV_2LTD`` tensor ``[2, L, T, H*D]``."""
    a = as_numpy(t)
    two, L, T, HD = a.shape
    if two != 2 or HD % num_heads:
        raise ValueError(f"expected a KV_2LTD chunk [2, L, T, H*D] with H={num_heads}, got {tuple(a.shape)}")
    a = a.reshape(2, L, T, num_heads, HD // num_heads)
    return [(a[0, i].transpose(1, 0, 2), a[1, i].transpose(1, 0, 2)) for i in range(L)]


def write_pairs(t, pairs) -> None:
    """Copy per-layer ``(k, v)`` ``[H, T, D]`` into a ``KV_2LTD`` torch tensor (in place)."""
    import torch

    for i, (k, v) in enumerate(pairs):
        for j, x in ((0, k), (1, v)):
            x = np.asarray(x)
            H, T, D = x.shape
            src = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)).reshape(T, H * D).view(np.uint16)
                                   if x.dtype.name == "bfloat16" else
                                   np.ascontiguousarray(x.transpose(1, 0, 2)).reshape(T, H * D))
            if x.dtype.name == "bfloat16":
                src = src.view(torch.bfloat16)
            t[j, i].copy_(src.to(t.dtype))


def num_heads_of(metadata) -> int:
    return int(metadata.kv_shape[3])


def key_binding(metadata) -> str:
    """What kvz puts before LMCache's key string in its store: the served checkpoint's weights
    fingerprint (:func:`~kvz.integrations.fingerprint.weights_fingerprint` of LMCache's
    ``metadata.model_name``), so two checkpoints served under the same name never read each other's
    chunks; ``""`` where nothing local can be fingerprinted (LMCache's key alone, as before).

    >>> from types import SimpleNamespace
    >>> key_binding(SimpleNamespace(model_name="org/not-downloaded-model"))
    ''
    """
    from kvz.integrations.fingerprint import weights_fingerprint

    fp = weights_fingerprint(getattr(metadata, "model_name", None))
    return f"{fp}@" if fp else ""


def backend_from_options(opts: dict, key: str, prefix: str, hint: str):
    """The chunk-store backend named by ``opts[key]`` (a URL or directory, see
    :func:`kvz.integrations.kvstore.open_url`), with the byte budget ``max_size_gb`` if set."""
    url = opts.get(key)
    if not url:
        raise ValueError(f"set {prefix}.{key} ({hint})")
    return open_url(str(url), budget_gb=opts.get("max_size_gb"))


def start_warmup(codec: KvzChunkCodec, metadata, opts: dict, who: str) -> None:
    """Compile the codec's kernels in the background at start-up (``<prefix>.warmup: false`` turns
    it off): a cold numba compile takes longer than LMCache waits for a read (10 s)."""
    if not as_bool(opts.get("warmup", True)):
        return
    L, _, _, H, D = (int(x) for x in metadata.kv_shape)
    dtype = str(getattr(metadata, "kv_dtype", "bfloat16")).replace("torch.", "")
    def failed(e: Exception) -> None:
        warn(f"{who}: codec warm-up failed ({type(e).__name__}: {e}); the first request compiles")

    codec.start_warmup(L, H, D, dtype, on_error=failed)


# ---------------------------------------------------------------------------- stored records
# A record: magic, JSON length, JSON {shape, dtype, fmt}, then the .kvz blob.
MAGIC = b"KVZLMC1\0"


def pack(blob: bytes, shape, dtype, fmt) -> bytes:
    head = json.dumps({"shape": [int(s) for s in shape], "dtype": str(dtype).replace("torch.", ""),
                       "fmt": getattr(fmt, "name", str(fmt))}, separators=(",", ":")).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + bytes(blob)


def unpack(buf) -> tuple[dict, memoryview]:
    mv = memoryview(buf)
    if len(mv) < 12 or bytes(mv[:8]) != MAGIC:
        raise ValueError("not a kvz LMCache record (bad magic)")
    (n,) = struct.unpack_from("<I", mv, 8)
    if 12 + n > len(mv):
        raise ValueError("kvz LMCache record truncated")
    head = json.loads(bytes(mv[12:12 + n]))
    return head, mv[12 + n:]


def torch_dtype(name: str):
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a kvz record")
    return dt


def memory_format(name: str):
    from lmcache.v1.memory_management import MemoryFormat

    return MemoryFormat[name]


def backend_reader(backend, what: str) -> CheckedReader:
    """The adapters' corrupt-aware read (:class:`kvz.integrations.kvstore.CheckedReader`), warning
    as :class:`KvzLMCacheWarning`."""
    return CheckedReader(backend, what, warn=warn)


def load_entry(rec, key: str, *, allocator, codec, backend, who: str):
    """A stored record decoded into a fresh LMCache memory object from ``allocator`` (the local CPU
    backend), or None: no buffer, or a corrupt entry (deleted) — a miss and a warning, never an error."""
    import torch

    obj = None
    try:
        head, blob = unpack(rec)
        obj = allocator.allocate([torch.Size(tuple(head["shape"]))], [torch_dtype(head["dtype"])],
                                 memory_format(head["fmt"]))
        if obj is None:
            warn(f"{who}: no CPU buffer for a hit; a miss")
            return None
        pairs, _ = codec.decode(blob)
        write_pairs(obj.tensor, pairs)
        return obj
    except Exception as e:
        warn(f"{who}: entry {key[:60]} is corrupt ({type(e).__name__}: {e}); deleted, a miss")
        if obj is not None:
            obj.ref_count_down()
        try:
            backend.delete(key)
        except Exception:
            pass
        return None
