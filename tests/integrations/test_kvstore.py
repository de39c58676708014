"""The chunk store's storage layer: one suite run against every backend (directory, one Redis node,
a Redis Cluster of 3 masters with a replica each).

The Redis parts start real redis-server processes on loopback (kvz.integrations.kvstore.server);
without redis-server on PATH (or the redis package) they are skipped, and with KVZ_REQUIRE_REDIS=1
they fail.
"""
import doctest
import hashlib
import math
import multiprocessing as mp
import os
import random
import threading
import time
import traceback
import uuid
import warnings

import pytest

from kvz.integrations.kvstore import (
    ChunkBackend,
    DirectoryBackend,
    RedisBackend,
    RedisClusterBackend,
    StoreError,
    StoreUnavailableWarning,
    StoreWarning,
    entry_size,
    open_url,
)
from kvz.integrations.kvstore import directory as directory_module
from kvz.integrations.kvstore.server import RedisServer, require_redis

KINDS = ("directory", "redis", "redis-cluster")  # the servers: tests/integrations/conftest.py (shared)


class Harness:
    """Makes stores of one kind (closed at teardown) and reaches into their raw storage."""

    def __init__(self, kind, tmp_path, request):
        self.kind = kind
        self.dir = str(tmp_path / "store")
        self.namespace = "t" + uuid.uuid4().hex[:12]
        self.url = (request.getfixturevalue("redis_server").url if kind == "redis" else
                    request.getfixturevalue("redis_cluster").url if kind == "redis-cluster" else None)
        self.created = []

    def fresh(self):
        """Point later stores at a new, empty location."""
        self.dir += "-" + uuid.uuid4().hex[:6]
        self.namespace = "t" + uuid.uuid4().hex[:12]

    def spec(self, **kw):
        return {"kind": self.kind, "path": self.dir, "url": self.url, "namespace": self.namespace, **kw}

    def make(self, **kw) -> ChunkBackend:
        store = open_store(self.spec(), **kw)
        self.created.append(store)
        return store

    def raw(self, store, key) -> bytes:
        if self.kind == "directory":
            with open(store.entry_path(key), "rb") as f:
                return f.read()
        return store._get_client().get(store.entry_key(key))

    def write_raw(self, store, key, data: bytes) -> None:
        if self.kind == "directory":
            with open(store.entry_path(key), "wb") as f:  # in place: what a torn write would leave
                f.write(data)
        else:
            store._get_client().set(store.entry_key(key), data)


def open_store(spec, **kw):
    if spec["kind"] == "directory":
        return DirectoryBackend(spec["path"], **kw)
    if spec["kind"] == "redis-cluster":
        return RedisClusterBackend(spec["url"], namespace=spec["namespace"], **kw)
    return RedisBackend(spec["url"], namespace=spec["namespace"], **kw)


@pytest.fixture(params=KINDS)
def h(request, tmp_path):
    harness = Harness(request.param, tmp_path, request)
    yield harness
    for store in harness.created:
        try:
            store.clear()
        except StoreError:
            pass  # already closed
        store.close()


# ---- basic operations ------------------------------------------------------------------------
def test_round_trip_and_miss(h):
    s = h.make()
    blob = os.urandom(5000)
    assert s.put("a1b2", blob, meta={"tokens": 16, "model": "gemma"}, importance=2.5) is True
    assert s.get("a1b2") == blob
    e = s.get_entry("a1b2")
    assert (e.key, e.blob, e.meta, e.importance) == ("a1b2", blob, {"tokens": 16, "model": "gemma"}, 2.5)
    assert e.size == entry_size("a1b2", blob, {"tokens": 16, "model": "gemma"})
    assert s.get("ffff") is None and s.get_entry("ffff") is None
    assert s.contains("a1b2") and not s.contains("ffff")
    # any key, not only hex; empty and memoryview blobs
    for key in ("not/hex\\..:*?\"<>|", "ключ-ünïcode", "x" * 4096):
        assert s.put(key, memoryview(b"abc")) and s.get(key) == b"abc"
    assert s.put("empty", b"") and s.get("empty") == b"" and s.get_entry("empty").meta == {}
    assert sorted(s.keys()) == sorted(["a1b2", "not/hex\\..:*?\"<>|", "ключ-ünïcode", "x" * 4096, "empty"])


