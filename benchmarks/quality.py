"""Downstream quality of a compressed KV cache: does the model still say the same thing?

For each prompt (a window of real text, BOS first) Gemma 3 270M prefills ``prompt[:-1]`` and its full K/V
(every layer; keys post-RoPE as the model stores them) is captured.  The *full* run then feeds the last prompt
token with that cache and decodes ``new_tokens`` tokens greedily - the reference continuation ``c``.  For each
*setting* (a callable ``restore(kv) -> kv`` that compresses and decompresses the K/V) the restored K/V is injected
into a fresh model cache (each layer's own ``update()``, so sliding layers keep what they would after a real
prefill) and the model is run teacher-forced over ``[prompt[-1], c_1 .. c_{n-1}]`` in one pass.  Metrics:

* ``kl_mean`` - mean per-token KL(full || restored) of the next-token distribution along the full run's path
  (log-softmax and KL in float64; float32 shows a false floor near 1.5e-5);
* ``top1_agree`` - fraction of those positions where the restored argmax equals the full run's argmax;
* ``identical_frac`` / ``first_div_mean`` - fraction of greedy continuations identical to the full one, and the
  mean position of the first differing token (``new_tokens`` when identical).  A greedy free run with the restored
  cache follows ``c`` exactly up to the first position where its argmax differs from ``c``, so by default
  (``free_run="tf"``) the first divergence is read off the teacher-forced pass; ``free_run="steps"`` decodes step
  by step (stopping at the first divergence) and reports both, as a check of that shortcut;
* ``nrmse_pooled`` / ``nrmse_max`` - measured NRMSE of the restored K/V against the setting's input (the cache at
  its stored precision, bfloat16), and ``nrmse_pooled_fp32`` against the model's float32 K/V;
* ``bpv`` - bits per value where the setting knows it (kvz: file size; FP8/INT4: payload + scales).

Settings get a :class:`KV` (a dict ``layers.{i}.key|value -> numpy [kv_heads, T, head_dim]`` in bfloat16 via
ml_dtypes, i.e. at the stored precision) with ``.fp32`` (the model's float32 K/V) and ``.metadata`` (kvz-cache
metadata: layer types, RoPE thetas, ...).  :func:`identity_setting` gives the two floors ("identity fp32": the
model's own K/V, must be exact; "bf16 cast": the storage precision every other setting starts from).

:func:`quality_matched_rate` interpolates log(KL) against bpv across the kvz eps sweep to find the rate at which
kvz is as good downstream as FP8 (and the other baselines).

Run standalone::

    python -m kvz.benchmarks.quality --bank gemma-3-270m --eps 0.01,0.0267,0.05 --prompts 20 --out DIR
"""
from __future__ import annotations

import argparse
import copy
import glob
import inspect
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TEXT_SOURCES = {
    "eval": ("samples/texts/*.txt", "samples/texts/eval/*.txt"),
    "calib": ("samples/gemma3-270m/calib_texts/*.txt",),
}
MAX_PROMPT_TOKENS = 500  # default HF cache keeps the last 511 positions of sliding layers; stay below

__all__ = ["KV", "Setting", "run_quality", "default_prompts", "kvz_setting", "fp8_setting", "int4_setting",
           "identity_setting", "partial_setting", "quality_matched_rate", "format_table", "default_settings",
           "main"]


# ============================================================================ settings

class KV(dict):
    """K/V handed to a setting: ``{name: bf16 array [kv_heads, T, head_dim]}`` plus ``.fp32`` and ``.metadata``."""

    def __init__(self, tensors, fp32=None, metadata=None):
        super().__init__(tensors)
        self.fp32 = fp32 if fp32 is not None else {}
        self.metadata = metadata if metadata is not None else {}


class Setting:
    """A restore callable with descriptive fields; ``info`` holds what the last call measured (e.g. bpv)."""

    def __init__(self, fn: Callable, method: str, eps: float | None = None, role: str = "main", **desc):
        self.fn = fn
        self.method = method
        self.eps = eps
        self.role = role
        self.desc = desc
        self.info: dict = {}

    def __call__(self, kv: KV) -> dict:
        memo = getattr(self, "_memo", None)
        if memo is not None and memo[0] is kv:  # same input again (a breakdown reusing a main setting): reuse
            self.info = dict(memo[2])
            return memo[1]
        self.info = {}
        out = self.fn(kv, self.info)
        self._memo = (kv, out, dict(self.info))
        return out

    def describe(self) -> dict:
        return {"method": self.method, "eps": self.eps, "role": self.role, **self.desc}


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _to_bf16(y) -> np.ndarray:
    """Cast a reconstruction to bfloat16 the way a real store would (float32 detour)."""
    y = np.asarray(y)
    return y if y.dtype == _bf16() else y.astype(np.float32).astype(_bf16())


