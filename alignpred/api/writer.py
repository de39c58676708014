"""Compress a cache into the .kvz container: to a file (atomically), to any writable binary
stream, or to bytes.

>>> import numpy as np
>>> from alignpred import Cache, KvzReader, fit_bank, nrmse
>>> rng = np.random.default_rng(0)
>>> kv = [(rng.standard_normal((1, 300, 16)).astype(np.float16),) * 2 for _ in range(2)]
>>> cache = Cache.from_arrays(kv)
>>> bank = fit_bank([cache], rank=None)
>>> blob = compress_bytes(cache, budget=0.05, bank=bank)
>>> out = KvzReader(blob, bank=bank).read()
>>> bool(nrmse(cache.tensors["layers.1.value"], out["layers.1.value"]) <= 0.05), out["layers.1.value"].dtype
(True, dtype('float16'))
"""
from __future__ import annotations

import functools
import io as _pyio
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from alignpred import entropy
from alignpred.bank.registry import resolve_bank
from alignpred.codec import refine
from alignpred.codec.budget import ErrorBudget, TensorMeta
from alignpred.codec.chain import OBJ_REFINE, OBJ_ZERO
from alignpred.codec.config import CodecConfig
from alignpred.codec.decoder import Decoder
from alignpred.codec.encoder import EncodedObject, Encoder
from alignpred.codec.profiles import Profile
from alignpred.codec.profiles import profile as profile_named
from alignpred.errors import BankMismatchError, KvzError, LayoutError, OutputExistsError
from alignpred.format.container import (
    FLAG_REFINE,
    FOOTER_SIZE,
    PREAMBLE_SIZE,
    Footer,
    IndexEntry,
    crc32,
    dump_header,
    pack_preamble,
)
from alignpred.format.header import build_header, minor_for
from alignpred.io import SPOOL_NOTE, atomic_write, release_pages, same_file, spool_file, write_error
from alignpred.threads import blas_single_thread, stepwise


@dataclass
class CompressInfo:
    """What :func:`compress` wrote: sizes, bits per value and achieved errors."""

    path: str | None
    n_values: int
    file_bytes: int
    bank_bytes: int
    nrmse_pooled: float
    nrmse_tensor: dict
    bank_id: str = ""
    data: bytes | None = None  # the file's bytes, when compressed to memory
    eps: float = 0.0
    scope: str = ""
    nrmse_weighted: float | None = None  # weighted scope: sqrt(sum w_t NRMSE_t^2 / sum w_t)
    kl_predicted: float | None = None  # weighted scope: sum w_t NRMSE_t^2 (KL, with weights in KL/NRMSE^2)

    @property
    def bpv(self) -> float:
        return 8.0 * self.file_bytes / max(self.n_values, 1)

    @property
    def nrmse_max_tensor(self) -> float:
        return max(self.nrmse_tensor.values(), default=0.0)


def _as_cache(cache):
    from alignpred.cache.cachefile import Cache

    if isinstance(cache, Cache):
        return cache
    if isinstance(cache, (dict, list, tuple)):
        return Cache.from_arrays(cache)
    raise LayoutError(f"cannot compress a {type(cache).__name__}: give an alignpred.Cache (Cache.from_arrays, "
                      "load_cache) or a dict of arrays")


_BUDGET_OPTIONS = ("eps", "scope", "tensor_cap", "weights", "target_kl", "plain_cap", "lossless", "attention_stats",
                   "capture_stats")  # kvz 0.x keywords of compress that are ErrorBudget fields now
_PROFILE_OPTIONS = ("coder", "embed_bank", "trust_rope")  # ... and those that are Profile fields

F = TypeVar("F", bound=Callable[..., Any])


def _moved_options(fn: F) -> F:
    """``fn`` (:func:`compress`, :func:`compress_bytes`), with the keywords it took before the
    budget and the profile held them (``eps=``, ``scope=``, ``coder=``, ...) answered by a
    :class:`KvzError` that says how to write the call now. The signature shown is ``fn``'s own."""

    @functools.wraps(fn)
    def call(*args, **kw):
        old_b = {k: kw.pop(k) for k in _BUDGET_OPTIONS if k in kw}
        old_p = {k: kw.pop(k) for k in _PROFILE_OPTIONS if k in kw}
        if old_b or old_p:
            raise KvzError(_how_to_write(fn.__name__, old_b, old_p, kw))
        return fn(*args, **kw)

    return cast(F, call)


