"""The vectorised ``lanes32`` decoder: all 32 lanes in lock-step as ``<32 x i32>`` LLVM vectors.

One decode step of the 32 lanes is straight-line vector code: the slot of every state, one
32-bit *gather* from the fused decode table (frequency, slot bias, token), the state update, one
32-bit gather of the two next 16-bit words of every lane's own stream (which serves both the
token's and the raw chunk's renormalisation), the raw chunk (a variable shift), the value from
the token (shifts and masks), and one 32-value store.  No shuffles: every lane reads only its own
stream.  The rare second raw chunk (values ``|v| >= 2**17``) is one branch per step, taken when
any lane of any vector needs it, so the vectors' steps are straight-line code side by side and the
core overlaps their gathers (a branch per vector serialised them: 1.6-2x slower on Zen 4).
:func:`decode_simd_objects` decodes ``GROUP`` objects of a tensor in lock-step the same way (their
lanes are independent, and they walk the same channels with the same tables).  Neither changes a
lane's arithmetic: the symbols are the same on every input.

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
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from alignpred.entropy.lanes import (
    ERR_OK,
    STATE_L,
    lane_finish,
    lane_step,
    lane_table,
)
from alignpred.kernels._jit import njit

_I1 = ir.IntType(1)
_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V8 = ir.VectorType(_I32, 8)
VW = 16                      # lanes per vector value: 32 lanes are 32 // VW independent vectors
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


def _head(builder, isa, x, p, mb, td, wd, pv, smask, wmaxv):
    """The token and raw chunk 1 of one decode step of ``VW`` lanes: ``(state, position, raw bits,
    nb, token, big, need2)`` (``need2``: the lanes whose value needs raw chunk 2)."""
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
    return x, p, r, nb, tok, big, builder.icmp_unsigned(">", nb, _splat(16))


def _chunk2(builder, isa, x, p, r, nb, need2, wd, wmaxv):
    """Raw chunk 2 (``nb - 16`` bits) of the lanes in ``need2``; the other lanes are unchanged
    (a 0-bit chunk, and their states need no renormalisation)."""
    k2 = builder.select(need2, builder.sub(nb, _splat(16)), _splat(0))
    r = builder.or_(r, builder.shl(builder.and_(x, builder.sub(builder.shl(_splat(1), k2), _splat(1))),
                                   _splat(16)))
    x = builder.lshr(x, k2)
    g2 = _gather(builder, isa, wd, _umin(builder, p, wmaxv), _I16)
    x, p, _ = _renorm(builder, x, p, builder.and_(g2, _splat(0xFFFF)))
    return x, p, r


def _value(builder, tok, big, nb, r):
    """The value ``a ^ -s`` with ``a = (hi << nb) | r``, ``s = tok & 1``, ``hi = tok >> 1`` (tok < 16)
    or ``2 | m`` (the bit after the leading one, bit 1 of tok): ``u = 2a + s`` is the zigzag code
    of the value."""
    t1 = builder.lshr(tok, _splat(1))
    hi = builder.select(big, builder.or_(builder.and_(t1, _splat(1)), _splat(2)), t1)
    a = builder.or_(builder.shl(hi, nb), r)
    return builder.xor(a, builder.sub(_splat(0), builder.and_(tok, _splat(1))))


def _steps(builder, isa, xs, ps, mbs, td, wd, pv, smask, wmaxvs):
    """One decode step of vectors of lanes (``wmaxvs``: each one's last readable word): ``(states,
    positions, values)`` per vector.  The
    vectors' steps are straight-line code side by side (so the core overlaps their gathers); the
    rare raw chunk 2 is one branch, taken when any lane of any vector needs it."""
    heads = [_head(builder, isa, x, p, mb, td, wd, pv, smask, wm) for x, p, mb, wm in zip(xs, ps, mbs, wmaxvs)]
    iv = ir.IntType(VW)
    anym = heads[0][6]
    for h in heads[1:]:
        anym = builder.or_(anym, h[6])
    anyb = builder.icmp_unsigned("!=", builder.bitcast(anym, iv), ir.Constant(iv, 0))
    bb_pre = builder.block
    with builder.if_then(anyb, likely=False):
        late = [_chunk2(builder, isa, x, p, r, nb, n2, wd, wm) for (x, p, r, nb, _, _, n2), wm in zip(heads, wmaxvs)]
        bb_in = builder.block
    merged = []   # every phi first (LLVM wants them at the top of the block), then the values
    for (x, p, r, *_), (x2, p2, r2) in zip(heads, late):
        for a, b in ((x, x2), (p, p2), (r, r2)):
            phi = builder.phi(_V)
            phi.add_incoming(a, bb_pre)
            phi.add_incoming(b, bb_in)
            merged.append(phi)
    return [(merged[3 * j], merged[3 * j + 1], _value(builder, tok, big, nb, merged[3 * j + 2]))
            for j, (_, _, _, nb, tok, big, _) in enumerate(heads)]


def _vptr(builder, base, j):
    """Pointer to vector ``j`` (``VW`` lanes) of the i32 array at ``base``."""
    return builder.bitcast(builder.gep(base, [ir.Constant(_I64, VW * j)]), _V.as_pointer())


def _states_in(builder, xd, pd, nv):
    """The ``nv`` state and position vectors of the lanes, loaded into stack slots."""
    sx = [cgutils.alloca_once(builder, _V) for _ in range(nv)]
    sp = [cgutils.alloca_once(builder, _V) for _ in range(nv)]
    for j in range(nv):
        builder.store(builder.load(_vptr(builder, xd, j), align=4), sx[j])
        builder.store(builder.load(_vptr(builder, pd, j), align=4), sp[j])
    return sx, sp


def _states_out(builder, sx, sp, xd, pd):
    for j in range(len(sx)):
        builder.store(builder.load(sx[j]), _vptr(builder, xd, j), align=4)
        builder.store(builder.load(sp[j]), _vptr(builder, pd, j), align=4)


def _put(builder, res, sx, sp, od, offs):
    """A step's values to ``od + offs[j]`` and its states back to the slots."""
    for j, (x, p, v) in enumerate(res):
        builder.store(v, builder.bitcast(builder.gep(od, [offs[j]]), _V.as_pointer()), align=4)
        builder.store(x, sx[j])
        builder.store(p, sp[j])


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

        nv = 32 // VW
        mbs = [builder.load(_vptr(builder, md, j), align=4) for j in range(nv)]
        pv = _vsplat(builder, builder.trunc(prec, _I32))
        smask = builder.sub(builder.shl(_splat(1), pv), _splat(1))
        wmaxv = _vsplat(builder, builder.trunc(wmax, _I32))
        sx, sp = _states_in(builder, xd, pd, nv)
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
            res = _steps(builder, isa, [builder.load(v) for v in sx], [builder.load(v) for v in sp],
                         [builder.select(walk, mbw, m) for m in mbs], td, wd, pv, smask, [wmaxv] * nv)
            _put(builder, res, sx, sp, od, [builder.add(off, ir.Constant(_I64, VW * j)) for j in range(nv)])
        _states_out(builder, sx, sp, xd, pd)
        return context.get_dummy_value()

    return sig, codegen


