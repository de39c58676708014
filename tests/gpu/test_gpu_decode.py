"""The GPU decoder (alignpred.gpu), in Triton's interpreter on this CPU (on CUDA where there is a
device): bit-identical to the CPU decoder on the golden vectors and on small caches in every
output layout, and the CPU's named errors on corrupt streams.

Default suite: the lanes32 golden vectors (entropy and full decode), the constriction vector's
symbols, a small synthetic cache with the 1.3 step features in both coders and every layout, and
corrupt payloads. ``slow``: the rans4 golden vectors (rans4 is sequential within an object: 65,536
iterations for a 256x256 object, minutes in the interpreter) and the bundled Gemma samples.
"""
import json
import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

import torch  # noqa: E402
from conftest import ROOT, sample_paths, synthetic_cache  # noqa: E402

from alignpred import Bank, CodecConfig, KvzReader, compress, fit_bank, load_cache  # noqa: E402
from alignpred.errors import FormatError  # noqa: E402
from alignpred.gpu import decoder as GD  # noqa: E402
from alignpred.gpu import entropy as GE  # noqa: E402

VEC = os.path.join(ROOT, "format_spec", "vectors")
MANIFEST = json.load(open(os.path.join(VEC, "manifest.json")))
VECTORS = {v["name"]: v for v in MANIFEST["vectors"]}


def _coder(v):
    return v["compress"].get("coder", "rans4")


def _marks(v):
    """rans4 vectors, and the Gemma lanes32 vector (14-22 s here), are slow."""
    return [pytest.mark.slow] if _coder(v) == "rans4" or "gemma" in v["name"] else []


def _reader(v):
    bank = Bank.load(os.path.join(VEC, v["files"]["bank"])) if "bank" in v["files"] else None
    return KvzReader(os.path.join(VEC, v["files"]["kvz"]), bank=bank, threads=1)


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.cpu()
    return (t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)).numpy()


def _cpu_plain(r, **kw) -> np.ndarray:
    """The CPU decoder's coarse tier as bits ``[layers, 2, tokens, heads, dim]``."""
    out = r.read(tier="coarse", **kw)
    lay = r.layout
    layers = sorted({int(k.split(".")[1]) for k in out})
    arr = []
    for i in layers:
        pair = []
        for kind in ("key", "value"):
            a = out[f"layers.{i}.{kind}"]
            a = a[0] if a.ndim == 4 else a
            pair.append(np.ascontiguousarray(a.transpose(1, 0, 2)))
        arr.append(np.stack(pair))
    res = np.stack(arr)
    return res.view(np.int16 if res.itemsize == 2 else np.int32).reshape(len(layers), 2, -1, lay.kv_heads, lay.head_dim)


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(v)) for n, v in sorted(VECTORS.items())])
def test_symbols_match_golden(name):
    """Every object's symbols, decoded on the device, equal the stored ones (all coders, all formats)."""
    v = VECTORS[name]
    r = _reader(v)
    S = r.config.object_size
    with np.load(os.path.join(VEC, v["files"]["expected"])) as z:
        q, _, _ = GE.symbols(r, len(r.metas), 0, r.n_objects_per_tensor, r.layout.n_tokens)
        q = q.cpu().numpy()
        for ti in range(len(r.metas)):
            for j in range(r.n_objects_per_tensor):
                want = z[f"q.{ti}.{j}"]
                assert np.array_equal(q[ti][:, j * S:j * S + want.shape[1]], want), (ti, j)


EXACT = sorted(n for n, v in VECTORS.items() if v["compress"]["config"].get("arith") == "exact")


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(VECTORS[n])) for n in EXACT])
def test_decode_matches_cpu_on_golden(name):
    """Exact-arithmetic vectors: the device's coarse tier has the CPU decoder's bits (= expected)."""
    v = VECTORS[name]
    r = _reader(v)
    got = _bits(GD.decode(r))
    assert np.array_equal(got, _cpu_plain(r))
    if not v["compress"].get("lossless"):
        with np.load(os.path.join(VEC, v["files"]["expected"])) as z:
            for i in range(r.layout.num_layers):
                want = z[f"dec.layers.{i}.key"]
                want = want[0] if want.ndim == 4 else want
                assert np.array_equal(got[i, 0], np.ascontiguousarray(want.transpose(1, 0, 2)).view(got.dtype))


def test_float_arith_refused():
    from alignpred.errors import KvzError

    with pytest.raises(KvzError, match="exact arithmetic"):
        GD.decode(_reader(VECTORS["synth-tensor-extbank"]))


def _small(tmp_path, coder, T=80, **cfg):
    c = synthetic_cache(n_layers=2, heads=2, T=T, d=32, roped=True, seed=3)
    bank = fit_bank([synthetic_cache(n_layers=2, heads=2, T=T, d=32, roped=True, seed=5)], rank=4)
    p = tmp_path / f"{coder}.kvz"
    compress(c, p, eps=0.05, bank=bank, coder=coder, trust_rope=True,
             config=CodecConfig(object_size=32, sink_tokens=2, **cfg))
    return KvzReader(p, bank=bank, threads=1)


