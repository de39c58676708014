"""Entropy stage of format 1.2: ns/symbol of the ``lanes32`` decoders against ``rans4``, and the bits
each probability precision costs, on the real residual symbols of the sample caches.

The symbols are those the codec writes: each sample cache is compressed (default settings, eps
0.0267, the bundled bank), and every object's payload is decoded back to its symbol array through
the public reader and entropy API.  Then, in one process, for every object: ``rans4`` decode, the
``lanes32`` vectorised decoder (compiled for this machine), and its portable decoder, interleaved;
the time per object is the minimum over rounds (the machine may be shared; the minimum is the
least disturbed run) and the median is recorded too.  Two child processes repeat the ``lanes32``
timings with the vectorised decoder compiled for an AVX2-only target (``NUMBA_CPU_NAME=haswell``)
and for a generic x86-64 target (``generic``: SSE2, gathers as scalar loads), after checking they
decode the same symbols.  Sizes: ``rans4`` against ``lanes32`` at 10..15-bit probabilities (real
payloads from the encoder; decoders exist for <= 12 bits, where one 32-bit table entry holds
frequency, slot bias and token).

    python -m kvz.benchmarks.entropy_lanes            # -> benchmarks/results/entropy_lanes.{json,md}
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from kvz.benchmarks.harness import (
    BANK_NAME,
    RESULTS,
    clean_env,
    code_revision,
    command_line,
    loadavg,
    machine_info,
    parser,
    sample_caches,
    stem,
    write_json,
    write_text,
)

EPS = 0.0267
PRECS = (10, 11, 12, 13, 14, 15)
TARGETS = {
    "avx2-only (haswell)": {"NUMBA_CPU_NAME": "haswell",
                            "NUMBA_CPU_FEATURES": "+64bit,+sse2,+sse4.2,+popcnt,+avx,+avx2,+fma,+bmi,+bmi2,+f16c,+lzcnt,"
                                                  "-avx512f"},
    "generic x86-64": {"NUMBA_CPU_NAME": "generic"},
}
PUBLISHED = {  # single-thread static-model decoders (the figures), ns per symbol
    "hypersonic-rANS 32x64 lanes, 10-12-bit": 0.3,
    "hypersonic-rANS, 15-bit (1.8 GiB/s)": 0.52,
    "htscodecs rans32x16 AVX2/AVX-512 (~2.3 GiB/s)": 0.41,
    "zstd Huff0 (~2.5 GiB/s)": 0.37,
}


def real_objects(caches, log=print):
    """``[(q, model_ids)]``: the symbol arrays of every coded object of ``caches``."""
    import numpy as np

    from alignpred import KvzReader, compress_bytes, entropy, load_cache

    objs = []
    for path in caches:
        t = time.perf_counter()
        data = compress_bytes(load_cache(path), bank=BANK_NAME, eps=EPS)
        r = KvzReader(data)
        coder = r.header["codec"]["entropy"]["coder"]
        n_obj = r.n_objects_per_tensor
        for ti, meta in enumerate(r.metas):
            for j in range(n_obj):
                e = r.index[ti * n_obj + j]
                if e.length == 0:
                    continue
                ids = np.asarray(meta.models)
                q = entropy.decode(data[e.offset:e.offset + e.length], ids, (ids.size, e.n_tokens), coder)
                objs.append((q, ids))
        log(f"{stem(path)}: {len(data):,} bytes, {len(objs)} objects so far ({time.perf_counter() - t:.1f} s)")
    return objs


def time_decoders(objs, decoders: dict, rounds: int) -> dict:
    """ns/symbol of each decoder: the sum over objects of the per-object minimum (and median) over
    ``rounds`` calls, the decoders interleaved call by call."""
    n = sum(q.size for q, _ in objs)
    acc = {k: [0.0, 0.0] for k in decoders}
    for q, ids in objs:
        out = q.copy()
        ts = {k: [] for k in decoders}
        for fn in decoders.values():
            fn(q, ids, out)   # warm (compiles on the first object)
        for _ in range(rounds):
            for name, fn in decoders.items():
                t = time.perf_counter()
                fn(q, ids, out)
                ts[name].append(time.perf_counter() - t)
        for name, v in ts.items():
            v.sort()
            acc[name][0] += v[0]
            acc[name][1] += v[len(v) // 2]
    return {k: {"ns_per_symbol_min": 1e9 * v[0] / n, "ns_per_symbol_median": 1e9 * v[1] / n} for k, v in acc.items()}


def lanes_decoders(objs, with_precisions: bool = False):
    """The lanes32 decoders of this process (payloads encoded once) and whether they decode ``objs``."""
    import numpy as np

    from alignpred import entropy

    bufs = {id(q): entropy.encode(q, ids, coder="lanes32") for q, ids in objs}

    def dec(path):
        return lambda q, ids, out: entropy.lanes_decode(bufs[id(q)], ids, q.shape, out=out, path=path)

    decs = {"lanes32 vectorised": dec("simd"), "lanes32 portable": dec("portable")}
    if with_precisions:   # the same decoder on 10- and 11-bit tables (4 and 8 KiB per model)
        for p in (10, 11):
            pb = {id(q): entropy.lanes_encode(q, ids, prec=p) for q, ids in objs}
            decs[f"lanes32 vectorised, {p}-bit tables"] = (
                lambda q, ids, out, pb=pb, p=p: entropy.lanes_decode(pb[id(q)], ids, q.shape, out=out, prec=p))
    ok = all(np.array_equal(entropy.lanes_decode(bufs[id(q)], ids, q.shape, path=p), q)
             for q, ids in objs for p in ("simd", "portable"))
    return decs, ok


def worker(npz: str, rounds: int) -> dict:
    """Child process: lanes32 timings and correctness under this process's numba target."""
    import numpy as np

    from alignpred import entropy

    z = np.load(npz)
    objs = [(z[f"q{k}"], z[f"i{k}"]) for k in range(int(z["n"]))]
    decs, ok = lanes_decoders(objs)
    return {"isa": entropy.lanes_isa(), "same_symbols": ok, "timing": time_decoders(objs, decs, rounds)}


