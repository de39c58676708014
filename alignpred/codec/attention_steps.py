"""Step multipliers of the ``attention`` scope (format 1.3): where the model reads a cache, put
the error there — per channel (``config.channel_steps``), per position (``config.row_steps``,
from the attention the positions received in the prefill that made the cache) and for the
positions a sliding-window layer never attends again (``config.stale_window``).

A key error ``δk`` costs ``Σ_c w_c δk_c²`` in squared logit error (``w``: the queries' second
moment per RoPE pair, :meth:`~alignpred.bank.AttentionStats.key_weights`, the same on both
channels of a pair, so the measure is the same before and after RoPE); a value error ``δv``
costs ``δvᵀ G δv`` (``G``: ``o_proj``'s Gram matrix of the KV head's query heads; its diagonal
here). At a fixed weighted error, the bits are fewest when each channel's step is ``∝ 1/sqrt(w_c)``
(high-rate reverse water-filling). The multipliers are stored per tensor as codes ``1..255``
(multiplier ``code / 32``), normalised to the head's median weight and clipped to
``[MIN_STEP, MAX_STEP]``, so that no channel is silently destroyed and a channel no query reads
still gets a bounded error.

>>> import numpy as np
>>> codes_for_weights(np.array([1.0, 4.0, 0.25, 0.0])).tolist()    # multipliers 1, 1/2, 2, max
[32, 16, 64, 255]
"""
from __future__ import annotations

import numpy as np

from alignpred.codec.budget import STEP_UNIT
from alignpred.errors import KvzError

__all__ = ["MIN_STEP", "MAX_STEP", "STALE_SCALE", "codes_for_weights", "channel_weights", "step_codes",
           "row_weights", "row_codes"]

MIN_STEP = 0.25  # multiplier bounds around the head's median-weight channel (codes 8..255)
MAX_STEP = 255 / STEP_UNIT
STALE_SCALE = MAX_STEP  # step multiplier of positions a sliding-window layer never attends again
ROW_PER_OCTAVE = 4  # row multipliers in quarter octaves: 21 distinct codes, ~1 KB per 1,000 positions and tensor


def codes_for_weights(w: np.ndarray, per_octave: int = 0) -> np.ndarray:
    """Step codes (uint8) for the weights ``w`` (of one head's channels, or of positions):
    ``round(32 · sqrt(median(w) / w_c))``, clipped to the multiplier bounds (a zero weight gets the
    largest); ``per_octave > 0`` first rounds the multiplier to that many steps per octave (few
    distinct codes: a row-code field deflates well)."""
    w = np.asarray(w, np.float64)
    pos = w[w > 0]
    if not len(pos):
        return np.full(w.shape, STEP_UNIT, np.uint8)
    ref = float(np.median(pos))
    with np.errstate(divide="ignore"):
        g = np.where(w > 0, np.sqrt(ref / np.maximum(w, 1e-300)), np.inf)
    g = np.clip(g, MIN_STEP, MAX_STEP)
    if per_octave:
        g = np.clip(np.exp2(np.rint(np.log2(g) * per_octave) / per_octave), MIN_STEP, MAX_STEP)
    return np.clip(np.rint(g * STEP_UNIT), 1, 255).astype(np.uint8)


def channel_weights(stats, layout, config) -> list[np.ndarray]:
    """Per tensor (layout order), the weight of every channel in the coding frame ``[kv_heads,
    head_dim]`` (float64): keys the pair weights, values the Gram diagonal (``config.align``: the
    weights seen through the bank's rotation, ``key_frame`` / ``value_frame``)."""
    if stats.num_layers != layout.num_layers or stats.kv_heads != layout.kv_heads \
            or stats.head_dim != layout.head_dim:
        raise KvzError(f"attention statistics of {stats.num_layers} layers x {stats.kv_heads} heads x "
                       f"{stats.head_dim} do not fit this cache ({layout.num_layers} x {layout.kv_heads} x "
                       f"{layout.head_dim})")
    if config.align:
        if stats.key_frame is None or stats.value_frame is None:
            raise KvzError("the bank's attention statistics lack the rotated-frame weights that --align needs")
        key, val = stats.key_frame, stats.value_frame
    else:
        key, val = stats.key_weights(), stats.value_gram_diag
    return [np.asarray(key[layer] if kind == "K" else val[layer], np.float64) for layer, kind in layout.tensors()]


def step_codes(stats, layout, config) -> list[np.ndarray]:
    """The ``step_codes`` of every tensor (uint8 ``[kv_heads * head_dim]``, layout order)."""
    return [np.concatenate([codes_for_weights(wh) for wh in w]) for w in channel_weights(stats, layout, config)]


def _visible(layout, layer: int, window: int) -> np.ndarray:
    """How many prefill queries could attend each position of ``layer`` (causal; a sliding
    window of ``window`` in sliding layers) — float64 [n_tokens]."""
    T = layout.n_tokens
    n = (T - np.arange(T)).astype(np.float64)
    if window and "sliding" in str(layout.layer_types[layer] if layout.layer_types else ""):
        n = np.minimum(n, float(window))
    return n


def row_weights(capture, layout, window: int = 0) -> list[np.ndarray]:
    """Per tensor (layout order), the weight of every position (float64 [n_tokens]) from a
    prefill's attention (:class:`~alignpred.bank.CaptureStats`): for keys the attention a
    position received (a logit error there moves the output by that much), for values the sum of
    its squared attention weights (its error's weight in the attention output), both per query
    that could see it (the causal bias of a prefill taken out), mean over the KV heads."""
    L, H, T = capture.mass.shape
    if (L, T) != (layout.num_layers, layout.n_tokens) or H != layout.kv_heads:
        raise KvzError(f"capture statistics of {L} layers x {H} heads x {T} tokens do not fit this cache "
                       f"({layout.num_layers} x {layout.kv_heads} x {layout.n_tokens})")
    out = []
    for layer, kind in layout.tensors():
        a = (capture.mass if kind == "K" else capture.sq)[layer].astype(np.float64).mean(axis=0)
        out.append(a * T / _visible(layout, layer, window))
    return out


def row_codes(capture, layout, config) -> list[np.ndarray]:
    """The ``row_codes`` of every tensor (uint8 [n_tokens]): :func:`codes_for_weights` of the
    positions' weights (:func:`row_weights`) over the positions a later query reads; the sink
    and the stale rows keep code 32 (their own factors, ``sink_scale`` / ``stale_scale``, apply)."""
    out = []
    T = layout.n_tokens
    for (layer, _), w in zip(layout.tensors(), row_weights(capture, layout, config.stale_window)):
        codes = np.full(T, STEP_UNIT, np.uint8)
        first = max(config.sink_rows(0, layout.position_offset), config.stale_rows(0, layout, layer))
        if first < T:
            codes[first:] = codes_for_weights(w[first:], ROW_PER_OCTAVE)
        out.append(codes)
    return out
