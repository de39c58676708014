"""One-core decode with the AMX map kernel on and off, next to SZ3, in one process.

Usage: python -m benchmarks.studies.speed.amx_decode [--caches N] [--rounds R] [--out benchmarks/results/amx_decode.json]

On each held-out cache (``data/eval``; ``samples/make_samples.py --what eval``), kvz's ``default`` and
``balanced`` profiles are encoded once (eps 0.0267, tensor scope, as the speed benchmark) and decoded
with one thread, ``KVZ_AMX=1`` and ``KVZ_AMX=0`` interleaved round by round (the same file, the same
process: the switch is read at every map product); SZ3 at its per-tensor bound is decoded in the same
run. Times are the best of ``--rounds`` (wall clock, BLAS limited to one thread). Rates are
values / summed time over the caches; ``x_sz3`` is that rate over SZ3's. Both kernels give the same
bits (``tests/kernels/test_intmap_amx.py``); on a CPU without AMX both rows time the vector kernel
(``amx_enabled`` in the JSON says which).
"""
from __future__ import annotations

import os
import time

import numpy as np

from kvz.benchmarks.harness import (
    code_revision,
    eval_caches,
    machine_info,
    parser,
    resolve_bank,
    write_json,
    write_text,
)
from kvz.benchmarks.speed.codecs import make_codecs


def measure(caches: list[str], rounds: int) -> dict:
    from threadpoolctl import threadpool_limits

    from alignpred import load_cache
    from alignpred.kernels import amx_enabled

    bank = resolve_bank()
    rows: list[dict] = []
    before = os.environ.get("KVZ_AMX")
    try:
        with threadpool_limits(1):
            for path in caches:
                cache = load_cache(path)
                nv = sum(np.asarray(v).size for v in cache.tensors.values())
                codecs, skipped = make_codecs(os.path.basename(path), cache, bank, ["kvz", "kvz-balanced", "sz3"])
                for c in codecs:
                    c.encode(1)
                    bpv = 8 * c.nbytes() / nv
                    modes = ("1", "0") if c.name.startswith("kvz") else ("-",)
                    best = {m: float("inf") for m in modes}
                    for r in range(rounds + 1):          # round 0 warms up (compiles, first pages)
                        for m in modes:
                            os.environ["KVZ_AMX"] = "1" if m == "-" else m
                            t0 = time.perf_counter()
                            c.decode(1)
                            t = time.perf_counter() - t0
                            if r:
                                best[m] = min(best[m], t)
                    for m in modes:
                        name = c.name if m == "-" else f"{c.name}/amx={m}"
                        rows.append({"cache": os.path.basename(path), "codec": name, "values": nv, "decode_s": best[m],
                                     "mvps": nv / best[m] / 1e6, "bpv": bpv})
                    print(f"[amx_decode] {os.path.basename(path)} {c.name}: "
                          + ", ".join(f"{m}: {nv / best[m] / 1e6:.1f} Mv/s" for m in modes) + f", {bpv:.3f} bpv",
                          flush=True)
    finally:
        if before is None:
            os.environ.pop("KVZ_AMX", None)
        else:
            os.environ["KVZ_AMX"] = before
    agg: dict = {}
    for r in rows:
        a = agg.setdefault(r["codec"], {"values": 0, "decode_s": 0.0, "bpv": []})
        a["values"] += r["values"]
        a["decode_s"] += r["decode_s"]
        a["bpv"].append(r["bpv"])
    sz = agg.get("sz3")
    sz_rate = sz["values"] / sz["decode_s"] / 1e6 if sz else None
    summary = []
    for name, a in agg.items():
        rate = a["values"] / a["decode_s"] / 1e6
        summary.append({"codec": name, "mvps": rate, "x_sz3": rate / sz_rate if sz_rate else None,
                        "mean_bpv": float(np.mean(a["bpv"]))})
    return {"schema": "kvz-amx-decode/1", "revision": code_revision(), "machine": machine_info(),
            "amx_enabled": amx_enabled(), "rounds": rounds, "caches": [os.path.basename(p) for p in caches],
            "rows": rows, "summary": summary}


def markdown(res: dict) -> str:
    lines = [f"# One-core decode, AMX map kernel on/off (revision {res['revision']})", "",
             f"AMX available: {res['amx_enabled']}; {len(res['caches'])} held-out caches, best of {res['rounds']} "
             "rounds; `python -m benchmarks.studies.speed.amx_decode`.", "",
             "| codec | M values/s | x SZ3 | mean bpv |", "|---|---:|---:|---:|"]
    for s in res["summary"]:
        lines.append(f"| {s['codec']} | {s['mvps']:.1f} | {s['x_sz3']:.3f} | {s['mean_bpv']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--caches", type=int, default=0, help="first N held-out caches (0: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/amx_decode.json")
    a = ap.parse_args(argv)
    if a.caches < 0 or a.rounds < 1:
        ap.error("--caches must be >= 0 and --rounds >= 1")
    res = run(a)
    write_json(res, a.out)
    write_text(os.path.splitext(a.out)[0] + ".md", markdown(res))
    print(markdown(res))
    return res


def run(args) -> dict:
    """The first ``args.caches`` held-out caches (0: all), ``args.rounds`` rounds."""
    caches = eval_caches()
    if not caches:
        raise SystemExit("no held-out caches: run python samples/make_samples.py --what eval")
    return measure(caches[:args.caches] if args.caches else caches, args.rounds)


if __name__ == "__main__":
    main()