def sizes(objs) -> dict:
    """Payload bytes of rans4 and of lanes32 at each precision."""
    from alignpred import entropy

    n = sum(q.size for q, _ in objs)
    r4 = sum(len(entropy.encode(q, ids)) for q, ids in objs)
    out = {"symbols": n, "rans4_bytes": r4, "rans4_bits_per_symbol": 8 * r4 / n, "lanes32": {}}
    for p in PRECS:
        b = sum(len(entropy.lanes_encode(q, ids, prec=p)) for q, ids in objs)
        out["lanes32"][str(p)] = {"bytes": b, "bits_per_symbol": 8 * b / n, "vs_rans4_pct": 100 * (b / r4 - 1),
                                  "decoder": p <= 12}
    return out


def markdown(res: dict) -> str:
    s = res["sizes"]
    lines = ["# Entropy stage of format 1.2: `lanes32` against `rans4`", "",
             f"`{res['command']}` — {res['machine']['cpu']}, vectorised target `{res['isa']}`, load "
             f"{res['loadavg']}, {s['symbols']:,} real residual symbols ({res['objects']} objects of the sample caches, "
             f"eps {EPS}; {res['timed_objects']} of them timed, {res['rounds']} calls each).", "",
             "## Decode, one thread (ns/symbol; min over rounds, median in brackets)", "",
             "| decoder | ns/symbol | vs rans4 |", "|---|---|---|"]
    base = res["timing"]["rans4"]["ns_per_symbol_min"]
    rows = dict(res["timing"])
    for tname, t in res["targets"].items():
        for k, v in t["timing"].items():
            if k.endswith("vectorised"):
                rows[f"{k}, {tname} ({t['isa']})"] = v
    for k, v in rows.items():
        lines.append(f"| {k} | {v['ns_per_symbol_min']:.2f} ({v['ns_per_symbol_median']:.2f}) | "
                     f"{v['ns_per_symbol_min'] / base:.2f}x |")
    lines += ["", "Published single-thread figures (for scale, other machines): " +
              "; ".join(f"{k} {v} ns" for k, v in PUBLISHED.items()) + ".", "",
              "## Size against probability precision", "",
              f"rans4 (15-bit): {s['rans4_bits_per_symbol']:.4f} bits/symbol.", "",
              "| precision | bits/symbol | vs rans4 | decoder |", "|---|---|---|---|"]
    for p, v in s["lanes32"].items():
        lines.append(f"| {p} | {v['bits_per_symbol']:.4f} | {v['vs_rans4_pct']:+.2f}% | "
                     f"{'yes' if v['decoder'] else 'no (2 gathers needed)'} |")
    lines += ["", f"All decoders decode the same symbols: {res['same_symbols']}.", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = parser(__doc__, caches="caches (default: the samples)", quick="two caches' worth of objects, fewer rounds",
                json="JSON output", json_default=os.path.join(RESULTS, "entropy_lanes.json"))
    ap.add_argument("--rounds", type=int, default=20, help="timed calls per object and decoder (default 20)")
    ap.add_argument("--objects", type=int, default=0,
                    help="time only this many objects, evenly spaced (sizes always use all; default all)")
    ap.add_argument("--worker", help=argparse_hidden())
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.rounds)))
        return
    import numpy as np

    from alignpred import entropy

    caches = args.caches or sample_caches()
    objs = real_objects(caches[:2] if args.quick else caches)
    rounds = 6 if args.quick else args.rounds
    all_objs = objs
    if 0 < args.objects < len(objs):
        objs = [objs[round(k * (len(objs) - 1) / max(1, args.objects - 1))] for k in range(args.objects)]
    decs, ok = lanes_decoders(objs, with_precisions=True)

    r4 = {id(q): entropy.encode(q, ids) for q, ids in objs}

    def rans4(q, ids, out):
        entropy.decode(r4[id(q)], ids, q.shape, out=out)

    timing = time_decoders(objs, {"rans4": rans4, **decs}, rounds)
    print(json.dumps(timing, indent=1))
    targets = {}
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "objs.npz")
        arrays = {"n": np.array(len(objs))}
        for k, (q, ids) in enumerate(objs):
            arrays[f"q{k}"], arrays[f"i{k}"] = q, ids
        np.savez(npz, **arrays)
        for tname, env in TARGETS.items():
            env = {k: v for k, v in clean_env(env).items() if not (k.startswith("NUMBA_CPU") and k not in env)}
            child = subprocess.run([sys.executable, "-m", "kvz.benchmarks.entropy_lanes", "--worker", npz,
                                    "--rounds", str(rounds)], env=env, capture_output=True, text=True)
            if child.returncode != 0:
                targets[tname] = {"error": child.stderr[-1500:]}
                continue
            targets[tname] = json.loads(child.stdout.strip().splitlines()[-1])
            print(tname, json.dumps(targets[tname]))
    res = {"command": command_line("entropy_lanes", argv), "revision": code_revision(), "machine": machine_info(),
           "loadavg": loadavg(), "isa": entropy.lanes_isa(), "objects": len(all_objs), "rounds": rounds,
           "lanes_prec": entropy.LANES_PREC, "timing": timing,
           "targets": {k: v for k, v in targets.items() if "error" not in v},
           "target_errors": {k: v["error"] for k, v in targets.items() if "error" in v},
           "same_symbols": bool(ok and all(v.get("same_symbols") for v in targets.values())),
           "timed_objects": len(objs), "sizes": sizes(all_objs), "published_ns_per_symbol": PUBLISHED}
    write_json(res, args.json)
    write_text(os.path.splitext(args.json)[0] + ".md", markdown(res))
    print(markdown(res))


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
