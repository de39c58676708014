"""The C ``lanes32`` decoder of ``benchmarks.studies.speed.entropy_decode.native`` (benchmarks/native/lanes32_avx2.c):
built with the system gcc when there is one (skipped otherwise), it must decode the library's
payloads to the same symbols, and damaged payloads to the library's values or its error, without
reading outside the payload (the words end at a guard page)."""
from __future__ import annotations

import ctypes
import mmap
import shutil

import numpy as np
import pytest

from alignpred import entropy as E
from alignpred.entropy import lanes
from alignpred.errors import FormatError

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to build the native decoder")
native_mod = pytest.importorskip("benchmarks.studies.speed.entropy_decode.native")


@pytest.fixture(scope="module")
def nat(tmp_path_factory):
    return native_mod.Native(native_mod.build(str(tmp_path_factory.mktemp("lanes32"))))


def _obj(seed=0, C=5, N=77):
    rng = np.random.default_rng(seed)
    q = np.empty((C, N), np.int32)
    for c in range(C):
        s = float(np.exp(rng.uniform(np.log(0.05), np.log(3e5))))
        q[c] = np.clip(np.rint(rng.laplace(0, s, N)), -2**31, 2**31 - 1).astype(np.int32)
    q.flat[:6] = [2**31 - 1, -2**31, 1 << 20, -(1 << 18), 131071, -131072][:q.size]
    return q, E.choose_models(q)


