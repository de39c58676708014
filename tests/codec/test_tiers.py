"""The lossless (two-tier) file: a coarse tier readable alone, and a refinement tier that takes it
to the original bits."""
import numpy as np
import pytest
from kvz_testing import sample_paths, synthetic_cache

from alignpred import ChecksumError, ErrorBudget, KvzError, KvzReader, compress, fit_bank, load_cache
from alignpred.codec.refine import apply, contexts, ordinal, symbols


def same_bits(a, b):
    return np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_ordinal_is_a_monotone_bijection():
    import ml_dtypes

    for dt in (np.float16, ml_dtypes.bfloat16):
        u = np.arange(1 << 16, dtype=np.uint16).view(dt)
        finite = np.isfinite(u.astype(np.float32))
        o = ordinal(u)
        assert len(np.unique(o)) == 1 << 16  # a bijection on bit patterns
        v = u[finite].astype(np.float64)
        order = np.argsort(o[finite], kind="stable")
        assert np.all(np.diff(v[order]) >= 0)  # ordinals order the values
        r = symbols(u[finite], np.zeros(finite.sum(), dt))
        assert same_bits(apply(np.zeros(finite.sum(), dt), r), u[finite])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, "bfloat16"])
def test_lossless_round_trip(dtype, tmp_path):
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    c = synthetic_cache(n_layers=3, heads=2, T=300, d=16, dtype=dt, roped=True)
    bank = fit_bank([synthetic_cache(n_layers=3, heads=2, T=300, d=16, dtype=dt, seed=4, roped=True)], rank=None)
    c.tensors["layers.1.value"][:, 10:20] = 0  # zeros and signed zeros survive
    c.tensors["layers.1.value"][:, 20] = -np.zeros(16, dt)
    info = compress(c, tmp_path / "l.kvz", budget=ErrorBudget(eps=0.03, lossless=True), bank=bank)
    r = KvzReader(tmp_path / "l.kvz", bank=bank)
    assert r.tiers == ("coarse", "exact") and r.version == (1, 1)
    exact = r.read()
    for n, x in c.tensors.items():
        assert same_bits(exact[n], x), n
    coarse = r.read(tier="coarse")
    for n, x in c.tensors.items():
        x64 = x.astype(np.float64)
        assert np.linalg.norm(coarse[n].astype(np.float64) - x64) / np.linalg.norm(x64) <= 0.03
    part = r.read(tokens=(100, 290), layers=[1, 2])
    for n in part:
        assert same_bits(part[n], c.tensors[n][:, 100:290])
    assert info.file_bytes > 0


def test_coarse_tier_reads_only_coarse_objects(tmp_path):
    c = synthetic_cache(n_layers=2, T=600)
    bank = fit_bank([c], rank=None)
    compress(c, tmp_path / "l.kvz", budget=ErrorBudget(eps=0.05, lossless=True), bank=bank)
    r = KvzReader(tmp_path / "l.kvz", bank=bank)
    r.read(tier="coarse")
    assert r.objects_decoded == 4 * 3  # 4 tensors x 3 objects: no refinement object touched
    r.objects_decoded = 0
    r.read()
    assert r.objects_decoded == 2 * 4 * 3
    with pytest.raises(KvzError, match="not 'exact'"):
        KvzReader(compress(c, None, budget=0.05, bank=bank).data, bank=bank).read(tier="exact")


def test_refinement_damage_is_detected(tmp_path):
    c = synthetic_cache(n_layers=2, T=300)
    bank = fit_bank([c], rank=None)
    compress(c, tmp_path / "l.kvz", budget=ErrorBudget(eps=0.05, lossless=True), bank=bank)
    r = KvzReader(tmp_path / "l.kvz", bank=bank)
    e = r.index[len(r.index) // 2 + 1]  # a refinement object
    raw = bytearray((tmp_path / "l.kvz").read_bytes())
    raw[e.offset + e.length // 2] ^= 0x10
    bad = KvzReader(bytes(raw), bank=bank)
    bad.read(tier="coarse")  # the coarse tier alone is intact
    with pytest.raises(ChecksumError, match="refinement"):
        bad.read()


def test_lossless_on_real_samples():
    p = sample_paths()[1]
    c = load_cache(p)
    info = compress(c, None, budget=ErrorBudget(eps=0.01, lossless=True), bank="gemma-3-270m")
    out = KvzReader(info.data).read(layers=4)
    for n in out:
        assert same_bits(out[n], c.tensors[n])
    assert info.bpv < 11.0  # below pcodec's 10.85 on 2,048-token caches; measured 9.80 here


def test_contexts_are_exponents():
    import ml_dtypes

    x = np.array([1.0, 2.0, 3.0, 0.0], ml_dtypes.bfloat16)
    assert contexts(x).tolist() == [127, 128, 128, 0]


@pytest.mark.slow
def test_lossless_round_trip_on_every_sample_any_thread_count_and_process(tmp_path):
    """Every bundled sample, whole: the exact tier decodes to the input bits with 1, 2 and 4 decode
    threads, and in a second process."""
    import subprocess
    import sys

    for i, p in enumerate(sample_paths()):
        c = load_cache(p)
        out = tmp_path / f"s{i}.kvz"
        compress(c, out, budget=ErrorBudget(eps=0.01, lossless=True), bank="gemma-3-270m")
        for threads in (1, 2, 4):
            got = KvzReader(out, threads=threads).read()
            for n in got:
                assert same_bits(got[n], c.tensors[n]), (p, threads, n)
    code = ("import sys, numpy as np\n"
            "from alignpred import KvzReader, load_cache\n"
            "ok = True\n"
            "for kvz, src in zip(sys.argv[1::2], sys.argv[2::2]):\n"
            "    c = load_cache(src); got = KvzReader(kvz).read()\n"
            "    ok &= all(np.array_equal(got[n].view(np.uint8), np.asarray(c.tensors[n]).view(np.uint8)) for n in got)\n"
            "print(ok)\n")
    args = [a for i, p in enumerate(sample_paths()) for a in (str(tmp_path / f"s{i}.kvz"), p)]
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "True", res.stderr
