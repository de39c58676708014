"""Lossless serving from compressed KV (VeriCache) on Gemma 3 270M: draft on a compressed cache,
verify on the full K/V paged in by the pager, and check every output against full-KV greedy decoding.

For each prompt (a window of real text, BOS first; :func:`kvz.benchmarks.quality.default_prompts`)
the model prefills ``prompt[:-1]``; its K/V, stored at bfloat16, is *the full cache* (the verifier
pages it in through :class:`~kvz.integrations.pager.KvPager`: from the exact tier of a two-tier
.kvz when the codec has tiers, otherwise from the raw cache). The reference is plain full-KV greedy
decoding from that cache (:func:`~kvz.integrations.verify.greedy_reference`: feed ``prompt[-1]``,
then one token at a time). Drafters:

* ``kvz`` - the cache compressed at ``eps`` (relative error 3/10/20%) and decoded (the coarse tier);
* ``window`` - sinks + most recent positions, ``keep`` of the context (StreamingLLM-style);
* ``snapkv`` - per layer, the positions the last 16 context tokens attend to most (SnapKV-style).

Per setting (drafter x draft length ``x``) the rows report ``identical_frac`` (outputs equal to
the reference, token for token; must be 1.0), ``mean_accept_len`` (tokens emitted per verify
round - accepted drafts plus the correction or bonus - over rounds that drafted ``x``),
``acceptance_rate``, bytes paged per generated token, resident bytes of the draft cache versus
the full cache, and wall time versus full-KV decoding (CPU float32: the drafter is the same model
at the same cost per token, so there is no speed-up to expect here - see the simulation).

Then the scheduling simulation (:mod:`kvz.integrations.pager.schedule`) runs ``B`` concurrent requests
on the seed's hardware scenarios with the measured acceptance, staggered versus lock-step.

Run::

    python -m benchmarks.studies.serving.verify --quick --json benchmarks/results/verify-quick.json
    python -m benchmarks.studies.serving.verify --json benchmarks/results/verify.json --md benchmarks/results/verify.md
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from kvz.benchmarks.harness import parser, pyplot, save_figure, write_json, write_text

BANK = "gemma-3-270m"

__all__ = ["run", "summarize", "looping", "simulate_rows", "format_markdown", "main", "two_tier_bytes"]


# ============================================================================ caches

def two_tier_bytes(cache, eps: float, bank):
    """A two-tier .kvz of ``cache`` (the coarse tier at ``eps`` + the exact refinement tier:
    ``compress(..., lossless=True)``), or None when the codec has no tiers."""
    from alignpred import ErrorBudget, KvzError, KvzReader, compress_bytes

    try:
        blob = compress_bytes(cache, budget=ErrorBudget(eps=eps, lossless=True), bank=bank)
    except (TypeError, KvzError):
        return None
    return blob if "exact" in tuple(getattr(KvzReader(blob, bank=bank), "tiers", ())) else None


def _context(model, ids):
    """The context's K/V as the full cache: an alignpred Cache at bfloat16 and float32 torch pairs."""
    import torch

    from alignpred import Cache
    from kvz.integrations.hf.capture import cache_metadata, record_kv
    from kvz.integrations.hf.rope import rope_thetas

    tensors, spec, info = record_kv(model, ids, dtype="bfloat16")
    meta = cache_metadata(info["layer_types"], rope_thetas(model, spec), ids, "benchmarks.verify",
                          model="gemma-3-270m", rope=spec)
    cache = Cache.from_arrays(tensors, meta)
    n_layers = cache.layout.num_layers
    ctx_kv = [(torch.from_numpy(np.asarray(cache.tensors[f"layers.{i}.key"], np.float32)),
               torch.from_numpy(np.asarray(cache.tensors[f"layers.{i}.value"], np.float32))) for i in range(n_layers)]
    return cache, ctx_kv


# ============================================================================ the measurement

def _settings(eps_list, xs, drops, drop_xs):
    out = []
    for eps in eps_list:
        for x in xs:
            out.append({"drafter": "kvz", "draft_eps": eps, "keep_frac": None, "x": x, "verify": "batched"})
    for method, frac in drops:
        for x in drop_xs:
            out.append({"drafter": method, "draft_eps": None, "keep_frac": frac, "x": x, "verify": "batched"})
    return out


def _name(s) -> str:
    base = f"kvz eps={s['draft_eps']:g}" if s["drafter"] == "kvz" else f"{s['drafter']} keep={s['keep_frac']:g}"
    extra = "" if s["verify"] == "batched" else f" {s['verify']}"
    t = f" T={s['temperature']:g}" if s.get("temperature") else ""
    return f"{base} x={s['x']}{extra}{t}"