class Guarded:
    """uint16 arrays that end right before an inaccessible page (an over-read faults)."""

    def __init__(self, nbytes: int):
        page = mmap.PAGESIZE
        self.npages = -(-nbytes // page) + 1
        self.m = mmap.mmap(-1, (self.npages + 1) * page)
        self.cbuf = (ctypes.c_char * len(self.m)).from_buffer(self.m)
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.guard = ctypes.addressof(self.cbuf) + self.npages * page
        assert self.libc.mprotect(self.guard, page, 0) == 0   # PROT_NONE
        self.arr = np.frombuffer(self.m, np.uint8, count=self.npages * page)

    def words(self, buf: bytes):
        """The payload words plus the two zero pad words, ending at the guard page; ``(w, W)``."""
        w, W = native_mod.padded(buf)
        nb = 2 * w.size
        dst = self.arr[self.arr.size - nb:].view(np.uint16)
        dst[:] = w
        return dst, W


@pytest.fixture(scope="module")
def guarded():
    g = Guarded(1 << 16)
    yield g
    g.libc.mprotect(g.guard, mmap.PAGESIZE, 3)   # PROT_READ | PROT_WRITE again


@pytest.mark.parametrize("prec", [10, 11, 12])
def test_spec_tables_are_the_library_tables(prec):
    np.testing.assert_array_equal(native_mod.spec_tables(prec), lanes.tables(prec)[1])


@pytest.mark.parametrize("shape", [(5, 77), (7, 256), (3, 20), (1, 31), (1, 32), (2, 1), (40, 1), (3, 33), (64, 256)])
def test_same_symbols_as_the_library(nat, guarded, shape):
    q, ids = _obj(sum(shape), *shape)
    for prec in (12, 11, 10):
        buf = E.lanes_encode(q, ids, prec=prec)
        ref = E.lanes_decode(buf, ids, q.shape, prec=prec)
        np.testing.assert_array_equal(ref, q)
        for path in nat.paths:
            w, W = guarded.words(buf)
            out = np.full(q.shape, 7, np.int32)
            nat.decode_words(w, W, np.asarray(ids, np.int64), q.shape, out, path=path, prec=prec)
            np.testing.assert_array_equal(out, q, err_msg=f"{path} {prec}")


def _outcome(fn):
    try:
        return fn()
    except FormatError as e:
        return str(e)


def test_damaged_streams_agree_with_the_library(nat, guarded):
    """Random byte damage, truncations and bad lane tables: each C path raises the library's
    FormatError (same message) or returns its values; no read passes the end of the payload."""
    rng = np.random.default_rng(5)
    checked = 0
    for seed in range(30):
        q, ids = _obj(seed, C=3, N=int(rng.choice([20, 64, 77, 256])))
        ids64 = np.asarray(ids, np.int64)
        good = E.encode(q, ids, coder="lanes32")
        variants = []
        for _ in range(4):
            b = bytearray(good)
            for _ in range(int(rng.integers(1, 4))):
                b[int(rng.integers(0, len(b)))] ^= int(rng.integers(1, 256))
            variants.append(bytes(b))
        variants += [good[:-2 * int(rng.integers(1, 8))], good[:190], good + b"\0\0", good[:-1]]
        b = bytearray(good)
        b[128] += 1                        # lane 0's count: the table no longer tiles
        b[130] -= 1                        # lanes 0/1 split the words wrongly
        variants.append(bytes(b))
        b = bytearray(good)
        b[2:4] = b"\0\0"                    # lane 0 state below 2**16
        variants.append(bytes(b))
        for bad in variants:
            ref = _outcome(lambda: lanes.decode(bad, ids, q.shape, path="portable"))
            for path in nat.paths:
                def dec():
                    if len(bad) % 2:
                        return nat.decode(bad, ids, q.shape, path=path)
                    w, W = guarded.words(bad)
                    return nat.decode_words(w, W, ids64, q.shape, np.empty(q.shape, np.int32), path=path)

                got = _outcome(dec)
                if isinstance(ref, str):
                    assert got == ref, (seed, path)
                else:
                    assert not isinstance(got, str) and np.array_equal(got, ref), (seed, path, got)
                checked += 1
    assert checked >= 30 * 10 * len(nat.paths)


def test_bad_model_id_and_arguments(nat):
    q, ids = _obj()
    buf = E.encode(q, ids, coder="lanes32")
    bad = np.asarray(ids, np.int64).copy()
    bad[1] = 240
    with pytest.raises(ValueError, match="model id"):
        nat.decode(buf, bad, q.shape, path="scalar")
    with pytest.raises(ValueError):
        nat.decode(buf, ids, q.shape, prec=13)


def test_pairs_decode_both_objects_and_report_damage(nat, guarded):
    """Two objects decoded together: both equal the library's; a damaged one raises its error."""
    paths = nat.paths[1:]
    if not paths:
        pytest.skip("no vector path in this build")
    q, ids = _obj(3, C=4, N=64)
    q2 = np.roll(q, 5)
    ids64 = np.asarray(ids, np.int64)
    a, b = E.lanes_encode(q, ids), E.lanes_encode(q2, ids)
    bad = bytearray(b)
    bad[130] ^= 3                          # lane 1's count: the table no longer tiles
    msg = _outcome(lambda: lanes.decode(bytes(bad), ids, q.shape))
    assert isinstance(msg, str)
    g2 = Guarded(1 << 16)
    for path in paths:
        wa, Wa = guarded.words(a)
        wb, Wb = g2.words(b)
        oa, ob = nat.decode_pair_words(wa, Wa, wb, Wb, ids64, q.shape, np.empty_like(q), np.empty_like(q), path)
        np.testing.assert_array_equal(oa, q)
        np.testing.assert_array_equal(ob, q2)
        wb, Wb = g2.words(bytes(bad))
        got = _outcome(lambda: nat.decode_pair_words(wa, Wa, wb, Wb, ids64, q.shape, np.empty_like(q),
                                                     np.empty_like(q), path))
        assert got == msg, path
    g2.libc.mprotect(g2.guard, mmap.PAGESIZE, 3)
    with pytest.raises(ValueError):
        nat.decode_pair_words(wa, Wa, wa, Wa, ids64[:3], (3, 77), np.empty((3, 77), np.int32),
                              np.empty((3, 77), np.int32))
