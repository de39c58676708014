"""Concurrent readers while a writer replaces the file: never a torn read.

One process compresses the same cache to the same path over and over with different eps
(atomic replace); three reader processes open and decode the path in a loop. Every read must
either decode to exactly one of the versions (compared with reference decodes made up front) or
raise a KvzError (kvz.md §13: with rename-based replacement it never has to). A reader that has
the file open keeps the old inode: it still decodes the old version after the replace.
"""
import hashlib
import multiprocessing as mp
import os
import time

import numpy as np
import pytest
from kvz_testing import synthetic_cache

from alignpred import KvzError, KvzReader, compress, fit_bank

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
EPS = (0.02, 0.05, 0.1)


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(np.ascontiguousarray(tensors[k]).tobytes())
    return h.hexdigest()


def _writer(cache, bank, path, stop, rounds):
    k = 0
    while not stop.is_set():
        compress(cache, path, budget=EPS[k % len(EPS)], bank=bank)
        k += 1
    rounds.value = k


def _reader(path, bank, known, stop, q):
    ok = errors = 0
    seen = set()
    bad = []
    while not stop.is_set():
        try:
            d = digest(KvzReader(path, bank=bank).read())
            if d in known:
                ok += 1
                seen.add(known[d])
            else:
                bad.append("unknown content")
        except KvzError as e:
            errors += 1
            bad.append(f"KvzError: {e}")
        except Exception as e:  # noqa: BLE001 - reported to the parent
            bad.append(f"{type(e).__name__}: {e}")
    q.put((ok, errors, sorted(seen), bad[:5]))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("conc")
    cache = synthetic_cache(n_layers=2, heads=1, T=300, d=16)
    bank = fit_bank([cache], rank=4, rotations=False)
    known = {}
    for eps in EPS:
        p = d / f"v{eps}.kvz"
        compress(cache, p, budget=eps, bank=bank)
        known[digest(KvzReader(p, bank=bank).read())] = eps
    assert len(known) == len(EPS)
    return d, cache, bank, known


def test_readers_never_see_a_torn_file(setup):
    d, cache, bank, known = setup
    path = str(d / "live.kvz")
    compress(cache, path, budget=EPS[0], bank=bank)
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    q = ctx.Queue()
    rounds = ctx.Value("i", 0)
    w = ctx.Process(target=_writer, args=(cache, bank, path, stop, rounds))
    readers = [ctx.Process(target=_reader, args=(path, bank, known, stop, q)) for _ in range(3)]
    for p in [w] + readers:
        p.start()
    time.sleep(5)
    stop.set()
    results = [q.get(timeout=60) for _ in readers]
    for p in [w] + readers:
        p.join(30)
    total_ok = sum(r[0] for r in results)
    errors = [b for r in results for b in r[3]]
    assert not errors, errors
    assert total_ok > 0 and rounds.value > 1, (results, rounds.value)
    print("concurrency: reads", [r[0] for r in results], "writer rounds", rounds.value)
    # the readers saw more than one version: the replacement really happened under them
    assert len(set().union(*(set(r[2]) for r in results))) > 1 or rounds.value < 3, results
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]


def test_open_reader_keeps_old_inode(setup):
    d, cache, bank, known = setup
    path = d / "inode.kvz"
    compress(cache, path, budget=0.02, bank=bank)
    r = KvzReader(path, bank=bank)
    compress(cache, path, budget=0.1, bank=bank)      # replaced while r holds the mmap
    assert known[digest(r.read())] == 0.02          # r still reads the old inode
    assert known[digest(KvzReader(path, bank=bank).read())] == 0.1
