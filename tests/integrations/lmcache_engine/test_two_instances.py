"""Two LMCache instances, one Redis Cluster: two processes, each its own ``LMCacheEngine`` with kvz's
remote connector on the same 3-master cluster (the shared ``redis_cluster`` of
tests/integrations/conftest.py) and namespace. The first stores a real Gemma 3 prefix, then exits;
the second, which shares nothing with it but the cluster, finds the chunk and retrieves it bit-exact
(lossless); a third looks up another namespace and misses."""
import json
import os
import subprocess
import sys
import textwrap
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lmcache_testlib  # noqa: E402

lmcache_testlib.require_lmcache()

WORKER = textwrap.dedent("""
    import json, sys, time, warnings
    sys.path.insert(0, {here!r})
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache_testlib import L, H, D, load_sample, lm_metadata
    from test_connector import remote_config, warm_decoder
    from kvz.integrations.lmcache import CPUBufferConnector

    role, url, out = sys.argv[1], sys.argv[2], sys.argv[3]
    ids, kv = load_sample()
    cfg = remote_config(url, lossless=True)
    cfg.local_cpu = False  # every lookup and retrieve goes to the store
    cfg.lmcache_instance_id = "kvz-" + role
    cfg.blocking_timeout_secs = 60  # LMCache gives a read 10 s by default: a loaded 2-core machine missed it once
    name = "kvz-two-" + role
    res = {{"role": role}}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        engine = LMCacheEngineBuilder.get_or_create(name, cfg, lm_metadata(), CPUBufferConnector(L, H, D, 256),
                                                    lambda t, s: None, lambda o, s: o)
        try:
            engine.post_init()
            tokens = torch.tensor(ids, dtype=torch.long)
            if role == "writer":
                res["before"] = int(engine.lookup(tokens))
                engine.store(tokens, kvcaches=kv)
                t0 = time.time()
                while engine.lookup(tokens) < 256 and time.time() - t0 < 120:
                    time.sleep(0.05)
                res["after"] = int(engine.lookup(tokens))
            else:
                warm_decoder()  # the decode kernels compiled (or loaded from numba's cache) before the read
                res["lookup"] = int(engine.lookup(tokens))
                if res["lookup"]:
                    got = [torch.zeros_like(x) for x in kv]
                    mask = engine.retrieve(tokens, kvcaches=got)
                    n = int(mask.sum())
                    res["retrieved"] = n
                    res["bit_exact"] = all(torch.equal(a[:, :n], b[:, :n]) for a, b in zip(kv, got))
                    res["rest_untouched"] = all(not b[:, n:].any() for b in got)
        finally:
            LMCacheEngineBuilder.destroy(name)
    res["warnings"] = [type(x.message).__name__ + ": " + str(x.message) for x in w
                       if "Deprecat" not in type(x.message).__name__]
    with open(out, "w") as f:
        json.dump(res, f)
    # no interpreter teardown: one run in five died of SIGSEGV (rc -11) after LMCache had logged the
    # engine destroyed (seen at 08:27 UTC, not diagnosed; reported); this test is about the store
    import os
    os._exit(0)
""")


def _instance(role, url, tmp_path):
    out = tmp_path / f"{role}.json"
    code = WORKER.format(here=os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code, role, url, str(out)], capture_output=True, text=True,
                       timeout=600, env=env, cwd=str(tmp_path))
    assert p.returncode == 0 and out.exists(), f"{role} failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(out.read_text())


def test_two_lmcache_instances_one_cluster(tmp_path, redis_cluster):
    from kvz.integrations.kvstore import open_url

    url = f"{redis_cluster.url}?namespace=lmc-{uuid.uuid4().hex[:8]}"
    w = _instance("writer", url, tmp_path)
    assert (w["before"], w["after"]) == (0, 256), w  # an empty namespace, then the sample's full chunk
    store = open_url(url)
    try:
        keys = store.keys()
        assert len(keys) == 1, keys  # the chunk: one entry, in one slot of one master
        assert redis_cluster.master_of_key(store.entry_key(keys[0])) in redis_cluster.masters()
    finally:
        store.close()
    r = _instance("reader", url, tmp_path)
    assert r["lookup"] == 256 and r["retrieved"] == 256, r
    assert r["bit_exact"] and r["rest_untouched"], r
    assert not [x for x in w["warnings"] + r["warnings"] if "Store" in x or "Kvz" in x], (w, r)
    other = _instance("reader", f"{redis_cluster.url}?namespace=lmc-{uuid.uuid4().hex[:8]}", tmp_path)
    assert other["lookup"] == 0, other  # another namespace on the same cluster: nothing to find
