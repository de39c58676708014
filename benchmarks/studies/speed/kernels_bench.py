"""Benchmark of the decoder kernels: exact integer map products (alignpred.kernels.intmap), the fused
post-prediction pass (alignpred.kernels.fused) and the rANS decoder (alignpred.entropy.rans).

Usage: python -m benchmarks.studies.speed.kernels_bench [--out out/kernels_bench.json] [--quick]

* precision: on the Gemma 3 270M samples, every map block and 256-row object: RMS of
  ``IntMap.predict - x @ W`` (float64 product) relative to the quantisation noise
  ``Delta / sqrt(12) = eps * rms(x_target)`` at eps = 0.0267, with and without the channel
  equalisation, next to float32 BLAS;
* speed (one core, measured side by side in one child process with OPENBLAS_NUM_THREADS=1):
  ns per output value of the float32 numpy/OpenBLAS product (sum over sources), the integer
  kernel (``map_predict``), the row quantisation and the whole ``IntMap.predict``, for the K
  (2 sources) and V (3 sources) maps of a real block, 256 rows x 256 outputs;
* the instructions of the integer kernel (vpdpwssd / vpmaddwd), compiled in a fresh cache;
* determinism: hashes of IntMap / fused outputs with the kernels compiled for the host, for
  generic x86-64 (SSE2 only) and for Haswell (AVX2 + FMA), at 1 and 2 threads;
* the fused post-processing vs its numpy reference (ns per value);
* rANS decoding of real payloads (symbols/s).

Medians of ``--reps`` repetitions (each the mean of several calls), all variants interleaved;
times are the CPU time of the benchmarking thread (``time.thread_time``), so that other
processes on a shared machine inflate them less (``--wall`` for wall-clock time).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvz.benchmarks.harness import ROOT, WARM_SAMPLE, bundled_bank, parser, sample_caches, write_json

EPS = 0.0267


_MINS: dict = {}   # best repetition of each variant (the machine may be shared)
CLOCK = time.thread_time   # CPU time of this thread: robust when other processes share the cores


def _interleaved(fns: dict, reps: int, inner: int) -> dict:
    """Median over ``reps`` of the mean time (s, :data:`CLOCK`) of ``inner`` calls, variants
    interleaved (the best repetition goes to ``_MINS``).  Every kernel timed here runs in the
    calling thread (numba without parallel, OpenBLAS with one thread)."""
    for f in fns.values():
        f()
    res = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = CLOCK()
            for _ in range(inner):
                f()
            res[k].append((CLOCK() - t0) / inner)
    _MINS.update({k: float(np.min(v)) for k, v in res.items()})
    return {k: float(np.median(v)) for k, v in res.items()}


def _bank():
    from alignpred import Bank

    return Bank.load(bundled_bank())


def _sources(cache, bank, blk):
    from alignpred.bank import block_samples

    return [np.ascontiguousarray(block_samples(cache, s) - bank.mean(s), np.float32) for s in bank.sources(blk)]


# --------------------------------------------------------------------------------------------
def precision(quick: bool) -> dict:
    from alignpred import load_cache
    from alignpred.bank import block_samples
    from alignpred.kernels import IntMap

    bank = _bank()
    res = {"int_equalised": [], "int_plain": [], "float32_blas": []}
    files = sample_caches()[: 1 if quick else None]
    for path in files:
        cache = load_cache(path)
        lay = cache.layout
        for i in range(lay.num_layers):
            for kind in "KV":
                blk = f"{kind}.{i}.0"
                f = bank.map_factors(blk)
                if f is None or f[1] is not None:
                    continue
                W = f[0]
                xs = _sources(cache, bank, blk)
                S = len(xs)
                d = W.shape[0] // S
                noise = EPS * np.sqrt(np.mean(block_samples(cache, blk).astype(np.float64) ** 2))
                m_eq = IntMap(W, S)
                m_pl = IntMap(W, S, shift=np.zeros((S, d), np.int32))
                W32 = W.astype(np.float32)
                for a in range(0, lay.n_tokens, 256):
                    rows = [x[a:a + 256] for x in xs]
                    ref = sum(x.astype(np.float64) @ W32[k * d:(k + 1) * d].astype(np.float64)
                              for k, x in enumerate(rows))
                    y32 = None
                    for k, x in enumerate(rows):
                        t = x @ W32[k * d:(k + 1) * d]
                        y32 = t if y32 is None else y32 + t
                    for key, y in (("int_equalised", m_eq.predict(rows)), ("int_plain", m_pl.predict(rows)),
                                   ("float32_blas", y32)):
                        res[key].append(float(np.sqrt(np.mean((y - ref) ** 2)) / noise))
    out = {}
    for k, v in res.items():
        v = np.array(v)
        out[k] = {"objects": int(len(v)), "median": float(np.median(v)), "p90": float(np.percentile(v, 90)),
                  "max": float(v.max())}
    return out


# --------------------------------------------------------------------------------------------
def speed_child(reps: int) -> dict:
    """Runs in a child with OPENBLAS_NUM_THREADS=1."""
    from alignpred import load_cache
    from alignpred.kernels import IntMap, map_predict

    bank = _bank()
    cache = load_cache(WARM_SAMPLE)
    out = {}
    n = 256
    for blk in ("K.5.0", "V.5.0"):
        W = bank.map_factors(blk)[0]
        xs = [x[:n] for x in _sources(cache, bank, blk)]
        S = len(xs)
        d = W.shape[0] // S
        m = W.shape[1]
        W32 = W.astype(np.float32)
        M = IntMap(W, S)
        xq, xe = M.quantize(xs)
        buf = np.empty((n, m), np.float32)

        def blas():
            y = None
            for k, x in enumerate(xs):
                t = x @ W32[k * d:(k + 1) * d]
                y = t if y is None else y + t
            return y

        t = _interleaved({
            "numpy_float32_matmul": blas,
            "int_kernel_map_predict": lambda: map_predict(xq, xe, M.panels, M.w_exp, buf),
            "quantize_rows_all_sources": lambda: M.quantize(xs, xq),
            "intmap_predict_total": lambda: M.predict(xs, buf),
        }, reps, 20)
        out[blk] = {"sources": S, "rows": n, "d_in": d, "d_out": m,
                    "ns_per_output": {k: v / (n * m) * 1e9 for k, v in t.items()},
                    "ns_per_output_best": {k: _MINS[k] / (n * m) * 1e9 for k in t},
                    "ns_per_output_per_source": {k: v / (n * m * S) * 1e9 for k, v in t.items()}}
        out[blk]["speedup_total_vs_blas"] = t["numpy_float32_matmul"] / t["intmap_predict_total"]
        out[blk]["speedup_kernel_vs_blas"] = t["numpy_float32_matmul"] / t["int_kernel_map_predict"]
    return out


NO_HANDLE = "alignpred.kernels exports no {} (the compiled integer kernel is not public)"


def asm_child() -> dict:
    """Runs in a child with a fresh NUMBA_CACHE_DIR (cached code cannot be inspected): counts the dot-product
    instructions of the compiled integer kernel, ``alignpred.kernels.map_predict_kernel`` (a numba dispatcher)."""
    import alignpred.kernels as K

    kernel = getattr(K, "map_predict_kernel", None)
    if kernel is None:
        return {"skipped": NO_HANDLE.format("map_predict_kernel")}
    M = K.IntMap(np.ones((512, 256), np.float32), 2)
    M.predict([np.ones((16, 256), np.float32)] * 2)
    asm = kernel.inspect_asm(kernel.signatures[0])
    return {k: asm.count(k) for k in ("vpdpwssd", "vpmaddwd", "pmaddwd", "zmm", "ymm")}


def hash_child() -> dict:
    """SHA-256 of IntMap predictions (real maps and sources) and fused outputs (seeded inputs)."""
    import hashlib

    import ml_dtypes

    from alignpred import load_cache
    from alignpred.kernels import IntMap, fused_post

    bank = _bank()
    cache = load_cache(WARM_SAMPLE)
    h = hashlib.sha256()
    for blk in ("K.5.0", "V.5.0", "K.11.0", "V.11.0"):
        W = bank.map_factors(blk)[0]
        xs = _sources(cache, bank, blk)
        h.update(IntMap(W, len(xs)).predict(xs).tobytes())
    rng = np.random.default_rng(3)
    n, d = 448, 256
    for dt in (ml_dtypes.bfloat16, np.float16, np.float32):
        base = rng.standard_normal((n, d)).astype(np.float32)
        q = rng.integers(-40, 41, (d, n)).astype(np.int32)
        ang = rng.random((n, d // 2)) * 6.3
        rope = (np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32), d, "half")
        rec, nat = fused_post(base, q, np.full(n, 0.03, np.float32), rng.random(d) < 0.5, 256,
                              rng.standard_normal(d).astype(np.float32), rope, float(ml_dtypes.finfo(dt).max), dt)
        h.update(rec.tobytes())
        h.update(nat.tobytes())
    return {"sha256": h.hexdigest()}


TARGETS = {
    "host": {},
    "generic x86-64 (SSE2)": {"NUMBA_CPU_NAME": "generic"},
    "haswell (AVX2+FMA)": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": (
        "+64bit,+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+popcnt,+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,"
        "+movbe,+cx16,-avx512f,-avx512bw,-avx512vl,-avx512dq,-avx512cd,-avx512vnni,-avx512bf16,-avxvnni")},
}


def _child(mode: str, env_extra: dict, reps: int) -> dict:
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, "-m", "benchmarks.studies.speed.kernels_bench", "--child", mode, "--reps", str(reps)]
    if CLOCK is time.perf_counter:
        cmd.append("--wall")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(ROOT))
    if r.returncode != 0:
        raise RuntimeError(f"child {mode} failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
def fused_speed(reps: int) -> dict:
    import ml_dtypes

    from alignpred.kernels import fused_post, reference_post

    rng = np.random.default_rng(0)
    d, S = 256, 256
    out = {}
    for n in (256, 2048):
        base = rng.standard_normal((n, d)).astype(np.float32)
        q = rng.integers(-20, 21, (d, n)).astype(np.int32)
        delta = np.full(n, 0.05, np.float32)
        mean = rng.standard_normal(d).astype(np.float32)
        interp = rng.random(d) < 0.5
        ang = rng.random((n, d // 2)) * 6.3
        rope = (np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32), d, "half")
        fmax = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
        rec = np.empty((n, d), np.float32)
        nat = np.empty((n, d), ml_dtypes.bfloat16)
        fns = {}
        for name, rp in (("keys_rope", rope), ("values_no_rope", None)):
            fns[f"{name}/numpy_reference"] = (lambda rp=rp: reference_post(base, q, delta, interp, S, mean, rp, fmax,
                                                                            ml_dtypes.bfloat16))
            fns[f"{name}/fused"] = (lambda rp=rp: fused_post(base, q, delta, interp, S, mean, rp, fmax,
                                                             ml_dtypes.bfloat16, rec=rec, native=nat))
        t = _interleaved(fns, reps, 3 if n > 256 else 10)
        out[f"n={n}"] = {k: v / (n * d) * 1e9 for k, v in t.items()}
        out[f"n={n} best rep"] = {k: _MINS[k] / (n * d) * 1e9 for k in t}
    return out


def rans_speed(reps: int, quick: bool) -> dict:
    """rANS decoding of the payloads of a real compressed sample: every object's payload, model ids and
    shape read through the public reader (``KvzReader.index`` / ``.metas``), decoded with
    ``alignpred.entropy.decode`` (the public decoder: the kernel plus its checks) into one buffer."""
    from alignpred import KvzReader, compress_bytes, load_cache
    from alignpred.entropy import decode

    bank = _bank()
    cache = load_cache(WARM_SAMPLE)
    raw = compress_bytes(cache, budget=EPS, bank=bank)
    r = KvzReader(raw, bank=bank)
    coder = r.header["codec"]["entropy"]["coder"]
    C = r.layout.kv_heads * r.layout.head_dim
    items = [(memoryview(raw)[e.offset:e.offset + e.length], r.metas[e.tensor].models, (C, e.n_tokens))
             for e in r.index if e.length]
    buf = np.empty((C, max(n for *_, (_, n) in items)), np.int32)
    nsym = sum(c * n for *_, (c, n) in items)

    def run():
        for payload, ids, shape in items:
            decode(payload, ids, shape, coder, out=buf[:, :shape[1]])

    sec = _interleaved({"decode_kernel": run}, reps, 1)["decode_kernel"]
    return {"payloads": len(items), "symbols": int(nsym), "bytes": int(sum(len(p) for p, *_ in items)),
            "Msymbols_per_s": nsym / sec / 1e6, "ns_per_symbol": sec / nsym * 1e9, "coder": coder,
            "timed": "alignpred.entropy.decode of every object payload"}


# --------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = parser(__doc__, out="write the results as JSON here", quick="one sample file for the precision table")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--wall", action="store_true", help="time with perf_counter instead of thread CPU time")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    global CLOCK
    if a.wall:
        CLOCK = time.perf_counter
    if a.child == "speed":
        print(json.dumps(speed_child(a.reps)))
        return 0
    if a.child == "asm":
        print(json.dumps(asm_child()))
        return 0
    if a.child == "hash":
        print(json.dumps(hash_child()))
        return 0
    res = run(a)
    if a.out:
        write_json(res, a.out, indent=2)
        print("wrote", a.out)
    return 0


def run(a) -> dict:
    """Precision, map speed, instructions, determinism across targets, fused post-processing, rANS decode."""
    res = {"clock": "wall (perf_counter)" if a.wall else "thread CPU time (thread_time)",
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "python": sys.version.split()[0], "cpus": os.cpu_count()}}
    try:
        import numba

        res["machine"]["numba"] = numba.__version__
        from llvmlite import binding

        res["machine"]["llvm_cpu"] = binding.get_host_cpu_name()
    except Exception:  # pragma: no cover
        pass
    import alignpred.kernels as K

    res["intmap"] = dict(getattr(K, "INTMAP_TILING", None) or {"skipped": NO_HANDLE.format("INTMAP_TILING")})
    print(f"== precision: RMS(int - float64) / (Delta/sqrt(12)) at eps = {EPS:.4f}", flush=True)
    res["precision"] = precision(a.quick)
    for k, v in res["precision"].items():
        print(f"  {k:15s} objects {v['objects']:4d}  median {v['median']:.4f}  p90 {v['p90']:.4f}  max {v['max']:.4f}")

    print("== map product speed (one core, OPENBLAS_NUM_THREADS=1, side by side), ns per output value", flush=True)
    res["map_speed"] = _child("speed", {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}, a.reps)
    for blk, v in res["map_speed"].items():
        print(f"  {blk} ({v['sources']} sources of {v['d_in']} -> {v['d_out']}, {v['rows']} rows):")
        for k, t in v["ns_per_output"].items():
            print(f"    {k:28s} {t:7.2f} ns/output  ({v['ns_per_output_per_source'][k]:.2f} per source; "
                  f"best rep {v['ns_per_output_best'][k]:.2f})")
        print(f"    speedup vs BLAS: kernel {v['speedup_kernel_vs_blas']:.2f}x, "
              f"total {v['speedup_total_vs_blas']:.2f}x")

    print("== integer kernel instructions (fresh compile)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        res["asm"] = _child("asm", {"NUMBA_CACHE_DIR": tmp}, 1)
    print("  ", res["asm"])

    print("== determinism: same bits when compiled for other x86-64 targets / thread settings", flush=True)
    res["determinism"] = {}
    for name, env in TARGETS.items():
        for threads in ("1", "2"):
            with tempfile.TemporaryDirectory() as tmp:
                e = dict(env, NUMBA_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads)
                if env:
                    e["NUMBA_CACHE_DIR"] = tmp
                res["determinism"][f"{name}, {threads} thread(s)"] = _child("hash", e, 1)["sha256"]
            if a.quick:
                break
    for k, v in res["determinism"].items():
        print(f"  {k:36s} {v[:16]}")
    res["determinism_all_equal"] = len(set(res["determinism"].values())) == 1
    print("  all equal:", res["determinism_all_equal"])

    print("== fused post-processing (bf16 out, half the channels interpolated), ns per value", flush=True)
    res["fused"] = fused_speed(a.reps)
    for nk, v in res["fused"].items():
        for k, t in v.items():
            print(f"  {nk:7s} {k:32s} {t:7.3f}")

    print("== rANS decode of real payloads", flush=True)
    try:
        res["rans"] = rans_speed(a.reps, a.quick)
        r = res["rans"]
        print(f"  {r['payloads']} payloads, {r['symbols']} symbols: {r['Msymbols_per_s']:.1f} Msymbols/s "
              f"({r['ns_per_symbol']:.2f} ns/symbol)")
    except Exception as e:  # the codec is not this benchmark's subject: report and go on
        res["rans"] = {"error": repr(e)}
        print("  skipped:", repr(e))
    return res


def markdown(res: dict) -> str:
    lines = [f"# Decoder kernels ({res['clock']})", "", "## Map products, ns per output value", "",
             "| block | kernel | ns/output | per source |", "|---|---|---|---|"]
    for blk, v in res["map_speed"].items():
        lines += [f"| {blk} | {k} | {t:.2f} | {v['ns_per_output_per_source'][k]:.2f} |"
                  for k, t in v["ns_per_output"].items()]
    lines += ["", f"Same bits for every target and thread setting: {res['determinism_all_equal']}."]
    r = res.get("rans", {})
    if "ns_per_symbol" in r:
        lines.append(f"rANS decode of real payloads: {r['ns_per_symbol']:.2f} ns/symbol.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
