"""Where the AMX map kernel's time goes: its tile products timed whole and with parts taken out.

Usage: python -m kvz.benchmarks.amx_mix [--sources S] [--rows N] [--rounds R] [--out benchmarks/results/amx_mix.json]

The speed benchmark compares the map kernel with the core's integer peak (``tdpbssd`` counted as
int16 multiply-adds, a quarter of the int8 ones). This probe runs the product loop of
:func:`alignpred.kernels.intmap_amx._products` on the decoder's shape (``S`` sources of ``N`` x 256
rows into 256 columns, random 14-bit sources and 13-bit weights, one thread) four ways, the same loop
with parts removed:

* ``kernel``: the kernel itself (tile products, stores, the float64 epilogue);
* ``tiles``: the same tile loads, products and stores, no epilogue;
* ``products``: the tile products and stores only (no operand loads: the tiles hold stale bytes);
* ``products, 4 tiles``: as ``products`` with the two middle products in separate tiles (no
  product waits on the other's result).

Only ``kernel`` computes the prediction; the others are timing probes, their outputs unused. Each
row's GMAC/s counts the int16 multiply-adds of the whole product (``S N 256 256``), so the rows
compare directly with the speed benchmark's peak. Needs AMX (``alignpred.kernels.amx_enabled()``).
"""
from __future__ import annotations

import os
import time

import numpy as np
from numba import njit

from alignpred.kernels import intmap_amx as amx
from kvz.benchmarks.harness import code_revision, machine_info, parser, write_json, write_text

_dot_lh_apart = amx._make_dot("tdpbusd", 7, 4, 5)   # xl . wh into tile 7 instead of the middle tile
_zero_7 = amx._make_zero(7)
_store_7 = amx._make_move(True, 7)


def _config8() -> np.ndarray:
    cfg = amx.tile_config().copy()
    cfg[16:48].view(np.uint16)[7] = 64
    cfg[48 + 7] = 16
    return cfg


@njit(nogil=True)
def _probe(xh, xl, n, wh, wl, cfg, acc, loads, apart):
    """The tile loop of ``_products`` (every item, every source, every 64-channel step) without the
    epilogue; ``loads``: load the operand tiles; ``apart``: the xl.wh product into its own tile."""
    ngrp, kq = wh.shape[1], wh.shape[2]
    S = wh.shape[0]
    K64 = 4 * kq
    n16 = -(-n // 16) * 16
    xstride = np.int64(K64)
    src_bytes = n16 * K64
    w_src = ngrp * kq * 64
    amx._tile_config(cfg)
    for it in range((n16 // 16) * ngrp):
        g = it % ngrp
        t0 = 16 * (it // ngrp)
        for s in range(S):
            amx._zero_hh()
            amx._zero_mid()
            amx._zero_ll()
            if apart:
                _zero_7()
            xo = s * src_bytes + t0 * K64
            wo = s * w_src + g * kq * 64
            for k in range(K64 // 64):
                if loads:
                    amx._load_xh(xh, xo + 64 * k, xstride)
                    amx._load_xl(xl, xo + 64 * k, xstride)
                    amx._load_wh(wh, wo + 1024 * k, np.int64(64))
                    amx._load_wl(wl, wo + 1024 * k, np.int64(64))
                amx._dot_hh()
                amx._dot_hl()
                if apart:
                    _dot_lh_apart()
                else:
                    amx._dot_lh()
                amx._dot_ll()
            ab = np.int64(4096 * (S * (it & 1) + s))
            amx._store_hh(acc, ab, np.int64(64))
            amx._store_mid(acc, ab + 1024, np.int64(64))
            amx._store_ll(acc, ab + 2048, np.int64(64))
            if apart:
                _store_7(acc, ab + 3072, np.int64(64))
    amx._tile_release()


def _best(fn, rounds: int) -> float:
    fn()
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def run(S: int, n: int, rounds: int) -> dict:
    from alignpred.kernels.intmap_block import aligned_empty

    if not amx.amx_enabled():
        raise SystemExit("AMX is not available here (alignpred.kernels.amx_enabled() is False)")
    K = m = 256
    rng = np.random.default_rng(0)
    wq = rng.integers(-4095, 4096, size=(S, K, m)).astype(np.int16)
    wh, wl = amx.amx_weights(wq)
    w_exp = rng.integers(-20, -10, size=(S, m)).astype(np.int32)
    xq = rng.integers(-8191, 8192, size=(S, n, K)).astype(np.int16)
    x_exp = rng.integers(-20, -10, size=(S, n)).astype(np.int32)
    out = np.empty((n, m), np.float32)
    xh, xl, acc = amx._scratch(S, n, K)
    amx._split(xq, xh, xl)
    acc8 = aligned_empty((2 * S * 4096,), np.int8)
    cfg8 = _config8()
    macs = S * n * K * m
    ways = {
        "kernel": lambda: amx._products(xh, xl, x_exp, wh, wl, w_exp, out, amx._CFG, acc),
        "tiles": lambda: _probe(xh, xl, n, wh, wl, amx._CFG, acc8, True, False),
        "products": lambda: _probe(xh, xl, n, wh, wl, amx._CFG, acc8, False, False),
        "products, 4 tiles": lambda: _probe(xh, xl, n, wh, wl, cfg8, acc8, False, True),
    }
    rows = []
    for name, fn in ways.items():
        s = _best(fn, rounds)
        rows.append({"way": name, "ms": s * 1e3, "gmacs": macs / s / 1e9})
    return {"revision": code_revision(), "machine": machine_info(()), "sources": S, "rows": n,
            "rounds": rounds, "macs": macs, "results": rows}


def markdown(res: dict, peak: float | None = None) -> str:
    lines = [f"# AMX map kernel: where the time goes (revision {res['revision']})", "",
             f"{res['sources']} sources x {res['rows']} rows x 256 -> 256 columns, one thread, best of "
             f"{res['rounds']}; `python -m kvz.benchmarks.amx_mix`. GMAC/s counts int16 multiply-adds.", "",
             "| way | ms | GMAC/s |" + (" share of peak |" if peak else ""),
             "|---|---:|---:|" + ("---:|" if peak else "")]
    for r in res["results"]:
        lines.append(f"| {r['way']} | {r['ms']:.3f} | {r['gmacs']:.0f} |" +
                     (f" {r['gmacs'] / peak:.0%} |" if peak else ""))
    if peak:
        lines += ["", f"Peak: {peak:.1f} GMAC/s (`tdpbssd`, int16 equivalent), from the speed benchmark's run "
                      "given with `--peak-from`."]
    return "\n".join(lines) + "\n"


def _peak(path: str | None) -> float | None:
    if not path:
        return None
    from kvz.benchmarks.harness.output import read_json

    p = ((read_json(path).get("bound") or {}).get("int_peak") or {}).get("peak_gmacs")
    return float(p) if p else None


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--sources", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--peak-from", default=None, help="a speed benchmark JSON whose measured peak to compare with")
    ap.add_argument("--out", default="benchmarks/results/amx_mix.json")
    a = ap.parse_args(argv)
    if a.sources < 1 or a.rows < 16 or a.rounds < 1:
        ap.error("--sources >= 1, --rows >= 16 and --rounds >= 1")
    res = run(a.sources, a.rows, a.rounds)
    peak = _peak(a.peak_from)
    res["peak_gmacs"] = peak
    write_json(res, a.out)
    md = markdown(res, peak)
    write_text(os.path.splitext(a.out)[0] + ".md", md)
    print(md)
    return res


if __name__ == "__main__":
    main()
