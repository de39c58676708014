"""kvz's decode process for the vLLM connector: loads decoded outside the engine's interpreter.

Why a process: the load thread shares the engine's GIL. The decode's kernels release it, but the
Python between them needs it back, and the forward's thread holds it between its own ops; at
Python's 5 ms switch interval a Python-busy thread cut a one-core 8K decode from 471 to 23 M
values/s (2-core Xeon). A process of its own, pinned to the load cores, has its own interpreter.

The parent (:class:`DecodeWorker`, in the engine) starts ``python -m
kvz.integrations.vllm.decode_worker FD`` with one end of a socket pair; the child opens the same
store (the store URL and the :class:`~kvz.integrations.vllm.store.BlockStore` settings), warms the
codec, and answers ``("ready", seconds, placement)``. Its decode threads: ``threads`` on the load cores, plus
one per *idle core* (the engine's own cores) at Linux's ``SCHED_IDLE`` priority, which runs only
while nothing else wants that core — on an engine core, while the forward sleeps waiting for a
layer. With idle cores each load's range is cut into :data:`SPLIT` parts per thread, taken as
threads come free, so the forward preempting an idle thread holds back one small part.

Per engine step the parent sends ``("step", sid,
[(segment, offset, tokens)], deadline, shm_name)``; the child opens each segment as the in-thread
path does (:meth:`BlockStore.open_segment`, the same checks), then, layer by layer and for every
load in lock-step, decodes into the shared-memory block at the load's ``offset`` (``[layers, 2,
kv_heads, tokens, head_dim]``, the engine's 16-bit dtype) and sends ``("layer", sid, j, i,
decode_s)``, or ``("fail", sid, j, why)``; ``("done", sid)`` ends the step. A ``("cancel", sid)``
from the parent stops it between layers. Deadlines are ``time.monotonic()`` values (one clock for
every process on Linux).

Faults stay misses: a child that dies, hangs past the deadline or answers out of protocol fails the
step's loads (recomputed by vLLM) and is not used again (the connector falls back to its load
thread, with one warning).
"""
from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

import numpy as np

logger = logging.getLogger("kvz.integrations.vllm")

#: seconds the parent waits for the child's warm-up (compiling from an empty numba cache included)
READY_TIMEOUT_S = 180.0
#: parts per decode thread of a load's range when idle cores are used (KvzReader's ``split``)
SPLIT = 4


def _layer_bytes(tokens: int, shape) -> int:
    _, H, d = shape
    return 2 * H * tokens * d * 2


class _Step:
    """The parent's side of one step: a per-load reader of the child's messages."""

    def __init__(self, worker: DecodeWorker, sid: int, loads: list, shm: SharedMemory, deadline: float):
        self.worker, self.sid, self.shm, self.deadline = worker, sid, shm, deadline
        self.loads = loads  # [(offset, tokens)]
        self.stash: dict = {}  # j -> [messages]
        self.done = False
        self.decode_s = 0.0

    def _next_for(self, j: int):
        while not self.stash.get(j):
            if self.done:
                raise RuntimeError("kvz decode process ended the step before this load's layers")
            msg = self.worker._recv(self.deadline)
            if msg[0] == "done" and msg[1] == self.sid:
                self.done = True
                continue
            if msg[1] != self.sid:  # a message of an earlier, cancelled step
                continue
            self.stash.setdefault(msg[2], []).append(msg)
        return self.stash[j].pop(0)

    def layers(self, j: int, n_layers: int):
        """Yield ``(layer, key, value)`` of load ``j``: torch views of the shared block, valid until
        the next step (the connector copies them into the paged cache at once)."""
        import torch

        off, n = self.loads[j]
        _, H, d = self.worker.shape
        dt = getattr(torch, self.worker.dtype)
        for i in range(n_layers):
            msg = self._next_for(j)
            if msg[0] == "fail":
                raise RuntimeError(msg[3])
            if msg[0] != "layer" or msg[3] != i:
                raise RuntimeError(f"kvz decode process: {msg[:4]} where layer {i} of load {j} was due")
            self.decode_s += float(msg[4])
            base = off + i * _layer_bytes(n, self.worker.shape)
            kv = torch.frombuffer(self.shm.buf, dtype=torch.int16, count=2 * H * n * d, offset=base).view(dt)
            kv = kv.view(2, H, n, d)
            yield i, kv[0], kv[1]

    def reader(self, j: int):
        """An object whose ``layers(tokens, out)`` yields load ``j``'s layers (what the load thread
        calls on a :class:`~alignpred.KvzReader`); ``out`` is not used: the layers are views."""
        step = self

        class _Reader:
            windowed = True  # the decode process applies the load's window starts itself

            def layers(self, tokens=None, out=None):
                return step.layers(j, step.worker.shape[0])

        return _Reader()

    def close(self) -> None:
        """Stop the child's work on this step (if any is left) and wait for its end."""
        if not self.done:
            try:
                self.worker._send(("cancel", self.sid))
                while not self.done:
                    msg = self.worker._recv(time.monotonic() + 5.0)
                    self.done = msg[0] == "done" and msg[1] == self.sid
            except Exception as e:  # noqa: BLE001 - a child that cannot finish is not used again
                self.worker.broken(f"did not end a cancelled step ({type(e).__name__}: {e})")


