"""Rotary position embedding (RoPE): the exact rotation a model applied to its cached keys, so
the codec can undo it (keys are coded with RoPE removed) and apply it again on decode.

Keys are cached after RoPE; the rotation angle depends on the position, which hides the
correlation between neighbouring layers and between K and V. Undoing it is an orthogonal
map per token (times the model's attention scaling, if any), so squared error is the same in
both frames up to that scale.

A :class:`RopeTable` is one rotary embedding as a model computes it: its inverse frequencies
(float32, exactly the values the model used — default, linear, llama3, dynamic-NTK, YaRN and
longrope scaling all end up as an ``inv_freq`` vector), its attention scaling (YaRN/longrope
multiply cos and sin by it), the channel pairing and the rotary dimension (partial rotary: only
the first ``rotary_dim`` channels rotate). A :class:`RopeSpec` maps every layer to a table
(or to none: a layer without RoPE).

Determinism. The decoded bits of a file must not depend on the machine, so the cos/sin tables
never call the platform's libm: :func:`sincos_f32` evaluates them in float64 with IEEE basic
operations only (``+ - *``), in a fixed order, with no fused multiply-add (a numba kernel
compiled without fastmath — its machine code holds no FMA instruction and its LLVM IR no
``contract``/``fast`` flag, both tested — bit-identical to the numpy reference
:func:`~alignpred.kernels.sincos.sincos_reference`, which runs one ufunc per operation):

1. ``k = rint(a * 2/pi)``, computed as ``(a * 2/pi + 1.5·2**52) - 1.5·2**52`` (ties to even),
   and Cody–Waite reduction ``r = (((a - k*P1) - k*P2) - k*P3) - k*P4`` with
   pi/2 ≈ P1 + P2 + P3 + P4 (27, 27, 27 and 53 significant bits): ``k*P1``, ``k*P2`` and
   ``k*P3`` are exact for ``|k| < 2**26`` and the first two subtractions are exact, so the
   reduction is accurate for every float32 angle below ``(2**26 - 1)·pi/2`` ≈ 1.05e8 (larger
   angles are refused with :class:`LayoutError`);
2. the fdlibm kernels ``__kernel_sin`` / ``__kernel_cos`` (their degree-13/14 polynomials on
   [-pi/4, pi/4], Horner's rule), result chosen and signed by the quadrant ``k mod 4``;
3. rounding to float32 (round to nearest even).

Accuracy: over 3.3 million float32 angles — random in [0, 2**20·pi] and [0, 8], every
position 0..131071 (step 37) × inverse frequency of three common tables, and the float32 values
nearest to k·pi/2 and k·pi/4 (± 2 ulp) for 120,000 k up to 2**26 — the max error against
``math.cos`` / ``math.sin`` is 0.4999997 / 0.4999999 ulp of float32: in every sampled case the
result is the correctly rounded float32 of the double-precision function (``tests/cache/test_rope.py``
checks the same on 167,000 such angles).
Speed: ~1.7 ns per angle (AVX-512 here), ~15x faster than ``np.cos`` + ``np.sin``.

The angle of position ``p`` and pair ``i`` is ``float32(float32(p) * inv_freq[i])``, the
float32 product transformers computes. Inverse frequencies are data (recorded from the model,
see ``kvz.integrations.hf.rope``); :meth:`RopeTable.from_theta` derives default ones from a
base without libm either (decimal arithmetic, :func:`_default_inv_freq`). Tables are built in
aligned blocks of 256 positions (a
position's value never depends on the range asked for) and kept in a bounded cache
(:func:`set_table_cache_bytes`, 64 MiB by default) whose eviction keeps working when the
blocks of a long cache do not all fit (see :class:`_BlockCache`).

>>> import numpy as np
>>> t = RopeTable.from_theta(1e4, head_dim=8)
>>> x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
>>> y = t.apply(x, start=3)
>>> bool(np.abs(t.apply(y, start=3, inverse=True) - x).max() < 1e-6)
True
>>> spec = RopeSpec.from_thetas([1e4, 1e6], head_dim=8)
>>> RopeSpec.from_json(spec.to_json()) == spec, spec.table(1).rotary_dim
(True, 8)
>>> c, s = sincos_f32(np.float32([0.0, 1.0, 1e6]))
>>> [float(v) for v in c] == [float(np.float32(math.cos(a))) for a in (0.0, 1.0, 1e6)]
True
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from decimal import Decimal, localcontext
from fractions import Fraction
from functools import lru_cache

import numpy as np

from alignpred.errors import LayoutError

PAIRINGS = ("half", "interleaved")
_BLOCK = 256  # positions per cached cos/sin block

from alignpred.kernels.sincos import MAX_ANGLE, sincos_f32  # noqa: E402,F401


def _f32(v: float) -> float:
    return float(np.float32(v))


def _f32_nearest(x: Fraction) -> np.float32:
    """The float32 nearest to an exact rational (no double rounding)."""
    a = np.float32(float(x))
    down, up = np.nextafter(a, np.float32(-np.inf)), np.nextafter(a, np.float32(np.inf))
    return min((a, down, up), key=lambda c: abs(Fraction(float(c)) - x))


@lru_cache(maxsize=64)
def _default_inv_freq(theta: float, rotary_dim: int) -> tuple:
    """``1 / theta ** (float32(2i) / float32(r))`` as transformers computes it in float32 (base and
    exponent in float32, the power rounded to float32, then a float32 reciprocal), with the power
    correctly rounded (decimal arithmetic, 40 digits) instead of libm's ``powf``: deterministic,
    and equal to torch's values for ~99% of pairs (torch's ``powf`` is off by one ulp now and
    then). Models record their exact inverse frequencies; this serves files that give only a base."""
    th = Decimal(_f32(theta))
    out = []
    with localcontext() as ctx:
        ctx.prec = 40
        ln_th = th.ln()
        for i in range(0, rotary_dim, 2):
            e = np.float32(i) / np.float32(rotary_dim)
            p = _f32_nearest(Fraction((Decimal(float(e)) * ln_th).exp()))
            out.append(float(np.float32(1.0) / p))
    return tuple(out)


@dataclass(frozen=True)
class RopeTable:
    """One rotary embedding: ``inv_freq`` (float32 values, length ``rotary_dim / 2``), the
    ``attention_scaling`` that multiplies cos and sin, and the channel ``pairing``.

    Channel pairs: ``half`` pairs ``i`` with ``i + r/2`` (Llama/Gemma ``rotate_half``),
    ``interleaved`` pairs ``2i`` with ``2i + 1``; channels ``>= r = rotary_dim`` do not rotate.
    The angle of position ``p`` and pair ``i`` is ``float32(p) * inv_freq[i]`` rounded to
    float32, as transformers computes it. An ``inv_freq`` of 0 is allowed (that pair does not
    rotate: "proportional" RoPE pads with zeros).
    """

    inv_freq: tuple
    attention_scaling: float = 1.0
    pairing: str = "half"

    def __post_init__(self):
        try:
            inv = tuple(float(v) for v in self.inv_freq)
            s = float(self.attention_scaling)
        except (TypeError, ValueError, OverflowError):
            raise LayoutError("RoPE inv_freq and attention_scaling must be numbers") from None
        if not inv:
            raise LayoutError("RoPE inv_freq is empty")
        if not all(math.isfinite(v) and v >= 0 and _f32(v) == v for v in inv):
            raise LayoutError("RoPE inv_freq must be finite float32 values >= 0")
        if not (math.isfinite(s) and s > 0 and _f32(s) == s):
            raise LayoutError("RoPE attention_scaling must be a positive finite float32 value")
        if not isinstance(self.pairing, str) or self.pairing not in PAIRINGS:
            raise LayoutError(f"unknown RoPE pairing {self.pairing!r}; use one of {', '.join(PAIRINGS)}")
        object.__setattr__(self, "inv_freq", inv)
        object.__setattr__(self, "attention_scaling", s)

    @property
    def rotary_dim(self) -> int:
        return 2 * len(self.inv_freq)

    @classmethod
    def from_theta(cls, theta: float, head_dim: int, rotary_dim: int | None = None, pairing: str = "half",
                   attention_scaling: float = 1.0) -> RopeTable:
        """Default RoPE: ``inv_freq[i] = 1 / theta ** (2i / rotary_dim)`` computed as transformers
        does in float32, deterministically (see :func:`_default_inv_freq`)."""
        try:
            theta = float(theta)
        except (TypeError, ValueError, OverflowError):
            raise LayoutError(f"rope_theta must be a number, got {theta!r}") from None
        if not (math.isfinite(theta) and 1.0 < theta < 3e38):
            raise LayoutError(f"rope_theta must be a finite number > 1, got {theta!r}")
        r = head_dim if rotary_dim is None else int(rotary_dim)
        if r < 2 or r % 2 or r > head_dim:
            raise LayoutError(f"rotary_dim {r} must be even and in 2..head_dim ({head_dim})")
        return cls(_default_inv_freq(theta, r), attention_scaling, pairing)

    def to_json(self) -> dict:
        """JSON form; ``inv_freq`` as base64 of little-endian float32 (a quarter of the
        decimal text, and exactly the values)."""
        import base64

        b = np.asarray(self.inv_freq, "<f4").tobytes()
        return {"inv_freq": base64.b64encode(b).decode(), "attention_scaling": self.attention_scaling,
                "pairing": self.pairing}

    @classmethod
    def from_json(cls, d) -> RopeTable:
        """From :meth:`to_json`'s form; ``inv_freq`` may also be a list of numbers."""
        import base64
        import binascii

        if isinstance(d, dict) and set(d) - {"inv_freq", "attention_scaling", "pairing"}:
            extra = sorted(set(d) - {"inv_freq", "attention_scaling", "pairing"})
            raise LayoutError(f"unknown RoPE table keys {extra}")
        if not isinstance(d, dict) or not isinstance(d.get("inv_freq"), (list, str)):
            raise LayoutError("RoPE table must be an object with inv_freq (base64 float32 or a list of numbers)")
        inv = d["inv_freq"]
        if isinstance(inv, str):
            try:
                raw = base64.b64decode(inv, validate=True)
            except (binascii.Error, ValueError):
                raise LayoutError("RoPE inv_freq is not base64") from None
            if not raw or len(raw) % 4 or len(raw) > 1 << 20:
                raise LayoutError("RoPE inv_freq must hold 1 to 262144 float32 values")
            inv = [float(v) for v in np.frombuffer(raw, "<f4")]
        elif not all(type(v) in (int, float) for v in inv):
            raise LayoutError("RoPE inv_freq must be numbers")
        d = dict(d, inv_freq=inv)
        s = d.get("attention_scaling", 1.0)
        if type(s) not in (int, float):
            raise LayoutError("RoPE attention_scaling must be a number")
        return cls(tuple(d["inv_freq"]), s, d.get("pairing", "half"))

    # -- tables ------------------------------------------------------------------------------------
    def cos_sin(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 ``cos, sin`` ``[n, rotary_dim/2]`` for positions ``start .. start+n-1``
        (unscaled). Computed in aligned blocks of 256 positions, so a position's value never
        depends on which range was asked for."""
        h = self.rotary_dim // 2
        start, n = int(start), int(n)
        if n <= 0:
            return np.zeros((0, h), np.float32), np.zeros((0, h), np.float32)
        if start < 0:
            raise LayoutError(f"negative RoPE position {start}")
        ks = range(start // _BLOCK, (start + n - 1) // _BLOCK + 1)
        blocks = [_CACHE.get(self, k) for k in ks]
        off = start - ks[0] * _BLOCK
        if len(blocks) == 1:
            return blocks[0][0][off:off + n], blocks[0][1][off:off + n]
        key = (self, start, n)
        hit = _RANGES.get(key)   # a decode asks each layer sharing this table for the same range
        if hit is not None and all(a[0] is b[0] and a[1] is b[1] for a, b in zip(hit[2], blocks)):
            return hit[0], hit[1]
        cos = np.concatenate([b[0] for b in blocks])[off:off + n]
        sin = np.concatenate([b[1] for b in blocks])[off:off + n]
        with _CACHE._lock:
            while len(_RANGES) >= _RANGE_SLOTS:
                _RANGES.pop(next(iter(_RANGES)))
            _RANGES[key] = (cos, sin, blocks)
        return cos, sin

    def apply(self, x: np.ndarray, start: int, inverse: bool = False) -> np.ndarray:
        """Rotate rows ``x[..., n, d]`` (positions ``start ..``) forward (RoPE as the model
        applied it, attention scaling included) or back (``inverse``); float32 result."""
        x = np.asarray(x, dtype=np.float32)
        n, d = x.shape[-2], x.shape[-1]
        r = self.rotary_dim
        if r > d:
            raise LayoutError(f"RoPE rotary_dim {r} exceeds head_dim {d}")
        cos, sin = self.cos_sin(int(start), n)
        s = np.float32(self.attention_scaling)
        if inverse:
            if s != 1:
                cos, sin = cos / s, sin / s
            sin = -sin
        elif s != 1:
            cos, sin = cos * s, sin * s
        out = np.array(x, dtype=np.float32, copy=True)
        if self.pairing == "half":
            x1, x2 = x[..., : r // 2], x[..., r // 2:r]
            out[..., : r // 2] = x1 * cos - x2 * sin
            out[..., r // 2:r] = x2 * cos + x1 * sin
        else:
            x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
            out[..., 0:r:2] = x1 * cos - x2 * sin
            out[..., 1:r:2] = x2 * cos + x1 * sin
        return out


def _compute_block(table: RopeTable, k: int):
    inv = np.asarray(table.inv_freq, np.float32)
    pos = np.arange(k * _BLOCK, (k + 1) * _BLOCK, dtype=np.int64).astype(np.float32)
    ang = pos[:, None] * inv[None, :]  # float32 product, as the model computes it
    cos, sin = sincos_f32(ang)
    cos.flags.writeable = False
    sin.flags.writeable = False
    return cos, sin


class _BlockCache:
    """Bounded cache of cos/sin blocks ``(table, k)``, thread-safe.

    Plain LRU thrashes when a long cache is decoded tensor by tensor (every tensor sweeps all
    blocks, and LRU evicts exactly the block needed next). Eviction here: the least recently
    used block if it has not been touched for a long time (``8 ×`` the number of cached
    blocks: stale, e.g. another model's table); otherwise the most recently *inserted* block
    not used in the last :attr:`window` look-ups. Short-range work (chunk by chunk through the
    layers) stays within the protected window and always hits; sweeps larger than the cache
    keep a stable part of it (hit rate ≈ capacity / sweep instead of 0)."""

    window = 64

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._entries: dict = {}  # key -> [cos, sin, last tick]
        self._recency: OrderedDict = OrderedDict()  # least recently used first
        self._inserted: OrderedDict = OrderedDict()  # oldest insertion first
        self._bytes = 0
        self._tick = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, table: RopeTable, k: int):
        key = (table, k)
        with self._lock:
            self._tick += 1
            e = self._entries.get(key)
            if e is not None:
                e[2] = self._tick
                self._recency.move_to_end(key)
                self.hits += 1
                return e[0], e[1]
            self.misses += 1
        cos, sin = _compute_block(table, k)
        nb = cos.nbytes + sin.nbytes
        with self._lock:
            e = self._entries.get(key)
            if e is not None:  # another thread computed it meanwhile (same values)
                return e[0], e[1]
            if nb > self.max_bytes:
                return cos, sin
            while self._bytes + nb > self.max_bytes and self._entries:
                self._evict()
            self._entries[key] = [cos, sin, self._tick]
            self._recency[key] = None
            self._inserted[key] = None
            self._bytes += nb
        return cos, sin

    def _evict(self) -> None:
        oldest = next(iter(self._recency))
        victim = oldest
        if self._tick - self._entries[oldest][2] <= 8 * max(len(self._entries), self.window):
            for key in reversed(self._inserted):
                if self._tick - self._entries[key][2] > self.window:
                    victim = key
                    break
        e = self._entries.pop(victim)
        del self._recency[victim]
        del self._inserted[victim]
        self._bytes -= e[0].nbytes + e[1].nbytes

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._recency.clear()
            self._inserted.clear()
            self._bytes = 0
            self.hits = self.misses = 0

    def info(self) -> dict:
        with self._lock:
            return {"blocks": len(self._entries), "bytes": self._bytes, "max_bytes": self.max_bytes,
                    "hits": self.hits, "misses": self.misses}


_CACHE = _BlockCache(64 << 20)
# the last few multi-block ranges, joined (key (table, start, n) -> (cos, sin, the blocks joined)):
# valid while the cache still holds those very blocks
_RANGE_SLOTS = 4
_RANGES: dict = {}


def set_table_cache_bytes(max_bytes: int) -> None:
    """Bound the cos/sin block cache (bytes; 0 disables it). Clears it."""
    if int(max_bytes) < 0:
        raise ValueError("max_bytes must be >= 0")
    with _CACHE._lock:
        _CACHE.max_bytes = int(max_bytes)
        _RANGES.clear()
    _CACHE.clear()


def table_cache_info() -> dict:
    """``blocks``, ``bytes``, ``max_bytes``, ``hits``, ``misses`` of the cos/sin block cache."""
    return _CACHE.info()


@dataclass(frozen=True)
class RopeSpec:
    """Per-layer RoPE: ``layer_table[i]`` indexes ``tables`` (``-1``: layer ``i`` has no RoPE)."""

    tables: tuple
    layer_table: tuple

    def __post_init__(self):
        tables = tuple(self.tables)
        lt = tuple(int(i) for i in self.layer_table)
        if not all(isinstance(t, RopeTable) for t in tables):
            raise LayoutError("RopeSpec.tables must hold RopeTable values")
        if not lt or not all(-1 <= i < len(tables) for i in lt):
            raise LayoutError("RoPE layer_table must index the tables (or be -1) for every layer")
        object.__setattr__(self, "tables", tables)
        object.__setattr__(self, "layer_table", lt)

    @property
    def num_layers(self) -> int:
        return len(self.layer_table)

    def table(self, layer: int) -> RopeTable | None:
        i = self.layer_table[layer]
        return None if i < 0 else self.tables[i]

    @classmethod
    def from_thetas(cls, thetas, head_dim: int, pairing: str = "half", rotary_dim: int | None = None) -> RopeSpec:
        """Default RoPE with one ``theta`` per layer (``None`` or 0: no RoPE on that layer)."""
        tables: list = []
        index: dict = {}
        lt = []
        for th in thetas:
            if th is None or th == 0:
                lt.append(-1)
                continue
            key = float(th)
            if key not in index:
                index[key] = len(tables)
                tables.append(RopeTable.from_theta(key, head_dim, rotary_dim, pairing))
            lt.append(index[key])
        return cls(tuple(tables), tuple(lt))

    def to_json(self) -> dict:
        return {"tables": [t.to_json() for t in self.tables], "layer_table": list(self.layer_table)}

    @classmethod
    def from_json(cls, d) -> RopeSpec:
        if isinstance(d, dict) and set(d) - {"tables", "layer_table"}:
            raise LayoutError(f"unknown rope keys {sorted(set(d) - {'tables', 'layer_table'})}")
        if not (isinstance(d, dict) and isinstance(d.get("tables"), list) and isinstance(d.get("layer_table"), list)):
            raise LayoutError("rope must be an object with 'tables' and 'layer_table' lists")
        if not all(type(i) is int for i in d["layer_table"]):
            raise LayoutError("rope.layer_table must be integers")
        return cls(tuple(RopeTable.from_json(t) for t in d["tables"]), tuple(d["layer_table"]))


def apply_rope(x: np.ndarray, positions, theta: float, inverse: bool = False,
               pairing: str = "half") -> np.ndarray:
    """Legacy helper (format 1.0 files and baselines): default RoPE with base ``theta`` on
    ``x[..., T, d]`` at consecutive ``positions``, tables computed as kvz 0.1 did (float64
    angles). New code uses :class:`RopeTable`."""
    positions = np.asarray(positions)
    n = x.shape[-2]
    d = x.shape[-1]
    start = int(positions[0]) if n else 0
    cos, sin = _legacy_tables(float(theta), d, start, n)
    if inverse:
        sin = -sin
    x = np.asarray(x, dtype=np.float32)
    if pairing == "half":
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x2 * cos + x1 * sin
    return out


@lru_cache(maxsize=64)
def _legacy_block(theta: float, d: int, k: int):
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = np.arange(k * _BLOCK, (k + 1) * _BLOCK, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def _legacy_tables(theta: float, d: int, start: int, n: int):
    if not n:
        return np.zeros((0, d // 2), np.float32), np.zeros((0, d // 2), np.float32)
    ks = range(start // _BLOCK, (start + n - 1) // _BLOCK + 1)
    cos = np.concatenate([_legacy_block(theta, d, k)[0] for k in ks])
    sin = np.concatenate([_legacy_block(theta, d, k)[1] for k in ks])
    off = start - ks[0] * _BLOCK
    return cos[off:off + n], sin[off:off + n]
