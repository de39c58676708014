"""Row kernels of the fused post-pass (:mod:`alignpred.kernels.fused`) in explicit ``<16 x float>``
vectors, and the float32 -> bfloat16 / float16 casts they share with its scalar loops.

A *plain* row (no per-channel step multipliers, not an odd row of interpolated channels) is one
straight pass over the channels: ``v = base + float32(q) * delta`` (the reconstruction, stored to
``rec``), ``x = v + mean``, RoPE on the pairs ``(i, h + i)`` (``half`` pairing), the clip and the
cast, stored to the native row.  Every product and sum is its own float32 operation, in the scalar
loop's order (no FMA contraction: LLVM fuses only with fast-math flags, which this IR never sets),
so the bits are the scalar loop's; the casts are the same IR on vectors as on scalars.  Numba's
loops for the same row spent more on per-loop alias checks and scratch-row traffic than on the
arithmetic (~1.4 ns per value on 256-channel rows).

Preconditions (checked by the caller, :func:`alignpred.kernels.fused._post`): ``d % 16 == 0``,
``h % 16 == 0``, ``2 h <= d``, unit column stride of every 2-D array (rows may have any stride).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from alignpred.kernels.intmap_block import _splat, _vload, _vstore

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_W = 16
_V16F = ir.VectorType(_F32, _W)
_V16I = ir.VectorType(_I32, _W)
_V16S = ir.VectorType(ir.IntType(16), _W)


def _k(ty, v):
    """The constant ``v`` of type ``ty``, splat across lanes for a vector type."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [v] * ty.count)
    return ir.Constant(ty, v)


def _int_of(ty):
    return _V16I if isinstance(ty, ir.VectorType) else _I32


def _short_of(ty):
    return _V16S if isinstance(ty, ir.VectorType) else ir.IntType(16)


def bf16_ir(builder, x):
    """float32 (scalar or vector) -> bfloat16 bits: round to nearest even; nan -> sign | 0x7fc0
    (ml_dtypes' rule)."""
    it = _int_of(x.type)
    u = builder.bitcast(x, it)
    a = builder.and_(u, _k(it, 0x7FFFFFFF))
    hi = builder.lshr(u, _k(it, 16))
    rne = builder.lshr(builder.add(builder.add(u, _k(it, 0x7FFF)), builder.and_(hi, _k(it, 1))), _k(it, 16))
    nanv = builder.or_(builder.and_(hi, _k(it, 0x8000)), _k(it, 0x7FC0))
    out = builder.select(builder.icmp_unsigned(">", a, _k(it, 0x7F800000)), nanv, rne)
    return builder.trunc(out, _short_of(x.type))


def f16_ir(builder, x):
    """float32 (scalar or vector) -> float16 bits as numpy: round to nearest even (subnormals
    included), overflow to inf, nan -> sign | 0x7c00 | top 10 payload bits (0x7c01 if those are zero)."""
    it, ft = _int_of(x.type), x.type
    u = builder.bitcast(x, it)
    sgn = builder.and_(builder.lshr(u, _k(it, 16)), _k(it, 0x8000))
    a = builder.and_(u, _k(it, 0x7FFFFFFF))
    # normal half: rebias the exponent (127 -> 15), round the 13 dropped bits to even
    a13 = builder.lshr(a, _k(it, 13))
    nrm = builder.lshr(builder.add(builder.add(builder.sub(a, _k(it, 0x38000000)), _k(it, 0xFFF)),
                                   builder.and_(a13, _k(it, 1))), _k(it, 13))
    # subnormal half: |v| * 2**24 (exact) rounded to an integer; clamped below 2048 (nan too) so
    # that the (unused, for larger |v|) conversion stays defined
    sv = builder.fmul(builder.bitcast(a, ft), _k(ft, 16777216.0))
    sv = builder.select(builder.fcmp_ordered("<", sv, _k(ft, 2048.0)), sv, _k(ft, 2048.0))
    mg = _k(ft, 12582912.0)
    sub = builder.fptosi(builder.fsub(builder.fadd(sv, mg), mg), it)
    nanh = builder.or_(_k(it, 0x7C00), builder.and_(a13, _k(it, 0x3FF)))
    nanh = builder.select(builder.icmp_unsigned("==", nanh, _k(it, 0x7C00)), _k(it, 0x7C01), nanh)
    hv = builder.select(builder.icmp_unsigned(">=", a, _k(it, 0x38800000)), nrm, sub)
    hv = builder.select(builder.icmp_unsigned(">=", a, _k(it, 0x477FF000)), _k(it, 0x7C00), hv)
    hv = builder.select(builder.icmp_unsigned(">", a, _k(it, 0x7F800000)), nanh, hv)
    return builder.trunc(builder.or_(sgn, hv), _short_of(x.type))


