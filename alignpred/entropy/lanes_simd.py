"""The vectorised ``lanes32`` decoder: all 32 lanes in lock-step as ``<32 x i32>`` LLVM vectors.

One decode step of the 32 lanes is straight-line vector code: the slot of every state, one
32-bit *gather* from the fused decode table (frequency, slot bias, token), the state update, one
32-bit gather of the two next 16-bit words of every lane's own stream (which serves both the
token's and the raw chunk's renormalisation), the raw chunk (a variable shift), the value from
the token (shifts and masks), and one 32-value store.  No shuffles: every lane reads only its own
stream.  The rare second raw chunk (values ``|v| >= 2**17``) is a branch taken when any lane
needs it.

The gathers are chosen at code generation from the target numba compiles for (so the on-disk
cache, keyed by target, stays right): AVX-512 targets use ``llvm.masked.gather`` (``vpgatherdd``
with mask registers); AVX2 targets the AVX2 gather intrinsic (``vpgatherdd ymm``, four per
32-lane gather — LLVM would otherwise scalarise gathers on cores it models as slow-gather, such
as Zen 3); any other target ``llvm.masked.gather``, which LLVM lowers to scalar loads.  Force a
target with ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES`` (e.g. ``haswell`` with ``-avx512f``, or
``generic``), which is how the tests run the AVX2-only and portable code on any machine.

The values, the words read and the validation are those of
:func:`alignpred.entropy.lanes.lane_step` (the portable decoder), on every input.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from llvmlite.ir import instructions as _ins
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from alignpred.entropy.lanes import (
    ERR_OK,
    STATE_L,
    lane_finish,
    lane_step,
    lane_table,
)

_I1 = ir.IntType(1)
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V8 = ir.VectorType(_I32, 8)
VW = 8                       # lanes per vector value: 32 lanes are 32 // VW independent vectors
_V = ir.VectorType(_I32, VW)
_VB = ir.VectorType(_I1, VW)


def isa_of(features: str) -> str:
    """``avx512``, ``avx2`` or ``none`` for an LLVM feature string (``+avx2,-avx512f,...``)."""
    f = set(features.split(","))
    if "+avx512f" in f and "+avx512vl" in f:
        return "avx512"
    if "+avx2" in f:
        return "avx2"
    return "none"


def target_isa() -> str:
    """The gather flavour the vectorised decoder is compiled with in this process."""
    from numba.core.registry import cpu_target

    return isa_of(cpu_target.target_context.codegen()._tm_features)


def _splat(v):
    return ir.Constant(_V, [v] * VW)


def _vsplat(builder, scalar):
    vec = builder.insert_element(ir.Constant(_V, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, ir.Constant(_V, ir.Undefined), ir.Constant(_V, None))


def _vgep(builder, base, idx, elty):
    """A vector of pointers ``base + idx`` (``base``: ``elty*``, ``idx``: <32 x i32>)."""
    gi = _ins.GEPInstr(builder.block, base, [builder.sext(idx, ir.VectorType(_I64, VW))], True, "vgep",
                       source_etype=elty)
    gi.type = ir.VectorType(elty.as_pointer(), VW)
    builder._insert(gi)
    return gi


def _gather(builder, isa, base, idx, elty):
    """32 little-endian 32-bit loads at ``base + idx`` (``elty`` units: i32 or i16)."""
    if isa == "avx2":
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V8, [_V8, _I8.as_pointer(), _V8, _V8, _I8]),
            "llvm.x86.avx2.gather.d.d.256")
        bp = builder.bitcast(base, _I8.as_pointer())
        scale = ir.Constant(_I8, elty.width // 8)
        ones = ir.Constant(_V8, [-1] * 8)
        zero = ir.Constant(_V8, None)
        parts = []
        for k in range(VW // 8):
            sub = idx if VW == 8 else builder.shuffle_vector(idx, idx, ir.Constant(_V8, list(range(8 * k, 8 * k + 8))))
            parts.append(builder.call(fn, [zero, bp, sub, ones, scale]))
        while len(parts) > 1:
            n = 2 * parts[0].type.count
            parts = [builder.shuffle_vector(parts[i], parts[i + 1], ir.Constant(ir.VectorType(_I32, n), list(range(n))))
                     for i in range(0, len(parts), 2)]
        return parts[0]
    ptrs = _vgep(builder, base, idx, elty)
    if elty is not _I32:
        ptrs = builder.bitcast(ptrs, ir.VectorType(_I32.as_pointer(), VW))
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V, [ptrs.type, _I32, _VB, _V]), f"llvm.masked.gather.v{VW}i32.v{VW}p0")
    return builder.call(fn, [ptrs, ir.Constant(_I32, elty.width // 8), ir.Constant(_VB, [1] * VW),
                             ir.Constant(_V, None)])


def _umin(builder, a, b):
    return builder.select(builder.icmp_unsigned("<", a, b), a, b)


def _renorm(builder, x, p, word):
    need = builder.icmp_unsigned("<", x, _splat(STATE_L))
    x = builder.select(need, builder.or_(builder.shl(x, _splat(16)), word), x)
    return x, builder.add(p, builder.zext(need, _V)), need


def _step(builder, isa, x, p, mb, td, wd, pv, smask, wmaxv):
    """One decode step of ``VW`` lanes: ``(state, position, value)`` vectors."""
    e = _gather(builder, isa, td, builder.add(mb, builder.and_(x, smask)), _I32)
    tok = builder.and_(e, _splat(0xFF))
    x = builder.add(builder.mul(builder.lshr(e, _splat(20)), builder.lshr(x, pv)),
                    builder.and_(builder.lshr(e, _splat(8)), _splat(0xFFF)))
    g = _gather(builder, isa, wd, _umin(builder, p, wmaxv), _I16)
    w0 = builder.and_(g, _splat(0xFFFF))
    w1 = builder.lshr(g, _splat(16))
    x, p, n1 = _renorm(builder, x, p, w0)
    # raw chunk 1: k1 = min(nb, 16) bits, nb = 0 for tokens < 16
    big = builder.icmp_signed(">", tok, _splat(15))
    nb = builder.and_(builder.sext(big, _V), builder.sub(builder.lshr(tok, _splat(2)), _splat(2)))
    k1 = _umin(builder, nb, _splat(16))
    r = builder.and_(x, builder.xor(builder.shl(_splat(-1), k1), _splat(-1)))
    x = builder.lshr(x, k1)
    x, p, _ = _renorm(builder, x, p, builder.select(n1, w1, w0))
    # raw chunk 2 (nb > 16), only when some lane needs it
    need2 = builder.icmp_unsigned(">", nb, _splat(16))
    anyb = builder.icmp_unsigned("!=", builder.bitcast(need2, ir.IntType(VW)), ir.Constant(ir.IntType(VW), 0))
    bb_pre = builder.block
    with builder.if_then(anyb, likely=False):
        k2 = builder.select(need2, builder.sub(nb, _splat(16)), _splat(0))
        r2 = builder.or_(r, builder.shl(builder.and_(x, builder.sub(builder.shl(_splat(1), k2), _splat(1))),
                                        _splat(16)))
        x2 = builder.lshr(x, k2)
        g2 = _gather(builder, isa, wd, _umin(builder, p, wmaxv), _I16)
        x2, p2, _ = _renorm(builder, x2, p, builder.and_(g2, _splat(0xFFFF)))
        bb_in = builder.block
    phis = []
    for a, b in ((r, r2), (x, x2), (p, p2)):
        phi = builder.phi(_V)
        phi.add_incoming(a, bb_pre)
        phi.add_incoming(b, bb_in)
        phis.append(phi)
    r, x, p = phis
    # value: a ^ -s with a = (hi << nb) | r, s = tok & 1, hi = tok >> 1 (tok < 16) or 2 | m (the bit
    # after the leading one, bit 1 of tok): u = 2a + s is the zigzag code of the value
    t1 = builder.lshr(tok, _splat(1))
    hi = builder.select(big, builder.or_(builder.and_(t1, _splat(1)), _splat(2)), t1)
    a = builder.or_(builder.shl(hi, nb), r)
    v = builder.xor(a, builder.sub(_splat(0), builder.and_(tok, _splat(1))))
    return x, p, v


@intrinsic
def _run(typingctx, xs, ps, w, wmax, tab, mbase, ngroups, out, ooff, prec, mbc, N, rs, c0):
    """Decode ``ngroups`` steps of all 32 lanes: states ``xs`` (uint32 [32]) and positions ``ps``
    (int32 [32]) in/out, words ``w`` (uint16, readable up to index ``wmax + 1``), table ``tab``
    (uint32).  ``N == 0``: per-lane table offsets ``mbase`` (int32 [32]), values to ``out[ooff + 32k
    + l]``.  ``N > 0`` (a multiple of 32: every group inside one channel): walk the channels from
    ``c0`` (position ``ooff`` in it), table offset ``mbc[c]`` (int32), values to element ``c * rs + t``
    of ``out`` (rows of unit stride)."""
    sig = types.void(xs, ps, w, wmax, tab, mbase, ngroups, out, ooff, prec, mbc, N, rs, c0)

    def codegen(context, builder, sig, args):
        isa = isa_of(context.codegen()._tm_features)
        xs, ps, w, wmax, tab, mbase, ngroups, out, ooff, prec, mbc, N, rs, c0 = args
        ta = sig.args

        def data(i, v):
            return context.make_array(ta[i])(context, builder, v).data

        xd, pd, wd, td, md, od = (data(0, xs), data(1, ps), data(2, w), data(4, tab), data(5, mbase),
                                  data(7, out))
        cd = builder.bitcast(data(10, mbc), _I32.as_pointer())
        xd = builder.bitcast(xd, _I32.as_pointer())
        pd = builder.bitcast(pd, _I32.as_pointer())
        md = builder.bitcast(md, _I32.as_pointer())
        wd = builder.bitcast(wd, _I16.as_pointer())
        td = builder.bitcast(td, _I32.as_pointer())
        od = builder.bitcast(od, _I32.as_pointer())

        def vptr(base, j):
            return builder.bitcast(builder.gep(base, [ir.Constant(_I64, VW * j)]), _V.as_pointer())

        nv = 32 // VW
        mbs = [builder.load(vptr(md, j), align=4) for j in range(nv)]
        pv = _vsplat(builder, builder.trunc(prec, _I32))
        smask = builder.sub(builder.shl(_splat(1), pv), _splat(1))
        wmaxv = _vsplat(builder, builder.trunc(wmax, _I32))
        sx = [cgutils.alloca_once(builder, _V) for _ in range(nv)]
        sp = [cgutils.alloca_once(builder, _V) for _ in range(nv)]
        for j in range(nv):
            builder.store(builder.load(vptr(xd, j), align=4), sx[j])
            builder.store(builder.load(vptr(pd, j), align=4), sp[j])
        walk = builder.icmp_signed(">", N, ir.Constant(_I64, 0))
        sc = cgutils.alloca_once_value(builder, c0)
        st = cgutils.alloca_once_value(builder, ooff)
        with cgutils.for_range(builder, ngroups) as loop:
            c, t = builder.load(sc), builder.load(st)
            off = builder.select(walk, builder.add(builder.mul(c, rs), t),
                                 builder.add(ooff, builder.mul(loop.index, ir.Constant(_I64, 32))))
            mbw = _vsplat(builder, builder.load(builder.gep(cd, [builder.select(walk, c, ir.Constant(_I64, 0))])))
            t = builder.add(t, ir.Constant(_I64, 32))
            wrap = builder.icmp_signed("==", t, N)
            builder.store(builder.select(wrap, ir.Constant(_I64, 0), t), st)
            builder.store(builder.add(c, builder.zext(wrap, _I64)), sc)
            for j in range(nv):
                x, p, v = _step(builder, isa, builder.load(sx[j]), builder.load(sp[j]),
                                builder.select(walk, mbw, mbs[j]), td, wd, pv, smask, wmaxv)
                dst = builder.gep(od, [builder.add(off, ir.Constant(_I64, VW * j))])
                builder.store(v, builder.bitcast(dst, _V.as_pointer()), align=4)
                builder.store(x, sx[j])
                builder.store(p, sp[j])
        for j in range(nv):
            builder.store(builder.load(sx[j]), vptr(xd, j), align=4)
            builder.store(builder.load(sp[j]), vptr(pd, j), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def decode_simd(w, W, hw, ids, dtab, prec, out):
    """The vectorised decoder (same contract as :func:`~alignpred.entropy.lanes.decode_portable`).

    With rows of unit stride and ``N`` a multiple of 32, one kernel call walks every channel;
    otherwise whole groups of 32 symbols inside one channel go to the kernel in runs (into the row,
    or through a scratch row when rows are strided), groups across a channel boundary one at a
    time through the scratch row.  The last partial group takes :func:`lane_step`.
    """
    C, N = out.shape
    n = C * N
    err, x, pos, end = lane_table(w, W, hw)
    if err != ERR_OK:
        return err
    if W >= (1 << 30):   # vector positions are 32-bit: such payloads take the portable steps
        g_full = 0
    else:
        g_full = n // 32
    xs = x.copy()
    ps = np.empty(32, np.int32)
    for ln in range(32):
        ps[ln] = np.int32(min(pos[ln], W))
    mbase = np.empty(32, np.int32)
    mbc = np.empty(C, np.int32)
    for c in range(C):
        mbc[c] = np.int32(ids[c] << prec)
    row = np.empty(32 * max(1, min(g_full, 64)), np.int32)
    contiguous = N == 0 or out.strides[1] == 4
    if contiguous and N % 32 == 0 and g_full:
        # every group inside one channel: one call walks all of them
        _run(xs, ps, w, W, dtab, mbase, g_full, out, 0, prec, mbc, N, out.strides[0] // 4, 0)
        g_full_done = g_full
    else:
        g_full_done = 0
    g = g_full_done
    while g < g_full:
        i0 = 32 * g
        c0 = i0 // N
        if (i0 + 31) // N == c0:
            g1 = min(g_full, ((c0 + 1) * N) // 32)
            for ln in range(32):
                mbase[ln] = mbc[c0]
            t0 = i0 - c0 * N
            if contiguous:
                _run(xs, ps, w, W, dtab, mbase, g1 - g, out[c0], t0, prec, mbc, 0, 0, 0)
            else:
                for gg in range(g, g1, 64):
                    ng = min(64, g1 - gg)
                    _run(xs, ps, w, W, dtab, mbase, ng, row, 0, prec, mbc, 0, 0, 0)
                    tt = t0 + 32 * (gg - g)
                    for k in range(32 * ng):
                        out[c0, tt + k] = row[k]
            g = g1
        else:
            for ln in range(32):
                mbase[ln] = mbc[(i0 + ln) // N]
            _run(xs, ps, w, W, dtab, mbase, 1, row, 0, prec, mbc, 0, 0, 0)
            for ln in range(32):
                c = (i0 + ln) // N
                out[c, i0 + ln - c * N] = row[ln]
            g += 1
    for ln in range(32):
        x[ln] = xs[ln]
        if g_full:
            pos[ln] = np.int64(ps[ln])
    for i in range(32 * g_full, n):
        ln = i & 31
        c = i // N
        v, xl, pl = lane_step(x[ln], pos[ln], w, W, dtab, np.int64(ids[c]) << prec, prec)
        out[c, i - c * N] = v
        x[ln] = xl
        pos[ln] = pl
    return lane_finish(x, pos, end)


@njit(cache=True, nogil=True)
def decode_simd_objects(w, offs, Ws, hws, ids, dtab, prec, out, cols):
    """:func:`decode_simd` over several objects in one call (the contract of
    :func:`alignpred.entropy.lanes._objects_portable`); returns ``(error, object)``."""
    for j in range(Ws.shape[0]):
        err = decode_simd(w[offs[j]:offs[j + 1]], Ws[j], hws[j], ids, dtab, prec, out[:, cols[j]:cols[j + 1]])
        if err != ERR_OK:
            return err, j
    return ERR_OK, -1
