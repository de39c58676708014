"""What attention reads of a cache, recorded during a prefill (issue 20, point 1): the statistics of
a model-aware error measure for keys and values.

* **Queries** (for keys: the logit error is ``q·δk``): per layer and KV head, the second moment of
  every pre-RoPE query channel (after ``q_norm`` where the model has one), summed over the query
  heads of the KV head's GQA group, ``E_t Σ_{h∈g} q_{h,t,c}²``. With RoPE the relative phase of
  a pair averages out, so a key error in pair ``p`` costs ``½ E|q_p|² |δk_p|²`` in expectation
  (:func:`pair_weights` folds the channels into pairs).
* **Attention** (for per-token importance): per layer, KV head and *key* position ``j``, the
  attention weight it receives, ``mass[j] = Σ_{h∈g,i} a_{h,i,j} / (|g| T)`` (mean over the group's
  heads and all query rows; sums to 1 over ``j``), and ``sq[j] = Σ_{h∈g,i} a_{h,i,j}² / (|g| T)`` —
  the weight of a value error ``δv_j`` in the attention output (errors of different tokens being
  independent), plus the heads' overlap ``C_{hh'} = Σ_{i,j} a_{h,i,j} a_{h',i,j} / T``.
* **Values** (no prefill needed, :func:`value_grams`): ``Σ_{h∈g} W_hᵀ W_h`` of ``o_proj``'s column
  blocks of the group's heads, optionally with the gain of the norm that follows ``o_proj``
  (Gemma's ``post_attention_layernorm``, measured on unit vectors: no assumption on how it is
  parametrised).

Recording uses forward hooks on public module attributes only (``self_attn.q_norm`` or
``self_attn.q_proj``, ``self_attn`` itself for the attention weights, which needs the eager
attention implementation; :func:`stats_hooks` switches to it and back). :func:`capture_with_stats`
runs kvz's own :func:`~kvz.integrations.hf.capture.record_kv` inside the hooks, so the cache and its
statistics come from the same prefill; :func:`capture_stats` turns them into the record ``kvz capture
--attention-stats`` stores beside the cache and ``kvz calibrate`` fits a bank's statistics from
(:class:`alignpred.bank.CaptureStats`). torch is imported lazily.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PrefillStats", "stats_hooks", "record_query_stats", "capture_with_stats", "capture_stats", "value_grams",
           "pair_index", "pair_weights", "group_heads"]


def pair_index(head_dim: int, pairing: str = "half", rotary_dim: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(a, b)``: the two channels of each RoPE frequency pair (``half``: ``j, j + r/2``;
    ``interleaved``: ``2j, 2j + 1``). Channels past ``rotary_dim`` are not rotated and are not listed."""
    r = head_dim if rotary_dim is None else int(rotary_dim)
    if r % 2 or not 0 < r <= head_dim:
        raise ValueError(f"rotary_dim {r} must be even and in 1..{head_dim}")
    j = np.arange(r // 2)
    if pairing == "half":
        return j, j + r // 2
    if pairing == "interleaved":
        return 2 * j, 2 * j + 1
    raise ValueError(f"unknown RoPE pairing {pairing!r}")


def pair_weights(channel_moments: np.ndarray, pairing: str = "half", rotary_dim: int | None = None) -> np.ndarray:
    """``E|q_p|²`` per pair ``[..., r/2]`` from per-channel second moments ``[..., d]``."""
    c = np.asarray(channel_moments, np.float64)
    a, b = pair_index(c.shape[-1], pairing, rotary_dim)
    return c[..., a] + c[..., b]


def group_heads(n_heads: int, kv_heads: int) -> list[list[int]]:
    """The query heads of each KV head (transformers' ``repeat_kv`` order: consecutive blocks)."""
    if n_heads % kv_heads:
        raise ValueError(f"{n_heads} query heads do not split into {kv_heads} KV groups")
    r = n_heads // kv_heads
    return [list(range(g * r, (g + 1) * r)) for g in range(kv_heads)]


@dataclass
class PrefillStats:
    """Statistics of one prefill of ``n_tokens`` tokens (float64 numpy; see the module docstring).

    ``q_channel``: ``[layers, kv_heads, head_dim]`` query second moments (per token, summed over
    the group's heads). ``mass`` / ``sq``: ``[layers, kv_heads, n_tokens]`` (None without
    attention). ``overlap``: ``[layers, kv_heads, r, r]``."""

    n_tokens: int
    layer_types: list
    q_channel: np.ndarray
    mass: np.ndarray | None = None
    sq: np.ndarray | None = None
    overlap: np.ndarray | None = None
    info: dict = field(default_factory=dict)

    def pairs(self, pairing: str = "half", rotary_dim: int | None = None) -> np.ndarray:
        """``E|q_p|²`` per pair, ``[layers, kv_heads, r/2]``."""
        return pair_weights(self.q_channel, pairing, rotary_dim)


def _decoder(model):
    from kvz.integrations.hf.rope import decoder_of

    return decoder_of(model)


def _attn(layer):
    from kvz.integrations.hf.rope import attention_module

    return attention_module(layer, ValueError)


def _dims(model):
    from kvz.integrations.hf.rope import text_config

    cfg = text_config(model.config)
    n_heads = int(cfg.num_attention_heads)
    kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    hd = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    return cfg, n_heads, kv, hd


class _Recorder:
    def __init__(self, n_layers: int, n_heads: int, kv: int, hd: int, attention: bool):
        self.n_layers, self.n_heads, self.kv, self.hd = n_layers, n_heads, kv, hd
        self.groups = group_heads(n_heads, kv)
        self.attention = attention
        self.q_sum = np.zeros((n_layers, kv, hd))
        self.q_rows = np.zeros(n_layers, np.int64)
        self.mass: list[np.ndarray] = [np.zeros((kv, 0)) for _ in range(n_layers)]
        self.sq: list[np.ndarray] = [np.zeros((kv, 0)) for _ in range(n_layers)]
        self.overlap = np.zeros((n_layers, kv, len(self.groups[0]), len(self.groups[0])))
        self.rows = np.zeros(n_layers, np.int64)
        self.seq_len: list[int] = [0] * n_layers
        self.missing_weights = False
        self.layer_types: list = []

    def query(self, i: int, q) -> None:
        """``q``: pre-RoPE queries ``[B, H, T, D]`` or ``[B, T, H, D]``."""
        import torch

        q = q.detach().to(torch.float64)
        if q.dim() != 4 or q.shape[0] != 1:
            raise RuntimeError(f"layer {i}: unexpected query shape {tuple(q.shape)}")
        T = self.seq_len[i]
        if q.shape[1] == self.n_heads and (q.shape[2] == T or q.shape[2] != self.n_heads):
            qs = (q[0] ** 2).sum(dim=1)  # [H, D]
            n = q.shape[2]
        elif q.shape[2] == self.n_heads:
            qs = (q[0] ** 2).sum(dim=0)
            n = q.shape[1]
        else:
            raise RuntimeError(f"layer {i}: query shape {tuple(q.shape)} has no axis of {self.n_heads} heads")
        if qs.shape[-1] != self.hd:
            raise RuntimeError(f"layer {i}: query head_dim {qs.shape[-1]} != {self.hd}")
        qs = qs.cpu().numpy()
        for g, heads in enumerate(self.groups):
            self.q_sum[i, g] += qs[heads].sum(axis=0)
        self.q_rows[i] += n

    def weights(self, i: int, a) -> None:
        """``a``: attention weights ``[B, H, Tq, Tk]`` of one call (keys: the cache so far)."""
        import torch

        if a is None:
            self.missing_weights = True
            return
        a = a.detach().to(torch.float64)[0]  # [H, Tq, Tk]
        tk = a.shape[-1]
        m, s = self.mass[i], self.sq[i]
        if m.shape[1] < tk:
            pad = ((0, 0), (0, tk - m.shape[1]))
            m, s = np.pad(m, pad), np.pad(s, pad)
        colsum = a.sum(dim=1).cpu().numpy()  # [H, Tk]
        colsq = (a * a).sum(dim=1).cpu().numpy()
        flat = a.reshape(a.shape[0], -1)
        ov = (flat @ flat.T).cpu().numpy()  # [H, H]
        for g, heads in enumerate(self.groups):
            m[g, :tk] += colsum[heads].sum(axis=0)
            s[g, :tk] += colsq[heads].sum(axis=0)
            self.overlap[i, g] += ov[np.ix_(heads, heads)]
        self.mass[i], self.sq[i] = m, s
        self.rows[i] += a.shape[1]

    def result(self, layer_types) -> PrefillStats:
        if not self.q_rows.all():
            raise RuntimeError(f"no queries recorded for layers {np.flatnonzero(self.q_rows == 0).tolist()}")
        T = int(self.q_rows[0])
        q = self.q_sum / self.q_rows[:, None, None]
        mass = sq = overlap = None
        if self.attention:
            if self.missing_weights or not self.rows.all():
                raise RuntimeError("the attention modules returned no weights (eager attention is needed)")
            r = len(self.groups[0])
            tk = max(x.shape[1] for x in self.mass)
            mass = np.stack([np.pad(x, ((0, 0), (0, tk - x.shape[1]))) for x in self.mass])
            sq = np.stack([np.pad(x, ((0, 0), (0, tk - x.shape[1]))) for x in self.sq])
            denom = (self.rows * r)[:, None, None]
            mass, sq = mass / denom, sq / denom
            overlap = self.overlap / self.rows[:, None, None, None]
        return PrefillStats(T, list(layer_types), q, mass, sq, overlap)


def _set_impl(model, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


@contextlib.contextmanager
def stats_hooks(model, attention: bool = True):
    """Hooks that record :class:`PrefillStats` of every forward pass run inside the block;
    yields a recorder whose ``result(layer_types)`` gives them. With ``attention`` the model
    runs the eager attention implementation inside the block (restored after)."""
    from kvz.integrations.hf.rope import layer_types_of

    dec = _decoder(model)
    cfg, n_heads, kv, hd = _dims(model)
    layers = list(dec.layers)
    rec = _Recorder(len(layers), n_heads, kv, hd, attention)
    rec.layer_types = layer_types_of(cfg)
    handles = []
    impl = getattr(model.config, "_attn_implementation", None)
    try:
        if attention and impl != "eager":
            _set_impl(model, "eager")
        for i, layer in enumerate(layers):
            attn = _attn(layer)

            def pre(mod, args, kwargs, i=i):
                hs = args[0] if args else kwargs.get("hidden_states")
                rec.seq_len[i] = int(hs.shape[1])

            handles.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
            qmod = getattr(attn, "q_norm", None)
            if qmod is not None:
                handles.append(qmod.register_forward_hook(lambda mod, a, out, i=i: rec.query(i, out)))
            else:
                def qproj(mod, a, out, i=i):
                    b, t = out.shape[0], out.shape[1]
                    rec.query(i, out.reshape(b, t, n_heads, hd))

                handles.append(attn.q_proj.register_forward_hook(qproj))
            if attention:
                def post(mod, a, out, i=i):
                    w = out[1] if isinstance(out, tuple) and len(out) > 1 else None
                    rec.weights(i, w)

                handles.append(attn.register_forward_hook(post))
        yield rec
    finally:
        for h in handles:
            h.remove()
        if attention and impl is not None and impl != "eager":
            _set_impl(model, impl)


def record_query_stats(model, ids: Sequence[int], *, attention: bool = True) -> PrefillStats:
    """Prefill ``ids`` (positions ``0..T-1``, one call) and return its :class:`PrefillStats`."""
    import torch

    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("no tokens")
    dec = _decoder(model)
    device = next(model.parameters()).device
    with stats_hooks(model, attention) as rec, torch.inference_mode():
        dec(input_ids=torch.tensor([ids], dtype=torch.long, device=device),
            position_ids=torch.arange(len(ids), device=device)[None], use_cache=False)
    return rec.result(rec.layer_types)


def capture_with_stats(model, ids: Sequence[int], *, dtype: str = "float32", attention: bool = True,
                       progress: bool = False):
    """``(tensors, spec, info, stats)``: :func:`~kvz.integrations.hf.capture.record_kv` of ``ids``
    (one prefill chunk: the attention weights of a chunk must see every key position) with the
    :class:`PrefillStats` of that same prefill."""
    from kvz.integrations.hf.capture import record_kv

    ids = [int(t) for t in ids]
    with stats_hooks(model, attention) as rec:
        tensors, spec, info = record_kv(model, ids, chunk=max(1, len(ids)), dtype=dtype, progress=progress)
    stats = rec.result(info["layer_types"])
    stats.info = {"chunk": info["chunk"], "seconds": info["seconds"]}
    return tensors, spec, info, stats


def capture_stats(model, stats: PrefillStats, ids: Sequence[int], *, model_id: str = "", pairing: str = "half"):
    """The :class:`~alignpred.bank.CaptureStats` record of a prefill (what ``kvz capture
    --attention-stats`` writes beside the cache): ``stats`` (with attention) plus the model's
    value Grams (:func:`value_grams`, with the post-``o_proj`` norm's gain where the model has one),
    tied to the prefill by the sha256 of ``ids``."""
    from alignpred.bank import CaptureStats, tokens_digest

    if stats.mass is None or stats.sq is None:
        raise ValueError("capture statistics need the attention weights (record with attention=True)")
    ids = [int(t) for t in ids]
    if len(ids) != stats.n_tokens:
        raise ValueError(f"{len(ids)} token ids for statistics of {stats.n_tokens} tokens")
    g = value_grams(model)
    norm = g["gram_norm"] is not None
    return CaptureStats(model=str(model_id), n_tokens=stats.n_tokens, tokens_sha256=tokens_digest(ids),
                        layer_types=tuple(stats.layer_types), pairing=pairing, q_channel=stats.q_channel,
                        mass=stats.mass, sq=stats.sq, value_gram=g["gram_norm"] if norm else g["gram"],
                        value_gram_kind="o_proj blocks of the group's heads times post_attention_layernorm's gain"
                        if norm else "o_proj blocks of the group's heads",
                        meta={"queries": "pre-RoPE, after q_norm where the model has one, summed over the GQA "
                                         "group's heads, mean over tokens",
                              "seconds": round(float(stats.info.get("seconds", 0.0)), 3),
                              "sliding_window": _sliding_window(model)})


def _sliding_window(model) -> int:
    """The attention window of the model's sliding-window layers (0 if it has none)."""
    from kvz.integrations.hf.bridge import text_config

    cfg = text_config(model)
    return int(getattr(cfg, "sliding_window", 0) or 0) if any(
        "sliding" in str(t) for t in (getattr(cfg, "layer_types", None) or ())) else 0


def _norm_gain(norm, dim: int):
    """Per-channel gain of an RMS-style norm, measured on scaled unit vectors (None if it is not
    a per-channel scaling)."""
    import torch

    p = next(norm.parameters(), None)
    dt = p.dtype if p is not None else torch.float32
    s = 64.0
    x = torch.eye(dim, dtype=dt) * s
    with torch.inference_mode():
        y = norm(x[None])[0].to(torch.float64)
    diag = torch.diagonal(y)
    off = (y - torch.diag(diag)).abs().max()
    if float(off) > 1e-6 * float(diag.abs().max()):
        return None
    # RMS of s*e_c is s/sqrt(dim): the output is gain_c * sqrt(dim) on the diagonal
    return (diag / np.sqrt(dim)).cpu().numpy()


def value_grams(model, *, post_norm: bool = True) -> dict:
    """``{"gram": [layers, kv_heads, d, d], "gram_norm": same or None, "norm_gain": [layers, hidden]
    or None}``: ``Σ_{h∈g} W_hᵀW_h`` of ``o_proj`` per KV head group; ``gram_norm`` with
    ``diag(γ²)`` of the norm applied to the attention output (``post_attention_layernorm``), if
    the decoder layers have one that is a per-channel scaling. float64."""
    import torch

    dec = _decoder(model)
    cfg, n_heads, kv, hd = _dims(model)
    groups = group_heads(n_heads, kv)
    grams, grams_n, gains = [], [], []
    have_norm = post_norm
    for layer in dec.layers:
        W = _attn(layer).o_proj.weight.detach().to(torch.float64).cpu().numpy()  # [hidden, H*D]
        if W.shape[1] != n_heads * hd:
            raise RuntimeError(f"o_proj has {W.shape[1]} inputs, expected {n_heads}x{hd}")
        gain = None
        norm = getattr(layer, "post_attention_layernorm", None) if have_norm else None
        if norm is not None:
            gain = _norm_gain(norm, W.shape[0])
        if gain is None:
            have_norm = False
        g_plain, g_norm = [], []
        for heads in groups:
            blocks = [W[:, h * hd:(h + 1) * hd] for h in heads]
            g_plain.append(sum(b.T @ b for b in blocks))
            if gain is not None:
                g_norm.append(sum((b * gain[:, None]).T @ (b * gain[:, None]) for b in blocks))
        grams.append(np.stack(g_plain))
        if gain is not None:
            grams_n.append(np.stack(g_norm))
            gains.append(gain)
    out = {"gram": np.stack(grams), "gram_norm": None, "norm_gain": None}
    if have_norm and len(grams_n) == len(grams):
        out["gram_norm"] = np.stack(grams_n)
        out["norm_gain"] = np.stack(gains)
    return out
