"""The register-blocked integer micro-kernel of :mod:`alignpred.kernels.intmap` (LLVM vector IR via
numba intrinsics) and the constants its exactness proof fixes; see that module for the arithmetic
and :func:`~alignpred.kernels.intmap.reference_predict` for the numpy reference it equals."""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from alignpred.kernels._jit import njit

BX = 14                          # bits (with sign) of a quantised x value
BW = 13                          # bits (with sign) of a quantised weight
XQ_MAX = (1 << (BX - 1)) - 1     # 8191
WQ_MAX = (1 << (BW - 1)) - 1     # 4095
K_CHUNK = 64                     # products summed in int32 before widening (see the proof above)
SHIFT_MAX = 24                   # |equalisation exponent| bound
L1_ONE_CHUNK = (2 ** 31 - 1) // WQ_MAX   # rows with sum |xq| <= this: no chunks needed
assert K_CHUNK * XQ_MAX * WQ_MAX < 2 ** 31 and K_CHUNK % 2 == 0

# Register blocking of the micro-kernel: R rows x C vectors of 16 output columns.
R_BLK = 8
C_BLK = 2
COL_BLK = 16 * C_BLK
KP_CHUNK = K_CHUNK // 2          # channel pairs per int32 chunk

# epilogue flags (see _make_block)
_FIRST, _LAST, _YFIRST, _FINAL = 1, 2, 4, 8


# --------------------------------------------------------------------------------------------
# rows

@intrinsic
def _f64_bits(typingctx, v):
    """The bits of a float64 as int64 (a bitcast)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(types.float64), codegen


@intrinsic
def _i64_as_f64(typingctx, v):
    """An int64 bit pattern as float64 (a bitcast)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@njit(cache=True, nogil=True, inline="always")
def _pow2(e):
    """2.0**e exactly (float64), without a libm call for normal results."""
    if -1022 <= e <= 1023:
        return _i64_as_f64(np.int64(e + 1023) << 52)
    return math.ldexp(1.0, e)


