"""kvz's own thread pools survive a fork: a child forked after the parent used them makes its own
pools instead of waiting forever on the parent's (absent) worker threads."""
import multiprocessing as mp
import os

import pytest

from alignpred.threads import pool

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _use_pool(q):
    q.put(sum(pool(2).map(lambda x: x * x, range(10))))


def test_pool_after_fork():
    assert sum(pool(2).map(abs, range(-3, 3))) == 9       # the parent's pool has live threads
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_use_pool, args=(q,))
    p.start()
    p.join(60)
    alive = p.is_alive()
    if alive:
        p.kill()
    assert not alive, "a forked child hung on the parent's thread pool"
    assert p.exitcode == 0 and q.get(timeout=5) == 285
    assert sum(pool(2).map(abs, range(-3, 3))) == 9       # and the parent's pool still works
