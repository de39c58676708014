"""What low-rank prediction maps cost in bits: bits per value vs decode multiply-adds per rank.

    python -m benchmarks.studies.speed.map_rank [--calib data/calib/*.safetensors] [--eval data/eval/*.safetensors]
                                      [--eps 0.0267] [--ranks 16 32 64 96 128 160]
                                      [--factored rrr_64 energy_0.99 resid_0.05] [--repeats 5]
                                      [--out benchmarks/results/map_rank.json]

The exact integer map products are a large part of a one-thread decode, and their cost is the
multiply-adds per decoded value. A map ``W [d_in, d_out]`` factored as ``U [d_in, r] @ Vt [r,
d_out]`` costs ``r * (d_in + d_out)`` per token instead of ``d_in * d_out``. The default bank
(``fit_bank``, full rank, eps_cal 0.03, default sources) is fitted once on the calibration
caches; then each map is replaced by a reduced-rank version of itself and every evaluation cache
is compressed at ``--eps`` (tensor scope):

* ``svd``: plain truncated SVD of ``W`` (the top ``r`` singular triplets of the weights);
* ``rrr``: reduced-rank regression, ``W_r = W V_r V_r^T`` with ``V_r`` the top right singular
  vectors of the fitted values ``X W`` on the calibration data (the same as
  ``S^{-1/2} [S^{1/2} W]_r``, ``S = X^T X``): the best rank-``r`` predictor from ``W``;
* ``rrr_noise``: the same in the metric of the noise-aware ridge, ``S + n diag(noise)``
  (the references the decoder sees carry quantisation noise of relative size eps_cal);
* ``energy_f``: ``rrr`` with a rank per map, the fewest directions that keep a fraction ``f`` of
  the fitted-value energy, rounded up to a multiple of 16 (the kernel pads to 16 columns);
* ``resid_a``: ``rrr`` with a rank per map, the fewest directions (multiple of 16) whose
  discarded fitted energy is at most ``a`` times the full map's calibration residual energy
  (a high-rate model of the bit loss: about ``0.5 log2(1 + a)`` bits per value of the block);
* ``alloc_t``: a rank per map chosen to minimise multiply-adds for a *predicted* loss of ``t``
  bits per value over the whole cache, under the same high-rate model (one Lagrange multiplier).

A map is only reduced where its factored form costs fewer multiply-adds than the dense one; the
others stay as fitted. The reduced maps are stored dense (``map/<block>/W``, the bank's dtype) so
only the bits change; ``<variant>_factored`` (``--factored``) stores ``U`` and ``Vt`` instead (the decoder's two-step
integer product, which rounds the rank-``r`` intermediate) and is also timed: one-thread
``KvzReader.read()`` of every cache, median of ``--repeats``, against the full-rank bank.

The modified banks are new :class:`Bank` objects built with the public constructor from the
fitted bank's arrays; no library file or private attribute is touched. Needs the 2,048-token
caches: ``python samples/make_samples.py --what calib`` and ``--what eval`` (``data/``).
Writes JSON and a Markdown table next to it.
"""
from __future__ import annotations

import math
import os
import statistics
import time

from kvz.benchmarks.harness import (
    RESULTS,
    display_path,
    limit_threads,
    parser,
    run_study,
)

STEP = 16  # the integer kernel pads output columns to a multiple of 16


def ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def dense_macs(n_src: int, d: int, d_out: int) -> int:
    """Multiply-adds per token of a dense map product (d_in padded to even, d_out to 16)."""
    return n_src * (d + d % 2) * ceil_to(d_out, STEP)


def factored_macs(n_src: int, d: int, d_out: int, r: int) -> int:
    """Multiply-adds per token of ``(x @ U) @ Vt`` with the same padding rules."""
    return n_src * (d + d % 2) * ceil_to(r, STEP) + (r + r % 2) * ceil_to(d_out, STEP)


