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
from numba import njit

# --- format constants (changing any of them is a new bitstream version) -------------------
PREC = 15                      # probability precision: frequencies sum to 2**PREC
K_DIRECT = 4                   # u < 2**K_DIRECT is a token by itself
N_TOKENS = (1 << K_DIRECT) + 4 * (32 - K_DIRECT)   # 128
N_LANES = 4                    # interleaved rANS states
STATE_BYTES = 8 * N_LANES      # flushed states at the start of a payload

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
def encode_kernel(q, ids, packed, out):
    """Encode q (int32 [C, N]) into ``out`` (uint32 words, written from the end backwards).

    ``packed[m, t] = freq << 16 | cum``.  Returns the index of the first word used; the
    payload is ``out[start:]`` (the first 8 words are the flushed states).  ``out`` must hold
    at least ``2 * C * N + 8`` words.
    """
    C, N = q.shape
    pos = out.shape[0]
    # x0 is the state of the lane of the current symbol i, x1 that of i+1, ... (mod 4)
    x0 = _L
    x1 = _L
    x2 = _L
    x3 = _L
    for cc in range(C):
        c = C - 1 - cc
        m = ids[c]
        for tt in range(N):
            t = N - 1 - tt
            tok, nb, raw = _tokenize(q[c, t])
            x = x0
            if nb > 0:
                nbu = np.uint64(nb)
                if x >= (_U64_1 << (np.uint64(64) - nbu)):
                    pos -= 1
                    out[pos] = np.uint32(x & _MASK32)
                    x >>= _SHIFT32
                x = (x << nbu) | np.uint64(raw)
            p = np.uint64(packed[m, tok])
            f = p >> _U16
            cum = p & _MASK16
            if x >= (f << _XMAX_SHIFT):
                pos -= 1
                out[pos] = np.uint32(x & _MASK32)
                x >>= _SHIFT32
            x = ((x // f) << _PREC_U) + (x % f) + cum
            # rotate backwards: the new x0 is the lane of symbol i-1
            x0 = x3
            x3 = x2
            x2 = x1
            x1 = x
    # now x1 = lane 0, x2 = lane 1, x3 = lane 2, x0 = lane 3; flush lane 0 first
    pos -= 8
    lanes = (x1, x2, x3, x0)
    for k in range(4):
        s = lanes[k]
        out[pos + 2 * k] = np.uint32(s & _MASK32)
        out[pos + 2 * k + 1] = np.uint32(s >> _SHIFT32)
    return pos


@njit(cache=True)
def decode_kernel(words, ids, slot2tok, packed, base, nbits, out):
    """Decode into ``out`` (int32 [C, N]).  Returns an ``ERR_*`` code (0 on success)."""
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
    pos = 8
    for c in range(C):
        m = ids[c]
        tab = slot2tok[m]
        pk = packed[m]
        for t in range(N):
            x = x0
            slot = x & _SLOT_MASK
            tok = tab[slot]
            p = np.uint64(pk[tok])
            x = (p >> _U16) * (x >> _PREC_U) + slot - (p & _MASK16)
            if x < _L:
                if pos >= W:
                    return ERR_EOF
                x = (x << _SHIFT32) | np.uint64(words[pos])
                pos += 1
            u = base[tok]
            nb = nbits[tok]
            if nb != _U64_0:
                u |= (x & ((_U64_1 << nb) - _U64_1)) << _U64_1
                x >>= nb
                if x < _L:
                    if pos >= W:
                        return ERR_EOF
                    x = (x << _SHIFT32) | np.uint64(words[pos])
                    pos += 1
            ui = np.int64(u)
            out[c, t] = np.int32((ui >> 1) ^ (-(ui & 1)))
            x0 = x1
            x1 = x2
            x2 = x3
            x3 = x
    if x0 != _L or x1 != _L or x2 != _L or x3 != _L:
        return ERR_FINAL
    if pos != W:
        return ERR_TRAILING
    return ERR_OK


@njit(cache=True)
def pack_raw_bits(q):
    """Raw bits of all symbols of q (row-major), packed LSB-first into bytes (constriction path)."""
    flat = q.ravel()
    n = flat.size
    total = 0
    for i in range(n):
        tok, nb, raw = _tokenize(flat[i])
        total += nb
    out = np.zeros((total + 7) // 8, dtype=np.uint8)
    acc = np.uint64(0)
    fill = 0
    o = 0
    for i in range(n):
        tok, nb, raw = _tokenize(flat[i])
        if nb > 0:
            acc |= np.uint64(raw) << np.uint64(fill)
            fill += nb
            while fill >= 8:
                out[o] = np.uint8(acc & np.uint64(0xFF))
                o += 1
                acc >>= np.uint64(8)
                fill -= 8
    if fill > 0:
        out[o] = np.uint8(acc & np.uint64(0xFF))
    return out


@njit(cache=True)
def detokenize_with_raw(toks, rawbytes, base, nbits, out_flat):
    """Inverse of tokenize + pack_raw_bits.  Returns ERR_OK, ERR_EOF or ERR_TRAILING."""
    n = toks.size
    nbytes = rawbytes.size
    acc = np.uint64(0)
    fill = 0
    ipos = 0
    for i in range(n):
        tok = toks[i]
        u = base[tok]
        nb = np.int64(nbits[tok])
        if nb > 0:
            while fill < nb:
                if ipos >= nbytes:
                    return ERR_EOF
                acc |= np.uint64(rawbytes[ipos]) << np.uint64(fill)
                ipos += 1
                fill += 8
            u |= (acc & ((_U64_1 << np.uint64(nb)) - _U64_1)) << _U64_1
            acc >>= np.uint64(nb)
            fill -= nb
        ui = np.int64(u)
        out_flat[i] = np.int32((ui >> 1) ^ (-(ui & 1)))
    if ipos != nbytes or acc != _U64_0:
        return ERR_TRAILING
    return ERR_OK
