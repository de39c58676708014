"""The AlignPred encoder: tensors -> objects of quantised, entropy-coded prediction residuals.

Each tensor is cut into objects of ``object_size`` positions. Per block (one head of one tensor)
and channel a prediction mode is chosen (:mod:`alignpred.codec.predictors`); residuals are quantised on
a lattice whose step is searched so that the *measured* error, after the inverse transform and
the cast to the source dtype, meets ``eps`` in every unit of the scope (``object``, ``tensor`` or
``pooled``, or ``weighted`` — a pooled budget in which each tensor's error counts by a weight, e.g.
its measured effect on the model's output; both cap every tensor at ``tensor_cap × eps``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from alignpred import entropy
from alignpred.cache.layout import Block, tensor_name
from alignpred.codec.budget import ErrorBudget, TensorMeta
from alignpred.codec.chain import OBJ_ZERO, Chain, obj_sums
from alignpred.codec.measure import Measure
from alignpred.codec.predictors import BASE_MASK, INTERP, ZERO
from alignpred.codec.ratecontrol import joint_search, step_shape
from alignpred.codec.ratesearch import bracket_search
from alignpred.errors import EncodeError, NonFiniteError
from alignpred.kernels.quantize import candidate_bits, quantize
from alignpred.threads import default_threads, pool

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


class Encoder(Chain):
    """Encode a cache in bounded memory. ``scope`` is ``object``, ``tensor``, ``pooled`` or
    ``weighted``; ``tensor_cap`` (pooled and weighted scopes; 0 = none) bounds every tensor's
    NRMSE by ``tensor_cap * eps``. ``weights`` (weighted scope: one positive number per tensor, in
    layout order) make the budget ``sum_t w_t NRMSE_t^2 <= eps^2 sum_t w_t``; steps are then
    allocated as ``Δ_t ∝ ||X_t|| / sqrt(w_t)``, which minimises the bits for that budget.

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

    def __init__(self, layout, bank, config, budget: ErrorBudget, coder: str = "rans4", chunk_objects: int = 2,
                 plans=None, weights=None, threads: int | None = None, step_codes=None, row_codes=None):
        super().__init__(layout, bank, config, coder, plans)
        if budget.eps is None:
            raise EncodeError("the encoder needs a resolved budget (ErrorBudget.resolved): eps is not known yet")
        self.budget = budget
        self.eps = float(budget.eps)
        self.scope = budget.scope
        self.strategy = budget.strategy  # what the scope decides (alignpred.codec.scopes)
        self.tensor_cap = budget.cap
        n_t = 2 * layout.num_layers
        self.weights: np.ndarray | None = None
        if self.strategy.weighted:
            w = np.asarray(weights if weights is not None else [], np.float64).reshape(-1)
            if w.shape != (n_t,) or not np.all(np.isfinite(w)) or not np.all(w > 0):
                raise EncodeError(f"the {self.scope} scope needs {n_t} positive finite tensor weights")
            self.weights = w
        elif weights is not None:
            raise EncodeError("tensor weights are used by the weighted scope only")
        self.measure = Measure(layout, config, budget, step_codes, row_codes)  # steps and the scope's measure
        self._tensor_of = {t: k for k, t in enumerate(layout.tensors())}
        self.chunk_objects = max(1, int(chunk_objects))
        self.threads = default_threads() if threads is None else max(1, int(threads))
        self._pool = pool(self.threads) if self.threads > 1 else None
        self.metas: list[TensorMeta] = []
        self._release = None
        self._early: dict | None = None
        S = config.object_size
        self.n_obj = -(-layout.n_tokens // S)
        self.tensors = layout.tensors()
        self.obj_rows = np.minimum(S, layout.n_tokens - S * np.arange(self.n_obj))

    # -- input -----------------------------------------------------------------------------------
    def _rows(self, tensors, ti: int, a: int, b: int) -> np.ndarray:
        """Native rows ``[a, b)`` of tensor ``ti`` as float32 ``[kv_heads, b - a, d]``."""
        arr = tensors[tensor_name(*self.tensors[ti])]
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
                    raise NonFiniteError(f"{tensor_name(*self.tensors[ti])}: {len(bad)}+ NaN/Inf values (first at "
                                         f"head {h}, token {a + t}, channel {c}); kvz refuses non-finite input: fix "
                                         "the cache or replace them before compressing")
                sq = [self.measure.row_sq(xh.astype(np.float64), ti, h, a) for h, xh in enumerate(x)]
                self.measure.keep_plain_norms(x, ti, j0, j1, a)
                norms[ti, j0:j1] = sum(obj_sums(v, S) for v in sq)  # per head, then summed: as before
        return norms

    # -- coding one head of one chunk ------------------------------------------------------------
    def chan(self, ti: int, h: int) -> np.ndarray | None:
        """Per-channel step multipliers of head ``h`` of tensor ``ti`` (None: all ones)."""
        return self.measure.chan(ti, h)

    def _code_head(self, plan, m, z, local, delta_rows, zero_rows, blk, base=None, chan=None):
        if base is None:
            base = plan.predict(m, local, z.shape[0])
        q, wh, big = quantize(z, delta_rows, (m & INTERP) != 0, self.config.object_size, base=base, chan=chan)
        if big >= 2.0 ** 30:
            raise EncodeError(f"eps {self.eps:g} is too small for this cache: its quantisation steps give symbols "
                              f"beyond 2**30; use eps >= {self.eps * big / 2.0 ** 29:.1e}, or --lossless for the "
                              "exact bits")
        rec = base + wh
        if zero_rows.any():
            q[zero_rows] = 0
            rec[zero_rows] = self.frame.zero_image(blk)
        return q, rec

    def _row_errors(self, rec, xh, blk, start) -> np.ndarray:
        """Squared error per row after the inverse transform and the cast, object by object (in
        the scope's measure, :meth:`Measure.row_sq`; with a plain cap, each object's plain squared
        error over the rows a later query reads is kept for the search)."""
        S = self.config.object_size
        ti = self._tensor_of[(blk.layer, blk.kind)]
        e = np.empty(rec.shape[0])
        for a in range(0, rec.shape[0], S):
            d = self.frame.to_native(rec[a:a + S], blk, start + a).astype(np.float64) - xh[a:a + S]
            e[a:a + S] = self.measure.row_sq(d, ti, blk.head, start + a)
            self.measure.keep_plain_error(d, ti, blk.head, start + a)
        return e

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
        Pooled: whole-sample passes (one step, tensors over their cap with their own). Returns
        ``(modes, delta [n_tensors, n_obj] float32, token histograms of the sample at delta)``."""
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
                z = [np.concatenate([self.frame.to_frame(xj[h], Block(layer, kind, h), j * S)
                                     for xj, j in zip(x, objs)]) for h in range(H)]
                zs_cache.clear()  # one tensor's sample at a time
                zs_cache[ti] = (np.concatenate(x, axis=1), z)
            return zs_cache[ti]

        preds: dict = {}  # block -> base prediction from the current sources (reused across step tries)

        def code(ti, delta_obj, local, modes):
            """Code tensor ``ti``'s sample; returns (modes, per-object error, recs, hist, q).
            Predictions are kept in ``preds`` while ``local`` (the sources) is unchanged."""
            layer, kind = self.tensors[ti]
            x, z = sample(ti)
            dr, zr = zip(*(self.delta_rows(delta_obj[k:k + 1], zero[ti, j:j + 1], j * S, layer=layer,
                                           rows=self.measure.rows[ti]) for k, j in enumerate(objs)))
            delta_rows, zero_rows = np.concatenate(dr), np.concatenate(zr)
            loc = dict(local)
            err = np.zeros(len(objs))
            hist = np.zeros((H * d, entropy.N_TOKENS), np.int32)
            chosen = []
            q_all = np.empty((len(delta_rows), H * d), np.int32)
            for h in range(H):
                blk = Block(layer, kind, h)
                plan = self.plans[blk.name]
                ch = self.chan(ti, h)
                m, bases = self._choose(plan, z[h], loc, delta_rows, ch) if modes is None else (modes[h], None)
                pred = preds.get(blk.name)
                if pred is None:
                    pred = plan.predict(m, loc, z[h].shape[0], bases)
                    # Kept for the next tries unless a source is another head of this tensor.
                    if not any(s.startswith(f"{kind}.{layer}.") for s in plan.sources):
                        preds[blk.name] = pred
                q, loc[blk.name] = self._code_head(plan, m, z[h], loc, delta_rows, zero_rows, blk, pred, ch)
                q_all[:, h * d:(h + 1) * d] = q
                e = np.concatenate([self._row_errors(loc[blk.name][k * S:k * S + int(self.obj_rows[j])], x[h][k * S:],
                                                     blk, j * S) for k, j in enumerate(objs)])
                e[zero_rows] = 0.0
                err += obj_sums(e, S)
                if (~zero_rows).any():
                    hist[h * d:(h + 1) * d] = entropy.histogram(np.ascontiguousarray(q[~zero_rows].T))[0]
                chosen.append(m)
            return np.stack(chosen), err, {b: loc[b] for b in loc if b not in local}, hist, q_all

        rows = self.obj_rows[objs] * H * d
        modes: list = [None] * n_t
        hists = np.zeros((n_t, H * d, entropy.N_TOKENS), np.int32)
        delta = np.zeros((n_t, self.n_obj), np.float32)
        if self.strategy.joint:
            def evaluate(dt):  # one step per tensor -> (errors per tensor, histograms)
                preds.clear()  # earlier tensors' reconstructions change with the steps
                local: dict = {}
                errs, hs = np.zeros(n_t), []
                for ti in range(n_t):
                    modes[ti], err, recs, h, _ = code(ti, np.full(len(objs), dt[ti], np.float32), local, modes[ti])
                    local.update(recs)
                    for b in recs:
                        self.prune(local, b)
                    errs[ti] = float(err.sum())
                    hs.append(h)
                return errs, hs

            norm_t = norms[:, objs].sum(axis=1)
            g0 = max(self.eps * np.sqrt(12.0 * norm_t.sum() / (rows.sum() * n_t)), 1e-30)
            dt, hs = self._pooled_search(evaluate, g0 * self._step_shape(norm_t), norm_t, objs=objs)
            return modes, np.repeat(dt.astype(np.float32)[:, None], self.n_obj, axis=1), np.stack(hs)
        local: dict = {}
        scope = self.strategy
        for ti in range(n_t):
            target, d0 = scope.sample_units(self.eps, norms[ti, objs], rows)
            d0 = np.maximum(d0, 1e-30)

            def expand(dl):
                return scope.expand(dl, len(objs))

            preds.clear()  # the sources of tensor ti are fixed during its search

            def evaluate(dl):
                m, err, recs, h, q = code(ti, expand(dl.astype(np.float32)).astype(np.float32), local, modes[ti])
                modes[ti] = m
                return scope.unit_errors(err), (recs, h, q, err)

            dl, (recs, hists[ti], q, err) = bracket_search(evaluate, d0, target,
                                                           f"{tensor_name(*self.tensors[ti])}: ")
            local.update(recs)
            for b in recs:
                self.prune(local, b)
            dl = expand(dl.astype(np.float32))
            delta[ti] = scope.spread(dl, d0, objs, lambda: np.maximum(  # every object's initial step
                self.eps * np.sqrt(12.0 * norms[ti] / (self.obj_rows * H * d)), 1e-30))
            if progress:  # in positions of the whole cache, like the passes
                progress(int(self.obj_rows[objs].sum()) / n_t)
            if self.n_obj <= CHOICE_OBJECTS:  # the sample is the cache: this tensor is final
                models = self._models(hists[ti], zero[ti])
                early = self._early
                assert early is not None  # set by encode() whenever the sample is the whole cache
                early["models"].append(models)
                early["objects"].extend(self._objects(ti, q, 0, self.n_obj, 0, delta, zero, err, models))
        return modes, delta, hists

    def _step_shape(self, norm_t) -> np.ndarray:
        return step_shape(norm_t, self.weights)

    def _pooled_search(self, evaluate, d0, norm_t, aim: float = 0.997, widen: int = 0, objs=None):
        m = self.measure  # the plain cap: plain errors and norms per tensor over the objects the search measures
        return joint_search(evaluate, d0, norm_t, self.eps, self.tensor_cap, self.weights, self.scope, aim, widen,
                            plain=(lambda: m.plain(objs)) if m.plain_cap else None, plain_cap=m.plain_cap)

    def _choose(self, plan, z, local, delta_rows, chan=None):
        """Modes ``[d]`` with the smallest estimated cost at the initial step, and the base
        predictions computed for the choice (by predictor id)."""
        cfg = self.config
        cands = plan.modes()
        bases = {bb: plan.base(bb, local) for bb in {m & BASE_MASK for m in cands} if bb != ZERO}
        def cost(m):  # one pass per candidate, no temporaries of the block's size (releases the GIL)
            base = bases[m & BASE_MASK] if m & BASE_MASK != ZERO else None
            return candidate_bits(z, delta_rows, bool(m & INTERP), cfg.object_size, base=base, chan=chan)

        bits = np.stack(list(self._pool.map(cost, cands)) if self._pool is not None else [cost(m) for m in cands])
        cands = np.array(cands, np.uint8)
        if cfg.channel_choice:
            return cands[np.argmin(bits, axis=0)], bases
        return np.full(z.shape[1], cands[int(np.argmin(bits.sum(axis=1)))], np.uint8), bases

    # -- one pass over the cache -----------------------------------------------------------------
    def _chunk(self, tensors, j0, j1, delta, zero, modes, keep_q: bool):
        """Code objects ``j0..j1-1`` of every tensor at steps ``delta``: returns per tensor
        ``(squared error per object, token histogram, q or None)``. Chunks are independent
        (predictions combine rows of the same positions), so they may run in parallel."""
        lay = self.layout
        S = self.config.object_size
        H, d = lay.kv_heads, lay.head_dim
        a, b = j0 * S, min(lay.n_tokens, j1 * S)
        local: dict = {}
        out = []
        for ti, (layer, kind) in enumerate(self.tensors):
            x = self._rows(tensors, ti, a, b)
            delta_rows, zero_rows = self.delta_rows(delta[ti, j0:j1], zero[ti, j0:j1], a, layer=layer,
                                                    rows=self.measure.rows[ti])
            q = np.empty((b - a, H * d), np.int32)
            err = np.zeros(j1 - j0)
            for h in range(H):
                blk = Block(layer, kind, h)
                z = self.frame.to_frame(x[h], blk, a)
                q[:, h * d:(h + 1) * d], local[blk.name] = self._code_head(
                    self.plans[blk.name], modes[ti][h], z, local, delta_rows, zero_rows, blk, chan=self.chan(ti, h))
                e = self._row_errors(local[blk.name], x[h], blk, a)
                e[zero_rows] = 0.0
                err += obj_sums(e, S)
                self.prune(local, blk.name)
            live = ~zero_rows
            hist = entropy.histogram(np.ascontiguousarray(q[live].T))[0] if live.any() and not keep_q else None
            out.append((err, hist, q if keep_q else None))
        return out

    def _pass(self, tensors, delta, zero, modes, models=None, progress=None):
        """Code the whole cache at steps ``delta [n_tensors, n_obj]``, chunk by chunk through
        every layer (``threads`` chunks at a time in parallel). Returns ``(sq_err [n_tensors,
        n_obj], token histograms per tensor)``; with ``models`` (emission) it is a generator of
        :class:`EncodedObject` instead, in chunk order."""
        lay = self.layout
        S, C = self.config.object_size, self.chunk_objects
        H, d = lay.kv_heads, lay.head_dim
        err = np.zeros(delta.shape)
        hist = np.zeros((len(self.tensors), H * d, entropy.N_TOKENS), np.int32)  # < 2**31 rows per tensor
        starts = list(range(0, self.n_obj, C))
        emit = models is not None
        for w0 in range(0, len(starts), self.threads):  # a window of chunks in flight
            window = [(j0, min(self.n_obj, j0 + C)) for j0 in starts[w0:w0 + self.threads]]

            def run(jj):
                return self._chunk(tensors, jj[0], jj[1], delta, zero, modes, emit)

            results = list(self._pool.map(run, window)) if self._pool is not None and len(window) > 1 else \
                [run(jj) for jj in window]
            for (j0, j1), res in zip(window, results):
                a = j0 * S
                for ti, (e, h, q) in enumerate(res):
                    err[ti, j0:j1] = e
                    if h is not None:
                        hist[ti] += h
                    if emit:
                        yield from self._objects(ti, q, j0, j1, a, delta, zero, err[ti, j0:j1], models[ti])
                if progress:
                    progress(min(lay.n_tokens, j1 * S) - a)
        if not emit:
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
        """Scope unit of every object ``[n_tensors, n_obj]`` (pooled: one unit per tensor, whose
        steps the pooled search ties together)."""
        return self.strategy.units(len(self.tensors), self.n_obj)

    def _search(self, tensors, norms, zero, progress=None):
        """Steps (one per scope unit) whose measured errors all meet the budget, searched jointly
        by whole-cache passes from the sample's steps. Returns ``(delta [n_tensors, n_obj]
        float32, modes, token histograms at delta)``."""
        modes, d_sample, hist = self._sample_search(tensors, norms, zero, progress)
        if self.n_obj <= CHOICE_OBJECTS:
            return d_sample, modes, hist  # the sample is the whole cache
        unit = self._units()
        n_u = int(unit.max()) + 1
        first = np.zeros(n_u)
        first[unit.ravel()] = d_sample.ravel()

        def evaluate(dl):
            e, h = self._evaluate(tensors, dl.astype(np.float32)[unit], zero, modes, progress=progress)
            return np.bincount(unit.ravel(), e.ravel(), n_u), h

        # Aim at the middle of the band: a unit's error drifts a little when other units' steps
        # change (through predictions), and should stay inside it.
        dl, hist = self.strategy.search(evaluate, first, norms, unit, self.eps, self._pooled_search, aim=0.997,
                                        widen=4)
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
        early: dict = {"models": [], "objects": []}
        self._early = early if self.n_obj <= CHOICE_OBJECTS and not self.strategy.joint else None
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
        self.metas = [TensorMeta(name=tensor_name(layer, kind), modes=modes[ti].astype(np.uint8), models=models[ti],
                                 sq_err=float(err[ti].sum()), sq_norm=float(norms[ti].sum()),
                                 step_codes=None if self.measure.step_codes is None else self.measure.step_codes[ti],
                                 row_codes=None if self.measure.row_codes is None else self.measure.row_codes[ti],
                                 plain_sq_err=self.measure.tensor_plain(ti)[0],
                                 plain_sq_norm=self.measure.tensor_plain(ti)[1])
                      for ti, (layer, kind) in enumerate(self.tensors)]