class MapStats:
    """Everything a rank rule needs about one fitted map, from the calibration data."""

    def __init__(self, block, srcs, w, x, y, noise):
        import numpy as np

        self.block, self.n_src = block, len(srcs)
        self.d, self.d_out = x.shape[1] // len(srcs), w.shape[1]
        self.w = np.asarray(w, np.float64)
        fitted = x @ self.w
        self.resid = float(np.sum(np.square(y - fitted)))
        self.sig2, self.v = self._top(fitted.T @ fitted)
        gram_noise = self.w.T @ (x.T @ x + x.shape[0] * np.diag(noise)) @ self.w
        _, self.v_noise = self._top(gram_noise)
        u, s, vt = np.linalg.svd(self.w, full_matrices=False)
        self.svd = (u, s, vt)

    @staticmethod
    def _top(g):
        import numpy as np

        vals, vecs = np.linalg.eigh(g)
        return np.maximum(vals[::-1], 0.0), vecs[:, ::-1]

    @property
    def full_rank(self) -> int:
        return min(self.w.shape)

    def dense(self) -> int:
        return dense_macs(self.n_src, self.d, self.d_out)

    def macs(self, r: int | None) -> int:
        """Cost at rank ``r`` (None: full); a map is never factored where that costs more."""
        if r is None or r >= self.full_rank:
            return self.dense()
        return min(self.dense(), factored_macs(self.n_src, self.d, self.d_out, r))

    def reduces(self, r: int | None) -> bool:
        return r is not None and r < self.full_rank and self.macs(r) < self.dense()

    def discarded(self, r: int) -> float:
        return float(self.sig2[r:].sum())

    def predicted_bits(self, r: int | None) -> float:
        """High-rate bit loss per token of this block at rank ``r`` (``rrr``)."""
        if not self.reduces(r):
            return 0.0
        return self.d_out * 0.5 * math.log2(1.0 + self.discarded(r) / max(self.resid, 1e-30))

    def reduced(self, method: str, r: int):
        """The rank-``r`` map ``[d_in, d_out]`` by ``method`` (float64)."""
        if method == "svd":
            u, s, vt = self.svd
            return (u[:, :r] * s[:r]) @ vt[:r]
        v = (self.v_noise if method == "rrr_noise" else self.v)[:, :r]
        return self.w @ v @ v.T

    def rank_for_energy(self, frac: float) -> int:
        c = self.sig2.cumsum() / max(self.sig2.sum(), 1e-30)
        r = int(min(len(c) - 1, (c < frac).sum())) + 1
        return min(ceil_to(r, STEP), self.full_rank)

    def rank_for_resid(self, a: float) -> int:
        for r in range(STEP, self.full_rank, STEP):
            if self.discarded(r) <= a * self.resid:
                return r
        return self.full_rank


def map_stats(bank, cal) -> dict:
    """:class:`MapStats` of every map of ``bank`` on the calibration caches ``cal``."""
    import numpy as np

    from alignpred.bank import block_samples

    eps_cal = float(bank.config.get("eps_cal", 0.03))
    blocks = [b.name for b in cal[0].layout.blocks()]
    samples = {b: np.concatenate([block_samples(c, b) for c in cal]).astype(np.float64) - bank.mean(b)
               for b in blocks}
    out = {}
    for b in blocks:
        f = bank.map_factors(b)
        srcs = bank.sources(b)
        if f is None or not srcs or f[1] is not None:
            continue
        x = np.concatenate([samples[s] for s in srcs], axis=1)
        noise = np.concatenate([np.full(samples[s].shape[1], eps_cal ** 2 * float(np.mean(np.square(samples[s]))))
                                for s in srcs])
        out[b] = MapStats(b, srcs, f[0], x, samples[b], noise)
    return out


def with_maps(bank, ranks: dict, method: str, factored: bool = False):
    """A new bank: ``bank`` with the map of each block in ``ranks`` reduced to its rank by
    ``method`` (the maps :meth:`MapStats.reduces` rejects stay as fitted)."""
    import numpy as np

    from alignpred import Bank

    arrays = dict(bank.arrays)
    store = {b: arrays[f"map/{b}/W"].dtype for b in ranks}
    for b, (st, r) in ranks.items():
        if not st.reduces(r):
            continue
        if factored:
            v = st.v[:, :r]
            del arrays[f"map/{b}/W"]
            arrays[f"map/{b}/U"] = (st.w @ v).astype(store[b])
            arrays[f"map/{b}/Vt"] = np.ascontiguousarray(v.T).astype(store[b])
        else:
            arrays[f"map/{b}/W"] = st.reduced(method, r).astype(store[b])
    config = dict(bank.config, reduced_maps=method + ("_factored" if factored else ""))
    return Bank(model=bank.model, signature=bank.signature, config=config, arrays=arrays)


def alloc_ranks(stats: dict, n_values_per_token: int, target: float) -> dict:
    """Per-map ranks (multiples of 16, or full) minimising multiply-adds subject to a predicted
    loss of ``target`` bits per value, by bisection on one Lagrange multiplier."""
    cands = {b: [r for r in range(STEP, st.full_rank, STEP) if st.reduces(r)] + [None] for b, st in stats.items()}

    def pick(lam):
        return {b: min(cands[b], key=lambda r, st=st: st.macs(r) + lam * st.predicted_bits(r))
                for b, st in stats.items()}

    def loss(choice):
        return sum(stats[b].predicted_bits(r) for b, r in choice.items()) / n_values_per_token

    lo, hi = 1e-3, 1e12
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if loss(pick(mid)) > target:
            lo = mid
        else:
            hi = mid
    return pick(hi)


