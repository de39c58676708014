"""The AlignPred decoder: objects -> native tensors, layer by layer, for a range of objects.

Layers are decoded in order (a block is predicted from earlier layers); a layer that was not
asked for is still reconstructed in the coding frame when a later layer needs it, but never
cast to the output dtype or copied out.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np

from alignpred import entropy
from alignpred.cache.layout import Block
from alignpred.codec import refine
from alignpred.codec.chain import OBJ_ZERO, Chain
from alignpred.codec.predictors import INTERP
from alignpred.errors import FormatError
from alignpred.kernels.fused import fused_post
from alignpred.kernels.quantize import dequant_add
from alignpred.kernels.quantize_ref import dequantize_residual


class StageTimer:
    """Decoder instrumentation: wall seconds and calls per stage, summed over every decode that
    runs with it (thread-safe; threads add their own time, so the sum can exceed the wall time).

    Stages: ``fetch`` (index look-up and CRC of payloads), ``entropy`` (rANS decoding),
    ``predict`` (base predictions: the exact map products), ``post`` (dequantise, interpolate,
    frame back, RoPE, cast), ``refine`` (the exact tier of a lossless file).

    >>> from alignpred import DecoderSession, StageTimer
    >>> timer = StageTimer()
    >>> session = DecoderSession(timer=timer)     # every KvzReader(..., session=session) reports to it
    >>> sorted(timer.seconds)
    ['entropy', 'fetch', 'post', 'predict', 'refine']
    """

    STAGES = ("fetch", "entropy", "predict", "post", "refine")

    def __init__(self):
        self._lock = threading.Lock()
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.calls = dict.fromkeys(self.STAGES, 0)

    @contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.seconds[name] += dt
                self.calls[name] += 1

    def reset(self) -> None:
        with self._lock:
            for k in self.STAGES:
                self.seconds[k], self.calls[k] = 0.0, 0


_NO_TIMER = nullcontext()


class _Buffers:
    """The float32 ``[rows, d]`` block buffers of one :meth:`Decoder.decode_range`: a block's
    prediction is written into the reconstruction of an earlier block that no later block reads
    (fresh memory costs a page fault per 4 KiB on first touch: ~1.7 us each on a 2-core VM, 20k
    of them per 2,048-token decode).  Only arrays made here come back (``mine``, held until the
    range is done), so a buffer is never one that anything else still reads."""

    def __init__(self, shape):
        self.shape = shape
        self.free: list = []
        self.mine: dict = {}

    def take(self) -> np.ndarray:
        if self.free:
            return self.free.pop()
        a = np.empty(self.shape, np.float32)
        self.mine[id(a)] = a
        return a

    def give(self, a) -> None:
        if a is not None and self.mine.get(id(a)) is a:
            self.free.append(a)


_AHEAD_MAX_BYTES = 32 << 20   # symbols a range may decode ahead (int32); larger ranges decode in turn
_AHEAD_KEEP = 2                # buffers kept for later decodes
_ahead_free: list = []
_ahead_lock = threading.Lock()


def _take_ahead_buffer(n_values: int) -> np.ndarray:
    """An int32 buffer of at least ``n_values`` for symbols decoded ahead, reused across decodes
    (fresh pages cost a fault each; a one-object range of Gemma 3 270M needs 9.4 MB), never
    shared by two decodes at once: give it back with :func:`_give_ahead_buffer`."""
    with _ahead_lock:
        for i, b in enumerate(_ahead_free):
            if b.size >= n_values:
                return _ahead_free.pop(i)
    return np.empty(n_values, np.int32)


def _give_ahead_buffer(buf: np.ndarray) -> None:
    with _ahead_lock:
        if len(_ahead_free) < _AHEAD_KEEP:
            _ahead_free.append(buf)


class _SymbolsAhead:
    """The symbols of every tensor of a range, decoded in tensor order by another thread while
    this one predicts and reconstructs: a tensor's symbols depend on its payloads alone, so the
    entropy stage (and the payloads' checksums) overlap the rest.  :meth:`get` waits for tensor
    ``ti`` and raises its error, if any, in the caller's thread."""

    def __init__(self, work, n_tensors: int, pool):
        self._work = work
        self._ready = [threading.Event() for _ in range(n_tensors)]
        self._out: list = [None] * n_tensors
        self._stop = False
        self._future = pool.submit(self._run)

    def _run(self) -> None:
        for ti, ev in enumerate(self._ready):
            if self._stop:
                break
            try:
                self._out[ti] = (True, self._work(ti))
            except BaseException as e:   # handed to the consumer at this tensor, then stop
                self._out[ti] = (False, e)
                ev.set()
                break
            ev.set()

    def get(self, ti: int):
        self._ready[ti].wait()
        ok, value = self._out[ti]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Stop after the tensor in progress and wait for it (the buffer is the caller's again)."""
        self._stop = True
        self._future.result()


class Decoder(Chain):
    """Decode objects back to native tensors. ``timer``: an optional :class:`StageTimer`."""

    timer: StageTimer | None = None

    def _stage(self, name: str):
        return _NO_TIMER if self.timer is None else self.timer.stage(name)

    def check(self, metas: list) -> None:
        """Reject per-channel modes or model ids a decoder could not honour (corrupt header)."""
        lay = self.layout
        for ti, meta in enumerate(metas):
            layer, kind = lay.tensors()[ti]
            if meta.models.shape != (lay.kv_heads * lay.head_dim,) or \
                    int(meta.models.max(initial=0)) >= entropy.N_MODELS:
                raise FormatError(f"{meta.name}: invalid entropy model ids in header")
            if meta.modes.shape != (lay.kv_heads, lay.head_dim):
                raise FormatError(f"{meta.name}: invalid predictor modes in header")
            for h in range(lay.kv_heads):
                allowed = set(self.plans[Block(layer, kind, h).name].modes())
                if not set(np.unique(meta.modes[h]).tolist()) <= allowed:
                    raise FormatError(f"{meta.name}: predictor modes not available with this bank/config")

    def _symbols(self, models, fetch, ti: int, j0: int, j1: int, n_rows: int, what: str, q=None):
        """Symbols (channel-major ``[H*d, n_rows]``, as the entropy coder emits them; into ``q``
        when given), steps and zero flags per object, of objects ``j0..j1-1`` of tensor ``ti``."""
        lay = self.layout
        S = self.config.object_size
        start = j0 * S
        if q is None:
            q = np.empty((lay.kv_heads * lay.head_dim, n_rows), np.int32)
        deltas = np.empty(j1 - j0, np.float32)
        zero = np.zeros(j1 - j0, bool)
        runs: list = [(0, [], [])]   # (first column, payloads, widths) of consecutive coded objects
        with self._stage("fetch"):
            for j in range(j0, j1):
                entry, payload = fetch(ti, j)
                if entry.n_tokens != min(S, lay.n_tokens - j * S):
                    raise FormatError(f"{what}: object {j} has the wrong length")
                deltas[j - j0] = entry.delta
                if entry.flags & OBJ_ZERO:
                    zero[j - j0] = True
                    q[:, j * S - start:j * S - start + entry.n_tokens] = 0
                    runs.append((j * S - start + entry.n_tokens, [], []))
                else:
                    runs[-1][1].append(payload)
                    runs[-1][2].append(entry.n_tokens)
        with self._stage("entropy"):   # one entropy call per run (entropy.decode_objects)
            for c0, payloads, widths in runs:
                if payloads:
                    entropy.decode_objects(payloads, models, q.shape[0], widths, self.coder,
                                           q[:, c0:c0 + sum(widths)])
        return q, deltas, zero

    def _tensor_input(self, metas: list, fetch, ti: int, layer: int, j0: int, j1: int, n_rows: int, q):
        """What tensor ``ti`` (of ``layer``) takes that no prediction does: its symbols (into
        ``q``), the per-row steps, the zero-row mask and whether any row is zero."""
        meta = metas[ti]
        q, deltas, zero = self._symbols(meta.models, fetch, ti, j0, j1, n_rows, meta.name, q)
        delta_rows, zr = self.delta_rows(deltas, zero, j0 * self.config.object_size, n_rows, layer, meta.row_steps())
        return q, delta_rows, zr, bool(zero.any())   # any: once per tensor (zr.any() per block held the GIL)

    def decode_range(self, metas: list, fetch, j0: int, j1: int, layers=None, out=None, refine_fetch=None,
                     ahead=None):
        """Decode objects ``j0..j1-1`` of every tensor up to the last layer in ``layers`` (an
        iterable of layer indices; default all); yield ``(ti, name, array [kv_heads, rows, d])``
        for the tensors of ``layers``. ``fetch(tensor_index, object_index)`` returns ``(entry,
        payload)`` with ``entry`` having ``n_tokens``, ``flags`` and ``delta``. ``out(ti)``
        (optional) returns the array ``[kv_heads, rows, d]`` (a view into the caller's buffer, of
        the layout's dtype) to write tensor ``ti`` into; otherwise arrays are allocated. With
        ``refine_fetch`` (same contract, refinement objects) the exact tier is decoded: the coarse
        values refined to the original bits. ``ahead``: an executor with a free worker: the
        symbols of every tensor are decoded there, in tensor order, while this thread predicts and
        reconstructs (for a range of one object, where the objects cannot be split over threads;
        the same bits)."""
        lay = self.layout
        S = self.config.object_size
        H, d = lay.kv_heads, lay.head_dim
        wanted = set(range(lay.num_layers)) if layers is None else set(layers)
        last = max(wanted)
        n_rows = min(lay.n_tokens, j1 * S) - j0 * S
        layer_of = [layer for layer, _ in lay.tensors() if layer <= last]
        n_tensors = len(layer_of)
        n_values = n_tensors * H * d * n_rows
        needed = self.needed(wanted)
        if ahead is None or n_values * 4 > _AHEAD_MAX_BYTES or len(needed) < n_tensors:
            yield from self._tensors(metas, fetch, j0, j1, n_rows, wanted, last, out, refine_fetch, None, needed)
            return
        raw = _take_ahead_buffer(n_values)
        q_all = raw[:n_values].reshape(n_tensors, H * d, n_rows)

        def work(ti):
            return self._tensor_input(metas, fetch, ti, layer_of[ti], j0, j1, n_rows, q_all[ti])

        pre = _SymbolsAhead(work, n_tensors, ahead)
        try:
            yield from self._tensors(metas, fetch, j0, j1, n_rows, wanted, last, out, refine_fetch, pre, needed)
        finally:
            pre.close()   # the other thread is done with the buffer before it is reused
            _give_ahead_buffer(raw)

    def needed(self, layers) -> frozenset:
        """The tensor indices a decode of ``layers`` reconstructs: their own and, transitively, those
        their predictions read (the plans' ``sources``: cross-layer and K->V maps). Without maps a
        layer needs only its own tensors, so a decode of some layers reads and decodes nothing else
        (the same bits: a tensor's reconstruction depends only on the tensors it is predicted from).
        """
        key = frozenset(int(i) for i in layers)
        memo = self.__dict__.setdefault("_needed_memo", {})
        got = memo.get(key)
        if got is None:
            lay = self.layout
            ts = lay.tensors()
            of_block = {Block(layer, kind, h).name: ti for ti, (layer, kind) in enumerate(ts)
                        for h in range(lay.kv_heads)}
            need = {ti for ti, (layer, _) in enumerate(ts) if layer in key}
            todo = list(need)
            while todo:
                layer, kind = ts[todo.pop()]
                for h in range(lay.kv_heads):
                    for src in self.plans[Block(layer, kind, h).name].sources:
                        ti = of_block[src]
                        if ti not in need:
                            need.add(ti)
                            todo.append(ti)
            got = memo[key] = frozenset(need)
        return got

    def _tensors(self, metas, fetch, j0: int, j1: int, n_rows: int, wanted: set, last: int, out, refine_fetch, pre,
                 needed=None):
        """:meth:`decode_range`'s tensor loop (``pre``: symbols decoded ahead, or None; ``needed``:
        the tensors to reconstruct, :meth:`needed`; None: every one up to ``last``)."""
        lay = self.layout
        S = self.config.object_size
        H, d = lay.kv_heads, lay.head_dim
        start = j0 * S
        recon: dict = {}
        q_buf = None if pre is not None else np.empty((H * d, n_rows), np.int32)   # every tensor's in turn
        bufs = _Buffers((n_rows, d))
        exact = self.config.arith == "exact"
        for ti, (layer, kind) in enumerate(lay.tensors()):
            if layer > last:
                break
            if needed is not None and ti not in needed:
                continue
            meta = metas[ti]
            if pre is not None:
                q, delta_rows, zr, any_zero = pre.get(ti)
            else:
                q, delta_rows, zr, any_zero = self._tensor_input(metas, fetch, ti, layer, j0, j1, n_rows, q_buf)
            emit = layer in wanted

            dst: Any = None
            final: Any = None  # the caller's buffer where the refinement needs the native dtype first
            if emit:
                dst = out(ti) if out is not None else np.empty((H, n_rows, d), self.frame.out_dtype)
                if refine_fetch is not None and dst.dtype != self.frame.out_dtype:  # it refines native bits
                    final, dst = dst, np.empty((H, n_rows, d), self.frame.out_dtype)
            for h in range(H):
                blk = Block(layer, kind, h)
                plan = self.plans[blk.name]
                m = meta.modes[h]
                buf = bufs.take() if exact else None
                with self._stage("predict"):
                    base = plan.predict(m, recon, n_rows, out=buf)
                if base is not buf:
                    bufs.give(buf)
                qh = q[h * d:(h + 1) * d]
                if exact:
                    with self._stage("post"):
                        rec = self._block_exact(base, qh, delta_rows, zr if any_zero else None, m, blk, start,
                                                dst[h] if emit else None, meta.channel_steps(h, d))
                    if plan.block in self._last_use:
                        recon[blk.name] = rec
                    else:
                        bufs.give(rec)
                    for a in self.prune(recon, blk.name):
                        bufs.give(a)
                    continue
                rec = dequant_add(base, qh, delta_rows)
                interp = np.nonzero(m & INTERP)[0]
                if len(interp):  # odd rows of interpolated channels depend on their even neighbours
                    wh = dequantize_residual(qh[interp].T, delta_rows, np.ones(len(interp), bool), S)
                    rec[:, interp] = base[:, interp] + wh
                if any_zero:
                    rec[zr] = self.frame.zero_image(blk)
                if plan.block in self._last_use:
                    recon[blk.name] = rec
                if emit:
                    x = self.frame.to_native(rec, blk, start)
                    if any_zero:
                        x[zr] = 0
                    dst[h] = x
                self.prune(recon, blk.name)
            if emit:
                if refine_fetch is not None:
                    with self._stage("refine"):
                        self._refine(dst, meta, refine_fetch, ti, j0, j1)
                if final is not None:
                    final[...] = dst
                    dst = final
                yield ti, meta.name, dst

    def _block_exact(self, base, qh, delta_rows, zr, modes, blk, start: int, dst, chan=None):
        """One block of a format-1.1 file in one fused pass (:func:`alignpred.kernels.fused.fused_post`):
        dequantise, interpolate, reconstruct (in place in ``base``), and — when ``dst`` is given
        — mean, RoPE, clip and cast straight into ``dst [rows, d]``; ``zr``: the zero rows' mask, or
        None when there are none. Returns the reconstruction."""
        plan = self.plans[blk.name]
        fr = self.frame
        n = base.shape[0]
        rec = np.ascontiguousarray(base, np.float32)
        native = dst if dst is not None and dst.dtype == fr.out_dtype else None
        if native is None:  # not emitted, or the caller's buffer has another dtype: cast afterwards
            native = np.empty((n, base.shape[1]), fr.out_dtype)
        fused_post(rec, qh, delta_rows, (modes & INTERP) != 0, self.config.object_size, plan.mean,
                   fr.rope_args(blk, start, n), fr.fmax, fr.out_dtype, rec=rec, native=native, chan=chan)
        if zr is not None:
            rec[zr] = fr.zero_image(blk)
            native[zr] = 0
        if dst is not None and native is not dst:
            dst[...] = native
        return rec

    def _refine(self, dst, meta, fetch, ti: int, j0: int, j1: int) -> None:
        """Refine the coarse values of tensor ``ti`` in ``dst [H, rows, d]`` to the exact bits:
        each object's symbols are coded channel-major with a model per context (the exponent of
        the coarse value, known here before the symbol)."""
        lay = self.layout
        S = self.config.object_size
        H, d = lay.kv_heads, lay.head_dim
        for j in range(j0, j1):
            entry, payload = fetch(ti, j)
            n = min(S, lay.n_tokens - j * S)
            if entry.n_tokens != n:
                raise FormatError(f"{meta.name}: refinement object {j} has the wrong length")
            if entry.flags & OBJ_ZERO:
                continue
            rows = slice(j * S - j0 * S, j * S - j0 * S + n)
            coarse = np.ascontiguousarray(dst[:, rows])  # [H, n, d]
            ctx = refine.contexts(coarse.transpose(0, 2, 1))
            r = entropy.decode_ctx(payload, meta.refine_models[ctx.reshape(-1)])
            dst[:, rows] = refine.apply(coarse, r.reshape(H, d, n).transpose(0, 2, 1))
