"""The header model of a .kvz file: what the JSON header holds (format_spec/kvz.md §6), built by
the writer and validated by the reader before anything is decoded (every key, type and range),
and the bank checks a decoder relies on.

>>> from alignpred.codec.budget import ErrorBudget
>>> h = build_header(layout=_toy_layout(), config=CodecConfig(), budget=ErrorBudget(eps=0.03), coder="rans4",
...                   bank_info={"id": "sha256:" + "0" * 64, "model": "", "embedded": None},
...                  metas=[], source_metadata={})
>>> sorted(h["codec"])
['config', 'entropy', 'eps', 'eps_scope', 'name']
"""
from __future__ import annotations

import base64
import math
import zlib

import numpy as np

from alignpred import entropy
from alignpred._version import __version__
from alignpred.bank.bank import Bank
from alignpred.cache.layout import CacheLayout
from alignpred.codec.budget import SCOPES, ErrorBudget, TensorMeta
from alignpred.codec.config import ARITHS, SINK_ORIGINS, CodecConfig
from alignpred.codec.scopes import scope_of
from alignpred.entropy import registry as coder_registry
from alignpred.errors import BankMismatchError, FormatError
from alignpred.format.container import FLAG_REFINE, MAJOR


def _toy_layout():
    return CacheLayout(num_layers=1, kv_heads=1, head_dim=2, n_tokens=1, dtype="float32")


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, np.uint8).tobytes()).decode()


def unb64(s, n: int, what: str) -> np.ndarray:
    try:
        b = base64.b64decode(s, validate=True)
    except (ValueError, TypeError):
        raise FormatError(f"header field {what} is not base64") from None
    if len(b) != n:
        raise FormatError(f"header field {what} has {len(b)} bytes, expected {n}")
    return np.frombuffer(b, np.uint8)


def _inflate(s, n: int, what: str) -> np.ndarray:
    """``n`` bytes from base64 of a zlib stream (RFC 1950); anything else is a FormatError."""
    try:
        raw = base64.b64decode(s, validate=True)
    except (ValueError, TypeError):
        raise FormatError(f"header field {what} is not base64") from None
    d = zlib.decompressobj()
    try:
        b = d.decompress(raw, n + 1)  # never more than one byte past what a valid field holds
    except zlib.error:
        raise FormatError(f"header field {what} is not a zlib stream") from None
    if len(b) != n or not d.eof or d.unconsumed_tail or d.unused_data:
        raise FormatError(f"header field {what} does not inflate to exactly {n} bytes")
    return np.frombuffer(b, np.uint8)


TIERS = ("coarse", "exact")


def minor_for(layout, config, scope: str = "tensor", tiers=("coarse",), coder: str = "rans4") -> int:
    """The oldest minor version that can express a file: 1.3 for per-channel steps
    (``config.channel_steps``, the attention scope); 1.2 for the ``lanes32`` entropy coder;
    1.1 for exact arithmetic, an absolute sink, an exact RoPE spec, a tensor cap or a refinement
    tier; 1.0 otherwise (kvz 0.1)."""
    if config.channel_steps or config.stale_window or config.row_steps:
        return 3
    new = (config.arith != "float" or config.sink_origin != "file" or layout.rope is not None
           or list(tiers) != ["coarse"] or scope_of(scope).weighted)  # tensor_cap alone is informative
    return max(1 if new else 0, coder_registry.get(coder).min_minor)


def coder_prec(coder: str) -> int:
    """The probability precision a coder's models use (recorded in the header, checked on read)."""
    return coder_registry.get(coder).precision


