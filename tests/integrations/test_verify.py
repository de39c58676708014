"""integrations.verify / integrations.schedule: the draft/verify loop and its lossless guarantee.

* acceptance rules: greedy, and speculative sampling - exact enumeration of the accept/resample
  step and chi-square tests on synthetic distributions, of the rule alone and of the whole loop
  (VeriCacheDecoder on a synthetic "model" whose next-token distribution depends on which cache
  it reads), for batched and stepwise verification;
* greedy output identical to full-KV greedy decoding on tiny random-weight models of every
  family the capture supports (sliding windows crossed during generation), with perfect, token-
  dropped and noisy drafters; stepwise verification also reproduces the reference's K/V bit for
  bit; the verifier paging a real .kvz through the pager;
* Gemma 3 270M (``model`` marker): kvz-compressed and token-dropped drafters;
* the scheduling model: the seed's worked example, staggered vs lock-step.
"""
from types import SimpleNamespace

import numpy as np
import pytest

from kvz.integrations.pager import schedule as S
from kvz.integrations.verify import greedy_accept, residual, speculative_accept

# ================================================================== acceptance rules (numpy only)


def _rand_dist(rng, V, zeros=0):
    p = rng.random(V) ** 2
    if zeros:
        p[rng.choice(V, zeros, replace=False)] = 0.0
    return p / p.sum()


def test_greedy_accept():
    lg = np.array([[0, 5, 1], [3, 0, 1], [0, 0, 9], [1, 2, 0]], float)  # argmax 1, 0, 2, 1
    assert greedy_accept(lg, [1, 0, 2]) == (3, 1)  # all accepted + bonus
    assert greedy_accept(lg, [1, 2, 2]) == (1, 0)  # d2 rejected, correction 0
    assert greedy_accept(lg, [0, 0, 2]) == (0, 1)
    assert greedy_accept(lg[:1], []) == (0, 1)


@pytest.mark.parametrize("seed", range(6))
def test_one_step_exact_enumeration(seed):
    """P(emit t) = q(t) min(1, p(t)/q(t)) + P(reject) residual(t) equals p(t) exactly."""
    rng = np.random.default_rng(seed)
    V = 7
    p = _rand_dist(rng, V, zeros=seed % 3)
    q = _rand_dist(rng, V, zeros=(seed + 1) % 3)
    q = 0.5 * q + 0.5 * p if seed == 5 else q
    acc = np.where(q > 0, np.minimum(1.0, np.divide(p, q, out=np.zeros(V), where=q > 0)), 0.0)
    p_reject = 1.0 - float(np.sum(q * acc))
    out = q * acc + p_reject * residual(p, q)
    np.testing.assert_allclose(out, p, rtol=0, atol=1e-15)
    np.testing.assert_allclose(residual(p, p), p)  # no mass to reject: never used, but well defined


def test_two_step_exact_enumeration():
    """The whole accept/resample tree of one round with x = 2, enumerated: the first two emitted
    tokens are distributed as p_full(y1) p_full(y2 | y1) (a round emitting one token is continued
    by the next round, which starts from the verifier's distribution)."""
    rng = np.random.default_rng(7)
    V = 4
    p1, q1 = _rand_dist(rng, V), _rand_dist(rng, V, zeros=1)
    p2 = {a: _rand_dist(rng, V, zeros=a % 2) for a in range(V)}
    q2 = {a: _rand_dist(rng, V) for a in range(V)}
    out = np.zeros((V, V))
    for d1 in range(V):
        a1 = min(1.0, p1[d1] / q1[d1]) if q1[d1] > 0 else 0.0
        # rejected at d1: emit r1 ~ residual; the next round draws y2 from p_full(. | r1)
        out += q1[d1] * (1 - a1) * residual(p1, q1)[:, None] * np.stack([p2[r] for r in range(V)])
        for d2 in range(V):
            a2 = min(1.0, p2[d1][d2] / q2[d1][d2])
            out[d1] += q1[d1] * a1 * q2[d1][d2] * (1 - a2) * residual(p2[d1], q2[d1])
            out[d1, d2] += q1[d1] * a1 * q2[d1][d2] * a2
    want = p1[:, None] * np.stack([p2[a] for a in range(V)])
    np.testing.assert_allclose(out, want, atol=1e-14)


