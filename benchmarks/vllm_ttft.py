"""TTFT of a long shared prefix through vLLM's KV connectors, in rounds (median of ``rounds``).

One engine process per store, run one after another (one model process at a time on a small
machine), each in vLLM's own ``LLM`` (:mod:`kvz.integrations.vllm.harness`):

- ``recompute``: no connector; the reader prompt ``rounds`` times (prefix caching off: every round
  is a full prefill). Its first round's tokens and top-``K`` logprobs are the reference.
- ``kvz`` (lossy, eps 0.02): the writer (the reader prompt itself, cold: it computes and stores the
  prefix and is the KL reference when there is no ``recompute`` engine), then the reader ``rounds``
  times; with ``cold``, each hit is preceded by a *cold* prompt (the reader prompt with its second token changed: no block matches, a full
  prefill with the connector on) followed by the reader prompt (a store hit). Cold and hit
  alternate in one process, so their ratio is measured under the same machine load (``cold=False``:
  the hits only).
- ``kvz-lossless`` and ``example`` (vLLM's ``ExampleConnector``): the writer, then the reader
  ``rounds`` times (each a store hit: prefix caching is off).

Engines already run (same spec, same ``workdir``) are reused with ``--resume``, so stores can be
added one invocation at a time.

TTFT is vLLM's ``first_token_latency`` of the reader's request (arrival to first token). For kvz
the split per round comes from the connector's counters: ``lookup_s`` (scheduler: fetch the runs
and check them), ``decode_s`` (kvz decode into staging buffers), ``copy_s`` (write into vLLM's
blocks with ``cpu_attn_reshape_and_cache``) and ``rest_s`` = TTFT minus those (the remaining
prefill of the uncached tokens, sampling and the engine's own overhead).

KL: mean over the generated steps (while the greedy tokens agree) of KL(recompute || store) on the
recompute's top-``K`` next-token logprobs (renormalised on that set; ``ref_topk_mass`` says how
much of the reference distribution the set holds).
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path

TOPK = 4096  # of Gemma 3's 262,144-token vocabulary; vLLM can return all, but as Python objects


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def _mass(lps) -> float | None:
    """Mean probability mass of the reference's top-K sets over the steps."""
    if not lps:
        return None
    return sum(sum(math.exp(v) for v in step.values()) for step in lps) / len(lps)


def cold_variant(ids: list, r: int) -> list:
    """The same prompt with its second token changed: the first block's hash differs, so no block of
    the store matches (a cold prefill of the same length and nearly the same text)."""
    out = list(ids)
    out[1] = 1000 + r if out[1] != 1000 + r else 1001 + r
    return out


def plan(store: str, writer: list, reader: list, rounds: int, cold: bool = True,
         recompute_rounds: int | None = None) -> tuple[list, list]:
    """The prompts of one store's engine and, per prompt, its label."""
    if store == "recompute":
        n = rounds if recompute_rounds is None else recompute_rounds
        return [reader] * n, ["hit"] * n
    prompts, labels = [writer], ["writer"]
    for r in range(rounds):
        if store == "kvz" and cold:  # (a cold prefill before each hit: ``rounds`` more 8K prefills)
            prompts.append(cold_variant(reader, r))
            labels.append("cold")
        prompts.append(reader)
        labels.append("hit")
    return prompts, labels


def run(sizes, stores, model_dir: str, *, rounds: int = 3, max_tokens: int = 8, topk: int = TOPK,
        workdir: str | None = None, cold: bool = False, recompute_rounds: int | None = None,
        resume: bool = False, log=print) -> list[dict]:
    """Rows in :mod:`kvz.benchmarks.vllm_reuse`'s format (plus the rounds, the split and the KL).

    ``recompute_ttft_s`` is the median of every full prefill of an 8K prompt the run made: the
    no-connector engine's rounds (``recompute_rounds``, default ``rounds``), the kvz engines' writers
    (a cold prefill with the connector on; its store encodes after the step) and the cold rounds.
    ExampleConnector's writer is left out (it writes its files inside the forward)."""
    from .harness.vllm_engines import redis_cluster

    with redis_cluster(stores) as cluster_url:  # a ``*-cluster`` store: a cluster for the run
        return _run(sizes, stores, model_dir, rounds, max_tokens, topk, workdir, cold, recompute_rounds, resume,
                    log, cluster_url)


