"""Numba kernels of the ``rans4`` entropy coder (see :mod:`alignpred.entropy` for the format).

Everything here is integer-only (``uint64`` state arithmetic, no floats, no fastmath), so the
bytes are identical on every machine.  The kernels never raise: decoding returns an error code
(``ERR_*``) that :mod:`alignpred.entropy` turns into :class:`alignpred.errors.FormatError`, and
every read of the input is bounds-checked.

The token mapping (shared by both coders and by the model tables)::

    u = zigzag(v) = (v << 1) ^ (v >> 31)        as uint32 (v >= 0 -> 2v, v < 0 -> -2v-1)
    u <  16:  token = u,                         no raw bits
    u >= 16:  n = floor(log2(u))                 (4 <= n <= 31)
              token = 16 + 4*(n-4) + 2*bit(u, n-1) + bit(u, 0)
              raw   = (u >> 1) & (2**(n-2) - 1), nbits = n-2 raw bits

so the token carries the sign (bit 0 of u), the octave and the bit after the leading one; the
``n-2`` bits in between are sent raw.  128 tokens cover every int32 value.
"""

from __future__ import annotations

import numpy as np

from alignpred.kernels._jit import njit

# --- format constants (changing any of them is a new bitstream version) -------------------
PREC = 15                      # probability precision: frequencies sum to 2**PREC
K_DIRECT = 4                   # u < 2**K_DIRECT is a token by itself
N_TOKENS = (1 << K_DIRECT) + 4 * (32 - K_DIRECT)   # 128
N_LANES = 4                    # interleaved rANS states
STATE_BYTES = 8 * N_LANES      # flushed states at the start of a payload
COARSE_SHIFT = 3               # decoder lookup: one table entry per 2**COARSE_SHIFT slots

_U64_0 = np.uint64(0)
_U64_1 = np.uint64(1)
_L = np.uint64(1 << 32)                      # lower bound of the normalised state interval
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_PREC_U = np.uint64(PREC)
_SLOT_MASK = np.uint64((1 << PREC) - 1)
_XMAX_SHIFT = np.uint64(64 - PREC)           # token renorm bound: x >= freq << (64 - PREC)
_U16 = np.uint64(16)
_MASK16 = np.uint64(0xFFFF)
_COARSE_SHIFT_U = np.uint64(COARSE_SHIFT)

ERR_OK = 0
ERR_EOF = 1          # ran out of input words
ERR_BAD_STATE = 2    # an initial state is outside [2**32, 2**64)
ERR_FINAL = 3        # final states differ from the initial value 2**32
ERR_TRAILING = 4     # input words left over after the last symbol

ERROR_TEXT = {
    ERR_EOF: "payload ends before the last symbol (ran out of input)",
    ERR_BAD_STATE: "initial rANS state out of range",
    ERR_FINAL: "final rANS state differs from the initial state",
    ERR_TRAILING: "trailing words after the last symbol",
}


def token_tables() -> tuple[np.ndarray, np.ndarray]:
    """Per-token ``base`` (uint64) and ``nbits`` (uint64): ``u = base | (raw << 1)``.

    >>> base, nb = token_tables()
    >>> int(base[15]), int(nb[15]), int(base[16]), int(nb[16]), int(nb[-1])
    (15, 0, 16, 2, 29)
    """
    base = np.zeros(N_TOKENS, dtype=np.uint64)
    nbits = np.zeros(N_TOKENS, dtype=np.uint64)
    for t in range(N_TOKENS):
        if t < (1 << K_DIRECT):
            base[t] = t
        else:
            r = t - (1 << K_DIRECT)
            n = K_DIRECT + (r >> 2)
            m = (r >> 1) & 1
            s = r & 1
            base[t] = (1 << n) | (m << (n - 1)) | s
            nbits[t] = n - 2
    return base, nbits


@njit(cache=True)
def _ilog2(u):
    """floor(log2(u)) for 1 <= u < 2**32 (integer-only)."""
    n = 0
    if u >= 65536:
        u >>= 16
        n += 16
    if u >= 256:
        u >>= 8
        n += 8
    if u >= 16:
        u >>= 4
        n += 4
    if u >= 4:
        u >>= 2
        n += 2
    if u >= 2:
        n += 1
    return n


