"""The decoder's post-prediction step in one pass: residual dequantisation (with token
interpolation), reconstruction, mean, RoPE, clip and the cast to the cache dtype.

:func:`reference_post` is the definition, in numpy; :func:`fused_post` computes the same bits
in one numba pass over the block (every product and sum rounded to float32 separately, as numpy
does: numba without fastmath never contracts to FMA; bfloat16 and float16 rounded to nearest
even with ml_dtypes' / numpy's NaN rules), writing the coding-frame reconstruction ``rec``
(float32) and the native rows into caller-provided arrays.

>>> import numpy as np, ml_dtypes
>>> rng = np.random.default_rng(0)
>>> n, d = 5, 8
>>> base = rng.standard_normal((n, d)).astype(np.float32)
>>> q = rng.integers(-5, 6, (d, n)).astype(np.int32)
>>> delta = np.full(n, 0.1, np.float32)
>>> interp = np.arange(d) % 2 == 0
>>> mean = rng.standard_normal(d).astype(np.float32)
>>> rec_ref, nat_ref = reference_post(base, q, delta, interp, 256, mean, None, 3.0e38, ml_dtypes.bfloat16)
>>> rec, nat = fused_post(base, q, delta, interp, 256, mean, None, 3.0e38, ml_dtypes.bfloat16)
>>> bool((rec.view(np.uint32) == rec_ref.view(np.uint32)).all())
True
>>> bool((nat.view(np.uint16) == nat_ref.view(np.uint16)).all())
True
"""
from __future__ import annotations

import threading

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from alignpred.kernels._jit import njit
from alignpred.kernels.fused_rows import (
    bf16_ir,
    f16_ir,
    interp_row_bf16,
    interp_row_f16,
    interp_row_f32,
    plain_row_bf16,
    plain_row_f16,
    plain_row_f32,
)

# out kinds
OUT_F32, OUT_BF16, OUT_F16 = 0, 1, 2

_TILE = 32  # rows per tile (even): q is transposed tile by tile through an L1 buffer


# --------------------------------------------------------------------------------------------
# reference

