"""How much each tensor's (and each position's) K/V error costs downstream: the weights kvz's error allocation uses.

Measured on the **calibration** texts (``samples/gemma3-270m/calib_texts``, the texts the bundled bank was fitted
on; never the held-out documents of the rate-quality benchmark), teacher-forced exactly as
:mod:`kvz.benchmarks.rate_quality`: a ``context``-token window is prefilled, its float32 K/V captured, an error is
added to it, and the next ``score_tokens`` document tokens are scored against the exact cache (mean next-token
KL(full || perturbed), float64).

**Per tensor** (layer x K/V): the error is added to that tensor alone, everything else exact; two error models:

* ``codec`` (the weights written to the JSON): kvz's own error - the cache is compressed and restored once at
  ``eps`` in tensor scope with the bundled bank (default codec config), and tensor t gets exactly its
  reconstruction error ``restored_t - bf16_t`` (added to the float32 K/V, so bf16 rounding is not counted);
* ``white``: i.i.d. Gaussian noise with the same per-value variance in every channel and position, scaled to
  NRMSE ``eps`` exactly (kvz's quantisation error is close to white in the coded domain; a cross-check that the
  weights are not an artefact of one error pattern).

``w_t = mean KL_t / mean NRMSE_t^2`` over the prompts (KL per unit of squared NRMSE of that tensor), so that
``KL ~ sum_t w_t NRMSE_t^2``; ``kl_per_nrmse2 = sum_t w_t`` is the KL of an error of NRMSE 1 in every tensor (KL
at a uniform eps is ``eps^2 * kl_per_nrmse2``).  Checks: **additivity** (all tensors perturbed at once: measured
KL vs the sum of the single-tensor KLs and vs the fitted prediction), **quadratic scaling** (all tensors at
``eps/2`` and ``2 eps``), and **out of sample**: kvz's pooled scope (no cap; cap 3), tensor scope at other eps
and FP8 e4m3 - measured KL against ``sum_t w_t NRMSE_t^2`` with their own per-tensor NRMSEs.

**Per position**: white noise at one cached position p in every tensor, with ``scale^2`` times the per-value
variance a uniform error at NRMSE ``eps`` puts there; ``w_p = T * KL_p / (scale^2 * KL_uniform)``, where
``KL_uniform`` is the measured KL of that uniform error over all T positions: under additivity the ``w_p`` average
1, and ``w_p`` is how much more a unit of squared error costs at p than on average.  Positions 0..7, a spread of
later ones, and the last few; position 0 also keys only / values only.  **Attention**: in the same pass (eager
attention), the mean attention weight (over heads and scored queries) each cached position receives, per layer.

Writes ``alignpred/bank/data/gemma-3-270m.sensitivity.json`` (``--out``)::

    {"model", "bank_id", "tensor_weights": {"layers.0.key": w, ...}, "kl_per_nrmse2", "token_weights": {...},
     "method", "command", ...}

Run::

    python -m benchmarks.studies.rate.sensitivity --quick --out /tmp/sens.json
    python -m benchmarks.studies.rate.sensitivity --out alignpred/bank/data/gemma-3-270m.sensitivity.json \\
        --report benchmarks/results/sensitivity.md
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from alignpred import nrmse
from kvz.benchmarks import quality as Q
from kvz.benchmarks import rate_quality as R
from kvz.benchmarks.harness import parser, write_json, write_text
from kvz.benchmarks.lm import model as load_model
from kvz.benchmarks.rate_report import fmt

PRESETS = {
    "quick": dict(per_doc=1, docs=("english-technical",), context=256, score_tokens=16, eps=0.0267,
                  modes=("codec",), positions=True, checks=False),
    # sized for ~30 min on 2 shared cores (each forward scores the full 262k vocabulary)
    "full": dict(per_doc=1, docs=None, context=256, score_tokens=32, eps=0.0267, modes=("codec", "white"),
                 positions=True, checks=True, white_prompts=1),
}
POSITION_SCALE = 4.0  # per-position noise: 16x the per-value variance of the uniform error (measurable KL)


def _names(n_layers: int) -> list[str]:
    return [f"layers.{i}.{kind}" for i in range(n_layers) for kind in ("key", "value")]


def _white(x: np.ndarray, eps: float, rng) -> np.ndarray:
    z = rng.standard_normal(x.shape)
    return (z * (eps * np.linalg.norm(x.astype(np.float64)) / np.linalg.norm(z))).astype(np.float32)


def _kvz_error(kv: Q.KV, bank, eps: float, scope: str = "tensor", **kw) -> tuple[dict, dict]:
    """(error ``restored - bf16`` per tensor as float32, info) of kvz at ``eps``."""
    s = Q.kvz_setting(bank, eps, scope, **kw)
    rec = s(kv)
    err = {k: np.asarray(rec[k], dtype=np.float32) - np.asarray(kv[k], dtype=np.float32) for k in kv}
    return err, dict(s.info)


def _fp8_error(kv: Q.KV) -> dict:
    s = Q.fp8_setting()
    rec = s(kv)
    return {k: np.asarray(rec[k], dtype=np.float32) - np.asarray(kv[k], dtype=np.float32) for k in kv}


def _attention(model, tensors, feed, n_ctx: int) -> np.ndarray:
    """``[layers, n_ctx]``: mean attention weight (heads, scored queries) on each cached position."""
    import torch

    from kvz.integrations.hf.bridge import cache_from_kv, cache_kwarg

    base = model
    impl = getattr(base.config, "_attn_implementation", None)
    try:
        if hasattr(base, "set_attn_implementation"):
            base.set_attn_implementation("eager")
        else:
            base.config._attn_implementation = "eager"
        out = model(input_ids=torch.tensor([feed], dtype=torch.long), use_cache=True, output_attentions=True,
                    **{cache_kwarg(model): cache_from_kv(model, tensors)})
        att = out.attentions
    finally:
        if impl is not None:
            if hasattr(base, "set_attn_implementation"):
                base.set_attn_implementation(impl)
            else:
                base.config._attn_implementation = impl
    rows = []
    for a in att:  # [1, heads, q, k_total]; k_total = kept cache + q (sliding layers may have dropped none here)
        a = a[0].double().mean(dim=(0, 1)).cpu().numpy()
        kept = a.shape[-1] - len(feed)
        v = np.zeros(n_ctx)
        v[n_ctx - kept:] = a[:kept]
        rows.append(v)
    return np.array(rows)


def measure(model, tokenizer, bank, *, docs=None, per_doc: int = 2, context: int = 256, score_tokens: int = 32,
            eps: float = 0.0267, modes=("codec", "white"), positions: bool = True, checks: bool = True,
            white_prompts: int | None = None, progress: bool = True, seed: int = 0) -> dict:
    """Run the measurements on calibration windows; returns raw per-prompt results (see :func:`summarize`)."""
    import torch

    from kvz.integrations.hf.bridge import text_config

    ws = R.windows(R.documents("calib", docs), per_doc, context, score_tokens, tokenizer, split="calib")
    lm = R.layer_meta_of(model)
    names = _names(text_config(model).num_hidden_layers)
    prompts = []
    t_start = time.perf_counter()

    def log(msg):
        if progress:
            print(f"[sensitivity] {msg}", file=sys.stderr, flush=True)

    def kl_of(ref, fp32, err: dict) -> float:
        x = {k: (v + err[k] if k in err else v) for k, v in fp32.items()}
        return R.compare(ref, R.score(model, x, feed))["kl_mean"]

    with torch.inference_mode():
        for wi, w in enumerate(ws):
            ids = w["token_ids"]
            ctx_ids, feed = ids[:context], ids[context:context + score_tokens]
            targets = ids[context + 1:context + score_tokens + 1]
            kv = R.capture(model, ctx_ids, w["source"], lm)
            ref = R.reference(R.score(model, kv.fp32, feed), targets)
            fp32 = kv.fp32
            rng = np.random.default_rng([seed, wi])
            P = {"doc": w["doc"], "start": w["start"], "single": {}, "all": {}, "nrmse": {}}
            errs = {}
            if "codec" in modes:
                errs["codec"], info = _kvz_error(kv, bank, eps)
                P["codec_bpv"] = info.get("bpv")
            if "white" in modes and (white_prompts is None or wi < white_prompts):
                errs["white"] = {k: _white(fp32[k], eps, rng) for k in names}
            for mode, err in errs.items():
                P["nrmse"][mode] = {k: nrmse(kv[k], np.asarray(kv[k], np.float64) + err[k]) for k in names}
                P["single"][mode] = {}
                t0 = time.perf_counter()
                for k in names:
                    P["single"][mode][k] = kl_of(ref, fp32, {k: err[k]})
                P["all"][mode] = kl_of(ref, fp32, err)
                log(f"prompt {wi + 1}/{len(ws)} {w['doc']}@{w['start']} {mode}: all-at-once KL "
                    f"{P['all'][mode]:.3e}, sum of singles {sum(P['single'][mode].values()):.3e} "
                    f"({time.perf_counter() - t0:.0f}s)")
            if checks:
                P["checks"] = {}
                if "white" in errs:
                    for f in (0.5, 2.0):
                        e = {k: v * f for k, v in errs["white"].items()}
                        P["checks"][f"white x{f:g}"] = {"kl": kl_of(ref, fp32, e),
                                                        "nrmse": {k: nrmse(kv[k], np.asarray(kv[k], np.float64) + e[k]) for k in names}}
                oos = {"kvz pooled nocap eps": dict(scope="pooled", tensor_cap=0.0),
                       "kvz pooled cap3 eps": dict(scope="pooled", tensor_cap=3.0),
                       "kvz tensor 2eps": dict(scope="tensor", _eps=2 * eps),
                       "kvz tensor eps/2": dict(scope="tensor", _eps=eps / 2)}
                for label, kw in oos.items():
                    e_ = kw.pop("_eps", eps)
                    err, info = _kvz_error(kv, bank, e_, **kw)
                    P["checks"][label] = {"kl": kl_of(ref, fp32, err), "bpv": info.get("bpv"), "eps": e_,
                                          "nrmse": {k: nrmse(kv[k], np.asarray(kv[k], np.float64) + err[k]) for k in names}}
                err = _fp8_error(kv)
                P["checks"]["fp8 e4m3"] = {"kl": kl_of(ref, fp32, err), "bpv": 8.0,
                                           "nrmse": {k: nrmse(kv[k], np.asarray(kv[k], np.float64) + err[k]) for k in names}}
                log(f"prompt {wi + 1}: checks " + ", ".join(f"{k} {v['kl']:.2e}" for k, v in P["checks"].items()))
            if positions:
                T = context
                pos = sorted(set(list(range(8)) + [int(round(x)) for x in np.linspace(16, T - 8, 4)]
                                 + list(range(T - 4, T))))
                sig = {k: eps * float(np.linalg.norm(fp32[k].astype(np.float64))) / math.sqrt(fp32[k].size)
                       for k in names}
                z = {k: rng.standard_normal(fp32[k].shape).astype(np.float32) for k in names}
                uniform = {k: sig[k] * z[k] for k in names}
                P["pos_uniform_kl"] = kl_of(ref, fp32, uniform)
                P["pos"] = {}
                for p in pos:
                    e = {}
                    for k in names:
                        v = np.zeros_like(fp32[k])
                        v[:, p] = POSITION_SCALE * sig[k] * z[k][:, p]
                        e[k] = v
                    P["pos"][str(p)] = kl_of(ref, fp32, e)
                    if p == 0:
                        for part in ("key", "value"):
                            P["pos"][f"0.{part}"] = kl_of(ref, fp32, {k: v for k, v in e.items()
                                                                      if k.endswith(part)})
                P["attention"] = _attention(model, fp32, feed, context).tolist()
                log(f"prompt {wi + 1}: positions, uniform KL {P['pos_uniform_kl']:.2e}, KL(p=0) {P['pos']['0']:.2e}")
            prompts.append(P)
    return {"prompts": prompts, "names": names, "eps": eps, "context": context, "score_tokens": score_tokens,
            "modes": list(modes), "seconds": time.perf_counter() - t_start, "layer_types": lm[0]}


def _weights(prompts, mode, names) -> dict[str, float]:
    prompts = [p for p in prompts if mode in p["single"]]
    return {k: float(np.mean([p["single"][mode][k] for p in prompts]) /
                     max(np.mean([p["nrmse"][mode][k] ** 2 for p in prompts]), 1e-30)) for k in names}


def summarize(raw: dict) -> dict:
    """Weights, checks and token weights from :func:`measure`'s raw results."""
    prompts, names = raw["prompts"], raw["names"]
    out = {"weights": {}, "checks": {}, "spread": {}}
    all_prompts = prompts
    for mode in raw["modes"]:
        prompts = [p for p in all_prompts if mode in p["single"]]
        if not prompts:
            continue
        w = _weights(prompts, mode, names)
        out["weights"][mode] = w
        # per-prompt weights: how stable a tensor's weight is across prompts (coefficient of variation)
        per = np.array([[p["single"][mode][k] / max(p["nrmse"][mode][k] ** 2, 1e-30) for k in names]
                        for p in prompts])
        out["spread"][mode] = {k: float(per[:, i].std() / per[:, i].mean()) if per[:, i].mean() > 0 else None
                               for i, k in enumerate(names)} if len(prompts) > 1 else {}
        meas = [p["all"][mode] for p in prompts]
        singles = [sum(p["single"][mode].values()) for p in prompts]
        pred = [sum(w[k] * p["nrmse"][mode][k] ** 2 for k in names) for p in prompts]
        out["checks"][f"{mode}: all tensors at eps"] = {
            "measured": float(np.mean(meas)), "sum_of_singles": float(np.mean(singles)),
            "predicted": float(np.mean(pred)), "ratio_measured_to_sum": float(np.mean(meas) / np.mean(singles)),
            "n_prompts": len(prompts)}
        if mode == "white" and "codec" in out["weights"]:  # codec weights on the same prompts: like for like
            wc = _weights(prompts, "codec", names)
            a, b = np.log([wc[k] for k in names]), np.log([w[k] for k in names])
            out["agreement"] = {"codec_vs_white_log_corr": float(np.corrcoef(a, b)[0, 1]),
                                "codec_over_white_median": float(np.exp(np.median(a - b))),
                                "n_prompts": len(prompts)}
    prompts = all_prompts
    main = "codec" if "codec" in out["weights"] else raw["modes"][0]
    w = out["weights"][main]
    labels = sorted({k for p in prompts for k in p.get("checks", {})})
    for lab in labels:
        ps = [p for p in prompts if lab in p.get("checks", {})]
        meas = float(np.mean([p["checks"][lab]["kl"] for p in ps]))
        wl = out["weights"].get("white", w) if lab.startswith("white") else w  # like error model, like weights
        pred = float(np.mean([sum(wl[k] * p["checks"][lab]["nrmse"][k] ** 2 for k in names) for p in ps]))
        nr = [p["checks"][lab]["nrmse"] for p in ps]
        pooled = float(np.mean([math.sqrt(sum(n[k] ** 2 for k in names) / len(names)) for n in nr]))
        worst = max(max(n.values()) for n in nr)
        e = {"measured": meas, "predicted": pred, "ratio_measured_to_predicted": meas / pred if pred > 0 else None,
             "nrmse_rms_over_tensors": pooled, "nrmse_max": worst}
        bpv = [p["checks"][lab].get("bpv") for p in ps]
        if all(b is not None for b in bpv):
            e["bpv"] = float(np.mean(bpv))
        out["checks"][lab] = e
    # token weights
    tp = [p for p in prompts if "pos" in p]
    if tp:
        T = raw["context"]
        keys = list(tp[0]["pos"])
        wpos = {k: float(np.mean([T * p["pos"][k] / (POSITION_SCALE ** 2 * p["pos_uniform_kl"]) for p in tp]))
                for k in keys}
        later = [int(k) for k in keys if k.isdigit() and 8 <= int(k) < T - 4]
        last = [int(k) for k in keys if k.isdigit() and int(k) >= T - 4]
        att = np.mean([np.array(p["attention"]) for p in tp], axis=0)  # [layers, T]
        att_all = att.mean(0)
        top = np.argsort(att_all)[::-1][:8]
        recent = [wpos[k] for k in keys if k.isdigit() and int(k) >= T - 8]
        middle = [wpos[k] for k in keys if k.isdigit() and 8 <= int(k) < T - 8]
        out["token_weights"] = {
            # a step-size profile the encoder can use directly: weight per position class (1 = the average position)
            "profile": {"sink_tokens": 1, "sink": wpos["0"], "recent_tokens": 8,
                        "recent": float(np.mean(recent)) if recent else None,
                        "middle": float(np.mean(middle)) if middle else None,
                        "early_1_7": float(np.mean([wpos[str(i)] for i in range(1, 8) if str(i) in wpos])),
                        "note": "recent = the last 8 cached positions (the continuation follows them directly)"},
            "per_position": {k: wpos[k] for k in keys},
            "sink_positions": [0],
            "first8": [wpos.get(str(i)) for i in range(8)],
            "later_mean": float(np.mean([wpos[str(i)] for i in later])) if later else None,
            "last4_mean": float(np.mean([wpos[str(i)] for i in last])) if last else None,
            "sink_key_only": wpos.get("0.key"), "sink_value_only": wpos.get("0.value"),
            "attention_mass_pos0_per_layer": att[:, 0].tolist(),
            "attention_mass_pos0_mean": float(att_all[0]),
            "attention_top_positions": [{"position": int(i), "mean_attention": float(att_all[i])} for i in top],
            "attention_first8_mean": att_all[:8].tolist(),
            "attention_uniform_share": 1.0 / T,
            "context": T, "scale": POSITION_SCALE,
        }
    return out


