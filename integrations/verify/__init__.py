"""Draft on compressed KV, verify on the full KV paged in (VeriCache): output identical to full-KV greedy decoding.

:mod:`~kvz.integrations.verify.accept` (acceptance maths), :mod:`~kvz.integrations.verify.drafters`
(the drafter's context), :mod:`~kvz.integrations.verify.paged` (the verifier's), and
:mod:`~kvz.integrations.verify.loop` (the full-KV reference and :class:`VeriCacheDecoder`).
``build_cache`` and ``forward_logits`` are :mod:`kvz.integrations.hf`'s, named here for the loop's callers.
"""
from kvz.integrations.hf import build_cache, forward_logits
from kvz.integrations.verify.accept import greedy_accept, residual, speculative_accept
from kvz.integrations.verify.drafters import DraftCache, snapkv_keep, window_keep
from kvz.integrations.verify.loop import GenerationResult, RoundLog, VeriCacheDecoder, greedy_reference
from kvz.integrations.verify.paged import PagedFullKV

__all__ = ["DraftCache", "PagedFullKV", "VeriCacheDecoder", "GenerationResult", "RoundLog", "greedy_reference",
           "speculative_accept", "greedy_accept", "residual", "window_keep", "snapkv_keep", "build_cache",
           "forward_logits"]