def measure(*, n_prompts=20, prompt_tokens=256, new_tokens=64, xs=(8, 16, 32), eps_list=(0.03, 0.10, 0.20),
        drops=(("window", 0.3), ("snapkv", 0.3)), drop_xs=(16,), stepwise=((0.10, 16),),
        temperatures=((0.7, 0.10, 16),), budget_bytes=256 << 20, workers=2, progress=True,
        checkpoint=None) -> dict:
    """Measure every setting on every prompt; returns ``{"config", "prompts", "per_prompt"}``."""
    import torch

    from kvz.benchmarks.lm import model as load_model
    from kvz.benchmarks.prompts import default_prompts
    from kvz.integrations.pager import ArraySource, KvPager, KvzSource, kv_bytes
    from kvz.integrations.verify import (
        DraftCache,
        PagedFullKV,
        VeriCacheDecoder,
        greedy_reference,
        snapkv_keep,
        window_keep,
    )

    def log(msg):
        if progress:
            print(msg, file=sys.stderr, flush=True)

    t_load = time.perf_counter()
    model, tok = load_model()
    log(f"model loaded in {time.perf_counter() - t_load:.1f}s")
    prompts = default_prompts(n_prompts, prompt_tokens, tokenizer=tok)
    settings = _settings(eps_list, xs, drops, drop_xs)
    for eps, x in stepwise:
        settings.append({"drafter": "kvz", "draft_eps": eps, "keep_frac": None, "x": x, "verify": "stepwise"})
    for temp, eps, x in temperatures:
        settings.append({"drafter": "kvz", "draft_eps": eps, "keep_frac": None, "x": x, "verify": "batched",
                         "temperature": temp})
    pager = KvPager(budget_bytes=budget_bytes, workers=workers)
    tiers_used = None
    per_prompt = []
    for pi, pr in enumerate(prompts):
        ids = [int(t) for t in pr["token_ids"]]
        ctx, first = ids[:-1], ids[-1]
        t0 = time.perf_counter()
        cache, ctx_kv = _context(model, ctx)
        ref, rinfo = greedy_reference(model, ctx_kv, first, new_tokens)
        full_bytes = kv_bytes(cache.layout)
        rec = {"kind": pr["kind"], "source": pr["source"], "start": pr["start"], "n_context": len(ctx),
               "reference": ref, "ref_seconds": rinfo["seconds"], "ref_min_top2_gap": rinfo["min_top2_gap"],
               "full_bytes": full_bytes, "results": {}}
        drafters, sources, blobs = {}, {}, {}
        for s in settings:  # the kvz drafters first: their two-tier files also serve the other verifiers
            key = (s["drafter"], s["draft_eps"], s["keep_frac"])
            if s["drafter"] != "kvz" or key in drafters:
                continue
            blob2 = two_tier_bytes(cache, s["draft_eps"], BANK)
            if blob2 is not None:  # coarse tier drafts, exact tier verifies
                blobs[key] = blob2
                drafters[key] = DraftCache.from_kvz(blob2, tier="coarse")
                sources[key] = ("kvz-exact", lambda b=blob2: KvzSource(b, tier="exact"))
            else:  # no tiers in this codec: a lossy file drafts, the raw cache verifies
                from alignpred import compress_bytes
                drafters[key] = DraftCache.from_kvz(compress_bytes(cache, budget=s["draft_eps"], bank=BANK))
        for s in settings:
            key = (s["drafter"], s["draft_eps"], s["keep_frac"])
            if s["drafter"] == "kvz" or key in drafters:
                continue
            if s["drafter"] == "window":
                drafters[key] = DraftCache.token_dropped(ctx_kv, window_keep(len(ctx), s["keep_frac"]), kind="window")
            elif s["drafter"] == "snapkv":
                drafters[key] = DraftCache.token_dropped(ctx_kv, snapkv_keep(model, ctx, ctx_kv, s["keep_frac"]),
                                                         kind="snapkv")
            else:
                raise ValueError(f"unknown drafter {s['drafter']!r}")
            blob2 = next(iter(blobs.values()), None) or two_tier_bytes(cache, 0.10, BANK)
            if blob2 is not None:
                blobs.setdefault(("exact",), blob2)
                sources[key] = ("kvz-exact", lambda b=blob2: KvzSource(b, tier="exact"))
        for s in settings:
            key = (s["drafter"], s["draft_eps"], s["keep_frac"])
            draft = drafters[key]
            src_kind, make = sources.get(key, ("raw", lambda: ArraySource(cache)))
            tiers_used = tiers_used or src_kind
            pkey = (pi, _name(s))
            pager.add(pkey, make())
            pager.reset_stats()
            full = PagedFullKV(pager, pkey)
            dec = VeriCacheDecoder(model, full, draft, x=s["x"], verify=s["verify"],
                                   temperature=s.get("temperature", 0.0), seed=pi)
            with torch.inference_mode():
                res = dec.generate(first, new_tokens)
            st = pager.stats
            src_bytes = pager.source(pkey).file_bytes
            pager.drop(pkey, close=True)
            rec["results"][_name(s)] = {
                "setting": s, "identical": res.tokens == ref, "tokens": res.tokens,
                "first_mismatch": next((i for i, (a, b) in enumerate(zip(res.tokens, ref)) if a != b), None),
                "rounds": [(r.drafted, r.accepted, r.emitted) for r in res.rounds],
                "seconds": res.seconds, "draft_s": sum(r.draft_s for r in res.rounds),
                "verify_s": sum(r.verify_s for r in res.rounds), "page_s": sum(r.page_s for r in res.rounds),
                "paged_bytes": res.paged_bytes, "min_top2_gap": res.min_top2_gap,
                "draft_resident_bytes": draft.resident_bytes, "draft_dense_bytes": draft.dense_bytes,
                "draft_info": draft.info, "full_source": src_kind, "full_source_bytes": src_bytes,
                "pager": {k: st[k] for k in ("objects_decoded", "pages_decoded", "page_hits", "direct_pages",
                                             "evictions", "peak_bytes", "bytes_out")}}
            r = rec["results"][_name(s)]
            log(f"[{pi + 1}/{len(prompts)} {pr['kind']}] {_name(s):28s} identical={r['identical']} "
                f"accept/round={res.mean_accept_len:.2f} {res.seconds:.1f}s (ref {rinfo['seconds']:.1f}s)")
        rec["seconds"] = time.perf_counter() - t0
        per_prompt.append(rec)
        if checkpoint:
            write_json({"config": None, "per_prompt": per_prompt, "partial": True}, checkpoint)
    pager.close()
    config = {"n_prompts": len(prompts), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "xs": list(xs),
              "eps": list(eps_list), "drops": [list(d) for d in drops], "drop_xs": list(drop_xs),
              "stepwise": [list(s) for s in stepwise], "temperatures": [list(t) for t in temperatures],
              "kinds": sorted({p["kind"] for p in prompts}), "budget_bytes": budget_bytes, "workers": workers,
              "verifier_source": tiers_used, "torch_threads": torch.get_num_threads(),
              "convention": "context = prompt[:-1] stored at bf16; feed prompt[-1]; greedy; reference = "
                            "single-token full-KV decoding from the same stored context"}
    return {"config": config, "per_prompt": per_prompt}


