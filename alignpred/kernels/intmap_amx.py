"""The integer map products on Intel AMX tiles: the same bits as the vector kernel, faster (1.6-1.9x
on the decoder's 2,048 x 256 x 256 products on a 2-core Xeon).

AMX (``amx-int8``, Sapphire Rapids and later Xeons) multiplies int8 tiles: ``tdpb[su][su]d C, A, B``
adds ``sum_i A[m, 4k+i] * B[k, 4n+i]`` to the int32 tile ``C[m, n]`` (16 x 16 outputs, 64 products
each, one instruction).  The map's operands are 14-bit (``xq``) and 13-bit (``wq``) integers, so each
is split into a signed high byte and an unsigned low byte, ``x = 256 xh + xl``, ``w = 256 wh + wl``
(``xh`` in [-32, 31], ``wh`` in [-16, 15], ``xl, wl`` in [0, 255]), and

    x . w = 65536 (xh . wh) + 256 (xh . wl + xl . wh) + (xl . wl)

takes four tile products into three int32 tiles (``tdpbssd``; ``tdpbsud`` and ``tdpbusd`` into the
same middle tile; ``tdpbuud``).  Bounds per source of ``K`` channels (``K`` padded to 64):
``|hh| <= 512 K``, ``|mid| <= 16320 K``, ``ll <= 65025 K``, all below ``2**31`` for
``K <= AMX_K_MAX = 33024``, so every tile sum is exact in int32 in any order and
``65536 hh + 256 mid + ll`` (formed in float64 with FMAs: an integer below 2**53, exact) is the
integer ``acc_s[t, j]`` of :mod:`alignpred.kernels.intmap`.  From there the epilogue is that module's, operation for
operation (``float64(acc) * (2**w_exp * 2**x_exp)``, sources added in order from +0.0, one
float32 rounding), so the predictions are bit-identical to the vector kernel's and the portable
reference's: AMX changes speed, never the bits.

The kernel is numba code around LLVM's explicit-tile AMX intrinsics (``llvm.x86.tileloadd64``,
``tdpb*d``, ``tilestored64``; tiles 0-2 the accumulators, 3-4 the two byte planes of 16 source
rows, 5-6 the two planes of 64 channels x 16 columns of weights in AMX's 4-byte-group layout).
One item (16 rows x 16 columns) takes every source's tile products, and its epilogue sums the
sources in order in registers and stores float32 once.  :meth:`IntMap.predict
<alignpred.kernels.intmap.IntMap.predict>` quantises the sources straight into the byte planes
(:func:`predict_amx`, the int16 rows' integers without writing them), in chunks of rows whose
planes stay in L2; the planes live in a per-thread scratch reused across calls.
It runs only where all of these hold, else the vector kernel does (:func:`amx_enabled`):

* the CPU numba compiles for has ``amx-tile`` and ``amx-int8`` (forcing another target with
  ``NUMBA_CPU_NAME`` turns AMX off with it);
* Linux granted this process the AMX tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, once);
* ``KVZ_AMX`` is not ``0`` (the tests compare both kernels on one machine this way).
"""
from __future__ import annotations

import ctypes
import os
import platform
import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from alignpred.kernels._jit import njit
from alignpred.kernels.intmap_block import (
    _V16D,
    _V16F,
    _V16I,
    _epilogue_scales,
    _splat,
    _vload,
    _vstore,
    aligned_empty,
    unblock_weights,
)
from alignpred.kernels.intmap_rows import _quantize_into

AMX_K_MAX = 33024                # channels per source: 65025 * K < 2**31
_I8 = ir.IntType(8)
_I64 = ir.IntType(64)
_P8 = _I8.as_pointer()
_VOID = ir.VoidType()

# --------------------------------------------------------------------------------------------
# the tile intrinsics (tile numbers are immediates: one intrinsic per tile)


def _call(builder, name, argtys, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VOID, argtys), name)
    builder.call(fn, args)


def _byte_ptr(context, builder, aty, arr, off):
    data = context.make_array(aty)(context, builder, arr).data
    return builder.gep(builder.bitcast(data, _P8), [off])


@intrinsic
def _tile_config(typingctx, cfg):
    """``ldtilecfg`` from a 64-byte uint8 array."""
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.ldtilecfg", [_P8], [_byte_ptr(context, builder, sig.args[0], args[0], _I64(0))])
        return context.get_dummy_value()
    return types.void(cfg), codegen


@intrinsic
def _tile_release(typingctx):
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()
    return types.void(), codegen


