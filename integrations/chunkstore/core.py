"""Reuse shared content's KV across prompts from compressed, hashed chunks (KVBoost-style, in context).

::

    from kvz.integrations.chunkstore import ChunkStore, ReuseEngine
    from kvz.integrations.kvstore import DirectoryBackend, RedisBackend
    store = ChunkStore.for_model(model, DirectoryBackend("/var/cache/kvz"), eps=0.02, bank="gemma-3-270m")
    engine = ReuseEngine(model, store, repair="seam", R=32)
    tokens, res = engine.generate(ids, max_new_tokens=32, boundaries=[len(system), len(system) + len(doc)])

**Chunks.** A prompt is split into chunks of ``chunk_tokens`` (256: one ``.kvz`` object row)
positions from its start, restarting at every ``boundaries`` position the caller knows (where a
retrieved document or tool output begins), so a document keeps the same chunks wherever it lands.
Every chunk has two keys:

* a *prefix key*: sha256 chained over the token ids up to and including the chunk — a hit means
  the same tokens at the same positions, so the stored KV is exactly what this prompt computes;
* a *content key*: sha256 of the chunk's token ids alone — the same text at another position,
  or after other text: usable after re-rotation and repair.

Both keys bind the *binding*: model id, ``.kvz`` format major version, codec configuration (JSON),
bank id, eps and error scope, chunk size (or the raw dtype for the uncompressed store), so a changed
model or codec never matches stale KV.

**What is stored** is the KV the model computed for the chunk *in the full prompt* (never a chunk
encoded alone): after a prefill, every chunk whose positions were computed (not served from the
store) is encoded once, for all layers at once (the codec's inter-layer maps read earlier layers),
as a normal ``.kvz`` of its positions with ``position_offset`` and ``token_ids`` set. A chunk whose
whole prefix was exact goes under its prefix key (and a small pointer under its content key); a
chunk computed after approximate (content-reused) KV goes under its content key only, so a prefix
hit is always exact up to the codec's error.

**Lookup** returns the longest run of prefix-key hits, then content-key hits for later chunks.
Hits are decoded with one :class:`alignpred.DecoderSession` straight into preallocated per-layer
buffers; content hits have their keys re-rotated from their old absolute positions to the new ones
with the model's own RoPE (:func:`kvz.integrations.hf.rope.rope_spec_from_model`: per-layer
frequencies and scaling, ``RopeTable.apply`` inverse then forward).

**Repair** of content hits (their KV still reflects the *old* preceding context):
``seam`` recomputes the first ``R`` tokens after each seam (SelectiveRecompute); ``blend`` runs a
probe pass through the first ``probe_layer + 1`` layers over every non-prefix position (which makes
those layers exact), ranks content-hit tokens by the relative deviation of their layer-``probe_layer``
K/V, and recomputes the top ``blend_ratio`` fraction (CacheBlend-style); ``seam+blend`` does both.
Recomputed tokens attend to the full assembled context: one forward over the scattered positions
with an explicit mask per layer type (causal, sliding window), whose cache writes their fresh K/V
into the buffers in place (:class:`_ScatterCache`). When the positions to compute are a suffix (pure
prefix reuse, or a miss) the ordinary cache path is used, so prefix reuse from a lossless store is
the model's own chunked prefill.

**Refresh**: content hits make a prompt's KV approximate; after the first token the engine (by default)
recomputes the approximate part exactly and stores those chunks under their prefix keys, so the store
only ever holds in-context KV and the next request with the same prefix gets exact hits.

**Threads**: kvz's decoder uses numpy BLAS products; on a shared CPU, BLAS threads that spin make it
~10x slower (measured: 2.8 s vs 0.17 s per 256-token chunk of Gemma 3 270M). Limit them
(``OPENBLAS_NUM_THREADS=1``, or ``kvz.benchmarks.run.limit_threads(1)``) as the benchmark does.

**Failures** never fail a request: a backend that is down answers misses (and warns, see
:mod:`kvz.integrations.kvstore`); an entry whose checksum or ``.kvz`` decode fails is deleted and
its positions recomputed (warning).
"""
from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