def looping(tokens, max_period: int = 16) -> bool:
    """Whether the second half of ``tokens`` repeats with a period of at most ``max_period``
    (greedy decoding of a small model often falls into such a loop, which any drafter predicts)."""
    n = len(tokens)
    h = n // 2
    for p in range(1, max_period + 1):
        if n - h > p and all(tokens[i] == tokens[i + p] for i in range(h, n - p)):
            return True
    return False


def batch_noise(*, n_prompts=20, prompt_tokens=256, new_tokens=64, xs=(8, 16, 32), progress=True) -> dict:
    """How far one forward over ``x + 1`` positions (batched verification) is from single-token
    steps in float32 on this CPU: teacher-force the greedy reference continuation in chunks of
    ``x + 1`` on a cache grown chunk by chunk (as the verifier grows it) and compare the logits with
    the reference's step by step; count argmax flips and report the smallest top-2 gap seen."""
    import torch

    from kvz.benchmarks.lm import model as load_model
    from kvz.benchmarks.prompts import default_prompts
    from kvz.integrations.verify import build_cache, forward_logits

    model, tok = load_model()
    prompts = default_prompts(n_prompts, prompt_tokens, tokenizer=tok)
    out = {x: {"max_abs_logit_diff": 0.0, "flips": 0, "positions": 0, "bitwise_equal_positions": 0,
               "max_abs_kv_diff": 0.0} for x in xs}
    gaps = []
    with torch.inference_mode():
        for pi, pr in enumerate(prompts):
            ids = [int(t) for t in pr["token_ids"]]
            _, ctx_kv = _context(model, ids[:-1])
            n0 = len(ids) - 1
            cache = build_cache(model, ctx_kv)
            cur, toks, ref_logits = ids[-1], [], []
            for t in range(new_tokens):
                lg = forward_logits(model, cache, [cur], n0 + t)[-1]
                ref_logits.append(lg)
                top = lg.topk(2).values
                gaps.append(float(top[0] - top[1]))
                cur = int(lg.argmax())
                toks.append(cur)
            ref_kv = [(layer.keys[..., -new_tokens:, :], layer.values[..., -new_tokens:, :]) for layer in cache.layers]
            path = [ids[-1]] + toks[:-1]
            for x in xs:
                c2 = build_cache(model, ctx_kv)
                for s0 in range(0, new_tokens, x + 1):
                    lg = forward_logits(model, c2, path[s0:s0 + x + 1], n0 + s0)
                    for i in range(lg.shape[0]):
                        d = float((lg[i] - ref_logits[s0 + i]).abs().max())
                        o = out[x]
                        o["max_abs_logit_diff"] = max(o["max_abs_logit_diff"], d)
                        o["bitwise_equal_positions"] += d == 0.0
                        o["flips"] += int(lg[i].argmax()) != toks[s0 + i]
                        o["positions"] += 1
                kvd = max(float((layer.keys[..., -new_tokens:, :] - rk).abs().max()) for layer, (rk, _) in
                          zip(c2.layers, ref_kv))
                out[x]["max_abs_kv_diff"] = max(out[x]["max_abs_kv_diff"], kvd)
            if progress:
                print(f"[noise {pi + 1}/{len(prompts)}] " + ", ".join(
                    f"x={x}: max|dlogit|={out[x]['max_abs_logit_diff']:.2e} flips={out[x]['flips']}" for x in xs),
                    file=sys.stderr, flush=True)
    return {"per_x": {str(x): v for x, v in out.items()}, "min_top2_gap": min(gaps),
            "top2_gap_quantiles": {q: float(np.quantile(gaps, q)) for q in (0.001, 0.01, 0.1, 0.5)},
            "n_prompts": len(prompts), "new_tokens": new_tokens, "prompt_tokens": prompt_tokens}


