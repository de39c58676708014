# ruff: noqa: F811
"""Layer-wise loads in vLLM's own engine: partial hits across two stored runs, and faults during a
load — a payload checksum flipped in one layer, an entry truncated on disk, a Redis store too slow
for the load deadline, Redis stopped between two layers. Every affected prompt is recomputed (the
blocks come back through ``get_block_ids_with_load_errors``, or the entry is a miss at lookup) and
gives the greedy tokens of an engine without a connector; no engine crashes or hangs.

Phase 1 (in parallel): an engine without a connector (the reference), a writer into a lossless
directory store, a writer into Redis. The test then damages two stored runs. Phase 2: a reader of
the directory store and a reader of Redis behind a 2 Mbit/s link with a 3 s deadline. Phase 3: a
reader of Redis behind an 8 Mbit/s link whose server the test stops once part of the load has
crossed the link, and beside it an engine whose store is a Redis Cluster that is down (no node
answers): its prompt is a miss and a warning.

On a 3-master Redis Cluster (``cluster_runs``, its own engines; ``-k "cluster and not
unreachable"`` runs only them): a reference and a writer; then two engines, one cluster (a second
engine process reads what the first stored); then a reader whose every cluster node is behind an
8 Mbit/s proxy of its own, and the test SIGKILLs the master of the stored run's slot once part of
the load has crossed that master's link."""
import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
from test_connector import BS, TEXTS, _spec, _wait

from kvz.integrations.kvstore.server import RedisServer, require_redis

pytestmark = pytest.mark.timeout(2400)


