"""A KV pager: bring the full K/V of chosen layers x token ranges from ``.kvz`` files (or from a
raw cache) into the caller's preallocated numpy / CPU-torch buffers, layer by layer.

This is the file side of draft/verify serving (VeriCache, ``kvz.integrations.verify``): a serving
runtime keeps a compressed cache resident for drafting and calls the pager whenever a request
verifies, to page the request's full K/V into a staging buffer while the forward pass runs.

Design
------
* **Pages.** The unit of decoding and caching is a *page*: one 256-position object (the .kvz
  object size) of one layer, keys and values, in the source's dtype. A page is decoded once and
  kept in an LRU page store, so a later load of the same positions costs a copy, not a decode.
* **Only what is asked for.** A load of ``tokens=(a, b)``, ``layers=Ls`` decodes the objects
  covering ``[a, b)`` of the tensors of ``Ls`` - plus, for a .kvz source, the same objects of the
  layers below ``max(Ls)``, which cross-layer prediction needs (they are reconstructed in the
  coding frame, never copied out). Pages already resident are not decoded again. Every source
  counts the objects it fetched (``objects_decoded``, from :attr:`KvzReader.objects_decoded`),
  and :attr:`KvPager.stats` sums them, so a test can prove it.
* **Memory budget.** ``budget_bytes`` bounds the pager's own memory: resident pages plus pages
  reserved for decodes in flight (``stats["resident_bytes"] + stats["reserved_bytes"] <=
  budget_bytes`` always; ``peak_bytes`` records the maximum). Reservations are taken before a
  decode starts, evicting least-recently-used pages nobody is reading (pinned pages are never
  evicted). A stripe whose pages cannot be reserved is decoded *direct*: in the loading thread,
  layer by layer, each page copied into the caller's buffer and dropped - correct at any budget,
  budget 0 included, just without overlap or reuse.
* **Prefetch on a worker pool.** :meth:`KvPager.prefetch` reserves and queues decodes on a
  thread pool and returns at once (a handle with ``wait()``). Decodes are cooperative: a job
  decodes ``layer_chunk`` layers of its stripe and requeues itself, so the pool advances all
  stripes of a request roughly layer by layer (layer 0 of every stripe first).
* **Layer by layer.** :meth:`KvPager.layers` is a generator that yields ``(layer, key, value)``
  as soon as that layer of the whole range is in the caller's buffers; the decodes of higher
  layers continue on the pool meanwhile, so paging overlaps the forward pass of lower layers.
  ``out(layer)`` is called just before layer ``layer`` is written (buffers may be reused across
  layers once the previous layer is consumed).

Sources (:mod:`~kvz.integrations.pager.sources`: ``KvzSource``, a .kvz path / bytes / mmap at a
tier; ``ArraySource``, an uncompressed :class:`alignpred.Cache` or dict of arrays - exact by
definition) share one small protocol: ``layout``, ``object_size``, ``chained`` and
``decode(j0, j1, layers, count)``. The budget's bookkeeping is :mod:`~kvz.integrations.pager.budget`.

>>> import numpy as np
>>> kv = [(np.arange(2400, dtype=np.float32).reshape(2, 300, 4) + i, np.ones((2, 300, 4), np.float32))
...       for i in range(3)]
>>> pager = KvPager(budget_bytes=1 << 20, workers=2)
>>> pager.add("req0", ArraySource(kv))
>>> h = pager.prefetch("req0", tokens=(0, 300))                        # decode ahead, on the pool
>>> _ = h.wait()                                                         # (or go on: loads wait per page)
>>> kb = np.zeros((2, 50, 4), np.float32); vb = np.zeros_like(kb)
>>> for layer, k, v in pager.layers("req0", tokens=(250, 300), layers=[1, 2], out=lambda i: (kb, vb)):
...     pass                                                             # forward pass of `layer` here
>>> bool(np.array_equal(kb, kv[2][0][:, 250:300])), pager.stats["page_hits"]   # 2 objects x 2 layers
(True, 4)
>>> pager.close()
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from alignpred import KvzError
from alignpred.cache import as_numpy, numpy_dtype
from kvz.integrations.pager.budget import Page, PageBudget, Slot, kv_bytes, page_bytes
from kvz.integrations.pager.sources import ArraySource, KvzSource

__all__ = ["KvPager", "PrefetchHandle", "kv_bytes", "KvzSource", "ArraySource"]

class PrefetchHandle:
    """What :meth:`KvPager.prefetch` queued: ``pages`` queued, ``skipped`` (no room in the
    budget), ``resident`` (already there); :meth:`wait` blocks until the queued pages are in
    (re-raising a decode error)."""

    def __init__(self, pager, slots, skipped, resident):
        self._pager, self._slots = pager, slots
        self.pages, self.skipped, self.resident = len(slots), skipped, resident

    def done(self) -> bool:
        return all(s.done for s in self._slots)

    def wait(self, timeout: float | None = None) -> PrefetchHandle:
        p = self._pager
        with p._cond:
            t_end = None if timeout is None else time.monotonic() + timeout
            for s in self._slots:
                while not s.done:
                    left = None if t_end is None else t_end - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError("prefetch not finished")
                    p._cond.wait(left)
                if s.error is not None:
                    raise s.error
        return self


class KvPager:
    """Page full K/V from sources into caller buffers under a memory budget (see the module doc).

    ``budget_bytes``: bound on the pager's resident + reserved page bytes. ``workers``: decode
    threads. ``layer_chunk``: layers a job decodes before yielding its thread to other stripes.
    """

    def __init__(self, budget_bytes: int, workers: int = 2, layer_chunk: int = 1):
        if budget_bytes < 0 or workers < 1 or layer_chunk < 1:
            raise ValueError("budget_bytes >= 0, workers >= 1 and layer_chunk >= 1 required")
        self.workers = int(workers)
        self.layer_chunk = int(layer_chunk)
        self._sources: dict = {}
        self._budget = PageBudget(budget_bytes)  # pages keyed (key, j, layer)
        self._inflight: dict = {}  # (key, j, layer) -> Slot
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="kvz-pager")
        self._closed = False
        self._st = dict(objects_decoded=0, pages_decoded=0, page_hits=0, page_waits=0, page_misses=0,
                        direct_pages=0, evictions=0, prefetch_pages=0, prefetch_skipped=0, bytes_out=0,
                        loads=0, decode_seconds=0.0, wait_seconds=0.0)

    @property
    def budget_bytes(self) -> int:
        """The bound on resident + reserved page bytes (the figures themselves are in :attr:`stats`)."""
        return self._budget.budget_bytes

    # -- registry ---------------------------------------------------------------------------------
    def add(self, key, source) -> None:
        """Register ``source`` (a :class:`KvzSource`, :class:`ArraySource`, or anything a
        KvzSource accepts) under ``key``."""
        if not hasattr(source, "decode"):
            source = KvzSource(source)
        with self._cond:
            if key in self._sources:
                raise KeyError(f"source {key!r} already registered")
            self._sources[key] = source

    def source(self, key):
        return self._sources[key]

    def drop(self, key, close: bool = False) -> None:
        """Forget ``key``'s resident pages (pinned ones stay until released) and the source."""
        with self._cond:
            self._budget.forget(key)
            src = self._sources.pop(key, None)
        if close and src is not None:
            src.close()

    @property
    def stats(self) -> dict:
        with self._cond:
            s = dict(self._st)
            b = self._budget
            s["evictions"] = b.evictions  # counted by the budget
            s.update(resident_bytes=b.resident_bytes, reserved_bytes=b.reserved_bytes,
                     peak_bytes=b.peak_bytes, budget_bytes=b.budget_bytes, resident_pages=len(b.pages))
        return s

    def resident_pages(self) -> dict:
        """``{(key, object, layer): pins}`` of the resident pages, least recently used first (a snapshot)."""
        with self._cond:
            return {pk: pg.pins for pk, pg in self._budget.pages.items()}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no decode is in flight (True), or ``timeout`` seconds pass (False)."""
        t_end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._inflight:
                left = None if t_end is None else t_end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def reset_stats(self) -> None:
        with self._cond:
            for k in self._st:
                self._st[k] = 0.0 if isinstance(self._st[k], float) else 0
            self._budget.reset_peak()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._cond:  # jobs cancelled before they ran: release their loaders
            stuck = list(self._inflight.items())
        for (key, j, L), s in stuck:
            self._fail(key, {(j, L): s}, KvzError("pager closed"))
        for src in list(self._sources.values()):
            src.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- geometry ---------------------------------------------------------------------------------
    def _plan(self, key, tokens, layers):
        src = self._sources[key]
        lay = src.layout
        a, b = (0, lay.n_tokens) if tokens is None else (int(tokens[0]), int(tokens[1]))
        if not 0 <= a < b <= lay.n_tokens:
            raise KvzError(f"token range {a}..{b} is outside 0..{lay.n_tokens}")
        if layers is None:
            Ls = list(range(lay.num_layers))
        elif isinstance(layers, (int, np.integer)):
            Ls = [int(layers)]
        else:
            Ls = sorted({int(i) for i in layers})
        if not Ls or Ls[0] < 0 or Ls[-1] >= lay.num_layers:
            raise KvzError(f"layers must be in 0..{lay.num_layers - 1}")
        S = src.object_size
        return src, a, b, Ls, list(range(a // S, -(-b // S)))

    def _schedule(self, key, src, per_stripe: dict, pin: bool):
        """Reserve and queue decode jobs: ``per_stripe = {j: [missing layers]}``. Returns
        ``(slots {(j, L): slot}, stripes that did not fit)``."""
        slots, no_room = {}, []
        for j, Ls in per_stripe.items():
            pb = page_bytes(src, j)
            if not self._budget.reserve(pb * len(Ls)):
                no_room.append(j)
                continue
            new = {}
            for L in Ls:
                s = Slot(pb)
                if pin:
                    s.pins = 1
                self._inflight[(key, j, L)] = new[(j, L)] = s
            slots.update(new)
            job = _Job(self, key, src, j, Ls, new)
            self._pool.submit(job.step)
        return slots, no_room

    # -- jobs -------------------------------------------------------------------------------------
    def _deliver(self, key, j, layer, k, v, slot):
        with self._cond:
            self._budget.unreserve(slot.nbytes)
            self._inflight.pop((key, j, layer), None)
            slot.done = True
            if slot.error is None and (key in self._sources or slot.pins):  # a dropped key's pages go
                self._budget.admit((key, j, layer), Page(k, v, pins=slot.pins))
                self._st["pages_decoded"] += 1
            self._cond.notify_all()

    def _fail(self, key, slots: dict, error: BaseException):
        with self._cond:
            for (j, L), s in slots.items():
                if not s.done:
                    s.done, s.error = True, error
                    self._budget.unreserve(s.nbytes)
                    self._inflight.pop((key, j, L), None)
            self._cond.notify_all()

    def _count(self, n):
        with self._cond:
            self._st["objects_decoded"] += n

    # -- public loading ---------------------------------------------------------------------------
    def prefetch(self, key, tokens=None, layers=None) -> PrefetchHandle:
        """Queue decodes of the pages of ``tokens`` x ``layers`` that are neither resident nor in
        flight, as far as the budget allows (a stripe's missing pages fit whole or are skipped);
        returns at once."""
        src, a, b, Ls, js = self._plan(key, tokens, layers)
        with self._cond:
            per, resident = {}, 0
            for j in js:
                miss = []
                for L in Ls:
                    pk = (key, j, L)
                    if self._budget.touch(pk) is not None:
                        resident += 1
                    elif pk not in self._inflight:
                        miss.append(L)
                if miss:
                    per[j] = miss
            slots, no_room = self._schedule(key, src, per, pin=False)
            skipped = sum(len(per[j]) for j in no_room)
            self._st["prefetch_pages"] += len(slots)
            self._st["prefetch_skipped"] += skipped
        return PrefetchHandle(self, list(slots.values()), skipped, resident)

    def layers(self, key, tokens=None, layers=None, out=None):
        """Yield ``(layer, key_view, value_view)`` layer by layer (ascending) once that layer of
        ``tokens = (a, b)`` is in the caller's buffers. ``out(layer) -> (key_buf, value_buf)``
        (numpy arrays or CPU torch tensors, ``[kv_heads, b-a, head_dim]`` or with a leading 1,
        any float dtype: values are cast), or a dict ``{layer: (key_buf, value_buf)}``; without
        ``out`` new arrays of the source dtype are allocated."""
        src, a, b, Ls, js = self._plan(key, tokens, layers)
        lay, S = src.layout, src.object_size
        direct = {}
        with self._cond:
            self._st["loads"] += 1
            waits = {}  # (j, L) -> slot
            per = {}
            for j in js:
                miss = []
                for L in Ls:
                    pk = (key, j, L)
                    pg = self._budget.touch(pk)
                    if pg is not None:
                        pg.pins += 1
                        self._st["page_hits"] += 1
                    elif pk in self._inflight:
                        s = self._inflight[pk]
                        s.pins += 1
                        waits[(j, L)] = s
                        self._st["page_waits"] += 1
                    else:
                        miss.append(L)
                if miss:
                    per[j] = miss
                    self._st["page_misses"] += len(miss)
            slots, no_room = self._schedule(key, src, per, pin=True)
            waits.update(slots)
            for j in no_room:
                direct[j] = per[j]
        # direct stripes: decoded here, in step with the layers
        gens = {j: src.decode(j, j + 1, Ls_j, self._count) for j, Ls_j in direct.items()}
        pending: dict = {j: None for j in gens}
        held = {(j, L) for j in js for L in Ls if (j, L) not in waits and L not in direct.get(j, ())}
        try:
            for L in Ls:
                kb, vb = self._out(out, L, lay, b - a)
                for j in js:
                    lo, hi = max(a, j * S), min(b, (j + 1) * S)
                    dst = slice(lo - a, hi - a)
                    src_rows = slice(lo - j * S, hi - j * S)
                    if j in gens and L in direct[j]:
                        t0 = time.perf_counter()
                        while pending[j] is None or pending[j][0] < L:
                            pending[j] = next(gens[j])
                        _, pk_, pv_ = pending[j]
                        self._copy(kb, vb, pk_, pv_, src_rows, dst)
                        pending[j] = None
                        with self._cond:
                            self._st["direct_pages"] += 1
                            self._st["decode_seconds"] += time.perf_counter() - t0
                        continue
                    pg = self._wait_page(key, j, L, waits.get((j, L)))
                    try:
                        self._copy(kb, vb, pg.k, pg.v, src_rows, dst)
                    finally:
                        with self._cond:
                            pg.pins -= 1
                    held.discard((j, L))
                    waits.pop((j, L), None)
                yield L, kb, vb
        finally:  # unpin whatever this load still holds (early close, errors)
            with self._cond:
                for (j, L), s in waits.items():
                    if s.done:
                        pg = self._budget.pages.get((key, j, L))
                        if pg is not None and s.error is None:
                            pg.pins -= 1
                    else:
                        s.pins -= 1
                for j, L in held:
                    pg = self._budget.pages.get((key, j, L))
                    if pg is not None:
                        pg.pins -= 1

    def load(self, key, tokens=None, layers=None, out=None) -> None:
        """Page ``tokens`` x ``layers`` into ``out`` (see :meth:`layers`) and return when done."""
        for _ in self.layers(key, tokens, layers, out):
            pass

    def read(self, key, tokens=None, layers=None) -> dict:
        """``{layers.{i}.key|value: new array}`` in the source dtype (a convenience for tests)."""
        res = {}
        for L, k, v in self.layers(key, tokens, layers):
            res[f"layers.{L}.key"], res[f"layers.{L}.value"] = k, v
        return res

    # -- helpers ----------------------------------------------------------------------------------
    def _out(self, out, L, lay, n):
        want = (lay.kv_heads, n, lay.head_dim)
        if out is None:
            dt = numpy_dtype(lay.dtype)
            return np.empty(want, dt), np.empty(want, dt)
        pair = out(L) if callable(out) else out[L]
        res = []
        for buf in pair:
            arr = as_numpy(buf, writable=True)
            if arr.ndim == 4 and arr.shape[0] == 1:
                arr = arr[0]
            if arr.shape != want:
                raise KvzError(f"output buffer for layer {L} has shape {tuple(arr.shape)}, expected {want}")
            res.append(arr)
        return res[0], res[1]

    def _copy(self, kb, vb, k, v, src_rows, dst):
        kb[:, dst] = k[:, src_rows]
        vb[:, dst] = v[:, src_rows]
        with self._cond:
            self._st["bytes_out"] += kb[:, dst].nbytes + vb[:, dst].nbytes

    def _wait_page(self, key, j, L, slot) -> Page:
        pk = (key, j, L)
        with self._cond:
            if slot is None:
                return self._budget.pages[pk]  # pinned by this load: cannot have gone
            t0 = time.perf_counter()
            while not slot.done:
                self._cond.wait()
            self._st["wait_seconds"] += time.perf_counter() - t0
            if slot.error is not None:
                raise slot.error
            return self._budget.pages[pk]


class _Job:
    """Decode one stripe (object ``j``) of ``layers`` on the pool, ``layer_chunk`` layers per turn."""

    def __init__(self, pager: KvPager, key, src, j: int, layers, slots: dict):
        self.pager, self.key, self.src, self.j, self.layers, self.slots = pager, key, src, j, layers, slots
        self.gen: Any = None

    def step(self):
        p = self.pager
        try:
            t0 = time.perf_counter()
            if self.gen is None:
                self.gen = self.src.decode(self.j, self.j + 1, self.layers, p._count)
            for _ in range(p.layer_chunk):
                try:
                    L, k, v = next(self.gen)
                except StopIteration:
                    self._account(t0)
                    return
                p._deliver(self.key, self.j, L, k, v, self.slots[(self.j, L)])
            self._account(t0)
            if p._closed:
                raise KvzError("pager closed")
            p._pool.submit(self.step)
        except BaseException as e:  # noqa: BLE001 - handed to the loaders waiting on these pages
            p._fail(self.key, self.slots, e)

    def _account(self, t0):
        with self.pager._cond:
            self.pager._st["decode_seconds"] += time.perf_counter() - t0
