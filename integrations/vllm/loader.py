"""Layer-wise loads of the vLLM connector: read and decode stored blocks layer by layer in kvz's own
threads, while the engine's forward runs, each layer waited for only where the forward needs it.

One engine step's loads are a :class:`StepLoad`. ``start_load_kv`` makes it and returns at once; a
kvz thread (pinned to :func:`load_cores`) then, layer by layer and for every load of the step in
lock-step, decodes the layer from the stored run (:class:`LayerPrefetch` reads the layer's bytes
from the store ahead of the decode, on an I/O thread) and writes it into the engine's paged cache.
``wait_for_layer_load(layer)`` returns once that layer is in place for every load of the step.

Faults never reach the engine as wrong KV: a load whose read or decode fails (store down, an entry
evicted or cut short, a payload checksum) stops writing, and its blocks (with the later blocks of
its request) are reported through ``get_block_ids_with_load_errors`` so vLLM recomputes them. The
step has a deadline (``load_deadline_s``, from ``start_load_kv``): a wait that reaches it cancels
every load not yet complete — under the lock every write into the engine's cache takes, so no late
write can land on blocks that are being recomputed — and reports their blocks the same way.

>>> sorted(parse_cpus("0-2,5"))
[0, 1, 2, 5]
"""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .window import windowed_layers

__all__ = ["parse_cpus", "load_cores", "idle_cores", "LayerPrefetch", "LoadJob", "StepLoad"]


def parse_cpus(spec: str) -> set[int]:
    """CPU ids of a list like ``"0-3,6"`` (also ``"{0,1}"`` as in ``OMP_PLACES``, ``|`` between ranks)."""
    out: set[int] = set()
    for part in str(spec).replace("{", "").replace("}", "").replace("|", ",").split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            out.update(range(int(a), int(b) + 1))
        else:
            out.add(int(part))
    return out


def _cpu_setting(setting) -> set[int]:
    """A cores setting: a list of ids or a CPU list string."""
    return set(setting) if isinstance(setting, (list, tuple, set)) else parse_cpus(str(setting))


def _machine_cpus() -> set[int]:
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            with open(path) as f:
                got = parse_cpus(f.read().strip())
            if got:
                return got
        except (OSError, ValueError):
            pass
    return set(range(os.cpu_count() or 1))


def load_cores(setting=None) -> tuple[list[int], str]:
    """The cores kvz's load threads run on, and why: ``setting`` (a CPU list or a list of ids) when
    given; else the machine's cores that vLLM's CPU worker does not bind (``VLLM_CPU_OMP_THREADS_BIND``
    when it is a CPU list, else the worker's ``OMP_PLACES``); all of them are bound, the load shares
    the worker's cores (said in the reason)."""
    cpus = _machine_cpus()
    if setting not in (None, "", "auto"):
        chosen = _cpu_setting(setting) & cpus
        if chosen:
            return sorted(chosen), "load_cores setting"
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    bound: set[int] = set()
    why = ""
    try:
        if bind and bind[0].isdigit():
            bound, why = parse_cpus(bind), f"VLLM_CPU_OMP_THREADS_BIND={bind}"
        elif os.environ.get("OMP_PLACES"):
            bound, why = parse_cpus(os.environ["OMP_PLACES"]), "OMP_PLACES"
    except ValueError:
        bound = set()
    free = cpus - bound
    if bound and free:
        return sorted(free), f"cores not bound by the engine ({why})"
    return sorted(cpus), "all cores (the engine's binding is unknown or covers every core: shared)"


def idle_cores(setting, load: list[int]) -> tuple[list[int], str]:
    """The cores kvz's decode process may also use at idle priority, and why: by default (``None`` or
    ``"auto"``) the machine's cores that are not load cores (the engine's own: its forward sleeps
    there while it waits for a layer, and an idle-priority thread runs only then); ``"none"`` (or
    ``""``, ``False``, ``0``) for none; else a CPU list. Never a load core.

    >>> idle_cores("none", [1])
    ([], 'idle_cores setting: none')
    >>> idle_cores("0,1", [1])
    ([0], 'idle_cores setting')
    """
    if setting in (False, 0, "", "0", "none", "None"):
        return [], "idle_cores setting: none"
    cpus = _machine_cpus()
    if setting not in (None, "auto"):
        return sorted((_cpu_setting(setting) & cpus) - set(load)), "idle_cores setting"
    rest = sorted(cpus - set(load))
    return rest, ("the engine's cores, at idle priority" if rest else "none: the loads run on every core")


