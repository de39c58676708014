"""The GPU decoder: a :class:`~alignpred.KvzReader`'s coarse tier decoded on the device into
a plain ``[layers, 2, tokens, heads, dim]`` tensor or straight into an engine's paged KV layout.

Per range: the entropy stage decodes every payload of the range in one launch
(:mod:`alignpred.gpu.entropy`); then, block by block in the layout's order (a block is predicted
from earlier layers' reconstructions, which stay on the device), the base prediction (exact map
products, blend, zero; selected per channel by the header's modes) and one fused post kernel that
reconstructs the coding-frame rows and writes the native rows to their destination. The host does
only what depends on the header and the bank, not on the payloads: the block plans and integer
map weights (prepared once per bank, as the CPU decoder does), the per-row steps, the RoPE tables
(kvz.md §8.3.2, the CPU's tables uploaded once per range) and the zero rows' image.

Bit-identity: the kernels compute what the CPU decoder's exact path (``arith: "exact"``, format
1.1 and later) computes, in the same order (see :mod:`alignpred.gpu.kernels`). Files of format 1.0
(``arith: "float"``: BLAS products, whose rounding is not specified) and the refinement tier are
not decoded here (``KvzError``).
"""
from __future__ import annotations

import weakref

import numpy as np
import torch

from alignpred.cache.layout import Block
from alignpred.codec.predictors import BASE_MASK, BLEND, INTERP, MAP, ZERO
from alignpred.errors import KvzError
from alignpred.gpu import entropy as _entropy
from alignpred.gpu import kernels as K

_TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_OUT_KIND = {"bfloat16": K.OUT_BF16, "float16": K.OUT_F16, "float32": K.OUT_F32}


def _p2(v: int, lo: int = 16) -> int:
    p = lo
    while p < v:
        p *= 2
    return p


