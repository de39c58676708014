"""Rate-quality: bits per value against downstream quality, for kvz and the field's KV codecs, on the same caches.

The field compares KV codecs by downstream quality at a bit budget, not by NRMSE.  This benchmark measures, for
every method at each of its rates, the bits per value (bpv) it spends and what the model loses, teacher-forced on
held-out text, and reports each method's bpv at FP8 e4m3's quality and at twice FP8's KL.

**Protocol** (per prompt window of a held-out document; Gemma 3 270M by default):

1. ``context`` tokens (BOS + document tokens) are prefilled; the model's float32 K/V of every layer (keys post-RoPE,
   as the model stores them) is captured.  Methods receive it at the stored precision, bfloat16 (a
   :class:`~kvz.benchmarks.quality.KV` with ``.fp32`` and ``.metadata``), compress and restore it.
2. The next ``score_tokens`` *document* tokens ``x_C .. x_{C+N-1}`` are fed in one pass on top of a fresh model
   cache holding (a) the exact float32 K/V (the reference) and (b) each method's restored K/V, injected through
   each layer's own ``update()`` (:func:`kvz.benchmarks.quality.inject`; sliding layers keep what a real prefill
   keeps).  The logits at those N positions predict ``x_{C+1} .. x_{C+N}``.
3. Metrics per prompt (log-softmax and KL in float64):

   * ``kl_mean``: mean over the N positions of KL(p_full || p_restored) of the next-token distribution;
   * ``top1``: fraction of positions where the restored argmax equals the reference argmax;
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
  KVQuant-style (``kvquant*``, self-contained and calibrated), KVTC and SZ3 at a few error levels (knobs chosen by
  the coders' own search for the target NRMSE); calibrated coders get caches of the *calibration* texts
  (``samples/gemma3-270m/calib_texts``), never the held-out ones; ``bf16`` (the storage precision, 16 bpv) is the
  floor.

Run::

    python -m kvz.benchmarks.rate_quality --quick --json out/rq.json --plot out/rq.png
    python -m kvz.benchmarks.rate_quality --full --json benchmarks/results/rate_quality.json \\
        --plot benchmarks/results/rate_quality.png          # 4 documents x 6 prompts; writes a .md beside the JSON

``--resume`` continues an interrupted run from its ``.partial.json``.  ``kvz bench --quality`` runs the same
benchmark (``--quick`` preset with ``kvz bench --quick``) into the bench output folder.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from kvz.benchmarks import quality as Q

ROOT = Q.ROOT
FP8 = "fp8_e4m3"
REFERENCE_METHOD = "fp8"

# Documents of the full run: the kinds of the issue (licence text, Python source, JSON, a Japanese man page), all
# held out from the bank's calibration texts.  ``--docs all`` takes every held-out document.
FULL_DOCS = ("licence-text", "python-code", "json-records", "japanese-manpage")
QUICK_DOCS = ("python-code", "json-records")

# kvz curves: name -> alignpred.compress keywords (scope, tensor_cap, config, ...) or {"fn": callable(kv, eps) ->
# (restored, bits)}.  One line adds a variant; its eps sweep comes from PRESETS (key "*" when not listed).
KVZ_VARIANTS: dict[str, dict] = {
    "kvz-tensor": dict(scope="tensor"),
    "kvz-pooled-cap3": dict(scope="pooled", tensor_cap=3.0),
    "kvz-pooled-nocap": dict(scope="pooled", tensor_cap=0.0),
    # error where the model is sensitive: per-tensor weights from the bank's sensitivity record
    # (measured on the calibration texts by benchmarks/sensitivity.py), tensor cap 3
    "kvz-weighted": dict(scope="weighted", tensor_cap=3.0),
}

PRESETS = {
    "quick": dict(docs=QUICK_DOCS, per_doc=1, context=256, score_tokens=32,
                  kvz_eps={"kvz-tensor": (0.0134, 0.0267, 0.0534), "*": (0.0267, 0.0534)},
                  error_eps=(0.0267,),
                  baselines=("fp8_e4m3", "bf16", "turboquant_mse_3", "turboquant_mse_4", "turboquant_prod_4",
                             "kivi2_r128", "kivi4_r128", "kvquant3_calib", "kvtc", "sz3")),
    # sized for < 60 min on 2 shared (and busy) cores: 24 prompts x 23 settings x 32 scored tokens (each scored
    # token costs a 262k-vocabulary softmax); --score-tokens 64 and more rates when there is CPU to spare
    "full": dict(docs=FULL_DOCS, per_doc=6, context=256, score_tokens=32,
                 kvz_eps={"kvz-tensor": (0.0188, 0.0267, 0.0376, 0.0534),
                          "kvz-pooled-cap3": (0.0188, 0.0267, 0.0376),
                          "kvz-pooled-nocap": (0.0188, 0.0376),
                          "*": (0.0188, 0.0267, 0.0376)},
                 error_eps=(0.0188, 0.0376),
                 baselines=("fp8_e4m3", "turboquant_mse_3", "turboquant_mse_4", "turboquant_mse@6",
                            "turboquant_prod_4", "turboquant_prod@6", "kivi2_r128", "kivi4_r128", "kvquant3_calib",
                            "kvquant4_calib", "kvtc", "sz3")),
}
# ``name@knob`` in a preset's baselines runs a searchable coder at a fixed knob (e.g. turboquant_mse@6: 6 bits, to
# extend its curve past the fixed-rate points).


# ============================================================================ interpolation (pure)

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


# ============================================================================ settings

def _label_num(x: float) -> str:
    return f"{x:g}"


def add_kvz_variant(name: str, **spec) -> None:
    """Register a kvz curve: ``alignpred.compress`` keywords, or ``fn=callable(kv, eps) -> (restored, bits)``."""
    KVZ_VARIANTS[name] = dict(spec)


def kvz_variant_setting(name: str, eps: float, bank, spec: dict | None = None) -> Q.Setting:
    """One kvz point: :func:`kvz.benchmarks.quality.kvz_setting` with the variant's keywords, or its ``fn``."""
    spec = dict(KVZ_VARIANTS[name] if spec is None else spec)
    fn = spec.pop("fn", None)
    if fn is None:
        s = Q.kvz_setting(bank, eps, **spec)
    else:
        def run(kv, info, fn=fn):
            rec, bits = fn(kv, eps)
            info["bpv"] = float(bits) / sum(x.size for x in kv.values())
            return {k: np.asarray(v) for k, v in rec.items()}

        s = Q.Setting(run, "kvz", eps=eps, **{k: v for k, v in spec.items() if isinstance(v, (str, int, float))})
    s.curve = name
    s.label = f"eps={_label_num(eps)}"
    return s


