"""The reuse engine: prefill (and generate) a transformers model with a :class:`ChunkStore`.

::

    from kvz.integrations.chunkstore import ChunkStore, ReuseEngine
    engine = ReuseEngine(model, store)  # the measured defaults: repair "seam+guided", R = 32, threshold 0.1
    # boundaries ON the separator before each document (and before the question), see below
    tokens, res = engine.generate(ids, max_new_tokens=32, boundaries=[len(system), len(system) + len(doc)])

**Prefill.** The prompt's chunks are looked up (:meth:`ChunkStore.lookup`). Hits are decoded with
one :class:`alignpred.DecoderSession` straight into preallocated per-layer buffers; content hits
have their keys re-rotated from their old absolute positions to the new ones with the model's own
RoPE (:func:`kvz.integrations.hf.rope_spec_from_model`: per-layer frequencies and scaling,
``RopeTable.apply`` inverse then forward).

**Repair** of content hits (their KV still reflects the *old* preceding context;
:mod:`~kvz.integrations.chunkstore.repair`): ``seam`` recomputes the first ``R`` tokens after each
seam (a content hit that does not continue the stored text before it: seams are derived from the
chunk layout); ``guided`` (deviation-guided) runs a probe pass through the first ``probe_layer + 1``
layers over the non-exact positions (which makes those layers exact), measures each content-hit
token's relative K/V deviation at layer ``probe_layer`` and recomputes every token above
``threshold`` (at most ``max_frac`` of them); ``blend`` recomputes a fixed top ``blend_ratio``
fraction by the same deviation (CacheBlend-style); ``seam+guided`` / ``seam+blend`` do both.
The defaults (:data:`DEFAULT_REPAIR` ...) come from ``benchmarks/reuse_repair.py``
(``benchmarks/results/reuse-repair.md``, 24 prompts, 16 with content hits, chunk 256): the cheapest
setting measured at mean KL ~2e-3 (TTFT 0.36x recompute, KL 2.1e-3, 14/24 identical continuations vs
prefix reuse's 22/24). No setting measured meets TTFT <= 0.30x and KL <= 2e-3 together: ``seam`` alone
is 0.15x at KL 5.9e-3; ``threshold=0.05, max_frac=0.5`` is 0.46x at KL 1.1e-3, 17/24 identical.
Judged by answers (``python -m kvz.benchmarks.rag_accuracy``, ``benchmarks/results/rag_accuracy.md``:
193 planted-fact and cloze questions over several documents per prompt, Gemma 3 270M, full recompute
EM 40.4%), the defaults stay: exact match −1.0 points [−3.1, +1.0] against full recompute at TTFT
0.347x, the same as a CacheBlend-style recompute of as many tokens (−1.0, 0.352x); the cheaper
settings (no repair +1.6 at 0.181x, CacheBlend-style 15% +0.5 at 0.292x) are inside the same interval
but agree less often with full recompute's answer (81.9% and 86.0% against 88.6%), chunk 128 is the
only kvz setting whose interval excludes 0 (−2.6), and no measured setting is better on both axes.
Recomputed tokens attend to the full assembled context: one forward over the scattered positions
with an explicit mask per layer type (causal, sliding window), whose cache writes their fresh K/V
into the buffers in place (:func:`kvz.integrations.hf.ScatterCache`). When the positions to compute
are a suffix (pure prefix reuse, or a miss) the ordinary cache path is used
(:func:`kvz.integrations.hf.BufferedCache`), so prefix reuse from a lossless store is the model's
own chunked prefill.

**Boundaries: where to put them.** A chunk's content key is its token ids, so a document is reused
wherever it lands only if it is cut the same way every time: put a boundary at the start of every
piece that can recur or move (each retrieved document, tool output, the question), *on the
separator that leads it* (``"\n\n"``, ``"Document:"``) rather than on its first token, and lead every
piece with the same separator. The chunk then starts with the same separator tokens wherever it
lands: the tokens right after a seam, the most perturbed, are separator tokens that the seam repair
recomputes, and the document's own tokens keep their stored neighbours. Measured
(``benchmarks/reuse_repair.py --first-settings``, the default repair, 24 prompts): on the separator,
mean KL 2.1e-3 and 14/24 identical; on the document's first token, KL 2.4e-3 and 16/24 identical, the
same tokens recomputed: lower KL on the separator, the identical counts within two prompts, so the
rule stays the separator (which is what ``separators`` derives). With no boundaries, an
engine given ``separators`` (token ids, e.g. the tokenizer's ``"\n\n"``) derives them on each
separator (:func:`~kvz.integrations.chunkstore.keys.separator_boundaries`, pieces of at least
``min_segment`` tokens); without either, chunks are fixed ``chunk_tokens`` pieces from position 0
and only an exact prefix (or text at the same offset) is reused.

**Storing**: after a prefill, every chunk whose positions were computed (not served from the store)
is encoded once, for all layers at once (the codec's inter-layer maps read earlier layers).

**Refresh**: content hits make a prompt's KV approximate; after the first token the engine (by default)
recomputes the approximate part exactly and stores those chunks under their prefix keys, so the store
only ever holds in-context KV and the next request with the same prefix gets exact hits.

**Threads**: kvz's decoder uses numpy BLAS products; on a shared CPU, BLAS threads that spin make it
~10x slower (measured: 2.8 s vs 0.17 s per 256-token chunk of Gemma 3 270M). Limit them
(``OPENBLAS_NUM_THREADS=1``) as the benchmark does.

**Failures** never fail a request: an entry whose checksum or ``.kvz`` decode fails is deleted and
its positions recomputed (:class:`ChunkStoreWarning`).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvz.integrations.chunkstore.keys import TOKENS_META, chunk_tokens_digest, separator_boundaries
from kvz.integrations.chunkstore.repair import REPAIRS, blend_select, guided_select, probe_deviation, seam_mask
from kvz.integrations.chunkstore.store import ChunkStore, ChunkStoreWarning

__all__ = ["ReuseEngine", "PrefillResult", "DEFAULT_REPAIR", "DEFAULT_R", "DEFAULT_THRESHOLD", "DEFAULT_MAX_FRAC",
           "DEFAULT_PROBE_LAYER"]

# from benchmarks/reuse_repair.py (benchmarks/results/reuse-repair.md): the cheapest setting measured at KL ~2e-3
DEFAULT_REPAIR = "seam+guided"
DEFAULT_R = 32
DEFAULT_THRESHOLD = 0.1
DEFAULT_MAX_FRAC = 0.3
DEFAULT_PROBE_LAYER = 1


@dataclass
class PrefillResult:
    """What :meth:`ReuseEngine.prefill` assembled: the prompt's KV, where it came from, and timings (``stats``)."""
    token_ids: list
    logits: Any  # torch [vocab] of the last position
    cache: object  # transformers DynamicCache holding every position
    kv: list  # [(K, V)] per layer, torch [1, kv_heads, T, d]: the assembled KV
    chunks: list
    hits: list
    computed: np.ndarray  # bool [T]: positions whose KV this prefill computed
    exact: np.ndarray  # bool [T]: positions whose KV is exact (prefix hit, or computed on an exact prefix)
    stats: dict = field(default_factory=dict)
    stored: bool = False


