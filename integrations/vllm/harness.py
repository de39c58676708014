"""Run vLLM's own engine once, in this process, on token-id prompts, and report what it did (JSON).

Used by the tests and the benchmark, each call in a fresh process (a second process is how a
store is proven to work across engines)::

    python -m kvz.integrations.vllm.harness SPEC.json OUT.json

SPEC: ``{"model": dir, "prompts": [[ids]], "max_tokens": 8, "logprobs": 0, "store": null | "example"
| {"kind": "vllm", "connector": name, "extra": {...}} (one of vLLM's own connectors) | {kvz extra config},
"max_model_len": 2048, "block_size": 128, "dtype": "bfloat16"}`` (optional:
``"max_logprobs"``, vLLM's cap on ``logprobs`` (default 20); ``"detokenize": false``;
``"kl_reference": OUT.json`` of an earlier run of the same prompts: each result gets
``kl_vs_reference``, :func:`mean_kl` of that run's logprobs against this one's). Each prompt
is run alone (sequentially), so its TTFT is its own. OUT: ``{"results": [{"tokens", "cached_tokens",
"ttft_s", "logprobs"}], "connector": {...timings and counters}, "startup_s"}``.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

DEFAULT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1",
               "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
               "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def mean_kl(ref, got) -> float | None:
    """The KL of two runs' logprobs (``results[i]["logprobs"]``): mean over the steps where the greedy
    tokens still agree of KL(ref || got) on ref's top-k (renormalised on that set; a token missing
    from got's top-k gets got's smallest logprob)."""
    if not ref or not got:
        return None
    vals = []
    for a, b in zip(ref, got):
        if not a or not b:
            break
        keys = list(a)
        pa = [math.exp(a[k]) for k in keys]
        floor = min(b.values())
        pb = [math.exp(b.get(k, floor)) for k in keys]
        za, zb = sum(pa), sum(pb)
        vals.append(sum((x / za) * math.log((x / za) / max(y / zb, 1e-30)) for x, y in zip(pa, pb) if x > 0))
        if max(a, key=a.get) != max(b, key=b.get):
            break
    return sum(vals) / len(vals) if vals else None


def kv_transfer_config(store) -> dict | None:
    if store is None:
        return None
    if store == "example" or (isinstance(store, dict) and store.get("kind") == "example"):
        path = store.get("path") if isinstance(store, dict) else None
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": path or "/tmp/kvz-example"}}
    if isinstance(store, dict) and store.get("kind") == "vllm":
        return {"kv_connector": store["connector"], "kv_role": "kv_both",
                "kv_connector_extra_config": dict(store.get("extra", {}))}
    extra = {k: v for k, v in store.items() if k != "kind"}
    return {"kv_connector": "KvzConnector", "kv_connector_module_path": "kvz.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def _connector():
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None
    except Exception:  # noqa: BLE001
        return None


def _dir_bytes(path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def _snapshot(conn, example_path=None) -> dict:
    out: dict = {"runs": []}
    if conn is not None and hasattr(conn, "store"):
        out.update({k: v for k, v in conn.timings.items()})
        out.update(getattr(type(conn), "scheduler_timings", {}))  # the scheduler's instance (same process)
        out.update({"stored_bytes": conn.store.counters["stored_bytes"], "raw_bytes": conn.store.counters["raw_bytes"],
                    "encode_s": conn.store.counters["encode_s"]})
        out["runs"] = list(conn.store.runs)
    if example_path is not None:
        out["stored_bytes"] = _dir_bytes(example_path) if os.path.isdir(example_path) else 0
    return out


def run(spec: dict) -> dict:
    for k, v in DEFAULT_ENV.items():
        os.environ.setdefault(k, v)
    import warnings

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    kw = {}
    ktc = kv_transfer_config(spec.get("store"))
    if ktc is not None:
        kw["kv_transfer_config"] = ktc
    mml = int(spec.get("max_model_len", 2048))
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), max_model_len=mml,
              max_num_batched_tokens=mml, enforce_eager=True, enable_prefix_caching=False,
              block_size=int(spec.get("block_size", 128)), seed=0, disable_log_stats=False,
              max_logprobs=int(spec.get("max_logprobs", 20)), **kw)
    startup = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=int(spec.get("max_tokens", 8)),
                        logprobs=int(spec.get("logprobs", 0)) or None, ignore_eos=True,
                        detokenize=bool(spec.get("detokenize", True)))
    sp1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    results = []
    caught = []
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for ids in spec.get("warmup_prompts", []):  # not measured: first-request costs of the engine and codec
            llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)
            conn = _connector()
            if conn is not None and hasattr(conn, "flush"):
                conn.flush()
        ex_path = (ktc or {}).get("kv_connector_extra_config", {}).get("shared_storage_path")
        for ids in spec["prompts"]:
            conn = _connector()
            if conn is not None and hasattr(conn, "flush"):
                conn.flush()
            before = _snapshot(conn, ex_path if ktc and ktc["kv_connector"] == "ExampleConnector" else None)
            probe: dict = {}
            if spec.get("ttft_probe"):  # a 1-token request first: wall and CPU seconds to the first token
                c1, t1 = time.process_time(), time.perf_counter()
                o1 = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp1, use_tqdm=False)[0]
                probe = {"ttft_probe_s": time.perf_counter() - t1, "ttft_cpu_s": time.process_time() - c1,
                         "probe_cached_tokens": int(o1.num_cached_tokens or 0)}
                if conn is not None and hasattr(conn, "flush"):
                    conn.flush()
                mid = _snapshot(conn, ex_path if ktc and ktc["kv_connector"] == "ExampleConnector" else None)
                probe["probe_delta"] = {k: mid[k] - before[k] for k in mid if isinstance(mid[k], (int, float))}
            t1 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], sp, use_tqdm=False)[0]
            wall = time.perf_counter() - t1
            if conn is not None and hasattr(conn, "flush"):
                conn.flush()
            after = _snapshot(conn, ex_path if ktc and ktc["kv_connector"] == "ExampleConnector" else None)
            m = getattr(out, "metrics", None)
            ttft = float(getattr(m, "first_token_latency", 0.0) or 0.0) or wall
            c = out.outputs[0]
            lps = None
            if c.logprobs:
                lps = [{str(t): float(lp.logprob) for t, lp in step.items()} for step in c.logprobs]
            delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))}
            delta["runs"] = after["runs"][len(before["runs"]):]
            results.append({"tokens": list(c.token_ids), "cached_tokens": int(out.num_cached_tokens or 0),
                            "ttft_s": ttft, "wall_s": wall, "logprobs": lps, "delta": delta, **probe})
        conn = _connector()
        if conn is not None and hasattr(conn, "flush"):
            conn.flush()
        caught = [f"{type(x.message).__name__}: {x.message}" for x in w]
    if spec.get("kl_reference"):
        with open(spec["kl_reference"]) as f:
            ref = json.load(f)["results"]
        for r, x in zip(ref, results):
            x["kl_vs_reference"] = mean_kl(r.get("logprobs"), x.get("logprobs"))
    info = {}
    if conn is not None and hasattr(conn, "store"):
        info = {"timings": dict(conn.timings), "counters": dict(conn.store.counters), "runs": list(conn.store.runs)}
        if hasattr(conn, "stats"):
            info["stats"] = conn.stats()
    return {"results": results, "connector": info, "startup_s": startup, "warnings": caught}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        spec = json.load(f)
    out = run(spec)
    with open(argv[1], "w") as f:
        json.dump(out, f)
    os._exit(0)  # the engine's threads need not wind down


if __name__ == "__main__":
    sys.exit(main())
