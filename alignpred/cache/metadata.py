"""Cache metadata: the positional facts a cache file carries next to its tensors, validated up
front with one-line errors that name the field and the fix.

In a safetensors file every metadata value is a string (JSON where the value is structured);
Python callers may pass the values themselves (a list instead of its JSON text). Fields:

=================  ===========================================================================
``model``          free text (the model id)
``layer_types``    list of strings, one per layer (e.g. ``sliding_attention``)
``keys_roped``     ``true``/``false``: the keys carry RoPE (a transformers cache always does)
``rope``           exact per-layer RoPE (:class:`~alignpred.cache.rope.RopeSpec` JSON): inverse
                   frequencies, attention scaling, pairing, rotary dimension
``rope_theta``     simpler form for default RoPE: one base (all layers), a list (per layer), or
                   an object keyed by layer type (``{"full_attention": 1e6, ...}``)
``rope_pairing``   ``half`` (Llama/Gemma ``rotate_half``, default) or ``interleaved``
``position_offset``  absolute position of the cache's first token (default 0)
``token_ids``      list of the cache's token ids (one per position)
=================  ===========================================================================

Other keys are kept as they are. Nothing here takes more than microseconds: no value is used
before it is checked (a NaN RoPE base used to run for minutes).

>>> parse_metadata({"rope_theta": "10000.0", "keys_roped": "true"}, num_layers=2, head_dim=8, n_tokens=4)["rope_theta"]
(10000.0, 10000.0)
>>> parse_metadata({"keys_roped": "maybe"}, num_layers=2, head_dim=8, n_tokens=4)
Traceback (most recent call last):
...
alignpred.errors.MetadataError: metadata 'keys_roped': 'maybe' is not a boolean; write true or false
"""
from __future__ import annotations

import json
import math
from typing import NoReturn

from alignpred.cache.rope import PAIRINGS, RopeSpec
from alignpred.errors import LayoutError, MetadataError

MAX_METADATA_VALUE = 64 << 20
MAX_POSITION = 1 << 40


def _fail(field: str, problem: str, fix: str) -> NoReturn:
    raise MetadataError(f"metadata {field!r}: {problem}; {fix}")


def _no_constant(name):
    raise ValueError(f"{name} is not allowed")