def _how_to_write(name: str, old_b: dict, old_p: dict, kw: dict) -> str:
    def show(v):
        return repr(v) if v is None or isinstance(v, (bool, int, float, str)) else "..."

    parts = []
    if set(old_b) == {"eps"} and kw.get("budget") is None:
        parts.append(f"budget={show(old_b['eps'])}")
    elif old_b:
        parts.append("budget=ErrorBudget(" + ", ".join(f"{k}={show(v)}" for k, v in old_b.items()) + ")")
    if old_p:
        given = kw.get("profile")
        base = "" if given is None else (repr(given) if isinstance(given, str) else "<your profile>") + ", "
        args = ", ".join(f"{k}={show(v)}" for k, v in old_p.items())
        parts.append(f"profile=profile({base}{args})" if given is not None else f"profile=Profile({args})")
    moved = ", ".join(f"{k}=" for k in (*old_b, *old_p))
    return (f"{name}() no longer takes {moved}: write {', '.join(parts)} (the error budget is one budget=, an "
            "ErrorBudget or a number: eps in the tensor scope; coder, embed_bank and trust_rope are fields of "
            "profile=, a name or an alignpred.codec.Profile)")


@_moved_options
def compress(cache, out=None, *, budget: ErrorBudget | float | None = None, bank=None,
             profile: str | Profile | None = None, config: CodecConfig | None = None, threads: int | None = None,
             progress: Callable[[int], Any] | None = None) -> CompressInfo:
    """Compress ``cache`` (an :class:`~alignpred.Cache`, or a dict of arrays) within ``budget``.

    ``out``: a path (written atomically; never the cache's own input file), a writable binary
    stream (written sequentially), or None (the bytes are returned in ``info.data``).
    ``budget``: an :class:`~alignpred.ErrorBudget` — an NRMSE bound ``eps`` in every unit of its
    ``scope`` (``object``, ``tensor``, ``pooled``, ``weighted`` or ``attention``) or a quality
    target ``target_kl``, with its tensor cap, tensor weights, attention statistics and whether
    the exact tier is added (``lossless``) — or a number: ``eps`` in the tensor scope. Loose
    options (the CLI's flags) become a budget through :meth:`ErrorBudget.from_options
    <alignpred.ErrorBudget.from_options>`.
    ``bank``: a :class:`~alignpred.Bank`, a path, or a registry id/name (see
    :mod:`alignpred.bank.registry`).
    ``profile``: ``default``, ``balanced`` or ``fast`` (:mod:`alignpred.codec.profiles`), or an
    :class:`alignpred.codec.Profile`: the entropy coder and predictors of a size/decode-speed
    trade-off (applied on top of ``config``), whether the bank is stored in the file (and counted
    in bpv) and whether the RoPE metadata is trusted unchecked; None is ``default``.
    ``config``: the bitstream's switches (:class:`~alignpred.CodecConfig`; None: the defaults).
    ``threads``: kvz's own worker threads (default: the cores available); the file does not
    depend on it. ``progress(n)`` is called with positions done (several passes may run).

    >>> import numpy as np
    >>> from alignpred import Cache, ErrorBudget, fit_bank
    >>> cache = Cache.from_arrays([(np.random.default_rng(1).standard_normal((1, 300, 16)).astype(np.float16),) * 2])
    >>> bank = fit_bank([cache], rank=None)
    >>> info = compress(cache, budget=ErrorBudget(eps=0.05, scope="pooled"), bank=bank, profile="fast")
    >>> info.scope, info.nrmse_pooled <= 0.05, len(info.data) == info.file_bytes
    ('pooled', True, True)
    >>> compress(cache, eps=0.05, scope="pooled", bank=bank)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    alignpred.errors.KvzError: compress() no longer takes eps=, scope=: write budget=ErrorBudget(eps=0.05, ...
    """
    budget = ErrorBudget.of(budget)
    prof = profile_named("default" if profile is None else profile)
    config = prof.apply(config or CodecConfig())
    cache = _as_cache(cache)
    src = cache.path
    try:
        if isinstance(out, (str, os.PathLike)) and src and same_file(out, src):
            raise OutputExistsError(f"{os.fspath(out)} is the input cache; write the .kvz to another path")
        return _compress(cache, out, budget=budget, bank=bank, config=config, profile=prof, threads=threads,
                         progress=progress)
    except KvzError as e:
        if src and src not in str(e):
            raise type(e)(f"{src}: {e}") from None
        raise


