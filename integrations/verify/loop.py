"""Lossless decoding from a compressed KV cache: the compressed cache drafts, the full KV (paged in
from ``.kvz`` files or a raw cache by :class:`~kvz.integrations.pager.KvPager`) verifies
(VeriCache, ``../shared/seeds/000_*``). A reference implementation on a Hugging Face causal LM.

One round, for a request whose context (``n0`` positions) is stored and whose ``m`` tokens after
it have exact K/V (the *tail*, kept in float32 as the verifier computed it):

1. **Draft.** The same model runs ``x`` single-token steps on the *draft cache* - the compressed
   context (a lossy .kvz decoded once, or a token-dropped subset) plus the exact tail - from the
   last emitted token ``cur``, proposing ``d_1..d_x`` (argmax, or sampled at temperature T).
2. **Verify.** The full context K/V is paged in, the tail appended, and the model runs over
   ``[cur, d_1..d_x]`` - one forward pass (``verify="batched"``, the paper's algorithm) or one
   token at a time, stopping at the first rejection (``verify="stepwise"``).
3. **Accept** the longest prefix of drafts the verifier agrees with, plus its own token at the
   first disagreement (or the bonus token after ``d_x`` when all agree). With temperature > 0,
   ``d_i`` is accepted with probability ``min(1, p_full(d_i) / p_draft(d_i))`` and a rejection
   is resampled from ``norm(max(p_full - p_draft, 0))`` (:func:`speculative_accept`), so every
   emitted token is distributed exactly as in full-KV sampling.
4. The verifier's K/V of the tokens it consumed and accepted (``cur, d_1..d_k``) is appended to
   the tail, which both caches read next round; the drafter's own K/V of its drafts is dropped.

Correctness (greedy). By induction over rounds: the tail holds exactly the K/V full-KV decoding
computes for the emitted tokens, and the verifier's cache is the stored context plus the tail -
the full-KV cache. The verifier emits its own argmax at every position it checks, so the output is
the full-KV greedy output *of the verifier's computation*. With ``verify="stepwise"`` that
computation is literally full-KV greedy decoding (:func:`greedy_reference`: same single-token
forward calls on the same cache contents), so outputs are bit-identical by construction, whatever
the drafter does. With ``verify="batched"`` the ``x + 1`` positions go through one forward pass,
whose float32 results differ from single-token steps in the last bits (different matmul shapes);
an argmax flip then needs a top-2 logit gap below that noise. :class:`GenerationResult` records the
smallest top-2 gap and the benchmark compares both modes against :func:`greedy_reference`.

The drafter can be anything: a poor drafter costs acceptance, never correctness.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from kvz.integrations.hf.bridge import cache_kwarg as _cache_kw
from kvz.integrations.hf.bridge import new_cache, text_config
from kvz.integrations.pager import KvPager, kv_bytes

__all__ = ["DraftCache", "PagedFullKV", "VeriCacheDecoder", "GenerationResult", "RoundLog", "greedy_reference",
           "speculative_accept", "greedy_accept", "residual", "window_keep", "snapkv_keep", "text_config",
           "new_cache", "build_cache", "forward_logits"]


# ================================================================================== model plumbing

def build_cache(model, *parts):
    """A fresh cache holding, per layer, the concatenation along positions of ``parts`` (each a list
    of ``(key, value)`` torch tensors ``[1, H, t, D]`` or ``[H, t, D]``, one per layer; ``None``
    entries contribute nothing). Each layer is filled through its own ``update()`` (by
    :func:`kvz.integrations.hf.bridge.cache_from_kv`) so sliding-window layers keep what they would
    after a real prefill."""
    import torch

    n_layers = text_config(model).num_hidden_layers
    layers = []
    for i in range(n_layers):
        ks, vs = [], []
        for part in parts:
            if part and part[i] is not None:
                k, v = part[i]
                ks.append(k if k.dim() == 4 else k[None])
                vs.append(v if v.dim() == 4 else v[None])
        layers.append((ks[0] if len(ks) == 1 else torch.cat(ks, dim=-2),
                       vs[0] if len(vs) == 1 else torch.cat(vs, dim=-2)))
    try:
        from kvz.integrations.hf.bridge import cache_from_kv
    except ImportError:  # the bridge is optional here: fill the cache the same way
        cache_from_kv = None
    if cache_from_kv is not None:
        return cache_from_kv(model, layers)
    cache = new_cache(model)
    dtype = next(model.parameters()).dtype
    for i, (k, v) in enumerate(layers):
        cache.update(k.to(dtype), v.to(dtype), i)
    return cache


def forward_logits(model, cache, ids, start: int):
    """float32 logits ``[len(ids), vocab]`` of ``ids`` at positions ``start..`` appended to ``cache``."""
    import torch

    dev = next(model.parameters()).device
    inp = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    pos = torch.arange(start, start + len(ids), device=dev)[None]
    out = model(input_ids=inp, position_ids=pos, use_cache=True, **{_cache_kw(model): cache})
    return out.logits[0].float()


def _last_kv(cache, n: int, keep: int | None = None):
    """Clones of the first ``keep`` (default all) of the last ``n`` positions of every layer of
    ``cache``: ``[(k, v) [1, H, keep, D]]``."""
    keep = n if keep is None else keep
    out = []
    for layer in cache.layers:
        t = layer.keys.shape[-2]
        if t < n:
            raise RuntimeError(f"a cache layer holds {t} positions, fewer than the {n} just appended")
        out.append((layer.keys[..., t - n:t - n + keep, :].clone(), layer.values[..., t - n:t - n + keep, :].clone()))
    return out


def _top2_gap(logits) -> float:
    top = logits.topk(2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


# ================================================================================== references

def greedy_reference(model, context_kv, first_token: int, n_new: int, *, start: int | None = None,
                     return_kv: bool = False):
    """Plain full-KV greedy decoding: the context K/V (``[(k, v)]`` per layer, ``[H, n0, D]``),
    then ``first_token`` and ``n_new - 1`` more, one single-token forward at a time. Returns
    ``(tokens, info)`` with ``info = {"seconds", "min_top2_gap"}`` (and ``"kv"``: per layer the
    cache's K/V of the ``n_new`` fed tokens - fewer on a sliding layer past its window - with
    ``return_kv``)."""
    import torch

    n0 = int(context_kv[0][0].shape[-2]) if start is None else int(start)
    toks, cur, gap = [], int(first_token), math.inf
    t0 = time.perf_counter()
    with torch.inference_mode():
        cache = build_cache(model, context_kv)
        for t in range(n_new):
            logits = forward_logits(model, cache, [cur], n0 + t)[-1]
            gap = min(gap, _top2_gap(logits))
            cur = int(logits.argmax())
            toks.append(cur)
        info = {"seconds": time.perf_counter() - t0, "min_top2_gap": gap}
        if return_kv:
            info["kv"] = [(layer.keys[..., -min(n_new, layer.keys.shape[-2]):, :].clone(),
                           layer.values[..., -min(n_new, layer.values.shape[-2]):, :].clone())
                          for layer in cache.layers]
    return toks, info


# ================================================================================== acceptance rules

def greedy_accept(logits, drafts) -> tuple[int, int]:
    """``(k, token)``: the drafts ``d_1..d_k`` the verifier's argmax agrees with (rows
    ``0..k-1`` of ``logits``, ``[len(drafts) + 1, V]``), and its own argmax at row ``k`` (the
    correction, or the bonus token when ``k == len(drafts)``)."""
    am = logits.argmax(-1).tolist() if hasattr(logits, "argmax") else list(np.argmax(logits, -1))
    for i, d in enumerate(drafts):
        if int(am[i]) != int(d):
            return i, int(am[i])
    return len(drafts), int(am[len(drafts)])


def residual(p_full, p_draft) -> np.ndarray:
    """The rejection distribution ``norm(max(p_full - p_draft, 0))`` (float64). If it is all
    zero (``p_draft == p_full``, when a rejection has probability 0) ``p_full`` is returned."""
    r = np.maximum(np.asarray(p_full, np.float64) - np.asarray(p_draft, np.float64), 0.0)
    s = r.sum()
    return r / s if s > 0 else np.asarray(p_full, np.float64) / np.sum(p_full)


def _sample(p, rng) -> int:
    p = np.asarray(p, np.float64)
    c = np.cumsum(p)
    u = rng.random() * c[-1]
    return int(min(np.searchsorted(c, u, side="right"), len(p) - 1))


def speculative_accept(p_full, p_draft, drafts, rng) -> tuple[int, int]:
    """Speculative-sampling acceptance (Leviathan et al. 2023; Chen et al. 2023).

    ``p_full``: ``[x + 1, V]`` verifier distributions (row ``i`` follows ``d_1..d_i``);
    ``p_draft``: ``[x, V]`` the drafter's distributions the drafts were sampled from;
    ``drafts``: ``d_1..d_x``; ``rng``: a numpy Generator. Returns ``(k, token)``: ``d_1..d_k``
    accepted, then ``token`` - resampled from the residual at the first rejection, or drawn from
    ``p_full[x]`` when all were accepted. The emitted sequence is distributed as sampling from
    ``p_full`` autoregressively."""
    for i, d in enumerate(drafts):
        d = int(d)
        pf, pd = float(p_full[i][d]), float(p_draft[i][d])
        if rng.random() < (1.0 if pd <= 0 else min(1.0, pf / pd)):
            continue
        return i, _sample(residual(p_full[i], p_draft[i]), rng)
    return len(drafts), _sample(p_full[len(drafts)], rng)


def _probs(logits, temperature: float) -> np.ndarray:
    z = logits.double() / temperature
    return (z - z.logsumexp(-1, keepdim=True)).exp().cpu().numpy()


# ================================================================================== caches

class DraftCache:
    """The drafter's context: per layer ``(k, v)`` torch float32 ``[1, H, n_kept, D]`` (every layer
    keeps the same number of positions; keys carry their RoPE, so which positions were kept does
    not matter to the model, and new tokens get their true positions). ``resident_bytes``: what
    the drafter keeps resident for the context (file bytes of a .kvz, or the kept positions at the
    stored precision); ``dense_bytes``: the decoded tensors at the stored precision."""

    def __init__(self, layers_kv, n_context: int, *, kind: str, resident_bytes: int, dense_bytes: int,
                 info: dict | None = None):
        self.layers_kv = layers_kv
        self.n_context = int(n_context)
        self.kind = kind
        self.resident_bytes = int(resident_bytes)
        self.dense_bytes = int(dense_bytes)
        self.info = dict(info or {})

    @property
    def n_kept(self) -> int:
        return int(self.layers_kv[0][0].shape[-2])

    @classmethod
    def from_kvz(cls, source, *, bank=None, tier: str | None = None) -> DraftCache:
        """Decode a .kvz (path / bytes; ``tier="coarse"`` for a two-tier file) to float32."""
        import torch

        from alignpred import KvzReader

        r = KvzReader(source, bank=bank)
        kw = {"tier": tier} if tier is not None else {}
        lay = r.layout
        out = []
        for _, k, v in r.layers(**kw):
            k = k[0] if k.ndim == 4 else k
            v = v[0] if v.ndim == 4 else v
            out.append((torch.from_numpy(np.asarray(k, np.float32))[None],
                        torch.from_numpy(np.asarray(v, np.float32))[None]))
        size = len(memoryview(source).cast("B")) if isinstance(source, (bytes, bytearray, memoryview)) \
            else os.path.getsize(source)
        tiers = tuple(getattr(r, "tiers", ("coarse",)))
        if len(tiers) > 1 and tier == "coarse":  # the drafter keeps the coarse tier only
            tb = r.summary().get("tier_payload_bytes", {})
            if tb:
                size -= sum(v for k, v in tb.items() if k != "coarse")
        return cls(out, lay.n_tokens, kind="kvz", resident_bytes=size, dense_bytes=kv_bytes(lay),
                   info={"eps": r.eps, "tier": tier, "tiers": list(tiers), "bpv": 8.0 * size / lay.n_values})

    @classmethod
    def token_dropped(cls, context_kv, keep, *, dtype_bytes: int = 2, kind: str = "drop") -> DraftCache:
        """Keep positions ``keep`` (a 1-D index array for every layer, or a list of per-layer
        arrays of one length) of the context K/V ``[(k, v)]`` (``[H, n0, D]`` torch)."""
        import torch

        n0 = int(context_kv[0][0].shape[-2])
        per_layer = keep if isinstance(keep, (list, tuple)) else [keep] * len(context_kv)
        lens = {len(k) for k in per_layer}
        if len(lens) != 1:
            raise ValueError("every layer must keep the same number of positions")
        out = []
        for (k, v), idx in zip(context_kv, per_layer):
            idx_t = torch.as_tensor(np.sort(np.asarray(idx)), dtype=torch.long)
            k = k if k.dim() == 4 else k[None]
            v = v if v.dim() == 4 else v[None]
            out.append((k.index_select(-2, idx_t).float().contiguous(), v.index_select(-2, idx_t).float().contiguous()))
        H, D = out[0][0].shape[1], out[0][0].shape[-1]
        n_kept = lens.pop()
        dense = 2 * len(out) * H * n0 * D * dtype_bytes
        return cls(out, n0, kind=kind, resident_bytes=2 * len(out) * H * n_kept * D * dtype_bytes,
                   dense_bytes=dense, info={"keep_frac": n_kept / n0})


def window_keep(n0: int, frac: float, sinks: int = 4) -> np.ndarray:
    """StreamingLLM-style: the first ``sinks`` positions and the most recent ones, ``round(frac * n0)`` in all."""
    k = max(sinks + 1, int(round(frac * n0)))
    if k >= n0:
        return np.arange(n0)
    return np.concatenate([np.arange(sinks), np.arange(n0 - (k - sinks), n0)])


def snapkv_keep(model, context_ids, context_kv, frac: float, *, window: int = 16, sinks: int = 4,
                pool: int = 7) -> list:
    """SnapKV-style per-layer selection: score context positions by the attention the last
    ``window`` context tokens pay them (summed over query heads and those queries, max-pooled
    over ``pool`` neighbours), keep the top ones plus the sinks and the observation window,
    ``round(frac * n0)`` per layer. Attention probabilities are recomputed from the model's own
    queries (a forward hook on each attention module with the eager kernel)."""
    import torch

    n0 = len(context_ids)
    k_keep = max(sinks + window + 1, int(round(frac * n0)))
    if k_keep >= n0:
        return [np.arange(n0)] * len(context_kv)
    head = context_kv
    prev = getattr(model.config, "_attn_implementation", None)
    try:
        model.set_attn_implementation("eager")
        cache = build_cache(model, [(k[..., :n0 - window, :], v[..., :n0 - window, :]) for k, v in head])
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(context_ids[n0 - window:])]),
                        position_ids=torch.arange(n0 - window, n0)[None], use_cache=True,
                        output_attentions=True, **{_cache_kw(model): cache})
        atts = out.attentions
    finally:
        if prev is not None:
            model.set_attn_implementation(prev)
    keep = []
    for a in atts:  # [1, heads, window, kv_len]
        a = a[0].float()
        kv_len = a.shape[-1]
        score = a.sum(dim=(0, 1))[: kv_len - window]  # the prefix positions (sliding layers: last part)
        full = torch.zeros(n0 - window)
        full[n0 - window - score.shape[0]:] = score
        if pool > 1:
            full = torch.nn.functional.max_pool1d(full[None, None], pool, stride=1, padding=pool // 2)[0, 0]
        full[:sinks] = math.inf
        extra = k_keep - window
        top = torch.topk(full, extra).indices.numpy()
        keep.append(np.sort(np.concatenate([top, np.arange(n0 - window, n0)])))
    return keep


class PagedFullKV:
    """The verifier's context K/V: paged in through ``pager`` (source registered under ``key``)
    into float32 staging buffers on every verify, as a serving runtime would page it into HBM."""

    def __init__(self, pager: KvPager, key, *, prefetch: bool = True, overlap: bool = False):
        import torch

        self.pager, self.key = pager, key
        self.overlap = bool(overlap)
        src = pager.source(key)
        lay = src.layout
        self.layout = lay
        self.n_context = lay.n_tokens
        shape = (1, lay.kv_heads, lay.n_tokens, lay.head_dim)
        self.staging = [(torch.empty(shape), torch.empty(shape)) for _ in range(lay.num_layers)]
        self.bytes_per_load = kv_bytes(lay)  # at the stored precision
        self.loads = 0
        self.seconds = 0.0
        self.prefetch = prefetch

    def page_in(self):
        t0 = time.perf_counter()
        for _ in self.pager.layers(self.key, (0, self.n_context), out=lambda i: self.staging[i]):
            pass
        self.loads += 1
        self.seconds += time.perf_counter() - t0
        return self.staging

    @contextlib.contextmanager
    def lazy_cache(self, model, tail_kv):
        """A verifier cache whose layers are filled from the pager as the forward pass reaches them
        (a forward pre-hook on every decoder layer), so paging overlaps the forward of the layers
        below. The layers the attention masks are sized from (the first of each kind) are filled
        before the forward starts. ``tail_kv``: per layer the exact tail ``(k, v)`` or None."""
        import torch

        from kvz.integrations.hf.rope import decoder_of

        cache = new_cache(model)
        dtype = next(model.parameters()).dtype
        gen = self.pager.layers(self.key, (0, self.n_context), out=lambda i: self.staging[i])
        staged, filled = set(), set()
        t_start = time.perf_counter()
        wait = 0.0

        def fill(L):
            nonlocal wait
            if L in filled:
                return
            t0 = time.perf_counter()
            while L not in staged:
                staged.add(next(gen)[0])
            wait += time.perf_counter() - t0
            k, v = self.staging[L]
            if tail_kv[L] is not None:
                k, v = torch.cat([k, tail_kv[L][0]], dim=-2), torch.cat([v, tail_kv[L][1]], dim=-2)
            cache.update(k.to(dtype), v.to(dtype), L)
            filled.add(L)

        kinds = list(getattr(cache, "is_sliding", []) or [])
        first = {0} | {kinds.index(b) for b in (True, False) if b in kinds}
        for L in sorted(first):
            fill(L)
        hooks = [layer.register_forward_pre_hook(lambda mod, args, L=i: fill(L))
                 for i, layer in enumerate(decoder_of(model).layers)]
        try:
            yield cache
        finally:
            for h in hooks:
                h.remove()
            gen.close()
            self.loads += 1
            self.seconds += time.perf_counter() - t_start
            self.last_wait = wait

    def prefetch_next(self):
        """Ask the pager to bring the context's pages in ahead of the next verify."""
        if self.prefetch:
            return self.pager.prefetch(self.key, (0, self.n_context))
        return None