def _chi2_ok(counts, probs, alpha=1e-4):
    from scipy.stats import chisquare

    keep = probs > 0
    assert counts[~keep].sum() == 0, "an impossible sequence was emitted"
    n = counts.sum()
    return chisquare(counts[keep], probs[keep] * n).pvalue > alpha


@pytest.mark.slow  # a chi-square test over many sampled drafts
def test_speculative_accept_chi_square():
    """Generate 4 tokens with rounds of x = 3 drafts (drafter and verifier conditional on the last
    token); the 4-token sequences must follow the verifier's chain."""
    rng = np.random.default_rng(11)
    V, N, X = 4, 4, 3
    pf = np.stack([_rand_dist(rng, V, zeros=int(a == 2)) for a in range(V)])  # p_full(next | last)
    pd = np.stack([_rand_dist(rng, V) for a in range(V)])  # p_draft(next | last)
    first = 0
    counts = np.zeros((V,) * N)
    gen = np.random.default_rng(12)
    for _ in range(30000):
        out, last = [], first
        while len(out) < N:
            drafts, t = [], last
            for _ in range(X):
                t = int(gen.choice(V, p=pd[t]))
                drafts.append(t)
            rows_q = [pd[last]] + [pd[d] for d in drafts[:-1]]
            rows_p = [pf[last]] + [pf[d] for d in drafts]
            k, nxt = speculative_accept(rows_p, rows_q, drafts, gen)
            out += drafts[:k] + [nxt]
            last = out[-1]
        counts[tuple(out[:N])] += 1
    probs = np.zeros((V,) * N)
    for seq in np.ndindex(*probs.shape):
        pr, last = 1.0, first
        for t in seq:
            pr *= pf[last, t]
            last = t
        probs[seq] = pr
    assert _chi2_ok(counts.ravel(), probs.ravel())


# ================================================================== the loop on a synthetic model

try:
    import torch
    import transformers
except ImportError:  # the model extra is not installed: the numpy-only tests above still run
    torch = transformers = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch and transformers (the model extra)")

from kvz.integrations.verify import DraftCache, PagedFullKV, VeriCacheDecoder, greedy_reference, window_keep  # noqa: E402


def TableLM(tables):  # noqa: N802 - reads like the class it builds
    """A 'model' whose next-token distribution is a table indexed by the fed token, chosen by the
    marker in its cache's first position (1: the drafter's context, 0: the verifier's). New
    positions get K/V 0, so the exact tail is shared, as in the real loop."""

    class _TableLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = transformers.LlamaConfig(num_hidden_layers=1, vocab_size=tables[0].shape[0],
                                                   hidden_size=8, num_attention_heads=1, num_key_value_heads=1,
                                                   head_dim=2)
            self.anchor = torch.nn.Parameter(torch.zeros(1))
            self.logp = {f: torch.log(torch.as_tensor(t, dtype=torch.float32)) for f, t in tables.items()}

        def forward(self, input_ids, position_ids=None, use_cache=True, cache=None):
            flag = int(cache.layers[0].keys[0, 0, 0, 0])
            z = torch.zeros(1, 1, input_ids.shape[1], 2)
            cache.update(z, z, 0)
            return SimpleNamespace(logits=self.logp[flag][input_ids[0]][None])

    return _TableLM()


