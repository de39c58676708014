"""Entropy coding of quantised residual symbols with a static, versioned model family.

An *object* is an int32 array ``q[C, N]`` (C channels, N tokens).  Channel ``c`` is coded with
model ``model_ids[c]`` out of the fixed family ``kvz-models-v1`` (:mod:`alignpred.entropy.models`); the
ids are chosen once per tensor (:func:`choose_models`) and stored by the caller.  The payload is
self-delimiting given ``(C, N, model_ids)`` and its exact byte length, which the container
records; a payload with bytes left over is invalid.

Bitstream of coder ``rans4`` (``CODER_IDS['rans4'] == 0``, the default)
-----------------------------------------------------------------------

*Token mapping.*  Each value ``v`` (int32) is mapped to ``u = zigzag(v)``
(``v >= 0 -> 2v``, ``v < 0 -> -2v - 1``; ``0 <= u < 2**32``).  If ``u < 16`` the token is
``u`` and there are no raw bits.  Otherwise let ``n = floor(log2 u)`` (``4 <= n <= 31``); the
token is ``16 + 4*(n - 4) + 2*((u >> (n-1)) & 1) + (u & 1)`` and the ``nb = n - 2`` raw bits
are ``r = (u >> 1) & (2**nb - 1)``.  Inverse: ``u = base(token) | (r << 1)`` with
``base = 2**n | m * 2**(n-1) | s`` for ``token = 16 + 4*(n-4) + 2m + s``.  The alphabet has
128 tokens; every int32 value is representable (the largest raw field is 29 bits).

*Models.*  Model ``m`` gives integer frequencies ``f[m, t] >= 1`` with
``sum_t f[m, t] = 2**PREC`` (``PREC = 15``) and ``c[m, t] = sum_{t' < t} f[m, t']``;
``0 <= m < N_MODELS`` (240 in ``kvz-models-v1``; model 0 is the "all zeros" table).

*Symbol order.*  Symbols are numbered ``i = c*N + t`` (channel-major).  Symbol ``i`` uses rANS
lane ``i mod 4`` and the model of its channel.

*State.*  Four 64-bit states ``x_0..x_3``; the normalised interval is ``[2**32, 2**64)``;
renormalisation moves 32-bit words.  The encoder starts every lane at ``x = 2**32`` and
processes symbols from ``i = C*N - 1`` down to ``0``; for symbol ``i`` with token ``t``,
``f = f[m, t]``, ``cc = c[m, t]``, on the state ``x`` of lane ``i mod 4``: if
``x >= f * 2**(64 - PREC)``, emit the word ``x mod 2**32`` and set ``x = x >> 32``; then
``x = (x // f) * 2**PREC + (x mod f) + cc``.  Emitted words are pushed on a stack.

*Raw bits* are not rANS-coded: the raw fields of symbols ``i = 0, 1, ...`` (those with
``nb > 0``) are concatenated LSB-first into a bit string (bit ``k`` of the string is bit
``k mod 32`` of raw word ``k // 32``), zero-padded to a multiple of 32 bits.

*Payload* (all words little-endian), ``W`` uint32 words in total:

1. the final states of lanes 0, 1, 2, 3, each as a little-endian uint64 (words 0..7);
2. the rANS words, popped from the stack last-pushed-first (words ``8 .. 8+R-1``);
3. the raw words in reverse order: raw word ``j`` is payload word ``W - 1 - j``.

There is no length field: ``R`` and the raw-word count follow from decoding.

*Decoding* reads the four states (each must be ``>= 2**32``), then for ``i = 0 .. C*N-1``,
with ``x`` the state of lane ``i mod 4`` and ``m`` the model of channel ``i // N``:
``s = x mod 2**PREC``; ``t`` is the token with ``c[m, t] <= s < c[m, t] + f[m, t]``;
``x = f * (x >> PREC) + s - c[m, t]``; if ``x < 2**32`` then ``x = (x << 32) | word[pos]``
and ``pos += 1`` (``pos`` starts at 8); then the next ``nb(t)`` bits of the raw bit string
give ``r``.  The payload is valid iff all four final states equal ``2**32``,
``pos + ceil(total_raw_bits / 32) == W`` (the two regions tile the payload exactly, so no
word is missing or left over) and the padding bits of the last raw word are zero.  Any
violation raises :class:`~alignpred.errors.FormatError`.  An object with ``C*N == 0`` has an
empty payload.  Overhead per object: 32 bytes of states plus < 4 bytes of rANS and raw-word
padding.  Raw bits carry no redundancy (a flipped raw bit decodes to another value), so
integrity is the container's checksum's job; the checks above catch truncation, extension
and nearly all damage to the states and rANS words.

Bitstream of coder ``constriction`` (``CODER_IDS['constriction'] == 1``)
-----------------------------------------------------------------------

Same token mapping and frequency tables.  Payload: ``K`` (uint32 LE), then the ``K`` words
(uint32 LE) of ``constriction.stream.stack.AnsCoder.get_compressed()`` after
``encode_reverse`` of each channel's tokens from channel ``C-1`` down to ``0`` with
``Categorical(f[m] / 2**PREC, perfect=False)``, then the raw words (uint32 LE, same bit string
as above) in forward order.  Decoding must end with an empty coder, all padding bits zero and
no word left over.  It is ~5-10x slower than ``rans4`` (about 60 M symbols/s encode, 20 M
symbols/s decode on one core) and exists as an independent reference implementation.

Bitstream of coder ``lanes32`` (``CODER_IDS['lanes32'] == 2``; format 1.2)
-------------------------------------------------------------------------

32 rANS lanes in lock-step, made for SIMD and GPU decoders (:mod:`alignpred.entropy.lanes`;
normative text: ``format_spec/kvz.md`` §7.3).  Same token mapping and symbol order; symbol
``i`` is on lane ``i mod 32``.  *Tables*: 12-bit frequencies ``g[m, t]`` from ``f[m, t]`` by
``g = max(1, (f * 2**12 + 2**14) >> 15)``, then the largest ``g`` of a model (lowest token on
ties) is decremented (or incremented) one at a time until the model sums to ``2**12``; the
decoder's one lookup per symbol is ``dtab[m, s] = g << 20 | (s - cum) << 8 | token``.
*Lanes*: 32-bit states in ``[2**16, 2**32)``, renormalisation by 16-bit words read from the
lane's own stream; after the token, the ``nb`` raw bits are coded in the same state as uniform
chunks (low ``min(nb, 16)`` bits, then the ``nb - 16`` high bits), so no data is shared
between lanes.  The encoder starts every lane at ``2**16`` and codes symbols from the last to
the first (chunk 2, chunk 1, token; push ``x mod 2**16`` when ``x >= 2**(32 - b)`` for a
``b``-bit chunk or ``x >= g * 2**20`` for a token).  *Payload* (uint16 LE): 64 words of final
states (lane ``l``: low at ``2l``, high at ``2l + 1``), 32 lane word counts (one word each, two
— low, high — when a lane holds more than 21845 symbols), then the 32 lane streams in lane
order.  *Decoding*: states ``>= 2**16``; the counts must tile the payload exactly; per symbol
``s = x mod 2**12``, ``x = g (x >> 12) + s - cum``, renormalise (``x < 2**16``: ``x = x << 16 |
next word``), then the raw chunks (``r = x mod 2**b``, ``x >>= b``, renormalise).  Valid iff
every lane ends at ``2**16`` having read exactly its own words; otherwise ``FormatError``.
Decoders: ``simd`` (LLVM vector code with gathers), ``portable`` (one lane at a time; choose
with ``KVZ_LANES_PATH``), and a torch reference (:mod:`alignpred.entropy.lanes_torch`).

>>> q = np.array([[0, 1, -1, 2], [100, -7, 0, 2**31 - 1]], dtype=np.int32)
>>> ids = choose_models(q)
>>> buf = encode(q, ids)
>>> np.array_equal(decode(buf, ids, q.shape), q)
True
"""