class LayerPrefetch:
    """A :class:`~alignpred.format.RangedSource` over a stored blob that reads the given spans
    (``[(offset, length)]``, in decode order) ahead on an I/O thread; a read inside a span waits for
    it (until ``deadline``, a ``time.monotonic()`` value), other reads go to the store directly.
    ``read_s``: seconds the I/O thread spent reading."""

    def __init__(self, blob, spans, deadline: float | None = None):
        self.blob = blob
        self.size = blob.size
        self.name = getattr(blob, "name", "<store entry>")
        self.spans = sorted(spans)
        self.deadline = deadline
        self._data: dict[int, memoryview] = {}
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._stop = False
        self.read_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kvz-load-io", daemon=True)
        self._thread.start()

    def _run(self):
        try:
            for off, n in self.spans:
                if self._stop:
                    return
                t0 = time.perf_counter()
                b = self.blob.read_range(off, n)
                self.read_s += time.perf_counter() - t0
                with self._cond:
                    self._data[off] = memoryview(b).cast("B")
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the decoding thread
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _span_of(self, offset: int, length: int):
        for off, n in self.spans:
            if off <= offset and offset + length <= off + n:
                return off
        return None

    def read_range(self, offset: int, length: int):
        at = self._span_of(offset, length)
        if at is None:
            return self.blob.read_range(offset, length)
        with self._cond:
            while at not in self._data:
                if self._error is not None:
                    raise self._error
                left = None if self.deadline is None else self.deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"{self.name}: the store did not deliver {length} bytes by the load deadline")
                self._cond.wait(left)
            data = self._data[at]
        return data[offset - at:offset - at + length]

    def close(self):
        self._stop = True
        try:
            self.blob.close()
        except Exception:  # noqa: BLE001
            pass


@dataclass
class LoadJob:
    """One segment of one request: decode ``tokens`` of stored run ``key`` into ``blocks``;
    on failure ``error_blocks`` (these blocks and the request's later loaded blocks) are recomputed."""

    req_id: str
    blocks: list
    error_blocks: list
    open_reader: object  # (deadline) -> (KvzReader, tokens (a, b), closer)
    out: object = None  # layer -> (key buffer, value buffer), as KvzReader.layers takes it (None: new arrays)
    starts: dict = field(default_factory=dict)  # layer -> first position to decode (kvz.integrations.vllm.window)
    gen: object = None
    closer: object = None
    failed: str | None = None
    done_layers: int = 0
    read_s: float = 0.0