def _make_move(store: bool, tile: int):
    """``tileloadd`` / ``tilestored`` of tile ``tile`` at byte offset ``off`` of an array, rows
    ``stride`` bytes apart."""
    name = "llvm.x86.tilestored64" if store else "llvm.x86.tileloadd64"

    @intrinsic
    def move(typingctx, arr, off, stride):
        def codegen(context, builder, sig, args):
            p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
            _call(builder, name, [_I8, _P8, _I64], [ir.Constant(_I8, tile), p, args[2]])
            return context.get_dummy_value()
        return types.void(arr, off, stride), codegen
    return move


def _make_dot(op: str, c: int, a: int, b: int):
    @intrinsic
    def dot(typingctx):
        def codegen(context, builder, sig, args):
            _call(builder, "llvm.x86." + op, [_I8, _I8, _I8], [ir.Constant(_I8, t) for t in (c, a, b)])
            return context.get_dummy_value()
        return types.void(), codegen
    return dot


def _make_zero(tile: int):
    @intrinsic
    def zero(typingctx):
        def codegen(context, builder, sig, args):
            _call(builder, "llvm.x86.tilezero", [_I8], [ir.Constant(_I8, tile)])
            return context.get_dummy_value()
        return types.void(), codegen
    return zero


_load_xh, _load_xl, _load_wh, _load_wl = (_make_move(False, t) for t in (3, 4, 5, 6))
_store_hh, _store_mid, _store_ll = (_make_move(True, t) for t in (0, 1, 2))
_zero_hh, _zero_mid, _zero_ll = (_make_zero(t) for t in (0, 1, 2))
_dot_hh = _make_dot("tdpbssd", 0, 3, 5)      # xh (signed) . wh (signed)
_dot_hl = _make_dot("tdpbsud", 1, 3, 6)      # xh (signed) . wl (unsigned)
_dot_lh = _make_dot("tdpbusd", 1, 4, 5)      # xl (unsigned) . wh (signed)
_dot_ll = _make_dot("tdpbuud", 2, 4, 6)      # xl . wl (unsigned)


