"""``KvzReader.read`` puts every tensor of a read in one allocation (views into one array: huge
pages where the kernel gives them, instead of a page fault per 4 KiB of each tensor); the values
are those of ``iter_layers``, which still gives each tensor its own array (streaming consumers
free tensors one by one)."""
import numpy as np
import pytest
from kvz_testing import sample_paths

from alignpred import KvzReader, compress, load_cache


@pytest.fixture(scope="module")
def data(real_bank):
    return compress(load_cache(sample_paths()[0]), None, budget=0.03, bank=real_bank).data, real_bank


def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@pytest.mark.parametrize("tokens, layers, threads", [(None, None, 1), ((3, 200), [0, 5, 17], 1),
                                                     ((0, 256), 4, 2), (None, None, 2)])
def test_one_allocation_same_values(data, tokens, layers, threads):
    blob, bank = data
    r = KvzReader(blob, bank=bank, threads=threads)
    got = r.read(tokens=tokens, layers=layers)
    streamed = {name: arr.copy() for name, arr in r.iter_layers(tokens=tokens, layers=layers)}
    assert got.keys() == streamed.keys()
    for k in got:
        assert got[k].shape == streamed[k].shape and got[k].dtype == streamed[k].dtype
        assert np.array_equal(got[k].view(np.uint16), streamed[k].view(np.uint16)), k
    roots = {id(_root(a)) for a in got.values()}
    assert len(roots) == 1 and _root(next(iter(got.values()))).nbytes >= sum(a.nbytes for a in got.values())
    # the tensors do not overlap: writing one leaves the others as they were
    first, *rest = got
    before = {k: got[k].copy() for k in rest}
    got[first][...] = 0
    assert all(np.array_equal(got[k].view(np.uint16), before[k].view(np.uint16)) for k in rest)


def test_streamed_tensors_are_separate_allocations(data):
    blob, bank = data
    arrays = [arr for _, arr in KvzReader(blob, bank=bank, threads=1).iter_layers(tokens=(0, 64), layers=3)]
    assert len(arrays) == 6 and len({id(_root(a)) for a in arrays}) == 6   # (all alive: no id reused)
