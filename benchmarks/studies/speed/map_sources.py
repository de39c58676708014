"""What each source of the linear-map predictor costs and buys: bits vs decode multiply-adds.

    python -m benchmarks.studies.speed.map_sources [--calib data/calib/*.safetensors] [--eval data/eval/*.safetensors]
                                         [--eps 0.0267] [--repeats 5] [--out benchmarks/results/map_sources.json]

The exact integer map products are about half of a one-thread decode, and their cost is linear in
the multiply-adds per decoded value (the sources of every map times d_in times d_out). For each
source set below a bank is fitted on the calibration caches with the same code (``fit_bank``,
full rank, eps_cal 0.03), every evaluation cache is compressed at ``--eps`` (tensor scope), and
reported side by side in one run: bits per value, multiply-adds per value, and one-thread
``KvzReader.read()`` values/s (median of ``--repeats``, the variants interleaved):

* ``default``: ``K_l <- K_{l-1}, V_{l-1}``; ``V_l <- V_{l-1}, K_l, K_{l-1}`` (the bundled bank's);
* ``v_no_prev_k``: values without ``K_{l-1}``;
* ``v_no_prev_v``: values without ``V_{l-1}``;
* ``k_prev_k_only``: keys from ``K_{l-1}`` alone, values without ``K_{l-1}``.

Needs the 2,048-token caches: ``python samples/make_samples.py --what calib`` and ``--what eval``
(``data/``, not committed). Writes JSON and a Markdown table next to it.
"""
from __future__ import annotations

import os
import statistics
import time

from kvz.benchmarks.harness import (
    CALIB_DIR,
    RESULTS,
    caches_in,
    display_path,
    eval_caches,
    parser,
    run_study,
    stem,
)


def calib_and_eval(a) -> tuple[list, list, list]:
    """``(calibration paths, their caches, [(name, cache)] to evaluate)`` of ``--calib`` /
    ``--eval`` (default: ``data/calib``, ``data/eval``), or ``a.error`` (the parser's) naming how to make them."""
    from alignpred import KvzError, load_cache

    calib = a.calib or caches_in(CALIB_DIR)
    evals = a.eval or eval_caches()
    if not calib or not evals:
        a.error("needs calibration and evaluation caches: python samples/make_samples.py --what calib "
                 "(and --what eval), or pass --calib/--eval")
    try:
        return calib, [load_cache(p) for p in calib], [(stem(p), load_cache(p)) for p in evals]
    except KvzError as e:
        a.error(str(e))
        raise


def variants(layout) -> dict[str, dict[str, list[str]]]:
    """Source sets per variant (one head per layer is all Gemma 3 270M has; earlier heads of the
    layer, which the default also uses for multi-head models, are kept as they are)."""
    from alignpred.bank import default_sources

    base = default_sources(layout)
    out = {"default": base}

    def drop(pred):
        return {b: [s for s in src if not pred(b, s)] for b, src in base.items()}

    def layer(name):
        return int(name.split(".")[1])

    out["v_no_prev_k"] = drop(lambda b, s: b[0] == "V" and s[0] == "K" and layer(s) == layer(b) - 1)
    out["v_no_prev_v"] = drop(lambda b, s: b[0] == "V" and s[0] == "V" and layer(s) == layer(b) - 1)
    out["k_prev_k_only"] = drop(lambda b, s: (b[0] == "V" and s[0] == "K" and layer(s) == layer(b) - 1)
                                or (b[0] == "K" and s[0] == "V" and layer(s) == layer(b) - 1))
    return {k: {b: s for b, s in v.items() if s} for k, v in out.items()}