def summarize(result: dict) -> list:
    """One row per setting, pooled over prompts."""
    by = defaultdict(list)
    for rec in result["per_prompt"]:
        for name, r in rec["results"].items():
            by[name].append((rec, r))
    rows = []
    for name, items in by.items():
        s = items[0][1]["setting"]
        x = s["x"]
        rounds = [rd for _, r in items for rd in r["rounds"]]
        full_rounds = [rd for rd in rounds if rd[0] == x]
        gen = sum(len(r["tokens"]) for _, r in items)
        greedy = not s.get("temperature")
        ref_s = sum(rec["ref_seconds"] for rec, _ in items)
        vc_s = sum(r["seconds"] for _, r in items)
        full_b = float(np.mean([rec["full_bytes"] for rec, _ in items]))
        res_b = float(np.mean([r["draft_resident_bytes"] for _, r in items]))
        gaps = [r["min_top2_gap"] for _, r in items if greedy and math.isfinite(r["min_top2_gap"])]
        row = {
            "name": name, "drafter": s["drafter"], "draft_eps": s["draft_eps"], "keep_frac": s["keep_frac"], "x": x,
            "verify": s["verify"], "temperature": s.get("temperature", 0.0),
            "n_prompts": len(items), "kinds": sorted({rec["kind"] for rec, _ in items}),
            "identical_frac": (float(np.mean([r["identical"] for _, r in items])) if greedy else None),
            "mean_accept_len": (float(np.mean([rd[2] for rd in full_rounds])) if full_rounds else
                                float(np.mean([rd[2] for rd in rounds]))),
            "mean_accept_len_all_rounds": float(np.mean([rd[2] for rd in rounds])),
            "mean_accepted_drafts": float(np.mean([rd[1] for rd in full_rounds])) if full_rounds else 0.0,
            "acceptance_rate": sum(rd[1] for rd in rounds) / max(1, sum(rd[0] for rd in rounds)),
            "all_accepted_frac": float(np.mean([rd[1] == rd[0] for rd in full_rounds])) if full_rounds else 0.0,
            "rounds": len(rounds), "tokens": gen,
            "verifies_per_token": len(rounds) / max(1, gen),
            "paged_bytes_per_token": sum(r["paged_bytes"] for _, r in items) / max(1, gen),
            "objects_decoded": int(sum(r["pager"]["objects_decoded"] for _, r in items)),
            "draft_resident_bytes": res_b, "full_bytes": full_b, "draft_resident_frac": res_b / full_b,
            "draft_bpv": (float(np.mean([r["draft_info"].get("bpv", 0.0) for _, r in items]))
                          if s["drafter"] == "kvz" else 16.0 * (s["keep_frac"] or 1.0)),
            "wall_s": vc_s, "ref_wall_s": ref_s, "wall_ratio": vc_s / ref_s if ref_s else None,
            "draft_s": sum(r["draft_s"] for _, r in items), "verify_s": sum(r["verify_s"] for _, r in items),
            "page_s": sum(r["page_s"] for _, r in items),
            "min_top2_gap": min(gaps) if gaps else None,
            "first_mismatch": [r["first_mismatch"] for _, r in items if r["first_mismatch"] is not None][:5],
            "full_source": items[0][1]["full_source"],
            "full_source_frac": float(np.mean([r["full_source_bytes"] / rec["full_bytes"] for rec, r in items])),
            "accept_rounds": [[int(d), int(k)] for d, k, _ in rounds],
        }
        fresh_all = [rd for rec, r in items if not looping(rec["reference"]) for rd in r["rounds"]]
        fresh = [rd for rd in fresh_all if rd[0] == x]
        row["looping_prompts"] = sum(looping(rec["reference"]) for rec, _ in items)
        row["mean_accept_len_nonloop"] = float(np.mean([rd[2] for rd in fresh])) if fresh and greedy else None
        row["accept_rounds_nonloop"] = [[int(d), int(k)] for d, k, _ in fresh_all]
        rows.append(row)
    return rows