def identity_setting(precision: str = "fp32") -> Setting:
    """``"fp32"``: the model's own float32 K/V (must reproduce the full run exactly); ``"bf16"``: the bf16 cast."""
    if precision not in ("fp32", "bf16"):
        raise ValueError("precision must be 'fp32' or 'bf16'")

    def fn(kv, info):
        info["bpv"] = 32.0 if precision == "fp32" else 16.0
        if precision == "fp32":
            if not kv.fp32:
                raise ValueError("identity fp32 needs kv.fp32")
            return dict(kv.fp32)
        return dict(kv)

    return Setting(fn, "identity" if precision == "fp32" else "bf16", precision=precision)


# -- FP8 / INT4: reuse benchmarks.baselines when present, small local versions otherwise -------------------------

def _fp8_local(x: np.ndarray):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.float8_e4m3fn)
    mx = float(ml_dtypes.finfo(dt).max)
    x32 = x.astype(np.float32)
    amax = float(np.abs(x32).max()) if x32.size else 0.0
    scale = np.float32(amax / mx if amax > 0 else 1.0)
    q = np.clip(x32 / scale, -mx, mx).astype(dt)
    return q.astype(np.float32) * scale, x.size * 8 + 32


def _kivi_local(x: np.ndarray, is_key: bool, bits: int, G: int):
    x32 = x.astype(np.float32)
    xt = np.swapaxes(x32, -1, -2) if is_key else x32  # keys: groups along tokens (per channel)
    n = xt.shape[-1]
    G = min(G, n)
    pad = (-n) % G
    if pad:
        xt = np.concatenate([xt, np.repeat(xt[..., -1:], pad, axis=-1)], axis=-1)
    g = xt.reshape(*xt.shape[:-1], -1, G)
    mn, mxv = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    levels = (1 << bits) - 1
    zero = mn.astype(np.float16).astype(np.float32)
    scale = ((mxv - mn) / levels).astype(np.float16).astype(np.float32)
    q = np.clip(np.rint((g - zero) / np.where(scale > 0, scale, 1.0)), 0, levels)
    y = (q * scale + zero).reshape(*xt.shape[:-1], -1)[..., :n]
    y = np.swapaxes(y, -1, -2) if is_key else y
    return y, x.size * bits + 32 * scale.size


def _baseline_codec(name: str):
    try:
        from kvz.benchmarks.baselines import BASELINES

        return BASELINES[name]
    except Exception:
        return None


def _run_codec(codec, name, x):
    enc = codec.encode(name, x, getattr(codec, "_q_knob", None), {})
    return codec.decode(name, enc, x.shape, {}), enc.bits


def fp8_setting() -> Setting:
    """FP8 e4m3 with a per-tensor float32 scale (amax / 448), decoded back to bf16."""
    codec = _baseline_codec("fp8_e4m3")

    def fn(kv, info):
        out, bits, n = {}, 0, 0
        for name, x in kv.items():
            if codec is not None:
                enc = codec.encode(name, x, None, {})
                y, b = codec.decode(name, enc, x.shape, {}), enc.bits
            else:
                y, b = _fp8_local(x)
            out[name] = _to_bf16(y)
            bits += b
            n += x.size
        info["bpv"] = bits / n
        info["impl"] = "kvz.benchmarks.baselines.fp8" if codec is not None else "local"
        return out

    return Setting(fn, "fp8", dtype="e4m3", scale="per-tensor")