class ReuseEngine:
    """Prefill (and generate) with a :class:`ChunkStore`: reuse stored chunks, repair, store the rest.

    ``reuse``: ``"none"`` (full recompute), ``"prefix"`` (exact prefix hits only) or ``"content"``
    (prefix, then content hits with repair). ``repair``: one of :data:`REPAIRS` (default
    :data:`DEFAULT_REPAIR`, see the module docstring); ``R`` tokens after each seam; ``threshold``: recompute
    content-hit tokens whose probe deviation at ``probe_layer`` exceeds it (``guided``, at most
    ``max_frac`` of them); ``blend_ratio``: the top fraction by that deviation (``blend``).
    ``separators``: token ids to derive boundaries on when the caller gives none (``min_segment``
    tokens apart at least). ``store_new``: encode and store computed chunks after the prefill (after the
    first token); ``refresh_after``: before storing, recompute the approximate (content-served) part
    exactly, so what is stored is always in-context KV and a repeated prefix hits exactly."""

    def __init__(self, model, store: ChunkStore | None, *, reuse: str = "content", repair: str = DEFAULT_REPAIR,
                 R: int = DEFAULT_R, blend_ratio: float = 0.1, threshold: float = DEFAULT_THRESHOLD,
                 max_frac: float = DEFAULT_MAX_FRAC, probe_layer: int = DEFAULT_PROBE_LAYER,
                 separators=(), min_segment: int = 32, store_new: bool = True, refresh_after: bool = True):
        from kvz.integrations.hf import cache_kwarg, decoder_of, kv_shape, text_config

        if reuse not in ("none", "prefix", "content"):
            raise ValueError("reuse must be none, prefix or content")
        if repair not in REPAIRS:
            raise ValueError(f"repair must be one of {REPAIRS}")
        self.model = model
        self.store = store
        self.reuse, self.repair, self.R = reuse, repair, int(R)
        self.blend_ratio, self.probe_layer = float(blend_ratio), int(probe_layer)
        self.threshold, self.max_frac = float(threshold), float(max_frac)
        self.separators, self.min_segment = frozenset(int(t) for t in separators), int(min_segment)
        self.store_new = store_new
        self.refresh_after = refresh_after
        self.cfg = text_config(model)
        self.n_layers, self.kv_heads, self.head_dim = kv_shape(model)
        self.layer_types = list(getattr(self.cfg, "layer_types", None) or ["full_attention"] * self.n_layers)
        self.window = getattr(self.cfg, "sliding_window", None)
        self.kw = cache_kwarg(model)
        self.dtype = next(model.parameters()).dtype
        self.decoder = decoder_of(model)
        self._spec: Any = store.rope if store is not None else None

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
        from kvz.integrations.hf import ScatterCache

        cache = ScatterCache(K, V, pos)
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
                R: int | None = None, blend_ratio: float | None = None, threshold: float | None = None,
                max_frac: float | None = None) -> PrefillResult:
        """Assemble the prompt's KV (hits decoded into buffers, content hits re-rotated and repaired,
        the rest computed) and return the last position's logits and a cache to continue from."""
        import torch

        from kvz.integrations.hf import BufferedCache, new_cache

        reuse = self.reuse if reuse is None else reuse
        repair = self.repair if repair is None else repair
        R = self.R if R is None else int(R)
        ratio = self.blend_ratio if blend_ratio is None else float(blend_ratio)
        tau = self.threshold if threshold is None else float(threshold)
        max_frac = self.max_frac if max_frac is None else float(max_frac)
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
            if not len(boundaries) and self.separators:
                boundaries = separator_boundaries(ids, self.separators, self.min_segment)
            chunks = self.store.chunks(ids, boundaries)
            hits = self.store.lookup(ids, chunks, content=reuse == "content", usable_end=T - 1)
            st["lookup_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            for h in hits:
                a, b = h.chunk.start, h.chunk.end
                try:
                    meta = self.store.decode_into(h, lambda i, a=a, b=b: (K[i][0, :, a:b], V[i][0, :, a:b]))
                    if meta.get(TOKENS_META) != chunk_tokens_digest(ids[a:b]):
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
                compute |= seam_mask(hits, T, R) & content_pos
            if "blend" in repair or "guided" in repair:
                t2 = time.perf_counter()
                cand, dev = probe_deviation(self, ids, K, V, exact, content_pos & ~compute)
                self.last_deviation = (cand, dev)
                if "blend" in repair:
                    sel = blend_select(cand, dev, ratio) if ratio > 0 else cand[:0]
                else:
                    sel = guided_select(cand, dev, tau, max_frac)
                compute[sel] = True
                st["probe_s"] = time.perf_counter() - t2
        t3 = time.perf_counter()
        positions = np.nonzero(compute)[0]
        c0 = int(positions[0])
        with torch.inference_mode():
            if len(positions) == T - c0:  # a suffix: the ordinary cache path
                cache = BufferedCache(K, V, c0, config=self.cfg)
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

    # -- storing -----------------------------------------------------------------------------------
    def refresh(self, res: PrefillResult) -> int:
        """Recompute exactly every position from the first approximate one (content-served) to the end,
        on the exact prefix, so the chunks of this prompt can be stored exact (under their prefix keys)
        and the next request with the same prefix gets exact hits. Runs after the first token (it costs
        a prefill of those positions, not time to first token). Returns the positions recomputed."""
        import torch

        from kvz.integrations.hf import BufferedCache

        T = len(res.token_ids)
        bad = np.nonzero(~res.exact)[0]
        if not len(bad):
            return 0
        s0 = int(bad[0])
        K = [k.clone() for k, _ in res.kv]
        V = [v.clone() for _, v in res.kv]
        with torch.inference_mode():
            cache = BufferedCache(K, V, s0, config=self.cfg)
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
                try:
                    got = self.store.put(c, kv, res.token_ids[a:b], exact=ex)
                except Exception as e:  # noqa: BLE001 - a chunk that cannot be encoded is not stored, never a failure
                    warnings.warn(ChunkStoreWarning(f"chunk {c.index} not stored ({type(e).__name__}: {e})"),
                                  stacklevel=2)
                    continue
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
