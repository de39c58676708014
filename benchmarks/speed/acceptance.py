"""The speed issue's acceptance points, each with its measured value and whether it is met (by wall
time, and by CPU time where that is the steadier reading)."""
from __future__ import annotations

import math

from .config import ENV_TOLERANCE

BPV_SLACK = 0.05  # issue 19: decode speed at no more than +0.05 bpv over the default profile


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
    base = agg_row(rows, "kvz", "decode", 1)
    if sz1 and base:
        decode_points(rows, sz1, base, n_all, add)
    entropy_point(res.get("entropy"), add)
    bd = res.get("bound") or {}
    if bd.get("kernel_share_of_int_peak") is not None:
        ip = bd["int_peak"]
        add("map products >= 85% of the core's integer dot-product peak", bd["kernel_share_of_int_peak"] >= 0.85,
            bd["kernel_share_of_int_peak"],
            f"map kernel {bd['map_kernel_gmacs']:.1f} GMAC/s (own time in a profiled read, " +
            ("on AMX with the quantisation into byte planes fused into the call" if bd.get("map_kernel") == "amx"
             else "the vector kernel, no AMX on this CPU" if bd.get("map_kernel") == "vector" else "kernel not recorded") +
            f"; the whole stage with the sources' "
            f"quantisation {bd['kernel_gmacs']:.1f}) vs peak {ip['peak_gmacs']:.1f} ({ip['instruction']}): "
            f"{bd['kernel_share_of_int_peak']:.0%}")
    elif bd:
        add("map products >= 85% of the core's integer dot-product peak", False, None,
            "not measured: no map kernel's own time in the profiled read")
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


def _variants(rows, th):
    """kvz's decode rows (default and every profile) at ``th`` threads."""
    return [r for r in rows if r["cache"] == "all" and r["op"] == "decode" and r["threads"] == th
            and (r["codec"] == "kvz" or r["codec"].startswith("kvz-"))]


def decode_points(rows, sz1, base, n_all, add):
    """Decode against SZ3's one-thread decode: the fastest kvz variant within +0.05 bpv of the
    default at 1 and ``n_all`` threads, and the fast profile at one thread with its bpv cost."""
    def best(th):
        ok = [r for r in _variants(rows, th) if r["bpv"] <= base["bpv"] + BPV_SLACK + 1e-9]
        return max(ok, key=lambda r: r["vps"]) if ok else None

    def line(r):
        cpu = f"; by CPU time {r['vps_cpu'] / sz1['vps_cpu']:.2f}x" if r["threads"] == 1 else ""
        return (f"{r['codec']} {r['vps'] / 1e6:.1f} vs SZ3 {sz1['vps'] / 1e6:.1f} Mv/s wall "
                f"({r['vps'] / sz1['vps']:.2f}x{cpu}) at {r['bpv']:.3f} bpv "
                f"({r['bpv'] - base['bpv']:+.3f} vs the default's {base['bpv']:.3f})")

    for th, target in ((1, 1.0), (n_all, 1.8)):
        if th == 1 or n_all > 1:
            b = best(th)
            if b:
                others = ", ".join(f"{r['codec']} {r['vps'] / sz1['vps']:.2f}x" for r in _variants(rows, th)
                                   if r is not b)
                add(f"decode {th} thread{'s' if th > 1 else ''} >= {target:g}x SZ3 1 thread at <= +{BPV_SLACK} bpv",
                    b["vps"] / sz1["vps"] >= target, b["vps"] / sz1["vps"],
                    line(b) + (f"; the others: {others}" if others else ""),
                    b["vps_cpu"] / sz1["vps_cpu"] >= target if th == 1 else None)
    fast = agg_row(rows, "kvz-fast", "decode", 1)
    if fast:
        add("--profile fast: decode 1 thread >= 1.5x SZ3 1 thread (bpv cost stated)", fast["vps"] / sz1["vps"] >= 1.5,
            fast["vps"] / sz1["vps"], line(fast), fast["vps_cpu"] / sz1["vps_cpu"] >= 1.5)


def entropy_point(e, add):
    """The entropy stage's fastest decoder of the format's own coders against 1 ns/symbol."""
    if not e:
        return
    t = {k: v["ns_per_symbol_min"] for k, v in e["timing"].items() if "bit tables" not in k}
    pt = e.get("lanes32_per_tensor")
    if pt:   # the decoder's own call: a tensor's objects at once
        t["lanes32 vectorised, one call per tensor"] = pt["timing"]["per tensor"]["ns_per_symbol_min"]
    k = min(t, key=lambda n: t[n])
    add("entropy stage <= 1 ns/symbol", t[k] <= 1.0 and e["same_symbols"] and (not pt or pt["same_symbols"]), t[k],
        f"{k} {t[k]:.2f} ns/symbol (min over calls; " + ", ".join(f"{n} {v:.2f}" for n, v in t.items() if n != k)
        + f"; {e['symbols']:,} symbols of {e['cache']}, vectorised for {e['isa']})")
