"""Triton kernels of the GPU decoder (see :mod:`alignpred.gpu` for why Triton).

Importing this module imports torch and triton. Without a CUDA device (or with ``KVZ_GPU_SIM=1``)
``TRITON_INTERPRET=1`` is set before the kernels are defined, so they run in Triton's
interpreter on CPU tensors: :data:`SIMULATED`. Every kernel mirrors one CPU kernel operation for
operation (named in its docstring); the integer kernels wrap as the CPU's fixed-width integers
do, and every float kernel is launched with ``enable_fp_fusion=False`` so that no product and sum
fuse into an FMA (kvz.md §1).

Entropy kernels (one lane of a ``lanes32`` object, or one whole ``rans4`` object, per program
element) write the symbols channel-major, as the CPU decoder's ``q [C, rows]``, and one ``ERR_*``
code per object (the CPU kernels' codes). The post kernel is :func:`alignpred.kernels.fused.
reference_post` plus the zero rows; the map kernels are kvz.md §8.4.1 (``map``): rows quantised
exactly as :mod:`alignpred.kernels.intmap_rows`, integer products summed exactly in float64 (every
partial sum an integer below 2**53, so any order gives the same value), sources added in order.
"""
from __future__ import annotations

import os

import torch

SIMULATED: bool = os.environ.get("KVZ_GPU_SIM", "") == "1" or not torch.cuda.is_available()
if SIMULATED:
    os.environ["TRITON_INTERPRET"] = "1"   # read by triton.jit when the kernels below are defined

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = "cpu" if SIMULATED else "cuda"

# Tile sizes: the device's (small blocks, many programs) or the interpreter's (one program per
# block of rows where it can: the interpreter pays per operation, not per element). Tests set it to
# True in the simulator to run the device's tiling (the same bits, slower).
DEVICE_TILES: bool = not SIMULATED

# launch options of every float kernel: no FMA contraction (the interpreter has none to disable)
FLOAT_OPTS: dict = {} if SIMULATED else {"enable_fp_fusion": False}

OUT_F32, OUT_BF16, OUT_F16 = 0, 1, 2


# triton.language's own tl.sum / tl.max / tl.cumsum are @triton.jit functions, decorated when triton
# was first imported: if that was before TRITON_INTERPRET=1 was set here (another module imported
# triton first), the interpreter cannot call them. These combine functions are defined here, so
# they follow this module's mode; tl.reduce and tl.associative_scan themselves are builtins.

@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


# ---------------------------------------------------------------------------------------------
# entropy: lanes32 (alignpred.entropy.lanes.decode_portable / lane_step, kvz.md §7.3)

