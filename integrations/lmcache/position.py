"""Find a chunk's rotary phase when the caller cannot say where the chunk sits.

LMCache's storage and serde keys carry a chunk hash, never the token position, but kvz codes keys
in a frame with RoPE undone at their absolute positions: a chunk coded with the wrong
``position_offset`` still decodes exactly as well (the same rotation is re-applied), it only costs
bits — measured on Gemma 3 270M, 4.86 instead of 3.76 bpv for a chunk at 192 coded as if at 0.

The search scores every candidate offset by the coding cost of the bank's first frame stage.
With RoPE undone at offset ``o`` the keys of a chunk are ``x_t(o) = R(-(o+t)θ) k_t``, and the
energy left after removing the bank's calibration mean ``μ`` is

    Σ_t ||x_t(o) - μ||² = const - 2T <R(-oθ) m₀, μ>,    m₀ = mean_t R(-tθ) k_t,

so the best offset maximises ``Σ_{layer, head} <R(-oθ) m₀, μ>``: one inverse rotation of the chunk
at offset 0 per layer, then a dot product per candidate (pairs of channels rotated by the candidate's
angles) — all 8,192 positions of a 256-token Gemma 3 chunk in about 0.2 s on one core, no encode.

::

    from kvz.integrations.lmcache.position import find_position_offset
    g = find_position_offset(tensors, metadata, bank="gemma-3-270m", step=256)  # chunk-aligned grid
    g.offset, g.margin         # the best offset; its score minus the best other candidate's

Interface: ``find_position_offset(tensors, metadata, *, bank, step=1, max_positions=8192,
candidates=None) -> PositionGuess(offset, score, margin, scores, candidates)``; ``tensors`` is
``{"layers.{i}.key": [kv_heads, T, head_dim], ...}`` (values are ignored) or a list of ``(k, v)``;
``metadata`` has the model's ``rope_theta`` (per layer or one), ``rope_pairing`` (and optionally a
full ``rope`` spec), as in a kvz cache file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

__all__ = ["PositionGuess", "find_position_offset", "rope_spec_of"]


@dataclass
class PositionGuess:
    offset: int
    score: float
    margin: float  # best score minus the best candidate's outside +-step/2 of it (0 when one candidate)
    scores: np.ndarray
    candidates: np.ndarray


def _bank(bank):
    from alignpred import resolve_bank

    return resolve_bank(bank)


def _field(meta: dict, name: str, default=None):
    v = meta.get(name, default)
    if isinstance(v, str) and name in ("rope_theta", "rope", "layer_types"):
        try:
            return json.loads(v)
        except ValueError:
            return v
    return v


def rope_spec_of(metadata: dict, num_layers: int, head_dim: int):
    """The :class:`alignpred.RopeSpec` of a cache's metadata (``rope`` if given, else
    ``rope_theta`` + ``rope_pairing``)."""
    from alignpred import RopeSpec

    rope = _field(metadata, "rope")
    if rope:
        return RopeSpec.from_json(rope)
    theta = _field(metadata, "rope_theta")
    if theta is None:
        raise ValueError("the cache metadata has no rope_theta (nor rope): the rotary phase cannot be searched")
    if not isinstance(theta, (list, tuple)):
        theta = [float(theta)] * num_layers
    return RopeSpec.from_thetas([float(t) for t in theta], head_dim, pairing=str(metadata.get("rope_pairing", "half")))


def _keys(tensors) -> list:
    from alignpred.cache import as_numpy

    if isinstance(tensors, dict):
        n = sum(1 for k in tensors if k.endswith(".key"))
        return [as_numpy(tensors[f"layers.{i}.key"]) for i in range(n)]
    return [as_numpy(k) for k, _ in tensors]


def find_position_offset(tensors, metadata: dict, *, bank, step: int = 1, max_positions: int = 8192,
                         candidates=None) -> PositionGuess:
    """The offset in ``candidates`` (default ``range(0, max_positions - T + 1, step)``) whose
    frame (RoPE undone there, the bank's key means removed) leaves the least energy — see the
    module docstring."""
    keys = _keys(tensors)
    if not keys:
        raise ValueError("no key tensors to search a position with")
    H, T, D = keys[0].shape[-3:]
    b = _bank(bank)
    spec = rope_spec_of(metadata, len(keys), D)
    if candidates is None:
        step = max(1, int(step))
        candidates = np.arange(0, max(1, int(max_positions) - T + 1), step, dtype=np.int64)
    cand = np.asarray(candidates, np.int64).reshape(-1)
    if cand.size == 0 or cand.min() < 0:
        raise ValueError("position candidates must be non-negative and not empty")
    scores = np.zeros(cand.size, np.float64)
    for li, k in enumerate(keys):
        tab = spec.table(li)
        if tab is None:
            continue
        r = tab.rotary_dim
        h = r // 2
        cos, sin = (np.ascontiguousarray(a[cand - int(cand.min())], np.float64)
                    for a in tab.cos_sin(int(cand.min()), int(cand.max() - cand.min()) + 1))
        for hd in range(H):
            try:
                mu = np.asarray(b.mean(f"K.{li}.{hd}"), np.float64)
            except KeyError:
                continue
            x = tab.apply(np.asarray(k[hd], np.float32), 0, inverse=True)  # [T, D], frame at offset 0
            m0 = x.mean(0).astype(np.float64)
            if tab.pairing == "half":
                a1, a2, u1, u2 = m0[:h], m0[h:r], mu[:h], mu[h:r]
            else:
                a1, a2, u1, u2 = m0[0:r:2], m0[1:r:2], mu[0:r:2], mu[1:r:2]
            # R(-oθ) on (a1, a2): (a1 cos + a2 sin, a2 cos - a1 sin)
            scores += cos @ (a1 * u1 + a2 * u2) + sin @ (a2 * u1 - a1 * u2)
    best = int(np.argmax(scores))
    off = int(cand[best])
    far = np.abs(cand - off) > max(1, int(step)) // 2
    margin = float(scores[best] - scores[far].max()) if far.any() else 0.0
    return PositionGuess(off, float(scores[best]), margin, scores, cand)
