"""A torch reference decoder of the ``lanes32`` bitstream: all 32 lanes of an object in lock-step.

Every step decodes one symbol of every lane with whole-tensor operations (a table gather, the
state update, the renormalisation from each lane's own word stream, the raw chunks, the value),
so nothing but the symbol count orders the work: the shape of a GPU decoder, where each lane is a
thread.  It is a reference (one Python-level step per 32 symbols), not a fast path; it gives the
same values and raises the same :class:`~alignpred.errors.FormatError` as the numba decoders.
torch is imported when this module is, so the core never needs it.

>>> import numpy as np
>>> from alignpred.entropy import lanes
>>> q = np.array([[0, 3, -70000, 5]], np.int32); ids = np.array([7])
>>> decode(lanes.encode(q, ids), ids, q.shape).tolist()
[[0, 3, -70000, 5]]
"""
from __future__ import annotations

import numpy as np
import torch

from alignpred.entropy import lanes
from alignpred.errors import FormatError

_L = lanes.STATE_L


def _fail(code: int):
    raise FormatError(f"lanes32 payload invalid: {lanes.ERROR_TEXT[code]}")


def _lane_table(w: torch.Tensor, W: int, hw: int):
    if W < hw:
        _fail(lanes.ERR_SHORT)
    x = w[0:64:2] | (w[1:64:2] << 16)
    if bool((x < _L).any()):
        _fail(lanes.ERR_BAD_STATE)
    cnt = w[64:96] if hw == 96 else (w[64:128:2] | (w[65:128:2] << 16))
    end = hw + torch.cumsum(cnt, 0)
    if int(end[-1]) != W:
        _fail(lanes.ERR_TILING)
    return x, end - cnt, end


def _renorm(x, pos, w, W, active):
    need = (x < _L) & active
    x = torch.where(need, (x << 16) | w[pos.clamp(max=W)], x)
    return x, pos + need.long()


def decode(buf, ids, shape, device: str = "cpu") -> np.ndarray:
    """Decode a ``lanes32`` payload (bytes-like) of ``shape = (C, N)`` with model ids ``ids``;
    int32 numpy array [C, N]."""
    C, N = (int(s) for s in shape)
    n = C * N
    raw = np.frombuffer(bytes(buf), np.uint8)
    if n == 0:
        if raw.size:
            raise FormatError("non-empty payload for an empty object")
        return np.zeros((C, N), np.int32)
    if raw.size % 2:
        _fail(lanes.ERR_SHORT)
    prec = lanes.LANES_PREC
    _, dtab = lanes.tables(prec)
    tab = torch.from_numpy(dtab.astype(np.int64)).to(device)
    W = raw.size // 2
    w = torch.from_numpy(lanes.padded_words(raw).astype(np.int64)).to(device)
    x, pos, end = _lane_table(w, W, lanes.header_words(n))
    steps = (n + 31) // 32
    sym = torch.arange(steps * 32, device=device).reshape(steps, 32)
    active_all = sym < n
    chan = torch.clamp(sym // N, max=C - 1)
    mbase = torch.as_tensor(np.asarray(ids, np.int64), device=device)[chan] << prec
    vals = torch.zeros(steps, 32, dtype=torch.int64, device=device)
    mask = (1 << prec) - 1
    for k in range(steps):
        act = active_all[k]
        e = tab[mbase[k] + (x & mask)]
        tok = e & 0xFF
        x = torch.where(act, (e >> 20) * (x >> prec) + ((e >> 8) & 0xFFF), x)
        x, pos = _renorm(x, pos, w, W, act)
        big = tok >= 16
        nb = torch.where(big, ((tok - 16) >> 2) + 2, torch.zeros_like(tok))
        k1 = nb.clamp(max=16)
        r = x & ((1 << k1) - 1)
        x = x >> k1
        x, pos = _renorm(x, pos, w, W, act)
        k2 = (nb - 16).clamp(min=0)
        r = r | ((x & ((1 << k2) - 1)) << 16)
        x = x >> k2
        x, pos = _renorm(x, pos, w, W, act)
        nn = nb + 2
        u = torch.where(big, (1 << nn) | (((tok >> 1) & 1) << (nn - 1)) | (tok & 1) | (r << 1), tok)
        vals[k] = (u >> 1) ^ -(u & 1)
    if bool((pos != end).any()):
        _fail(lanes.ERR_WORDS)
    if bool((x != _L).any()):
        _fail(lanes.ERR_FINAL)
    return vals.reshape(-1)[:n].to(torch.int32).cpu().numpy().reshape(C, N)
