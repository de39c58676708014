"""Rate-quality: bits per value against downstream quality, for kvz and the field's KV codecs, on the same caches.

The field compares KV codecs by downstream quality at a bit budget, not by NRMSE.  This benchmark measures, for
every method at each of its rates, the bits per value (bpv) it spends and what the model loses, teacher-forced on
held-out text, and reports each method's bpv at FP8 e4m3's quality and at twice FP8's KL.

**Protocol** (per prompt window of a held-out document; Gemma 3 270M by default):

1. ``context`` tokens (BOS + document tokens) are prefilled; the model's float32 K/V of every layer and position
   (keys post-RoPE, as the model stores them; a sliding-window layer's old positions too, as ``kvz capture`` stores
   them) is captured with the prefill's attention statistics.  Methods receive it at the stored precision, bfloat16
   (a :class:`~kvz.benchmarks.quality.KV` with ``.fp32``, ``.metadata`` and ``.capture_stats``, which kvz's attention
   scope weighs positions by), compress and restore it.
2. The next ``score_tokens`` *document* tokens ``x_C .. x_{C+N-1}`` are fed in one pass on top of a fresh model
   cache holding (a) the exact float32 K/V (the reference) and (b) each method's restored K/V, injected through
   each layer's own ``update()`` (:func:`kvz.benchmarks.quality.inject`; sliding layers keep what a real prefill
   keeps).  The logits at those N positions predict ``x_{C+1} .. x_{C+N}``.
3. Metrics per prompt (log-softmax and KL in float64):

   * ``kl_mean``: mean over the N positions of KL(p_full || p_restored) of the next-token distribution;
   * ``top1``: fraction of positions where the restored argmax equals the reference argmax;
   * ``greedy_identical``: 1 if the :data:`GREEDY_TOKENS` greedy tokens generated after the context (fed the
     document's next token) equal those of the exact cache (the share of prompts: "identical greedy");
   * ``ppl_rel_change``: perplexity of the true next tokens with the restored cache over that with the exact
     cache, minus 1 (``exp(mean NLL_restored - mean NLL_full) - 1``; aggregated over prompts by pooling the NLLs,
     i.e. per token, not by averaging per-prompt ratios);
   * ``bpv``: every bit the decoder needs (payload + scales + headers; kvz: the .kvz file size) per K/V value.

Aggregates: a *method* (one curve: ``kvz-tensor``, ``turboquant_mse``, ``kivi_r128`` ...) has *settings* (its
points: an eps, a rate, a bit width).  Per setting and document the prompt metrics are averaged (bpv, KL, top-1)
or pooled (NLL); overall the same over all prompts.  Each method's **bpv at a KL target** (FP8 e4m3's mean KL,
and 2x it; per document and overall) comes from :func:`bpv_at_kl`: the method's Pareto frontier (points not beaten
by a cheaper point), linear interpolation of bpv in log(KL) between the two frontier points that bracket the target,
and ``None`` where the target lies outside the measured range (never extrapolated; ``status`` says which side and
``bound`` gives the one-sided bound the measurements do support).

Methods (``--methods`` filters by method name):

* kvz, one curve per entry of :data:`KVZ_VARIANTS` (``alignpred.compress`` keywords, or ``fn`` - a callable
  ``fn(kv, eps) -> (restored tensors, total bits)`` for an encoder variant that is not in ``compress`` yet); its eps
  sweep is the preset's (``--kvz NAME:eps,eps`` overrides).  Adding a variant is one line in
  :data:`KVZ_VARIANTS` (or :func:`add_kvz_variant` from a script);
* every baseline registered in ``kvz.benchmarks.baselines.BASELINES`` that imports here, at its natural rates:
  FP8 e4m3 (the reference), TurboQuant-style with and without the 1-bit QJL residual (``turboquant_mse_*`` /
  ``turboquant_prod_*``), KIVI with its residual window (``kivi*_r128``) and without (``kivi_int*``, group 32),
  KVQuant-style (``kvquant*``, self-contained and calibrated), the covariance-rotation peer in the style of OSCAR /
  AQUA-KV (``covrot``, keys post-RoPE, and ``covrot_pre``, keys pre-RoPE; calibrated; ``covrot@2`` .. ``@5``), KVTC
  and SZ3 at a few error levels (knobs chosen by the coders' own search for the target NRMSE); calibrated coders
  get caches of the *calibration* texts (``samples/gemma3-270m/calib_texts``), never the held-out ones;
  ``bf16`` (the storage precision, 16 bpv) is the floor.

Run::

    python -m kvz.benchmarks.rate_quality --quick --json out/rq.json --plot out/rq.png
    python -m kvz.benchmarks.rate_quality --long --json benchmarks/results/rate_quality-long.json \\
        --plot benchmarks/results/rate_quality-long.png    # 1,024-token contexts: kvz scopes against FP8
    python -m kvz.benchmarks.rate_quality --full --json benchmarks/results/rate_quality.json \\
        --plot benchmarks/results/rate_quality.png          # 4 documents x 6 prompts; writes a .md beside the JSON

``--resume`` continues an interrupted run from its ``.partial.json``.  ``kvz bench --quality`` runs the same
benchmark (``--quick`` preset with ``kvz bench --quick``) into the bench output folder.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .harness import ROOT, parser, write_json, write_text
from .lm import forward_logits, greedy, kv_nrmse, log_softmax64, prefill
from .lm import model as load_model
from .prompts import text_files
from .quality import KV, capture_kv
from .rate_methods import (  # noqa: F401  (the methods, re-exported)
    FP8,
    KVZ_VARIANTS,
    REFERENCE_METHOD,
    add_kvz_variant,
    baseline_setting,
    baseline_specs,
    build_settings,
    codec_points,
    kvz_variant_setting,
    needs_calib,
)
from .rate_report import ROW_KEYS, aggregate, bpv_at_kl, format_report, pareto, plot, verdict  # noqa: F401

# Documents of the full run: the kinds of the issue (licence text, Python source, JSON, a Japanese man page), all
# held out from the bank's calibration texts.  ``--docs all`` takes every held-out document.
FULL_DOCS = ("licence-text", "python-code", "json-records", "japanese-manpage")
QUICK_DOCS = ("python-code", "json-records")
MAX_CONTEXT = 4096  # the capture keeps every head's attention weights for the statistics: T² per head
GREEDY_TOKENS = 16  # greedy tokens after the context compared with the exact cache's (identical continuations)

# The covariance-rotation peer (baselines/covrot.py, OSCAR / AQUA-KV style; calibrated) at 2, 3, 4 and 5 bits, keys
# post-RoPE (covrot, as OSCAR) and pre-RoPE (covrot_pre); 5 bits because at 4 (4.17 bpv) neither reached FP8's KL
# on python-code (KL 7.5e-03 / 5.3e-03 against FP8's 3.6e-03), and bpv at a target is never extrapolated
COVROT_POINTS = tuple(f"{n}@{b}" for n in ("covrot", "covrot_pre") for b in (2, 3, 4, 5))

PRESETS = {
    "quick": dict(docs=QUICK_DOCS, per_doc=1, context=256, score_tokens=32,
                  kvz_eps={"kvz-tensor": (0.0134, 0.0267, 0.0534), "*": (0.0267, 0.0534)},
                  error_eps=(0.0267,),
                  baselines=("fp8_e4m3", "bf16", "turboquant_mse_3", "turboquant_mse_4", "turboquant_prod_4",
                             "kivi2_r128", "kivi4_r128", "kvquant3_calib", "covrot@3", "covrot_pre@3", "kvtc",
                             "sz3")),
    # sized for < 60 min on 2 shared (and busy) cores: 24 prompts x 23 settings x 32 scored tokens (each scored
    # token costs a 262k-vocabulary softmax), before the 8 covrot points were added (31 settings now);
    # --score-tokens 64 and more rates when there is CPU to spare
    # issue 20's long contexts: 1,024 cached tokens (the sliding layers' window is 512, so half of their positions are
    # never attended again), the kvz scopes and FP8 on the four documents of the full run
    "long": dict(docs=FULL_DOCS, per_doc=2, context=1024, score_tokens=32,
                 kvz_eps={"kvz-weighted": (0.0188, 0.0267, 0.0376, 0.0534),
                          # 0.0225: FP8's KL lies between 0.0188 and 0.0267 for this mode (0.37 bpv apart)
                          "kvz-attention": (0.0134, 0.0188, 0.0225, 0.0267, 0.0376, 0.0534),
                          "kvz-tensor": (0.0188, 0.0267, 0.0376)},
                 error_eps=(0.0267,), baselines=("fp8_e4m3",)),
    "full": dict(docs=FULL_DOCS, per_doc=6, context=256, score_tokens=32,
                 kvz_eps={"kvz-tensor": (0.0188, 0.0267, 0.0376, 0.0534),
                          "kvz-pooled-cap3": (0.0188, 0.0267, 0.0376),
                          "kvz-pooled-nocap": (0.0188, 0.0376),
                          "*": (0.0188, 0.0267, 0.0376)},
                 error_eps=(0.0188, 0.0376),
                 baselines=("fp8_e4m3", "turboquant_mse_3", "turboquant_mse_4", "turboquant_mse@6",
                            "turboquant_prod_4", "turboquant_prod@6", "kivi2_r128", "kivi4_r128", "kvquant3_calib",
                            "kvquant4_calib", *COVROT_POINTS, "kvtc", "sz3")),
}
# ``name@knob`` in a preset's baselines runs a searchable coder at a fixed knob (e.g. turboquant_mse@6: 6 bits, to
# extend its curve past the fixed-rate points).


# ============================================================================ prompts

def _tok_ids(tokenizer, text: str) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids[1:] if ids and bos is not None and ids[0] == bos else ids


def documents(split: str = "eval", names=None) -> list[tuple[str, Path]]:
    """``[(name, path)]`` of the held-out (``"eval"``: samples/texts, samples/texts/eval) or calibration
    (``"calib"``) texts; ``names`` selects and orders them (stems; ``None`` or ``"all"``: every one)."""
    files = {p.stem: p for _, p in text_files(split)}
    if names in (None, "all", ("all",)):
        return sorted(files.items())
    missing = [n for n in names if n not in files]
    if missing:
        raise FileNotFoundError(f"no {split} text(s) {', '.join(missing)} (have: {', '.join(sorted(files))})")
    return [(n, files[n]) for n in names]


def windows(docs, per_doc: int, context: int, score_tokens: int, tokenizer, split: str = "eval") -> list[dict]:
    """``per_doc`` windows of each document: BOS + ``context - 1`` document tokens as the cached context, then the
    ``score_tokens + 1`` following document tokens (fed, and predicted).  Starts are evenly spaced over the document
    (disjoint when it is long enough).  Returns ``{"doc", "source", "split", "index", "start", "token_ids"}``."""
    if context < 2 or context > MAX_CONTEXT:
        raise ValueError(f"context must be in 2..{MAX_CONTEXT} (the capture records every head's attention "
                         "weights, T² per head)")
    if score_tokens < 1 or per_doc < 1:
        raise ValueError("score_tokens and per_doc must be >= 1")
    bos = tokenizer.bos_token_id
    need = context - 1 + score_tokens + 1
    out = []
    for name, path in docs:
        ids = _tok_ids(tokenizer, Path(path).read_text(encoding="utf-8"))
        if len(ids) < need:
            raise ValueError(f"{path}: {len(ids)} tokens, fewer than the {need} a window needs")
        span = len(ids) - need
        starts = [round(i * span / (per_doc - 1)) for i in range(per_doc)] if per_doc > 1 else [0]
        try:
            rel = str(Path(path).resolve().relative_to(ROOT))
        except ValueError:
            rel = str(path)
        for i, s in enumerate(starts):
            out.append({"doc": name, "source": rel, "split": split, "index": i, "start": s,
                        "token_ids": [bos] + ids[s:s + need]})
    return out


# ============================================================================ model side

def layer_meta_of(lm):
    """``(layer types, RoPE thetas)`` of the model."""
    from kvz.integrations.hf.bridge import text_config
    from kvz.integrations.hf.gemma import layer_info

    return layer_info(text_config(lm))


def capture(lm, ids: list[int], source: str = "prompt", layer_meta=None) -> KV:
    """Prefill ``ids`` and return the cache as a :class:`~kvz.benchmarks.quality.KV` (bf16, with ``.fp32``, kvz-cache
    ``.metadata`` and the prefill's ``.capture_stats``): kvz's own capture (:func:`~kvz.benchmarks.quality.capture_kv`),
    every position of every layer — a sliding-window layer's old positions too, as ``kvz capture`` stores them; the
    scoring cache keeps only the window again (:func:`score` fills each layer through its ``update()``).
    ``layer_meta`` is not used (kept for callers)."""
    return capture_kv(lm, ids, source)


def score(lm, tensors: dict, feed: list[int]):
    """float64 log-probabilities ``[len(feed), vocab]`` of the model fed ``feed`` on a fresh cache of ``tensors``."""
    from kvz.integrations.hf.bridge import cache_from_kv

    return log_softmax64(forward_logits(lm, cache_from_kv(lm, tensors), feed))


def continuation(lm, tensors: dict, first: int, n: int = GREEDY_TOKENS, stop_at=None) -> list[int]:
    """The ``n`` greedy tokens after feeding ``first`` (the document's next token) on a fresh cache of ``tensors``;
    with ``stop_at`` (the exact cache's continuation) it stops at the first token that differs."""
    from kvz.integrations.hf.bridge import cache_from_kv

    return greedy(lm, cache_from_kv(lm, tensors), int(first), n, stop_at=stop_at)


def reference(ref_lp, targets) -> dict:
    """What :func:`compare` needs of the exact cache's log-probs, computed once per prompt."""
    import torch

    tgt = torch.as_tensor(targets, dtype=torch.long)[:, None]
    return {"lp": ref_lp, "p": ref_lp.exp(), "top": ref_lp.argmax(-1), "tgt": tgt,
            "nll": float(-ref_lp.gather(1, tgt).mean())}


def compare(ref, lp, targets=None) -> dict:
    """Per-prompt metrics of restored log-probs ``lp`` against the reference (:func:`reference`, or the reference's
    log-probs and ``targets``); see the module docstring."""
    if not isinstance(ref, dict):
        ref = reference(ref, targets)
    kl = (ref["p"] * (ref["lp"] - lp)).sum(-1).clamp_min(0.0)
    nll = float(-lp.gather(1, ref["tgt"]).mean())
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float((lp.argmax(-1) == ref["top"]).double().mean()),
            "nll_ref": ref["nll"], "nll": nll, "ppl_rel_change": math.expm1(nll - ref["nll"])}


def calibration_caches(model, tokenizer, context: int, n: int = 4) -> list[KV]:
    """K/V of ``n`` windows of the calibration texts (the bank's own calibration set), for calibrated baselines."""
    docs = documents("calib")
    per = max(1, math.ceil(n / len(docs)))
    ws = windows(docs, per, context, 1, tokenizer, split="calib")
    ws = sorted(ws, key=lambda w: (w["index"], w["doc"]))[:n]
    meta = layer_meta_of(model)
    return [capture(model, w["token_ids"][:context], w["source"], meta) for w in ws]


# ============================================================================ the benchmark

def run_rate_quality(settings: dict, prompts: list[dict], *, context: int, score_tokens: int, model=None,
                     progress: bool = True, done_rows=(), on_row: Callable | None = None) -> dict:
    """Score every setting on every prompt window (:func:`windows`); returns ``{"rows", "prompts", "timing"}``.

    ``model``: a causal LM (default: Gemma 3 270M).  ``done_rows``: rows of an earlier run to keep (resume);
    ``on_row(rows)`` is called after every prompt."""
    import torch

    t_start = time.perf_counter()
    if model is None:
        model = load_model()[0]
    meta = layer_meta_of(model)
    rows = list(done_rows)
    done = {(r["doc"], r["start"], r["method"], r["setting"]) for r in rows}
    prompt_meta = []
    timing: dict[str, float] = {}

    def log(msg):
        if progress:
            print(msg, file=sys.stderr, flush=True)

    with torch.inference_mode():
        for pi, pr in enumerate(prompts):
            todo = {n: s for n, s in settings.items()
                    if (pr["doc"], pr["start"], s.curve, s.label) not in done}
            if not todo:
                continue
            ids = [int(t) for t in pr["token_ids"]]
            ctx_ids, feed = ids[:context], ids[context:context + score_tokens]
            targets = ids[context + 1:context + score_tokens + 1]
            t0 = time.perf_counter()
            kv = capture(model, ctx_ids, pr.get("source", "prompt"), meta)
            ref_lp = score(model, kv.fp32, feed)
            ref = reference(ref_lp, targets)
            ref_greedy = continuation(model, kv.fp32, feed[0])
            t_ref = time.perf_counter() - t0
            pm = {k: v for k, v in pr.items() if k != "token_ids"}
            pm["seconds_reference"] = round(t_ref, 3)
            if pi == 0:  # the injected exact cache must reproduce the live prefill cache
                live = prefill(model, ctx_ids)
                live_lp = log_softmax64(forward_logits(model, live, feed))
                pm["inject_check_max_abs_logprob"] = float((live_lp - ref_lp).abs().max())
                del live, live_lp
            prompt_meta.append(pm)
            del ref_lp
            msg = []
            for name, s in todo.items():
                ts = time.perf_counter()
                rec = s(kv)
                t_restore = time.perf_counter() - ts
                info = dict(s.info)
                nr_pool, nr_max = kv_nrmse(kv, rec)
                m = compare(ref, score(model, rec, feed))
                g = continuation(model, rec, feed[0], stop_at=ref_greedy)
                m["greedy_identical"] = float(g == ref_greedy)
                row = {"method": s.curve, "setting": s.label, "doc": pr["doc"], "prompt": pr["index"],
                       "start": pr["start"], "bpv": float(info["bpv"]), **m, "nrmse_pooled": nr_pool,
                       "nrmse_max": nr_max, "eps": s.eps, "restore_s": t_restore,
                       "seconds": time.perf_counter() - ts}
                for k in ("knob", "meta_bpv", "kvz_nrmse_pooled", "kvz_nrmse_max"):
                    if k in info:
                        row[k] = info[k]
                rows.append(row)
                timing[s.curve] = timing.get(s.curve, 0.0) + row["seconds"]
                msg.append(f"{name}: {row['bpv']:.2f} bpv KL {row['kl_mean']:.2e}")
                del rec
            log(f"[rate-quality] prompt {pi + 1}/{len(prompts)} {pr['doc']}@{pr['start']} "
                f"(ref {t_ref:.1f}s, {time.perf_counter() - t0:.0f}s): " + "; ".join(msg))
            if on_row is not None:
                on_row(rows, prompt_meta)
    return {"rows": rows, "prompts": prompt_meta,
            "timing": {"per_method_s": timing, "total_s": time.perf_counter() - t_start}}


# ============================================================================ entry points

def run(preset_name: str = "quick", *, bank="gemma-3-270m", json_out=None, plot_out=None, md_out=None,
        methods=None, kvz_eps=None, docs=None, per_doc=None, context=None, score_tokens=None, resume=False,
        command: str = "", progress: bool = True, model=None, tokenizer=None,
        model_name: str = "gemma-3-270m") -> dict:
    """Run a preset (optionally overridden) and write JSON / Markdown / PNG; returns the results dict."""
    from alignpred.bank import resolve_bank

    preset = dict(PRESETS[preset_name])
    for k, v in (("docs", docs), ("per_doc", per_doc), ("context", context), ("score_tokens", score_tokens)):
        if v is not None:
            preset[k] = v
    if isinstance(bank, (str, os.PathLike)):
        bank = resolve_bank(str(bank))
    if model is None:
        model, tokenizer = load_model()
    ps = windows(documents("eval", preset["docs"]), preset["per_doc"], preset["context"], preset["score_tokens"],
                 tokenizer)
    settings = build_settings(preset, bank, methods=methods, kvz_eps=kvz_eps)
    cfg = {"preset": preset_name, "docs": list(d for d, _ in documents("eval", preset["docs"])),
           "per_doc": preset["per_doc"], "context": preset["context"], "score_tokens": preset["score_tokens"],
           "greedy_tokens": GREEDY_TOKENS,
           "bank": getattr(bank, "id", None), "settings": {n: {**s.describe(), "method": s.curve, "setting": s.label}
                                              for n, s in settings.items()},
           "kvz_variants": {k: {kk: (vv if isinstance(vv, (str, int, float)) else repr(vv)) for kk, vv in v.items()}
                            for k, v in KVZ_VARIANTS.items()},
           "command": command, "kv_dtype": "bfloat16", "reference": "float32 K/V of the same prefill"}
    json_out = Path(json_out) if json_out else None
    partial = json_out.with_name(json_out.stem + ".partial.json") if json_out else None
    done = []
    if resume and json_out is not None and (partial.exists() or json_out.exists()):
        # an interrupted run (.partial.json), or a finished one extended with more settings (new eps, new methods)
        prev = json.loads((partial if partial.exists() else json_out).read_text())
        done = prev.get("rows", [])
        pc = prev.get("config", {})
        cfg["previous_commands"] = pc.get("previous_commands", []) + [pc.get("command", "")]
        if "total_s" in prev.get("timing", {}):
            cfg["previous_total_s"] = pc.get("previous_total_s", 0.0) + prev["timing"]["total_s"]
        keys = {(s.curve, s.label) for s in settings.values()}
        done = [r for r in done if (r["method"], r["setting"]) in keys]
    if needs_calib(settings):  # calibrated coders get caches of the calibration texts (never the held-out ones)
        calib = calibration_caches(model, tokenizer, preset["context"])
        settings = build_settings(preset, bank, methods=methods, kvz_eps=kvz_eps, calib=calib)

    def checkpoint(rows, prompt_meta):
        if partial is not None:
            write_json({"config": cfg, "rows": rows, "prompts": prompt_meta}, partial)

    t0 = time.perf_counter()
    r = run_rate_quality(settings, ps, context=preset["context"], score_tokens=preset["score_tokens"], model=model,
                         progress=progress, done_rows=done, on_row=checkpoint)
    res = {"model": model_name, "config": cfg, "rows": r["rows"], "prompts": r["prompts"], "timing": r["timing"]}
    res["timing"]["wall_s"] = time.perf_counter() - t0
    res["aggregate"] = aggregate(res["rows"])
    if json_out is not None:
        write_json(res, json_out)
        if partial is not None and partial.exists():
            partial.unlink()
    md_out = md_out or (json_out.with_suffix(".md") if json_out is not None else None)
    if md_out is not None:
        write_text(md_out, format_report(res))
    if plot_out is not None:
        plot(res, plot_out)
    return res


def finalize(json_out, plot_out=None, md_out=None) -> dict:
    """Results of an interrupted run: aggregate the rows of ``<json>.partial.json`` (prompts that every setting
    completed) and write the JSON, Markdown and plot as a finished run would; the partial file is kept."""
    json_out = Path(json_out)
    partial = json_out.with_name(json_out.stem + ".partial.json")
    src = json.loads(partial.read_text())
    res = {"model": src.get("model", "gemma-3-270m"), "config": dict(src["config"], interrupted=True),
           "rows": src["rows"], "prompts": src.get("prompts", []), "timing": {}}
    res["aggregate"] = aggregate(res["rows"])
    write_json(res, json_out)
    write_text(md_out or json_out.with_suffix(".md"), format_report(res))
    if plot_out is not None:
        plot(res, plot_out)
    return res


def _parse_kvz(items) -> dict:
    out = {}
    for it in items or ():
        name, _, eps = it.partition(":")
        if name not in KVZ_VARIANTS:
            raise SystemExit(f"--kvz {it}: unknown variant {name!r} (have {', '.join(KVZ_VARIANTS)})")
        out[name] = tuple(float(e) for e in eps.split(",") if e.strip())
    return out


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m kvz.benchmarks.rate_quality", quiet=True)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="2 documents x 1 prompt, 32 scored tokens, few rates")
    g.add_argument("--full", action="store_true", help="4 documents x 6 prompts, 64 scored tokens, every rate")
    g.add_argument("--long", action="store_true", help="4 documents x 2 prompts, 1,024-token contexts, the kvz "
                   "scopes against FP8")
    ap.add_argument("--json", required=True, help="output JSON (a Markdown report is written beside it)")
    ap.add_argument("--plot", help="output PNG (bpv vs KL per method)")
    ap.add_argument("--md", help="Markdown report path (default: the JSON's with .md)")
    ap.add_argument("--bank", default="gemma-3-270m", help="kvz bank (path, id or registry name)")
    ap.add_argument("--methods", help="comma-separated method (curve) or registry names to run (default: all)")
    ap.add_argument("--kvz", action="append", metavar="VARIANT:EPS,EPS", help="override a kvz variant's eps sweep")
    ap.add_argument("--docs", help="comma-separated held-out document names, or 'all'")
    ap.add_argument("--per-doc", type=int)
    ap.add_argument("--context", type=int, help="cached context tokens (BOS included)")
    ap.add_argument("--score-tokens", type=int, help="teacher-forced tokens scored after the context")
    ap.add_argument("--resume", action="store_true", help="continue from the JSON's .partial.json, or "
                    "extend a finished JSON with settings it lacks (rows it has are kept, not re-measured)")
    ap.add_argument("--finalize", action="store_true", help="no new measurements: aggregate the rows of the JSON's "
                    ".partial.json (an interrupted run; only prompts every setting completed) into JSON/MD/PNG")
    a = ap.parse_args(argv)
    preset = "full" if a.full else "long" if a.long else "quick"
    docs = None
    if a.docs:
        docs = "all" if a.docs == "all" else tuple(d.strip() for d in a.docs.split(",") if d.strip())
    cmd = "python -m kvz.benchmarks.rate_quality " + " ".join(sys.argv[1:] if argv is None else argv)
    if a.finalize:
        res = finalize(a.json, plot_out=a.plot, md_out=a.md)
        print("\n".join(verdict(res["aggregate"])) or "(no FP8 reference in this run)")
        print(f"{a.json}: {len(res['rows'])} rows ({res['aggregate']['n_prompts']} complete prompts)")
        return 0
    res = run(preset, bank=a.bank, json_out=a.json, plot_out=a.plot, md_out=a.md,
              methods=[m.strip() for m in a.methods.split(",")] if a.methods else None, kvz_eps=_parse_kvz(a.kvz),
              docs=docs, per_doc=a.per_doc, context=a.context, score_tokens=a.score_tokens, resume=a.resume,
              command=cmd, progress=not a.quiet)
    print("\n".join(verdict(res["aggregate"])) or "(no FP8 reference in this run)")
    print(f"{a.json}: {len(res['rows'])} rows; {res['timing']['total_s'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
