"""Acceptance measurement of the codec on held-out real caches: bpv at a target error (tensor and
pooled scopes), the error measured independently by decoding, and encode/decode speed.

    python -m benchmarks.studies.rate.acceptance [CACHES...] [--bank gemma-3-270m] [--eps 0.0267] \
        [--out benchmarks/results/acceptance.json]

With no CACHES it uses ``data/eval/*.safetensors`` (2,048-token captures of held-out documents,
made by ``python samples/make_samples.py --what eval``); if there are none it stops and says how
to make them (``--samples`` runs on the bundled 448-token samples instead, and says so in the
output). Threads are pinned (``--threads``, default 1) before numpy loads, so speeds are per
core; decode speed is the median of ``--repeats`` decodes.
"""
from __future__ import annotations

import os
import sys

from kvz.benchmarks.harness import (
    NO_EVAL,
    RESULTS,
    eval_caches,
    parser,
    pin_threads,
    resolve_bank,
    run_study,
    sample_caches,
)


def main(argv=None):
    ap = parser(__doc__, caches="caches (default: data/eval/*.safetensors)",
                out="results JSON", out_default=os.path.join(RESULTS, "acceptance.json"))
    ap.add_argument("--bank", default="gemma-3-270m", help="bank file or registry name (default: the bundled one)")
    ap.add_argument("--samples", action="store_true", help="run on the bundled samples (not the held-out eval set)")
    ap.add_argument("--eps", type=float, default=0.0267)
    ap.add_argument("--scopes", default="tensor,pooled")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="decode this many times, report the median")
    return run_study(ap, run, markdown, "studies.rate.acceptance", argv, out="out", md=False, indent=2)


def run(a) -> dict:
    """bpv and measured error of every cache at ``a.eps`` in each of ``a.scopes``, decode timed."""
    pin_threads(a.threads)

    import platform
    import tempfile
    import time

    import numpy as np

    from alignpred import ErrorBudget, KvzReader, compress, load_cache

    if a.caches:
        caches, dataset = a.caches, "given"
    elif a.samples:
        caches, dataset = sample_caches(), "samples"
    else:
        caches, dataset = eval_caches(), "data/eval"
        if not caches:
            print(f"acceptance: {NO_EVAL} (needs the [model] extra), or pass --samples to run on the bundled samples",
                  file=sys.stderr)
            raise SystemExit(2)
    print(f"data set: {dataset} ({len(caches)} caches)", flush=True)
    bank = resolve_bank(a.bank)
    rows = []
    tmp = tempfile.mkdtemp()
    for path in caches:
        c = load_cache(path)
        for scope in a.scopes.split(","):
            out = os.path.join(tmp, "x.kvz")
            t0 = time.perf_counter()
            info = compress(c, out, budget=ErrorBudget(eps=a.eps, scope=scope), bank=bank)
            enc = time.perf_counter() - t0
            r = KvzReader(out, bank=bank)
            _ = r.decoder  # resolve the bank outside the timed region
            times = []
            for _ in range(a.repeats):  # median of a few decodes (the first also warms caches)
                t0 = time.perf_counter()
                dec = r.read()
                times.append(time.perf_counter() - t0)
            dect = float(np.median(times))
            num = den = 0.0
            worst = 0.0
            for name, x in c.tensors.items():
                x64 = np.asarray(x, np.float64)
                e = float(np.sum((np.asarray(dec[name], np.float64) - x64) ** 2))
                n = float(np.sum(x64 * x64))
                num, den = num + e, den + n
                worst = max(worst, (e / n) ** 0.5 if n else 0.0)
            row = {"cache": os.path.basename(path), "tokens": c.layout.n_tokens, "scope": scope, "eps": a.eps,
                   "bpv": info.bpv, "file_bytes": info.file_bytes, "n_values": info.n_values,
                   "nrmse_pooled": (num / den) ** 0.5, "nrmse_max_tensor": worst,
                   "encode_s": enc, "decode_s": dect, "encode_mvps": info.n_values / enc / 1e6,
                   "decode_mvps": info.n_values / dect / 1e6}
            rows.append(row)
            print(f"{row['cache']:<32} {scope:<7} {row['bpv']:6.3f} bpv  pooled {row['nrmse_pooled']:.5f}  "
                  f"worst tensor {row['nrmse_max_tensor']:.5f}  enc {row['encode_mvps']:5.1f} Mv/s  "
                  f"dec {row['decode_mvps']:5.1f} Mv/s", flush=True)
    summary = {}
    for scope in a.scopes.split(","):
        sel = [r for r in rows if r["scope"] == scope]
        summary[scope] = {"bpv_mean": float(np.mean([r["bpv"] for r in sel])),
                          "bpv_max": float(np.max([r["bpv"] for r in sel])),
                          "nrmse_max_tensor": float(np.max([r["nrmse_max_tensor"] for r in sel])),
                          "nrmse_pooled_max": float(np.max([r["nrmse_pooled"] for r in sel])),
                          "decode_mvps_min": float(np.min([r["decode_mvps"] for r in sel]))}
        print(f"{scope}: mean {summary[scope]['bpv_mean']:.3f} bpv, max {summary[scope]['bpv_max']:.3f} bpv")
    res = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads,
                       "python": sys.version.split()[0]},
           "dataset": dataset, "eps": a.eps, "bank_id": bank.id, "rows": rows, "summary": summary}
    return res


def markdown(res: dict) -> str:
    """The per-scope summary of a result as a Markdown table."""
    lines = [f"# Rate at a given error ({res['dataset']}, {len({r['cache'] for r in res['rows']})} caches, "
             f"eps {res.get('eps', res['rows'][0]['eps'] if res['rows'] else '?')})", "",
             "| scope | bpv mean | bpv max | worst tensor NRMSE | worst pooled NRMSE | slowest decode (M values/s) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {k} | {s['bpv_mean']:.3f} | {s['bpv_max']:.3f} | {s['nrmse_max_tensor']:.5f} | "
              f"{s['nrmse_pooled_max']:.5f} | {s['decode_mvps_min']:.1f} |" for k, s in res["summary"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