def _codec_points(name: str):
    """(curve, label) of a registered baseline at its natural setting, or None for those run at error levels."""
    m = re.fullmatch(r"turboquant_(mse|prod)_(\d+)(?:p(\d+))?", name)
    if m:
        rate = float(m.group(2) + ("." + m.group(3) if m.group(3) else ""))
        return f"turboquant_{m.group(1)}", f"{rate:g} bit"
    m = re.fullmatch(r"kivi(\d+)_r(\d+)", name)
    if m:
        return f"kivi_r{m.group(2)}", f"{m.group(1)} bit"
    m = re.fullmatch(r"kivi_int(\d+)", name)
    if m:
        return "kivi", f"{m.group(1)} bit g32"
    m = re.fullmatch(r"kvquant(\d+)(_calib)?", name)
    if m:
        return f"kvquant{m.group(2) or ''}", f"{m.group(1)} bit"
    if name == FP8:
        return REFERENCE_METHOD, "e4m3"
    if name == "bf16":
        return "bf16", "bf16"
    return None


ERROR_LEVEL_CODECS = {"kvtc": "pooled", "sz3": "tensor"}  # searched to a target NRMSE (alloc used for the search)


def baseline_specs(names=None, error_eps=(0.0267,)) -> list[dict]:
    """The baseline points to run: ``{"name", "curve", "label", "eps", "alloc"}`` for every registered baseline that
    imports here (``names``: a subset by registry name; None: all field baselines)."""
    import kvz.benchmarks.baselines as B

    avail = set(B.available())
    if names is None:
        names = [n for n in B.BASELINES if _codec_points(n) is not None and n not in ("kivi_int8",)]
        names += [n for n in ERROR_LEVEL_CODECS if n in B.BASELINES]
    out = []
    for item in names:
        n, _, knob = item.partition("@")
        if n not in B.BASELINES or n not in avail:
            continue
        if knob:
            k = float(knob)
            label = f"{k:g} bit" if n.startswith("turboquant") else f"{B.BASELINES[n].knob_name}={k:g}"
            out.append({"name": n, "curve": n, "label": label, "eps": None, "alloc": None, "knob": k})
            continue
        if n in ERROR_LEVEL_CODECS:
            for e in error_eps:
                out.append({"name": n, "curve": n, "label": f"eps={_label_num(e)}", "eps": e,
                            "alloc": ERROR_LEVEL_CODECS[n]})
            continue
        cp = _codec_points(n)
        if cp is None:
            continue
        out.append({"name": n, "curve": cp[0], "label": cp[1], "eps": None, "alloc": None})
    return out


