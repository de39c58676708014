"""IntMap prepares its integer weights at first use (start-up time): the same integers and
predictions as the eager preparation, argument errors still at construction, and one preparation
when many threads use a new map at once."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from alignpred.kernels.intmap import IntMap, prepare_weights


def test_lazy_equals_eager():
    rng = np.random.default_rng(3)
    W = rng.normal(size=(2 * 48, 40)).astype(np.float16)
    xs = [rng.normal(size=(33, 48)).astype(np.float32) for _ in range(2)]
    m = IntMap(W, 2)
    assert m._ready is None and (m.n_src, m.d_in, m.d_out) == (2, 48, 40)
    y = m.predict(xs)
    wp, we, sh = prepare_weights(W, 2)
    assert (m.wp == wp).all() and (m.w_exp == we).all() and (m.shift == sh).all()
    m2 = IntMap(W, 2)
    assert (m2.wp == wp).all()  # attributes first: the same map
    assert m2.predict(xs).tobytes() == y.tobytes()


@pytest.mark.parametrize("args, err", [((np.zeros((4, 3, 2), np.float32), 1), TypeError),
                                       ((np.zeros((5, 3), np.float32), 2), ValueError),
                                       ((np.zeros((4, 3), np.int32), 1), TypeError),
                                       ((np.zeros((4, 3), np.float32), 2, np.zeros(3, np.int32)), ValueError)])
def test_bad_arguments_fail_at_construction(args, err):
    with pytest.raises(err):
        IntMap(*args)


def test_first_use_from_many_threads(monkeypatch):
    import alignpred.kernels.intmap as im

    calls = []
    real = im.prepare_weights
    monkeypatch.setattr(im, "prepare_weights", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(4)
    W = rng.normal(size=(64, 32)).astype(np.float32)
    x = rng.normal(size=(20, 64)).astype(np.float32)
    ref = IntMap(W).predict([x]).tobytes()
    calls.clear()
    m = IntMap(W)
    out, barrier = [None] * 8, threading.Barrier(8)

    def run(i):
        barrier.wait()
        out[i] = m.predict([x]).tobytes()

    ts = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert calls == [1] and all(o == ref for o in out)
