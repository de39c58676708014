"""Bad input: every case either round-trips correctly or fails with one clear line naming the
file, the tensor and a fix — in the library (a KvzError subclass) and in the CLI (exit status
non-zero, ``Error: ...`` on one line, no traceback), leaving nothing behind."""
import errno
import json
import os
import struct
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner
from kvz_testing import synthetic_cache

from alignpred import (
    BankMismatchError,
    KvzError,
    KvzReader,
    LayoutError,
    NonFiniteError,
    compress,
    fit_bank,
    load_cache,
    save_cache,
)
from kvz.cli.main import cli


def kvz(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    return res.exit_code, res.output


def one_line_error(code, out, *must):
    assert code != 0, out
    lines = [ln for ln in out.splitlines() if ln.strip() and "Warning" not in ln and not ln.startswith("  ")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    assert "Traceback" not in out
    for m in must:
        assert str(m) in lines[0], f"{m!r} not in {lines[0]!r}"
    return lines[0]


def leftovers(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".tmp"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    c = synthetic_cache(n_layers=2, T=40, d=16)
    bank = fit_bank([c], rank=4, rotations=False)
    bank.save(d / "bank.h5")
    save_cache(d / "good.safetensors", c.tensors, c.metadata)
    return d, c, bank


def _write(d, name, tensors, meta=None):
    p = d / name
    save_cache(p, tensors, meta or {})
    return p


def _raw_safetensors(path, tensors: dict, st_dtype: str):
    header, blobs, off = {}, [], 0
    for k, a in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[k] = {"dtype": st_dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


def nrmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


# -- refused inputs ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite(base, tmp_path, bad):
    d, c, bank = base
    t = {k: v.copy() for k, v in c.tensors.items()}
    t["layers.1.value"][0, 7, 3] = bad
    p = _write(tmp_path, "nan.safetensors", t, c.metadata)
    with pytest.raises(NonFiniteError, match="nan.safetensors: layers.1.value: .*token 7, channel 3"):
        compress(load_cache(p), tmp_path / "x.kvz", budget=0.05, bank=bank)
    one_line_error(*kvz("compress", p, "--bank", d / "bank.h5", "-q"), p, "layers.1.value", "replace")
    assert not (tmp_path / "nan.kvz").exists() and leftovers(tmp_path) == []


def test_empty_cache(base, tmp_path):
    d, c, _ = base
    p = _write(tmp_path, "empty.safetensors", {k: v[:, :0] for k, v in c.tensors.items()}, c.metadata)
    one_line_error(*kvz("compress", p, "--bank", d / "bank.h5", "-q"), p, "no tokens", "capture at least one")
    p2 = _write(tmp_path, "none.safetensors", {})
    one_line_error(*kvz("compress", p2, "--bank", d / "bank.h5", "-q"), p2, "no tensors")
    assert leftovers(tmp_path) == []


def test_mismatched_shapes(base, tmp_path):
    d, c, _ = base
    t = dict(c.tensors)
    t["layers.1.value"] = t["layers.1.value"][:, :30]
    p = _write(tmp_path, "mm.safetensors", t)
    one_line_error(*kvz("compress", p, "--bank", d / "bank.h5", "-q"), p, "layers.1.value", "must have the same shape")
    t = dict(c.tensors)
    del t["layers.1.key"]
    p = _write(tmp_path, "missing.safetensors", t)
    one_line_error(*kvz("compress", p, "--bank", d / "bank.h5", "-q"), p, "missing tensors: layers.1.key")
    t = {("layers.01.key" if k == "layers.1.key" else k): v for k, v in c.tensors.items()}
    p = _write(tmp_path, "names.safetensors", t)
    one_line_error(*kvz("compress", p, "--bank", d / "bank.h5", "-q"), p, "layers.01.key", "rename")


@pytest.mark.parametrize("st_dtype,np_dtype", [("I8", np.int8), ("F64", np.float64), ("U8", np.uint8)])
def test_unknown_dtype(base, tmp_path, st_dtype, np_dtype):
    d, c, _ = base
    p = tmp_path / "dt.safetensors"
    _raw_safetensors(p, {k: v.astype(np_dtype) for k, v in c.tensors.items()}, st_dtype)
    with pytest.raises(LayoutError, match="unsupported dtype"):
        load_cache(p)
    one_line_error(*kvz("compress", p, "--bank", d / "bank.h5", "-q"), p, "layers.0.key", st_dtype, "convert")


def test_wrong_bank(base, tmp_path):
    d, c, bank = base
    out = tmp_path / "g.kvz"
    assert kvz("compress", d / "good.safetensors", "--bank", d / "bank.h5", "-o", out, "-q")[0] == 0
    other = fit_bank([synthetic_cache(n_layers=2, T=40, d=16, seed=9)], rank=4, rotations=False)
    other.save(tmp_path / "other.h5")
    with pytest.raises(BankMismatchError, match="needs bank"):
        KvzReader(out, bank=other).read()
    one_line_error(*kvz("decompress", out, "--bank", tmp_path / "other.h5", "-q"), out, "needs bank",
                   "use the bank the file was compressed with")
    one_line_error(*kvz("decompress", out, "-q"), out, "pass the bank it was written with")
    # a bank for another model shape
    fit_bank([synthetic_cache(n_layers=3, T=40, d=16)], rank=4, rotations=False).save(tmp_path / "b3.h5")
    one_line_error(*kvz("compress", d / "good.safetensors", "--bank", tmp_path / "b3.h5", "-q"),
                   "good.safetensors", "bank fits", "kvz calibrate")
    # not a bank at all
    one_line_error(*kvz("compress", d / "good.safetensors", "--bank", d / "good.safetensors", "-q"),
                   "good.safetensors", "not a kvz bank")
    assert leftovers(tmp_path) == []


def test_not_kvz_and_missing_files(base, tmp_path):
    d, _, _ = base
    one_line_error(*kvz("decompress", d / "good.safetensors", "-q"), "good.safetensors", "not a .kvz file")
    one_line_error(*kvz("inspect", tmp_path / "nope.kvz"), "nope.kvz", "no such file")
    one_line_error(*kvz("compress", tmp_path / "nope.safetensors", "--bank", d / "bank.h5", "-q"),
                   "nope.safetensors", "no such file")
    (tmp_path / "t.kvz").write_bytes(b"\x89KVZ\r\n\x1a\n")
    one_line_error(*kvz("inspect", tmp_path / "t.kvz"), "t.kvz", "truncated")


# -- inputs that must round-trip -----------------------------------------------------------------
def _roundtrip(tmp_path, tensors, meta=None, eps=0.05, self_cal=True, bank=None):
    p = _write(tmp_path, "rt.safetensors", tensors, meta)
    args = ["compress", p, "-q", "--force", "--eps", eps] + (["--self-calibrate"] if self_cal else ["--bank", bank])
    code, out = kvz(*args)
    assert code == 0, out
    code, out = kvz("decompress", tmp_path / "rt.kvz", "-o", tmp_path / "back.safetensors", "-q", "--force",
                    *(["--bank", bank] if bank else []))
    assert code == 0, out
    back = load_cache(tmp_path / "back.safetensors").tensors
    assert set(back) == set(tensors)
    for k in tensors:
        assert back[k].dtype == tensors[k].dtype and back[k].shape == tensors[k].shape
        assert np.isfinite(back[k].astype(np.float32)).all()
    return back


def test_zero_variance_channels(base, tmp_path):
    _, c, _ = base
    t = {k: v.copy() for k, v in c.tensors.items()}
    for k in t:
        t[k][..., 3] = 1.5   # constant channel
        t[k][..., 5] = 0.0   # zero channel
    back = _roundtrip(tmp_path, t)
    assert max(nrmse(back[k], t[k]) for k in t) <= 0.05 + 1e-9


def test_all_zero_tensors(base, tmp_path):
    _, c, _ = base
    t = {k: np.zeros_like(v) for k, v in c.tensors.items()}
    back = _roundtrip(tmp_path, t)
    assert all(not back[k].astype(np.float32).any() for k in t)
    # one all-zero tensor in an otherwise normal cache, with an external bank
    d, c, _ = base
    t = dict(c.tensors)
    t["layers.0.value"] = np.zeros_like(t["layers.0.value"])
    back = _roundtrip(tmp_path, t, self_cal=False, bank=d / "bank.h5")
    assert not back["layers.0.value"].astype(np.float32).any()
    assert nrmse(back["layers.1.key"], t["layers.1.key"]) <= 0.05 + 1e-9


def test_fp16_extremes(base, tmp_path):
    _, c, _ = base
    t = {}
    for k, v in c.tensors.items():
        x = v.astype(np.float32)
        x = x / np.abs(x).max() * 65504.0
        t[k] = x.astype(np.float16)
        t[k][0, 0, 0], t[k][0, 1, 0] = 65504.0, -65504.0
    assert max(float(np.abs(v.astype(np.float32)).max()) for v in t.values()) == 65504.0
    back = _roundtrip(tmp_path, t)
    assert max(nrmse(back[k], t[k]) for k in t) <= 0.05 + 1e-9


# -- disk full -----------------------------------------------------------------------------------
class _FullFile:
    """A file object whose writes fail with ENOSPC after ``budget`` bytes."""

    def __init__(self, f, budget):
        self.f, self.budget = f, budget

    def write(self, b):
        if len(b) > self.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.budget -= len(b)
        return self.f.write(b)

    def __getattr__(self, n):
        return getattr(self.f, n)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return self.f.__exit__(*a)


def test_disk_full_simulated(base, tmp_path, monkeypatch):
    d, c, bank = base
    import alignpred.io as aio

    out = tmp_path / "full.kvz"
    compress(c, out, budget=0.05, bank=bank)
    old = out.read_bytes()
    real = os.fdopen
    monkeypatch.setattr(aio.os, "fdopen", lambda fd, *a, **k: _FullFile(real(fd, *a, **k), 100))
    with pytest.raises(KvzError, match="full.kvz: No space left on device; free some space"):
        compress(c, out, budget=0.02, bank=bank)
    assert out.read_bytes() == old and leftovers(tmp_path) == []
    one_line_error(*kvz("compress", d / "good.safetensors", "--bank", d / "bank.h5", "-o", out, "-q", "--force"),
                   "full.kvz", "No space left", "free some space")
    one_line_error(*kvz("decompress", out, "--bank", d / "bank.h5", "-o", tmp_path / "o.safetensors", "-q"),
                   "o.safetensors", "No space left")
    assert out.read_bytes() == old and leftovers(tmp_path) == [] and not (tmp_path / "o.safetensors").exists()


def test_disk_full_tmpfs(base, tmp_path):
    """A real 64 KiB tmpfs (needs root and mount; skipped otherwise)."""
    d, c, bank = base
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        big = synthetic_cache(n_layers=4, T=600, d=32)   # 307 KB raw; ~118 KB at eps 0.01, ~27 KB at 0.3
        save_cache(tmp_path / "big.safetensors", big.tensors, big.metadata)
        bbank = fit_bank([big], rank=4, rotations=False)
        bbank.save(tmp_path / "bbank.h5")
        one_line_error(*kvz("compress", tmp_path / "big.safetensors", "--bank", tmp_path / "bbank.h5", "--eps", 0.01,
                            "-o", mnt / "big.kvz", "-q"), "big.kvz", "No space left")
        assert os.listdir(mnt) == []
        compress(big, mnt / "small.kvz", budget=0.3, bank=bbank)   # fits
        one_line_error(*kvz("decompress", mnt / "small.kvz", "--bank", tmp_path / "bbank.h5",
                            "-o", mnt / "x.safetensors", "-q"), "x.safetensors", "No space left")
        assert os.listdir(mnt) == ["small.kvz"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)  # lazy: a reader may still map a file


def test_disk_full_in_the_spool_says_how_much_room_is_needed(base, tmp_path, monkeypatch):
    """Compress spools payloads next to the output before writing the file: a full disk there is
    the same one-line message as for the file, saying that about twice the output's size is needed."""
    d, c, bank = base
    import alignpred.io as aio

    real = aio.tempfile.TemporaryFile
    monkeypatch.setattr(aio.tempfile, "TemporaryFile", lambda *a, **k: _FullFile(real(*a, **k), 100))
    with pytest.raises(KvzError, match=r"full.kvz: No space left on device \(the temporary spool.*twice the output's "
                                       r"size free.*; free some space"):
        compress(c, tmp_path / "full.kvz", budget=0.05, bank=bank)
    assert leftovers(tmp_path) == []