# ================================================================================== the loop

@dataclass
class RoundLog:
    drafted: int
    accepted: int  # drafts accepted (k)
    emitted: int  # tokens this round added to the output (k + 1, cut at n_new)
    draft_s: float
    verify_s: float
    page_s: float
    paged_bytes: int


@dataclass
class GenerationResult:
    tokens: list
    rounds: list = field(default_factory=list)
    seconds: float = 0.0
    min_top2_gap: float = math.inf  # smallest top-2 logit gap at a verified position (greedy)
    tail_kv: list = field(default_factory=list)  # per layer (k, v) [1, H, m, D]: exact K/V of the consumed tokens

    @property
    def mean_accept_len(self) -> float:
        """Mean tokens emitted per verify round (accepted drafts + the correction or bonus)."""
        return float(np.mean([r.emitted for r in self.rounds])) if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        d = sum(r.drafted for r in self.rounds)
        return sum(r.accepted for r in self.rounds) / d if d else 0.0

    @property
    def paged_bytes(self) -> int:
        return sum(r.paged_bytes for r in self.rounds)


class VeriCacheDecoder:
    """Draft on ``draft`` (:class:`DraftCache`), verify on ``full`` (:class:`PagedFullKV`, or a
    callable returning the context ``[(k, v)]``), ``x`` drafts per round.

    ``verify``: ``"batched"`` (one forward pass over ``[cur, d_1..d_x]``) or ``"stepwise"``.
    ``temperature``: 0 for greedy; > 0 samples (drafts from the drafter's tempered distribution,
    acceptance by :func:`speculative_accept`) with ``seed``.
    """

    def __init__(self, model, full, draft: DraftCache, *, x: int = 16, verify: str = "batched",
                 temperature: float = 0.0, seed: int = 0):
        if x < 0:
            raise ValueError("x must be >= 0")
        if verify not in ("batched", "stepwise"):
            raise ValueError("verify must be 'batched' or 'stepwise'")
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.model, self.full, self.draft = model, full, draft
        self.x, self.verify, self.temperature = int(x), verify, float(temperature)
        self.rng = np.random.default_rng(seed)
        self.n0 = draft.n_context
        n_full = full.n_context if hasattr(full, "n_context") else None
        if n_full is not None and n_full != self.n0:
            raise ValueError(f"draft context has {self.n0} positions, full context {n_full}")
        # positions of the context: position_offset .. position_offset + n0 - 1 (the stored cache's)
        self.offset = int(getattr(getattr(full, "layout", None), "position_offset", 0) or 0)
        window = getattr(text_config(model), "sliding_window", None)
        if isinstance(window, int) and window > 0 and self.x + 1 > window - 1:
            raise ValueError(f"x + 1 = {self.x + 1} positions per verify exceed what a sliding layer keeps "
                             f"({window - 1})")

    def _full_kv(self):
        return self.full.page_in() if hasattr(self.full, "page_in") else self.full()

    def generate(self, first_token: int, n_new: int) -> GenerationResult:
        """Emit ``n_new`` tokens after the context, starting by feeding ``first_token``."""
        import torch

        model, greedy = self.model, self.temperature == 0
        n0 = self.n0 + self.offset  # the position of the first token after the context
        n_layers = text_config(model).num_hidden_layers
        tail = [[] for _ in range(n_layers)]  # exact K/V chunks of consumed tokens, per layer
        res = GenerationResult(tokens=[])
        cur, m = int(first_token), 0
        t_start = time.perf_counter()
        per_tok = kv_bytes(self.full.layout, 1) if hasattr(self.full, "layout") else 0
        with torch.inference_mode():
            while len(res.tokens) < n_new:
                xe = max(0, min(self.x, n_new - len(res.tokens) - 1))
                tail_kv = [self._cat(ch) for ch in tail]
                # ---- draft
                t0 = time.perf_counter()
                drafts, q = [], []
                if xe:
                    if hasattr(self.full, "prefetch_next"):
                        self.full.prefetch_next()  # the pager decodes while we draft
                    dc = build_cache(model, self.draft.layers_kv, tail_kv)
                    tok = cur
                    for i in range(xe):
                        lg = forward_logits(model, dc, [tok], n0 + m + i)[-1]
                        if greedy:
                            tok = int(lg.argmax())
                        else:
                            p = _probs(lg, self.temperature)
                            q.append(p)
                            tok = _sample(p, self.rng)
                        drafts.append(tok)
                    del dc
                t1 = time.perf_counter()
                # ---- verify
                seq = [cur] + drafts
                if getattr(self.full, "overlap", False):  # layers paged in as the forward reaches them
                    with self.full.lazy_cache(model, tail_kv) as vc:
                        k, nxt, new = self._verify(vc, seq, drafts, q, n0 + m, res)
                    page_s = self.full.last_wait  # the time the forward waited for pages
                else:
                    full_kv = self._full_kv()
                    page_s = time.perf_counter() - t1
                    vc = build_cache(model, full_kv, tail_kv)
                    k, nxt, new = self._verify(vc, seq, drafts, q, n0 + m, res)
                    del vc
                verify_s = time.perf_counter() - t1 - page_s
                for L in range(n_layers):
                    tail[L] = [self._cat(tail[L] + [new[L]])]
                m += k + 1
                emitted = drafts[:k] + [nxt]
                room = n_new - len(res.tokens)
                res.tokens += emitted[:room]
                res.rounds.append(RoundLog(drafted=xe, accepted=k, emitted=min(len(emitted), room),
                                           draft_s=t1 - t0, verify_s=verify_s, page_s=page_s,
                                           paged_bytes=per_tok * (self.n0 + m - k - 1)))
                cur = nxt
        res.seconds = time.perf_counter() - t_start
        res.tail_kv = [self._cat(ch) for ch in tail]
        return res

    def _verify(self, vc, seq, drafts, q, start, res):
        """Check ``drafts`` on the verifier cache ``vc``: ``(k, next token, exact K/V of seq[:k+1])``."""
        greedy, xe = self.temperature == 0, len(drafts)
        if self.verify == "batched":
            lg = forward_logits(self.model, vc, seq, start)
            if greedy:
                k, nxt = greedy_accept(lg, drafts)
                res.min_top2_gap = min(res.min_top2_gap, _top2_gap(lg[:k + 1]))
            else:
                k, nxt = speculative_accept(_probs(lg, self.temperature), q, drafts, self.rng)
            return k, nxt, _last_kv(vc, len(seq), k + 1)
        k = 0
        while True:  # feed seq[k]; its row decides d_{k+1} (or gives the bonus token)
            lg = forward_logits(self.model, vc, [seq[k]], start + k)[-1]
            if greedy:
                res.min_top2_gap = min(res.min_top2_gap, _top2_gap(lg))
                t = int(lg.argmax())
                if k < xe and t == drafts[k]:
                    k += 1
                    continue
                nxt = t
            else:
                p = _probs(lg, self.temperature)
                if k < xe:
                    d = drafts[k]
                    if self.rng.random() < min(1.0, p[d] / q[k][d]):
                        k += 1
                        continue
                    nxt = _sample(residual(p, q[k]), self.rng)
                else:
                    nxt = _sample(p, self.rng)
            return k, nxt, _last_kv(vc, k + 1)

    @staticmethod
    def _cat(chunks):
        import torch

        if not chunks:
            return None
        if len(chunks) == 1:
            return chunks[0]
        return torch.cat([c[0] for c in chunks], dim=-2), torch.cat([c[1] for c in chunks], dim=-2)