from __future__ import annotations

import numpy as np

from alignpred.entropy import lanes, rans
from alignpred.entropy import registry as _registry
from alignpred.entropy.models import MODEL_SET_ID
from alignpred.entropy.models import load as _load_tables
from alignpred.errors import EncodeError, FormatError

__all__ = ["MODEL_SET_ID", "PREC", "N_MODELS", "N_TOKENS", "CODERS", "CODER_IDS", "choose_models",
           "estimate_bits", "encode", "decode", "histogram"]

PREC: int = rans.PREC
N_TOKENS: int = rans.N_TOKENS
N_MODELS: int = int(_load_tables().freq.shape[0])
_MAX_SYMBOLS = 1 << 32
_MAX_SYMBOLS_PER_BYTE = 2048
_FX = 1 << 16


def _as_q(q, err=EncodeError) -> np.ndarray:
    q = np.asarray(q)
    if q.ndim != 2:
        raise err(f"q must be 2-D [C, N], got shape {q.shape}")
    if not np.issubdtype(q.dtype, np.integer):
        raise err(f"q must be an integer array, got {q.dtype}")
    if q.dtype != np.int32:
        if q.size and (q.min() < -(1 << 31) or q.max() >= (1 << 31)):
            raise err("q has values outside the int32 range")
        q = q.astype(np.int32)
    return np.ascontiguousarray(q)


