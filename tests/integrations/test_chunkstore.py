"""The KV chunk store (integrations/chunkstore: keys, serde, store, engine): keys, serdes, exact prefix reuse,
content reuse at another position (RoPE re-rotation + repair), corrupt entries, concurrent writers, Redis outages.

CI tests use a tiny random-weight Gemma 3 (tests/test_hf_bridge.py) or synthetic KV; the ``model``
tests run the real Gemma 3 270M. Every store test runs on a directory, one real redis-server and a
real 3-master Redis Cluster (the shared fixtures of tests/integrations/conftest.py: skipped without
redis-server, failed under KVZ_REQUIRE_REDIS=1).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from alignpred.cache.rope import RopeSpec
from kvz.integrations.chunkstore import (
    TOKENS_META,
    ChunkStore,
    ChunkStoreWarning,
    KvzSerde,
    RawSerde,
    chunk_tokens_digest,
    split_chunks,
)
from kvz.integrations.kvstore import DirectoryBackend, StoreWarning, open_url

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ["directory", "redis", "redis-cluster"]


def make_backend(kind, store_url, **kw):
    """A fresh, empty store of ``kind`` (``store_url``: the shared fixture of conftest.py)."""
    return open_url(store_url(kind), **kw)


def synth_store(backend, **kw):
    return ChunkStore(backend, model_id="synthetic", layer_types=["full_attention"] * 3,
                      rope=RopeSpec.from_thetas([1e4] * 3, head_dim=16), shape=(3, 2, 16), **kw)


# --------------------------------------------------------------------------- keys (no model)

def test_split_chunks():
    assert split_chunks(512, 256) == [(0, 256), (256, 512)]
    assert split_chunks(10, 4, boundaries=[3, 3, 0, 10, 99]) == [(0, 3), (3, 7), (7, 10)]
    assert split_chunks(0, 256) == []


def test_keys_chain_and_bind(tmp_path):
    st = synth_store(DirectoryBackend(str(tmp_path / "s")), codec="raw", chunk_tokens=4)
    a = st.chunks(list(range(12)))
    b = st.chunks([99] + list(range(1, 12)))
    assert [c.prefix_key for c in a] != [c.prefix_key for c in b]
    assert all(x.prefix_key != y.prefix_key for x, y in zip(a, b))  # a changed first token changes every prefix key
    assert [c.content_key for c in a[1:]] == [c.content_key for c in b[1:]]  # content keys only see the chunk
    # the same document at another position: same content key, other prefix key
    c = st.chunks(list(range(100, 103)) + list(range(12)), boundaries=[3])
    assert c[1].content_key == a[0].content_key and c[1].prefix_key != a[0].prefix_key
    # everything in the binding changes every key
    others = [synth_store(st.backend, codec="raw", chunk_tokens=4, raw_dtype="float32"),
              synth_store(st.backend, codec="raw", chunk_tokens=8)]
    for o in others:
        k = o.chunks(list(range(12)))
        assert k[0].prefix_key != a[0].prefix_key and k[0].content_key != a[0].content_key
    other_model = ChunkStore(st.backend, model_id="other", layer_types=st.layer_types, rope=st.rope, shape=st.shape,
                             codec="raw", chunk_tokens=4)
    assert other_model.chunks(list(range(12)))[0].content_key != a[0].content_key
    assert st.binding["codec"] == "raw" and st.binding["model"] == "synthetic"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_raw_serde_round_trip(dtype):
    rng = np.random.default_rng(0)
    kv = [(rng.standard_normal((2, 5, 8)).astype(np.float32), rng.standard_normal((2, 5, 8)).astype(np.float32))
          for _ in range(3)]
    serde = RawSerde(dtype)
    blob = serde.encode(kv, {"model": "m", "position_offset": 7})
    out = [(np.zeros((2, 5, 8), np.float32), np.zeros((2, 5, 8), np.float32)) for _ in range(3)]
    meta = serde.decode_into(blob, lambda i: out[i])
    assert meta["model"] == "m" and meta["position_offset"] == "7"
    for (k, v), (ko, vo) in zip(kv, out):
        assert np.array_equal(ko, k.astype(dtype).astype(np.float32)) and np.array_equal(vo, v.astype(dtype))
    with pytest.raises(ValueError, match="raw dtype"):
        RawSerde("int8")


def test_binding_holds_codec_bank_eps_format(tmp_path, real_bank):
    from alignpred import CodecConfig
    from alignpred.format.container import MAJOR

    be = DirectoryBackend(str(tmp_path / "s"))
    kw = dict(model_id="m", layer_types=["full_attention"] * 18, rope=RopeSpec.from_thetas([1e4] * 18, head_dim=256),
              shape=(18, 1, 256), bank=real_bank)
    s1 = ChunkStore(be, eps=0.02, **kw)
    assert isinstance(s1.codec, KvzSerde) and s1.codec.bank.id == real_bank.id
    assert s1.binding["format_major"] == MAJOR and s1.binding["bank"] == real_bank.id
    assert s1.binding["config"] == CodecConfig().to_json() and s1.binding["eps"] == 0.02
    ids = list(range(300))
    k1 = s1.chunks(ids)[0]
    for s2 in (ChunkStore(be, eps=0.03, **kw), ChunkStore(be, eps=0.02, config=CodecConfig(intra=False), **kw)):
        k2 = s2.chunks(ids)[0]
        assert k1.prefix_key != k2.prefix_key and k1.content_key != k2.content_key


def _synth_kv(chunk, shape=(3, 2, 16)):
    """Deterministic K/V of a chunk (what every writer of that chunk writes)."""
    L, H, d = shape
    rng = np.random.default_rng(int(chunk.prefix_key[6:14], 16))
    return [(rng.standard_normal((H, chunk.n, d)).astype(np.float32),
             rng.standard_normal((H, chunk.n, d)).astype(np.float32)) for _ in range(L)]


@pytest.mark.parametrize("codec", ["raw", "kvz"])
def test_put_lookup_decode(tmp_path, codec):
    from alignpred import Cache, fit_bank

    be = DirectoryBackend(str(tmp_path / "s"))
    kw = {}
    if codec == "kvz":
        rng = np.random.default_rng(0)
        lat = rng.standard_normal((2, 300, 16)).cumsum(1) * 0.1
        kv = [((lat @ rng.standard_normal((16, 16))).astype(np.float32),
               (lat @ rng.standard_normal((16, 16))).astype(np.float32)) for _ in range(3)]
        kw = dict(bank=fit_bank([Cache.from_arrays(kv)], rank=None), eps=0.05)
    st = synth_store(be, codec=codec, chunk_tokens=8, raw_dtype="float32", **kw)
    ids = list(range(40, 60))
    chunks = st.chunks(ids)
    for c in chunks:
        st.put(c, _synth_kv(c), ids[c.start:c.end], exact=True)
    hits = st.lookup(ids, chunks)
    assert [h.kind for h in hits] == ["prefix"] * 3
    for h in hits:
        want = _synth_kv(h.chunk)
        got = [(np.zeros_like(k), np.zeros_like(v)) for k, v in want]
        meta = st.decode_into(h, lambda i: got[i])
        assert meta[TOKENS_META] == chunk_tokens_digest(ids[h.chunk.start:h.chunk.end])
        for (k, v), (gk, gv) in zip(want, got):
            if codec == "raw":
                assert np.array_equal(k, gk) and np.array_equal(v, gv)
            else:
                assert np.linalg.norm(gv - v) <= 0.05 * np.linalg.norm(v) * 1.001
    # the same tokens after other tokens: content hits (via the pointer), not prefix hits
    ids2 = [1, 2, 3] + ids[:16]
    hits2 = st.lookup(ids2, st.chunks(ids2, boundaries=[3]))
    assert [h.kind for h in hits2] == ["content", "content"] and [h.src_start for h in hits2] == [0, 8]
    assert st.lookup(ids2, st.chunks(ids2, boundaries=[3]), content=False) == []


# --------------------------------------------------------------------------- concurrency (no model)

WORKER = textwrap.dedent("""
    import json, sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_chunkstore import synth_store, _synth_kv
    from kvz.integrations.kvstore import open_url
    spec, role, seed = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    be = open_url(spec["url"], budget_bytes=spec["budget"])
    st = synth_store(be, codec="raw", chunk_tokens=8, raw_dtype="float32")
    rng = np.random.default_rng(seed)
    checked = 0
    # start together (imports take a while and vary), and readers read for the whole write phase
    import os, time
    open(os.path.join(spec["sync"], f"ready-{{role}}{{seed}}"), "w").close()
    t0 = time.monotonic()
    while len(os.listdir(spec["sync"])) < spec["procs"] and time.monotonic() - t0 < 120:
        time.sleep(0.005)
    it = 0
    while it < spec["iters"] or (role == "r" and not os.path.exists(spec["done"]) and time.monotonic() - t0 < 240):
        it += 1
        p = int(rng.integers(spec["prompts"]))
        ids = [1000 * p + j for j in range(32)]
        chunks = st.chunks(ids)
        if role == "w":
            for c in chunks:
                st.put(c, _synth_kv(c), ids[c.start:c.end], exact=True)
        else:
            for h in st.lookup(ids, chunks):
                want = _synth_kv(h.chunk)
                got = [(np.zeros_like(k), np.zeros_like(v)) for k, v in want]
                st.decode_into(h, lambda i: got[i])
                for (k, v), (gk, gv) in zip(want, got):
                    assert np.array_equal(k, gk) and np.array_equal(v, gv), "torn or foreign entry decoded"
                checked += 1
    print(checked)