def macs_per_value(layout, sources) -> float:
    """Multiply-adds of the map products per decoded value (d_in padded to even, d_out to 16)."""
    d = layout.head_dim
    per_token = sum(len(s) * (d + d % 2) * (-(-d // 16) * 16) for s in sources.values())
    return per_token * layout.n_tokens / layout.n_values


def main(argv=None) -> dict:
    ap = parser(__doc__, out="results JSON (a .md beside it)", out_default=os.path.join(RESULTS, "map_sources.json"))
    ap.add_argument("--calib", nargs="*", help="calibration caches (default: data/calib/*.safetensors)")
    ap.add_argument("--eval", nargs="*", help="evaluation caches (default: data/eval/*.safetensors)")
    ap.add_argument("--eps", type=float, default=0.0267)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    return run_study(ap, run, markdown, "studies.speed.map_sources", argv, args=a, out="out", indent=2)


def run(a) -> dict:
    """Every source set's bank, bits and interleaved one-thread decode speed."""
    from alignpred import ErrorBudget, KvzReader, compress_bytes, fit_bank

    calib, cal, ev = calib_and_eval(a)
    lay = ev[0][1].layout
    rows = []
    for name, src in variants(cal[0].layout).items():
        t0 = time.perf_counter()
        bank = fit_bank(cal, rank=None, eps_cal=0.03, sources=src)
        fit_s = time.perf_counter() - t0
        blobs = [(n, compress_bytes(c, budget=ErrorBudget(eps=a.eps, scope="tensor"), bank=bank), c.layout.n_values) for n, c in ev]
        bpv = {n: 8 * len(b) / nv for n, b, nv in blobs}
        rows.append({"variant": name, "sources": src, "bank_id": bank.id, "fit_s": fit_s,
                     "macs_per_value": macs_per_value(lay, src), "bpv": bpv,
                     "bpv_mean": statistics.fmean(bpv.values()), "_blobs": blobs, "_bank": bank, "times": []})
        print(f"{name:<14} fitted in {fit_s:.1f} s, {rows[-1]['macs_per_value']:.0f} MAC/value, "
              f"{rows[-1]['bpv_mean']:.4f} bpv", flush=True)
    for r in rows:  # warm (kernels, plans)
        KvzReader(r["_blobs"][0][1], bank=r["_bank"], threads=1).read()
    for _ in range(a.repeats):  # interleaved rounds
        for r in rows:
            t0 = time.perf_counter()
            for _, blob, _ in r["_blobs"]:
                KvzReader(blob, bank=r["_bank"], threads=1).read()
            r["times"].append(time.perf_counter() - t0)
    n_values = sum(nv for _, _, nv in rows[0]["_blobs"])
    base = rows[0]
    for r in rows:
        r["decode_mvps"] = n_values / statistics.median(r["times"]) / 1e6
        r["bpv_vs_default"] = r["bpv_mean"] - base["bpv_mean"]
        del r["_blobs"], r["_bank"]
    for r in rows:
        r["decode_vs_default"] = r["decode_mvps"] / base["decode_mvps"]
    return {"command": a.command, "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "eps": a.eps, "scope": "tensor",
            "calib": [display_path(p) for p in calib], "eval": [n for n, _ in ev],
            "repeats": a.repeats, "threads": 1, "rows": rows}


def markdown(res: dict) -> str:
    rows = res["rows"]
    lines = ["# Map sources: bits vs decode multiply-adds", "",
             f"`{res['command'].strip()}` — {res['created']}; banks fitted on {len(res['calib'])} calibration caches, "
             f"{len(res['eval'])} evaluation caches at eps {res['eps']} (tensor scope); one-thread read(), median of "
             f"{res['repeats']} interleaved rounds.", "",
             "| variant | MAC/value | bpv (mean) | Δbpv vs default | decode M values/s | vs default |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['macs_per_value']:.0f} | {r['bpv_mean']:.4f} | "
                     f"{r['bpv_vs_default']:+.4f} | {r['decode_mvps']:.1f} | {r['decode_vs_default']:.2f}x |")
    lines += ["", "bpv per cache: " + "; ".join(
        f"{r['variant']}: " + ", ".join(f"{n} {v:.4f}" for n, v in r["bpv"].items()) for r in rows), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
