"""Start-up and exit time of the ``kvz`` process (``kvz.cli.main`` uses these; imports nothing heavy).

What ``kvz decompress`` of a small file would otherwise spend outside kvz's own work: numba's
first-kernel probes (:func:`skip_numba_blas_probe`), tqdm where no bar is shown (:class:`NoBar`),
and the interpreter's teardown after numba (:func:`exit_process`). What it spends is measured,
not forced: :class:`StartupClock` (``kvz decompress --verbose``), and :func:`announce_compiles`
says on stderr when a command has to compile kvz's kernels (numba's cache empty).
"""
from __future__ import annotations

import os
import sys
import threading
import time

COMPILE_NOTE = ("kvz: compiling its numba kernels for this machine (once, 10-40 s; numba's cache keeps them "
                "for later runs; `kvz warmup` compiles them ahead)")


class NoBar:
    """A progress bar that shows nothing (what a disabled ``tqdm`` does)."""

    def update(self, n=1) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def skip_numba_blas_probe() -> None:
    """Start-up time of the CLI process: three things numba does at its first compile or cache
    load in a process that kvz's kernels never use, skipped in the CLI's process only (the library
    does not do this: it would change numba for a host application's own jitted code).

    * ``numba.np.arraymath``'s BLAS probe imports all of ``scipy.linalg`` (0.4 s on the project
      machine: more than decoding a 2,048-token cache), only to pick BLAS for
      ``np.cov``/``np.correlate`` in jitted code (``np.dot`` in jitted code still finds BLAS).
    * ``numba.core.typing.cffi_utils`` imports ``cffi`` and ``pycparser`` and builds an ``FFI``
      (0.05-0.08 s measured here) so that jitted code can call cffi functions.
    * ``numba.core.entrypoints.init_all`` reads the entry points of every installed distribution
      (0.02 s with 157 installed) to run ``numba_extensions`` hooks, which type third-party
      objects; kvz's kernels take numpy arrays and scalars only.

    The modules are imported with ``scipy.linalg`` and ``cffi`` hidden for the moment; both import
    normally afterwards.
    """
    hide = [m for m, user in (("scipy.linalg", "numba.np.arraymath"), ("cffi", "numba.core.typing.cffi_utils"))
            if m not in sys.modules and user not in sys.modules]  # (a module imported already stays as it is)
    for m in hide:
        sys.modules[m] = None  # type: ignore[assignment]  # import -> ImportError
    try:
        import numba.core.entrypoints
        import numba.core.typing.cffi_utils  # noqa: F401
        import numba.np.arraymath  # noqa: F401

        numba.core.entrypoints._already_initialized = True
    except Exception:  # a numba that does this differently: no harm, it imports again later
        pass
    finally:
        for m in hide:
            if m in sys.modules and sys.modules[m] is None:
                del sys.modules[m]


def exit_process(code) -> None:
    """Leave the process as ``sys.exit(code)`` does -- the same status (a non-int code printed on
    stderr, status 1; 120 if stdout cannot be flushed), other threads joined, ``atexit`` handlers
    run, stdout and stderr flushed -- but without the interpreter's teardown of every module and
    object, which after numba's first kernel load costs more than decoding a 2,048-token file
    (0.9 s on the loaded project machine: ``import numba`` + one cached kernel, then exit). Only
    the ``kvz`` process does this (:func:`kvz.cli.main.main`), never the library or ``cli`` called in-process;
    every file kvz writes is closed (and renamed into place) before its command returns."""
    import atexit
    import threading

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            if f is not None:
                f.flush()
        except Exception:
            status = 120
    os._exit(status)


def announce_compiles(stream=None):
    """From now on in this process, the first compile of one of kvz's numba kernels prints
    :data:`COMPILE_NOTE` on ``stream`` (stderr), once, as it starts (kernels loaded from numba's
    on-disk cache compile nothing and print nothing). Returns the
    :class:`alignpred.api.CompileWatch` counting them (``len(watch.compiled)``)."""
    from alignpred.api import CompileWatch

    said = threading.Event()

    def note(_name: str) -> None:
        if not said.is_set():
            said.set()
            print(COMPILE_NOTE, file=stream or sys.stderr, flush=True)

    watch = CompileWatch(on_compile=note)
    watch.__enter__()  # for the rest of the process: the kvz process exits after one command
    _WATCHES.append(watch)  # held here: a collected watch's listener would be unregistered
    return watch


_WATCHES: list = []


def process_age() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat``, 10 ms steps), or None."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupClock:
    """Where a command's time goes, for ``--verbose``: marks taken as it runs (the first of each
    name counts), reported as one line. Start-up is everything before decoding begins: the
    process (Python, the CLI's imports) up to this clock's creation, then each mark."""

    def __init__(self, watch=None) -> None:
        self.t0 = time.perf_counter()
        self.age0 = process_age()
        self.watch = watch
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.perf_counter())

    def report(self, what: str = "decode") -> str:
        """``start-up S s (process P s, imports I s, ...), then <what> D s ...; total T s``."""
        end = time.perf_counter()
        parts, last = [], self.t0
        if self.age0 is not None:
            parts.append(f"Python and the CLI {self.age0:.2f} s")
        for name, t in self.marks.items():
            parts.append(f"{name} {t - last:.2f} s")
            last = t
        before = (self.age0 or 0.0) + last - self.t0
        compiled = len(self.watch.compiled) if self.watch is not None else None
        kernels = ("" if compiled is None else
                   f" ({compiled} kernel compiles in it: numba's cache did not have them)" if compiled else
                   " (its first kernel calls load them from numba's cache; none compiled)")
        return (f"start-up {before:.2f} s ({', '.join(parts)}), then {what} {end - last:.2f} s{kernels}; "
                f"total {before + end - last:.2f} s")
