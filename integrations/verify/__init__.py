"""Draft on compressed KV, verify on the full KV paged in (VeriCache): output identical to full-KV greedy decoding."""
from kvz.integrations.verify.loop import (
    DraftCache,
    GenerationResult,
    PagedFullKV,
    RoundLog,
    VeriCacheDecoder,
    build_cache,
    forward_logits,
    greedy_accept,
    greedy_reference,
    new_cache,
    residual,
    snapkv_keep,
    speculative_accept,
    text_config,
    window_keep,
)

__all__ = ["DraftCache", "PagedFullKV", "VeriCacheDecoder", "GenerationResult", "RoundLog", "greedy_reference",
           "speculative_accept", "greedy_accept", "residual", "window_keep", "snapkv_keep", "text_config",
           "new_cache", "build_cache", "forward_logits"]
