"""The speed benchmark's Markdown summary: acceptance, codec tables, break-even by core count (measured
and projected), the entropy stage against published decoders, one chunk, kvz 0.1 vs 0.2,
environment, CLI, restore vs prefill, the one-thread bound and the profile."""
from __future__ import annotations

import math

from .acceptance import agg_row
from .codec_study import by_cores
from .config import BLAS1, ENV_TOLERANCE, PROJECTED_CORES


def _mv(x):
    return "-" if x is None or not math.isfinite(x) else f"{x / 1e6:.1f}"


def _bw(b):
    if b is None:
        return "never"
    if not math.isfinite(b):
        return "any"
    return f"{b * 8 / 1e9:.2f} Gbit/s"


def by_cores_markdown(res: dict) -> list[str]:
    """The break-even table by core count: 1 and 2 threads measured, 16 and 64 cores projected."""
    rows = res.get("break_even_by_cores") or by_cores(res.get("aggregate", []))
    if not rows:
        return []
    proj = [c for c in PROJECTED_CORES if any(f"break_even_Bps_projected_{c}c" in r for r in rows)]
    L = ["", "## Break-even link speed by core count", "",
         "Measured: the decode's median wall time at 1 and 2 threads in this run. Projected: the 1-thread time "
         "divided by the core count (linear scaling assumed, not measured). '-': not run; 'never': the "
         "compressed data is not smaller than raw bf16.", "",
         "| codec | op | bpv | 1 thread (measured) | 2 threads (measured) | " +
         " | ".join(f"{c} cores (projected, 1-thread time / {c})" for c in proj) + " |",
         "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in proj) + " |"]
    for r in rows:
        meas = [_bw(r[f"break_even_Bps_t{t}"]) if r.get(f"decode_s_t{t}") is not None else "-" for t in (1, 2)]
        L.append(f"| {r['codec']} | {r['op']} | {r['bpv']:.3f} | " + " | ".join(meas) + " | " +
                 " | ".join(_bw(r.get(f"break_even_Bps_projected_{c}c")) for c in proj) + " |")
    return L


def entropy_markdown(res: dict) -> list[str]:
    """The entropy stage's ns/symbol (measured here) next to the published figures (not measured here)."""
    e = res.get("entropy")
    if not e:
        return []
    L = ["", f"## Entropy stage: ns/symbol ({e['cache']}, {e['timed_objects']} of {e['objects']} objects, "
         f"{e['symbols']:,} residual symbols, {e['rounds']} calls each)", "",
         f"Measured here: one thread, min over calls (median in brackets); rans4 at "
         f"{e['rans4_bits_per_symbol']:.3f} bits/symbol; lanes32 vectorised for `{e['isa']}`; all decoders gave "
         f"back the symbols: {'yes' if e['same_symbols'] else 'NO'}. Published: other decoders' single-thread "
         "figures on 8-bit symbols, on other machines, converted as ns = 1 / (GiB/s x 1.073741824); "
         "**published, not measured here**.", "",
         "| decoder | source | GiB/s | ns/symbol | figure |", "| --- | --- | --- | --- | --- |"]
    for k, t in e["timing"].items():
        L.append(f"| {k} | kvz (this run) | - | {t['ns_per_symbol_min']:.2f} ({t['ns_per_symbol_median']:.2f}) "
                 "| measured here |")
    for p in e.get("published", []):
        L.append(f"| {p['decoder']} | {p['source']} | {p['gib_per_s']:g} | {p['ns_per_symbol']:.2f} | "
                 "published, not measured here |")
    return L


def chunk_markdown(res: dict) -> list[str]:
    """ms per 256-token chunk (one object range) at 1 and 2 threads and the speed-up."""
    ch = res.get("chunk")
    if not ch:
        return []
    a, b = ch["tokens"]
    L = ["", f"## One chunk: tokens {a}:{b} of {ch['cache']} ({ch['object_size']}-token objects, "
         f"{ch['n_values'] / 1e6:.2f} M values; medians of {ch['rounds']} interleaved rounds)", "",
         "`KvzReader(data, bank=, threads=t).read(tokens=(a, b))` on a reader opened once; the same bits at every "
         f"thread count: {'yes' if ch['identical'] else 'NO'}.", "",
         "| threads | ms per chunk (wall) | ms per chunk (cpu) | speed-up vs 1 thread (wall) |",
         "| --- | --- | --- | --- |"]
    for k, ms in ch["ms_per_chunk"].items():
        L.append(f"| {k} | {ms:.1f} | {ch['ms_per_chunk_cpu'][k]:.1f} | {ch['speedup'][k]:.2f}x |")
    return L


def markdown(res: dict) -> str:
    """The Markdown summary of a results dict."""
    m = res["machine"]
    n_all, mode = m["all_threads"], "quick" if res["quick"] else "full"
    L = [f"# kvz speed ({mode})", "",
         f"`{res['command']}` - {res['created']}, code {res.get('code_rev')}, {m.get('cpu')}, "
         f"{m.get('usable_cores')} usable cores; load average {res.get('loadavg_start')} at the start, "
         f"{res.get('loadavg_end')} at the end; {res['wall_s'] / 60:.1f} min wall."]
    for k in ("cpu_probe_start", "cpu_probe_end"):
        p = res.get(k)
        if p and "scaling" in p:
            L.append(f"CPU probe ({k[10:]}): 1 thread got {p['1']['cpu_over_wall']:.2f} CPU-s per s; {n_all} threads of "
                     f"GIL-free work ran {p['scaling']:.2f}x as fast as 1.")
    L.append("")
    L += ["## Acceptance", "", "| point | met | measured |", "| --- | --- | --- |"]
    for a in res.get("acceptance", []):
        cpu = a.get("met_cpu")
        note = "" if cpu is None or cpu == a["met"] else f" (by CPU time: {'yes' if cpu else 'no'})"
        L.append(f"| {a['point']} | {'yes' if a['met'] else 'NO'}{note} | {a['detail']} |")
    rows = res.get("aggregate", [])
    if rows:
        L += ["", f"## Codecs in process ({res['n_caches']} caches, {res.get('tokens')} tokens each; medians of "
              f"{res['settings']['rounds']} interleaved rounds, encode {res['settings']['enc_rounds']})", "",
              "Mv/s = million values per second by wall time; (cpu) = by the process's CPU time. Break-even: the "
              f"link speed below which loading + decoding beats loading raw bf16 ({n_all} threads, wall).", "",
              "| codec | op | bpv | worst tensor NRMSE | 1 thread Mv/s | 1 thread Mv/s (cpu) | "
              f"{n_all} threads Mv/s | {n_all} threads Mv/s (cpu) | break-even ({n_all} threads) | "
              "break-even (1 thread, by CPU time) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        keys = []
        for r in rows:
            if (r["codec"], r["op"]) not in keys:
                keys.append((r["codec"], r["op"]))
        for codec, op in keys:
            r1, rn = agg_row(rows, codec, op, 1), agg_row(rows, codec, op, n_all)
            any_r = r1 or rn
            be = _bw((rn or r1).get("break_even_Bps")) if op.startswith("decode") else ""
            be1 = _bw(r1.get("break_even_Bps_cpu")) if op.startswith("decode") and r1 else ""
            L.append(f"| {codec} | {op} | {any_r['bpv']:.3f} | {any_r['nrmse_max_tensor']:.4f} | "
                     f"{_mv(r1 and r1['vps'])} | {_mv(r1 and r1['vps_cpu'])} | "
                     f"{_mv(rn and rn['vps']) if n_all > 1 else '-'} | "
                     f"{_mv(rn and rn['vps_cpu']) if n_all > 1 else '-'} | {be} | {be1} |")
        if res.get("skipped"):
            L += [""] + [f"- skipped {k}: {v}" for k, v in res["skipped"].items()]
        ic = res.get("idle_core")
        if ic:
            L += ["", f"Every timed op starts after {ic['warm_s'] * 1e3:.0f} ms with all cores busy (untimed). What that "
                  f"takes out, measured ({ic['cache']}): {ic['codec']} at {ic['threads']} threads decodes in "
                  f"{ic['after_warm_s'] * 1e3:.1f} ms after it and in {ic['after_idle_s'] * 1e3:.1f} ms after "
                  f"{ic['idle_s']:.2f} s with the cores idle (medians)."]
    L += by_cores_markdown(res) + entropy_markdown(res) + chunk_markdown(res)
    vs = (res.get("processes") or {}).get("summary") or {}
    if vs:
        L += ["", "## kvz 0.1 vs 0.2 (fresh processes, same caches, tensor scope, eps 0.0267)", "",
              "0.1 ran in the default environment and with single-thread BLAS (`" + BLAS1 + "`); the speed-ups are "
              "against the better 0.1 figure.", "",
              "| | 0.1 (default env) | 0.1 (1-thread BLAS) | 0.2, 1 thread | " + f"0.2, {n_all} threads |",
              "| --- | --- | --- | --- | --- |"]
        for kind in ("encode", "decode"):
            for what in ("wall", "cpu"):
                L.append(f"| {kind} Mv/s ({what}) | {_mv(vs.get(f'{kind}_{what}_vps_0.1'))} | "
                         f"{_mv(vs.get(f'{kind}_{what}_vps_0.1_blas1'))} | "
                         f"{_mv(vs.get(f'{kind}_{what}_vps_0.2_t1'))} | "
                         f"{_mv(vs.get(f'{kind}_{what}_vps_0.2_t{n_all}'))} |")
        for kind in ("encode", "decode"):
            for what in ("wall", "cpu"):
                L.append(f"| {kind} speed-up ({what}) | | | {vs.get(f'{kind}_{what}_speedup_t1', math.nan):.2f}x | "
                         f"{vs.get(f'{kind}_{what}_speedup_t{n_all}', math.nan):.2f}x |")
        if "bpv" in vs:
            L += ["", "bpv per cache: " + "; ".join(
                f"{c}: " + ", ".join(f"{k} {x:.4f}" for k, x in sorted(v.items())) for c, v in vs["bpv"].items())]
    env = (res.get("processes") or {}).get("env") or {}
    if env.get("variants"):
        L += ["", "## Default environment vs thread variables (this tree, fresh processes)", "",
              "Medians over rounds x repeats; a run is flagged when the default is slower by more than "
              f"{ENV_TOLERANCE:.0%} in wall *and* CPU time.", "",
              "| variant | run | default s | variant s | default / variant (wall) | default / variant (cpu) |",
              "| --- | --- | --- | --- | --- | --- |"]
        for v, d in env["variants"].items():
            for k, x in d.items():
                if isinstance(x, dict) and k.endswith("_wall"):
                    c = d.get(k[:-5] + "_cpu", {})
                    L.append(f"| {v} ({d['rounds']} rounds) | {k[:-5]} | {x['default_s']:.3f} | {x['variant_s']:.3f} | "
                             f"{x['default_over_variant']:.3f} | {c.get('default_over_variant', math.nan):.3f} |")
        L += ["", "Flags: " + ("; ".join(env["flags"]) if env["flags"] else "none")]
        if env.get("noise"):
            L += ["", "Not flagged (noise): " + "; ".join(env["noise"])]
    cli = res.get("cli")
    if cli:
        L += ["", "## CLI vs in process (one 2,048-token cache)", "", "| run | wall s | cpu s |", "| --- | --- | --- |"]
        for k, t in cli["times"].items():
            L.append(f"| {k} | {t['wall_s']:.3f} | {t['cpu_s']:.3f} |")
        L += ["", f"CLI {cli['cli_vps'] / 1e6:.1f} Mv/s with the process start, "
              f"{cli['cli_vps_excl_start'] / 1e6:.1f} without; in-process read {cli['inproc_read_vps'] / 1e6:.1f} "
              f"Mv/s: ratio {cli['ratio_incl_start']:.2f} / {cli['ratio_excl_start']:.2f}. (CPU of the "
              f"subprocesses: {cli['children_cpu_s']:.1f} s in all.)"]
        if "ratio_batch" in cli:
            L += ["", f"`kvz decompress` of {cli['batch_files']} such files in one call: "
                  f"{cli['cli_batch_vps'] / 1e6:.1f} Mv/s, {cli['ratio_batch']:.2f}x of in-process read() and "
                  f"{cli['cli_batch_vps'] / cli['inproc_decompress_to_vps']:.2f}x of in-process decompress_to() "
                  f"(which also writes the file; one file: {cli['cli_vps'] / cli['inproc_decompress_to_vps']:.2f}x)."]
        ph = cli.get("cold_start_phases") or {}
        if ph:
            L += ["", "Where a fresh process spends its time (medians): " + ", ".join(
                f"{k[:-2].replace('_', ' ')} {v:.3f} s" for k, v in ph.items()) +
                " (the first decompress includes loading the compiled kernels; the second is warm)."]
    rs = res.get("restore")
    if rs:
        L += ["", f"## Restore vs prefill ({rs['tokens']} tokens, {rs['model']})", "",
              f"Prefill {rs['prefill_s']:.1f} s wall ({rs['prefill_tokens_per_s']:.0f} tokens/s, torch "
              f"{rs['torch_threads']} threads, chunk {rs['prefill_chunk']}); compressed to {rs['bpv']:.3f} bpv in "
              f"{rs['encode_s']:.1f} s ({rs['encode_threads']} threads).", "",
              "| threads | restore s | restore / prefill | Mv/s |", "| --- | --- | --- | --- |"]
        for th, t in rs["restore"].items():
            L.append(f"| {th} | {t['wall_s']:.3f} | {t['fraction_of_prefill'] * 100:.2f}% | {t['vps'] / 1e6:.1f} |")
    bd = res.get("bound")
    if bd:
        sz1 = agg_row(res.get("aggregate", []), "sz3", "decode", 1)
        L += ["", f"## How fast one thread can decode with exact map products ({bd['cache']})", "",
              f"One single-thread read(): {bd['values'] / 1e6:.1f} M values in {bd['read_s']:.3f} s; the integer map "
              f"products do {bd['macs'] / 1e9:.2f} G multiply-adds ({bd['macs_per_value']:.0f} per decoded value); "
              f"the prediction stage (the decoder's StageTimer: sources quantised, map products) takes "
              f"{bd['map_products_s']:.3f} s ({bd['kernel_gmacs']:.1f} GMAC/s, {bd['map_share']:.0%} of the read); "
              f"everything else takes {bd['rest_s']:.3f} s ({bd['rest_ns_per_value']:.2f} ns per value)."]
        ref = bd.get("bf16_reference")
        if ref:
            L += ["", f"torch {ref['torch']} bf16 GEMM on the same shapes, one thread: {ref['gmacs']:.1f} GMAC/s. At "
                  f"the faster of the two ({bd['peak_gmacs']:.1f} GMAC/s) the map products alone need "
                  f"{bd['map_floor_s']:.3f} s: a decode could reach at most {bd['max_vps_maps_only'] / 1e6:.1f} M "
                  "values/s if everything else were free" +
                  (f" = {bd['max_vps_maps_only'] / sz1['vps']:.2f}x SZ3's single-thread decode in this run "
                   f"({sz1['vps'] / 1e6:.1f} M values/s); 1.0x SZ3 leaves "
                   f"{(bd['values'] / sz1['vps'] - bd['map_floor_s']) / bd['values'] * 1e9:.2f} ns per value "
                   f"for the rest (measured {bd['rest_ns_per_value']:.2f})" if sz1 else "") + "."]
        ip = bd.get("int_peak") or {}
        if ip.get("peak_gmacs"):
            L += ["", "Integer dot-product peak of this core (register-only chains, `benchmarks/native/dot_peak.c`): "
                  + ", ".join(f"{k} {v:.1f}" if v else f"{k} not available" for k, v in ip["probes"].items())
                  + f" GMAC/s. The prediction stage runs at {bd['stage_share_of_int_peak']:.0%} of "
                  f"{ip['peak_gmacs']:.1f}" + (f"; the map kernel alone ({'AMX tiles' if bd.get('map_kernel') == 'amx' else 'the vector kernel'}, its own time in one profiled read, "
                                               f"{bd['map_kernel_s']:.3f} s) at {bd['map_kernel_gmacs']:.1f} GMAC/s, "
                                               f"{bd['kernel_share_of_int_peak']:.0%}"
                                               if "kernel_share_of_int_peak" in bd else "") + "."]
        elif ip.get("error"):
            L += ["", f"Integer dot-product peak: not measured ({ip['error'].splitlines()[0]})."]
    pf = res.get("profile")
    if pf:
        L += ["", f"## Profile of one single-thread decode ({pf['wall_s_profiled']:.2f} s under cProfile)", "",
              "| function | calls | own s | share |", "| --- | --- | --- | --- |"]
        for e in pf["top_own"][:12]:
            L.append(f"| `{e['function']}` | {e['calls']} | {e['own_s']:.3f} | {e['own_share'] * 100:.1f}% |")
    if res.get("notes"):
        L += ["", "## Notes", ""] + [f"- {x}" for x in res["notes"]]
    return "\n".join(L) + "\n"
