"""Benchmark of the entropy-coding stage (alignpred.entropy): size vs entropy, and speed.

Usage: python -m benchmarks.studies.speed.entropy_decode --study coders [--json out/bench_entropy.json] [--quick]

For Laplace, Gaussian and Student-t(3) data of scale s (in quantisation steps), one object of
C=256 x N=256 symbols q = rint(s * X) is coded with the best model id per channel.  Reported per
(distribution, scale), in bits/symbol: the exact entropy of the quantised distribution
(``h_true``), the plug-in entropy of all 65536 symbols (``h_emp``, biased low for wide
distributions), the mean plug-in entropy of each 256-symbol channel (``h_emp_ch``, meaningless
above s ~ 10), ``estimate_bits`` and the full payload size of both coders.  Speed is measured
on one core on "typical" objects (per-channel Laplace/t3 scales log-uniform in [0.3, 30]).
"""

from __future__ import annotations

import platform
import sys
import time

import numpy as np

from alignpred.entropy import MODEL_SET_ID, N_MODELS, PREC, choose_models, decode, encode, estimate_bits

SCALES = (0.05, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0)
DISTS = ("laplace", "gauss", "t3")


def sample(rng, dist, scale, shape):
    if dist == "laplace":
        x = rng.laplace(0.0, scale, shape)
    elif dist == "gauss":
        x = rng.normal(0.0, scale, shape)
    else:
        x = scale * rng.standard_t(3, shape)
    return np.clip(np.rint(x), -(2**31), 2**31 - 1).astype(np.int32)


def true_entropy(dist, scale):
    """Exact entropy (bits) of rint(scale * X), tail of t3 by continuous integration."""
    from scipy import stats

    d = {"laplace": stats.laplace(scale=scale), "gauss": stats.norm(scale=scale),
         "t3": stats.t(3, scale=scale)}[dist]
    v0 = int(60 * scale + 20) if dist != "t3" else int(max(400 * scale, 2000))
    v = np.arange(0, v0 + 1, dtype=np.float64)
    p = d.sf(v - 0.5) - d.sf(v + 0.5)
    p[0] = d.cdf(0.5) - d.cdf(-0.5)
    p = p[p > 0]
    h = -(p[0] * np.log2(p[0])) - 2 * np.sum(p[1:] * np.log2(p[1:]))
    if dist == "t3":  # 2 * integral_{v0+0.5}^inf -f log2 f dx (f smooth there)
        x = np.geomspace(v0 + 0.5, (v0 + 0.5) * 1e9, 200001)
        f = d.pdf(x)
        g = np.where(f > 0, -f * np.log2(np.where(f > 0, f, 1.0)), 0.0)
        h += 2 * np.trapezoid(g, x)
    return float(h)