def reference_post(base, q, delta, interp, object_size, mean, rope, fmax, out_dtype, chan=None):
    """The definition (numpy, float32 throughout).

    ``base`` float32 ``[n, d]`` (prediction, coding frame); ``q`` int32 ``[d, n]`` (channel-
    major symbols); ``delta`` float32 ``[n]`` (step per row); ``chan``: None or float32 ``[d]``,
    per-channel step multipliers (the step of row ``t``, channel ``c`` is
    ``float32(delta[t] * chan[c])``); ``interp`` bool ``[d]``;
    ``object_size`` (even; row 0 is an object boundary); ``mean`` float32 ``[d]``; ``rope``:
    None or ``(cos [n, r/2], sin [n, r/2], r, pairing)`` with ``pairing`` ``'half'`` or
    ``'interleaved'``; ``fmax`` (clip bound); ``out_dtype``: bfloat16, float16 or float32.
    Returns ``(rec float32 [n, d], native [n, d] out_dtype)``.
    """
    f32 = np.float32
    base = np.asarray(base, f32)
    n, d = base.shape
    dr = np.asarray(delta, f32)[:, None]
    if chan is not None:  # per-channel step multipliers: the step of (t, c) is delta[t] * chan[c]
        dr = dr * np.asarray(chan, f32).reshape(1, d)
    qt = np.asarray(q).T.astype(f32)
    wh = qt * dr
    cols = np.nonzero(np.asarray(interp, bool))[0]
    if len(cols) and n > 1:
        odd = np.arange(1, n, 2)
        right = odd + 1
        ok = (right < n) & (right % object_size != 0)
        left_v = wh[odd - 1][:, cols]
        right_v = wh[np.where(ok, right, odd - 1)][:, cols]
        pred = np.where(ok[:, None], f32(0.5) * (left_v + right_v), left_v)
        dro = dr[odd] if chan is None else dr[np.ix_(odd, cols)]
        wh[np.ix_(odd, cols)] = pred + qt[np.ix_(odd, cols)] * dro
    rec = base + wh
    x = rec + np.asarray(mean, f32)
    if rope is not None:
        cos, sin, r, pairing = rope
        cos = np.asarray(cos, f32)
        sin = np.asarray(sin, f32)
        x = x.copy()
        if pairing == "half":
            x1, x2 = x[:, :r // 2].copy(), x[:, r // 2:r].copy()
            x[:, :r // 2] = x1 * cos - x2 * sin
            x[:, r // 2:r] = x2 * cos + x1 * sin
        elif pairing == "interleaved":
            x1, x2 = x[:, 0:r:2].copy(), x[:, 1:r:2].copy()
            x[:, 0:r:2] = x1 * cos - x2 * sin
            x[:, 1:r:2] = x2 * cos + x1 * sin
        else:
            raise ValueError(f"unknown RoPE pairing {pairing!r}")
    fm = f32(fmax)
    x = np.clip(x, -fm, fm)
    with np.errstate(over="ignore", invalid="ignore"):
        native = x.astype(out_dtype)
    return rec.astype(f32), native


# --------------------------------------------------------------------------------------------
# kernel

_TB = 16  # transpose block (int32 lanes)


def _transpose_masks(N):
    """shufflevector masks of the log2(N) butterfly stages of an N x N transpose: stage bit
    ``k`` swaps bit k of the row and of the column index."""
    stages = []
    k = 1
    while k < N:
        lo = [j if not j & k else N + j - k for j in range(N)]
        hi = [j + k if not j & k else N + j for j in range(N)]
        stages.append((k, lo, hi))
        k *= 2
    return stages


@intrinsic
def _transpose_block(typingctx, src, soff, sstride, dst, doff, dstride):
    """``dst[doff + i*dstride + j] = src[soff + j*sstride + i]`` for ``i, j < 16`` (flat int32
    arrays): sixteen vector loads, 4 x 16 shuffles, sixteen vector stores."""
    sig = types.void(src, soff, sstride, dst, doff, dstride)

    def codegen(context, builder, sig, args):
        src, soff, sstride, dst, doff, dstride = args
        sd = context.make_array(sig.args[0])(context, builder, src).data
        dd = context.make_array(sig.args[3])(context, builder, dst).data
        i32, i64 = ir.IntType(32), ir.IntType(64)
        vty = ir.VectorType(i32, _TB)
        rows = []
        for j in range(_TB):
            p = builder.gep(sd, [builder.add(soff, builder.mul(sstride, ir.Constant(i64, j)))])
            rows.append(builder.load(builder.bitcast(p, vty.as_pointer()), align=4))
        for k, lo, hi in _transpose_masks(_TB):
            mlo = ir.Constant(ir.VectorType(i32, _TB), lo)
            mhi = ir.Constant(ir.VectorType(i32, _TB), hi)
            new = list(rows)
            for i in range(_TB):
                if i & k:
                    continue
                new[i] = builder.shuffle_vector(rows[i], rows[i + k], mlo)
                new[i + k] = builder.shuffle_vector(rows[i], rows[i + k], mhi)
            rows = new
        for i in range(_TB):
            p = builder.gep(dd, [builder.add(doff, builder.mul(dstride, ir.Constant(i64, i)))])
            builder.store(rows[i], builder.bitcast(p, vty.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, nogil=True)
def _load_tile(q, t0, t1, te, qt):
    """qt[t - t0, c] = q[c, t] for t0 <= t < te (q [d, n] with unit column stride, C order)."""
    d, n = q.shape
    qf = q.ravel()
    qtf = qt.ravel()
    c16 = d - d % _TB
    t16 = t0 + (t1 - t0) - (t1 - t0) % _TB
    for tb in range(t0, t16, _TB):
        for cb in range(0, c16, _TB):
            _transpose_block(qf, cb * n + tb, n, qtf, (tb - t0) * d + cb, d)
    for t in range(t0, te):
        if t < t16:
            for c in range(c16, d):
                qt[t - t0, c] = q[c, t]
        else:
            for c in range(d):
                qt[t - t0, c] = q[c, t]


@intrinsic
def _f32_bits(typingctx, v):
    """The bits of a float32 as uint32 (a bitcast)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(cache=True, nogil=True, inline="always")
def _clip(v, fmax):
    """np.clip(v, -fmax, fmax): nan stays nan, -0.0 stays -0.0."""
    v = fmax if v > fmax else v
    return -fmax if v < -fmax else v


# The casts are LLVM IR on 32-bit integers (numba would widen uint32 arithmetic to 64 bits, which
# halves the vector width of the loops that call them), the same IR as the row kernels' vectors.

@intrinsic
def _bf16(typingctx, v):
    """float32 -> bfloat16 bits (:func:`~alignpred.kernels.fused_rows.bf16_ir`)."""
    def codegen(context, builder, sig, args):
        return bf16_ir(builder, args[0])
    return types.uint16(types.float32), codegen


@intrinsic
def _f16(typingctx, v):
    """float32 -> float16 bits as numpy (:func:`~alignpred.kernels.fused_rows.f16_ir`)."""
    def codegen(context, builder, sig, args):
        return f16_ir(builder, args[0])
    return types.uint16(types.float32), codegen


@njit(cache=True, nogil=True)
def _post(base, q, delta, chan, has_chan, interp, S, mean, cos, sin, r, interleaved, fmax, kind, rec, nat32, nat16,
          qt, xrow, vrow, srow, vec):
    """One block.  base [n, d] f32; q [d, n] i32 (C order); delta [n] f32; chan [d] f32 (step
    multipliers; read when has_chan); interp [d] u8; mean [d] f32; cos/sin [n, r/2] f32 (r = 0: no
    rope); rec [n, d] f32 (may be base); nat32 [n, d] f32 (kind 0) or nat16 [n, d] u16 (kinds 1, 2);
    scratch qt [TILE+1, d] i32, xrow, vrow [d] f32, srow [3, d] f32 (steps of rows t-1, t, t+1).
    ``vec``: plain rows take the vector row kernels (:mod:`~alignpred.kernels.fused_rows`; the
    caller checked their preconditions)."""
    n, d = base.shape
    h = r // 2
    any_interp = False
    for c in range(d):
        if interp[c] != 0:
            any_interp = True
    half = np.float32(0.5)
    for t0 in range(0, n, _TILE):
        t1 = min(n, t0 + _TILE)
        te = min(n, t1 + 1)  # one more row: the right neighbour of the tile's last odd row
        _load_tile(q, t0, t1, te if any_interp else t1, qt)
        for t in range(t0, t1):
            lt = t - t0
            dt = delta[t]
            if vec and not has_chan:
                if not (any_interp and (t & 1) == 1):
                    if kind == OUT_F32:
                        plain_row_f32(base, t, qt, lt, dt, mean, cos, sin, h, rec, nat32, fmax)
                    elif kind == OUT_BF16:
                        plain_row_bf16(base, t, qt, lt, dt, mean, cos, sin, h, rec, nat16, fmax)
                    else:
                        plain_row_f16(base, t, qt, lt, dt, mean, cos, sin, h, rec, nat16, fmax)
                    continue
                both = t + 1 < n and (t + 1) % S != 0
                dl = delta[t - 1]
                drt = delta[t + 1] if both else np.float32(0.0)
                if kind == OUT_F32:
                    interp_row_f32(base, t, qt, lt, dt, dl, drt, both, interp, mean, cos, sin, h, rec, nat32, fmax)
                elif kind == OUT_BF16:
                    interp_row_bf16(base, t, qt, lt, dt, dl, drt, both, interp, mean, cos, sin, h, rec, nat16, fmax)
                else:
                    interp_row_f16(base, t, qt, lt, dt, dl, drt, both, interp, mean, cos, sin, h, rec, nat16, fmax)
                continue
            if has_chan:  # the steps of this row (and its neighbours) per channel
                for c in range(d):
                    srow[1, c] = dt * chan[c]
            if any_interp and (t & 1) == 1:
                dl = delta[t - 1]
                if t + 1 < n and (t + 1) % S != 0:
                    drt = delta[t + 1]
                    if has_chan:
                        for c in range(d):
                            srow[0, c] = dl * chan[c]
                            srow[2, c] = drt * chan[c]
                        for c in range(d):
                            w = np.float32(qt[lt, c]) * srow[1, c]
                            left = np.float32(qt[lt - 1, c]) * srow[0, c]
                            right = np.float32(qt[lt + 1, c]) * srow[2, c]
                            wi = half * (left + right) + w
                            w = wi if interp[c] != 0 else w
                            v = base[t, c] + w
                            vrow[c] = v
                            xrow[c] = v + mean[c]
                    else:
                        for c in range(d):
                            w = np.float32(qt[lt, c]) * dt
                            left = np.float32(qt[lt - 1, c]) * dl
                            right = np.float32(qt[lt + 1, c]) * drt
                            wi = half * (left + right) + w
                            w = wi if interp[c] != 0 else w
                            v = base[t, c] + w
                            vrow[c] = v
                            xrow[c] = v + mean[c]
                elif has_chan:
                    for c in range(d):
                        srow[0, c] = dl * chan[c]
                    for c in range(d):
                        w = np.float32(qt[lt, c]) * srow[1, c]
                        wi = np.float32(qt[lt - 1, c]) * srow[0, c] + w
                        w = wi if interp[c] != 0 else w
                        v = base[t, c] + w
                        vrow[c] = v
                        xrow[c] = v + mean[c]
                else:
                    for c in range(d):
                        w = np.float32(qt[lt, c]) * dt
                        wi = np.float32(qt[lt - 1, c]) * dl + w
                        w = wi if interp[c] != 0 else w
                        v = base[t, c] + w
                        vrow[c] = v
                        xrow[c] = v + mean[c]
            elif has_chan:
                for c in range(d):
                    v = base[t, c] + np.float32(qt[lt, c]) * srow[1, c]
                    vrow[c] = v
                    xrow[c] = v + mean[c]
            else:
                for c in range(d):
                    v = base[t, c] + np.float32(qt[lt, c]) * dt
                    vrow[c] = v
                    xrow[c] = v + mean[c]
            # (through a scratch row: with rec = base the loops above would not vectorise)
            for c in range(d):
                rec[t, c] = vrow[c]
            if r > 0:
                if interleaved:
                    for i in range(h):
                        x1 = xrow[2 * i]
                        x2 = xrow[2 * i + 1]
                        xrow[2 * i] = x1 * cos[t, i] - x2 * sin[t, i]
                        xrow[2 * i + 1] = x2 * cos[t, i] + x1 * sin[t, i]
                else:
                    for i in range(h):
                        x1 = xrow[i]
                        x2 = xrow[h + i]
                        xrow[i] = x1 * cos[t, i] - x2 * sin[t, i]
                        xrow[h + i] = x2 * cos[t, i] + x1 * sin[t, i]
            # native[t] = cast(clip(xrow)), written here: a helper taking the arrays would cost
            # numba's reference counting on every row
            if kind == OUT_F32:
                for c in range(d):
                    nat32[t, c] = _clip(xrow[c], fmax)
            elif kind == OUT_BF16:
                for c in range(d):
                    nat16[t, c] = _bf16(_clip(xrow[c], fmax))
            else:
                for c in range(d):
                    nat16[t, c] = _f16(_clip(xrow[c], fmax))


_KINDS = {"float32": OUT_F32, "bfloat16": OUT_BF16, "float16": OUT_F16}
_NO_F32 = np.zeros((0, 0), np.float32)   # the native view a kind does not write (never written)
_NO_U16 = np.zeros((0, 0), np.uint16)
_scratch = threading.local()


def _post_scratch(d: int) -> tuple:
    """This thread's scratch rows for :func:`_post` (``qt [TILE+1, d]`` i32, ``xrow``, ``vrow``
    ``[d]`` f32, ``srow [3, d]`` f32, ``ones [d]`` f32), kept per width: fresh arrays per block
    cost an allocation each, and the decoder calls this once per block."""
    hit = getattr(_scratch, "bufs", None)
    if hit is None or hit[0] != d:
        ones = np.ones(d, np.float32)
        ones.setflags(write=False)
        hit = _scratch.bufs = (d, np.empty((_TILE + 1, d), np.int32), np.empty(d, np.float32),
                               np.empty(d, np.float32), np.empty((3, d), np.float32), ones)
    return hit[1:]


def _f32_vector(a, n: int, msg: str) -> np.ndarray:
    """``a`` as a contiguous float32 ``[n]`` (no copy when it is one), else ValueError(msg)."""
    if type(a) is not np.ndarray or a.dtype != np.float32 or not a.flags.c_contiguous:
        a = np.ascontiguousarray(a, np.float32)
    if a.shape != (n,):
        raise ValueError(msg)
    return a


def _unit_columns(a) -> bool:
    return not (a.shape[0] and a.shape[1]) or a.strides[1] == a.itemsize


def fused_post(base, q, delta, interp, object_size, mean, rope, fmax, out_dtype, rec=None, native=None, chan=None):
    """:func:`reference_post` in one numba pass, bit for bit (``chan``: per-channel step
    multipliers, as there; None = ones, the loops without them).

    ``rec``: float32 ``[n, d]`` to write the reconstruction into (may be ``base`` itself:
    in place); ``native``: ``[n, d]`` array of ``out_dtype`` (or its uint16 bit view for
    bfloat16/float16), e.g. ``out[h, a:b]`` of a ``[heads, T, d]`` array: any strides.
    Both are allocated when None.  Returns ``(rec, native)``.  Releases the GIL.
    """
    dt = np.dtype(out_dtype)
    kind = _KINDS.get(dt.name)
    if kind is None:
        raise TypeError(f"unsupported output dtype {dt}")
    base = np.asarray(base)
    if base.dtype != np.float32 or base.ndim != 2:
        raise TypeError("base must be float32 [n, d]")
    n, d = base.shape
    if type(q) is not np.ndarray or not q.flags.c_contiguous:
        q = np.ascontiguousarray(q)
    if q.shape != (d, n) or q.dtype != np.int32:
        raise TypeError("q must be int32 [d, n]")
    shapes = "delta [n], mean [d] and interp [d] expected"
    delta = _f32_vector(delta, n, shapes)
    mean = _f32_vector(mean, d, shapes)
    interp_u8 = np.ascontiguousarray(interp, bool).view(np.uint8)
    if interp_u8.shape != (d,):
        raise ValueError(shapes)
    if object_size <= 0 or object_size % 2:
        raise ValueError("object_size must be even and positive")
    if rope is None:
        cos = sin = _NO_F32
        r, interleaved = 0, False
    else:
        cos, sin, r, pairing = rope
        if pairing not in ("half", "interleaved"):
            raise ValueError(f"unknown RoPE pairing {pairing!r}")
        interleaved = pairing == "interleaved"
        r = int(r)
        if r % 2 or not 0 <= r <= d:
            raise ValueError("rotary dims must be even and <= d")
        cos = np.asarray(cos, np.float32)
        sin = np.asarray(sin, np.float32)
        if cos.shape != (n, r // 2) or sin.shape != (n, r // 2):
            raise ValueError("cos/sin must be float32 [n, r/2]")
    if rec is None:
        rec = np.empty((n, d), np.float32)
    elif rec.shape != (n, d) or rec.dtype != np.float32:
        raise ValueError("rec must be float32 [n, d]")
    if native is None:
        native = np.empty((n, d), dt)
    elif native.shape != (n, d) or native.dtype not in (dt, np.dtype(np.uint16) if kind else dt):
        raise ValueError(f"native must be [n, d] of {dt}")
    nat32 = native if kind == OUT_F32 else _NO_F32
    nat16 = native.view(np.uint16) if kind != OUT_F32 else _NO_U16
    qt, xrow, vrow, srow, ones = _post_scratch(d)
    has_chan = chan is not None
    chan = _f32_vector(chan, d, "chan [d] expected") if has_chan else ones
    # the vector row kernels' preconditions (fused_rows): whole vectors, half pairing, unit column strides
    vec = (d % 16 == 0 and (r // 2) % 16 == 0 and not (r and interleaved) and _unit_columns(base)
           and _unit_columns(rec) and _unit_columns(native) and _unit_columns(cos) and _unit_columns(sin))
    _post(base, q, delta, chan, has_chan, interp_u8, int(object_size), mean, cos, sin, r, interleaved,
          np.float32(fmax), kind, rec, nat32, nat16, qt, xrow, vrow, srow, vec)
    return rec, native