@njit(cache=True)
def _tokenize(v):
    """int value -> (token, nbits, raw) as int64s."""
    vi = np.int64(v)
    if vi >= 0:
        u = vi << 1
    else:
        u = ((-vi) << 1) - 1
    if u < 16:
        return u, 0, 0
    n = _ilog2(u)
    tok = 16 + 4 * (n - 4) + 2 * ((u >> (n - 1)) & 1) + (u & 1)
    nb = n - 2
    raw = (u >> 1) & ((1 << nb) - 1)
    return tok, nb, raw


@njit(cache=True)
def tokenize_array(q):
    """Tokens (uint8) and raw-bit counts (uint8) of an int32 array of any shape (flattened)."""
    flat = q.ravel()
    n = flat.size
    toks = np.empty(n, dtype=np.uint8)
    nbs = np.empty(n, dtype=np.uint8)
    for i in range(n):
        t, nb, raw = _tokenize(flat[i])
        toks[i] = t
        nbs[i] = nb
    return toks, nbs


@njit(cache=True)
def histogram(q, n_tokens):
    """Per-row token histogram (int64 [C, T]) and total raw bits per row (int64 [C])."""
    C, N = q.shape
    hist = np.zeros((C, n_tokens), dtype=np.int64)
    raw_bits = np.zeros(C, dtype=np.int64)
    for c in range(C):
        rb = 0
        for t in range(N):
            tok, nb, raw = _tokenize(q[c, t])
            hist[c, tok] += 1
            rb += nb
        raw_bits[c] = rb
    return hist, raw_bits


@njit(cache=True)
def model_costs(hist, cost_fx):
    """Fixed-point cost (int64 [C, M]) of coding each row's histogram with each model.

    ``cost_fx[m, t]`` is the cost of token t under model m in units of 2**-16 bit; the sum is
    exact integer arithmetic, so model choice is identical on every machine.
    """
    C, T = hist.shape
    M = cost_fx.shape[0]
    out = np.zeros((C, M), dtype=np.int64)
    for c in range(C):
        for t in range(T):
            h = hist[c, t]
            if h != 0:
                for m in range(M):
                    out[c, m] += h * np.int64(cost_fx[m, t])
    return out


