"""One run of the speed benchmark: every section asked for, the results saved after each, and
re-rendering a results JSON from its raw rows."""
from __future__ import annotations

import gc
import inspect
import math
import os
import time

from ..harness import (
    WARM_SAMPLE,
    all_threads,
    bank_file,
    code_revision,
    cpu_probe,
    display_path,
    eval_caches,
    loadavg,
    machine_info,
    package_versions,
    read_json,
    resolve_bank,
    stem,
    thread_counts,
    write_json,
    write_text,
)
from ..harness.machine import THREAD_VARS
from .acceptance import acceptance
from .cli_study import cli_section
from .codec_study import aggregate, by_cores, codec_section
from .codecs import KvzCodec, lmcache_status
from .config import BANK, CHUNK_THREADS, CODECS, EPS, KVZ01_COMMIT, KVZ01_DIR, PRESETS, SCHEMA, SCOPE, SECTIONS, log
from .entropy_stage import entropy_section
from .one_chunk import chunk_section
from .plot import write_plot
from .processes import ensure_kvz01, summarize_env, summarize_versions, version_env_section
from .profiling import bound_section, profile_decode
from .report import markdown
from .restore import restore_section


def default_caches() -> list[str]:
    """The caches the benchmark runs on by default: the 2,048-token held-out caches (``data/eval``)."""
    return eval_caches()


def machine() -> dict:
    """The harness's machine description plus threads, thread variables, BLAS pools and versions."""
    m = machine_info()
    m["all_threads"] = all_threads()
    m["env"] = {k: os.environ[k] for k in THREAD_VARS + ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
                if k in os.environ}
    try:
        from threadpoolctl import threadpool_info

        m["blas"] = [{k: i.get(k) for k in ("user_api", "internal_api", "num_threads", "version",
                                            "architecture")} for i in threadpool_info()]
    except Exception:
        pass
    m.setdefault("packages", {}).update(package_versions(("torch", "ml_dtypes", "lmcache", "transformers")))
    try:
        import alignpred

        m["kvz"] = alignpred.__version__
    except Exception:
        pass
    return m


