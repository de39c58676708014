"""The integer map products on Intel AMX tiles: the same integers as the vector kernel, 2-4x faster.

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
``(hh << 16) + (mid << 8) + ll`` in int64 is the exact integer ``acc_s[t, j]`` of
:mod:`alignpred.kernels.intmap`.  From there the epilogue is that module's, operation for
operation (``float64(acc) * (2**w_exp * 2**x_exp)``, sources added in order from +0.0, one
float32 rounding), so the predictions are bit-identical to the vector kernel's and the portable
reference's: AMX changes speed, never the bits.

The kernel is numba code around LLVM's explicit-tile AMX intrinsics (``llvm.x86.tileloadd64``,
``tdpb*d``, ``tilestored64``; tiles 0-2 the accumulators, 3-4 the two byte planes of 16 source
rows, 5-6 the two planes of 64 channels x 16 columns of weights in AMX's 4-byte-group layout).
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
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from alignpred.kernels.intmap_block import (
    _V16D,
    _V16F,
    _V16I,
    _pow2,
    _splat,
    _vload,
    _vstore,
    aligned_empty,
    unblock_weights,
)

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
    from numba.core.registry import cpu_target

    f = set(cpu_target.target_context.codegen()._tm_features.split(","))
    return "+amx-tile" in f and "+amx-int8" in f


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


@njit(cache=True, nogil=True)
def _split(xq, xh, xl):
    """``xq int16 [S, n, K2]`` into byte planes ``xh int8 / xl uint8 [S, >= n, >= K2]`` (the
    padding left as it is: zeros): ``xq = 256 xh + xl``."""
    S, n, K2 = xq.shape
    for s in range(S):
        for t in range(n):
            for k in range(K2):
                v = xq[s, t, k]
                xh[s, t, k] = np.int8(v >> np.int16(8))
                xl[s, t, k] = np.uint8(v & np.int16(255))


@intrinsic
def _epilogue_row(typingctx, acc, ai, cs, ci, rsv, y, yi):
    """One row of 16 outputs: ``y[yi + c] += float64(65536 hh + 256 mid + ll) * (cs[ci + c] * rsv)``
    with ``hh, mid, ll = acc[ai + c], acc[ai + 256 + c], acc[ai + 512 + c]`` (the three tiles, flat
    int32).  ``65536 hh + 256 mid + ll`` is formed in float64 exactly (integers below 2**53)."""
    sig = types.void(acc, ai, cs, ci, rsv, y, yi)

    def codegen(context, builder, sig, args):
        acc, ai, cs, ci, rsv, y, yi = args
        ta = sig.args
        ad = context.make_array(ta[0])(context, builder, acc).data
        cd = context.make_array(ta[2])(context, builder, cs).data
        yd = context.make_array(ta[5])(context, builder, y).data
        parts = [builder.sitofp(_vload(builder, builder.gep(ad, [builder.add(ai, _I64(256 * i))]), _V16I, 4), _V16D)
                 for i in range(3)]
        v = builder.fadd(builder.fadd(builder.fmul(parts[0], ir.Constant(_V16D, [65536.0] * 16)),
                                      builder.fmul(parts[1], ir.Constant(_V16D, [256.0] * 16))), parts[2])
        scale = builder.fmul(_vload(builder, builder.gep(cd, [ci]), _V16D, 8), _splat(builder, rsv, _V16D))
        yp = builder.gep(yd, [yi])
        _vstore(builder, builder.fadd(_vload(builder, yp, _V16D, 8), builder.fmul(v, scale)), yp, 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_row(typingctx, y, yi, out, row, col):
    """``out[row, col : col + 16] = float32(y[yi : yi + 16])`` (``out`` float32 2-D, unit column stride)."""
    sig = types.void(y, yi, out, row, col)

    def codegen(context, builder, sig, args):
        y, yi, out, row, col = args
        yd = context.make_array(sig.args[0])(context, builder, y).data
        oarr = context.make_array(sig.args[2])(context, builder, out)
        od = builder.bitcast(oarr.data, _P8)
        ostride0 = cgutils.unpack_tuple(builder, oarr.strides, 2)[0]
        p = builder.gep(od, [builder.add(builder.mul(row, ostride0), builder.mul(col, _I64(4)))])
        _vstore(builder, builder.fptrunc(_vload(builder, builder.gep(yd, [yi]), _V16D, 8), _V16F), p, 4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _map_predict_amx(xq, x_exp, wh, wl, w_exp, out, cfg):
    """xq int16 [S, n, K2]; x_exp int32 [S, n]; wh / wl [S, m16/16, K64/4, 64] (:func:`amx_weights`);
    w_exp int32 [S, >= m]; out float32 [n, m] (unit column stride), m % 16 == 0, m <= m16."""
    S, n, K2 = xq.shape
    m = out.shape[1]
    ngrp, kq = wh.shape[1], wh.shape[2]
    K64 = 4 * kq
    m16 = 16 * ngrp
    cs = np.zeros(S * m16, np.float64)
    rs = np.empty(S * n, np.float64)
    for s in range(S):
        for j in range(m):
            cs[s * m16 + j] = _pow2(np.int64(w_exp[s, j]))
        for t in range(n):
            rs[s * n + t] = _pow2(np.int64(x_exp[s, t]))
    n16 = -(-n // 16) * 16
    xh = aligned_zeros_i8(S * n16 * K64).reshape(S, n16, K64)
    xl = aligned_zeros_i8(S * n16 * K64).view(np.uint8).reshape(S, n16, K64)
    _split(xq, xh, xl)
    acc = aligned_zeros_i8(2 * 4096).view(np.int32)   # two sets of the three tiles (4 KiB apart): see below
    y = np.empty(256, np.float64)
    xstride = np.int64(K64)
    src_bytes = n16 * K64
    w_src = ngrp * kq * 64
    ng = m // 16
    # Items (row block, column group, source) in order.  The epilogue of an item runs one item
    # late, from the other half of ``acc``: reading a tile back right after ``tilestored`` stalls
    # until the store completes, and the tile products of the next item overlap that wait.  The
    # epilogues still run in item order, so y sums the sources in order.
    _tile_config(cfg)
    prev = -1
    nitems = ((n + 15) // 16) * ng * S
    for it in range(nitems + 1):
        if it < nitems:
            s = it % S
            g = (it // S) % ng
            t0 = 16 * (it // (S * ng))
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
            ab = np.int64(4096 * (it & 1))
            _store_hh(acc, ab, np.int64(64))
            _store_mid(acc, ab + 1024, np.int64(64))
            _store_ll(acc, ab + 2048, np.int64(64))
        if prev >= 0:
            s = prev % S
            g = (prev // S) % ng
            t0 = 16 * (prev // (S * ng))
            nr = min(16, n - t0)
            if s == 0:
                y[:] = 0.0
            a0 = 1024 * (prev & 1)
            for r in range(nr):
                _epilogue_row(acc, np.int64(a0 + 16 * r), cs, np.int64(s * m16 + 16 * g), rs[s * n + t0 + r], y,
                              np.int64(16 * r))
            if s == S - 1:
                for r in range(nr):
                    _store_row(y, np.int64(16 * r), out, np.int64(t0 + r), np.int64(16 * g))
        prev = it
    _tile_release()


@njit(cache=True, nogil=True)
def aligned_zeros_i8(n):
    """A zeroed int8 array of ``n`` bytes starting on a 64-byte boundary (tile rows on whole cache lines)."""
    buf = np.zeros(n + 64, np.int8)
    off = (-buf.ctypes.data) % 64
    return buf[off:off + n]


def map_predict_amx(xq: np.ndarray, x_exp: np.ndarray, amx: tuple[np.ndarray, np.ndarray], w_exp: np.ndarray,
                    out: np.ndarray) -> None:
    """Write the map prediction into ``out`` (float32 ``[n, m]``, ``m % 16 == 0``, unit column
    stride) with the AMX kernel: ``amx`` from :func:`amx_weights`, the rest as
    :func:`alignpred.kernels.intmap.map_predict` checked them; call only where :func:`amx_enabled`."""
    wh, wl = amx
    S, _, K2 = xq.shape
    if (wh.shape != wl.shape or wh.shape[0] != S or 4 * wh.shape[2] < K2 or 16 * wh.shape[1] < out.shape[1]
            or w_exp.shape[1] < out.shape[1] or out.shape[1] % 16):
        raise ValueError("map_predict_amx: inconsistent shapes")
    if 4 * wh.shape[2] > AMX_K_MAX:
        raise ValueError(f"map_predict_amx: {4 * wh.shape[2]} channels per source exceed {AMX_K_MAX}")
    _map_predict_amx(xq, x_exp, wh, wl, w_exp, out, _CFG)