@_moved_options
def compress_bytes(cache, *, budget: ErrorBudget | float | None = None, bank=None, profile: str | Profile | None = None,
                   config: CodecConfig | None = None, threads: int | None = None,
                   progress: Callable[[int], Any] | None = None) -> bytes:
    """:func:`compress` to memory; returns the file's bytes."""
    data = compress(cache, None, budget=budget, bank=bank, profile=profile, config=config, threads=threads,
                    progress=progress).data
    assert data is not None
    return data


def _refinement(cache, enc, metas, obs, read_spool, spool, where_pos: int, chunk: int = 2):
    """The refinement tier: decode the coarse objects just written (the same code a reader runs),
    take symbols against the original bits, choose a model per tensor and context (first pass),
    code each object (second pass). Returns ``(refinement objects tensor-major, their spool
    positions, end position in the spool)``; fills ``meta.refine_models``."""
    lay = enc.layout
    S = enc.config.object_size
    n_obj = enc.n_obj
    H, d = lay.kv_heads, lay.head_dim
    n_ctx = refine.n_contexts(enc.frame.out_dtype)
    dec = Decoder(lay, None, enc.config, enc.coder, plans=enc.plans)

    def fetch(ti, j):
        return obs[ti * n_obj + j], read_spool(ti * n_obj + j)

    def channel_major(a):  # [H, n, d] -> [H*d, n], the order symbols are coded in
        return np.ascontiguousarray(a.transpose(0, 2, 1).reshape(H * d, a.shape[1]))

    def passes():
        for j0 in range(0, n_obj, chunk):
            j1 = min(n_obj, j0 + chunk)
            a, b = j0 * S, min(lay.n_tokens, j1 * S)
            for ti, name, arr in dec.decode_range(metas, fetch, j0, j1):
                orig = cache.tensors[name]
                orig = np.asarray(orig[0] if lay.batch_dim else orig)[:, a:b]
                yield ti, j0, j1, a, channel_major(refine.symbols(orig, arr)), channel_major(refine.contexts(arr))

    hist = np.zeros((len(metas), n_ctx * entropy.N_TOKENS), np.int64)
    for ti, _, _, _, r, ctx in passes():
        tok = rans_tokens(r)
        hist[ti] += np.bincount((ctx.reshape(-1) * entropy.N_TOKENS + tok), minlength=hist.shape[1])
    for ti, m in enumerate(metas):
        m.refine_models = entropy.models_from_histogram(hist[ti].reshape(n_ctx, entropy.N_TOKENS))
    robs: list = [None] * (len(metas) * n_obj)
    where = np.zeros((len(robs), 2), np.int64)
    pos = where_pos
    for ti, j0, j1, a, r, ctx in passes():
        for j in range(j0, j1):
            cols = slice(j * S - a, j * S - a + int(enc.obj_rows[j]))
            rows = r[:, cols]
            if rows.any():
                ids = metas[ti].refine_models[ctx[:, cols]]
                payload, flags = entropy.encode_ctx(rows, ids), OBJ_REFINE
            else:
                payload, flags = b"", OBJ_REFINE | OBJ_ZERO
            k = ti * n_obj + j
            spool.seek(pos)
            spool.write(payload)
            where[k] = pos, len(payload)
            pos += len(payload)
            coarse = obs[k]
            robs[k] = EncodedObject(tensor=ti, token_start=j * S, n_tokens=coarse.n_tokens, flags=flags, delta=0.0,
                                    sq_err=0.0, sq_norm=coarse.sq_norm, payload=b"")
    return robs, where, pos


def rans_tokens(q: np.ndarray) -> np.ndarray:
    """Token of every value of ``q`` (flat int64), as the entropy coder maps it."""
    from alignpred.entropy.rans import tokenize_array

    return tokenize_array(np.ascontiguousarray(q, np.int32))[0].astype(np.int64)


