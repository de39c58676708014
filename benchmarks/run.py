"""``kvz bench``: kvz (AlignPred) against every baseline coder at matched *measured* error, side by side.

What one run measures (all in one process, on the same caches, so the timings compare):

* **kvz eps sweep** - ``compress`` at each eps (log-spaced 0.5 % .. 10 % by default) under both allocations
  (scope ``tensor``: every tensor meets eps; ``pooled``: the whole cache does).  bpv is the ``.kvz`` file size
  (every byte: preamble, payloads, header, index, footer) over the value count; the bank is auxiliary (referenced
  by id, fitted on other caches) and not counted.  Errors are measured by *decoding* the file
  (:class:`~alignpred.KvzReader`) and comparing with the source, not read from the header.
* **FP8 e4m3's measured error** (``eps_fp8``; per allocation: its worst per-tensor NRMSE, resp. its pooled NRMSE
  over all caches) is added as an exact eps point for kvz and for every searchable baseline, so the headline table
  needs no interpolation.
* **baselines** (``benchmarks.baselines``): searchable ones (SZ3, ZFP, KVTC, HEVC, ...) at matched error under both
  allocations via ``.run(cache, eps, alloc, calib)``; fixed-rate ones (FP8, FP16, BF16, lossless) and KIVI at their
  natural setting (reported as points; KIVI is also searched at ``eps_fp8``).  Slow methods (HEVC) run only at
  ``eps_fp8``, the other searchable baselines on every other sweep point.
* **ablation** of the codec switches (:class:`~alignpred.CodecConfig`) and a **calibration study** (auxiliary bank
  vs a bank fitted on the target and embedded), both at ``eps_fp8`` under the tensor allocation.
* optionally **downstream quality** (``benchmarks.quality``, needs torch/transformers).

Results go to ``OUT/results.json``; :mod:`kvz.benchmarks.report` turns them into ``OUT/RESULTS.md`` and ``OUT/rd.png``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time

import numpy as np

from .harness import (
    CALIB_DIR,
    bundled_bank,
    caches_in,
    code_revision,
    display_path,
    limit_threads,
    loadavg,
    machine_info,
    sample_caches,
    write_json,
)
from .rd_point import (  # noqa: F401 - slice_cache: this module's name too (tests)
    _memo_prepare,
    baseline_point,
    kvz_point,
    measure,
    slice_cache,
    sq_norm_total,
    target_error,
)

BUNDLED_BANK = bundled_bank()

EPS_DEFAULT = tuple(float(f"{e:.3g}") for e in np.geomspace(0.005, 0.10, 8))
ALLOCS = ("tensor", "pooled")
FIXED = ("fp8_e4m3", "fp8_e5m2", "fp16", "bf16", "zstd", "zstd_shuffle", "pcodec")  # natural setting only
NATURAL_AND_FP8 = ("kivi_int8", "kivi_int4", "kivi_int2")  # natural setting + searched at eps_fp8
SLOW = ("hevc", "hevc_chnorm")  # only at eps_fp8 (about 20-25 s per point per 2,048-token cache)
QUICK_TOKENS = 256

# name -> (label, CodecConfig kwargs, what it toggles)
ABLATIONS = {
    "default": ("full default (map + intra + channel choice + RoPE undo)", {}),
    "align": ("+ alignment (GPA frame)", {"align": True}),
    "no_inter": ("- inter-block (linear map)", {"inter_map": False}),
    "no_intra": ("- intra-block (token interpolation)", {"intra": False}),
    "blend": ("+ blending (paper's lambda predictor; + alignment)", {"blend": True, "align": True}),
    "no_channel_choice": ("- per-channel predictor choice", {"channel_choice": False}),
    "no_rope_undo": ("- RoPE undo (keys coded with RoPE)", {"rope_undo": False}),
    "paper": ("paper configuration (align + blend + intra, no map)", {"align": True, "blend": True,
                                                                       "inter_map": False}),
    "no_prediction": ("no prediction (no map, no intra)", {"inter_map": False, "intra": False}),
}
SELF_RANKS_DEFAULT = (None, 16)  # a rank-64 fit takes ~2x a rank-16 one (reduced-rank fit); kvz bench --self-ranks


# ============================================================================ small helpers

def _log(msg: str) -> None:
    try:
        from tqdm import tqdm
        tqdm.write(msg, file=sys.stderr)
    except ImportError:
        print(msg, file=sys.stderr, flush=True)


def default_caches() -> list[str]:
    """The bundled sample caches."""
    return sample_caches()


def run_bench(caches: list[str] | None = None, *, bank: str | None = None, calib: list[str] | None = None,
              eps_points=None, out: str = "out/bench", quick: bool = False, quality: bool = False,
              methods: list[str] | None = None, ablation: bool = True, calibration: bool = True,
              self_ranks=SELF_RANKS_DEFAULT, quality_prompts: int = 20, quality_prompt_tokens: int = 256,
              quality_new_tokens: int = 64, command: str | None = None, progress: bool = True,
              report: bool = True, threads: int | None = 1) -> dict:
    """Run the benchmark; write ``out/results.json`` (and the report); return the results dict."""
    from tqdm import tqdm

    import kvz.benchmarks.baselines as B
    from alignpred import Bank, CodecConfig, fit_bank, load_cache

    thread_note = limit_threads(threads) if threads else "not limited"
    t_start = time.perf_counter()
    c_start = time.process_time()
    os.makedirs(out, exist_ok=True)
    load_start = loadavg()
    cache_paths = list(caches or default_caches())
    if not cache_paths:
        raise ValueError("no caches given and no bundled samples found")
    if quick:
        cache_paths = cache_paths[:1]
    loaded = [load_cache(p) for p in cache_paths]
    if quick:
        loaded = [slice_cache(c, QUICK_TOKENS) for c in loaded]
    names = [os.path.splitext(os.path.basename(p))[0] for p in cache_paths]
    tensors = [dict(c.tensors) for c in loaded]
    norms = [sq_norm_total(t) for t in tensors]

    # ---- calibration caches for the calibration-based baselines (and for fitting a bank if none is given)
    def _load_calib(paths):
        cs = [load_cache(p) for p in paths]
        return [slice_cache(c, QUICK_TOKENS) for c in cs] if quick else cs

    calib_paths = list(calib or [])
    calib_mode = "given (--calib)"
    if not calib_paths and caches_in(CALIB_DIR):
        calib_paths = caches_in(CALIB_DIR)
        calib_mode = "data/calib (the caches the bundled bank is fitted on)"
    if calib_paths:
        fit_caches = _load_calib(calib_paths)
        shared = [dict(c.tensors) for c in fit_caches]
        calib_per_cache = [shared] * len(loaded)
        calib_desc = [display_path(p) for p in calib_paths]
    elif len(loaded) > 1:
        calib_mode = "leave-one-out over the inputs"
        calib_per_cache = [[tensors[j] for j in range(len(loaded)) if j != i] for i in range(len(loaded))]
        calib_desc = [display_path(p) for p in cache_paths]
        fit_caches = loaded
    else:
        others = [p for p in default_caches() if os.path.abspath(p) != os.path.abspath(cache_paths[0])]
        if not others:
            raise ValueError("no calibration caches: give --calib")
        calib_mode = "the other bundled samples (single input)"
        fit_caches = _load_calib(others)
        calib_per_cache = [[dict(c.tensors) for c in fit_caches]]
        calib_desc = [display_path(p) for p in others]

    # ---- the kvz bank
    bank_path = bank or (BUNDLED_BANK if os.path.exists(BUNDLED_BANK) else None)
    if bank_path:
        kbank = Bank.load(bank_path)
        bank_info = {"source": display_path(bank_path), "id": kbank.id, "bytes": os.path.getsize(bank_path)}
    else:
        _log(f"[bench] no bank given and {display_path(BUNDLED_BANK)} absent: fitting one on the calibration caches")
        t0 = time.perf_counter()
        kbank = fit_bank(fit_caches)
        bank_info = {"source": f"fitted in this run on the calibration caches ({time.perf_counter() - t0:.1f} s)",
                     "id": kbank.id, "bytes": len(kbank.to_bytes())}
    has_rot = _bank_has_rotations(kbank)

    # ---- methods
    avail = B.available()
    wanted = methods or (["kvz"] + list(B.BASELINES))
    unknown = [m for m in wanted if m != "kvz" and m not in B.BASELINES]
    if unknown:
        raise ValueError(f"unknown methods: {', '.join(unknown)} (have kvz, {', '.join(B.BASELINES)})")
    skipped = {m: "package missing: " + ", ".join(B.REQUIRES.get(m, ())) for m in wanted
               if m != "kvz" and m not in avail}
    run_methods = [m for m in wanted if m not in skipped]
    eps_points = sorted(float(e) for e in (eps_points or EPS_DEFAULT))
    rows: list[dict] = []
    tmpdir = tempfile.mkdtemp(prefix="kvz-bench-")
    memo: dict = {}

    def add(row: dict, method: str, ci: int, study: str = "main", variant: str | None = None):
        row.update(method=method, cache=names[ci], study=study)
        if variant is not None:
            row["variant"] = variant
        row["extra"]["sq_norm"] = norms[ci]
        row["extra"]["n_tokens"] = loaded[ci].layout.n_tokens
        rows.append(row)
        ex = row["extra"]
        ok = ex.get("meets_target")
        _log(f"  {method:<14} {row['alloc']:<6} eps {_fmt_eps(row['eps_target'])} {names[ci][:22]:<22} "
             f"bpv {row['bpv']:7.3f}  pooled {row['nrmse_pooled']:.5f}  worst {row['nrmse_max_tensor']:.5f}  "
             f"enc {row['encode_s']:6.2f}s dec {row['decode_s']:6.2f}s"
             + ("" if ok is None else ("" if ok else "  (misses target)")))

    # ---- 1. FP8 e4m3 first: its measured error defines the matched-error point
    fp8 = B.BASELINES["fp8_e4m3"]
    fp8_rows = []
    for ci in range(len(loaded)):
        r = baseline_point(fp8, tensors[ci], None, "tensor", None)
        fp8_rows.append(r)
    eps_fp8 = {"tensor": max(r["nrmse_max_tensor"] for r in fp8_rows),
               "pooled": math.sqrt(sum(r["nrmse_pooled"] ** 2 * n for r, n in zip(fp8_rows, norms)) / sum(norms))}
    _log(f"[bench] FP8 e4m3 measured error: worst tensor {eps_fp8['tensor']:.5f}, pooled {eps_fp8['pooled']:.5f}")

    # searchable baselines: every other sweep point, minus points within 20 % of FP8's error (run exactly there)
    coarse = [e for e in eps_points[::2] if all(abs(math.log(e / v)) > math.log(1.2) for v in eps_fp8.values())]

    # ---- 2. task list
    tasks = []  # (kind, method, alloc, eps, ci, extra)
    for m in run_methods:
        if m in FIXED:
            for ci in range(len(loaded)):
                tasks.append(("fixed", m, "tensor", None, ci, None))
            continue
        if m in NATURAL_AND_FP8:
            for ci in range(len(loaded)):
                tasks.append(("fixed", m, "tensor", None, ci, None))
        for alloc in ALLOCS:
            if quick or m in SLOW or m in NATURAL_AND_FP8:
                pts = [eps_fp8[alloc]]
            elif m == "kvz":
                pts = eps_points + [eps_fp8[alloc]]
            else:
                pts = coarse + [eps_fp8[alloc]]
            for e in sorted(set(pts)):
                for ci in range(len(loaded)):
                    tasks.append(("kvz" if m == "kvz" else "search", m, alloc, e, ci, None))
    if quick:
        ablation = calibration = False
    if "kvz" in run_methods and ablation:
        for key, (_label, kw) in ABLATIONS.items():
            if key == "default":
                continue
            if kw.get("align") and not has_rot:
                skipped[f"kvz:{key}"] = "bank has no rotations"
                continue
            for ci in range(len(loaded)):
                tasks.append(("ablation", f"kvz:{key}", "tensor", eps_fp8["tensor"], ci, key))
    if "kvz" in run_methods and calibration:
        for r in ((16,) if quick else self_ranks):
            for ci in range(len(loaded)):
                tasks.append(("self", f"kvz:self-r{r or 'full'}", "tensor", eps_fp8["tensor"], ci, r))

    # ---- 3. warm-up (imports, JIT caches, calibration fits) outside the timed runs, on a 64-token slice
    # (``tiny`` stays referenced: some baselines memoize per-array analysis by id())
    tiny = slice_cache(loaded[0], min(64, loaded[0].layout.n_tokens))
    for m in run_methods:
        try:
            if m == "kvz":
                kvz_point(tiny, kbank, 0.03, "tensor", tmpdir)
                if has_rot and ablation:
                    kvz_point(tiny, kbank, 0.03, "tensor", tmpdir, config=CodecConfig(align=True, blend=True))
            else:
                codec = B.BASELINES[m]
                _memo_prepare(codec, memo)
                codec.run(dict(tiny.tensors), None if codec.knob_kind == "none" else 0.03, "pooled",
                          calib=calib_per_cache[0] if codec.uses_calib else None)
        except Exception as e:  # a warm-up failure shows up again (and is reported) in the real run
            _log(f"[bench] warm-up of {m} failed: {e}")

    # ---- 4. run
    bar = tqdm(tasks, desc="bench", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    for kind, m, alloc, eps, ci, arg in bar:
        bar.set_description(f"{m} {alloc} {_fmt_eps(eps)} {names[ci][:16]}")
        if kind == "fixed":
            if m == "fp8_e4m3":
                row = fp8_rows[ci]
            else:
                row = baseline_point(B.BASELINES[m], tensors[ci], None, "tensor", None)
            for a in ALLOCS:
                rr = json.loads(json.dumps(row))
                rr["alloc"] = a
                rr["extra"]["natural_setting"] = True
                rr["extra"]["same_run_both_allocs"] = True
                add(rr, m, ci)
        elif kind == "search":
            codec = B.BASELINES[m]
            _memo_prepare(codec, memo)
            row = baseline_point(codec, tensors[ci], eps, alloc, calib_per_cache[ci])
            key = (codec.name, id(calib_per_cache[ci]), tuple(tensors[ci]))
            if codec.uses_calib and ("fit_s",) + key in memo:
                row["extra"]["prepare_fit_s"] = memo[("fit_s",) + key]
            add(row, m, ci)
        elif kind == "kvz":
            add(kvz_point(loaded[ci], kbank, eps, alloc, tmpdir), "kvz", ci)
        elif kind == "ablation":
            cfg = CodecConfig(**ABLATIONS[arg][1])
            add(kvz_point(loaded[ci], kbank, eps, alloc, tmpdir, config=cfg), m, ci, "ablation", arg)
        elif kind == "self":
            t0 = time.perf_counter()
            sb = fit_bank([loaded[ci]], rank=arg, rotations=False)
            fit_s = time.perf_counter() - t0
            row = kvz_point(loaded[ci], sb, eps, alloc, tmpdir, embed_bank=True)
            row["extra"].update(fit_s=fit_s, rank=arg)
            add(row, m, ci, "calibration", f"self-r{arg or 'full'}")
    bar.close()

    # ---- 5. results (+ quality)
    results = {
        "schema": "kvz-bench/1",
        "command": command or "kvz bench",
        "quick": quick,
        "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "code_rev": code_revision(),
        "machine": {**machine_info(), "threads": threads, "thread_limit": thread_note},
        "caches": [{"name": n, "path": display_path(p), "n_tokens": c.layout.n_tokens, "n_values": c.layout.n_values,
                    "layers": c.layout.num_layers, "kv_heads": c.layout.kv_heads, "head_dim": c.layout.head_dim,
                    "dtype": c.layout.dtype, "model": c.layout.model}
                   for n, p, c in zip(names, cache_paths, loaded)],
        "bank": bank_info,
        "calib": {"mode": calib_mode, "caches": calib_desc},
        "eps_points": eps_points,
        "eps_points_coarse": coarse,
        "eps_fp8": eps_fp8,
        "methods": run_methods,
        "skipped": skipped,
        "budget": {"slow_methods_fp8_only": [m for m in SLOW if m in run_methods],
                   "coarse_sweep": [m for m in run_methods if m not in SLOW + FIXED + NATURAL_AND_FP8
                                    and m != "kvz"]},
        "ablations": {k: {"label": v[0], "config": v[1]} for k, v in ABLATIONS.items()},
        "rows": rows,
    }
    results["summary_rows"] = summarize(rows)
    if quality:
        results["quality"] = run_quality_study(kbank, eps_fp8, eps_points, quality_prompts, quality_prompt_tokens,
                                               quality_new_tokens, progress)
    results["timing"] = {"wall_s": time.perf_counter() - t_start, "cpu_s": time.process_time() - c_start,
                         "loadavg_start": load_start, "loadavg_end": loadavg()}
    try:
        os.rmdir(tmpdir)
    except OSError:
        pass
    write_results(results, out, report)
    return results


def _bank_has_rotations(bank) -> bool:
    from alignpred.cache import block_name

    try:
        return bank.rotation(block_name("K", 0, 0)) is not None
    except Exception:
        return False


def _fmt_eps(e):
    return "natural" if e is None else f"{e:.4f} "


def write_results(results: dict, out: str, report: bool = True) -> None:
    """``out/results.json`` (and, with ``report``, the Markdown report and plot beside it)."""
    write_json(results, os.path.join(out, "results.json"))
    if report:
        from kvz.benchmarks.report import write_report

        write_report(results, out)


# ============================================================================ aggregation over caches

def summarize(rows: list[dict]) -> list[dict]:
    """One row per (study, method, variant, alloc, eps_target), pooled over the caches: bits and squared errors
    add up, the worst tensor is the worst over all caches, times add up."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r.get("study", "main"), r["method"], r.get("variant"), r["alloc"], r["eps_target"])
        groups.setdefault(key, []).append(r)
    out = []
    for (study, method, variant, alloc, eps), rs in groups.items():
        n = sum(r["n_values"] for r in rs)
        sn = [r["extra"].get("sq_norm", 1.0) for r in rs]
        pooled = math.sqrt(sum(r["nrmse_pooled"] ** 2 * s for r, s in zip(rs, sn)) / max(sum(sn), 1e-300))
        row = {"method": method, "alloc": alloc, "eps_target": eps,
               "bpv": sum(r["bpv"] * r["n_values"] for r in rs) / n, "nrmse_pooled": pooled,
               "nrmse_max_tensor": max(r["nrmse_max_tensor"] for r in rs),
               "encode_s": sum(r["encode_s"] for r in rs), "decode_s": sum(r["decode_s"] for r in rs),
               "n_values": n, "cache": "all", "study": study, "n_caches": len(rs)}
        if variant is not None:
            row["variant"] = variant
        ex = {}
        mts = [r["extra"].get("meets_target") for r in rs]
        ex["meets_target"] = None if any(m is None for m in mts) else all(mts)
        for k in ("encode_to_target_s", "search_s", "run_s", "cpu_s", "prepare_s", "prepare_fit_s", "fit_s",
                  "encode_cpu_s", "decode_cpu_s", "file_bytes", "bank_bytes", "total_bits", "meta_bits",
                  "bank_bits"):
            vals = [r["extra"][k] for r in rs if isinstance(r["extra"].get(k), (int, float))
                    and not isinstance(r["extra"].get(k), bool)]
            if vals:
                ex[k] = sum(vals)
        if any("bpv_payload_excl_bank" in r["extra"] for r in rs):
            ex["bpv_payload_excl_bank"] = sum(r["extra"].get("bpv_payload_excl_bank", r["bpv"]) * r["n_values"]
                                              for r in rs) / n
        for k in ("fixed_rate", "natural_setting", "knob", "rank", "bank_excluded_from_bpv", "bank_counted"):
            if k in rs[0]["extra"]:
                ex[k] = rs[0]["extra"][k]
        row["extra"] = ex
        out.append(row)
    return out