def plugin_entropy(a):
    _, counts = np.unique(a, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def timeit(fn, reps):
    best = np.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def typical_object(rng, C=256, N=256):
    q = np.empty((C, N), np.int32)
    scales = np.exp(rng.uniform(np.log(0.3), np.log(30.0), C))
    for c in range(C):
        q[c] = sample(rng, "laplace" if c % 2 else "t3", scales[c], N)
    return q


def run(args) -> dict:
    """Sizes against entropy and the two coders' speed (``args.quick``: fewer repetitions)."""
    reps = 3 if args.quick else 10
    rng = np.random.default_rng(12345)
    res = {"command": args.command, "model_set": MODEL_SET_ID, "prec": PREC, "n_models": N_MODELS,
           "machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
           "compression": [], "speed": {}}

    # warm up numba (compile or load cache)
    q0 = typical_object(rng, 8, 16)
    decode(encode(q0, choose_models(q0)), choose_models(q0), q0.shape)

    print(f"{'dist':8s} {'scale':>7s} {'h_true':>8s} {'h_emp':>8s} {'h_emp_ch':>8s} {'est':>8s} "
          f"{'rans4':>8s} {'constr':>8s} {'gap':>8s} {'gap%':>7s}")
    for dist in DISTS:
        for s in SCALES:
            q = sample(rng, dist, s, (256, 256))
            ids = choose_models(q)
            n = q.size
            b4 = encode(q, ids)
            bc = encode(q, ids, coder="constriction")
            assert np.array_equal(decode(b4, ids, q.shape), q)
            assert np.array_equal(decode(bc, ids, q.shape, coder="constriction"), q)
            row = dict(dist=dist, scale=s, h_true=true_entropy(dist, s),
                       h_emp=plugin_entropy(q), h_emp_ch=float(np.mean([plugin_entropy(r) for r in q])),
                       est=float(estimate_bits(q, ids).sum() / n),
                       rans4=8 * len(b4) / n, constriction=8 * len(bc) / n)
            row["gap"] = row["rans4"] - row["h_true"]
            row["gap_pct"] = 100 * row["gap"] / max(row["h_true"], 1e-12)
            res["compression"].append(row)
            print(f"{dist:8s} {s:7.2f} {row['h_true']:8.4f} {row['h_emp']:8.4f} {row['h_emp_ch']:8.4f} "
                  f"{row['est']:8.4f} {row['rans4']:8.4f} {row['constriction']:8.4f} "
                  f"{row['gap']:8.4f} {row['gap_pct']:6.2f}%")

    def speed(label, q):
        ids = choose_models(q)
        n = q.size
        b4 = encode(q, ids)
        bc = encode(q, ids, coder="constriction")
        r = {"bits_per_symbol": 8 * len(b4) / n,
             "rans4_encode_Msym_s": n / timeit(lambda: encode(q, ids), reps) / 1e6,
             "rans4_decode_Msym_s": n / timeit(lambda: decode(b4, ids, q.shape), reps) / 1e6,
             "constriction_encode_Msym_s":
                 n / timeit(lambda: encode(q, ids, coder="constriction"), max(1, reps // 3)) / 1e6,
             "constriction_decode_Msym_s":
                 n / timeit(lambda: decode(bc, ids, q.shape, coder="constriction"),
                            max(1, reps // 3)) / 1e6,
             "choose_models_Msym_s": n / timeit(lambda: choose_models(q), reps) / 1e6}
        res["speed"][label] = r
        print(f"{label:28s} " + "  ".join(f"{k}={v:.1f}" for k, v in r.items()))

    print("\nspeed (one core, best of reps, M symbols/s):")
    speed("typical_256x256", typical_object(rng))
    speed("typical_16x(256x256)", np.vstack([typical_object(rng) for _ in range(16)]))
    speed("laplace_s0.05", sample(rng, "laplace", 0.05, (256, 256)))
    speed("laplace_s3000", sample(rng, "laplace", 3000.0, (256, 256)))
    return res


def markdown(res: dict) -> str:
    lines = ["# Entropy coders: size against entropy, and speed", "",
             f"`{res['command']}` — {res['machine']}, model set {res['model_set']} ({res['n_models']} models, "
             f"{res['prec']}-bit).", "",
             "| dist | scale | h_true | estimate | rans4 | constriction | gap (rans4 - h_true) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dist']} | {r['scale']:g} | {r['h_true']:.4f} | {r['est']:.4f} | {r['rans4']:.4f} | "
              f"{r['constriction']:.4f} | {r['gap']:.4f} ({r['gap_pct']:.2f}%) |" for r in res["compression"]]
    lines += ["", "Speed, one core, best of the repetitions (M symbols/s):", "",
              "| object | " + " | ".join(next(iter(res["speed"].values()))) + " |",
              "|---|" + "---|" * len(next(iter(res["speed"].values())))]
    lines += [f"| {k} | " + " | ".join(f"{x:.1f}" for x in v.values()) + " |" for k, v in res["speed"].items()]
    return "\n".join(lines) + "\n"
