"""A timing probe of the AMX map kernel (:mod:`~alignpred.kernels.intmap_amx`): its tile loop
timed whole and with parts taken out, on the decoder's shape, to show where its time goes
(``python -m benchmarks.studies.speed.amx_mix`` reports it).

* ``kernel``: :func:`~alignpred.kernels.intmap_amx._products` itself (tile products, stores, the
  float64 epilogue);
* ``tiles``: the same tile loads, products and stores, no epilogue;
* ``products``: the tile products and stores only (no operand loads: the tiles hold stale bytes);
* ``products, 4 tiles``: as ``products`` with the two middle products in separate tiles (no
  product waits on the other's result);
* ``... sources joined``: as ``tiles`` / ``products``, but every source's products go into one
  set of accumulator tiles, zeroed and stored once per item instead of once per source.  This
  is the loop that a bitstream where sources share per-row and per-column exponents would allow.
  Today's maps scale each source on its own, so this loop does not compute their prediction.
* ``tiles, sources joined, operands in L1``: as ``tiles, sources joined``, with every tile load
  reading the same 1 KiB operand.  Nothing comes from L2, which shows what the loads cost.

Only ``kernel`` computes a prediction; the others are timing probes whose outputs are unused.
"""
from __future__ import annotations

import time

import numpy as np

from alignpred.kernels import intmap_amx as amx
from alignpred.kernels._jit import njit
from alignpred.kernels.intmap_block import aligned_empty

__all__ = ["amx_mix"]

_dot_lh_apart = amx._make_dot("tdpbusd", 7, 4, 5)   # xl . wh into tile 7 instead of the middle tile
_zero_7 = amx._make_zero(7)
_store_7 = amx._make_move(True, 7)


def _config8() -> np.ndarray:
    cfg = amx.tile_config().copy()
    cfg[16:48].view(np.uint16)[7] = 64
    cfg[48 + 7] = 16
    return cfg


@njit(cache=True, nogil=True)
def _probe(xh, xl, n, wh, wl, cfg, acc, loads, apart, joined=False, hot=False):
    """The tile loop of ``_products`` (every item, every source, every 64-channel step) without the
    epilogue; ``loads``: load the operand tiles; ``apart``: the xl.wh product into its own tile;
    ``joined``: zero and store the accumulators once per item, not once per source; ``hot``: every
    load reads the first operand (L1-resident)."""
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
            if s == 0 or not joined:
                amx._zero_hh()
                amx._zero_mid()
                amx._zero_ll()
                if apart:
                    _zero_7()
            xo = s * src_bytes + t0 * K64
            wo = s * w_src + g * kq * 64
            if hot:
                xo = wo = 0
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
            if joined and s < S - 1:
                continue
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


def amx_mix(sources: int = 3, rows: int = 2048, rounds: int = 30) -> list[dict]:
    """Best-of-``rounds`` time (``ms``) and int16 multiply-adds per second (``gmacs``) of each
    way (``kernel``, ``tiles``, ``products``, ``products, 4 tiles`` and the three *sources
    joined* ways; see the module docstring) on
    ``sources`` random sources of ``rows`` x 256 into 256 columns, in this thread.  Every way
    counts the same ``sources * rows * 256 * 256`` int16 multiply-adds (four tile byte products
    each).  RuntimeError
    where AMX does not run (:func:`~alignpred.kernels.intmap_amx.amx_enabled`)."""
    S, n = int(sources), int(rows)
    if not amx.amx_enabled():
        raise RuntimeError("AMX is not available here (alignpred.kernels.amx_enabled() is False)")
    if S < 1 or n < 16 or rounds < 1:
        raise ValueError("sources >= 1, rows >= 16 and rounds >= 1")
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
        "tiles, sources joined": lambda: _probe(xh, xl, n, wh, wl, amx._CFG, acc8, True, False, True),
        "products, sources joined": lambda: _probe(xh, xl, n, wh, wl, amx._CFG, acc8, False, False, True),
        "tiles, sources joined, operands in L1": lambda: _probe(xh, xl, n, wh, wl, amx._CFG, acc8, True, False,
                                                                 True, True),
    }
    out_rows = []
    for name, fn in ways.items():
        s = _best(fn, rounds)
        out_rows.append({"way": name, "ms": s * 1e3, "gmacs": macs / s / 1e9})
    return out_rows