# ============================================================================ downstream quality

def quality_eps_list(eps_fp8: dict, eps_points) -> list[float]:
    """kvz eps values for the quality run: FP8's error and sweep points around it (a bracket for the
    quality-matched interpolation)."""
    e8 = eps_fp8["tensor"]
    near = sorted(eps_points, key=lambda e: abs(math.log(e / e8)))[:4]
    return sorted(set([e8] + near + [e for e in eps_points if e8 / 3 <= e <= e8 * 3]))


def run_quality_study(bank, eps_fp8: dict, eps_points, n_prompts: int, prompt_tokens: int, new_tokens: int,
                      progress: bool = True) -> dict:
    """kvz at FP8-level error (and around it) vs FP8 e4m3 and INT4 KIVI, downstream (Gemma 3 270M)."""
    from kvz.benchmarks import quality as Q  # needs torch + transformers; imported only here

    settings = {"identity fp32": Q.identity_setting("fp32"), "bf16 cast": Q.identity_setting("bf16")}
    eps_list = quality_eps_list(eps_fp8, eps_points)
    for e in eps_list:
        settings[f"kvz eps={e:.4g}"] = Q.kvz_setting(bank, e, "tensor")
    settings["fp8 e4m3"] = Q.fp8_setting()
    settings["int4 kivi g32"] = Q.int4_setting()
    t0 = time.perf_counter()
    res = Q.run_quality(settings, n_prompts=n_prompts, prompt_tokens=prompt_tokens, new_tokens=new_tokens,
                        progress=progress)
    res["quality_matched"] = Q.quality_matched_rate(res)
    res["bench"] = {"eps_fp8_tensor": eps_fp8["tensor"], "kvz_eps": eps_list, "scope": "tensor",
                    "wall_s": time.perf_counter() - t0}
    for s in res.get("settings", {}).values():  # keep the committed JSON small
        s.pop("per_prompt", None)
    for p in res.get("prompts", []):
        p.pop("continuation", None)
    return res