class DecodeWorker:
    """The engine's handle on kvz's decode process (see the module docstring).

    ``store_url``/``store_kw``: what :func:`kvz.integrations.kvstore.open_url` takes;
    ``store_settings``: :class:`~kvz.integrations.vllm.store.BlockStore`'s keyword arguments (plain
    values); ``cores``: the CPUs the child is pinned to; ``threads``: its decode threads there;
    ``idle_cores``: CPUs it also decodes on, one idle-priority thread each (see the module docstring);
    ``max_tokens``: the most tokens one step loads (the engine's ``max_model_len``): both shared
    blocks are made and their pages touched now, in both processes, not in the first hit (an 8K
    hit's first request took 1.34 s against 0.34 s once the blocks existed)."""

    def __init__(self, store_url, store_kw: dict, store_settings: dict, cores, threads: int = 1,
                 max_tokens: int | None = None, idle_cores=()):
        self.shape = tuple(store_settings["shape"])
        self.dtype = str(store_settings["dtype"])
        self.error: str | None = None
        self._warned = False
        self._sid = 0
        self._shms: list[SharedMemory | None] = [None, None]
        self._old: list = []
        self._lock = threading.Lock()
        parent, child = socket.socketpair()
        self._sock = parent
        self._conn = Connection(os.dup(parent.fileno()))
        env = dict(os.environ)
        env.setdefault("NUMBA_NUM_THREADS", str(max(1, threads) + len(idle_cores)))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvz.integrations.vllm.decode_worker", str(child.fileno())],
                                     pass_fds=[child.fileno()], env=env, stdin=subprocess.DEVNULL)
        child.close()
        names = []
        if max_tokens:
            names = [self._block(self.shape[0] * _layer_bytes(int(max_tokens), self.shape), i).name for i in (0, 1)]
        self._send(("init", store_url, dict(store_kw), dict(store_settings), sorted(cores), int(threads), names,
                    sorted(idle_cores)))
        msg = self._recv(time.monotonic() + READY_TIMEOUT_S)
        if msg[0] != "ready":
            raise RuntimeError(f"kvz decode process did not start: {msg}")
        self.warmup_s = float(msg[1])
        self.placement = msg[2] if len(msg) > 2 else []  # per decode thread: (cores, "normal" | "idle")

    # -- transport
    def _send(self, msg) -> None:
        self._conn.send(msg)

    def _recv(self, deadline: float):
        left = deadline - time.monotonic()
        if left <= 0 or not self._conn.poll(left):
            raise TimeoutError("the kvz decode process did not answer by the load deadline")
        return self._conn.recv()

    def broken(self, why: str) -> None:
        """Mark the child unusable (it is stopped); later steps decode in the load thread."""
        if self.error is None:
            self.error = why
        self.close()

    @property
    def alive(self) -> bool:
        return self.error is None and self.proc.poll() is None

    def _block(self, nbytes: int, slot: int) -> SharedMemory:
        """Shared block ``slot`` (steps alternate between two, so a step never decodes into the
        block the previous step's layers may still be copied from)."""
        cur = self._shms[slot]
        if cur is None or cur.size < nbytes:
            if cur is not None:
                self._old.append(cur)  # views of it may still be alive: freed at close
            cur = self._shms[slot] = SharedMemory(create=True, size=max(nbytes, 1 << 20))
            _touch(cur)
        return cur

    def submit(self, segments: list, deadline: float) -> _Step:
        """Start decoding ``segments`` ([(Segment, tokens)] or [(Segment, tokens, starts)], ``starts``
        as :func:`~kvz.integrations.vllm.window.windowed_layers` takes them); returns the step to
        read layers from."""
        with self._lock:
            L = self.shape[0]
            loads, off = [], 0
            for seg_n in segments:
                n = seg_n[1]
                loads.append((off, n))
                off += L * _layer_bytes(n, self.shape)
            self._sid += 1
            shm = self._block(off, self._sid % 2)
            self._send(("step", self._sid, [(x[0], o, x[1], dict(x[2]) if len(x) > 2 else {})
                                            for x, (o, _) in zip(segments, loads)], deadline, shm.name))
            return _Step(self, self._sid, loads, shm, deadline)

    def try_submit(self, segments: list, deadline: float, warn=print):
        """:meth:`submit`, or None (with a warning, once) where the process is gone or fails."""
        if not segments:
            return None
        if not self.alive:
            if not self._warned:
                warn(f"kvz: the decode process is gone ({self.error or 'exited'}); loads decode in the load thread")
                self._warned = True
            return None
        try:
            return self.submit(segments, deadline)
        except Exception as e:  # noqa: BLE001
            self.broken(f"{type(e).__name__}: {e}")
            return None

    def close(self) -> None:
        try:
            self._send(("quit",))
        except Exception:  # noqa: BLE001
            pass
        try:
            self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        for s in [*self._shms, *self._old]:
            if s is not None:
                try:
                    s.close()
                    s.unlink()
                except Exception:  # noqa: BLE001 - a view still alive: freed with the process
                    pass
        self._shms, self._old = [None, None], []
        try:
            self._conn.close()
            self._sock.close()
        except Exception:  # noqa: BLE001
            pass


