"""The methods of the rate-quality benchmark (:mod:`.rate_quality`): kvz curves (:data:`KVZ_VARIANTS`) and
every registered baseline of ``kvz.benchmarks.baselines`` at its natural rates or searched error levels, each
as a :class:`~kvz.benchmarks.quality.Setting` with a ``curve`` (the method) and a ``label`` (the point)."""
from __future__ import annotations

import re

import numpy as np

from .lm import to_bf16
from .quality import Setting, identity_setting, kvz_setting

FP8 = "fp8_e4m3"
REFERENCE_METHOD = "fp8"

# kvz curves: name -> alignpred.compress keywords (scope, tensor_cap, config, ...) or {"fn": callable(kv, eps) ->
# (restored, bits)}.  One line adds a variant; its eps sweep comes from PRESETS (key "*" when not listed).
KVZ_VARIANTS: dict[str, dict] = {
    "kvz-tensor": dict(scope="tensor"),
    "kvz-pooled-cap3": dict(scope="pooled", tensor_cap=3.0),
    "kvz-pooled-nocap": dict(scope="pooled", tensor_cap=0.0),
    # error where the model is sensitive: per-tensor weights from the bank's sensitivity record
    # (measured on the calibration texts by benchmarks/studies/rate/sensitivity.py), tensor cap 3
    "kvz-weighted": dict(scope="weighted", tensor_cap=3.0),
    # error where attention reads the cache (format 1.3): the weighted budget in the attention measure, channels by
    # the bank's attention statistics, positions by the prefill's attention (the KV carries its CaptureStats), the
    # positions a sliding-window layer never attends again coarse
    "kvz-attention": dict(scope="attention", tensor_cap=3.0),
}


def label_num(x: float) -> str:
    """A knob or eps as a point label."""
    return f"{x:g}"


def add_kvz_variant(name: str, **spec) -> None:
    """Register a kvz curve: ``alignpred.compress`` keywords, or ``fn=callable(kv, eps) -> (restored, bits)``."""
    KVZ_VARIANTS[name] = dict(spec)


def kvz_variant_setting(name: str, eps: float, bank, spec: dict | None = None) -> Setting:
    """One kvz point: :func:`kvz.benchmarks.quality.kvz_setting` with the variant's keywords, or its ``fn``."""
    spec = dict(KVZ_VARIANTS[name] if spec is None else spec)
    fn = spec.pop("fn", None)
    if fn is None:
        s = kvz_setting(bank, eps, **spec)
    else:
        def run(kv, info, fn=fn):
            rec, bits = fn(kv, eps)
            info["bpv"] = float(bits) / sum(x.size for x in kv.values())
            return {k: np.asarray(v) for k, v in rec.items()}

        s = Setting(run, "kvz", eps=eps, **{k: v for k, v in spec.items() if isinstance(v, (str, int, float))})
    s.curve = name
    s.label = f"eps={label_num(eps)}"
    return s


def codec_points(name: str):
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
    m = re.fullmatch(r"covrot(\d+)", name)
    if m:  # the fixed-rate covrot coders: the same curve as covrot@N (the searchable coder at N bits)
        return "covrot", f"{m.group(1)} bit"
    if name == FP8:
        return REFERENCE_METHOD, "e4m3"
    if name == "bf16":
        return "bf16", "bf16"
    return None


# Coders whose ``name@knob`` knob is a rate in bits (labelled "N bit", the label of their fixed-rate points).
RATE_KNOB_CODECS = ("turboquant", "covrot")
ERROR_LEVEL_CODECS = {"kvtc": "pooled", "sz3": "tensor"}  # searched to a target NRMSE (alloc used for the search)


def baseline_specs(names=None, error_eps=(0.0267,)) -> list[dict]:
    """The baseline points to run: ``{"name", "curve", "label", "eps", "alloc"}`` for every registered baseline that
    imports here (``names``: a subset by registry name; None: all field baselines)."""
    import kvz.benchmarks.baselines as B

    avail = set(B.available())
    if names is None:
        names = [n for n in B.BASELINES if codec_points(n) is not None and n not in ("kivi_int8",)]
        names += [n for n in ERROR_LEVEL_CODECS if n in B.BASELINES]
    out = []
    for item in names:
        n, _, knob = item.partition("@")
        if n not in B.BASELINES or n not in avail:
            continue
        if knob:
            k = float(knob)
            bits = n.startswith(RATE_KNOB_CODECS)  # the knob is a rate in bits per value: label as a fixed rate
            label = f"{k:g} bit" if bits else f"{B.BASELINES[n].knob_name}={k:g}"
            out.append({"name": n, "curve": n, "label": label, "eps": None, "alloc": None, "knob": k})
            continue
        if n in ERROR_LEVEL_CODECS:
            for e in error_eps:
                out.append({"name": n, "curve": n, "label": f"eps={label_num(e)}", "eps": e,
                            "alloc": ERROR_LEVEL_CODECS[n]})
            continue
        cp = codec_points(n)
        if cp is None:
            continue
        out.append({"name": n, "curve": cp[0], "label": cp[1], "eps": None, "alloc": None})
    return out


def baseline_setting(spec: dict, calib: list | None = None) -> Setting:
    """A registered baseline coder as a restore callable: its natural knob (fixed-rate coders, KIVI's group 32,
    KVQuant's 1 % outliers) or, with ``spec["eps"]``, the knobs its own search picks for that NRMSE under
    ``spec["alloc"]``; each tensor is then encoded and decoded, and every bit it reports is counted."""
    import kvz.benchmarks.baselines as B
    from kvz.benchmarks.baselines import cast_back, run_codec

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
            out[k] = to_bf16(cast_back(codec.decode(k, enc, x.shape, ctx), np.float32))
            bits += enc.bits
            meta += enc.meta_bits
        info["bpv"] = bits / sum(x.size for x in kv.values())
        info["meta_bpv"] = meta / sum(x.size for x in kv.values())
        kn = sorted({str(v) for v in knobs.values()})
        info["knob"] = kn[0] if len(kn) == 1 else f"{len(kn)} values"
        return out

    s = Setting(fn, spec["curve"], eps=spec.get("eps"), codec=spec["name"])
    s.curve, s.label = spec["curve"], spec["label"]
    return s


def bf16_setting() -> Setting:
    """The storage precision (16 bpv): the floor of every curve."""
    s = identity_setting("bf16")
    s.curve, s.label = "bf16", "bf16"
    return s


def build_settings(preset: dict, bank, *, methods=None, kvz_eps=None, calib=None) -> dict[str, Setting]:
    """``{"curve | label": Setting}`` for a preset (``methods``: curve names or registry names to keep)."""
    settings: dict[str, Setting] = {}
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
    """Whether any setting is a calibrated baseline (it then needs calibration caches)."""
    import kvz.benchmarks.baselines as B

    return any(getattr(B.BASELINES.get(s.desc.get("codec", "")), "uses_calib", False) for s in settings.values())
