"""What a serving loader pays: decoding 256-token chunks into preallocated buffers.

    python -m benchmarks.studies.speed.loader [CACHES...] [--bank gemma-3-270m] [--eps 0.0267] [--chunk 256]
                                    [--repeats 5] [--out benchmarks/results/loader.json]

For each cache (default: the bundled samples; ``data/eval`` 2,048-token caches when present) it
measures, side by side in one run:

* ``whole``: ``KvzReader.read()`` of the whole file (new arrays);
* ``whole_into``: the whole file decoded into preallocated buffers (``read_into``);
* ``ranges``: every 256-token range of the same file decoded into preallocated buffers
  (random access within one file);
* ``chunk_files``: the cache stored as separate 256-token ``.kvz`` files (each with its
  ``position_offset``, as a chunk store holds them), each opened from bytes and decoded into the
  buffers with one shared :class:`~alignpred.DecoderSession`: the per-file overhead a chunk store
  pays;

values/s (median of ``--repeats``), the per-chunk overhead against whole-file decode, and peak
memory (tracemalloc: numpy allocations) of decoding one layer of one chunk into the caller's
buffers, at 1–8 chunks so that a per-token slope (what grows with the chunk) is separated from the
fixed cost; the slope is compared with the raw size of one layer's K+V per token. ``read_into``
works ``TILE_TOKENS`` at a time on each thread, so memory grows up to one tile per thread and not
beyond it: the slope between the points of at least ``threads`` tiles
(``slope_beyond_tile_over_raw``; None with fewer than two such points) is the bound that counts.
Threads: one (pinned before numpy loads), so the figures are per core.
"""
from __future__ import annotations

import os

from kvz.benchmarks.harness import (
    RESULTS,
    default_caches,
    median_time,
    parser,
    pin_threads,
    resolve_bank,
    run_study,
)


def measure(path: str, bank, eps: float, chunk: int, repeats: int, threads: int = 1) -> dict:
    import tracemalloc

    import numpy as np

    from alignpred import Cache, DecoderSession, KvzReader, compress_bytes, load_cache

    c = load_cache(path)
    lay = c.layout
    T = lay.n_tokens
    blob = compress_bytes(c, budget=eps, bank=bank)
    session = DecoderSession(banks=[bank])
    r = KvzReader(blob, session=session, threads=threads)
    names = lay.tensor_names()
    dt = c.tensors[names[0]].dtype
    bufs = {n: np.empty((lay.kv_heads, T, lay.head_dim), dt) for n in names}
    r.read()  # warm up (kernels compiled, plans built)
    res = {"cache": os.path.basename(path), "tokens": T, "n_values": lay.n_values, "file_bytes": len(blob),
           "bpv": 8 * len(blob) / lay.n_values}
    res["whole_s"] = median_time(r.read, repeats)
    res["whole_into_s"] = median_time(lambda: r.read_into(bufs), repeats)
    starts = list(range(0, T, chunk))

    def ranges():
        for a in starts:
            b = min(T, a + chunk)
            r.read_into({n: bufs[n][:, a:b] for n in names}, tokens=(a, b))

    res["ranges_s"] = median_time(ranges, repeats)
    # separate chunk files, as a chunk store holds them
    files = []
    for a in starts:
        b = min(T, a + chunk)
        t = {n: np.ascontiguousarray(np.asarray(c.tensors[n])[..., a:b, :]) for n in names}
        meta = dict(c.metadata, position_offset=str(lay.position_offset + a))
        meta.pop("token_ids", None)
        files.append((a, b, compress_bytes(Cache.from_arrays(t, meta), budget=eps, bank=bank)))

    def chunk_files():
        for a, b, data in files:
            KvzReader(data, session=session, threads=threads).read_into({n: bufs[n][:, a:b] for n in names})

    chunk_files()
    res["chunk_files_s"] = median_time(chunk_files, repeats)
    res["chunk_files_bytes"] = sum(len(f[2]) for f in files)
    for k in ("whole", "whole_into", "ranges", "chunk_files"):
        res[f"{k}_mvps"] = lay.n_values / res[f"{k}_s"] / 1e6
    res["ranges_vs_whole"] = res["whole_s"] / res["ranges_s"]
    res["chunk_files_vs_whole"] = res["whole_s"] / res["chunk_files_s"]
    n_chunks = len(starts)
    res["overhead_per_chunk_ms"] = 1e3 * (res["chunk_files_s"] - res["whole_into_s"]) / n_chunks
    # peak memory of one layer's chunk (the last layer: every earlier one is decoded on the way)
    layer = lay.num_layers - 1
    kname, vname = f"layers.{layer}.key", f"layers.{layer}.value"
    peaks = []
    for k in sorted({1, 2, 4, min(8, n_chunks)}):
        n = min(T, k * chunk)
        out = {kname: np.empty((lay.kv_heads, n, lay.head_dim), dt), vname: np.empty((lay.kv_heads, n, lay.head_dim), dt)}
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        r.read_into(out, tokens=(0, n), layers=[layer])
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        peaks.append((n, peak))
    ns = np.array([p[0] for p in peaks], float)
    pk = np.array([p[1] for p in peaks], float)
    slope, fixed = np.polyfit(ns, pk, 1) if len(ns) > 1 else (pk[0] / ns[0], 0.0)
    from alignpred.api import TILE_TOKENS

    past = ns >= TILE_TOKENS * threads   # each thread works a tile of its own part of the range
    beyond = float(np.polyfit(ns[past], pk[past], 1)[0]) if past.sum() > 1 else None
    raw_per_token = 2 * lay.kv_heads * lay.head_dim * dt.itemsize  # one layer's K + V
    res["memory"] = {"layer": layer, "points": [{"tokens": int(n), "peak_bytes": int(p)} for n, p in peaks],
                     "slope_bytes_per_token": float(slope), "fixed_bytes": float(fixed),
                     "raw_layer_bytes_per_token": raw_per_token, "slope_over_raw": float(slope / raw_per_token),
                     "chunk_peak_over_raw": float(peaks[0][1] / (raw_per_token * peaks[0][0])),
                     "tile_tokens": TILE_TOKENS,
                     "slope_beyond_tile_over_raw": None if beyond is None else beyond / raw_per_token}
    return res