@dataclass
class StepLoad:
    """The loads of one engine step (see the module docstring). ``write(job, layer, k, v)`` puts a
    decoded layer into the engine's cache; it is only called under ``write_lock`` and never after a
    cancel. ``switch_interval_s``: the interpreter's switch interval while the step runs (the
    forward's thread holds the GIL between its ops, and a decode needs it between kernels: at
    Python's 5 ms default a Python-busy thread cut a one-core 8K decode from 471 to 23 M values/s
    on a 2-core Xeon, at 0.0005 s to 78, at 0.0001 s to 165)."""

    jobs: list
    n_layers: int
    write: Callable[..., Any]
    deadline_s: float
    warn: Callable[..., Any] = print
    switch_interval_s: float | None = None  # the interpreter's switch interval while this step loads
    proc: Any = None  # the decode process's step (kvz.integrations.vllm.decode_worker), if it decodes
    started: float = field(default_factory=time.monotonic)
    ready: int = 0  # layers in place for every job still loading
    cancelled: bool = False
    finished: bool = False
    errors: set = field(default_factory=set)
    waits: int = 0
    blocked_s: float = 0.0
    decode_s: float = 0.0
    copy_s: float = 0.0
    layer_ready_s: list = field(default_factory=list)  # seconds after the start each layer was ready
    _cond: threading.Condition = field(default_factory=threading.Condition)
    write_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def deadline(self) -> float:
        return self.started + self.deadline_s

    def _fail(self, job: LoadJob, why: str) -> None:
        if job.failed is None:
            job.failed = why
            self.errors.update(int(b) for b in job.error_blocks)
            self.warn(f"kvz: loading {len(job.blocks)} stored blocks for {job.req_id} failed ({why}); "
                      "reported as load errors, recomputed")

    def run(self) -> None:
        """Decode every job layer by layer in lock-step (in kvz's load thread)."""
        before = sys.getswitchinterval()
        if self.switch_interval_s:
            sys.setswitchinterval(self.switch_interval_s)
        try:
            for job in self.jobs:
                try:
                    reader, tokens, job.closer = job.open_reader(self.deadline)
                    if job.starts and job.out is not None and not getattr(reader, "windowed", False):
                        job.gen = windowed_layers(reader, tokens, job.starts, job.out)
                    else:  # the decode process windows its loads itself
                        job.gen = iter(reader.layers(tokens=tokens, out=job.out))
                except Exception as e:  # noqa: BLE001 - a miss, recomputed
                    self._fail(job, f"{type(e).__name__}: {e}")
            for i in range(self.n_layers):
                for job in self.jobs:
                    if job.failed is not None or self.cancelled:
                        continue
                    t0 = time.perf_counter()
                    try:
                        li, k, v = next(job.gen)
                        if li != i:
                            raise RuntimeError(f"decoded layer {li} where layer {i} was due")
                    except Exception as e:  # noqa: BLE001
                        self._fail(job, f"{type(e).__name__}: {e}")
                        continue
                    t1 = time.perf_counter()
                    self.decode_s += t1 - t0
                    with self.write_lock:
                        if self.cancelled:
                            break
                        try:
                            self.write(job, i, k, v)
                        except Exception as e:  # noqa: BLE001
                            self._fail(job, f"writing into the engine's cache: {type(e).__name__}: {e}")
                            continue
                    self.copy_s += time.perf_counter() - t1
                    job.done_layers = i + 1
                with self._cond:
                    self.ready = i + 1
                    self.layer_ready_s.append(time.monotonic() - self.started)
                    self._cond.notify_all()
        finally:
            if self.switch_interval_s:
                sys.setswitchinterval(before)
            for job in self.jobs:
                if job.closer is not None:
                    try:
                        job.read_s = float(getattr(job.closer, "read_s", 0.0))
                        job.closer.close()
                    except Exception:  # noqa: BLE001
                        pass
            with self._cond:
                self.finished = True
                self._cond.notify_all()

    def wait(self, layer: int) -> None:
        """Until ``layer`` is in place for every job (or failed), or the deadline: then cancel."""
        t0 = time.monotonic()
        with self._cond:
            self.waits += 1
            ok = self._cond.wait_for(lambda: self.ready > layer or self.finished or self.cancelled,
                                     max(0.0, self.deadline - t0))
        self.blocked_s += time.monotonic() - t0
        if not ok:
            self.cancel(f"load deadline of {self.deadline_s:g} s passed at layer {layer}")

    def cancel(self, why: str) -> None:
        with self.write_lock:  # no write is in flight after this, and none starts
            if self.finished and all(j.failed is not None or j.done_layers == self.n_layers for j in self.jobs):
                return
            self.cancelled = True
            for job in self.jobs:
                if job.failed is None and job.done_layers < self.n_layers:
                    self._fail(job, why)
        with self._cond:
            self._cond.notify_all()

    def finish(self, waited_all: bool) -> set:
        """After the forward: the blocks to recompute. ``waited_all``: whether the forward waited for
        every layer (if not, the forward may have read a layer before it was loaded: every block
        loaded this step is reported)."""
        if not waited_all:
            with self._cond:
                self._cond.wait_for(lambda: self.finished, max(0.0, self.deadline - time.monotonic()))
            self.cancel("the forward did not wait for every layer")
            for job in self.jobs:
                self.errors.update(int(b) for b in job.error_blocks)
        else:
            self.cancel("unfinished after the forward")
        return set(self.errors)