def int4_setting(group: int = 32) -> Setting:
    """KIVI-style INT4: keys per channel (groups of ``group`` tokens), values per token (groups of channels),
    fp16 scale + zero per group; the whole cache is quantized (no full-precision recent window)."""
    codec = _baseline_codec("kivi_int4")

    def fn(kv, info):
        out, bits, n = {}, 0, 0
        for name, x in kv.items():
            if codec is not None:
                enc = codec.encode(name, x, group, {})
                y, b = codec.decode(name, enc, x.shape, {}), enc.bits
            else:
                y, b = _kivi_local(x, name.endswith("key"), 4, group)
            out[name] = _to_bf16(y)
            bits += b
            n += x.size
        info["bpv"] = bits / n
        info["impl"] = "kvz.benchmarks.baselines.kivi" if codec is not None else "local"
        return out

    return Setting(fn, "int4", group=group)


def kvz_setting(bank, eps: float, scope: str = "tensor", **kw) -> Setting:
    """kvz compress + decompress through a temporary .kvz file; records bpv (file bytes) and kvz's own NRMSE.
    ``bank`` is an :class:`alignpred.Bank` or a path; extra keywords go to :func:`alignpred.compress`."""
    from alignpred import Bank, KvzReader, compress
    from alignpred.cache.cachefile import Cache
    from alignpred.cache.layout import infer_layout

    if isinstance(bank, (str, os.PathLike)):
        bank = Bank.load(bank)

    def fn(kv, info):
        tensors = {k: np.ascontiguousarray(v) for k, v in kv.items()}
        meta = {k: v for k, v in (kv.metadata or {}).items()}
        cache = Cache(tensors, meta, infer_layout(tensors, meta))
        with tempfile.TemporaryDirectory(prefix="kvz-quality-") as d:
            path = os.path.join(d, "c.kvz")
            t0 = time.perf_counter()
            ci = compress(cache, path, eps=eps, bank=bank, scope=scope, **kw)
            t1 = time.perf_counter()
            out = KvzReader(path, bank=bank).read()
            t2 = time.perf_counter()
            out = {k: np.array(v) for k, v in out.items()}  # own the memory before the file goes
        info.update(bpv=ci.bpv, kvz_nrmse_pooled=ci.nrmse_pooled, kvz_nrmse_max=ci.nrmse_max_tensor,
                    encode_s=t1 - t0, decode_s=t2 - t1)
        return out

    return Setting(fn, "kvz", eps=eps, scope=scope)


def partial_setting(base: Setting, keys: bool = True, values: bool = True, protect_tokens: int = 0,
                    role: str = "breakdown") -> Setting:
    """Where does the error go: apply ``base`` to the whole cache, then keep its reconstruction only for keys
    and/or values, and optionally put the first ``protect_tokens`` positions (the attention sink) back exactly.
    bpv is the base's, plus 16 bits per protected value (an upper bound for storing them raw)."""

    def fn(kv, info):
        y = base(kv)
        info.update(base.info)
        out = {}
        for name, x in kv.items():
            use = keys if name.endswith("key") else values
            r = np.array(y[name]) if use else np.array(x)
            if protect_tokens:
                r[:, :protect_tokens] = x[:, :protect_tokens]
            out[name] = r
        if "bpv" in info and protect_tokens:
            T = next(iter(kv.values())).shape[-2]
            info["bpv"] = info["bpv"] + 16.0 * min(protect_tokens, T) / T
        return out

    parts = "keys+values" if keys and values else ("keys only" if keys else "values only")
    return Setting(fn, base.method, eps=base.eps, role=role, base=base.describe(), compressed=parts,
                   protect_tokens=protect_tokens, **{k: v for k, v in base.desc.items() if k == "scope"})


# ============================================================================ prompts

def _text_files(sources) -> list[tuple[str, Path]]:
    if isinstance(sources, str):
        sources = ("eval", "calib") if sources == "all" else (sources,)
    out = []
    for split in sources:
        if split not in TEXT_SOURCES:
            raise ValueError(f"unknown text source {split!r}; use {', '.join(TEXT_SOURCES)} or 'all'")
        for pat in TEXT_SOURCES[split]:
            out += [(split, Path(p)) for p in sorted(glob.glob(str(ROOT / pat)))]
    return out


