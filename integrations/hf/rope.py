"""The RoPE a transformers decoder applies to its cached keys, as a kvz :class:`RopeSpec`.

kvz undoes RoPE before coding keys and applies it again on decode, so it needs the rotation
the model *actually* used: the float32 inverse frequencies and attention scaling of its rotary
embedding module(s), per layer, for the sequence that was prefilled. Nothing here
re-implements the scaling math (linear, llama3, dynamic NTK, YaRN, longrope, partial rotary,
…): a copy of the model's own rotary module is run for the sequence length — which lets
transformers' ``ROPE_INIT_FUNCTIONS`` and its dynamic update pick the parameters — and its
buffers are read.

Every table is then *checked*: the model's own ``apply_rotary_pos_emb`` (the function its
attention module calls) is run on basis vectors with the module's cos/sin, and the resulting
rotation matrices (at positions from the start, the middle and the end of the sequence) must
equal those of the :class:`RopeTable` to float32 rounding (≤ 1e-6 × attention scaling; a wrong
pairing or frequency is off by O(1)). This settles the channel pairing (``half`` /
``interleaved``) and partial rotary, and anything kvz cannot express raises
:class:`UnsupportedRope` instead of producing a wrong spec.

Sequence-length dependence: ``dynamic`` (NTK) and ``longrope`` choose their frequencies from
the largest position of each forward call. :func:`rope_spec_from_model` gives the parameters
of a single prefill over ``n_positions`` tokens from a fresh module state;
:func:`prefill_chunk` tells a capture whether chunked prefill would change them (then it must
prefill in one call), and :func:`record_rope_calls` checks afterwards what was used.

torch / transformers are imported lazily.
"""
from __future__ import annotations

import copy
import inspect
import re
import sys
from contextlib import contextmanager
from typing import Any

import numpy as np

from alignpred.cache import RopeSpec, RopeTable

__all__ = ["UnsupportedRope", "rope_spec_from_model", "rope_spec_from_config", "prefill_chunk",
           "record_rope_calls", "decoder_of", "text_config", "layer_types_of", "rope_thetas", "takes_layer_type"]

LENGTH_DEPENDENT = ("dynamic", "longrope")
_PROBE = 24  # positions per probe segment (start, middle, end of the sequence)


class UnsupportedRope(NotImplementedError):
    """The model's key rotation cannot be recorded exactly as a kvz RoPE spec."""


# -- locating the pieces ---------------------------------------------------------------------------
def text_config(config):
    """The decoder's config (``text_config`` of multimodal models)."""
    get = getattr(config, "get_text_config", None)
    if callable(get):
        try:
            return get(decoder=True)
        except TypeError:
            return get()
    return getattr(config, "text_config", None) or config


def decoder_of(model):
    """The module holding the decoder ``layers`` and the model-level ``rotary_emb``."""
    import torch

    cands = [model, getattr(model, "model", None)]
    for c in list(cands):
        if c is not None:
            cands += [getattr(c, "language_model", None), getattr(c, "text_model", None)]
    for c in cands:
        if c is not None and isinstance(getattr(c, "layers", None), torch.nn.ModuleList) and \
                getattr(c, "rotary_emb", None) is not None:
            return c
    for _, m in model.named_modules():
        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList) and getattr(m, "rotary_emb", None) is not None:
            return m
    raise UnsupportedRope(f"{type(model).__name__}: no decoder with a model-level rotary embedding "
                          "(`rotary_emb`) found; kvz can only record RoPE from such models")


def layer_types_of(config) -> list[str]:
    cfg = text_config(config)
    n = cfg.num_hidden_layers
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n:
        raise ValueError(f"config.layer_types has {len(types)} entries for {n} layers")
    return [str(t) for t in types]


def attention_module(layer, error: type[Exception] = NotImplementedError):
    """A decoder layer's attention module (``self_attn``, ``attention`` or ``attn``); ``error`` if none."""
    for name in ("self_attn", "attention", "attn"):
        m = getattr(layer, name, None)
        if m is not None:
            return m
    raise error(f"{type(layer).__name__}: no attention module (self_attn) found")


def _attention(layer):
    return attention_module(layer, UnsupportedRope)


