"""``rans4`` with a model per *symbol* instead of per channel (the refinement tier's coder).

Same bitstream as :mod:`alignpred.entropy.rans` (token mapping, four interleaved 64-bit lanes, symbol
``i`` on lane ``i mod 4``, rANS words from the front, raw bits from the back, the same validity
checks), except that symbol ``i`` is coded with model ``ids[i]`` — a context the decoder knows
before it decodes the symbol (for the refinement tier: the exponent of the coarse value).
Integer-only, like every entropy kernel: the bytes are the same on every machine.

>>> import numpy as np
>>> from alignpred.entropy.models import load
>>> t = load()
>>> q = np.array([0, 5, -3, 100000, 7], np.int32)
>>> ids = np.array([0, 3, 3, 200, 3], np.int64)
>>> w = encode_kernel(q, ids, t.packed)
>>> out = np.empty(5, np.int32)
>>> decode_kernel(w, ids, t.coarse, t.cumhi, t.packed, t.base, t.nbits, out), out.tolist()
(0, [0, 5, -3, 100000, 7])
"""
from __future__ import annotations

import numpy as np

from alignpred.entropy.rans import (
    _COARSE_SHIFT_U,
    _L,
    _MASK16,
    _MASK32,
    _PREC_U,
    _SHIFT32,
    _SLOT_MASK,
    _U16,
    _XMAX_SHIFT,
    ERR_BAD_STATE,
    ERR_EOF,
    _finish,
    _raw_bits,
    _tokenize,
    _value,
    pack_raw,
)
from alignpred.kernels._jit import njit


@njit(cache=True, nogil=True)
def encode_kernel(q, ids, packed):
    """Encode ``q`` (int32 [n], n > 0) with per-symbol models ``ids`` (int64 [n]); uint32 words."""
    n = q.shape[0]
    raw_words = pack_raw(q)
    stack = np.empty(n + 1, dtype=np.uint32)
    pos = stack.shape[0]
    x0 = _L
    x1 = _L
    x2 = _L
    x3 = _L
    for ii in range(n):
        i = n - 1 - ii
        tok, nb, raw = _tokenize(q[i])
        p = np.uint64(packed[ids[i], tok])
        f = p >> _U16
        x = x0
        if x >= (f << _XMAX_SHIFT):
            pos -= 1
            stack[pos] = np.uint32(x & _MASK32)
            x >>= _SHIFT32
        x = ((x // f) << _PREC_U) + (x % f) + (p & _MASK16)
        x0 = x3
        x3 = x2
        x2 = x1
        x1 = x
    # after the loop x1 holds lane 0 (as in rans.encode_kernel)
    n_ans = stack.shape[0] - pos
    n_raw = raw_words.shape[0]
    out = np.empty(8 + n_ans + n_raw, dtype=np.uint32)
    lanes = (x1, x2, x3, x0)
    for k in range(4):
        out[2 * k] = np.uint32(lanes[k] & _MASK32)
        out[2 * k + 1] = np.uint32(lanes[k] >> _SHIFT32)
    out[8:8 + n_ans] = stack[pos:]
    W = out.shape[0]
    for j in range(n_raw):
        out[W - 1 - j] = raw_words[j]
    return out


@njit(cache=True, nogil=True)
def decode_kernel(words, ids, coarse, cumhi, packed, base, nbits, out):
    """Decode into ``out`` (int32 [n]) with per-symbol models ``ids``; returns an ``ERR_*`` code.
    Reads are clamped to the buffer; overruns are detected at the end (see :mod:`alignpred.entropy.rans`)."""
    n = out.shape[0]
    W = words.shape[0]
    if W < 8:
        return ERR_EOF
    x0 = np.uint64(words[0]) | (np.uint64(words[1]) << _SHIFT32)
    x1 = np.uint64(words[2]) | (np.uint64(words[3]) << _SHIFT32)
    x2 = np.uint64(words[4]) | (np.uint64(words[5]) << _SHIFT32)
    x3 = np.uint64(words[6]) | (np.uint64(words[7]) << _SHIFT32)
    if x0 < _L or x1 < _L or x2 < _L or x3 < _L:
        return ERR_BAD_STATE
    last = W - 1
    pos = 8
    bitpos = 0
    for i in range(n):
        m = ids[i]
        x = x0
        s = x & _SLOT_MASK
        tok = coarse[m, s >> _COARSE_SHIFT_U]
        while s >= cumhi[m, tok]:
            tok += 1
        p = np.uint64(packed[m, tok])
        x = (p >> _U16) * (x >> _PREC_U) + s - (p & _MASK16)
        w = np.uint64(words[min(pos, last)])
        r = x < _L
        x = ((x << _SHIFT32) | w) if r else x
        pos += r
        nb = nbits[tok]
        out[i] = _value(base[tok], _raw_bits(words, last, bitpos, nb))
        bitpos += np.int64(nb)
        x0 = x1
        x1 = x2
        x2 = x3
        x3 = x
    return _finish(x0, x1, x2, x3, pos, bitpos, words)
