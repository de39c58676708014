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

import copy
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .harness import parser, write_json, write_text
from .lm import bf16, extract, forward_logits, greedy, kv_nrmse, log_softmax64, model, prefill, to_bf16
from .prompts import MAX_PROMPT_TOKENS, default_prompts
from .quality_report import format_table, quality_matched_rate  # noqa: F401 - this module's names too

__all__ = ["KV", "Setting", "run_quality", "default_prompts", "kvz_setting", "fp8_setting", "int4_setting",
           "identity_setting", "partial_setting", "quality_matched_rate", "format_table", "default_settings",
           "main"]


# ============================================================================ settings

class KV(dict):
    """K/V handed to a setting: ``{name: bf16 array [kv_heads, T, head_dim]}`` plus ``.fp32``, ``.metadata`` and
    ``.capture_stats`` (the prefill's :class:`alignpred.bank.CaptureStats`, when it was recorded: what kvz's attention
    scope weighs positions by, as ``kvz capture --attention-stats`` records it beside a cache)."""

    def __init__(self, tensors, fp32=None, metadata=None, capture_stats=None):
        super().__init__(tensors)
        self.fp32 = fp32 if fp32 is not None else {}
        self.metadata = metadata if metadata is not None else {}
        self.capture_stats = capture_stats


def capture_kv(lm, ids, source: str = "prompt", *, stats: bool = True) -> KV:
    """One prefill of ``ids`` through kvz's own capture (:func:`kvz.integrations.hf.capture.record_kv`: every
    position of every layer, sliding-window layers included; the exact RoPE in the metadata) as a :class:`KV`
    (bf16 tensors, ``.fp32``, kvz-cache ``.metadata``) with, when ``stats``, the prefill's attention statistics
    (``.capture_stats``, as ``kvz capture --attention-stats`` records them; eager attention)."""
    from kvz.integrations.hf.bridge import model_id_of
    from kvz.integrations.hf.capture import cache_metadata, record_kv
    from kvz.integrations.hf.querystats import capture_stats, capture_with_stats
    from kvz.integrations.hf.rope import rope_thetas

    ids = [int(t) for t in ids]
    if stats:
        tensors, spec, info, st = capture_with_stats(lm, ids)
    else:
        tensors, spec, info = record_kv(lm, ids, chunk=max(1, len(ids)))
    mid = model_id_of(lm)
    meta = cache_metadata(info["layer_types"], rope_thetas(lm, spec), ids, source, model=mid, rope=spec)
    fp32 = {k: v.detach().to("cpu").float().numpy().copy() for k, v in tensors.items()}
    cs = None
    if stats:
        pairing = spec.tables[0].pairing if spec is not None and spec.tables else "half"
        cs = capture_stats(lm, st, ids, model_id=mid, pairing=pairing)
    return KV({k: v.astype(bf16()) for k, v in fp32.items()}, fp32=fp32, metadata=meta, capture_stats=cs)


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


# -- FP8 / INT4: the codecs of kvz.benchmarks.baselines, decoded back to bf16 -----------------------------------

def baseline_setting_fixed(codec_name: str, knob, impl: str, method: str, **desc) -> Setting:
    """Every tensor through the baseline ``codec_name`` at ``knob``, decoded back to bf16; bpv from its bits."""
    from kvz.benchmarks.baselines import BASELINES

    codec = BASELINES[codec_name]

    def fn(kv, info):
        out, bits, n = {}, 0, 0
        for name, x in kv.items():
            enc = codec.encode(name, x, knob, {})
            out[name] = to_bf16(codec.decode(name, enc, x.shape, {}))
            bits += enc.bits
            n += x.size
        info["bpv"] = bits / n
        info["impl"] = impl
        return out

    return Setting(fn, method, **desc)


def fp8_setting() -> Setting:
    """FP8 e4m3 with a per-tensor float32 scale (amax / 448), decoded back to bf16."""
    return baseline_setting_fixed("fp8_e4m3", None, "kvz.benchmarks.baselines.fp8", "fp8", dtype="e4m3",
                                  scale="per-tensor")


def int4_setting(group: int = 32) -> Setting:
    """KIVI-style INT4: keys per channel (groups of ``group`` tokens), values per token (groups of channels),
    fp16 scale + zero per group; the whole cache is quantized (no full-precision recent window)."""
    return baseline_setting_fixed("kivi_int4", group, "kvz.benchmarks.baselines.kivi", "int4", group=group)