def _run(sizes, stores, model_dir, rounds, max_tokens, topk, workdir, cold, recompute_rounds, resume, log,
         cluster_url) -> list[dict]:
    import tempfile

    from kvz.integrations.vllm import mean_kl

    from .harness import vllm_engines as vr
    from .harness.vllm_engines import store_cfg

    root = Path(workdir or tempfile.mkdtemp(prefix="kvz-vllm-ttft-"))
    root.mkdir(parents=True, exist_ok=True)
    prompts = vr.build_prompts(model_dir, sizes)
    mml = max(sizes) + max_tokens + vr.BS
    base = {"model": model_dir, "max_tokens": max_tokens, "max_model_len": mml, "block_size": vr.BS,
            "logprobs": topk, "max_logprobs": topk, "detokenize": False,
            "warmup_prompts": [[2] + list(range(3000, 3300))]}
    L, H, d = 18, 1, 256
    rows = []
    for n in sizes:
        _, reader, shared = prompts[n]
        writer = reader  # the writer's cold prefill is also a recompute of the reader (the KL reference)
        outs, labels = {}, {}
        for store in stores:
            ps, labels[store] = plan(store, writer, reader, rounds, cold, recompute_rounds)
            cfg = store_cfg(store, root / f"n{n}", cluster_url)
            t0 = time.perf_counter()
            outs[store] = vr.engine({**base, "prompts": ps, "store": cfg}, root, f"{store}-{n}", resume=resume)
            log(f"  {store} @ {n}: {time.perf_counter() - t0:.0f} s")
        rec = outs["recompute"]["results"] if "recompute" in outs else []
        first = next((s for s in stores if s.startswith("kvz")), stores[0])
        ref = rec[0] if rec else outs[first]["results"][0]  # no-connector round, else a kvz writer's cold prefill
        rec_ttft = [x["ttft_s"] for x in rec]
        for store in stores:  # every other cold 8K prefill with the same thread count
            if store.startswith("kvz"):
                rec_ttft += [x["ttft_s"] for x, k in zip(outs[store]["results"], labels[store]) if k != "hit"]
        for store in stores:
            if store == "recompute" and not rec:
                continue
            res = outs[store]["results"]
            lab = labels[store]
            hits = [x for x, k in zip(res, lab) if k == "hit"]
            colds = [x for x, k in zip(res, lab) if k == "cold"]  # (not ``cold``: the option, for the next size)
            w = res[0] if lab[0] == "writer" else None
            wd = w["delta"] if w else {}
            stored_tokens = (sum(x["blocks"] for x in wd.get("runs", [])) * vr.BS if store.startswith("kvz") else
                             ((n - 1) // vr.BS * vr.BS if store == "example" else 0))
            ttfts = [x["ttft_s"] for x in hits]
            row = {"store": store, "prompt_tokens": n, "shared_tokens": shared,
                   "cached_tokens": hits[-1]["cached_tokens"],
                   "identical": all(x["tokens"] == ref["tokens"] for x in hits),
                   "ttft_s": _median(ttfts), "recompute_ttft_s": _median(rec_ttft),
                   "ttft_rounds_s": [round(x, 4) for x in ttfts],
                   "recompute_rounds_s": [round(x, 4) for x in rec_ttft],
                   "recompute_noconnector_s": [round(x["ttft_s"], 4) for x in rec],
                   "stored_bytes": int(wd.get("stored_bytes", 0)), "stored_tokens": stored_tokens,
                   "raw_bytes": stored_tokens * L * 2 * H * d * 2, "rounds": rounds, "topk": topk,
                   "kl_topk": None if store == "recompute" else mean_kl(ref["logprobs"], hits[-1]["logprobs"]),
                   "ref_topk_mass": round(_mass(ref["logprobs"]) or 0.0, 6)}
            if colds:
                row["cold_rounds_s"] = [round(x["ttft_s"], 4) for x in colds]
                row["cold_ttft_s"] = _median(row["cold_rounds_s"])
            if w:
                row["writer_ttft_s"] = round(w["ttft_s"], 4)
            if store.startswith("kvz"):
                parts = {k: [x["delta"].get(k, 0.0) for x in hits] for k in ("lookup_s", "decode_s", "copy_s")}
                for k, v in parts.items():
                    row[k] = _median(v)
                row["rest_s"] = _median([t - sum(parts[k][i] for k in parts) for i, t in enumerate(ttfts)])
                row["encode_s"] = round(wd.get("encode_s", 0.0), 3)
            rows.append(row)
    return rows


def to_markdown(rows, note: str = "") -> str:
    """One line per store and size: medians, the kvz split, bytes and KL."""
    lines = ["| store | prompt | cached | identical | TTFT s (median) | rounds s | × recompute | × cold (same engine) "
             "| lookup / decode / copy / rest s | bytes/token | × ExampleConnector | KL (top-K) |",
             "|---|---:|---:|:-:|---:|---|---:|---:|---|---:|---:|---:|"]
    ex = {r["prompt_tokens"]: r for r in rows if r["store"] == "example"}
    for r in rows:
        ratio = f"{r['ttft_s'] / r['recompute_ttft_s']:.2f}" if r.get("recompute_ttft_s") else ""
        cold = f"{r['ttft_s'] / r['cold_ttft_s']:.2f} (cold {r['cold_ttft_s']:.1f} s)" if r.get("cold_ttft_s") else ""
        split = (f"{r['lookup_s']:.2f} / {r['decode_s']:.2f} / {r['copy_s']:.2f} / {r['rest_s']:.2f}"
                 if "decode_s" in r else "")
        per = f"{r['stored_bytes'] / r['stored_tokens']:.0f}" if r["stored_tokens"] and r["stored_bytes"] else ""
        e = ex.get(r["prompt_tokens"])
        xe = f"{r['stored_bytes'] / e['stored_bytes']:.3f}" if e and e["stored_bytes"] and r["stored_bytes"] else ""
        kl = f"{r['kl_topk']:.2e}" if r.get("kl_topk") is not None else ""
        rs = ", ".join(f"{x:.2f}" for x in r["ttft_rounds_s"])
        lines.append(f"| {r['store']} | {r['prompt_tokens']} | {r['cached_tokens']} | {'yes' if r['identical'] else 'no'} "
                     f"| {r['ttft_s']:.2f} | {rs} | {ratio} | {cold} | {split} | {per} | {xe} | {kl} |")
    k = rows[0]["topk"] if rows else TOPK
    mass = min((r["ref_topk_mass"] for r in rows), default=0.0)
    lines.append("")
    lines.append(f"KL: mean over the generated steps of KL(recompute ‖ store) on the recompute's top-{k} "
                 f"next-token logprobs, renormalised (that set holds ≥ {mass:.4f} of the reference's probability).")
    return "\n".join(lines) + ("\n\n" + note if note else "") + "\n"
