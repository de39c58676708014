"""One chunk of a serving engine's KV as one ``.kvz`` blob, shared by the LMCache and SGLang adapters.

Engines hand over a chunk (LMCache) or a page (SGLang) of every layer at once; this module turns
per-layer ``(key, value)`` arrays ``[kv_heads, tokens, head_dim]`` into a ``.kvz`` file and back,
with the model's cache metadata (layer types, RoPE thetas, pairing, ``keys_roped``) configured
once, and the chunk's token position either given by the caller or found by
:func:`kvz.integrations.lmcache.position.find_position_offset` (recorded in the file either way:
``position_offset`` and ``kvz.position_source`` = ``caller`` | ``search``).

::

    codec = KvzChunkCodec(bank="gemma-3-270m", cache_metadata=metadata_from_file(sample))  # FP8's KL
    blob = codec.encode(pairs, position_offset=None)      # None: the phase is searched
    pairs2, meta = codec.decode(blob)                      # the stored dtype; meta["position_offset"]

Nothing here imports an engine; errors are :class:`alignpred.KvzError` (corrupt blobs) or
``ValueError`` (configuration).
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["KvzChunkCodec", "DEFAULT_EPS", "as_bool", "codec_from_options", "metadata_from_file",
           "model_metadata", "MODEL_FIELDS"]

# The cache metadata fields that describe the model (not one cache): what an adapter configures once.
MODEL_FIELDS = ("model", "layer_types", "rope_theta", "rope_pairing", "keys_roped", "rope", "rotary_dim",
                "rope_scaling", "partial_rotary_factor", "attention_scaling")
POSITION_MODES = ("search", "zero")
DEFAULT_EPS = 0.0267  # an eps-less lossless codec's coarse tier, and the fallback of a bank without statistics


def model_metadata(meta) -> dict:
    """The model fields of a cache's metadata (a dict or a JSON string); everything else (token ids,
    source, position) is dropped."""
    if isinstance(meta, (str, bytes)):
        meta = json.loads(meta)
    if not isinstance(meta, dict):
        raise ValueError("cache metadata must be a dict (or its JSON)")
    return {k: v for k, v in meta.items() if k in MODEL_FIELDS}


def metadata_from_file(path) -> dict:
    """The model fields of a kvz-cache safetensors file (e.g. one captured with ``kvz capture``)."""
    from alignpred import load_cache

    return model_metadata(load_cache(path).metadata)


def as_bool(v) -> bool:
    """A configuration flag: ``true/1/yes/on`` (any case) in a string, else Python truth."""
    return v.strip().lower() in ("1", "true", "yes", "on") if isinstance(v, str) else bool(v)


@dataclass
class KvzChunkCodec:
    """Encode/decode one chunk (every layer) as a ``.kvz`` blob.

    ``bank``: a registry name, path or :class:`alignpred.Bank`; ``eps`` and ``scope`` as in
    :func:`alignpred.compress`, or ``target_kl`` (a mean next-token KL or ``"fp8"``): with neither
    eps nor target_kl, FP8's KL in the attention scope from the bank's statistics
    (:class:`~kvz.integrations.scope.StoreBudget`, :attr:`budget`; docs/engine-scope.md); ``eps``
    alone keeps the tensor scope as before. ``lossless`` adds the exact tier (bit-exact decode).
    ``cache_metadata``: the model fields (see :func:`model_metadata`). ``position``: what to do when
    the caller gives no position — ``"search"`` (default: :func:`find_position_offset` over
    ``search_step``-aligned offsets below ``max_positions``) or ``"zero"``. ``profile``:
    ``default``, ``balanced`` or ``fast`` (:mod:`alignpred.codec.profiles`: fewer bits, or a faster
    page-in at more bits).
    """

    bank: object = "gemma-3-270m"
    eps: float | None = None
    scope: str | None = None
    lossless: bool = False
    cache_metadata: dict = field(default_factory=dict)
    position: str = "search"
    search_step: int | None = None
    max_positions: int = 8192
    threads: int | None = 1
    profile: str = "default"
    target_kl: object = None
    stats: dict = field(default_factory=lambda: {"encoded": 0, "decoded": 0, "searched": 0,
                                                 "encode_s": 0.0, "decode_s": 0.0, "search_s": 0.0,
                                                 "raw_bytes": 0, "stored_bytes": 0})
    warmup_s: float | None = field(default=None, init=False, compare=False)  # set by start_warmup
    _warm: threading.Thread | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.position not in POSITION_MODES:
            raise ValueError(f"kvz position mode must be one of {POSITION_MODES}, got {self.position!r}")
        self.budget = self._choose_budget()
        self.eps, self.scope = self.budget.eps, self.budget.scope
        import logging

        logging.getLogger("kvz.integrations.chunks").info("kvz chunk codec: %s", self.budget.describe())
        self.cache_metadata = model_metadata(self.cache_metadata or {})
        from alignpred.codec import PROFILES

        if self.profile not in PROFILES:
            raise ValueError(f"kvz profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")

    def _choose_budget(self):
        from alignpred import KvzError, resolve_bank
        from kvz.integrations.scope import StoreBudget

        eps, kl = self.eps, self.target_kl
        if eps is not None:
            eps = float(eps)
            if not (eps > 0):
                raise ValueError(f"kvz eps must be positive, got {eps}")
        elif self.lossless and kl is None:
            eps = DEFAULT_EPS  # the lossless tier: its coarse tier as before
        bank = None
        if eps is None:
            try:
                bank = resolve_bank(self.bank)
            except KvzError:
                bank = None  # compress names the problem at the first encode
        try:
            return StoreBudget.choose(bank, eps=eps, target_kl=kl, scope=self.scope, fallback_eps=DEFAULT_EPS)
        except KvzError as e:
            raise ValueError(f"kvz: {e}") from None

    # ------------------------------------------------------------------ encode
    def tensors(self, pairs) -> dict:
        """``{"layers.{i}.key"/"value": array}`` from ``[(k, v), ...]`` (numpy or CPU torch)."""
        from alignpred.cache import as_numpy

        out = {}
        for i, (k, v) in enumerate(pairs):
            out[f"layers.{i}.key"] = np.ascontiguousarray(as_numpy(k))
            out[f"layers.{i}.value"] = np.ascontiguousarray(as_numpy(v))
        return out

    def find_offset(self, tensors: dict, step: int | None = None) -> int:
        from .position import find_position_offset

        t0 = time.perf_counter()
        g = find_position_offset(tensors, self.cache_metadata, bank=self.bank, step=step or self.search_step or 1,
                                 max_positions=self.max_positions)
        self.stats["searched"] += 1
        self.stats["search_s"] += time.perf_counter() - t0
        return g.offset

    def encode(self, pairs, position_offset: int | None = None, *, step: int | None = None,
               extra: dict | None = None) -> bytes:
        """The ``.kvz`` bytes of one chunk. ``position_offset``: the chunk's first token position, or
        None (position-blind caller: searched, or 0 with ``position="zero"``); ``step``: the search
        grid (chunk-aligned callers pass their chunk size)."""
        from alignpred import Cache, compress_bytes

        tensors = pairs if isinstance(pairs, dict) else self.tensors(pairs)
        source = "caller"
        if position_offset is None:
            if self.position == "search" and self.cache_metadata.get("keys_roped") in (True, "true", "True"):
                position_offset = self.find_offset(tensors, step)
                source = "search"
            else:
                position_offset, source = 0, "zero"
        meta = dict(self.cache_metadata, position_offset=int(position_offset))
        meta["kvz.position_source"] = source
        if extra:
            meta.update({str(k): (v if isinstance(v, str) else json.dumps(v)) for k, v in extra.items()})
        t0 = time.perf_counter()
        data = compress_bytes(Cache.from_arrays(tensors, meta), budget=self.budget.budget(lossless=self.lossless),
                              bank=self.bank, profile=self.profile, threads=self.threads)
        self.stats["encode_s"] += time.perf_counter() - t0
        self.stats["encoded"] += 1
        self.stats["raw_bytes"] += sum(a.nbytes for a in tensors.values())
        self.stats["stored_bytes"] += len(data)
        return data

    # ------------------------------------------------------------------ warm-up
    def warmup(self, num_layers: int, num_heads: int, head_dim: int, dtype: str = "bfloat16",
               tokens: int = 16) -> float:
        """Encode and decode one synthetic chunk of this shape in this codec's mode, so numba has
        compiled (or loaded from its cache) every kernel before the first real request: a cold
        first compile takes tens of seconds, longer than an engine waits for a read. Not counted
        in :attr:`stats`. Returns the seconds taken."""
        import ml_dtypes

        t0 = time.perf_counter()
        dt = np.dtype(getattr(ml_dtypes, dtype, dtype))
        rng = np.random.default_rng(0)
        pairs = [tuple(rng.standard_normal((num_heads, tokens, head_dim)).astype(dt) for _ in range(2))
                 for _ in range(num_layers)]
        saved = dict(self.stats)
        try:
            self.decode(self.encode(pairs, None, step=tokens))
        finally:
            self.stats.clear()
            self.stats.update(saved)
        return time.perf_counter() - t0

    def start_warmup(self, num_layers: int, num_heads: int, head_dim: int, dtype: str = "bfloat16", *,
                     on_error=None) -> None:
        """:meth:`warmup` on a background thread (engines call it at start-up); ``on_error(exc)``
        is told of a failure (the codec still works, its first request just compiles)."""
        def run():
            try:
                self.warmup_s = self.warmup(num_layers, num_heads, head_dim, dtype)
            except Exception as e:  # noqa: BLE001 - reported, never raised into the engine
                if on_error is not None:
                    on_error(e)

        self._warm = threading.Thread(target=run, name="kvz-warmup", daemon=True)
        self._warm.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for a warm-up started by :meth:`start_warmup`; True when none is running."""
        if self._warm is not None:
            self._warm.join(timeout)
            return not self._warm.is_alive()
        return True

    # ------------------------------------------------------------------ decode
    def reader(self, blob):
        from alignpred import KvzReader

        return KvzReader(memoryview(blob), bank=self.bank, threads=self.threads)

    def decode(self, blob) -> tuple[list, dict]:
        """``([(k, v), ...], source metadata)`` in the stored dtype."""
        t0 = time.perf_counter()
        r = self.reader(blob)
        t = r.read()
        n = len(t) // 2
        pairs = [(t[f"layers.{i}.key"], t[f"layers.{i}.value"]) for i in range(n)]
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["decoded"] += 1
        return pairs, dict(r.header.get("source_metadata", {}))

    def decode_into(self, blob, out) -> dict:
        """Decode every layer into ``out(layer) -> (k_buf, v_buf)`` (numpy or CPU torch, the
        stored shape ``[kv_heads, tokens, head_dim]``); returns the source metadata."""
        t0 = time.perf_counter()
        r = self.reader(blob)
        for _ in r.layers(out=out):
            pass
        self.stats["decode_s"] += time.perf_counter() - t0
        self.stats["decoded"] += 1
        return dict(r.header.get("source_metadata", {}))


