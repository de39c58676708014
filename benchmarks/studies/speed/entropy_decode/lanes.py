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

    python -m benchmarks.studies.speed.entropy_decode --study lanes   # -> benchmarks/results/entropy_lanes.{json,md}
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from kvz.benchmarks.harness import (
    ROOT,
    clean_env,
    code_revision,
    loadavg,
    machine_info,
    sample_caches,
)
from kvz.benchmarks.speed.entropy_stage import lanes_decoders, real_objects, time_decoders

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


def add_args(ap) -> None:
    ap.add_argument("--worker", help=argparse.SUPPRESS)


def run(args) -> dict:
    """The lanes32 study (``args``: caches, quick, rounds (default 20), objects (default all), worker)."""
    if args.worker:
        return worker(args.worker, args.rounds or 20)
    import numpy as np

    from alignpred import entropy

    caches = args.caches or sample_caches()
    objs = real_objects(caches[:2] if args.quick else caches)
    rounds = 6 if args.quick else (args.rounds or 20)
    all_objs = objs
    if args.objects and 0 < args.objects < len(objs):
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
            child = subprocess.run([sys.executable, "-m", "benchmarks.studies.speed.entropy_decode", "--study", "lanes",
                                    "--worker", npz, "--rounds", str(rounds)], env=env, capture_output=True, text=True,
                                   cwd=ROOT)
            if child.returncode != 0:
                targets[tname] = {"error": child.stderr[-1500:]}
                continue
            targets[tname] = json.loads(child.stdout.strip().splitlines()[-1])
            print(tname, json.dumps(targets[tname]))
    return {"command": args.command, "revision": code_revision(), "machine": machine_info(),
            "loadavg": loadavg(), "isa": entropy.lanes_isa(), "objects": len(all_objs), "rounds": rounds,
            "lanes_prec": entropy.LANES_PREC, "timing": timing,
            "targets": {k: v for k, v in targets.items() if "error" not in v},
            "target_errors": {k: v["error"] for k, v in targets.items() if "error" in v},
            "same_symbols": bool(ok and all(v.get("same_symbols") for v in targets.values())),
            "timed_objects": len(objs), "sizes": sizes(all_objs), "published_ns_per_symbol": PUBLISHED}