def run_quality_only(out: str, *, bank: str | None = None, n_prompts: int = 20, prompt_tokens: int = 256,
                     new_tokens: int = 64, progress: bool = True, report: bool = True) -> dict:
    """Add (or replace) the quality section of an existing ``out/results.json`` and regenerate the report."""
    from alignpred import Bank

    p = os.path.join(out, "results.json")
    with open(p) as f:
        results = json.load(f)
    bank_path = bank or (BUNDLED_BANK if os.path.exists(BUNDLED_BANK) else None)
    if bank_path is None:
        raise ValueError("--quality-only needs --bank (the bundled bank is absent)")
    kb = Bank.load(bank_path)
    if kb.id != results.get("bank", {}).get("id"):
        _log(f"[bench] note: quality bank {kb.id[:20]}… differs from the rate-distortion run's bank")
    t0 = time.perf_counter()
    results["quality"] = run_quality_study(kb, results["eps_fp8"], results["eps_points"], n_prompts, prompt_tokens,
                                           new_tokens, progress)
    results["quality"]["bank"] = {"source": display_path(bank_path), "id": kb.id}
    results.setdefault("timing", {})["quality_wall_s"] = time.perf_counter() - t0
    write_results(results, out, report)
    return results


# ============================================================================ speed (kvz bench --speed)

