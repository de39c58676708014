"""Crash safety: a writer SIGKILLed at a random moment never damages the destination.

A forked child compresses to a path that already holds a valid file (the old version) and is
killed after a random delay. Afterwards the path holds either the old file or the complete new
one (byte for byte, and it decodes), never anything else; at most the killed writer's own
temporary file ``.<name>.<random>.tmp`` is left behind, it is no longer locked, and the next
write to the same path removes it once it is stale (kvz.md §13).
"""
import multiprocessing as mp
import os
import random
import signal
import time

import numpy as np
import pytest
from kvz_testing import synthetic_cache

from alignpred import KvzReader, compress, fit_bank
from alignpred.io import remove_stale_temps

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def temps(d, name):
    return sorted(n for n in os.listdir(d) if n.startswith(f".{name}.") and n.endswith(".tmp"))


def _writer(cache, bank, path, eps):
    compress(cache, path, budget=eps, bank=bank)
    os._exit(0)


def test_sigkill_writer_at_random_points(tmp_path):
    cache = synthetic_cache(n_layers=4, heads=2, T=500, d=32)
    bank = fit_bank([cache], rank=8, rotations=False)
    path = tmp_path / "c.kvz"
    compress(cache, tmp_path / "new.kvz", budget=0.02, bank=bank)
    new_bytes = (tmp_path / "new.kvz").read_bytes()
    compress(cache, path, budget=0.08, bank=bank)
    old_bytes = path.read_bytes()
    assert old_bytes != new_bytes
    ctx = mp.get_context("fork")
    t0 = time.monotonic()
    p = ctx.Process(target=_writer, args=(cache, bank, str(tmp_path / "timing.kvz"), 0.02))
    p.start()
    p.join(120)
    assert p.exitcode == 0, f"the timing writer did not finish (exit code {p.exitcode})"
    duration = time.monotonic() - t0
    rng = random.Random(1)
    outcomes = {"old": 0, "new": 0}
    left = 0
    for it in range(10):
        if path.read_bytes() == new_bytes:  # start every round from the old version
            compress(cache, path, budget=0.08, bank=bank)
        before = len(temps(tmp_path, "c.kvz"))
        p = ctx.Process(target=_writer, args=(cache, bank, str(path), 0.02))
        p.start()
        time.sleep(rng.uniform(0.0, 1.1 * duration))
        os.kill(p.pid, signal.SIGKILL)
        p.join(30)
        assert not p.is_alive()
        got = path.read_bytes()
        assert got in (old_bytes, new_bytes), f"round {it}: the destination is neither the old nor the new file"
        outcomes["old" if got == old_bytes else "new"] += 1
        r = KvzReader(path, bank=bank)
        assert set(r.read(tokens=(0, 10))) == set(cache.tensors)
        after = temps(tmp_path, "c.kvz")
        assert len(after) <= before + 1, after
        left = max(left, len(after))
    print("crash-safety outcomes", outcomes, "max temps left", left)
    assert outcomes["old"] > 0, outcomes   # some kills landed before the rename
    # leftovers of killed writers are not locked: once stale, the next write removes them
    for n in temps(tmp_path, "c.kvz"):
        past = time.time() - 60
        os.utime(tmp_path / n, (past, past))
    compress(cache, path, budget=0.05, bank=bank)
    assert temps(tmp_path, "c.kvz") == []
    assert not any(n.endswith(".tmp") for n in os.listdir(tmp_path))


def test_live_writer_temp_is_not_removed(tmp_path):
    """A temp file locked by a live writer survives the stale-temp sweep, however old."""
    import fcntl

    tmp = tmp_path / ".x.kvz.abc123.tmp"
    tmp.write_bytes(b"partial")
    past = time.time() - 3600
    os.utime(tmp, (past, past))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert remove_stale_temps(tmp_path / "x.kvz") == [] and tmp.exists()
    finally:
        os.close(fd)
    assert remove_stale_temps(tmp_path / "x.kvz") == [str(tmp)] and not tmp.exists()
    # a young temp is left alone even when unlocked (its writer may not have locked it yet)
    tmp.write_bytes(b"partial")
    assert remove_stale_temps(tmp_path / "x.kvz") == [] and tmp.exists()
    np.testing.assert_equal(tmp.read_bytes(), b"partial")
