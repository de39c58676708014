"""Cache layout: which tensors a KV cache has, their shapes, dtypes and positional metadata, and
the one definition of the order in which the codec visits tensors and blocks.

A cache is a mapping ``name -> array`` with tensors ``layers.{i}.key`` and ``layers.{i}.value``,
each shaped ``[kv_heads, T, head_dim]`` (or HF's ``[batch=1, kv_heads, T, head_dim]``).
:class:`CacheLayout` is the frozen description the codec and the container agree on. A *block*
is one KV head of one tensor (``K.3.0`` = keys of layer 3, head 0); the codec visits blocks
layer by layer, keys before values, head by head (:meth:`CacheLayout.blocks`): a block is
predicted only from blocks earlier in that order.

>>> lay = CacheLayout(num_layers=2, kv_heads=1, head_dim=4, n_tokens=3, dtype="bfloat16")
>>> lay.tensor_names()
['layers.0.key', 'layers.0.value', 'layers.1.key', 'layers.1.value']
>>> [b.name for b in lay.blocks()]
['K.0.0', 'V.0.0', 'K.1.0', 'V.1.0']
>>> lay.n_values
48
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from alignpred.cache.rope import PAIRINGS, RopeSpec
from alignpred.errors import LayoutError

DTYPES = ("bfloat16", "float16", "float32")
KINDS = ("K", "V")
_NAME = re.compile(r"^layers\.(0|[1-9][0-9]*)\.(key|value)$")  # canonical: no leading zeros
MAX_LAYERS = 1 << 12
MAX_TOKENS = 1 << 40


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for one of :data:`DTYPES` (bfloat16 comes from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name in ("float16", "float32"):
        return np.dtype(name)
    raise LayoutError(f"unsupported dtype {name!r}; kvz reads {', '.join(DTYPES)}")


def dtype_name(dt) -> str:
    """Inverse of :func:`numpy_dtype`; raises LayoutError for anything else."""
    dt = np.dtype(dt)
    for name in DTYPES:
        if numpy_dtype(name) == dt:
            return name
    raise LayoutError(f"unsupported dtype {dt}; convert the cache to one of {', '.join(DTYPES)}")


def tensor_name(layer: int, kind: str) -> str:
    """``tensor_name(3, 'V') -> 'layers.3.value'``."""
    return f"layers.{layer}.{'key' if kind in ('K', 'key') else 'value'}"


def block_name(kind: str, layer: int, head: int) -> str:
    """``block_name('key', 3, 0) -> 'K.3.0'``."""
    return f"{'K' if kind in ('key', 'K') else 'V'}.{layer}.{head}"


class Block(NamedTuple):
    """One KV head of one tensor, in codec order."""

    layer: int
    kind: str  # "K" or "V"
    head: int

    @property
    def name(self) -> str:
        return block_name(self.kind, self.layer, self.head)

    @property
    def tensor(self) -> str:
        return tensor_name(self.layer, self.kind)


@dataclass(frozen=True)
class CacheLayout:
    """Shape and positional metadata of a KV cache (every field is JSON-serialisable).

    RoPE on keys: ``keys_roped`` says the keys carry it; ``rope`` is the exact per-layer
    description (:class:`~alignpred.cache.rope.RopeSpec`); the older ``rope_theta`` (one base per
    layer, default RoPE over all channels, ``rope_pairing``) is still read and turned into a
    spec by :attr:`rope_spec`.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    n_tokens: int
    dtype: str
    batch_dim: bool = False
    model: str = ""
    layer_types: tuple = ()
    rope_theta: tuple = ()
    rope_pairing: str = "half"
    keys_roped: bool = False
    position_offset: int = 0
    rope: RopeSpec | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for k in ("num_layers", "kv_heads", "head_dim", "n_tokens", "position_offset"):
            if type(getattr(self, k)) is not int:
                raise LayoutError(f"layout {k} must be an integer")
        if not (1 <= self.num_layers <= MAX_LAYERS and self.kv_heads >= 1 and self.head_dim >= 1
                and 0 <= self.n_tokens <= MAX_TOKENS):
            raise LayoutError(f"invalid layout sizes: {self.num_layers} layers, {self.kv_heads} heads, "
                              f"head_dim {self.head_dim}, {self.n_tokens} tokens")
        if not 0 <= self.position_offset <= MAX_TOKENS:
            raise LayoutError("position_offset must be in 0..2**40")
        if self.dtype not in DTYPES:
            raise LayoutError(f"unsupported dtype {self.dtype!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "rope_theta", tuple(self.rope_theta))
        if not all(isinstance(t, str) and t for t in self.layer_types):
            raise LayoutError("layer_types must be non-empty strings")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise LayoutError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if not all(type(t) in (int, float) and math.isfinite(t) and t > 1 for t in self.rope_theta):
            raise LayoutError("rope_theta values must be finite numbers > 1")
        if self.rope_theta and len(self.rope_theta) != self.num_layers:
            raise LayoutError(f"rope_theta has {len(self.rope_theta)} entries for {self.num_layers} layers")
        if self.rope_pairing not in PAIRINGS:
            raise LayoutError(f"unknown rope_pairing {self.rope_pairing!r}; use one of {', '.join(PAIRINGS)}")
        if self.rope is not None:
            if not isinstance(self.rope, RopeSpec):
                raise LayoutError("rope must be a RopeSpec")
            if self.rope.num_layers != self.num_layers:
                raise LayoutError(f"rope covers {self.rope.num_layers} layers, the cache has {self.num_layers}")
            if any(t.rotary_dim > self.head_dim for t in self.rope.tables):
                raise LayoutError(f"rope rotary_dim exceeds head_dim {self.head_dim}")
        if self.keys_roped:
            if self.rope is None and len(self.rope_theta) != self.num_layers:
                raise LayoutError("keys_roped needs rope_theta for every layer (or a rope spec)")
            if self.head_dim % 2:
                raise LayoutError("RoPE needs an even head_dim")

    # -- RoPE ------------------------------------------------------------------------------------
    @cached_property
    def rope_spec(self) -> RopeSpec | None:
        """The RoPE applied to the keys (None when ``keys_roped`` is false)."""
        if not self.keys_roped:
            return None
        if self.rope is not None:
            return self.rope
        return RopeSpec.from_thetas(self.rope_theta, self.head_dim, self.rope_pairing)

    # -- order -----------------------------------------------------------------------------------
    def tensors(self) -> list[tuple[int, str]]:
        """``(layer, kind)`` of every tensor in codec order: layer by layer, key before value."""
        return [(i, k) for i in range(self.num_layers) for k in KINDS]

    def tensor_names(self) -> list[str]:
        """Tensor names in codec order."""
        return [tensor_name(i, k) for i, k in self.tensors()]

    def blocks(self) -> list[Block]:
        """Every block in codec order: tensor by tensor, head by head."""
        return [Block(i, k, h) for i, k in self.tensors() for h in range(self.kv_heads)]

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def n_values(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.n_tokens * self.head_dim

    def tensor_shape(self) -> tuple[int, ...]:
        base = (self.kv_heads, self.n_tokens, self.head_dim)
        return (1,) + base if self.batch_dim else base

    def signature(self) -> dict:
        """What a calibration bank must agree with."""
        return {"num_layers": self.num_layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim}

    # -- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["rope_theta"] = list(self.rope_theta)
        if self.rope is None:
            del d["rope"]
        else:
            d["rope"] = self.rope.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> CacheLayout:
        try:
            d = dict(d)
            d["layer_types"] = tuple(d.get("layer_types", ()))
            d["rope_theta"] = tuple(d.get("rope_theta", ()))
            if d.get("rope") is not None:
                d["rope"] = RopeSpec.from_json(d["rope"])
            return cls(**d)
        except (TypeError, ValueError) as e:
            if isinstance(e, LayoutError):
                raise
            raise LayoutError(f"malformed layout: {e}") from None

    def replace(self, **changes) -> CacheLayout:
        """A copy with some fields changed (validated again)."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d.update(changes)
        return CacheLayout(**d)

    def with_tokens(self, n_tokens: int) -> CacheLayout:
        return self.replace(n_tokens=n_tokens)


def parse_name(name: str) -> tuple[int, str]:
    """``'layers.3.value' -> (3, 'value')``; LayoutError for anything else."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if not m:
        raise LayoutError(f"unknown tensor name {name!r}; expected layers.{{i}}.key / layers.{{i}}.value "
                          "(i = 0, 1, ... without leading zeros): rename the tensors")
    return int(m.group(1)), m.group(2)


def infer_layout(tensors: dict, metadata: dict | None = None) -> CacheLayout:
    """Build a :class:`CacheLayout` from arrays (or objects with ``.shape``/``.dtype``) and
    safetensors-style string metadata (validated by :func:`alignpred.cache.metadata.parse_metadata`);
    raises :class:`LayoutError` (:class:`MetadataError` for metadata) naming what is wrong.

    >>> import numpy as np
    >>> t = {f"layers.{i}.{k}": np.zeros((1, 5, 8), np.float16) for i in range(2) for k in ("key", "value")}
    >>> infer_layout(t).n_tokens
    5
    """
    from alignpred.cache.metadata import parse_metadata

    if not tensors:
        raise LayoutError("the cache holds no tensors (empty cache)")
    layers: dict[int, set] = {}
    for name in tensors:
        i, kind = parse_name(name)
        layers.setdefault(i, set()).add(kind)
    n = max(layers) + 1
    if n > MAX_LAYERS:
        raise LayoutError(f"{n} layers is more than kvz supports ({MAX_LAYERS})")
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
    fields = parse_metadata(metadata or {}, num_layers=n, head_dim=int(shape[2]), n_tokens=int(shape[1]))
    return CacheLayout(num_layers=n, kv_heads=int(shape[0]), head_dim=int(shape[2]), n_tokens=int(shape[1]), dtype=dt,
                       batch_dim=batch, **fields)
