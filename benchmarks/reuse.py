"""Reuse shared content's KV across prompts: kvz's chunk store vs full recompute vs the ``kvboost`` package.

Workload (RAG-like, Gemma 3 270M, CPU): a pool of documents (windows of ``doc_tokens`` tokens from the
repository's sample texts, each led by ``Document:``), a handful of *topics* each retrieving an ordered
list of ``docs_per_prompt`` documents that overlap across topics, and a question per prompt (always
new). Prompt = BOS + system prompt + the topic's documents + question. A topic asked again usually
retrieves its documents in the same order (an exact prefix: prefix-key reuse); with probability
``shuffle_p`` retrieval reorders them, and documents recur at different positions in other topics
(content-key reuse at another position, with repair). The application knows where each document
starts and passes those positions as chunk ``boundaries``.

Strategies, interleaved prompt by prompt in one process (same model, machine and load):

* ``full`` — full recompute (the reference: its greedy continuation and logits);
* ``kvz-prefix`` — kvz chunk store (default eps), exact prefix-key hits only;
* ``kvz-content`` — prefix, then content-key hits at other positions, re-rotated and repaired;
* ``kvz-prefix-lossless`` — prefix reuse from an uncompressed float32 store (must be identical);
* ``fp8-same-positions`` — the same positions kvz-prefix served from its store, as an FP8 e4m3 cache
  (per-tensor scale) instead: the quality yardstick for kvz's default eps;
* ``kvboost`` — the ``kvboost`` package (0.9.0): ``KVBoost(model=fp32 model, tokenizer, max_cache_bytes,
  device="cpu")``, default chunk-reuse mode; its tokenizer call is replaced by our token ids so it sees
  the same prompts.

Metrics per strategy: ``ttft_s`` (from the call to the first generated token: lookup, fetch, decode,
re-rotation, repair and the remaining prefill; storing new chunks comes after the first token and is
reported as ``store_s``), ``reuse_frac`` (prompt positions whose KV came from the store and were not
recomputed), ``identical_frac`` (32-token greedy continuations identical to full recompute),
``kl_mean`` (mean per-token KL(full || strategy) of the next-token distribution, float64), and
``stored_bytes`` (kvz: bytes of the stored chunk blobs; ``raw_fp16_bytes`` the same positions as raw
fp16; kvboost: its own cache bytes). kvz strategies are measured along the reference's greedy path by
teacher forcing (a greedy run follows it exactly up to the first argmax that differs, so "identical" is
read off the same pass); kvboost only exposes a free run, so its KL is along its own greedy path
against the reference model teacher-forced on that path.

Also: a repair sweep (``R`` tokens after each seam, CacheBlend-style top fraction by probe deviation,
both) on prompts with content hits; and a budget scenario (a byte budget holding a quarter of the
workload's distinct documents as raw fp16): kvz (LRU and importance eviction) vs kvboost at 16/8/4 bits,
TTFT and hit rates.

Run::

    python -m kvz.benchmarks.reuse --quick --json benchmarks/results/reuse-quick.json
    python -m kvz.benchmarks.reuse --json benchmarks/results/reuse.json --md benchmarks/results/reuse.md
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from .harness import command_line, parser, write_json, write_text
from .reuse_workload import (  # noqa: F401 - QUESTIONS, SYSTEM, TEXTS: this module's names too (reuse_repair)  # noqa: F401 - Ref, _kl_rows, _score_tf: this module's names too
    QUESTIONS,
    SYSTEM,
    TEXTS,
    Ref,
    _fp8,
    _kl_rows,
    _score_tf,
    _tf,
    build_workload,
    to_markdown,
)

__all__ = ["build_workload", "run", "main"]


class KvzStrategy:
    def __init__(self, name, model, store_dir, *, reuse, repair="seam", R=32, blend_ratio=0.1, codec="kvz",
                 eps=None, chunk_tokens=256, budget=None, policy="lru", raw_dtype="float32", backend=None):
        from kvz.integrations.chunkstore import DEFAULT_EPS, ChunkStore, ReuseEngine
        from kvz.integrations.kvstore import DirectoryBackend

        self.name = name
        be = backend or DirectoryBackend(os.path.join(store_dir, name), budget_bytes=budget, policy=policy,
                                         fsync=False)
        self.store = ChunkStore.for_model(model, be, model_id="gemma-3-270m", codec=codec,
                                          eps=DEFAULT_EPS if eps is None else eps, chunk_tokens=chunk_tokens,
                                          raw_dtype=raw_dtype, max_positions=4096)
        self.engine = ReuseEngine(model, self.store, reuse=reuse, repair=repair, R=R, blend_ratio=blend_ratio)

    def run(self, p, ref: Ref | None, score=True):
        res = self.engine.prefill(p["ids"], p["boundaries"])
        t0 = time.perf_counter()
        int(res.logits.argmax())
        ttft = res.stats["ttft_s"] + (time.perf_counter() - t0)
        st = self.engine.store_result(res)
        row = {"ttft_s": ttft, "reuse_frac": res.stats["reuse_frac"], "store_s": st["store_s"],
               **{k: res.stats[k] for k in ("prefix_tokens", "content_tokens", "repaired_tokens", "computed_tokens",
                                            "n_prefix_hits", "n_content_hits", "n_chunks", "decode_s", "forward_s",
                                            "lookup_s", "probe_s")}}
        if score and ref is not None:
            row["identical"], row["kl_mean"], row["first_div"] = _score_tf(ref, res.logits, res.cache)
        self.last = res
        return row

    def stored(self):
        be = self.store.backend.stats()
        return {"stored_bytes": int(self.store.counters["put_bytes"]), "backend_bytes": int(be["bytes"]),
                "stored_chunks": int(self.store.counters["puts"]), "evictions": int(be.get("evictions", 0))}


class KvboostStrategy:
    def __init__(self, name, model, tok, *, max_cache_bytes=int(64e9), kv_cache_bits=16):
        import kvboost

        self.name = name
        self.kvb = kvboost
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.engine = kvboost.KVBoost(model=model, tokenizer=tok, max_cache_bytes=int(max_cache_bytes),
                                          device="cpu", kv_cache_bits=kv_cache_bits, max_chunks=1_000_000)
        self._ids: dict = {}
        self.engine._encode = lambda text: list(self._ids[text])
        self._orig_sample = self.engine._sample
        self._steps: list = []

        def sample(logits, temperature, do_sample):
            self._steps.append(logits[0].detach().float().clone())
            return self._orig_sample(logits, temperature, do_sample)

        self.engine._sample = sample
        self.errors = 0

    def run(self, p, ref: Ref | None, score=True, n_new=32):
        key = f"prompt-{len(self._ids)}"
        self._ids[key] = p["ids"]
        self._steps = []
        first = {}
        toks = []

        def on_token(t):
            if "t" not in first:
                first["t"] = time.perf_counter()
            toks.append(int(t))

        t0 = time.perf_counter()
        err = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = self.engine.generate(key, max_new_tokens=n_new if score else 1, do_sample=False, on_token=on_token)
            reuse = float(r.kv_reuse_ratio)
        except Exception as e:  # noqa: BLE001 - its CacheBlend path fails on Gemma 3; the request is retried plainly
            err = f"{type(e).__name__}: {str(e)[:120]}"
            self.errors += 1
            self._steps, toks, first = [], [], {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.engine.generate(key, max_new_tokens=n_new if score else 1, do_sample=False, on_token=on_token,
                                     mode=self.kvb.GenerationMode.BASELINE)
            reuse = 0.0
        ttft = first.get("t", time.perf_counter()) - t0
        row = {"ttft_s": ttft, "reuse_frac": reuse}
        if err:
            row["error"] = err
        if score and ref is not None and self._steps:
            import torch

            logits = torch.stack(self._steps)
            n = min(len(toks), len(ref.tokens))
            kl = _kl_rows(ref.along(toks[:n]), logits[:n])
            row["identical"] = toks[:len(ref.tokens)] == ref.tokens
            row["kl_mean"] = float(kl.mean())
            row["first_div"] = next((i for i, (a, b) in enumerate(zip(toks, ref.tokens)) if a != b), len(ref.tokens))
        return row

    def stored(self):
        s = self.engine.cache_manager.stats()
        return {"stored_bytes": int(self.engine.cache_manager._bytes_used), "hit_rate": s.get("hit_rate"),
                "exact_hit_rate": s.get("exact_hit_rate"), "evictions": s.get("evictions"),
                "budget_rejections": s.get("budget_rejections"), "hot_chunks": s.get("hot_chunks")}


def fp8_same_positions(ref: Ref, served: np.ndarray):
    """Score an FP8 e4m3 cache on the positions another strategy served from its store (the rest exact)."""

    from kvz.integrations.hf.bridge import cache_from_kv

    T = ref.T
    idx = np.nonzero(served[:T - 1])[0]
    kv = []
    for k, v in ref.full_kv:
        k = k[:, :T - 1].float().numpy().copy()
        v = v[:, :T - 1].float().numpy().copy()
        if len(idx):
            k[:, idx] = _fp8(k[:, idx])
            v[:, idx] = _fp8(v[:, idx])
        kv.append((k, v))
    cache = cache_from_kv(ref.model, kv)
    first = _tf(ref.model, cache, [ref.last_id], T - 1, ref.kw)[-1]
    ident, kl, div = _score_tf(ref, first, cache)
    return {"identical": ident, "kl_mean": kl, "first_div": div, "reuse_frac": len(idx) / T}


# ============================================================================ the run

def _agg(rows, key):
    vals = [r[key] for r in rows if key in r and r[key] is not None]
    return float(np.mean(vals)) if vals else None


def run(args) -> dict:
    import torch

    from kvz.benchmarks.harness import limit_threads
    from kvz.integrations.hf.bridge import cache_kwarg, kv_shape
    from kvz.integrations.hf.gemma import load_gemma

    n_threads = int(os.environ.get("KVZ_THREADS", "1"))
    torch.set_num_threads(n_threads)
    blas = limit_threads(n_threads)  # BLAS threads spinning on a shared machine make kvz's decode ~10x slower
    t_start = time.perf_counter()
    model, tok = load_gemma()
    kw = cache_kwarg(model)
    L, H, d = kv_shape(model)
    wl = build_workload(tok, n_prompts=args.prompts, n_docs=args.docs, n_topics=args.topics,
                        docs_per_prompt=args.docs_per_prompt, doc_tokens=args.doc_tokens, seed=args.seed)
    prompts = wl["prompts"]
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if not args.silent else (lambda m: None)
    log(f"[reuse] {len(prompts)} prompts, {args.docs} docs x {args.doc_tokens} tok, "
        f"T = {min(len(p['ids']) for p in prompts)}..{max(len(p['ids']) for p in prompts)}")
    tmp = tempfile.mkdtemp(prefix="kvz-reuse-")
    strategies = {
        "kvz-prefix": KvzStrategy("kvz-prefix", model, tmp, reuse="prefix", eps=args.eps),
        "kvz-content": KvzStrategy("kvz-content", model, tmp, reuse="content", repair=args.repair, R=args.R,
                                   blend_ratio=args.blend_ratio, eps=args.eps),
        "kvz-prefix-lossless": KvzStrategy("kvz-prefix-lossless", model, tmp, reuse="prefix", codec="raw",
                                           raw_dtype="float32"),
    }
    for cs in args.extra_chunk_sizes:
        strategies[f"kvz-content-c{cs}"] = KvzStrategy(f"kvz-content-c{cs}", model, tmp, reuse="content",
                                                       repair=args.repair, R=min(args.R, cs // 2),
                                                       blend_ratio=args.blend_ratio, eps=args.eps, chunk_tokens=cs)
    if args.sweep_only:
        strategies = {"kvz-content": strategies["kvz-content"]}
    kvb = None
    if not args.no_kvboost and not args.sweep_only:
        try:
            kvb = KvboostStrategy("kvboost", model, tok)
        except ImportError:
            log("[reuse] kvboost is not installed (pip install kvboost==0.9.0 --no-deps): skipped")
    names = ["full"] + list(strategies) + ["fp8-same-positions"] + (["kvboost"] if kvb else [])
    if args.sweep_only:
        names = ["kvz-content"]
    per = {n: [] for n in names}
    sweep_rows = []
    for i, p in enumerate(prompts):
        cont = strategies["kvz-content"]
        # repair sweep on prompts where the content strategy will find content hits (before it stores them)
        do_sweep = False
        if args.sweep and len({r["prompt"] for r in sweep_rows}) < args.sweep_prompts:
            probe = cont.engine.prefill(p["ids"], p["boundaries"], repair="none")
            do_sweep = probe.stats["n_content_hits"] > 0
            del probe
        ref = Ref(model, p["ids"], args.new_tokens, kw) if (do_sweep or not args.sweep_only) else None
        if do_sweep:
            for rep, R, ratio in args.sweep:
                res = cont.engine.prefill(p["ids"], p["boundaries"], repair=rep, R=R, blend_ratio=ratio)
                ident, kl, div = _score_tf(ref, res.logits, res.cache)
                sweep_rows.append({"prompt": i, "repair": rep, "R": R, "blend_ratio": ratio, "kl_mean": kl,
                                   "identical": ident, "first_div": div, "ttft_s": res.stats["ttft_s"],
                                   "reuse_frac": res.stats["reuse_frac"], "repaired": res.stats["repaired_tokens"],
                                   "content_tokens": res.stats["content_tokens"], "probe_s": res.stats["probe_s"]})
        if args.sweep_only:
            if len({r["prompt"] for r in sweep_rows}) >= args.sweep_prompts:
                break
            per["kvz-content"].append(cont.run(p, ref, score=ref is not None))
            log(f"[sweep] {i + 1}/{len(prompts)} content hits: {per['kvz-content'][-1]['n_content_hits']}"
                f"{' (swept)' if do_sweep else ''}")
            continue
        per["full"].append({"ttft_s": ref.ttft, "reuse_frac": 0.0, "identical": True, "kl_mean": 0.0,
                            "first_div": args.new_tokens})
        for n, s in strategies.items():
            per[n].append(s.run(p, ref))
            if n == "kvz-prefix":
                served = ~s.last.computed
                per["fp8-same-positions"].append(fp8_same_positions(ref, served))
        if kvb is not None:
            per["kvboost"].append(kvb.run(p, ref, n_new=args.new_tokens))
        log(f"[reuse] {i + 1}/{len(prompts)} T={len(p['ids'])} topic {p['topic']} docs {p['docs']}: " + ", ".join(
            f"{n} {per[n][-1].get('ttft_s', 0):.2f}s r{per[n][-1].get('reuse_frac', 0):.2f} "
            f"kl{per[n][-1].get('kl_mean', float('nan')):.1e}" for n in names))
        del ref
        if args.json:  # a checkpoint after every prompt (a long run that is stopped still leaves its rows)
            part = _assemble(per, names, strategies, kvb, sweep_rows, wl, prompts[:i + 1], args, L * 2 * H * d * 2, blas)
            write_json(part, Path(args.json).with_suffix(".partial.json"))
    out = _assemble(per, names, strategies, kvb, sweep_rows, wl, prompts, args, L * 2 * H * d * 2, blas)
    if args.budget_frac > 0 and not args.sweep_only:
        out["budget"] = run_budget(args, model, tok, prompts, wl, L * 2 * H * d * 2, log)
    out["seconds"] = time.perf_counter() - t_start
    return out


def _assemble(per, names, strategies, kvb, sweep_rows, wl, prompts, args, raw_per_tok, blas) -> dict:
    """The result dict from the per-prompt rows so far."""
    import torch

    rows = []
    full_ttft = _agg(per.get("full", []), "ttft_s")
    for n in names:
        rs = per[n]
        row = {"strategy": n, "ttft_s": _agg(rs, "ttft_s"), "ttft_median_s": float(np.median([r["ttft_s"] for r in rs]))
               if rs and "ttft_s" in rs[0] else None,
               "reuse_frac": _agg(rs, "reuse_frac"), "identical_frac": _agg(rs, "identical"),
               "kl_mean": _agg(rs, "kl_mean"), "first_div_mean": _agg(rs, "first_div"), "stored_bytes": None,
               "n": len(rs)}
        if row["ttft_s"] and full_ttft:
            row["speedup_mean"] = full_ttft / row["ttft_s"]
            row["speedup_of_medians"] = float(np.median([r["ttft_s"] for r in per["full"]])) / row["ttft_median_s"]
        if n == "kvz-content" and args.sweep_only:
            row["note"] = "sweep-only run: scored only on swept prompts"
        if n in strategies:
            s = strategies[n]
            row.update(s.stored())
            row["raw_fp16_bytes"] = int(s.store.counters["put_tokens"] * raw_per_tok)
            row["store_s_mean"] = _agg(rs, "store_s")
            for k in ("prefix_tokens", "content_tokens", "repaired_tokens", "decode_s", "forward_s", "probe_s"):
                row[k + "_mean"] = _agg(rs, k)
        if n == "kvboost" and kvb is not None:
            row.update(kvb.stored())
            row["errors"] = kvb.errors
        rows.append(row)
    out = {"rows": rows, "sweep": sweep_rows, "per_prompt": per,
           "workload": {"n_prompts": len(prompts), "n_docs": args.docs, "n_topics": args.topics,
                        "docs_per_prompt": args.docs_per_prompt, "doc_tokens": args.doc_tokens,
                        "system_tokens": wl["system_tokens"], "T_mean": float(np.mean([len(p["ids"]) for p in prompts])),
                        "distinct_docs": len({d for p in prompts for d in p["docs"]}),
                        "new_tokens": args.new_tokens, "seed": args.seed},
           "config": {"eps": args.eps, "repair": args.repair, "R": args.R, "blend_ratio": args.blend_ratio,
                      "threads": torch.get_num_threads(), "blas": blas}}
    return out


def run_budget(args, model, tok, prompts, wl, raw_per_tok, log) -> dict:
    """TTFT and hit rates under a byte budget holding ``budget_frac`` of the distinct documents as raw fp16."""
    n_docs = len({d for p in prompts for d in p["docs"]})
    budget = int(args.budget_frac * n_docs * args.doc_tokens * raw_per_tok)
    tmp = tempfile.mkdtemp(prefix="kvz-reuse-budget-")
    strat = {"kvz-content lru": KvzStrategy("b-lru", model, tmp, reuse="content", repair=args.repair, R=args.R,
                                            blend_ratio=args.blend_ratio, eps=args.eps, budget=budget, policy="lru"),
             "kvz-content importance": KvzStrategy("b-imp", model, tmp, reuse="content", repair=args.repair, R=args.R,
                                                   blend_ratio=args.blend_ratio, eps=args.eps, budget=budget,
                                                   policy="importance")}
    if not args.no_kvboost:
        try:
            for bits in args.kvboost_bits:
                strat[f"kvboost {bits}-bit"] = KvboostStrategy(f"kvboost{bits}", model, tok, max_cache_bytes=budget,
                                                               kv_cache_bits=bits)
        except ImportError:
            pass
    import torch

    per = {n: [] for n in ["full"] + list(strat)}
    prompts = prompts[:args.budget_prompts] if args.budget_prompts else prompts
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            from kvz.integrations.hf.bridge import capture_prefill

            t0 = time.perf_counter()
            lg, _, _ = capture_prefill(model, p["ids"])
            int(lg[0, -1].argmax())
            per["full"].append({"ttft_s": time.perf_counter() - t0, "reuse_frac": 0.0})
            for n, s in strat.items():
                per[n].append(s.run(p, None, score=False))
            log(f"[budget] {i + 1}/{len(prompts)}: " + ", ".join(f"{n} {per[n][-1]['ttft_s']:.2f}s "
                                                                  f"r{per[n][-1]['reuse_frac']:.2f}" for n in per))
    rows = []
    for n, rs in per.items():
        row = {"strategy": n, "ttft_s": _agg(rs, "ttft_s"), "ttft_median_s": float(np.median([r["ttft_s"] for r in rs])),
               "reuse_frac": _agg(rs, "reuse_frac"),
               "hit_prompts": float(np.mean([r["reuse_frac"] > 0 for r in rs]))}
        if n in strat:
            row.update(strat[n].stored())
            if isinstance(strat[n], KvzStrategy):
                c = strat[n].store.counters
                tot = c["prefix_hits"] + c["content_hits"] + c["misses"]
                row.update(chunk_hit_rate=(c["prefix_hits"] + c["content_hits"]) / max(tot, 1),
                           prefix_hit_rate=c["prefix_hits"] / max(tot, 1), content_hit_rate=c["content_hits"] / max(tot, 1))
            else:
                row["errors"] = strat[n].errors
        rows.append(row)
    return {"budget_bytes": budget, "budget_frac": args.budget_frac, "distinct_docs": n_docs, "rows": rows,
            "n_prompts": len(prompts)}


# ============================================================================ report

def _sweep_spec(s: str):
    out = []
    for item in s.split(","):
        rep, _, val = item.partition(":")
        if rep == "none":
            out.append(("none", 0, 0.0))
        elif rep == "seam":
            out.append(("seam", int(val), 0.0))
        elif rep == "blend":
            out.append(("blend", 0, float(val)))
        elif rep == "seam+blend":
            R, ratio = val.split("/")
            out.append(("seam+blend", int(R), float(ratio)))
        else:
            raise ValueError(f"bad sweep item {item!r}")
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, quick="a small version (a few minutes)",
                json="write the rows (list of dicts) here; details go to FILE with .full.json")
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--docs", type=int, default=9)
    ap.add_argument("--topics", type=int, default=6)
    ap.add_argument("--docs-per-prompt", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--eps", type=float, default=None, help="kvz eps (default: the chunk store's)")
    ap.add_argument("--repair", default="seam+blend", choices=["none", "seam", "blend", "seam+blend"])
    ap.add_argument("--R", type=int, default=32)
    ap.add_argument("--blend-ratio", type=float, default=0.1)
    ap.add_argument("--extra-chunk-sizes", default="", help="e.g. 128: also kvz-content with these chunk sizes")
    ap.add_argument("--sweep", default="none,seam:8,seam:32,seam:64,seam:128,blend:0.05,blend:0.1,blend:0.2,"
                                       "blend:0.3,seam+blend:16/0.05,seam+blend:32/0.1,seam+blend:64/0.2")
    ap.add_argument("--sweep-prompts", type=int, default=10)
    ap.add_argument("--sweep-only", action="store_true", help="only the content strategy and the repair sweep")
    ap.add_argument("--budget-frac", type=float, default=0.25, help="0 skips the budget scenario")
    ap.add_argument("--budget-prompts", type=int, default=0, help="budget scenario on the first N prompts (0: all)")
    ap.add_argument("--kvboost-bits", default="16,8,4")
    ap.add_argument("--no-kvboost", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", help="write a markdown report")
    ap.add_argument("--silent", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.docs, args.topics, args.docs_per_prompt = min(args.prompts, 12), 5, 3, 2
        args.sweep_prompts = min(args.sweep_prompts, 3)
        args.sweep = "none,seam:16,seam:64,blend:0.1,seam+blend:32/0.1"
    from kvz.integrations.chunkstore import DEFAULT_EPS

    args.eps = DEFAULT_EPS if args.eps is None else args.eps
    args.sweep = _sweep_spec(args.sweep) if args.sweep else []
    args.extra_chunk_sizes = [int(x) for x in args.extra_chunk_sizes.split(",") if x]
    args.kvboost_bits = [int(x) for x in args.kvboost_bits.split(",") if x]
    out = run(args)
    cmd = command_line("reuse", argv)
    if args.json:
        write_json(out["rows"], args.json)
        write_json(dict(out), Path(args.json).with_suffix(".full.json"))
        Path(args.json).with_suffix(".partial.json").unlink(missing_ok=True)  # the run's checkpoint, now complete
    md = to_markdown(out, cmd)
    if args.md:
        write_text(args.md, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
