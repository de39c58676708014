"""The kvz command line: round trip, JSON output, one-line errors without tracebacks."""
import json
import subprocess
import sys

import numpy as np
from click.testing import CliRunner
from kvz_testing import synthetic_cache

from alignpred import load_cache, save_cache
from kvz.cli.main import cli


def _write_cache(tmp_path, **kw):
    c = synthetic_cache(**kw)
    p = tmp_path / "c.safetensors"
    save_cache(p, c.tensors, c.metadata)
    return p, c


def test_calibrate_compress_inspect_decompress(tmp_path):
    p, c = _write_cache(tmp_path, T=300, roped=True)
    r = CliRunner()
    res = r.invoke(cli, ["calibrate", str(p), "-o", str(tmp_path / "b.h5"), "--rank", "8", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["bank_id"].startswith("sha256:")
    res = r.invoke(cli, ["compress", str(p), "-o", str(tmp_path / "c.kvz"), "--eps", "0.02", "--bank",
                         str(tmp_path / "b.h5"), "--json", "-q"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["nrmse_max_tensor"] <= 0.02 and 0 < info["bpv"] < 16
    res = r.invoke(cli, ["inspect", str(tmp_path / "c.kvz"), "--json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.output)
    assert abs(s["bpv"] - info["bpv"]) < 1e-9 and s["bank_embedded"] is False
    assert set(s["tensors"]) == set(c.tensors)
    res = r.invoke(cli, ["decompress", str(tmp_path / "c.kvz"), "-o", str(tmp_path / "d.safetensors"), "--bank",
                         str(tmp_path / "b.h5"), "-q"])
    assert res.exit_code == 0, res.output
    d = load_cache(tmp_path / "d.safetensors")
    for n, x in c.tensors.items():
        y = d.tensors[n]
        assert y.shape == x.shape and y.dtype == x.dtype
        x64 = x.astype(np.float64)
        assert np.linalg.norm(y.astype(np.float64) - x64) / np.linalg.norm(x64) <= 0.02
    assert d.metadata.get("keys_roped") == "true"


def test_self_calibrate_embeds_bank(tmp_path):
    p, _ = _write_cache(tmp_path, T=100)
    r = CliRunner()
    res = r.invoke(cli, ["compress", str(p), "-o", str(tmp_path / "c.kvz"), "--self-calibrate", "--rank", "4",
                         "--json", "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["bank_bytes"] > 0
    res = r.invoke(cli, ["decompress", str(tmp_path / "c.kvz"), "-o", str(tmp_path / "d.safetensors"), "-q"])
    assert res.exit_code == 0, res.output


def test_errors_are_one_line(tmp_path):
    r = CliRunner()
    cases = [["compress", str(tmp_path / "missing.safetensors"), "--self-calibrate"],
             ["inspect", str(tmp_path / "missing.kvz")]]
    junk = tmp_path / "junk.kvz"
    junk.write_bytes(b"\x00" * 100)
    cases.append(["inspect", str(junk)])
    cases.append(["decompress", str(junk)])
    for args in cases:
        res = r.invoke(cli, args)
        assert res.exit_code != 0
        assert "Traceback" not in res.output
        lines = [ln for ln in res.output.strip().splitlines() if ln]
        assert len(lines) == 1 and lines[0].startswith("Error:"), res.output


def test_cli_start_skips_numba_blas_probe():
    """The CLI's start-up shortcut: numba's first kernel load no longer imports scipy.linalg
    (0.4 s) or cffi, nor reads every distribution's entry points, and afterwards scipy.linalg,
    cffi and numba's own BLAS-backed np.dot still work."""
    code = (
        "import sys, numpy as np\n"
        "from kvz.cli.main import skip_numba_blas_probe\n"
        "skip_numba_blas_probe()\n"
        "from alignpred.kernels.intmap import quantize_rows\n"
        "quantize_rows(np.ones((1, 2), np.float32))\n"
        "assert 'numba.np.arraymath' in sys.modules and 'scipy.linalg' not in sys.modules\n"
        "assert 'cffi' not in sys.modules and 'pycparser' not in sys.modules\n"
        "import numba.core.entrypoints, importlib.util\n"
        "assert numba.core.entrypoints._already_initialized\n"
        "assert importlib.util.find_spec('cffi') is None or __import__('cffi').FFI()\n"
        "import numba, scipy.linalg\n"
        "assert abs(scipy.linalg.det(2 * np.eye(2)) - 4) < 1e-12\n"
        "dot = numba.njit(lambda a, b: np.dot(a, b))\n"
        "assert (dot(np.eye(2), 3 * np.eye(2)) == 3 * np.eye(2)).all()\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_decompress_several_files(tmp_path):
    """One `kvz decompress` call decodes several files (the start-up paid once) to the same bytes
    as one call per file; outputs are checked before anything is decoded."""
    r = CliRunner()
    srcs = []
    for i, T in enumerate((120, 77)):
        d = tmp_path / f"in{i}"
        d.mkdir()
        p, _ = _write_cache(d, T=T, seed=i)
        res = r.invoke(cli, ["compress", str(p), "-o", str(tmp_path / f"c{i}.kvz"), "--self-calibrate", "--rank", "4",
                             "-q"])
        assert res.exit_code == 0, res.output
        srcs.append(str(tmp_path / f"c{i}.kvz"))
    for i, s in enumerate(srcs):
        res = r.invoke(cli, ["decompress", s, "-o", str(tmp_path / f"one{i}.safetensors"), "-q"])
        assert res.exit_code == 0, res.output
    outdir = tmp_path / "out"
    outdir.mkdir()
    res = r.invoke(cli, ["decompress", *srcs, "-o", str(outdir), "--json", "-q"])
    assert res.exit_code == 0, res.output
    files = json.loads(res.output)["files"]
    assert [f["input"] for f in files] == srcs
    for i, f in enumerate(files):
        assert f["output"] == str(outdir / f"c{i}.safetensors")
        assert (outdir / f"c{i}.safetensors").read_bytes() == (tmp_path / f"one{i}.safetensors").read_bytes()
    # an existing output stops the whole call before any decoding: nothing new is written
    (outdir / "c0.safetensors").unlink()
    res = r.invoke(cli, ["decompress", *srcs, "-o", str(outdir), "-q"])
    assert res.exit_code != 0 and "--force" in res.output
    assert not (outdir / "c0.safetensors").exists()
    res = r.invoke(cli, ["decompress", *srcs, "-o", str(outdir), "-q", "--force"])
    assert res.exit_code == 0 and res.output.splitlines() == [f"{outdir / f'c{i}.safetensors'}: 6 tensors"
                                                              for i in range(2)]
    # several inputs need a directory, and distinct output names
    res = r.invoke(cli, ["decompress", *srcs, "-o", str(tmp_path / "x.safetensors")])
    assert res.exit_code == 2 and "existing directory" in res.output
    res = r.invoke(cli, ["decompress", srcs[0], srcs[0], "-o", str(outdir)])
    assert res.exit_code == 2 and "both be written" in res.output


def test_decompress_start_up_imports(tmp_path):
    """Start-up time of `kvz decompress` (stderr not a terminal, so no bar): the process does not
    import h5py (the bank is read without it), tqdm (no bar to show), cffi or scipy.linalg (numba's
    probes, skipped), and decodes to the same bytes as the library."""
    p, c = _write_cache(tmp_path, T=150, roped=True)
    r = CliRunner()
    bank = str(tmp_path / "b.h5")
    assert r.invoke(cli, ["calibrate", str(p), "-o", bank, "--rank", "4"]).exit_code == 0
    kvz = str(tmp_path / "c.kvz")
    assert r.invoke(cli, ["compress", str(p), "-o", kvz, "--bank", bank, "-q"]).exit_code == 0
    out = str(tmp_path / "d.safetensors")
    code = ("import atexit, sys\n"
            "atexit.register(lambda: print(sorted(m for m in ('tqdm', 'h5py', 'cffi', 'scipy.linalg') "
            "if m in sys.modules)))\n"
            "from kvz.cli.main import main\n"
            f"sys.argv = ['kvz', 'decompress', {kvz!r}, '-o', {out!r}, '--bank', {bank!r}]\n"
            "main()\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout
    from alignpred import KvzReader

    ref = KvzReader(kvz, bank=bank).read()
    got = load_cache(out).tensors
    assert set(got) == set(ref) and all(np.asarray(got[k]).tobytes() == np.asarray(ref[k]).tobytes() for k in ref)


def test_kvz_process_exit(tmp_path):
    """`kvz` leaves its process without the interpreter's teardown (cli/startup.py exit_process) but
    as sys.exit would: statuses, stdout/stderr flushed, atexit handlers and other threads finished."""
    def run(*args, pre=""):
        code = (pre + "import sys\nfrom kvz.cli.main import main\n"
                f"sys.argv = ['kvz', *{list(args)!r}]\nmain()\nprint('not reached')\n")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)

    from alignpred import __version__

    r = run("--version")
    assert r.returncode == 0 and r.stdout == f"kvz, version {__version__}\n"
    r = run("inspect", str(tmp_path / "missing.kvz"))
    assert r.returncode == 1 and r.stderr.strip().endswith("no such file") and "not reached" not in r.stdout
    r = run("decompress")
    assert r.returncode == 2 and "Missing argument" in r.stderr
    pre = ("import atexit, threading, time\n"
           "atexit.register(lambda: print('atexit ran', flush=False))\n"
           "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=False))).start()\n")
    r = run("--help", pre=pre)
    assert r.returncode == 0 and r.stdout.splitlines()[0].startswith("Usage: kvz")
    assert r.stdout.splitlines()[-2:] == ["thread done", "atexit ran"]
