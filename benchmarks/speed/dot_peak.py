"""The core's integer dot-product peak, the reference for the map products' share of it.

``benchmarks/native/dot_peak.c`` (compiled here with ``gcc -O3 -march=native``, not part of the
package build) runs 12 independent register-only chains of the instructions the exact map kernel
lowers to: ``vpdpwssd`` zmm (AVX512-VNNI, 32 int16 multiply-adds each), ``vpmaddwd`` +
``vpaddd`` ymm (AVX2, 16), and AMX ``tdpbssd`` on six accumulator tiles (16 x 16 x 64 int8
multiply-adds each; counted as a quarter as many int16 ones, the four byte products the AMX map
kernel forms each int16 product from). The best of ``reps`` timed calls of each is its
throughput; the peak is the fastest the CPU (and, for AMX, the OS) allows."""
from __future__ import annotations

import ctypes
import os
import tempfile
import time

from ..harness.native import NATIVE

SOURCE = os.path.join(NATIVE, "dot_peak.c")
CHAINS = 12
#: label: (function, int16 multiply-adds per loop iteration). AMX counts a quarter of its int8
#: multiply-adds: the AMX map kernel forms each int16 product from four int8 tile products.
AMX = "tdpbssd (AMX-INT8), int16 equivalent"
PROBES = {"vpdpwssd zmm (AVX512-VNNI)": ("dot_peak_vnni512", CHAINS * 32),
          "vpmaddwd+vpaddd ymm (AVX2)": ("dot_peak_madd256", CHAINS * 16),
          AMX: ("dot_peak_amx_int8", 6 * 16 * 16 * 64 // 4)}
NO_ISA = -(2 ** 63)


def dot_peak(reps: int = 7, iters: int = 2_000_000) -> dict:
    """``{"probes": {instruction: GMAC/s or None}, "peak_gmacs", "instruction"}``, or
    ``{"error": why}`` when the probe cannot be built."""
    from ..harness.native import NativeUnavailable, build

    with tempfile.TemporaryDirectory(prefix="kvz-dot-peak-") as tmp:
        try:
            lib = ctypes.CDLL(build(tmp, source=SOURCE))
        except (NativeUnavailable, OSError) as e:
            return {"error": str(e)}
        probes: dict = {}
        for label, (fn, macs) in PROBES.items():
            f = getattr(lib, fn)
            f.restype, f.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int32]
            if f(1, 1) == NO_ISA:
                probes[label] = None
                continue
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                f(iters, 7)
                best = min(best, time.perf_counter() - t0)
            probes[label] = iters * macs / best / 1e9
    have = {k: v for k, v in probes.items() if v}
    if not have:
        return {"probes": probes, "error": "none of AVX512-VNNI, AVX2, AMX-INT8"}
    top = max(have, key=lambda k: have[k])
    return {"probes": probes, "peak_gmacs": have[top], "instruction": top, "chains": CHAINS, "iters": iters}
