"""The row quantiser's vector path (float32, 16 lanes) against the exact float64 definition, on
the rows that leave float32's range, and the AMX byte planes against the int16 rows."""
from __future__ import annotations

import numpy as np
import pytest

from alignpred.kernels import intmap as im
from alignpred.kernels.intmap_rows import _quantize_planes, _row_scales


def _ref(x, shift):
    """numpy definition (float64, exact scalings): the integers and exponents of quantize_rows."""
    x64 = np.ldexp(x.astype(np.float64), -shift.astype(np.int32)[None, :])
    m = np.abs(x64).max(axis=1, initial=0.0)
    e = np.where(m > 0, np.frexp(m)[1], 0).astype(np.int32) - np.int32(im.BX - 1)
    q = np.clip(np.rint(np.ldexp(x64, -e[:, None])), -im.XQ_MAX, im.XQ_MAX).astype(np.int16)
    return q, e


def _edge_rows(d: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Rows that each take another path, and shifts at the bounds (+-SHIFT_MAX)."""
    shift = rng.integers(-im.SHIFT_MAX, im.SHIFT_MAX + 1, d).astype(np.int32)
    base = rng.standard_normal(d).astype(np.float32)
    rows = [
        base,                                            # ordinary
        np.zeros(d, np.float32),                         # all zero
        base / np.abs(base).max() * np.float32(3e38),    # float32 products overflow (shift < 0)
        base * np.float32(1e-30),                        # products below float32's normal range
        base * np.float32(1e-44),                        # subnormal inputs
        np.where(np.arange(d) == d - 1, np.float32(1.0), np.float32(1e-42)),   # max in the last channel
        np.where(np.arange(d) % 16 == 3, base, 0).astype(np.float32),          # sparse
    ]
    return np.stack(rows).astype(np.float32), shift


@pytest.mark.parametrize("d", [16, 64, 256, 17, 31, 300, 5])
def test_vector_path_matches_the_float64_definition(d):
    rng = np.random.default_rng(d)
    x, shift = _edge_rows(d, rng)
    for sh in (shift, np.zeros(d, np.int32), np.full(d, im.SHIFT_MAX, np.int32), np.full(d, -im.SHIFT_MAX, np.int32)):
        with np.errstate(over="ignore", under="ignore"):
            rq, re_ = _ref(x, sh)
        xq, xe = im.quantize_rows(x, sh)
        assert (xe == re_).all(), (xe, re_)
        assert (xq[:, :d] == rq).all()
        assert (xq[:, d:] == 0).all()


@pytest.mark.parametrize("d", [256, 300, 7])
def test_planes_are_the_int16_rows(d):
    """The AMX path's planes hold the vector kernel's integers, non-finite rows included."""
    rng = np.random.default_rng(1 + d)
    x, shift = _edge_rows(d, rng)
    x = np.concatenate([x, np.array([[np.inf] + [1.0] * (d - 1), [np.nan] * d], np.float32)])
    K2 = d + (d & 1)
    K64 = -(-K2 // 64) * 64
    xq, xe = im.quantize_rows(x, shift)
    xh = np.full(len(x) * K64, 77, np.int8)
    xl = np.full(len(x) * K64, 77, np.uint8)
    pe = np.empty(len(x), np.int32)
    _quantize_planes(x, *_row_scales(shift), K2, xh, xl, 0, K64, pe)
    q = (256 * xh.reshape(len(x), K64).astype(np.int32) + xl.reshape(len(x), K64))[:, :K2]
    assert (q == xq).all() and (pe == xe).all()
    assert (xh.reshape(len(x), K64)[:, K2:] == 77).all()     # the padding is not written


def test_out_buffer_is_checked():
    x = np.ones((4, 6), np.float32)
    with pytest.raises(ValueError, match="C-contiguous int16"):
        im.quantize_rows(x, out=np.empty((4, 8), np.int16)[:, :6])
    with pytest.raises(ValueError, match="C-contiguous int16"):
        im.quantize_rows(x, out=np.empty((4, 6), np.int32))
    out = np.empty((4, 6), np.int16)
    assert im.quantize_rows(x, out=out)[0] is out
