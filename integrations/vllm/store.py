"""The block store behind the vLLM connector: runs of full KV blocks as ``.kvz`` objects in a
:class:`~kvz.integrations.kvstore.ChunkBackend`, found by a chained prefix hash per block.

Keys (every one binds the *binding*: model id, the weights fingerprint
(:mod:`~kvz.integrations.fingerprint`), block size, KV dtype, ``.kvz`` format major, bank id, the
error budget, lossless — a changed model, checkpoint, bank or budget never matches stale KV):

* ``kvzv:b:<h_i>`` — one small *pointer* per block ``i``: ``h_i = sha256("p" + h_{i-1} + ids of
  block i)`` with ``h_{-1} = sha256(binding)``, so a hit means the same tokens at the same
  positions from position 0. Its blob is the key of the run holding the block, its meta the
  block's index in that run.
* ``kvzv:r:<h_last>`` — one ``.kvz`` per *run*: the consecutive full blocks one prefill computed,
  encoded for all layers at once (the codec's maps read earlier layers), ``position_offset`` = the
  first block's position, with the digest of each block's token ids in its metadata.

A pointer is written after its run, so it never names a run that was not stored (eviction aside:
then the lookup stops there, a miss). Anything that fails — a backend that is down, an entry that
fails its checksum, a ``.kvz`` that does not parse, a block whose token ids differ — is a miss and a
:class:`KvzVllmWarning`; the engine recomputes.
"""
from __future__ import annotations

import hashlib
import json
import threading
import warnings
from dataclasses import dataclass

import numpy as np

KEY_SCHEME = "kvz-vllm/1"
DEFAULT_EPS = 0.02
BLOCKS_META = "kvz.vllm.block_sha256"  # per-block token-id digests (hex, first 32 chars) of a run


class KvzVllmWarning(UserWarning):
    """Stored KV could not be used (store down, corrupt or foreign entry): a miss, recomputed."""


def warn(msg: str) -> None:
    warnings.warn(KvzVllmWarning(msg), stacklevel=3)
    import logging

    logging.getLogger("kvz.vllm").warning(msg)


def block_digest(ids) -> str:
    return hashlib.sha256(np.asarray(ids, dtype="<u4").tobytes()).hexdigest()[:32]


DEFAULT_STORE = "~/.cache/kvz/vllm"  # the connector's store where kv_connector_extra_config has no "store"


@dataclass
class Segment:
    """Blocks ``[first, first + count)`` of a prompt, found in run ``run_key`` from its block
    ``run_index``; ``footer``: the run's last bytes when it was checked (a run replaced since is
    refused by the worker before it decodes anything)."""

    run_key: str
    footer: bytes
    run_index: int
    first: int
    count: int