def codec_from_options(opts: dict, *, default_step: int | None = None) -> KvzChunkCodec:
    """A :class:`KvzChunkCodec` from an engine's string options (``bank``, ``eps``, ``target_kl``, ``scope``,
    ``lossless``, ``metadata`` (dict or JSON) or ``metadata_from`` (a kvz-cache file), ``position``,
    ``search_step``, ``max_positions``, ``threads``, ``profile``), with the adapters' defaults."""
    meta = opts.get("metadata")
    if meta is None and opts.get("metadata_from"):
        meta = metadata_from_file(opts["metadata_from"])
    if meta is None:
        raise ValueError("kvz needs the model's cache metadata: set <prefix>.metadata (JSON with rope_theta, "
                         "rope_pairing, keys_roped, layer_types, model) or <prefix>.metadata_from (a kvz-cache file)")
    threads = opts.get("threads", 1)
    eps, scope = opts.get("eps"), opts.get("scope")
    return KvzChunkCodec(bank=opts.get("bank", "gemma-3-270m"), eps=None if eps in (None, "") else float(eps),
                         scope=None if scope in (None, "") else str(scope), target_kl=opts.get("target_kl"),
                         lossless=as_bool(opts.get("lossless", False)),
                         cache_metadata=model_metadata(meta), position=str(opts.get("position", "search")),
                         search_step=int(opts.get("search_step", default_step or 1)),
                         max_positions=int(opts.get("max_positions", 8192)),
                         threads=None if threads in (None, "auto") else int(threads),
                         profile=str(opts.get("profile", "default")))