def test_overwrite_delete_clear(h):
    s = h.make()
    assert s.put("k", b"one", meta={"v": 1}) and s.put("k", b"two!", meta={"v": 2}, importance=0.5)
    e = s.get_entry("k")
    assert (e.blob, e.meta, e.importance) == (b"two!", {"v": 2}, 0.5)
    assert s.stats()["entries"] == 1 and s.stats()["bytes"] == entry_size("k", b"two!", {"v": 2})
    assert s.delete("k") is True and s.delete("k") is False
    assert s.get("k") is None and not s.contains("k") and s.keys() == []
    for i in range(5):
        s.put(f"c{i}", b"x" * 10)
    assert len(s.keys()) == 5
    s.clear()
    assert s.keys() == [] and s.stats()["entries"] == 0 and s.stats()["bytes"] == 0
    assert s.put("c0", b"again") and s.get("c0") == b"again"


def test_stats_counters(h):
    s = h.make()
    st = s.stats()
    assert st["backend"] == h.kind and st["policy"] == "lru" and st["budget_bytes"] is None
    assert {k: st[k] for k in ("entries", "bytes", "hits", "misses", "puts", "refused", "evictions",
                               "corrupt_dropped", "errors")} == dict.fromkeys(
        ("entries", "bytes", "hits", "misses", "puts", "refused", "evictions", "corrupt_dropped", "errors"), 0)
    s.put("a", b"12345")
    s.put("b", b"123")
    s.get("a"), s.get("a"), s.get("zz"), s.get_entry("b")
    s.delete("b")
    st = s.stats()
    assert (st["entries"], st["bytes"]) == (1, entry_size("a", 5))
    assert (st["puts"], st["hits"], st["misses"], st["errors"], st["corrupt_dropped"]) == (2, 3, 1, 0, 0)


# ---- budget and eviction ---------------------------------------------------------------------
def test_oversize_put_refused(h):
    s = h.make(budget_bytes=1000)
    assert s.put("big", b"x" * 1000) is False
    assert not s.contains("big") and s.get("big") is None
    assert s.put("fits", b"x" * (1000 - entry_size("fits", 0))) is True  # exactly the budget
    st = s.stats()
    assert (st["refused"], st["puts"], st["entries"], st["bytes"]) == (1, 1, 1, 1000)
    assert h.make().put("big", b"x" * 100_000) is True  # no budget: anything goes


def test_lru_eviction_order(h):
    blob = b"v" * 1000
    size = entry_size("k0", blob)
    s = h.make(budget_bytes=3 * size + 10)
    for k in ("k0", "k1", "k2"):
        assert s.put(k, blob)
    other = h.make()  # another client of the same store (as another process would be)
    assert other.get("k0") == blob  # k0 is now more recent than k1 and k2, for every client
    assert s.put("k3", blob)
    assert sorted(s.keys()) == ["k0", "k2", "k3"]
    assert s.get("k2") == blob
    assert s.put("k4", blob)  # least recent now: k0 (read before k3 was written)
    assert sorted(s.keys()) == ["k2", "k3", "k4"]
    assert s.put("k3", blob)  # overwrite refreshes k3; evicts nothing
    st = s.stats()
    assert (st["evictions"], st["entries"]) == (2, 3) and st["bytes"] <= s.budget_bytes
    # one entry larger than the rest evicts as many as needed
    assert s.put("wide", b"w" * (2 * size - entry_size("wide", 0)))
    assert sorted(s.keys()) == ["k3", "wide"] and s.stats()["bytes"] <= s.budget_bytes