def simulate_rows(rows, *, Bs=(4, 8, 16, 32), iterations=3000, scenarios=None) -> list:
    """The scheduling simulation for every greedy batched setting's measured acceptance."""
    from kvz.integrations.pager import SCENARIOS, AcceptModel, full_kv_baseline, simulate

    # one acceptance model per drafter, pooled over its measured draft lengths, from the prompts whose
    # greedy reference is not a short loop (loops are trivially predicted; all prompts if too few)
    pooled: dict = defaultdict(lambda: {"nonloop": [], "all": [], "xs": set()})
    for row in rows:
        if row["verify"] == "batched" and not row["temperature"]:
            key = (row["drafter"], row["draft_eps"], row["keep_frac"])
            pooled[key]["nonloop"] += [r for r in row.get("accept_rounds_nonloop", []) if r[0] > 0]
            pooled[key]["all"] += [r for r in row["accept_rounds"] if r[0] > 0]
            pooled[key]["xs"].add(row["x"])
    out = []
    for sc_name in (scenarios or list(SCENARIOS)):
        hw, kv = SCENARIOS[sc_name]
        for B in Bs:
            base = full_kv_baseline(hw, B, kv)
            out.append({"scenario": sc_name, "B": B, "setting": "full KV", **base})
            for row in rows:
                if row["verify"] != "batched" or row["temperature"]:
                    continue
                pool = pooled[(row["drafter"], row["draft_eps"], row["keep_frac"])]
                src = "nonloop" if len(pool["nonloop"]) >= 5 else "all"
                am = AcceptModel(pool[src])
                c = row["draft_resident_frac"]
                for pol in ("staggered", "lockstep", "lockstep_prefetch"):
                    r = simulate(hw, B=B, kv_full=kv, c=c, x=row["x"], accept=am, policy=pol, iterations=iterations,
                                 max_draft=max(pool["xs"]))
                    r.pop("hardware", None)
                    r.update(scenario=sc_name, setting=row["name"], drafter=row["drafter"], draft_eps=row["draft_eps"],
                             keep_frac=row["keep_frac"], accept_source=src,
                             mean_emitted_at_x=am.mean_emitted(row["x"], n=4000),
                             speedup_vs_full=(r.get("tokens_per_s", 0.0) / base["tokens_per_s"]
                                              if base["tokens_per_s"] else None))
                    out.append(r)
    return out


# ============================================================================ reporting

def _fmt(v, spec=".2f"):
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return "inf"
    return format(v, spec)