CODERS = ["lanes32", pytest.param("rans4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("coder", CODERS)
def test_small_cache_all_layouts(tmp_path, coder):
    """A small cache (2 layers, 2 heads, 80 tokens in 32-token objects, RoPE, sink): plain tensor,
    a token/layer subset, vLLM's flash layout and FlashInfer's HND layout, against the CPU."""
    r = _small(tmp_path, coder)
    want = _cpu_plain(r)
    assert np.array_equal(_bits(GD.decode(r)), want)
    assert np.array_equal(_bits(GD.decode(r, tokens=(20, 70), layers=[1])), _cpu_plain(r, tokens=(20, 70), layers=[1]))
    lay = r.layout
    bs, nb = 16, 12
    table = np.array([7, 2, 9, 0, 11, 4], np.int64)     # 6 blocks of 16 cover the 80 positions
    dt = GD._TORCH_DTYPE[lay.dtype]
    for layout in ("flash", "hnd"):
        shape = (2, nb, bs, lay.kv_heads, lay.head_dim) if layout == "flash" else (nb, 2, lay.kv_heads, bs, lay.head_dim)
        caches = [torch.zeros(shape, dtype=dt) for _ in range(lay.num_layers)]
        GD.decode_paged(r, caches, table, layout=layout)
        for i, kc in enumerate(caches):
            got = _bits(kc)
            for t in range(lay.n_tokens):
                b, o = table[t // bs], t % bs
                row = got[:, b, o] if layout == "flash" else got[b, :, :, o]
                assert np.array_equal(row, want[i, :, t]), (layout, i, t)


def _corrupt(r, ti, j, mutate):
    """Make ``r`` (CPU and GPU paths alike) read a changed payload for object ``(ti, j)``, its CRC
    still passing (so the entropy stage sees it)."""
    orig = r._fetch

    def fetch(t, k, tier=0):
        e, p = orig(t, k, tier)
        return (e, mutate(bytes(p))) if (t, k, tier) == (ti, j, 0) else (e, p)

    r._fetch = fetch
    return r


MUTATIONS = {
    "flip": lambda p: p[:70] + bytes([p[70] ^ 0x5A]) + p[71:],          # a lane's state / table word
    "tail": lambda p: p[:-4] + bytes(4),                               # the last words zeroed
    "short": lambda p: p[:-6],                                         # truncated
    "odd": lambda p: p[:-1],                                           # odd length / not whole words
    "state": lambda p: bytes(8) + p[8:],                               # an initial state of 0
}


@pytest.mark.parametrize("coder", CODERS)
@pytest.mark.parametrize("how", sorted(MUTATIONS))
def test_corrupt_payload_same_error(tmp_path, coder, how):
    r_cpu = _corrupt(_small(tmp_path, coder), 1, 1, MUTATIONS[how])
    with pytest.raises(FormatError) as cpu:
        r_cpu.read(tier="coarse")
    r_gpu = _corrupt(KvzReader(r_cpu.path, bank=r_cpu._resolve_bank(), threads=1), 1, 1, MUTATIONS[how])
    with pytest.raises(FormatError) as gpu:
        GD.decode(r_gpu)
    assert type(gpu.value) is type(cpu.value)
    assert str(cpu.value).endswith(str(gpu.value)), (str(cpu.value), str(gpu.value))


def test_checksum_error_same(tmp_path):
    r = _small(tmp_path, "lanes32")
    raw = bytearray(open(r.path, "rb").read())
    e = r.index[3]
    raw[e.offset + e.length // 2] ^= 0xFF
    bad = tmp_path / "bad.kvz"
    bad.write_bytes(bytes(raw))
    bank = r._resolve_bank()
    with pytest.raises(FormatError) as cpu:
        KvzReader(bad, bank=bank, threads=1).read()
    with pytest.raises(FormatError) as gpu:
        GD.decode(KvzReader(bad, bank=bank, threads=1))
    assert type(gpu.value) is type(cpu.value) and str(gpu.value) == str(cpu.value)


def test_import_alignpred_loads_no_torch():
    import subprocess
    import sys

    code = "import sys, alignpred, alignpred.gpu; print('torch' in sys.modules or 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
@pytest.mark.parametrize("path", sample_paths(), ids=lambda p: os.path.basename(p).split(".")[0])
def test_bundled_samples(tmp_path, path, real_bank):
    """Each bundled Gemma 3 270M sample (448 tokens, bf16), compressed in lanes32 with the bundled
    bank at eps 0.03: the device decode has the CPU's bits, plain and in vLLM's flash layout."""
    c = load_cache(path)
    p = tmp_path / "s.kvz"
    compress(c, p, eps=0.03, bank=real_bank, coder="lanes32")
    r = KvzReader(p, bank=real_bank, threads=1)
    want = _cpu_plain(r)
    assert np.array_equal(_bits(GD.decode(r)), want)
    lay = r.layout
    bs = 16
    nblk = -(-lay.n_tokens // bs)
    table = np.arange(nblk)[::-1].copy()
    caches = [torch.zeros((2, nblk, bs, lay.kv_heads, lay.head_dim), dtype=torch.bfloat16)
              for _ in range(lay.num_layers)]
    GD.decode_paged(r, caches, table)
    for i, kc in enumerate(caches):
        got = _bits(kc)[:, table].reshape(2, nblk * bs, lay.kv_heads, lay.head_dim)[:, :lay.n_tokens]
        assert np.array_equal(got, want[i])