@needs_torch
@pytest.mark.slow  # exact-distribution check of the sampling loop over many runs
@pytest.mark.parametrize("verify", ["batched", "stepwise"])
def test_loop_sampling_is_exact(verify):
    rng = np.random.default_rng(5)
    V, N = 3, 3
    pf = np.stack([_rand_dist(rng, V) for _ in range(V)])
    pd = np.stack([_rand_dist(rng, V) for _ in range(V)])
    model = TableLM({0: pf, 1: pd})
    ctx_full = [(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))]
    draft = DraftCache([(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))], 1, kind="table", resident_bytes=0,
                       dense_bytes=0)
    dec = VeriCacheDecoder(model, lambda: ctx_full, draft, x=2, verify=verify, temperature=1.0, seed=3)
    counts = np.zeros((V,) * N)
    accepted = drafted = 0
    for _ in range(4000):
        res = dec.generate(1, N)
        counts[tuple(res.tokens)] += 1
        accepted += sum(r.accepted for r in res.rounds)
        drafted += sum(r.drafted for r in res.rounds)
    probs = np.zeros((V,) * N)
    for seq in np.ndindex(*probs.shape):
        pr, last = 1.0, 1
        for t in seq:
            pr *= pf[last, t]
            last = t
        probs[seq] = pr
    assert _chi2_ok(counts.ravel(), probs.ravel())
    assert 0 < accepted < drafted  # both branches were exercised


@needs_torch
def test_loop_greedy_table_model():
    """A drafter that disagrees at known places: the output is still the verifier's chain."""
    pf = np.array([[0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.8, 0.1, 0.1]])  # 0 -> 1 -> 2 -> 0
    pd = np.array([[0.1, 0.8, 0.1], [0.1, 0.1, 0.8], [0.1, 0.8, 0.1]])  # disagrees after 2
    model = TableLM({0: pf, 1: pd})
    full = lambda: [(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))]  # noqa: E731
    draft = DraftCache([(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))], 1, kind="t", resident_bytes=0,
                       dense_bytes=0)
    for verify in ("batched", "stepwise"):
        res = VeriCacheDecoder(model, full, draft, x=4, verify=verify).generate(0, 10)
        assert res.tokens == [1, 2, 0, 1, 2, 0, 1, 2, 0, 1]
        # from 0 the drafter proposes 1 2 1 2: "1 2" accepted, corrected to 0; the last token needs no drafts
        assert [(r.drafted, r.accepted, r.emitted) for r in res.rounds] == [(4, 2, 3)] * 2 + [(3, 2, 3), (0, 0, 1)]


# ================================================================== tiny real architectures

COMMON = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
SF = ["sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = {
    "llama": ("LlamaConfig", dict(head_dim=64)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(head_dim=32, sliding_window=48)),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5)),
    "gemma2": ("Gemma2Config", dict(head_dim=32, sliding_window=48, layer_types=SF)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=64, sliding_window=48, layer_types=SF)),
}