def _attention_steps(bank_ref, bank, layout, config, stats=None):
    """``(config with channel_steps, step codes per tensor)`` from ``stats`` or the bank's
    attention statistics; a bank without them is a one-line error naming the fix."""
    from dataclasses import replace

    from alignpred.codec.attention_steps import STALE_SCALE, step_codes

    if stats is None:
        stats = _bank_stats(bank_ref, bank)
    elif not stats.fits(bank):
        raise KvzError(f"attention_stats are of bank {stats.bank_id[:19]}…, not of {bank.id[:19]}…")
    if stats is None:
        raise KvzError(f"the attention scope needs the bank's attention statistics, and bank {bank.id[:19]}… has "
                       "none: fit them with `kvz calibrate` on captures made with `kvz capture --attention-stats` "
                       "(or use --eps-scope weighted)")
    if config.align:
        raise KvzError("the attention scope needs exact arithmetic, which does not combine with --align")
    config = replace(config, channel_steps=True, stale_window=int(stats.sliding_window),
                     stale_scale=STALE_SCALE if stats.sliding_window else 1.0)
    return config, step_codes(stats, layout, config)


def _bank_stats(bank_ref, bank, quiet: bool = False):
    """The attention statistics beside the bank's file, or None (a bank built in memory has no
    file to sit beside). A stale or malformed sidecar is an error, or None when ``quiet``."""
    from alignpred.bank.attention_stats import find_attention_stats

    try:
        return find_attention_stats(bank_ref if isinstance(bank_ref, (str, os.PathLike)) else bank)
    except BankMismatchError:
        return None
    except KvzError:
        if quiet:
            return None
        raise


def _row_steps(cache, layout, config, capture=None):
    """``(config, row codes or None)``: per-position steps from the prefill's attention when its
    statistics are given or lie beside the cache file (:func:`~alignpred.bank.find_capture_stats`)."""
    from dataclasses import replace

    from alignpred.bank.capture_stats import find_capture_stats
    from alignpred.codec.attention_steps import row_codes

    if capture is None:
        capture = find_capture_stats(cache)
    else:
        capture.check_cache(cache, where="capture_stats")
    if capture is None:
        return config, None
    config = replace(config, row_steps=True)
    return config, row_codes(capture, layout, config)


