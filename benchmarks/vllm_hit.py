"""A long prefix hit through vLLM's KV connectors, as an operator sees it: TTFT of a stored 8K prefix
from kvz (lossless, each speed profile, ``auto``) and from vLLM's ExampleConnector (raw bf16), over
the local directory store and over Redis behind a loopback link of 1 or 10 Gbit/s
(:mod:`kvz.benchmarks.link_proxy`), with kvz's split: lookup, read, decode, copy, and how much of
the load ran under the forward.

    python -m kvz.benchmarks.vllm_reuse --hit [--sizes 8192] [--rounds 3] [--links 1g,10g] --json OUT --md OUT
    python -m kvz.benchmarks.vllm_hit --from-json OUT --plot PNG [--md MD]   # again from the JSON (no vLLM)

Engines run one at a time, pinned to core 0 (``VLLM_CPU_OMP_THREADS_BIND=0``); kvz's load thread
takes the cores the engine does not bind (core 1 on a 2-core machine). Steps:

1. Two cold prefills of the prompt (each a writer): ExampleConnector, and kvz lossless. The lossless
   writer's tokens and logprobs are the reference (a full prefill with a connector on).
2. The lossy stores (the connector's default budget: FP8's next-token KL in the attention scope,
   docs/engine-scope.md) are made from the lossless store without more prefills: each run is
   decoded to the engine's exact KV and encoded again in each profile under the same keys — what a
   writer in that profile stores. ``auto`` is the profile the connector's own choice
   (:mod:`kvz.integrations.vllm.profile_choice`) picks on this machine and this store, measured here
   on the load cores as the connector measures it at warm-up.
3. The ``auto`` store is copied into a real ``redis-server``; readers reach it through a link proxy.
4. One read-only reader engine per row, the prompt ``rounds`` times (each a store hit: prefix
   caching is off), TTFT = vLLM's ``first_token_latency``, median of the rounds.

ExampleConnector over a link is not measured (it reads local safetensors files): its row adds the raw
bytes' time on that link to its local hit (``modeled``), the best a raw store on that link could do.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

PROFILES = ("default", "balanced", "fast")
L, H, D = 18, 1, 256


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _rate(text: str) -> float:
    from .link_proxy import parse_rate

    return float(parse_rate(text))


def transcode(src_dir: str, dst_dir: str, runs: list, token_ids: list, profile: str, eps: float | None = None, *,
              weights: str | None) -> dict:
    """Store in ``dst_dir`` what a writer in ``profile`` (lossy: the connector's default budget, or
    ``eps`` in the tensor scope) stores for ``token_ids``,
    from the lossless runs of ``src_dir`` (decoded to the exact KV the writer computed). ``weights``:
    the served model's :func:`~kvz.integrations.fingerprint.weights_fingerprint`, which the engine's
    keys bind (without it every key differs from the reader's: a miss)."""
    from alignpred import KvzReader
    from kvz.integrations.kvstore import DirectoryBackend
    from kvz.integrations.vllm import BlockStore

    src = DirectoryBackend(src_dir)
    out = None
    t0 = time.perf_counter()
    for run in runs:
        blob = src.get(run["key"])
        r = KvzReader(blob, bank="gemma-3-270m")
        meta = r.source_metadata
        if out is None:
            out = BlockStore(DirectoryBackend(dst_dir), model_id=meta["model"], block_size=int(r.layout.n_tokens //
                             run["blocks"]), layer_types=json.loads(meta["layer_types"]),
                             rope_theta=json.loads(meta["rope_theta"]), shape=(L, H, D), dtype="bfloat16", eps=eps,
                             bank="gemma-3-270m", threads=1, profile=profile, weights=weights)
        kv = [(k, v) for _, k, v in r.layers()]
        first = int(run["first_block"])
        hashes = out.block_hashes(token_ids, first + run["blocks"])[first:]
        out.put_run(token_ids, first, [(k.copy(), v.copy()) for k, v in kv], hashes)
    assert out is not None
    return {"profile": profile, "bytes": out.counters["stored_bytes"], "encode_s": round(time.perf_counter() - t0, 2)}


def copy_to_redis(src_dir: str, url: str, namespace: str) -> int:
    from kvz.integrations.kvstore import DirectoryBackend, RedisBackend

    src, dst = DirectoryBackend(src_dir), RedisBackend(url, namespace=namespace)
    n = 0
    for k in src.keys():
        e = src.get_entry(k)
        if e is not None and dst.put(k, e.blob, meta=e.meta, importance=e.importance):
            n += 1
    dst.close()
    return n


def choose_auto(store_dir: str, tokens: int, cores) -> dict:
    """The connector's ``auto`` choice for a lossy store at its default budget, measured on ``cores``."""
    from kvz.integrations.kvstore import DirectoryBackend
    from kvz.integrations.vllm import BlockStore, choose_profile

    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(cores))
    except OSError:
        pass
    try:
        thetas = [1e6 if i % 6 == 5 else 1e4 for i in range(L)]
        types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(L)]
        be = DirectoryBackend(store_dir)
        st = BlockStore(be, model_id="probe", block_size=128, layer_types=types, rope_theta=thetas, shape=(L, H, D),
                        dtype="bfloat16", bank="gemma-3-270m", threads=1)
        return choose_profile(st, be, (L, H, D), tokens)
    finally:  # the engines started after this inherit the benchmark's affinity: give them every core again
        os.sched_setaffinity(0, before)