__all__ = ["ChunkStore", "ReuseEngine", "Chunk", "Hit", "PrefillResult", "split_chunks", "tokens_digest",
           "ChunkStoreWarning",
           "CHUNK_TOKENS", "DEFAULT_EPS"]

CHUNK_TOKENS = 256
DEFAULT_EPS = 0.02
KEY_SCHEME = "kvz-chunk/1"
RAW_DTYPES = ("float16", "bfloat16", "float32")


class ChunkStoreWarning(UserWarning):
    """A stored chunk could not be used (corrupt, undecodable) and was recomputed."""


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int
    end: int
    prefix_key: str
    content_key: str

    @property
    def n(self) -> int:
        return self.end - self.start


@dataclass
class Hit:
    chunk: Chunk
    kind: str  # "prefix" | "content"
    blob: bytes
    src_start: int  # absolute position the stored KV was computed at
    key: str  # backend key the blob came from


@dataclass
class PrefillResult:
    token_ids: list
    logits: object  # torch [vocab] of the last position
    cache: object  # transformers DynamicCache holding every position
    kv: list  # [(K, V)] per layer, torch [1, kv_heads, T, d]: the assembled KV
    chunks: list
    hits: list
    computed: np.ndarray  # bool [T]: positions whose KV this prefill computed
    exact: np.ndarray  # bool [T]: positions whose KV is exact (prefix hit, or computed on an exact prefix)
    stats: dict = field(default_factory=dict)
    stored: bool = False


