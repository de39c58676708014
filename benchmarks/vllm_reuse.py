"""Prefix reuse through vLLM's KV connectors: vLLM serving Gemma 3 270M on this CPU, prompts of
1K–8K tokens sharing a prefix (system prompt + documents), each store measured across two engine
processes — a *writer* that computes and stores the prefix, then a *reader* whose request has the same
prefix and another question.

Stores: ``recompute`` (no connector), ``example`` (vLLM's ``ExampleConnector``: raw safetensors per
layer), ``kvz`` (lossy, eps 0.02), ``kvz-lossless`` (each in a directory), and ``kvz-cluster`` /
``kvz-lossless-cluster``: the same on a Redis Cluster (3 masters, a replica each, started for the
run from ``redis-server``), so writer and reader are two engines on one cluster (issue 38); the
default stores are ``recompute,kvz,example,kvz-lossless,kvz-cluster``. Per store and prompt: TTFT of the reader
(vLLM's ``first_token_latency``), cached tokens, stored bytes (what the writer stored for the
prompt) against the raw bf16 bytes of the same tokens, identical greedy tokens and the mean KL of
the first steps' top-20 logprobs against recompute; for kvz the TTFT split (decode, copy into the
paged cache, the rest: lookup + remaining prefill).

    python -m kvz.benchmarks.vllm_reuse [--quick] [--json OUT.json] [--md OUT.md] [--model DIR]
    python -m kvz.benchmarks.vllm_reuse --rounds 3 --sizes 8192 --topk 4096 --json OUT.json --md OUT.md

Needs the vLLM venv (see ``.ci/vllm.sh``). ``--quick``: one 1K prompt (CI smoke; no timing claim).
``--rounds R``: the engines run one after another and each measures its TTFT ``R`` times (median;
kvz's hits alternate with cold prefills in the same engine), the KL on the top ``--topk`` logprobs:
see :mod:`kvz.benchmarks.vllm_ttft`.
Engines are pinned to one core (``VLLM_CPU_OMP_THREADS_BIND``) so every store runs with the same
thread count; kvz's codec runs on the same core in the engine's process.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from kvz.integrations.vllm import mean_kl  # noqa: F401 - also this module's name for it (tests, vllm_ttft)

from .harness.vllm_engines import (  # noqa: F401 - this module's names for them too (vllm_hit)
    BS,
    LOGPROBS,
    QUESTION,
    SIZES,
    SYSTEM,
    build_prompts,
    redis_cluster,
    resolve_model,
    store_cfg,
)
from .harness.vllm_engines import engine as _run_engine
from .harness.vllm_engines import texts as _texts  # noqa: F401

STORES = ("recompute", "kvz", "example", "kvz-lossless", "kvz-cluster")
RESUME = False
_store_cfg = store_cfg


def _engine(spec: dict, root: Path, name: str, timeout: int = 3600, core: int | None = None,
            resume: bool | None = None) -> dict:
    """One engine process (:func:`kvz.benchmarks.harness.vllm_engines.engine`); ``resume`` defaults to
    ``--resume``."""
    return _run_engine(spec, root, name, timeout=timeout, core=core, resume=RESUME if resume is None else resume)


def run(sizes, stores, model_dir: str, max_tokens: int = 8, workdir: str | None = None, log=print,
        partial=None) -> list[dict]:
    """Rows, one per store and size (``--json``); a ``*-cluster`` store runs on a cluster started for
    the run and stopped after it."""
    with redis_cluster(stores) as cluster_url:
        return _run(sizes, stores, model_dir, max_tokens, workdir, log, partial, cluster_url)


def _run(sizes, stores, model_dir, max_tokens, workdir, log, partial, cluster_url) -> list[dict]:
    root = Path(workdir or tempfile.mkdtemp(prefix="kvz-vllm-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    prompts = build_prompts(model_dir, sizes)
    mml = max(sizes) + max_tokens + BS
    warm = [[2] + list(range(3000, 3000 + 300))]  # a first request in every engine: not measured
    base = {"model": model_dir, "max_tokens": max_tokens, "max_model_len": mml, "block_size": BS,
            "logprobs": LOGPROBS, "warmup_prompts": warm}
    rows = []
    L, H, d = 18, 1, 256
    # phase 1 in parallel: recompute and every writer; phase 2: every reader (read-only, with a 1-token
    # TTFT probe: wall and CPU seconds). CPU seconds are what a contended machine cannot distort.
    from concurrent.futures import ThreadPoolExecutor

    readers = [prompts[n][1] for n in sizes]
    cores = sorted(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(stores)) as ex:
        futs = {}
        for store in stores:
            cfg = _store_cfg(store, root, cluster_url)
            if store == "recompute":
                futs[store] = ex.submit(_engine, {**base, "prompts": readers, "store": None, "ttft_probe": True},
                                        root, "recompute", core=cores[len(futs) % len(cores)])
            else:
                futs[store] = ex.submit(_engine, {**base, "prompts": [prompts[n][0] for n in sizes], "store": cfg},
                                        root, f"{store}-writer", core=cores[len(futs) % len(cores)])
        first = {k: f.result() for k, f in futs.items()}
    log(f"  phase 1 (recompute + writers): {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(stores)) as ex:
        futs = {}
        for store in stores:
            if store == "recompute":
                continue
            cfg = _store_cfg(store, root, cluster_url)
            if isinstance(cfg, dict) and cfg.get("kind") != "example":
                cfg = {**cfg, "read_only": True}
            futs[store] = ex.submit(_engine, {**base, "prompts": readers, "store": cfg, "ttft_probe": True},
                                    root, f"{store}-reader", core=cores[len(futs) % len(cores)])
        second = {k: f.result() for k, f in futs.items()}
    log(f"  phase 2 (readers): {time.perf_counter() - t0:.0f} s")
    ref = first.get("recompute")
    for store in stores:
        w = None if store == "recompute" else first[store]
        r = first[store] if store == "recompute" else second[store]
        for i, n in enumerate(sizes):
            rr = r["results"][i]
            rec = ref["results"][i] if ref is not None else None
            wd = w["results"][i]["delta"] if w is not None else {}
            stored = int(wd.get("stored_bytes", 0))
            stored_tokens = sum(x["blocks"] for x in wd.get("runs", [])) * BS if store.startswith("kvz") else \
                ((n - 1) // BS * BS if store == "example" else 0)
            row = {"store": store, "prompt_tokens": n, "shared_tokens": prompts[n][2],
                   "cached_tokens": rr["cached_tokens"],
                   "identical": bool(rec is not None and rr["tokens"] == rec["tokens"]),
                   "ttft_s": round(rr["ttft_probe_s"], 4), "recompute_ttft_s": round(rec["ttft_probe_s"], 4) if rec else None,
                   "ttft_vllm_s": round(rr["ttft_s"], 4),
                   "ttft_cpu_s": round(rr.get("ttft_cpu_s", 0.0), 4),
                   "recompute_ttft_cpu_s": round(rec.get("ttft_cpu_s", 0.0), 4) if rec else None,
                   "stored_bytes": stored, "stored_tokens": stored_tokens,
                   "raw_bytes": stored_tokens * L * 2 * H * d * 2,
                   "kl_top20": mean_kl(rec["logprobs"], rr["logprobs"]) if rec else None}
            dl = rr.get("probe_delta", {})
            if store.startswith("kvz"):
                row.update(decode_s=round(dl.get("decode_s", 0.0), 4), copy_s=round(dl.get("copy_s", 0.0), 4),
                           rest_s=round(rr["ttft_probe_s"] - dl.get("decode_s", 0.0) - dl.get("copy_s", 0.0), 4),
                           encode_s=round(wd.get("encode_s", 0.0), 3))
            rows.append(row)
    if partial is not None:
        partial(rows)
    return rows


def to_markdown(rows, note: str = "") -> str:
    lines = ["| store | prompt | cached | identical | TTFT s | recompute s | ratio | CPU-s ratio | stored bytes/token | × raw | × example | KL top-20 | decode / copy / rest s |",
             "|---|---:|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    ex = {r["prompt_tokens"]: r for r in rows if r["store"] == "example"}
    for r in rows:
        per = r["stored_bytes"] / r["stored_tokens"] if r["stored_tokens"] else 0
        e = ex.get(r["prompt_tokens"])
        xe = (f"{r['stored_bytes'] / e['stored_bytes']:.3f}" if e and e["stored_bytes"] and r["stored_bytes"] else "")
        ratio = f"{r['ttft_s'] / r['recompute_ttft_s']:.2f}" if r["recompute_ttft_s"] else ""
        cr = (f"{r['ttft_cpu_s'] / r['recompute_ttft_cpu_s']:.2f} ({r['ttft_cpu_s']:.1f} s)"
              if r.get("recompute_ttft_cpu_s") else "")
        split = f"{r['decode_s']:.2f} / {r['copy_s']:.3f} / {r['rest_s']:.2f}" if "decode_s" in r else ""
        kl = f"{r['kl_top20']:.2e}" if r.get("kl_top20") is not None else ""
        lines.append(f"| {r['store']} | {r['prompt_tokens']} | {r['cached_tokens']} | {'yes' if r['identical'] else 'no'} "
                     f"| {r['ttft_s']:.2f} | {r['recompute_ttft_s'] or 0:.2f} | {ratio} | {cr} | {per:.0f} "
                     f"| {r['stored_bytes'] / r['raw_bytes']:.3f} | {xe} | {kl} | {split} |"
                     if r["raw_bytes"] else
                     f"| {r['store']} | {r['prompt_tokens']} | {r['cached_tokens']} | {'yes' if r['identical'] else 'no'} "
                     f"| {r['ttft_s']:.2f} | {r['recompute_ttft_s'] or 0:.2f} | {ratio} | {cr} | | | | {kl} | |")
    return "\n".join(lines) + ("\n\n" + note if note else "") + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="vLLM prefix reuse through kvz and ExampleConnector")
    ap.add_argument("--quick", action="store_true", help="one 1K prompt (CI smoke)")
    ap.add_argument("--sizes", default=None, help="comma-separated prompt sizes (default 1024,2048,4096,8192)")
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--model", default=os.environ.get("KVZ_VLLM_MODEL_DIR"))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--md", dest="md_out")
    ap.add_argument("--workdir")
    ap.add_argument("--resume", action="store_true", help="reuse the engines' outputs already in --workdir")
    ap.add_argument("--rounds", type=int, default=0,
                    help="sequential engines, TTFT median of this many rounds (kvz.benchmarks.vllm_ttft)")
    ap.add_argument("--recompute-rounds", type=int, default=None,
                    help="with --rounds: rounds of the no-connector engine (default --rounds)")
    ap.add_argument("--cold", action="store_true", help="with --rounds: a cold 8K prefill before each of kvz's hits")
    ap.add_argument("--topk", type=int, default=4096, help="logprobs per step for the KL (with --rounds)")
    ap.add_argument("--hit", action="store_true",
                    help="kvz's hit against ExampleConnector's: profiles, auto, Redis behind links (kvz.benchmarks.vllm_hit)")
    ap.add_argument("--links", default="1g,10g", help="with --hit: link rates of the Redis rows (bits/s, k/m/g)")
    ap.add_argument("--plot", help="with --hit: a PNG of TTFT per store and link")
    a = ap.parse_args(argv)
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:  # before the engines run, not after
            ap.error("--plot needs matplotlib (pip install matplotlib); or plot afterwards in kvz's own venv: "
                     "python -m kvz.benchmarks.vllm_hit --from-json RESULT.json --plot OUT.png")
    global RESUME
    RESUME = a.resume
    if a.hit:
        return _hit_main(a, argv)
    sizes = [1024] if a.quick else [int(x) for x in (a.sizes or ",".join(map(str, SIZES))).split(",")]
    stores = a.stores.split(",")
    if "recompute" not in stores:
        stores = ["recompute"] + stores
    stores = ["recompute"] + [s for s in stores if s != "recompute"]
    if a.rounds > 0 and a.recompute_rounds == 0:  # the kvz writers' cold prefills are the recompute
        stores = [s for s in stores if s != "recompute"]
    model = resolve_model(a.model)
    t0 = time.perf_counter()
    def partial(rows):
        if a.json_out:
            Path(a.json_out + ".partial").write_text(json.dumps(rows, indent=1) + "\n")

    eprint = lambda m: print(m, file=sys.stderr)  # noqa: E731
    if a.rounds > 0:
        from . import vllm_ttft

        rows = vllm_ttft.run(sizes, stores, model, rounds=a.rounds, max_tokens=a.max_tokens, topk=a.topk,
                             workdir=a.workdir, cold=a.cold, resume=a.resume,
                             recompute_rounds=a.recompute_rounds, log=eprint)
        partial(rows)
    else:
        rows = run(sizes, stores, model, a.max_tokens, a.workdir, log=eprint, partial=partial)
    cmd = " ".join(["python -m kvz.benchmarks.vllm_reuse"] + [Path(x).name if "/" in x else x for x in
                                                              (argv if argv is not None else sys.argv[1:])])
    note = (f"Measured with `{cmd}` in {time.perf_counter() - t0:.0f} s: vLLM 0.32 CPU, Gemma 3 270M bf16, "
            f"block 128, engines pinned to one core{' and run one at a time' if a.rounds > 0 else ''}, "
            f"prefix caching off (all reuse through the connector).")
    md = (vllm_ttft.to_markdown if a.rounds > 0 else to_markdown)(rows, note)
    print(md)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    if a.md_out:
        Path(a.md_out).write_text(md)
    return 0


def _hit_main(a, argv) -> int:
    from . import vllm_hit

    sizes = [int(x) for x in (a.sizes or "8192").split(",")]
    model = resolve_model(a.model)
    results = []
    for n in sizes:
        results.append(vllm_hit.run(n, model, rounds=max(1, a.rounds or 3), links=a.links.split(",") if a.links else (),
                                    workdir=a.workdir and str(Path(a.workdir) / f"n{n}"), topk=min(a.topk, 20),
                                    recompute_rounds=a.recompute_rounds or None,
                                    log=lambda m: print(m, file=sys.stderr)))
    cmd = " ".join(["python -m kvz.benchmarks.vllm_reuse"] + [Path(x).name if "/" in x else x for x in
                                                              (argv if argv is not None else sys.argv[1:])])
    import platform

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), platform.processor())
    flags = set(next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), []))
    isa = "+".join(f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile") if f in flags) or "?"
    cpu = f"{cpu} ({isa})"
    for r in results:
        r["cpu"] = cpu
    note = (f"Measured with `{cmd}`: vLLM 0.32 CPU, Gemma 3 270M bf16, block 128, prefix caching off, on a "
            f"{os.cpu_count()}-core {cpu}; engine on core {results[0]['engine_core']}, kvz's loads on "
            f"{results[0]['load_cores']}; {sum(r['seconds'] for r in results):.0f} s in all.")
    md = "\n".join(vllm_hit.markdown(r, note) for r in results)
    print(md)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1) + "\n")
    if a.md_out:
        Path(a.md_out).write_text(md)
    if a.plot:
        vllm_hit.plot(results[-1], a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