def _compress(cache, out, *, budget: ErrorBudget, bank, config: CodecConfig, profile: Profile, threads,
              progress) -> CompressInfo:
    lossless, attention_stats, capture_stats = budget.lossless, budget.attention_stats, budget.capture_stats
    coder, embed_bank = profile.coder, profile.embed_bank
    lay = cache.layout
    if lossless and config.arith != "exact":
        from dataclasses import replace

        config = replace(config, arith="exact")  # a refinement tier needs the same coarse bits everywhere
    if lossless and config.align:
        raise KvzError("the lossless tier needs exact arithmetic, which does not combine with --align")
    if lay.n_tokens == 0:
        raise LayoutError("the cache has no tokens (empty cache); nothing to compress: capture at least one token")
    from alignpred.codec.frame import check_rope_range

    check_rope_range(lay, config)
    bank_ref = bank
    bank = resolve_bank(bank, lay)
    codes = rcodes = None
    better = budget.strategy.stats_scope  # --target-kl: the best scope this bank supports
    if budget.auto_scope and better is not None and (
            attention_stats is not None or _bank_stats(bank_ref, bank, quiet=True) is not None):
        from dataclasses import replace

        budget = replace(budget, scope=better)
    if budget.strategy.attention:
        config, codes = _attention_steps(bank_ref, bank, lay, config, attention_stats)
        config, rcodes = _row_steps(cache, lay, config, capture_stats)
    elif attention_stats is not None or capture_stats is not None:
        raise KvzError("attention_stats and capture_stats are used by the attention scope only")
    w = budget.tensor_weights(lay.tensor_names(), bank)
    budget = budget.resolved(w)
    eps, scope = float(budget.eps or 0.0), budget.scope  # eps is known once resolved
    from alignpred.cache.detect import check_rope, check_rope_theta

    bank.check_layout(lay)  # a bank of another shape says so before any RoPE question
    check_rope(lay, bank, cache.tensors)
    if not profile.trust_rope and config.rope_undo:
        check_rope_theta(lay, cache.tensors)
    enc = Encoder(lay, bank, config, budget, coder, weights=w, threads=threads, step_codes=codes, row_codes=rcodes)
    bank_bytes = bank.to_bytes() if embed_bank else b""
    n_obj = enc.n_obj
    buf = cache.buf
    is_path = isinstance(out, (str, os.PathLike))
    # The encoder emits objects chunk-major (all tensors of positions 0..2047, then the next
    # 2048, ...); the file holds them tensor-major. They wait in an anonymous spool file next to
    # the output (nothing is left behind on a crash), not in memory.
    spool = spool_file(out if is_path else None)
    try:
        where = np.zeros((2 * lay.num_layers * n_obj, 2), np.int64)  # spool offset, length
        obs: list = [None] * len(where)
        pos = 0
        try:
            encoded = enc.encode(cache.tensors, progress, release=lambda view: release_pages(buf))
            for ob in stepwise(blas_single_thread, encoded):
                k = ob.tensor * n_obj + ob.token_start // config.object_size
                spool.write(ob.payload)
                where[k] = pos, len(ob.payload)
                pos += len(ob.payload)
                ob.payload = b""
                obs[k] = ob
            spool.flush()
        except OSError as e:  # name the output: the spool file has no name of its own
            raise write_error(os.fspath(out) if is_path else "the output", e, SPOOL_NOTE) from None
        metas: list[TensorMeta] = enc.metas
        entries: list[IndexEntry] = []
        state = {"bytes": 0}
        source_metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in cache.metadata.items()}

        def read_spool(k, table=where):
            n, off = int(table[k, 1]), int(table[k, 0])
            if not n:
                return b""
            spool.seek(off)
            payload = spool.read(n)
            if len(payload) != n:
                raise KvzError("the temporary spool file was truncated while compressing")
            return payload

        tiers = ["coarse"]
        if lossless:
            try:
                robs, rwhere, pos = _refinement(cache, enc, metas, obs, read_spool, spool, pos)
            except OSError as e:
                raise write_error(os.fspath(out) if is_path else "the output", e, SPOOL_NOTE) from None
            tiers.append("exact")

        def chunks():
            minor = minor_for(lay, config, budget.scope, tiers, coder)
            yield pack_preamble(FLAG_REFINE if lossless else 0, minor=minor)
            off = PREAMBLE_SIZE
            for table, objs in ((where, obs),) + (((rwhere, robs),) if lossless else ()):
                for k, ob in enumerate(objs):
                    payload = read_spool(k, table)
                    entries.append(IndexEntry(ob.tensor, ob.token_start, ob.n_tokens, ob.flags, off, len(payload),
                                              ob.delta, ob.sq_err, ob.sq_norm, crc32(payload)))
                    off += len(payload)
                    yield payload
            bank_info = {"id": bank.id, "model": bank.model, "embedded": None}
            if embed_bank:
                bank_info["embedded"] = {"offset": off, "length": len(bank_bytes), "crc32": crc32(bank_bytes)}
                off += len(bank_bytes)
                yield bank_bytes
            header = build_header(layout=lay, config=config, budget=budget, coder=coder, bank_info=bank_info,
                                  metas=metas, source_metadata=source_metadata, tiers=tiers,
                                  weights=None if w is None else [float(x) for x in w])
            hb = dump_header(header)
            ib = b"".join(e.pack() for e in entries)
            ft = Footer(off, len(hb), off + len(hb), len(ib), crc32(hb), crc32(ib))
            yield hb
            yield ib
            yield ft.pack()
            state["bytes"] = off + len(hb) + len(ib) + FOOTER_SIZE

        data = None
        if is_path:
            atomic_write(out, chunks())
        elif out is None:
            sink = _pyio.BytesIO()
            for c in chunks():
                sink.write(c)
            data = sink.getvalue()
        else:
            if not hasattr(out, "write"):
                raise KvzError(f"out must be a path, a writable binary stream or None, not {type(out).__name__}")
            for c in chunks():
                out.write(c)
    finally:
        try:
            spool.close()  # unlinked already; a failed flush of its last bytes does not matter
        except OSError:
            pass
    tens = {m.name: math.sqrt(m.sq_err / m.sq_norm) if m.sq_norm > 0 else 0.0 for m in metas}
    tot_e = sum(m.sq_err for m in metas)
    tot_n = sum(m.sq_norm for m in metas)
    info = CompressInfo(os.fspath(out) if is_path else None, lay.n_values, state["bytes"], len(bank_bytes),
                        math.sqrt(tot_e / tot_n) if tot_n > 0 else 0.0, tens, bank.id, data, eps=eps,
                        scope=scope)
    if w is not None:
        live = np.array([m.sq_norm > 0 for m in metas])
        err2 = np.array([tens[m.name] ** 2 for m in metas])
        info.nrmse_weighted = math.sqrt(float(np.sum(w[live] * err2[live]) / np.sum(w[live])))
        info.kl_predicted = float(np.sum(w * err2))
    return info