def main(argv=None):
    ap = parser(__doc__, caches="caches (default: data/eval/*.safetensors, else the bundled samples)",
                out="results JSON", out_default=os.path.join(RESULTS, "loader.json"))
    ap.add_argument("--bank", default="gemma-3-270m")
    ap.add_argument("--eps", type=float, default=0.0267)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    if a.threads < 1 or a.repeats < 1 or a.chunk < 1:
        ap.error("--threads, --repeats and --chunk must be >= 1")
    return run_study(ap, run, markdown, "studies.speed.loader", argv, args=a, out="out", md=False, indent=2)


def run(a) -> dict:
    """Every cache of ``a.caches`` measured (:func:`measure`), one row each."""
    pin_threads(a.threads)
    from alignpred import KvzError

    caches = default_caches(a.caches)
    bank = resolve_bank(a.bank)
    rows = []
    print(f"{'cache':<28} {'tokens':>6} {'whole':>7} {'into':>7} {'ranges':>7} {'chunks':>7}  Mvalues/s; "
          f"{'rng/whole':>9} {'chk/whole':>9} {'ms/chunk':>8} {'mem slope/raw':>13} {'past tile':>9}")
    for p in caches:
        try:
            row = measure(p, bank, a.eps, a.chunk, a.repeats, a.threads)
        except KvzError as e:
            a.error(str(e))
        rows.append(row)
        m = row["memory"]
        print(f"{row['cache']:<28} {row['tokens']:>6} {row['whole_mvps']:7.1f} {row['whole_into_mvps']:7.1f} "
              f"{row['ranges_mvps']:7.1f} {row['chunk_files_mvps']:7.1f}  {'':10} {row['ranges_vs_whole']:9.2f} "
              f"{row['chunk_files_vs_whole']:9.2f} {row['overhead_per_chunk_ms']:8.2f} {m['slope_over_raw']:13.2f} "
              f"{'-' if m['slope_beyond_tile_over_raw'] is None else format(m['slope_beyond_tile_over_raw'], '9.2f'):>9}",
              flush=True)
    return {"command": a.command, "eps": a.eps, "chunk": a.chunk, "threads": a.threads, "bank_id": bank.id,
            "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"# Loading chunks: `{res['command']}`", "",
             f"eps {res['eps']}, {res['chunk']}-token chunks, {res['threads']} thread(s); M values/s.", "",
             "| cache | tokens | read() | read_into | ranges | chunk files | ranges/whole | files/whole | ms per chunk "
             "| memory slope / raw |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cache']} | {r['tokens']} | {r['whole_mvps']:.1f} | {r['whole_into_mvps']:.1f} | "
              f"{r['ranges_mvps']:.1f} | {r['chunk_files_mvps']:.1f} | {r['ranges_vs_whole']:.2f} | "
              f"{r['chunk_files_vs_whole']:.2f} | {r['overhead_per_chunk_ms']:.2f} | "
              f"{r['memory']['slope_over_raw']:.2f} |" for r in res["rows"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
