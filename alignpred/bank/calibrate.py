"""Fit a calibration bank from KV caches: block means, GPA rotations per group, prediction maps.

Prediction maps are ridge regressions, closed-loop aware: the references the decoder will see
carry quantisation noise of relative size about ``eps_cal``, so the ridge term of each source
block is that noise's variance (the expected normal equations under noise). A reduced-rank
projection keeps the top ``rank`` output directions (``rank=None``: full rank).

>>> import numpy as np
>>> from alignpred.cache.layout import CacheLayout
>>> lay = CacheLayout(num_layers=3, kv_heads=1, head_dim=4, n_tokens=8, dtype="float32")
>>> default_groups(lay, size=2)
[['K.0.0', 'K.1.0'], ['K.2.0'], ['V.0.0', 'V.1.0'], ['V.2.0']]
>>> default_sources(lay)["V.1.0"]
['V.0.0', 'K.1.0', 'K.0.0']
"""
from __future__ import annotations

import numpy as np

from alignpred.bank.bank import Bank, block_name
from alignpred.bank.gpa import fit_gpa
from alignpred.cache.rope import apply_rope
from alignpred.errors import BankMismatchError, LayoutError


def default_groups(layout, size: int = 3) -> list[list[str]]:
    """GPA groups: the KV heads of a layer; with one KV head, runs of up to ``size`` neighbouring
    layers of the same attention type (a leftover layer is a singleton)."""
    groups = []
    for kind in ("K", "V"):
        if layout.kv_heads > 1:
            for i in range(layout.num_layers):
                groups.append([block_name(kind, i, h) for h in range(layout.kv_heads)])
            continue
        types = layout.layer_types or ("",) * layout.num_layers
        run: list[str] = []
        for i in range(layout.num_layers):
            if run and (types[i] != types[i - 1] or len(run) == size):
                groups.append(run)
                run = []
            run.append(block_name(kind, i, 0))
        groups.append(run)
    return groups


def default_sources(layout, depth: int = 1) -> dict[str, list[str]]:
    """Prediction sources per block, all decoded before it: ``K_l <- K_{l-1}, V_{l-1}`` (+ earlier
    heads of layer l); ``V_l <- V_{l-1}, K_l, K_{l-1}`` (+ earlier heads). ``depth=2`` adds
    ``K_{l-2}, V_{l-2}`` to both."""
    src = {}
    for i in range(layout.num_layers):
        for h in range(layout.kv_heads):
            back = [block_name(kind, i - j, h) for j in range(2, depth + 1) if i - j >= 0 for kind in ("K", "V")]
            k = [block_name("K", i - 1, h), block_name("V", i - 1, h)] if i else []
            k += [block_name("K", i, g) for g in range(h)] + back
            v = ([block_name("V", i - 1, h)] if i else []) + [block_name("K", i, h)]
            v += [block_name("K", i - 1, h)] if i else []
            v += [block_name("V", i, g) for g in range(h)] + back
            src[block_name("K", i, h)] = k
            src[block_name("V", i, h)] = v
    return src


def block_samples(cache, block: str, max_tokens: int | None = None) -> np.ndarray:
    """The block's vectors ``[T, d]`` in float32, with RoPE undone for keys."""
    lay = cache.layout
    kind, layer_s, head_s = block.split(".")
    layer, head = int(layer_s), int(head_s)
    t = cache.tensors[f"layers.{layer}.{'key' if kind == 'K' else 'value'}"]
    if lay.batch_dim:
        t = t[0]
    x = np.asarray(t[head], dtype=np.float32)
    if max_tokens:
        x = x[:max_tokens]
    if kind == "K" and lay.keys_roped:
        if lay.rope is None:  # default RoPE from rope_theta: the tables kvz 0.1 fitted its banks with
            x = apply_rope(x, np.arange(x.shape[0]) + lay.position_offset, lay.rope_theta[layer], inverse=True,
                           pairing=lay.rope_pairing)
        elif lay.rope.table(layer) is not None:
            x = lay.rope.table(layer).apply(x, lay.position_offset, inverse=True)
    return x


