"""The speed issue's acceptance points, each with its measured value and whether it is met (by wall
time, and by CPU time where that is the steadier reading)."""
from __future__ import annotations

import math

from .config import ENV_TOLERANCE


def agg_row(rows, codec, op, th):
    """The aggregate row (over all caches) of ``codec``'s ``op`` with ``th`` threads, or None."""
    for r in rows:
        if r["cache"] == "all" and r["codec"] == codec and r["op"] == op and r["threads"] == th:
            return r
    return None


def acceptance(res: dict) -> list[dict]:
    """The issue's acceptance points, each with its measured value and whether it is met."""
    rows = res.get("aggregate", [])
    n_all = res["machine"]["all_threads"]
    out = []

    def add(point, met, value, detail, met_cpu=None):
        """``met``: by wall time (the acceptance's values/s); ``met_cpu``: the same test on CPU times,
        the steadier reading of a single-thread comparison on a loaded machine."""
        out.append({"point": point, "met": bool(met), "value": value, "detail": detail, "met_cpu": met_cpu})

    sz1 = agg_row(rows, "sz3", "decode", 1)
    k1, kn = agg_row(rows, "kvz", "decode", 1), agg_row(rows, "kvz", "decode", n_all)
    if sz1 and k1:
        r, rc = k1["vps"] / sz1["vps"], k1["vps_cpu"] / sz1["vps_cpu"]
        add("decode 1 thread >= 0.6x SZ3 1 thread", r >= 0.6, r,
            f"kvz {k1['vps'] / 1e6:.1f} vs SZ3 {sz1['vps'] / 1e6:.1f} Mv/s wall ({r:.2f}x); by CPU time {rc:.2f}x "
            f"(kvz {k1['vps_cpu'] / 1e6:.1f} vs SZ3 {sz1['vps_cpu'] / 1e6:.1f} Mv/s per CPU-second)", rc >= 0.6)
    if sz1 and kn and n_all > 1:
        r = kn["vps"] / sz1["vps"]
        szn = agg_row(rows, "sz3", "decode", n_all)
        extra = f"; vs SZ3 on {n_all} threads {kn['vps'] / szn['vps']:.2f}x" if szn else ""
        add(f"decode {n_all} threads >= 1.0x SZ3 1 thread", r >= 1.0, r,
            f"kvz {kn['vps'] / 1e6:.1f} vs SZ3 {sz1['vps'] / 1e6:.1f} Mv/s wall ({r:.2f}x){extra}")
    cli = res.get("cli")
    if cli:
        tc = cli["times"]
        rcpu = tc["in-process read()"]["cpu_s"] / max(tc["kvz decompress (CLI)"]["cpu_s"], 1e-9)
        add("CLI kvz decompress >= 50% of in-process (2,048 tokens)", cli["ratio_incl_start"] >= 0.5,
            cli["ratio_incl_start"], f"process start included {cli['ratio_incl_start']:.2f}, excluded "
            f"{cli['ratio_excl_start']:.2f} (CLI {cli['cli_vps'] / 1e6:.1f}, in-process read "
            f"{cli['inproc_read_vps'] / 1e6:.1f} Mv/s); by CPU time {rcpu:.2f}" +
            (f"; {cli['batch_files']} files in one call: {cli['ratio_batch']:.2f}" if "ratio_batch" in cli else "") +
            (f"; against in-process decompress_to (the same job: decode and write the file) "
             f"{cli['cli_vps'] / cli['inproc_decompress_to_vps']:.2f}"
             + (f", {cli['batch_files']} files {cli['cli_batch_vps'] / cli['inproc_decompress_to_vps']:.2f}"
                if "cli_batch_vps" in cli else "") if cli.get("inproc_decompress_to_vps") else ""),
            rcpu >= 0.5)
    env = (res.get("processes") or {}).get("env")
    if env and env.get("variants"):
        def worst(what):
            return max(v["default_over_variant"] for var in env["variants"].values() for k, v in var.items()
                       if isinstance(v, dict) and k.endswith("_" + what))

        add("no run slower with the default environment than with OPENBLAS_NUM_THREADS=1", not env["flags"],
            worst("wall"), f"worst default/variant ratio: wall {worst('wall'):.3f}, CPU {worst('cpu'):.3f}" +
            (" - " + "; ".join(env["flags"]) if env["flags"] else
             f" (flag: > {ENV_TOLERANCE:.0%} in wall and CPU, outside the samples' spread"
             + (f"; {len(env['noise'])} noise-level difference(s)" if env.get("noise") else "") + ")"))
    vs = (res.get("processes") or {}).get("summary") or {}
    if "encode_wall_speedup_t1" in vs:
        dbpv = vs.get("bpv_diff_max", math.nan)
        sp1 = vs["encode_wall_speedup_t1"]
        spn = vs.get(f"encode_wall_speedup_t{n_all}", sp1)
        best = max(sp1, spn)
        dflt = vs.get(f"encode_wall_speedup_vs_default_t{n_all}", math.nan)
        spc = vs.get("encode_cpu_speedup_t1", math.nan)
        add("encode >= 2x kvz 0.1 at unchanged bpv (+-0.01)", best >= 2.0 and dbpv <= 0.01, best,
            f"vs 0.1 at its best (default env or 1-thread BLAS): 1 thread {sp1:.2f}x (CPU "
            f"{vs.get('encode_cpu_speedup_t1', math.nan):.2f}x), {n_all} threads {spn:.2f}x; vs 0.1 in the default "
            f"environment {dflt:.2f}x; max |bpv 0.2 - 0.1| {dbpv:.4f}", spc >= 2.0 and dbpv <= 0.01)
    rs = res.get("restore")
    if rs and rs.get("restore"):
        fr = {k: v["fraction_of_prefill"] for k, v in rs["restore"].items()}
        best = min(fr.values())
        add(f"restore of a {rs['tokens']}-token cache <= 5% of its prefill", best <= 0.05, best,
            ", ".join(f"{k} thread(s) {v * 100:.2f}%" for k, v in fr.items()) +
            f" of a {rs['prefill_s']:.1f} s prefill" + ("" if rs["tokens"] >= 16384 else
                                                        " (quick mode: not the 16K-token point)"))
    ident = res.get("identity") or {}
    if ident:
        ok = all(v.get("identical") for v in ident.values()) and vs.get(
            "decode_identical_across_processes_and_threads", True)
        add("decode bit-identical across threads (1/2/4) and processes", ok, None,
            f"{len(ident)} caches, in process and in the worker processes")
    return out