@triton.jit
def lanes32_kernel(w_ptr, obj_off_ptr, obj_W_ptr, obj_hw_ptr, obj_N_ptr, obj_n_ptr, obj_ids_ptr, obj_out_ptr,
                   ids_ptr, dtab_ptr, out_ptr, err_ptr, n_obj, row_stride, n_iter, OB: tl.constexpr):
    """``OB`` objects x 32 lanes per program. ``w``: every payload's uint16 words (as int32), each
    followed by two zero words; per object its first word ``obj_off``, length ``W``, header words
    ``hw``, symbols ``N = C n``, width ``n``, the offset of its model ids in ``ids`` and of its
    first symbol in ``out`` (channel ``c``, column ``t`` at ``+ c row_stride + t``)."""
    o = tl.program_id(0) * OB + tl.arange(0, OB)[:, None]          # [OB, 1]
    ln = tl.arange(0, 32)[None, :]                                   # [1, 32]
    valid = o < n_obj
    wbase = tl.load(obj_off_ptr + o, mask=valid, other=0)
    W = tl.load(obj_W_ptr + o, mask=valid, other=0)
    hw = tl.load(obj_hw_ptr + o, mask=valid, other=96)
    N = tl.load(obj_N_ptr + o, mask=valid, other=0)
    n = tl.load(obj_n_ptr + o, mask=valid, other=1)
    ids_off = tl.load(obj_ids_ptr + o, mask=valid, other=0)
    out_off = tl.load(obj_out_ptr + o, mask=valid, other=0)
    short = W < hw                                                   # ERR_SHORT
    rd = valid & (~short)
    lo = tl.load(w_ptr + wbase + 2 * ln, mask=rd, other=0).to(tl.uint64)
    hi = tl.load(w_ptr + wbase + 2 * ln + 1, mask=rd, other=0).to(tl.uint64)
    x = lo | (hi << 16)
    wide = hw > 96
    c_lo = tl.load(w_ptr + wbase + tl.where(wide, 64 + 2 * ln, 64 + ln), mask=rd, other=0).to(tl.int64)
    c_hi = tl.load(w_ptr + wbase + 64 + 2 * ln + 1, mask=rd & wide, other=0).to(tl.int64)
    cnt = c_lo | (c_hi << 16)
    pref = tl.associative_scan(cnt, 1, _add) - cnt
    pos = hw + pref
    end = pos + cnt
    total = hw + tl.reduce(cnt, 1, _add)[:, None]
    bad_state = tl.reduce((x < 65536).to(tl.int32), 1, _max)[:, None] > 0
    err = tl.where(short, 1, tl.where(bad_state, 3, tl.where(total != W, 2, 0)))
    ok = valid & (err == 0)
    for k in range(0, n_iter):
        i = ln + 32 * k
        act = ok & (i < N)
        c = i // n
        t = i - c * n
        m = tl.load(ids_ptr + ids_off + c, mask=act, other=0).to(tl.int64)
        e = tl.load(dtab_ptr + m * 4096 + (x & 4095).to(tl.int64), mask=act, other=0).to(tl.uint32, bitcast=True)
        e = e.to(tl.uint64)
        tok = (e & 255).to(tl.int64)
        x = tl.where(act, (e >> 20) * (x >> 12) + ((e >> 8) & 4095), x)
        need = act & (x < 65536)
        wv = tl.load(w_ptr + wbase + tl.minimum(pos, W), mask=need, other=0).to(tl.uint64)
        x = tl.where(need, (x << 16) | wv, x)
        pos = tl.where(need, pos + 1, pos)
        raw = act & (tok >= 16)
        nb = tl.where(raw, ((tok - 16) >> 2) + 2, 0)
        k1 = tl.minimum(nb, 16).to(tl.uint64)
        r = x & ((tl.full(x.shape, 1, tl.uint64) << k1) - 1)
        x = tl.where(raw, x >> k1, x)
        need = raw & (x < 65536)
        wv = tl.load(w_ptr + wbase + tl.minimum(pos, W), mask=need, other=0).to(tl.uint64)
        x = tl.where(need, (x << 16) | wv, x)
        pos = tl.where(need, pos + 1, pos)
        two = raw & (nb > 16)
        k2 = tl.where(two, nb - 16, 0).to(tl.uint64)
        r = tl.where(two, r | ((x & ((tl.full(x.shape, 1, tl.uint64) << k2) - 1)) << 16), r)
        x = tl.where(two, x >> k2, x)
        need = two & (x < 65536)
        wv = tl.load(w_ptr + wbase + tl.minimum(pos, W), mask=need, other=0).to(tl.uint64)
        x = tl.where(need, (x << 16) | wv, x)
        pos = tl.where(need, pos + 1, pos)
        x = x & 0xFFFFFFFF
        r = tl.where(raw, r, 0)
        nn = ((tok - 16) >> 2) + 4
        big = (tl.full(x.shape, 1, tl.int64) << nn) | (((tok >> 1) & 1) << (nn - 1)) | (tok & 1) | \
            (r.to(tl.int64) << 1)
        u = tl.where(tok < 16, tok, big)
        v = ((u >> 1) ^ (-(u & 1))).to(tl.int32)
        tl.store(out_ptr + out_off + c * row_stride + t, v, mask=act)
    words_bad = tl.reduce((pos != end).to(tl.int32), 1, _max)[:, None] > 0
    final_bad = tl.reduce((x != 65536).to(tl.int32), 1, _max)[:, None] > 0
    err = tl.where(err != 0, err, tl.where(words_bad, 5, tl.where(final_bad, 4, 0)))
    tl.store(err_ptr + o + ln * 0, err, mask=valid & (ln == 0))


# ---------------------------------------------------------------------------------------------
# entropy: rans4 (alignpred.entropy.rans.decode_kernel, the one-symbol-at-a-time definition, §7)

