"""Section 7: a cProfile of one single-thread decode, and how fast one thread could decode if
everything but the exact map products were free (the decoder's own stage timer, no patching)."""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import time

import numpy as np

from ..harness import ROOT
from .codecs import KvzCodec
from .dot_peak import dot_peak


def profile_decode(codec: KvzCodec, top: int = 15) -> dict:
    """cProfile of one single-thread ``read()``: the functions with the most own time."""
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    codec.decode(1)
    pr.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(pr, stream=io.StringIO())
    total = st.total_tt  # type: ignore[attr-defined]
    entries = []
    for (fname, line, func), (_, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        short = os.path.relpath(fname, ROOT) if fname.startswith(ROOT) else os.path.basename(fname)
        entries.append({"function": f"{short}:{line}({func})", "calls": nc, "own_s": tt, "cum_s": ct,
                        "own_share": tt / total if total else 0.0})
    entries.sort(key=lambda e: -e["own_s"])
    cum = sorted(entries, key=lambda e: -e["cum_s"])
    return {"wall_s_profiled": wall, "total_own_s": total, "top_own": entries[:top],
            "top_cumulative": [e for e in cum if "alignpred" in e["function"]][:top]}


def map_shapes(layout, bank) -> list[tuple[int, int, int, int]]:
    """``(sources, rows, d_in padded, d_out padded)`` of every exact map product a whole-file read of
    ``layout`` runs with ``bank`` (the factored maps' second product included), from the bank's maps
    prepared as the decoder prepares them (:class:`alignpred.kernels.IntMap`)."""
    from alignpred.kernels import IntMap

    shapes = []
    for blk in layout.blocks():
        srcs = bank.sources(blk.name)
        f = bank.map_factors(blk.name)
        if f is None or not srcs:
            continue
        u, vt = f
        for w, n_src in ((u, len(srcs)), (vt, 1)):
            if w is not None:
                m = IntMap(np.asarray(w, np.float32), n_src)
                shapes.append((n_src, layout.n_tokens, 2 * m.panels.shape[2], -(-m.d_out // 16) * 16))
    return shapes


def bound_section(codec: KvzCodec, reps: int = 5) -> dict:
    """How fast a one-thread decode can be with exact map products on this core.

    One single-thread ``read()`` runs ``reps`` times with a :class:`alignpred.StageTimer` on its
    session; its ``predict`` stage (quantising the sources and the exact integer map products) is
    the map products' time, and their multiply-adds are counted from the bank's maps
    (``sources x d_in x d_out`` per row, padding included, :func:`map_shapes`). Next to them, in the
    same process, torch's bf16 GEMM on the same shapes (oneDNN, one thread; ``vdpbf16ps``/AMX where
    the CPU has them) is the reference for the core's dot-product peak. The bound: the read's
    values / (its multiply-adds / peak rate) is the values/s a decode would reach if everything but
    the map products were free. Also: the map kernel's own time (one profiled read) and both rates
    as shares of the core's integer dot-product peak (:func:`~.dot_peak.dot_peak`)."""
    from alignpred import DecoderSession, KvzReader, StageTimer

    timer = StageTimer()
    session = DecoderSession(timer=timer)
    walls = []
    arrays: dict = {}
    for _ in range(reps):
        timer.reset()
        t0 = time.perf_counter()
        arrays = KvzReader(codec.data, bank=codec.bank, session=session, threads=1).read()
        walls.append((time.perf_counter() - t0, timer.seconds["predict"]))
    shapes = map_shapes(codec.cache.layout, codec.bank)
    n_values = sum(np.asarray(a).size for a in arrays.values())
    macs = sum(S * n * K2 * m for S, n, K2, m in shapes)
    wall, t_maps = sorted(walls)[len(walls) // 2]
    out = {"values": n_values, "macs": macs, "macs_per_value": macs / n_values, "read_s": wall,
           "map_products_s": t_maps, "kernel_gmacs": macs / t_maps / 1e9, "map_share": t_maps / wall,
           "rest_s": wall - t_maps, "rest_ns_per_value": (wall - t_maps) / n_values * 1e9,
           "shapes": sorted(set(shapes)), "stage_s": dict(timer.seconds)}
    # the integer products alone (the kernel's own time in one profiled read) against the core's
    # integer dot-product peak (register-only vpdpwssd / vpmaddwd chains)
    prof = profile_decode(codec, top=1000)
    # the vector kernel (intmap_block._map_predict) or, where AMX runs, intmap_amx._predict_rows (the
    # tile products with the sources' quantisation into byte planes fused into the same call, so
    # on AMX this own time over-counts the products: the share is a lower bound there)
    own = sum(e["own_s"] for e in prof["top_own"]
              if "_map_predict" in e["function"] or ("intmap_amx" in e["function"] and (
                  "(_products)" in e["function"] or "(_predict_rows)" in e["function"])))
    if own > 0:
        out["map_kernel_s"], out["map_kernel_gmacs"] = own, macs / own / 1e9
    from alignpred.kernels import amx_enabled

    out["map_kernel"] = "amx" if amx_enabled() else "vector"
    out["int_peak"] = dot_peak()
    ip = out["int_peak"].get("peak_gmacs")
    if ip:
        out["stage_share_of_int_peak"] = out["kernel_gmacs"] / ip
        if own > 0:
            out["kernel_share_of_int_peak"] = out["map_kernel_gmacs"] / ip
    try:
        import torch
    except ImportError:
        out["bf16_reference"] = None
        return out
    nt = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = 0.0
        for S, n, K2, m in out["shapes"]:
            a = torch.randn(n, S * K2).to(torch.bfloat16)
            b = torch.randn(S * K2, m).to(torch.bfloat16)
            a @ b
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(5):
                    a @ b
                ts.append((time.perf_counter() - t0) / 5)
            best = max(best, n * S * K2 * m / min(ts) / 1e9)
    finally:
        torch.set_num_threads(nt)
    out["bf16_reference"] = {"gmacs": best, "torch": torch.__version__}
    peak = max(best, out["kernel_gmacs"])
    out["peak_gmacs"] = peak
    out["map_floor_s"] = macs / (peak * 1e9)
    out["max_vps_maps_only"] = n_values / out["map_floor_s"]
    return out