def format_report(res: dict) -> str:
    s = res["summary"]
    w = res["tensor_weights"]
    names = list(w)
    L = len(names) // 2
    lines = [f"# Downstream sensitivity of K/V error ({res['model']})", "",
             f"{res['n_prompts']} calibration windows ({', '.join(res['docs'])}), {res['context']}-token context, "
             f"{res['score_tokens']} teacher-forced tokens scored; error model for the weights: {res['method']}. "
             f"eps = {res['eps']}. Weights w_t = KL per NRMSE_t^2 (KL ~ sum_t w_t NRMSE_t^2); "
             f"kl_per_nrmse2 = sum_t w_t = {res['kl_per_nrmse2']:.3g} (KL at a uniform eps = eps^2 x that = "
             f"{res['kl_per_nrmse2'] * res['eps'] ** 2:.2e} at eps {res['eps']}).", "",
             f"Command: `{res['command']}` ({res['seconds'] / 60:.1f} min)", "",
             "## Per-tensor weights (share of sum_t w_t)", "",
             "| layer | type | key w | value w | key share | value share |" +
             (" key w (white) | value w (white) |" if "white" in s["weights"] else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if "white" in s["weights"] else "")]
    tot = sum(w.values())
    types = res.get("layer_types") or [""] * L
    for i in range(L):
        k, v = f"layers.{i}.key", f"layers.{i}.value"
        row = (f"| {i} | {types[i].replace('_attention', '')} | {w[k]:.3g} | {w[v]:.3g} | {100 * w[k] / tot:.1f}% | "
               f"{100 * w[v] / tot:.1f}% |")
        if "white" in s["weights"]:
            ww = s["weights"]["white"]
            row += f" {ww[k]:.3g} | {ww[v]:.3g} |"
        lines.append(row)
    kt = sum(w[f"layers.{i}.key"] for i in range(L))
    lines += ["", f"Keys carry {100 * kt / tot:.0f}% of the total weight, values {100 * (1 - kt / tot):.0f}%.", ""]
    ag = s.get("agreement")
    if ag:
        lines += [f"codec vs white weights on the same {ag['n_prompts']} prompts: correlation of log w "
                  f"{ag['codec_vs_white_log_corr']:.3f}; median ratio codec/white {ag['codec_over_white_median']:.2f}.",
                  ""]
    lines += ["## Additivity and out-of-sample checks (mean over prompts)", "",
              "Predicted = sum_t w_t NRMSE_t^2 with each perturbation's own per-tensor NRMSEs: codec weights for kvz "
              "and FP8, white-noise weights for the white rows. White noise also hits position 0 (the attention sink), "
              "which kvz codes with a 16x finer step: that is why white noise costs ~3x the KL of kvz's error at equal "
              "NRMSE, and why FP8 (no sink protection, error proportional to |x|) costs more than predicted.", "",
              "| perturbation | bpv | NRMSE (rms over tensors) | NRMSE max | measured KL | predicted KL | "
              "measured / predicted |", "|---|---|---|---|---|---|---|"]
    for lab, e in s["checks"].items():
        if "sum_of_singles" in e:
            lines.append(f"| {lab} | - | {res['eps']} | {res['eps']} | {e['measured']:.3e} | "
                         f"{e['predicted']:.3e} (sum of singles {e['sum_of_singles']:.3e}) | "
                         f"{e['measured'] / e['predicted']:.2f} |")
        else:
            lines.append(f"| {lab} | {fmt(e.get('bpv'), '.2f')} | {e['nrmse_rms_over_tensors']:.4f} | "
                         f"{e['nrmse_max']:.4f} | {e['measured']:.3e} | {e['predicted']:.3e} | "
                         f"{fmt(e['ratio_measured_to_predicted'], '.2f')} |")
    tw = res.get("token_weights")
    if tw:
        lines += ["", "## Token weights (KL per unit squared error at one position, relative to the average)", "",
                  "| position | " + " | ".join(k for k in tw["per_position"]) + " |",
                  "|---|" + "---|" * len(tw["per_position"]),
                  "| w_p | " + " | ".join(f"{v:.3g}" for v in tw["per_position"].values()) + " |", "",
                  f"Later positions (8..T-5, sampled) average {fmt(tw['later_mean'], '.3g')}, the last 4 "
                  f"{fmt(tw['last4_mean'], '.3g')}; position 0 keys only {fmt(tw['sink_key_only'], '.3g')}, "
                  f"values only {fmt(tw['sink_value_only'], '.3g')}.", "",
                  f"Attention (eager pass, mean over layers, heads and scored queries): position 0 receives "
                  f"{100 * tw['attention_mass_pos0_mean']:.1f}% of the attention (uniform share "
                  f"{100 * tw['attention_uniform_share']:.2f}%); per layer "
                  + ", ".join(f"{100 * a:.0f}%" for a in tw["attention_mass_pos0_per_layer"]) + ". Top positions: "
                  + ", ".join(f"{t['position']} ({100 * t['mean_attention']:.1f}%)" for t in tw["attention_top_positions"])
                  + "."]
    return "\n".join(lines) + "\n"


