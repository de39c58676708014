"""The ``lanes32`` entropy coder: 32 interleaved 32-bit rANS lanes in lock-step (format 1.2).

The bitstream is specified in :mod:`alignpred.entropy.coder` (and ``format_spec/kvz.md``, §7.3).
In brief: symbol ``i`` is on lane ``i mod 32``; every lane has a 32-bit state in
``[2**16, 2**32)``, renormalises with 16-bit words read from its *own* word stream, and codes
its raw bits in its own state (uniform symbols of at most 16 bits), so the 32 lanes share
nothing but the model tables: a SIMD decoder steps all 32 with gathers, a GPU decoder gives
each lane a thread.  Probabilities have ``LANES_PREC = 12`` bits (one 32-bit decode-table entry
holds frequency, slot bias and token, 16 KiB per model).

This module holds the tables, the encoder and the portable decoder (plain numba, one lane
after another); :mod:`alignpred.entropy.lanes_simd` the vectorised decoder, and
:mod:`alignpred.entropy.lanes_torch` a torch reference decoder.  Everything is integer-only.
The kernels never raise: they return ``ERR_*`` codes that :func:`decode` turns into
:class:`~alignpred.errors.FormatError`.

>>> q = np.array([[0, 1, -1, 70000], [5, 0, 0, -2**31]], np.int32)
>>> ids = np.array([3, 200], np.uint8)
>>> buf = encode(q, ids)
>>> decode(buf, ids, q.shape).tolist() == q.tolist()
True
"""
from __future__ import annotations

import functools
import os

import numpy as np

from alignpred.entropy.models import load as _load_v1
from alignpred.entropy.rans import _tokenize
from alignpred.errors import FormatError
from alignpred.kernels._jit import njit

N_LANES = 32
LANES_PREC = 12                  # probability precision of the lanes32 tables
STATE_L = 1 << 16                # states live in [2**16, 2**32)
RAW_CHUNK = 16                   # raw bits are coded in chunks of at most 16 bits
WIDE_LANE_SYMBOLS = 21845        # more symbols per lane than this: 32-bit word counts
MAX_PREC_FUSED = 12              # freq (12) | bias (12) | token (8) fit one uint32

ERR_OK = 0
ERR_SHORT = 1      # payload shorter than its lane table, or odd length
ERR_TILING = 2     # the lane table does not tile the payload exactly
ERR_BAD_STATE = 3  # an initial state below 2**16
ERR_FINAL = 4      # a lane did not end in the initial state 2**16
ERR_WORDS = 5      # a lane did not use exactly its words

ERROR_TEXT = {
    ERR_SHORT: "payload shorter than its lane table (or of odd length)",
    ERR_TILING: "lane word counts do not tile the payload",
    ERR_BAD_STATE: "initial lane state below 2**16",
    ERR_FINAL: "a lane's final state differs from 2**16",
    ERR_WORDS: "a lane did not consume exactly its own words",
}

_L = np.uint64(STATE_L)
_M16 = np.uint64(0xFFFF)
_S16 = np.uint64(16)
_ONE = np.uint64(1)


# --- tables ----------------------------------------------------------------------------------

def quantize_freq(freq: np.ndarray, prec: int) -> np.ndarray:
    """The normative rule mapping ``kvz-models-v1`` frequencies (sum ``2**15``) to ``prec`` bits.

    ``g = max(1, (f * 2**prec + 2**14) >> 15)`` per token (round half up, floor 1); then, while
    ``sum(g) > 2**prec``, decrement the largest ``g`` (lowest token index on ties), and while
    ``sum(g) < 2**prec`` increment it.  Integer-only, so every machine builds the same tables.

    >>> quantize_freq(np.array([[32768 - 127] + [1] * 127]), 12)[0, :3].tolist()
    [3969, 1, 1]
    """
    f = np.asarray(freq, np.int64)
    total = 1 << prec
    g = np.maximum(1, (f * total + (1 << 14)) >> 15)
    for m in range(g.shape[0]):
        row = g[m]
        while row.sum() != total:
            k = int(np.argmax(row))
            row[k] += 1 if row.sum() < total else -1
    return g