def plan_variants(stats: dict, ranks: list[int], n_values_per_token: int) -> list[dict]:
    """The variants: name, method, per-map ranks (None: full), factored or not."""
    out = [{"variant": "full", "method": "full", "r": "full", "ranks": {b: None for b in stats}}]
    for method in ("svd", "rrr", "rrr_noise"):
        for r in ranks:
            out.append({"variant": f"{method}_{r}", "method": method, "r": r, "ranks": {b: r for b in stats}})
    for f in (0.98, 0.985, 0.99, 0.995, 0.999):
        out.append({"variant": f"energy_{f}", "method": "rrr", "r": "per map",
                    "ranks": {b: st.rank_for_energy(f) for b, st in stats.items()}})
    for a in (0.02, 0.03, 0.05, 0.07, 0.1):
        out.append({"variant": f"resid_{a}", "method": "rrr", "r": "per map",
                    "ranks": {b: st.rank_for_resid(a) for b, st in stats.items()}})
    for t in (0.005, 0.01, 0.015, 0.02):
        out.append({"variant": f"alloc_{t}", "method": "rrr", "r": "per map",
                    "ranks": alloc_ranks(stats, n_values_per_token, t)})
    return out


def summarise_ranks(stats: dict, choice: dict) -> dict:
    """Which ranks a variant gave the K and V maps (the full ones as 256 etc.)."""
    eff = {b: (r if stats[b].reduces(r) else stats[b].full_rank) for b, r in choice.items()}
    out = {}
    for kind in ("K", "V"):
        rs = [r for b, r in eff.items() if b.startswith(kind)]
        if rs:
            out[kind] = {"min": min(rs), "median": statistics.median(rs), "max": max(rs)}
    return out


def timed_reads(pairs: list[tuple[str, list, object]], repeats: int) -> dict:
    """One-thread ``read()`` of all blobs per (name, blobs, bank), interleaved; median seconds."""
    from alignpred import KvzReader

    times = {n: [] for n, _, _ in pairs}
    for _, blobs, bank in pairs:
        KvzReader(blobs[0], bank=bank, threads=1).read()
    for _ in range(repeats):
        for n, blobs, bank in pairs:
            t0 = time.perf_counter()
            for b in blobs:
                KvzReader(b, bank=bank, threads=1).read()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}


def fmt(s: dict) -> str:
    return f"{s['min']}/{s['median']:g}/{s['max']}" if s else "-"


