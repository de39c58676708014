"""Warm-up: every numba kernel a later compress or read needs is compiled, or loaded from numba's
on-disk cache, before the first request, so that no request waits for a compile.

numba compiles a kernel at its first call in a process (~25-40 s for all of kvz's on a fresh
machine) and keeps the result on disk (``cache=True``: next to the kernel's source, or in
``$NUMBA_CACHE_DIR``), where a later process loads it in milliseconds. :func:`warmup` has two ways:

* **run**: compress and read back a small synthetic cache in every requested mode (profile x
  lossy/lossless x dtype), which compiles or loads whatever those calls reach; then it writes a
  *manifest* beside numba's cache: the argument types of every kvz kernel version the codec
  called (not those only compiled into another kernel: their code is inside the caller's).
* **load**: where a manifest of the same request exists (same modes, shape, bank, kvz kernel
  sources, numba version and CPU target), only those kernel versions are loaded from numba's cache
  (no compress, no read: a fraction of the time). If any of them has to compile (the cache was
  deleted, or is stale) the run follows, so the result is never less than a run's.

Call it at engine start-up, or run ``kvz warmup`` once at install time, as the user that serves,
to fill the cache. The result says whether anything compiled (numba's compile events, not the time).

Kernels compile per argument *types* (dtypes, dimensions, memory layout), not per size, so a
small cache of the served model's layout covers every later size. What the warm-up does not touch
may still compile at first use: another input dtype (pass ``dtype``), another
:class:`~alignpred.codec.config.CodecConfig` (pass ``config``), the attention or weighted scopes.

numba checks a kernel's on-disk cache against that kernel's own source file only, not against
the files of the kernels it calls; kvz's tests drop the caches when any kernel source changes
(``tests/conftest.py``); an installed kvz has no edited sources. The manifest (a pickle, as numba's
own index files beside it) is keyed on all kernel sources.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import pickle
import sys
import threading
import time
import warnings

__all__ = ["warmup", "DEFAULT_BANK", "WARM_TOKENS", "kernel_dispatchers", "CompileWatch"]

DEFAULT_BANK = "gemma-3-270m"  # the bank shipped with kvz (its layout gives the default shape)
WARM_TOKENS = 64               # positions of the synthetic cache (kernels compile per type, not size)
_PROFILES = ("default", "balanced", "fast")
_MANIFEST_VERSION = 1
_LOCK = threading.Lock()       # one warm-up at a time: the compile counts are per process


def kernel_dispatchers() -> list:
    """Every numba dispatcher defined by kvz's modules imported so far (``alignpred.*``)."""
    from numba.core.dispatcher import Dispatcher

    out, seen = [], set()
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("alignpred."):
            continue
        for value in list(vars(mod).values()):
            if isinstance(value, Dispatcher) and id(value) not in seen and _is_kvz(value):
                seen.add(id(value))
                out.append(value)
    return out


def _is_kvz(dispatcher) -> bool:
    return str(getattr(dispatcher.py_func, "__module__", "")).startswith("alignpred.")


def _name(dispatcher) -> str:
    f = dispatcher.py_func
    return f"{f.__module__}.{f.__qualname__}"


class CompileWatch:
    """Records the numba compiles of kvz's kernels while it is entered, in every thread (numba's
    ``numba:compile`` event fires for a real compile only, never for a load from the on-disk cache);
    ``compiled``: ``module.function`` of each; ``nested``: ``(dispatcher, signature)`` of those
    compiled only as a callee of another kernel being compiled (its compiled code holds theirs).
    ``on_compile(name)``, if given, is called as each compile starts (in the compiling thread)."""

    def __init__(self, on_compile=None) -> None:
        self.on_compile = on_compile
        self.compiled: list[str] = []
        self._outer: set = set()
        self._inner: set = set()

    @property
    def nested(self) -> set:
        return self._inner - self._outer

    def __enter__(self) -> CompileWatch:
        from numba.core import event

        compiled, outer, inner, depth = self.compiled, self._outer, self._inner, threading.local()
        on_compile = self.on_compile

        class _Listener(event.Listener):
            def on_start(self, ev) -> None:
                d = (ev.data or {}).get("dispatcher")
                n = getattr(depth, "n", 0)
                depth.n = n + 1
                if d is not None and _is_kvz(d):
                    compiled.append(_name(d))
                    (inner if n else outer).add((id(d), tuple(ev.data.get("args") or ())))
                    if on_compile is not None:
                        on_compile(_name(d))

            def on_end(self, ev) -> None:
                depth.n = getattr(depth, "n", 1) - 1

        self._cm = event.install_listener("numba:compile", _Listener())
        self._cm.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._cm.__exit__(*exc)