def _apply_fn(attn):
    """The function ``attn.forward`` calls to rotate q/k, and how many tensors it takes."""
    mod = sys.modules[type(attn).__module__]
    try:
        src = inspect.getsource(type(attn).forward)
    except (OSError, TypeError):
        src = ""
    if src:
        names = sorted(set(re.findall(r"\b(apply_\w*rot\w*)\s*\(", src)))
    else:  # no source to read: the module's standard function
        names = ["apply_rotary_pos_emb"] if hasattr(mod, "apply_rotary_pos_emb") else []
    if len(names) != 1 or not callable(getattr(mod, names[0], None)):
        raise UnsupportedRope(f"{type(attn).__name__}: cannot tell how RoPE is applied "
                              f"(rotation functions called: {names or 'none'})")
    fn = getattr(mod, names[0])
    return fn, _n_inputs(fn, type(attn).__name__)


def _n_inputs(fn, owner: str) -> int:
    """How many tensors ``fn`` rotates before its ``cos, sin`` arguments: 2 (q, k) or 1 (x).
    ``fn`` may be a function or a module wrapping one (transformers >= 5.25 wraps the rotation
    functions in ``nn.Module`` objects whose ``forward`` has the function's signature)."""
    target = getattr(fn, "forward", fn) if not inspect.isfunction(fn) else fn
    params = list(inspect.signature(target).parameters)
    if "cos" in params and params.index("cos") in (1, 2) and params[params.index("cos") + 1:][:1] == ["sin"]:
        return params.index("cos")
    name = getattr(fn, "__name__", type(fn).__name__)
    raise UnsupportedRope(f"{owner}: unknown rotation function {name}{tuple(params)}")