def baseline_setting(spec: dict, calib: list | None = None) -> Q.Setting:
    """A registered baseline coder as a restore callable: its natural knob (fixed-rate coders, KIVI's group 32,
    KVQuant's 1 % outliers) or, with ``spec["eps"]``, the knobs its own search picks for that NRMSE under
    ``spec["alloc"]``; each tensor is then encoded and decoded, and every bit it reports is counted."""
    import kvz.benchmarks.baselines as B
    from kvz.benchmarks.baselines._core import cast_back, run_codec

    codec = B.BASELINES[spec["name"]]

    chosen: dict = {}

    def fn(kv, info):
        cal = calib if codec.uses_calib else None
        if codec.uses_calib and not cal:
            raise ValueError(f"{codec.name} needs calibration caches")
        if spec.get("knob") is not None:
            knobs = {k: spec["knob"] for k in kv}
        elif spec.get("eps") is not None and codec.knob_kind != "none":
            if "knob" in chosen:  # a pooled search gives one knob: searched on the first prompt, then kept fixed
                knobs = {k: chosen["knob"] for k in kv}
            else:
                r = run_codec(codec, kv, spec["eps"], spec.get("alloc") or "tensor", cal)
                knobs = r.extra["knobs"]
                if spec.get("alloc") == "pooled" and spec.get("fix_knob", True):
                    chosen["knob"] = next(iter(knobs.values()))
        else:
            knobs = {k: getattr(codec, "default_knob", None) for k in kv}
        ctx = codec.prepare(kv, cal)
        out, bits, meta = {}, 0, 0
        for k, x in kv.items():
            enc = codec.encode(k, x, knobs[k], ctx)
            out[k] = Q._to_bf16(cast_back(codec.decode(k, enc, x.shape, ctx), np.float32))
            bits += enc.bits
            meta += enc.meta_bits
        info["bpv"] = bits / sum(x.size for x in kv.values())
        info["meta_bpv"] = meta / sum(x.size for x in kv.values())
        kn = sorted({str(v) for v in knobs.values()})
        info["knob"] = kn[0] if len(kn) == 1 else f"{len(kn)} values"
        return out

    s = Q.Setting(fn, spec["curve"], eps=spec.get("eps"), codec=spec["name"])
    s.curve, s.label = spec["curve"], spec["label"]
    return s


def bf16_setting() -> Q.Setting:
    s = Q.identity_setting("bf16")
    s.curve, s.label = "bf16", "bf16"
    return s


def build_settings(preset: dict, bank, *, methods=None, kvz_eps=None, calib=None) -> dict[str, Q.Setting]:
    """``{"curve | label": Setting}`` for a preset (``methods``: curve names or registry names to keep)."""
    settings: dict[str, Q.Setting] = {}
    keep = None if not methods else set(methods)

    def want(*names):
        return keep is None or any(n in keep for n in names)

    eps_map = dict(preset["kvz_eps"])
    eps_map.update(kvz_eps or {})
    for name in KVZ_VARIANTS:
        if not want(name, "kvz"):
            continue
        for e in eps_map.get(name, eps_map.get("*", ())):
            s = kvz_variant_setting(name, e, bank)
            settings[f"{name} | {s.label}"] = s
    for spec in baseline_specs(preset.get("baselines"), preset.get("error_eps", (0.0267,))):
        if not want(spec["curve"], spec["name"]):
            continue
        if spec["name"] == "bf16" and spec.get("knob") is None:
            s = bf16_setting()
        else:
            s = baseline_setting(spec, calib)
        settings[f"{spec['curve']} | {spec['label']}"] = s
    return settings


def needs_calib(settings) -> bool:
    import kvz.benchmarks.baselines as B

    return any(getattr(B.BASELINES.get(s.desc.get("codec", "")), "uses_calib", False) for s in settings.values())