def _value(meta: dict, key: str):
    """The parsed value of ``key`` (JSON for strings; Python values as given)."""
    v = meta[key]
    if isinstance(v, (bytes, bytearray)):
        v = bytes(v).decode("utf-8", "replace")
    if not isinstance(v, str):
        return v
    if len(v) > MAX_METADATA_VALUE:
        _fail(key, "value too large", "store at most 64 MiB per field")
    try:
        return json.loads(v, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return v  # plain text: left to the field's own check


def _bool(meta: dict, key: str, default: bool) -> bool:
    if key not in meta:
        return default
    v = meta[key]
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower() if isinstance(v, str) else None
    if s in ("true", "false"):
        return s == "true"
    _fail(key, f"{v!r} is not a boolean", "write true or false")


def _theta(field: str, v) -> float:
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            _fail(field, f"{v!r} is not a number", "give the RoPE base as a number, e.g. 10000.0")
    if isinstance(v, bool) or type(v) not in (int, float):
        _fail(field, f"{v!r} is not a number", "give the RoPE base as a number, e.g. 10000.0")
    if not math.isfinite(v) or v <= 1.0:
        _fail(field, f"{v!r} is not a valid RoPE base", "give a finite number > 1 (e.g. 10000.0, or 1e6 for "
              "long-context layers)")
    return float(v)


def _rope_theta(meta: dict, num_layers: int, layer_types: tuple) -> tuple:
    v = _value(meta, "rope_theta")
    if v is None:
        _fail("rope_theta", "null is not a RoPE base", "remove the field or give a number, a list with one number "
              "per layer, or an object keyed by layer type")
    if isinstance(v, list):
        if len(v) != num_layers:
            _fail("rope_theta", f"{len(v)} values for {num_layers} layers", "give one base per layer")
        return tuple(_theta(f"rope_theta[{i}]", x) for i, x in enumerate(v))
    if isinstance(v, dict):
        if not layer_types:
            _fail("rope_theta", "an object keyed by layer type needs layer_types",
                  "add layer_types (one string per layer) or give a list")
        missing = sorted(set(layer_types) - set(v))
        if missing:
            _fail("rope_theta", f"no base for layer type {missing[0]!r}", "give a base for every type in layer_types")
        return tuple(_theta(f"rope_theta[{t!r}]", v[t]) for t in layer_types)
    t = _theta("rope_theta", v)
    return (t,) * num_layers


def parse_metadata(meta: dict, *, num_layers: int, head_dim: int, n_tokens: int) -> dict:
    """Validate ``meta`` against a cache of this size; returns the :class:`CacheLayout` fields
    (``model, layer_types, rope_theta, rope_pairing, keys_roped, position_offset, rope``)."""
    if not isinstance(meta, dict):
        raise MetadataError("metadata must be a mapping of field names to values")
    for k in meta:
        if not isinstance(k, str):
            raise MetadataError(f"metadata key {k!r} is not a string")
    out: dict = {}
    model = meta.get("model", "")
    if not isinstance(model, str):
        _fail("model", f"{model!r} is not text", "give the model id as a string")
    out["model"] = model

    layer_types: tuple = ()
    if "layer_types" in meta:
        v = _value(meta, "layer_types")
        if not isinstance(v, list) or not all(isinstance(t, str) and t for t in v):
            _fail("layer_types", "must be a list of non-empty strings", 'e.g. ["sliding_attention", "full_attention"]')
        if len(v) != num_layers:
            _fail("layer_types", f"{len(v)} entries for {num_layers} layers", "give one type per layer")
        layer_types = tuple(v)
    out["layer_types"] = layer_types

    pairing = meta.get("rope_pairing", "half")
    if pairing not in PAIRINGS:
        _fail("rope_pairing", f"{pairing!r} is unknown", f"use one of {', '.join(PAIRINGS)}")
    out["rope_pairing"] = pairing

    out["rope_theta"] = _rope_theta(meta, num_layers, layer_types) if "rope_theta" in meta else ()
    rope = None
    if "rope" in meta:
        v = _value(meta, "rope")
        try:
            rope = RopeSpec.from_json(v)
        except LayoutError as e:
            _fail("rope", str(e), "write it with alignpred.cache.rope.RopeSpec.to_json()")
        if rope.num_layers != num_layers:
            _fail("rope", f"covers {rope.num_layers} layers, the cache has {num_layers}", "give one entry per layer")
        if any(t.rotary_dim > head_dim for t in rope.tables):
            _fail("rope", f"rotary dimension exceeds head_dim {head_dim}", "check the model's partial_rotary_factor")
    out["rope"] = rope

    has_rope = rope is not None or bool(out["rope_theta"])
    if "keys_roped" not in meta and has_rope:
        _fail("keys_roped", "missing while RoPE parameters are given",
              "say whether the keys carry RoPE (true for keys taken from a transformers cache)")
    out["keys_roped"] = _bool(meta, "keys_roped", False)
    if out["keys_roped"] and not has_rope:
        _fail("keys_roped", "true but no RoPE parameters are given",
              "add rope_theta (or rope), or set keys_roped to false")
    if out["keys_roped"] and head_dim % 2:
        _fail("keys_roped", f"RoPE needs an even head_dim, the cache has {head_dim}", "set keys_roped to false")

    off = 0
    if "position_offset" in meta:
        v = _value(meta, "position_offset")
        if isinstance(v, bool) or type(v) is not int or not 0 <= v <= MAX_POSITION:
            _fail("position_offset", f"{meta['position_offset']!r} is not a position",
                  "give the absolute position of the first token, an integer >= 0")
        off = v
    out["position_offset"] = off

    if "token_ids" in meta:
        v = _value(meta, "token_ids")
        if not isinstance(v, list) or not all(type(t) is int and 0 <= t < 1 << 32 for t in v):
            _fail("token_ids", "must be a list of non-negative integers", "store the cache's token ids as a JSON list")
        if len(v) != n_tokens:
            _fail("token_ids", f"{len(v)} ids for {n_tokens} positions", "store one id per cached position")
    if meta.get("format") == "kvz-cache" and str(meta.get("kvz.version", "1")) != "1":
        _fail("kvz.version", f"{meta.get('kvz.version')!r} is unknown", "this kvz reads kvz-cache version 1")
    return out


def layout_metadata(layout) -> dict:
    """String metadata that :func:`parse_metadata` turns back into the layout's fields."""
    m = {"model": layout.model}
    if layout.layer_types:
        m["layer_types"] = json.dumps(list(layout.layer_types))
    if layout.rope_theta:
        m["rope_theta"] = json.dumps(list(layout.rope_theta))
        m["rope_pairing"] = layout.rope_pairing
    if layout.rope is not None:
        m["rope"] = json.dumps(layout.rope.to_json())
    m["keys_roped"] = "true" if layout.keys_roped else "false"
    m["position_offset"] = str(layout.position_offset)
    return m
