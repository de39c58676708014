"""Where the AMX map kernel's time goes: its tile products timed whole and with parts taken out.

Usage: python -m benchmarks.studies.speed.amx_mix [--sources S] [--rows N] [--rounds R] [--out benchmarks/results/amx_mix.json]

The speed benchmark compares the map kernel with the core's integer peak (``tdpbssd`` counted as
int16 multiply-adds, a quarter of the int8 ones). This probe (:func:`alignpred.kernels.amx_mix`)
runs the product loop of
:func:`alignpred.kernels.intmap_amx._products` on the decoder's shape (``S`` sources of ``N`` x 256
rows into 256 columns, random 14-bit sources and 13-bit weights, one thread), the same loop
with parts removed or changed:

* ``kernel``: the kernel itself (tile products, stores, the float64 epilogue);
* ``tiles``: the same tile loads, products and stores, no epilogue;
* ``products``: the tile products and stores only (no operand loads: the tiles hold stale bytes);
* ``products, 4 tiles``: as ``products`` with the two middle products in separate tiles (no
  product waits on the other's result);
* ``tiles, sources joined`` / ``products, sources joined``: every source's products go into one
  set of accumulators, zeroed and stored once per item. This loop needs sources that share
  exponents, which would be a bitstream change.
* ``tiles, sources joined, operands in L1``: as ``tiles, sources joined``, with every load
  reading the same 1 KiB operand, so that nothing comes from L2.

Only ``kernel`` computes the prediction; the others are timing probes, their outputs unused. Each
row's GMAC/s counts the int16 multiply-adds of the whole product (``S N 256 256``). The peak is
measured in the same run, before and after the probe, and the faster of the two is used
(``benchmarks/speed/dot_peak.py``: register-only ``tdpbssd`` chains; the CPU's clock moves
between runs and machines, so a peak from another run does not compare). Needs AMX
(``alignpred.kernels.amx_enabled()``).
"""
from __future__ import annotations

import os

from alignpred.kernels import amx_enabled, amx_mix
from kvz.benchmarks.harness import code_revision, machine_info, parser, write_json, write_text


def _amx_peak() -> float | None:
    """The AMX int16-equivalent peak (GMAC/s) of :func:`~kvz.benchmarks.speed.dot_peak.dot_peak`,
    or None where the probe cannot be built (no C compiler)."""
    from kvz.benchmarks.speed.dot_peak import AMX, dot_peak

    return dot_peak().get("probes", {}).get(AMX)


def measure(S: int, n: int, rounds: int) -> dict:
    if not amx_enabled():
        raise SystemExit("AMX is not available here (alignpred.kernels.amx_enabled() is False)")
    before = _amx_peak()
    results = amx_mix(S, n, rounds)
    after = _amx_peak()
    peaks = [p for p in (before, after) if p]
    return {"revision": code_revision(), "machine": machine_info(()), "sources": S, "rows": n,
            "rounds": rounds, "macs": S * n * 256 * 256, "results": results,
            "peak_gmacs": max(peaks) if peaks else None, "peak_before_after": [before, after]}


def run(args) -> dict:
    """The probe at ``args.sources`` x ``args.rows``, ``args.rounds`` rounds, with the peak before and after."""
    return measure(args.sources, args.rows, args.rounds)


def markdown(res: dict, peak: float | None = None) -> str:
    peak = res.get("peak_gmacs") if peak is None else peak
    lines = [f"# AMX map kernel: where the time goes (revision {res['revision']})", "",
             f"{res['sources']} sources x {res['rows']} rows x 256 -> 256 columns, one thread, best of "
             f"{res['rounds']}; `python -m benchmarks.studies.speed.amx_mix`. GMAC/s counts int16 multiply-adds.", "",
             "| way | ms | GMAC/s |" + (" share of peak |" if peak else ""),
             "|---|---:|---:|" + ("---:|" if peak else "")]
    for r in res["results"]:
        lines.append(f"| {r['way']} | {r['ms']:.3f} | {r['gmacs']:.0f} |" +
                     (f" {r['gmacs'] / peak:.0%} |" if peak else ""))
    if peak:
        b, a = res.get("peak_before_after") or (None, None)
        lines += ["", f"Peak: {peak:.1f} GMAC/s (`tdpbssd`, int16 equivalent), measured in this run "
                      f"(before the probe {b or 0:.1f}, after it {a or 0:.1f}; the faster one counts)."]
    else:
        lines += ["", "Peak: not measured (the register-only probe `benchmarks/native/dot_peak.c` could not be built)."]
    lines += ["", "Rows marked *sources joined* put every source's products into one set of accumulator tiles. "
                  "That needs sources that share exponents, a bitstream change; today's maps cannot run that loop."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--sources", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results/amx_mix.json")
    a = ap.parse_args(argv)
    if a.sources < 1 or a.rows < 16 or a.rounds < 1:
        ap.error("--sources >= 1, --rows >= 16 and --rounds >= 1")
    res = run(a)
    write_json(res, a.out)
    md = markdown(res, res["peak_gmacs"])
    write_text(os.path.splitext(a.out)[0] + ".md", md)
    print(md)
    return res


if __name__ == "__main__":
    main()
