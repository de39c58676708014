"""Attention statistics recorded with one capture (issue 20, point 1), and the fit that turns the
statistics of several captures into a bank's :class:`~alignpred.bank.AttentionStats`.

``kvz capture --attention-stats -o x.safetensors`` writes, beside the cache, ``x.capture-stats.json``
(:func:`capture_stats_path`): what attention read during the prefill that produced the cache —
per layer and KV head the queries' second moment per pre-RoPE channel (summed over the GQA group's
query heads, mean over tokens), the attention mass and summed squared attention each key position
received, and the ``o_proj`` Gram of the group's heads (a property of the model, stored with every
capture so that ``kvz calibrate CACHES...`` needs no model). The record names the prefill it belongs
to (model, number of tokens, sha256 of the token ids), so a record beside another cache of the same
name is refused, not silently used.

:func:`fit_attention_stats` aggregates the records of the calibration captures for a bank: query
moments averaged weighted by tokens; the relative attention mass of the first ``prior`` positions
averaged over captures, and the quantiles of the later positions' relative mass pooled over
captures; the value Gram's eigenvalues, diagonal and the key / value weights in the bank's coding
frame (``diag(Rᵀ W R)`` with the block's GPA rotation). It is the same fit as
``benchmarks/studies/rate/attention_gain.py --fit`` (which wrote the bundled bank's sidecar) given the same
prefills.

The file is JSON with base64 little-endian float32 arrays, like the bank's sidecar; the Gram is
stored as its upper triangle. A malformed or mismatched record is an
:class:`~alignpred.bank.AttentionStatsError`.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from alignpred.bank.attention_stats import (
    PAIRINGS,
    AttentionStats,
    AttentionStatsError,
    check_envelope,
    decode_array,
    encode_array,
    read_record,
)

__all__ = ["CaptureStats", "CAPTURE_SUFFIX", "capture_stats_path", "find_capture_stats", "tokens_digest",
           "fit_attention_stats", "PRIOR", "LEVELS"]

FORMAT = "kvz-capture-stats"
VERSION = 1
CAPTURE_SUFFIX = ".capture-stats.json"
PRIOR = 16  # first positions with a prior of their own (the sink and its neighbours)
LEVELS = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)  # quantiles of the later positions' relative mass
_MAX_BYTES = 256 << 20
_SHA = len("sha256:") + 64


def tokens_digest(token_ids) -> str:
    """``sha256:<hex>`` of a prefill's token ids (their compact JSON list): what ties a record to
    its cache. (A stored chunk's token check is another digest:
    ``kvz.integrations.chunkstore.chunk_tokens_digest``.)"""
    ids = [int(t) for t in token_ids]
    return "sha256:" + hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode("ascii")).hexdigest()


def capture_stats_path(capture_path) -> Path:
    """``<stem>.capture-stats.json`` beside a capture (``a/x.safetensors`` -> ``a/x.capture-stats.json``)."""
    p = Path(os.fspath(capture_path))
    return p.with_name(p.name.removesuffix(".safetensors") + CAPTURE_SUFFIX)


@dataclass(frozen=True, eq=False)
class CaptureStats:
    """The attention statistics of one prefill (float32 arrays, read-only).

    ``q_channel``: ``[layers, kv_heads, head_dim]``; ``mass`` / ``sq``: ``[layers, kv_heads,
    n_tokens]`` (each sums over positions to the mean over heads and query rows of ``Σ a`` / ``Σ a²``);
    ``value_gram``: ``[layers, kv_heads, head_dim, head_dim]``; ``value_gram_kind`` says what it is
    (``o_proj`` alone, or with the gain of the norm after it)."""

    model: str
    n_tokens: int
    tokens_sha256: str
    layer_types: tuple
    pairing: str
    q_channel: np.ndarray
    mass: np.ndarray
    sq: np.ndarray
    value_gram: np.ndarray
    value_gram_kind: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("q_channel", "mass", "sq", "value_gram"):
            a = np.array(getattr(self, name), dtype=np.float32)
            a.flags.writeable = False
            object.__setattr__(self, name, a)
        object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
        self.validate()

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, kv_heads, head_dim)``."""
        L, H, d = self.q_channel.shape
        return int(L), int(H), int(d)

    def validate(self) -> None:
        """Raise :class:`AttentionStatsError` naming the first thing that is wrong."""
        if not isinstance(self.model, str) or not isinstance(self.value_gram_kind, str):
            raise AttentionStatsError("capture stats: model and value_gram_kind must be strings")
        if isinstance(self.n_tokens, bool) or not isinstance(self.n_tokens, int) or self.n_tokens < 1:
            raise AttentionStatsError(f"capture stats: n_tokens {self.n_tokens!r} is not a positive integer")
        if not isinstance(self.tokens_sha256, str) or len(self.tokens_sha256) != _SHA or \
                not self.tokens_sha256.startswith("sha256:"):
            raise AttentionStatsError("capture stats: tokens_sha256 must be sha256:<64 hex digits>")
        if self.pairing not in PAIRINGS:
            raise AttentionStatsError(f"capture stats: unknown RoPE pairing {self.pairing!r}")
        q = self.q_channel
        if q.ndim != 3 or min(q.shape) < 1:
            raise AttentionStatsError(f"capture stats: q_channel must be [layers, kv_heads, head_dim], "
                                      f"got {list(q.shape)}")
        L, H, d = q.shape
        if len(self.layer_types) != L:
            raise AttentionStatsError(f"capture stats: {len(self.layer_types)} layer types for {L} layers")
        for name, want in (("mass", (L, H, self.n_tokens)), ("sq", (L, H, self.n_tokens)),
                           ("value_gram", (L, H, d, d))):
            a = getattr(self, name)
            if a.shape != want:
                raise AttentionStatsError(f"capture stats: {name} has shape {list(a.shape)}, expected {list(want)}")
        for name in ("q_channel", "mass", "sq", "value_gram"):
            a = getattr(self, name)
            if not np.isfinite(a).all() or (name != "value_gram" and (a < 0).any()):
                raise AttentionStatsError(f"capture stats: {name} holds negative or non-finite values")
        if not isinstance(self.meta, dict):
            raise AttentionStatsError("capture stats: meta must be a mapping")

    # -- bytes -----------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = self.shape[2]
        iu = np.triu_indices(d)
        arrays = {"q_channel": self.q_channel, "mass": self.mass, "sq": self.sq,
                  "value_gram_triu": self.value_gram[..., iu[0], iu[1]]}
        return {"format": FORMAT, "version": VERSION, "model": self.model, "n_tokens": self.n_tokens,
                "tokens_sha256": self.tokens_sha256, "layer_types": list(self.layer_types), "pairing": self.pairing,
                "value_gram_kind": self.value_gram_kind, "meta": self.meta,
                "arrays": {k: encode_array(v) for k, v in arrays.items()}}

    @classmethod
    def from_json(cls, d, where: str = "capture stats") -> CaptureStats:
        check_envelope(d, where, FORMAT, VERSION)
        raw = d.get("arrays")
        names = ("q_channel", "mass", "sq", "value_gram_triu")
        if not isinstance(raw, dict) or set(raw) != set(names):
            raise AttentionStatsError(f"{where}: arrays must be a mapping of {', '.join(names)}")
        arrays = {n: decode_array(raw[n], f"{where}: array {n}") for n in names}
        try:
            q, tri = arrays["q_channel"], arrays["value_gram_triu"]
            if q.ndim != 3 or tri.shape != q.shape[:2] + (q.shape[2] * (q.shape[2] + 1) // 2,):
                raise AttentionStatsError(f"attention stats: value_gram_triu has shape {list(tri.shape)} for "
                                          f"q_channel {list(q.shape)}")
            dim = q.shape[2]
            iu = np.triu_indices(dim)
            gram = np.zeros(q.shape[:2] + (dim, dim), np.float32)
            gram[..., iu[0], iu[1]] = tri
            gram[..., iu[1], iu[0]] = tri
            return cls(model=d.get("model", ""), n_tokens=d["n_tokens"], tokens_sha256=d["tokens_sha256"],
                       layer_types=tuple(d["layer_types"]), pairing=d.get("pairing", "half"), q_channel=q,
                       mass=arrays["mass"], sq=arrays["sq"], value_gram=gram,
                       value_gram_kind=d.get("value_gram_kind", ""), meta=d.get("meta", {}))
        except AttentionStatsError as e:
            msg = str(e).removeprefix("capture stats: ").removeprefix("attention stats: ")
            raise AttentionStatsError(f"{where}: {msg}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise AttentionStatsError(f"{where}: malformed ({type(e).__name__}: {e})") from None

    # -- files -----------------------------------------------------------------------------------------
    def save(self, path) -> Path:
        """Write to ``path`` (JSON, atomically)."""
        from alignpred.io import atomic_write

        self.validate()
        text = json.dumps(self.to_json(), sort_keys=True) + "\n"
        atomic_write(os.fspath(path), [text.encode("utf-8")])
        return Path(path)

    @staticmethod
    def load(path) -> CaptureStats:
        """Read a record; :class:`AttentionStatsError` if it is missing, not JSON or malformed."""
        d, where = read_record(path, "capture statistics", _MAX_BYTES)
        return CaptureStats.from_json(d, where=where)

    def check_cache(self, cache, where: str = "capture stats") -> None:
        """Raise :class:`AttentionStatsError` unless this record is of ``cache``'s prefill (same model,
        token ids, layer types and shape)."""
        lay = cache.layout
        fix = "recapture with --attention-stats, or remove the file"
        if (lay.num_layers, lay.kv_heads, lay.head_dim) != self.shape or lay.n_tokens != self.n_tokens:
            raise AttentionStatsError(f"{where}: statistics of {self.shape[0]} layers x {self.shape[1]} KV heads x "
                                      f"{self.n_tokens} tokens x {self.shape[2]}, the cache has {lay.num_layers} x "
                                      f"{lay.kv_heads} x {lay.n_tokens} x {lay.head_dim}; {fix}")
        if lay.model and self.model and lay.model != self.model:
            raise AttentionStatsError(f"{where}: statistics of model {self.model!r}, the cache is of "
                                      f"{lay.model!r}; {fix}")
        if lay.layer_types and tuple(lay.layer_types) != self.layer_types:
            raise AttentionStatsError(f"{where}: layer types differ from the cache's; {fix}")
        raw = cache.metadata.get("token_ids") if isinstance(cache.metadata, dict) else None
        if raw is None:
            raise AttentionStatsError(f"{where}: the cache has no token_ids metadata to match the statistics with; "
                                      f"{fix}")
        try:
            ids = json.loads(raw) if isinstance(raw, str) else list(raw)
        except ValueError:
            raise AttentionStatsError(f"{where}: the cache's token_ids metadata is not JSON; {fix}") from None
        if tokens_digest(ids) != self.tokens_sha256:
            raise AttentionStatsError(f"{where}: statistics of another prefill (the token ids differ); {fix}")


def find_capture_stats(cache, path=None) -> CaptureStats | None:
    """The record beside a loaded cache (``cache.path``, or ``path``), checked against it; None if
    there is none. A malformed or mismatched one is an :class:`AttentionStatsError`."""
    src = path if path is not None else getattr(cache, "path", None)
    if not src:
        return None
    side = capture_stats_path(src)
    if not side.is_file():
        return None
    rec = CaptureStats.load(side)
    rec.check_cache(cache, where=str(side))
    return rec


# -- the fit ---------------------------------------------------------------------------------------------
def _frame_diag(R: np.ndarray | None, M: np.ndarray) -> np.ndarray:
    """``diag(Rᵀ M R)`` (``M`` a matrix, or a vector meaning a diagonal; ``R`` None: identity)."""
    if R is None:
        return np.diagonal(M).copy() if M.ndim == 2 else M.copy()
    R = np.asarray(R, np.float64)
    if M.ndim == 1:
        return (R * R).T @ M
    return np.einsum("ic,ij,jc->c", R, M, R)


def fit_attention_stats(captures, bank, *, prior: int = PRIOR, levels=LEVELS,
                        meta: dict | None = None) -> AttentionStats:
    """A bank's :class:`~alignpred.bank.AttentionStats` from the :class:`CaptureStats` of its
    calibration captures (see the module docstring). ``prior`` is cut to the shortest capture's
    length minus one (the quantiles need later positions). The captures' value Grams must agree
    (they are the model's)."""
    caps = list(captures)
    if not caps:
        raise AttentionStatsError("attention stats: no capture statistics to fit")
    first = caps[0]
    L, H, d = first.shape
    sig = bank.signature
    if (sig.get("num_layers"), sig.get("kv_heads"), sig.get("head_dim")) != (L, H, d):
        raise AttentionStatsError(f"attention stats: captures of {L} layers x {H} KV heads x {d}, the bank is of "
                                  f"{sig.get('num_layers')} x {sig.get('kv_heads')} x {sig.get('head_dim')}")
    for c in caps[1:]:
        if c.shape != first.shape or c.layer_types != first.layer_types or c.pairing != first.pairing:
            raise AttentionStatsError("attention stats: the captures' statistics disagree on shape, layer types "
                                      "or RoPE pairing (captures of different models?)")
        tol = 1e-6 * float(np.abs(first.value_gram).max())
        if c.value_gram_kind != first.value_gram_kind or not np.allclose(c.value_gram, first.value_gram, rtol=1e-4,
                                                                         atol=tol):
            raise AttentionStatsError("attention stats: the captures' W_o Grams differ (captures of different models?)")
    n_min = min(c.n_tokens for c in caps)
    if n_min < 2:
        raise AttentionStatsError("attention stats: every capture needs at least 2 tokens")
    P = max(1, min(int(prior), n_min - 1))
    n = np.array([c.n_tokens for c in caps], np.float64)
    q = sum(c.q_channel.astype(np.float64) * c.n_tokens for c in caps) / n.sum()
    rel = [c.mass.astype(np.float64) * c.n_tokens for c in caps]  # 1 = an average position
    rel_sq = []
    for c in caps:
        s = c.sq.astype(np.float64)
        rel_sq.append(s / np.maximum(s.mean(axis=-1, keepdims=True), np.finfo(np.float64).tiny))
    levels = tuple(float(x) for x in levels)

    def quantiles(xs):
        return np.quantile(np.concatenate([x[..., P:] for x in xs], -1), levels, axis=-1).transpose(1, 2, 0)

    G = first.value_gram.astype(np.float64)
    G = (G + np.swapaxes(G, -1, -2)) / 2
    eig = np.maximum(np.linalg.eigvalsh(G)[..., ::-1], 0.0)
    stats = AttentionStats(model=bank.model or first.model, bank_id=bank.id, layer_types=first.layer_types,
                           pairing=first.pairing, key_channel=q, value_gram_eig=eig,
                           value_gram_diag=np.maximum(np.diagonal(G, axis1=-2, axis2=-1), 0.0),
                           token_prior=np.mean([x[..., :P] for x in rel], axis=0), token_quantiles=quantiles(rel),
                           quantile_levels=levels, token_prior_sq=np.mean([x[..., :P] for x in rel_sq], axis=0),
                           token_quantiles_sq=quantiles(rel_sq))
    kw = stats.key_weights()
    key_frame = np.stack([[_frame_diag(bank.rotation(f"K.{i}.{g}"), kw[i, g]) for g in range(H)] for i in range(L)])
    value_frame = np.stack([[_frame_diag(bank.rotation(f"V.{i}.{g}"), G[i, g]) for g in range(H)] for i in range(L)])
    info = {"captures": len(caps), "tokens": [int(x) for x in n], "prior_positions": P,
            "value_gram": first.value_gram_kind,
            "queries": "pre-RoPE, after q_norm, summed over the GQA group's heads, mean over tokens",
            "token_prior": f"attention mass received (mean over heads and query rows) x T, positions 0..{P - 1}"}
    info.update(meta or {})
    from dataclasses import replace

    # the model's sliding window, as the captures recorded it (0: none recorded)
    window = max(int(c.meta.get("sliding_window", 0) or 0) for c in caps)
    return replace(stats, key_frame=np.maximum(key_frame, 0.0), value_frame=np.maximum(value_frame, 0.0), meta=info,
                   sliding_window=window)