@triton.jit
def rans4_kernel(w_ptr, obj_off_ptr, obj_W_ptr, obj_N_ptr, obj_n_ptr, obj_ids_ptr, obj_out_ptr,
                 ids_ptr, tok_ptr, packed_ptr, base_ptr, nbits_ptr, out_ptr, err_ptr,
                 n_obj, row_stride, n_iter, OB: tl.constexpr):
    """``OB`` objects per program, one per element. Symbols ``4g .. 4g+3`` are on lanes 0..3
    (states ``x0..x3`` fixed to their lanes), decoded in symbol order: the CPU's lock-step loop,
    and its one-symbol-at-a-time definition for any ``N``. ``w``: every payload's uint32 words (as
    int64); per object as in :func:`lanes32_kernel` (``W >= 8`` words, checked by the host).
    ``tok[m * 2**15 + s]``: the token of slot ``s`` of model ``m``; ``packed[m * 128 + t] = freq
    << 16 | cum``. (No jit helper is called in the loop: the interpreter re-patches triton's
    language on every device-function call, ~0.3 ms each.)"""
    o = tl.program_id(0) * OB + tl.arange(0, OB)
    valid = o < n_obj
    wb = tl.load(obj_off_ptr + o, mask=valid, other=0)
    W = tl.load(obj_W_ptr + o, mask=valid, other=8)
    N = tl.load(obj_N_ptr + o, mask=valid, other=0)
    n = tl.load(obj_n_ptr + o, mask=valid, other=1)
    ids_off = tl.load(obj_ids_ptr + o, mask=valid, other=0)
    out_off = tl.load(obj_out_ptr + o, mask=valid, other=0)
    L = tl.full(o.shape, 1 << 32, tl.uint64)
    one = tl.full(o.shape, 1, tl.uint64)
    x0 = tl.load(w_ptr + wb, mask=valid, other=0).to(tl.uint64) | \
        (tl.load(w_ptr + wb + 1, mask=valid, other=1).to(tl.uint64) << 32)
    x1 = tl.load(w_ptr + wb + 2, mask=valid, other=0).to(tl.uint64) | \
        (tl.load(w_ptr + wb + 3, mask=valid, other=1).to(tl.uint64) << 32)
    x2 = tl.load(w_ptr + wb + 4, mask=valid, other=0).to(tl.uint64) | \
        (tl.load(w_ptr + wb + 5, mask=valid, other=1).to(tl.uint64) << 32)
    x3 = tl.load(w_ptr + wb + 6, mask=valid, other=0).to(tl.uint64) | \
        (tl.load(w_ptr + wb + 7, mask=valid, other=1).to(tl.uint64) << 32)
    bad = (x0 < L) | (x1 < L) | (x2 < L) | (x3 < L)
    ok = valid & (~bad)
    last = W - 1
    pos = tl.full(o.shape, 8, tl.int64)
    bitpos = tl.full(o.shape, 0, tl.int64)
    for g in range(0, n_iter):
        # lane 0: symbol 4g+0
        i = 4 * g + 0
        act = ok & (i < N)
        c = i // n
        t = i - c * n
        m = tl.load(ids_ptr + ids_off + c, mask=act, other=0).to(tl.int64)
        s = x0 & 32767
        tok = tl.load(tok_ptr + m * 32768 + s.to(tl.int64), mask=act, other=0).to(tl.int64)
        p = tl.load(packed_ptr + m * 128 + tok, mask=act, other=0).to(tl.uint64)
        xn = (p >> 16) * (x0 >> 15) + s - (p & 65535)
        r = act & (xn < L)
        w = tl.load(w_ptr + wb + tl.minimum(pos, last), mask=r, other=0).to(tl.uint64)
        x0 = tl.where(act, tl.where(r, (xn << 32) | w, xn), x0)
        pos = tl.where(r, pos + 1, pos)
        nb = tl.load(nbits_ptr + tok, mask=act, other=0).to(tl.int64)
        j = bitpos >> 5
        lo = tl.load(w_ptr + wb + tl.maximum(last - j, 0), mask=act, other=0).to(tl.uint64)
        hi = tl.load(w_ptr + wb + tl.maximum(last - j - 1, 0), mask=act, other=0).to(tl.uint64)
        rb = (((hi << 32) | lo) >> (bitpos & 31).to(tl.uint64)) & ((one << nb.to(tl.uint64)) - 1)
        bt = tl.load(base_ptr + tok, mask=act, other=0).to(tl.uint64)
        ui = (bt | (rb << 1)).to(tl.int64)
        tl.store(out_ptr + out_off + c * row_stride + t, ((ui >> 1) ^ (-(ui & 1))).to(tl.int32), mask=act)
        bitpos = tl.where(act, bitpos + nb, bitpos)
        # lane 1: symbol 4g+1
        i = 4 * g + 1
        act = ok & (i < N)
        c = i // n
        t = i - c * n
        m = tl.load(ids_ptr + ids_off + c, mask=act, other=0).to(tl.int64)
        s = x1 & 32767
        tok = tl.load(tok_ptr + m * 32768 + s.to(tl.int64), mask=act, other=0).to(tl.int64)
        p = tl.load(packed_ptr + m * 128 + tok, mask=act, other=0).to(tl.uint64)
        xn = (p >> 16) * (x1 >> 15) + s - (p & 65535)
        r = act & (xn < L)
        w = tl.load(w_ptr + wb + tl.minimum(pos, last), mask=r, other=0).to(tl.uint64)
        x1 = tl.where(act, tl.where(r, (xn << 32) | w, xn), x1)
        pos = tl.where(r, pos + 1, pos)
        nb = tl.load(nbits_ptr + tok, mask=act, other=0).to(tl.int64)
        j = bitpos >> 5
        lo = tl.load(w_ptr + wb + tl.maximum(last - j, 0), mask=act, other=0).to(tl.uint64)
        hi = tl.load(w_ptr + wb + tl.maximum(last - j - 1, 0), mask=act, other=0).to(tl.uint64)
        rb = (((hi << 32) | lo) >> (bitpos & 31).to(tl.uint64)) & ((one << nb.to(tl.uint64)) - 1)
        bt = tl.load(base_ptr + tok, mask=act, other=0).to(tl.uint64)
        ui = (bt | (rb << 1)).to(tl.int64)
        tl.store(out_ptr + out_off + c * row_stride + t, ((ui >> 1) ^ (-(ui & 1))).to(tl.int32), mask=act)
        bitpos = tl.where(act, bitpos + nb, bitpos)
        # lane 2: symbol 4g+2
        i = 4 * g + 2
        act = ok & (i < N)
        c = i // n
        t = i - c * n
        m = tl.load(ids_ptr + ids_off + c, mask=act, other=0).to(tl.int64)
        s = x2 & 32767
        tok = tl.load(tok_ptr + m * 32768 + s.to(tl.int64), mask=act, other=0).to(tl.int64)
        p = tl.load(packed_ptr + m * 128 + tok, mask=act, other=0).to(tl.uint64)
        xn = (p >> 16) * (x2 >> 15) + s - (p & 65535)
        r = act & (xn < L)
        w = tl.load(w_ptr + wb + tl.minimum(pos, last), mask=r, other=0).to(tl.uint64)
        x2 = tl.where(act, tl.where(r, (xn << 32) | w, xn), x2)
        pos = tl.where(r, pos + 1, pos)
        nb = tl.load(nbits_ptr + tok, mask=act, other=0).to(tl.int64)
        j = bitpos >> 5
        lo = tl.load(w_ptr + wb + tl.maximum(last - j, 0), mask=act, other=0).to(tl.uint64)
        hi = tl.load(w_ptr + wb + tl.maximum(last - j - 1, 0), mask=act, other=0).to(tl.uint64)
        rb = (((hi << 32) | lo) >> (bitpos & 31).to(tl.uint64)) & ((one << nb.to(tl.uint64)) - 1)
        bt = tl.load(base_ptr + tok, mask=act, other=0).to(tl.uint64)
        ui = (bt | (rb << 1)).to(tl.int64)
        tl.store(out_ptr + out_off + c * row_stride + t, ((ui >> 1) ^ (-(ui & 1))).to(tl.int32), mask=act)
        bitpos = tl.where(act, bitpos + nb, bitpos)
        # lane 3: symbol 4g+3
        i = 4 * g + 3
        act = ok & (i < N)
        c = i // n
        t = i - c * n
        m = tl.load(ids_ptr + ids_off + c, mask=act, other=0).to(tl.int64)
        s = x3 & 32767
        tok = tl.load(tok_ptr + m * 32768 + s.to(tl.int64), mask=act, other=0).to(tl.int64)
        p = tl.load(packed_ptr + m * 128 + tok, mask=act, other=0).to(tl.uint64)
        xn = (p >> 16) * (x3 >> 15) + s - (p & 65535)
        r = act & (xn < L)
        w = tl.load(w_ptr + wb + tl.minimum(pos, last), mask=r, other=0).to(tl.uint64)
        x3 = tl.where(act, tl.where(r, (xn << 32) | w, xn), x3)
        pos = tl.where(r, pos + 1, pos)
        nb = tl.load(nbits_ptr + tok, mask=act, other=0).to(tl.int64)
        j = bitpos >> 5
        lo = tl.load(w_ptr + wb + tl.maximum(last - j, 0), mask=act, other=0).to(tl.uint64)
        hi = tl.load(w_ptr + wb + tl.maximum(last - j - 1, 0), mask=act, other=0).to(tl.uint64)
        rb = (((hi << 32) | lo) >> (bitpos & 31).to(tl.uint64)) & ((one << nb.to(tl.uint64)) - 1)
        bt = tl.load(base_ptr + tok, mask=act, other=0).to(tl.uint64)
        ui = (bt | (rb << 1)).to(tl.int64)
        tl.store(out_ptr + out_off + c * row_stride + t, ((ui >> 1) ^ (-(ui & 1))).to(tl.int32), mask=act)
        bitpos = tl.where(act, bitpos + nb, bitpos)
    n_raw = (bitpos + 31) >> 5
    eof = pos + n_raw > W
    final = (x0 != L) | (x1 != L) | (x2 != L) | (x3 != L)
    trailing = pos + n_raw != W
    pad = bitpos & 31
    lastw = tl.load(w_ptr + wb + tl.maximum(W - n_raw, 0), mask=ok & (pad != 0) & (~eof), other=0).to(tl.uint64)
    pad_bad = (pad != 0) & ((lastw >> pad.to(tl.uint64)) != 0)
    err = tl.where(eof, 1, tl.where(final, 3, tl.where(trailing | pad_bad, 4, 0)))
    err = tl.where(bad, 2, err)
    tl.store(err_ptr + o, err, mask=valid)