def run(size: int, model_dir: str, *, rounds: int = 3, links=("1g", "10g"), workdir: str | None = None,
        topk: int = 20, recompute_rounds: int | None = None, log=print) -> dict:
    """The rows at ``size`` tokens; ``recompute_rounds`` (default ``rounds``): the no-connector prefills,
    fewer where a full prefill is slow (bf16 without AMX or AVX-512 BF16 runs vLLM's torch fallback)."""
    from kvz.integrations.fingerprint import weights_fingerprint
    from kvz.integrations.kvstore import RedisServer
    from kvz.integrations.vllm import mean_kl

    from . import vllm_reuse as vr
    from .link_proxy import LinkProxy

    root = Path(workdir or tempfile.mkdtemp(prefix="kvz-vllm-hit-"))
    root.mkdir(parents=True, exist_ok=True)
    _, reader, shared = vr.build_prompts(model_dir, [size])[size]
    base = {"model": model_dir, "max_tokens": 8, "max_model_len": size + 8 + vr.BS, "block_size": vr.BS,
            "logprobs": topk, "max_logprobs": max(20, topk), "detokenize": False,
            "warmup_prompts": [[2] + list(range(3000, 3300))]}
    cores = sorted(os.sched_getaffinity(0))
    engine_core, load_cores = cores[0], [c for c in cores if c != cores[0]] or cores
    t0 = time.perf_counter()

    def engine(name, store, prompts, resume=True):
        t = time.perf_counter()
        out = vr._engine({**base, "prompts": prompts, "store": store}, root, name, core=engine_core, resume=resume)
        log(f"  {name}: {time.perf_counter() - t:.0f} s")
        return out

    # 1. cold prefills: the writers
    ex_cfg = {"kind": "example", "path": str(root / "example")}
    lossless_dir = str(root / "kvz-lossless")
    ex_w = engine("example-writer", ex_cfg, [reader])
    ll_w = engine("kvz-lossless-writer", {"store": lossless_dir, "lossless": True, "profile": "default"}, [reader])
    ref = ll_w["results"][0]
    runs = ll_w["connector"]["runs"]
    stored_tokens = sum(r["blocks"] for r in runs) * vr.BS
    raw_bytes = stored_tokens * L * 2 * H * D * 2
    # 2. lossy stores per profile (same keys), and auto's choice
    made = {}
    for p in PROFILES:
        d = str(root / f"kvz-{p}")
        if not Path(d).exists():
            made[p] = transcode(lossless_dir, d, runs, reader, p, weights=weights_fingerprint(model_dir))
            log(f"  transcoded {p}: {made[p]}")
    auto = choose_auto(str(root / "probe-store"), size, load_cores)
    log(f"  auto: {auto['reason']}")
    rows = []

    def row(store, link, out, stored_bytes, note=""):
        hits = out["results"]
        ttfts = [x["ttft_s"] for x in hits]
        r = {"store": store, "link": link, "prompt_tokens": size, "cached_tokens": hits[-1]["cached_tokens"],
             "identical": all(x["tokens"] == ref["tokens"] for x in hits), "ttft_s": round(_median(ttfts), 4),
             "ttft_rounds_s": [round(x, 4) for x in ttfts], "stored_bytes": stored_bytes,
             "bytes_per_token": round(stored_bytes / stored_tokens, 1), "x_raw_bytes": round(stored_bytes / raw_bytes, 4),
             "kl_topk": mean_kl(ref["logprobs"], hits[-1]["logprobs"]), "note": note}
        if store.startswith("kvz"):
            for k in ("lookup_s", "read_s", "decode_s", "copy_s", "blocked_s", "load_s", "failed_blocks"):
                r[k] = round(_median([x["delta"].get(k, 0.0) for x in hits]), 4)
            r["rest_s"] = round(r["ttft_s"] - r["lookup_s"] - r["blocked_s"], 4)
            r["load_under_forward"] = round(1 - r["blocked_s"] / r["load_s"], 4) if r["load_s"] else None
            r["decode_under_forward"] = round(max(0.0, 1 - r["blocked_s"] / r["decode_s"]), 4) if r["decode_s"] else None
        rows.append(r)
        log(f"  {store} {link}: TTFT {r['ttft_s']:.2f} s {r.get('decode_s', '')}")
        return r

    # 3. recompute (no connector), vLLM's own CPU offloading connector, then readers over the directory store
    rec = row("recompute", "-", engine("recompute", None, [reader] * (recompute_rounds or rounds)), 0, "no connector: a full prefill")
    off_cfg = {"kind": "vllm", "connector": "OffloadingConnector", "extra": {"cpu_bytes_to_use": 2 << 30}}
    try:
        off = engine("offloading", off_cfg, [reader] * (rounds + 1))
        off["results"] = off["results"][1:]  # the first request stores, the rest hit
        row("vllm-offloading", "cpu memory", off, raw_bytes, "vLLM's OffloadingConnector (CPU memory)")
    except RuntimeError as e:  # it is built for a GPU engine's KV; say why it does not run here
        why = next((ln.strip() for ln in reversed(str(e).splitlines()) if "Error" in ln), str(e).splitlines()[-1])
        rows.append({"store": "vllm-offloading", "link": "cpu memory", "prompt_tokens": size, "cached_tokens": 0,
                     "identical": False, "ttft_s": None, "ttft_rounds_s": [], "stored_bytes": 0,
                     "bytes_per_token": 0.0, "x_raw_bytes": 0.0, "kl_topk": None,
                     "note": f"does not run on vLLM's CPU backend: {why[:300]}"})
        log(f"  vllm-offloading: {rows[-1]['note']}")
    ex = row("example", "local", engine("example-reader", ex_cfg, [reader] * rounds),
             (sum(x["delta"].get("stored_bytes", 0) for x in ex_w["results"])) or raw_bytes)
    kinds = [("kvz-lossless", lossless_dir, True)] + [(f"kvz-{p}", str(root / f"kvz-{p}"), False) for p in PROFILES]
    sizes = {}
    for name, d, lossless in kinds:
        cfg = {"store": d, "lossless": lossless, "read_only": True}  # the default budget, as a user gets it
        sizes[name] = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".kvc"))
        out = engine(f"{name}-reader", cfg, [reader] * rounds)
        row(name, "local", out, (made.get(name[4:], {}).get("bytes") or
                                 sum(r["bytes"] for r in out["connector"].get("runs", [])) or
                                 (ll_w["connector"]["counters"]["stored_bytes"] if lossless else sizes[name])))
    a = next(r for r in rows if r["store"] == f"kvz-{auto['profile']}")
    rows.append({**a, "store": "kvz-auto", "note": f"= kvz-{auto['profile']} (auto's choice here)"})
    # the same hit decoded in kvz's decode process (decode_process: true; the default decodes in the
    # load thread), with its idle-priority threads on the engine's core (A/B)
    d = str(root / f"kvz-{auto['profile']}")
    out = engine("kvz-auto-process-reader", {"store": d, "read_only": True, "decode_process": True},
                 [reader] * rounds)
    row("kvz-auto", "local, decode process", out, a["stored_bytes"],
        "decode_process true: decoded in kvz's own process, idle-priority threads on the engine's core")
    # 4. Redis behind a link
    with RedisServer() as srv:
        copy_to_redis(str(root / f"kvz-{auto['profile']}"), srv.url, "hit")
        for link in links:
            with LinkProxy(("127.0.0.1", srv.port), rate_bits_per_s=_rate(link)) as px:
                cfg = {"store": px.url_for(srv.url), "namespace": "hit", "read_only": True}
                out = engine(f"kvz-auto-redis-{link}-reader", cfg, [reader] * rounds, resume=False)
                row("kvz-auto", f"redis {link}bit/s", out, a["stored_bytes"])
            rows.append({**ex, "link": f"{link}bit/s (modeled)", "ttft_s": round(ex["ttft_s"] + raw_bytes * 8 / _rate(link), 4),
                         "ttft_rounds_s": [], "note": f"local hit + {raw_bytes} raw bytes at {link}bit/s"})
    return {"size": size, "rounds": rounds, "rows": rows, "recompute_ttft_s": rec["ttft_s"], "auto": auto, "transcoded": made, "raw_bytes": raw_bytes,
            "stored_tokens": stored_tokens, "shared_tokens": shared, "engine_core": engine_core, "load_cores": load_cores,
            "seconds": round(time.perf_counter() - t0, 1)}