# ============================================================================ prompts

def _tok_ids(tokenizer, text: str) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids[1:] if ids and bos is not None and ids[0] == bos else ids


def documents(split: str = "eval", names=None) -> list[tuple[str, Path]]:
    """``[(name, path)]`` of the held-out (``"eval"``: samples/texts, samples/texts/eval) or calibration
    (``"calib"``) texts; ``names`` selects and orders them (stems; ``None`` or ``"all"``: every one)."""
    files = {p.stem: p for _, p in Q._text_files(split)}
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
    if context < 2 or context > Q.MAX_PROMPT_TOKENS:
        raise ValueError(f"context must be in 2..{Q.MAX_PROMPT_TOKENS} (Gemma 3's sliding layers keep 511 "
                         "positions; the exact-cache injection is checked below that)")
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

def _layer_meta(model):
    from kvz.integrations.hf.gemma import layer_info

    return layer_info(Q._text_config(model))


def capture(model, ids: list[int], source: str = "prompt", layer_meta=None) -> Q.KV:
    """Prefill ``ids`` and return the cache as a :class:`~kvz.benchmarks.quality.KV` (bf16, with ``.fp32`` and
    kvz-cache ``.metadata``)."""
    from kvz.integrations.hf.gemma import cache_metadata

    cfg = Q._text_config(model)
    types, thetas = layer_meta or _layer_meta(model)
    live = Q._prefill(model, ids)
    fp32 = Q._extract(live, cfg.num_hidden_layers)
    meta = cache_metadata(types, thetas, ids, source)
    return Q.KV({k: v.astype(Q._bf16()) for k, v in fp32.items()}, fp32=fp32, metadata=meta)


def score(model, tensors: dict, feed: list[int]):
    """float64 log-probabilities ``[len(feed), vocab]`` of the model fed ``feed`` on a fresh cache of ``tensors``."""
    return Q._log_softmax64(Q._forward_logits(model, Q.inject(model, tensors), feed))


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


def calibration_caches(model, tokenizer, context: int, n: int = 4) -> list[Q.KV]:
    """K/V of ``n`` windows of the calibration texts (the bank's own calibration set), for calibrated baselines."""
    docs = documents("calib")
    per = max(1, math.ceil(n / len(docs)))
    ws = windows(docs, per, context, 1, tokenizer, split="calib")
    ws = sorted(ws, key=lambda w: (w["index"], w["doc"]))[:n]
    lm = _layer_meta(model)
    return [capture(model, w["token_ids"][:context], w["source"], lm) for w in ws]


# ============================================================================ the benchmark

def run_rate_quality(settings: dict, prompts: list[dict], *, context: int, score_tokens: int, model=None,
                     progress: bool = True, done_rows=(), on_row: Callable | None = None) -> dict:
    """Score every setting on every prompt window (:func:`windows`); returns ``{"rows", "prompts", "timing"}``.

    ``model``: a causal LM (default: Gemma 3 270M).  ``done_rows``: rows of an earlier run to keep (resume);
    ``on_row(rows)`` is called after every prompt."""
    import torch

    t_start = time.perf_counter()
    if model is None:
        model = Q._model()[0]
    lm = _layer_meta(model)
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
            kv = capture(model, ctx_ids, pr.get("source", "prompt"), lm)
            ref_lp = score(model, kv.fp32, feed)
            ref = reference(ref_lp, targets)
            t_ref = time.perf_counter() - t0
            pm = {k: v for k, v in pr.items() if k != "token_ids"}
            pm["seconds_reference"] = round(t_ref, 3)
            if pi == 0:  # the injected exact cache must reproduce the live prefill cache
                live = Q._prefill(model, ctx_ids)
                live_lp = Q._log_softmax64(Q._forward_logits(model, live, feed))
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
                nr_pool, nr_max = Q._nrmse(kv, rec)
                m = compare(ref, score(model, rec, feed))
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
            "nrmse_max": float(np.max([r["nrmse_max"] for r in rows]))}


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

