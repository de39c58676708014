"""Quantising source rows for the exact map products (:mod:`alignpred.kernels.intmap`): one
power-of-two scale per row, exactly.  One row's code serves the int16 rows of the vector kernel
(:func:`_quantize_rows`) and the byte planes of the AMX kernel (:func:`_quantize_planes`), so
both read the same integers.

Per row: the exponent from the row's largest ``|x_k| * 2**-shift_k`` (:func:`_row_exponent`),
then ``q_k = clamp(round_half_even(x_k * 2**-shift_k * 2**-e))``.  The common case runs in
``<16 x float>`` vectors (:func:`_absmax_bits16`, ``_quant16_*``); rows that need float64 (a
maximum outside float32's normal range, inf/nan, scales that would leave it) and the channels past
the last multiple of 16 take the scalar paths (:func:`_row_exponent`, :func:`_row_slow`), which give the same integers
wherever both apply.  The row functions take the 2-D array and a row index, never a row view: a
view per row costs numba's reference counting (atomic increments), measured at ~1 cycle per value
on 256-channel rows, more than the arithmetic.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from alignpred.kernels._jit import njit
from alignpred.kernels.intmap_block import (
    _I32,
    _MAGIC32,
    _MAGIC64,
    _V16F,
    _V16I,
    BX,
    XQ_MAX,
    _f64_bits,
    _i32_as_f32,
    _splat,
    _vload,
    _vstore,
)

_XQ_MAX_F = float(XQ_MAX)
_NONFINITE = np.int64(0x7FF0000000000000)
_F32_NORMAL_MIN = np.int32(0x00800000)   # float32 bits of 2**-126
_F32_INF = np.int32(0x7F800000)
_V16B = ir.VectorType(ir.IntType(8), 16)
_V16S = ir.VectorType(ir.IntType(16), 16)


@intrinsic
def _f32_bits(typingctx, v):
    """The bits of a float32 as int32 (a bitcast)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


def _c_array(ty, ndim: int) -> bool:
    return isinstance(ty, types.Array) and ty.ndim == ndim and ty.layout == "C"


def _row_ptr(context, builder, ty, arr, t):
    """Pointer to row ``t`` of a C-contiguous 2-D array (or to a 1-D array's start)."""
    a = context.make_array(ty)(context, builder, arr)
    if ty.ndim == 1:
        return a.data
    width = cgutils.unpack_tuple(builder, a.shape, 2)[1]
    return builder.gep(a.data, [builder.mul(t, width)])


@intrinsic
def _absmax_bits16(typingctx, x, t, p32, n):
    """``max_k bits(|x[t, k]| * p32[k])`` over ``k < n`` (``n % 16 == 0``; 0 if ``n == 0``): the
    float32 products' bit patterns as int32, in ``<16 x float>`` vectors (``|x| * p`` is ``x * p``
    with the sign bit cleared, as ``p > 0``)."""
    if not (_c_array(x, 2) and _c_array(p32, 1)):
        return None
    sig = types.int32(x, t, p32, n)

    def codegen(context, builder, sig, args):
        x, t, p32, n = args
        xd = _row_ptr(context, builder, sig.args[0], x, t)
        pd = _row_ptr(context, builder, sig.args[2], p32, t)
        accp = cgutils.alloca_once_value(builder, ir.Constant(_V16I, None))
        mask = ir.Constant(_V16I, [0x7FFFFFFF] * 16)
        with cgutils.for_range(builder, builder.udiv(n, n.type(16))) as loop:
            o = builder.mul(loop.index, loop.index.type(16))
            v = builder.fmul(_vload(builder, builder.gep(xd, [o]), _V16F, 4),
                             _vload(builder, builder.gep(pd, [o]), _V16F, 4))
            b = builder.and_(builder.bitcast(v, _V16I), mask)
            a = builder.load(accp)
            builder.store(builder.select(builder.icmp_signed(">", b, a), b, a), accp)
        red = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [_V16I]),
                                             "llvm.vector.reduce.smax.v16i32")
        return builder.call(red, [builder.load(accp)])

    return sig, codegen


