"""The machine a benchmark ran on, its load, the code revision, and how many threads it may use."""
from __future__ import annotations

import ctypes
import os
import platform
import subprocess

from .paths import ROOT

THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
CODER_PACKAGES = ("pysz", "zfpy", "av", "zstandard", "pcodec", "numba")


def loadavg() -> list[float] | None:
    """The 1/5/15-minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_name() -> str:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return cpu


def usable_cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def package_versions(names) -> dict:
    """``{name: version}`` of the packages among ``names`` that import here."""
    out = {}
    for mod in names:
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            pass
    return out


def machine_info(packages=CODER_PACKAGES) -> dict:
    """CPU, cores, memory, Python/numpy and the versions of ``packages``."""
    import numpy as np

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "usable_cores": usable_cores(),
            "python": platform.python_version(), "numpy": np.__version__,
            "platform": f"{platform.system()} {platform.machine()}"}
    try:
        info["mem_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    versions = package_versions(packages)
    if versions:
        info["packages"] = versions
    return info


def code_revision() -> str | None:
    """``git describe``-style revision of the repository (with ``-dirty`` when tracked files differ), if any."""
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("-dirty" if dirty else "")) or None


def all_threads() -> int:
    """The thread count kvz uses by default (``alignpred.threads.default_threads``)."""
    from alignpred.threads import default_threads

    return default_threads()


def thread_counts(n_all: int | None = None) -> list[int]:
    """``[1, all]`` (just ``[1]`` on one core)."""
    n = all_threads() if n_all is None else n_all
    return sorted({1, max(1, int(n))})


def clean_env(extra: dict | None = None, pythonpath: str | None = None) -> dict:
    """The default environment (the thread variables of this process removed, so a parent that pinned
    them does not leak into a child's "default" run) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS and k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.update(extra or {})
    return env


def parse_env(spec: str) -> dict:
    """``"A=1 B=2"`` -> ``{"A": "1", "B": "2"}``."""
    return dict(kv.split("=", 1) for kv in spec.split())


def pin_threads(n: int) -> None:
    """Set the thread variables of BLAS, OpenMP and numba to ``n`` (before numpy and numba load; once they
    have loaded, :func:`limit_threads`)."""
    for k in THREAD_VARS:
        os.environ[k] = str(n)


def _openblas_set(n: int) -> list[str]:
    """OpenBLAS's own thread setter, found among the loaded libraries (no threadpoolctl)."""
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "blas" in line.lower() and ".so" in line})
    except OSError:
        libs = []
    how = []
    for lib in libs:
        try:
            dll = ctypes.CDLL(lib)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                    "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(dll, sym, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                how.append(f"openblas ({sym})")
                break
    return how


def limit_threads(n: int = 1) -> str:
    """Limit BLAS (and numba) threads to ``n`` at run time, so coders are timed per core and none of them spins
    extra threads on a shared machine. numpy may already be loaded, so the environment is not enough: use
    threadpoolctl if installed, else OpenBLAS's own setter found among the loaded libraries. Returns how."""
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[k] = str(n)
    how = []
    try:
        import numba
        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        how.append("numba")
    except Exception:
        pass
    try:
        from threadpoolctl import threadpool_limits
        threadpool_limits(n)
        return "+".join(how + ["threadpoolctl"])
    except ImportError:
        pass
    how += _openblas_set(n)
    return "+".join(how) or "environment only"
