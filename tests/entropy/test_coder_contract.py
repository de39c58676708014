"""The entropy-coder contract (alignpred.entropy.registry), checked for every registered coder the
same way (numcodecs' ``check_encode_decode`` is the model): round trips through the object API,
several payloads in one call, empty objects, damaged payloads as named errors, and the record's
fields agreeing with what the container writes."""
import numpy as np
import pytest

from alignpred import entropy
from alignpred.entropy import registry
from alignpred.errors import EncodeError, FormatError
from alignpred.format.header import coder_prec, minor_for

CODERS = [c.name for c in registry.coders()]


def _q(seed: int, C: int = 6, N: int = 97) -> np.ndarray:
    rng = np.random.default_rng(seed)
    q = np.round(rng.laplace(0, 2.0 + seed, (C, N))).astype(np.int32)
    q[0] = 0  # an all-zero channel
    q[-1, :3] = [2**31 - 1, -(2**31), 70000]  # the widest raw fields
    return q


def test_registry_is_consistent():
    got = registry.coders()
    assert [c.id for c in got] == sorted({c.id for c in got})  # unique ids, in order
    assert entropy.CODERS == tuple(c.name for c in got)
    assert entropy.CODER_IDS == {c.name: c.id for c in got}
    with pytest.raises(ValueError):
        registry.register(got[0])  # a name (and id) can be registered once
    with pytest.raises(EncodeError, match="unknown entropy coder"):
        entropy.encode(_q(0), np.zeros(6, np.uint8), "nope")
    with pytest.raises(FormatError, match="unknown entropy coder"):
        entropy.decode(b"\0" * 64, np.zeros(6, np.uint8), (6, 97), "nope")


@pytest.mark.parametrize("name", CODERS)
def test_round_trip(name):
    for seed in range(3):
        q = _q(seed)
        ids = entropy.choose_models(q)
        buf = entropy.encode(q, ids, name)
        assert np.array_equal(entropy.decode(buf, ids, q.shape, name), q)
        out = np.full((q.shape[0], q.shape[1] + 5), -7, np.int32)
        entropy.decode(buf, ids, q.shape, name, out=out[:, 2:2 + q.shape[1]])  # into a strided view
        assert np.array_equal(out[:, 2:2 + q.shape[1]], q) and (out[:, :2] == -7).all() and (out[:, -3:] == -7).all()


@pytest.mark.parametrize("name", CODERS)
def test_decode_objects_same_as_one_by_one(name):
    q = _q(4, C=5, N=150)
    ids = entropy.choose_models(q)
    widths = [64, 0, 50, 36]
    edges = np.cumsum([0] + widths)
    bufs = [entropy.encode(q[:, a:b], ids, name) if b > a else b"" for a, b in zip(edges, edges[1:])]
    out = np.empty((5, 150), np.int32)
    assert np.array_equal(entropy.decode_objects(bufs, ids, 5, widths, name, out), q)


@pytest.mark.parametrize("name", CODERS)
def test_empty_object(name):
    ids = np.zeros(3, np.uint8)
    assert entropy.encode(np.zeros((3, 0), np.int32), ids, name) == b""
    assert entropy.decode(b"", ids, (3, 0), name).shape == (3, 0)
    with pytest.raises(FormatError, match="non-empty payload"):
        entropy.decode(b"\0" * 8, ids, (3, 0), name)


@pytest.mark.parametrize("name", CODERS)
def test_damaged_payload_is_a_format_error(name):
    q = _q(1)
    ids = entropy.choose_models(q)
    buf = entropy.encode(q, ids, name)
    for bad in (buf[:-4], buf[:len(buf) // 2], buf + b"\0\0\0\0", b"\xff" * 8):
        with pytest.raises(FormatError):
            entropy.decode(bad, ids, q.shape, name)


@pytest.mark.parametrize("name", CODERS)
def test_record_fields(name):
    c = registry.get(name)
    assert coder_prec(name) == c.precision and 1 <= c.precision <= 16
    assert c.summary and isinstance(c.min_minor, int)
    if c.errors is not None:
        assert all(isinstance(k, int) and isinstance(v, str) and v for k, v in c.errors.items())
    from pathlib import Path

    from alignpred import KvzReader
    from alignpred.codec.config import CodecConfig

    vec = Path(__file__).resolve().parents[2] / "format_spec" / "vectors" / "gemma3-270m-3l-300t.kvz"
    lay = KvzReader(str(vec)).layout
    assert minor_for(lay, CodecConfig(), coder=name) >= c.min_minor