def _group_run(G: int):
    """An intrinsic decoding ``G`` objects of one tensor in lock-step: the same channel walk (every
    object ``N`` symbols per channel, ``N`` a multiple of 32, rows of unit stride), so each step
    decodes channel ``c`` of all ``G`` objects with one table (``mbc[c]``) — ``32 G // VW``
    independent vectors side by side, whose gathers the core overlaps.  ``xs`` (uint32) and ``ps``
    (int32, positions in the whole word array ``w``) hold ``32 G`` lanes, object-major, in/out;
    ``wmax`` (int32 [G]): each object's clamp word (its zero pad word); ``ooff`` (int64 [G]): the
    element offset of each object's first column in ``out``."""

    @intrinsic
    def run(typingctx, xs, ps, w, wmax, tab, ngroups, out, ooff, prec, mbc, N, rs):
        sig = types.void(xs, ps, w, wmax, tab, ngroups, out, ooff, prec, mbc, N, rs)

        def codegen(context, builder, sig, args):
            isa = isa_of(context.codegen()._tm_features)
            xs, ps, w, wmax, tab, ngroups, out, ooff, prec, mbc, N, rs = args
            ta = sig.args

            def data(i, v, ty):
                return builder.bitcast(context.make_array(ta[i])(context, builder, v).data, ty.as_pointer())

            xd, pd, wd, md = data(0, xs, _I32), data(1, ps, _I32), data(2, w, _I16), data(3, wmax, _I32)
            td, od, fd, cd = data(4, tab, _I32), data(6, out, _I32), data(7, ooff, _I64), data(9, mbc, _I32)

            per = 32 // VW
            nv = G * per
            pv = _vsplat(builder, builder.trunc(prec, _I32))
            smask = builder.sub(builder.shl(_splat(1), pv), _splat(1))
            wmaxvs = [_vsplat(builder, builder.load(builder.gep(md, [ir.Constant(_I64, j // per)])))
                      for j in range(nv)]
            offs = [builder.load(builder.gep(fd, [ir.Constant(_I64, g)])) for g in range(G)]
            sx, sp = _states_in(builder, xd, pd, nv)
            sc = cgutils.alloca_once_value(builder, ir.Constant(_I64, 0))
            st = cgutils.alloca_once_value(builder, ir.Constant(_I64, 0))
            with cgutils.for_range(builder, ngroups):
                c, t = builder.load(sc), builder.load(st)
                off = builder.add(builder.mul(c, rs), t)
                mbw = _vsplat(builder, builder.load(builder.gep(cd, [c])))
                t = builder.add(t, ir.Constant(_I64, 32))
                wrap = builder.icmp_signed("==", t, N)
                builder.store(builder.select(wrap, ir.Constant(_I64, 0), t), st)
                builder.store(builder.add(c, builder.zext(wrap, _I64)), sc)
                res = _steps(builder, isa, [builder.load(v) for v in sx], [builder.load(v) for v in sp],
                             [mbw] * nv, td, wd, pv, smask, wmaxvs)
                _put(builder, res, sx, sp, od, [builder.add(builder.add(offs[j // per], off),
                                                            ir.Constant(_I64, VW * (j % per))) for j in range(nv)])
            _states_out(builder, sx, sp, xd, pd)
            return context.get_dummy_value()

        return sig, codegen

    return run


GROUP = 2   # objects decoded in lock-step (measured on Zen 4: 2 beats 1, 4 and 8)
_run_group = _group_run(GROUP)


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
    :func:`alignpred.entropy.lanes._objects_portable`); returns ``(error, object)``: the first
    object in order whose payload is invalid.

    Runs of ``GROUP`` consecutive objects of one width ``N`` (a multiple of 32, rows of unit
    stride) are decoded in lock-step by one kernel call (:func:`_group_run`); each lane's steps
    are those of :func:`decode_simd`, so are the symbols and the error of every object."""
    k = Ws.shape[0]
    C = out.shape[0]
    errs = np.zeros(k, np.int64)
    G = GROUP
    xs = np.empty(32 * G, np.uint32)
    ps = np.empty(32 * G, np.int32)
    wm = np.empty(G, np.int32)
    oo = np.empty(G, np.int64)
    ends = np.empty((G, 32), np.int64)
    mbc = np.empty(C, np.int32)
    for c in range(C):
        mbc[c] = np.int32(ids[c] << prec)
    unit = out.strides[1] == 4
    rs = out.strides[0] // 4
    j = 0
    while j < k:
        N = cols[j + 1] - cols[j]
        grouped = unit and N > 0 and N % 32 == 0 and j + G <= k and offs[j + G] < (1 << 30)
        for g in range(G):
            if not grouped:
                break
            grouped = cols[j + g + 1] - cols[j + g] == N
        if grouped:
            for g in range(G):
                jj = j + g
                err, x, pos, end = lane_table(w[offs[jj]:offs[jj + 1]], Ws[jj], hws[jj])
                if err != ERR_OK:
                    grouped = False
                    break
                for ln in range(32):
                    xs[32 * g + ln] = x[ln]
                    ps[32 * g + ln] = np.int32(offs[jj] + min(pos[ln], Ws[jj]))
                    ends[g, ln] = offs[jj] + end[ln]
                wm[g] = np.int32(offs[jj] + Ws[jj])
                oo[g] = cols[jj]
        if grouped:
            _run_group(xs, ps, w, wm, dtab, C * N // 32, out, oo, prec, mbc, N, rs)
            x = np.empty(32, np.uint32)
            pos = np.empty(32, np.int64)
            for g in range(G):
                for ln in range(32):
                    x[ln] = xs[32 * g + ln]
                    pos[ln] = np.int64(ps[32 * g + ln])
                errs[j + g] = lane_finish(x, pos, ends[g])
            j += G
        else:
            errs[j] = decode_simd(w[offs[j]:offs[j + 1]], Ws[j], hws[j], ids, dtab, prec, out[:, cols[j]:cols[j + 1]])
            j += 1
    for j in range(k):
        if errs[j] != ERR_OK:
            return errs[j], j
    return ERR_OK, -1