def markdown(res: dict) -> str:
    rows = res["rows"]
    lines = ["# Map rank: bits vs decode multiply-adds", "",
             f"`{res['command'].strip()}` — {res['created']}; the default bank fitted on {len(res['calib'])} "
             f"calibration caches, {len(res['eval'])} evaluation caches at eps {res['eps']} (tensor scope). "
             "MAC/value: the map products per decoded value, factored where that is cheaper "
             "(the reduced maps are decoded dense here: bits only).", "",
             "| variant | method | r | K r (min/med/max) | V r (min/med/max) | MAC/value | vs full | bpv (mean) | Δbpv | "
             "predicted Δbpv |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        k, v = r["rank_summary"].get("K", {}), r["rank_summary"].get("V", {})
        lines.append(f"| {r['variant']} | {r['method']} | {r['r']} | {fmt(k)} | {fmt(v)} | {r['macs_per_value']:.0f} | "
                     f"{r['macs_vs_full']:.2f}x | {r['bpv_mean']:.4f} | {r['bpv_vs_full']:+.4f} | "
                     f"{'-' if r['predicted_dbpv'] is None else format(r['predicted_dbpv'], '+.4f')} |")
    names = res["eval"]
    lines += ["", "bpv per cache:", "", "| variant | " + " | ".join(names) + " |",
              "| --- |" + " --- |" * len(names)]
    for r in rows:
        lines.append(f"| {r['variant']} | " + " | ".join(f"{r['bpv'][n]:.4f}" for n in names) + " |")
    if res.get("timing"):
        lines += ["", f"One-thread read() of all {len(names)} caches, median of {res['repeats']} interleaved rounds "
                  "(factored banks store U and Vt; the decoder runs the two integer products):", "",
                  "| bank | MAC/value | bpv (mean) | Δbpv | read s | M values/s | vs full |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for t in res["timing"]:
            lines.append(f"| {t['variant']} | {t['macs_per_value']:.0f} | {t['bpv_mean']:.4f} | {t['bpv_vs_full']:+.4f} | "
                         f"{t['read_s']:.3f} | {t['mvps']:.1f} | {t['vs_full']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = parser(__doc__, out="results JSON (a .md beside it)", out_default=os.path.join(RESULTS, "map_rank.json"))
    ap.add_argument("--calib", nargs="*", help="calibration caches (default: data/calib/*.safetensors)")
    ap.add_argument("--eval", nargs="*", help="evaluation caches (default: data/eval/*.safetensors)")
    ap.add_argument("--eps", type=float, default=0.0267)
    ap.add_argument("--ranks", type=int, nargs="*", default=[16, 32, 64, 96, 128, 160])
    ap.add_argument("--factored", nargs="*", default=["rrr_64", "energy_0.99", "resid_0.05"],
                    help="rrr variants also run with U/Vt stored (the decoder's factored product); these "
                         "and their dense twins are timed")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    return run_study(ap, run, markdown, "studies.speed.map_rank", argv, args=a, out="out", indent=1)


def run(a) -> dict:
    """Every rank variant's bits and multiply-adds; the factored variants and their dense twins timed."""
    limit_threads(1)
    from alignpred import ErrorBudget, compress_bytes, fit_bank

    from .map_sources import calib_and_eval

    calib, cal, ev = calib_and_eval(a)
    lay = ev[0][1].layout
    per_token = lay.n_values // lay.n_tokens
    t0 = time.perf_counter()
    bank = fit_bank(cal, rank=None, eps_cal=0.03)
    stats = map_stats(bank, cal)
    print(f"default bank fitted and {len(stats)} maps analysed in {time.perf_counter() - t0:.1f} s", flush=True)
    full_macs = sum(st.dense() for st in stats.values()) / per_token

    def bits(bk):
        blobs = [(n, compress_bytes(c, budget=ErrorBudget(eps=a.eps, scope="tensor"), bank=bk), c.layout.n_values) for n, c in ev]
        return {n: 8 * len(b) / nv for n, b, nv in blobs}, [b for _, b, _ in blobs]

    rows, blobs_of = [], {}
    plan = plan_variants(stats, a.ranks, per_token)
    named = {v["variant"]: v for v in plan}
    bad = [n for n in a.factored if named.get(n, {}).get("method") != "rrr"]
    if bad:
        ok = [n for n, v in named.items() if v["method"] == "rrr"]
        a.error(f"--factored takes rrr variants of this run ({', '.join(ok)}), not {bad}")
    plan += [dict(named[n], variant=f"{n}_factored", factored=True) for n in a.factored]
    for v in plan:
        choice = {b: (stats[b], r) for b, r in v["ranks"].items()}
        bk = bank if v["method"] == "full" else with_maps(bank, choice, v["method"], v.get("factored", False))
        t1 = time.perf_counter()
        bpv, blobs = bits(bk)
        if v["variant"] == "full" or v.get("factored") or v["variant"] in a.factored:
            blobs_of[v["variant"]] = (blobs, bk)
        macs = sum(stats[b].macs(r) for b, r in v["ranks"].items()) / per_token
        pred = sum(stats[b].predicted_bits(r) for b, r in v["ranks"].items()) / per_token
        row = {"variant": v["variant"], "method": v["method"], "r": v["r"], "factored": v.get("factored", False),
               "ranks": {b: (r if stats[b].reduces(r) else None) for b, r in v["ranks"].items()},
               "rank_summary": summarise_ranks(stats, v["ranks"]), "macs_per_value": macs,
               "macs_vs_full": macs / full_macs, "predicted_dbpv": pred if v["method"] == "rrr" else None,
               "bpv": bpv, "bpv_mean": statistics.fmean(bpv.values())}
        rows.append(row)
        print(f"{v['variant']:<18} {macs:6.0f} MAC/value  {row['bpv_mean']:.4f} bpv  "
              f"({time.perf_counter() - t1:.1f} s)", flush=True)
    base = rows[0]["bpv_mean"]
    for r in rows:
        r["bpv_vs_full"] = r["bpv_mean"] - base
    timing = []
    if a.factored and a.repeats > 0:
        secs = timed_reads([(n, b, bk) for n, (b, bk) in blobs_of.items()], a.repeats)
        n_values = sum(c.layout.n_values for _, c in ev)
        by = {r["variant"]: r for r in rows}
        for n, s in secs.items():
            timing.append({"variant": n, "macs_per_value": by[n]["macs_per_value"], "bpv_mean": by[n]["bpv_mean"],
                           "bpv_vs_full": by[n]["bpv_vs_full"], "read_s": s, "mvps": n_values / s / 1e6,
                           "vs_full": secs["full"] / s})
    return {"command": a.command, "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "eps": a.eps, "scope": "tensor", "bank_id": bank.id, "calib": [display_path(p) for p in calib],
            "eval": [n for n, _ in ev], "full_macs_per_value": full_macs, "repeats": a.repeats, "threads": 1,
            "rows": rows, "timing": timing}


if __name__ == "__main__":
    main()