def default_prompts(n: int = 20, tokens: int = 256, *, sources="eval", tokenizer=None) -> list[dict]:
    """``n`` prompts of ``tokens`` tokens (BOS + a window of ``tokens - 1`` document tokens), spread round-robin
    over the documents of ``sources`` (``"eval"``: samples/texts/*.txt and samples/texts/eval/* - held out from
    calibration; ``"calib"``: samples/gemma3-270m/calib_texts/*; ``"all"``); windows of one document are evenly
    spaced and do not overlap when the document is long enough.  Returns dicts with ``kind`` (document name),
    ``source`` (repo-relative path), ``split``, ``start`` (token offset in the document) and ``token_ids``."""
    if not 2 <= tokens <= MAX_PROMPT_TOKENS:
        raise ValueError(f"tokens must be in 2..{MAX_PROMPT_TOKENS} (sliding layers keep 511 positions)")
    if n < 1:
        raise ValueError("n must be >= 1")
    if tokenizer is None:
        tokenizer = _model()[1]
    files = _text_files(sources)
    if not files:
        raise FileNotFoundError(f"no texts for sources {sources!r} under {ROOT}")
    docs = []
    for split, p in files:
        ids = list(tokenizer(p.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
        bos = tokenizer.bos_token_id
        if ids and ids[0] == bos:
            ids = ids[1:]
        docs.append((split, p, ids))
    per = [n // len(docs) + (1 if i < n % len(docs) else 0) for i in range(len(docs))]
    w = tokens - 1
    prompts_by_doc = []
    for (split, p, ids), k in zip(docs, per):
        if k == 0:
            prompts_by_doc.append([])
            continue
        if len(ids) < w:
            raise ValueError(f"{p} has {len(ids)} tokens, fewer than the {w} a window needs")
        span = len(ids) - w
        # evenly spaced from the document's start to its end (disjoint when span >= (k - 1) * w)
        starts = [round(i * span / (k - 1)) for i in range(k)] if k > 1 else [0]
        rel = str(p.relative_to(ROOT))
        prompts_by_doc.append([{"kind": p.stem, "source": rel, "split": split, "start": s,
                                "token_ids": [tokenizer.bos_token_id] + ids[s:s + w]} for s in starts])
    out = []
    for r in range(max(per)):  # round-robin so a prefix of the list still covers every kind
        out += [ps[r] for ps in prompts_by_doc if r < len(ps)]
    return out


# ============================================================================ the model

_MODEL = None


def _model():
    global _MODEL
    if _MODEL is None:
        import torch

        from kvz.integrations.hf.gemma import load_gemma

        torch.set_num_threads(min(2, os.cpu_count() or 1) if "KVZ_THREADS" not in os.environ
                              else int(os.environ["KVZ_THREADS"]))
        _MODEL = load_gemma("cpu")
    return _MODEL


def _cache_kw(model) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _text_config(model):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def _new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=_text_config(model))


def _extract(cache, n_layers) -> dict:
    """float32 numpy K/V ``{layers.i.key: [kv_heads, T, head_dim]}`` of a (non-overflowed) DynamicCache."""
    out = {}
    for i in range(n_layers):
        layer = cache.layers[i]
        out[f"layers.{i}.key"] = layer.keys[0].detach().to("cpu").float().numpy().copy()
        out[f"layers.{i}.value"] = layer.values[0].detach().to("cpu").float().numpy().copy()
    return out


def inject(model, tensors: dict):
    """A fresh model cache holding ``tensors`` (any float dtype, ``[kv_heads, T, head_dim]``), fed through each
    layer's own ``update()`` so sliding layers keep what they would keep after a real prefill."""
    import torch

    cfg = _text_config(model)
    cache = _new_cache(model)
    dtype = next(model.parameters()).dtype
    for i in range(cfg.num_hidden_layers):
        k = torch.from_numpy(np.asarray(tensors[f"layers.{i}.key"], dtype=np.float32))[None].to(dtype)
        v = torch.from_numpy(np.asarray(tensors[f"layers.{i}.value"], dtype=np.float32))[None].to(dtype)
        cache.update(k, v, i)
    return cache


def _prefill(model, ids):
    import torch

    cache = _new_cache(model)
    base = getattr(model, "model", model)
    base(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True, **{_cache_kw(base): cache})
    return cache


def _forward_logits(model, cache, ids):
    import torch

    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True, **{_cache_kw(model): cache})
    return out.logits[0]


def _greedy(model, cache, first, n, stop_at=None):
    """Greedy decode ``n`` tokens after feeding ``first``; with ``stop_at`` (the reference continuation) stop at
    the first token that differs.  Returns the generated tokens."""
    toks, cur = [], first
    for t in range(n):
        logits = _forward_logits(model, cache, [cur])[-1]
        cur = int(logits.argmax())
        toks.append(cur)
        if stop_at is not None and cur != stop_at[t]:
            break
    return toks


def _log_softmax64(logits):
    return logits.double().log_softmax(-1)


def _nrmse(ref: dict, rec: dict) -> tuple[float, float]:
    te = tn = 0.0
    mx = 0.0
    for k, x in ref.items():
        x64 = np.asarray(x, dtype=np.float64)
        d = np.asarray(rec[k], dtype=np.float64) - x64
        e, n = float(np.vdot(d, d)), float(np.vdot(x64, x64))
        te, tn = te + e, tn + n
        mx = max(mx, math.sqrt(e / n) if n > 0 else 0.0)
    return (math.sqrt(te / tn) if tn > 0 else 0.0), mx


# ============================================================================ the benchmark

def run_quality(settings: dict, prompts: list | None = None, n_prompts: int = 20, prompt_tokens: int = 256,
                new_tokens: int = 64, progress: bool = True, *, free_run: str = "tf",
                sources="eval", on_prompt: Callable | None = None) -> dict:
    """Run every setting on every prompt; see the module docstring for the metrics.

    ``settings``: ``{name: callable(kv) -> dict}`` (plain callables or :class:`Setting`; a Setting's ``info``
    supplies bpv).  ``prompts``: from :func:`default_prompts` (made with ``n_prompts``/``prompt_tokens``/
    ``sources`` when None) or any ``[{"token_ids": [...]} ...]``.  ``free_run``: ``"tf"`` (first divergence from
    the teacher-forced pass) or ``"steps"`` (also decode greedily, stopping at the first divergence).
    ``on_prompt``: called with the results so far after each prompt (for checkpoints).
    Returns ``{"prompts": [...], "settings": {name: metrics}, "quality_matched": ..., "config": ..., "timing": ...}``.
    """
    import torch

    from kvz.integrations.hf.gemma import cache_metadata, layer_info

    if free_run not in ("tf", "steps"):
        raise ValueError("free_run must be 'tf' or 'steps'")
    if new_tokens < 1:
        raise ValueError("new_tokens must be >= 1")
    t_start = time.perf_counter()
    model, tok = _model()
    t_load = time.perf_counter() - t_start
    if prompts is None:
        prompts = default_prompts(n_prompts, prompt_tokens, sources=sources, tokenizer=tok)
    cfg = _text_config(model)
    n_layers = cfg.num_hidden_layers
    layer_types, thetas = layer_info(cfg)
    bf16 = _bf16()

    cfg_out = {"n_prompts": len(prompts), "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
               "free_run": free_run, "kv_dtype": "bfloat16",
               "convention": "prefill prompt[:-1]; inject the (restored) K/V; feed prompt[-1]; greedy"}
    per_setting = {name: [] for name in settings}
    timing = {name: 0.0 for name in settings}
    prompt_meta = []

    def log(msg):
        if progress:
            print(msg, file=sys.stderr, flush=True)

    with torch.inference_mode():
        for pi, pr in enumerate(prompts):
            ids = [int(t) for t in pr["token_ids"]]
            if not 2 <= len(ids) <= MAX_PROMPT_TOKENS + 1:
                raise ValueError(f"prompt {pi}: {len(ids)} tokens; use 2..{MAX_PROMPT_TOKENS}")
            t0 = time.perf_counter()
            live = _prefill(model, ids[:-1])
            fp32 = _extract(live, n_layers)
            t_pre = time.perf_counter() - t0
            live_tf = copy.deepcopy(live)
            t0 = time.perf_counter()
            cont = _greedy(model, live, ids[-1], new_tokens)
            t_greedy = time.perf_counter() - t0
            del live
            path = [ids[-1]] + cont[:-1]
            t0 = time.perf_counter()
            ref_lp = _log_softmax64(_forward_logits(model, live_tf, path))
            del live_tf
            ref_p = ref_lp.exp()
            ref_top = ref_lp.argmax(-1)
            cont_t = torch.tensor(cont)
            t_tf = time.perf_counter() - t0
            meta = cache_metadata(layer_types, thetas, ids[:-1], pr.get("source", "prompt"))
            kv = KV({k: v.astype(bf16) for k, v in fp32.items()}, fp32=fp32, metadata=meta)
            pm = {k: v for k, v in pr.items() if k != "token_ids"}
            pm.update(n_tokens=len(ids), continuation=cont,
                      ref_tf_matches_greedy=bool((ref_top == cont_t).all()),
                      seconds={"prefill": round(t_pre, 3), "greedy": round(t_greedy, 3), "tf": round(t_tf, 3)})
            prompt_meta.append(pm)
            for name, restore in settings.items():
                ts = time.perf_counter()
                rec = restore(kv)
                info = dict(getattr(restore, "info", {}) or {})
                t_restore = time.perf_counter() - ts
                nr_pool, nr_max = _nrmse(kv, rec)
                nr_pool32, nr_max32 = _nrmse(fp32, rec)
                lp = _log_softmax64(_forward_logits(model, inject(model, rec), path))
                kl = (ref_p * (ref_lp - lp)).sum(-1).clamp_min(0.0)
                top = lp.argmax(-1)
                miss = (top != cont_t).nonzero()
                first_div = int(miss[0, 0]) if len(miss) else new_tokens
                row = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                       "top1_agree": float((top == ref_top).double().mean()), "first_div": first_div,
                       "identical": first_div == new_tokens, "nrmse_pooled": nr_pool, "nrmse_max": nr_max,
                       "nrmse_pooled_fp32": nr_pool32, "nrmse_max_fp32": nr_max32, **info}
                if free_run == "steps":
                    gen = _greedy(model, inject(model, rec), ids[-1], new_tokens, stop_at=cont)
                    d = next((t for t, (a, b) in enumerate(zip(gen, cont)) if a != b), new_tokens)
                    row["first_div_tf"] = first_div
                    row["first_div"] = d
                    row["identical"] = d == new_tokens
                row["seconds"] = time.perf_counter() - ts
                row["restore_s"] = t_restore
                timing[name] += row["seconds"]
                per_setting[name].append(row)
            if on_prompt is not None:
                on_prompt(_aggregate(settings, per_setting, prompt_meta, cfg_out, timing))
            log(f"[quality] prompt {pi + 1}/{len(prompts)} {pr.get('kind', '')} ({len(ids)} tok): "
                f"prefill {t_pre:.1f}s greedy {t_greedy:.1f}s; " + ", ".join(
                    f"{n}: KL {per_setting[n][-1]['kl_mean']:.2e} div {per_setting[n][-1]['first_div']}"
                    for n in settings))

    results = _aggregate(settings, per_setting, prompt_meta, cfg_out, timing)
    results["timing"]["load_s"] = t_load
    results["timing"]["total_s"] = time.perf_counter() - t_start
    return results