@functools.lru_cache(maxsize=8)
def tables(prec: int = LANES_PREC):
    """``(packed, dtab)`` for precision ``prec``: ``packed[m, t] = freq << 16 | cum`` (uint32, the
    encoder's) and ``dtab[m * 2**prec + s] = freq << 20 | (s - cum) << 8 | token`` (uint32, the
    decoder's one lookup per symbol; ``None`` above 12 bits, where the three fields no longer fit
    32 bits).  ``prec`` other than ``LANES_PREC`` is for measurements only.  Read-only, cached."""
    if not 7 <= prec <= 15:
        raise ValueError("lanes32 tables need 7 <= prec <= 15")
    g = quantize_freq(_load_v1().freq, prec)
    cum = np.zeros_like(g)
    cum[:, 1:] = np.cumsum(g, axis=1)[:, :-1]
    packed = ((g << 16) | cum).astype(np.uint32)
    packed.setflags(write=False)
    if prec > MAX_PREC_FUSED:
        return packed, None
    M, T = g.shape
    dtab = np.empty((M, 1 << prec), np.uint32)
    tok = np.arange(T)
    s = np.arange(1 << prec)
    for m in range(M):
        toks = np.repeat(tok, g[m])
        dtab[m] = (g[m][toks] << 20) | ((s - cum[m][toks]) << 8) | toks
    flat = dtab.reshape(-1)
    flat.setflags(write=False)
    return packed, flat


def header_words(n: int) -> int:
    """uint16 words before the lane streams for an object of ``n`` symbols: 64 words of states
    (lane ``l``: low half at ``2l``, high half at ``2l + 1``) and 32 word counts, each one word,
    or two (low, high) when a lane has more than ``WIDE_LANE_SYMBOLS`` symbols."""
    wide = (n + N_LANES - 1) // N_LANES > WIDE_LANE_SYMBOLS
    return 2 * N_LANES + N_LANES * (2 if wide else 1)


