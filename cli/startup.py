"""Start-up and exit time of the ``kvz`` process (``kvz.cli.main`` uses these; imports nothing heavy).

What ``kvz decompress`` of a small file would otherwise spend outside kvz's own work: numba's
first-kernel probes (:func:`skip_numba_blas_probe`), tqdm where no bar is shown (:class:`NoBar`),
and the interpreter's teardown after numba (:func:`exit_process`).
"""
from __future__ import annotations

import os
import sys


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