""")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_writers_and_readers(kind, tmp_path, store_url):
    """4 writer processes put the same and different chunks while 2 readers decode and verify every
    hit bit for bit, under a budget that forces eviction: no torn or half-visible entry is ever read."""
    url = store_url(kind)
    be = open_url(url)
    spec = {"url": url, "budget": 60_000, "iters": 25, "prompts": 6}
    roles = "wwwwrr"
    spec.update(sync=str(tmp_path / "sync"), done=str(tmp_path / "writers-done"), procs=len(roles))
    os.makedirs(spec["sync"])
    code = WORKER.format(tests=os.path.join(ROOT, "tests", "integrations"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", code, json.dumps(spec), role, str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for i, role in enumerate(roles)]
    outs = [p.communicate(timeout=300) for p, r in zip(procs, roles) if r == "w"]
    open(spec["done"], "w").close()  # the readers stop once they have seen the whole write phase
    outs += [p.communicate(timeout=300) for p, r in zip(procs, roles) if r == "r"]
    for p, (_o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-2000:]
    assert sum(int(o.strip() or 0) for (o, _), r in zip(outs, "wwwwrr") if r == "r") > 0
    assert be.stats()["bytes"] <= 60_000 + 4 * 20_000  # the budget, give or take the puts in flight


# --------------------------------------------------------------------------- tiny model (CI)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvz.integrations.chunkstore import ReuseEngine  # noqa: E402
from kvz.integrations.hf.bridge import capture_prefill  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    sys.path.insert(0, os.path.join(ROOT, "tests", "integrations"))
    from test_hf_bridge import tiny_gemma

    return tiny_gemma()


def _tiny_store(model, backend, **kw):
    kw.setdefault("codec", "raw")
    kw.setdefault("raw_dtype", "float32")
    kw.setdefault("chunk_tokens", 16)
    return ChunkStore.for_model(model, backend, max_positions=1024, **kw)


def _ids(n, seed):
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_reuse_exact_from_lossless_store(tiny, kind, store_url):
    eng = ReuseEngine(tiny, _tiny_store(tiny, make_backend(kind, store_url)), reuse="content")
    ids = _ids(70, 3)
    full = eng.prefill(ids, reuse="none")
    t0, r0 = eng.generate(ids, 10, return_logits=True)
    assert r0.stats["reuse_frac"] == 0 and r0.stats["stored"] == 5
    t1, r1 = eng.generate(ids + [5, 6], 10, return_logits=True)  # a longer prompt with the same prefix
    assert r1.stats["prefix_tokens"] == 64 and r1.stats["n_content_hits"] == 0
    t2, r2 = eng.generate(ids, 10, return_logits=True)
    assert r2.stats["prefix_tokens"] == 64 and r2.stats["computed_tokens"] == 6
    assert t2 == t0
    assert torch.allclose(r2.stats["logits"], r0.stats["logits"], atol=1e-4)
    assert torch.allclose(r2.logits, full.logits, atol=1e-4)


def test_rerotation_matches_model_rope(tiny, tmp_path):
    """Layer 0's K/V do not depend on the context: a chunk moved to another position must get exactly
    the keys the model computes there (RoPE re-rotation with the model's own per-layer tables)."""
    eng = ReuseEngine(tiny, _tiny_store(tiny, DirectoryBackend(str(tmp_path / "s"))), repair="none")
    doc = _ids(32, 4)
    eng.generate([1] + _ids(15, 5) + doc, 2, boundaries=[16])
    ids2 = [1] + _ids(40, 6) + doc + [7, 8]
    res = eng.prefill(ids2, boundaries=[41, 73])
    assert res.stats["n_content_hits"] == 2 and res.stats["content_tokens"] == 32
    _, _, kv = capture_prefill(tiny, ids2)
    for i in range(tiny.config.num_hidden_layers):
        k = res.kv[i][0][0, :, 41:73]
        err = float((k - kv[i][0][:, 41:73]).abs().max() / kv[i][0].abs().max())
        if i == 0:
            assert err < 1e-5
            assert float((res.kv[i][1][0, :, 41:73] - kv[i][1][:, 41:73]).abs().max()) < 1e-5
    # the stale (not re-rotated) keys would be far off
    assert float((kv[0][0][:, 16:48] - kv[0][0][:, 41:73]).abs().max()) > 0.1


def test_content_reuse_with_repair(tiny, tmp_path):
    """Content hits are served, repaired tokens are recomputed, and repair brings the logits closer."""
    eng = ReuseEngine(tiny, _tiny_store(tiny, DirectoryBackend(str(tmp_path / "s"))), R=4)
    doc = _ids(48, 8)
    eng.generate([1] + _ids(15, 9) + doc, 2, boundaries=[16])
    ids2 = [1] + _ids(20, 10) + doc + _ids(5, 11)
    full = eng.prefill(ids2, reuse="none")

    def kl(res):  # the tiny model's logits are nearly flat: compare the assembled K/V of every layer instead
        return sum(float((a - b).norm() / b.norm()) for (a, _), (b, _) in zip(res.kv, full.kv))

    out = {rep: eng.prefill(ids2, boundaries=[21, 69], repair=rep) for rep in ("none", "seam", "blend", "seam+blend")}
    assert out["none"].stats["content_tokens"] == 48 and out["none"].stats["repaired_tokens"] == 0
    assert out["seam"].stats["repaired_tokens"] == 4  # one seam (the doc's 3 chunks continue each other) x R=4
    assert out["blend"].stats["repaired_tokens"] == round(eng.blend_ratio * 48)
    assert out["seam+blend"].stats["repaired_tokens"] == 4 + round(eng.blend_ratio * 44)  # seam, then the top 10% of the rest
    assert kl(out["seam+blend"]) < kl(out["seam"]) < kl(out["none"]) and kl(out["blend"]) < kl(out["none"])
    # without refresh, chunks computed after approximate KV are stored under their content key only
    assert out["none"].exact[:21].all() and not out["none"].exact[21:].any()
    assert eng.store_result(out["none"], refresh=False)["stored"] == 3  # 2 exact leading chunks + the last (content)
    assert eng.prefill(ids2, boundaries=[21, 69]).stats["prefix_tokens"] == 21
    # refresh (the default) recomputes the approximate part after the first token and stores it exact
    r = eng.prefill(ids2, boundaries=[21, 69], repair="seam")
    st = eng.store_result(r)
    assert st["refreshed"] == len(ids2) - 21 - eng.R and r.exact.all()  # the R repaired tokens were exact already
    again = eng.prefill(ids2, boundaries=[21, 69])
    assert again.stats["prefix_tokens"] == 69 and again.stats["n_content_hits"] == 0
    assert torch.allclose(again.logits, full.logits, atol=1e-4)


def test_corrupt_entries_are_dropped_and_recomputed(tiny, tmp_path):
    be = DirectoryBackend(str(tmp_path / "s"))
    eng = ReuseEngine(tiny, _tiny_store(tiny, be))
    ids = _ids(40, 12)
    t0, _ = eng.generate(ids, 6)
    chunks = eng.store.chunks(ids)
    # 1) a flipped byte in the stored file: the backend's checksum drops it (a miss)
    path = be.entry_path(chunks[0].prefix_key)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    t1, r1 = eng.generate(ids, 6)
    assert r1.stats["prefix_tokens"] == 0 and t1 == t0 and not os.path.exists(path) or be.contains(chunks[0].prefix_key)
    # 2) an entry with a valid backend checksum but an undecodable payload: dropped with a warning, recomputed
    be.put(chunks[0].prefix_key, b"not a chunk", meta={"start": 0})
    with pytest.warns(ChunkStoreWarning, match="dropped and recomputed"):
        t2, r2 = eng.generate(ids, 6, store=False)
    assert t2 == t0 and r2.stats["prefix_tokens"] == 16  # chunk 0 recomputed; chunk 1 is still an exact hit
    assert not be.contains(chunks[0].prefix_key)
    # 3) a foreign chunk under the key (other token ids): refused
    eng.generate(ids, 2)
    other = _ids(40, 13)
    blob = be.get(eng.store.chunks(other)[0].prefix_key) if be.contains(eng.store.chunks(other)[0].prefix_key) else None
    if blob is None:
        eng.generate(other, 2)
        blob = be.get(eng.store.chunks(other)[0].prefix_key)
    be.put(chunks[0].prefix_key, blob, meta={"start": 0})
    with pytest.warns(ChunkStoreWarning, match="token ids"):
        t3, _ = eng.generate(ids, 6, store=False)
    assert t3 == t0


def test_redis_restart_mid_run(tiny, redis_store):
    """The store (one node, or every node of the cluster) goes away between two requests and comes back
    empty: the engine recomputes, with the same tokens, and stores again."""
    srv = redis_store
    be = open_url(srv.url, socket_timeout=0.5, connect_timeout=0.5, reconnect_interval=0.0)
    eng = ReuseEngine(tiny, _tiny_store(tiny, be))
    ids = _ids(50, 14)
    t0, _ = eng.generate(ids, 5)
    _, r = eng.generate(ids, 5)
    assert r.stats["prefix_tokens"] == 48
    srv.stop()
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            t1, r1 = eng.generate(ids, 5)
        assert t1 == t0 and r1.stats["reuse_frac"] == 0
        assert any(issubclass(x.category, StoreWarning) for x in w)
    finally:
        srv.start()  # restarted, empty
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        t2, r2 = eng.generate(ids, 5)
        assert t2 == t0 and r2.stats["reuse_frac"] == 0
        t3, r3 = eng.generate(ids, 5)
    assert t3 == t0 and r3.stats["prefix_tokens"] == 48


# --------------------------------------------------------------------------- real model

@pytest.mark.slow
@pytest.mark.model
def test_gemma_prefix_and_content_reuse(gemma, tmp_path):
    """Real model, kvz codec at the default eps: exact-prefix reuse stays close to full recompute;
    a document moved to another position gets the model's own layer-0 keys after re-rotation."""
    model, tok = gemma
    from pathlib import Path

    text = (Path(ROOT) / "samples" / "texts" / "english-prose.txt").read_text()
    body = tok(text, add_special_tokens=False)["input_ids"]
    assert len(body) > 1800
    sys_ids, doc, q = [2] + body[:40], body[1000:1256], body[1700:1730]
    store = ChunkStore.for_model(model, DirectoryBackend(str(tmp_path / "s")), model_id="gemma-3-270m", eps=0.02)
    eng = ReuseEngine(model, store, R=32)
    p1 = sys_ids + doc + q
    eng.generate(p1, 1, boundaries=[41, 297])
    res = eng.prefill(p1, boundaries=[41, 297])
    full = eng.prefill(p1, reuse="none")
    assert res.stats["prefix_tokens"] == 297
    a, b = full.logits.double().log_softmax(-1), res.logits.double().log_softmax(-1)
    assert float((a.exp() * (a - b)).sum()) < 0.02
    p2 = sys_ids + body[1300:1400] + doc + q
    r2 = eng.prefill(p2, boundaries=[41, 141, 397], repair="none")
    assert r2.stats["n_content_hits"] == 1
    _, _, kv = capture_prefill(model, p2)
    k = r2.kv[0][0][0, :, 141:397]
    assert float((k - kv[0][0][:, 141:397]).norm() / kv[0][0][:, 141:397].norm()) < 0.03  # codec error only