# --- encoder ---------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def encode_kernel(q, ids, packed, prec, hw):
    """Encode ``q`` (int32 [C, N], C*N > 0) with per-channel models; the payload as uint16 words.
    ``hw``: :func:`header_words`."""
    C, N = q.shape
    n = C * N
    per_lane = (n + 31) // 32
    cap = 3 * per_lane + 2
    stack = np.empty((32, cap), np.uint16)
    sp = np.full(32, cap, np.int64)
    x = np.full(32, _L, np.uint64)
    pshift = np.uint64(32 - prec)
    up = np.uint64(prec)
    i = n
    for cc in range(C):
        c = C - 1 - cc
        pk = packed[ids[c]]
        for tt in range(N):
            t = N - 1 - tt
            i -= 1
            ln = i & 31
            tok, nb, raw = _tokenize(q[c, t])
            xl = x[ln]
            ur = np.uint64(raw)
            # raw chunks in reverse decode order: high part (nb > 16) first, then the low part
            if nb > 16:
                k = np.uint64(nb - 16)
                if xl >= (np.uint64(1) << (np.uint64(32) - k)):
                    sp[ln] -= 1
                    stack[ln, sp[ln]] = np.uint16(xl & _M16)
                    xl >>= _S16
                xl = (xl << k) | (ur >> _S16)
            if nb > 0:
                k = np.uint64(min(nb, 16))
                if xl >= (np.uint64(1) << (np.uint64(32) - k)):
                    sp[ln] -= 1
                    stack[ln, sp[ln]] = np.uint16(xl & _M16)
                    xl >>= _S16
                xl = (xl << k) | (ur & ((np.uint64(1) << k) - np.uint64(1)))
            p = np.uint64(pk[tok])
            f = p >> _S16
            if xl >= (f << pshift):
                sp[ln] -= 1
                stack[ln, sp[ln]] = np.uint16(xl & _M16)
                xl >>= _S16
            x[ln] = ((xl // f) << up) + (xl % f) + (p & _M16)
    total = hw
    for ln in range(32):
        total += cap - sp[ln]
    out = np.empty(total, np.uint16)
    wide = hw > 96
    o = hw
    for ln in range(32):
        out[2 * ln] = np.uint16(x[ln] & _M16)
        out[2 * ln + 1] = np.uint16(x[ln] >> _S16)
        cnt = cap - sp[ln]
        if wide:
            out[64 + 2 * ln] = np.uint16(cnt & 0xFFFF)
            out[64 + 2 * ln + 1] = np.uint16(cnt >> 16)
        else:
            out[64 + ln] = np.uint16(cnt)
        out[o:o + cnt] = stack[ln, sp[ln]:]
        o += cnt
    return out


# --- lane table and validation (shared by the decoders) ----------------------------------------

@njit(cache=True, nogil=True)
def lane_table(w, W, hw):
    """Read states and word counts of the payload ``w`` (uint16, ``W`` words, padded):
    ``(err, x, pos, end)`` with ``x`` (uint32 [32]) the states and ``pos``/``end`` (int64 [32]) the
    first and one-past-last word of each lane; ``err`` an ``ERR_*`` code."""
    x = np.empty(32, np.uint32)
    pos = np.zeros(32, np.int64)
    end = np.zeros(32, np.int64)
    if W < hw:
        return ERR_SHORT, x, pos, end
    o = np.int64(hw)
    for ln in range(32):
        xl = np.uint32(w[2 * ln]) | (np.uint32(w[2 * ln + 1]) << np.uint32(16))
        if xl < np.uint32(STATE_L):
            return ERR_BAD_STATE, x, pos, end
        x[ln] = xl
        if hw > 96:
            cnt = np.int64(w[64 + 2 * ln]) | (np.int64(w[64 + 2 * ln + 1]) << 16)
        else:
            cnt = np.int64(w[64 + ln])
        pos[ln] = o
        o += cnt
        end[ln] = o
    if o != W:
        return ERR_TILING, x, pos, end
    return ERR_OK, x, pos, end


@njit(cache=True, nogil=True)
def lane_finish(x, pos, end):
    """Every lane back at state ``2**16`` having used exactly its own words."""
    for ln in range(32):
        if pos[ln] != end[ln]:
            return ERR_WORDS
    for ln in range(32):
        if x[ln] != np.uint32(STATE_L):
            return ERR_FINAL
    return ERR_OK


@njit(cache=True, nogil=True, inline="always")
def token_value(tok, r):
    """The int32 value of token ``tok`` with raw field ``r`` (the rans4 token mapping)."""
    if tok < 16:
        u = np.int64(tok)
    else:
        nn = ((tok - 16) >> 2) + 4
        u = (np.int64(1) << nn) | (np.int64((tok >> 1) & 1) << (nn - 1)) | np.int64(tok & 1) | (np.int64(r) << 1)
    return np.int32((u >> 1) ^ (-(u & 1)))


@njit(cache=True, nogil=True, inline="always")
def _renorm(xl, pl, w, W):
    if xl < _L:
        xl = (xl << _S16) | np.uint64(w[min(pl, W)])
        pl += 1
    return xl, pl


@njit(cache=True, nogil=True, inline="always")
def lane_step(x32, pl, w, W, dtab, mb, prec):
    """Decode one symbol of one lane: ``(value, state, position)``.  Reads are clamped to
    index ``W`` (a zero pad word); running past the lane's end is detected by :func:`lane_finish`.
    No intermediate reaches ``2**32`` on any input (``freq < 2**12``), so 32-bit lanes agree."""
    up = np.uint64(prec)
    xl = np.uint64(x32)
    e = np.uint64(dtab[mb + np.int64(xl & ((_ONE << up) - _ONE))])
    tok = np.int64(e & np.uint64(0xFF))
    xl = (e >> np.uint64(20)) * (xl >> up) + ((e >> np.uint64(8)) & np.uint64(0xFFF))
    xl, pl = _renorm(xl, pl, w, W)
    r = np.uint64(0)
    if tok >= 16:
        nb = ((tok - 16) >> 2) + 2
        k = np.uint64(min(nb, 16))
        r = xl & ((_ONE << k) - _ONE)
        xl >>= k
        xl, pl = _renorm(xl, pl, w, W)
        if nb > 16:
            k2 = np.uint64(nb - 16)
            r |= (xl & ((_ONE << k2) - _ONE)) << _S16
            xl >>= k2
            xl, pl = _renorm(xl, pl, w, W)
    return token_value(tok, r), np.uint32(xl), pl


@njit(cache=True, nogil=True)
def decode_portable(w, W, hw, ids, dtab, prec, out):
    """The portable decoder: lanes one after another, symbol order.  ``w``: uint16 payload
    padded with two zero words (``W`` real words); ``out`` int32 [C, N]."""
    C, N = out.shape
    err, x, pos, end = lane_table(w, W, hw)
    if err != ERR_OK:
        return err
    ln = 0
    for c in range(C):
        mb = np.int64(ids[c]) << prec
        for t in range(N):
            v, xl, pl = lane_step(x[ln], pos[ln], w, W, dtab, mb, prec)
            out[c, t] = v
            x[ln] = xl
            pos[ln] = pl
            ln = (ln + 1) & 31
    return lane_finish(x, pos, end)


# --- object API --------------------------------------------------------------------------------

PATHS = ("auto", "simd", "portable")


def _path(path: str | None) -> str:
    p = path or os.environ.get("KVZ_LANES_PATH", "auto") or "auto"
    if p not in PATHS:
        raise ValueError(f"unknown lanes32 decode path {p!r}; expected one of {PATHS}")
    return "simd" if p == "auto" else p


def encode(q: np.ndarray, ids: np.ndarray, prec: int = LANES_PREC) -> bytes:
    """Payload bytes of ``q`` (int32 [C, N], C*N > 0) with model ids ``ids`` (validated by the
    caller); ``prec`` other than ``LANES_PREC`` is for measurements only (not a format)."""
    packed, _ = tables(prec)
    n = q.shape[0] * q.shape[1]
    words = encode_kernel(q, np.asarray(ids, np.int64), packed, prec, header_words(n))
    return words.astype("<u2", copy=False).tobytes()


def padded_words(raw: np.ndarray) -> np.ndarray:
    """The payload bytes as uint16 words plus two zero pad words (what the decoders read)."""
    w = np.zeros(raw.size // 2 + 2, np.uint16)
    w[:raw.size // 2] = raw[:raw.size // 2 * 2].view("<u2")
    return w


@njit(cache=True, nogil=True)
def _objects_portable(w, offs, Ws, hws, ids, dtab, prec, out, cols):
    """:func:`decode_portable` over objects ``j`` (words ``w[offs[j]:offs[j+1]]``, columns
    ``cols[j]:cols[j+1]`` of ``out``) in one call; returns ``(error, object)``."""
    for j in range(Ws.shape[0]):
        err = decode_portable(w[offs[j]:offs[j + 1]], Ws[j], hws[j], ids, dtab, prec, out[:, cols[j]:cols[j + 1]])
        if err != ERR_OK:
            return err, j
    return ERR_OK, -1


def decode_objects(bufs: list, ids: np.ndarray, C: int, widths, out: np.ndarray, path: str | None = None,
                   prec: int = LANES_PREC) -> np.ndarray:
    """Decode several payloads that share the model ids ``ids`` into consecutive column ranges of
    ``out`` (int32 ``[C, sum(widths)]``, any strides): payload ``j`` holds ``[C, widths[j]]``
    (``C * widths[j] > 0``). The symbols, words read and errors of :func:`decode` on each
    payload, in one kernel call (the per-object work of a tensor's objects, once).

    >>> q = np.arange(-40, 40, dtype=np.int32).reshape(2, 40)
    >>> ids = np.array([3, 7])
    >>> bufs = [encode(np.ascontiguousarray(q[:, :25]), ids), encode(np.ascontiguousarray(q[:, 25:]), ids)]
    >>> np.array_equal(decode_objects(bufs, ids, 2, [25, 15], np.empty((2, 40), np.int32)), q)
    True
    """
    if out.shape != (C, sum(widths)) or out.dtype != np.int32:
        raise ValueError(f"out must be int32 {(C, sum(widths))}, got {out.dtype} {out.shape}")
    _, dtab = tables(prec)
    if dtab is None:
        raise ValueError(f"no lanes32 decoder for {prec}-bit tables (at most {MAX_PREC_FUSED})")
    k = len(bufs)
    Ws = np.empty(k, np.int64)
    hws = np.empty(k, np.int64)
    offs = np.zeros(k + 1, np.int64)
    cols = np.zeros(k + 1, np.int64)
    raws = []
    for j, buf in enumerate(bufs):
        raw = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
        if raw.size % 2:
            raise FormatError(f"lanes32 payload invalid: {ERROR_TEXT[ERR_SHORT]}")
        raws.append(raw)
        Ws[j] = raw.size // 2
        hws[j] = header_words(C * widths[j])
        offs[j + 1] = offs[j] + Ws[j] + 2      # two zero pad words after every payload
        cols[j + 1] = cols[j] + widths[j]
    w = np.zeros(offs[k], np.uint16)
    for j, raw in enumerate(raws):
        w[offs[j]:offs[j] + Ws[j]] = raw[:2 * Ws[j]].view("<u2")
    ids64 = np.asarray(ids, np.int64)
    if _path(path) == "portable":
        err, _ = _objects_portable(w, offs, Ws, hws, ids64, dtab, prec, out, cols)
    else:
        from alignpred.entropy import lanes_simd

        err, _ = lanes_simd.decode_simd_objects(w, offs, Ws, hws, ids64, dtab, prec, out, cols)
    if err != ERR_OK:
        raise FormatError(f"lanes32 payload invalid: {ERROR_TEXT[err]}")
    return out


def decode(buf, ids: np.ndarray, shape: tuple[int, int], out: np.ndarray | None = None,
           path: str | None = None, prec: int = LANES_PREC) -> np.ndarray:
    """Decode a payload (bytes-like) of ``shape`` (C*N > 0) into ``out`` (int32 [C, N], any
    strides); FormatError on any inconsistency.  ``path``: ``simd`` (the vectorised decoder,
    default), ``portable``, or ``auto``; the environment variable ``KVZ_LANES_PATH`` sets the
    default.  Both give the same symbols and the same errors on every input."""
    C, N = shape
    raw = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    if raw.size % 2:
        raise FormatError(f"lanes32 payload invalid: {ERROR_TEXT[ERR_SHORT]}")
    if out is None:
        out = np.empty((C, N), np.int32)
    elif out.shape != (C, N) or out.dtype != np.int32:
        raise ValueError(f"out must be int32 {(C, N)}, got {out.dtype} {out.shape}")
    _, dtab = tables(prec)
    if dtab is None:
        raise ValueError(f"no lanes32 decoder for {prec}-bit tables (at most {MAX_PREC_FUSED})")
    w = padded_words(raw)
    W = raw.size // 2
    hw = header_words(C * N)
    ids64 = np.asarray(ids, np.int64)
    if _path(path) == "portable":
        err = decode_portable(w, W, hw, ids64, dtab, prec, out)
    else:
        from alignpred.entropy import lanes_simd

        err = lanes_simd.decode_simd(w, W, hw, ids64, dtab, prec, out)
    if err != ERR_OK:
        raise FormatError(f"lanes32 payload invalid: {ERROR_TEXT[err]}")
    return out
