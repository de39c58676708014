"""Cache layout: which tensors a KV cache has, their shapes, dtypes and positional metadata.

A cache is a mapping ``name -> array`` with tensors ``layers.{i}.key`` and ``layers.{i}.value``,
each shaped ``[kv_heads, T, head_dim]`` (or HF's ``[batch=1, kv_heads, T, head_dim]``).
:class:`CacheLayout` is the frozen description the codec and the container agree on.

>>> lay = CacheLayout(num_layers=2, kv_heads=1, head_dim=4, n_tokens=3, dtype="bfloat16")
>>> lay.tensor_names()
['layers.0.key', 'layers.0.value', 'layers.1.key', 'layers.1.value']
>>> lay.n_values
48
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

import numpy as np

from .errors import LayoutError

DTYPES = ("bfloat16", "float16", "float32")
_NAME = re.compile(r"^layers\.(0|[1-9][0-9]*)\.(key|value)$")  # canonical: no leading zeros


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for one of :data:`DTYPES` (bfloat16 comes from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name in ("float16", "float32"):
        return np.dtype(name)
    raise LayoutError(f"unsupported dtype {name!r}; kvz reads {', '.join(DTYPES)}")


def dtype_name(dt: np.dtype) -> str:
    """Inverse of :func:`numpy_dtype`; raises LayoutError for anything else."""
    dt = np.dtype(dt)
    for name in DTYPES:
        if numpy_dtype(name) == dt:
            return name
    raise LayoutError(f"unsupported dtype {dt}; convert the cache to one of {', '.join(DTYPES)}")


@dataclass(frozen=True)
class CacheLayout:
    """Shape and positional metadata of a KV cache (every field is JSON-serialisable)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    n_tokens: int
    dtype: str
    batch_dim: bool = False
    model: str = ""
    layer_types: tuple[str, ...] = ()
    rope_theta: tuple[float, ...] = ()
    rope_pairing: str = "half"
    keys_roped: bool = False
    position_offset: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.num_layers < 1 or self.kv_heads < 1 or self.head_dim < 1 or self.n_tokens < 0:
            raise LayoutError(f"invalid layout sizes: {self.num_layers} layers, {self.kv_heads} heads, "
                              f"head_dim {self.head_dim}, {self.n_tokens} tokens")
        if self.dtype not in DTYPES:
            raise LayoutError(f"unsupported dtype {self.dtype!r}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise LayoutError("layer_types must have one entry per layer")
        if self.keys_roped:
            if len(self.rope_theta) != self.num_layers:
                raise LayoutError("keys_roped needs rope_theta for every layer")
            if self.rope_pairing not in ("half", "interleaved"):
                raise LayoutError(f"unknown rope_pairing {self.rope_pairing!r}")
            if self.head_dim % 2:
                raise LayoutError("RoPE needs an even head_dim")

    # -- names -----------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        """Tensor names in codec order: layer by layer, key before value."""
        return [f"layers.{i}.{kind}" for i in range(self.num_layers) for kind in ("key", "value")]

    @property
    def n_values(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.n_tokens * self.head_dim

    def tensor_shape(self) -> tuple[int, ...]:
        base = (self.kv_heads, self.n_tokens, self.head_dim)
        return (1,) + base if self.batch_dim else base

    def signature(self) -> dict:
        """What a calibration bank must agree with."""
        return {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim}

    def to_json(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["rope_theta"] = list(self.rope_theta)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CacheLayout":
        try:
            d = dict(d)
            d["layer_types"] = tuple(d.get("layer_types", ()))
            d["rope_theta"] = tuple(float(x) for x in d.get("rope_theta", ()))
            return cls(**d)
        except (TypeError, ValueError) as e:
            if isinstance(e, LayoutError):
                raise
            raise LayoutError(f"malformed layout: {e}") from None

    def with_tokens(self, n_tokens: int) -> "CacheLayout":
        d = self.to_json()
        d["n_tokens"] = n_tokens
        return CacheLayout.from_json(d)


def parse_name(name: str) -> tuple[int, str]:
    """``'layers.3.value' -> (3, 'value')``; LayoutError for anything else."""
    m = _NAME.match(name)
    if not m:
        raise LayoutError(f"unknown tensor name {name!r}; expected layers.{{i}}.key / layers.{{i}}.value "
                          "(i = 0, 1, ... without leading zeros): rename the tensors")
    return int(m.group(1)), m.group(2)


def infer_layout(tensors: dict, metadata: dict | None = None) -> CacheLayout:
    """Build a :class:`CacheLayout` from arrays (or objects with ``.shape``/``.dtype``) and
    safetensors-style string metadata; raises :class:`LayoutError` naming what is wrong.

    >>> import numpy as np
    >>> t = {f"layers.{i}.{k}": np.zeros((1, 5, 8), np.float16) for i in range(2) for k in ("key", "value")}
    >>> infer_layout(t).n_tokens
    5
    """
    metadata = metadata or {}
    if not tensors:
        raise LayoutError("the cache holds no tensors (empty cache)")
    layers: dict[int, set] = {}
    for name in tensors:
        i, kind = parse_name(name)
        layers.setdefault(i, set()).add(kind)
    n = max(layers) + 1
    missing = [f"layers.{i}.{k}" for i in range(n) for k in ("key", "value") if k not in layers.get(i, ())]
    if missing:
        raise LayoutError(f"missing tensors: {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}")
    first = tensors["layers.0.key"]
    shape = tuple(first.shape)
    if len(shape) == 4:
        if shape[0] != 1:
            raise LayoutError(f"layers.0.key has batch size {shape[0]}; kvz stores one sequence per file")
        batch = True
        shape = shape[1:]
    elif len(shape) == 3:
        batch = False
    else:
        raise LayoutError(f"layers.0.key has shape {tuple(first.shape)}; expected [kv_heads, T, head_dim] "
                          "or [1, kv_heads, T, head_dim]")
    dt = dtype_name(first.dtype)
    for name, arr in tensors.items():
        if tuple(arr.shape) != tuple(first.shape):
            raise LayoutError(f"{name} has shape {tuple(arr.shape)} but layers.0.key has {tuple(first.shape)}; "
                              "every key and value tensor must have the same shape")
        if dtype_name(arr.dtype) != dt:
            raise LayoutError(f"{name} has dtype {arr.dtype} but layers.0.key has {dt}; use one dtype")

    def _json(key, default):
        if key not in metadata:
            return default
        try:
            return json.loads(metadata[key])
        except (ValueError, TypeError):
            raise LayoutError(f"metadata {key!r} is not valid JSON") from None

    layer_types = tuple(_json("layer_types", []))
    rope_theta = tuple(float(x) for x in _json("rope_theta", []))
    keys_roped = str(metadata.get("keys_roped", "false")).lower() == "true"
    try:
        offset = int(metadata.get("position_offset", 0))
    except ValueError:
        raise LayoutError("metadata 'position_offset' is not an integer") from None
    return CacheLayout(num_layers=n, kv_heads=shape[0], head_dim=shape[2], n_tokens=shape[1], dtype=dt,
                       batch_dim=batch, model=str(metadata.get("model", "")), layer_types=layer_types,
                       rope_theta=rope_theta, rope_pairing=str(metadata.get("rope_pairing", "half")),
                       keys_roped=keys_roped, position_offset=offset)