def tiny_model(family, seed=0):
    from transformers import AutoModelForCausalLM

    cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(getattr(transformers, cls)(**COMMON, **extra)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # a shared embedding component makes the model less flat (a mean key, as trained ones)
        E = model.get_input_embeddings().weight
        E.copy_(0.25 * torch.randn(E.shape, generator=g) + torch.randn(E.shape[1], generator=g))
        for name, w in model.named_parameters():  # sharper next-token distributions
            if "lm_head" in name:
                w.mul_(8.0)
    return model


def _context(model, n, seed=0, meta=False):
    from kvz.integrations.hf import cache_metadata, record_kv, rope_thetas

    ids = [1] + np.random.default_rng(seed).integers(3, 256, n - 1).tolist()
    tensors, spec, info = record_kv(model, ids[:-1], dtype="float32")
    L = model.config.num_hidden_layers
    kv = [(tensors[f"layers.{i}.key"], tensors[f"layers.{i}.value"]) for i in range(L)]
    if meta:
        return ids, kv, tensors, cache_metadata(info["layer_types"], rope_thetas(model, spec), ids[:-1], "test",
                                                rope=spec)
    return ids, kv, tensors


def _pager_full(tensors):
    from kvz.integrations.pager import ArraySource, KvPager

    pager = KvPager(budget_bytes=1 << 24, workers=2)
    pager.add("ctx", ArraySource({k: v.numpy() for k, v in tensors.items()}))
    return pager, PagedFullKV(pager, "ctx"), PagedFullKV(pager, "ctx", overlap=True)


@needs_torch
# one family in the default run, every family in CI's slow pass
@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f == "llama" else pytest.mark.slow) for f in sorted(FAMILIES)])
def test_greedy_identical_on_every_family(family):
    model = tiny_model(family)
    ids, ctx_kv, tensors = _context(model, 40)
    n0, first, N = len(ids) - 1, ids[-1], 16  # 39 + 16 positions: crosses the 48-position sliding window
    ref, info = greedy_reference(model, ctx_kv, first, N, return_kv=True)
    pager, full, lazy = _pager_full(tensors)
    gen = torch.Generator().manual_seed(9)
    drafters = {
        "perfect": DraftCache.token_dropped(ctx_kv, np.arange(n0), dtype_bytes=4),
        "window": DraftCache.token_dropped(ctx_kv, window_keep(n0, 0.4), dtype_bytes=4),
        "noisy": DraftCache([((k + 0.3 * k.std() * torch.randn(k.shape, generator=gen))[None],
                              (v + 0.3 * v.std() * torch.randn(v.shape, generator=gen))[None]) for k, v in ctx_kv],
                            n0, kind="noisy", resident_bytes=0, dense_bytes=0),
    }
    try:
        runs = [("perfect", "stepwise", 5, full), ("perfect", "batched", 5, lazy), ("window", "batched", 1, full),
                ("window", "stepwise", 5, lazy), ("noisy", "batched", 5, full), ("noisy", "stepwise", 5, lazy),
                ("noisy", "batched", 1, lazy)]
        for dname, verify, x, src in runs:
            draft = drafters[dname]
            res = VeriCacheDecoder(model, src, draft, x=x, verify=verify).generate(first, N)
            assert res.tokens == ref, (dname, verify, x, src.overlap)
            assert sum(r.emitted for r in res.rounds) == N
            if dname == "perfect" and verify == "stepwise":
                assert all(r.accepted == r.drafted for r in res.rounds)  # the same computation
            if verify == "stepwise":  # the tail is the reference's K/V, bit for bit
                for (tk, tv), (rk, rv) in zip(res.tail_kv, info["kv"]):
                    n = rk.shape[-2]
                    assert torch.equal(tk[..., -n:, :], rk) and torch.equal(tv[..., -n:, :], rv)
    finally:
        pager.close()


@needs_torch
def test_verifier_pages_a_kvz_file():
    """The full cache is a .kvz (whatever it decodes to is the stored cache): the verifier pages it
    through the pager's KvzSource, the drafter reads a coarser file of the same context."""
    from alignpred import Cache, KvzReader, compress_bytes, fit_bank
    from kvz.integrations.pager import KvPager, KvzSource

    model = tiny_model("llama", seed=2)
    ids, ctx_kv, tensors, meta = _context(model, 300, seed=2, meta=True)  # two objects
    n0, first, N = len(ids) - 1, ids[-1], 12
    cache = Cache.from_arrays({k: v.numpy() for k, v in tensors.items()}, meta)
    bank = fit_bank([cache], rank=None)
    stored = compress_bytes(cache, budget=0.01, bank=bank)
    dec_kv = KvzReader(stored, bank=bank).read()
    stored_kv = [(torch.from_numpy(np.array(dec_kv[f"layers.{i}.key"])),
                  torch.from_numpy(np.array(dec_kv[f"layers.{i}.value"]))) for i in range(3)]
    ref, _ = greedy_reference(model, stored_kv, first, N)
    draft = DraftCache.from_kvz(compress_bytes(cache, budget=0.2, bank=bank), bank=bank)
    assert draft.kind == "kvz" and draft.resident_bytes < draft.dense_bytes
    with KvPager(budget_bytes=0, workers=2) as pager:  # budget 0: every verify decodes straight into staging
        src = KvzSource(stored, bank=bank)
        pager.add("req", src)
        full = PagedFullKV(pager, "req", prefetch=False)
        res = VeriCacheDecoder(model, full, draft, x=4).generate(first, N)
        assert res.tokens == ref
        assert src.objects_decoded == len(res.rounds) * 2 * 2 * 3  # per verify: 2 objects x (K, V) x 3 layers
        assert pager.stats["peak_bytes"] == 0
    with KvPager(budget_bytes=1 << 24, workers=2) as pager:  # room for the pages: decoded once, then copied
        src = KvzSource(stored, bank=bank)
        pager.add("req", src)
        res = VeriCacheDecoder(model, PagedFullKV(pager, "req"), draft, x=4).generate(first, N)
        assert res.tokens == ref and src.objects_decoded == 2 * 2 * 3
        assert res.paged_bytes == sum(2 * 3 * 2 * 64 * 4 * (n0 + sum(r.emitted for r in res.rounds[:i]))
                                      for i in range(len(res.rounds)))
    for budget, verify in ((0, "batched"), (1 << 24, "stepwise")):  # layers paged in as the forward reaches them
        with KvPager(budget_bytes=budget, workers=2) as pager:  # (budget 0: decoded in the hooks)
            pager.add("req", KvzSource(stored, bank=bank))
            lazy = PagedFullKV(pager, "req", overlap=True, prefetch=False)
            res = VeriCacheDecoder(model, lazy, draft, x=4, verify=verify).generate(first, N)
            assert res.tokens == ref, (budget, verify)
            assert pager.stats["peak_bytes"] <= budget


