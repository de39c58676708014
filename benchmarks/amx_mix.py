"""Where the AMX map kernel's time goes: its tile products timed whole and with parts taken out.

Usage: python -m kvz.benchmarks.amx_mix [--sources S] [--rows N] [--rounds R] [--out benchmarks/results/amx_mix.json]

The speed benchmark compares the map kernel with the core's integer peak (``tdpbssd`` counted as
int16 multiply-adds, a quarter of the int8 ones). This probe (:func:`alignpred.kernels.amx_mix`)
runs the product loop of
:func:`alignpred.kernels.intmap_amx._products` on the decoder's shape (``S`` sources of ``N`` x 256
rows into 256 columns, random 14-bit sources and 13-bit weights, one thread) four ways, the same loop
with parts removed:

* ``kernel``: the kernel itself (tile products, stores, the float64 epilogue);
* ``tiles``: the same tile loads, products and stores, no epilogue;
* ``products``: the tile products and stores only (no operand loads: the tiles hold stale bytes);
* ``products, 4 tiles``: as ``products`` with the two middle products in separate tiles (no
  product waits on the other's result).

Only ``kernel`` computes the prediction; the others are timing probes, their outputs unused. Each
row's GMAC/s counts the int16 multiply-adds of the whole product (``S N 256 256``), so the rows
compare directly with the speed benchmark's peak. Needs AMX (``alignpred.kernels.amx_enabled()``).
"""
from __future__ import annotations

import os

from alignpred.kernels import amx_enabled, amx_mix
from kvz.benchmarks.harness import code_revision, machine_info, parser, write_json, write_text


def run(S: int, n: int, rounds: int) -> dict:
    if not amx_enabled():
        raise SystemExit("AMX is not available here (alignpred.kernels.amx_enabled() is False)")
    return {"revision": code_revision(), "machine": machine_info(()), "sources": S, "rows": n,
            "rounds": rounds, "macs": S * n * 256 * 256, "results": amx_mix(S, n, rounds)}


def markdown(res: dict, peak: float | None = None) -> str:
    lines = [f"# AMX map kernel: where the time goes (revision {res['revision']})", "",
             f"{res['sources']} sources x {res['rows']} rows x 256 -> 256 columns, one thread, best of "
             f"{res['rounds']}; `python -m kvz.benchmarks.amx_mix`. GMAC/s counts int16 multiply-adds.", "",
             "| way | ms | GMAC/s |" + (" share of peak |" if peak else ""),
             "|---|---:|---:|" + ("---:|" if peak else "")]
    for r in res["results"]:
        lines.append(f"| {r['way']} | {r['ms']:.3f} | {r['gmacs']:.0f} |" +
                     (f" {r['gmacs'] / peak:.0%} |" if peak else ""))
    if peak:
        lines += ["", f"Peak: {peak:.1f} GMAC/s (`tdpbssd`, int16 equivalent), from the speed benchmark's run "
                      "given with `--peak-from`."]
    return "\n".join(lines) + "\n"


def _peak(path: str | None) -> float | None:
    if not path:
        return None
    from kvz.benchmarks.harness.output import read_json

    p = ((read_json(path).get("bound") or {}).get("int_peak") or {}).get("peak_gmacs")
    return float(p) if p else None


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--sources", type=int, default=3)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--peak-from", default=None, help="a speed benchmark JSON whose measured peak to compare with")
    ap.add_argument("--out", default="benchmarks/results/amx_mix.json")
    a = ap.parse_args(argv)
    if a.sources < 1 or a.rows < 16 or a.rounds < 1:
        ap.error("--sources >= 1, --rows >= 16 and --rounds >= 1")
    res = run(a.sources, a.rows, a.rounds)
    peak = _peak(a.peak_from)
    res["peak_gmacs"] = peak
    write_json(res, a.out)
    md = markdown(res, peak)
    write_text(os.path.splitext(a.out)[0] + ".md", md)
    print(md)
    return res


if __name__ == "__main__":
    main()