def fit_bank(caches, *, rank: int | None = None, eps_cal: float = 0.03, group_size: int = 3, depth: int = 1,
             groups: list[list[str]] | None = None, rotations: bool = True, maps: bool = True,
             max_tokens: int | None = None, dtype: str = "float16", progress=None,
             sources: dict[str, list[str]] | None = None) -> Bank:
    """Fit a :class:`Bank` on one or more caches of the same layout. ``sources``: the map sources
    per block (default :func:`default_sources` with ``depth``); each must be decoded before its
    block (an earlier layer, or an earlier tensor of the same layer)."""
    if not caches:
        raise LayoutError("calibration needs at least one cache")
    lay = caches[0].layout
    for c in caches[1:]:
        if c.layout.signature() != lay.signature():
            raise BankMismatchError(f"calibration caches disagree: {c.layout.signature()} vs {lay.signature()}")
    groups = groups or default_groups(lay, group_size)
    blocks = [b.name for b in lay.blocks()]
    if sources is not None and maps:
        order = {b: i for i, b in enumerate(blocks)}
        for b, src in sources.items():
            if b not in order or any(s not in order or order[s] >= order[b] for s in src):
                raise LayoutError(f"map sources {src} of {b}: every source must be a block decoded before it")
    sources = (default_sources(lay, depth) if sources is None else dict(sources)) if maps else {}
    store = np.dtype(dtype)
    samples = {}
    for b in blocks:
        samples[b] = np.concatenate([block_samples(c, b, max_tokens) for c in caches], axis=0)
        if progress:
            progress(1)
    arrays = {}
    means = {b: samples[b].astype(np.float64).mean(axis=0) for b in blocks}
    for b in blocks:
        arrays[f"mean/{b}"] = means[b].astype(np.float32)
    if rotations:
        for g in groups:
            _, rots = fit_gpa([samples[b] for b in g])
            for b, a in zip(g, rots):
                arrays[f"rot/{b}"] = a.astype(store)
    if maps:
        for b in blocks:
            src = sources.get(b, [])
            if not src:
                continue
            u, vt = fit_map([samples[s] - means[s] for s in src], samples[b] - means[b], eps_cal, rank)
            if vt is None:
                arrays[f"map/{b}/W"] = u.astype(store)
            else:
                arrays[f"map/{b}/U"] = u.astype(store)
                arrays[f"map/{b}/Vt"] = vt.astype(store)
    config = {"groups": groups, "sources": {b: s for b, s in sources.items() if s}, "rank": rank,
              "eps_cal": eps_cal, "n_positions": int(samples[blocks[0]].shape[0]),
              "rope_undone": bool(lay.keys_roped)}
    return Bank(model=lay.model, signature=lay.signature(), config=config, arrays=arrays)


def fit_map(srcs: list[np.ndarray], y: np.ndarray, eps_cal: float, rank: int | None):
    """Noise-aware ridge map from stacked sources to ``y``; returns ``(U, Vt)``, or ``(W, None)``
    at full rank."""
    s = np.concatenate(srcs, axis=1).astype(np.float64)
    y = np.asarray(y, np.float64)
    n = s.shape[0]
    noise = np.concatenate([np.full(x.shape[1], eps_cal ** 2 * float(np.mean(np.square(x)))) for x in srcs])
    gram = s.T @ s + n * np.diag(noise) + 1e-9 * np.eye(s.shape[1])
    w = np.linalg.solve(gram, s.T @ y)
    d = y.shape[1]
    if rank is None or rank >= min(s.shape[1], d):
        return w, None
    fitted = s @ w
    _, vecs = np.linalg.eigh(fitted.T @ fitted)  # right singular vectors of the fitted values
    v = vecs[:, ::-1][:, :rank]
    return w @ v, v.T
