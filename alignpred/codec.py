"""The AlignPred codec: tensors <-> objects of quantised, entropy-coded prediction residuals.

Order: tensors layer by layer, key before value; inside a tensor, head by head. Each tensor is
cut into objects of ``object_size`` positions. Per block (one head of one tensor) and channel a
prediction mode is chosen (:mod:`alignpred.predict`); residuals are quantised on a lattice whose
step ``delta`` is searched so that the *measured* error, after the inverse transform and the
cast to the source dtype, meets ``eps`` in every unit of the scope (``object``, ``tensor`` or
``pooled``). Encoder and decoder form predictions from the same reconstructed references.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import entropy
from .bank import block_name
from .kernels import dequant_add
from .errors import EncodeError, FormatError, NonFiniteError
from .layout import numpy_dtype
from .predict import (INTERP, ZERO, CodecConfig, build_plans, channel_entropy_bits, dequantize_residual,
                      quantize_residual)
from .rope import apply_rope

SCOPES = ("object", "tensor", "pooled")
OBJ_ZERO = 1  # object flag: every value is zero, no payload
CHOICE_OBJECTS = 8  # the encoder chooses predictor modes on at most this many objects per tensor


@dataclass
class EncodedObject:
    tensor: int
    token_start: int
    n_tokens: int
    flags: int
    delta: float
    sq_err: float
    sq_norm: float
    payload: bytes


@dataclass
class TensorMeta:
    """Per-tensor coding parameters (stored in the file header)."""

    name: str
    modes: np.ndarray  # uint8 [kv_heads, head_dim]
    models: np.ndarray  # uint8 [kv_heads * head_dim]
    sq_err: float = 0.0
    sq_norm: float = 0.0
    objects: list = field(default_factory=list, repr=False)


class _Chain:
    """Shared state of encoder and decoder: plans, and reconstructed blocks still referenced."""

    def __init__(self, layout, bank, config: CodecConfig, coder: str = "rans4"):
        if coder not in entropy.CODERS:
            raise EncodeError(f"unknown entropy coder {coder!r}; use one of {', '.join(entropy.CODERS)}")
        self.coder = coder
        self.layout = layout
        self.config = config
        self.plans = build_plans(layout, bank, config)
        self.out_dtype = numpy_dtype(layout.dtype)
        import ml_dtypes

        self._fmax = float(ml_dtypes.finfo(self.out_dtype).max)
        last_use: dict[str, int] = {}
        order = self.block_order()
        for k, b in enumerate(order):
            p = self.plans[b]
            for s in (p.map_sources if p.map_u is not None else []) + (p.blend_refs or []):
                last_use[s] = k
        self._last_use = last_use
        self._order_idx = {b: k for k, b in enumerate(order)}

    def block_order(self) -> list[str]:
        lay = self.layout
        return [block_name(kind, i, h) for i in range(lay.num_layers) for kind in ("K", "V")
                for h in range(lay.kv_heads)]

    def prune(self, recon: dict, done_block: str) -> None:
        k = self._order_idx[done_block]
        for b in [b for b in recon if self._last_use.get(b, -1) <= k]:
            del recon[b]

    def to_frame(self, x: np.ndarray, layer: int, kind: str, head: int, start: int) -> np.ndarray:
        """Native block rows ``[n, d]`` -> coding frame (float32)."""
        lay = self.layout
        p = self.plans[block_name(kind, layer, head)]
        x = np.asarray(x, np.float32)
        if kind == "K" and lay.keys_roped and self.config.rope_undo:
            x = apply_rope(x, np.arange(x.shape[0]) + start + lay.position_offset, lay.rope_theta[layer],
                           inverse=True, pairing=lay.rope_pairing)
        z = x - p.mean
        return z @ p.rot if p.rot is not None else z

    def to_native(self, z: np.ndarray, layer: int, kind: str, head: int, start: int) -> np.ndarray:
        """Coding frame rows -> native rows, cast to the source dtype (clipped to its range)."""
        lay = self.layout
        p = self.plans[block_name(kind, layer, head)]
        if p.rot is not None:  # per object, so the product has the same shape on every path
            S = self.config.object_size
            x = np.concatenate([z[a:a + S] @ p.rot.T for a in range(0, z.shape[0], S)]) if len(z) else z
        else:
            x = z
        x = x + p.mean
        if kind == "K" and lay.keys_roped and self.config.rope_undo:
            x = apply_rope(x, np.arange(x.shape[0]) + start + lay.position_offset, lay.rope_theta[layer],
                           pairing=lay.rope_pairing)
        return np.clip(x, -self._fmax, self._fmax).astype(self.out_dtype)


def _tensor_name(layer: int, kind: str) -> str:
    return f"layers.{layer}.{'key' if kind == 'K' else 'value'}"


def _obj_sums(v: np.ndarray, size: int) -> np.ndarray:
    """Sum of ``v [n]`` over consecutive chunks of ``size``."""
    n = v.shape[0]
    k = -(-n // size)
    pad = np.zeros(k * size, v.dtype)
    pad[:n] = v
    return pad.reshape(k, size).sum(axis=1)


class Encoder(_Chain):
    """Encode a cache tensor by tensor. ``scope`` is ``object``, ``tensor`` or ``pooled``."""

    def __init__(self, layout, bank, config: CodecConfig, eps: float, scope: str = "tensor", coder: str = "rans4"):
        super().__init__(layout, bank, config, coder)
        if not (0.0 < eps < 1.0):
            raise EncodeError(f"eps must be in (0, 1), got {eps}")
        if scope not in SCOPES:
            raise EncodeError(f"unknown eps scope {scope!r}; use one of {', '.join(SCOPES)}")
        self.eps = float(eps)
        self.scope = scope

    # -- one tensor at given steps ---------------------------------------------------------------
    def _prepare(self, layer: int, kind: str, arr: np.ndarray):
        name = _tensor_name(layer, kind)
        a = arr[0] if self.layout.batch_dim else arr
        x = np.asarray(a, np.float32)
        if not np.isfinite(x).all():
            bad = np.argwhere(~np.isfinite(x))
            h, t, c = (int(v) for v in bad[0])
            raise NonFiniteError(f"{name}: {len(bad)} NaN/Inf values (first at head {h}, token {t}, channel {c}); "
                                 "kvz refuses non-finite input: fix the cache or replace them before compressing")
        zs = [self.to_frame(x[h], layer, kind, h, 0) for h in range(x.shape[0])]
        sq_row = [np.einsum("ij,ij->i", xh.astype(np.float64), xh.astype(np.float64)) for xh in x]
        return x, zs, sq_row

    def _code(self, layer, kind, x, zs, recon, delta_obj, zero_obj, modes=None):
        """Quantise every head at per-object steps; returns (q [T, H*d], recon per head, modes,
        per-object squared error)."""
        S = self.config.object_size
        T = x.shape[1]
        delta_rows = np.repeat(np.asarray(delta_obj, np.float32), S)[:T]
        self.config.scale_sink(delta_rows, 0)
        zero_rows = np.repeat(zero_obj, S)[:T]
        delta_rows[zero_rows] = 1.0
        local = dict(recon)
        qs, recs, chosen = [], [], []
        err = np.zeros(len(delta_obj))
        for h, z in enumerate(zs):
            b = block_name(kind, layer, h)
            plan = self.plans[b]
            if modes is None:
                m = self._choose(plan, z, local, delta_rows)
            else:
                m = modes[h]
            base = plan.predict(m, local, z.shape[0])
            q, wh = quantize_residual(z - base, delta_rows, (m & INTERP) != 0, S)
            rec = base + wh
            if zero_rows.any():
                q[zero_rows] = 0
                rec[zero_rows] = z[zero_rows]
            local[b] = rec
            e = self._row_errors(rec, x[h], layer, kind, h)
            e[zero_rows] = 0.0
            err += _obj_sums(e, S)
            qs.append(q)
            recs.append(rec)
            chosen.append(m)
        return np.concatenate(qs, axis=1), recs, np.stack(chosen), err

    def _row_errors(self, rec, xh, layer, kind, h) -> np.ndarray:
        """Squared error per row after the inverse transform and the cast, object by object
        (float64 temporaries stay one object in size; to_native is elementwise per row)."""
        S = self.config.object_size
        e = np.empty(rec.shape[0])
        for a in range(0, rec.shape[0], S):
            d = self.to_native(rec[a:a + S], layer, kind, h, a).astype(np.float64) - xh[a:a + S]
            e[a:a + S] = np.einsum("ij,ij->i", d, d)
        return e

    def _choose(self, plan, z, local, delta_rows) -> np.ndarray:
        """Per-channel predictor mode with the smallest estimated cost, measured on at most
        :data:`CHOICE_OBJECTS` objects spread over the tensor (all of them in short caches)."""
        cfg = self.config
        S = cfg.object_size
        n_obj = -(-z.shape[0] // S)
        rows = None
        if n_obj > CHOICE_OBJECTS:
            objs = np.unique(np.linspace(0, n_obj - 1, CHOICE_OBJECTS).round().astype(int))
            rows = np.concatenate([np.arange(j * S, min((j + 1) * S, z.shape[0])) for j in objs])
            z, delta_rows = z[rows], delta_rows[rows]
        cands = cfg.candidate_modes(plan.map_u is not None, bool(plan.blend_refs))
        bases = {}
        bits = []
        for m in cands:
            bb = m & 3
            if bb not in bases:
                bases[bb] = plan.base(bb, local, rows) if bb != ZERO else np.zeros_like(z)
            interp = np.full(z.shape[1], bool(m & INTERP))
            q, _ = quantize_residual(z - bases[bb], delta_rows, interp, cfg.object_size)
            bits.append(channel_entropy_bits(q))
        bits = np.stack(bits)  # [n_modes, d]
        cands = np.array(cands, np.uint8)
        if cfg.channel_choice:
            return cands[np.argmin(bits, axis=0)]
        return np.full(z.shape[1], cands[int(np.argmin(bits.sum(axis=1)))], np.uint8)

    # -- step search ----------------------------------------------------------------------------
    def _search(self, layer, kind, x, zs, sq_row, recon, zero_obj):
        """Largest steps meeting the budget for object/tensor scope; returns the _code result."""
        S = self.config.object_size
        norm_obj = sum(_obj_sums(s, S) for s in sq_row)
        n_obj = len(norm_obj)
        rows_obj = np.minimum(S, x.shape[1] - S * np.arange(n_obj)) * x.shape[0] * x.shape[2]
        if self.scope == "object":
            target = self.eps ** 2 * norm_obj
            d0 = self.eps * np.sqrt(12.0 * norm_obj / rows_obj)
        else:
            target = np.array([self.eps ** 2 * norm_obj.sum()])
            d0 = np.full(1, self.eps * np.sqrt(12.0 * norm_obj.sum() / rows_obj.sum()))
        d0 = np.maximum(d0, 1e-30)
        expand = (lambda d: d) if self.scope == "object" else (lambda d: np.full(n_obj, d[0]))
        lo = np.zeros_like(d0)
        hi = np.full_like(d0, np.inf)
        best = None
        delta = d0.copy()
        modes = None
        for it in range(14):
            res = self._code(layer, kind, x, zs, recon, expand(delta.astype(np.float32)), zero_obj, modes)
            modes = res[2]
            e = res[3] if self.scope == "object" else np.array([res[3].sum()])
            ok = e <= target
            lo = np.where(ok, np.maximum(lo, delta), lo)
            hi = np.where(ok, hi, np.minimum(hi, delta))
            if ok.all():
                best = (delta.copy(), res)
                if np.all(e >= target * 0.994):
                    break
            ratio = np.sqrt(np.where(e > 0, target / np.maximum(e, 1e-300), 4.0))
            nxt = delta * np.clip(ratio, 0.5, 2.0) * np.where(ok, 1.0, 0.999)
            bracket = np.isfinite(hi) & (lo > 0)
            outside = (nxt <= lo) | (nxt >= hi)
            nxt = np.where(bracket & outside, np.sqrt(np.maximum(lo, 1e-300) * np.where(np.isfinite(hi), hi, 1.0)), nxt)
            # Objects already inside [0.994 target, target] keep their step.
            done = ok & (e >= target * 0.994)
            delta = np.where(done, delta, np.where(ok, nxt, np.minimum(nxt, delta * 0.999)))
        if best is None or not np.allclose(best[0], lo):
            lo = np.where(lo > 0, lo, delta * 0.5)  # units never feasible yet: keep shrinking from the last try
            res = self._code(layer, kind, x, zs, recon, expand(lo.astype(np.float32)), zero_obj, modes)
            e = res[3] if self.scope == "object" else np.array([res[3].sum()])
            while not (e <= target).all():
                lo = np.where(e <= target, lo, lo * 0.5)
                if np.all(lo < 1e-30):
                    raise EncodeError(f"{_tensor_name(layer, kind)}: cannot meet eps={self.eps}")
                res = self._code(layer, kind, x, zs, recon, expand(lo.astype(np.float32)), zero_obj, modes)
                e = res[3] if self.scope == "object" else np.array([res[3].sum()])
            best = (lo, res)
        return expand(best[0].astype(np.float32)), best[1]

    # -- driver ----------------------------------------------------------------------------------
    def encode(self, tensors: dict, progress=None):
        """Yield a :class:`TensorMeta` (with its objects) per tensor, in codec order."""
        lay = self.layout
        S = self.config.object_size
        n_obj = -(-lay.n_tokens // S)
        pooled_delta = None
        pooled_modes = None
        if self.scope == "pooled":
            pooled_delta, pooled_modes = self._pooled_search(tensors, progress)
        recon: dict = {}
        for ti, (layer, kind) in enumerate((i, k) for i in range(lay.num_layers) for k in ("K", "V")):
            x, zs, sq_row = self._prepare(layer, kind, tensors[_tensor_name(layer, kind)])
            zero_obj = sum(_obj_sums(s, S) for s in sq_row) == 0
            if self.scope == "pooled":
                delta = np.full(n_obj, pooled_delta, np.float32)
                res = self._code(layer, kind, x, zs, recon, delta, zero_obj, pooled_modes[ti])
            else:
                delta, res = self._search(layer, kind, x, zs, sq_row, recon, zero_obj)
            q, recs, modes, err = res
            for h, rec in enumerate(recs):
                b = block_name(kind, layer, h)
                recon[b] = rec
                self.prune(recon, b)
            yield self._emit(ti, layer, kind, q, modes, err, sq_row, delta, zero_obj)
            if progress:
                progress(1)

    def _pooled_search(self, tensors, progress):
        lay = self.layout
        total_norm = 0.0
        for name in lay.tensor_names():
            a = np.asarray(tensors[name], np.float64)
            total_norm += float(np.sum(a * a))
        target = self.eps ** 2 * total_norm
        delta = max(self.eps * np.sqrt(12.0 * total_norm / lay.n_values), 1e-30)
        modes = None
        lo, hi, best = 0.0, np.inf, None
        for it in range(10):
            err, modes_it = self._pass(tensors, delta, modes, progress)
            modes = modes_it
            if err <= target:
                lo = max(lo, delta)
                best = delta
                if err >= target * 0.994:
                    break
            else:
                hi = min(hi, delta)
            nxt = delta * float(np.clip(np.sqrt(target / max(err, 1e-300)), 0.5, 2.0))
            if np.isfinite(hi) and lo > 0 and not (lo < nxt < hi):
                nxt = float(np.sqrt(lo * hi))
            delta = nxt if err <= target else min(nxt, delta * 0.999)
        while best is None:
            delta *= 0.5
            err, _ = self._pass(tensors, delta, modes, progress)
            if err <= target:
                best = delta
        return float(np.float32(best)), modes

    def _pass(self, tensors, delta, modes, progress=None):
        lay = self.layout
        S = self.config.object_size
        n_obj = -(-lay.n_tokens // S)
        recon: dict = {}
        total = 0.0
        out_modes = []
        for ti, (layer, kind) in enumerate((i, k) for i in range(lay.num_layers) for k in ("K", "V")):
            x, zs, sq_row = self._prepare(layer, kind, tensors[_tensor_name(layer, kind)])
            zero_obj = sum(_obj_sums(s, S) for s in sq_row) == 0
            _, recs, m, err = self._code(layer, kind, x, zs, recon, np.full(n_obj, delta, np.float32), zero_obj,
                                         None if modes is None else modes[ti])
            out_modes.append(m)
            if progress:
                progress(1)
            total += float(err.sum())
            for h, rec in enumerate(recs):
                b = block_name(kind, layer, h)
                recon[b] = rec
                self.prune(recon, b)
        return total, out_modes

    def _emit(self, ti, layer, kind, q, modes, err, sq_row, delta, zero_obj) -> TensorMeta:
        S = self.config.object_size
        T = q.shape[0]
        norm_obj = sum(_obj_sums(s, S) for s in sq_row)
        live = ~np.repeat(zero_obj, S)[:T]
        models = entropy.choose_models(np.ascontiguousarray(q[live].T)) if live.any() else \
            np.zeros(q.shape[1], np.uint8)
        meta = TensorMeta(name=_tensor_name(layer, kind), modes=modes.astype(np.uint8), models=models,
                          sq_err=float(err.sum()), sq_norm=float(norm_obj.sum()))
        for j in range(len(delta)):
            a, b = j * S, min(T, (j + 1) * S)
            if zero_obj[j]:
                payload, flags = b"", OBJ_ZERO
            else:
                payload, flags = entropy.encode(np.ascontiguousarray(q[a:b].T), models, self.coder), 0
            meta.objects.append(EncodedObject(tensor=ti, token_start=a, n_tokens=b - a, flags=flags,
                                              delta=float(delta[j]), sq_err=float(err[j]),
                                              sq_norm=float(norm_obj[j]), payload=payload))
        return meta


class Decoder(_Chain):
    """Decode objects back to native tensors, layer by layer, for a range of objects."""

    def check(self, metas: list) -> None:
        """Reject per-channel modes or model ids a decoder could not honour (corrupt header)."""
        lay = self.layout
        for ti, meta in enumerate(metas):
            layer, kind = divmod(ti, 2)
            if meta.models.shape != (lay.kv_heads * lay.head_dim,) or \
                    int(meta.models.max(initial=0)) >= entropy.N_MODELS:
                raise FormatError(f"{meta.name}: invalid entropy model ids in header")
            if meta.modes.shape != (lay.kv_heads, lay.head_dim):
                raise FormatError(f"{meta.name}: invalid predictor modes in header")
            for h in range(lay.kv_heads):
                p = self.plans[block_name("KV"[kind], layer, h)]
                allowed = set(self.config.candidate_modes(p.map_u is not None, bool(p.blend_refs)))
                if not set(np.unique(meta.modes[h]).tolist()) <= allowed:
                    raise FormatError(f"{meta.name}: predictor modes not available with this bank/config")

    def decode_range(self, metas: list, fetch, j0: int, j1: int, n_layers: int | None = None):
        """Yield ``(name, array [kv_heads, rows, d])`` for objects ``j0..j1-1`` of every tensor of
        the first ``n_layers`` layers. ``fetch(tensor_index, object_index)`` returns
        ``(entry, payload)`` with ``entry`` having ``n_tokens``, ``flags`` and ``delta``."""
        lay = self.layout
        S = self.config.object_size
        H, d = lay.kv_heads, lay.head_dim
        n_layers = lay.num_layers if n_layers is None else n_layers
        start = j0 * S
        recon: dict = {}
        n_rows = min(lay.n_tokens, j1 * S) - start
        for ti, (layer, kind) in enumerate((i, k) for i in range(n_layers) for k in ("K", "V")):
            meta = metas[ti]
            q = np.zeros((H * d, n_rows), np.int32)  # channel-major, as the entropy coder emits it
            delta_rows = np.empty(n_rows, np.float32)
            zr = np.zeros(n_rows, bool)
            for j in range(j0, j1):
                entry, payload = fetch(ti, j)
                a = j * S - start
                b = a + entry.n_tokens
                if entry.n_tokens != min(S, lay.n_tokens - j * S):
                    raise FormatError(f"{meta.name}: object {j} has the wrong length")
                delta_rows[a:b] = entry.delta
                if entry.flags & OBJ_ZERO:
                    zr[a:b] = True
                    delta_rows[a:b] = 1.0
                else:
                    q[:, a:b] = entropy.decode(payload, meta.models, (H * d, entry.n_tokens), self.coder)
            self.config.scale_sink(delta_rows, start)
            out = np.empty((H, n_rows, d), self.out_dtype)
            for h in range(H):
                blk = block_name(kind, layer, h)
                plan = self.plans[blk]
                m = meta.modes[h]
                base = plan.predict(m, recon, n_rows)
                qh = q[h * d:(h + 1) * d]
                rec = dequant_add(base, qh, delta_rows)
                interp = np.nonzero(m & INTERP)[0]
                if len(interp):  # odd rows of interpolated channels depend on their even neighbours
                    wh = dequantize_residual(qh[interp].T, delta_rows, np.ones(len(interp), bool), S)
                    rec[:, interp] = base[:, interp] + wh
                if zr.any():
                    rec[zr] = self.to_frame(np.zeros((int(zr.sum()), d), np.float32), layer, kind, h,
                                            start)  # zero rows: frame image of 0 (RoPE(0) = 0)
                recon[blk] = rec
                x = self.to_native(rec, layer, kind, h, start)
                if zr.any():
                    x[zr] = 0
                out[h] = x
                self.prune(recon, blk)
            yield meta.name, out


