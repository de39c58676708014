"""The vLLM connector's layer-wise loads (``kvz.integrations.vllm.loader``) and block store, on a real
Gemma 3 270M cache, without vLLM: lock-step decode layer by layer from a directory or Redis store
read by ranges, the forward's per-layer waits, faults (a flipped payload, a store that is too slow
for the deadline, Redis stopped between two layers) reported as blocks to recompute and never as a
late write, and the ``auto`` profile's choice."""
import json
import threading
import time

import numpy as np
import pytest

from alignpred import KvzReader, load_cache
from kvz.integrations.kvstore import DirectoryBackend, RedisBackend
from kvz.integrations.kvstore.server import RedisServer, require_redis
from kvz.integrations.vllm import profile_choice as pc
from kvz.integrations.vllm.loader import LoadJob, StepLoad, load_cores, parse_cpus
from kvz.integrations.vllm.store import BlockStore

BS = 128
N_BLOCKS = 3  # of the sample's 448 tokens


@pytest.fixture(scope="module")
def sample(sample_files):
    c = load_cache(sample_files[0])
    ids = [int(x) for x in json.loads(c.metadata["token_ids"])][:N_BLOCKS * BS]
    kv = [(np.asarray(c.tensors[f"layers.{i}.key"])[..., :N_BLOCKS * BS, :],
           np.asarray(c.tensors[f"layers.{i}.value"])[..., :N_BLOCKS * BS, :]) for i in range(18)]
    kv = [(k[0] if k.ndim == 4 else k, v[0] if v.ndim == 4 else v) for k, v in kv]
    return ids, kv, json.loads(c.metadata["layer_types"]), json.loads(c.metadata["rope_theta"])


def _store(backend, sample, **kw):
    _, _, types, thetas = sample
    return BlockStore(backend, model_id="gemma-3-270m-test", block_size=BS, layer_types=types, rope_theta=thetas,
                      shape=(18, 1, 256), dtype="bfloat16", bank="gemma-3-270m", threads=1, **kw)


def _filled(store, sample):
    ids, kv, _, _ = sample
    assert store.put_run(ids, 0, kv, store.block_hashes(ids, N_BLOCKS)) > 0
    return ids


def _step(store, segs, deadline_s=30.0, on_write=None, **kw):
    writes = []

    def write(job, i, k, v):
        writes.append((time.monotonic(), i, k.copy(), v.copy()))
        if on_write:
            on_write(i)

    jobs = [LoadJob("r", list(range(s.first, s.first + s.count)), list(range(s.first, N_BLOCKS)),
                    lambda d, s=s: store.open_segment(s, d, 1)) for s in segs]
    step = StepLoad(jobs, 18, write, deadline_s, warn=lambda m: None, **kw)
    th = threading.Thread(target=step.run)
    th.start()
    return step, th, writes


def _forward(step):  # what vLLM's attention layers do: wait for each layer in turn
    for i in range(18):
        step.wait(i)


def test_layer_by_layer_same_values_as_a_whole_read(tmp_path, sample):
    store = _store(DirectoryBackend(str(tmp_path)), sample)
    ids = _filled(store, sample)
    n, segs = store.lookup(ids, N_BLOCKS)
    assert n == N_BLOCKS and len(segs) == 1
    step, th, writes = _step(store, segs)
    _forward(step)
    th.join()
    assert step.finish(True) == set() and [w[1] for w in writes] == list(range(18))
    blob = store.backend.get(store.runs[0]["key"])
    want = KvzReader(blob, bank=store.bank).read()
    for _, i, k, v in writes:
        assert np.array_equal(k.view(np.uint16), want[f"layers.{i}.key"].view(np.uint16))
        assert np.array_equal(v.view(np.uint16), want[f"layers.{i}.value"].view(np.uint16))