class _DevMap:
    """An :class:`~alignpred.kernels.intmap.IntMap`'s integer weights on the device: ``wq`` float64
    ``[S, KP, NP]`` (exact small integers), ``w_exp`` int32 ``[S, NP]``, ``p2`` float64 ``[S, KP]``
    (``2**-shift``)."""

    def __init__(self, m, dev: str):
        wp = m.wp                                             # [S, ceil(d_in/2), d_out_pad, 2]
        S, kp, mp, _ = wp.shape
        wq = wp.transpose(0, 1, 3, 2).reshape(S, 2 * kp, mp)[:, :m.d_in, :m.d_out]   # [S, d_in, d_out]
        self.S, self.d_in, self.d_out = S, m.d_in, m.d_out
        self.KP, self.NP = _p2(m.d_in), _p2(m.d_out)
        w = np.zeros((S, self.KP, self.NP), np.float64)
        w[:, :m.d_in, :m.d_out] = wq
        we = np.zeros((S, self.NP), np.int32)
        we[:, :m.d_out] = m.w_exp
        p2 = np.ones((S, self.KP), np.float64)
        p2[:, :m.d_in] = np.ldexp(1.0, -np.asarray(m.shift, np.int32))
        self.wq = torch.from_numpy(w).to(dev)
        self.w_exp = torch.from_numpy(we).to(dev)
        self.p2 = torch.from_numpy(p2).to(dev)

    def predict(self, srcs: list, n: int, dev: str):
        """float32 ``[n, NP]`` from the sources (float32 ``[n, >= d_in]``, contiguous rows)."""
        xq = torch.empty((self.S, n, self.KP), dtype=torch.float64, device=dev)
        xe = torch.empty((self.S, n), dtype=torch.int32, device=dev)
        br = 16 if K.DEVICE_TILES else min(_p2(n, 16), 4096)
        for s, x in enumerate(srcs):
            K.quant_rows_kernel[(-(-n // br),)](x, x.stride(0), self.p2[s], xq[s], xe[s], n, self.d_in,
                                                KP=self.KP, BR=br, **K.FLOAT_OPTS)
        y = torch.empty((n, self.NP), dtype=torch.float32, device=dev)
        if K.DEVICE_TILES:
            bm, bn, bk = 64, min(64, self.NP), min(32, self.KP)
        else:
            bm, bn, bk = min(_p2(n, 16), 1024), self.NP, self.KP
        K.map_kernel[(-(-n // bm), self.NP // bn)](xq, xe, self.wq, self.w_exp, y, y.stride(0), n, self.d_out,
                                                   self.S, KP=self.KP, NP=self.NP, BR=bm, BN=bn, BK=bk,
                                                   **K.FLOAT_OPTS)
        return y


# per CPU decoder (one per layout, bank and config in a session) and device: the maps' device
# weights and the blocks' constants, uploaded once, not at every decode
_UPLOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class GpuDecoder:
    """Decode ``reader``'s coarse tier on the device (``device``: ``"cuda"``, or ``"cpu"`` when
    :data:`alignpred.gpu.kernels.SIMULATED`)."""

    def __init__(self, reader, device: str | None = None):
        if reader.config.arith != "exact":
            raise KvzError(f"{reader.path}: the GPU decoder needs exact arithmetic (format 1.1 or later, "
                           "arith 'exact'); this file has float arithmetic (format 1.0): decode it on the CPU")
        self.reader = reader
        self.dec = reader.decoder            # plans, frame, steps (also checks the header's modes)
        self.dev = K.DEVICE if device is None else device
        per = _UPLOADED.setdefault(self.dec, {}).setdefault(self.dev, ({}, {}))
        self._maps, self._const = per

    def _devmap(self, m) -> _DevMap:
        dm = self._maps.get(id(m))
        if dm is None:
            dm = self._maps[id(m)] = _DevMap(m, self.dev)
        return dm

    def _up(self, a, dtype=None):
        t = torch.from_numpy(np.array(a, copy=True, order="C"))
        return t.to(self.dev) if dtype is None else t.to(device=self.dev, dtype=dtype)

    def _block_const(self, blk, plan):
        """Per-block device constants: mean, zero image."""
        hit = self._const.get(blk.name)
        if hit is None:
            hit = self._const[blk.name] = (self._up(np.asarray(plan.mean, np.float32)),
                                           self._up(np.asarray(self.dec.frame.zero_image(blk), np.float32)))
        return hit

    def _base(self, plan, kind: int, recon: dict, n: int, DP: int):
        if kind == MAP:
            srcs, first, second = plan.data["map"]
            y = self._devmap(first).predict([recon[s] for s in srcs], n, self.dev)
            if second is not None:
                y = self._devmap(second).predict([y], n, self.dev)
            return y
        if kind == BLEND:   # (lam / len(refs)) * (0 + rec_1 + rec_2 + ...), float32 operations in order
            refs, lam = plan.data["blend"]
            s = 0.0 + recon[refs[0]]
            for b in refs[1:]:
                s = s + recon[b]
            return s * torch.tensor(np.float32(lam / len(refs)), device=self.dev)
        raise KvzError(f"unknown predictor id {kind}")

    def _predict(self, plan, modes, recon: dict, n: int, DP: int):
        """The base prediction float32 ``[n, DP]`` (channels past ``d`` zero): each channel's own
        predictor, +0.0 for ``ZERO`` (``BlockPlan.predict``'s values)."""
        d = len(modes)
        ids = np.asarray(modes) & BASE_MASK
        kinds = [int(k) for k in np.unique(ids)]
        P = torch.zeros((n, DP), dtype=torch.float32, device=self.dev)
        sel = torch.zeros(DP, dtype=torch.int64, device=self.dev)
        sel[:d] = self._up(ids.astype(np.int64))
        for k in kinds:
            if k == ZERO:
                continue
            b = self._base(plan, k, recon, n, DP)
            P = torch.where(sel[None, :] == k, b[:, :DP] if b.shape[1] >= DP else
                            torch.nn.functional.pad(b, (0, DP - b.shape[1])), P)
        return P

    def decode_into(self, j0: int, j1: int, layers, sink) -> None:
        """Decode objects ``j0..j1-1`` of every tensor up to the last layer in ``layers``;
        ``sink(ti, layer, kind, h)`` returns ``(out, dst)`` for the tensors to emit: ``out`` a flat
        device tensor (float32, or int16 holding 16-bit patterns) and ``dst`` int64 ``[rows]``
        the offset of each row's channel 0 in it (-1: not written), or None."""
        r, dec = self.reader, self.dec
        lay = r.layout
        S = r.config.object_size
        H, d = lay.kv_heads, lay.head_dim
        DP = _p2(d, 16)
        last = max(layers)
        start = j0 * S
        n = min(lay.n_tokens, j1 * S) - start
        tensors = [(ti, lk) for ti, lk in enumerate(lay.tensors()) if lk[0] <= last]
        q, deltas, zero = _entropy.symbols(r, len(tensors), j0, j1, n, self.dev)
        fr = dec.frame
        out_kind = _OUT_KIND[lay.dtype]
        fmax = float(np.float32(fr.fmax))
        recon: dict = {}
        br = 32 if K.DEVICE_TILES else min(_p2(n, 16), 2048)
        dummy = torch.zeros(1, dtype=torch.float32, device=self.dev)
        rope_cache: dict = {}
        for ti, (layer, kind) in tensors:
            meta = r.metas[ti]
            delta_rows, zr = dec.delta_rows(deltas[ti], zero[ti], start, n, layer, meta.row_steps())
            dr = self._up(np.asarray(delta_rows, np.float32))
            zr_d = self._up(np.asarray(zr, np.int8))
            for h in range(H):
                blk = Block(layer, kind, h)
                plan = dec.plans[blk.name]
                m = meta.modes[h]
                P = self._predict(plan, m, recon, n, DP)
                mean, zimg = self._block_const(blk, plan)
                chan = meta.channel_steps(h, d)
                chan_d = dummy if chan is None else self._up(np.asarray(chan, np.float32))
                interp = self._up(((np.asarray(m) & INTERP) != 0).astype(np.int8))
                target = sink(ti, layer, kind, h) if layer in layers else None
                rope = fr.rope_args(blk, start, n) if target is not None else None
                if rope is not None:
                    key = (id(rope[0]), start, n)
                    if key not in rope_cache:
                        rope_cache[key] = (self._up(np.asarray(rope[0], np.float32)),
                                           self._up(np.asarray(rope[1], np.float32)))
                    cos_d, sin_d = rope_cache[key]
                    rot, half_pair = int(rope[2]), rope[3] == "half"
                else:
                    cos_d = sin_d = dummy
                    rot, half_pair = 0, True
                out, dst = target if target is not None else (dummy, torch.zeros(1, dtype=torch.int64,
                                                                                 device=self.dev))
                K.post_kernel[(-(-n // br),)](
                    P, q[ti, h * d:], n, dr, chan_d, interp, mean, zr_d, zimg, cos_d, sin_d, rot, P, out, dst,
                    n, d, S, fmax, HAS_CHAN=chan is not None, ROPE=rope is not None, PAIR_HALF=half_pair,
                    OUT=out_kind, EMIT=target is not None, D=DP, BR=br, **K.FLOAT_OPTS)
                if plan.block in dec._last_use:
                    recon[blk.name] = P
                dec.prune(recon, blk.name)


def _range(reader, tokens, layers):
    a, b, sel = reader.selection(tokens, layers)
    S = reader.config.object_size
    return a, b, sel, a // S, -(-b // S)


def _check_tier(reader, tier) -> None:
    if tier not in (None, "coarse"):
        raise KvzError(f"{reader.path}: the GPU decoder decodes the coarse tier only (tier={tier!r})")


def decode(reader, tokens=None, layers=None, tier=None, device: str | None = None):
    """The coarse tier of ``reader`` (tokens ``[a, b)``, layers as :meth:`KvzReader.read` takes
    them) as one device tensor ``[len(layers), 2, b - a, kv_heads, head_dim]`` in the file's
    dtype (index 1: 0 key, 1 value)."""
    _check_tier(reader, tier)
    g = GpuDecoder(reader, device)
    lay = reader.layout
    a, b, sel, j0, j1 = _range(reader, tokens, layers)
    H, d = lay.kv_heads, lay.head_dim
    T = b - a
    out = torch.empty((len(sel), 2, T, H, d), dtype=_TORCH_DTYPE[lay.dtype], device=g.dev)
    flat = out.view(-1) if lay.dtype == "float32" else out.view(torch.int16).view(-1)
    slot = {layer: i for i, layer in enumerate(sel)}
    rows = np.arange(j0 * reader.config.object_size, min(lay.n_tokens, j1 * reader.config.object_size)) - a
    inside = (rows >= 0) & (rows < T)

    def sink(ti, layer, kind, h):
        base = ((slot[layer] * 2 + (kind == "V")) * T) * H * d + h * d
        dst = np.where(inside, base + rows * H * d, -1).astype(np.int64)
        return flat, g._up(dst)

    g.decode_into(j0, j1, set(sel), sink)
    return out


def decode_paged(reader, kv_caches, block_table, layout: str = "flash", tokens=None, layers=None, tier=None,
                 device: str | None = None):
    """Decode straight into an engine's paged KV cache: ``kv_caches[i]`` is layer ``i``'s tensor,
    ``[2, num_blocks, block_size, kv_heads, head_dim]`` (``layout="flash"``: vLLM's FlashAttention
    backend) or ``[num_blocks, 2, kv_heads, block_size, head_dim]`` (``"hnd"``: FlashInfer's HND);
    ``block_table`` (ints) maps block ``k`` of the sequence (positions ``k*block_size ..``,
    counted from 0: the file's token ``t`` is position ``position_offset + t``) to its block id.
    Returns ``kv_caches``."""
    _check_tier(reader, tier)
    if layout not in ("flash", "hnd"):
        raise KvzError(f"unknown paged layout {layout!r}; use 'flash' or 'hnd'")
    g = GpuDecoder(reader, device)
    lay = reader.layout
    a, b, sel, j0, j1 = _range(reader, tokens, layers)
    H, d = lay.kv_heads, lay.head_dim
    S = reader.config.object_size
    rows = np.arange(j0 * S, min(lay.n_tokens, j1 * S))
    inside = (rows >= a) & (rows < b)
    pos = lay.position_offset + rows
    bt = np.asarray(block_table, np.int64)
    flats = {}
    for layer in sel:
        kc = kv_caches[layer]
        shape = tuple(kc.shape)
        bs = shape[2] if layout == "flash" else shape[3]
        want = (2, shape[1], bs, H, d) if layout == "flash" else (shape[0], 2, H, bs, d)
        if shape != want or kc.dtype != _TORCH_DTYPE[lay.dtype] or not kc.is_contiguous():
            raise KvzError(f"kv cache of layer {layer}: {shape} {kc.dtype}, expected a contiguous "
                           f"{want} {lay.dtype} ({layout} layout)")
        nb = shape[1] if layout == "flash" else shape[0]
        need = int(pos[inside].max()) // bs if inside.any() else -1
        if need >= len(bt):
            raise KvzError(f"block table has {len(bt)} blocks; position {int(pos[inside].max())} needs {need + 1}")
        if len(bt) and (bt[:need + 1].min(initial=0) < 0 or bt[:need + 1].max(initial=0) >= nb):
            raise KvzError(f"block table names blocks outside 0..{nb - 1}")
        flats[layer] = (kc.view(-1) if lay.dtype == "float32" else kc.view(torch.int16).view(-1), bs, nb)

    def sink(ti, layer, kind, h):
        flat, bs, nb = flats[layer]
        kv = int(kind == "V")
        blk = bt[np.minimum(pos // bs, len(bt) - 1)] if len(bt) else np.zeros_like(pos)
        off = pos % bs
        if layout == "flash":
            o = (((kv * nb + blk) * bs + off) * H + h) * d
        else:
            o = (((blk * 2 + kv) * H + h) * bs + off) * d
        return flat, g._up(np.where(inside, o, -1).astype(np.int64))

    g.decode_into(j0, j1, set(sel), sink)
    return kv_caches
