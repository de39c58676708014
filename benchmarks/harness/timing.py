"""Timing on a shared machine: interleaved rounds (every method once per round, the order rotated),
medians of wall and CPU time, a thread pool for "all threads" baselines, and a CPU probe that says
how much CPU the process actually got."""
from __future__ import annotations

import gc
import math
import resource
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .machine import loadavg, thread_counts


def median(xs) -> float:
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else math.nan


def median_time(fn, repeats: int, clock=time.perf_counter) -> float:
    """Median of ``repeats`` timed calls of ``fn()`` (seconds by ``clock``)."""
    ts = []
    for _ in range(max(1, repeats)):
        t0 = clock()
        fn()
        ts.append(clock() - t0)
    return median(ts)


def children_cpu() -> float:
    """CPU seconds of the subprocesses waited for so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


@dataclass
class Op:
    """One timed operation: ``fn()`` is called once per round it takes part in."""

    codec: str
    op: str  # encode | decode | decode_into | ...
    threads: int
    fn: Callable[[], Any]
    rounds: int | None = None  # None: every round
    walls: list = field(default_factory=list)
    cpus: list = field(default_factory=list)


def warm_cores(seconds: float, threads: int | None = None) -> None:
    """Keep ``threads`` cores (default: all this process may use) busy for ``seconds`` with GIL-free
    numpy work. On a VM a core left idle for ~0.1 s comes back slowly (measured on the 2-vCPU Xeon
    this suite was written on: a 2-thread decode took 104 ms after 0.15 s idle, 76 ms after 30 ms of
    this), which would charge a multi-threaded op for the single-threaded ops timed before it."""
    import numpy as np

    n = threads or max(thread_counts())
    deadline = time.perf_counter() + seconds

    def spin(_=None):
        a = np.ones(1 << 16, np.float64)
        while time.perf_counter() < deadline:
            np.sqrt(a, out=a)

    pmap(n, spin, range(n))


def run_interleaved(ops: list[Op], rounds: int, label: str = "", log: Callable[[str], None] | None = None,
                    warm_s: float = 0.0) -> None:
    """Run every op once per round, the order rotated (and reversed every other round) so that a noisy
    stretch of a shared machine hits all methods alike; walls and CPU times are appended to each op.
    ``warm_s``: before each op (untimed) every core is kept busy that long (:func:`warm_cores`), so
    each op starts on cores at speed."""
    n = len(ops)
    for r in range(rounds):
        order = ops[r % n:] + ops[:r % n] if n else []
        if r % 2:
            order = order[::-1]
        for op in order:
            if op.rounds is not None and r >= op.rounds:
                continue
            gc.collect()
            if warm_s > 0:
                warm_cores(warm_s)
            k0, c0, t0 = children_cpu(), time.process_time(), time.perf_counter()
            op.fn()
            op.walls.append(time.perf_counter() - t0)
            op.cpus.append(time.process_time() - c0 + children_cpu() - k0)  # + subprocesses waited for
        if label and log is not None:
            log(f"{label}: round {r + 1}/{rounds} done (load {loadavg()})")


def timing(walls, cpus) -> dict:
    """Medians and the runs of a timed op."""
    return {"wall_s": median(walls), "cpu_s": median(cpus), "wall_runs": [round(x, 5) for x in walls],
            "cpu_runs": [round(x, 5) for x in cpus], "repeats": len(walls)}


_POOLS: dict[int, ThreadPoolExecutor] = {}


def pmap(threads: int, fn: Callable, items) -> list:
    """``[fn(x) for x in items]``, on a pool of ``threads`` threads when ``threads > 1``."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-pool")
    return list(pool.map(fn, items))


def cpu_probe(seconds: float = 0.4) -> dict:
    """How much CPU this process gets with 1 and with all threads of GIL-free work (single-thread BLAS
    products): ``cpu/wall`` near 1 and near the thread count on an idle machine. On a shared or
    throttled machine the all-threads share shows whether thread-scaling figures mean anything."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).random((300, 300))
    out = {}
    with threadpool_limits(1):
        reps = 1
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / 4:  # calibrate the work to about ``seconds`` per thread
            for _ in range(reps):
                a @ a
            reps *= 2
        reps = max(1, int(reps * seconds / max(time.perf_counter() - t0, 1e-3)))

        def work(_=None):
            for _ in range(reps):
                a @ a

        for n in thread_counts():
            c0, t0 = time.process_time(), time.perf_counter()
            pmap(n, work, range(n))
            w = time.perf_counter() - t0
            out[str(n)] = {"cpu_over_wall": (time.process_time() - c0) / w, "work_per_s": n * reps / w}
    ks = sorted(out, key=int)
    out["scaling"] = out[ks[-1]]["work_per_s"] / out[ks[0]]["work_per_s"]
    return out
