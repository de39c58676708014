"""The chunk store on a Redis Cluster (integrations/kvstore/cluster.py) under the conditions a fleet meets:
entries spread over masters, TTL, a master killed during reads and saves, failover to its replica and
its return, a node that stops answering, a slot migrated while it is read, maxmemory eviction, wrong
password, missing ACL permission, an unreachable cluster, records of another store format, open_url.

Every cluster is real: redis-server processes on free loopback ports (RedisClusterServer); without
redis-server (or the redis package) the tests are skipped, with KVZ_REQUIRE_REDIS=1 they fail. The
backend-contract tests run against the cluster in test_kvstore.py (parametrized).
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
import warnings
from collections import Counter

import pytest

from kvz.integrations.kvstore import (
    DirectoryBackend,
    RedisBackend,
    RedisClusterBackend,
    RedisClusterServer,
    StoreAccessWarning,
    StoreError,
    StoreReadError,
    StoreUnavailableError,
    StoreUnavailableWarning,
    StoreWarning,
    open_url,
)
from kvz.integrations.kvstore.server import _free_port, require_redis

# ``redis_cluster`` (one 3-master cluster per session) and ``redis_server``: tests/integrations/conftest.py


# the least a store's user needs (docs/store-cluster.md): its namespace's keys and these commands
ACL_RULES = ("on >pw ~{kvz* resetchannels -@all +@read +@write +@scripting +@connection +cluster|slots "
             "+cluster|shards +cluster|info +cluster|myid +info +scan +unlink")


def fresh_cluster(**kw):
    """A cluster of the test's own (one it may break)."""
    require_redis()
    return RedisClusterServer(**kw).start()


def ns() -> str:
    return "t" + uuid.uuid4().hex[:10]