@njit(cache=True)
def pack_raw(q):
    """Raw bits of all symbols of q in order i = 0.., packed LSB-first into uint32 words."""
    flat = q.ravel()
    n = flat.size
    total = 0
    for i in range(n):
        tok, nb, raw = _tokenize(flat[i])
        total += nb
    out = np.zeros((total + 31) // 32, dtype=np.uint32)
    acc = _U64_0
    fill = 0
    o = 0
    for i in range(n):
        tok, nb, raw = _tokenize(flat[i])
        if nb > 0:
            acc |= np.uint64(raw) << np.uint64(fill)
            fill += nb
            if fill >= 32:
                out[o] = np.uint32(acc & _MASK32)
                o += 1
                acc >>= _SHIFT32
                fill -= 32
    if fill > 0:
        out[o] = np.uint32(acc & _MASK32)
    return out


@njit(cache=True)
def encode_kernel(q, ids, packed):
    """Encode q (int32 [C, N], C*N > 0) with models ``ids``; returns the payload as uint32 words.

    ``packed[m, t] = freq << 16 | cum``.
    """
    C, N = q.shape
    n = C * N
    raw_words = pack_raw(q)
    stack = np.empty(n + 1, dtype=np.uint32)
    pos = stack.shape[0]
    # x0 is the state of the lane of the current symbol i, x1 that of i+1, ... (mod 4)
    x0 = _L
    x1 = _L
    x2 = _L
    x3 = _L
    for cc in range(C):
        c = C - 1 - cc
        pk = packed[ids[c]]
        for tt in range(N):
            t = N - 1 - tt
            tok, nb, raw = _tokenize(q[c, t])
            x = x0
            p = np.uint64(pk[tok])
            f = p >> _U16
            if x >= (f << _XMAX_SHIFT):
                pos -= 1
                stack[pos] = np.uint32(x & _MASK32)
                x >>= _SHIFT32
            x = ((x // f) << _PREC_U) + (x % f) + (p & _MASK16)
            # rotate backwards: the new x0 is the lane of symbol i-1
            x0 = x3
            x3 = x2
            x2 = x1
            x1 = x
    # now x1 = lane 0, x2 = lane 1, x3 = lane 2, x0 = lane 3
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


@njit(cache=True)
def _raw_bits(words, last, bitpos, nb):
    """nb (<= 29) raw bits at bit offset bitpos of the raw stream (word j at index last - j)."""
    j = bitpos >> 5
    lo = np.uint64(words[max(last - j, 0)])
    hi = np.uint64(words[max(last - j - 1, 0)])
    return (((hi << _SHIFT32) | lo) >> np.uint64(bitpos & 31)) & ((_U64_1 << nb) - _U64_1)


_U64_5 = np.uint64(5)
_U64_31 = np.uint64(31)


@njit(cache=True, nogil=True)
def _raw_bits_u(words, last, bitpos, nb):
    """:func:`_raw_bits` with unsigned ``last``/``bitpos`` (no negative-index wraparound code):
    the same words are read (index ``max(last - j, 0)`` and ``max(last - j - 1, 0)``)."""
    j = bitpos >> _U64_5
    i0 = last - j if j <= last else _U64_0
    i1 = i0 - _U64_1 if i0 >= _U64_1 else _U64_0
    lo = np.uint64(words[i0])
    hi = np.uint64(words[i1])
    return (((hi << _SHIFT32) | lo) >> (bitpos & _U64_31)) & ((_U64_1 << nb) - _U64_1)


@njit(cache=True)
def _finish(x0, x1, x2, x3, pos, bitpos, words):
    W = words.shape[0]
    n_raw = (bitpos + 31) >> 5
    if pos + n_raw > W:
        return ERR_EOF
    if x0 != _L or x1 != _L or x2 != _L or x3 != _L:
        return ERR_FINAL
    if pos + n_raw != W:
        return ERR_TRAILING
    if bitpos & 31:   # padding bits of the last raw word must be zero
        if (np.uint64(words[W - n_raw]) >> np.uint64(bitpos & 31)) != _U64_0:
            return ERR_TRAILING
    return ERR_OK


@njit(cache=True)
def _value(base_t, r):
    ui = np.int64(base_t | (r << _U64_1))
    return np.int32((ui >> 1) ^ (-(ui & 1)))


@njit(cache=True, nogil=True)
def decode_kernel(words, ids, coarse, cumhi, packed, base, nbits, out):
    """Decode a payload (uint32 words) into ``out`` (int32 [C, N]); returns an ``ERR_*`` code.

    ``coarse[m, s >> COARSE_SHIFT]`` is the token holding slot ``s & ~(2**COARSE_SHIFT - 1)``
    and ``cumhi[m, t] = cum + freq`` (the exact token is found by stepping forward).  All reads
    are clamped to the buffer, and running past the end (or the two streams overlapping) is
    detected at the end; no input can make it read or write out of bounds, or loop forever.
    """
    C, N = out.shape
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
    pos = 8          # next rANS word (forward from the front)
    bitpos = 0       # raw bits consumed (raw words stored backwards from the end)
    cs = _COARSE_SHIFT_U
    if N % 4 == 0:
        # lock-step: 4 consecutive symbols of one channel are lanes 0..3.  Positions are
        # unsigned (no wraparound code), and a group of four tokens without raw bits (the common
        # case) takes its values from a table; the words read and the values are those of the
        # one-symbol-at-a-time definition below.
        upos = np.uint64(pos)
        ulast = np.uint64(last)
        ubit = _U64_0
        val0 = np.empty(base.shape[0], np.int32)
        for t in range(base.shape[0]):
            val0[t] = _value(base[t], _U64_0)
        for c in range(C):
            m = ids[c]
            tab = coarse[m]
            hi = cumhi[m]
            pk = packed[m]
            orow = out[c]
            for g in range(N // 4):
                s0 = x0 & _SLOT_MASK
                s1 = x1 & _SLOT_MASK
                s2 = x2 & _SLOT_MASK
                s3 = x3 & _SLOT_MASK
                t0 = tab[s0 >> cs]
                t1 = tab[s1 >> cs]
                t2 = tab[s2 >> cs]
                t3 = tab[s3 >> cs]
                while s0 >= hi[t0]:
                    t0 += 1
                while s1 >= hi[t1]:
                    t1 += 1
                while s2 >= hi[t2]:
                    t2 += 1
                while s3 >= hi[t3]:
                    t3 += 1
                p0 = np.uint64(pk[t0])
                p1 = np.uint64(pk[t1])
                p2 = np.uint64(pk[t2])
                p3 = np.uint64(pk[t3])
                x0 = (p0 >> _U16) * (x0 >> _PREC_U) + s0 - (p0 & _MASK16)
                x1 = (p1 >> _U16) * (x1 >> _PREC_U) + s1 - (p1 & _MASK16)
                x2 = (p2 >> _U16) * (x2 >> _PREC_U) + s2 - (p2 & _MASK16)
                x3 = (p3 >> _U16) * (x3 >> _PREC_U) + s3 - (p3 & _MASK16)
                # renormalise in lane order (branch-free; reads clamped, overrun checked at end)
                w = np.uint64(words[min(upos, ulast)])
                r = x0 < _L
                x0 = ((x0 << _SHIFT32) | w) if r else x0
                upos += np.uint64(r)
                w = np.uint64(words[min(upos, ulast)])
                r = x1 < _L
                x1 = ((x1 << _SHIFT32) | w) if r else x1
                upos += np.uint64(r)
                w = np.uint64(words[min(upos, ulast)])
                r = x2 < _L
                x2 = ((x2 << _SHIFT32) | w) if r else x2
                upos += np.uint64(r)
                w = np.uint64(words[min(upos, ulast)])
                r = x3 < _L
                x3 = ((x3 << _SHIFT32) | w) if r else x3
                upos += np.uint64(r)
                # raw bits and output values
                k = 4 * g
                nb0 = nbits[t0]
                nb1 = nbits[t1]
                nb2 = nbits[t2]
                nb3 = nbits[t3]
                if (nb0 | nb1 | nb2 | nb3) == _U64_0:
                    orow[k] = val0[t0]
                    orow[k + 1] = val0[t1]
                    orow[k + 2] = val0[t2]
                    orow[k + 3] = val0[t3]
                else:
                    orow[k] = _value(base[t0], _raw_bits_u(words, ulast, ubit, nb0))
                    ubit += nb0
                    orow[k + 1] = _value(base[t1], _raw_bits_u(words, ulast, ubit, nb1))
                    ubit += nb1
                    orow[k + 2] = _value(base[t2], _raw_bits_u(words, ulast, ubit, nb2))
                    ubit += nb2
                    orow[k + 3] = _value(base[t3], _raw_bits_u(words, ulast, ubit, nb3))
                    ubit += nb3
        return _finish(x0, x1, x2, x3, np.int64(upos), np.int64(ubit), words)
    # general N: one symbol at a time, states rotating so that x0 is lane i mod 4
    for c in range(C):
        m = ids[c]
        tab = coarse[m]
        hi = cumhi[m]
        pk = packed[m]
        for t in range(N):
            x = x0
            s = x & _SLOT_MASK
            tok = tab[s >> cs]
            while s >= hi[tok]:
                tok += 1
            p = np.uint64(pk[tok])
            x = (p >> _U16) * (x >> _PREC_U) + s - (p & _MASK16)
            w = np.uint64(words[min(pos, last)])
            r = x < _L
            x = ((x << _SHIFT32) | w) if r else x
            pos += r
            nb = nbits[tok]
            out[c, t] = _value(base[tok], _raw_bits(words, last, bitpos, nb))
            bitpos += np.int64(nb)
            x0 = x1
            x1 = x2
            x2 = x3
            x3 = x
    return _finish(x0, x1, x2, x3, pos, bitpos, words)


@njit(cache=True)
def detokenize(toks, raw_words, base, nbits, out_flat):
    """Tokens + raw words (forward order) -> values (constriction path).  Returns ERR_*."""
    n = toks.size
    RW = raw_words.size
    acc = _U64_0
    fill = _U64_0
    rpos = 0
    for i in range(n):
        tok = toks[i]
        nb = nbits[tok]
        if fill < nb:
            if rpos >= RW:
                return ERR_EOF
            acc |= np.uint64(raw_words[rpos]) << fill
            fill += _SHIFT32
            rpos += 1
        u = base[tok] | ((acc & ((_U64_1 << nb) - _U64_1)) << _U64_1)
        acc >>= nb
        fill -= nb
        ui = np.int64(u)
        out_flat[i] = np.int32((ui >> 1) ^ (-(ui & 1)))
    if rpos != RW or acc != _U64_0:
        return ERR_TRAILING
    return ERR_OK