def _make_quant16(planes: bool):
    """``q[k] = clamp(int32((x[t, k] * (p32[k] * c) + M) - M))`` for ``k < n`` (``n % 16 == 0``) in
    ``<16 x float>`` vectors, the scalar float32 path's operations (:func:`_q32`), stored as int16
    ``xq[tq, k]`` (``_quant16_i16(x, t, p32, c, n, xq, tq)``) or as the byte planes
    ``xh[o + k] = q >> 8``, ``xl[o + k] = q & 255`` (``_quant16_planes(x, t, p32, c, n, xh, xl, o)``)."""

    def typer(x, p32, outs):
        if not (_c_array(x, 2) and _c_array(p32, 1)):
            return False
        return _c_array(outs[0], 2) if not planes else (_c_array(outs[0], 1) and _c_array(outs[1], 1))

    def codegen(context, builder, sig, args):
        x, t, p32, c, n = args[:5]
        ta = sig.args
        xd = _row_ptr(context, builder, ta[0], x, t)
        pd = _row_ptr(context, builder, ta[2], p32, t)
        cv = _splat(builder, c, _V16F)
        mg = ir.Constant(_V16F, [float(_MAGIC32)] * 16)
        hi, lo = ir.Constant(_V16I, [XQ_MAX] * 16), ir.Constant(_V16I, [-XQ_MAX] * 16)
        if planes:
            hd, ld = (_row_ptr(context, builder, ta[5 + i], args[5 + i], None) for i in range(2))
            base = args[7]
        else:
            qd = _row_ptr(context, builder, ta[5], args[5], args[6])

        def vectors(offs):  # the loads first, then the stores
            qs = []
            for o in offs:
                v = builder.fmul(_vload(builder, builder.gep(xd, [o]), _V16F, 4),
                                 builder.fmul(_vload(builder, builder.gep(pd, [o]), _V16F, 4), cv))
                q = builder.fptosi(builder.fsub(builder.fadd(v, mg), mg), _V16I)
                q = builder.select(builder.icmp_signed("<", q, hi), q, hi)
                qs.append(builder.select(builder.icmp_signed(">", q, lo), q, lo))
            for o, q in zip(offs, qs):
                if planes:
                    ob = builder.add(base, o)
                    h = builder.trunc(builder.ashr(q, ir.Constant(_V16I, [8] * 16)), _V16B)
                    _vstore(builder, h, builder.gep(hd, [ob]), 1)
                    _vstore(builder, builder.trunc(q, _V16B), builder.gep(ld, [ob]), 1)
                else:
                    _vstore(builder, builder.trunc(q, _V16S), builder.gep(qd, [o]), 2)

        n64 = builder.udiv(n, n.type(64))
        with cgutils.for_range(builder, n64) as loop:
            o = builder.mul(loop.index, loop.index.type(64))
            vectors([builder.add(o, o.type(16 * i)) for i in range(4)])
        done = builder.mul(n64, n.type(64))
        with cgutils.for_range(builder, builder.udiv(builder.sub(n, done), n.type(16))) as loop:
            vectors([builder.add(done, builder.mul(loop.index, loop.index.type(16)))])
        return context.get_dummy_value()

    if planes:
        def _quant16_planes(typingctx, x, t, p32, c, n, xh, xl, o):
            return (types.void(x, t, p32, c, n, xh, xl, o), codegen) if typer(x, p32, (xh, xl)) else None
        return intrinsic(_quant16_planes)

    def _quant16_i16(typingctx, x, t, p32, c, n, xq, tq):
        return (types.void(x, t, p32, c, n, xq, tq), codegen) if typer(x, p32, (xq,)) else None
    return intrinsic(_quant16_i16)


_quant16_i16 = _make_quant16(False)
_quant16_planes = _make_quant16(True)


@njit(cache=True, nogil=True)
def _row_exponent(x, t, pscale, p32):
    """``(e, finite)``: the frexp exponent of row ``t``'s ``max_k |x[t, k]| * 2**-shift_k`` (0 for
    an all-zero row) and whether that maximum is finite; the scalar definition that
    :func:`_exponent_fast` agrees with wherever that applies."""
    d = x.shape[1]
    m32 = np.int32(0)
    for k in range(d):
        b = _f32_bits(abs(x[t, k]) * p32[k])
        m32 = b if b > m32 else m32
    if _F32_NORMAL_MIN <= m32 < _F32_INF:
        return _exponent_of(m32), True
    # max |x'| exactly (float64 products by powers of two), as bits: for non-negative
    # doubles the integer order is the numeric order; inf/nan have the largest patterns.
    mb = np.int64(0)
    for k in range(d):
        b = _f64_bits(abs(np.float64(x[t, k])) * pscale[k])
        mb = b if b > mb else mb
    if mb >= _NONFINITE:
        return np.int64(0), False
    if mb > 0:
        return np.int64(mb >> 52) - 1022, True   # x' max < 2**e (x' >= 2**-173: normal)
    return np.int64(0), True