def _synthetic(shape, dtype: str, seed: int = 0):
    """A random cache of ``shape`` ``(layers, kv_heads, tokens, head_dim)`` in ``dtype`` (numpy;
    bfloat16 from ml_dtypes), keys said to carry RoPE with Gemma 3's layer pattern (five
    sliding-window layers of base 1e4, then a full-attention one of base 1e6)."""
    import numpy as np

    from alignpred.cache import Cache
    from alignpred.cache.layout import numpy_dtype

    n_layers, heads, tokens, d = (int(v) for v in shape)
    rng = np.random.default_rng(seed)
    dt = numpy_dtype(dtype)
    kv = [tuple(rng.standard_normal((heads, tokens, d), dtype=np.float32).astype(dt) for _ in range(2))
          for _ in range(n_layers)]
    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(n_layers)]
    theta = [1e6 if "full" in t else 1e4 for t in types]
    return Cache.from_arrays(kv, {"keys_roped": True, "rope_theta": theta, "layer_types": types})


def _sources_digest() -> str:
    """sha256 over kvz's kernel sources (``alignpred/kernels``, ``alignpred/entropy``)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for sub in ("kernels", "entropy"):
        folder = os.path.join(root, sub)
        for f in sorted(os.listdir(folder)):
            if f.endswith(".py"):
                with open(os.path.join(folder, f), "rb") as fh:
                    h.update(f.encode() + b"\0" + fh.read())
    return h.hexdigest()


def _manifest_path(request: dict) -> str | None:
    """Where the manifest of ``request`` lives: beside the on-disk cache of kvz's kernels (None: no cache)."""
    import numba
    from numba.core.registry import cpu_target

    quantize = importlib.import_module("alignpred.kernels.quantize")  # (alignpred.kernels.quantize is a function)
    folder = quantize._dequant_add.stats.cache_path
    if folder is None:
        return None
    key = json.dumps({**request, "v": _MANIFEST_VERSION, "numba": numba.__version__, "sources": _sources_digest(),
                      "target": list(cpu_target.target_context.codegen().magic_tuple())}, sort_keys=True)
    return os.path.join(folder, f"kvz-warmup-{hashlib.sha256(key.encode()).hexdigest()[:24]}.pkl")


def _load(path: str, watch: CompileWatch) -> int | None:
    """Load the kernel versions a manifest lists; their number, or None (no manifest, or one that
    does not apply: a kernel not found, or one that had to compile)."""
    try:
        with open(path, "rb") as f:
            entries = pickle.load(f)
    except (OSError, pickle.PickleError, EOFError, AttributeError, ImportError, TypeError, ValueError):
        return None
    n0, n = len(watch.compiled), 0
    try:
        for module, qualname, sigs in entries:
            d = getattr(importlib.import_module(module), qualname)
            for sig in sigs:
                d.compile(sig)
                n += 1
    except Exception:  # noqa: BLE001 - a manifest that does not apply: run instead
        return None
    return n if len(watch.compiled) == n0 else None


def _save(path: str, nested: set) -> str | None:
    """Write the manifest: the kvz kernel versions of this process but those only ever compiled
    into another kernel (``nested``: loading them would cost time for nothing); an error message, or None."""
    from alignpred.io import atomic_write

    entries = []
    for d in kernel_dispatchers():
        sigs = [sig for sig in d.overloads if (id(d), tuple(sig)) not in nested]
        if sigs and d.stats.cache_path is not None and "." not in d.py_func.__qualname__:
            entries.append((d.py_func.__module__, d.py_func.__qualname__, sigs))
    try:
        atomic_write(path, [pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)])
    except OSError as e:
        return f"KvzWarning: could not write the warm-up manifest {path} ({e}); the next warm-up runs again"
    return None


def _run(names, lossless, dtypes, shape, b, eps, config, threads, watch, progress) -> list[dict]:
    from alignpred.api.reader import KvzReader
    from alignpred.api.writer import compress_bytes
    from alignpred.codec.budget import ErrorBudget
    from alignpred.codec.profiles import profile

    steps = []
    for dt in dtypes:
        cache = _synthetic(shape, dt)
        for name in names:
            for exact in ([False, True] if lossless else [False]):
                n0 = len(watch.compiled)
                t0 = time.perf_counter()
                blob = compress_bytes(cache, budget=ErrorBudget(eps=eps, lossless=exact), bank=b,
                                      profile=profile(name, trust_rope=True), config=config, threads=threads)
                t1 = time.perf_counter()
                r = KvzReader(memoryview(blob), bank=b, threads=threads)
                r.read()
                for _ in r.layers(tokens=(1, shape[2] - 1)):  # a range, layer by layer
                    pass
                if exact:
                    r.read(tier="coarse")
                t2 = time.perf_counter()
                step = {"step": f"{name} {'lossless' if exact else 'lossy'} {dt}", "profile": name, "lossless": exact,
                        "dtype": dt, "compress_s": t1 - t0, "read_s": t2 - t1, "seconds": t2 - t0,
                        "compiled": len(watch.compiled) - n0}
                steps.append(step)
                if progress is not None:
                    progress(step)
    return steps


