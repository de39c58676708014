"""The chunk store: a model's KV chunks in a :class:`~kvz.integrations.kvstore.ChunkBackend`.

**What is stored** is the KV the model computed for the chunk *in the full prompt* (never a chunk
encoded alone), encoded by a serde (:mod:`~kvz.integrations.chunkstore.serde`) as a normal ``.kvz``
of its positions with ``position_offset`` and the digest of its token ids set. A chunk whose whole
prefix was exact goes under its prefix key (and a small pointer under its content key); a chunk
computed after approximate (content-reused) KV goes under its content key only, so a prefix hit is
always exact up to the codec's error.

**Lookup** returns the longest run of prefix-key hits, then content-key hits for later chunks
(blobs fetched, not decoded: :class:`Hit`).

**Failures**: a backend that is down answers misses (and warns, see :mod:`kvz.integrations.kvstore`);
an entry the caller cannot use is :meth:`ChunkStore.drop`-ped.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvz.integrations.chunkstore.keys import (
    CHUNK_TOKENS,
    KEY_SCHEME,
    TOKENS_META,
    Chunk,
    binding_digest,
    chunk_keys,
    chunk_tokens_digest,
)
from kvz.integrations.chunkstore.serde import KvzSerde, RawSerde

__all__ = ["ChunkStore", "Hit", "ChunkStoreWarning"]


class ChunkStoreWarning(UserWarning):
    """A stored chunk could not be used (corrupt, undecodable) and was recomputed."""


@dataclass
class Hit:
    """A stored chunk found for ``chunk``: its blob (not decoded yet) and where it came from."""
    chunk: Chunk
    kind: str  # "prefix" | "content"
    blob: bytes
    src_start: int  # absolute position the stored KV was computed at
    key: str  # backend key the blob came from


class ChunkStore:
    """Chunks of a model's KV in a :class:`~kvz.integrations.kvstore.ChunkBackend`, under prefix and
    content keys bound to the model and codec (:mod:`~kvz.integrations.chunkstore.keys`).

    ``backend``: a backend (default: a :class:`DirectoryBackend` in ``~/.cache/kvz/chunks``).
    ``codec``: ``"kvz"`` (compressed at ``eps`` — or ``target_kl``, a KL or ``"fp8"``, the default when
    neither is given: the attention scope from the bank's statistics — with ``bank``: a :class:`KvzSerde`) or
    ``"raw"`` (``raw_dtype`` arrays, uncompressed: the lossless reference, a :class:`RawSerde`); the
    serde is :attr:`codec`. ``layer_types`` / ``rope`` (a RopeSpec) /
    ``shape`` ``(layers, kv_heads, head_dim)`` describe the cache; :meth:`for_model` reads them from
    a transformers model. ``weights``: the checkpoint's fingerprint
    (:func:`~kvz.integrations.fingerprint.weights_fingerprint`; :meth:`for_model` takes it from the
    model's directory), bound into every key with ``model_id`` when given."""

    def __init__(self, backend, *, model_id: str, layer_types, rope, shape, codec: str = "kvz",
                 eps: float | None = None, bank="gemma-3-270m", config=None, scope: str | None = None,
                 raw_dtype: str = "float16", chunk_tokens: int = CHUNK_TOKENS, session=None, target_kl=None,
                 weights: str | None = None):
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
            self.codec: KvzSerde | RawSerde = KvzSerde(eps, bank, config, scope, session, target_kl=target_kl)
        elif codec == "raw":
            self.codec = RawSerde(raw_dtype)
        else:
            raise ValueError("codec must be 'kvz' or 'raw'")
        self.binding = {"scheme": KEY_SCHEME, "model": self.model_id, "chunk_tokens": self.chunk_tokens,
                        **self.codec.binding()}
        if weights:
            self.binding["weights"] = str(weights)
        self._bind = binding_digest(self.binding)
        self.counters = dict.fromkeys(("prefix_hits", "content_hits", "misses", "puts", "put_bytes", "put_tokens",
                                      "dropped"), 0)

    @classmethod
    def for_model(cls, model, backend=None, *, model_id: str | None = None, max_positions: int = 8192, **kw):
        """A store for ``model``'s KV (layer types, exact RoPE and shape read from the model)."""
        from kvz.integrations.fingerprint import weights_fingerprint
        from kvz.integrations.hf import kv_shape, layer_types_of, model_id_of, rope_spec_from_model

        kw.setdefault("weights", weights_fingerprint(getattr(model.config, "_name_or_path", None)))
        return cls(backend, model_id=model_id or model_id_of(model), layer_types=layer_types_of(model.config),
                   rope=rope_spec_from_model(model, max_positions), shape=kv_shape(model), **kw)

    # -- keys ------------------------------------------------------------------------------------
    def chunks(self, token_ids, boundaries=()) -> list[Chunk]:
        """The prompt's chunks with their prefix and content keys."""
        return chunk_keys(token_ids, self._bind, self.chunk_tokens, boundaries)

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
                TOKENS_META: chunk_tokens_digest(token_ids)}
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