@intrinsic
def _i32_as_f32(typingctx, v):
    """An int32 bit pattern as float32 (a bitcast)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


_MAGIC32 = np.float32(1.5 * 2 ** 23)     # (v + M) - M: v rounded half to even, |v| < 2**22
_MAGIC64 = 1.5 * 2.0 ** 52

# --------------------------------------------------------------------------------------------
# the micro-kernel (LLVM vector IR)

_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_F64 = ir.DoubleType()
_V16I = ir.VectorType(_I32, 16)
_V32S = ir.VectorType(_I16, 32)
_V32I = ir.VectorType(_I32, 32)
_V16D = ir.VectorType(_F64, 16)
_V16F = ir.VectorType(_F32, 16)
_EVEN = ir.Constant(_V16I, [2 * i for i in range(16)])
_ODD = ir.Constant(_V16I, [2 * i + 1 for i in range(16)])
_SPLAT0 = ir.Constant(_V16I, None)


def _c64(v):
    return ir.Constant(_I64, v)


def _vload(builder, ptr, vty, align):
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=align)


def _vstore(builder, v, ptr, align):
    builder.store(v, builder.bitcast(ptr, v.type.as_pointer()), align=align)


def _splat(builder, scalar, vty):
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), _SPLAT0)


def _make_block(R: int, C: int):
    """An intrinsic computing one ``R x 16C`` block of one chunk of one source and its epilogue.

    ``blk(xq, xoff, xstride, wp, woff, wstride, nkp, tmp, flags, cs, csoff, rs, rsoff, y, out,
    orow, ocol)``: int32 accumulators ``acc[r, c] = sum_{kp < nkp} xq[xoff + r*xstride + 2kp + e]
    * wp[woff + kp*wstride + 32c + 2l + e]`` (flat int16 arrays); then, with ``v = float64(acc)``
    (plus ``tmp`` unless ``flags & FIRST``): not ``LAST``: ``tmp = v``; ``LAST``: ``term = v *
    (cs[csoff + col] * rs[rsoff + r])`` (exact: powers of two), ``yv = (0.0 if YFIRST else y) +
    term``; ``FINAL``: ``out[orow + r, ocol + col] = float32(yv)``, else ``y = yv``.  ``tmp``,
    ``y``: float64 ``[R * 16C]`` scratch; ``out`` float32 2-D with unit column stride.
    """

    @intrinsic
    def blk(typingctx, xq, xoff, xstride, wp, woff, wstride, nkp, tmp, flags, cs, csoff, rs, rsoff, y,
            out, orow, ocol):
        sig = types.void(xq, xoff, xstride, wp, woff, wstride, nkp, tmp, flags, cs, csoff, rs, rsoff, y,
                         out, orow, ocol)

        def codegen(context, builder, sig, args):
            (xq, xoff, xstride, wp, woff, wstride, nkp, tmp, flags, cs, csoff, rs, rsoff, y,
             out, orow, ocol) = args
            ta = sig.args

            def data(i, v):
                return context.make_array(ta[i])(context, builder, v).data

            xd, wd, td, csd, rsd, yd = data(0, xq), data(3, wp), data(7, tmp), data(9, cs), data(11, rs), data(13, y)
            oarr = context.make_array(ta[14])(context, builder, out)
            od = builder.bitcast(oarr.data, ir.IntType(8).as_pointer())
            ostride0 = cgutils.unpack_tuple(builder, oarr.strides, 2)[0]

            slots = [[cgutils.alloca_once(builder, _V16I) for _ in range(C)] for _ in range(R)]
            for r in range(R):
                for c in range(C):
                    builder.store(ir.Constant(_V16I, None), slots[r][c])
            xrow = [builder.add(xoff, builder.mul(xstride, _c64(r))) for r in range(R)]
            with cgutils.for_range(builder, nkp) as loop:
                kp = loop.index
                wrow = builder.add(woff, builder.mul(kp, wstride))
                wv = [builder.sext(_vload(builder, builder.gep(wd, [builder.add(wrow, _c64(32 * c))]), _V32S, 2),
                                   _V32I) for c in range(C)]
                k2 = builder.add(kp, kp)
                for r in range(R):
                    p = builder.gep(xd, [builder.add(xrow[r], k2)])
                    xi = builder.load(builder.bitcast(p, _I32.as_pointer()), align=2)
                    xv = builder.sext(builder.bitcast(_splat(builder, xi, _V16I), _V32S), _V32I)
                    for c in range(C):
                        pr = builder.mul(xv, wv[c])
                        pair = builder.add(builder.shuffle_vector(pr, pr, _EVEN), builder.shuffle_vector(pr, pr, _ODD))
                        builder.store(builder.add(builder.load(slots[r][c]), pair), slots[r][c])

            accs = [[builder.load(slots[r][c]) for c in range(C)] for r in range(R)]
            end = builder.append_basic_block("blk_end")
            sw = builder.switch(flags, end)
            for fl in range(16):
                first, last, yfirst, final = bool(fl & _FIRST), bool(fl & _LAST), bool(fl & _YFIRST), bool(fl & _FINAL)
                if not last and (yfirst or final):
                    continue
                bb = builder.append_basic_block(f"epi{fl}")
                sw.add_case(_c64(fl), bb)
                builder.position_at_end(bb)
                for r in range(R):
                    if last:
                        rsv = _splat(builder, builder.load(builder.gep(rsd, [builder.add(rsoff, _c64(r))])), _V16D)
                        orow_r = builder.mul(builder.add(orow, _c64(r)), ostride0)
                    for c in range(C):
                        off = _c64((r * C + c) * 16)
                        v = builder.sitofp(accs[r][c], _V16D)
                        if not first:
                            v = builder.fadd(_vload(builder, builder.gep(td, [off]), _V16D, 8), v)
                        if not last:
                            _vstore(builder, v, builder.gep(td, [off]), 8)
                            continue
                        csv = _vload(builder, builder.gep(csd, [builder.add(csoff, _c64(16 * c))]), _V16D, 8)
                        term = builder.fmul(v, builder.fmul(csv, rsv))
                        yv = ir.Constant(_V16D, None) if yfirst else _vload(builder, builder.gep(yd, [off]), _V16D, 8)
                        yv = builder.fadd(yv, term)
                        if final:
                            col = builder.mul(builder.add(ocol, _c64(16 * c)), _c64(4))
                            p = builder.gep(od, [builder.add(orow_r, col)])
                            _vstore(builder, builder.fptrunc(yv, _V16F), p, 4)
                        else:
                            _vstore(builder, yv, builder.gep(yd, [off]), 8)
                builder.branch(end)
            builder.position_at_end(end)
            return context.get_dummy_value()

        return sig, codegen

    return blk


_blk_full = _make_block(R_BLK, C_BLK)
_blk_row1 = _make_block(1, C_BLK)
_blk_col1 = _make_block(R_BLK, 1)
_blk_one = _make_block(1, 1)


# --------------------------------------------------------------------------------------------
# weight panels

def block_weights(wp: np.ndarray) -> np.ndarray:
    """The kernel layout ``[S, KP, mp, 2]`` (:func:`pack_weights`) -> the panel layout
    ``[S, mp32/32, KP, 32, 2]`` (``COL_BLK = 32``; columns padded with zeros to ``mp32``, a multiple of 32) that
    :class:`IntMap` keeps: the micro-kernel reads each 32-column panel contiguously along the
    channel pairs (one stream instead of one 128-byte row per KiB), every row of a panel on its
    own two cache lines (the array starts on a 64-byte boundary).  The integers, and so the
    predictions, are the same."""
    S, KP, mp, _ = wp.shape
    mp32 = -(-mp // 32) * 32
    full = np.zeros((S, KP, mp32, 2), np.int16)
    full[:, :, :mp] = wp
    out = aligned_empty((S, mp32 // 32, KP, 32, 2), np.int16)
    out[...] = full.reshape(S, KP, mp32 // 32, 32, 2).transpose(0, 2, 1, 3, 4)
    return out


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``align``-byte boundary."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.empty(n + align, np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + n].view(dtype).reshape(shape)


def unblock_weights(wb: np.ndarray, d_out: int) -> np.ndarray:
    """Inverse of :func:`block_weights`: ``[S, KP, ceil16(d_out), 2]``."""
    S, ncb, KP = wb.shape[:3]
    mp = -(-d_out // 16) * 16
    return np.ascontiguousarray(wb.transpose(0, 2, 1, 3, 4).reshape(S, KP, ncb * 32, 2)[:, :, :mp])


@njit(cache=True, nogil=True)
def _row_l1(xq, K2):
    """``sum_k |xq[s, t, k]|`` per source and row (int32: at most ``K2 * XQ_MAX``, ``K2 < 2**18``)."""
    S, n = xq.shape[0], xq.shape[1]
    l1 = np.empty((S, n), np.int32)
    for s in range(S):
        for t in range(n):
            a = np.int32(0)
            for k in range(K2):
                v = np.int32(xq[s, t, k])
                a += v if v >= 0 else -v
            l1[s, t] = a
    return l1


@njit(cache=True, nogil=True)
def _epilogue_scales(w_exp, x_exp, m, mp):
    """The epilogue's powers of two: ``cs [S * mp]`` per source and column (``2**w_exp``, zero past
    ``m``) and ``rs [S * n]`` per source and row (``2**x_exp``)."""
    S, n = x_exp.shape
    cs = np.zeros(S * mp, np.float64)
    rs = np.empty(S * n, np.float64)
    for s in range(S):
        for j in range(m):
            cs[s * mp + j] = _pow2(np.int64(w_exp[s, j]))
        for t in range(n):
            rs[s * n + t] = _pow2(np.int64(x_exp[s, t]))
    return cs, rs


@njit(cache=True, nogil=True)
def _map_predict(xq, x_exp, wb, w_exp, out):
    """xq int16 [S, n, 2KP]; x_exp int32 [S, n]; wb int16 [S, mp/32, KP, 32, 2] (the panels of
    :func:`block_weights`); w_exp int32 [S, >= m]; out float32 [n, m] (unit column stride),
    m <= mp, m % 16 == 0."""
    S, n, K2 = xq.shape
    KP = wb.shape[2]
    mp = wb.shape[1] * COL_BLK
    m = out.shape[1]
    xf = xq.ravel()
    wf = wb.ravel()
    tmp = np.empty(R_BLK * COL_BLK, np.float64)
    y = np.empty(R_BLK * COL_BLK, np.float64)
    cs, rs = _epilogue_scales(w_exp, x_exp, m, mp)
    nch_static = (KP + KP_CHUNK - 1) // KP_CHUNK
    if S == 0 or KP == 0:
        out[:] = 0.0
        return
    mfull = m - m % COL_BLK
    ncb = mp // COL_BLK
    wstride = 2 * COL_BLK    # one channel pair of a panel
    l1 = _row_l1(xq, K2)
    one_chunk = np.zeros(S, np.bool_)
    for t0 in range(0, n, R_BLK):
        full_rows = t0 + R_BLK <= n
        nr = R_BLK if full_rows else n - t0
        # one int32 accumulator for a whole source when every row of the block has
        # sum_k |xq| <= L1_ONE_CHUNK (then |any partial sum| <= L1 * WQ_MAX < 2**31), else
        # chunks of K_CHUNK products (the same exact integers either way)
        for s in range(S):
            worst = 0
            for r in range(nr):
                worst = max(worst, l1[s, t0 + r])
            one_chunk[s] = worst <= L1_ONE_CHUNK
        for j0 in range(0, m, 16):
            if j0 < mfull:
                if j0 % COL_BLK != 0:
                    continue
                wide = True
            else:
                wide = False
            for s in range(S):
                nch = 1 if one_chunk[s] else nch_static
                csz = KP if one_chunk[s] else KP_CHUNK
                for ch in range(nch):
                    kp0 = ch * csz
                    nk = min(csz, KP - kp0)
                    fl = 0
                    if ch == 0:
                        fl |= _FIRST
                    if ch == nch - 1:
                        fl |= _LAST
                        if s == 0:
                            fl |= _YFIRST
                        if s == S - 1:
                            fl |= _FINAL
                    # j0 % COL_BLK == 0 on both paths (the leftover 16 columns start a panel)
                    woff = ((s * ncb + j0 // COL_BLK) * KP + kp0) * 2 * COL_BLK
                    if full_rows:
                        if wide:
                            _blk_full(xf, (s * n + t0) * K2 + 2 * kp0, K2, wf, woff, wstride, nk, tmp, fl,
                                      cs, s * mp + j0, rs, s * n + t0, y, out, t0, j0)
                        else:
                            _blk_col1(xf, (s * n + t0) * K2 + 2 * kp0, K2, wf, woff, wstride, nk, tmp, fl,
                                      cs, s * mp + j0, rs, s * n + t0, y, out, t0, j0)
                    else:
                        # leftover rows one at a time (tmp/y of row r at offset r * CW)
                        for r in range(nr):
                            t = t0 + r
                            if wide:
                                _blk_row1(xf, (s * n + t) * K2 + 2 * kp0, K2, wf, woff, wstride, nk,
                                          tmp[r * COL_BLK:], fl, cs, s * mp + j0, rs, s * n + t, y[r * COL_BLK:],
                                          out, t, j0)
                            else:
                                _blk_one(xf, (s * n + t) * K2 + 2 * kp0, K2, wf, woff, wstride, nk,
                                         tmp[r * COL_BLK:], fl, cs, s * mp + j0, rs, s * n + t, y[r * COL_BLK:],
                                         out, t, j0)