# ---------------------------------------------------------------------------------------------
# post: dequantise, interpolate, reconstruct, mean, RoPE, clip, cast (fused.reference_post)

@triton.jit
def _residual(q_ptr, q_row, dr_ptr, chan_ptr, r, c, msk, HAS_CHAN: tl.constexpr):
    """``w = float32(q[c, r]) * delta[r, c]`` (step 1 of kvz.md §8.6), with ``delta[r, c] =
    float32(delta_r * chan[c])`` under per-channel steps."""
    qv = tl.load(q_ptr + c * q_row + r, mask=msk, other=0).to(tl.float32)
    d = tl.load(dr_ptr + r, mask=msk, other=1.0)
    if HAS_CHAN:
        d = d * tl.load(chan_ptr + c, mask=msk, other=1.0)
    return qv * d


@triton.jit
def _coding_x(p_ptr, q_ptr, q_row, dr_ptr, chan_ptr, interp_ptr, mean_ptr, r, c, msk, n, S,
              HAS_CHAN: tl.constexpr, D: tl.constexpr):
    """``(rec, x)`` of rows ``r``, channels ``c``: steps 1-4 of kvz.md §8.6."""
    w = _residual(q_ptr, q_row, dr_ptr, chan_ptr, r, c, msk, HAS_CHAN)
    ip = tl.load(interp_ptr + c, mask=msk, other=0) != 0
    odd = (r % 2) == 1
    io = msk & ip & odd
    wl = _residual(q_ptr, q_row, dr_ptr, chan_ptr, r - 1, c, io, HAS_CHAN)
    right = r + 1
    ok = (right < n) & ((right % S) != 0)
    wr = _residual(q_ptr, q_row, dr_ptr, chan_ptr, right, c, io & ok, HAS_CHAN)
    pred = tl.where(ok, 0.5 * (wl + wr), wl)
    w = tl.where(io, pred + w, w)
    rec = tl.load(p_ptr + r * D + c, mask=msk, other=0.0) + w
    x = rec + tl.load(mean_ptr + c, mask=msk, other=0.0)
    return rec, x