def kvz_setting(bank, eps: float, scope: str = "tensor", profile=None, config=None, **budget_kw) -> Setting:
    """kvz compress + decompress through a temporary .kvz file; records bpv (file bytes) and kvz's own NRMSE.
    ``bank`` is an :class:`alignpred.Bank` or a path; ``profile`` and ``config`` go to :func:`alignpred.compress`,
    the extra keywords (``tensor_cap``, ``weights``, ``lossless``, ...) to :meth:`alignpred.ErrorBudget.from_options`."""
    from alignpred import Bank, Cache, ErrorBudget, KvzReader, compress
    from alignpred.cache import infer_layout

    if isinstance(bank, (str, os.PathLike)):
        bank = Bank.load(bank)

    def fn(kv, info):
        tensors = {k: np.ascontiguousarray(v) for k, v in kv.items()}
        meta = {k: v for k, v in (kv.metadata or {}).items()}
        cache = Cache(tensors, meta, infer_layout(tensors, meta))
        with tempfile.TemporaryDirectory(prefix="kvz-quality-") as d:
            path = os.path.join(d, "c.kvz")
            t0 = time.perf_counter()
            extra = {"capture_stats": kv.capture_stats} if scope == "attention" and getattr(
                kv, "capture_stats", None) is not None else {}
            budget = ErrorBudget.from_options(eps=eps, scope=scope, **budget_kw, **extra)
            ci = compress(cache, path, budget=budget, bank=bank, profile=profile, config=config)
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

    from kvz.integrations.hf.bridge import cache_from_kv, text_config
    from kvz.integrations.hf.gemma import cache_metadata, layer_info

    if free_run not in ("tf", "steps"):
        raise ValueError("free_run must be 'tf' or 'steps'")
    if new_tokens < 1:
        raise ValueError("new_tokens must be >= 1")
    t_start = time.perf_counter()
    lm, tok = model()
    t_load = time.perf_counter() - t_start
    if prompts is None:
        prompts = default_prompts(n_prompts, prompt_tokens, sources=sources, tokenizer=tok)
    cfg = text_config(lm)
    n_layers = cfg.num_hidden_layers
    layer_types, thetas = layer_info(cfg)
    b16 = bf16()

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
            live = prefill(lm, ids[:-1])
            fp32 = extract(live, n_layers)
            t_pre = time.perf_counter() - t0
            live_tf = copy.deepcopy(live)
            t0 = time.perf_counter()
            cont = greedy(lm, live, ids[-1], new_tokens)
            t_greedy = time.perf_counter() - t0
            del live
            path = [ids[-1]] + cont[:-1]
            t0 = time.perf_counter()
            ref_lp = log_softmax64(forward_logits(lm, live_tf, path))
            del live_tf
            ref_p = ref_lp.exp()
            ref_top = ref_lp.argmax(-1)
            cont_t = torch.tensor(cont)
            t_tf = time.perf_counter() - t0
            meta = cache_metadata(layer_types, thetas, ids[:-1], pr.get("source", "prompt"))
            kv = KV({k: v.astype(b16) for k, v in fp32.items()}, fp32=fp32, metadata=meta)
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
                nr_pool, nr_max = kv_nrmse(kv, rec)
                nr_pool32, nr_max32 = kv_nrmse(fp32, rec)
                lp = log_softmax64(forward_logits(lm, cache_from_kv(lm, rec), path))
                kl = (ref_p * (ref_lp - lp)).sum(-1).clamp_min(0.0)
                top = lp.argmax(-1)
                miss = (top != cont_t).nonzero()
                first_div = int(miss[0, 0]) if len(miss) else new_tokens
                row = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                       "top1_agree": float((top == ref_top).double().mean()), "first_div": first_div,
                       "identical": first_div == new_tokens, "nrmse_pooled": nr_pool, "nrmse_max": nr_max,
                       "nrmse_pooled_fp32": nr_pool32, "nrmse_max_fp32": nr_max32, **info}
                if free_run == "steps":
                    gen = greedy(lm, cache_from_kv(lm, rec), ids[-1], new_tokens, stop_at=cont)
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


def main(argv=None) -> int:
    ap = parser(__doc__, prog="python -m kvz.benchmarks.quality", quiet=True)
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
    a = ap.parse_args(argv)
    eps = [float(x) for x in a.eps.split(",") if x.strip()]
    settings = default_settings(a.bank, eps, a.scope, breakdown=not a.no_breakdown, int4_group=a.int4_group)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = dict(bank=os.path.basename(str(a.bank)), eps=eps, scope=a.scope, sources=a.sources)

    def checkpoint(partial):
        partial["config"].update(extra, partial=True)
        write_json(partial, out / "quality.partial.json")
        write_text(out / "quality.partial.md", format_table(partial) + "\n")

    res = run_quality(settings, n_prompts=a.prompts, prompt_tokens=a.tokens, new_tokens=a.new_tokens,
                      progress=not a.quiet, free_run=a.free_run, sources=a.sources, on_prompt=checkpoint)
    res["config"].update(extra)
    write_json(res, out / "quality.json")
    for f in ("quality.partial.json", "quality.partial.md"):
        (out / f).unlink(missing_ok=True)
    table = format_table(res)
    write_text(out / "quality.md", table + "\n")
    print(table)
    t = res["timing"]
    print(f"\n{len(res['prompts'])} prompts x {a.new_tokens} tokens; total {t['total_s']:.0f}s "
          f"(model load {t['load_s']:.0f}s, prefill {t['prefill_s']:.0f}s, reference greedy "
          f"{t['reference_greedy_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