class BlockStore:
    """Encode / look up / decode runs of KV blocks (see the module docstring).

    ``layer_types``: one per layer; ``rope_theta``: per-layer RoPE bases (keys are stored roped);
    ``shape``: ``(layers, kv_heads, head_dim)``; ``dtype``: the engine's KV dtype name; ``weights``:
    the checkpoint's fingerprint (bound into every key when given).
    The error budget (:attr:`budget`, :class:`~kvz.integrations.scope.StoreBudget`): ``eps`` given
    (or ``lossless``) keeps the tensor scope at that eps, as before; otherwise ``target_kl`` (a mean
    next-token KL or ``"fp8"``, the default) in the attention scope from the bank's statistics
    (docs/engine-scope.md); ``any_prefix=False`` codes the positions a sliding-window layer never
    attends again after a run's end coarse (for prompts only ever continued after their end)."""

    def __init__(self, backend, *, model_id: str, block_size: int, layer_types, rope_theta, shape, dtype: str,
                 eps: float | None = None, lossless: bool = False, bank=None, threads: int | None = None,
                 profile: str = "default", target_kl=None, any_prefix: bool = True, weights: str | None = None):
        from alignpred import CodecConfig, DecoderSession
        from kvz.integrations.scope import StoreBudget

        self.backend = backend
        self.model_id = str(model_id)
        self.block_size = int(block_size)
        self.layer_types = [str(t) for t in layer_types]
        self.rope_theta = [float(t) for t in rope_theta]
        self.shape = tuple(int(x) for x in shape)
        self.dtype = str(dtype)
        self.lossless = bool(lossless)
        self.config = CodecConfig()
        self.bank = None
        if bank is not None:
            from alignpred import resolve_bank

            self.bank = resolve_bank(bank)
        # the budget (kvz.integrations.scope): eps given, or lossless (the coarse tier), keeps the tensor
        # scope; otherwise target_kl (default FP8's KL) in the attention scope from the bank's statistics
        if lossless and eps is None and target_kl is None:
            eps = DEFAULT_EPS
        self.budget = StoreBudget.choose(self.bank, eps=eps, target_kl=target_kl, fallback_eps=DEFAULT_EPS,
                                         any_prefix=any_prefix)
        self.eps = self.budget.eps
        self.scope = self.budget.scope
        import logging

        logging.getLogger("kvz.vllm").info("kvz store: %s", self.budget.describe())
        self.threads = threads
        self.profile = str(profile)
        self.session = DecoderSession(banks=[self.bank] if self.bank is not None else ())
        from alignpred.format import MAJOR
        self.binding = {"scheme": KEY_SCHEME, "model": self.model_id, "block_size": self.block_size,
                        "dtype": self.dtype, "shape": list(self.shape), "format_major": MAJOR,
                        # not the codec config or profile: a .kvz says how it was coded, and an engine
                        # saving in another profile (``auto`` picks per machine) must find the same runs
                        "bank": self.bank.id if self.bank is not None else None,
                        "eps": self.eps, "lossless": self.lossless}
        if weights:  # the checkpoint, not only its name (None: nothing local to fingerprint)
            self.binding["weights"] = str(weights)
        from alignpred.codec import scope_of

        if not scope_of(self.scope).default:  # an eps-only store (tensor scope) keeps the keys it always had
            self.binding.update(self.budget.binding())
        self._bind = hashlib.sha256(json.dumps(self.binding, sort_keys=True, separators=(",", ":")).encode()).digest()
        self._lock = threading.Lock()
        self.runs: list[dict] = []  # what this object stored: key, first block, blocks, bytes, first block's digest
        self.counters: dict[str, float] = dict.fromkeys(
            ("lookups", "hit_blocks", "misses", "runs_stored", "blocks_stored", "stored_bytes", "raw_bytes",
             "bad_entries", "encode_s", "decode_s"), 0)

    # -- keys --------------------------------------------------------------------------------------
    def block_hashes(self, token_ids, n_blocks: int) -> list[str]:
        ids = np.asarray(token_ids[:n_blocks * self.block_size], dtype="<u4")
        out, prev = [], self._bind
        bs = self.block_size
        for i in range(n_blocks):
            body = ids[i * bs:(i + 1) * bs].tobytes()
            prev = hashlib.sha256(b"p" + prev + body).digest()
            out.append(prev.hex())
        return out

    @staticmethod
    def ptr_key(h: str) -> str:
        return "kvzv:b:" + h

    @staticmethod
    def run_key(h: str) -> str:
        return "kvzv:r:" + h

    def _count(self, name, n=1):
        with self._lock:
            self.counters[name] += n

    # -- lookup (scheduler side) ------------------------------------------------------------------
    def lookup(self, token_ids, max_blocks: int, start_block: int = 0) -> tuple[int, list[Segment]]:
        """The longest run of stored blocks from block 0 (at most ``max_blocks``); returns
        ``(n_blocks, segments covering blocks start_block..n_blocks)`` with the run blobs fetched and
        checked (checksum, header, token ids). Never raises: a failure ends the hit there."""
        self._count("lookups")
        if max_blocks <= 0:
            return 0, []
        try:
            hashes = self.block_hashes(token_ids, max_blocks)
            segs: list[Segment] = []
            runs: dict[str, tuple] = {}
            n = 0
            bs = self.block_size
            for i, h in enumerate(hashes):
                e = self.backend.get_entry(self.ptr_key(h))
                if e is None:
                    break
                rk = e.blob.decode("ascii", "replace")
                idx = int((e.meta or {}).get("index", -1))
                if rk not in runs:
                    runs[rk] = self._fetch_run(rk)
                got = runs[rk]
                if got is None:
                    warn(f"kvz: stored block {i} points to run {rk[:24]}… which is missing or corrupt; "
                         "treated as a miss, recomputed")
                    self._count("bad_entries")
                    break
                footer, digests = got
                if not (0 <= idx < len(digests)) or digests[idx] != block_digest(token_ids[i * bs:(i + 1) * bs]):
                    warn(f"kvz: stored block {i} ({rk[:24]}…) holds other tokens; treated as a miss")
                    self._count("bad_entries")
                    break
                n = i + 1
                if i < start_block:
                    continue
                last = segs[-1] if segs else None
                if last is not None and last.run_key == rk and last.run_index + last.count == idx:
                    last.count += 1
                else:
                    segs.append(Segment(rk, footer, idx, i, 1))
            self._count("hit_blocks", n)
            if n < max_blocks:
                self._count("misses")
            return n, segs
        except Exception as e:  # noqa: BLE001 - a store fault is a miss, never a failed request
            warn(f"kvz: store lookup failed ({type(e).__name__}: {e}); treated as a miss")
            return 0, []

    def _fetch_run(self, rk: str):
        """``(footer, block digests)`` of a stored run, from its tail only (header, index, footer:
        verified as for a whole file); None when it is missing or unusable (then dropped)."""
        src = self.backend.open_blob(rk)
        if src is None:
            return None
        try:
            from alignpred import KvzReader
            from alignpred.format import FOOTER_SIZE

            r = KvzReader(src, bank=self.bank, session=self.session)
            meta = r.header.get("source_metadata", {}) or {}
            digests = meta.get(BLOCKS_META)
            if isinstance(digests, str):
                digests = json.loads(digests)
            lay = r.layout
            if (lay.num_layers, lay.kv_heads, lay.head_dim) != self.shape or not isinstance(digests, list):
                raise ValueError("not a run of this model")
            if lay.n_tokens != len(digests) * self.block_size:
                raise ValueError("run length does not match its blocks")
            return bytes(src.read_range(src.size - FOOTER_SIZE, FOOTER_SIZE)), [str(d) for d in digests]
        except Exception as exc:  # noqa: BLE001
            warn(f"kvz: stored run {rk[:24]}… unusable ({type(exc).__name__}: {exc}); dropped, recomputing")
            self._count("bad_entries")
            try:
                self.backend.delete(rk)
            except Exception:  # noqa: BLE001
                pass
            return None
        finally:
            src.close()

    def stored_prefix(self, token_ids, n_blocks: int) -> int:
        """How many leading blocks already have a pointer (unverified)."""
        try:
            for i, h in enumerate(self.block_hashes(token_ids, n_blocks)):
                if not self.backend.contains(self.ptr_key(h)):
                    return i
            return n_blocks
        except Exception:  # noqa: BLE001
            return 0

    # -- decode (worker side) ---------------------------------------------------------------------
    def open_segment(self, seg: Segment, deadline: float | None = None, threads: int | None = None,
                     starts: dict | None = None):
        """``(reader, tokens, source)`` to decode ``seg`` layer by layer: the run opened for ranged
        reads, its layers' bytes fetched ahead (:class:`~kvz.integrations.vllm.loader.LayerPrefetch`,
        waiting at most until ``deadline``); ``source.close()`` when done. Raises if the run is gone
        or is no longer the run the lookup checked. ``starts`` (``{layer: position in the segment}``,
        :func:`~kvz.integrations.vllm.window.segment_starts`): fetch those layers from there only."""
        from alignpred import KvzReader
        from alignpred.format import FOOTER_SIZE

        from .loader import LayerPrefetch
        from .window import skips_work

        src = self.backend.open_blob(seg.run_key)
        if src is None:
            raise LookupError(f"stored run {seg.run_key[:24]}… is gone (evicted or the store is down)")
        try:
            if bytes(src.read_range(src.size - FOOTER_SIZE, FOOTER_SIZE)) != seg.footer:
                raise LookupError(f"stored run {seg.run_key[:24]}… was replaced since its lookup")
            r = KvzReader(src, bank=self.bank, session=self.session,
                          threads=threads if threads is not None else self.threads)
            a = seg.run_index * self.block_size
            tokens = (a, a + seg.count * self.block_size)
            n = seg.count * self.block_size
            st = {int(i): int(x) for i, x in (starts or {}).items()} if skips_work(r) else {}
            spans = [sp for i in range(self.shape[0]) if st.get(i, 0) < n
                     for sp in r.payload_spans(i, (a + st.get(i, 0), tokens[1]))]
        except BaseException:
            src.close()
            raise
        pre = LayerPrefetch(src, spans, deadline)
        return KvzReader(pre, bank=self.bank, session=self.session, threads=r.threads), tokens, pre

    def warmup(self) -> float:
        """Encode and decode one synthetic block in this store's mode, so the codec's kernels are
        compiled before the first request (numba compiles on first use). Returns the seconds taken."""
        import time

        import torch

        from alignpred import Cache, KvzReader, compress_bytes

        t0 = time.perf_counter()
        L, H, d = self.shape
        g = torch.Generator().manual_seed(0)
        dt = getattr(torch, self.dtype, torch.bfloat16)
        kv = [tuple(torch.randn(H, self.block_size, d, generator=g).to(dt) for _ in range(2)) for _ in range(L)]
        meta = {"layer_types": self.layer_types, "keys_roped": True, "rope_theta": self.rope_theta}
        for name in dict.fromkeys((self.profile, "default", "fast")):
            blob = compress_bytes(Cache.from_arrays(kv, meta), budget=self.budget.budget(lossless=self.lossless),
                                  bank=self.bank, profile=name, config=self.config, threads=self.threads)
            KvzReader(memoryview(blob), bank=self.bank, session=self.session, threads=self.threads).read()
        return time.perf_counter() - t0

    # -- store (worker side) ----------------------------------------------------------------------
    def put_run(self, token_ids, first_block: int, kv, hashes: list[str]) -> int:
        """Encode ``kv`` (``[(K, V)]`` per layer, ``[kv_heads, n*bs, head_dim]``) of blocks
        ``first_block..`` of ``token_ids`` (their chained ``hashes``) as one ``.kvz`` and store it
        with one pointer per block. Returns the bytes stored (0 on failure, after a warning)."""
        import time

        from alignpred import Cache, compress_bytes

        t0 = time.perf_counter()
        bs = self.block_size
        n = len(hashes)
        try:
            digests = [block_digest(token_ids[(first_block + j) * bs:(first_block + j + 1) * bs]) for j in range(n)]
            meta = {"model": self.model_id, "layer_types": self.layer_types, "keys_roped": True,
                    "rope_theta": self.rope_theta, "rope_pairing": "half",
                    "position_offset": int(first_block * bs), BLOCKS_META: json.dumps(digests)}
            cache = Cache.from_arrays(kv, meta)
            blob = compress_bytes(cache, budget=self.budget.budget(lossless=self.lossless), bank=self.bank,
                                  profile=self.profile, config=self.config, threads=self.threads)
            rk = self.run_key(hashes[-1])
            if not self.backend.put(rk, blob, meta={"start": int(first_block * bs), "blocks": n},
                                    importance=float(n * bs)):
                return 0
            for j, h in enumerate(hashes):
                self.backend.put(self.ptr_key(h), rk.encode("ascii"), meta={"index": j}, importance=float(bs))
            raw = sum(int(k.numel() if hasattr(k, "numel") else np.size(k)) * 2 * _itemsize(k) for k, _ in kv)
            with self._lock:
                self.counters["runs_stored"] += 1
                self.counters["blocks_stored"] += n
                self.counters["stored_bytes"] += len(blob)
                self.counters["raw_bytes"] += raw
                self.counters["encode_s"] += time.perf_counter() - t0
                self.runs.append({"key": rk, "first_block": int(first_block), "blocks": n, "bytes": len(blob),
                                  "first_digest": digests[0]})
            return len(blob)
        except Exception as e:  # noqa: BLE001 - a failed store is a future miss, never a failed request
            warn(f"kvz: storing {n} blocks failed ({type(e).__name__}: {e})")
            return 0


def _itemsize(a) -> int:
    if hasattr(a, "element_size"):
        return int(a.element_size())
    return int(np.asarray(a).itemsize)