@needs_torch
def test_paging_overlaps_the_verify_forward():
    """With ``overlap=True`` the verify forward computes layer 0 while the pager still decodes the
    layers above (a source that takes 0.15 s per layer)."""
    import time

    from kvz.integrations.hf import decoder_of
    from kvz.integrations.pager import ArraySource, KvPager

    class Slow(ArraySource):
        def __init__(self, cache, log):
            super().__init__(cache)
            self.log = log

        def decode(self, j0, j1, layers, count=None):
            for item in super().decode(j0, j1, layers, count):
                time.sleep(0.15)
                self.log.append(("decoded", item[0], time.perf_counter()))
                yield item

    model = tiny_model("llama")
    ids, ctx_kv, tensors = _context(model, 30)
    log = []
    hook = decoder_of(model).layers[0].register_forward_hook(
        lambda *a: log.append(("layer0 computed", 0, time.perf_counter())))
    try:
        with KvPager(budget_bytes=1 << 24, workers=2) as pager:
            pager.add("ctx", Slow({k: v.numpy() for k, v in tensors.items()}, log))
            lazy = PagedFullKV(pager, "ctx", overlap=True, prefetch=False)
            draft = DraftCache.token_dropped(ctx_kv, np.arange(len(ids) - 1), dtype_bytes=4)
            res = VeriCacheDecoder(model, lazy, draft, x=0).generate(ids[-1], 1)  # one verify, no drafts
    finally:
        hook.remove()
    ref, _ = greedy_reference(model, ctx_kv, ids[-1], 1)
    assert res.tokens == ref
    t_l0 = next(t for kind, _, t in log if kind == "layer0 computed")
    t_last = max(t for kind, layer, t in log if kind == "decoded" and layer == 2)
    assert t_l0 < t_last


@needs_torch
def test_loop_rejects_bad_arguments():
    model = TableLM({0: np.full((2, 2), 0.5), 1: np.full((2, 2), 0.5)})
    draft = DraftCache([(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))], 1, kind="t", resident_bytes=0,
                       dense_bytes=0)
    with pytest.raises(ValueError):
        VeriCacheDecoder(model, lambda: None, draft, verify="tree")
    with pytest.raises(ValueError):
        VeriCacheDecoder(model, lambda: None, draft, x=-1)
    with pytest.raises(ValueError):
        DraftCache.token_dropped([(torch.zeros(1, 5, 2), torch.zeros(1, 5, 2))] * 2, [np.arange(2), np.arange(3)])
    assert list(window_keep(10, 0.5, sinks=2)) == [0, 1, 7, 8, 9]


# ================================================================== Gemma 3 270M


