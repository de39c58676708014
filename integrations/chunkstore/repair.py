"""Repair of content hits: which reused positions a prefill recomputes, and why.

A content hit's KV was computed after *other* preceding text; re-rotated, it is close to what this
prompt computes but not equal. Repair picks positions to recompute (they then attend to the whole
assembled context); every policy returns a boolean mask over the prompt.

* :func:`seam_starts` — where the preceding context of a content hit differs from the one it was
  stored with (derived from the chunk layout: a content hit that continues the previous content hit
  at the same relative offset, i.e. the next piece of the same stored document, is no seam);
* :func:`seam_mask` — the first ``R`` positions after each seam (SelectiveRecompute);
* :func:`probe_deviation` — a probe pass through layers ``0..P`` over the non-exact positions
  (this makes those layers exact for them) and each candidate's relative K/V deviation at layer
  ``P`` between the stored (re-rotated) KV and what this context computes: the cheap predictor of
  how far the reused KV is from the truth;
* :func:`guided_select` — deviation-guided recomputation: every candidate whose predicted
  deviation exceeds ``threshold`` (capped at ``max_frac`` of the candidates, highest first);
* :func:`blend_select` — CacheBlend-style: the top ``ratio`` fraction by the same deviation.
"""
from __future__ import annotations

import numpy as np

__all__ = ["REPAIRS", "seam_starts", "seam_mask", "probe_deviation", "guided_select", "blend_select"]

REPAIRS = ("none", "seam", "blend", "seam+blend", "guided", "seam+guided")


def seam_starts(hits) -> list:
    """Start positions of the content hits that follow a context other than the stored one.

    A content hit right after another content hit, whose stored position continues that hit's stored
    positions (``src_start == prev.src_start + prev.n``), is the next chunk of the same stored text:
    its preceding tokens are the ones it was computed after, so it has no seam of its own."""
    out, prev = [], None
    for h in sorted(hits, key=lambda h: h.chunk.start):
        if h.kind == "content":
            cont = (prev is not None and prev.kind == "content" and prev.chunk.end == h.chunk.start
                    and prev.src_start + prev.chunk.n == h.src_start)
            if not cont:
                out.append(h.chunk.start)
        prev = h
    return out


def seam_mask(hits, T: int, R: int) -> np.ndarray:
    """The first ``R`` positions after each seam (within its content hit)."""
    m = np.zeros(T, bool)
    if R <= 0:
        return m
    ends = {h.chunk.start: h for h in hits}
    for s in seam_starts(hits):
        # a seam's R tokens may run into the next chunk(s) of the same stored text
        a, left = s, int(R)
        while left > 0 and a in ends and ends[a].kind == "content":
            b = min(ends[a].chunk.end, a + left)
            m[a:b] = True
            left -= b - a
            a = ends[a].chunk.end
    return m


def probe_deviation(engine, ids, K, V, exact, candidates):
    """``(cand, dev)``: candidate positions and their relative K/V deviation at the probe layer.

    Runs layers ``0..P`` (``P = engine.probe_layer``) over every non-exact position (earlier positions
    must be exact at layers ``< P`` for the candidates' layer-P K/V to be right, and every buffered
    position must be written: the additive mask does not hide a NaN left in an unwritten buffer);
    those layers' buffers then hold this context's K/V."""
    import torch

    P = min(engine.probe_layer, engine.n_layers - 1)
    cand = np.nonzero(candidates)[0]
    if not len(cand):
        return cand, np.zeros(0)
    k_old = K[P][0][:, cand].clone()
    v_old = V[P][0][:, cand].clone()
    run = 0
    while run < len(ids) and exact[run]:
        run += 1
    with torch.inference_mode():
        engine._probe(ids, list(range(run, len(ids))), K, V)
    k_new = K[P][0][:, cand]
    v_new = V[P][0][:, cand]

    def rel(new, old):
        num = (new - old).float().pow(2).sum(dim=(0, 2))
        den = new.float().pow(2).sum(dim=(0, 2)).clamp_min(1e-30)
        return (num / den).sqrt()

    dev = (rel(k_new, k_old) + rel(v_new, v_old)).numpy()
    return cand, dev


def guided_select(cand, dev, threshold: float, max_frac: float = 1.0) -> np.ndarray:
    """Candidates whose deviation exceeds ``threshold``, at most ``max_frac`` of them (highest first)."""
    if not len(cand):
        return cand
    over = np.nonzero(dev > threshold)[0]
    cap = int(np.ceil(max_frac * len(cand)))
    if len(over) > cap:
        over = over[np.argsort(-dev[over], kind="stable")[:cap]]
    return np.sort(cand[over])


def blend_select(cand, dev, ratio: float) -> np.ndarray:
    """The top ``ratio`` fraction of the candidates by deviation (at least one)."""
    if not len(cand):
        return cand
    n = max(1, int(round(ratio * len(cand))))
    top = np.argsort(-dev, kind="stable")[:n]
    return np.sort(cand[top])
