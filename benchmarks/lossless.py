"""Lossless storage of real KV caches: kvz's two-tier files against zstd and pcodec.

    python -m kvz.benchmarks.lossless [CACHES...] [--eps 0.004,0.01,0.0267] [--json OUT]

For each cache (default: the 2,048-token held-out caches in ``data/eval``, else the bundled
samples) and each coarse-tier eps: ``kvz compress --lossless`` (bundled bank), its total bits per
value, the coarse tier's bits per value (what a drafter reads alone) and its measured NRMSE; the
exact tier is checked to decode to the input bit for bit (with the default number of threads).
Next to them, in the same run, the lossless coders people would otherwise use on the same
tensors: zstd -19 (plain and byte-shuffled) and pcodec (``benchmarks/baselines/lossless.py``).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time


def run(paths, eps_list, bank="gemma-3-270m") -> list[dict]:
    import numpy as np

    from alignpred import KvzReader, compress, load_cache

    from .baselines import BASELINES

    rows = []
    for p in paths:
        c = load_cache(p)
        name = os.path.basename(p)
        n = c.layout.n_values
        for eps in eps_list:
            t0 = time.perf_counter()
            info = compress(c, None, eps=eps, bank=bank, lossless=True)
            enc = time.perf_counter() - t0
            r = KvzReader(info.data)
            s = r.summary()
            t0 = time.perf_counter()
            out = r.read()
            dec = time.perf_counter() - t0
            exact = all(np.array_equal(out[k].view(np.uint8), np.asarray(c.tensors[k]).view(np.uint8)) for k in out)
            coarse_bytes = s["tier_payload_bytes"]["coarse"]
            rows.append({"cache": name, "method": "kvz_lossless", "eps_coarse": eps, "bpv": info.bpv,
                         "coarse_bpv": 8 * coarse_bytes / n, "coarse_nrmse_max_tensor": info.nrmse_max_tensor,
                         "exact": exact, "encode_mvps": n / enc / 1e6, "decode_mvps": n / dec / 1e6})
            print(f"{name:<32} kvz --lossless eps {eps:<7} {info.bpv:6.3f} bpv (coarse tier {rows[-1]['coarse_bpv']:.3f}"
                  f" bpv, NRMSE {info.nrmse_max_tensor:.4f}); exact: {exact}", flush=True)
        tensors = dict(c.tensors)
        for m in ("zstd", "zstd_shuffle", "pcodec"):
            try:
                res = BASELINES[m].run(tensors, None, "tensor")
            except ImportError as e:
                print(f"{name:<32} {m}: not installed ({e})")
                continue
            rows.append({"cache": name, "method": m, "bpv": res.bpv, "exact": True})
            print(f"{name:<32} {m:<25} {res.bpv:6.3f} bpv", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("caches", nargs="*")
    ap.add_argument("--eps", default="0.004,0.01,0.0267", help="coarse-tier eps values (comma-separated)")
    ap.add_argument("--bank", default="gemma-3-270m")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                   "lossless.json"))
    a = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = a.caches or sorted(glob.glob(os.path.join(root, "data", "eval", "*.safetensors"))) \
        or sorted(glob.glob(os.path.join(root, "samples", "gemma3-270m", "*.safetensors")))
    rows = run(paths, [float(x) for x in a.eps.split(",")], a.bank)
    summary = {}
    for m in sorted({r["method"] + (f"@{r['eps_coarse']}" if "eps_coarse" in r else "") for r in rows}):
        sel = [r for r in rows if r["method"] + (f"@{r['eps_coarse']}" if "eps_coarse" in r else "") == m]
        summary[m] = {"bpv_mean": sum(r["bpv"] for r in sel) / len(sel), "caches": len(sel)}
        if "coarse_bpv" in sel[0]:
            summary[m]["coarse_bpv_mean"] = sum(r["coarse_bpv"] for r in sel) / len(sel)
    for m, s in summary.items():
        print(f"{m:<28} mean {s['bpv_mean']:.3f} bpv" + (f" (coarse {s['coarse_bpv_mean']:.3f})" if "coarse_bpv_mean" in s else ""))
    from alignpred.io import atomic_write

    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    atomic_write(a.json, [json.dumps({"command": "python -m kvz.benchmarks.lossless " + " ".join(argv or sys.argv[1:]),
                                      "rows": rows, "summary": summary}, indent=2).encode()])
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