def tile_config() -> np.ndarray:
    """The ``ldtilecfg`` block: palette 1, tiles 0-6 of 16 rows x 64 bytes."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb = cfg[16:48].view(np.uint16)
    for t in range(7):
        colsb[t] = 64
        cfg[48 + t] = 16
    return cfg


_CFG = tile_config()

# --------------------------------------------------------------------------------------------
# weights


def amx_weights(wq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Integer weights ``wq int16 [S, K, m]`` (``|wq| <= WQ_MAX``) -> ``(wh int8, wl uint8)``, each
    ``[S, ceil16(m)/16, ceil64(K)/4, 64]``: per source and 16-column group, AMX's B layout
    ``B[k4, 4n + i] = w[4 k4 + i, n]`` (zeros in the padding), 64-byte aligned."""
    S, K, m = wq.shape
    K64, m16 = -(-K // 64) * 64, -(-m // 16) * 16
    w = np.zeros((S, K64, m16), np.int32)
    w[:, :K, :m] = wq
    planes = []
    for part, dt in ((w >> 8, np.int8), (w & 255, np.uint8)):
        b = part.reshape(S, K64 // 4, 4, m16 // 16, 16).transpose(0, 3, 1, 4, 2).reshape(S, m16 // 16, K64 // 4, 64)
        out = aligned_empty(b.shape, dt)
        out[...] = b.astype(dt)
        planes.append(out)
    return planes[0], planes[1]


def amx_from_panels(panels: np.ndarray, d_out: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`amx_weights` of the vector kernel's panels (:func:`~alignpred.kernels.intmap_block.block_weights`)."""
    wp = unblock_weights(panels, d_out)                      # [S, KP, ceil16(d_out), 2]
    S, KP, mp, _ = wp.shape
    return amx_weights(wp.transpose(0, 1, 3, 2).reshape(S, 2 * KP, mp))


# --------------------------------------------------------------------------------------------
# availability

_state: dict = {}
_state_lock = threading.Lock()


def _target_has_amx() -> bool:
    """Whether numba compiles for a CPU with ``amx-tile`` and ``amx-int8``: the host's features
    (llvmlite), unless ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` name another target."""
    import numba
    from llvmlite import binding

    if numba.config.CPU_FEATURES:
        f = set(numba.config.CPU_FEATURES.split(","))
        return "+amx-tile" in f and "+amx-int8" in f
    if numba.config.CPU_NAME and numba.config.CPU_NAME != "host":
        return False
    host = binding.get_host_cpu_features()
    return bool(host.get("amx-tile")) and bool(host.get("amx-int8"))


def _request_tile_state() -> bool:
    """``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``: Linux hands out the AMX register
    state only on request (once per process; threads started later inherit it)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0   # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
    except (OSError, AttributeError):
        return False


def amx_enabled() -> bool:
    """Whether :func:`alignpred.kernels.intmap.map_predict` uses the AMX kernel in this process
    (the CPU target, the kernel's permission and ``KVZ_AMX``; see the module docstring).  The bits
    are the same either way."""
    if os.environ.get("KVZ_AMX", "1") == "0":
        return False
    pid = os.getpid()
    if _state.get("pid") != pid:
        with _state_lock:
            if _state.get("pid") != pid:
                _state["ok"] = _target_has_amx() and _request_tile_state()
                _state["pid"] = pid
    return bool(_state["ok"])


# --------------------------------------------------------------------------------------------
# the kernel


_V32H = ir.VectorType(ir.IntType(16), 32)
_V32B = ir.VectorType(_I8, 32)


@intrinsic
def _split32(typingctx, xf, i, xh, xl, o):
    """``xh[o + c] = int8(xf[i + c] >> 8)``, ``xl[o + c] = uint8(xf[i + c] & 255)`` for ``c < 32``."""
    sig = types.void(xf, i, xh, xl, o)

    def codegen(context, builder, sig, args):
        xf, i, xh, xl, o = args
        ta = sig.args
        xd = context.make_array(ta[0])(context, builder, xf).data
        v = _vload(builder, builder.gep(xd, [i]), _V32H, 2)
        hi = builder.trunc(builder.ashr(v, ir.Constant(_V32H, [8] * 32)), _V32B)
        lo = builder.trunc(v, _V32B)
        for arr, ty, val in ((xh, ta[2], hi), (xl, ta[3], lo)):
            _vstore(builder, val, builder.gep(context.make_array(ty)(context, builder, arr).data, [o]), 1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _split(xq, xh, xl):
    """``xq int16 [S, n, K2]`` (C-contiguous) into the flat byte planes ``xh int8 / xl uint8 [S,
    ceil16(n), ceil64(K2)]``, ``xq = 256 xh + xl`` (the padding not written: it meets zero weights
    or rows never read, see :func:`_products`).  Indexed through the flat array, not a view per row
    (a view costs numba's reference counting, see :mod:`~alignpred.kernels.intmap_rows`)."""
    S, n, K2 = xq.shape
    K64 = -(-K2 // 64) * 64
    n16 = -(-n // 16) * 16
    xf = xq.ravel()
    k32 = K2 // 32 * 32
    for s in range(S):
        for t in range(n):
            i, o = (s * n + t) * K2, (s * n16 + t) * K64
            for k in range(0, k32, 32):
                _split32(xf, np.int64(i + k), xh, xl, np.int64(o + k))
            for k in range(k32, K2):
                v = xf[i + k]
                xh[o + k] = np.int8(v >> np.int16(8))
                xl[o + k] = np.uint8(v & np.int16(255))


@intrinsic
def _epilogue_row(typingctx, acc, ai, cs, ci, cstride, rs, ri, rstride, nsrc, out, row, col):
    """One row of 16 outputs, every source:
    ``out[row, col + c] = float32(sum_s float64(65536 hh + 256 mid + ll) * (cs[ci + s cstride + c] *
    rs[ri + s rstride]))``, the sum from +0.0 in source order, with ``hh, mid, ll`` source ``s``'s
    three tiles at ``acc[ai + 1024 s + 256 i + c]`` (flat int32).  ``65536 hh + 256 mid + ll`` is
    an integer below 2**53, so forming it with FMAs is exact; the scaling, each addition and the
    float32 conversion are the vector kernel's roundings, in its order."""
    sig = types.void(acc, ai, cs, ci, cstride, rs, ri, rstride, nsrc, out, row, col)

    def codegen(context, builder, sig, args):
        acc, ai, cs, ci, cstride, rs, ri, rstride, nsrc, out, row, col = args
        ta = sig.args
        ad = context.make_array(ta[0])(context, builder, acc).data
        cd = context.make_array(ta[2])(context, builder, cs).data
        rd = context.make_array(ta[5])(context, builder, rs).data
        oarr = context.make_array(ta[9])(context, builder, out)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16D, [_V16D] * 3), "llvm.fma.v16f64")
        yp = cgutils.alloca_once_value(builder, ir.Constant(_V16D, [0.0] * 16))
        with cgutils.for_range(builder, nsrc) as loop:
            s = loop.index
            a0 = builder.add(ai, builder.mul(s, _I64(1024)))
            hh, mid, ll = (builder.sitofp(_vload(builder, builder.gep(ad, [builder.add(a0, _I64(256 * i))]), _V16I, 4),
                                          _V16D) for i in range(3))
            v = builder.call(fma, [hh, ir.Constant(_V16D, [65536.0] * 16),
                                   builder.call(fma, [mid, ir.Constant(_V16D, [256.0] * 16), ll])])
            c = _vload(builder, builder.gep(cd, [builder.add(ci, builder.mul(s, cstride))]), _V16D, 8)
            r = builder.load(builder.gep(rd, [builder.add(ri, builder.mul(s, rstride))]))
            builder.store(builder.fadd(builder.load(yp), builder.fmul(v, builder.fmul(c, _splat(builder, r, _V16D)))),
                          yp)
        od = builder.bitcast(oarr.data, _P8)
        ostride0 = cgutils.unpack_tuple(builder, oarr.strides, 2)[0]
        p = builder.gep(od, [builder.add(builder.mul(row, ostride0), builder.mul(col, _I64(4)))])
        _vstore(builder, builder.fptrunc(builder.load(yp), _V16F), p, 4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _products(xh, xl, x_exp, wh, wl, w_exp, out, cfg, acc):
    """The tile products and epilogue.  xh / xl: flat byte planes ``[S, n16, K64]`` (:func:`_split`,
    :func:`_quantize_planes`); x_exp int32 [S, n]; wh / wl [S, m16/16, K64/4, 64] (:func:`amx_weights`);
    w_exp int32 [S, >= m]; out float32 [n, m] (unit column stride), m % 16 == 0, m <= m16; acc:
    int8 scratch of ``2 S`` 4-KiB tile sets, 64-byte aligned.

    The planes' padding (rows ``n..n16``, channels ``K2..K64``) may hold anything: padded channels
    meet zero weights (exactly 0 in the integer sums) and padded rows' sums are never read."""
    S, n = x_exp.shape
    m = out.shape[1]
    ngrp, kq = wh.shape[1], wh.shape[2]
    K64 = 4 * kq
    m16 = 16 * ngrp
    cs, rs = _epilogue_scales(w_exp, x_exp, m, m16)
    n16 = -(-n // 16) * 16
    acc32 = acc.view(np.int32)
    xstride = np.int64(K64)
    src_bytes = n16 * K64
    w_src = ngrp * kq * 64
    ng = m // 16
    # Items (row block, column group), each taking every source's tile products.  The epilogue
    # of an item runs one item late, from the other half of ``acc``: reading a tile back right
    # after ``tilestored`` stalls until the store completes, and the tile products of the next
    # item overlap that wait.
    _tile_config(cfg)
    prev = -1
    nitems = (n16 // 16) * ng
    for it in range(nitems + 1):
        if it < nitems:
            g = it % ng
            t0 = 16 * (it // ng)
            for s in range(S):
                _zero_hh()
                _zero_mid()
                _zero_ll()
                xo = s * src_bytes + t0 * K64
                wo = s * w_src + g * kq * 64
                for k in range(K64 // 64):
                    _load_xh(xh, xo + 64 * k, xstride)
                    _load_xl(xl, xo + 64 * k, xstride)
                    _load_wh(wh, wo + 1024 * k, np.int64(64))
                    _load_wl(wl, wo + 1024 * k, np.int64(64))
                    _dot_hh()
                    _dot_hl()
                    _dot_lh()
                    _dot_ll()
                ab = np.int64(4096 * (S * (it & 1) + s))
                _store_hh(acc, ab, np.int64(64))
                _store_mid(acc, ab + 1024, np.int64(64))
                _store_ll(acc, ab + 2048, np.int64(64))
        if prev >= 0:
            g = prev % ng
            t0 = 16 * (prev // ng)
            a0 = 1024 * S * (prev & 1)
            for r in range(min(16, n - t0)):
                _epilogue_row(acc32, np.int64(a0 + 16 * r), cs, np.int64(16 * g), np.int64(m16), rs,
                              np.int64(t0 + r), np.int64(n), np.int64(S), out, np.int64(t0 + r), np.int64(16 * g))
        prev = it
    _tile_release()


_local = threading.local()


def _scratch(S: int, n: int, K2: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's scratch for ``S`` sources of ``n`` rows of ``K2`` channels: the two flat byte
    planes and the tile sets (kept and grown as needed: fresh pages would cost a fault each)."""
    nb = S * (-(-n // 16) * 16) * (-(-K2 // 64) * 64)
    need = 2 * nb + 2 * S * 4096
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < need:
        buf = _local.buf = aligned_empty((need,), np.int8)
    return buf[:nb], buf[nb:2 * nb].view(np.uint8), buf[2 * nb:need]


def _check(amx, S: int, K2: int, m: int, w_exp: np.ndarray) -> None:
    wh, wl = amx
    if (wh.shape != wl.shape or wh.shape[0] != S or 4 * wh.shape[2] < K2 or 16 * wh.shape[1] < m
            or w_exp.shape[1] < m or m % 16):
        raise ValueError("map_predict_amx: inconsistent shapes")
    if 4 * wh.shape[2] > AMX_K_MAX:
        raise ValueError(f"map_predict_amx: {4 * wh.shape[2]} channels per source exceed {AMX_K_MAX}")


def map_predict_amx(xq: np.ndarray, x_exp: np.ndarray, amx: tuple[np.ndarray, np.ndarray], w_exp: np.ndarray,
                    out: np.ndarray) -> None:
    """Write the map prediction into ``out`` (float32 ``[n, m]``, ``m % 16 == 0``, unit column
    stride) with the AMX kernel: ``amx`` from :func:`amx_weights`, the rest as
    :func:`alignpred.kernels.intmap.map_predict` checked them; call only where :func:`amx_enabled`."""
    S, n, K2 = xq.shape
    _check(amx, S, K2, out.shape[1], w_exp)
    xh, xl, acc = _scratch(S, n, K2)
    _split(xq, xh, xl)
    _products(xh, xl, x_exp, amx[0], amx[1], w_exp, out, _CFG, acc)


def stack_scales(scales: list) -> tuple:
    """The sources' :func:`~alignpred.kernels.intmap_rows._row_scales` as :func:`predict_amx`
    takes them: ``pscale`` float64 ``[S, d]``, ``p32`` float32 ``[S, d]``, ``smin``, ``smax`` int64 ``[S]``."""
    return (np.ascontiguousarray(np.stack([sc[0] for sc in scales]), np.float64),
            np.ascontiguousarray(np.stack([sc[1] for sc in scales]), np.float32),
            np.array([sc[2] for sc in scales], np.int64), np.array([sc[3] for sc in scales], np.int64))


@njit(cache=True, nogil=True)
def _predict_rows(xs, pscale, p32, smin, smax, K2, rows, wh, wl, w_exp, out, cfg, xh, xl, acc):
    """:func:`predict_amx` in one call: ``rows`` rows at a time (their byte planes stay in L2),
    every source quantised into the planes, then the tile products of those rows."""
    S, n = len(xs), out.shape[0]
    K64 = -(-K2 // 64) * 64
    no_rows = np.zeros((0, 0), np.int16)   # the int16 rows _quantize_into does not write here
    for c in range(0, n, rows):
        d = min(n, c + rows)
        n16 = -(-(d - c) // 16) * 16
        x_exp = np.empty((S, d - c), np.int32)
        for s in range(S):   # source s's rows at the flat planes' [s, t, :] ([S, n16, K64])
            _quantize_into(xs[s][c:d], pscale[s], p32[s], smin[s], smax[s], K2, no_rows, xh, xl, s * n16 * K64,
                           K64, x_exp[s], True)
        _products(xh, xl, x_exp, wh, wl, w_exp, out[c:d], cfg, acc)


def predict_amx(xs: list, scales: tuple, K2: int, amx: tuple[np.ndarray, np.ndarray], w_exp: np.ndarray,
                out: np.ndarray, rows: int = 512) -> None:
    """Quantise the source rows ``xs`` (float32 ``[n, d]`` each; ``scales``: the sources'
    :func:`stack_scales`) straight into the AMX byte planes and write the prediction into ``out``
    (float32 ``[n, m]``, ``m % 16 == 0``, unit column stride), ``rows`` rows at a time, in one
    kernel call: the integers and bits of quantising to int16 and :func:`map_predict_amx`,
    without the int16 pass."""
    S, n = len(xs), out.shape[0]
    _check(amx, S, K2, out.shape[1], w_exp)
    xh, xl, acc = _scratch(S, min(n, rows), K2)
    src = tuple(np.ascontiguousarray(x, np.float32) for x in xs)
    _predict_rows(src, *scales, K2, rows, amx[0], amx[1], w_exp, out, _CFG, xh, xl, acc)
