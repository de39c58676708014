"""The fused post-prediction kernel (alignpred.kernels.fused) equals its numpy reference bit for bit."""
import hashlib

import ml_dtypes
import numpy as np
import pytest

from alignpred.kernels.fused import fused_post, reference_post

DTYPES = [ml_dtypes.bfloat16, np.float16, np.float32]


def _bits(a):
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _case(rng, n, d, S, dtype, rope_kind, r=None, frac=0.5, big=False, special=False):
    base = (rng.standard_normal((n, d)) * (1e5 if big else 3)).astype(np.float32)
    q = rng.integers(-50, 51, (d, n)).astype(np.int32)
    delta = (rng.random(n) * (10 if big else 0.1) + 1e-3).astype(np.float32)
    if big:
        q[rng.random((d, n)) < 0.1] = 2 ** 30 - 1
        delta[::3] = np.float32(3e30)            # q * delta overflows to inf
    interp = rng.random(d) < frac
    mean = rng.standard_normal(d).astype(np.float32)
    if special:
        k = rng.integers(0, n * d, 6)
        base.ravel()[k] = np.array([np.inf, -np.inf, np.nan, 1e-40, -0.0, -np.nan], np.float32)
    rope = None
    if rope_kind:
        r = d if r is None else r
        ang = rng.random((n, r // 2)) * 6.3
        rope = (np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32), r, rope_kind)
    fmax = float(ml_dtypes.finfo(dtype).max)
    return base, q, delta, interp, S, mean, rope, fmax, dtype


def _check(args, inplace=False, strided=True):
    base, q, delta, interp, S, mean, rope, fmax, dtype = args
    n, d = base.shape
    with np.errstate(all="ignore"):
        rr, nr = reference_post(*args)
    if inplace:
        b2 = base.copy()
        rec, nat = fused_post(b2, q, delta, interp, S, mean, rope, fmax, dtype, rec=b2)
        assert rec is b2
    elif strided:
        big = np.zeros((3, n + 4, d), dtype)
        rec, nat = fused_post(base, q, delta, interp, S, mean, rope, fmax, dtype, native=big[1, 2:2 + n])
        assert (_bits(big[1, :2]) == 0).all() and (_bits(big[2]) == 0).all()
    else:
        rec, nat = fused_post(base, q, delta, interp, S, mean, rope, fmax, dtype)
    assert (_bits(rec) == _bits(rr)).all()
    assert (_bits(nat) == _bits(nr)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_kind", [None, "half", "interleaved"])
def test_random_blocks(dtype, rope_kind):
    rng = np.random.default_rng(0)
    for n, d, S in [(1, 8, 2), (2, 16, 2), (3, 16, 4), (7, 16, 4), (31, 64, 8), (32, 64, 32), (33, 64, 8),
                    (65, 128, 32), (300, 256, 256), (64, 6, 64), (47, 48, 16)]:
        for frac in (0.0, 0.5, 1.0):
            _check(_case(rng, n, d, S, dtype, rope_kind, frac=frac))
        _check(_case(rng, n, d, S, dtype, rope_kind), inplace=True)
        _check(_case(rng, n, d, S, dtype, rope_kind), strided=False)
    _check(_case(rng, 50, 64, 16, dtype, rope_kind, r=32))      # partial rotary
    _check(_case(rng, 50, 64, 16, dtype, rope_kind, r=0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope_kind", [None, "half", "interleaved"])
def test_adversarial(dtype, rope_kind):
    """Values needing the clip, q * delta overflowing to inf, nan/inf/-0/denormal inputs."""
    rng = np.random.default_rng(1)
    for n, d, S in [(1, 8, 2), (33, 64, 8), (130, 32, 64)]:
        _check(_case(rng, n, d, S, dtype, rope_kind, big=True))
        _check(_case(rng, n, d, S, dtype, rope_kind, special=True))
        _check(_case(rng, n, d, S, dtype, rope_kind, big=True, special=True), inplace=True)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_casts_over_float32_bit_patterns(dtype):
    """The bfloat16/float16 casts against ml_dtypes/numpy on ~1M float32 bit patterns (every
    exponent, mantissas around the rounding ties, subnormals, inf, nan payloads): base = x,
    q = 0, mean = 0, no clip."""
    rng = np.random.default_rng(2)
    hi = np.arange(0, 1 << 16, dtype=np.uint32) << np.uint32(16)           # every sign/exponent/top bits
    lo = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    pats = (hi[:, None] | lo[None, :]).ravel()
    pats = np.concatenate([pats, rng.integers(0, 2 ** 32, 300_000, dtype=np.uint64).astype(np.uint32)])
    x = pats.view(np.float32)
    d = 64
    n = len(x) // d
    base = x[:n * d].reshape(n, d)
    args = (base, np.zeros((d, n), np.int32), np.ones(n, np.float32), np.zeros(d, bool), 256,
            np.zeros(d, np.float32), None, np.inf, dtype)
    _check(args, strided=False)


def test_interp_object_boundaries():
    """Odd rows before an object boundary use their left neighbour only."""
    n, d, S = 12, 4, 4
    base = np.zeros((n, d), np.float32)
    q = np.tile(np.arange(n, dtype=np.int32), (d, 1))
    delta = np.ones(n, np.float32)
    interp = np.array([True, False, True, False])
    rec, _ = fused_post(base, q, delta, interp, S, np.zeros(d, np.float32), None, 1e30, np.float32)
    # t = 1: 0.5 * (0 + 2) + 1 = 2; t = 3 (next is a boundary): 2 + 3 = 5; t = 11 (last): 10 + 11
    assert rec[:, 0].tolist() == [0, 2, 2, 5, 4, 10, 6, 13, 8, 18, 10, 21]
    assert rec[:, 1].tolist() == list(range(n))


def test_rejects_bad_arguments():
    base = np.zeros((4, 8), np.float32)
    q = np.zeros((8, 4), np.int32)
    ok = (np.ones(4, np.float32), np.zeros(8, bool), 256, np.zeros(8, np.float32))
    with pytest.raises(ValueError):
        fused_post(base, q, *ok[:2], 3, ok[3], None, 1.0, np.float32)
    with pytest.raises(TypeError):
        fused_post(base, q.T, *ok, None, 1.0, np.float32)
    with pytest.raises(TypeError):
        fused_post(base, q, *ok, None, 1.0, np.int8)
    with pytest.raises(ValueError):
        fused_post(base, q, *ok, (np.zeros((4, 2), np.float32),) * 2 + (4, "weird"), 1.0, np.float32)


def _hash_case():
    rng = np.random.default_rng(77)
    h = hashlib.sha256()
    for dtype in DTYPES:
        for rope_kind in (None, "half", "interleaved"):
            args = _case(rng, 300, 256, 256, dtype, rope_kind)
            rec, nat = fused_post(*args)
            h.update(rec.tobytes())
            h.update(nat.tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 7, 64, 300])
def test_channel_steps_match_the_definition_and_the_encoder(dtype, n):
    """Format 1.3 per-channel step multipliers: the fused pass equals reference_post bit for bit,
    equals the encoder's reconstruction (quantize), and multipliers of 1 change nothing."""
    from alignpred.kernels.quantize import dequant_add, quantize
    from alignpred.kernels.quantize_ref import dequantize_residual, quantize_residual

    rng = np.random.default_rng(n)
    d, S = 16, 256
    w = (3 * rng.standard_normal((n, d))).astype(np.float32)
    base = rng.standard_normal((n, d)).astype(np.float32)
    delta = np.full(n, 0.1, np.float32)
    delta[0] = 0.00625
    chan = (rng.integers(1, 256, d) / 32).astype(np.float32)
    interp = rng.random(d) < 0.5
    mean = rng.standard_normal(d).astype(np.float32)
    q, wh, _ = quantize(w, delta, interp, S, base=base, chan=chan)
    q_ref, wh_ref = quantize_residual(w - base, delta, interp, S, chan=chan)
    assert np.array_equal(q, q_ref) and np.array_equal(wh, wh_ref)
    assert np.array_equal(dequantize_residual(q, delta, interp, S, chan=chan), wh)
    rr, nr = reference_post(base, q.T.copy(), delta, interp, S, mean, None, 3.0e38, dtype, chan=chan)
    rec, nat = fused_post(base.copy(), q.T.copy(), delta, interp, S, mean, None, 3.0e38, dtype, chan=chan)
    assert np.array_equal(rec.view(np.uint32), rr.view(np.uint32))
    assert np.array_equal(np.asarray(nat).view(np.uint8), np.asarray(nr).view(np.uint8))
    assert np.array_equal(rec.view(np.uint32), (base + wh).view(np.uint32))  # what the encoder predicts from
    ones, _ = fused_post(base.copy(), q.T.copy(), delta, interp, S, mean, None, 3.0e38, dtype,
                         chan=np.ones(d, np.float32))
    plain, _ = fused_post(base.copy(), q.T.copy(), delta, interp, S, mean, None, 3.0e38, dtype)
    assert np.array_equal(ones.view(np.uint32), plain.view(np.uint32))
    step = delta[:, None] * chan[None, :]  # float32 products, as the spec's delta_{r,c}
    assert np.array_equal(dequant_add(base, q.T.copy(), delta, chan), base + q.astype(np.float32) * step)


def test_scratch_rows_shared_across_widths_and_threads():
    """The per-thread scratch rows (kept between calls) never carry one block's values into the
    next: alternating widths in one thread, and blocks in several threads at once, equal the
    reference bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(5)
    cases = [_case(rng, n, d, 256, dtype, rope_kind) for n, d in ((40, 32), (33, 256), (64, 48), (7, 32))
             for dtype, rope_kind in ((ml_dtypes.bfloat16, "half"), (np.float32, "interleaved"))]
    for args in cases + cases[::-1]:
        _check(args, strided=False)
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(lambda a: _check(a, strided=False), cases * 3))


def test_channel_steps_of_the_wrong_length_are_refused():
    base = np.zeros((4, 16), np.float32)
    q = np.zeros((16, 4), np.int32)
    with pytest.raises(ValueError, match="chan"):
        fused_post(base, q, np.ones(4, np.float32), np.zeros(16, bool), 256, np.zeros(16, np.float32), None,
                   1.0, np.float32, chan=np.ones(8, np.float32))