def _prompts(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    c = tok.encode((TEXTS / "c-code.txt").read_text(), add_special_tokens=False)
    m = tok.encode((TEXTS / "math-proofs.txt").read_text(), add_special_tokens=False)
    e = tok.encode((TEXTS / "english-technical.txt").read_text(), add_special_tokens=False)
    cut = lambda t, a, n: [2] + [t[(a + i) % len(t)] for i in range(n - 1)]  # noqa: E731
    p = {"F1": cut(c, 0, 600), "F2": cut(m, 0, 600), "Q1": cut(e, 2000, 300), "Q2": cut(e, 2000, 700),
         "R1": cut(m, 900, 600), "R2": cut(c, 900, 600)}
    p["Q3"] = p["Q2"][:650] + cut(m, 3000, 101)[1:]  # Q2's first 640 tokens (5 blocks), then other text
    return p


def _entry_file(store_dir, key):
    return os.path.join(store_dir, hashlib.sha256(key.encode()).hexdigest() + ".kvc")


def _run_of(out, first_block=0, blocks=None):
    runs = [r for r in out["connector"]["runs"] if r["first_block"] == first_block
            and (blocks is None or r["blocks"] == blocks)]
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gemma_hf_dir):
    require_redis()
    from kvz.benchmarks.link_proxy import LinkProxy

    tmp = tmp_path_factory.mktemp("vllm-layerwise")
    P = _prompts(gemma_hf_dir)
    cores = sorted(os.sched_getaffinity(0))
    c0, c1 = cores[0], cores[-1]
    store = str(tmp / "store")
    out = {"_P": P, "_tmp": tmp}
    with RedisServer() as srv:
        fast = LinkProxy(("127.0.0.1", srv.port), rate_bits_per_s=None).start()
        slow = LinkProxy(("127.0.0.1", srv.port), rate_bits_per_s=2e6).start()
        mid = LinkProxy(("127.0.0.1", srv.port), rate_bits_per_s=8e6).start()
        try:
            ns = {"namespace": "layerwise"}
            p1 = {"ref": _spec(tmp, "ref", gemma_hf_dir, [P[k] for k in ("F1", "F2", "Q3", "R1", "R2")], None, c0),
                  "dir_write": _spec(tmp, "dir_write", gemma_hf_dir, [P[k] for k in ("F1", "F2", "Q1", "Q2")],
                                     {"store": store, "lossless": True}, c1),
                  "redis_write": _spec(tmp, "redis_write", gemma_hf_dir, [P["R1"], P["R2"]],
                                       {"store": fast.url_for(srv.url), **ns}, c0)}
            out.update(_wait(p1))
            # damage the directory store: F1's run gets one byte of layer 9 flipped, F2's is cut short
            from alignpred import KvzReader
            from kvz.integrations.kvstore import DirectoryBackend

            be = DirectoryBackend(store)
            (f1,) = [r["key"] for r in out["dir_write"]["connector"]["runs"]][:1]
            f2 = out["dir_write"]["connector"]["runs"][1]["key"]
            src = be.open_blob(f1)
            off, n = KvzReader(src, bank="gemma-3-270m").payload_spans(9)[0]
            size = src.size
            src.close()
            path = _entry_file(store, f1)
            data = bytearray(Path(path).read_bytes())
            data[len(data) - size + off + n // 2] ^= 0x10
            Path(path).write_bytes(bytes(data))
            path2 = _entry_file(store, f2)
            Path(path2).write_bytes(Path(path2).read_bytes()[:-5000])
            p2 = {"dir_read": _spec(tmp, "dir_read", gemma_hf_dir, [P["F1"], P["F2"], P["Q3"]],
                                    {"store": store, "lossless": True, "read_only": True}, c1),
                  "redis_slow": _spec(tmp, "redis_slow", gemma_hf_dir, [P["R1"]],
                                      {"store": slow.url_for(srv.url), "read_only": True, "load_deadline_s": 3.0,
                                       **ns}, c0)}
            t0 = time.monotonic()
            out.update(_wait(p2))
            out["_phase2_s"] = time.monotonic() - t0
            # phase 3: stop the server once 400 kB of the load (of ~2 MB) have crossed the 8 Mbit/s link
            stopped = {}

            def watch():
                while mid.stats()["bytes_down"] < 400_000:
                    if stopped.get("end"):
                        return
                    time.sleep(0.01)
                stopped["at_bytes"] = mid.stats()["bytes_down"]
                srv.stop()

            w = threading.Thread(target=watch, daemon=True)
            w.start()
            # beside it, on the other core: an engine whose store is a Redis Cluster nobody serves
            out.update(_wait({"redis_stop": _spec(tmp, "redis_stop", gemma_hf_dir, [P["R2"]],
                                                  {"store": mid.url_for(srv.url), "read_only": True, **ns}, c1),
                              "cluster_down": _spec(tmp, "cluster_down", gemma_hf_dir, [P["R1"]],
                                                    {"store": "redis+cluster://127.0.0.1:1/", **ns}, c0)}))
            stopped["end"] = True
            w.join(5)
            out["_stopped"] = stopped
        finally:
            for p in (fast, slow, mid):
                p.stop()
    return out


def _tokens(r, name, i):
    return r[name]["results"][i]["tokens"]


def test_partial_hit_from_two_runs_is_exact(runs):
    """Q1 (2 blocks) then Q2 (5 blocks: 3 new) were stored as two runs; Q3 shares Q2's first 650 tokens
    and then diverges: the 5 stored blocks are loaded from both runs, lossless, the tokens exact."""
    w = runs["dir_write"]["connector"]["runs"]
    assert [(r["first_block"], r["blocks"]) for r in w][2:] == [(0, 2), (2, 3)]
    q3 = runs["dir_read"]["results"][2]
    assert q3["cached_tokens"] == 5 * BS
    # against a full prefill of Q3 (the reference computes all 750 tokens at once, the reader 110 on top of
    # the loaded 640: other matmul shapes, other rounding), the first greedy tokens agree (measured: 4 of 8)
    assert q3["tokens"][:2] == _tokens(runs, "ref", 2)[:2]
    assert q3["delta"]["loaded_blocks"] == 5 and q3["delta"]["failed_blocks"] == 0


def test_flipped_layer_is_recomputed(runs):
    f1 = runs["dir_read"]["results"][0]
    assert f1["tokens"] == _tokens(runs, "ref", 0)
    assert f1["delta"]["failed_blocks"] == 4 and f1["delta"]["loaded_blocks"] == 0
    assert any("ChecksumError" in x and "layers.9" in x for x in runs["dir_read"]["warnings"]), runs["dir_read"]["warnings"]


def test_truncated_entry_is_a_miss(runs):
    f2 = runs["dir_read"]["results"][1]
    assert f2["tokens"] == _tokens(runs, "ref", 1)
    assert f2["cached_tokens"] == 0


def test_slow_store_hits_the_deadline_and_recomputes(runs):
    r1 = runs["redis_slow"]["results"][0]
    assert r1["tokens"] == _tokens(runs, "ref", 3)
    assert r1["delta"]["failed_blocks"] == 4
    assert any("deadline" in x for x in runs["redis_slow"]["warnings"]), runs["redis_slow"]["warnings"]
    # the deadline bounds the wait: the cold prefill that follows is the rest of this request's time
    assert r1["delta"]["blocked_s"] < 3.0 + 1.0, r1["delta"]


def test_redis_stopped_between_layers_recomputes(runs):
    assert runs["_stopped"].get("at_bytes"), "the server was never stopped: the load did not cross the link"
    r2 = runs["redis_stop"]["results"][0]
    assert r2["tokens"] == _tokens(runs, "ref", 4)
    assert r2["delta"]["failed_blocks"] == 4
    st = runs["redis_stop"]["connector"]["stats"]
    assert st["profile"]["setting"] == "auto"


CLUSTER_DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory, gemma_hf_dir):
    """Engines over one 3-master Redis Cluster of the test's own (no replica: it would replicate
    through the proxies). Phase 1 (in parallel): a reference without a connector (R2) and a writer into
    the cluster (lossless: A of test_connector, then R2). Phase 2: two engines, one cluster — a second
    engine process reads A and B from it. Phase 3: a reader of R2 whose every cluster node is behind an
    8 Mbit/s proxy of its own; the test SIGKILLs the master of R2's slot once part of the load has
    crossed that master's link."""
    require_redis()
    from kvz_test_helpers import cluster_behind_proxies
    from test_connector import _prompts as connector_prompts

    from kvz.integrations.kvstore import RedisClusterBackend, RedisClusterServer
    from kvz.integrations.vllm.store import block_digest

    tmp = tmp_path_factory.mktemp("vllm-layerwise-cluster")
    P = _prompts(gemma_hf_dir)
    A, B, _ = connector_prompts(gemma_hf_dir)
    cores = sorted(os.sched_getaffinity(0))
    c0, c1 = cores[0], cores[-1]
    ns = {"namespace": "layerwise"}
    out: dict = {"_A": A}
    with RedisClusterServer(masters=3, replicas=0) as cl:
        store = {"store": cl.url, "lossless": True, **ns}
        out.update(_wait({"ref": _spec(tmp, "ref", gemma_hf_dir, [P["R2"]], None, c0),
                          "write": _spec(tmp, "write", gemma_hf_dir, [A, P["R2"]], store, c1)}))
        out.update(_wait({"two": _spec(tmp, "two", gemma_hf_dir, [A, B], {**store, "read_only": True}, c0,
                                       kl_reference="write")}))
        # where the writer's entries are: one slot, on one of the masters
        be = RedisClusterBackend(cl.url, **ns)
        try:
            out["_keys"] = be.keys()
            out["_slot_master"] = {r["key"]: cl.master_of_key(be.entry_key(r["key"]))
                                   for r in out["write"]["connector"]["runs"]}
            out["_masters"] = list(cl.masters())
        finally:
            be.close()
        (run,) = [r for r in out["write"]["connector"]["runs"]
                  if r["first_block"] == 0 and r["first_digest"] == block_digest(P["R2"][:BS])]
        victim = out["_slot_master"][run["key"]]
        out["_run"], out["_victim"] = run, victim
        threshold = max(200_000, run["bytes"] // 5)
        with cluster_behind_proxies(cl, 8e6) as (url, proxies):
            killed: dict = {}

            def watch():
                while proxies[victim].stats()["bytes_down"] < threshold:
                    if killed.get("end"):
                        return
                    time.sleep(0.01)
                killed["at_bytes"] = proxies[victim].stats()["bytes_down"]
                cl.kill(victim)

            w = threading.Thread(target=watch, daemon=True)
            w.start()
            out.update(_wait({"read": _spec(tmp, "read", gemma_hf_dir, [P["R2"]],
                                            {**store, "store": url, "read_only": True,
                                             "load_deadline_s": CLUSTER_DEADLINE_S}, c1)}))
            killed["end"] = True
            w.join(5)
            out["_killed"] = killed
    return out


def test_cluster_second_engine_gives_the_single_engine_tokens(cluster_runs):
    """Two engines, one cluster: the second engine process loads every full block of A that the first
    stored, and its greedy tokens are the first's (which computed A itself: what one engine alone
    gives); B shares A's first 300 tokens and takes their two full blocks."""
    w, r = cluster_runs["write"]["results"], cluster_runs["two"]["results"]
    A = cluster_runs["_A"]
    assert w[0]["cached_tokens"] == 0
    assert r[0]["cached_tokens"] == (len(A) - 1) // BS * BS == 512
    assert r[0]["tokens"] == w[0]["tokens"], "the second engine's greedy tokens differ from a single engine's"
    assert r[0]["kl_vs_reference"] is not None and r[0]["kl_vs_reference"] < 0.01, r[0]["kl_vs_reference"]
    # B's tokens are not compared: a partial hit computes the rest of the prompt in other matmul shapes
    # than a full prefill, and greedy decoding follows the rounding (measured: the first token differed)
    assert r[1]["cached_tokens"] == 300 // BS * BS == 256
    assert cluster_runs["two"]["connector"]["timings"]["loaded_blocks"] == 4 + 2
    warned = [x for x in cluster_runs["two"]["warnings"] + cluster_runs["write"]["warnings"]
              if x.startswith(("KvzVllmWarning", "Store"))]  # "Category: message"
    assert not warned, warned


def test_cluster_holds_the_prefix(cluster_runs):
    """The writer's runs are entries of the namespace on the cluster (each in one slot, on a master),
    and the second engine found them there, not in anything the two processes share besides it."""
    written = [x["key"] for x in cluster_runs["write"]["connector"]["runs"]]
    assert len(written) == 2 and set(written) <= set(cluster_runs["_keys"]), (written, cluster_runs["_keys"])
    assert set(cluster_runs["_slot_master"].values()) <= set(cluster_runs["_masters"])
    assert cluster_runs["two"]["connector"].get("runs", []) == []  # read-only: it stored nothing


def test_redis_cluster_master_killed_between_layers_recomputes(cluster_runs):
    """The master that holds the run's slot dies while the load crosses its link: the load's blocks
    come back through get_block_ids_with_load_errors and are recomputed, the greedy tokens are the
    no-connector engine's, and the forward waited no longer than the load deadline."""
    r = cluster_runs
    assert r["_killed"].get("at_bytes"), "the master was never killed: the load did not cross its link"
    run = r["_run"]
    assert run["blocks"] == 4, run
    got = r["read"]["results"][0]
    print("killed at", r["_killed"]["at_bytes"], "of", run["bytes"], "bytes; delta", json.dumps(got["delta"])[:400])
    print("reader warnings:", r["read"]["warnings"][:6])
    assert got["tokens"] == _tokens(r, "ref", 0)
    assert got["delta"]["failed_blocks"] == 4 and got["delta"]["loaded_blocks"] == 0, got["delta"]
    assert got["delta"]["blocked_s"] < CLUSTER_DEADLINE_S + 1.0, got["delta"]


def test_unreachable_redis_cluster_is_a_miss_with_warning(runs):
    """The cluster variant of test_connector's ``down`` store: no node answers; the engine starts,
    computes the prompt itself (the no-connector engine's tokens) and warns, never crashes."""
    d = runs["cluster_down"]
    r = d["results"][0]
    assert r["cached_tokens"] == 0
    assert r["tokens"] == _tokens(runs, "ref", 3)
    assert any("Unavailable" in x or "KvzVllmWarning" in x for x in d["warnings"]), d["warnings"]


def test_writers_chose_a_profile_and_report_it(runs):
    for name in ("dir_write", "redis_write"):
        prof = runs[name]["connector"]["stats"]["profile"]
        assert prof["profile"] in ("default", "balanced", "fast"), prof
        assert prof["decode_values_per_s"] and prof["read_bytes_per_s"] > 0, prof
        print(name, json.dumps(prof)[:600])
