"""Second model (issue 20): kvz's weighted and attention scopes against FP8 e4m3 on a model that is not Gemma.

For a model (a ``.gguf`` file or a Hugging Face directory) and a bank fitted on it beforehand with its sensitivity
record (``kvz calibrate --model M --texts samples/gemma3-270m/calib_texts -o BANK.h5``), this driver

1. fits the bank's attention statistics (``<bank>.attention.json``) if the bank has none: every calibration text
   (the bank's own, at most ``--calib-tokens`` tokens each, BOS first, as ``kvz calibrate -n`` keeps them) is
   prefilled once through :func:`kvz.benchmarks.quality.capture_kv`, and the captures' statistics are fitted by
   :func:`alignpred.bank.fit_attention_stats`;
2. runs the rate-quality protocol of :mod:`kvz.benchmarks.rate_quality` (its ``windows``, ``run_rate_quality``,
   ``aggregate`` and report) at each ``--contexts`` length on held-out documents (``documents("eval")``, never the
   calibration texts): FP8 e4m3 (the reference), ``kvz-weighted`` and ``kvz-attention`` (tensor cap 3) at the
   ``--eps`` sweep;
3. writes JSON + Markdown (+ PNG) with the verdict of issue 20: each scope's bpv at FP8's KL per context (per
   document and overall) and their ratio attention / weighted against the target ``<= 0.8``.

Run::

    kvz calibrate --model data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --texts samples/gemma3-270m/calib_texts \\
        -n 1024 -o data/smollm2/smollm2.h5
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 KVZ_THREADS=1 python -m benchmarks.studies.rate.second_model \\
        --model data/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --bank data/smollm2/smollm2.h5 \\
        --contexts 256,1024 --json benchmarks/results/rate_quality-smollm2.json

``--resume`` continues from the JSON's ``.partial.json`` (checkpointed after every prompt), or extends a finished JSON
(more documents, eps or contexts; rows it has are kept, not re-measured); ``--finalize`` writes the reports from the
``.partial.json`` without measuring more.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from kvz.benchmarks import rate_quality as rq
from kvz.benchmarks.harness import ROOT, parser, pyplot, save_figure, write_json, write_text
from kvz.benchmarks.harness.cli import command_line
from kvz.benchmarks.quality import KV, Setting, capture_kv
from kvz.benchmarks.rate_methods import FP8, REFERENCE_METHOD, add_kvz_variant, build_settings, kvz_variant_setting
from kvz.benchmarks.rate_report import aggregate, format_report

DEFAULT_EPS = (0.0134, 0.0188, 0.0267, 0.0376, 0.0534)
DEFAULT_DOCS = rq.FULL_DOCS
WEIGHTED, ATTENTION = "kvz-weighted", "kvz-attention"
NO_POSITIONS = "kvz-attention-nopos"  # the ablation (--ablation): no per-position weights
VARIANTS = {WEIGHTED: dict(scope="weighted", tensor_cap=3.0), ATTENTION: dict(scope="attention", tensor_cap=3.0)}
TARGET_RATIO = 0.8  # issue 20: attention's bpv at FP8's KL <= 0.8 x weighted's
CALIB_TEXTS = "samples/gemma3-270m/calib_texts"


# ============================================================================ until rate_quality supports it

def _capture_full(lm, ids, source: str = "prompt", layer_meta=None):
    return capture_kv(lm, ids, source)


def patch_rate_quality(max_context: int) -> bool:
    """Monkeypatch of this driver only, for a :mod:`.rate_quality` that still captures with its old prefill (no
    ``MAX_CONTEXT``): its ``capture`` becomes :func:`~kvz.benchmarks.quality.capture_kv` (every position, the exact
    RoPE metadata, and the prefill's ``capture_stats`` that the attention scope's per-position steps need), and
    ``windows()`` accepts contexts up to ``max_context`` (its old limit is Gemma 3's sliding window; the injected exact
    cache is still checked against the live prefill on the first prompt of every context).  It goes once every
    rate_quality in use does this itself.  Returns whether it patched."""
    if hasattr(rq, "MAX_CONTEXT"):  # rate_quality captures with capture_kv and takes long contexts itself
        if max_context > rq.MAX_CONTEXT:
            raise SystemExit(f"--contexts: at most {rq.MAX_CONTEXT} tokens")
        return False
    rq.capture = _capture_full
    old = getattr(rq, "MAX_PROMPT_TOKENS", 0)
    setattr(rq, "MAX_PROMPT_TOKENS", max(old, int(max_context)))  # noqa: B010 - an attribute of older versions
    return True


# ============================================================================ attention statistics

def ensure_attention_stats(lm, tokenizer, bank_path, texts=CALIB_TEXTS, tokens: int = 1024, *,
                           progress: bool = True) -> dict:
    """The bank's attention sidecar: kept if it is there and of this bank, else fitted from the calibration texts
    (first ``tokens`` tokens each, BOS first).  Returns what was done (path, fitted, texts, tokens, seconds)."""
    import torch

    from alignpred.bank import AttentionStats, Bank, fit_attention_stats
    from kvz.integrations.hf.calibrate import read_texts
    from kvz.integrations.hf.capture import tokenize

    bank = Bank.load(bank_path)
    side = AttentionStats.path_for(bank_path)
    if side.is_file():
        st = AttentionStats.load(side)
        if not st.fits(bank):
            raise SystemExit(f"{side}: attention statistics of another bank; remove it to refit")
        return {"path": _rel(side), "fitted": False, "sliding_window": int(st.sliding_window)}
    t0 = time.perf_counter()
    caps, used = [], []
    with torch.inference_mode():
        for name, text in read_texts(texts):
            ids = tokenize(tokenizer, text)[:tokens]
            caps.append(capture_kv(lm, ids, f"calib:{name}").capture_stats)
            used.append({"text": name, "tokens": len(ids)})
            if progress:
                print(f"[second-model] attention stats: captured {name} ({len(ids)} tokens)", file=sys.stderr,
                      flush=True)
    st = fit_attention_stats(caps, bank)
    st.save(side)
    return {"path": _rel(side), "fitted": True, "texts": used, "sliding_window": int(st.sliding_window),
            "seconds": round(time.perf_counter() - t0, 1)}


def _rel(p) -> str:
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


# ============================================================================ settings

def no_positions_setting(bank, eps: float) -> Setting:
    """The ablation ``kvz-attention-nopos``: the attention scope given no capture statistics, so positions get no
    weights of their own (per-tensor and per-channel weights only)."""
    base = kvz_variant_setting(ATTENTION, eps, bank, spec=VARIANTS[ATTENTION])

    def fn(kv, info):
        bare = KV(dict(kv), fp32=kv.fp32, metadata=kv.metadata, capture_stats=None)
        out = base.fn(bare, info)
        return out

    s = Setting(fn, "kvz", eps=eps, scope="attention", positions="none")
    s.curve, s.label = NO_POSITIONS, base.label  # type: ignore[attr-defined]  # as rate_methods' settings
    return s


def settings_for(bank, eps=DEFAULT_EPS, ablation: bool = False) -> dict:
    """FP8 e4m3 and the two kvz scopes at ``eps`` (``{"curve | label": Setting}``); with ``ablation`` also
    :func:`no_positions_setting` at every eps."""
    for name, spec in VARIANTS.items():
        add_kvz_variant(name, **spec)
    preset = {"kvz_eps": {name: tuple(eps) for name in VARIANTS}, "baselines": (FP8,)}
    out = build_settings(preset, bank, methods=[*VARIANTS, FP8])
    if ablation:
        for e in eps:
            s = no_positions_setting(bank, e)
            out[f"{NO_POSITIONS} | {s.label}"] = s  # type: ignore[attr-defined]
    return out


# ============================================================================ verdict (no model)

def _bounds(e: dict | None):
    """``(value, kind)`` of a bpv-at-target entry: kind ``"="``, ``"<"`` (upper bound), ``">"`` (lower) or None."""
    if not e:
        return None, None
    if e.get("bpv") is not None:
        return float(e["bpv"]), "="
    if e.get("bound") is not None and e.get("status") == "above range":
        return float(e["bound"]), "<"
    if e.get("bound") is not None and e.get("status") == "below range":
        return float(e["bound"]), ">"
    return None, None


def ratio_of(att: dict | None, wtd: dict | None) -> dict:
    """attention bpv / weighted bpv at the same target, from two :func:`~.rate_report.bpv_at_kl` entries:
    ``{"ratio", "kind"}`` with kind ``"="`` (both interpolated), ``"<"`` / ``">"`` (only a bound follows from the
    measured ranges) or None (nothing follows)."""
    a, ka = _bounds(att)
    w, kw = _bounds(wtd)
    if a is None or w is None or w <= 0:
        return {"ratio": None, "kind": None}
    r = a / w
    kind = {("=", "="): "=", ("<", "="): "<", (">", "="): ">", ("=", "<"): ">", ("=", ">"): "<",
            ("<", ">"): "<", (">", "<"): ">"}.get((ka, kw))
    return {"ratio": r if kind else None, "kind": kind}


def meets(r: dict, target: float = TARGET_RATIO) -> bool | None:
    """Whether a ratio (:func:`ratio_of`) meets ``<= target``; None when the bound does not decide it."""
    if r["kind"] == "=" or (r["kind"] == "<" and r["ratio"] <= target) or (r["kind"] == ">" and r["ratio"] > target):
        return r["ratio"] <= target
    return None


def _nearest(points: list[dict], kl: float) -> dict | None:
    """The measured point whose KL is nearest ``kl`` in log."""
    pts = [p for p in points if p["kl_mean"] > 0]
    if not pts or not kl > 0:
        return None
    p = min(pts, key=lambda p: abs(math.log(p["kl_mean"] / kl)))
    return {k: p.get(k) for k in ("setting", "bpv", "kl_mean", "top1", "ppl_rel_change", "identical")}


def verdict_rows(agg: dict, target: float = TARGET_RATIO) -> list[dict]:
    """Per scope (``overall`` then each document) of an :func:`~.rate_report.aggregate`: FP8's KL, bpv, top-1 and
    ppl change; each kvz scope's bpv at FP8's KL (entry of ``bpv_at_kl``) and its measured point nearest that KL;
    the ratio attention / weighted and whether it meets ``target``."""
    out = []
    for sc in ["overall"] + list(agg["docs"]):
        t = agg["targets"].get(sc)
        if t is None:
            continue
        ref = agg["curves"][REFERENCE_METHOD]
        fp8 = (ref["overall"] if sc == "overall" else ref["per_doc"][sc])[0]
        row = {"scope": sc, "fp8_kl": t["fp8_kl"], "fp8_bpv": t["fp8_bpv"], "fp8_top1": fp8["top1"],
               "fp8_ppl_rel_change": fp8["ppl_rel_change"]}
        for m in (WEIGHTED, ATTENTION):
            c = agg["curves"].get(m)
            pts = [] if c is None else (c["overall"] if sc == "overall" else c["per_doc"].get(sc, []))
            row[m] = {"at_fp8": agg["at_target"].get(m, {}).get(sc, {}).get("fp8_kl"),
                      "nearest": _nearest(pts, t["fp8_kl"])}
        r = ratio_of(row[ATTENTION]["at_fp8"], row[WEIGHTED]["at_fp8"])
        row["ratio"], row["ratio_kind"], row["meets"] = r["ratio"], r["kind"], meets(r, target)
        if NO_POSITIONS in agg["at_target"]:
            e = agg["at_target"][NO_POSITIONS].get(sc, {}).get("fp8_kl")
            row[NO_POSITIONS] = {"at_fp8": e, "ratio_to_weighted": ratio_of(e, row[WEIGHTED]["at_fp8"])}
        out.append(row)
    return out


def _cell(e: dict | None) -> str:
    v, k = _bounds(e)
    return "-" if v is None else (f"{v:.2f}" if k == "=" else f"{k} {v:.2f}")


def _near(p: dict | None) -> str:
    if p is None:
        return "-"
    ident = "" if p.get("identical") is None else f", greedy {100 * p['identical']:.0f}%"
    return f"{p['setting']}: {p['bpv']:.2f} bpv, {100 * p['top1']:.1f}%, {100 * p['ppl_rel_change']:+.2f}%{ident}"


def shortfall(row: dict, target: float = TARGET_RATIO) -> str:
    """One sentence on a verdict row (:func:`verdict_rows`): the ratio against the target and, when both bpv are
    interpolated, by how many bpv the attention scope misses (or beats) ``target`` x weighted's bpv; with the
    ablation, its ratio (how much of the gain the per-position weights carry)."""
    w, a = _bounds(row[WEIGHTED]["at_fp8"]), _bounds(row[ATTENTION]["at_fp8"])
    if row["ratio"] is None:
        return f"{row['scope']}: no ratio follows from the measured ranges"
    s = f"{row['scope']}: ratio {_ratio_cell({'ratio': row['ratio'], 'kind': row['ratio_kind']})}"
    if w[1] == "=" and a[1] == "=":
        need = target * w[0]
        s += (f" (attention {a[0]:.2f} bpv against {target:g} x {w[0]:.2f} = {need:.2f}: "
              f"{'short by' if a[0] > need else 'within by'} {abs(a[0] - need):.2f} bpv)")
    if NO_POSITIONS in row:
        s += (f"; without per-position weights {_ratio_cell(row[NO_POSITIONS]['ratio_to_weighted'])} "
              f"(bpv {_cell(row[NO_POSITIONS]['at_fp8'])})")
    return s


def _ratio_cell(r: dict) -> str:
    if r["ratio"] is None:
        return "-"
    return f"{r['ratio']:.3f}" if r["kind"] == "=" else f"{r['kind']} {r['ratio']:.3f}"


def verdict_table(rows: list[dict], target: float = TARGET_RATIO) -> list[str]:
    """Markdown table of :func:`verdict_rows`."""
    out = ["| scope | FP8 KL | FP8 bpv | FP8 top-1 / ppl | weighted bpv @FP8 | attention bpv @FP8 | ratio | "
           f"<= {target:g} | weighted nearest (top-1, ppl) | attention nearest (top-1, ppl) |",
           "|---|---:|---:|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        ratio = _ratio_cell({"ratio": r["ratio"], "kind": r["ratio_kind"]})
        ok = {True: "yes", False: "no", None: "undecided"}[r["meets"]]
        out.append(f"| {r['scope']} | {r['fp8_kl']:.2e} | {r['fp8_bpv']:.2f} | {100 * r['fp8_top1']:.1f}% / "
                   f"{100 * r['fp8_ppl_rel_change']:+.2f}% | {_cell(r[WEIGHTED]['at_fp8'])} | "
                   f"{_cell(r[ATTENTION]['at_fp8'])} | {ratio} | {ok} | {_near(r[WEIGHTED]['nearest'])} | "
                   f"{_near(r[ATTENTION]['nearest'])} |")
    return out


# ============================================================================ assembly

def assemble(model_name: str, config: dict, per_context: dict) -> dict:
    """The results dict from ``{context: {"rows", "prompts", "timing"}}`` (rate_quality's per-run shape)."""
    contexts: dict[str, dict] = {}
    verdicts: dict[str, list] = {}
    for ctx, r in sorted(per_context.items(), key=lambda kv: int(kv[0])):
        agg = aggregate(r["rows"])
        cmds = list(config.get("commands", []))
        cfg = dict(config, context=int(ctx), previous_commands=cmds[:-1], command=cmds[-1] if cmds else "")
        contexts[str(ctx)] = {"rows": r["rows"], "prompts": r.get("prompts", []),
                              "timing": r.get("timing", {}), "aggregate": agg, "config": cfg}
        verdicts[str(ctx)] = verdict_rows(agg)
    return {"model": model_name, "config": config, "contexts": contexts, "verdict": verdicts}


def markdown(res: dict) -> str:
    cfg = res["config"]
    out = [f"# Second model: kvz attention vs weighted scope against FP8 e4m3 ({res['model']})", "",
           f"Issue 20: bpv at FP8 e4m3's KL of the attention scope <= {TARGET_RATIO:g} x the weighted scope's. "
           f"Held-out documents {', '.join(cfg['docs'])} ({cfg['per_doc']} prompt(s) each), {cfg['score_tokens']} "
           f"teacher-forced tokens scored against the exact float32 cache, bf16 K/V compressed and restored; "
           f"kvz-weighted and kvz-attention with tensor cap 3 at eps {', '.join(f'{e:g}' for e in cfg['eps'])}. "
           "bpv at FP8's KL is interpolated in log-KL between measured points (`<` x / `>` x: only a bound follows). "
           "'nearest' is the measured point whose KL is nearest FP8's (setting, bpv, top-1 agreement, ppl change; "
           "greedy: share of prompts whose greedy continuation equals the exact cache's, where measured).",
           "", "Commands:", ""]
    out += [f"    {c}" for c in cfg.get("commands", [])]
    out += ["", f"Attention statistics: `{res.get('attention_stats', {}).get('path', '-')}` "
            f"({'fitted by this run' if res.get('attention_stats', {}).get('fitted') else 'already there'}; "
            f"sliding window {res.get('attention_stats', {}).get('sliding_window', 0)}).", ""]
    for note in cfg.get("notes", []):
        out.append(f"- {note}")
    out.append("")
    for ctx, rows in res["verdict"].items():
        c = res["contexts"][ctx]
        tm = c.get("timing", {})
        t = (tm.get("total_s") or 0.0) + (tm.get("previous_total_s") or 0.0)
        out += [f"## Verdict at context {ctx}", "",
                f"{c['aggregate']['n_prompts']} complete prompts" + (f"; {t / 60:.1f} min" if t else "") + ".", ""]
        out += verdict_table(rows) + [""]
        out += [f"By how much (overall): {shortfall(rows[0])}.", ""] if rows and rows[0]["scope"] == "overall" \
            else []
        if any(NO_POSITIONS in r for r in rows):
            out += [f"Ablation {NO_POSITIONS} (the attention scope without the prefill's per-position weights: "
                    "per-tensor and per-channel weights only), bpv at FP8's KL and its ratio to weighted's: "
                    + "; ".join(f"{r['scope']} {_cell(r[NO_POSITIONS]['at_fp8'])} "
                                f"({_ratio_cell(r[NO_POSITIONS]['ratio_to_weighted'])})"
                                for r in rows if NO_POSITIONS in r) + ".", ""]
    for c in res["contexts"].values():
        sub = {"model": res["model"], "config": c["config"], "aggregate": c["aggregate"], "timing": {}}
        body = format_report(sub).splitlines()
        out += [f"#{line}" if line.startswith("#") else line for line in body]
        out.append("")
    tm = res.get("timing", {})
    wall = (tm.get("wall_s") or 0.0) + (tm.get("previous_wall_s") or 0.0)
    if wall:
        out.append(f"Wall time {wall / 60:.1f} min (all runs; model load, attention statistics and every context) "
                   "on shared CPU cores, one thread, float32 model.")
    return "\n".join(out).rstrip() + "\n"


def plot_contexts(res: dict, path) -> None:
    """bpv vs mean KL (overall) per context, FP8's KL as a dotted line."""
    plt = pyplot()
    ctxs = list(res["contexts"])
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5.4 * len(ctxs), 4.2), squeeze=False)
    style = {WEIGHTED: ("tab:blue", "o-"), ATTENTION: ("tab:red", "o-"), REFERENCE_METHOD: ("k", "*"),
             NO_POSITIONS: ("tab:orange", "s--")}
    for ax, ctx in zip(axes[0], ctxs):
        agg = res["contexts"][ctx]["aggregate"]
        for m, (col, st) in style.items():
            pts = [p for p in agg["curves"].get(m, {}).get("overall", []) if p["kl_mean"] > 0]
            if pts:
                ax.plot([p["bpv"] for p in pts], [p["kl_mean"] for p in pts], st, color=col, label=m,
                        ms=11 if st == "*" else 5)
        t = agg["targets"].get("overall")
        if t:
            ax.axhline(t["fp8_kl"], color="k", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xlabel("bits per value")
        ax.set_ylabel("mean next-token KL")
        ax.set_title(f"context {ctx} ({agg['n_prompts']} prompts)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['model']}: kvz scopes vs FP8 e4m3 (dotted: FP8's KL)")
    fig.tight_layout()
    save_figure(fig, path)


def write_outputs(res: dict, json_out, plot_out=None, md_out=None) -> None:
    json_out = Path(json_out)
    write_json(res, json_out)
    write_text(md_out or json_out.with_suffix(".md"), markdown(res))
    if plot_out:
        plot_contexts(res, plot_out)


# ============================================================================ entry point

def parse_args(argv=None):
    ap = parser(__doc__, prog="python -m benchmarks.studies.rate.second_model", quiet=True)
    ap.add_argument("--model", required=True, help="a .gguf file or a Hugging Face model directory")
    ap.add_argument("--bank", required=True, help="the model's bank file (with its .sensitivity.json beside it)")
    ap.add_argument("--contexts", default="256,1024", help="comma-separated cached context lengths (BOS included)")
    ap.add_argument("--eps", default=",".join(f"{e:g}" for e in DEFAULT_EPS), help="comma-separated kvz eps sweep")
    ap.add_argument("--docs", default=",".join(DEFAULT_DOCS), help="comma-separated held-out documents, or 'all'")
    ap.add_argument("--per-doc", type=int, default=1)
    ap.add_argument("--score-tokens", type=int, default=32)
    ap.add_argument("--calib-texts", default=CALIB_TEXTS, help="the bank's calibration texts (attention stats)")
    ap.add_argument("--calib-tokens", type=int, default=1024, help="tokens per calibration text for the stats")
    ap.add_argument("--json", required=True, help="output JSON (a Markdown report is written beside it)")
    ap.add_argument("--plot", help="output PNG (default: the JSON's with .png)")
    ap.add_argument("--md", help="Markdown report path (default: the JSON's with .md)")
    ap.add_argument("--bank-command", default="", help="the command that fitted the bank (recorded in the report)")
    ap.add_argument("--model-name", help="the model's name in the report (default: the bank's model id)")
    ap.add_argument("--ablation", action="store_true", help=f"also {NO_POSITIONS}: the attention scope without "
                    "per-position weights (the prefill's capture statistics withheld)")
    ap.add_argument("--resume", action="store_true", help="continue from the JSON's .partial.json, or extend a "
                    "finished JSON (rows it has are kept)")
    ap.add_argument("--finalize", action="store_true", help="write the reports from the .partial.json only")
    a = ap.parse_args(argv)
    try:
        a.contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
        a.eps = [float(e) for e in a.eps.split(",") if e.strip()]
    except ValueError as e:
        ap.error(f"--contexts / --eps: {e}")
    if not a.contexts or min(a.contexts) < 2:
        ap.error("--contexts: at least one length >= 2")
    if not a.eps or min(a.eps) <= 0:
        ap.error("--eps: at least one positive eps")
    if a.per_doc < 1 or a.score_tokens < 1 or a.calib_tokens < 2:
        ap.error("--per-doc and --score-tokens must be >= 1, --calib-tokens >= 2")
    a.docs = "all" if a.docs == "all" else tuple(d.strip() for d in a.docs.split(",") if d.strip())
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    a.command = command_line("studies.rate.second_model", argv)
    json_out = Path(a.json)
    partial = json_out.with_name(json_out.stem + ".partial.json")
    res = run(a)
    write_outputs(res, json_out, a.plot or str(json_out.with_suffix(".png")), a.md)
    if a.finalize:
        print("\n".join(verdict_table(res["verdict"][max(res["verdict"], key=int)])))
        return 0
    if partial.is_file():
        partial.unlink()
    for ctx, rows in res["verdict"].items():
        print(f"context {ctx}:")
        print("\n".join(verdict_table(rows)))
    print(f"{json_out}: {res['timing']['wall_s'] / 60:.1f} min")
    return 0


def run(a) -> dict:
    """The measurement ``a`` (as :func:`parse_args` makes it) asks for, resumed or finalised from the
    ``.partial.json`` beside ``a.json`` when told; checkpoints there after every row."""
    json_out = Path(a.json)
    partial = json_out.with_name(json_out.stem + ".partial.json")
    cmd = a.command
    if a.finalize:
        src = json.loads(partial.read_text())
        res = assemble(src["model"], dict(src["config"], interrupted=True), src["contexts"])
        res["attention_stats"] = src.get("attention_stats", {})
        return res

    from alignpred.bank import resolve_bank
    from kvz.integrations.hf.capture import load_model

    patched = patch_rate_quality(max(a.contexts))
    t_start = time.perf_counter()
    lm, tok = load_model(a.model)
    t_load = time.perf_counter() - t_start
    att = ensure_attention_stats(lm, tok, a.bank, a.calib_texts, a.calib_tokens, progress=not a.quiet)
    bank = resolve_bank(a.bank)  # by path: its .sensitivity.json and .attention.json are found beside it
    model_name = a.model_name or bank.model
    docs = rq.documents("eval", a.docs)
    prev = {}  # --resume: an interrupted run (.partial.json), or a finished one extended (more docs, eps, contexts)
    if a.resume and (partial.is_file() or json_out.is_file()):
        prev = json.loads((partial if partial.is_file() else json_out).read_text())
    settings = settings_for(bank, a.eps, ablation=a.ablation)
    keys = {(getattr(s, "curve"), getattr(s, "label")) for s in settings.values()}  # noqa: B009
    commands = [c for c in [a.bank_command, *prev.get("config", {}).get("commands", [])[1:], cmd] if c]
    config = {"docs": [d for d, _ in docs], "per_doc": a.per_doc, "score_tokens": a.score_tokens,
              "contexts": a.contexts, "eps": a.eps, "bank": bank.id, "bank_model": bank.model,
              "variants": VARIANTS, "ablation": NO_POSITIONS if a.ablation else None, "reference": "float32 K/V of the same prefill", "kv_dtype": "bfloat16",
              "calib_texts": a.calib_texts, "calib_tokens": a.calib_tokens, "commands": commands,
              "model_load_s": round(t_load, 1), "greedy_tokens": getattr(rq, "GREEDY_TOKENS", None),
              "rate_quality_patched": patched, "notes": []}
    if patched:
        config["notes"].append("rate_quality.capture is replaced by quality.capture_kv and MAX_PROMPT_TOKENS raised in "
                               "this driver (a monkeypatch until rate_quality supports it).")
    if att.get("sliding_window", 0) == 0:
        config["notes"].append("The model has no sliding-window layers: the attention scope's coarser steps for "
                               "positions a window never attends again do not act; only its per-channel weights "
                               "(bank statistics) and per-position weights (the prefill's attention) do.")
    if att.get("fitted") is False and prev.get("attention_stats"):  # extended run: how the sidecar was made
        att = dict(prev["attention_stats"])
    per_context = {k: {"rows": [r for r in v.get("rows", []) if (r["method"], r["setting"]) in keys],
                       "prompts": v.get("prompts", []),
                       "timing": {"previous_total_s": v.get("timing", {}).get("total_s", 0.0)
                                  + v.get("timing", {}).get("previous_total_s", 0.0)}}
                   for k, v in prev.get("contexts", {}).items() if int(k) in a.contexts}
    prev_prompts = {k: list(v["prompts"]) for k, v in per_context.items()}
    prev_timing = {k: v["timing"] for k, v in per_context.items()}

    def merged(ctx, pm):
        old = prev_prompts.get(str(ctx), [])
        return old + [p for p in pm if p not in old]

    def checkpoint(ctx, rows, prompts):
        per_context[str(ctx)] = {"rows": rows, "prompts": merged(ctx, prompts),
                                 "timing": prev_timing.get(str(ctx), {})}
        write_json({"model": model_name, "config": config, "attention_stats": att, "contexts": per_context}, partial)

    for ctx in a.contexts:
        ps = rq.windows(docs, a.per_doc, ctx, a.score_tokens, tok)
        done = per_context.get(str(ctx), {}).get("rows", [])
        r = rq.run_rate_quality(settings, ps, context=ctx, score_tokens=a.score_tokens, model=lm,
                                progress=not a.quiet, done_rows=done,
                                on_row=lambda rows, pm, ctx=ctx: checkpoint(ctx, rows, pm))
        per_context[str(ctx)] = {"rows": r["rows"], "prompts": merged(ctx, r["prompts"]),
                                 "timing": {**r["timing"], **prev_timing.get(str(ctx), {})}}
    res = assemble(model_name, config, per_context)
    res["attention_stats"] = att
    res["timing"] = {"wall_s": time.perf_counter() - t_start, "model_load_s": t_load,
                     "previous_wall_s": prev.get("timing", {}).get("wall_s", 0.0)
                     + prev.get("timing", {}).get("previous_wall_s", 0.0)}
    return res


if __name__ == "__main__":
    sys.exit(main())