def _as_ids(model_ids, C: int, err) -> np.ndarray:
    ids = np.asarray(model_ids)
    if ids.shape != (C,) or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise err(f"model_ids must be an integer array of shape ({C},), got {ids.shape}")
    if ids.size and (ids.max() >= N_MODELS or (ids.dtype.kind == "i" and ids.min() < 0)):
        raise err(f"model id out of range [0, {N_MODELS})")
    return ids.astype(np.int64, copy=False)   # read only: no copy of an int64 array


def histogram(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token histogram int64 [C, 128] and total raw bits int64 [C] of ``q`` (int32 [C, N]).

    Histograms of several objects of a tensor can be summed before choosing models.

    >>> h, rb = histogram(np.array([[0, 0, 5, -300]], dtype=np.int32))
    >>> int(h[0, 0]), int(h[0, 10]), int(rb[0])
    (2, 1, 7)
    """
    q = _as_q(q, ValueError)
    return rans.histogram(q, N_TOKENS)


def models_from_histogram(hist: np.ndarray) -> np.ndarray:
    """Best model id per channel (uint8 [C]) for token histograms ``hist`` (int64 [C, 128], as
    from :func:`histogram`, possibly summed over objects); see :func:`choose_models`."""
    hist = np.ascontiguousarray(hist, np.int64)
    if hist.shape[0] == 0:
        return np.zeros(0, np.uint8)
    costs = rans.model_costs(hist, _load_tables().cost_fx)
    return np.argmin(costs, axis=1).astype(np.uint8)


def choose_models(q: np.ndarray) -> np.ndarray:
    """Best model id per channel (uint8 [C]) for ``q`` (int32 [C, N], any N).

    Minimises the exact static cost ``sum_t hist[c, t] * (PREC - log2 f[m, t])`` (integer
    fixed point, so the choice is identical on every machine; ties go to the lower id).

    >>> q = np.zeros((3, 50), dtype=np.int32); q[1] = np.arange(50) - 25
    >>> ids = choose_models(q)
    >>> ids.dtype, ids.shape, bool(ids[0] == ids[2])
    (dtype('uint8'), (3,), True)
    """
    return models_from_histogram(histogram(q)[0])


def estimate_bits(q: np.ndarray, model_ids: np.ndarray) -> np.ndarray:
    """Estimated coded size in bits per channel, float64 [C].

    Ideal static cost of the tokens plus the raw bits; excludes the 32-byte state flush of
    the payload (per object, not per channel).  The real ``rans4`` size is within a fraction
    of a percent of ``sum(estimate_bits) + 256``.

    >>> q = np.zeros((2, 1000), dtype=np.int32)
    >>> est = estimate_bits(q, choose_models(q))
    >>> bool(est.max() < 10)
    True
    """
    q = _as_q(q, ValueError)
    ids = _as_ids(model_ids, q.shape[0], ValueError)
    hist, raw_bits = rans.histogram(q, N_TOKENS)
    cost_fx = _load_tables().cost_fx.astype(np.int64)
    tok = (hist * cost_fx[ids]).sum(axis=1)
    return tok / _FX + raw_bits.astype(np.float64)


def encode(q: np.ndarray, model_ids: np.ndarray, coder: str = "rans4") -> bytes:
    """Encode ``q`` (int32 [C, N]) with per-channel model ids; see the module docstring.

    >>> len(encode(np.zeros((16, 16), np.int32), np.zeros(16, np.uint8)))  # just the 4 states
    32
    """
    q = _as_q(q)
    ids = _as_ids(model_ids, q.shape[0], EncodeError)
    if q.size == 0:
        return b""
    if q.size >= _MAX_SYMBOLS:
        raise EncodeError("object too large")
    return _registry.get(coder, EncodeError).encode(q, ids)


def _payload_words(buf) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        raw = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
    else:
        raw = np.frombuffer(buf, dtype=np.uint8)
    return raw


def _checked_payload(buf, C: int, N: int, shape) -> np.ndarray:
    """The payload's bytes (uint8), or FormatError: not a byte buffer, or too short for C*N symbols."""
    try:
        raw = _payload_words(buf)
    except (TypeError, ValueError) as e:
        raise FormatError(f"payload is not a byte buffer: {e}") from None
    if C * N > _MAX_SYMBOLS_PER_BYTE * (raw.size + 32):
        # every symbol costs >= log2(2**15 / 32641) = 0.0056 bit in any model, so a payload
        # this short cannot hold C*N symbols; refuse before allocating the output
        raise FormatError(f"payload of {raw.size} bytes is too short for shape {shape!r}")
    return raw


def decode(buf, model_ids: np.ndarray, shape: tuple[int, int],
           coder: str = "rans4", out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`encode`: returns int32 [C, N]; raises FormatError on any inconsistency.
    ``out``: an int32 ``[C, N]`` array (any strides, e.g. a column slice of a larger array) to
    decode into; its contents are undefined after an error.

    >>> ids = np.array([3, 200], np.uint8)
    >>> q = np.array([[1, -2, 3], [-(2**31), 0, 2**31 - 1]], np.int32)
    >>> buf = encode(q, ids)
    >>> decode(buf, ids, (2, 3)).tolist()
    [[1, -2, 3], [-2147483648, 0, 2147483647]]
    >>> decode(buf[:-4], ids, (2, 3))
    Traceback (most recent call last):
    ...
    alignpred.errors.FormatError: rans4 payload invalid: payload ends before the last symbol (ran out of input)
    """
    try:
        C, N = (int(s) for s in shape)
    except (TypeError, ValueError):
        raise FormatError(f"bad shape {shape!r}") from None
    if C < 0 or N < 0 or C * N >= _MAX_SYMBOLS:
        raise FormatError(f"bad shape {shape!r}")
    impl = _registry.get(coder)
    ids = _as_ids(model_ids, C, FormatError)
    raw = _checked_payload(buf, C, N, shape)
    if C * N == 0:
        if raw.size:
            raise FormatError("non-empty payload for an empty object")
        return np.zeros((C, N), np.int32) if out is None else out
    return impl.decode(raw, ids, C, N, out)


def decode_objects(bufs: list, model_ids: np.ndarray, C: int, widths, coder: str, out: np.ndarray) -> np.ndarray:
    """:func:`decode` of several payloads sharing ``model_ids`` (the objects of one tensor) into
    consecutive column ranges of ``out`` (int32 ``[C, sum(widths)]``, any strides): the symbols
    and errors of one :func:`decode` per payload, with the validation and the kernel call done
    once for all ``lanes32`` payloads.

    >>> ids = np.array([3, 200], np.uint8)
    >>> q = np.array([[1, -2, 3], [-5, 0, 7]], np.int32)
    >>> bufs = [encode(q[:, :2], ids, "lanes32"), encode(q[:, 2:], ids, "lanes32")]
    >>> decode_objects(bufs, ids, 2, [2, 1], "lanes32", np.empty((2, 3), np.int32)).tolist()
    [[1, -2, 3], [-5, 0, 7]]
    """
    if len(bufs) != len(widths):
        raise ValueError("one width per payload")
    impl = _registry.get(coder)
    if impl.decode_objects is None or not bufs:
        c0 = 0
        for buf, n in zip(bufs, widths):
            decode(buf, model_ids, (C, n), coder, out=out[:, c0:c0 + n])
            c0 += n
        return out
    ids = _as_ids(model_ids, C, FormatError)
    raws, kept = [], []
    for buf, n in zip(bufs, widths):
        if C < 0 or n < 0 or C * n >= _MAX_SYMBOLS:
            raise FormatError(f"bad shape {(C, n)!r}")
        raw = _checked_payload(buf, C, n, (C, n))
        if C * n == 0:   # no symbols, no columns (C == 0) or none of them (n == 0)
            if raw.size:
                raise FormatError("non-empty payload for an empty object")
            continue
        raws.append(raw)
        kept.append(n)
    if not raws:
        return out
    return impl.decode_objects(raws, ids, C, kept, out)


# --- the coders' bitstreams (registered at the end of this module) ---------------------------

def _encode_rans4(q: np.ndarray, ids: np.ndarray) -> bytes:
    return rans.encode_kernel(q, ids, _load_tables().packed).astype("<u4", copy=False).tobytes()


def _decode_rans4(raw: np.ndarray, ids: np.ndarray, C: int, N: int, out: np.ndarray | None) -> np.ndarray:
    if raw.size % 4 or raw.size < rans.STATE_BYTES:
        raise FormatError(f"rans4 payload length {raw.size} is invalid")
    t = _load_tables()
    words = raw.view("<u4").astype(np.uint32, copy=False)
    if out is None:
        out = np.empty((C, N), np.int32)
    elif out.shape != (C, N) or out.dtype != np.int32:
        raise ValueError(f"out must be int32 {(C, N)}, got {out.dtype} {out.shape}")
    err = rans.decode_kernel(words, ids, t.coarse, t.cumhi, t.packed, t.base, t.nbits, out)
    if err != rans.ERR_OK:
        raise FormatError(f"rans4 payload invalid: {rans.ERROR_TEXT[err]}")
    return out


def _decode_lanes32(raw: np.ndarray, ids: np.ndarray, C: int, N: int, out: np.ndarray | None) -> np.ndarray:
    return lanes.decode(raw, ids, (C, N), out=out)


def _decode_constriction_into(raw: np.ndarray, ids: np.ndarray, C: int, N: int, out: np.ndarray | None) -> np.ndarray:
    res = _decode_constriction(raw, ids, C, N)
    if out is None:
        return res
    out[...] = res
    return out


# --- constriction reference coder ----------------------------------------------------------

_cmodels: dict[int, object] = {}


def _constriction_model(m: int):
    mod = _cmodels.get(m)
    if mod is None:
        import constriction

        f = _load_tables().freq[m].astype(np.float64)
        # dyadic values: exactly representable, sum exactly 1, all > 0
        mod = constriction.stream.model.Categorical(f / float(1 << PREC), perfect=False)
        _cmodels[m] = mod
    return mod


def _encode_constriction(q: np.ndarray, ids: np.ndarray) -> bytes:
    import constriction

    toks, _ = rans.tokenize_array(q)
    toks = toks.reshape(q.shape).astype(np.int32)
    coder = constriction.stream.stack.AnsCoder()
    for c in range(q.shape[0] - 1, -1, -1):
        coder.encode_reverse(toks[c], _constriction_model(int(ids[c])))
    words = np.asarray(coder.get_compressed(), dtype=np.uint32)
    raw_words = rans.pack_raw(q)
    return (np.array([words.size], "<u4").tobytes() + words.astype("<u4").tobytes()
            + raw_words.astype("<u4").tobytes())


def _decode_constriction(raw: np.ndarray, ids: np.ndarray, C: int, N: int) -> np.ndarray:
    import constriction

    if raw.size < 4:
        raise FormatError("constriction payload too short")
    k = int(raw[:4].view("<u4")[0])
    if 4 + 4 * k > raw.size:
        raise FormatError("constriction payload truncated")
    if raw.size % 4:
        raise FormatError("constriction payload length is not a multiple of 4")
    words = raw[4:4 + 4 * k].view("<u4").astype(np.uint32)
    raw_words = raw[4 + 4 * k:].view("<u4").astype(np.uint32)
    toks = np.empty((C, N), np.uint8)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        for c in range(C):
            d = np.asarray(coder.decode(_constriction_model(int(ids[c])), N))
            if d.shape != (N,) or (d.size and (d.min() < 0 or d.max() >= N_TOKENS)):
                raise FormatError("constriction decoded an invalid token")
            toks[c] = d
        empty = bool(coder.is_empty())
    except (KeyboardInterrupt, SystemExit, FormatError):
        raise
    except BaseException as e:  # pyo3 PanicException is a BaseException
        raise FormatError(f"constriction payload invalid: {type(e).__name__}: {e}") from None
    if not empty:
        raise FormatError("constriction payload has data left after the last symbol")
    t = _load_tables()
    out = np.empty(C * N, np.int32)
    err = rans.detokenize(toks.reshape(-1), raw_words, t.base, t.nbits, out)
    if err != rans.ERR_OK:
        raise FormatError(f"constriction raw bits invalid: {rans.ERROR_TEXT[err]}")
    return out.reshape(C, N)


# --- per-symbol models (the refinement tier) ------------------------------------------------

def encode_ctx(q: np.ndarray, ids: np.ndarray) -> bytes:
    """Encode ``q`` (int32, any shape, coded flat) with one model per symbol (``ids``, same size):
    the ``rans4`` bitstream with per-symbol instead of per-channel models (:mod:`alignpred.entropy.rans_ctx`).

    >>> q = np.array([3, -1, 0, 70000], np.int32)
    >>> ids = np.array([5, 5, 0, 230])
    >>> decode_ctx(encode_ctx(q, ids), ids).tolist()
    [3, -1, 0, 70000]
    """
    from alignpred.entropy import rans_ctx

    q = np.ascontiguousarray(np.asarray(q, np.int32).reshape(-1))
    ids = _as_ids(np.asarray(ids).reshape(-1), q.size, EncodeError)
    if q.size == 0:
        return b""
    if q.size >= _MAX_SYMBOLS:
        raise EncodeError("object too large")
    return rans_ctx.encode_kernel(q, ids, _load_tables().packed).astype("<u4", copy=False).tobytes()


def decode_ctx(buf, ids: np.ndarray) -> np.ndarray:
    """Inverse of :func:`encode_ctx`: int32 ``[len(ids)]``; FormatError on any inconsistency."""
    from alignpred.entropy import rans_ctx

    ids = np.asarray(ids).reshape(-1)
    n = ids.size
    ids = _as_ids(ids, n, FormatError)
    try:
        raw = _payload_words(buf)
    except (TypeError, ValueError) as e:
        raise FormatError(f"payload is not a byte buffer: {e}") from None
    if n > _MAX_SYMBOLS_PER_BYTE * (raw.size + 32) or n >= _MAX_SYMBOLS:
        raise FormatError(f"payload of {raw.size} bytes is too short for {n} symbols")
    if n == 0:
        if raw.size:
            raise FormatError("non-empty payload for an empty object")
        return np.zeros(0, np.int32)
    if raw.size % 4 or raw.size < rans.STATE_BYTES:
        raise FormatError(f"rans4 payload length {raw.size} is invalid")
    t = _load_tables()
    words = raw.view("<u4").astype(np.uint32, copy=False)
    out = np.empty(n, np.int32)
    err = rans_ctx.decode_kernel(words, ids, t.coarse, t.cumhi, t.packed, t.base, t.nbits, out)
    if err != rans.ERR_OK:
        raise FormatError(f"rans4 payload invalid: {rans.ERROR_TEXT[err]}")
    return out


# --- the registry's built-in coders (ids are the header's; names are what files record) -----

_registry.register(_registry.Coder(
    0, "rans4", PREC, 0, "4 interleaved 64-bit rANS lanes, 15-bit tables (the default)",
    _encode_rans4, _decode_rans4, errors=rans.ERROR_TEXT))
_registry.register(_registry.Coder(
    1, "constriction", PREC, 0, "constriction's AnsCoder: an independent reference implementation",
    _encode_constriction, _decode_constriction_into))
_registry.register(_registry.Coder(
    2, "lanes32", lanes.LANES_PREC, 2, "32 rANS lanes in lock-step for SIMD and GPU decoders, 12-bit tables",
    lanes.encode, _decode_lanes32, decode_objects=lanes.decode_objects, errors=lanes.ERROR_TEXT))

CODERS = tuple(c.name for c in _registry.coders())
CODER_IDS = {c.name: c.id for c in _registry.coders()}   # suggested ids for file headers
