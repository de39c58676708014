"""Reuse shared content's KV across prompts from compressed, hashed chunks (KVBoost-style, in context).

::

    from kvz.integrations.chunkstore import ChunkStore, ReuseEngine
    from kvz.integrations.kvstore import DirectoryBackend, RedisBackend
    store = ChunkStore.for_model(model, DirectoryBackend("/var/cache/kvz"), eps=0.02, bank="gemma-3-270m")
    engine = ReuseEngine(model, store)  # repair: the measured default (seam + deviation-guided)
    tokens, res = engine.generate(ids, max_new_tokens=32, boundaries=[len(system), len(system) + len(doc)])

One module per concept, each building on the ones before it:

* :mod:`~kvz.integrations.chunkstore.keys` — chunking a prompt, the prefix and content keys and
  the binding they carry (model, format, codec, bank, eps);
* :mod:`~kvz.integrations.chunkstore.serde` — a chunk's K/V to bytes and back (:class:`KvzSerde`:
  a ``.kvz``; :class:`RawSerde`: uncompressed, the lossless reference);
* :mod:`~kvz.integrations.chunkstore.store` — :class:`ChunkStore`: chunks under their keys in a
  :class:`~kvz.integrations.kvstore.ChunkBackend`, lookup of prefix then content hits;
* :mod:`~kvz.integrations.chunkstore.engine` — :class:`ReuseEngine`: a transformers model's prefill
  from the store (re-rotation, seam / blend repair, refresh, storing), through
  :mod:`kvz.integrations.hf`;
* :mod:`~kvz.integrations.chunkstore.repair` — which reused positions a prefill recomputes (seams
  derived from the chunk layout, probe-layer deviation, deviation-guided and CacheBlend-style selection).
"""
from kvz.integrations.chunkstore.engine import (
    DEFAULT_MAX_FRAC,
    DEFAULT_PROBE_LAYER,
    DEFAULT_R,
    DEFAULT_REPAIR,
    DEFAULT_THRESHOLD,
    PrefillResult,
    ReuseEngine,
)
from kvz.integrations.chunkstore.keys import (
    CHUNK_TOKENS,
    TOKENS_META,
    Chunk,
    chunk_tokens_digest,
    separator_boundaries,
    split_chunks,
)
from kvz.integrations.chunkstore.repair import REPAIRS
from kvz.integrations.chunkstore.serde import DEFAULT_EPS, KvzSerde, RawSerde
from kvz.integrations.chunkstore.store import ChunkStore, ChunkStoreWarning, Hit

__all__ = ["TOKENS_META", "ChunkStore", "ReuseEngine", "Chunk", "Hit", "PrefillResult", "split_chunks",
           "chunk_tokens_digest", "ChunkStoreWarning", "CHUNK_TOKENS", "DEFAULT_EPS", "KvzSerde", "RawSerde",
           "separator_boundaries",
           "REPAIRS", "DEFAULT_REPAIR", "DEFAULT_R", "DEFAULT_THRESHOLD", "DEFAULT_MAX_FRAC", "DEFAULT_PROBE_LAYER"]