def test_switch_interval_while_loading_and_restored(tmp_path, sample):
    """A step's load lowers the interpreter's switch interval while it decodes (the forward thread
    holds the GIL between its ops) and puts the previous value back when it ends, failed or not."""
    import sys

    store = _store(DirectoryBackend(str(tmp_path)), sample)
    ids = _filled(store, sample)
    before = sys.getswitchinterval()
    seen = []
    _, segs = store.lookup(ids, N_BLOCKS)
    step, th, writes = _step(store, segs, on_write=lambda i: seen.append(sys.getswitchinterval()),
                             switch_interval_s=2e-4)
    _forward(step)
    th.join()
    assert step.finish(True) == set() and len(writes) == 18
    assert seen and all(abs(x - 2e-4) < 1e-9 for x in seen) and sys.getswitchinterval() == before


def test_partial_hits(tmp_path, sample):
    """A prompt that diverges in block 2 loads blocks 0-1; a longer prompt stored by a second request on
    top of a shorter one is found whole, from both runs."""
    ids, kv, _, _ = sample
    store = _store(DirectoryBackend(str(tmp_path)), sample)
    hashes = store.block_hashes(ids, N_BLOCKS)
    store.put_run(ids[:BS], 0, [(k[:, :BS], v[:, :BS]) for k, v in kv], hashes[:1])  # a 1-block request first
    assert store.stored_prefix(ids, N_BLOCKS) == 1
    store.put_run(ids, 1, [(k[:, BS:], v[:, BS:]) for k, v in kv], hashes[1:])  # then the longer one: its new blocks
    diverged = ids[:2 * BS + 5] + [7] * (BS - 5)
    assert store.lookup(diverged, N_BLOCKS)[0] == 2
    n, segs = store.lookup(ids, N_BLOCKS)
    assert n == N_BLOCKS and [(s.first, s.count) for s in segs] == [(0, 1), (1, 2)]
    step, th, writes = _step(store, segs)
    _forward(step)
    th.join()
    assert step.finish(True) == set() and len(writes) == 2 * 18