def build_header(*, layout, config, budget: ErrorBudget, coder, bank_info, metas, source_metadata,
                 tiers=("coarse",), weights=None) -> dict:
    """The header dict of a file (the writer adds nothing else); ``budget`` is resolved (eps known)."""
    scope, tensor_cap, target_kl = budget.scope, budget.cap, budget.target_kl
    codec = {"name": "alignpred", "config": config.to_json(), "eps": budget.eps, "eps_scope": scope,
             "entropy": {"coder": coder, "model_set": entropy.MODEL_SET_ID, "prec": coder_prec(coder)}}
    if tensor_cap:
        codec["tensor_cap"] = tensor_cap
    if budget.strategy.attention and budget.plain_cap:
        codec["plain_cap"] = float(budget.plain_cap)
    if weights is not None:
        codec["tensor_weights"] = list(weights)
    if target_kl is not None:
        codec["target_kl"] = target_kl

    def tensor(m):
        t = {"name": m.name, "modes": b64(m.modes), "models": b64(m.models), "sq_err": m.sq_err, "sq_norm": m.sq_norm}
        if m.refine_models is not None:
            t["refine_models"] = b64(m.refine_models)
        if m.step_codes is not None:
            t["step_codes"] = b64(m.step_codes)
        if m.plain_sq_err is not None:  # attention scope: plain error over the positions a query reads
            t["plain_sq_err"], t["plain_sq_norm"] = m.plain_sq_err, m.plain_sq_norm
        if m.row_codes is not None:  # one byte per position, deflated (RFC 1950)
            t["row_codes"] = base64.b64encode(zlib.compress(m.row_codes.tobytes(), 9)).decode("ascii")
        return t

    return {
        "format": "kvz", "version": [MAJOR, minor_for(layout, config, scope, tiers, coder)],
        "flags": FLAG_REFINE if "exact" in tiers else 0,
        "created_by": f"kvz {__version__}", "layout": layout.to_json(), "codec": codec, "bank": bank_info,
        "tensors": [tensor(m) for m in metas],
        # token ids are left out; the exact RoPE is in the layout (a decompressor writes it back)
        "source_metadata": {k: v for k, v in source_metadata.items() if k not in ("token_ids", "rope")},
    }


def tensor_metas(h: dict, layout) -> list:
    """The per-tensor modes/models (and refinement models) of a validated header."""
    refined = bool(h.get("flags", 0) & FLAG_REFINE)
    stepped = bool(h["codec"]["config"].get("channel_steps", False))
    rowed = bool(h["codec"]["config"].get("row_steps", False))
    C = layout.kv_heads * layout.head_dim
    tensors = h["tensors"]
    if not isinstance(tensors, list) or len(tensors) != 2 * layout.num_layers:
        raise FormatError("header tensor list does not match the layout")
    metas = []
    for ti, (t, name) in enumerate(zip(tensors, layout.tensor_names())):
        if not isinstance(t, dict) or t.get("name") != name:
            raise FormatError(f"header tensor {ti} should be {name}")
        modes = unb64(t.get("modes"), C, f"{name}.modes").reshape(layout.kv_heads, layout.head_dim)
        models = unb64(t.get("models"), C, f"{name}.models")
        m = TensorMeta(name, modes, models, float(t.get("sq_err", 0.0)), float(t.get("sq_norm", 0.0)))
        if refined:
            from alignpred.cache.layout import numpy_dtype
            from alignpred.codec.refine import n_contexts

            m.refine_models = unb64(t.get("refine_models"), n_contexts(numpy_dtype(layout.dtype)),
                                    f"{name}.refine_models")
        if stepped:
            m.step_codes = unb64(t.get("step_codes"), C, f"{name}.step_codes")
            if int(m.step_codes.min()) < 1:
                raise FormatError(f"header field {name}.step_codes holds a zero step code (codes are 1..255)")
        if rowed:
            m.row_codes = _inflate(t.get("row_codes"), layout.n_tokens, f"{name}.row_codes")
            if int(m.row_codes.min()) < 1:
                raise FormatError(f"header field {name}.row_codes holds a zero step code (codes are 1..255)")
        if "plain_sq_err" in t:
            m.plain_sq_err, m.plain_sq_norm = float(t["plain_sq_err"]), float(t.get("plain_sq_norm", 0.0))
        metas.append(m)
    return metas


# -- header validation (every key the reader uses, with its JSON type and range) ---------------
MAX_LAYERS = 1 << 12
MAX_CHANNELS = 1 << 16      # kv_heads * head_dim
MAX_TOKENS = 1 << 40
_LAYOUT_TYPES = {"num_layers": "int", "kv_heads": "int", "head_dim": "int", "n_tokens": "int", "dtype": "str",
                 "batch_dim": "bool", "model": "str", "layer_types": "list", "rope_theta": "list",
                 "rope_pairing": "str", "keys_roped": "bool", "position_offset": "int", "extra": "dict",
                 "rope": "dict"}
_CONFIG_TYPES = {"object_size": "int", "align": "bool", "inter_map": "bool", "blend": "bool", "intra": "bool",
                 "channel_choice": "bool", "rope_undo": "bool", "lambdas": "list", "sink_tokens": "int",
                 "sink_scale": "float", "sink_origin": "str", "arith": "str", "channel_steps": "bool",
                 "stale_window": "int", "stale_scale": "float",
                 "row_steps": "bool"}
