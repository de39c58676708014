"""Reading and writing KV caches as safetensors files (the kvz input/output convention).

The parser is pure over bytes (:func:`parse_safetensors`); :func:`load_cache` maps a file and
returns zero-copy views; :func:`save_cache` writes atomically. bfloat16 arrays use ml_dtypes.

>>> import numpy as np, tempfile, os
>>> t = {f"layers.0.{k}": np.arange(12, dtype=np.float32).reshape(1, 3, 4) for k in ("key", "value")}
>>> p = os.path.join(tempfile.mkdtemp(), "c.safetensors")
>>> save_cache(p, t, {"model": "toy"})
>>> c = load_cache(p)
>>> c.layout.n_tokens, c.metadata["model"], float(c.tensors["layers.0.value"][0, 2, 3])
(3, 'toy', 11.0)
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from alignpred.cache.layout import CacheLayout, infer_layout, numpy_dtype
from alignpred.errors import KvzError, LayoutError
from alignpred.io import atomic_write, map_file

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
MAX_HEADER = 256 << 20


@dataclass
class Cache:
    """A KV cache: tensors (numpy arrays, possibly memory-mapped), metadata, layout.

    Build one from arrays with :meth:`from_arrays` (numpy arrays or CPU torch tensors, viewed
    without a copy), or load a safetensors file with :func:`load_cache`.
    """

    tensors: dict
    metadata: dict
    layout: CacheLayout
    path: str | None = None  # the file it was loaded from (for error messages)
    buf: object = field(default=None, repr=False, compare=False)  # the mapped file behind tensors

    @classmethod
    def from_arrays(cls, tensors, metadata: dict | None = None, **fields) -> Cache:
        """A cache from ``{"layers.{i}.key" | "layers.{i}.value": array}`` (or a list of
        ``(key, value)`` pairs, one per layer), each ``[kv_heads, T, head_dim]`` or
        ``[1, kv_heads, T, head_dim]`` in bfloat16/float16/float32 — numpy arrays or CPU torch
        tensors, viewed without copying. ``metadata`` uses the fields of
        :mod:`alignpred.cache.metadata` (strings as in a file, or Python values); keyword ``fields``
        are the same fields given directly (``keys_roped=True, rope_theta=[1e4, 1e6]``).
        Everything is validated here, with errors naming the field.

        >>> import numpy as np
        >>> kv = [(np.ones((2, 5, 8), np.float16), np.ones((2, 5, 8), np.float16)) for _ in range(3)]
        >>> c = Cache.from_arrays(kv, model="toy", position_offset=7)
        >>> c.layout.num_layers, c.layout.kv_heads, c.layout.position_offset
        (3, 2, 7)
        """
        from alignpred.cache.arrays import as_numpy

        if isinstance(tensors, (list, tuple)):
            pairs = list(tensors)
            if not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
                raise LayoutError("give tensors as {name: array} or as a list of (key, value) pairs")
            tensors = {f"layers.{i}.{k}": a for i, p in enumerate(pairs) for k, a in zip(("key", "value"), p)}
        if not isinstance(tensors, dict):
            raise LayoutError("give tensors as {name: array} or as a list of (key, value) pairs")
        arrays = {str(n): as_numpy(a) for n, a in tensors.items()}
        meta = dict(metadata or {})
        meta.update(fields)
        return cls(arrays, meta, infer_layout(arrays, meta))

    @classmethod
    def from_paged(cls, k_pools, v_pools, block_table, n_tokens: int | None = None, start: int = 0,
                   metadata: dict | None = None, **fields) -> Cache:
        """A cache from paged KV: per layer a block pool ``[num_blocks, block_size, kv_heads,
        head_dim]`` (a list of pools, or one array with a leading layer axis), the sequence's
        ``block_table`` (block ids in position order) and the positions ``[start, start +
        n_tokens)`` to take (default: all the table covers). ``position_offset`` becomes ``start``
        (plus any offset given). Other fields as :meth:`from_arrays`.

        >>> import numpy as np
        >>> pools = np.random.default_rng(0).standard_normal((2, 8, 16, 1, 4)).astype(np.float16)
        >>> c = Cache.from_paged(pools, pools, [5, 2, 7], n_tokens=40)
        >>> c.layout.n_tokens, c.tensors["layers.1.key"].shape
        (40, (1, 40, 4))
        """
        from alignpred.cache.paged import gather

        if len(k_pools) != len(v_pools):
            raise LayoutError(f"{len(k_pools)} key pools but {len(v_pools)} value pools: one of each per layer")
        kv = [(gather(k, block_table, n_tokens, start), gather(v, block_table, n_tokens, start))
              for k, v in zip(k_pools, v_pools)]
        meta = dict(metadata or {})
        meta.update(fields)
        if start:
            meta["position_offset"] = int(meta.get("position_offset", 0) or 0) + int(start)
        return cls.from_arrays(kv, meta)


def parse_safetensors(buf) -> tuple[dict, dict]:
    """Parse safetensors bytes into ``({name: array view}, metadata)`` without copying."""
    mv = memoryview(buf)
    if len(mv) < 8:
        raise LayoutError("not a safetensors file (shorter than 8 bytes)")
    (hlen,) = struct.unpack_from("<Q", mv, 0)
    if hlen > MAX_HEADER or 8 + hlen > len(mv):
        raise LayoutError("not a safetensors file (header length out of range; truncated?)")
    try:
        header = json.loads(bytes(mv[8:8 + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise LayoutError("not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise LayoutError("not a safetensors file (header is not an object)")
    meta = header.pop("__metadata__", None) or {}
    data = mv[8 + hlen:]
    out = {}
    for name, info in header.items():
        try:
            dt = _ST_DTYPES[info["dtype"]]
        except (KeyError, TypeError):
            got = info.get("dtype") if isinstance(info, dict) else info
            raise LayoutError(f"tensor {name!r}: unsupported dtype {got!r}; "
                              f"kvz reads {', '.join(_ST_DTYPES)}: convert the cache first "
                              "(e.g. tensor.to(torch.bfloat16) before saving)") from None
        shape = tuple(int(s) for s in info["shape"])
        a, b = (int(x) for x in info["data_offsets"])
        npdt = numpy_dtype(dt)
        if not (0 <= a <= b <= len(data)) or (b - a) != int(np.prod(shape, dtype=np.int64)) * npdt.itemsize:
            raise LayoutError(f"tensor {name!r}: data offsets out of range (truncated file?)")
        out[name] = np.frombuffer(data[a:b], dtype=npdt).reshape(shape)
    return out, {str(k): str(v) for k, v in meta.items()}


def load_cache(path) -> Cache:
    """Load a cache file; raises KvzError/LayoutError with the file name on any problem."""
    buf = map_file(path)
    try:
        tensors, meta = parse_safetensors(buf)
        layout = infer_layout(tensors, meta)
    except LayoutError as e:
        raise LayoutError(f"{path}: {e}") from None
    return Cache(tensors, meta, layout, path=str(path), buf=buf)


def safetensors_header(specs, metadata: dict | None = None) -> bytes:
    """The length-prefixed safetensors header for tensors ``specs = [(name, shape, dtype), ...]``
    laid out in that order (JSON without whitespace, padded with spaces to a multiple of 8)."""
    header = {}
    off = 0
    for name, shape, dtype in specs:
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        header[name] = {"dtype": _ST_NAMES[_dtname(dt)], "shape": [int(x) for x in shape],
                        "data_offsets": [off, off + n]}
        off += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb


def cache_bytes(tensors: dict, metadata: dict | None = None):
    """Yield the safetensors encoding of ``tensors`` (in the dict's order)."""
    names = list(tensors)
    yield safetensors_header([(n, tensors[n].shape, tensors[n].dtype) for n in names], metadata)
    for name in names:
        yield np.ascontiguousarray(tensors[name]).tobytes()


def _dtname(dt) -> str:
    for name in _ST_DTYPES.values():
        if numpy_dtype(name) == dt:
            return name
    raise LayoutError(f"unsupported dtype {dt}")


def save_cache(path, tensors, metadata: dict | None = None) -> None:
    """Write a cache atomically as safetensors: ``tensors`` is ``{name: array}`` or a
    :class:`Cache` (its metadata is written unless ``metadata`` is given); ``save_cache(cache,
    path)`` is accepted too."""
    if isinstance(path, Cache) and not isinstance(tensors, Cache):
        path, tensors = tensors, path
    if isinstance(tensors, Cache):
        tensors, metadata = tensors.tensors, tensors.metadata if metadata is None else metadata
    if not isinstance(tensors, dict):
        raise KvzError(f"save_cache(path, tensors): tensors must be a Cache or {{name: array}}, got "
                       f"{type(tensors).__name__}")
    try:
        atomic_write(path, cache_bytes(tensors, metadata))
    except KvzError:
        raise
