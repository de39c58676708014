"""The C probes in ``benchmarks/native/`` (not part of the package build): compiled here with the
system ``gcc`` into a folder of the caller's, loaded through ctypes by the benchmark that uses them
(the speed benchmark's integer dot-product peak, the entropy-decode study's C ``lanes32`` decoder)."""
from __future__ import annotations

import os
import shutil
import subprocess

from .paths import ROOT

NATIVE = os.path.join(ROOT, "benchmarks", "native")
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC")


class NativeUnavailable(RuntimeError):
    """No C compiler (or no C source) to build a native probe with."""


def build(folder: str, extra=(), *, source: str) -> str:
    """Compile ``source`` (one of ``benchmarks/native``'s files) into ``folder``; the shared library's path."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise NativeUnavailable("gcc not found on PATH: the native probes cannot be built "
                                "(install gcc, e.g. `apt-get install gcc`)")
    if not os.path.exists(source):
        raise NativeUnavailable(f"C source {os.path.basename(source)} missing (not an editable install?)")
    stem = os.path.splitext(os.path.basename(source))[0]
    so = os.path.join(folder, f"{stem}{''.join(extra).replace('-', '_')}.so")
    r = subprocess.run([gcc, *CFLAGS, *extra, "-o", so, source], capture_output=True, text=True)
    if r.returncode != 0:
        raise NativeUnavailable(f"gcc failed:\n{r.stderr[-2000:]}")
    return so
