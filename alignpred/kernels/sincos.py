"""Deterministic float32 sin/cos for RoPE tables: a numba kernel and the numpy reference it must
equal bit for bit (fdlibm's kernels in float64 with basic operations only, no FMA contraction;
the notes are in :mod:`alignpred.cache.rope`)."""
from __future__ import annotations

import math

import numpy as np

from alignpred.errors import LayoutError
from alignpred.kernels._jit import njit

__all__ = ["sincos_f32", "sincos_reference", "MAX_ANGLE", "ANGLE_LIMIT"]

# -- deterministic sin/cos ------------------------------------------------------------------------
_INVPIO2 = float.fromhex("0x1.45f306dc9c883p-1")  # 2/pi rounded to double
# pi/2 = _PIO2_0 + _PIO2_1 + _PIO2_2 + _PIO2_3 (+ 2e-43): 27, 27, 27 and 53 significant bits
_PIO2_0 = float.fromhex("0x1.921fb54p+0")
_PIO2_1 = float.fromhex("0x1.10b461p-30")
_PIO2_2 = float.fromhex("0x1.a62633p-58")
_PIO2_3 = float.fromhex("0x1.45c06e0e68948p-86")
_K_LIMIT = 2.0 ** 26  # |k| below this: k * _PIO2_0.._PIO2_2 exact
#: float32 angles must be below this (``2**25 * pi``) in magnitude
MAX_ANGLE = _K_LIMIT * 0.5 * math.pi
# fdlibm k_sin.c / k_cos.c coefficients (|x| <= pi/4)
_S1 = -1.66666666666666324348e-01
_S2 = 8.33333333332248946124e-03
_S3 = -1.98412698298579493134e-04
_S4 = 2.75573137070700676789e-06
_S5 = -2.50507602534068634195e-08
_S6 = 1.58969099521155010221e-10
_C1 = 4.16666666666666019037e-02
_C2 = -1.38888888888741095749e-03
_C3 = 2.48015872894767294178e-05
_C4 = -2.75573143513906633035e-07
_C5 = 2.08757232129817482790e-09
_C6 = -1.13596475577881948265e-11


_SHIFT = float.fromhex("0x1.8p52")  # (y + _SHIFT) - _SHIFT rounds y to an integer, ties to even
ANGLE_LIMIT = (_K_LIMIT - 1.0) * 0.5 * math.pi  # |angle| below this keeps |k| < 2**26


def _check_angles(a: np.ndarray) -> None:
    if a.size:
        m = float(np.abs(a).max())
        if not math.isfinite(m):
            raise LayoutError("RoPE angle is not finite")
        if m >= ANGLE_LIMIT:
            raise LayoutError(f"RoPE angle {m:.6g} is too large (position × inv_freq must stay below "
                              f"2**25·pi ≈ {MAX_ANGLE:.4g})")


@njit(cache=True)
def _sincos_kernel(a, cos_out, sin_out):  # pragma: no cover - compiled
    # Same operations, in the same order, as sincos_reference (no fastmath: no FMA contraction).
    for i in range(a.size):
        x = np.float64(a[i])
        k = (x * _INVPIO2 + _SHIFT) - _SHIFT
        r = x - k * _PIO2_0
        r = r - k * _PIO2_1
        r = r - k * _PIO2_2
        r = r - k * _PIO2_3
        z = r * r
        ps = _S2 + z * (_S3 + z * (_S4 + z * (_S5 + z * _S6)))
        s = r + (z * r) * (_S1 + z * ps)
        pc = z * (_C1 + z * (_C2 + z * (_C3 + z * (_C4 + z * (_C5 + z * _C6)))))
        hz = 0.5 * z
        w = 1.0 - hz
        c = w + (((1.0 - w) - hz) + z * pc)
        q = np.int64(k)
        sv = c if q & 1 else s  # sin by quadrant q mod 4: s, c, -s, -c
        cv = s if q & 1 else c  # cos: c, -s, -c, s
        sv = -sv if q & 2 else sv
        cv = -cv if (q + 1) & 2 else cv
        cos_out[i] = np.float32(cv)
        sin_out[i] = np.float32(sv)


def sincos_reference(angle) -> tuple[np.ndarray, np.ndarray]:
    """Reference numpy evaluation of :func:`sincos_f32` (same operations, same order)."""
    a32 = np.asarray(angle, np.float32)
    _check_angles(a32)
    a = a32.astype(np.float64)
    k = (a * _INVPIO2 + _SHIFT) - _SHIFT
    r = a - k * _PIO2_0
    r = r - k * _PIO2_1
    r = r - k * _PIO2_2
    r = r - k * _PIO2_3
    z = r * r
    ps = _S2 + z * (_S3 + z * (_S4 + z * (_S5 + z * _S6)))
    s = r + (z * r) * (_S1 + z * ps)
    pc = z * (_C1 + z * (_C2 + z * (_C3 + z * (_C4 + z * (_C5 + z * _C6)))))
    hz = 0.5 * z
    w = 1.0 - hz
    c = w + (((1.0 - w) - hz) + z * pc)
    q = k.astype(np.int64) & 3
    swap = (q & 1).astype(bool)
    a_ = np.where(swap, c, s)  # sin: s, c, -s, -c by quadrant
    b_ = np.where(swap, s, c)  # cos: c, -s, -c, s
    sin = np.where(q >= 2, -a_, a_)
    cos = np.where((q == 1) | (q == 2), -b_, b_)
    return cos.astype(np.float32), sin.astype(np.float32)


def sincos_f32(angle) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin`` (float32, the shape of ``angle``) of float32 angles, identical on every
    IEEE-754 machine.

    Float64 evaluation with basic operations only (see the module notes): a numba kernel
    compiled without fastmath, bit-identical to the numpy reference :func:`sincos_reference`
    (tested). The results are the float32 roundings of the double-precision values (within
    0.5 ulp of float32 in every measured case). Raises :class:`LayoutError` for angles of
    magnitude ``>= 2**25 * pi`` or non-finite ones."""
    a = np.ascontiguousarray(angle, np.float32)
    _check_angles(a)
    flat = a.reshape(-1)
    cos = np.empty(flat.shape, np.float32)
    sin = np.empty(flat.shape, np.float32)
    _sincos_kernel(flat, cos, sin)
    return cos.reshape(a.shape), sin.reshape(a.shape)