@pytest.mark.slow
@needs_torch
@pytest.mark.model
def test_gemma_drafters_are_lossless(gemma):
    from pathlib import Path

    from alignpred import Cache, compress_bytes
    from kvz.integrations.hf import cache_metadata, record_kv, rope_thetas, tokenize
    from kvz.integrations.pager import ArraySource, KvPager
    from kvz.integrations.verify import snapkv_keep

    model, tok = gemma
    text = (Path(__file__).resolve().parents[2] / "samples" / "texts" / "english-prose.txt").read_text()
    ids = tokenize(tok, text)[:64]
    ctx, first = ids[:-1], ids[-1]
    tensors, spec, info = record_kv(model, ctx, dtype="bfloat16")
    cache = Cache.from_arrays(tensors, cache_metadata(info["layer_types"], rope_thetas(model, spec), ctx, "test",
                                                      model="gemma-3-270m", rope=spec))
    ctx_kv = [(torch.from_numpy(np.asarray(cache.tensors[f"layers.{i}.key"], np.float32)),
               torch.from_numpy(np.asarray(cache.tensors[f"layers.{i}.value"], np.float32)))
              for i in range(cache.layout.num_layers)]
    ref, _ = greedy_reference(model, ctx_kv, first, 10)
    drafts = [DraftCache.from_kvz(compress_bytes(cache, budget=0.1, bank="gemma-3-270m")),
              DraftCache.token_dropped(ctx_kv, snapkv_keep(model, ctx, ctx_kv, 0.5))]
    with KvPager(budget_bytes=1 << 26) as pager:
        pager.add("ctx", ArraySource(cache))
        full, lazy = PagedFullKV(pager, "ctx"), PagedFullKV(pager, "ctx", overlap=True)
        for draft in drafts:
            for verify, src in (("batched", full), ("stepwise", full), ("batched", lazy)):
                res = VeriCacheDecoder(model, src, draft, x=4, verify=verify).generate(first, 10)
                assert res.tokens == ref, (draft.kind, verify, src.overlap)


# ================================================================== scheduling model


def _accept(p=0.9, x=32, n=300, seed=0):
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(n):
        k = 0
        while k < x and rng.random() < p:
            k += 1
        rounds.append((x, k))
    return S.AcceptModel(rounds)


def test_accept_model():
    am = _accept(0.9)
    assert abs(am.p_continue - 0.9) < 0.02
    rng = np.random.default_rng(1)
    e = [am.emitted(10, rng) for _ in range(2000)]
    assert min(e) >= 1 and max(e) <= 11
    assert am.mean_emitted(64) > am.mean_emitted(32) > am.mean_emitted(8)  # censored rounds are continued
    assert S.AcceptModel([(4, 0)] * 10).mean_emitted(16) == 1.0


def test_seed_example_and_policies():
    hw, kv = S.SCENARIOS["rtx6000-24b-50k"]
    g, x = S.eq3_iter_time(hw, B=6, kv_full=kv, c=0.2, x=25)
    assert abs(g - 0.0345) < 1e-4 and abs(x - 0.01875) < 1e-5
    base = S.full_kv_baseline(hw, 10, kv)
    assert base["B_running"] == 9  # (96 - 48) / 5
    am = _accept(0.97)
    res = {pol: S.simulate(hw, B=10, kv_full=kv, c=0.2, x=25, accept=am, policy=pol, iterations=1500)
           for pol in ("staggered", "lockstep", "lockstep_prefetch")}
    st, ls = res["staggered"], res["lockstep"]
    assert st["stall_frac"] < 0.01 and ls["stall_frac"] > 0.2  # lock-step serialises B transfers in one window
    assert st["tokens_per_s"] > 1.3 * ls["tokens_per_s"]
    assert st["tokens_per_s"] >= res["lockstep_prefetch"]["tokens_per_s"]
    assert st["hbm_peak_gb"] < ls["hbm_peak_gb"] <= hw.hbm_bytes / 1e9
    assert abs(st["iter_ms"] - st["eq3_t_iter_ms"]) / st["eq3_t_iter_ms"] < 0.1  # Eq. 3 predicts the iteration
    big = S.simulate(hw, B=20, kv_full=kv, c=0.2, x=25, accept=am, iterations=800)
    assert big["feasible"] and big["tokens_per_s"] > base["tokens_per_s"]  # more requests than full KV fits
    assert not S.simulate(hw, B=40, kv_full=kv, c=0.25, x=25, accept=am)["feasible"]
