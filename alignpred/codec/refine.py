"""The refinement tier: what turns the coarse (lossy) decode of a .kvz file into the exact
original bits.

Every float of the cache's dtype is mapped to its *ordinal* — an integer that orders the finite
values and is a bijection on bit patterns: ``ord(u) = u & M`` for a positive sign bit, ``-(u & M)
- 1`` for a negative one (``M`` = all bits but the sign; so ``+0 -> 0``, ``-0 -> -1``). A
refinement symbol is ``ord(original) - ord(coarse)``: the number of representable values between
the coarse decode and the truth, small where the coarse tier is close. Symbols are coded like the
coarse residuals (int32, channel-major per object), with one static rANS model per *context*:
the exponent field of the coarse value (its scale decides how many representable values the
coarse error spans), models chosen per tensor and context (:func:`contexts`,
:func:`alignpred.entropy.encode_ctx`). Decoding: ``original = unord(ord(coarse) + r)``.
This needs the coarse decode to be the
same bits everywhere (``arith = "exact"``, format 1.1) — a file with a refinement tier is only
written with it.

>>> import numpy as np, ml_dtypes
>>> x = np.array([1.0, -0.0, 0.0, -2.5, 3e-39], ml_dtypes.bfloat16)
>>> y = np.array([1.0078125, 0.0, -0.0, -2.5, 0.0], ml_dtypes.bfloat16)
>>> r = symbols(x, y)
>>> r.tolist(), bool(np.array_equal(apply(y, r).view(np.uint16), x.view(np.uint16)))
([-1, -1, 1, 0, 33], True)
"""
from __future__ import annotations

import numpy as np

from alignpred.errors import EncodeError, FormatError

_UINT = {2: np.uint16, 4: np.uint32}


def ordinal(x: np.ndarray) -> np.ndarray:
    """Ordinals (int64) of a bfloat16/float16/float32 array's bit patterns."""
    x = np.ascontiguousarray(x)
    bits = 8 * x.dtype.itemsize
    u = x.view(_UINT[x.dtype.itemsize]).astype(np.int64)
    mag = u & ((1 << (bits - 1)) - 1)
    return np.where(u >> (bits - 1), -mag - 1, mag)


def from_ordinal(o: np.ndarray, dtype) -> np.ndarray:
    """Inverse of :func:`ordinal` (raises FormatError for an ordinal out of range)."""
    dtype = np.dtype(dtype)
    bits = 8 * dtype.itemsize
    lim = 1 << (bits - 1)
    o = np.asarray(o, np.int64)
    if o.size and (int(o.min()) < -lim or int(o.max()) >= lim):
        raise FormatError("refinement leads outside the dtype's values (corrupt refinement tier)")
    u = np.where(o >= 0, o, (-o - 1) | lim)
    return u.astype(_UINT[dtype.itemsize]).view(dtype)


_MANT = {2: None, 4: 23}


def n_contexts(dtype) -> int:
    """Number of refinement contexts of a dtype (its exponent values)."""
    dtype = np.dtype(dtype)
    return 32 if dtype == np.float16 else 256


def contexts(coarse: np.ndarray) -> np.ndarray:
    """Context (int64) of every coarse value: its exponent field."""
    x = np.ascontiguousarray(coarse)
    u = x.view(_UINT[x.dtype.itemsize]).astype(np.int64)
    if x.dtype == np.float16:
        return (u >> 10) & 0x1F
    if x.dtype.itemsize == 2:  # bfloat16
        return (u >> 7) & 0xFF
    return (u >> 23) & 0xFF


def symbols(original: np.ndarray, coarse: np.ndarray) -> np.ndarray:
    """Refinement symbols (int32) that take ``coarse`` to ``original`` (same shape and dtype)."""
    r = ordinal(original) - ordinal(coarse)
    if r.size and (int(r.min()) < -(1 << 31) or int(r.max()) >= 1 << 31):
        raise EncodeError("a value is too far from its coarse decode for the refinement tier (float32 values of "
                          "opposite signs and huge magnitude); compress with a smaller eps")
    return r.astype(np.int32)


def apply(coarse: np.ndarray, r: np.ndarray) -> np.ndarray:
    """``coarse`` refined by symbols ``r`` (same shape), in the coarse dtype."""
    return from_ordinal(ordinal(coarse) + np.asarray(r, np.int64), coarse.dtype)
