"""The model-aware error measure of a bank (issue 20, point 1): what attention reads of the cache,
fitted at calibration and stored in a sidecar ``<bank>.attention.json`` beside the bank file (the
bank's own bytes, whose sha256 is the bank id files name, are not touched).

Per layer ``l`` and KV head ``g`` (``d = head_dim``):

* ``key_channel[l, g, c]``: the queries' second moment per pre-RoPE channel ``c`` (after
  ``q_norm``), summed over the query heads of ``g``'s GQA group. RoPE's relative phase averages
  out inside each frequency pair, so the expected squared logit error of a key error ``δk`` is
  ``Σ_c key_weights[c] δk_c²`` with ``key_weights = E|q_p|² / 2`` on both channels of pair ``p``
  (:meth:`AttentionStats.key_weights`; :meth:`AttentionStats.pair_weights` gives ``E|q_p|²``).
* ``value_gram_eig`` / ``value_gram_diag``: eigenvalues (descending) and diagonal of
  ``G = Σ_{h∈g} W_hᵀ W_h`` (``o_proj``'s blocks of the group's heads, times the gain of the norm
  after ``o_proj`` when the model has one): a value error costs ``δvᵀ G δv``.
* ``key_frame`` / ``value_frame``: the same weights seen in the bank's coding frame, where kvz
  quantises: ``diag(Rᵀ W R)`` with the block's GPA rotation ``R`` (``W`` the key weights as a
  diagonal, ``G`` for values); independent quantisation errors per frame channel cost
  ``Σ_c frame[c] d_c``.
* ``sliding_window``: the attention window of the model's sliding-window layers (``layer_types``
  naming ``sliding``), 0 when it has none or it is not known: the attention scope codes positions
  such a layer never attends again more coarsely (:mod:`alignpred.codec.attention_steps`).
* ``token_prior[l, g, j]``: attention mass received by the first ``P`` positions relative to the
  mean (the mass of position ``j`` times the number of positions: 1 = an average token), mean over
  the calibration prefills; ``token_quantiles[l, g, :]`` the quantiles (``quantile_levels``) of
  that relative mass over later positions. ``token_prior_sq`` / ``token_quantiles_sq``: the same
  for the summed *squared* attention weights, the per-token weight of a value error.

``kvz calibrate CACHES... -o bank.h5`` writes the sidecar when the caches were captured with
``kvz capture --attention-stats`` (:func:`~alignpred.bank.fit_attention_stats`); the registry
says whether a bank has one (:meth:`~alignpred.bank.BankEntry.attention_stats`).
``meta`` holds how it was made (texts, tokens, command). The file is JSON with base64
little-endian float32 arrays (``{"dtype", "shape", "data"}``), so it ships beside the bank as
package data. A bank without a sidecar keeps working; a malformed one is an
:class:`AttentionStatsError`.

>>> import numpy as np
>>> s = AttentionStats.empty("toy", "sha256:" + "0" * 64, ["full_attention"], kv_heads=1, head_dim=4)
>>> s.pair_weights().shape, s.key_weights().shape
((1, 1, 2), (1, 1, 4))
"""
from __future__ import annotations

import base64
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from alignpred.errors import BankMismatchError, KvzError

__all__ = ["AttentionStats", "AttentionStatsError", "SUFFIX", "sidecar_path", "save_attention_stats",
           "load_attention_stats", "find_attention_stats", "stats_beside", "read_record", "check_envelope",
           "encode_array", "decode_array", "highrate_gain", "waterfill_gain"]

FORMAT = "kvz-attention-stats"
VERSION = 1
SUFFIX = ".attention.json"
PAIRINGS = ("half", "interleaved")
_ID = re.compile(r"^sha256:[0-9a-f]{64}$")
_MAX_BYTES = 64 << 20
# name -> trailing shape after [layers, kv_heads] ("d": head_dim, "P": prior length, "Q": quantiles)
_ARRAYS = {"key_channel": "d", "value_gram_eig": "d", "value_gram_diag": "d", "key_frame": "d",
           "value_frame": "d", "token_prior": "P", "token_quantiles": "Q", "token_prior_sq": "P",
           "token_quantiles_sq": "Q"}
_OPTIONAL = ("key_frame", "value_frame", "token_prior_sq", "token_quantiles_sq")


