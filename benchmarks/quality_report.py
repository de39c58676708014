"""What a quality run (:func:`kvz.benchmarks.quality.run_quality`) comes to: the bits kvz needs to match
each baseline's downstream quality (interpolated along kvz's eps sweep), and the Markdown table."""
from __future__ import annotations

import math


def _kvz_sweep(results, scope=None) -> list[tuple[float, float, float, str]]:
    pts = []
    for name, s in results["settings"].items():
        if s.get("method") == "kvz" and s.get("role", "main") == "main" and "bpv" in s and "kl_mean" in s:
            if scope is None or s.get("scope") == scope:
                pts.append((s["bpv"], s["kl_mean"], s.get("eps"), name))
    return sorted(pts)


def _interp_bpv(pts, target_kl, metric="KL"):
    """bpv where log(metric) of the sweep crosses log(target); linear in log-metric between neighbouring points."""
    logs = [(b, math.log(max(k, 1e-300)), e) for b, k, e, _ in pts]
    lt = math.log(max(target_kl, 1e-300))
    for (b0, l0, e0), (b1, l1, e1) in zip(logs, logs[1:]):
        if (l0 - lt) * (l1 - lt) <= 0 and l0 != l1:
            f = (lt - l0) / (l1 - l0)
            eps = None
            if e0 and e1:
                eps = math.exp(math.log(e0) + f * (math.log(e1) - math.log(e0)))
            return b0 + f * (b1 - b0), eps, "interpolated"
    kls = [k for _, k, _, _ in pts]
    if target_kl < min(kls):
        return None, None, f"below sweep: kvz's lowest {metric} in the sweep is still above the target (needs smaller eps)"
    if target_kl > max(kls):
        return None, None, f"above sweep: kvz's highest-eps {metric} is still below the target (larger eps would do)"
    return None, None, "sweep not monotone around the target"


def quality_matched_rate(results) -> dict:
    """For each non-kvz main setting with a bpv (FP8, INT4, ...): the kvz bpv (and eps) at which kvz's mean KL
    equals that setting's, interpolating log(KL) against bpv across the kvz eps sweep, and the same at matched
    pooled NRMSE for comparison.  ``status`` says when the target lies outside the sweep."""
    out = {}
    pts = _kvz_sweep(results)
    for name, s in results["settings"].items():
        if s.get("method") in ("kvz", "identity", "bf16") or s.get("role", "main") != "main":
            continue
        if "kl_mean" not in s or "bpv" not in s:
            continue
        entry = {"baseline_bpv": s["bpv"], "baseline_kl": s["kl_mean"], "baseline_nrmse": s.get("nrmse_pooled")}
        if len(pts) < 2:
            entry["status"] = "need >= 2 kvz eps points"
        else:
            bpv, eps, status = _interp_bpv(pts, s["kl_mean"])
            entry.update(kvz_bpv=bpv, kvz_eps=eps, status=status)
            if bpv is not None:
                entry["rate_ratio"] = s["bpv"] / bpv
            # at matched NRMSE (log NRMSE vs bpv), for context
            npts = sorted((results["settings"][n]["bpv"], results["settings"][n]["nrmse_pooled"], e, n)
                          for _, _, e, n in pts)
            nb, _, nstatus = _interp_bpv(npts, s.get("nrmse_pooled") or 0.0, "NRMSE")
            entry["kvz_bpv_at_matched_nrmse"] = nb
            entry["matched_nrmse_status"] = nstatus
            if nb is not None and bpv is not None:
                entry["kl_penalty_bpv"] = bpv - nb  # extra bits kvz needs to match KL vs matching NRMSE
        out[name] = entry
    return out


# ============================================================================ report

def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def format_table(results) -> str:
    """Markdown table of the settings (main first, then the error breakdown) and the quality-matched rates."""
    n_new = results["config"]["new_tokens"]
    head = ("| setting | eps target | bpv | NRMSE pooled | NRMSE max | identical % | mean first div "
            f"(/{n_new}) | mean KL | top-1 agree |")
    lines = [head, "|" + "---|" * 9]
    rows = sorted(results["settings"].items(), key=lambda kv: (kv[1].get("role") != "main", kv[1].get("bpv") or 0))
    for name, s in rows:
        if "kl_mean" not in s:
            continue
        lines.append(f"| {name} | {_fmt(s.get('eps'), 'g')} | {_fmt(s.get('bpv'), '.3f')} | "
                     f"{_fmt(s.get('nrmse_pooled'), '.4f')} | {_fmt(s.get('nrmse_max'), '.4f')} | "
                     f"{100 * s['identical_frac']:.0f} | {s['first_div_mean']:.1f} | {s['kl_mean']:.2e} | "
                     f"{100 * s['top1_agree']:.1f}% |")
    qm = results.get("quality_matched") or {}
    if qm:
        lines.append("")
        lines.append("Quality-matched rate (kvz bpv at equal mean KL; log-KL interpolated across the eps sweep):")
        lines.append("")
        for name, e in qm.items():
            if e.get("kvz_bpv") is not None:
                extra = ""
                if e.get("kvz_bpv_at_matched_nrmse") is not None:
                    extra = f"; at matched NRMSE kvz would need {e['kvz_bpv_at_matched_nrmse']:.3f} bpv"
                lines.append(f"- {name} ({e['baseline_bpv']:.3f} bpv, KL {e['baseline_kl']:.2e}): kvz matches at "
                             f"**{e['kvz_bpv']:.3f} bpv** (eps ~ {_fmt(e.get('kvz_eps'), '.4f')}), "
                             f"{e['rate_ratio']:.2f}x fewer bits{extra}")
            else:
                lines.append(f"- {name} ({e.get('baseline_bpv', 0):.3f} bpv, KL {e.get('baseline_kl', 0):.2e}): "
                             f"{e.get('status')}")
    return "\n".join(lines)


# ============================================================================ CLI
