"""Content reuse judged by answers: RAG accuracy vs TTFT per reuse method (Gemma 3 270M, CPU).

Task (:mod:`kvz.benchmarks.rag.tasks`): documents of about ``--doc-tokens`` tokens cut from real
text (``samples/texts`` and every ``--text-dirs`` directory), each with one invented fact planted in
it; a question per prompt about one document of the prompt (the planted fact, or with probability
``--text-share`` the word after a five-word run of the document's own text); ``--docs-per-prompt``
documents per prompt from overlapping topics, their order shuffled with probability
``--shuffle-p``, so a document recurs at other positions (content hits) as well as in repeated
prefixes. ``--dataset musique --musique PATH``: CacheBlend's MuSiQue subset instead, the first
``--passages`` retrieved passages of each question cut to ``--passage-tokens``, order varied; each
passage is first prefilled and stored on its own (CacheBlend's setting: every passage's KV exists
before the question arrives), then the question's prompt finds them at other positions.

Methods, in one process, question by question (the kvz settings' order rotated per question):
``full`` (full recompute: the reference), ``prefix`` (exact prefix hits only), ``content:none``
(content hits, no repair), ``kvz`` (ReuseEngine's default repair), ``kvz:<setting>`` (its other
settings, ``--settings``, the syntax of :mod:`kvz.benchmarks.reuse_repair`), ``cacheblend:0.15``
(CacheBlend-style selective recompute: the 15% of reused tokens whose layer-1 K/V deviates most,
repair ``blend``), ``cacheblend@kvz`` (the same, recomputing as many reused tokens as ``kvz`` did on
that question: the ratio matching kvz's TTFT), ``lossless:<m>`` (method m from a float32 store,
``--lossless``), ``kvz-c128`` / ``kvz-first`` (the default repair with chunk 128, or with boundaries on
each document's first token instead of its separator: ``--boundaries``) and ``kvboost`` (the
``kvboost`` 0.9.0 package on the same token ids; if it cannot run, the row's ``status`` is the
error). The kvz store is at its default eps (``DEFAULT_EPS``). Every method decodes
``--new-tokens`` greedy tokens; the answer is the first line.

Rows (``--json``: ``rows``; one per method)::

    method          the method's name (above)
    exact_match     % of questions whose answer equals a gold answer (SQuAD normalisation)
    em_diff         [mean, low, high]: exact_match - full's, 95% paired bootstrap interval (points)
    f1              mean token F1 against the gold answers (%), f1_diff likewise
    agree           % of questions whose answer equals full recompute's (normalised); agree_f1: token F1
    ttft_ratio      median over questions of TTFT / full recompute's TTFT (same question)
    recomputed_frac mean fraction of the prompt's positions the prefill computed
    identical       questions whose generated tokens equal full recompute's
    kl_mean         mean per-token KL(full || method) along the method's own greedy path
    n               questions scored; status: "ok" or why not

Run::

    python -m kvz.benchmarks.rag_accuracy --quick --json benchmarks/results/rag_accuracy-quick.json \\
        --md benchmarks/results/rag_accuracy-quick.md --plot benchmarks/results/rag_accuracy-quick.png
    python -m kvz.benchmarks.rag_accuracy --dataset musique --musique ../shared/data/musique_s.json --json ...
    # a run cut short leaves OUT.partial.json after every question; its report:
    python -m kvz.benchmarks.rag_accuracy --from-json OUT.partial.json --md ... --plot ...
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .harness import command_line, machine_info, parser, read_json, write_json, write_text
from .rag.scoring import answer_text, exact_match, paired_bootstrap, token_f1
from .rag.tasks import assemble, build_questions, make_documents, musique_questions, plant_facts, text_paths

__all__ = ["method_list", "store_exact", "summarize", "to_markdown", "plot", "run", "main"]

DEFAULT_SETTINGS = "none,seam:32,seam+guided:32/0.05/0.5"


def method_list(settings: str, lossless: str, boundaries: str, kvboost: bool) -> list:
    """``[{"name", "engine", "kw"}]``: the methods of a run (``kw``: ReuseEngine.prefill overrides;
    ``None``: computed per question, ``cacheblend@kvz``)."""
    from .reuse_repair import parse_settings

    def kw_of(s):
        return {"repair": s["repair"], "R": s["R"], "blend_ratio": s["blend_ratio"], "threshold": s["threshold"],
                "max_frac": s["max_frac"]}

    from kvz.integrations.chunkstore import DEFAULT_MAX_FRAC, DEFAULT_R, DEFAULT_REPAIR, DEFAULT_THRESHOLD

    default = {"repair": DEFAULT_REPAIR, "R": DEFAULT_R, "threshold": DEFAULT_THRESHOLD, "max_frac": DEFAULT_MAX_FRAC}
    ms = [{"name": "full", "engine": None, "kw": {}}, {"name": "prefix", "engine": "kvz", "kw": {"reuse": "prefix"}},
          {"name": "kvz", "engine": "kvz", "kw": default}]
    for s in parse_settings(settings):
        ms.append({"name": "content:none" if s["name"] == "none" else f"kvz:{s['name']}", "engine": "kvz",
                   "kw": kw_of(s)})
    ms.append({"name": "cacheblend:0.15", "engine": "kvz", "kw": kw_of(parse_settings("blend:0.15")[0])})
    ms.append({"name": "cacheblend@kvz", "engine": "kvz", "kw": None})
    for m in (x.strip() for x in lossless.split(",") if x.strip()):
        base = next(x for x in ms if x["name"] == m)
        ms.append({"name": f"lossless:{m}", "engine": "lossless", "kw": base["kw"]})
    for b in (x.strip() for x in boundaries.split(",") if x.strip()):
        ms.append({"name": f"kvz-{b}", "engine": b, "kw": default})
    if kvboost:
        ms.append({"name": "kvboost", "engine": "kvboost", "kw": {}})
    return ms


class _Run:
    """The model, the engines and their stores, and the per-question scoring."""

    def __init__(self, args, log):
        import torch

        from kvz.integrations.chunkstore import DEFAULT_EPS
        from kvz.integrations.hf import cache_kwarg, load_gemma

        from .harness import limit_threads
        from .reuse import KvzStrategy

        n = int(os.environ.get("KVZ_THREADS", "1"))
        torch.set_num_threads(n)
        self.blas = limit_threads(n)
        self.model, self.tok = load_gemma()
        self.kw = cache_kwarg(self.model)
        self.n_new, self.log, self.eps = args.new_tokens, log, DEFAULT_EPS
        tmp = tempfile.mkdtemp(prefix="kvz-rag-")
        mk = {"kvz": {}, "lossless": {"codec": "raw", "raw_dtype": "float32"}, "c128": {"chunk_tokens": 128},
              "first": {}}
        self.engines = {e: KvzStrategy(e, self.model, tmp, reuse="content", **mk[e])
                        for e in {m["engine"] for m in args.methods} if e in mk}
        self.kvb, self.kvb_status = None, "not run"
        if any(m["engine"] == "kvboost" for m in args.methods):
            try:
                from .reuse import KvboostStrategy

                self.kvb, self.kvb_status = KvboostStrategy("kvboost", self.model, self.tok), "ok"
            except Exception as e:  # noqa: BLE001 - recorded as the row's status
                self.kvb_status = f"{type(e).__name__}: {e}"
                log(f"[rag] kvboost unavailable: {self.kvb_status}")

    def _row(self, toks, ref, ttft, computed, T, q, full_ans, logits=None, extra=None):
        from .reuse import _kl_rows

        ans = answer_text(self.tok.decode(toks, skip_special_tokens=True))
        n = min(len(toks), len(ref.tokens))
        kl = float(_kl_rows(ref.along(toks[:n]), logits[:n]).mean()) if logits is not None and n else None
        row = {"q": q["id"], "answer": ans, "em": exact_match(ans, q["answers"]), "f1": token_f1(ans, q["answers"]),
               "agree": exact_match(ans, full_ans) if full_ans is not None else 1.0,
               "agree_f1": token_f1(ans, full_ans) if full_ans is not None else 1.0, "ttft_s": ttft,
               "ttft_ratio": ttft / ref.ttft, "recomputed_frac": computed / T, "identical": toks == ref.tokens,
               "kl": kl}
        row.update(extra or {})
        return row

    def question(self, i, q, prompts, methods) -> dict:
        """Score every method on question ``q`` (``prompts``: engine -> assembled prompt)."""
        from .reuse import Ref

        p = prompts["kvz"]
        T = len(p["ids"])
        t0 = time.perf_counter()
        ref = Ref(self.model, p["ids"], self.n_new, self.kw)
        ref_s = time.perf_counter() - t0
        full_ans = answer_text(self.tok.decode(ref.tokens, skip_special_tokens=True))
        out = {"full": self._row(ref.tokens, ref, ref.ttft, T, T, q, None, extra={"wall_s": ref_s})}
        kvz_ms = [m for m in methods if m["engine"] in self.engines]
        k = i % max(1, len(kvz_ms))
        order = kvz_ms[k:] + kvz_ms[:k]
        last = {}
        matched = [m for m in order if m["kw"] is None]
        order = [m for m in order if m["kw"] is not None] + matched  # cacheblend@kvz after kvz
        for m in order:
            eng = self.engines[m["engine"]].engine
            pp = prompts.get(m["engine"], p)
            kw = m["kw"]
            if kw is None:
                st = out["kvz"]
                ratio = st["repaired"] / st["content_tokens"] if st["content_tokens"] else 0.0
                kw = {"repair": "blend", "R": 0, "blend_ratio": ratio}
            t0 = time.perf_counter()
            toks, res = eng.generate(pp["ids"], self.n_new, pp["boundaries"], store=False, return_logits=True, **kw)
            s = res.stats
            out[m["name"]] = self._row(toks, ref, s["ttft_s"], s["computed_tokens"], T, q, full_ans, s["logits"],
                                       {"repaired": s["repaired_tokens"], "content_tokens": s["content_tokens"],
                                        "prefix_tokens": s["prefix_tokens"], "probe_s": s["probe_s"],
                                        "wall_s": time.perf_counter() - t0})
            last[m["engine"]] = res
        for e, res in last.items():
            out["full"].setdefault("store_s", {})[e] = store_exact(self.engines[e].engine, res, ref.full_kv)
        if any(m["engine"] == "kvboost" for m in methods) and self.kvb is not None:
            kp = {"ids": p["ids"], "boundaries": p["boundaries"]}
            t0 = time.perf_counter()
            r = self.kvb.run(kp, ref, n_new=self.n_new)
            import torch

            toks = [int(x.argmax()) for x in self.kvb._steps[:self.n_new]]
            lg = torch.stack(self.kvb._steps[:len(toks)]) if toks else None
            out["kvboost"] = self._row(toks, ref, r["ttft_s"], T * (1 - r["reuse_frac"]), T, q, full_ans, lg,
                                       {"error": r.get("error"), "wall_s": time.perf_counter() - t0})
        return out

    def warm(self, texts, prompts_of):
        """Prefill and store each passage on its own (MuSiQue: CacheBlend's precomputed passages)."""
        for t in texts:
            for e, s in self.engines.items():
                pp = prompts_of(e, [t])
                s.engine.store_result(s.engine.prefill(pp["ids"], pp["boundaries"], reuse="prefix"))
            if self.kvb is not None:
                pp = prompts_of("kvz", [t])
                self.kvb.run(pp, None, score=False)


def store_exact(engine, res, full_kv) -> float:
    """Store ``res``'s chunks with the prompt's exact KV (``full_kv``: full recompute's ``[(k, v)]``,
    ``[kv_heads, T, d]``): what ``ReuseEngine.store_result``'s refresh stores, without recomputing the
    prompt once more per engine (the refresh is after the first token: no method's TTFT includes it).
    Returns the seconds spent encoding and storing."""
    T = len(res.token_ids)
    res.kv = [(k[None], v[None]) for k, v in full_kv]
    res.computed, res.exact = np.ones(T, bool), np.ones(T, bool)
    return float(engine.store_result(res, refresh=False)["store_s"])


def summarize(per: dict, methods, status: dict | None = None, n_boot: int = 2000) -> list:
    """One row per method (see the module docstring) from the per-question rows ``per[method]``; the
    interval is over the questions both the method and ``full`` scored."""
    rows = []
    full = {r["q"]: r for r in per.get("full", [])}
    for m in methods:
        rs = [r for r in per.get(m, []) if r["q"] in full]
        row = {"method": m, "n": len(rs), "status": (status or {}).get(m, "ok" if rs else "no rows")}
        if rs:
            def mean(k, rs=rs):
                v = [r[k] for r in rs if r.get(k) is not None]
                return float(np.mean(v)) if v else None

            for k in ("em", "f1"):
                d = paired_bootstrap([r[k] for r in rs], [full[r["q"]][k] for r in rs], n_boot=n_boot)
                row[{"em": "em_diff", "f1": "f1_diff"}[k]] = [100 * x for x in d]
            row.update(exact_match=100 * mean("em"), f1=100 * mean("f1"), agree=100 * mean("agree"),
                       agree_f1=100 * mean("agree_f1"), ttft_ratio=float(np.median([r["ttft_ratio"] for r in rs])),
                       ttft_median_s=float(np.median([r["ttft_s"] for r in rs])),
                       recomputed_frac=mean("recomputed_frac"), identical=int(sum(bool(r["identical"]) for r in rs)),
                       kl_mean=mean("kl"), errors=sum(bool(r.get("error")) for r in rs))
        rows.append(row)
    return rows


def _f(x, fmt):
    return "-" if x is None else format(x, fmt)


def to_markdown(out: dict) -> str:
    w = out["workload"]
    lines = [f"# RAG accuracy vs TTFT per reuse method: {w['dataset']} (Gemma 3 270M, CPU)", "",
             f"Command: `{out['command']}`", "", f"Machine: {out['machine'].get('cpu')}, "
             f"{out['machine'].get('usable_cores')} usable cores (shared with other jobs), KVZ_THREADS="
             f"{out['config']['threads']}; {out['seconds'] / 60:.1f} min; kvz eps {out['config']['eps']}.", "",
             f"Workload: {w['n_done']} of {w['n_questions']} questions{' (' + w['note'] + ')' if w.get('note') else ''}; "
             f"{w['describe']}; prompts {w['T_min']}-"
             f"{w['T_max']} tokens (mean {w['T_mean']:.0f}); {out['config']['new_tokens']} greedy tokens, answer = "
             "first line. EM / F1: SQuAD normalisation, vs gold; diff: vs full recompute on the same questions, "
             "95% paired bootstrap interval (points). Agree: EM / F1 vs full recompute's answer. TTFT ratio: median "
             "of per-question TTFT / full recompute's. Identical: generated tokens equal full recompute's.", "",
             "| method | EM % | EM diff [95% CI] | F1 % | F1 diff [95% CI] | agree % | agree F1 % | TTFT ratio | "
             "recomputed | identical | KL mean | n | status |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]

    def ci(d):
        return "-" if not d else f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]"

    for r in out["rows"]:
        lines.append(f"| {r['method']} | {_f(r.get('exact_match'), '.1f')} | {ci(r.get('em_diff'))} | "
                     f"{_f(r.get('f1'), '.1f')} | {ci(r.get('f1_diff'))} | {_f(r.get('agree'), '.1f')} | "
                     f"{_f(r.get('agree_f1'), '.1f')} | {_f(r.get('ttft_ratio'), '.3f')} | "
                     f"{_f(r.get('recomputed_frac'), '.3f')} | {r.get('identical', '-')}/{r['n']} | "
                     f"{_f(r.get('kl_mean'), '.2e')} | {r['n']} | {r['status']} |")
    by = {r["method"]: r for r in out["rows"]}
    k = by.get("kvz", {})
    if k.get("em_diff"):
        ok = k["em_diff"][2] >= -1.0 and k["ttft_ratio"] <= 0.35
        lines += ["", f"Acceptance (issue 39, point 1): kvz default EM diff {ci(k['em_diff'])}, TTFT ratio "
                  f"{k['ttft_ratio']:.3f}: interval reaches -1.0 or better and TTFT <= 0.35x: "
                  f"{'yes' if ok else '**no**'}."]
    return "\n".join(lines) + "\n"


def plot(out: dict, path, metric: str = "exact_match") -> None:
    """The frontier: ``metric`` (with the 95% interval of its difference to full) and agreement vs TTFT."""
    from .harness import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    full = next((r for r in out["rows"] if r["method"] == "full" and r["n"]), None)
    for i, r in enumerate(r for r in out["rows"] if r["n"]):
        x, mk = r["ttft_ratio"], "osD^v<>p*h"[i % 10]
        d = r.get("em_diff" if metric == "exact_match" else "f1_diff")
        y = r[metric]
        yerr = [[max(0.0, d[0] - d[1])], [max(0.0, d[2] - d[0])]] if d and r["method"] != "full" else None
        axes[0].errorbar(x, y, yerr=yerr, fmt=mk, capsize=3, label=r["method"])
        axes[1].scatter(x, r["agree"], marker=mk, label=r["method"])
        for ax, yy in ((axes[0], y), (axes[1], r["agree"])):
            ax.annotate(r["method"], (x, yy), fontsize=6, xytext=(3, 2), textcoords="offset points")
    if full:
        axes[0].axhline(full[metric] - 1.0, color="k", lw=0.6, ls="--")
    axes[0].set_ylabel(f"{metric} % (error bar: 95% paired CI of the difference to full)")
    axes[1].set_ylabel("agreement with full recompute's answer %")
    for ax in axes:
        ax.set_xlabel("TTFT / full recompute (median)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6)
    fig.suptitle(f"RAG accuracy vs TTFT, {out['workload']['dataset']} ({out['workload']['n_done']} questions)")
    fig.tight_layout()
    save_figure(fig, path)


def _workload(args, tok):
    if args.dataset == "musique":
        qs = musique_questions(args.musique, tok, limit=args.limit or 30, passages=args.passages,
                               passage_tokens=args.passage_tokens, seed=args.seed)
        return qs, None, (f"MuSiQue (CacheBlend's subset, CC BY 4.0): {args.passages} passages of <= "
                          f"{args.passage_tokens} tokens each, order varied; each passage prefilled and stored alone "
                          "before its question")
    docs = make_documents(tok, text_paths(args.text_dirs), args.docs, args.doc_tokens)
    facts = plant_facts(docs, seed=args.seed)
    qs = build_questions(docs, facts, args.limit or args.questions, n_topics=args.topics,
                         docs_per_prompt=args.docs_per_prompt, shuffle_p=args.shuffle_p, text_share=args.text_share,
                         seed=args.seed)
    return qs, docs, (f"{args.docs} documents of ~{args.doc_tokens} tokens from {len(text_paths(args.text_dirs))} real "
                      f"texts, one planted fact each; {args.docs_per_prompt} per prompt from {args.topics} overlapping "
                      f"topics, shuffle p {args.shuffle_p}; {args.text_share:.0%} of questions about the text itself")


def run(args) -> dict:
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if not args.silent else (lambda msg: None)
    t0 = time.perf_counter()
    R = _Run(args, log)
    qs, docs, describe = _workload(args, R.tok)
    names = [m["name"] for m in args.methods]
    per: dict = {n: [] for n in names}
    lens: list = []

    def prompts_of(e, texts, question=""):
        return assemble(R.tok, texts, question, boundary="first" if e == "first" else "sep")

    for i, q in enumerate(qs):
        t_q = time.perf_counter()
        texts = q["passages"] if docs is None else [docs[d]["text"] for d in q["docs"]]
        if docs is None:
            R.warm(texts, prompts_of)
        prompts = {e: prompts_of(e, texts, q["question"]) for e in ("kvz", *R.engines)}
        lens.append(len(prompts["kvz"]["ids"]))
        rows = R.question(i, q, prompts, args.methods)
        for n, r in rows.items():
            per[n].append(r)
        f = rows["full"]
        log(f"[rag] {i + 1}/{len(qs)} T={lens[-1]} ({time.perf_counter() - t_q:.0f}s) gold {q['answers'][0]!r} full "
            f"{f['answer']!r}: " + ", ".join(f"{n} {'=' if r['agree'] else 'x'}{r['ttft_ratio']:.2f}"
                                               for n, r in rows.items() if n != "full"))
        out = _assemble(args, R, per, names, qs, lens, describe, time.perf_counter() - t0)
        if args.json:
            write_json(out, Path(args.json).with_suffix(".partial.json"))
    return _assemble(args, R, per, names, qs, lens, describe, time.perf_counter() - t0)


def _assemble(args, R, per, names, qs, lens, describe, seconds) -> dict:
    status = {"kvboost": R.kvb_status} if R.kvb_status != "ok" else {}
    kv_err = [r["error"] for r in per.get("kvboost", []) if r.get("error")]
    if kv_err:
        status["kvboost"] = f"ok; {len(kv_err)} requests fell back to its baseline mode ({kv_err[0]})"
    return {"rows": summarize(per, names, status, n_boot=args.n_boot), "per_question": per,
            "questions": [{k: q[k] for k in ("id", "question", "answers", "kind") if k in q} for q in qs[:len(lens)]],
            "workload": {"dataset": args.dataset, "describe": describe, "n_questions": len(qs), "n_done": len(lens),
                         "T_min": min(lens) if lens else 0, "T_max": max(lens) if lens else 0,
                         "T_mean": float(np.mean(lens)) if lens else 0.0},
            "config": {"eps": R.eps, "new_tokens": args.new_tokens, "threads": int(os.environ.get("KVZ_THREADS", "1")),
                       "blas": R.blas, "seed": args.seed, "methods": args.methods},
            "machine": machine_info(()), "seconds": seconds, "command": args.command}


def main(argv=None) -> int:
    ap = parser(__doc__, quick="40 questions", json="write the results here")
    ap.add_argument("--dataset", choices=("planted", "musique"), default="planted")
    ap.add_argument("--musique", default=os.path.join("..", "shared", "data", "musique_s.json"),
                    help="the MuSiQue subset (JSON list of {ctxs, question, answers})")
    ap.add_argument("--text-dirs", nargs="*", default=[], help="more directories of real text (*.txt, *.md)")
    ap.add_argument("--questions", type=int, default=300)
    ap.add_argument("--limit", type=int, default=None, help="at most this many questions (musique default 30)")
    ap.add_argument("--docs", type=int, default=30)
    ap.add_argument("--doc-tokens", type=int, default=120)
    ap.add_argument("--docs-per-prompt", type=int, default=3)
    ap.add_argument("--topics", type=int, default=40)
    ap.add_argument("--shuffle-p", type=float, default=0.5)
    ap.add_argument("--text-share", type=float, default=0.25)
    ap.add_argument("--passages", type=int, default=3)
    ap.add_argument("--passage-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--settings", default=DEFAULT_SETTINGS, help="kvz repair settings besides the default")
    ap.add_argument("--lossless", default="kvz", help="methods also run from a float32 store")
    ap.add_argument("--boundaries", default="c128,first", help="boundary engines: c128 (chunk 128), first")
    ap.add_argument("--no-kvboost", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-boot", type=int, default=2000)
    ap.add_argument("--md")
    ap.add_argument("--plot")
    ap.add_argument("--silent", action="store_true")
    ap.add_argument("--from-json", help="only write --md / --plot from a saved (or .partial) result")
    ap.add_argument("--first", type=int, default=None, help="with --from-json: report only the first N questions")
    args = ap.parse_args(argv)
    if args.from_json:
        out = read_json(args.from_json)
        if args.first:  # the first N questions: a run's prefix is the run with --limit N (same questions, same store)
            out["per_question"] = {m: [r for r in rs if r["q"] < args.first] for m, rs in out["per_question"].items()}
            out["questions"] = out["questions"][:args.first]
            w = out["workload"]
            w["n_done"] = min(w["n_done"], args.first)
            w["note"] = f"the first {args.first} questions of the run (the run with --limit {args.first})"
        names = [m["name"] for m in out["config"]["methods"]]
        st = {r["method"]: r["status"] for r in out["rows"]}
        out["rows"] = summarize(out["per_question"], names, st, n_boot=args.n_boot)
        return _report(out, args)
    if args.quick:
        args.questions = min(args.questions, 40)
    args.command = command_line("rag_accuracy", argv)
    args.methods = method_list(args.settings, args.lossless, args.boundaries, not args.no_kvboost)
    out = run(args)
    if args.json:
        write_json(out, args.json)
        Path(args.json).with_suffix(".partial.json").unlink(missing_ok=True)
    return _report(out, args)


def _report(out, args) -> int:
    md = to_markdown(out)
    if args.md:
        write_text(args.md, md)
    if args.plot:
        plot(out, args.plot, "f1" if out["workload"]["dataset"] == "musique" else "exact_match")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
