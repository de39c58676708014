"""The rate-quality benchmark's summaries: Pareto frontiers and bpv at a KL target (pure interpolation),
curves per method aggregated over prompts, the verdict, the Markdown report and the plot."""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from .harness import pyplot, save_figure
from .rate_methods import REFERENCE_METHOD


def pareto(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (bpv, kl) points not beaten by a cheaper one: sorted by bpv, KL strictly decreasing.  Points without a
    positive finite KL are dropped (KL 0 is the floor of the exact cache, not a rate-quality point)."""
    pts = sorted((float(b), float(k)) for b, k in points
                 if b is not None and k is not None and math.isfinite(b) and math.isfinite(k) and k > 0)
    out: list[tuple[float, float]] = []
    for b, k in pts:
        if out and b == out[-1][0]:
            if k < out[-1][1]:
                out[-1] = (b, k)
                while len(out) > 1 and out[-2][1] <= k:  # the replaced point may now beat its predecessor
                    out.pop(-2)
            continue
        if not out or k < out[-1][1]:
            out.append((b, k))
    return out


def bpv_at_kl(points: Iterable[tuple[float, float]], target: float) -> dict:
    """bpv at which a method's KL equals ``target``, from measured ``(bpv, kl)`` points.

    Linear in log(KL) between the two Pareto-frontier points that bracket ``target``; never extrapolated.
    Returns ``{"bpv", "status", "bound"}``: ``status`` is ``"interpolated"`` / ``"measured"`` (a point hits the
    target), ``"above range"`` (even the cheapest measured point is better than the target: bpv is None, ``bound``
    = that point's bpv, an upper bound), ``"below range"`` (no measured point reaches the target: None, ``bound`` =
    the largest bpv measured, a lower bound) or ``"no points"``."""
    if target is None or not (target > 0 and math.isfinite(target)):
        return {"bpv": None, "status": "no target", "bound": None}
    fr = pareto(points)
    if not fr:
        return {"bpv": None, "status": "no points", "bound": None}
    lt = math.log(target)
    for b, k in fr:
        if k == target:
            return {"bpv": b, "status": "measured", "bound": None}
    if target > fr[0][1]:
        return {"bpv": None, "status": "above range", "bound": fr[0][0]}
    if target < fr[-1][1]:
        return {"bpv": None, "status": "below range", "bound": fr[-1][0]}
    for (b0, k0), (b1, k1) in zip(fr, fr[1:]):
        if k1 < target < k0:
            f = (math.log(k0) - lt) / (math.log(k0) - math.log(k1))
            return {"bpv": b0 + f * (b1 - b0), "status": "interpolated", "bound": None}
    return {"bpv": None, "status": "no bracket", "bound": None}  # unreachable for a strict frontier


# ============================================================================ aggregation

ROW_KEYS = ("method", "setting", "doc", "bpv", "kl_mean", "top1", "ppl_rel_change")


def _agg(rows: list[dict]) -> dict:
    nll_ref = float(np.mean([r["nll_ref"] for r in rows]))
    nll = float(np.mean([r["nll"] for r in rows]))
    return {"n": len(rows), "bpv": float(np.mean([r["bpv"] for r in rows])),
            "kl_mean": float(np.mean([r["kl_mean"] for r in rows])),
            "top1": float(np.mean([r["top1"] for r in rows])),
            "ppl_rel_change": math.expm1(nll - nll_ref), "nll_ref": nll_ref, "nll": nll,
            "nrmse_pooled": float(np.mean([r["nrmse_pooled"] for r in rows])),
            "nrmse_max": float(np.max([r["nrmse_max"] for r in rows])),
            # fraction of prompts whose greedy continuation equals the exact cache's (rows of older runs lack it)
            "identical": float(np.mean([r["greedy_identical"] for r in rows]))
            if all("greedy_identical" in r for r in rows) else None}


def aggregate(rows: list[dict], reference: str = REFERENCE_METHOD) -> dict:
    """Curves per method (overall and per document), FP8's KL targets and each method's bpv at them.

    Only prompts that every setting has completed are aggregated (so curves of an interrupted run compare like with
    like).  Returns ``{"docs", "n_prompts", "curves": {method: {"overall": [points], "per_doc": {doc: [points]}}},
    "targets": {scope: {"fp8_kl", "2x_fp8_kl"}}, "at_target": {method: {scope: {"fp8_kl": {...}, "2x_fp8_kl":
    {...}}}}}`` where scope is ``"overall"`` or a document name."""
    pairs = {(r["method"], r["setting"]) for r in rows}
    by_prompt: dict[tuple, set] = {}
    for r in rows:
        by_prompt.setdefault((r["doc"], r["start"]), set()).add((r["method"], r["setting"]))
    complete = {p for p, s in by_prompt.items() if s == pairs}
    rows = [r for r in rows if (r["doc"], r["start"]) in complete]
    docs = sorted({r["doc"] for r in rows})
    groups: dict[tuple, list] = {}
    for r in rows:
        groups.setdefault((r["method"], r["setting"], r["doc"]), []).append(r)
        groups.setdefault((r["method"], r["setting"], None), []).append(r)
    curves: dict[str, dict] = {}
    for (m, s, d), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or "")):
        pt = {"setting": s, **_agg(rs)}
        c = curves.setdefault(m, {"overall": [], "per_doc": {}})
        (c["overall"] if d is None else c["per_doc"].setdefault(d, [])).append(pt)
    for c in curves.values():
        c["overall"].sort(key=lambda p: p["bpv"])
        for v in c["per_doc"].values():
            v.sort(key=lambda p: p["bpv"])
    targets, at = {}, {}
    ref = curves.get(reference)
    for sc in ["overall"] + docs:
        pts = [] if ref is None else (ref["overall"] if sc == "overall" else ref["per_doc"].get(sc, []))
        if pts:
            targets[sc] = {"fp8_kl": pts[0]["kl_mean"], "2x_fp8_kl": 2 * pts[0]["kl_mean"], "fp8_bpv": pts[0]["bpv"]}
    for m, c in curves.items():
        at[m] = {}
        for sc, t in targets.items():
            pts = c["overall"] if sc == "overall" else c["per_doc"].get(sc, [])
            xy = [(p["bpv"], p["kl_mean"]) for p in pts]
            at[m][sc] = {name: bpv_at_kl(xy, t[name]) for name in ("fp8_kl", "2x_fp8_kl")}
    return {"docs": docs, "n_prompts": len(complete), "curves": curves, "targets": targets, "at_target": at}


# ============================================================================ report

def fmt(x, spec=".2f"):
    """``x`` formatted, or ``-`` for None."""
    return "-" if x is None else format(x, spec)


def at_cell(e: dict) -> str:
    if e["bpv"] is not None:
        return f"{e['bpv']:.2f}"
    if e["status"] == "above range":
        return f"< {e['bound']:.2f}"
    if e["status"] == "below range":
        return f"> {e['bound']:.2f}"
    return "-"


def verdict(agg: dict, kvz_prefix: str = "kvz") -> list[str]:
    """Plain sentences: each kvz curve's bpv at FP8's KL and 2x, against the best baseline at each target."""
    lines = []
    at = agg["at_target"]
    kvz = [m for m in at if m.startswith(kvz_prefix)]
    base = [m for m in at if not m.startswith(kvz_prefix) and m not in ("bf16",)]
    for tname, tlabel in (("fp8_kl", "FP8's KL"), ("2x_fp8_kl", "2x FP8's KL")):
        if "overall" not in agg["targets"]:
            break
        best = None  # (bpv, method): interpolated values, and upper bounds of methods already better at their floor
        unreached = None  # (bound, method): the lowest lower bound of baselines that never reached the target
        for m in base:
            e = at[m].get("overall", {}).get(tname)
            if not e:
                continue
            v = e["bpv"] if e["bpv"] is not None else (e["bound"] if e["status"] == "above range" else None)
            if v is not None and (best is None or v < best[0]):
                best = (v, m, e["bpv"] is None)
            if e["status"] == "below range" and (unreached is None or e["bound"] < unreached[0]):
                unreached = (e["bound"], m)
        for m in kvz:
            e = at[m].get("overall", {}).get(tname)
            if not e:
                continue
            if e["bpv"] is None:
                lines.append(f"- {m} at {tlabel} ({agg['targets']['overall'][tname]:.2e}): not in its measured "
                             f"range ({e['status']}, bound {fmt(e['bound'])} bpv)")
                continue
            s = f"- {m} at {tlabel} ({agg['targets']['overall'][tname]:.2e}): **{e['bpv']:.2f} bpv**"
            if best is not None:
                rel = "fewer" if e["bpv"] < best[0] else "more"
                s += (f"; best baseline {best[1]} {'<= ' if best[2] else ''}{best[0]:.2f} bpv -> kvz spends "
                      f"{abs(best[0] - e['bpv']):.2f} bpv {rel}")
            if unreached is not None and (best is None or unreached[0] < best[0]):
                s += (f"; {unreached[1]} never reached it up to its highest measured rate, {unreached[0]:.2f} bpv "
                      f"({'more than' if e['bpv'] < unreached[0] else 'not necessarily more than'} kvz)")
            lines.append(s)
    return lines


def format_report(res: dict) -> str:
    """The Markdown report of a results dict."""
    agg = res["aggregate"]
    cfg = res["config"]
    out = [f"# Rate-quality: bits per value against downstream quality ({res['model']})", "",
           f"{agg['n_prompts']} prompts ({', '.join(agg['docs'])}; {cfg['per_doc']} per document), "
           f"{cfg['context']}-token context (bf16 K/V compressed and restored), {cfg['score_tokens']} teacher-forced "
           f"document tokens scored against the exact cache. KL = mean next-token KL(full || restored); top-1 = "
           f"argmax agreement; ppl = relative perplexity change on the true next tokens; identical greedy = share of "
           f"prompts whose {cfg.get('greedy_tokens', 16)} greedy tokens after the context equal the exact cache's "
           f"(where measured). Every number is measured "
           f"by decoding and running the model; bpv at a target is interpolated between measured points in log-KL "
           f"(`<` x: already better than the target at its cheapest point x; `>` x: never reached it up to x).", "",
           "Commands: " + ", then ".join(f"`{c}`" for c in cfg.get("previous_commands", []) + [cfg.get("command", "")]),
           ""]
    tg = agg["targets"]
    if "overall" in tg:
        out += ["## bpv at FP8 e4m3's KL and at 2x FP8's KL", ""]
        scopes = ["overall"] + agg["docs"]
        out.append("| method | " + " | ".join(f"{sc} @FP8 | {sc} @2xFP8" for sc in scopes) + " |")
        out.append("|---|" + "---|" * (2 * len(scopes)))
        out.append("| *FP8 KL target* | " + " | ".join(
            f"{tg[sc]['fp8_kl']:.2e} | {tg[sc]['2x_fp8_kl']:.2e}" if sc in tg else "- | -" for sc in scopes) + " |")
        order = sorted(agg["at_target"], key=lambda m: (not m.startswith("kvz"), m))
        for m in order:
            if m == "bf16":
                continue
            cells = []
            for sc in scopes:
                e = agg["at_target"][m].get(sc)
                cells += [at_cell(e["fp8_kl"]), at_cell(e["2x_fp8_kl"])] if e else ["-", "-"]
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        out += ["", "**Verdict (overall):**", ""] + verdict(agg) + [""]
    out += ["## Measured points (all prompts)", "",
            "| method | setting | bpv | mean KL | top-1 | ppl change | identical greedy | NRMSE pooled | NRMSE max |",
            "|---|---|---|---|---|---|---|---|---|"]
    for m in sorted(agg["curves"], key=lambda m: (not m.startswith("kvz"), m)):
        for p in agg["curves"][m]["overall"]:
            ident = "-" if p.get("identical") is None else f"{100 * p['identical']:.0f}%"
            out.append(f"| {m} | {p['setting']} | {p['bpv']:.3f} | {p['kl_mean']:.2e} | {100 * p['top1']:.1f}% | "
                       f"{100 * p['ppl_rel_change']:+.2f}% | {ident} | {p['nrmse_pooled']:.4f} | "
                       f"{p['nrmse_max']:.4f} |")
    out += ["", "## Per document (mean KL; bpv)", ""]
    for d in agg["docs"]:
        out += [f"### {d}", "", "| method | setting | bpv | mean KL | top-1 | ppl change |", "|---|---|---|---|---|---|"]
        for m in sorted(agg["curves"], key=lambda m: (not m.startswith("kvz"), m)):
            for p in agg["curves"][m]["per_doc"].get(d, []):
                out.append(f"| {m} | {p['setting']} | {p['bpv']:.3f} | {p['kl_mean']:.2e} | {100 * p['top1']:.1f}% "
                           f"| {100 * p['ppl_rel_change']:+.2f}% |")
        out.append("")
    t = res.get("timing", {})
    if t:
        tot = t.get("total_s", 0) + cfg.get("previous_total_s", 0.0)
        out.append(f"Wall time {tot / 60:.1f} min on 2 shared CPU cores ({res.get('model', 'the model')}, float32, one "
                   "thread).")
    return "\n".join(out) + "\n"


def plot(res: dict, path) -> None:
    """bpv vs mean KL per method (log KL), overall and per document; FP8's KL and 2x as horizontal lines."""
    plt = pyplot()

    agg = res["aggregate"]
    scopes = ["overall"] + agg["docs"]
    n = len(scopes)
    cols = min(3, n)
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5.2 * cols, 4.2 * rows_), squeeze=False)
    methods = sorted(agg["curves"], key=lambda m: (not m.startswith("kvz"), m))
    cmap = plt.get_cmap("tab20")
    style = {m: (cmap(i % 20), "o-" if m.startswith("kvz") else ("*" if m in (REFERENCE_METHOD, "bf16") else "s--"))
             for i, m in enumerate(methods)}
    style[REFERENCE_METHOD] = ("k", "*")
    for ax, sc in zip(axes.ravel(), scopes):
        for m in methods:
            pts = agg["curves"][m]["overall"] if sc == "overall" else agg["curves"][m]["per_doc"].get(sc, [])
            pts = [p for p in pts if p["kl_mean"] > 0]
            if not pts:
                continue
            c, st = style[m]
            ax.plot([p["bpv"] for p in pts], [p["kl_mean"] for p in pts], st, color=c, ms=5 if "*" not in st else 11,
                    lw=2.0 if m.startswith("kvz") else 1.0, label=m)
        t = agg["targets"].get(sc)
        if t:
            ax.axhline(t["fp8_kl"], color="k", lw=0.8, ls=":")
            ax.axhline(t["2x_fp8_kl"], color="grey", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xlim(left=0)
        ax.set_xlabel("bits per value")
        ax.set_ylabel("mean next-token KL")
        ax.set_title(sc if sc != "overall" else f"overall ({agg['n_prompts']} prompts)")
        ax.grid(alpha=0.3, which="both")
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    h, lab = axes[0, 0].get_legend_handles_labels()
    fig.legend(h, lab, loc="lower center", ncol=min(6, len(lab)), fontsize=8, frameon=False)
    fig.suptitle(f"{res['model']}: rate vs downstream KL (dotted: FP8 e4m3's KL and 2x)")
    fig.tight_layout(rect=(0, 0.04 + 0.02 * math.ceil(len(lab) / 6), 1, 0.97))
    save_figure(fig, path)