def test_importance_policy(h):
    blob = b"v" * 1000
    size = entry_size("a", blob)
    s = h.make(budget_bytes=3 * size + 10, policy="importance")
    s.put("a", blob, importance=10.0)
    s.put("b", blob, importance=0.1)
    s.put("c", blob, importance=1.0)
    s.put("d", blob, importance=1.0)  # evicts b: lowest importance
    assert sorted(s.keys()) == ["a", "c", "d"]
    s.put("e", blob, importance=1.0)  # c and d tie on importance/size: the older, c, goes
    assert sorted(s.keys()) == ["a", "d", "e"]
    for k in "fgh":
        s.put(k, blob, importance=1.0)  # the old but important entry outlives newer ones
    assert "a" in s.keys() and s.stats()["evictions"] == 5

    # size counts: per byte, a big entry of importance 1.5 is worth less than small ones of 1.0
    big = b"B" * 2000
    h.fresh()
    s2 = h.make(budget_bytes=entry_size("big", big) + 2 * size + 10, policy="importance")
    s2.put("big", big, importance=1.5)
    s2.put("s1", blob, importance=1.0)
    s2.put("s2", blob, importance=1.0)
    s2.put("s3", blob, importance=1.0)
    assert sorted(s2.keys()) == ["s1", "s2", "s3"]


# ---- corruption ------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["blob_byte", "header_byte", "length_field", "truncated", "appended",
                                    "garbage"])