def _touch(shm: SharedMemory) -> None:
    """Fault in every page of ``shm`` in this process (a write per 4 KiB page)."""
    assert shm.buf is not None
    np.frombuffer(shm.buf, np.uint8)[::4096] = 0


def start_worker(store_url, store_kw: dict, store_settings: dict, cores, threads: int, max_tokens: int,
                 warn=print, idle_cores=()) -> DecodeWorker | None:
    """A started :class:`DecodeWorker`, or None (with a warning) where it does not start."""
    try:
        w = DecodeWorker(store_url, store_kw, store_settings, cores, threads, max_tokens=max_tokens,
                         idle_cores=idle_cores)
    except Exception as e:  # noqa: BLE001 - loads decode in the load thread instead
        warn(f"kvz: the decode process did not start ({type(e).__name__}: {e}); loads decode in the load thread")
        return None
    logger.info("kvz: loads decode in kvz's process %d (threads on cores, priority: %s)", w.proc.pid, w.placement)
    return w


# ---------------------------------------------------------------------------------------- child
def _attach(name: str) -> SharedMemory:
    """The parent's block, without this process's resource tracker owning it (Python < 3.13 would
    unlink it when the child exits, and warn)."""
    shm = SharedMemory(name=name)
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        pass
    _touch(shm)
    return shm