def blob_for(key: str, version: int = 0, size: int = 3000) -> bytes:
    """A blob that names its key and version and carries the sha256 of its payload."""
    payload = hashlib.sha256(f"{key}|{version}".encode()).digest() * (size // 32)
    return f"{key}|{version}|{hashlib.sha256(payload).hexdigest()}\n".encode() + payload


def wrong(key: str, blob: bytes | None, versions=range(1000)) -> str | None:
    """None if ``blob`` is a miss or exactly a blob written for ``key``; else what is wrong."""
    if blob is None:
        return None
    head, _, payload = blob.partition(b"\n")
    try:
        k, v, sha = head.decode().split("|")
    except ValueError:
        return f"{key}: unparseable"
    if k != key:
        return f"{key}: holds {k}"
    if hashlib.sha256(payload).hexdigest() != sha or blob != blob_for(key, int(v), len(payload) // 32 * 32 + 0):
        return f"{key}: payload does not match"
    return None


def caught_warnings():
    cm = warnings.catch_warnings(record=True)
    caught = cm.__enter__()
    warnings.simplefilter("always")
    return cm, caught


# ---- URLs -------------------------------------------------------------------------------------------
def test_open_url_kinds_and_parameters(tmp_path, monkeypatch):
    d = open_url(str(tmp_path / "d"), budget_bytes=1000, namespace="ignored")
    assert isinstance(d, DirectoryBackend) and d.budget_bytes == 1000
    assert isinstance(open_url("file://" + str(tmp_path / "f")), DirectoryBackend)
    r = open_url("redis://127.0.0.1:1/0?namespace=m1&ttl_s=5&budget_gb=0.5&policy=importance")
    assert isinstance(r, RedisBackend) and not isinstance(r, RedisClusterBackend)
    assert (r.namespace, r.ttl_s, r.budget_bytes, r.policy) == ("m1", 5.0, 1 << 29, "importance")
    assert open_url("redis://127.0.0.1:1/0?namespace=m1", namespace="m2").namespace == "m2"  # keywords win
    c = open_url("redis+cluster://u:s3cret@10.0.0.1:7000,10.0.0.2:7001/?namespace=m3&shards=8")
    assert isinstance(c, RedisClusterBackend) and (c.namespace, c.shards) == ("m3", 8)
    assert "s3cret" not in repr(c) and "s3cret" not in c.url and "u:***@" in c.url
    assert isinstance(open_url("rediss+cluster://h:1/"), RedisClusterBackend)
    monkeypatch.setenv("KVZ_REDIS_PASSWORD", "from-env")
    e = open_url("redis+cluster://h:1/")
    assert e._password == "from-env" and "from-env" not in repr(e)
    for bad in ("redis+cluster://h:notaport/", "redis+cluster:///", "redis://h:1/0?ttl_s=x"):
        with pytest.raises(StoreError):
            open_url(bad)
    with pytest.raises(StoreError, match="shards"):
        RedisClusterBackend("redis+cluster://h:1/", shards=0)
    with pytest.raises(StoreError, match="URL"):
        RedisClusterBackend("redis://h:1/0")
    with pytest.raises(StoreError):
        open_url("")
    # engine configurations give the budget in GiB, as a string (LMCache max_size_gb, SGLang kvz_max_size_gb)
    assert open_url(str(tmp_path / "g"), budget_gb="0.25").budget_bytes == 1 << 28
    assert open_url(str(tmp_path / "g"), budget_gb=1, budget_bytes=7).budget_bytes == 7  # bytes win
    assert open_url(str(tmp_path / "g"), budget_gb="").budget_bytes is None
    assert open_url(str(tmp_path / "g"), budget_gb=0).budget_bytes is None  # 0: no budget (max_size_gb: 0)
    assert open_url(str(tmp_path / "g"), budget_gb="0").budget_bytes is None
    with pytest.raises(StoreError, match=">= 0"):
        open_url(str(tmp_path / "g"), budget_gb="-1")
    with pytest.raises(StoreError, match="GiB"):
        open_url(str(tmp_path / "g"), budget_gb="lots")


# ---- layout -----------------------------------------------------------------------------------------
def test_entries_spread_over_masters_one_slot_each(redis_cluster):
    s = RedisClusterBackend(redis_cluster.url, namespace=ns())
    keys = [f"k{i}" for i in range(160)]
    for k in keys:
        assert s.put(k, blob_for(k))
    per_master = Counter(redis_cluster.master_of_key(s.entry_key(k)) for k in keys)
    assert len(per_master) == 3 and min(per_master.values()) > 160 / 3 * 0.6, per_master
    from redis.crc import key_slot
    for k in keys[:20]:  # an entry and its shard's bookkeeping: one slot
        sk = s._keys_of(s._shard_of(k.encode()), k.encode())
        assert len({key_slot(x if isinstance(x, bytes) else x.encode()) for x in sk}) == 1
    assert all(wrong(k, s.get(k)) is None and s.get(k) is not None for k in keys)
    st = s.store_stats()
    assert st["entries"] == 160 and st["puts"] == 160 and st["hits"] == 320 and st["server"]["nodes"] == 3
    s.clear()
    assert s.store_stats()["entries"] == 0
    s.close()


def test_budget_holds_across_shards(redis_cluster):
    one = len(blob_for("k0")) + 100
    s = RedisClusterBackend(redis_cluster.url, namespace=ns(), budget_bytes=20 * one)
    for i in range(100):
        assert s.put(f"k{i}", blob_for(f"k{i}"))
        assert s.stats()["bytes"] <= s.budget_bytes
    st = s.store_stats()
    assert st["evicted"] == 100 - st["entries"] and 15 <= st["entries"] <= 20
    live = set(s.keys())
    assert live <= {f"k{i}" for i in range(80, 100)} | {f"k{i}" for i in range(60, 100)}  # the newest stay
    s.close()


def test_ttl_expires_whole_entries(redis_cluster):
    s = RedisClusterBackend(redis_cluster.url, namespace=ns(), ttl_s=0.3)
    for i in range(10):
        s.put(f"k{i}", blob_for(f"k{i}"))
    assert s.get("k0") is not None
    time.sleep(0.5)
    assert all(s.get(f"k{i}") is None for i in range(5))
    assert s.store_stats()["lost"] == 5
    assert s.gc()["stale"] == 5  # the bookkeeping of the five never read again
    st = s.store_stats()
    assert (st["entries"], st["bytes"]) == (0, 0)
    s.close()


def test_foreign_record_version_is_a_miss_with_a_warning(redis_cluster, tmp_path):
    for s in (RedisClusterBackend(redis_cluster.url, namespace=ns()), DirectoryBackend(str(tmp_path / "d"))):
        s.put("k", b"payload")
        if isinstance(s, DirectoryBackend):
            p = s.entry_path("k")
            raw = bytearray(open(p, "rb").read())
            raw[4] = 2  # the record version byte
            open(p, "wb").write(bytes(raw))
        else:
            c = s._get_client()
            raw = bytearray(c.get(s.entry_key("k")))
            raw[4] = 2
            c.set(s.entry_key("k"), bytes(raw))
        with pytest.warns(StoreWarning, match="another kvz store format"):
            assert s.get("k") is None
        with pytest.warns(StoreWarning, match="another kvz store format"):
            assert s.open_blob("k") is None
        assert s.contains("k")  # left for the kvz that wrote it
        assert s.stats()["foreign"] == 2 and s.stats()["corrupt_dropped"] == 0
        assert s.store_stats()["foreign"] == (2 if s.kind != "directory" else 2)
        s.close()


# ---- faults -----------------------------------------------------------------------------------------
def test_master_killed_during_reads_and_saves_then_failover_and_return():
    """A master is SIGKILLed while 2 threads read and 1 writes: no call raises, no read is wrong, the
    dead master's shards miss and refuse puts until its replica takes over, one warning per outage;
    after the failover every shard works again, and the old master rejoins as a replica."""
    cl = fresh_cluster()
    try:
        s = RedisClusterBackend(cl.url, namespace=ns(), reconnect_interval=0.2)
        keys = [f"k{i}" for i in range(96)]
        for k in keys:
            assert s.put(k, blob_for(k))
        time.sleep(0.2)  # let the replicas catch up (replication is asynchronous)
        stop = threading.Event()
        errors, bad, counts = [], [], Counter[str]()

        def reader(r):
            try:
                i = r
                while not stop.is_set():
                    k = keys[i % len(keys)]
                    b = s.get(k)
                    counts["hit" if b is not None else "miss"] += 1
                    e = wrong(k, b)
                    if e:
                        bad.append(e)
                    i += 7
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        def writer():
            try:
                v = 1
                while not stop.is_set():
                    for k in keys[::4]:
                        counts["put_ok" if s.put(k, blob_for(k, v)) else "put_refused"] += 1
                    v += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        victim = cl.master_of_key(s.entry_key(keys[0]))
        cm, caught = caught_warnings()
        try:
            threads = [threading.Thread(target=reader, args=(r,)) for r in range(2)] + [threading.Thread(target=writer)]
            for t in threads:
                t.start()
            time.sleep(0.3)
            t_kill = time.monotonic()
            cl.kill(victim)
            time.sleep(0.5)
            during = Counter(counts)
            cl.wait_ok(timeout=30)
            failover_s = time.monotonic() - t_kill
            time.sleep(1.0)  # the client finds the new master
            stop.set()
            for t in threads:
                t.join(30)
        finally:
            cm.__exit__(None, None, None)
        assert not errors, errors
        assert not bad, bad[:5]
        assert during["miss"] > 0 and during["hit"] > 0  # the dead master's shards missed, the others did not
        unavailable = [w for w in caught if issubclass(w.category, StoreUnavailableWarning)]
        assert len(unavailable) == 1, [str(w.message) for w in unavailable]  # one per outage
        assert failover_s < 15
        # after the failover: every shard answers; what was replicated is still there, and correct
        got = {k: s.get(k) for k in keys}
        assert all(wrong(k, b) is None for k, b in got.items())
        assert sum(b is not None for b in got.values()) >= len(keys) // 2
        with warnings.catch_warnings(record=True) as late:
            warnings.simplefilter("always")
            refused = list(keys)
            deadline = time.monotonic() + 10  # the client may need a topology refresh or two
            while refused and time.monotonic() < deadline:
                refused = [k for k in refused if not s.put(k, blob_for(k, 999))]
                time.sleep(0.1 if refused else 0)
        assert not refused, (refused, [str(w.message) for w in late], s.stats())
        assert all(s.get(k) == blob_for(k, 999) for k in keys)
        cl.restart(victim)  # comes back empty, as a replica of the node that took over
        cl.wait_ok(timeout=30)
        assert victim not in cl.masters()
        assert all(s.get(k) == blob_for(k, 999) for k in keys)
        assert s.gc()["orphans"] == 0
        s.close()
    finally:
        cl.close()


def test_ranged_read_of_a_dead_master_raises_store_read_error():
    cl = fresh_cluster(replicas=0)
    try:
        s = RedisClusterBackend(cl.url, namespace=ns(), reconnect_interval=0)
        s.put("k", os.urandom(50_000))
        b = s.open_blob("k")
        assert b is not None and len(b.read_range(0, 100)) == 100
        cl.kill(cl.master_of_key(s.entry_key("k")))
        with pytest.warns(StoreUnavailableWarning), pytest.raises(StoreReadError):
            b.read_range(100, 100)
        t0 = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert s.get("k") is None and s.open_blob("k") is None and s.put("k", b"x") is False
        assert time.monotonic() - t0 < 10
        s.close()
    finally:
        cl.close()


def test_node_that_stops_answering_is_a_bounded_miss():
    """A master SIGSTOPped (a network partition of that node): calls on its shards give up after
    the socket timeout and answer misses; the other shards keep working; it comes back."""
    cl = fresh_cluster(replicas=0, node_timeout_ms=5000)
    try:
        s = RedisClusterBackend(cl.url, namespace=ns(), socket_timeout=0.5, reconnect_interval=0.5)
        keys = [f"k{i}" for i in range(48)]
        for k in keys:
            s.put(k, blob_for(k))
        victim = cl.master_of_key(s.entry_key(keys[0]))
        on_victim = [k for k in keys if cl.master_of_key(s.entry_key(k)) == victim]
        others = [k for k in keys if k not in on_victim]
        cl.pause(victim)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.monotonic()
                assert s.get(on_victim[0]) is None
                assert time.monotonic() - t0 < 5
                t0 = time.monotonic()
                assert all(s.get(k) == blob_for(k) for k in others)
                assert all(s.get(k) is None for k in on_victim)
                assert time.monotonic() - t0 < 20
            assert len([w for w in caught if issubclass(w.category, StoreUnavailableWarning)]) == 1
        finally:
            cl.resume(victim)
        time.sleep(0.6)
        assert all(s.get(k) == blob_for(k) for k in keys)
        s.close()
    finally:
        cl.close()


def test_slot_migration_while_reading(redis_cluster):
    """A shard's slot moves to another master (batches of keys, ASK redirects meanwhile) while a
    thread reads it: every read is the entry or a miss, never wrong; afterwards all are there."""
    s = RedisClusterBackend(redis_cluster.url, namespace=ns(), shards=2)
    keys = [f"k{i}" for i in range(60)]
    for k in keys:
        s.put(k, blob_for(k, size=2000))
    from redis.crc import key_slot
    slot = key_slot(s._tags[0].encode())
    src = redis_cluster.master_of_slot(slot)
    dst = next(i for i in redis_cluster.masters() if i != src)
    stop, bad, errors, counts = threading.Event(), [], [], Counter[str]()

    def reader():
        try:
            i = 0
            while not stop.is_set():
                k = keys[i % len(keys)]
                b = s.get(k)
                counts["hit" if b is not None else "miss"] += 1
                if wrong(k, b):
                    bad.append(wrong(k, b))
                i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    t = threading.Thread(target=reader)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t.start()
        try:
            moved = redis_cluster.migrate_slot(slot, dst, batch=5, pause_s=0.05)
        finally:
            stop.set()
            t.join(30)
    assert moved > 5 and not errors and not bad, (errors, bad[:3])
    assert counts["hit"] > 0
    assert redis_cluster.master_of_slot(slot) == dst
    assert all(s.get(k) == blob_for(k, size=2000) for k in keys)
    redis_cluster.migrate_slot(slot, src)  # put it back for the other tests
    s.clear()
    s.close()


@pytest.mark.parametrize("policy, ttl_s", [("allkeys-lru", None), ("volatile-ttl", 3600.0)])
def test_maxmemory_eviction_is_a_whole_entry_miss_and_gc_leaves_no_orphans(policy, ttl_s):
    """allkeys-lru evicts entries (and sometimes bookkeeping); volatile-ttl with ttl_s evicts entries
    only (the bookkeeping has no TTL): every read is the whole entry or a miss, the store counts what
    it found gone, and gc leaves entries and bookkeeping consistent."""
    cl = fresh_cluster(replicas=0, args=["--maxmemory", "3mb", "--maxmemory-policy", policy])
    try:
        s = RedisClusterBackend(cl.url, namespace=ns(), ttl_s=ttl_s)
        keys = [f"k{i}" for i in range(400)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k in keys:
                s.put(k, blob_for(k, size=40_000))  # 16 MB into 3 x 3 MB
            got = {k: s.get(k) for k in keys}
        assert all(wrong(k, b) is None for k, b in got.items())
        hits = sum(b is not None for b in got.values())
        assert 0 < hits < len(keys)
        st = s.store_stats()
        assert st["server"]["evicted_keys"] > 0 and st["lost"] > 0
        passes = []
        for _ in range(4):  # the server may still evict while the first pass runs (memory is at its limit)
            passes.append(s.gc())
            if passes[-1]["orphans"] == passes[-1]["stale"] == 0:
                break
        assert passes[-1]["orphans"] == passes[-1]["stale"] == 0, passes
        if policy.startswith("volatile"):  # only entries were evicted: nothing left without bookkeeping
            assert all(p["orphans"] == 0 for p in passes), passes
        g = passes[0]
        c = s._get_client()
        live = {bytes(k) for k in c.scan_iter(match=s._entry_pattern())}
        assert len(live) == s.store_stats()["entries"] == len(s.keys()), g
        s.close()
    finally:
        cl.close()


# ---- access control ---------------------------------------------------------------------------------
def test_wrong_password_missing_acl_and_unreachable(monkeypatch):
    """Each is one clear warning and misses through the backend engines use; check() (what
    `kvz store stats` calls) raises StoreUnavailableError with a one-line reason."""
    cl = fresh_cluster(replicas=0, password="right-pw",
                       users={"kvz": ACL_RULES.replace("{kvz*", "{allowed*").replace(">pw", ">kvz-pw"),
                              "reader": "on >r-pw ~* -@all +ping +info"})
    try:
        good = RedisClusterBackend(cl.url.replace("://", "://default:right-pw@"), namespace="allowed")
        assert good.put("k", b"v") and good.get("k") == b"v" and good.check()["entries"] == 1
        monkeypatch.setenv("KVZ_REDIS_PASSWORD", "right-pw")
        assert open_url(cl.url + "?namespace=allowed").get("k") == b"v"  # the password from the environment
        monkeypatch.delenv("KVZ_REDIS_PASSWORD")
        cases = {
            "wrong password": (cl.url.replace("://", "://default:wrong-pw@"), "allowed", StoreAccessWarning,
                               "authentication failed"),
            "no password": (cl.url, "allowed", StoreAccessWarning, "authentication failed"),
            "ACL: other keys": (cl.url.replace("://", "://kvz:kvz-pw@"), "denied", StoreAccessWarning,
                                "permission denied"),
            "ACL: no commands": (cl.url.replace("://", "://reader:r-pw@"), "allowed", StoreAccessWarning,
                                 "permission denied"),
            "unreachable": (f"redis+cluster://127.0.0.1:{_free_port('127.0.0.1')}/", "allowed",
                            StoreUnavailableWarning, "unreachable"),
        }
        for name, (url, namespace, category, text) in cases.items():
            s = RedisClusterBackend(url, namespace=namespace, reconnect_interval=0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.monotonic()
                assert s.get("k") is None and s.put("k2", b"x") is False and s.open_blob("k") is None, name
                assert s.get("k") is None and s.contains("k") is False, name
                assert time.monotonic() - t0 < 10, name
            ours = [w for w in caught if issubclass(w.category, StoreWarning)]
            assert len(ours) == 1 and issubclass(ours[0].category, category), (name, [str(w.message) for w in ours])
            msg = str(ours[0].message)
            assert text in msg and "pw" not in msg.replace("***", ""), (name, msg)
            with pytest.raises(StoreUnavailableError, match=text):
                s.check()
            s.close()
            r = run_cli("store", "stats", url, "--namespace", namespace)  # the CLI: one error line, exit 1
            lines = r.stderr.strip().splitlines()
            assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("Error: ") and text in lines[0], \
                (name, r.stderr)
            assert "pw" not in lines[0].replace("***", "") and r.stdout == ""
        # the allowed user on its own keys works
        ok = RedisClusterBackend(cl.url.replace("://", "://kvz:kvz-pw@"), namespace="allowed")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert ok.put("k3", b"w") and ok.get("k3") == b"w"
        ok.close()
        good.close()
    finally:
        cl.close()


def make_certs(d) -> dict:
    """A CA and a server certificate for 127.0.0.1 (openssl on PATH, else the test is skipped)."""
    import shutil
    import subprocess

    if not shutil.which("openssl"):
        pytest.skip("openssl not on PATH (needed to make test certificates)")
    d = str(d)

    def ssl(*a):
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=kvz-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    with open(os.path.join(d, "ext.cnf"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out", "srv.crt",
        "-days", "2", "-extfile", "ext.cnf")
    return {"cert": os.path.join(d, "srv.crt"), "key": os.path.join(d, "srv.key"), "ca": os.path.join(d, "ca.crt")}


def test_tls_cluster(tmp_path, monkeypatch):
    """rediss+cluster:// with the CA from the URL or KVZ_REDIS_CA_CERTS; without it, one warning
    that names TLS and misses."""
    require_redis()
    tls = make_certs(tmp_path)
    try:
        cl = RedisClusterServer(replicas=0, tls=tls).start()
    except RuntimeError as e:
        pytest.skip(f"this redis-server has no TLS: {str(e)[:200]}")
    try:
        s = open_url(cl.tls_url + "&namespace=tls")
        assert isinstance(s, RedisClusterBackend) and s.put("k", b"over tls") and s.get("k") == b"over tls"
        assert s.check()["entries"] == 1
        s.close()
        bare = cl.tls_url.split("?")[0]
        monkeypatch.setenv("KVZ_REDIS_CA_CERTS", tls["ca"])
        assert open_url(bare + "?namespace=tls").get("k") == b"over tls"
        monkeypatch.delenv("KVZ_REDIS_CA_CERTS")
        s = open_url(bare + "?namespace=tls", reconnect_interval=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert s.get("k") is None and s.put("k", b"x") is False
        ours = [str(w.message) for w in caught if issubclass(w.category, StoreWarning)]
        assert len(ours) == 1 and "TLS" in ours[0], ours
        with pytest.raises(StoreUnavailableError, match="TLS"):
            s.check()
    finally:
        cl.close()


# ---- kvz store stats / gc ------------------------------------------------------------------------------
def run_cli(*args):
    import inspect

    from click.testing import CliRunner

    from kvz.cli.main import cli

    # click < 8.2 mixes stderr into stdout unless told not to; 8.2 keeps them apart (and has no mix_stderr)
    kw: dict = {"mix_stderr": False} if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters else {}
    runner = CliRunner(**kw)
    return runner.invoke(cli, list(args), catch_exceptions=False)


def test_cli_store_stats_and_gc(redis_cluster, redis_server, tmp_path):
    import json

    namespace = ns()
    stores: dict[str, tuple] = {"directory": (str(tmp_path / "d"), DirectoryBackend(str(tmp_path / "d"))),
              "redis": (redis_server.url, RedisBackend(redis_server.url, namespace=namespace)),
              "redis-cluster": (redis_cluster.url, RedisClusterBackend(redis_cluster.url, namespace=namespace))}
    for kind, (url, s) in stores.items():
        for i in range(5):
            s.put(f"k{i}", blob_for(f"k{i}"))
        s.get("k0"), s.get("k1"), s.get("nope")
        if kind == "directory":
            open(os.path.join(url, ".tmp-dead-writer"), "wb").close()
            t = time.time() - 120  # older than gc's minute (a scan drops those older than an hour by itself)
            os.utime(os.path.join(url, ".tmp-dead-writer"), (t, t))
        else:  # an entry whose bookkeeping the server evicted, and bookkeeping whose entry it evicted
            c = s._get_client()
            ek = s.entry_key("k2")
            sh = s._shard_of(b"k3")
            c.zrem(s._keys_of(sh)[1], "k3")
            c.delete(ek)
        s.close()
        r = run_cli("store", "stats", url, "--namespace", namespace, "--json")
        assert r.exit_code == 0, r.stderr
        st = json.loads(r.stdout)
        assert (st["backend"], st["hits"], st["misses"], st["corrupt"]) == (kind, 2, 1, 0), st
        assert {"entries", "bytes", "evicted", "lost", "puts"} <= set(st) and st["puts"] == 5
        r = run_cli("store", "gc", url, "--namespace", namespace, "--json")
        assert r.exit_code == 0, r.stderr
        g = json.loads(r.stdout)
        assert (g["orphans"], g["stale"]) == ((1, 0) if kind == "directory" else (1, 1)), (kind, g)
        again = json.loads(run_cli("store", "gc", url, "--namespace", namespace, "--json").stdout)
        assert again["orphans"] == again["stale"] == 0
        r = run_cli("store", "stats", url, "--namespace", namespace)
        assert r.exit_code == 0 and "entries  " + str(5 if kind == "directory" else 3) in r.stdout, r.stdout
    r = run_cli("store", "stats", str(tmp_path / "missing"))
    assert r.exit_code == 1 and r.stderr.startswith("Error: no store directory")


# ---- what the adapters build on a cluster -------------------------------------------------------------
def test_chunk_store_over_the_cluster(redis_cluster):
    import numpy as np

    from alignpred.cache.rope import RopeSpec
    from kvz.integrations.chunkstore import ChunkStore

    st = ChunkStore(open_url(redis_cluster.url + f"?namespace={ns()}"), model_id="synthetic",
                    layer_types=["full_attention"] * 2, rope=RopeSpec.from_thetas([1e4] * 2, head_dim=8),
                    shape=(2, 2, 8), codec="raw", chunk_tokens=8, raw_dtype="float32")
    ids = list(range(100, 124))
    rng = np.random.default_rng(0)
    chunks = st.chunks(ids)
    kv = {c.prefix_key: [(rng.standard_normal((2, c.n, 8)).astype(np.float32),
                          rng.standard_normal((2, c.n, 8)).astype(np.float32)) for _ in range(2)] for c in chunks}
    for c in chunks:
        st.put(c, kv[c.prefix_key], ids[c.start:c.end], exact=True)
    hits = st.lookup(ids, chunks)
    assert [h.kind for h in hits] == ["prefix"] * 3
    for h in hits:
        want = kv[h.chunk.prefix_key]
        got = [(np.zeros_like(k), np.zeros_like(v)) for k, v in want]
        st.decode_into(h, lambda i: got[i])
        assert all(np.array_equal(a, b) for (k, v), (gk, gv) in zip(want, got) for a, b in ((k, gk), (v, gv)))
    st.backend.clear()
    st.backend.close()


# ---- the soak benchmark (benchmarks/store_soak.py), short ------------------------------------------------
@pytest.mark.slow  # spawns processes and a cluster for ~25 s; CI's slow pass runs it
def test_store_soak_short_run(tmp_path):
    import json

    require_redis()
    from kvz.benchmarks import store_soak

    out = tmp_path / "soak.json"
    rc = store_soak.main(["--writers", "2", "--readers", "2", "--seconds", "10", "--keys", "200",
                          "--budget-mb", "4", "--json", str(out), "--md", str(tmp_path / "soak.md")])
    r = json.loads(out.read_text())
    assert rc == 0 and r["processes_failed"] == 0, r["tracebacks"]
    assert r["wrong_reads"] == r["partial_reads"] == 0 and r["orphaned_parts_after_gc"] == 0
    assert r["leaked_bytes_after_gc"] == 0 and r["hits"] > 0 and r["puts_ok"] > 0
    assert r["fault"]["failover_s"] < 30 and r["fault"]["rejoined_as"] == "replica"
    assert r["store_stats"]["bytes"] <= 4 << 20