def _fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _at_cell(e: dict) -> str:
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
                             f"range ({e['status']}, bound {_fmt(e['bound'])} bpv)")
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
    agg = res["aggregate"]
    cfg = res["config"]
    out = [f"# Rate-quality: bits per value against downstream quality ({res['model']})", "",
           f"{agg['n_prompts']} prompts ({', '.join(agg['docs'])}; {cfg['per_doc']} per document), "
           f"{cfg['context']}-token context (bf16 K/V compressed and restored), {cfg['score_tokens']} teacher-forced "
           f"document tokens scored against the exact cache. KL = mean next-token KL(full || restored); top-1 = "
           f"argmax agreement; ppl = relative perplexity change on the true next tokens. Every number is measured "
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
                cells += [_at_cell(e["fp8_kl"]), _at_cell(e["2x_fp8_kl"])] if e else ["-", "-"]
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        out += ["", "**Verdict (overall):**", ""] + verdict(agg) + [""]
    out += ["## Measured points (all prompts)", "",
            "| method | setting | bpv | mean KL | top-1 | ppl change | NRMSE pooled | NRMSE max |",
            "|---|---|---|---|---|---|---|---|"]
    for m in sorted(agg["curves"], key=lambda m: (not m.startswith("kvz"), m)):
        for p in agg["curves"][m]["overall"]:
            out.append(f"| {m} | {p['setting']} | {p['bpv']:.3f} | {p['kl_mean']:.2e} | {100 * p['top1']:.1f}% | "
                       f"{100 * p['ppl_rel_change']:+.2f}% | {p['nrmse_pooled']:.4f} | {p['nrmse_max']:.4f} |")
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
        out.append(f"Wall time {tot / 60:.1f} min on 2 shared CPU cores (Gemma 3 270M, float32, one thread).")
    return "\n".join(out) + "\n"


def plot(res: dict, path) -> None:
    """bpv vs mean KL per method (log KL), overall and per document; FP8's KL and 2x as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ entry points

def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.bool_):
        return bool(o)
    raise TypeError(type(o))


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default))
    os.replace(tmp, path)


def run(preset_name: str = "quick", *, bank="gemma-3-270m", json_out=None, plot_out=None, md_out=None,
        methods=None, kvz_eps=None, docs=None, per_doc=None, context=None, score_tokens=None, resume=False,
        command: str = "", progress: bool = True, model=None, tokenizer=None,
        model_name: str = "gemma-3-270m") -> dict:
    """Run a preset (optionally overridden) and write JSON / Markdown / PNG; returns the results dict."""
    from alignpred import Bank

    preset = dict(PRESETS[preset_name])
    for k, v in (("docs", docs), ("per_doc", per_doc), ("context", context), ("score_tokens", score_tokens)):
        if v is not None:
            preset[k] = v
    if isinstance(bank, (str, os.PathLike)):
        from alignpred.bank.registry import find

        bank = Bank.load(bank) if os.path.exists(str(bank)) else find(str(bank))
    if model is None:
        model, tokenizer = Q._model()
    ps = windows(documents("eval", preset["docs"]), preset["per_doc"], preset["context"], preset["score_tokens"],
                 tokenizer)
    settings = build_settings(preset, bank, methods=methods, kvz_eps=kvz_eps)
    cfg = {"preset": preset_name, "docs": list(d for d, _ in documents("eval", preset["docs"])),
           "per_doc": preset["per_doc"], "context": preset["context"], "score_tokens": preset["score_tokens"],
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
            _write_json(partial, {"config": cfg, "rows": rows, "prompts": prompt_meta})

    t0 = time.perf_counter()
    r = run_rate_quality(settings, ps, context=preset["context"], score_tokens=preset["score_tokens"], model=model,
                         progress=progress, done_rows=done, on_row=checkpoint)
    res = {"model": model_name, "config": cfg, "rows": r["rows"], "prompts": r["prompts"], "timing": r["timing"]}
    res["timing"]["wall_s"] = time.perf_counter() - t0
    res["aggregate"] = aggregate(res["rows"])
    if json_out is not None:
        _write_json(json_out, res)
        if partial is not None and partial.exists():
            partial.unlink()
    md_out = md_out or (json_out.with_suffix(".md") if json_out is not None else None)
    if md_out is not None:
        Path(md_out).write_text(format_report(res))
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
    _write_json(json_out, res)
    Path(md_out or json_out.with_suffix(".md")).write_text(format_report(res))
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
    ap = argparse.ArgumentParser(prog="python -m kvz.benchmarks.rate_quality", description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="2 documents x 1 prompt, 32 scored tokens, few rates")
    g.add_argument("--full", action="store_true", help="4 documents x 6 prompts, 64 scored tokens, every rate")
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
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    preset = "full" if a.full else "quick"
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