def warmup(profiles=_PROFILES, lossless: bool = True, *, bank=None, shape=None, dtype="bfloat16",
           eps: float = 0.02, config=None, threads: int | None = None, full: bool = False, progress=None) -> dict:
    """Have every kernel that compress and read need in the given modes compiled or loaded in this
    process (see the module notes); returns what was done.

    ``profiles``: speed profiles (:mod:`alignpred.codec.profiles`) warmed lossy at ``eps``;
    ``lossless``: each of them also with the lossless tier. ``bank``: as :func:`alignpred.compress`
    (default: the bundled ``gemma-3-270m``). ``shape``: ``(layers, kv_heads, tokens, head_dim)``
    (default: the bank's layout and :data:`WARM_TOKENS` positions). ``dtype``: ``bfloat16``,
    ``float16`` or ``float32`` (the served cache's), or a sequence of them. ``config``/``threads``:
    as :func:`alignpred.compress`. ``full``: always run (never only load). ``progress(step)`` is
    called with each step's dict when it is done.

    Returns ``{"how": "loaded" | "run", "total_s", "steps": [{"step", "seconds", "compiled", ...}],
    "compiled": [kernels compiled here], "compile_count", "cache_loads" (kernel versions loaded from
    the on-disk cache), "cache_dirs", "uncached" (kernels with no on-disk cache), "manifest",
    "warnings" (as text; warnings raised during the run are caught on the main thread only), "numba",
    "shape", "bank"}``. A second call in the same process compiles
    nothing. A cache that cannot be written is a warning in the result, never an error.
    """
    t_all = time.perf_counter()
    # warnings.catch_warnings swaps process-wide state: entered in a thread (an engine's warm-up on
    # kvz's load thread), its exit restores what it saved and wipes any catch_warnings the main thread
    # entered meanwhile (and records the other threads' warnings as its own). So it records warnings
    # on the main thread only; elsewhere they go where the process sends them, and the report's
    # "warnings" holds only its own notes.
    record = threading.current_thread() is threading.main_thread()
    with _LOCK, (warnings.catch_warnings(record=True) if record else contextlib.nullcontext([])) as caught:
        if record:
            warnings.simplefilter("always")
        t0 = time.perf_counter()
        import numba

        import alignpred.api.reader  # noqa: F401  (what a request imports: timed as a step)
        import alignpred.api.writer  # noqa: F401
        from alignpred.bank.registry import resolve_bank
        from alignpred.codec.profiles import profile as _check_profile

        names = [profiles] if isinstance(profiles, str) else list(profiles)
        for name in names:
            _check_profile(name)
        dtypes = [dtype] if isinstance(dtype, str) else list(dtype)
        b = resolve_bank(DEFAULT_BANK if bank is None else bank)
        if shape is None:
            sig = b.signature
            shape = (sig["num_layers"], sig["kv_heads"], WARM_TOKENS, sig["head_dim"])
        shape = tuple(int(v) for v in shape)
        steps = [{"step": "import", "seconds": time.perf_counter() - t0, "compiled": 0}]
        request = {"profiles": names, "lossless": bool(lossless), "dtypes": dtypes, "shape": list(shape),
                   "bank": b.id, "eps": float(eps), "threads": threads,
                   "config": None if config is None else config.to_json()}
        before = {id(d): sum(d.stats.cache_hits.values()) for d in kernel_dispatchers()}
        notes: list[str] = []
        with CompileWatch() as watch:
            t0 = time.perf_counter()
            path = _manifest_path(request)
            loaded = None if full or path is None else _load(path, watch)
            if loaded is not None:
                how = "loaded"
                steps.append({"step": "load", "seconds": time.perf_counter() - t0, "compiled": 0, "kernels": loaded})
            else:
                how = "run"
                steps += _run(names, lossless, dtypes, shape, b, eps, config, threads, watch, progress)
                if path is not None:
                    err = _save(path, watch.nested)
                    if err:
                        notes.append(err)
        ds = kernel_dispatchers()
        loads = sum(sum(d.stats.cache_hits.values()) - before.get(id(d), 0) for d in ds)
        dirs = sorted({str(d.stats.cache_path) for d in ds if d.stats.cache_path is not None})
        uncached = sorted(_name(d) for d in ds if d.stats.cache_path is None)
    notes = [f"{w.category.__name__}: {w.message}" for w in caught] + notes
    if uncached:
        notes.append(f"KvzWarning: {len(uncached)} kvz kernels have no on-disk cache (numba found no writable cache "
                     "folder): they compile in every process; set NUMBA_CACHE_DIR to a writable folder")
    for w in caught:  # what was caught here is still the caller's to see
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return {"how": how, "total_s": time.perf_counter() - t_all, "steps": steps, "compiled": sorted(set(watch.compiled)),
            "compile_count": len(watch.compiled), "cache_loads": loads, "cache_dirs": dirs, "uncached": uncached,
            "manifest": path, "warnings": notes, "numba": numba.__version__, "shape": list(shape), "bank": b.id}
