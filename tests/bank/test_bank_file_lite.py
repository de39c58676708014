"""Banks are read without h5py (start-up time) when the file is in the subset h5py writes by
default; these tests hold that reader to h5py's answer, and check that every other file still
reads through h5py."""
from __future__ import annotations

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from alignpred import io as kio  # noqa: E402
from alignpred.bank.bank import Bank  # noqa: E402
from alignpred.bank.registry import PACKAGE_DIR  # noqa: E402

BUNDLED = PACKAGE_DIR / "gemma-3-270m.h5"


def _h5py_read(path):
    with h5py.File(path, "r") as f:
        arrays = {}
        f.visititems(lambda n, o: arrays.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
        return str(f.attrs["kvz_bank"]), str(f.attrs["content_id"]), arrays


def _same(a, b):
    assert a[0] == b[0] and a[1] == b[1]
    assert list(a[2]) == list(b[2])  # same names in the same (visit) order
    for n in a[2]:
        x, y = a[2][n], b[2][n]
        assert x.dtype == y.dtype and x.shape == y.shape, n
        assert x.tobytes() == y.tobytes(), n
        assert x.flags.writeable and x.flags.aligned and x.flags.c_contiguous


def _lite(path, arrays=True):
    with open(path, "rb") as f:
        return kio._h5_lite(bytearray(f.read()), arrays)


def test_bundled_bank_reads_as_h5py_does():
    attrs, found = _lite(BUNDLED)
    got = kio.read_bank_file(BUNDLED)
    _same(got, _h5py_read(BUNDLED))
    assert (attrs["kvz_bank"], attrs["content_id"]) == got[:2] == kio.read_bank_attrs(BUNDLED)
    assert len(found) == len(got[2]) > 100


def _toy_bank(n_blocks=3, d=4, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    for i in range(n_blocks):
        arrays[f"mean/K.{i}.0"] = rng.normal(size=d).astype(np.float32)
        arrays[f"map/K.{i}.0/W"] = rng.normal(size=(2 * d, d)).astype(np.float16)
        arrays[f"map/K.{i}.0/U"] = rng.normal(size=(d, 2)).astype(np.float32)
    arrays["rot/K.0.0"] = np.eye(d, dtype=np.float16)
    arrays["mean/empty"] = np.zeros((0, 3), np.float32)
    return Bank(model="toy-é", signature={"num_layers": n_blocks, "kv_heads": 1, "head_dim": d},
                config={"groups": [], "sources": {}, "note": "ünïcode"}, arrays=arrays)


@pytest.mark.parametrize("n_blocks", [1, 3, 300])  # 300: the group B-tree has more than one level
def test_saved_banks_read_as_h5py_does(tmp_path, n_blocks):
    b = _toy_bank(n_blocks)
    p = tmp_path / "b.h5"
    b.save(p)
    _lite(p)  # in the subset (raises _NotLite otherwise)
    _same(kio.read_bank_file(p), _h5py_read(p))
    assert Bank.load(p).id == b.id


def _write(path, libver=None, **ds_kw):
    with h5py.File(path, "w", libver=libver) as f:
        f.attrs["kvz_bank"] = '{"a": 1}'
        f.attrs["content_id"] = "sha256:00"
        f.create_dataset("g/x", data=np.arange(12, dtype=np.float32).reshape(3, 4), **ds_kw)
        f.create_dataset("y", data=np.arange(5, dtype=np.float16))


@pytest.mark.parametrize("how", ["gzip", "chunked", "latest", "big-endian", "float64", "scalar", "bytes-attr",
                                 "soft-link"])
def test_other_files_fall_back_to_h5py(tmp_path, how):
    p = tmp_path / "o.h5"
    if how == "gzip":
        _write(p, compression="gzip")
    elif how == "chunked":
        _write(p, chunks=(1, 4))
    elif how == "latest":
        _write(p, libver="latest")
    elif how in ("big-endian", "float64"):
        _write(p, dtype=">f4" if how == "big-endian" else np.float64)
    else:
        _write(p)
        with h5py.File(p, "a") as f:
            if how == "scalar":
                f.create_dataset("z", data=np.float32(1.5))
            elif how == "bytes-attr":
                f.attrs["content_id"] = np.bytes_(b"sha256:00")
            else:
                f["g/s"] = h5py.SoftLink("/y")
    with pytest.raises(kio._NotLite):
        _lite(p)
    got = kio.read_bank_file(p)
    ref = _h5py_read(p)
    assert got[:2] == ref[:2] == kio.read_bank_attrs(p)
    assert list(got[2]) == list(ref[2])
    assert all(np.array_equal(got[2][n], ref[2][n]) for n in ref[2])


def test_corrupt_bank_is_refused(tmp_path):
    b = _toy_bank()
    p = tmp_path / "b.h5"
    b.save(p)
    raw = bytearray(p.read_bytes())
    off = raw.rfind(np.asarray(b.arrays["mean/K.1.0"]).tobytes())
    assert off > 0
    raw[off] ^= 1  # one bit of one array: the stored content id no longer matches
    p.write_bytes(bytes(raw))
    from alignpred.errors import BankMismatchError

    with pytest.raises(BankMismatchError, match="does not match its id"):
        Bank.load(p)


def test_truncated_and_garbage_files(tmp_path):
    from alignpred.errors import BankMismatchError, KvzError

    b = _toy_bank()
    p = tmp_path / "b.h5"
    b.save(p)
    raw = p.read_bytes()
    for cut in (0, 8, 100, len(raw) // 2, len(raw) - 1):
        q = tmp_path / f"t{cut}.h5"
        q.write_bytes(raw[:cut])
        with pytest.raises(KvzError):
            Bank.load(q)
    q = tmp_path / "junk.h5"
    q.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(range(256)) * 8)
    with pytest.raises(BankMismatchError):
        kio.read_bank_attrs(q)
    with pytest.raises(KvzError, match="no such file"):
        kio.read_bank_file(tmp_path / "missing.h5")


def test_bundled_bank_loads_without_h5py():
    """Start-up time: resolving and loading the bundled bank does not import h5py (0.07 s or more)."""
    import subprocess
    import sys

    code = ("import sys; from alignpred.bank.registry import resolve_bank, lookup; b = resolve_bank('gemma-3-270m'); "
            "assert lookup(b.id).name == 'gemma-3-270m'; print('h5py' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
