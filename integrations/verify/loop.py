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

The pieces: :mod:`~kvz.integrations.verify.drafters` (the drafter's context),
:mod:`~kvz.integrations.verify.paged` (the verifier's, through the pager),
:mod:`~kvz.integrations.verify.accept` (acceptance rules); this module holds the full-KV
reference (:func:`greedy_reference`) and the loop (:class:`VeriCacheDecoder`). The model plumbing
(:func:`~kvz.integrations.hf.build_cache`, :func:`~kvz.integrations.hf.forward_logits`) is the
transformers adapter's.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from kvz.integrations.hf import build_cache, forward_logits, last_kv, text_config
from kvz.integrations.pager import kv_bytes
from kvz.integrations.verify.accept import greedy_accept, probs, residual, sample, speculative_accept, top2_gap
from kvz.integrations.verify.drafters import DraftCache

__all__ = ["greedy_reference", "RoundLog", "GenerationResult", "VeriCacheDecoder"]


# ================================================================================== reference

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
            gap = min(gap, top2_gap(logits))
            cur = int(logits.argmax())
            toks.append(cur)
        info: dict = {"seconds": time.perf_counter() - t0, "min_top2_gap": gap}
        if return_kv:
            info["kv"] = [(layer.keys[..., -min(n_new, layer.keys.shape[-2]):, :].clone(),
                           layer.values[..., -min(n_new, layer.values.shape[-2]):, :].clone())
                          for layer in cache.layers]
    return toks, info


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
        tail: list[list] = [[] for _ in range(n_layers)]  # exact K/V chunks of consumed tokens, per layer
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
                            p = probs(lg, self.temperature)
                            q.append(p)
                            tok = sample(p, self.rng)
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
                res.min_top2_gap = min(res.min_top2_gap, top2_gap(lg[:k + 1]))
            else:
                k, nxt = speculative_accept(probs(lg, self.temperature), q, drafts, self.rng)
            return k, nxt, last_kv(vc, len(seq), k + 1)
        k = 0
        while True:  # feed seq[k]; its row decides d_{k+1} (or gives the bonus token)
            lg = forward_logits(self.model, vc, [seq[k]], start + k)[-1]
            if greedy:
                res.min_top2_gap = min(res.min_top2_gap, top2_gap(lg))
                t = int(lg.argmax())
                if k < xe and t == drafts[k]:
                    k += 1
                    continue
                nxt = t
            else:
                p = probs(lg, self.temperature)
                if k < xe:
                    d = drafts[k]
                    if self.rng.random() < min(1.0, p[d] / q[k][d]):
                        k += 1
                        continue
                    nxt = sample(residual(p, q[k]), self.rng)
                else:
                    nxt = sample(p, self.rng)
            return k, nxt, last_kv(vc, k + 1)

    @staticmethod
    def _cat(chunks):
        import torch

        if not chunks:
            return None
        if len(chunks) == 1:
            return chunks[0]
        return torch.cat([c[0] for c in chunks], dim=-2), torch.cat([c[1] for c in chunks], dim=-2)