@triton.jit
def _bf16_bits(x):
    """float32 -> bfloat16 bits (fused_rows.bf16_ir): round to nearest even, nan -> sign | 0x7fc0."""
    u = x.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    hi = u >> 16
    rne = (u + 0x7FFF + (hi & 1)) >> 16
    nanv = (hi & 0x8000) | 0x7FC0
    return tl.where(a > 0x7F800000, nanv, rne) & 0xFFFF


@triton.jit
def _f16_bits(x):
    """float32 -> float16 bits as numpy (fused_rows.f16_ir)."""
    u = x.to(tl.uint32, bitcast=True)
    sgn = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    a13 = a >> 13
    nrm = ((a - 0x38000000) + 0xFFF + (a13 & 1)) >> 13
    sv = a.to(tl.float32, bitcast=True) * 16777216.0
    sv = tl.where(sv < 2048.0, sv, 2048.0)
    sub = ((sv + 12582912.0) - 12582912.0).to(tl.int32).to(tl.uint32)
    nanh = 0x7C00 | (a13 & 0x3FF)
    nanh = tl.where(nanh == 0x7C00, 0x7C01, nanh)
    hv = tl.where(a >= 0x38800000, nrm, sub)
    hv = tl.where(a >= 0x477FF000, 0x7C00, hv)
    hv = tl.where(a > 0x7F800000, nanh, hv)
    return (sgn | hv) & 0xFFFF