def test_corrupt_entry_dropped(h, damage):
    s = h.make()
    blob = os.urandom(3000)
    s.put("k", blob, meta={"m": 1})
    s.put("other", b"fine")
    raw = bytearray(h.raw(s, "k"))
    if damage == "blob_byte":
        raw[-100] ^= 0x01
    elif damage == "header_byte":
        raw[25] ^= 0x80  # inside the importance field
    elif damage == "length_field":
        raw[19] ^= 0x40  # top byte of blob_len: claims 2**62 more bytes
    elif damage == "truncated":
        raw = raw[:len(raw) // 2]
    elif damage == "appended":
        raw += b"\0"
    else:
        raw = bytearray(os.urandom(200))
    h.write_raw(s, "k", bytes(raw))
    assert s.get("k") is None  # never the damaged bytes
    assert not s.contains("k") and "k" not in s.keys()  # dropped
    st = s.stats()
    assert (st["corrupt_dropped"], st["misses"], st["entries"]) == (1, 1, 1)
    if h.kind != "directory":
        assert st["bytes"] == entry_size("other", b"fine")  # bookkeeping follows the drop
    assert s.get("other") == b"fine"
    assert s.put("k", blob) and s.get("k") == blob


def test_entry_under_another_key_is_dropped(h):
    s = h.make()
    s.put("a", b"payload of a")
    s.put("b", b"payload of b")
    h.write_raw(s, "b", h.raw(s, "a"))  # a valid record, but of key "a"
    assert s.get("b") is None and not s.contains("b")
    assert s.get("a") == b"payload of a" and s.stats()["corrupt_dropped"] == 1


# ---- arguments -------------------------------------------------------------------------------
def test_bad_arguments(h):
    for kw in ({"budget_bytes": -1}, {"budget_bytes": 0}, {"budget_bytes": 1.5}, {"policy": "fifo"},
               {"half_life_s": 0}):
        with pytest.raises(StoreError):
            h.make(**kw)
    s = h.make()
    bad_puts = [((123, b"x"), {}), (("", b"x"), {}), (("k", "text"), {}), (("k", b"x"), {"meta": {"o": object()}}),
                (("k", b"x"), {"meta": ["not", "a", "dict"]}), (("k", b"x"), {"meta": {"x": math.nan}}),
                (("k", b"x"), {"importance": -1.0}), (("k", b"x"), {"importance": math.inf}),
                (("k" * 5000, b"x"), {}), (("\ud800", b"x"), {})]
    for args, kw in bad_puts:
        with pytest.raises(StoreError):
            s.put(*args, **kw)
    for op in (s.get, s.contains, s.delete):
        with pytest.raises(StoreError):
            op(None)
    assert issubclass(StoreError, ValueError) and s.keys() == []
    s.close()
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.get("k")


def test_bad_redis_arguments():
    with pytest.raises(StoreError, match="URL"):
        RedisBackend("http://127.0.0.1:6379")
    with pytest.raises(StoreError, match="URL"):
        RedisBackend(None)
    with pytest.raises(StoreError, match="namespace"):
        RedisBackend(namespace="has space")
    with pytest.raises(StoreError, match="namespace"):
        RedisBackend(namespace="{tag}")
    with pytest.raises(StoreError, match="reconnect_interval"):
        RedisBackend(reconnect_interval=-1)


def test_bad_directory_path(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(StoreError, match="not a directory"):
        DirectoryBackend(f)


def test_directory_doctest():
    res = doctest.testmod(directory_module, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


# ---- many processes at once ------------------------------------------------------------------
N_WRITERS, N_READERS, N_KEYS, ROUNDS = 4, 2, 6, 8
KEYS = [hashlib.sha256(f"chunk{i}".encode()).hexdigest()[:16] for i in range(N_KEYS)]


def make_blob(key, writer, seq):
    """Deterministic blob of (key, writer, seq); its first line names them and the payload's sha256."""
    rng = random.Random(f"{key}|{writer}|{seq}")
    payload = rng.randbytes(rng.randint(2000, 24000))
    return f"{key}|{writer}|{seq}|{hashlib.sha256(payload).hexdigest()}\n".encode() + payload


def check_blob(key, blob):
    """None if ``blob`` is exactly one of the blobs written for ``key``, else what is wrong."""
    head, _, payload = blob.partition(b"\n")
    try:
        k, w, seq, sha = head.decode().split("|")
        w, seq = int(w), int(seq)
    except ValueError:
        return f"{key}: unparseable head {head[:80]!r}"
    if k != key:
        return f"{key}: blob of key {k}"
    if hashlib.sha256(payload).hexdigest() != sha:
        return f"{key}: payload sha mismatch"
    if not (0 <= w < N_WRITERS and 0 <= seq < ROUNDS) or blob != make_blob(key, w, seq):
        return f"{key}: not a written blob ({w}, {seq})"
    return None


def _writer(spec, wid, go, out):
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = open_store(spec, budget_bytes=spec["budget"])
            go.wait(60)
            ok = 0
            for seq in range(ROUNDS):
                for i in range(N_KEYS):
                    key = KEYS[(i + wid) % N_KEYS]  # every writer writes every key, in its own order
                    ok += store.put(key, make_blob(key, wid, seq), meta={"writer": wid, "seq": seq})
            st = store.stats()
            store.close()
        out.put(("writer", wid, {"ok": ok, "errors": st["errors"], "warnings": len(caught)}, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("writer", wid, None, traceback.format_exc()))


def _reader(spec, rid, go, stop, out):
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = open_store(spec)
            go.wait(60)
            reads = hits = during = 0
            bad = []
            while not stop.is_set() or reads < 50:
                key = KEYS[(reads * 7 + rid) % N_KEYS]
                blob = store.get(key)
                reads += 1
                during += not stop.is_set()
                if blob is not None:
                    hits += 1
                    err = check_blob(key, blob)
                    if err:
                        bad.append(err)
            st = store.stats()
            store.close()
        out.put(("reader", rid, {"reads": reads, "during": during, "hits": hits, "bad": bad[:5], "n_bad": len(bad),
                                 "errors": st["errors"], "corrupt": st["corrupt_dropped"],
                                 "warnings": len(caught)}, None))
    except BaseException:  # noqa: BLE001
        out.put(("reader", rid, None, traceback.format_exc()))


@pytest.mark.slow  # many writer/reader processes for seconds; CI's slow pass runs it
def test_concurrent_writers_and_readers(h):
    """4 writer processes put overlapping keys under a tight budget (evictions all the time) while
    2 reader processes read: every hit is exactly a blob that some writer put for that key, no
    torn or corrupt entry is ever seen, nothing raises."""
    budget = 4 * entry_size(KEYS[0], 24200, {"writer": 0, "seq": 0})
    spec = h.spec(budget=budget)
    if h.kind == "directory":
        os.makedirs(spec["path"], exist_ok=True)
    ctx = mp.get_context("spawn")
    # go: every process waits, store open, until all are ready (a spawned process takes ~0.5 s to
    # import; with a start signal alone the writers could finish before a reader's first read)
    go, stop, out = ctx.Barrier(N_WRITERS + N_READERS + 1), ctx.Event(), ctx.Queue()
    writers = [ctx.Process(target=_writer, args=(spec, w, go, out)) for w in range(N_WRITERS)]
    readers = [ctx.Process(target=_reader, args=(spec, r, go, stop, out)) for r in range(N_READERS)]
    procs = writers + readers
    for p in procs:
        p.start()
    results = []
    try:
        try:
            go.wait(120)
        except threading.BrokenBarrierError:
            pass  # a child failed before it was ready: its traceback is reported below
        deadline = time.monotonic() + 90
        while len([r for r in results if r[0] == "writer"]) < N_WRITERS and time.monotonic() < deadline:
            try:
                results.append(out.get(timeout=1))
            except Exception:  # queue.Empty
                if not any(p.is_alive() for p in writers) and out.empty():
                    break
        stop.set()
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                results.append(out.get(timeout=1))
            except Exception:
                if not any(p.is_alive() for p in procs) and out.empty():
                    break
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    assert len(results) == len(procs), f"only {len(results)} of {len(procs)} processes reported"
    tracebacks = [tb for *_, tb in results if tb]
    assert not tracebacks, tracebacks[0]
    for role, idx, r, _ in results:
        assert r["errors"] == 0 and r["warnings"] == 0, (role, idx, r)
        if role == "writer":
            assert r["ok"] == ROUNDS * N_KEYS, (idx, r)
        else:
            assert r["n_bad"] == 0, r["bad"]
            assert r["corrupt"] == 0, r  # atomic writes: never a torn entry
    assert sum(r["hits"] for role, _, r, _ in results if role == "reader") > 0
    assert all(r["during"] > 0 for role, _, r, _ in results if role == "reader")  # reads overlapped the writes
    s = h.make(budget_bytes=budget)
    for key in KEYS:
        blob = s.get(key)
        assert blob is None or check_blob(key, blob) is None
    s.put(KEYS[0], make_blob(KEYS[0], 0, 0))
    assert s.stats()["bytes"] <= budget and s.stats()["corrupt_dropped"] == 0
    if h.kind == "directory":  # no temp file left behind
        assert [n for n in os.listdir(spec["path"]) if n.startswith(".tmp")] == []


# ---- Redis outages ---------------------------------------------------------------------------
def _unavailable(caught):
    return [w for w in caught if issubclass(w.category, StoreUnavailableWarning)]


def test_redis_restart(redis_store):
    """The store goes away (every node of the cluster) and comes back empty on the same ports."""
    s = open_url(redis_store.url, budget_bytes=1 << 20, reconnect_interval=0.05)
    assert s.put("a", b"before") and s.get("a") == b"before"
    redis_store.stop()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        for i in range(20):
            assert s.get("a") is None
            assert s.put(f"k{i}", b"during") is False
            assert s.contains("a") is False and s.delete("a") is False and s.keys() == []
            s.clear()
            st = s.stats()
            assert st["available"] is False and st["entries"] is None
            time.sleep(0.01)
        assert time.monotonic() - t0 < 10  # calls fail fast
    assert len(_unavailable(caught)) == 1, [str(w.message) for w in caught]  # once per outage
    assert s.stats()["errors"] >= 20
    redis_store.start()  # same ports, empty (no persistence)
    time.sleep(0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert s.get("a") is None  # lost with the restart: a plain miss
        assert s.put("b", b"after") is True and s.get("b") == b"after"
        assert s.stats()["available"] is True and s.stats()["entries"] == 1
    assert caught == []
    redis_store.stop()  # a second outage warns again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        time.sleep(0.06)
        assert s.get("b") is None and s.put("c", b"x") is False
    assert len(_unavailable(caught)) == 1
    redis_store.start()
    time.sleep(0.06)
    assert s.put("c", b"x") is True
    s.close()


@pytest.mark.parametrize("scheme", ["redis://127.0.0.1:{port}/0", "redis+cluster://127.0.0.1:{port}/"])
def test_redis_unreachable_from_the_start(scheme):
    require_redis()
    from kvz.integrations.kvstore.server import _free_port
    port = _free_port("127.0.0.1")  # nothing listens there
    s = open_url(scheme.format(port=port), reconnect_interval=0)
    with pytest.warns(StoreUnavailableWarning) as caught:
        assert s.put("a", b"x") is False
        assert s.get("a") is None and s.get_entry("a") is None
        assert s.contains("a") is False
    assert len([w for w in caught if issubclass(w.category, StoreWarning)]) == 1
    st = s.stats()  # the stats call failed too: 5 errors
    assert (st["errors"], st["misses"], st["available"]) == (5, 2, False)
    s.close()


def test_redis_server_helper():
    require_redis()
    with RedisServer() as srv:
        from kvz.integrations.kvstore.server import ping
        assert srv.running and ping(srv.host, srv.port)
        d = srv.dir
        port = srv.port
        srv.restart()
        assert srv.port == port and ping(srv.host, port)
    assert not srv.running and not os.path.exists(d)


# ---- ranged reads (open_blob) ------------------------------------------------------------------
def test_open_blob_ranges(h):
    s = h.make()
    blob = os.urandom(300_000)
    s.put("r1", blob, meta={"tokens": 9}, importance=3.0)
    b = s.open_blob("r1")
    assert (b.size, b.meta, b.importance) == (len(blob), {"tokens": 9}, 3.0)
    for off, n in ((0, 10), (123_456, 70_000), (len(blob) - 5, 5), (7, 0)):
        assert bytes(b.read_range(off, n)) == blob[off:off + n]
    with pytest.raises(StoreError):
        b.read_range(len(blob) - 2, 5)
    b.close()
    assert s.open_blob("missing") is None


def test_open_blob_refuses_a_record_cut_short(h):
    s = h.make()
    s.put("r2", os.urandom(50_000))
    raw = h.raw(s, "r2")
    h.write_raw(s, "r2", raw[:-1000])
    assert s.open_blob("r2") is None and not s.contains("r2")  # dropped, a miss


def test_open_blob_reads_a_real_kvz_layer_by_layer(h, real_bank, sample_files):
    import numpy as np

    from alignpred import KvzReader, compress, load_cache

    blob = compress(load_cache(sample_files[0]), None, budget=0.03, bank=real_bank).data
    s = h.make()
    s.put("kvz", blob)
    want = KvzReader(blob, bank=real_bank).read(tokens=(0, 128))
    src = s.open_blob("kvz")
    got = KvzReader(src, bank=real_bank).read(tokens=(0, 128))
    assert all(np.array_equal(want[k].view(np.uint16), got[k].view(np.uint16)) for k in want)
    assert src.bytes_read < 0.7 * len(blob)  # the first of two objects per tensor (256 of 448 tokens), the tail


def test_open_blob_entry_deleted_while_reading(h):
    s = h.make()
    blob = os.urandom(100_000)
    s.put("r3", blob)
    b = s.open_blob("r3")
    s.delete("r3")
    if h.kind == "directory":  # the open file is a snapshot: its reader still sees the entry it opened
        assert bytes(b.read_range(1000, 500)) == blob[1000:1500]
    else:  # GETRANGE of a deleted key: no bytes (the .kvz reader reports it truncated)
        assert len(b.read_range(1000, 500)) == 0
    b.close()


def test_open_blob_store_down_raises_store_read_error(redis_store):
    from kvz.integrations.kvstore import StoreReadError

    s = open_url(redis_store.url, reconnect_interval=0.0)
    s.put("r4", os.urandom(10_000))
    b = s.open_blob("r4")
    redis_store.stop()
    with pytest.warns(StoreUnavailableWarning), pytest.raises(StoreReadError):
        b.read_range(0, 100)
    s.close()
