"""KV chunk reuse across prompts (KVBoost-style): chunk keys, serdes, the store and the transformers reuse engine.

See :mod:`kvz.integrations.chunkstore.core` for the design."""
from kvz.integrations.chunkstore.core import (
    CHUNK_TOKENS,
    DEFAULT_EPS,
    TOKENS_META,
    Chunk,
    ChunkStore,
    ChunkStoreWarning,
    Hit,
    PrefillResult,
    ReuseEngine,
    split_chunks,
    tokens_digest,
)

__all__ = ["TOKENS_META", "ChunkStore", "ReuseEngine", "Chunk", "Hit", "PrefillResult", "split_chunks", "tokens_digest",
           "ChunkStoreWarning", "CHUNK_TOKENS", "DEFAULT_EPS"]
