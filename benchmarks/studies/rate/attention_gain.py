"""How many bits an attention-aware error measure could save (issue 20): per layer, kvz's key and
value errors weighed by what attention reads of them, and the reverse water-filling gains of those
weights, on held-out Gemma 3 270M caches of >= 1,024 tokens.

Keys are read through queries: with RoPE the relative phase averages out inside each frequency pair,
so a key error in pair ``p`` costs ``E|q_p|² |δk_p|² / 2`` (pre-RoPE queries after ``q_norm``,
summed over the GQA group's query heads; ``|δk_p|²`` is the same before and after RoPE, so it is
measured on the cached keys). Values are read through attention and ``W_o``: ``δvᵀ G δv`` with
``G = Σ_h W_hᵀ W_h`` of ``o_proj`` (with the gain of ``post_attention_layernorm``), and per token
``j`` by ``Σ_{h,i} a_{hij}²`` (independent token errors; the attention mass ``Σ a`` is reported too).

Per layer: the plain NRMSE of kvz's reconstruction (eps 0.0267, tensor scope, bundled bank, default
codec config) and the weighted relative error ``sqrt(Σ w δ² / Σ w x²)``; the high-rate gain
``½ log2(AM/GM)`` of the weights (bits per value: what steps ``∝ 1/sqrt(w)`` save at equal weighted
error) in the pre-RoPE pair basis (the weights' eigenbasis) and in kvz's quantisation frame (RoPE
undone, bank mean removed, GPA rotation ``R``: weights ``diag(Rᵀ W R)``, since independent
per-channel quantisation errors cost ``Σ_c diag(RᵀWR)_c d_c``; the rotation mixes pairs and so
flattens the weights); and the reverse water-filling gain at the measured operating point (Gaussian
model, frame-coefficient variances, components below the water level get no bits). Key weights
come from the bank's sidecar (the calibration texts), so the gains are out of sample; the
held-out prefill's own weights are reported beside them.

``--fit`` first writes the sidecar ``<bank>.attention.json`` of the bundled bank from the bank's
calibration texts (``samples/gemma3-270m/calib_texts``, 2,048 tokens each, as the bank was fitted)::

    python -m benchmarks.studies.rate.attention_gain --fit alignpred/bank/data/gemma-3-270m.attention.json
    python -m benchmarks.studies.rate.attention_gain   # results: benchmarks/results/attention_gain.{json,md}
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from kvz.benchmarks.harness import RESULTS, ROOT, command_line, parser, write_json, write_text

DOCS = ("licence-text", "python-code", "json-records", "japanese-manpage")  # rate_quality's held-out set
EPS = 0.0267
PRIOR = 16
LEVELS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


def _texts(split: str, names=None):
    from kvz.benchmarks.rate_quality import documents

    return documents(split, names)


def _ids(tok, path, n: int):
    from kvz.integrations.hf.capture import tokenize

    ids = tokenize(tok, Path(path).read_text(encoding="utf-8"))
    if len(ids) < n:
        raise ValueError(f"{path}: {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def _rotation(bank, name: str, d: int) -> np.ndarray:
    r = bank.rotation(name)
    return np.eye(d) if r is None else np.asarray(r, np.float64)


def _frame_diag(R: np.ndarray, M: np.ndarray) -> np.ndarray:
    """``diag(Rᵀ M R)`` (``M`` a matrix, or a vector meaning a diagonal)."""
    if M.ndim == 1:
        return (R * R).T @ M
    return np.einsum("ic,ij,jc->c", R, M, R)


def _model():
    import torch

    from kvz.benchmarks.lm import model

    torch.set_num_threads(1)
    return model()


# ============================================================================ fit the sidecar
def fit(out: Path, tokens: int, bank_name: str) -> dict:
    from alignpred.bank import AttentionStats, resolve_bank
    from kvz.integrations.hf.bridge import text_config
    from kvz.integrations.hf.querystats import record_query_stats, value_grams

    bank = resolve_bank(bank_name)
    m, tok = _model()
    docs = _texts("calib")
    t0 = time.perf_counter()
    qsum: np.ndarray | None = None
    n, prior, prior_sq, later, later_sq, types = 0, [], [], [], [], []
    for name, path in docs:
        st = record_query_stats(m, _ids(tok, path, tokens))
        types = st.layer_types
        qsum = st.q_channel * st.n_tokens + (0.0 if qsum is None else qsum)
        n += st.n_tokens
        rel = st.mass * st.n_tokens  # mean 1 over positions
        rel_sq = st.sq / st.sq.mean(axis=-1, keepdims=True)
        prior.append(rel[..., :PRIOR])
        prior_sq.append(rel_sq[..., :PRIOR])
        later.append(rel[..., PRIOR:])
        later_sq.append(rel_sq[..., PRIOR:])
        print(f"  {name}: {st.n_tokens} tokens", file=sys.stderr)
    if qsum is None:
        raise SystemExit("no calibration texts")
    q = qsum / n
    grams = value_grams(m)
    G = grams["gram_norm"] if grams["gram_norm"] is not None else grams["gram"]
    L, H, d = q.shape
    stats = AttentionStats(model=bank.model, bank_id=bank.id, layer_types=tuple(types), pairing="half",
                           key_channel=q, value_gram_eig=np.linalg.eigvalsh(G)[..., ::-1].copy(),
                           value_gram_diag=np.diagonal(G, axis1=-2, axis2=-1), token_prior=np.mean(prior, axis=0),
                           token_quantiles=np.quantile(np.concatenate(later, -1), LEVELS, axis=-1).transpose(1, 2, 0),
                           quantile_levels=LEVELS, token_prior_sq=np.mean(prior_sq, axis=0),
                           token_quantiles_sq=np.quantile(np.concatenate(later_sq, -1), LEVELS,
                                                          axis=-1).transpose(1, 2, 0),
                           meta={}, sliding_window=int(getattr(text_config(m), "sliding_window", 0) or 0))
    kw = stats.key_weights()
    key_frame = np.stack([[_frame_diag(_rotation(bank, f"K.{i}.{g}", d), kw[i, g]) for g in range(H)]
                          for i in range(L)])
    value_frame = np.stack([[_frame_diag(_rotation(bank, f"V.{i}.{g}", d), G[i, g]) for g in range(H)]
                            for i in range(L)])
    meta = {"texts": [str(Path(p).resolve().relative_to(ROOT)) for _, p in docs], "tokens_per_text": tokens,
            "value_gram": "o_proj blocks of the group's heads times post_attention_layernorm's gain"
            if grams["gram_norm"] is not None else "o_proj blocks of the group's heads",
            "queries": "pre-RoPE, after q_norm, summed over the GQA group's heads, mean over tokens",
            "token_prior": f"attention mass received (mean over heads and query rows) x T, positions 0..{PRIOR - 1}",
            "command": command_line("studies.rate.attention_gain", ["--fit", str(out)]),
            "seconds": round(time.perf_counter() - t0, 1)}
    from dataclasses import replace

    stats = replace(stats, key_frame=key_frame, value_frame=value_frame, meta=meta)
    stats.save(out)
    print(f"wrote {out} ({out.stat().st_size} bytes)", file=sys.stderr)
    return {"path": str(out), "bytes": out.stat().st_size}


# ============================================================================ measure
def _layer_rows(kv, rec, st, stats, G, bank, spec, G_plain=None) -> list[dict]:
    from alignpred.bank import highrate_gain, waterfill_gain

    rows = []
    kw_cal = stats.key_weights()
    pw_cal = stats.pair_weights()
    pw_own = st.pairs()
    for i in range(stats.num_layers):
        k = np.asarray(kv[f"layers.{i}.key"], np.float32).astype(np.float64)
        v = np.asarray(kv[f"layers.{i}.value"], np.float32).astype(np.float64)
        dk = np.asarray(rec[f"layers.{i}.key"], np.float32) - k
        dv = np.asarray(rec[f"layers.{i}.value"], np.float32) - v
        H, T, d = k.shape
        r = {"layer": i, "type": stats.layer_types[i]}
        acc = {x: 0.0 for x in ("k2", "dk2", "kw", "dkw", "kwo", "dkwo", "v2", "dv2", "vG", "dvG", "vGa", "dvGa",
                                "vGm", "dvGm")}
        g_pair, g_frame, g_own, wf_k, top5, zeros, g_eig, g_vdiag, g_vframe, g_mass, g_sq, wf_sq, wf_v, g_plain = \
            ([] for _ in range(14))
        for g in range(H):
            acc["k2"] += float((k[g] ** 2).sum())
            acc["dk2"] += float((dk[g] ** 2).sum())
            w = kw_cal[i, g]
            own = np.concatenate([pw_own[i, g], pw_own[i, g]]) / 2 if stats.pairing == "half" else None
            acc["kw"] += float((k[g] ** 2 @ w).sum())
            acc["dkw"] += float((dk[g] ** 2 @ w).sum())
            if own is not None:
                acc["kwo"] += float((k[g] ** 2 @ own).sum())
                acc["dkwo"] += float((dk[g] ** 2 @ own).sum())
            p = pw_cal[i, g]
            g_pair.append(highrate_gain(p))
            g_own.append(highrate_gain(pw_own[i, g]))
            zeros.append(int((p <= 1e-12 * p.max()).sum()))
            top5.append(float(np.sort(p)[::-1][:5].sum() / p.sum()))
            R = _rotation(bank, f"K.{i}.{g}", d)
            kf = _frame_diag(R, w)
            g_frame.append(highrate_gain(kf))
            table = spec.table(i)
            kd = table.apply(k[g].astype(np.float32), 0, inverse=True) if table is not None else k[g]
            z = (np.asarray(kd, np.float64) - bank.mean(f"K.{i}.{g}")) @ R
            dmean = float((dk[g] ** 2).mean())
            wf_k.append(waterfill_gain(kf, (z ** 2).mean(axis=0), dmean)["bits"])
            # values
            Gg = G[i, g]
            acc["v2"] += float((v[g] ** 2).sum())
            acc["dv2"] += float((dv[g] ** 2).sum())
            vq = np.einsum("tc,cd,td->t", v[g], Gg, v[g])
            dq = np.einsum("tc,cd,td->t", dv[g], Gg, dv[g])
            acc["vG"] += float(vq.sum())
            acc["dvG"] += float(dq.sum())
            sq, mass = st.sq[i, g, :T], st.mass[i, g, :T]
            acc["vGa"] += float((sq * vq).sum())
            acc["dvGa"] += float((sq * dq).sum())
            acc["vGm"] += float((mass * vq).sum())
            acc["dvGm"] += float((mass * dq).sum())
            g_eig.append(highrate_gain(np.linalg.eigvalsh(Gg)))
            g_plain.append(highrate_gain(np.linalg.eigvalsh(G_plain[i, g])) if G_plain is not None else float("nan"))
            g_vdiag.append(highrate_gain(np.diagonal(Gg)))
            Rv = _rotation(bank, f"V.{i}.{g}", d)
            vf = _frame_diag(Rv, Gg)
            g_vframe.append(highrate_gain(vf))
            zv = (v[g] - bank.mean(f"V.{i}.{g}")) @ Rv
            dvm = float((dv[g] ** 2).mean())
            wf_v.append(waterfill_gain(vf, (zv ** 2).mean(axis=0), dvm)["bits"])
            g_mass.append(highrate_gain(mass))
            g_sq.append(highrate_gain(sq))
            wf_sq.append(waterfill_gain(sq, (zv ** 2).mean(axis=1), dvm)["bits"])
        r.update({
            "key_nrmse": (acc["dk2"] / acc["k2"]) ** 0.5, "key_qrel": (acc["dkw"] / acc["kw"]) ** 0.5,
            "key_qrel_own": (acc["dkwo"] / acc["kwo"]) ** 0.5 if acc["kwo"] else None,
            "key_gain_pair": float(np.mean(g_pair)), "key_gain_pair_own": float(np.mean(g_own)),
            "key_gain_frame": float(np.mean(g_frame)), "key_waterfill_frame": float(np.mean(wf_k)),
            "key_top5_share": float(np.mean(top5)), "key_zero_pairs": int(np.sum(zeros)),
            "value_nrmse": (acc["dv2"] / acc["v2"]) ** 0.5, "value_grel": (acc["dvG"] / acc["vG"]) ** 0.5,
            "value_arel": (acc["dvGa"] / acc["vGa"]) ** 0.5, "value_mrel": (acc["dvGm"] / acc["vGm"]) ** 0.5,
            "value_gain_eig": float(np.mean(g_eig)), "value_gain_eig_wo": float(np.mean(g_plain)),
            "value_gain_diag": float(np.mean(g_vdiag)),
            "value_gain_frame": float(np.mean(g_vframe)), "value_waterfill_frame": float(np.mean(wf_v)),
            "token_gain_mass": float(np.mean(g_mass)), "token_gain_sq": float(np.mean(g_sq)),
            "token_waterfill_sq": float(np.mean(wf_sq)),
        })
        rows.append(r)
    return rows


def measure(docs, tokens: int, eps: float, bank_name: str, sidecar: Path | None) -> dict:
    from alignpred import Cache, ErrorBudget, KvzReader, compress, resolve_bank
    from alignpred.bank import AttentionStats
    from kvz.integrations.hf.capture import cache_metadata
    from kvz.integrations.hf.querystats import capture_with_stats, value_grams
    from kvz.integrations.hf.rope import rope_thetas

    bank = resolve_bank(bank_name)
    stats = AttentionStats.load(sidecar) if sidecar else AttentionStats.find(bank_name)
    if stats is None or not stats.fits(bank):
        raise SystemExit(f"no attention statistics of bank {bank_name!r}: run with --fit first")
    m, tok = _model()
    grams = value_grams(m)
    G = grams["gram_norm"] if grams["gram_norm"] is not None else grams["gram"]
    per_doc, t0 = [], time.perf_counter()
    for name, path in _texts("eval", docs):
        ids = _ids(tok, path, tokens)
        tensors, spec, info, st = capture_with_stats(m, ids, dtype="bfloat16")
        kv = {k: t.float().numpy() for k, t in tensors.items()}
        meta = cache_metadata(info["layer_types"], rope_thetas(m, spec), ids, name, model="gemma-3-270m", rope=spec)
        cache = Cache.from_arrays(tensors, metadata=meta)
        ci = compress(cache, None, budget=ErrorBudget(eps=eps, scope="tensor"), bank=bank)
        rec = KvzReader(ci.data).read()
        rows = _layer_rows(kv, rec, st, stats, G, bank, spec, grams["gram"])
        per_doc.append({"doc": name, "tokens": tokens, "bpv": ci.bpv, "layers": rows})
        print(f"  {name}: {ci.bpv:.3f} bpv, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    keys = [k for k in per_doc[0]["layers"][0] if k not in ("layer", "type")]
    mean = []
    for i in range(len(per_doc[0]["layers"])):
        row = {"layer": i, "type": per_doc[0]["layers"][i]["type"]}
        for k in keys:
            vals = [d["layers"][i][k] for d in per_doc if d["layers"][i][k] is not None]
            row[k] = float(np.mean(vals)) if vals else None
        mean.append(row)
    return {"docs": per_doc, "mean": mean, "eps": eps, "tokens": tokens, "bank": bank.id,
            "sidecar_meta": stats.meta, "seconds": round(time.perf_counter() - t0, 1),
            "value_gram": "with post_attention_layernorm gain" if grams["gram_norm"] is not None else "plain"}


def _md(res: dict, command: str) -> str:
    mean = res["mean"]
    L = len(mean)

    def avg(k):
        return float(np.mean([r[k] for r in mean]))

    lines = [
        "# Attention-aware error: the opportunity (issue 20)", "",
        f"Gemma 3 270M, held-out documents {', '.join(d['doc'] for d in res['docs'])} "
        f"({res['tokens']} tokens each), kvz at eps {res['eps']} (tensor scope, bundled bank), mean over documents. "
        "bpv: " + ", ".join(f"{d['bpv']:.3f}" for d in res["docs"]) + ". Key weights from the bank's sidecar "
        "(calibration texts, out of sample); `own` = the held-out prefill's own queries.", "",
        f"Command: `{command}`", "",
        "Gains are bits per value (high-rate `½ log2(AM/GM)`, or reverse water-filling at the measured operating "
        "point, `wf`). Pair = pre-RoPE pair basis (the key weights' eigenbasis); frame = kvz's quantisation frame "
        "(RoPE undone, GPA rotation: `diag(RᵀWR)`). Rel. errors: `sqrt(Σ w δ² / Σ w x²)`.", "",
        "## Keys", "",
        "| layer | type | NRMSE | q-weighted rel | (own q) | top-5 pair share | zero pairs | gain pair | (own) "
        "| gain frame | wf frame |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in mean:
        lines.append(f"| {r['layer']} | {r['type'].split('_')[0]} | {r['key_nrmse']:.4f} | {r['key_qrel']:.4f} | "
                     f"{r['key_qrel_own']:.4f} | {r['key_top5_share']:.2f} | {r['key_zero_pairs']:.0f} | "
                     f"{r['key_gain_pair']:.3f} | {r['key_gain_pair_own']:.3f} | {r['key_gain_frame']:.3f} | "
                     f"{r['key_waterfill_frame']:.3f} |")
    lines.append(f"| mean | | {avg('key_nrmse'):.4f} | {avg('key_qrel'):.4f} | {avg('key_qrel_own'):.4f} | "
                 f"{avg('key_top5_share'):.2f} | | {avg('key_gain_pair'):.3f} | {avg('key_gain_pair_own'):.3f} | "
                 f"{avg('key_gain_frame'):.3f} | {avg('key_waterfill_frame'):.3f} |")
    lines += ["", "## Values", "",
              "Channel weights: `G = Σ_h W_hᵀW_h` (" + res["value_gram"] + "); token weights from the held-out "
              "prefill itself: `sq` = `Σ_{h,i} a²` (the weight of an independent value error), `mass` = `Σ a`.", "",
              "| layer | NRMSE | G-weighted rel | G·sq rel | G·mass rel | gain eig | (W_o only) | gain native diag "
              "| gain frame | wf frame | token gain sq | token gain mass | token wf sq |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in mean:
        lines.append(f"| {r['layer']} | {r['value_nrmse']:.4f} | {r['value_grel']:.4f} | {r['value_arel']:.4f} | "
                     f"{r['value_mrel']:.4f} | {r['value_gain_eig']:.3f} | {r['value_gain_eig_wo']:.3f} | "
                     f"{r['value_gain_diag']:.3f} | {r['value_gain_frame']:.3f} | "
                     f"{r['value_waterfill_frame']:.3f} | {r['token_gain_sq']:.2f} | {r['token_gain_mass']:.2f} | "
                     f"{r['token_waterfill_sq']:.3f} |")
    lines.append(f"| mean | {avg('value_nrmse'):.4f} | {avg('value_grel'):.4f} | {avg('value_arel'):.4f} | "
                 f"{avg('value_mrel'):.4f} | {avg('value_gain_eig'):.3f} | {avg('value_gain_eig_wo'):.3f} | "
                 f"{avg('value_gain_diag'):.3f} | {avg('value_gain_frame'):.3f} | "
                 f"{avg('value_waterfill_frame'):.3f} | {avg('token_gain_sq'):.2f} | {avg('token_gain_mass'):.2f} | "
                 f"{avg('token_waterfill_sq'):.3f} |")
    rot = [r for r in mean if abs(r["key_gain_frame"] - r["key_gain_pair"]) > 1e-3]
    keep = [r for r in mean if r not in rot]
    full = [r for r in mean if r["type"] == "full_attention"]
    full_s = ", ".join(f"layer {r['layer']}: {r['key_gain_pair']:.2f}" for r in full)
    rot_s = ", ".join(str(r["layer"]) for r in rot)
    lines += ["", "## Summary (computed from the tables)", "",
              f"* Keys: the query weights are worth {avg('key_gain_pair'):.2f} bits/value in the pair basis "
              f"({full_s} in the full-attention "
              f"layers) but {avg('key_gain_frame'):.2f} in kvz's quantisation frame: in the {len(rot)} layers with a "
              f"GPA rotation ({rot_s}) the rotation mixes pairs and leaves "
              f"{np.mean([r['key_gain_frame'] for r in rot]):.2f} of {np.mean([r['key_gain_pair'] for r in rot]):.2f} "
              f"bits; the {len(keep)} anchor layers (identity) keep all of it. "
              f"{sum(r['key_zero_pairs'] for r in mean):.0f} pairs (over all layers) are never read (zero query "
              "energy).",
              f"* Values: W_o alone is worth {avg('value_gain_eig_wo'):.2f} bits/value in its eigenbasis; with the "
              f"norm after o_proj {avg('value_gain_eig'):.2f}, but only {avg('value_gain_frame'):.2f} as per-channel "
              f"steps in kvz's frame. Per token (squared attention) {avg('token_gain_sq'):.2f} bits/value at high "
              f"rate, {avg('token_waterfill_sq'):.2f} water-filled.", "",
              "Caveats: high-rate and Gaussian water-filling estimates, not coded bits (kvz codes prediction "
              "residuals; low-rate channels save less); the phase average assumes relative RoPE phases spread over "
              "the pair's circle (low-frequency pairs of sliding layers rotate little inside the window); token "
              "weights are the prefill's own queries, not future decode queries; gains of channels and tokens do not "
              "simply add.", "", f"{L} layers; {res['seconds']} s."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = parser(__doc__, json="results JSON (default benchmarks/results/attention_gain.json)")
    ap.add_argument("--fit", metavar="SIDECAR", help="first fit the bank's sidecar from the calibration texts")
    ap.add_argument("--fit-tokens", type=int, default=2048)
    ap.add_argument("--sidecar", help="read the statistics from this file (default: beside the bank)")
    ap.add_argument("--bank", default="gemma-3-270m")
    ap.add_argument("--docs", nargs="+", default=list(DOCS))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--eps", type=float, default=EPS)
    ap.add_argument("--md", help="Markdown report (default beside the JSON)")
    ap.add_argument("--no-measure", action="store_true", help="only --fit")
    a = ap.parse_args(argv)
    a.command = command_line("studies.rate.attention_gain", argv)
    res = run(a)
    if not res:
        return 0
    out = Path(a.json) if a.json else Path(RESULTS) / "attention_gain.json"
    write_json(res, out)
    write_text(Path(a.md) if a.md else out.with_suffix(".md"), markdown(res))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def run(a) -> dict:
    """``--fit`` (the bank's sidecar) and then the measurement; ``{}`` for ``--fit --no-measure``."""
    if a.fit:
        fit(Path(a.fit), a.fit_tokens, a.bank)
        if a.no_measure:
            return {}
    res = measure(a.docs, a.tokens, a.eps, a.bank, Path(a.sidecar) if a.sidecar else
                  (Path(a.fit) if a.fit else None))
    res["command"] = a.command
    return res


def markdown(result: dict) -> str:
    return _md(result, result["command"])


if __name__ == "__main__":
    sys.exit(main())