def _row(context, builder, ty, arr, t, elem):
    """Pointer (to ``elem``) at row ``t`` of a 2-D array (its row stride), or a 1-D array's start."""
    a = context.make_array(ty)(context, builder, arr)
    if ty.ndim == 1:
        return builder.bitcast(a.data, elem.as_pointer())
    stride = cgutils.unpack_tuple(builder, a.strides, 2)[0]
    p = builder.gep(builder.bitcast(a.data, ir.IntType(8).as_pointer()), [builder.mul(t, stride)])
    return builder.bitcast(p, elem.as_pointer())


def _load(builder, ptr, i, vty):
    return _vload(builder, builder.gep(ptr, [i]), vty, 4)


def _store(builder, v, ptr, i):
    _vstore(builder, v, builder.gep(ptr, [i]), 2)


def _make_row(kind: int, interp: bool):
    """The row intrinsic writing native rows of ``kind`` (0 float32, 1 bfloat16, 2 float16).

    Plain rows: ``(base, t, qt, lt, dt, mean, cos, sin, h, rec, nat, fmax)``; ``h = 0``: no RoPE.
    ``interp``: an odd row of a block with interpolated channels, ``(base, t, qt, lt, dt, dl, dr,
    both, mask, mean, cos, sin, h, rec, nat, fmax)``: in the channels where ``mask`` (uint8 [d]) is
    non-zero the residual is ``0.5 * (q[lt-1] dl + q[lt+1] dr) + q[lt] dt`` (``both``) or
    ``q[lt-1] dl + q[lt] dt`` (no right neighbour in the object), elsewhere ``q[lt] dt`` — the
    scalar loop's operations in its order."""
    cast = (None, bf16_ir, f16_ir)[kind]

    def check(a, arrs):
        if not all(isinstance(a[i], types.Array) for i in arrs):
            return None
        return types.void(*a), codegen

    def interp_typer(typingctx, base, t, qt, lt, dt, dl, dr, both, mask, mean, cos, sin, h, rec, nat, fmax):
        return check((base, t, qt, lt, dt, dl, dr, both, mask, mean, cos, sin, h, rec, nat, fmax),
                     (0, 2, 8, 9, 10, 11, 13, 14))

    def plain_typer(typingctx, base, t, qt, lt, dt, mean, cos, sin, h, rec, nat, fmax):
        return check((base, t, qt, lt, dt, mean, cos, sin, h, rec, nat, fmax), (0, 2, 5, 6, 7, 9, 10))

    def codegen(context, builder, sig, args):
        ta = sig.args
        if interp:
            base, t, qt, lt, dt, dl, dr, both, mask, mean, cos, sin, h, rec, nat, fmax = args
            ib, iq, im, ic, is_, ir_, inat = 0, 2, 9, 10, 11, 13, 14
        else:
            base, t, qt, lt, dt, mean, cos, sin, h, rec, nat, fmax = args
            ib, iq, im, ic, is_, ir_, inat = 0, 2, 5, 6, 7, 9, 10
        bp = _row(context, builder, ta[ib], base, t, _F32)
        qp = _row(context, builder, ta[iq], qt, lt, _I32)
        mp = _row(context, builder, ta[im], mean, None, _F32)
        cp = _row(context, builder, ta[ic], cos, t, _F32)
        sp = _row(context, builder, ta[is_], sin, t, _F32)
        rp = _row(context, builder, ta[ir_], rec, t, _F32)
        nat_elem = _F32 if kind == 0 else ir.IntType(16)
        np_ = _row(context, builder, ta[inat], nat, t, nat_elem)
        d = cgutils.unpack_tuple(builder, context.make_array(ta[0])(context, builder, base).shape, 2)[1]
        vdt = _splat(builder, dt, _V16F)
        hi = _splat(builder, fmax, _V16F)
        lo = builder.fsub(_k(_V16F, -0.0), hi)   # -fmax exactly
        if interp:
            one = _I64(1)
            ql = _row(context, builder, ta[iq], qt, builder.sub(lt, one), _I32)
            qr = _row(context, builder, ta[iq], qt, builder.add(lt, one), _I32)
            kp = _row(context, builder, ta[8], mask, None, ir.IntType(8))
            vdl = _splat(builder, dl, _V16F)
            vdr = _splat(builder, dr, _V16F)
            two = builder.icmp_signed("!=", both, ir.Constant(both.type, 0))
            v16b = ir.VectorType(ir.IntType(8), _W)

        def q_f(ptr, i):
            return builder.sitofp(_load(builder, ptr, i, _V16I), _V16F)

        def residual(i):
            w = builder.fmul(q_f(qp, i), vdt)
            if not interp:
                return w
            left = builder.fmul(q_f(ql, i), vdl)
            # row lt + 1 of the tile scratch is always readable (TILE + 1 rows); without a right
            # neighbour its value is not selected
            right = builder.fmul(q_f(qr, i), vdr)
            wi2 = builder.fadd(builder.fmul(_k(_V16F, 0.5), builder.fadd(left, right)), w)
            wi1 = builder.fadd(left, w)
            wi = builder.select(two, wi2, wi1)
            on = builder.icmp_unsigned("!=", _vload(builder, builder.gep(kp, [i]), v16b, 1), ir.Constant(v16b, None))
            return builder.select(on, wi, w)

        def recon(i):
            v = builder.fadd(_load(builder, bp, i, _V16F), residual(i))
            _store(builder, v, rp, i)
            return builder.fadd(v, _load(builder, mp, i, _V16F))

        def emit(x, i):
            x = builder.select(builder.fcmp_ordered(">", x, hi), hi, x)
            x = builder.select(builder.fcmp_ordered("<", x, lo), lo, x)
            _store(builder, x if cast is None else cast(builder, x), np_, i)

        w = _I64(_W)
        with cgutils.for_range(builder, builder.udiv(h, w)) as loop:   # the RoPE pairs (i, h + i)
            i = builder.mul(loop.index, w)
            j = builder.add(i, h)
            x1, x2 = recon(i), recon(j)
            c, s = _load(builder, cp, i, _V16F), _load(builder, sp, i, _V16F)
            emit(builder.fsub(builder.fmul(x1, c), builder.fmul(x2, s)), i)
            emit(builder.fadd(builder.fmul(x2, c), builder.fmul(x1, s)), j)
        r = builder.add(h, h)
        with cgutils.for_range(builder, builder.udiv(builder.sub(d, r), w)) as loop:   # no RoPE
            i = builder.add(r, builder.mul(loop.index, w))
            emit(recon(i), i)
        return context.get_dummy_value()

    return intrinsic(interp_typer if interp else plain_typer)


plain_row_f32, plain_row_bf16, plain_row_f16 = (_make_row(k, False) for k in range(3))
interp_row_f32, interp_row_bf16, interp_row_f16 = (_make_row(k, True) for k in range(3))