def run_preset(preset: str = "full", *, out=None, report=None, bank="gemma-3-270m", command="", progress=True,
        model=None, tokenizer=None, **over) -> dict:
    from alignpred.bank import resolve_bank

    cfg = dict(PRESETS[preset])
    raw = over.pop("raw", None)  # earlier measurements (--from-raw): summarize only
    cfg.update({k: v for k, v in over.items() if v is not None})
    bank = resolve_bank(str(bank))
    if raw is None:
        if model is None:
            model, tokenizer = load_model()
        raw = measure(model, tokenizer, bank, docs=cfg["docs"], per_doc=cfg["per_doc"], context=cfg["context"],
                      score_tokens=cfg["score_tokens"], eps=cfg["eps"], modes=cfg["modes"],
                      positions=cfg["positions"], checks=cfg["checks"], white_prompts=cfg.get("white_prompts"),
                      progress=progress)
        raw["command"] = command
    layer_types = raw.get("layer_types")
    command = raw.get("command") or command
    s = summarize(raw)
    main = "codec" if "codec" in s["weights"] else raw["modes"][0]
    w = s["weights"][main]
    method = {"codec": f"kvz's own error: cache compressed at eps={raw['eps']} (tensor scope, bundled bank, default "
                       f"codec config), one tensor's reconstruction error at a time added to the float32 K/V",
              "white": f"white Gaussian noise at NRMSE {raw['eps']}, one tensor at a time"}[main]
    res = {"model": "gemma-3-270m", "bank_id": bank.id, "tensor_weights": w, "kl_per_nrmse2": float(sum(w.values())),
           "token_weights": s.get("token_weights", {}), "method": method,
           "metric": "mean next-token KL(full || perturbed), teacher-forced, float64",
           "command": command, "eps": raw["eps"], "context": raw["context"], "score_tokens": raw["score_tokens"],
           "n_prompts": len(raw["prompts"]), "docs": sorted({p["doc"] for p in raw["prompts"]}),
           "layer_types": layer_types, "seconds": raw["seconds"], "summary": s,
           "weights_other_modes": {m: v for m, v in s["weights"].items() if m != main}}
    if out:
        write_json(res, out)
        if report:  # the raw measurements beside the report (not in the bank folder)
            write_json(raw, Path(report).with_suffix(".raw.json"))
    if report:
        write_text(report, format_report(res))
    return res


