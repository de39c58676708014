"""kvz's decode process with idle cores (kvz.integrations.vllm.decode_worker): one thread per load
core plus one idle-priority thread per engine core, each load's range cut into more parts than
threads. The same bits as a whole read, and each thread where it was placed."""
import os
import time

import numpy as np
import pytest
from test_vllm_loader import BS, N_BLOCKS, _filled, _settings, _store, sample  # noqa: F401  (sample: a fixture)

from alignpred import KvzReader
from kvz.integrations.kvstore import DirectoryBackend
from kvz.integrations.vllm.loader import idle_cores

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def test_idle_cores_setting():
    assert idle_cores("none", CPUS[:1]) == ([], "idle_cores setting: none")
    got, why = idle_cores(None, CPUS[:1])
    assert got == CPUS[1:] and CPUS[0] not in got
    assert idle_cores(None, CPUS)[0] == []  # the loads run on every core: no idle thread


@pytest.mark.skipif(len(CPUS) < 2 or not hasattr(os, "SCHED_IDLE"), reason="needs 2 cores and Linux's SCHED_IDLE")
def test_idle_threads_same_bits(tmp_path, sample):  # noqa: F811
    torch = pytest.importorskip("torch")
    from kvz.integrations.vllm.decode_worker import SPLIT, DecodeWorker

    settings = _settings(sample)
    store = _store(DirectoryBackend(str(tmp_path)), sample)
    ids = _filled(store, sample)
    _, segs = store.lookup(ids, N_BLOCKS)
    load, idle = CPUS[1:2], CPUS[:1]
    w = DecodeWorker(str(tmp_path), {}, settings, load, 1, idle_cores=idle)
    try:
        assert w.placement == [(load, "normal"), (idle, "idle")] and SPLIT > 1
        proc = w.submit([(segs[0], N_BLOCKS * BS)], time.monotonic() + 60)
        want = KvzReader(store.backend.get(store.runs[0]["key"]), bank=store.bank).read()
        n = 0
        for i, k, v in proc.layers(0, 18):
            for kind, got in (("key", k), ("value", v)):
                exp = want[f"layers.{i}.{kind}"].view(np.int16).reshape(tuple(got.shape))
                assert np.array_equal(got.view(torch.int16).numpy(), exp)
            n += 1
        assert n == 18 and proc.decode_s > 0
        proc.close()
        assert w.alive
    finally:
        w.close()
