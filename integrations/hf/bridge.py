"""The transformers cache bridge: a model's KV to ``.kvz`` and back into a cache ``generate`` continues from.

::

    from kvz.integrations.hf.bridge import capture_prefill, save_kv, load_kvz_cache
    logits, cache, full_kv = capture_prefill(model, ids[:-1])          # full K/V of every layer
    save_kv(full_kv, "p.kvz", model=model, eps=0.02, bank="gemma-3-270m", token_ids=ids[:-1])
    out = model.generate(torch.tensor([ids]), past_key_values=load_kvz_cache("p.kvz", model), max_new_tokens=32)

* :func:`capture_prefill` runs the model over ``input_ids`` with a :class:`RecordingCache` (a
  ``DynamicCache`` that also keeps every K/V handed to ``update``), so ``full_kv`` holds *all*
  positions of every layer — Gemma 3's sliding-window layers keep only the last window in the
  cache itself.
* :func:`save_kv` writes ``full_kv`` as a ``.kvz`` with the metadata the codec and the loader need:
  model id, layer types, ``keys_roped``, the model's exact RoPE
  (:func:`~kvz.integrations.hf.rope.rope_spec_from_model`),
  ``position_offset`` and the token ids.
* :func:`load_kvz_cache` builds a ``DynamicCache`` from the model config and fills it layer by layer
  from :meth:`alignpred.KvzReader.layers` (decoded straight into preallocated tensors) through each
  layer's own ``update()``, so sliding layers keep exactly the window a real prefill keeps. The
  file's RoPE must be the model's (checked), and its first position must be 0 (a cache for
  ``generate`` starts there).
* :func:`cache_from_kv` does the same from tensors in memory (the "inject by hand" path).

torch / transformers are imported lazily.
"""
from __future__ import annotations

import inspect
import os

import numpy as np

__all__ = ["RecordingCache", "capture_prefill", "save_kv", "load_kvz_cache", "cache_from_kv", "new_cache",
           "kv_metadata", "model_id_of", "kv_shape", "cache_kwarg", "text_config", "build_cache", "forward_logits",
           "last_kv"]


def text_config(model):
    from kvz.integrations.hf.rope import text_config as _tc

    return _tc(model.config)


def model_id_of(model) -> str:
    """The model id written into metadata and bound into chunk keys."""
    cfg = model.config
    mid = getattr(model, "kvz_model_id", None)
    if not mid:
        path = str(getattr(cfg, "_name_or_path", "") or "")
        # a local directory is not a model id: its last component is the closest thing to a name
        mid = os.path.basename(os.path.normpath(path)) if path and (os.path.isabs(path) or os.path.exists(path)) \
            else path
    return str(mid or getattr(cfg, "model_type", "") or type(model).__name__)


def kv_shape(model) -> tuple[int, int, int]:
    """``(num_layers, kv_heads, head_dim)`` of the model's cache."""
    cfg = text_config(model)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(cfg.num_hidden_layers), int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads), int(d)