def _aggregate(settings, per_setting, prompt_meta, config, timing) -> dict:
    results = {"model": "gemma-3-270m", "config": dict(config, n_prompts_done=len(prompt_meta)),
               "prompts": prompt_meta, "settings": {}}
    for name, rows in per_setting.items():
        restore = settings[name]
        desc = restore.describe() if hasattr(restore, "describe") else {"method": name, "role": "main"}
        agg = {**desc, "n": len(rows)}
        if rows:
            agg.update(
                identical_frac=float(np.mean([r["identical"] for r in rows])),
                first_div_mean=float(np.mean([r["first_div"] for r in rows])),
                kl_mean=float(np.mean([r["kl_mean"] for r in rows])),
                kl_median_prompt=float(np.median([r["kl_mean"] for r in rows])),
                kl_max=float(np.max([r["kl_max"] for r in rows])),
                top1_agree=float(np.mean([r["top1_agree"] for r in rows])),
                nrmse_pooled=float(np.mean([r["nrmse_pooled"] for r in rows])),
                nrmse_max=float(np.max([r["nrmse_max"] for r in rows])),
                nrmse_pooled_fp32=float(np.mean([r["nrmse_pooled_fp32"] for r in rows])),
                seconds=timing[name])
            if all("bpv" in r for r in rows):
                agg["bpv"] = float(np.mean([r["bpv"] for r in rows]))
            if all("first_div_tf" in r for r in rows):
                agg["first_div_tf_mean"] = float(np.mean([r["first_div_tf"] for r in rows]))
                agg["free_run_matches_tf"] = float(np.mean([r["first_div_tf"] == r["first_div"] for r in rows]))
        agg["per_prompt"] = rows
        results["settings"][name] = agg
    results["quality_matched"] = quality_matched_rate(results)
    results["timing"] = {"per_setting_s": dict(timing),
                         "prefill_s": sum(p["seconds"]["prefill"] for p in prompt_meta),
                         "reference_greedy_s": sum(p["seconds"]["greedy"] for p in prompt_meta),
                         "reference_tf_s": sum(p["seconds"]["tf"] for p in prompt_meta)}
    return results