_PY = {"int": int, "str": str, "bool": bool, "list": list, "dict": dict, "float": float}


def _f32(v) -> bool:
    """A finite number exactly representable as float32."""
    return isinstance(v, float) and math.isfinite(v) and float(np.float32(v)) == v


def _nonneg(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


def _typed(d, types: dict, where: str, required=()) -> None:
    if not isinstance(d, dict):
        raise FormatError(f"header field {where} must be an object")
    for k in required:
        if k not in d:
            raise FormatError(f"header field {where}.{k} is missing")
    for k, t in types.items():
        if k in d and type(d[k]) is not _PY[t]:
            raise FormatError(f"header field {where}.{k} must be a JSON {t}")


def check_header(h: dict) -> None:
    """Type and range checks of every header key the decoder relies on (FormatError)."""
    for k in ("layout", "codec", "bank", "tensors"):
        if k not in h:
            raise FormatError(f"header field {k} is missing")
    lay = h["layout"]
    _typed(lay, _LAYOUT_TYPES, "layout", ("num_layers", "kv_heads", "head_dim", "n_tokens", "dtype"))
    if not (1 <= lay["num_layers"] <= MAX_LAYERS and lay["kv_heads"] >= 1 and lay["head_dim"] >= 1
            and lay["kv_heads"] * lay["head_dim"] <= MAX_CHANNELS and 1 <= lay["n_tokens"] <= MAX_TOKENS):
        raise FormatError("layout sizes out of range")
    if not all(isinstance(x, str) for x in lay.get("layer_types", [])):
        raise FormatError("layout.layer_types must be strings")
    if not all(type(x) in (int, float) and math.isfinite(x) and x > 0 for x in lay.get("rope_theta", [])):
        raise FormatError("layout.rope_theta must be positive numbers")
    if not 0 <= lay.get("position_offset", 0) <= MAX_TOKENS:
        raise FormatError("layout.position_offset out of range")
    codec = h["codec"]
    _typed(codec, {"name": "str", "eps_scope": "str", "config": "dict", "entropy": "dict"}, "codec",
           ("name", "config", "eps", "eps_scope", "entropy"))
    if not (type(codec["eps"]) in (int, float) and 0 < codec["eps"] < 1):
        raise FormatError("codec.eps must be a number in (0, 1)")
    if codec["eps_scope"] not in SCOPES:
        raise FormatError(f"unknown eps scope {codec['eps_scope']!r}")
    cfg = codec["config"]
    _typed(cfg, _CONFIG_TYPES, "codec.config")
    lam = cfg.get("lambdas", [0.5, 0.75])
    if len(lam) != 2 or not all(type(x) in (int, float) and math.isfinite(x) for x in lam):
        raise FormatError("codec.config.lambdas must be two numbers")
    if not (0 <= cfg.get("sink_tokens", 0) <= MAX_TOKENS and _f32(cfg.get("sink_scale", 1.0))
            and 0 < cfg.get("sink_scale", 1.0) <= 1):
        raise FormatError("codec.config.sink_tokens/sink_scale out of range")
    if cfg.get("sink_origin", "file") not in SINK_ORIGINS or cfg.get("arith", "float") not in ARITHS:
        raise FormatError("codec.config.sink_origin/arith unknown")
    refined = bool(h.get("flags", 0) & FLAG_REFINE)
    if refined and cfg.get("arith") != "exact":
        raise FormatError("a refinement tier needs exact arithmetic")
    stepped = bool(cfg.get("channel_steps", False))
    if (stepped or cfg.get("row_steps", False)) and cfg.get("arith") != "exact":
        raise FormatError("codec.config.channel_steps and row_steps need exact arithmetic")
    if ("stale_window" in cfg) != ("stale_scale" in cfg) or not 0 <= cfg.get("stale_window", 0) <= MAX_TOKENS \
            or not (_f32(cfg.get("stale_scale", 1.0)) and 1 <= cfg.get("stale_scale", 1.0) <= 256):
        raise FormatError("codec.config.stale_window/stale_scale out of range")
    tw = codec.get("tensor_weights")
    if tw is not None and not (isinstance(tw, list) and all(type(x) in (int, float) and math.isfinite(x) and x > 0
                                                            for x in tw)):
        raise FormatError("codec.tensor_weights must be positive numbers")
    if scope_of(codec["eps_scope"]).weighted != (tw is not None):
        raise FormatError("codec.tensor_weights go with the weighted and attention scopes")
    if tw is not None and len(tw) != 2 * lay["num_layers"]:
        raise FormatError("codec.tensor_weights must hold one weight per tensor")
    pc = codec.get("plain_cap", 0.0)
    if not (type(pc) in (int, float) and 0 <= pc <= 10):
        raise FormatError("codec.plain_cap must be a number in [0, 10]")
    cap = codec.get("tensor_cap", 0.0)
    if not (type(cap) in (int, float) and (cap == 0 or 1 <= cap < 1e6)):
        raise FormatError("codec.tensor_cap must be 0 or a number >= 1")
    bank = h["bank"]
    _typed(bank, {"id": "str", "model": "str"}, "bank", ("id",))
    emb = bank.get("embedded")
    if emb is not None:
        _typed(emb, {"offset": "int", "length": "int", "crc32": "int"}, "bank.embedded", ("offset", "length", "crc32"))
        if emb["length"] < 0 or not 0 <= emb["crc32"] < 1 << 32:
            raise FormatError("bank.embedded out of range")
    if not isinstance(h["tensors"], list):
        raise FormatError("header field tensors must be a list")
    for t in h["tensors"]:
        _typed(t, {"name": "str", "modes": "str", "models": "str", "refine_models": "str", "step_codes": "str",
                   "row_codes": "str"},
               "tensors[]", ("name", "modes", "models") + (("refine_models",) if refined else ())
               + (("step_codes",) if stepped else ()) + (("row_codes",) if cfg.get("row_steps") else ()))
        if not (_nonneg(t.get("sq_err", 0.0)) and _nonneg(t.get("sq_norm", 0.0))
                and _nonneg(t.get("plain_sq_err", 0.0)) and _nonneg(t.get("plain_sq_norm", 0.0))):
            raise FormatError(f"header tensor {t['name']!r} has invalid error statistics")
    if not isinstance(h.get("source_metadata", {}), dict):
        raise FormatError("header field source_metadata must be an object")


def check_bank(bank: Bank, layout: CacheLayout, config: CodecConfig) -> None:
    """The bank has every array the decoder will use, with the right shapes, finite values, and
    prediction sources that are decoded before the block they predict (BankMismatchError)."""
    d = layout.head_dim
    order = [b.name for b in layout.blocks()]
    pos = {b: k for k, b in enumerate(order)}
    cfgd = bank.config
    if not isinstance(cfgd, dict) or not isinstance(cfgd.get("sources", {}), dict) \
            or not isinstance(cfgd.get("groups", []), list) \
            or not all(isinstance(g, list) and all(isinstance(s, str) for s in g) for g in cfgd.get("groups", [])):
        raise BankMismatchError("bank config is malformed")
    for a in bank.arrays.values():
        a = np.asarray(a)
        # float16: exponent bits all ones is Inf/NaN (tested on the bits: no float32 copy at start-up)
        finite = ((a.view(np.uint16) & 0x7C00) != 0x7C00).all() if a.dtype == np.float16 \
            else np.isfinite(np.asarray(a, np.float32)).all()
        if not finite:
            raise BankMismatchError("bank holds non-finite values")
    for b in order:
        m = bank.arrays.get(f"mean/{b}")
        if m is None or tuple(m.shape) != (d,):
            raise BankMismatchError(f"bank mean of {b} is missing or has the wrong shape")
        if config.align:
            r = bank.arrays.get(f"rot/{b}")
            if r is None or tuple(r.shape) != (d, d):
                raise BankMismatchError(f"bank rotation of {b} is missing or has the wrong shape")
        src = cfgd.get("sources", {}).get(b, [])
        if not isinstance(src, list) or not all(isinstance(s, str) and pos.get(s, len(order)) < pos[b] for s in src):
            raise BankMismatchError(f"bank sources of {b} are not blocks decoded before it")
        if config.inter_map and src:
            w, u, vt = (bank.arrays.get(f"map/{b}/{n}") for n in ("W", "U", "Vt"))
            din = d * len(src)
            if w is not None:
                ok = tuple(w.shape) == (din, d)
            elif u is not None:
                ok = vt is not None and u.ndim == 2 and u.shape[0] == din and tuple(vt.shape) == (u.shape[1], d)
            else:
                ok = True
            if not ok:
                raise BankMismatchError(f"bank map of {b} has the wrong shape")
        if config.blend:
            for g in cfgd.get("groups", []):
                if b in g:
                    if not all(isinstance(s, str) and pos.get(s, len(order)) < pos[b] for s in g[:g.index(b)]):
                        raise BankMismatchError(f"bank group of {b} is not in decode order")
                    break