def _load_raw(path, out) -> dict:
    raw = json.loads(Path(path).read_text())
    if "command" not in raw and out and Path(out).exists():  # measured before raw files carried these
        old = json.loads(Path(out).read_text())
        raw["command"] = old.get("command")
        raw.setdefault("layer_types", old.get("layer_types"))
    return raw


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m benchmarks.studies.rate.sensitivity", quick="1 window, 16 scored tokens, codec error only",
                quiet=True)
    ap.add_argument("--out", required=True, help="output JSON (the bank's sensitivity file)")
    ap.add_argument("--report", help="Markdown report")
    ap.add_argument("--bank", default="gemma-3-270m")
    ap.add_argument("--eps", type=float)
    ap.add_argument("--per-doc", type=int)
    ap.add_argument("--context", type=int)
    ap.add_argument("--score-tokens", type=int)
    ap.add_argument("--from-raw", help="no new measurements: summarize a report's .raw.json again")
    a = ap.parse_args(argv)
    a.command = "python -m benchmarks.studies.rate.sensitivity " + " ".join(sys.argv[1:] if argv is None else argv)
    res = run(a)
    top = sorted(res["tensor_weights"].items(), key=lambda kv: -kv[1])[:6]
    print(f"kl_per_nrmse2 = {res['kl_per_nrmse2']:.3g}; top tensors: " + ", ".join(f"{k} {v:.3g}" for k, v in top))
    for lab, e in res["summary"]["checks"].items():
        print(f"  {lab}: measured {e['measured']:.3e} predicted {e['predicted']:.3e}")
    return 0


def run(a) -> dict:
    """The preset (``a.quick``) with ``a``'s overrides; writes ``a.out`` (and ``a.report``)."""
    return run_preset("quick" if a.quick else "full", out=a.out, report=a.report, bank=a.bank, command=a.command,
                      progress=not a.quiet, eps=a.eps, per_doc=a.per_doc, context=a.context,
                      score_tokens=a.score_tokens, raw=_load_raw(a.from_raw, a.out) if a.from_raw else None)


def markdown(result: dict) -> str:
    return format_report(result)


if __name__ == "__main__":
    sys.exit(main())