# ============================================================================ quality-matched rate

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

def default_settings(bank, eps_list, scope="tensor", breakdown_eps=None, breakdown=True, int4_group=32) -> dict:
    """identity fp32, bf16 cast, kvz at each eps, FP8 e4m3, INT4 KIVI; plus the error breakdown (keys only /
    values only / token 0 protected) for kvz at ``breakdown_eps`` (default: the eps nearest 0.0267, FP8-level
    error) and for FP8."""
    from alignpred import Bank

    if isinstance(bank, (str, os.PathLike)):
        bank = Bank.load(bank)
    s = {"identity fp32": identity_setting("fp32"), "bf16 cast": identity_setting("bf16")}
    for e in eps_list:
        s[f"kvz eps={e:g}"] = kvz_setting(bank, e, scope)
    s["fp8 e4m3"] = fp8_setting()
    s[f"int4 kivi g{int4_group}"] = int4_setting(int4_group)
    if breakdown and eps_list:
        be = breakdown_eps if breakdown_eps is not None else min(eps_list, key=lambda e: abs(math.log(e / 0.0267)))
        kb = s.get(f"kvz eps={be:g}") or kvz_setting(bank, be, scope)  # shared: its output is memoized per prompt
        fb = s["fp8 e4m3"]
        s[f"kvz eps={be:g} keys only"] = partial_setting(kb, values=False)
        s[f"kvz eps={be:g} values only"] = partial_setting(kb, keys=False)
        s[f"kvz eps={be:g} token0 exact"] = partial_setting(kb, protect_tokens=1)
        s["fp8 keys only"] = partial_setting(fb, values=False)
        s["fp8 values only"] = partial_setting(fb, keys=False)
        s["fp8 token0 exact"] = partial_setting(fb, protect_tokens=1)
    return s


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.bool_):
        return bool(o)
    raise TypeError(type(o))


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default))
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvz.benchmarks.quality", description=__doc__.split("\n")[0])
    ap.add_argument("--bank", required=True, help="calibration bank (.h5)")
    ap.add_argument("--eps", default="0.01,0.0267,0.05", help="comma-separated kvz eps values")
    ap.add_argument("--scope", default="tensor", choices=("tensor", "pooled"))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=256, help="prompt length in tokens (BOS included)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--sources", default="eval", choices=("eval", "calib", "all"))
    ap.add_argument("--free-run", default="tf", choices=("tf", "steps"))
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--int4-group", type=int, default=32)
    ap.add_argument("--out", required=True, help="output directory (quality.json, quality.md)")
    ap.add_argument("-q", "--quiet", action="store_true")
    a = ap.parse_args(argv)
    eps = [float(x) for x in a.eps.split(",") if x.strip()]
    settings = default_settings(a.bank, eps, a.scope, breakdown=not a.no_breakdown, int4_group=a.int4_group)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = dict(bank=os.path.basename(str(a.bank)), eps=eps, scope=a.scope, sources=a.sources)

    def checkpoint(partial):
        partial["config"].update(extra, partial=True)
        _write_json(out / "quality.partial.json", partial)
        (out / "quality.partial.md").write_text(format_table(partial) + "\n")

    res = run_quality(settings, n_prompts=a.prompts, prompt_tokens=a.tokens, new_tokens=a.new_tokens,
                      progress=not a.quiet, free_run=a.free_run, sources=a.sources, on_prompt=checkpoint)
    res["config"].update(extra)
    _write_json(out / "quality.json", res)
    for f in ("quality.partial.json", "quality.partial.md"):
        (out / f).unlink(missing_ok=True)
    table = format_table(res)
    (out / "quality.md").write_text(table + "\n")
    print(table)
    t = res["timing"]
    print(f"\n{len(res['prompts'])} prompts x {a.new_tokens} tokens; total {t['total_s']:.0f}s "
          f"(model load {t['load_s']:.0f}s, prefill {t['prefill_s']:.0f}s, reference greedy "
          f"{t['reference_greedy_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