def _place_threads(cores: list, threads: int, idle: list) -> list:
    """Pin kvz's decode threads in this process: ``threads`` on ``cores``, then one per ``idle``
    core at ``SCHED_IDLE`` (:func:`alignpred.threads.place_threads`). Returns each thread's
    ``(cores, priority)``; a placement the OS refuses leaves that thread as it was (said there)."""
    if not idle:
        return [(cores, "normal")] * max(1, threads)
    from alignpred.threads import place_threads

    n = max(1, threads)

    def setup(i: int):
        want = (cores, "normal") if i < n else ([idle[i - n]], "idle")
        try:
            os.sched_setaffinity(0, set(want[0]))
            if want[1] == "idle":
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError) as e:
            return (want[0], f"{want[1]} refused ({e})")
        return want

    return place_threads(n + len(idle), setup)


def _child(fd: int) -> int:
    from alignpred.cache import numpy_dtype
    from kvz.integrations.kvstore import open_url

    from .store import BlockStore
    from .window import windowed_layers

    conn = Connection(fd)
    _, url, store_kw, settings, cores, threads, names, idle = conn.recv()
    try:
        os.sched_setaffinity(0, set(cores))
    except (AttributeError, OSError):
        pass
    placement = _place_threads(list(cores), int(threads), list(idle))
    split = SPLIT if idle else 1
    threads = max(1, int(threads)) + len(idle)
    store = BlockStore(open_url(url, **store_kw), **settings)
    t0 = time.perf_counter()
    try:
        store.warmup()
    except Exception:  # noqa: BLE001 - decoding still works, compiling on first use
        pass
    L, H, d = store.shape
    dt = numpy_dtype(store.dtype)
    shms: dict = {name: _attach(name) for name in names}
    conn.send(("ready", time.perf_counter() - t0, placement))
    pending: collections.deque = collections.deque()  # messages read while a step ran

    def cancelled_now(sid) -> bool:
        while conn.poll():
            m = conn.recv()
            if m[0] == "quit":
                pending.appendleft(m)
                return True
            if m[0] == "cancel" and m[1] == sid:
                return True
            pending.append(m)
        return False

    while True:
        msg = pending.popleft() if pending else conn.recv()
        if msg[0] == "quit":
            return 0
        if msg[0] != "step":
            continue  # a cancel for a step already done
        _, sid, loads, deadline, shm_name = msg
        if shm_name not in shms:
            shms[shm_name] = _attach(shm_name)
        shm = shms[shm_name]
        gens, closers = {}, []
        for j, (seg, off, n, starts) in enumerate(loads):
            try:
                reader, tokens, src = store.open_segment(seg, deadline, threads, starts=starts)
                reader.split = split
                closers.append(src)
                block = np.ndarray((L, 2, H, n, d), dtype=dt, buffer=shm.buf, offset=off)
                gens[j] = windowed_layers(reader, tokens, starts, lambda i, b=block: (b[i, 0], b[i, 1]))
            except Exception as e:  # noqa: BLE001 - a miss, recomputed
                conn.send(("fail", sid, j, f"{type(e).__name__}: {e}"))
        for i in range(L):
            if cancelled_now(sid):
                break
            for j in list(gens):
                t1 = time.perf_counter()
                try:
                    li, _, _ = next(gens[j])
                    if li != i:
                        raise RuntimeError(f"decoded layer {li} where layer {i} was due")
                except Exception as e:  # noqa: BLE001
                    conn.send(("fail", sid, j, f"{type(e).__name__}: {e}"))
                    del gens[j]
                    continue
                conn.send(("layer", sid, j, i, time.perf_counter() - t1))
        for src in closers:
            try:
                src.close()
            except Exception:  # noqa: BLE001
                pass
        gens.clear()
        conn.send(("done", sid))


if __name__ == "__main__":
    sys.exit(_child(int(sys.argv[1])))
