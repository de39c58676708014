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

    def zero_image(self, layer: int, kind: str, head: int) -> np.ndarray:
        """Coding-frame image ``[d]`` of a zero row (RoPE(0) = 0 at every position); encoder and
        decoder compute it the same way, on one row."""
        return self.to_frame(np.zeros((1, self.layout.head_dim), np.float32), layer, kind, head, 0)[0]

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
    """Encode a cache in bounded memory. ``scope`` is ``object``, ``tensor`` or ``pooled``.

    Work runs *object chunk by object chunk* through every layer (``chunk_objects`` objects of
    every tensor at a time), as predictions only combine rows of the same positions: memory
    holds one chunk of each referenced block, never a whole tensor. The steps are searched
    jointly: each pass codes the whole cache at one step per scope unit and measures every
    object's error; units are updated together until all meet ``eps`` and lie within 0.6 % of
    it. A last pass at the chosen steps emits the payloads, chunk-major
    (:meth:`encode` yields them; :attr:`metas` holds the per-tensor parameters afterwards).

    ``release(view)`` (optional) is called with every input slice once it has been read, e.g.
    to drop mapped input pages from the resident set.
    """

    def __init__(self, layout, bank, config: CodecConfig, eps: float, scope: str = "tensor", coder: str = "rans4",
                 chunk_objects: int = 2):
        super().__init__(layout, bank, config, coder)
        if not (0.0 < eps < 1.0):
            raise EncodeError(f"eps must be in (0, 1), got {eps}")
        if scope not in SCOPES:
            raise EncodeError(f"unknown eps scope {scope!r}; use one of {', '.join(SCOPES)}")
        self.eps = float(eps)
        self.scope = scope
        self.chunk_objects = max(1, int(chunk_objects))
        self.metas: list[TensorMeta] = []
        self._release = None
        self._early = None
        lay = layout
        S = config.object_size
        self.n_obj = -(-lay.n_tokens // S)
        self.tensors = [(i, k) for i in range(lay.num_layers) for k in ("K", "V")]
        self.obj_rows = np.minimum(S, lay.n_tokens - S * np.arange(self.n_obj))

    # -- input -----------------------------------------------------------------------------------
    def _rows(self, tensors, ti: int, a: int, b: int) -> np.ndarray:
        """Native rows ``[a, b)`` of tensor ``ti`` as float32 ``[kv_heads, b - a, d]``."""
        layer, kind = self.tensors[ti]
        arr = tensors[_tensor_name(layer, kind)]
        arr = arr[0] if self.layout.batch_dim else arr
        view = arr[:, a:b]
        x = np.asarray(view, np.float32)
        if self._release is not None:
            self._release(view)
        return x

    def _norms(self, tensors) -> np.ndarray:
        """Squared norm of every object ``[n_tensors, n_obj]`` (float64); rejects NaN/Inf."""
        S, C = self.config.object_size, self.chunk_objects
        norms = np.zeros((len(self.tensors), self.n_obj))
        for j0 in range(0, self.n_obj, C):
            j1 = min(self.n_obj, j0 + C)
            a, b = j0 * S, min(self.layout.n_tokens, j1 * S)
            for ti in range(len(self.tensors)):
                x = self._rows(tensors, ti, a, b)
                if not np.isfinite(x).all():
                    bad = np.argwhere(~np.isfinite(x))
                    h, t, c = (int(v) for v in bad[0])
                    layer, kind = self.tensors[ti]
                    raise NonFiniteError(f"{_tensor_name(layer, kind)}: {len(bad)}+ NaN/Inf values (first at head {h}, "
                                         f"token {a + t}, channel {c}); kvz refuses non-finite input: fix the cache "
                                         "or replace them before compressing")
                sq = [np.einsum("ij,ij->i", xh.astype(np.float64), xh.astype(np.float64)) for xh in x]
                norms[ti, j0:j1] = sum(_obj_sums(v, S) for v in sq)  # per head, then summed: as before
        return norms

    # -- coding one head of one chunk ------------------------------------------------------------
    def _code_head(self, plan, m, z, local, delta_rows, zero_rows, layer, kind, h):
        base = plan.predict(m, local, z.shape[0])
        q, wh = quantize_residual(z - base, delta_rows, (m & INTERP) != 0, self.config.object_size)
        rec = base + wh
        if zero_rows.any():
            q[zero_rows] = 0
            rec[zero_rows] = self.zero_image(layer, kind, h)
        return q, rec

    def _row_errors(self, rec, xh, layer, kind, h, start) -> np.ndarray:
        """Squared error per row after the inverse transform and the cast, object by object."""
        S = self.config.object_size
        e = np.empty(rec.shape[0])
        for a in range(0, rec.shape[0], S):
            d = self.to_native(rec[a:a + S], layer, kind, h, start + a).astype(np.float64) - xh[a:a + S]
            e[a:a + S] = np.einsum("ij,ij->i", d, d)
        return e

    def _delta_rows(self, delta_obj, zero_obj, start):
        S = self.config.object_size
        n = int(self.obj_rows[start // S:start // S + len(delta_obj)].sum())
        delta_rows = np.repeat(np.asarray(delta_obj, np.float32), S)[:n]
        self.config.scale_sink(delta_rows, start)
        zero_rows = np.repeat(zero_obj, S)[:n]
        delta_rows[zero_rows] = 1.0
        return delta_rows, zero_rows

    # -- predictor modes and first steps, on a sample of objects --------------------------------
    def _sample_objects(self) -> np.ndarray:
        if self.n_obj <= CHOICE_OBJECTS:
            return np.arange(self.n_obj)
        return np.unique(np.linspace(0, self.n_obj - 1, CHOICE_OBJECTS).round().astype(int))

    def _sample_search(self, tensors, norms, zero, progress=None):
        """Predictor modes and steps measured on at most :data:`CHOICE_OBJECTS` objects spread
        over the cache (all of them in short caches, where the result is final).

        Tensor and object scope: tensor by tensor, the modes with the smallest estimated cost at
        the initial step, then the step search with earlier tensors' sampled rows fixed.
        Pooled: whole-sample passes at one step. Returns ``(modes, delta [n_tensors, n_obj]
        float32, token histograms of the sample at delta)``."""
        S = self.config.object_size
        objs = self._sample_objects()
        lay = self.layout
        H, d = lay.kv_heads, lay.head_dim
        n_t = len(self.tensors)
        zs_cache: dict = {}

        def sample(ti):
            if ti not in zs_cache:
                layer, kind = self.tensors[ti]
                x = [self._rows(tensors, ti, j * S, j * S + int(self.obj_rows[j])) for j in objs]
                z = [np.concatenate([self.to_frame(xj[h], layer, kind, h, j * S) for xj, j in zip(x, objs)])
                     for h in range(H)]
                zs_cache.clear()  # one tensor's sample at a time
                zs_cache[ti] = (np.concatenate(x, axis=1), z)
            return zs_cache[ti]

        def code(ti, delta_obj, local, modes):
            """Code tensor ``ti``'s sample; returns (modes, per-object error, recs, hist)."""
            layer, kind = self.tensors[ti]
            x, z = sample(ti)
            dr, zr = zip(*(self._delta_rows(delta_obj[k:k + 1], zero[ti, j:j + 1], j * S) for k, j in enumerate(objs)))
            delta_rows, zero_rows = np.concatenate(dr), np.concatenate(zr)
            loc = dict(local)
            err = np.zeros(len(objs))
            hist = np.zeros((H * d, entropy.N_TOKENS), np.int32)
            chosen = []
            q_all = np.empty((len(delta_rows), H * d), np.int32)
            for h in range(H):
                b = block_name(kind, layer, h)
                plan = self.plans[b]
                m = self._choose(plan, z[h], loc, delta_rows) if modes is None else modes[h]
                q, loc[b] = self._code_head(plan, m, z[h], loc, delta_rows, zero_rows, layer, kind, h)
                q_all[:, h * d:(h + 1) * d] = q
                e = np.concatenate([self._row_errors(loc[b][k * S:k * S + int(self.obj_rows[j])], x[h][k * S:],
                                                     layer, kind, h, j * S) for k, j in enumerate(objs)])
                e[zero_rows] = 0.0
                err += _obj_sums(e, S)
                if (~zero_rows).any():
                    hist[h * d:(h + 1) * d] = entropy.histogram(np.ascontiguousarray(q[~zero_rows].T))[0]
                chosen.append(m)
            return np.stack(chosen), err, {b: loc[b] for b in loc if b not in local}, hist, q_all

        rows = self.obj_rows[objs] * H * d
        modes: list = [None] * n_t
        hists = np.zeros((n_t, H * d, entropy.N_TOKENS), np.int32)
        delta = np.zeros((n_t, self.n_obj), np.float32)
        if self.scope == "pooled":
            norm = norms[:, objs].sum()
            target = np.array([self.eps ** 2 * norm])
            d0 = np.array([max(self.eps * np.sqrt(12.0 * norm / (rows.sum() * n_t)), 1e-30)])

            def evaluate(dl):
                local: dict = {}
                total, hs = 0.0, []
                for ti, (layer, kind) in enumerate(self.tensors):
                    modes[ti], err, recs, h, _ = code(ti, np.full(len(objs), dl[0], np.float32), local, modes[ti])
                    local.update(recs)
                    for b in recs:
                        self.prune(local, b)
                    total += float(err.sum())
                    hs.append(h)
                return np.array([total]), hs

            dl, hs = _bracket_search(evaluate, d0, target)
            return modes, np.full(delta.shape, np.float32(dl[0])), np.stack(hs)
        local: dict = {}
        for ti in range(n_t):
            if self.scope == "object":
                target = self.eps ** 2 * norms[ti, objs]
                d0 = self.eps * np.sqrt(12.0 * norms[ti, objs] / rows)
            else:
                norm = norms[ti, objs].sum()
                target = np.array([self.eps ** 2 * norm])
                d0 = np.array([self.eps * np.sqrt(12.0 * norm / rows.sum())])
            d0 = np.maximum(d0, 1e-30)
            expand = (lambda dl: dl) if self.scope == "object" else (lambda dl: np.full(len(objs), dl[0]))

            def evaluate(dl):
                m, err, recs, h, q = code(ti, expand(dl.astype(np.float32)).astype(np.float32), local, modes[ti])
                modes[ti] = m
                return (err if self.scope == "object" else np.array([err.sum()])), (recs, h, q, err)

            dl, (recs, hists[ti], q, err) = _bracket_search(evaluate, d0, target,
                                                            f"{_tensor_name(*self.tensors[ti])}: ")
            local.update(recs)
            for b in recs:
                self.prune(local, b)
            dl = expand(dl.astype(np.float32))
            if self.scope == "object":  # unsampled objects: their initial step scaled like the sample's
                full0 = np.maximum(self.eps * np.sqrt(12.0 * norms[ti] / (self.obj_rows * H * d)), 1e-30)
                delta[ti] = full0 * float(np.median(dl / d0))
                delta[ti, objs] = dl
            else:
                delta[ti] = dl[0]
            if progress:  # in positions of the whole cache, like the passes
                progress(int(self.obj_rows[objs].sum()) / n_t)
            if self.n_obj <= CHOICE_OBJECTS:  # the sample is the cache: this tensor is final
                models = self._models(hists[ti], zero[ti])
                self._early["models"].append(models)
                self._early["objects"].extend(self._objects(ti, q, 0, self.n_obj, 0, delta, zero, err, models))
        return modes, delta, hists

    def _choose(self, plan, z, local, delta_rows) -> np.ndarray:
        cfg = self.config
        cands = cfg.candidate_modes(plan.map_u is not None, bool(plan.blend_refs))
        bases = {bb: plan.base(bb, local) for bb in {m & 3 for m in cands} if bb != ZERO}
        bits = np.empty((len(cands), z.shape[1]))  # [n_modes, d]
        for c0 in range(0, z.shape[1], 64):  # channels are independent: small temporaries
            cs = slice(c0, c0 + 64)
            for k, m in enumerate(cands):
                w = z[:, cs] - bases[m & 3][:, cs] if m & 3 != ZERO else z[:, cs]
                q, _ = quantize_residual(w, delta_rows, np.full(w.shape[1], bool(m & INTERP)), cfg.object_size)
                bits[k, cs] = channel_entropy_bits(q)
        cands = np.array(cands, np.uint8)
        if cfg.channel_choice:
            return cands[np.argmin(bits, axis=0)]
        return np.full(z.shape[1], cands[int(np.argmin(bits.sum(axis=1)))], np.uint8)

    # -- one pass over the cache -----------------------------------------------------------------
    def _pass(self, tensors, delta, zero, modes, models=None, progress=None):
        """Code the whole cache at steps ``delta [n_tensors, n_obj]``, chunk by chunk through
        every layer. Returns ``(sq_err [n_tensors, n_obj], token histograms per tensor)``;
        with ``models`` (emission) it is a generator of :class:`EncodedObject` instead."""
        lay = self.layout
        S, C = self.config.object_size, self.chunk_objects
        H, d = lay.kv_heads, lay.head_dim
        err = np.zeros(delta.shape)
        hist = np.zeros((len(self.tensors), H * d, entropy.N_TOKENS), np.int32)  # < 2**31 rows per tensor
        for j0 in range(0, self.n_obj, C):
            j1 = min(self.n_obj, j0 + C)
            a, b = j0 * S, min(lay.n_tokens, j1 * S)
            local: dict = {}
            for ti, (layer, kind) in enumerate(self.tensors):
                x = self._rows(tensors, ti, a, b)
                delta_rows, zero_rows = self._delta_rows(delta[ti, j0:j1], zero[ti, j0:j1], a)
                q = np.empty((b - a, H * d), np.int32)
                for h in range(H):
                    blk = block_name(kind, layer, h)
                    z = self.to_frame(x[h], layer, kind, h, a)
                    q[:, h * d:(h + 1) * d], local[blk] = self._code_head(
                        self.plans[blk], modes[ti][h], z, local, delta_rows, zero_rows, layer, kind, h)
                    e = self._row_errors(local[blk], x[h], layer, kind, h, a)
                    e[zero_rows] = 0.0
                    err[ti, j0:j1] += _obj_sums(e, S)
                    self.prune(local, blk)
                live = ~zero_rows
                if models is None:
                    if live.any():
                        hist[ti] += entropy.histogram(np.ascontiguousarray(q[live].T))[0]
                    continue
                yield from self._objects(ti, q, j0, j1, a, delta, zero, err[ti, j0:j1], models[ti])
            if progress:
                progress(b - a)
        if models is None:
            yield err, hist

    def _objects(self, ti, q, j0, j1, a, delta, zero, err, models):
        """Entropy-code objects ``j0..j1-1`` of tensor ``ti`` from ``q`` (rows from position
        ``a``); ``err`` holds their squared errors."""
        S = self.config.object_size
        for j in range(j0, j1):
            r0, r1 = j * S - a, j * S - a + int(self.obj_rows[j])
            if zero[ti, j]:
                payload, flags = b"", OBJ_ZERO
            else:
                payload, flags = entropy.encode(np.ascontiguousarray(q[r0:r1].T), models, self.coder), 0
            yield EncodedObject(tensor=ti, token_start=j * S, n_tokens=r1 - r0, flags=flags,
                                delta=float(delta[ti, j]), sq_err=float(err[j - j0]), sq_norm=0.0, payload=payload)

    @staticmethod
    def _models(hist, zero) -> np.ndarray:
        return entropy.models_from_histogram(hist) if not zero.all() else np.zeros(hist.shape[0], np.uint8)

    def _evaluate(self, *args, **kw):
        return next(self._pass(*args, **kw))

    # -- step search over the whole cache -------------------------------------------------------
    def _units(self) -> np.ndarray:
        """Scope unit of every object ``[n_tensors, n_obj]``."""
        n_t = len(self.tensors)
        if self.scope == "object":
            return np.arange(n_t * self.n_obj).reshape(n_t, self.n_obj)
        if self.scope == "tensor":
            return np.repeat(np.arange(n_t)[:, None], self.n_obj, axis=1)
        return np.zeros((n_t, self.n_obj), np.int64)

    def _search(self, tensors, norms, zero, progress=None):
        """Steps (one per scope unit) whose measured errors all meet the budget, searched jointly
        by whole-cache passes from the sample's steps. Returns ``(delta [n_tensors, n_obj]
        float32, modes, token histograms at delta)``."""
        modes, d_sample, hist = self._sample_search(tensors, norms, zero, progress)
        if self.n_obj <= CHOICE_OBJECTS:
            return d_sample, modes, hist  # the sample is the whole cache
        unit = self._units()
        n_u = int(unit.max()) + 1
        target = self.eps ** 2 * np.bincount(unit.ravel(), norms.ravel(), n_u)
        first = np.zeros(n_u)
        first[unit.ravel()] = d_sample.ravel()

        def evaluate(dl):
            e, h = self._evaluate(tensors, dl.astype(np.float32)[unit], zero, modes, progress=progress)
            return np.bincount(unit.ravel(), e.ravel(), n_u), h

        # Aim at the middle of the band: a unit's error drifts a little when other units' steps
        # change (through predictions), and should stay inside it.
        dl, hist = _bracket_search(evaluate, first, target, "", aim=0.997, widen=4)
        return dl.astype(np.float32)[unit], modes, hist

    # -- driver ----------------------------------------------------------------------------------
    def encode(self, tensors: dict, progress=None, release=None):
        """Yield every :class:`EncodedObject` (chunk-major after whole-cache passes: all tensors
        of object chunk 0, then chunk 1, ...; tensor by tensor for short caches); :attr:`metas`
        is filled when the generator is exhausted. ``progress(n)`` is called with the work done,
        in positions of the whole cache (each pass counts every position once; the number of
        passes is not known in advance)."""
        self._release = release
        norms = self._norms(tensors)
        zero = norms == 0
        # Short caches (tensor/object scope) are final after the sample search, which codes each
        # tensor's objects as it goes (models first, then its objects); otherwise one more pass.
        early = {"models": [], "objects": []}
        self._early = early if self.n_obj <= CHOICE_OBJECTS and self.scope != "pooled" else None
        delta, modes, hist = self._search(tensors, norms, zero, progress)
        if self._early is not None:
            models, emitted = early["models"], early["objects"]
        else:
            models = [self._models(h, z) for h, z in zip(hist, zero)]
            emitted = self._pass(tensors, delta, zero, modes, models, progress)
        self._early = None
        err = np.zeros(delta.shape)
        for ob in emitted:
            ob.sq_norm = float(norms[ob.tensor, ob.token_start // self.config.object_size])
            err[ob.tensor, ob.token_start // self.config.object_size] = ob.sq_err
            yield ob
        self.metas = [TensorMeta(name=_tensor_name(layer, kind), modes=modes[ti].astype(np.uint8), models=models[ti],
                                 sq_err=float(err[ti].sum()), sq_norm=float(norms[ti].sum()))
                      for ti, (layer, kind) in enumerate(self.tensors)]


def _bracket_search(evaluate, d0, target, what: str = "", aim: float = 1.0, iters: int = 14, widen: int = 0):
    """Largest steps ``d`` (one per unit) with ``evaluate(d)[0] <= target``, each within 0.6 % of
    its target where possible. ``evaluate(d)`` returns ``(errors per unit, result)``; returns
    ``(d, result at d)``. Errors grow with the step (about as its square); the next try scales
    each step by ``sqrt(aim * target / error)`` inside the bracket of feasible/infeasible
    steps seen so far. Units interact only weakly, so each keeps its own bracket. With
    ``widen = k``, the 0.6 % band doubles after every try from the k-th on (whole-cache passes
    are expensive; a unit a little under its budget costs a few thousandths of a bit)."""
    lo = np.zeros_like(d0)
    hi = np.full_like(d0, np.inf)
    best = None
    delta = d0.copy()
    e = None
    for it in range(iters):
        e, res = evaluate(delta)
        ok = e <= target
        lo = np.where(ok, np.maximum(lo, delta), lo)
        hi = np.where(ok, hi, np.minimum(hi, delta))
        band = 0.006 * (2.0 ** max(0, it + 1 - widen) if widen else 1.0)
        if ok.all():
            best = (delta.copy(), res)
            if np.all(e >= target * (1.0 - band)):
                return best
        ratio = np.sqrt(np.where(e > 0, aim * target / np.maximum(e, 1e-300), 4.0))
        nxt = delta * np.clip(ratio, 0.5, 2.0) * np.where(ok, 1.0, 0.999)
        bracket = np.isfinite(hi) & (lo > 0)
        outside = (nxt <= lo) | (nxt >= hi)
        nxt = np.where(bracket & outside, np.sqrt(np.maximum(lo, 1e-300) * np.where(np.isfinite(hi), hi, 1.0)), nxt)
        # Units already inside the band below their target keep their step.
        done = ok & (e >= target * (1.0 - band))
        delta = np.where(done, delta, np.where(ok, nxt, np.minimum(nxt, delta * 0.999)))
    if best is not None and np.allclose(best[0], lo):
        return best
    # Each unit's largest feasible step, tried together; if that fails (units interacting), the
    # last all-feasible try is kept; without one, failing units halve until all are met.
    cand = np.where(lo > 0, lo, delta * 0.5)
    e, res = evaluate(cand)
    while not (e <= target).all():
        if best is not None:
            return best
        cand = np.where(e <= target, cand, cand * 0.5)
        if np.any(cand[e > target] < 1e-30):
            raise EncodeError(f"{what}cannot meet the error budget (eps too small for this data?)")
        e, res = evaluate(cand)
    return cand, res


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
                    rec[zr] = self.zero_image(layer, kind, h)
                recon[blk] = rec
                x = self.to_native(rec, layer, kind, h, start)
                if zr.any():
                    x[zr] = 0
                out[h] = x
                self.prune(recon, blk)
            yield meta.name, out