def cache_kwarg(model) -> str:
    """``cache`` (transformers >= 5.x renamed it) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_cache(model):
    """An empty ``DynamicCache`` built from the model config (sliding layers where the model has them)."""
    from transformers import DynamicCache

    return DynamicCache(config=text_config(model))


def RecordingCache(model):  # noqa: N802 - a factory that reads like the class
    """A new recording cache for ``model`` (see :func:`capture_prefill`)."""
    from kvz.integrations.hf.caches import recording_cache_cls

    return recording_cache_cls()(config=text_config(model))


def capture_prefill(model, input_ids, *, cache=None, logits_to_keep: int = 1, chunk: int | None = None):
    """Run ``model`` over ``input_ids`` (a list of ids, or a ``[1, T]`` / ``[T]`` tensor) and return
    ``(logits, cache, full_kv)``: the logits of the last ``logits_to_keep`` positions (``[1, n, vocab]``;
    0 keeps all), the model's cache (a :class:`RecordingCache`, usable by ``generate``), and
    ``full_kv``, ``[(key, value)]`` per layer of shape ``[kv_heads, T, head_dim]`` holding every
    position fed in this call (keys post-RoPE, as cached). ``cache``: a recording cache to continue
    (positions then start at its length). ``chunk``: prefill in pieces of that many tokens."""
    import torch

    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"input_ids must be one non-empty sequence, got shape {tuple(ids.shape)}")
    if cache is None:
        cache = RecordingCache(model)
    elif not hasattr(cache, "recorded"):
        raise ValueError("cache must be a RecordingCache from this module (or None)")
    before = {i: len(v[0]) for i, v in cache.recorded.items()}
    start = cache.get_seq_length()
    T = ids.shape[1]
    step = T if not chunk else max(1, int(chunk))
    device = next(model.parameters()).device
    kw = cache_kwarg(model)
    logits = None
    with torch.inference_mode():
        for a in range(0, T, step):
            piece = ids[:, a:a + step].to(device)
            pos = torch.arange(start + a, start + a + piece.shape[1], device=device)[None]
            last = a + step >= T
            out = model(input_ids=piece, position_ids=pos, use_cache=True, **{kw: cache},
                        logits_to_keep=logits_to_keep if last else 1)
            if last:
                logits = out.logits
    full = []
    for i in range(len(cache.recorded)):
        ks, vs = cache.recorded[i]
        n0 = before.get(i, 0)
        full.append((torch.cat(ks[n0:], dim=-2)[0], torch.cat(vs[n0:], dim=-2)[0]))
    return logits, cache, full


def kv_metadata(model, n_positions: int, *, position_offset: int = 0, token_ids=None, model_id: str | None = None,
                spec=None) -> dict:
    """The cache metadata of ``n_positions`` positions of ``model``'s KV starting at ``position_offset``:
    ``model``, ``layer_types``, ``keys_roped``, ``rope`` (the model's exact RoPE spec),
    ``position_offset`` and ``token_ids`` (when given)."""
    from kvz.integrations.hf.rope import layer_types_of, rope_spec_from_model

    if spec is None:
        spec = rope_spec_from_model(model, int(position_offset) + int(n_positions))
    meta = {"model": model_id or model_id_of(model), "layer_types": list(layer_types_of(model.config)),
            "keys_roped": True, "rope": spec.to_json(), "position_offset": int(position_offset)}
    if token_ids is not None:
        ids = [int(t) for t in token_ids]
        if len(ids) != n_positions:
            raise ValueError(f"{len(ids)} token ids for {n_positions} positions")
        meta["token_ids"] = ids
    return meta


def kv_pairs(kv) -> list:
    """``[(key, value)]`` per layer from what a transformers user holds: a ``Cache`` (``DynamicCache``,
    full and sliding layers: ``cache.layers[i].keys``), legacy tuples ``((k, v), ...)``, or pairs
    already; each ``[kv_heads, T, head_dim]`` (a batch of one is dropped), on the CPU."""
    layers = getattr(kv, "layers", None)
    if layers is not None and not isinstance(kv, (list, tuple)):
        pairs = [(layer.keys, layer.values) for layer in layers]
        if any(k is None for k, _ in pairs):
            raise ValueError("the cache has layers that hold nothing yet (run a prefill first)")
    else:
        pairs = [tuple(p)[:2] for p in kv]
    out = []
    for i, (k, v) in enumerate(pairs):
        k = k.detach().to("cpu") if hasattr(k, "detach") else k
        v = v.detach().to("cpu") if hasattr(v, "detach") else v
        if k.ndim == 4:
            if k.shape[0] != 1:
                raise ValueError(f"layer {i} holds a batch of {k.shape[0]}; save one sequence at a time (cache[b])")
            k, v = k[0], v[0]
        out.append((k, v))
    return out


def _pad_sliding(kv: list, model) -> list:
    """Sliding-window layers of a ``DynamicCache`` hold only their last window; the file needs every
    layer at every position. The positions a sliding layer dropped are never attended again, so they
    are stored as zeros (cheap to code; loading keeps only the window again, as a prefill would).
    Any other length mismatch is an error that says which layer and why."""
    from kvz.integrations.hf.rope import layer_types_of

    T = max(int(k.shape[-2]) for k, _ in kv)
    if all(int(k.shape[-2]) == T for k, _ in kv):
        return kv
    types = list(layer_types_of(model.config)) or ["full_attention"] * len(kv)
    window = int(getattr(text_config(model), "sliding_window", 0) or 0)
    out = []
    for i, (k, v) in enumerate(kv):
        n = int(k.shape[-2])
        if n != T:
            if "sliding" not in str(types[i]) or n < min(T, max(window - 1, 1)):
                raise ValueError(f"layer {i} ({types[i]}) holds {n} positions but others hold {T}: save the cache "
                                 "right after a prefill or generate, before any layer was cropped")
            pad = (k.shape[0], T - n, k.shape[-1])
            if hasattr(k, "new_zeros"):
                import torch

                k, v = torch.cat([k.new_zeros(pad), k], dim=-2), torch.cat([v.new_zeros(pad), v], dim=-2)
            else:
                import numpy as np

                k = np.concatenate([np.zeros(pad, k.dtype), k], axis=-2)
                v = np.concatenate([np.zeros(pad, v.dtype), v], axis=-2)
        out.append((k, v))
    return out


def save_kv(full_kv, out, *, model, eps: float, bank, position_offset: int = 0, token_ids=None,
            model_id: str | None = None, config=None, scope: str = "tensor", dtype: str | None = None, profile=None,
            threads: int | None = None, **budget_options):
    """Compress ``full_kv`` — a transformers ``Cache`` as ``generate``/a forward returns it (full and
    sliding layers, any length), legacy tuples, or ``[(key, value)]`` per layer, ``[kv_heads, T,
    head_dim]``, torch or numpy — to ``out`` (a path, a binary stream, or None for bytes in
    ``info.data``) with the model's metadata; returns :class:`alignpred.CompressInfo`. ``dtype``
    (``float16``/``bfloat16``/``float32``) casts before coding (default: as given — float32 for an
    fp32 model). ``eps``, ``scope`` and the other keywords (``lossless``, ``tensor_cap``, ...) are
    the budget (:meth:`alignpred.ErrorBudget.from_options`); ``profile``, ``config`` and ``threads``
    go to :func:`alignpred.compress`."""
    from alignpred import Cache, ErrorBudget, compress

    budget = ErrorBudget.from_options(eps=eps, scope=scope, **budget_options)  # a bad option fails before any work

    kv = _pad_sliding(kv_pairs(full_kv), model)
    if dtype is not None:
        import torch

        tdt = getattr(torch, dtype)
        kv = [(k.to(tdt) if hasattr(k, "to") else k.astype(dtype), v.to(tdt) if hasattr(v, "to") else v.astype(dtype))
              for k, v in kv]
    T = int(kv[0][0].shape[-2])
    meta = kv_metadata(model, T, position_offset=position_offset, token_ids=token_ids, model_id=model_id)
    cache = Cache.from_arrays(kv, meta)
    return compress(cache, out, budget=budget, bank=bank, profile=profile, config=config, threads=threads)


def _check_rope(reader, model, n_positions: int) -> None:
    from alignpred import KvzError
    from kvz.integrations.hf.rope import rope_spec_from_model

    lay = reader.layout
    if not lay.keys_roped:
        raise KvzError(f"{reader.path}: keys are not marked as RoPE'd; this is not a transformers cache")
    want = rope_spec_from_model(model, n_positions)
    have = lay.rope
    if have is None:
        from alignpred import RopeSpec

        if not lay.rope_theta:
            raise KvzError(f"{reader.path}: no RoPE metadata")
        have = RopeSpec.from_thetas(list(lay.rope_theta), head_dim=lay.head_dim)
    for i in range(lay.num_layers):
        a, b = have.table(i), want.table(i)
        if (a is None) != (b is None) or (a is not None and b is not None
                                          and (a.inv_freq != b.inv_freq or a.attention_scaling != b.attention_scaling
                                               or a.pairing != b.pairing)):
            raise KvzError(f"{reader.path}: layer {i} was cached with another RoPE than this model applies; "
                           "load it with the model it was captured from")


def _check_shape(lay, model, where: str) -> None:
    from alignpred import KvzError

    n, h, d = kv_shape(model)
    if (lay.num_layers, lay.kv_heads, lay.head_dim) != (n, h, d):
        raise KvzError(f"{where}: cache is {lay.num_layers} layers x {lay.kv_heads} KV heads x {lay.head_dim}, "
                       f"the model needs {n} x {h} x {d}")


def load_kvz_cache(src, model, tokens=None, *, bank=None, session=None, cache=None, check_rope: bool = True):
    """A transformers ``DynamicCache`` holding the K/V of ``src`` (a ``.kvz`` path, bytes, or a
    :class:`alignpred.KvzReader`) for positions ``tokens=(a, b)`` (default all), ready for
    ``model.generate`` / a forward pass to continue from. (Not :func:`alignpred.load_cache`, which
    reads a safetensors capture into an :class:`alignpred.Cache`; the old name ``load_cache`` still
    imports from :mod:`kvz.integrations.hf`, with a ``DeprecationWarning``.)

    The cache is built from the model config and filled layer by layer: each layer is decoded
    straight into a preallocated tensor of the model's dtype and handed to that layer's
    ``update()`` (sliding-window layers keep their window, as after a real prefill). The first
    position must be absolute position 0 (``position_offset`` + ``a``). ``cache``: fill this
    (empty) cache instead of a new one."""
    import torch

    from alignpred import KvzError, KvzReader

    r = src if isinstance(src, KvzReader) else KvzReader(src, bank=bank, session=session)
    lay = r.layout
    _check_shape(lay, model, r.path)
    a, b = (0, lay.n_tokens) if tokens is None else (int(tokens[0]), int(tokens[1]))
    if lay.position_offset + a != 0:
        raise KvzError(f"{r.path}: positions {lay.position_offset + a}.. cannot start a cache (it starts at 0); "
                       "load from the file's first position, or use kvz.integrations.chunkstore to place chunks")
    if check_rope:
        _check_rope(r, model, lay.position_offset + lay.n_tokens)
    dtype = next(model.parameters()).dtype
    cache = new_cache(model) if cache is None else cache
    n, h, d = kv_shape(model)
    bufs: dict = {}

    def out(i):
        return bufs.setdefault(i, (torch.empty((1, h, b - a, d), dtype=dtype),
                                   torch.empty((1, h, b - a, d), dtype=dtype)))

    for i, _, _ in r.layers(tokens=(a, b), out=out):
        k, v = bufs.pop(i)
        cache.update(k, v, i)
    return cache


def _as_torch(x, dtype):
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(dtype)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(dtype)


def cache_from_kv(model, kv, *, cache=None):
    """A ``DynamicCache`` filled from ``kv`` (``[(key, value)]`` per layer or ``{layers.i.key: ...}``;
    torch or numpy, ``[kv_heads, T, d]`` or ``[1, kv_heads, T, d]``) through each layer's ``update()``."""
    n, h, d = kv_shape(model)
    dtype = next(model.parameters()).dtype
    if isinstance(kv, dict):
        kv = [(kv[f"layers.{i}.key"], kv[f"layers.{i}.value"]) for i in range(n)]
    if len(kv) != n:
        raise ValueError(f"{len(kv)} layers of K/V for a model with {n}")
    cache = new_cache(model) if cache is None else cache
    for i, (k, v) in enumerate(kv):
        kt, vt = _as_torch(k, dtype), _as_torch(v, dtype)
        if kt.dim() == 3:
            kt, vt = kt[None], vt[None]
        cache.update(kt, vt, i)
    return cache



def build_cache(model, *parts):
    """A fresh cache holding, per layer, the concatenation along positions of ``parts`` (each a list
    of ``(key, value)`` torch tensors ``[1, H, t, D]`` or ``[H, t, D]``, one per layer; ``None``
    entries contribute nothing). Each layer is filled through its own ``update()`` (by
    :func:`cache_from_kv`) so sliding-window layers keep what they would after a real prefill."""
    import torch

    n_layers = text_config(model).num_hidden_layers
    layers = []
    for i in range(n_layers):
        ks, vs = [], []
        for part in parts:
            if part and part[i] is not None:
                k, v = part[i]
                ks.append(k if k.dim() == 4 else k[None])
                vs.append(v if v.dim() == 4 else v[None])
        layers.append((ks[0] if len(ks) == 1 else torch.cat(ks, dim=-2),
                       vs[0] if len(vs) == 1 else torch.cat(vs, dim=-2)))
    return cache_from_kv(model, layers)


def forward_logits(model, cache, ids, start: int):
    """float32 logits ``[len(ids), vocab]`` of ``ids`` at positions ``start..`` appended to ``cache``."""
    import torch

    dev = next(model.parameters()).device
    inp = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    pos = torch.arange(start, start + len(ids), device=dev)[None]
    out = model(input_ids=inp, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[0].float()


def last_kv(cache, n: int, keep: int | None = None) -> list:
    """Clones of the first ``keep`` (default all) of the last ``n`` positions of every layer of
    ``cache``: ``[(k, v) [1, H, keep, D]]``."""
    keep = n if keep is None else keep
    out = []
    for layer in cache.layers:
        t = layer.keys.shape[-2]
        if t < n:
            raise RuntimeError(f"a cache layer holds {t} positions, fewer than the {n} just appended")
        out.append((layer.keys[..., t - n:t - n + keep, :].clone(), layer.values[..., t - n:t - n + keep, :].clone()))
    return out
