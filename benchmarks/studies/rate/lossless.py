"""Lossless storage of real KV caches: kvz's two-tier files against zstd and pcodec.

    python -m benchmarks.studies.rate.lossless [CACHES...] [--eps 0.004,0.01,0.0267] [--json OUT]

For each cache (default: the 2,048-token held-out caches in ``data/eval``, else the bundled
samples) and each coarse-tier eps: ``kvz compress --lossless`` (bundled bank), its total bits per
value, the coarse tier's bits per value (what a drafter reads alone) and its measured NRMSE; the
exact tier is checked to decode to the input bit for bit (with the default number of threads).
Next to them, in the same run, the lossless coders people would otherwise use on the same
tensors: zstd -19 (plain and byte-shuffled) and pcodec (``benchmarks/baselines/lossless.py``).
"""
from __future__ import annotations

import os
import time

from kvz.benchmarks.harness import RESULTS, default_caches, parser, run_study


def measure(paths, eps_list, bank="gemma-3-270m") -> list[dict]:
    import numpy as np

    from alignpred import ErrorBudget, KvzReader, compress, load_cache
    from kvz.benchmarks.baselines import BASELINES

    rows = []
    for p in paths:
        c = load_cache(p)
        name = os.path.basename(p)
        n = c.layout.n_values
        for eps in eps_list:
            t0 = time.perf_counter()
            info = compress(c, None, budget=ErrorBudget(eps=eps, lossless=True), bank=bank)
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
    ap = parser(__doc__, caches="caches (default: data/eval/*.safetensors, else the bundled samples)",
                json="results JSON", json_default=os.path.join(RESULTS, "lossless.json"))
    ap.add_argument("--eps", default="0.004,0.01,0.0267", help="coarse-tier eps values (comma-separated)")
    ap.add_argument("--bank", default="gemma-3-270m")
    return run_study(ap, run, markdown, "studies.rate.lossless", argv or None, md=False, indent=2)


def run(a) -> dict:
    """kvz --lossless at each coarse eps of ``a.eps`` and the lossless baselines on ``a.caches``."""
    paths = default_caches(a.caches)
    rows = measure(paths, [float(x) for x in a.eps.split(",")], a.bank)
    summary = {}
    for m in sorted({r["method"] + (f"@{r['eps_coarse']}" if "eps_coarse" in r else "") for r in rows}):
        sel = [r for r in rows if r["method"] + (f"@{r['eps_coarse']}" if "eps_coarse" in r else "") == m]
        summary[m] = {"bpv_mean": sum(r["bpv"] for r in sel) / len(sel), "caches": len(sel)}
        if "coarse_bpv" in sel[0]:
            summary[m]["coarse_bpv_mean"] = sum(r["coarse_bpv"] for r in sel) / len(sel)
    for m, s in summary.items():
        print(f"{m:<28} mean {s['bpv_mean']:.3f} bpv" + (f" (coarse {s['coarse_bpv_mean']:.3f})" if "coarse_bpv_mean" in s else ""))
    return {"command": a.command, "rows": rows, "summary": summary}


def markdown(res: dict) -> str:
    lines = ["# Lossless storage: kvz's two-tier files against zstd and pcodec", "", f"`{res['command']}`", "",
             "| method | bpv (mean) | coarse tier bpv | caches |", "|---|---|---|---|"]
    lines += [f"| {m} | {s['bpv_mean']:.3f} | {s['coarse_bpv_mean']:.3f} | {s['caches']} |" if "coarse_bpv_mean" in s
              else f"| {m} | {s['bpv_mean']:.3f} | | {s['caches']} |" for m, s in res["summary"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