@njit(cache=True, nogil=True, inline="always")
def _exponent_of(m32):
    """The frexp exponent of a positive normal float32 given by its bits."""
    return np.int64(m32 >> 23) - 126


@njit(cache=True, nogil=True, inline="always")
def _exponent_fast(m32, d16, d):
    """Whether :func:`_absmax_bits16`'s ``m32`` over all ``d`` channels decides the row's exponent.

    Each ``|x| * 2**-shift`` is exact in float32 unless it leaves the normal range, and rounding is
    monotone, so when the float32 maximum is a finite normal number it *is* the exact maximum
    (:func:`_row_exponent` otherwise: zero, tiny, overflow, inf or nan rows, or ``d % 16``)."""
    return d16 == d and _F32_NORMAL_MIN <= m32 < _F32_INF


@njit(cache=True, nogil=True, inline="always")
def _row_fast(e, finite, smin, smax):
    """Whether every ``2**(-shift_k - e)`` is a normal float32 (then ``x * (p32 * c)`` is exact up
    to values that round to 0, and ``|v| <= 2**(BX-1)``: no clamp before the conversion is needed)."""
    return finite and -126 <= -e <= 127 and -smax - e >= -126 and -smin - e <= 127


@njit(cache=True, nogil=True, inline="always")
def _q32(xv, pc):
    """One value on the float32 path: ``x * (p32 * c)`` rounded half to even, clamped."""
    i = np.int32((xv * pc + _MAGIC32) - _MAGIC32)
    i = min(i, np.int32(XQ_MAX))
    return max(i, np.int32(-XQ_MAX))


@njit(cache=True, nogil=True, inline="always")
def _q64(xv, ps, c64):
    """One value on the float64 path (with clamps; nan -> XQ_MAX: garbage, but defined)."""
    w = np.float64(xv) * ps * c64
    w = w if w < _XQ_MAX_F else _XQ_MAX_F
    w = w if w > -_XQ_MAX_F else -_XQ_MAX_F
    return np.int32((w + _MAGIC64) - _MAGIC64)


@njit(cache=True, nogil=True)
def _row_slow(x, t, pscale, p32, e, fast, k0, K2):
    """Row ``t``'s integers ``k0..K2`` (int32; zero past ``d``) on the scalar paths: float32 where
    ``fast``, else float64 with clamps (the vector path's integers wherever both apply)."""
    d = x.shape[1]
    q = np.zeros(K2 - k0, np.int32)
    if fast:
        c = _i32_as_f32(np.int32((127 - e) << 23))
        for k in range(k0, d):
            q[k - k0] = _q32(x[t, k], p32[k] * c)
    else:
        c64 = math.ldexp(1.0, -e)
        for k in range(k0, d):
            q[k - k0] = _q64(x[t, k], pscale[k], c64)
    return q


# The row loops below call only intrinsics and inlined scalar functions on their hot path: an
# njit function that takes arrays costs reference counting at every call (see the module doc).

