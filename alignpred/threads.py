"""kvz owns its thread pools: library thread pools (BLAS, OpenMP) are held to one thread inside
kvz's own calls, and kvz parallelises explicitly (``threads=``), so nothing oversubscribes the
cores and no result depends on a library's thread count.

>>> with blas_single_thread():
...     pass
"""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from alignpred.errors import FormatError

_CONTROLLER = None
_LOCK = threading.Lock()


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _controller():
    global _CONTROLLER
    with _LOCK:
        if _CONTROLLER is None:
            from threadpoolctl import ThreadpoolController

            _CONTROLLER = ThreadpoolController()
        return _CONTROLLER


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOL_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child inherits the pools but not their threads: work submitted to them would
    wait forever. Forget them (and re-create the locks, which a parent thread may have held at
    the fork); the child makes its own pools on first use."""
    global _POOL_LOCK, _LOCK, _CONTROLLER
    _POOLS.clear()
    _HELPERS.clear()
    _POOL_LOCK = threading.Lock()
    _LOCK = threading.Lock()
    _CONTROLLER = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def pool(n: int) -> ThreadPoolExecutor:
    """kvz's own worker threads (one pool per size, created on first use). Work given to them
    must release the GIL to run in parallel (kvz's numba kernels do, as do numpy's large ops)."""
    with _POOL_LOCK:
        p = _POOLS.get(n)
        if p is None:
            p = _POOLS[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvz")
        return p


def place_threads(n: int, setup) -> list:
    """Call ``setup(i)`` once in each thread of :func:`pool` ``(n)`` (``i`` = 0 .. n-1, one per
    thread: all n are started and held at a barrier until each has run its call), e.g. to pin
    thread ``i`` to a core or give it idle priority (on Linux, ``os.sched_setaffinity(0, ...)``
    and ``os.sched_setscheduler(0, ...)`` act on the calling thread). Returns the n results.
    Work given to the pool later runs on those threads (a pool never replaces a thread).

    >>> import threading
    >>> len(set(place_threads(2, lambda i: threading.get_ident())))
    2
    """
    p = pool(n)
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait(timeout=30)  # every task on a thread of its own
        return setup(i)

    return list(p.map(run, range(n)))


_HELPERS: list = []


def helper_pool() -> ThreadPoolExecutor:
    """kvz's threads for work that waits on nothing but its own input (a decode's symbols decoded
    ahead, :class:`~alignpred.codec.decoder.Decoder`): kept apart from :func:`pool`, whose work
    may wait on it, so that no wait can close a cycle (one per process, as many threads as the
    process may use cores)."""
    with _POOL_LOCK:
        if not _HELPERS:
            _HELPERS.append(ThreadPoolExecutor(max_workers=default_threads(), thread_name_prefix="kvz-helper"))
        return _HELPERS[0]


def stepwise(ctx, it):
    """Yield the items of ``it``, each produced inside a fresh context ``ctx()`` (left while the
    consumer holds the item, so a caller's own BLAS use between steps is not limited)."""
    it = iter(it)
    while True:
        with ctx():
            try:
                item = next(it)
            except StopIteration:
                return
        yield item


def lockstep(pool, gens, whole: bool = False):
    """Advance several decode generators together (one tensor each per step, in parallel).
    ``whole``: run each to its end first, in parallel, with no barrier between tensors (for a
    caller that takes every tensor before using any), then yield the steps."""
    if whole:
        runs = list(pool.map(list, gens))
        if any(len(r) != len(runs[0]) for r in runs):
            raise FormatError("decode groups went out of step")
        yield from (list(step) for step in zip(*runs))
        return
    sentinel = object()
    while True:
        results = list(pool.map(lambda g: next(g, sentinel), gens))
        if any(r is sentinel for r in results):
            if not all(r is sentinel for r in results):
                raise FormatError("decode groups went out of step")
            return
        yield results


@contextlib.contextmanager
def blas_single_thread():
    """Hold BLAS and OpenMP pools to one thread for the block (kvz's float products are small
    and many; a library pool fighting kvz's own threads made decode 16x slower)."""
    with _controller().limit(limits=1, user_api="blas"):
        yield


_ROWS = threading.local()


@contextlib.contextmanager
def split_rows(n: int):
    """Inside the block, kvz's row-independent kernels called from *this* thread (the exact map
    products, :meth:`alignpred.kernels.intmap.IntMap.predict`) split their rows over ``n`` of
    kvz's threads. Rows are independent (per-row scales), so the bits do not depend on ``n``.
    Other threads are not affected. (:class:`~alignpred.api.reader.KvzReader` does not use it:
    a hand-off per product cost more than it saved on the 2-core VMs measured; a one-object
    range decodes its symbols ahead on another thread instead.)

    >>> with split_rows(2):
    ...     row_threads()
    2
    >>> row_threads()
    1
    """
    prev = getattr(_ROWS, "n", 1)
    _ROWS.n = max(1, int(n))
    try:
        yield
    finally:
        _ROWS.n = prev


def row_threads() -> int:
    """The row split :func:`split_rows` set for this thread (1 outside it)."""
    return getattr(_ROWS, "n", 1)
