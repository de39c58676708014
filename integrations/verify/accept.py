"""Acceptance maths of draft/verify decoding: which drafts the verifier keeps, and what it emits next.

* :func:`greedy_accept` — the drafts the verifier's argmax agrees with, then its own argmax;
* :func:`speculative_accept` — speculative sampling (Leviathan et al. 2023; Chen et al. 2023):
  ``d_i`` accepted with probability ``min(1, p_full(d_i) / p_draft(d_i))``, a rejection resampled
  from :func:`residual`, so every emitted token is distributed exactly as in full-KV sampling;
* :func:`sample`, :func:`probs`, :func:`top2_gap` — the small pieces the loop shares.
"""
from __future__ import annotations

import numpy as np

__all__ = ["greedy_accept", "speculative_accept", "residual", "sample", "probs", "top2_gap"]


def greedy_accept(logits, drafts) -> tuple[int, int]:
    """``(k, token)``: the drafts ``d_1..d_k`` the verifier's argmax agrees with (rows
    ``0..k-1`` of ``logits``, ``[len(drafts) + 1, V]``), and its own argmax at row ``k`` (the
    correction, or the bonus token when ``k == len(drafts)``)."""
    am = logits.argmax(-1).tolist() if hasattr(logits, "argmax") else list(np.argmax(logits, -1))
    for i, d in enumerate(drafts):
        if int(am[i]) != int(d):
            return i, int(am[i])
    return len(drafts), int(am[len(drafts)])


def residual(p_full, p_draft) -> np.ndarray:
    """The rejection distribution ``norm(max(p_full - p_draft, 0))`` (float64). If it is all
    zero (``p_draft == p_full``, when a rejection has probability 0) ``p_full`` is returned."""
    r = np.maximum(np.asarray(p_full, np.float64) - np.asarray(p_draft, np.float64), 0.0)
    s = r.sum()
    return r / s if s > 0 else np.asarray(p_full, np.float64) / np.sum(p_full)


def sample(p, rng) -> int:
    """One index drawn from the (unnormalised) distribution ``p`` with the numpy Generator ``rng``."""
    p = np.asarray(p, np.float64)
    c = np.cumsum(p)
    u = rng.random() * c[-1]
    return int(min(np.searchsorted(c, u, side="right"), len(p) - 1))


def speculative_accept(p_full, p_draft, drafts, rng) -> tuple[int, int]:
    """Speculative-sampling acceptance (Leviathan et al. 2023; Chen et al. 2023).

    ``p_full``: ``[x + 1, V]`` verifier distributions (row ``i`` follows ``d_1..d_i``);
    ``p_draft``: ``[x, V]`` the drafter's distributions the drafts were sampled from;
    ``drafts``: ``d_1..d_x``; ``rng``: a numpy Generator. Returns ``(k, token)``: ``d_1..d_k``
    accepted, then ``token`` - resampled from the residual at the first rejection, or drawn from
    ``p_full[x]`` when all were accepted. The emitted sequence is distributed as sampling from
    ``p_full`` autoregressively."""
    for i, d in enumerate(drafts):
        d = int(d)
        pf, pd = float(p_full[i][d]), float(p_draft[i][d])
        if rng.random() < (1.0 if pd <= 0 else min(1.0, pf / pd)):
            continue
        return i, sample(residual(p_full[i], p_draft[i]), rng)
    return len(drafts), sample(p_full[len(drafts)], rng)


def probs(logits, temperature: float) -> np.ndarray:
    """float64 softmax of torch ``logits / temperature`` (numpy)."""
    z = logits.double() / temperature
    return (z - z.logsumexp(-1, keepdim=True)).exp().cpu().numpy()


def top2_gap(logits) -> float:
    """The smallest gap between the two largest logits over the rows of ``logits`` (torch)."""
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())