@njit(cache=True, nogil=True)
def _quantize_into(x, pscale, p32, smin, smax, K2, xq, xh, xl, o0, ostride, x_exp, planes):
    """The row loop of :func:`_quantize_rows` (``planes`` False: int16 rows ``xq``) and of
    :func:`_quantize_planes` (True: the byte planes ``xh`` / ``xl``; ``xq`` unused); ``K2``: the
    channels written (``d..K2`` zero).  One loop for both, calling only intrinsics on its hot path."""
    n, d = x.shape
    d16 = d - d % 16
    for t in range(n):
        m32 = _absmax_bits16(x, t, p32, np.int64(d16))
        e, finite = (_exponent_of(m32), True) if _exponent_fast(m32, d16, d) else _row_exponent(x, t, pscale, p32)
        e -= BX - 1
        x_exp[t] = e
        fast = _row_fast(e, finite, smin, smax)
        k0 = d16 if fast else 0
        c = _i32_as_f32(np.int32((127 - e) << 23)) if fast else np.float32(0.0)
        o = o0 + t * ostride
        if fast and planes:
            _quant16_planes(x, t, p32, c, np.int64(d16), xh, xl, np.int64(o))
        elif fast:
            _quant16_i16(x, t, p32, c, np.int64(d16), xq, np.int64(t))
        if k0 < K2:
            q = _row_slow(x, t, pscale, p32, e, fast, k0, K2)
            for k in range(k0, K2):
                if planes:
                    xh[o + k] = np.int8(q[k - k0] >> 8)
                    xl[o + k] = np.uint8(q[k - k0] & 255)
                else:
                    xq[t, k] = np.int16(q[k - k0])


_NO_I16 = np.zeros((0, 0), np.int16)
_NO_I8 = np.zeros(0, np.int8)
_NO_U8 = np.zeros(0, np.uint8)


def _quantize_rows(x, pscale, p32, smin, smax, xq, x_exp):
    """x float32 [n, d] (C-contiguous); the scales as :func:`_row_scales` gives them; xq int16
    [n, K2 >= d] (C-contiguous; columns beyond d zeroed); x_exp int32 [n]."""
    _quantize_into(x, pscale, p32, smin, smax, xq.shape[1], xq, _NO_I8, _NO_U8, 0, 0, x_exp, False)


def _quantize_planes(x, pscale, p32, smin, smax, K2, xh, xl, o0, ostride, x_exp):
    """The integers of :func:`_quantize_rows` for ``K2`` channels (``d..K2`` zero) as the AMX
    kernel's byte planes: row ``t``'s ``q`` at ``xh[o + k] = q >> 8`` (int8), ``xl[o + k] = q & 255``
    (uint8), ``o = o0 + t * ostride`` (``ostride >= K2``); exponents into ``x_exp`` (int32 [n])."""
    _quantize_into(x, pscale, p32, smin, smax, K2, _NO_I16, xh, xl, o0, ostride, x_exp, True)


def quantize_rows(x: np.ndarray, shift: np.ndarray | None = None, out: np.ndarray | None = None):
    """Quantise rows ``x float32 [n, d]`` (one source block): ``x[t, k] * 2**-shift[k] ~=
    xq[t, k] * 2**x_exp[t]``, one power-of-two scale per row from the row's max (exactly, via
    frexp), ``|xq| <= XQ_MAX``, round half to even.  Returns ``(xq int16 [n, d_pad], x_exp int32
    [n])``, ``d_pad`` = ``d`` rounded up to even (a zero column).  All-zero rows give zeros;
    rows with inf/nan give clipped garbage (never undefined behaviour).  ``out``: an int16
    ``[n, d_pad]`` C-contiguous buffer to write into.

    >>> xq, xe = quantize_rows(np.array([[1.0, -0.5, 0.0], [0.0, 0.0, 0.0]], np.float32))
    >>> xq.tolist(), xe.tolist()
    ([[4096, -2048, 0, 0], [0, 0, 0, 0]], [-12, -13])
    """
    x = np.ascontiguousarray(x, np.float32)
    n, d = x.shape
    dp = d + (d & 1)
    sh = np.zeros(d, np.int32) if shift is None else np.asarray(shift, np.int32).reshape(d)
    if out is None:
        xq = np.empty((n, dp), np.int16)
    elif out.shape != (n, dp) or out.dtype != np.int16 or not out.flags.c_contiguous:
        raise ValueError(f"quantize_rows: out must be a C-contiguous int16 array of shape {(n, dp)}")
    else:
        xq = out
    x_exp = np.empty(n, np.int32)
    _quantize_rows(x, *_row_scales(sh), xq, x_exp)
    return xq, x_exp


def _row_scales(shift: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Arguments of :func:`_quantize_rows` for one source's shifts ``int32 [d]``."""
    pscale = np.ldexp(1.0, -shift.astype(np.int32))
    lo, hi = (int(shift.min()), int(shift.max())) if shift.size else (0, 0)
    return pscale, pscale.astype(np.float32), lo, hi
