"""Chunk keys: how a prompt is cut into chunks, and the two keys each chunk is stored under.

**Chunks.** A prompt is split into chunks of ``chunk_tokens`` (256: one ``.kvz`` object row)
positions from its start, restarting at every ``boundaries`` position the caller knows (where a
retrieved document or tool output begins), so a document keeps the same chunks wherever it lands.
Every chunk has two keys:

* a *prefix key*: sha256 chained over the token ids up to and including the chunk — a hit means
  the same tokens at the same positions, so the stored KV is exactly what this prompt computes;
* a *content key*: sha256 of the chunk's token ids alone — the same text at another position,
  or after other text: usable after re-rotation and repair.

Both keys bind the *binding* (:func:`binding_digest`): model id, ``.kvz`` format major version,
codec configuration (JSON), bank id, eps and error scope, chunk size (or the raw dtype for the
uncompressed store), so a changed model or codec never matches stale KV.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

__all__ = ["CHUNK_TOKENS", "KEY_SCHEME", "TOKENS_META", "Chunk", "split_chunks", "separator_boundaries",
           "chunk_tokens_digest", "binding_digest", "chunk_keys"]

CHUNK_TOKENS = 256
KEY_SCHEME = "kvz-chunk/1"
TOKENS_META = "kvz.chunk.tokens_sha256"  # metadata of every stored chunk: which token ids it holds


@dataclass(frozen=True)
class Chunk:
    """Positions ``start..end`` of a prompt (its ``index``-th chunk) and the keys it is stored under."""
    index: int
    start: int
    end: int
    prefix_key: str
    content_key: str

    @property
    def n(self) -> int:
        return self.end - self.start


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


def separator_boundaries(token_ids, separators, min_segment: int = 32) -> list[int]:
    """Boundaries derived from the text itself: the position of each separator token (a boundary *on*
    the separator, so it leads the next chunk), skipping separators that follow the previous boundary
    (or the start) by fewer than ``min_segment`` positions, and every separator of a run but the first.

    >>> separator_boundaries([5, 9, 1, 1, 9, 2, 3, 9, 4], {9}, min_segment=2)
    [4, 7]
    """
    seps = frozenset(int(t) for t in separators)
    out, last = [], 0
    prev_sep = False
    for i, t in enumerate(token_ids):
        is_sep = int(t) in seps
        if is_sep and not prev_sep and i - last >= min_segment:
            out.append(i)
            last = i
        prev_sep = is_sep
    return out


def _ids_bytes(ids) -> bytes:
    return np.asarray(ids, dtype="<u4").tobytes()


def chunk_tokens_digest(ids) -> str:
    """sha256 (hex) of token ids as little-endian uint32: what a stored chunk's metadata records
    (``TOKENS_META``). Not :func:`alignpred.bank.tokens_digest`, the ``sha256:`` of their JSON list
    that ties a capture-stats record to its cache."""
    return hashlib.sha256(_ids_bytes([int(t) for t in ids])).hexdigest()


def binding_digest(binding: dict) -> bytes:
    """The sha256 of ``binding`` (canonical JSON) that every key of a store is bound to."""
    return hashlib.sha256(json.dumps(binding, sort_keys=True, separators=(",", ":")).encode()).digest()


def chunk_keys(token_ids, bind: bytes, chunk_tokens: int = CHUNK_TOKENS, boundaries=()) -> list[Chunk]:
    """The prompt's chunks (:func:`split_chunks`) with their prefix and content keys under ``bind``
    (a :func:`binding_digest`)."""
    ids = [int(t) for t in token_ids]
    out = []
    prev = bind
    for i, (a, b) in enumerate(split_chunks(len(ids), chunk_tokens, boundaries)):
        body = _ids_bytes(ids[a:b])
        prev = hashlib.sha256(b"p" + prev + len(body).to_bytes(8, "little") + body).digest()
        content = hashlib.sha256(b"c" + bind + body).hexdigest()
        out.append(Chunk(i, a, b, "kvz:p:" + prev.hex(), "kvz:c:" + content))
    return out