def markdown(res: dict, note: str = "") -> str:
    local_ex = next(r for r in res["rows"] if r["store"] == "example" and r["link"] == "local")
    lines = [f"# vLLM prefix hit at {res['size']} tokens: kvz against ExampleConnector", "",
             f"auto's choice on this machine: **{res['auto']['profile']}** — {res['auto']['reason']}", "",
             "| store | link | cached | identical | TTFT s (median) | rounds s | × ExampleConnector (same link) "
             "| lookup / read / decode / copy s | forward blocked s | decode / load under the forward | bytes/token | × raw | KL (top-k) |",
             "|---|---|---:|:-:|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in res["rows"]:
        if r["store"] == "example":
            base = r
        else:
            key = r["link"].replace("redis ", "").replace(" (modeled)", "")
            base = next((x for x in res["rows"] if x["store"] == "example" and x["link"].startswith(key)), local_ex)
            if r["link"] == "local":
                base = local_ex
        if r["ttft_s"] is None:  # a row that could not run: its reason
            lines.append(f"| {r['store']} | {r['link']} | | | — | | | | | | | | {r['note']} |")
            continue
        rel = f"{r['ttft_s'] / base['ttft_s']:.2f}" if base["ttft_s"] and r["store"] != "recompute" else ""
        split = (f"{r['lookup_s']:.3f} / {r['read_s']:.3f} / {r['decode_s']:.2f} / {r['copy_s']:.3f}"
                 if "decode_s" in r else "")
        blocked = f"{r['blocked_s']:.3f}" if "blocked_s" in r else ""
        under = (f"{100 * r['decode_under_forward']:.0f}% / {100 * r['load_under_forward']:.0f}%"
                 if r.get("load_under_forward") is not None and r.get("decode_under_forward") is not None else "")
        kl = f"{r['kl_topk']:.2e}" if r.get("kl_topk") is not None else ""
        rounds = ", ".join(f"{x:.2f}" for x in r["ttft_rounds_s"])
        lines.append(f"| {r['store']} | {r['link']} | {r['cached_tokens']} | {'yes' if r['identical'] else 'no'} "
                     f"| {r['ttft_s']:.2f} | {rounds} | {rel} | {split} | {blocked} | {under} | {r['bytes_per_token']:.0f} "
                     f"| {r['x_raw_bytes']:.3f} | {kl} |")
    lines += ["", "Decode / load under the forward: 1 − (time the forward waited on kvz's loads) / (decode seconds, "
              "resp. load wall time). "
              "KL: mean over the 8 generated steps of KL(reference ‖ store) on the reference's top-k logprobs "
              "(renormalised), the reference being the lossless writer's cold prefill.", ""]
    return "\n".join(lines) + (note + "\n" if note else "")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if r["ttft_s"] is not None]
    labels = [f"{r['store']}\n{r['link']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["ttft_s"] for r in rows],
           color=["#888" if r["store"] == "example" else "#c44" if r["store"] == "recompute" else "#2a7"
                  for r in rows])
    ax.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT of the hit, s (median, log scale)")
    ax.set_title(f"vLLM CPU, Gemma 3 270M, {res['size']}-token prefix hit")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    """Tables and the plot again from a ``vllm_reuse --hit --json`` result (no engine runs)."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--from-json", required=True, help="the --json output of vllm_reuse --hit")
    ap.add_argument("--plot", help="PNG of the last size's TTFT per store and link")
    ap.add_argument("--md", help="markdown tables, one per size")
    a = ap.parse_args(argv)
    got = json.loads(Path(a.from_json).read_text())
    results = got if isinstance(got, list) else [got]
    if a.md:
        Path(a.md).write_text("\n".join(markdown(r) for r in results))
    if a.plot:
        plot(results[-1], a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