def run(preset: str = "full", caches: list[str] | None = None, *, bank: str = BANK, codecs=CODECS,
        sections=SECTIONS, kvz01: str = KVZ01_DIR,
        overrides: dict | None = None, json_out: str | None = None, plot_out: str | None = None,
        md_out: str | None = None, command: str | None = None, progress: bool = True) -> dict:
    """The whole benchmark; returns the results (and writes what was asked)."""
    from alignpred import load_cache

    cfg = {**PRESETS[preset], **(overrides or {})}
    t_start, c_start = time.perf_counter(), time.process_time()
    paths = list(caches or default_caches())
    if not paths:
        raise FileNotFoundError("no caches: make data/eval/*.safetensors with `python samples/make_samples.py "
                                "--what eval`, or pass cache paths")
    if cfg["n_caches"]:
        paths = paths[:cfg["n_caches"]]
    kbank = resolve_bank(bank)
    bank_path = bank_file(bank)
    loaded = [(stem(p), load_cache(p)) for p in paths]
    res: dict = {"schema": SCHEMA, "command": command or "python -m kvz.benchmarks.speed" +
                 (" --quick" if preset == "quick" else ""), "quick": preset == "quick",
                 "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "code_rev": code_revision(),
                 "machine": machine(), "loadavg_start": loadavg(), "settings": {**cfg, "eps": EPS, "scope": SCOPE,
                                                                                 "bank": bank, "codecs": list(codecs),
                                                                                 "sections": list(sections)},
                 "caches": [{"name": n, "path": display_path(p), "n_tokens": c.layout.n_tokens,
                             "n_values": c.layout.n_values, "dtype": c.layout.dtype}
                            for (n, c), p in zip(loaded, paths)],
                 "n_caches": len(loaded), "tokens": loaded[0][1].layout.n_tokens, "notes": []}
    ok, why = lmcache_status()
    res["lmcache"] = {"available": ok, "detail": why}
    n_all = res["machine"]["all_threads"]
    threads = sorted(set(thread_counts(n_all)) | ({2} if n_all >= 2 else set()))  # 1, 2 and all
    _warm_kvz(kbank)
    res["cpu_probe_start"] = cpu_probe()
    log(f"CPU probe: {res['cpu_probe_start']}")

    def save(final: bool = False):
        if final:
            res["cpu_probe_end"] = cpu_probe()
            pr = [res.get("cpu_probe_start", {}), res["cpu_probe_end"]]
            sc = [p["scaling"] for p in pr if "scaling" in p]
            if n_all > 1 and sc and min(sc) < 0.75 * n_all:
                res["notes"].append(
                    f"{n_all} threads of GIL-free work ran only {min(sc):.2f}x as fast as 1 thread during this run "
                    f"(CPU probe; 1 thread got {pr[0].get('1', {}).get('cpu_over_wall', math.nan):.2f} CPU-s per "
                    "second): the machine was shared or throttled, so the multi-thread figures here do not show "
                    "kvz's scaling; the CPU-time columns approximate an idle core")
        res["loadavg_end"] = loadavg()
        res["wall_s"] = time.perf_counter() - t_start
        res["cpu_s"] = time.process_time() - c_start
        res["acceptance"] = acceptance(res)
        if json_out:
            write_json(res, json_out)
        if md_out:
            write_text(md_out, markdown(res))

    if "codecs" in sections:
        log(f"codecs on {len(loaded)} caches, threads {threads}, {cfg['rounds']} rounds (load {loadavg()})")
        cs = codec_section(loaded, kbank, codecs=codecs, threads=threads, rounds=cfg["rounds"],
                           enc_rounds=cfg["enc_rounds"], progress=progress)
        res["rows"], res["skipped"], res["identity"] = cs["rows"], cs["skipped"], cs["identity"]
        res["idle_core"] = cs["idle_core"]
        res["aggregate"] = aggregate(cs["rows"])
        res["break_even_by_cores"] = by_cores(res["aggregate"])
        save()
    if "entropy" in sections:
        log("entropy stage (rans4, lanes32) ...")
        res["entropy"] = entropy_section(paths[0], objects=cfg["entropy_objects"], rounds=cfg["entropy_rounds"])
        save()
    if "chunk" in sections and "kvz" in codecs:
        log(f"one chunk on {CHUNK_THREADS} threads ...")
        res["chunk"] = chunk_section(loaded[0][0], loaded[0][1], kbank, rounds=cfg["chunk_rounds"], progress=progress)
        save()
    if "profile" in sections and "kvz" in codecs:
        c = KvzCodec(loaded[0][1], kbank)
        c.encode(n_all)
        c.decode(1)
        res["profile"] = profile_decode(c)
        res["profile"]["cache"] = loaded[0][0]
        del c
        save()
    if "bound" in sections and "kvz" in codecs:
        log("one-thread bound of exact map products ...")
        c = KvzCodec(loaded[0][1], kbank)
        c.encode(n_all)
        res["bound"] = bound_section(c)
        res["bound"]["cache"] = loaded[0][0]
        del c
        save()
    if "processes" in sections:
        ok01, where = ensure_kvz01(kvz01)
        res["kvz01"] = {"available": ok01, "detail": where, "commit": KVZ01_COMMIT}
        if not ok01:
            res["notes"].append(f"kvz 0.1 not measured: {where}")
        log(f"fresh-process workers (kvz 0.1: {where}) ...")
        res["processes"] = version_env_section(
            paths[:cfg["proc_caches"]] if cfg["proc_caches"] else paths, bank_path=bank_path,
            kvz01=kvz01 if ok01 else None, threads=threads,
            proc_rounds=cfg["proc_rounds"], env_rounds=cfg["env_rounds"], env_variants=cfg["env_variants"],
            rep_enc=cfg["rep_enc"], rep_dec=cfg["rep_dec"], progress=progress)
        save()
    if "cli" in sections:
        log("CLI vs in process ...")
        res["cli"] = cli_section(loaded[0][1], kbank, rounds=cfg["cli_rounds"], progress=progress)
        res["cli"]["cache"] = loaded[0][0]
        save()
    del loaded
    gc.collect()
    if "restore" in sections:
        try:
            res["restore"] = restore_section(cfg["prefill_tokens"], kbank, repeats=cfg["restore_repeats"],
                                             progress=progress)
        except (ImportError, FileNotFoundError, RuntimeError, OSError) as e:
            res["notes"].append(f"restore vs prefill not measured: {type(e).__name__}: {e}")
            log(res["notes"][-1])
        save()
    if not ok and "lmcache_k16v8" in codecs:
        res["notes"].append(f"LMCache not measured: {why}")
    res["notes"].append("baselines' 'all threads' = their tensors (LMCache: layers) split over a thread pool; kvz's = "
                        "its own threads= (object ranges); SZ3 at a per-tensor absolute bound giving NRMSE <= eps per "
                        "tensor (the knob search is set-up, not encode time); zstd-19 encode timed once")
    save(final=True)
    if plot_out and res.get("aggregate"):
        write_plot(res, plot_out)
    return res


def _warm_kvz(bank) -> None:
    """JIT-compile/load kvz's kernels and plans outside the timed runs (a 448-token sample)."""
    from alignpred import ErrorBudget, KvzReader, compress, load_cache

    p = WARM_SAMPLE
    if not os.path.exists(p):
        return
    c = load_cache(p)
    for th in thread_counts():
        kw = {"threads": th} if "threads" in inspect.signature(compress).parameters else {}
        data = compress(c, None, budget=ErrorBudget(eps=EPS, scope=SCOPE), bank=bank, **kw).data
        KvzReader(data, bank=bank, threads=th).read()


def render(json_path: str, plot_out: str | None = None, md_out: str | None = None) -> dict:
    """Recompute the summaries and the acceptance from a results JSON's raw rows and runs, and rewrite
    it with its Markdown and plot (after a change to how results are summarised; nothing is re-timed)."""
    res = read_json(json_path)
    if res.get("rows"):
        res["aggregate"] = aggregate(res["rows"])
        res["break_even_by_cores"] = by_cores(res["aggregate"])
    pr = res.get("processes")
    if pr and pr.get("runs"):
        pr["summary"], pr["env"] = summarize_versions(pr["runs"]), summarize_env(pr["runs"])
    res["acceptance"] = acceptance(res)
    write_json(res, json_path)
    base = os.path.splitext(json_path)[0]
    write_text(md_out or base + ".md", markdown(res))
    if res.get("aggregate"):
        write_plot(res, plot_out or base + ".png")
    return res


def print_acceptance(res: dict) -> None:
    """One line per acceptance point."""
    for x in res.get("acceptance", []):
        cpu = "" if x.get("met_cpu") in (None, x["met"]) else f" [by CPU time: {'met' if x['met_cpu'] else 'not met'}]"
        print(f"{'met' if x['met'] else 'NOT MET':>8}  {x['point']}: {x['detail']}{cpu}")