def test_flipped_payload_is_recomputed_and_nothing_after_it_is_written(tmp_path, sample):
    store = _store(DirectoryBackend(str(tmp_path)), sample)
    ids = _filled(store, sample)
    n, segs = store.lookup(ids, N_BLOCKS)
    key = store.runs[0]["key"]
    path = store.backend.entry_path(key)
    src = store.backend.open_blob(key)
    off, length = KvzReader(src, bank=store.bank).payload_spans(9)[0]
    base = src.size  # the blob is the file's last bytes
    src.close()
    data = bytearray(open(path, "rb").read())
    data[len(data) - base + off + length // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    step, th, writes = _step(store, segs)
    _forward(step)
    th.join()
    assert step.finish(True) == {0, 1, 2}
    assert [w[1] for w in writes] == list(range(9))


class SlowBackend(DirectoryBackend):
    """A directory store whose ranged reads take ``delay`` seconds each (a store 10x slower than usual)."""

    delay = 0.0

    def open_blob(self, key):
        b = super().open_blob(key)
        if b is not None:
            read = b._read
            b._read = lambda off, n: (time.sleep(self.delay), read(off, n))[1]
        return b


def test_deadline_cancels_and_no_late_write(tmp_path, sample):
    store = _store(SlowBackend(str(tmp_path)), sample)
    ids = _filled(store, sample)
    n, segs = store.lookup(ids, N_BLOCKS)
    store.backend.delay = 0.1  # 36 spans: 3.6 s of reads against a 0.6 s deadline
    t0 = time.monotonic()
    step, th, writes = _step(store, segs, deadline_s=0.6)
    _forward(step)
    waited = time.monotonic() - t0
    cancelled_at = time.monotonic()
    th.join(10)
    assert not th.is_alive()
    assert waited < 1.5  # no hang beyond the deadline
    assert step.finish(True) == {0, 1, 2} and step.cancelled
    assert all(t <= cancelled_at for t, *_ in writes) and len(writes) < 18


def _stop_at_layer_2(stop):
    def on_write(i):
        if i == 2:
            stop()
    return on_write


def test_redis_stopped_between_two_layers(sample):
    require_redis()
    from kvz.benchmarks.link_proxy import LinkProxy

    with RedisServer() as srv:
        with LinkProxy(("127.0.0.1", srv.port), rate_bits_per_s=20e6) as proxy:
            store = _store(RedisBackend(proxy.url_for(srv.url), namespace="loader"), sample)
            ids = _filled(store, sample)
            n, segs = store.lookup(ids, N_BLOCKS)
            assert n == N_BLOCKS

            with pytest.warns(Warning):
                step, th, writes = _step(store, segs, on_write=_stop_at_layer_2(srv.stop))
                _forward(step)
                th.join(30)
            assert step.finish(True) == {0, 1, 2}
            assert 3 <= len(writes) < 18


@pytest.mark.parametrize("how", ["kill", "pause"])
def test_cluster_master_stopped_between_two_layers(sample, how):
    """The run's master of a 3-master Redis Cluster (every node behind a 20 Mbit/s proxy of its own, so
    the load is still crossing the link) is SIGKILLed or SIGSTOPped (a partition) once layer 2 is
    written: the load fails, every block of it is reported for recompute, nothing after the failure
    is written, one StoreUnavailableWarning, and the step ends well within its deadline."""
    require_redis()
    import warnings

    from kvz_test_helpers import cluster_behind_proxies

    from kvz.integrations.kvstore import RedisClusterServer, StoreUnavailableWarning, StoreWarning, open_url

    deadline_s = 10.0
    cl = RedisClusterServer(masters=3, replicas=0).start()
    victim = None
    try:
        ids = _filled(_store(open_url(cl.url + "?namespace=loader"), sample), sample)  # written at full speed
        with cluster_behind_proxies(cl, 20e6) as (url, proxies):
            backend = open_url(url + "?namespace=loader", socket_timeout=0.5, reconnect_interval=0.5)
            store = _store(backend, sample)
            n, segs = store.lookup(ids, N_BLOCKS)
            assert n == N_BLOCKS and len(segs) == 1
            victim = cl.master_of_key(backend.entry_key(segs[0].run_key))
            before = proxies[victim].stats()["bytes_down"]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.monotonic()
                step, th, writes = _step(store, segs, deadline_s, on_write=_stop_at_layer_2(
                    lambda: (cl.kill if how == "kill" else cl.pause)(victim)))
                _forward(step)
                th.join(30)
                elapsed = time.monotonic() - t0
            assert not th.is_alive()
            assert proxies[victim].stats()["bytes_down"] > before  # the load read from that master
            assert step.finish(True) == {0, 1, 2} and not step.cancelled  # failed, not timed out
            assert 3 <= len(writes) < 18 and [w[1] for w in writes] == list(range(len(writes)))
            ours = [str(w.message) for w in caught if issubclass(w.category, StoreWarning)]
            assert len(ours) == 1 and issubclass(
                next(w.category for w in caught if issubclass(w.category, StoreWarning)), StoreUnavailableWarning), ours
            assert elapsed < deadline_s, elapsed
            backend.close()
    finally:
        if victim is not None and how == "pause":
            cl.resume(victim)
        cl.close()


def test_load_cores():
    assert parse_cpus("{0,1}") == {0, 1} and parse_cpus("0-1|3") == {0, 1, 3}
    cores, why = load_cores("0")
    assert cores == [0] and "setting" in why
    import os

    old = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"
    try:
        cores, why = load_cores()
        if (os.cpu_count() or 1) > 1:
            assert 0 not in cores and "not bound" in why
    finally:
        if old is None:
            del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = old


def test_auto_profile_choice(tmp_path, sample):
    ms = {"default": 30e6, "balanced": 35e6, "fast": 120e6}
    v = 8064 * 9216
    assert pc.choose(ms, bandwidth=2e9, values=v, layers=18, lossless=False)[0] == "fast"  # decode-bound
    assert pc.choose(ms, bandwidth=2e9, values=v, layers=18, lossless=False, forward_s=4.0)[0] == "default"
    # a slow link: bytes dominate, so the fewest bits (default) even though fast decodes faster
    assert pc.choose({"default": 300e6, "fast": 310e6}, bandwidth=1e6, values=v, layers=18, lossless=False)[0] == "default"
    store = _store(DirectoryBackend(str(tmp_path)), sample)
    thr = pc.measure_decode(store, profiles=("default", "fast"), tokens=128, repeats=1)
    assert set(thr) == {"default", "fast"} and all(x > 0 for x in thr.values())
    assert pc.measure_read(store.backend, nbytes=1 << 20) > 0
    assert store.backend.keys() == []  # the probe is gone


def _settings(sample):
    _, _, types, thetas = sample
    return dict(model_id="gemma-3-270m-test", block_size=BS, layer_types=types, rope_theta=thetas,
                shape=(18, 1, 256), dtype="bfloat16", bank="gemma-3-270m", threads=1)


def _proc_step(store, proc, n_jobs=1, deadline_s=30.0):
    import torch

    writes = []

    def write(job, i, k, v):
        writes.append((i, k.clone().view(torch.int16).numpy(), v.clone().view(torch.int16).numpy()))

    jobs = [LoadJob("r", list(range(N_BLOCKS)), list(range(N_BLOCKS)),
                    lambda d, j=j: (proc.reader(j), None, proc)) for j in range(n_jobs)]
    step = StepLoad(jobs, 18, write, deadline_s, warn=lambda m: None, proc=proc)
    th = threading.Thread(target=step.run)
    th.start()
    return step, th, writes


def test_decode_process_same_bits_as_a_whole_read(tmp_path, sample):
    """kvz's decode process (kvz.integrations.vllm.decode_worker) opens the same store, decodes
    into shared memory and hands the load thread the same bits as a whole read, two loads in
    lock-step; a run removed from the store is a failed load (recomputed), and the process serves
    the next step."""
    pytest.importorskip("torch")
    from kvz.integrations.vllm.decode_worker import DecodeWorker

    store = _store(DirectoryBackend(str(tmp_path)), sample)
    ids = _filled(store, sample)
    _, segs = store.lookup(ids, N_BLOCKS)
    w = DecodeWorker(str(tmp_path), {}, _settings(sample), sorted(__import__("os").sched_getaffinity(0)), 1)
    try:
        proc = w.submit([(segs[0], N_BLOCKS * BS)] * 2, time.monotonic() + 30)
        step, th, writes = _step_run(step_and_thread=_proc_step(store, proc, n_jobs=2))
        assert step.finish(True) == set() and [x[0] for x in writes] == [i for i in range(18) for _ in range(2)]
        want = KvzReader(store.backend.get(store.runs[0]["key"]), bank=store.bank).read()
        for i, k, v in writes:
            assert np.array_equal(k, want[f"layers.{i}.key"].view(np.int16).reshape(k.shape))
            assert np.array_equal(v, want[f"layers.{i}.value"].view(np.int16).reshape(v.shape))
        assert proc.decode_s > 0
        for k in list(store.backend.keys()):  # the run is gone: the next load fails, nothing is written
            store.backend.delete(k)
        proc = w.submit([(segs[0], N_BLOCKS * BS)], time.monotonic() + 30)
        step, th, writes = _step_run(step_and_thread=_proc_step(store, proc))
        assert step.finish(True) == set(range(N_BLOCKS)) and writes == [] and w.alive
        store = _store(DirectoryBackend(str(tmp_path)), sample)
        ids = _filled(store, sample)
        _, segs = store.lookup(ids, N_BLOCKS)
        w.proc.kill()  # the process dies: the step's loads fail (recomputed), it is not used again
        w.proc.wait()
        try:
            proc = w.submit([(segs[0], N_BLOCKS * BS)], time.monotonic() + 5)
        except OSError:
            proc = None
        if proc is not None:
            step, th, writes = _step_run(step_and_thread=_proc_step(store, proc))
            assert step.finish(True) == set(range(N_BLOCKS)) and writes == []
        assert not w.alive
    finally:
        w.close()
    assert not w.alive


def _step_run(step_and_thread):
    step, th, writes = step_and_thread
    _forward(step)
    th.join()
    return step, th, writes