def format_markdown(result: dict, rows: list, sim: list) -> str:
    cfg = result["config"]
    lines = ["# VeriCache on Gemma 3 270M: draft on compressed KV, verify on the full KV",
             "",
             f"{cfg['n_prompts']} prompts ({', '.join(cfg['kinds'])}), {cfg['prompt_tokens']} tokens each "
             f"(context = all but the last, stored at bfloat16), {cfg['new_tokens']} new tokens, greedy unless T is "
             f"given; verifier source: {cfg['verifier_source']}; torch threads {cfg['torch_threads']}.",
             "",
             "| setting | identical | accept/round | ... w/o looping | drafts acc. | all-acc. rounds | accept rate | "
             "verifies/token | paged KB/token | draft resident | draft bpv | full at rest | wall vs full-KV | "
             "min top-2 gap |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['name']} | {_fmt(r['identical_frac'], '.3f')} | {r['mean_accept_len']:.2f} | "
            f"{_fmt(r.get('mean_accept_len_nonloop'))} | "
            f"{r['mean_accepted_drafts']:.2f} | {r['all_accepted_frac']:.2f} | {r['acceptance_rate']:.3f} | "
            f"{r['verifies_per_token']:.3f} | {r['paged_bytes_per_token'] / 1024:.0f} | "
            f"{100 * r['draft_resident_frac']:.1f}% | {r['draft_bpv']:.2f} | "
            f"{100 * r.get('full_source_frac', 1.0):.0f}% ({r['full_source']}) | {_fmt(r['wall_ratio'])}x | "
            f"{_fmt(r['min_top2_gap'], '.2e')} |")
    lines += ["", "accept/round: tokens emitted per verify round (accepted drafts + the correction or bonus) over "
              "rounds that drafted x tokens; drafts acc.: drafts accepted per such round; draft resident: the "
              "drafter's context bytes / the full context bytes at bf16 (kvz: coarse-tier bytes; token dropping: "
              "kept positions); full at rest: bytes the verifier pages from (kvz-exact: the two-tier file) / raw "
              "bf16; paged KB/token: full K/V (context + generated tail, bf16) moved into the verifier's staging "
              "per verify, per generated token; wall: this CPU, float32, one request; min top-2 gap: smallest "
              "top-1/top-2 logit gap the verifier saw at a checked position; w/o looping: accept/round over the "
              f"prompts whose greedy reference does not end in a loop of period <= 16 "
              f"({rows[0]['n_prompts'] - rows[0]['looping_prompts'] if rows else 0} of "
              f"{rows[0]['n_prompts'] if rows else 0}).", ""]
    if sim:
        lines += ["## Scheduling simulation (seed's throughput model, BW/HBM-ring admission)", "",
                  "| scenario | B | setting | policy | tok/s | vs full KV | iter ms | stall | link util | "
                  "HBM peak GB | tok/verify | drafts/verify |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        xs = sorted({r["x"] for r in sim if r["setting"] != "full KV"})
        show_x = 16 if 16 in xs else (xs[len(xs) // 2] if xs else None)
        lines.insert(len(lines) - 2, f"Settings with x = {show_x} shown (all in the JSON); acceptance resampled from "
                                     "the prompts whose greedy reference is not a short loop (pooled over the drafter's "
                                     "measured x; Admit never schedules a draft longer than the longest measured). "
                                     "c (the drafter's "
                                     "resident fraction of the full K/V) is the measured 'draft resident': for kvz "
                                     "that assumes the drafter attends over the coded cache in place (a decode-in-"
                                     "attention kernel kvz does not have; decoded to dense bf16 the drafter saves no "
                                     "HBM), for token dropping it is the kept positions.")
        lines.insert(len(lines) - 2, "")
        for r in sim:
            if r["setting"] != "full KV" and r["x"] != show_x:
                continue
            if r["setting"] == "full KV":
                lines.append(f"| {r['scenario']} | {r['B']} | full KV ({r['B_running']} fit) | - | "
                             f"{r['tokens_per_s']:.0f} | 1.00 | {_fmt(r['iter_ms'], '.1f')} | - | - | "
                             f"{r['hbm_peak_gb']:.0f} | 1 | - |")
            elif not r.get("feasible", True):
                lines.append(f"| {r['scenario']} | {r['B']} | {r['setting']} | {r['policy']} | infeasible | - | - | - "
                             f"| - | - | - | - |")
            else:
                lines.append(f"| {r['scenario']} | {r['B']} | {r['setting']} | {r['policy']} | "
                             f"{r['tokens_per_s']:.0f} | {_fmt(r['speedup_vs_full'])} | {r['iter_ms']:.1f} | "
                             f"{100 * r['stall_frac']:.0f}% | {100 * r['link_util']:.0f}% | {r['hbm_peak_gb']:.0f} | "
                             f"{r['tokens_per_verify']:.1f} | {r.get('drafts_per_verify', 0.0):.1f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list, sim: list, path) -> None:
    """Two panels: tokens per verify round against x per drafter; simulated throughput against B."""
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    by = defaultdict(list)
    for r in rows:
        if r["verify"] == "batched" and not r["temperature"]:
            key = f"kvz eps={r['draft_eps']:g}" if r["drafter"] == "kvz" else f"{r['drafter']} keep={r['keep_frac']:g}"
            by[key].append((r["x"], r["mean_accept_len"], r.get("mean_accept_len_nonloop")))
    for key, pts in sorted(by.items()):
        pts.sort()
        line, = a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=key)
        if all(p[2] is not None for p in pts):
            a.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=line.get_color())
    xs = sorted({p[0] for pts in by.values() for p in pts})
    a.plot(xs, [x + 1 for x in xs], "k:", label="x + 1 (all accepted)")
    a.set_xlabel("draft length x")
    a.set_ylabel("tokens per verify round")
    a.set_title("Gemma 3 270M (dashed: prompts without a greedy loop)", fontsize=9)
    a.legend(fontsize=7)
    sc = sim[0]["scenario"] if sim else None
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    for setting in sorted({r["setting"] for r in sim if r["scenario"] == sc}):
        color = next(colors) if ("x=16" in setting and "stepwise" not in setting) else "k"
        for pol, style in (("staggered", "o-"), ("lockstep", "s--")):
            pts = [(r["B"], r["tokens_per_s"]) for r in sim if r["scenario"] == sc and r["setting"] == setting
                   and r.get("policy") in (pol, "full_kv") and r.get("feasible", True)]
            if setting == "full KV":
                if pol == "staggered":
                    b.plot([p[0] for p in pts], [p[1] for p in pts], "k-", lw=2, label="full KV")
                continue
            if "x=16" in setting and "stepwise" not in setting:
                b.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, label=f"{setting} {pol}", ms=3)
    b.set_xlabel("concurrent requests B")
    b.set_ylabel("tokens/s (simulated)")
    b.set_title(f"scheduling simulation: {sc} (solid: staggered, dashed: lock-step)", fontsize=9)
    b.legend(fontsize=6)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def summarize_all(result: dict, Bs, iterations: int) -> tuple[list, list]:
    """The summary rows of a run and their scheduling simulation."""
    rows = summarize(result)
    return rows, simulate_rows(rows, Bs=Bs, iterations=iterations)


def write_outputs(a, result: dict, rows: list, sim: list) -> None:
    """``--json`` (config, rows, simulation, per-prompt details), ``--md``, ``--png`` and the table on stdout."""
    md = format_markdown(result, rows, sim)
    if a.json:
        write_json({"config": result["config"], "rows": rows, "simulation": sim,
                    "per_prompt": result["per_prompt"]}, a.json)
    if a.md:
        write_text(a.md, md)
    if a.png:
        plot(rows, sim, a.png)
    if not a.quiet:
        print(md)


def run(a) -> dict:
    """The drafters of ``a.settings`` (what :func:`main` makes of the flags) on the model, summarised:
    ``{"config", "rows", "simulation", "per_prompt"}`` (checkpoints to ``a.json + ".partial"``)."""
    import torch

    os.environ.setdefault("KVZ_THREADS", str(a.threads))
    torch.set_num_threads(a.threads)
    ckpt = (a.json + ".partial") if a.json else None
    t0 = time.perf_counter()
    result = measure(budget_bytes=int(a.budget_mb * (1 << 20)), workers=a.workers, progress=not a.quiet,
                     checkpoint=ckpt, **a.settings)
    result["config"]["seconds"] = time.perf_counter() - t0
    result["config"]["quick"] = bool(a.quick)
    rows, sim = summarize_all(result, a.Bs, a.iters)
    return {"config": result["config"], "rows": rows, "simulation": sim, "per_prompt": result["per_prompt"]}


def markdown(result: dict) -> str:
    return format_markdown(result, result["rows"], result["simulation"])


def _floats(s: str) -> tuple:
    return tuple(float(v) for v in s.split(",") if v.strip())


def _ints(s: str) -> tuple:
    return tuple(int(v) for v in s.split(",") if v.strip())


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m benchmarks.studies.serving.verify", quick="3 prompts x 128 tokens, 24 new tokens, a few settings",
                json="write rows (and per-prompt details) here", quiet=True)
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--tokens", type=int, help="prompt length in tokens (BOS included)")
    ap.add_argument("--new-tokens", type=int)
    ap.add_argument("--x", help="draft lengths, e.g. 8,16,32")
    ap.add_argument("--eps", help="kvz drafter eps values, e.g. 0.03,0.1,0.2")
    ap.add_argument("--drop", help="token-dropping drafters method:keep, e.g. window:0.3,snapkv:0.3 ('' for none)")
    ap.add_argument("--drop-x", help="draft lengths for the token-dropping drafters")
    ap.add_argument("--no-stepwise", action="store_true", help="skip the stepwise-verification check")
    ap.add_argument("--no-temperature", action="store_true", help="skip the T>0 (rejection sampling) row")
    ap.add_argument("--budget-mb", type=float, default=256.0, help="pager memory budget")
    ap.add_argument("--workers", type=int, default=2, help="pager decode threads")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--sim-iterations", type=int, default=3000)
    ap.add_argument("--md", help="write a markdown table here")
    ap.add_argument("--png", help="write a figure here (matplotlib)")
    ap.add_argument("--report", help="re-summarize a JSON written by an earlier run (no model runs)")
    ap.add_argument("--noise", action="store_true", help="only measure batched-vs-single-step float32 differences "
                    "(logits, K/V, argmax flips) along the greedy references; writes --json")
    a = ap.parse_args(argv)
    if a.report:
        result = json.loads(Path(a.report).read_text())
        if result.get("config") is None:
            result["config"] = {"n_prompts": len(result["per_prompt"]), "prompt_tokens": "?", "new_tokens": "?",
                                "kinds": sorted({p["kind"] for p in result["per_prompt"]}), "verifier_source": "?",
                                "torch_threads": "?"}
        write_outputs(a, result, *summarize_all(result, (4, 8, 16, 32), a.sim_iterations))
        return 0
    import torch

    if a.noise:
        os.environ.setdefault("KVZ_THREADS", str(a.threads))
        torch.set_num_threads(a.threads)
        res = batch_noise(n_prompts=a.prompts or (3 if a.quick else 20), prompt_tokens=a.tokens or
                          (128 if a.quick else 256), new_tokens=a.new_tokens or (24 if a.quick else 64),
                          xs=_ints(a.x) if a.x else (8, 16, 32), progress=not a.quiet)
        if a.json:
            write_json(res, a.json)
        print(json.dumps(res, indent=1))
        return 0
    if a.quick:
        d = dict(n_prompts=3, prompt_tokens=128, new_tokens=24, xs=(8, 16), eps_list=(0.10,), drops=(("window", 0.3),),
                 drop_xs=(8,), stepwise=((0.10, 8),), temperatures=((0.7, 0.10, 8),))
        Bs, iters = (4, 16), min(a.sim_iterations, 1500)
    else:
        d = dict(n_prompts=20, prompt_tokens=256, new_tokens=64, xs=(8, 16, 32), eps_list=(0.03, 0.10, 0.20),
                 drops=(("window", 0.3), ("snapkv", 0.3)), drop_xs=(16,), stepwise=((0.10, 16),),
                 temperatures=((0.7, 0.10, 16),))
        Bs, iters = (4, 8, 16, 32), a.sim_iterations
    if a.prompts is not None:
        d["n_prompts"] = a.prompts
    if a.tokens is not None:
        d["prompt_tokens"] = a.tokens
    if a.new_tokens is not None:
        d["new_tokens"] = a.new_tokens
    if a.x:
        d["xs"] = _ints(a.x)
    if a.eps:
        d["eps_list"] = _floats(a.eps)
    if a.drop is not None:
        d["drops"] = tuple((m.split(":")[0], float(m.split(":")[1])) for m in a.drop.split(",") if m.strip())
    if a.drop_x:
        d["drop_xs"] = _ints(a.drop_x)
    if a.no_stepwise:
        d["stepwise"] = ()
    if a.no_temperature:
        d["temperatures"] = ()
    a.settings, a.Bs, a.iters = d, Bs, iters
    res = run(a)
    rows = res["rows"]
    write_outputs(a, res, rows, res["simulation"])
    ckpt = (a.json + ".partial") if a.json else None
    if ckpt and os.path.exists(ckpt):
        os.remove(ckpt)
    bad = [r["name"] for r in rows if r["identical_frac"] is not None and r["identical_frac"] < 1.0]
    if bad:
        print(f"NOT IDENTICAL: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