def run_speed(out: str, *, quick: bool = False, bank: str | None = None, caches: list[str] | None = None,
              command: str | None = None, progress: bool = True, extra_args=()) -> dict:
    """The speed benchmark (:mod:`kvz.benchmarks.speed`) into ``OUT/speed.{json,md,png}``, in a fresh
    process with the default thread environment (this process may have pinned BLAS/numba threads for the
    rate-distortion run); its acceptance lines are appended to ``OUT/RESULTS.md`` when that exists.
    ``extra_args``: more options of ``python -m kvz.benchmarks.speed`` (e.g. ``["--sections", "codecs"]``)."""
    import subprocess

    from kvz.benchmarks import speed as SP

    if not caches and not SP.default_caches():
        raise FileNotFoundError("the speed benchmark runs on data/eval/*.safetensors (2,048-token held-out "
                                "caches): make them with `python samples/make_samples.py --what eval`, or pass caches")
    os.makedirs(out, exist_ok=True)
    js = os.path.join(out, "speed.json")
    args = [sys.executable, "-m", "kvz.benchmarks.speed", "--json", js, "--plot", os.path.join(out, "speed.png"),
            "--md", os.path.join(out, "speed.md"), "--command", command or "kvz bench --speed"]
    if quick:
        args.append("--quick")
    if bank:
        args += ["--bank", bank]
    if not progress:
        args.append("-q")
    args += list(extra_args) + [os.path.abspath(c) for c in caches or ()]
    p = subprocess.run(args, env=SP.clean_env(pythonpath=os.environ.get("PYTHONPATH")),
                       stdout=None if progress else subprocess.DEVNULL)
    if p.returncode != 0 or not os.path.exists(js):
        raise RuntimeError(f"the speed benchmark failed (exit status {p.returncode})")
    with open(js) as f:
        res = json.load(f)
    md = os.path.join(out, "RESULTS.md")
    if os.path.exists(md):
        with open(md, "a", encoding="utf-8") as f:
            f.write("\n## Speed (kvz decode/encode vs SZ3, FP8, zstd, LMCache; restore vs prefill)\n\n"
                    "Full tables in [speed.md](speed.md), plot in speed.png.\n\n"
                    + "\n".join(f"- {'met' if a['met'] else 'NOT MET'}: {a['point']} - {a['detail']}"
                                for a in res.get("acceptance", [])) + "\n")
    return res