class AttentionStatsError(KvzError):
    """An attention-statistics sidecar that is missing pieces, malformed, or of another bank."""


@dataclass(frozen=True, eq=False)
class AttentionStats:
    """A bank's attention statistics (see the module docstring). Arrays are float32."""

    model: str
    bank_id: str
    layer_types: tuple
    pairing: str
    key_channel: np.ndarray
    value_gram_eig: np.ndarray
    value_gram_diag: np.ndarray
    token_prior: np.ndarray
    token_quantiles: np.ndarray
    quantile_levels: tuple
    key_frame: np.ndarray | None = None
    value_frame: np.ndarray | None = None
    token_prior_sq: np.ndarray | None = None
    token_quantiles_sq: np.ndarray | None = None
    meta: dict = field(default_factory=dict)
    sliding_window: int = 0  # the model's attention window of its sliding layers (0: none or unknown)
    kl_per_eps2: float = 0.0  # attention scope without capture statistics: mean next-token KL per eps² (0: unknown)

    def __post_init__(self):
        for name in _ARRAYS:
            a = getattr(self, name)
            if a is not None:
                a = np.array(a, dtype=np.float32)
                a.flags.writeable = False
                object.__setattr__(self, name, a)
        object.__setattr__(self, "layer_types", tuple(str(t) for t in self.layer_types))
        object.__setattr__(self, "quantile_levels", tuple(float(q) for q in self.quantile_levels))
        self.validate()

    @property
    def num_layers(self) -> int:
        return int(self.key_channel.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.key_channel.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.key_channel.shape[2])

    def validate(self) -> None:
        """Raise :class:`AttentionStatsError` naming the first thing that is wrong."""
        if not isinstance(self.model, str):
            raise AttentionStatsError("attention stats: model must be a string")
        if not isinstance(self.bank_id, str) or not _ID.match(self.bank_id):
            raise AttentionStatsError(f"attention stats: bank_id {self.bank_id!r} is not sha256:<64 hex digits>")
        if self.pairing not in PAIRINGS:
            raise AttentionStatsError(f"attention stats: unknown RoPE pairing {self.pairing!r}")
        kc = self.key_channel
        if kc.ndim != 3 or min(kc.shape) < 1 or kc.shape[2] % 2:
            raise AttentionStatsError(f"attention stats: key_channel must be [layers, kv_heads, even head_dim], "
                                      f"got {list(kc.shape)}")
        L, H, d = kc.shape
        if len(self.layer_types) != L:
            raise AttentionStatsError(f"attention stats: {len(self.layer_types)} layer types for {L} layers")
        Q = len(self.quantile_levels)
        if not all(0.0 <= q <= 1.0 for q in self.quantile_levels) or list(self.quantile_levels) != sorted(
                self.quantile_levels):
            raise AttentionStatsError("attention stats: quantile_levels must be increasing numbers in [0, 1]")
        P = self.token_prior.shape[-1] if self.token_prior.ndim == 3 else -1
        sizes = {"d": d, "P": P, "Q": Q}
        for name, tail in _ARRAYS.items():
            a = getattr(self, name)
            if a is None:
                if name not in _OPTIONAL:
                    raise AttentionStatsError(f"attention stats: {name} is missing")
                continue
            want = (L, H, sizes[tail])
            if a.shape != want:
                raise AttentionStatsError(f"attention stats: {name} has shape {list(a.shape)}, expected {list(want)}")
            if not np.isfinite(a).all() or (a < 0).any():
                raise AttentionStatsError(f"attention stats: {name} holds negative or non-finite values")
        if not isinstance(self.meta, dict):
            raise AttentionStatsError("attention stats: meta must be a mapping")
        sw = self.sliding_window
        if isinstance(sw, bool) or not isinstance(sw, int) or sw < 0:
            raise AttentionStatsError(f"attention stats: sliding_window {sw!r} is not a non-negative integer")
        c = self.kl_per_eps2
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not (math.isfinite(c) and c >= 0):
            raise AttentionStatsError(f"attention stats: kl_per_eps2 {c!r} is not a non-negative number")

    @classmethod
    def empty(cls, model: str, bank_id: str, layer_types, *, kv_heads: int, head_dim: int, prior: int = 8,
              levels=(0.5, 0.9, 0.99)) -> AttentionStats:
        """Neutral statistics (every weight 1): what a bank without measurements is equivalent to."""
        L = len(layer_types)
        one = np.ones((L, kv_heads, head_dim), np.float32)
        return cls(model, bank_id, tuple(layer_types), "half", one, one, one, np.ones((L, kv_heads, prior)),
                   np.ones((L, kv_heads, len(levels))), tuple(levels))

    # -- weights ---------------------------------------------------------------------------------------
    def pair_weights(self) -> np.ndarray:
        """``E|q_p|²`` per RoPE pair, ``[layers, kv_heads, head_dim / 2]`` (float64)."""
        c = self.key_channel.astype(np.float64)
        d = c.shape[-1]
        j = np.arange(d // 2)
        a, b = (j, j + d // 2) if self.pairing == "half" else (2 * j, 2 * j + 1)
        return c[..., a] + c[..., b]

    def key_weights(self) -> np.ndarray:
        """Per pre-RoPE channel weight of a key error, phase-averaged: ``E|q_p|² / 2`` on both
        channels of pair ``p``, ``[layers, kv_heads, head_dim]`` (float64)."""
        p = self.pair_weights() / 2
        d = self.head_dim
        out = np.empty(p.shape[:-1] + (d,))
        j = np.arange(d // 2)
        a, b = (j, j + d // 2) if self.pairing == "half" else (2 * j, 2 * j + 1)
        out[..., a] = p
        out[..., b] = p
        return out

    # -- files (the module functions, as methods: ``AttentionStats.find("gemma-3-270m")``) ---------------
    def save(self, path) -> Path:
        """Write to ``path`` (:func:`save_attention_stats`)."""
        return save_attention_stats(self, path)

    @staticmethod
    def load(path) -> AttentionStats:
        """Read a sidecar (:func:`load_attention_stats`)."""
        return load_attention_stats(path)

    @staticmethod
    def find(bank_ref) -> AttentionStats | None:
        """The statistics beside a bank, or None (:func:`find_attention_stats`)."""
        return find_attention_stats(bank_ref)

    @staticmethod
    def path_for(bank_path) -> Path:
        """Where the sidecar of a bank file lives (:func:`sidecar_path`)."""
        return sidecar_path(bank_path)

    def fits(self, bank) -> bool:
        """Whether these statistics belong to ``bank`` (same id)."""
        return self.bank_id == bank.id

    # -- bytes -----------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        arrays = {name: encode_array(getattr(self, name)) for name in _ARRAYS if getattr(self, name) is not None}
        return {"format": FORMAT, "version": VERSION, "model": self.model, "bank_id": self.bank_id,
                "layer_types": list(self.layer_types), "pairing": self.pairing,
                "quantile_levels": list(self.quantile_levels), "arrays": arrays, "meta": self.meta,
                **({"sliding_window": self.sliding_window} if self.sliding_window else {}),
                **({"kl_per_eps2": self.kl_per_eps2} if self.kl_per_eps2 else {})}

    @classmethod
    def from_json(cls, d, where: str = "attention stats") -> AttentionStats:
        check_envelope(d, where, FORMAT, VERSION)
        raw = d.get("arrays")
        if not isinstance(raw, dict) or set(raw) - set(_ARRAYS):
            raise AttentionStatsError(f"{where}: arrays must be a mapping of {', '.join(_ARRAYS)}")
        arrays = {}
        for name, e in raw.items():
            arrays[name] = decode_array(e, f"{where}: array {name}")
        try:
            kw: dict[str, Any] = {n: arrays.get(n) for n in _ARRAYS}
            kw.update(model=d.get("model", ""), bank_id=d.get("bank_id"), layer_types=tuple(d["layer_types"]),
                      pairing=d.get("pairing", "half"), quantile_levels=tuple(d["quantile_levels"]),
                      meta=d.get("meta", {}), sliding_window=d.get("sliding_window", 0),
                      kl_per_eps2=d.get("kl_per_eps2", 0.0))
            return cls(**kw)
        except AttentionStatsError as e:
            raise AttentionStatsError(f"{where}: {str(e).removeprefix('attention stats: ')}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise AttentionStatsError(f"{where}: malformed ({type(e).__name__}: {e})") from None


def check_envelope(d, where: str, fmt: str, version: int) -> None:
    """:class:`AttentionStatsError` unless ``d`` is a JSON object of format ``fmt`` and ``version``."""
    if not isinstance(d, dict):
        raise AttentionStatsError(f"{where}: not a JSON object")
    if d.get("format") != fmt:
        raise AttentionStatsError(f"{where}: format {d.get('format')!r}, expected {fmt!r}")
    if d.get("version") != version:
        raise AttentionStatsError(f"{where}: version {d.get('version')!r} is not supported (this kvz reads {version})")


def encode_array(a) -> dict:
    """A float32 array as ``{"dtype", "shape", "data"}`` (base64 of little-endian bytes): the array
    form of the statistics files."""
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"dtype": "float32", "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}


def decode_array(e, where: str) -> np.ndarray:
    """The array of an :func:`encode_array` entry; :class:`AttentionStatsError` naming ``where``."""
    if not isinstance(e, dict) or e.get("dtype") != "float32" or not isinstance(e.get("data"), str):
        raise AttentionStatsError(f"{where}: needs dtype 'float32', shape and base64 data")
    shape = e.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                               for s in shape):
        raise AttentionStatsError(f"{where}: shape must be a list of non-negative integers")
    try:
        buf = base64.b64decode(e["data"].encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        raise AttentionStatsError(f"{where}: data is not base64") from None
    if len(buf) != 4 * math.prod(shape):
        raise AttentionStatsError(f"{where}: {len(buf)} bytes for shape {shape}")
    return np.frombuffer(buf, dtype="<f4").reshape(shape).astype(np.float32)


# -- files ---------------------------------------------------------------------------------------------
def sidecar_path(bank_path) -> Path:
    """``<stem>.attention.json`` beside a bank file (``x/gemma-3-270m.h5`` ->
    ``x/gemma-3-270m.attention.json``)."""
    p = Path(os.fspath(bank_path))
    return p.with_name(p.name.removesuffix(".h5") + SUFFIX)


def save_attention_stats(stats: AttentionStats, path) -> Path:
    """Write ``stats`` to ``path`` (JSON, atomically)."""
    from alignpred.io import atomic_write

    stats.validate()
    text = json.dumps(stats.to_json(), indent=1, sort_keys=True) + "\n"
    atomic_write(os.fspath(path), [text.encode("utf-8")])
    return Path(path)


def read_record(path, kind: str, max_bytes: int = _MAX_BYTES) -> tuple[dict, str]:
    """``(JSON object, where)`` of a statistics file of ``kind`` (``"attention statistics"``: a
    bank's sidecar; ``"capture statistics"``: a capture's record); :class:`AttentionStatsError` if
    it is missing, larger than ``max_bytes`` or not JSON."""
    from alignpred.io import read_json

    p = Path(os.fspath(path))
    if not p.is_file():
        raise AttentionStatsError(f"{p}: no {kind} file")
    if p.stat().st_size > max_bytes:
        raise AttentionStatsError(f"{p}: {p.stat().st_size} bytes, more than a file of {kind} may hold")
    d = read_json(p)
    if d is None:
        raise AttentionStatsError(f"{p}: not a readable JSON file")
    return d, str(p)


def load_attention_stats(path) -> AttentionStats:
    """Read a sidecar; :class:`AttentionStatsError` if it is missing, not JSON or malformed."""
    d, where = read_record(path, "attention statistics")
    return AttentionStats.from_json(d, where=where)


def _bank_file(ref) -> tuple[Path, str]:
    """``(bank file, bank id)`` of a bank reference: a path, a registry name or id, or a loaded
    :class:`~alignpred.bank.bank.Bank` registered in a search folder."""
    from alignpred.bank.registry import loaded_from, lookup
    from alignpred.io import read_bank_attrs

    if hasattr(ref, "id") and hasattr(ref, "arrays"):  # a Bank: registered, or loaded from a file by path
        e = lookup(ref.id)
        if e is not None:
            return Path(e.path), e.id
        paths = loaded_from(ref.id)
        if not paths:
            raise BankMismatchError(f"bank {ref.id[:19]}… is not in the registry; give the bank file's path")
        return Path(paths[0]), ref.id
    s = os.fspath(ref)
    if os.path.sep in s or s.endswith(".h5") or os.path.exists(s):
        p = Path(s)
        if not p.is_file():
            raise BankMismatchError(f"{p}: no bank file")
        return p, read_bank_attrs(p)[1]
    e = lookup(s)
    if e is None:
        raise BankMismatchError(f"no bank file or registered bank {s!r} (`kvz bank list` shows the registered ones)")
    return Path(e.path), e.id


def find_attention_stats(ref) -> AttentionStats | None:
    """The attention statistics beside a bank (``ref``: path, registry name or id, or a registered
    ``Bank``), or None if it has none. A sidecar of another bank (stale: the bank was refitted) or a
    malformed one is an :class:`AttentionStatsError`."""
    path, bank_id = _bank_file(ref)
    return stats_beside(path, bank_id)


def stats_beside(bank_path, bank_id: str) -> AttentionStats | None:
    """The sidecar beside the bank file ``bank_path`` whose content id is ``bank_id``, or None if
    there is none; a stale (another bank's) or malformed one is an :class:`AttentionStatsError`."""
    path = Path(os.fspath(bank_path))
    side = sidecar_path(path)
    if not side.is_file():
        return None
    stats = load_attention_stats(side)
    if stats.bank_id != bank_id:
        raise AttentionStatsError(f"{side}: statistics of bank {stats.bank_id[:19]}…, not of {path.name} "
                                  f"({bank_id[:19]}…); refit them for this bank (`kvz calibrate` on captures "
                                  "made with `kvz capture --attention-stats`) or remove the file")
    return stats


# -- what the weights are worth ------------------------------------------------------------------------
def highrate_gain(weights) -> float:
    """High-rate reverse water-filling gain ``½ log2(AM / GM)`` of positive weights, in bits per
    component: what per-component steps ``∝ 1/sqrt(w)`` save over one step at equal weighted
    error. Zero weights are left out (those components need no bits at all)."""
    w = np.asarray(weights, np.float64).ravel()
    w = w[w > 0]
    if w.size == 0:
        return 0.0
    return max(0.0, float(0.5 * np.log2(w.mean() / np.exp(np.log(w).mean()))))  # AM >= GM; no -0.0 from rounding


def waterfill_gain(weights, variances, d: float) -> dict:
    """Reverse water-filling at an operating point: one step today gives every component the
    squared error ``min(d, σ²_c)``; the optimum at the same weighted error ``D = Σ w_c min(d,
    σ²_c)`` gives ``min(θ / w_c, σ²_c)`` (components below the water level get no bits). Returns
    ``{"bits": saving in bits per component, "zero_bits": fraction of components given no bits,
    "rate_uniform", "rate_opt"}`` (rates in bits per component, Gaussian high-rate model)."""
    w = np.asarray(weights, np.float64).ravel()
    s = np.maximum(np.asarray(variances, np.float64).ravel(), 0.0)
    if w.shape != s.shape or d <= 0:
        raise ValueError("weights and variances need the same shape, d > 0")
    du = np.minimum(d, s)
    D = float(np.sum(w * du))
    ru = 0.5 * np.log2(np.maximum(s / d, 1.0))
    act = (w > 0) & (s > 0)
    if D <= 0 or not act.any():
        return {"bits": 0.0, "zero_bits": 1.0, "rate_uniform": float(ru.mean()), "rate_opt": 0.0}

    def dist(theta):
        return float(np.sum(np.where(act, w * np.minimum(theta / np.where(act, w, 1.0), s), 0.0)))

    lo, hi = 1e-300, float(np.max(w[act] * s[act])) * 2
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if dist(mid) > D:
            hi = mid
        else:
            lo = mid
        if hi / lo < 1 + 1e-12:
            break
    dc = np.where(act, np.minimum(lo / np.where(act, w, 1.0), s), s)
    ro = 0.5 * np.log2(np.maximum(np.where(s > 0, s / np.maximum(dc, 1e-300), 1.0), 1.0))
    return {"bits": float(ru.mean() - ro.mean()), "zero_bits": float(np.mean(ro == 0)),
            "rate_uniform": float(ru.mean()), "rate_opt": float(ro.mean())}