def _head_dim(attn, cfg) -> int:
    d = getattr(attn, "head_dim", None) or getattr(cfg, "head_dim", None)
    return int(d or cfg.hidden_size // cfg.num_attention_heads)


def _rope_type(rot, key) -> str:
    t = getattr(rot, "rope_type", "default")
    if isinstance(t, dict):
        t = t.get(key, "default")
    return str(t)


def takes_layer_type(rot) -> bool:
    """Whether the rotary module's forward takes a ``layer_type`` (one table per attention type)."""
    return "layer_type" in inspect.signature(rot.forward).parameters


def _fresh(rot, key):
    """A copy of the rotary module in the state of a freshly loaded model (dynamic NTK grows its
    frequencies with the longest sequence seen and keeps them; a capture starts from scratch)."""
    r = copy.deepcopy(rot)
    reset_length_state(r, key)
    return r


def reset_length_state(rot, key) -> None:
    """Put a dynamic-NTK rotary module back into its initial state (as transformers' own reset
    does when a short sequence comes); no-op for other types."""
    if "dynamic" not in _rope_type(rot, key):
        return
    prefix = f"{key}_" if key else ""
    orig = getattr(rot, f"{prefix}original_inv_freq", None)
    if orig is None:
        return
    rot.register_buffer(f"{prefix}inv_freq", orig.clone(), persistent=False)
    setattr(rot, f"{prefix}max_seq_len_cached", rot.original_max_seq_len)


def used_parameters(rot, key) -> tuple[tuple, float]:
    """The ``(inv_freq, attention_scaling)`` the module's forward reads now (float32 values)."""
    prefix = f"{key}_" if key else ""
    inv = getattr(rot, f"{prefix}inv_freq", None)
    if inv is None:
        raise UnsupportedRope(f"{type(rot).__name__}: no inverse frequencies for layer type {key!r}")
    s: Any = getattr(rot, f"{prefix}attention_scaling", None) if key else None
    if s is None:
        s = getattr(rot, "attention_scaling", 1.0)
    inv = inv.detach().to("cpu").float().numpy().astype(np.float32)
    return tuple(float(v) for v in inv), float(np.float32(float(s)))


# -- probing ------------------------------------------------------------------------------------------
def _segments(n: int) -> list[tuple[int, int]]:
    m = min(n, _PROBE)
    segs = [(0, m)]
    if n > 2 * m:
        segs.append(((n - m) // 2, m))
    if n > m:
        segs.append((n - m, m))
    return segs


def _probe_table(rot, key, n: int, head_dim: int, apply) -> RopeTable:
    """Run a fresh copy of ``rot`` for a prefill of ``n`` positions; read and check its table."""
    import torch

    fn, n_in = apply
    r = _fresh(rot, key)
    segs = _segments(n)
    pos = torch.tensor([[p for a, m in segs for p in range(a, a + m)]], dtype=torch.long)  # max = n - 1
    kw = {"layer_type": key} if key is not None else {}
    with torch.no_grad():
        cos, sin = r(torch.zeros(1, 1, head_dim, dtype=torch.float32), pos, **kw)
        inv, s = used_parameters(r, key)
        if cos.dtype != torch.float32:
            raise UnsupportedRope(f"{type(rot).__name__}: cos/sin come in {cos.dtype}, not float32")
        P = pos.shape[1]
        basis = torch.eye(head_dim, dtype=torch.float32)[None, :, None, :].expand(1, head_dim, P, head_dim)
        basis = basis.contiguous()
        try:
            out = fn(basis, basis, cos, sin)[1] if n_in == 2 else fn(basis, cos, sin)
        except Exception as e:  # noqa: BLE001 - any failure means we cannot check this rotation
            raise UnsupportedRope(f"{type(rot).__name__}: probing {fn.__name__} failed: {e}") from None
    got = out[0].numpy()  # [head_dim (basis j), P, head_dim]: column j of each position's matrix
    if 2 * len(inv) > head_dim:
        raise UnsupportedRope(f"{type(rot).__name__}: {2 * len(inv)} rotary channels for head_dim {head_dim}")
    eye = np.broadcast_to(np.eye(head_dim, dtype=np.float32)[:, None, :], got.shape)
    tol = 1e-6 * max(1.0, s)
    errs = {}
    for pairing in ("half", "interleaved"):
        table = RopeTable(inv, s, pairing)
        parts, k = [], 0
        for a, m in segs:
            parts.append(table.apply(eye[:, k:k + m], a))
            k += m
        want = np.concatenate(parts, axis=1)
        errs[pairing] = float(np.abs(want - got).max())
        if errs[pairing] <= tol:
            return table
    raise UnsupportedRope(
        f"{type(rot).__name__} (layer type {key!r}, rope_type {_rope_type(rot, key)!r}): the key rotation is not "
        f"a RoPE kvz can express exactly (max deviation from the recorded table: half pairing "
        f"{errs['half']:.3g}, interleaved {errs['interleaved']:.3g}; tolerance {tol:.3g})")


def _spec(rot, attns, cfg, n_positions: int, use_rope) -> RopeSpec:
    if n_positions < 1:
        raise ValueError("n_positions must be >= 1")
    keyed = takes_layer_type(rot)
    types = layer_types_of(cfg)
    tables: list = []
    index: dict = {}
    lt = []
    probed: dict = {}
    for i in range(cfg.num_hidden_layers):
        if not use_rope(i):
            lt.append(-1)
            continue
        key = types[i] if keyed else None
        attn = attns(i)
        apply = _apply_fn(attn) if attn is not None else _module_apply(rot)
        d = _head_dim(attn, cfg) if attn is not None else _head_dim(None, cfg)
        pk = (key, d, apply[0])
        if pk not in probed:
            probed[pk] = _probe_table(rot, key, n_positions, d, apply)
        t = probed[pk]
        if t not in index:
            index[t] = len(tables)
            tables.append(t)
        lt.append(index[t])
    return RopeSpec(tuple(tables), tuple(lt))


def _module_apply(rot):
    mod = sys.modules[type(rot).__module__]
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    if fn is None:
        raise UnsupportedRope(f"{mod.__name__} has no apply_rotary_pos_emb")
    return fn, _n_inputs(fn, mod.__name__)


def rope_spec_from_model(model, n_positions: int) -> RopeSpec:
    """Per-layer RoPE of ``model`` (a transformers decoder, float32) for one prefill of
    ``n_positions`` tokens starting at position 0: the model's own float32 ``inv_freq`` and
    ``attention_scaling`` per layer (per layer type where sliding and full attention differ),
    pairing and rotary dimension checked against the model's rotation function. Layers whose
    attention has ``use_rope`` false get no table. Raises :class:`UnsupportedRope`."""
    import torch

    dec = decoder_of(model)
    cfg = text_config(getattr(dec, "config", None) or model.config)
    p = next(model.parameters(), None)
    if p is not None and p.dtype != torch.float32:
        raise ValueError(f"the model runs in {p.dtype}: its cos/sin are rounded to that type, which kvz cannot "
                         "record exactly; load it in float32")
    layers = dec.layers
    if len(layers) != cfg.num_hidden_layers:
        raise UnsupportedRope(f"{len(layers)} decoder layers but config.num_hidden_layers = {cfg.num_hidden_layers}")
    return _spec(dec.rotary_emb, lambda i: _attention(layers[i]), cfg, n_positions,
                 lambda i: bool(getattr(_attention(layers[i]), "use_rope", True)))


def rope_spec_from_config(config, n_positions: int) -> RopeSpec:
    """Like :func:`rope_spec_from_model` without weights: the model class's rotary embedding is
    built from ``config`` (``<Family>RotaryEmbedding`` next to ``<Family>ForCausalLM``) and checked
    against the module's ``apply_rotary_pos_emb``. ``no_rope_layers`` (Llama 4 / SmolLM3: 1 =
    RoPE) marks layers without RoPE."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = text_config(config)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.model_type)
    cls = getattr(transformers, name, None) if name else None
    if name is None or cls is None:
        raise UnsupportedRope(f"no causal-LM class for model_type {cfg.model_type!r}")
    mod = sys.modules[cls.__module__]
    rot_cls = getattr(mod, name.replace("ForCausalLM", "RotaryEmbedding"), None)
    if rot_cls is None:
        raise UnsupportedRope(f"{mod.__name__} has no {name.replace('ForCausalLM', 'RotaryEmbedding')}")
    rot = rot_cls(config=cfg)
    nope = getattr(cfg, "no_rope_layers", None)
    return _spec(rot, lambda i: None, cfg, n_positions, lambda i: bool(nope[i]) if nope else True)


# -- chunked prefill -----------------------------------------------------------------------------
def prefill_chunk(model, n_positions: int, chunk: int) -> int:
    """The prefill chunk to use for ``n_positions`` tokens: ``chunk``, unless the RoPE is
    length-dependent (dynamic NTK, longrope) and a first call of ``chunk`` tokens would get other
    frequencies than a call over all ``n_positions`` — then ``n_positions`` (one call)."""
    chunk = max(1, int(chunk))
    if chunk >= n_positions:
        return n_positions
    dec = decoder_of(model)
    rot = dec.rotary_emb
    keys = set(layer_types_of(text_config(model.config))) if takes_layer_type(rot) else {None}
    for key in keys:
        if not any(t in _rope_type(rot, key) for t in LENGTH_DEPENDENT):
            continue
        if _length_params(rot, key, chunk) != _length_params(rot, key, n_positions):
            return n_positions
    return chunk


def _length_params(rot, key, n):
    import torch

    r = _fresh(rot, key)
    kw = {"layer_type": key} if key is not None else {}
    with torch.no_grad():
        r(torch.zeros(1, 1, 1, dtype=torch.float32), torch.tensor([[n - 1]]), **kw)
    return used_parameters(r, key)


@contextmanager
def record_rope_calls(model):
    """Within the block, every call of the model's rotary embedding appends
    ``(layer_type, inv_freq, attention_scaling)`` — the parameters that call used — to the
    yielded list. Dynamic-NTK state is reset first (a fresh model's state)."""
    dec = decoder_of(model)
    rot = dec.rotary_emb
    keyed = takes_layer_type(rot)
    for key in (set(layer_types_of(text_config(model.config))) if keyed else {None}):
        reset_length_state(rot, key)
    calls: list = []

    def hook(module, args, kwargs, output):
        key = kwargs.get("layer_type", args[2] if len(args) > 2 else None) if keyed else None
        calls.append((key,) + used_parameters(module, key))

    h = rot.register_forward_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        h.remove()


def rope_thetas(model, spec: RopeSpec) -> list | None:
    """Per-layer ``rope_theta`` when every layer has plain default RoPE over all channels (for the
    informational ``rope_theta`` metadata older readers use); ``None`` otherwise."""
    dec = decoder_of(model)
    cfg = text_config(model.config)
    rot = dec.rotary_emb
    keyed = takes_layer_type(rot)
    params = getattr(cfg, "rope_parameters", None) or {}
    types = layer_types_of(cfg)
    out = []
    for i in range(cfg.num_hidden_layers):
        t = spec.table(i)
        key = types[i] if keyed else None
        p = params.get(key, params) if isinstance(params, dict) and key in params else params
        if t is None or _rope_type(rot, key) != "default" or not isinstance(p, dict) or "rope_theta" not in p:
            return None
        if t.attention_scaling != 1.0 or t.rotary_dim != _head_dim(_attention(dec.layers[i]), cfg):
            return None
        out.append(float(p["rope_theta"]))
    return out