@triton.jit
def post_kernel(p_ptr, q_ptr, q_row, dr_ptr, chan_ptr, interp_ptr, mean_ptr, zr_ptr, zimg_ptr,
                cos_ptr, sin_ptr, rot, rec_ptr, out_ptr, dst_ptr, n, d, S, fmax,
                HAS_CHAN: tl.constexpr, ROPE: tl.constexpr, PAIR_HALF: tl.constexpr, OUT: tl.constexpr,
                EMIT: tl.constexpr, D: tl.constexpr, BR: tl.constexpr):
    """One block's rows ``[BR, D]`` per program (``d`` channels, rows ``D`` apart in ``p``/``rec``).
    ``p``: the base prediction float32 ``[n, D]``; ``q``: the block's symbols, channel ``c`` row
    ``r`` at ``c q_row + r``; ``dr`` float32 ``[n]`` (1.0 on zero rows); ``zr`` int8 ``[n]``: zero
    rows; ``zimg`` float32 ``[d]``: their coding-frame image; ``cos``/``sin`` float32 ``[n, rot/2]``
    (attention scaling in); ``rec``: the coding-frame reconstruction out (may be ``p``); with
    ``EMIT`` the native row ``r`` goes to ``out + dst[r] + c`` (float32, or the 16-bit pattern as
    int16) where ``dst[r] >= 0``."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    c = tl.arange(0, D)[None, :]
    msk = (r < n) & (c < d)
    rec, x = _coding_x(p_ptr, q_ptr, q_row, dr_ptr, chan_ptr, interp_ptr, mean_ptr, r, c, msk, n, S, HAS_CHAN, D)
    zero = tl.load(zr_ptr + r, mask=r < n, other=0) != 0
    zimg = tl.load(zimg_ptr + c + r * 0, mask=msk, other=0.0)
    if EMIT:
        if ROPE:
            half = rot // 2
            inrot = c < rot
            if PAIR_HALF:
                first = c < half
                k = tl.where(first, c, c - half)
                pc = tl.where(first, c + half, c - half)
            else:
                first = (c % 2) == 0
                k = c // 2
                pc = tl.where(first, c + 1, c - 1)
            pm = msk & inrot
            k = tl.where(inrot, k, 0)
            pc = tl.where(inrot, pc, c)
            _, xp = _coding_x(p_ptr, q_ptr, q_row, dr_ptr, chan_ptr, interp_ptr, mean_ptr, r, pc, pm, n, S,
                              HAS_CHAN, D)
            cs = tl.load(cos_ptr + r * half + k, mask=pm, other=1.0)
            sn = tl.load(sin_ptr + r * half + k, mask=pm, other=0.0)
            xr = tl.where(first, x * cs - xp * sn, x * cs + xp * sn)
            x = tl.where(inrot, xr, x)
        x = tl.where(x > fmax, fmax, tl.where(x < -fmax, -fmax, x))
        drow = tl.load(dst_ptr + r, mask=r < n, other=-1)
        om = msk & (drow >= 0)
        if OUT == 0:
            tl.store(out_ptr + drow + c, tl.where(zero, 0.0, x), mask=om)
        else:
            if OUT == 1:
                bits = _bf16_bits(x)
            else:
                bits = _f16_bits(x)
            bits = tl.where(zero, 0, bits)
            tl.store(out_ptr + drow + c, bits.to(tl.int32).to(tl.int16), mask=om)
    tl.store(rec_ptr + r * D + c, tl.where(zero, zimg, rec), mask=msk)


# ---------------------------------------------------------------------------------------------
# predictions: exact maps (kvz.md §8.4.1)

@triton.jit
def quant_rows_kernel(x_ptr, x_stride, p2_ptr, xq_ptr, xexp_ptr, n, K, KP: tl.constexpr, BR: tl.constexpr):
    """Rows of one source (float32, ``K`` channels, rows ``x_stride`` apart) -> ``xq`` (float64
    integers ``[n, KP]``, zero padded) and ``x_exp`` (int32 ``[n]``); ``p2[k] = 2**-shift[k]``
    (float64; ``|shift| <= 24`` keeps every nonzero ``x'`` a normal float64)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    c = tl.arange(0, KP)[None, :]
    msk = (r < n) & (c < K)
    xv = tl.load(x_ptr + r * x_stride + c, mask=msk, other=0.0).to(tl.float64) * \
        tl.load(p2_ptr + c + r * 0, mask=msk, other=1.0)
    bits = xv.to(tl.int64, bitcast=True)
    nonfin = ((bits >> 52) & 0x7FF) == 0x7FF
    a = tl.where(nonfin, 0.0, tl.abs(xv))
    mx = tl.reduce(a, 1, _max)[:, None]
    anynf = tl.reduce(nonfin.to(tl.int32), 1, _max)[:, None] > 0
    e = ((mx.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1022
    e = tl.where(mx > 0.0, e, 0)
    xe = tl.where(anynf, -13, e - 13)
    scale = ((1023 - xe) << 52).to(tl.float64, bitcast=True)       # 2**-x_exp, exact
    v = xv * scale
    v = tl.where(v > 8191.0, 8191.0, tl.where(v < -8191.0, -8191.0, v))
    v = tl.where(v != v, 8191.0, v)
    v = (v + 6755399441055744.0) - 6755399441055744.0              # round half to even (|v| < 2**51)
    tl.store(xq_ptr + r * KP + c, tl.where(msk, v, 0.0), mask=(r < n) & (c < KP))
    tl.store(xexp_ptr + r + c * 0, xe.to(tl.int32), mask=(r < n) & (c == 0))


@triton.jit
def map_kernel(xq_ptr, xexp_ptr, wq_ptr, wexp_ptr, y_ptr, y_stride, n, n_out, S_src,
               KP: tl.constexpr, NP: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """``Y[t, j] = float32(sum_s float64(xq_s @ wq_s)[t, j] * 2**(x_exp_s[t] + w_exp_s[j]))`` with
    ``xq [S, n, KP]`` and ``wq [S, KP, NP]`` float64 integers, ``x_exp [S, n]``, ``w_exp [S, NP]``
    int32; the sources added in order from +0.0; rows of ``Y`` ``y_stride`` apart. Program
    ``(i, k)``: rows ``i BR ..``, columns ``k BN ..``; the dot runs over ``BK``-channel slices.
    Every product and partial sum is an integer below 2**53 (``|acc| < 8191 * 4095 * KP``), so the
    float64 dots are exact in any order and tiling, on tensor cores too."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
    j = tl.program_id(1) * BN + tl.arange(0, BN)[None, :]
    rm = r < n
    y = tl.full((BR, BN), 0.0, tl.float64)
    for s in range(0, S_src):
        acc = tl.full((BR, BN), 0.0, tl.float64)
        for k0 in range(0, KP, BK):
            kr = k0 + tl.arange(0, BK)
            xq = tl.load(xq_ptr + s * n * KP + r * KP + kr[None, :], mask=rm, other=0.0)
            wq = tl.load(wq_ptr + s * KP * NP + kr[:, None] * NP + j)
            acc += tl.dot(xq, wq, input_precision="ieee")
        xe = tl.load(xexp_ptr + s * n + r, mask=rm, other=0).to(tl.int64)
        we = tl.load(wexp_ptr + s * NP + j).to(tl.int64)
        p2 = ((xe + we + 1023) << 52).to(tl.float64, bitcast=True)
        y = y + acc * p2
    tl.store(y_ptr + r * y_stride + j, y.to(tl.float32), mask=rm & (j < n_out))