def split_chunks(n_tokens: int, chunk_tokens: int = CHUNK_TOKENS, boundaries=()) -> list[tuple[int, int]]:
    """``[(start, end)]`` covering ``0..n_tokens``: pieces of ``chunk_tokens`` from each segment start
    (position 0 and every boundary).

    >>> split_chunks(600, 256)
    [(0, 256), (256, 512), (512, 600)]
    >>> split_chunks(600, 256, boundaries=[40, 340])
    [(0, 40), (40, 296), (296, 340), (340, 596), (596, 600)]
    """
    if chunk_tokens < 1:
        raise ValueError("chunk_tokens must be >= 1")
    cuts = sorted({0, n_tokens, *(int(b) for b in boundaries if 0 < int(b) < n_tokens)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        for s in range(a, b, chunk_tokens):
            out.append((s, min(b, s + chunk_tokens)))
    return out


TOKENS_META = "kvz.chunk.tokens_sha256"  # metadata of every stored chunk: which token ids it holds


def _ids_bytes(ids) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def tokens_digest(ids) -> str:
    return hashlib.sha256(_ids_bytes([int(t) for t in ids])).hexdigest()


# ============================================================================ codecs

class _KvzCodec:
    kind = "kvz"

    def __init__(self, eps: float, bank, config=None, scope: str = "tensor", session=None):
        from alignpred import CodecConfig, DecoderSession
        from alignpred.bank.registry import find as find_bank

        self.eps = float(eps)
        self.scope = scope
        self.config = config or CodecConfig()
        self.bank = find_bank(bank, None) if bank is not None else None
        self.session = session or DecoderSession(banks=[self.bank] if self.bank is not None else ())

    def binding(self) -> dict:
        from alignpred.format.container import MAJOR

        return {"codec": "kvz", "format_major": MAJOR, "config": self.config.to_json(),
                "bank": self.bank.id if self.bank is not None else None, "eps": self.eps, "scope": self.scope}

    def encode(self, kv, meta) -> bytes:
        from alignpred import Cache, compress

        return compress(Cache.from_arrays(kv, meta), None, eps=self.eps, bank=self.bank, scope=self.scope,
                        config=self.config).data

    def decode_into(self, blob, out) -> dict:
        """Decode every layer into ``out(layer) -> (k_view, v_view)``; returns the source metadata."""
        from alignpred import KvzReader

        r = KvzReader(memoryview(blob), bank=self.bank, session=self.session)
        for _ in r.layers(out=out):
            pass
        return dict(r.header.get("source_metadata", {}))


class _RawCodec:
    kind = "raw"

    def __init__(self, dtype: str = "float16"):
        if dtype not in RAW_DTYPES:
            raise ValueError(f"raw dtype must be one of {RAW_DTYPES}")
        self.dtype = dtype

    def binding(self) -> dict:
        return {"codec": "raw", "dtype": self.dtype}

    def encode(self, kv, meta) -> bytes:
        from alignpred.cache.cachefile import cache_bytes
        from alignpred.cache.layout import numpy_dtype

        dt = numpy_dtype(self.dtype)
        tensors = {}
        for i, (k, v) in enumerate(kv):
            tensors[f"layers.{i}.key"] = np.asarray(k, np.float32).astype(dt)
            tensors[f"layers.{i}.value"] = np.asarray(v, np.float32).astype(dt)
        return b"".join(cache_bytes(tensors, {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}))

    def decode_into(self, blob, out) -> dict:
        from alignpred.cache.cachefile import parse_safetensors

        tensors, meta = parse_safetensors(memoryview(blob))
        n = len(tensors) // 2
        from alignpred.cache.arrays import as_numpy

        for i in range(n):
            k, v = out(i)
            as_numpy(k, writable=True)[...] = tensors[f"layers.{i}.key"]
            as_numpy(v, writable=True)[...] = tensors[f"layers.{i}.value"]
        return meta


# ============================================================================ the store

class ChunkStore:
    """Chunks of a model's KV in a :class:`~kvz.integrations.kvstore.ChunkBackend`, under prefix and
    content keys bound to the model and codec (see the module docstring).

    ``backend``: a backend (default: a :class:`DirectoryBackend` in ``~/.cache/kvz/chunks``).
    ``codec``: ``"kvz"`` (compressed at ``eps`` with ``bank``, default) or ``"raw"`` (``raw_dtype``
    arrays, uncompressed: the lossless reference). ``layer_types`` / ``rope`` (a RopeSpec) /
    ``shape`` ``(layers, kv_heads, head_dim)`` describe the cache; :meth:`for_model` reads them from
    a transformers model."""

    def __init__(self, backend, *, model_id: str, layer_types, rope, shape, codec: str = "kvz",
                 eps: float = DEFAULT_EPS, bank="gemma-3-270m", config=None, scope: str = "tensor",
                 raw_dtype: str = "float16", chunk_tokens: int = CHUNK_TOKENS, session=None):
        if backend is None:
            import os

            from kvz.integrations.kvstore import DirectoryBackend

            backend = DirectoryBackend(os.path.expanduser("~/.cache/kvz/chunks"))
        self.backend = backend
        self.model_id = str(model_id)
        self.layer_types = [str(t) for t in layer_types]
        self.rope = rope
        self.shape = tuple(int(x) for x in shape)
        self.chunk_tokens = int(chunk_tokens)
        if codec == "kvz":
            self.codec = _KvzCodec(eps, bank, config, scope, session)
        elif codec == "raw":
            self.codec = _RawCodec(raw_dtype)
        else:
            raise ValueError("codec must be 'kvz' or 'raw'")
        self.binding = {"scheme": KEY_SCHEME, "model": self.model_id, "chunk_tokens": self.chunk_tokens,
                        **self.codec.binding()}
        self._bind = hashlib.sha256(json.dumps(self.binding, sort_keys=True, separators=(",", ":")).encode()).digest()
        self.counters = dict.fromkeys(("prefix_hits", "content_hits", "misses", "puts", "put_bytes", "put_tokens",
                                      "dropped"), 0)

    @classmethod
    def for_model(cls, model, backend=None, *, model_id: str | None = None, max_positions: int = 8192, **kw):
        """A store for ``model``'s KV (layer types, exact RoPE and shape read from the model)."""
        from kvz.integrations.hf.bridge import kv_shape, model_id_of
        from kvz.integrations.hf.rope import layer_types_of, rope_spec_from_model

        return cls(backend, model_id=model_id or model_id_of(model), layer_types=layer_types_of(model.config),
                   rope=rope_spec_from_model(model, max_positions), shape=kv_shape(model), **kw)

    # -- keys ------------------------------------------------------------------------------------
    def chunks(self, token_ids, boundaries=()) -> list[Chunk]:
        """The prompt's chunks with their prefix and content keys."""
        ids = [int(t) for t in token_ids]
        out = []
        prev = self._bind
        for i, (a, b) in enumerate(split_chunks(len(ids), self.chunk_tokens, boundaries)):
            body = _ids_bytes(ids[a:b])
            prev = hashlib.sha256(b"p" + prev + len(body).to_bytes(8, "little") + body).digest()
            content = hashlib.sha256(b"c" + self._bind + body).hexdigest()
            out.append(Chunk(i, a, b, "kvz:p:" + prev.hex(), "kvz:c:" + content))
        return out

    # -- lookup ----------------------------------------------------------------------------------
    def lookup(self, token_ids, chunks=None, *, content: bool = True, usable_end: int | None = None) -> list:
        """Fetch hits: the longest run of prefix-key hits, then (``content``) content-key hits for later
        chunks. Returns a list of :class:`Hit` (blobs fetched, not decoded). Chunks ending after
        ``usable_end`` are not looked up."""
        chunks = self.chunks(token_ids) if chunks is None else chunks
        end = len(token_ids) if usable_end is None else usable_end
        hits = []
        i = 0
        for c in chunks:
            if c.end > end:
                break
            e = self.backend.get_entry(c.prefix_key)
            if e is None:
                break
            hits.append(Hit(c, "prefix", e.blob, c.start, c.prefix_key))
            self.counters["prefix_hits"] += 1
            i += 1
        if content:
            for c in chunks[i:]:
                if c.end > end:
                    break
                h = self._content_hit(c)
                if h is not None:
                    hits.append(h)
                    self.counters["content_hits"] += 1
                else:
                    self.counters["misses"] += 1
        else:
            self.counters["misses"] += sum(1 for c in chunks[i:] if c.end <= end)
        return hits

    def _content_hit(self, c: Chunk) -> Hit | None:
        e = self.backend.get_entry(c.content_key)
        if e is None:
            return None
        meta = e.meta or {}
        if meta.get("ptr"):
            key = e.blob.decode("ascii", "replace")
            e2 = self.backend.get_entry(key)
            if e2 is None:
                return None
            return Hit(c, "content", e2.blob, int((e2.meta or {}).get("start", meta.get("start", 0))), key)
        return Hit(c, "content", e.blob, int(meta.get("start", 0)), c.content_key)

    def decode_into(self, hit: Hit, out) -> dict:
        """Decode ``hit`` into ``out(layer) -> (k_view, v_view)`` (``[kv_heads, n, d]``); returns the
        stored metadata. The stored token ids must be the chunk's (else :class:`ValueError`)."""
        return self.codec.decode_into(hit.blob, out)

    def drop(self, hit: Hit) -> None:
        self.counters["dropped"] += 1
        try:
            self.backend.delete(hit.key)
        except Exception:  # noqa: BLE001 - best effort
            pass

    # -- storing ---------------------------------------------------------------------------------
    def put(self, chunk: Chunk, kv, token_ids, *, exact: bool) -> int:
        """Encode ``kv`` (``[(k, v)]`` per layer, numpy ``[kv_heads, n, d]``) of ``chunk`` and store it
        (prefix key + content pointer if ``exact``, else under the content key). Returns bytes stored."""
        meta = {"model": self.model_id, "layer_types": self.layer_types, "keys_roped": True,
                "rope": self.rope.to_json(), "position_offset": int(chunk.start),
                TOKENS_META: tokens_digest(token_ids)}
        blob = self.codec.encode(kv, meta)
        m = {"start": int(chunk.start), "n": chunk.n, "exact": bool(exact)}
        if exact:
            ok = self.backend.put(chunk.prefix_key, blob, meta=m, importance=float(chunk.n))
            if ok:
                self.backend.put(chunk.content_key, chunk.prefix_key.encode("ascii"),
                                 meta={"ptr": 1, "start": int(chunk.start)}, importance=float(chunk.n))
        else:
            ok = self.backend.put(chunk.content_key, blob, meta=m, importance=float(chunk.n))
        if ok:
            self.counters["puts"] += 1
            self.counters["put_bytes"] += len(blob)
            self.counters["put_tokens"] += chunk.n
        return len(blob) if ok else 0


# ============================================================================ the model side

def _scatter_cache_cls():
    from transformers import DynamicCache

    class _ScatterCache(DynamicCache):
        """Writes the K/V of the positions being computed into the full per-layer buffers (in place)
        and hands attention every position; the explicit masks say what each query may see."""

        def __init__(self, K, V, positions):
            super().__init__()
            self.K, self.V, self.pos = K, V, positions
            self.T = K[0].shape[-2]

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            self.K[layer_idx][:, :, self.pos] = key_states.to(self.K[layer_idx].dtype)
            self.V[layer_idx][:, :, self.pos] = value_states.to(self.V[layer_idx].dtype)
            return self.K[layer_idx], self.V[layer_idx]

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.T

    return _ScatterCache


def _buffered_cache_cls():
    from transformers import DynamicCache

    class _BufferedCache(DynamicCache):
        """A normal DynamicCache that also writes the K/V of computed positions into the buffers."""

        def __init__(self, K, V, start, **kw):
            super().__init__(**kw)
            self.K, self.V, self.start = K, V, start
            self.recording = False

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.recording:
                n = key_states.shape[-2]
                self.K[layer_idx][:, :, self.start:self.start + n] = key_states
                self.V[layer_idx][:, :, self.start:self.start + n] = value_states
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return _BufferedCache


class ReuseEngine:
    """Prefill (and generate) with a :class:`ChunkStore`: reuse stored chunks, repair, store the rest.

    ``reuse``: ``"none"`` (full recompute), ``"prefix"`` (exact prefix hits only) or ``"content"``
    (prefix, then content hits with repair). ``repair``: ``"seam"``, ``"blend"``, ``"seam+blend"`` or
    ``"none"``; ``R`` tokens after each seam; ``blend_ratio`` of content-hit tokens by probe deviation
    at ``probe_layer``. ``store_new``: encode and store computed chunks after the prefill (after the
    first token); ``refresh_after``: before storing, recompute the approximate (content-served) part
    exactly, so what is stored is always in-context KV and a repeated prefix hits exactly."""

    def __init__(self, model, store: ChunkStore | None, *, reuse: str = "content", repair: str = "seam",
                 R: int = 32, blend_ratio: float = 0.1, probe_layer: int = 1, store_new: bool = True,
                 refresh_after: bool = True):
        from kvz.integrations.hf.bridge import cache_kwarg, kv_shape, text_config

        if reuse not in ("none", "prefix", "content"):
            raise ValueError("reuse must be none, prefix or content")
        if repair not in ("none", "seam", "blend", "seam+blend"):
            raise ValueError("repair must be none, seam, blend or seam+blend")
        self.model = model
        self.store = store
        self.reuse, self.repair, self.R = reuse, repair, int(R)
        self.blend_ratio, self.probe_layer = float(blend_ratio), int(probe_layer)
        self.store_new = store_new
        self.refresh_after = refresh_after
        self.cfg = text_config(model)
        self.n_layers, self.kv_heads, self.head_dim = kv_shape(model)
        self.layer_types = list(getattr(self.cfg, "layer_types", None) or ["full_attention"] * self.n_layers)
        self.window = getattr(self.cfg, "sliding_window", None)
        self.kw = cache_kwarg(model)
        self.dtype = next(model.parameters()).dtype
        from kvz.integrations.hf.rope import decoder_of

        self.decoder = decoder_of(model)
        self._spec = store.rope if store is not None else None

    # -- helpers -----------------------------------------------------------------------------------
    def _masks(self, pos, T):
        import torch

        q = pos[:, None]
        k = torch.arange(T)[None, :]
        allowed = k <= q
        neg = torch.finfo(self.dtype).min
        out = {}
        for t in set(self.layer_types):
            a = allowed
            if t == "sliding_attention" and self.window:
                a = a & (q - k < int(self.window))
            m = torch.zeros(a.shape, dtype=self.dtype)
            m.masked_fill_(~a, neg)
            out[t] = m[None, None]
        if len(out) == 1 and not getattr(self.cfg, "layer_types", None):
            return next(iter(out.values()))
        return out

    def _forward_scatter(self, ids, positions, K, V):
        """One forward over ``positions`` (sorted, absolute) attending to every buffered position;
        writes their K/V into the buffers; returns the last position's logits."""
        import torch

        pos = torch.as_tensor(positions, dtype=torch.long)
        T = K[0].shape[-2]
        cache = _scatter_cache_cls()(K, V, pos)
        inp = torch.as_tensor([ids[p] for p in positions], dtype=torch.long)[None]
        out = self.model(input_ids=inp, position_ids=pos[None], attention_mask=self._masks(pos, T),
                         use_cache=True, logits_to_keep=1, **{self.kw: cache})
        return out.logits[0, -1]

    def _probe(self, ids, positions, K, V):
        """Forward ``positions`` through the first ``probe_layer + 1`` layers only (layers 0..P become
        exact for them)."""
        import torch

        layers = self.decoder.layers
        P = min(self.probe_layer, self.n_layers - 1)
        self.decoder.layers = torch.nn.ModuleList(list(layers)[:P + 1])
        try:
            self._forward_scatter(ids, positions, K, V)
        finally:
            self.decoder.layers = layers

    # -- prefill -----------------------------------------------------------------------------------
    def prefill(self, token_ids, boundaries=(), *, reuse: str | None = None, repair: str | None = None,
                R: int | None = None, blend_ratio: float | None = None) -> PrefillResult:
        """Assemble the prompt's KV (hits decoded into buffers, content hits re-rotated and repaired,
        the rest computed) and return the last position's logits and a cache to continue from."""
        import torch

        reuse = self.reuse if reuse is None else reuse
        repair = self.repair if repair is None else repair
        R = self.R if R is None else int(R)
        ratio = self.blend_ratio if blend_ratio is None else float(blend_ratio)
        ids = [int(t) for t in token_ids]
        T = len(ids)
        if T < 1:
            raise ValueError("empty prompt")
        st = {"T": T, "lookup_s": 0.0, "decode_s": 0.0, "probe_s": 0.0, "forward_s": 0.0}
        t0 = time.perf_counter()
        L, H, d = self.n_layers, self.kv_heads, self.head_dim
        K = [torch.empty((1, H, T, d), dtype=self.dtype) for _ in range(L)]
        V = [torch.empty((1, H, T, d), dtype=self.dtype) for _ in range(L)]
        filled = np.zeros(T, bool)
        exact = np.zeros(T, bool)
        content_pos = np.zeros(T, bool)
        chunks, hits = [], []
        if reuse != "none" and self.store is not None:
            chunks = self.store.chunks(ids, boundaries)
            hits = self.store.lookup(ids, chunks, content=reuse == "content", usable_end=T - 1)
            st["lookup_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            for h in hits:
                a, b = h.chunk.start, h.chunk.end
                try:
                    meta = self.store.decode_into(h, lambda i, a=a, b=b: (K[i][0, :, a:b], V[i][0, :, a:b]))
                    if meta.get(TOKENS_META) != tokens_digest(ids[a:b]):
                        raise ValueError("stored token ids differ from the chunk's")
                except Exception as e:  # noqa: BLE001 - a bad entry is a miss, never a failed request
                    warnings.warn(ChunkStoreWarning(f"chunk {h.key[:20]}… unusable ({type(e).__name__}: {e}); "
                                                    "dropped and recomputed"), stacklevel=2)
                    self.store.drop(h)
                    h.kind = "dropped"
                    continue
                filled[a:b] = True
                if h.kind == "prefix":
                    exact[a:b] = True
                else:
                    content_pos[a:b] = True
                    if h.src_start != a:
                        self._rerotate(K, a, b, h.src_start)
            hits = [h for h in hits if h.kind != "dropped"]
            st["decode_s"] = time.perf_counter() - t1
        compute = ~filled
        compute[T - 1] = True
        if content_pos.any():
            if "seam" in repair and R > 0:
                for h in hits:
                    if h.kind == "content":
                        a, b = h.chunk.start, h.chunk.end
                        compute[a:min(b, a + R)] = True
            if "blend" in repair and ratio > 0:
                t2 = time.perf_counter()
                sel = self._blend_select(ids, K, V, exact, content_pos & ~compute, ratio)
                compute[sel] = True
                st["probe_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        positions = np.nonzero(compute)[0]
        c0 = int(positions[0])
        with torch.inference_mode():
            if len(positions) == T - c0:  # a suffix: the ordinary cache path
                cache = _buffered_cache_cls()(K, V, c0, config=self.cfg)
                if c0:
                    for i in range(L):
                        cache.update(K[i][:, :, :c0], V[i][:, :, :c0], i)
                cache.recording = True
                pos = torch.arange(c0, T)[None]
                out = self.model(input_ids=torch.as_tensor([ids[c0:]]), position_ids=pos, use_cache=True,
                                 logits_to_keep=1, **{self.kw: cache})
                cache.recording = False
                logits = out.logits[0, -1]
            else:
                logits = self._forward_scatter(ids, positions.tolist(), K, V)
                from kvz.integrations.hf.bridge import new_cache

                cache = new_cache(self.model)
                for i in range(L):
                    cache.update(K[i], V[i], i)
        st["forward_s"] = time.perf_counter() - t3
        st["ttft_s"] = time.perf_counter() - t0  # first token = argmax of logits, microseconds more
        # exact: prefix hits and computed positions before the first stale (content-served) position
        stale = np.nonzero(content_pos & ~compute)[0]
        exact_all = exact | compute
        exact_all[int(stale[0]) if len(stale) else T:] = False
        n_prefix = int(sum(h.chunk.n for h in hits if h.kind == "prefix"))
        n_content = int(sum(h.chunk.n for h in hits if h.kind == "content"))
        st.update(prefix_tokens=n_prefix, content_tokens=n_content, computed_tokens=int(compute.sum()),
                  reused_tokens=int((filled & ~compute).sum()), reuse_frac=float((filled & ~compute).sum()) / T,
                  repaired_tokens=int((content_pos & compute).sum()),
                  n_prefix_hits=sum(h.kind == "prefix" for h in hits),
                  n_content_hits=sum(h.kind == "content" for h in hits), n_chunks=len(chunks))
        return PrefillResult(ids, logits, cache, list(zip(K, V)), chunks, hits, compute, exact_all, st)

    def _rerotate(self, K, a: int, b: int, src: int) -> None:
        """Keys of positions ``a..b`` were rotated for ``src..``: rotate them for ``a..``."""
        spec = self._spec
        for i in range(self.n_layers):
            t = spec.table(i)
            if t is None:
                continue
            x = K[i][0, :, a:b].numpy()
            x[...] = t.apply(t.apply(x, src, inverse=True), a)

    def _blend_select(self, ids, K, V, exact, candidates, ratio):
        """CacheBlend-style: probe layers 0..P over every non-exact position, rank candidate positions
        by the relative deviation of their layer-P K/V from the stored ones, return the top ``ratio``."""
        P = min(self.probe_layer, self.n_layers - 1)
        cand = np.nonzero(candidates)[0]
        if not len(cand):
            return cand
        k_old = K[P][0][:, cand].clone()
        v_old = V[P][0][:, cand].clone()
        T = len(ids)
        run = 0
        while run < T and exact[run]:
            run += 1
        import torch

        with torch.inference_mode():
            self._probe(ids, list(range(run, T)), K, V)
        k_new = K[P][0][:, cand]
        v_new = V[P][0][:, cand]

        def rel(new, old):
            num = (new - old).float().pow(2).sum(dim=(0, 2))
            den = new.float().pow(2).sum(dim=(0, 2)).clamp_min(1e-30)
            return (num / den).sqrt()

        dev = (rel(k_new, k_old) + rel(v_new, v_old)).numpy()
        n = max(1, int(round(ratio * len(cand))))
        top = np.argsort(-dev, kind="stable")[:n]
        self.last_deviation = (cand, dev)
        return np.sort(cand[top])

    # -- storing -----------------------------------------------------------------------------------
    def refresh(self, res: PrefillResult) -> int:
        """Recompute exactly every position from the first approximate one (content-served) to the end,
        on the exact prefix, so the chunks of this prompt can be stored exact (under their prefix keys)
        and the next request with the same prefix gets exact hits. Runs after the first token (it costs
        a prefill of those positions, not time to first token). Returns the positions recomputed."""
        import torch

        T = len(res.token_ids)
        bad = np.nonzero(~res.exact)[0]
        if not len(bad):
            return 0
        s0 = int(bad[0])
        K = [k.clone() for k, _ in res.kv]
        V = [v.clone() for _, v in res.kv]
        with torch.inference_mode():
            cache = _buffered_cache_cls()(K, V, s0, config=self.cfg)
            if s0:
                for i in range(self.n_layers):
                    cache.update(K[i][:, :, :s0], V[i][:, :, :s0], i)
            cache.recording = True
            self.model(input_ids=torch.as_tensor([res.token_ids[s0:]]), position_ids=torch.arange(s0, T)[None],
                       use_cache=True, logits_to_keep=1, **{self.kw: cache})
        res.kv = list(zip(K, V))
        res.computed = res.computed.copy()
        res.computed[s0:] = True
        res.exact = np.ones(T, bool)
        return T - s0

    def store_result(self, res: PrefillResult, *, refresh: bool | None = None) -> dict:
        """Encode and store every chunk of ``res`` whose positions were all computed in this prefill
        (exact ones under their prefix key); with ``refresh`` (default: the engine's) first recompute
        the approximate part exactly (:meth:`refresh`). Returns ``{"stored", "bytes", "store_s",
        "refreshed"}``."""
        t0 = time.perf_counter()
        n = nbytes = 0
        refreshed = 0
        if (self.refresh_after if refresh is None else refresh) and self.store is not None and not res.stored:
            refreshed = self.refresh(res)
        if self.store is not None and not res.stored:
            chunks = res.chunks or self.store.chunks(res.token_ids)
            T = len(res.token_ids)
            for c in chunks:
                a, b = c.start, c.end
                if b > T or not res.computed[a:b].all():
                    continue
                ex = bool(res.exact[a:b].all())
                if self.store.backend.contains(c.prefix_key if ex else c.content_key):
                    continue  # another request stored it meanwhile
                kv = [(k[0, :, a:b].detach().float().numpy(), v[0, :, a:b].detach().float().numpy())
                      for k, v in res.kv]
                got = self.store.put(c, kv, res.token_ids[a:b], exact=ex)
                n += got > 0
                nbytes += got
            res.stored = True
        out = {"stored": n, "bytes": nbytes, "store_s": time.perf_counter() - t0, "refreshed": refreshed}
        res.stats.update(out)
        return out

    # -- generation --------------------------------------------------------------------------------
    def generate(self, token_ids, max_new_tokens: int = 32, boundaries=(), *, store: bool | None = None,
                 return_logits: bool = False, **kw):
        """Greedy generation: prefill with reuse (``ttft_s`` in the stats is the time to the first
        token), store the new chunks, decode the rest. Returns ``(tokens, result)``; with
        ``return_logits`` the per-step logits (torch ``[n, vocab]``) are in ``result.stats['logits']``."""
        import torch

        res = self.prefill(token_ids, boundaries, **kw)
        first = int(res.logits.argmax())
        if self.store_new if store is None else store:
            self.store_result(res)
        toks = [first]
        steps = [res.logits.detach().float().clone()] if return_logits else None
        pos = len(res.token_ids)
        with torch.inference_mode():
            while len(toks) < max_new_tokens:
                out = self.model(input_ids=torch.tensor([[toks[-1]]]), position_ids=torch.tensor([[pos]]),
                                 use_cache=True, **{self.kw: res.cache})
                lg = out.logits[0, -1]
                if steps is not None:
                    steps.append(lg.detach().float().clone())
                toks.append(int(lg.argmax()))
                pos += 1
        if steps is not None:
            res.stats["logits"] = torch.stack(steps)
        return toks, res
