"""The library as a serving loader uses it: buffers in and out, sessions, banks by name, and the
defects of 0.1 that lost data or compression silently."""
import io
import json
import mmap
import warnings

import numpy as np
import pytest
from click.testing import CliRunner
from kvz_testing import synthetic_cache

from alignpred import (
    BankMismatchError,
    Cache,
    DecoderSession,
    ErrorBudget,
    KvzError,
    KvzReader,
    KvzWarning,
    OutputExistsError,
    compress,
    compress_bytes,
    fit_bank,
    load_cache,
    save_cache,
)
from kvz.cli.main import cli


@pytest.fixture(scope="module")
def cb():
    c = synthetic_cache(n_layers=3, heads=2, T=600, d=16, roped=True)
    bank = fit_bank([synthetic_cache(n_layers=3, heads=2, T=600, d=16, seed=3, roped=True)], rank=None)
    return c, bank


def nrmse(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return np.linalg.norm(x - y) / np.linalg.norm(x)


def test_bytes_stream_path_agree(cb, tmp_path):
    c, bank = cb
    blob = compress_bytes(c, budget=0.03, bank=bank)
    s = io.BytesIO()
    info = compress(c, s, budget=0.03, bank=bank)
    compress(c, tmp_path / "c.kvz", budget=0.03, bank=bank)
    assert s.getvalue() == blob == (tmp_path / "c.kvz").read_bytes() and info.file_bytes == len(blob)
    with open(tmp_path / "c.kvz", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        a = KvzReader(m, bank=bank).read()
        b = KvzReader(memoryview(blob), bank=bank).read()
        for n in a:
            assert np.array_equal(a[n].view(np.uint8), b[n].view(np.uint8))
            assert nrmse(c.tensors[n], a[n]) <= 0.03


def test_decode_into_buffers(cb):
    c, bank = cb
    r = KvzReader(compress_bytes(c, budget=0.03, bank=bank), bank=bank)
    full = r.read()
    for tokens in [(0, 600), (256, 512), (100, 450)]:
        a, b = tokens
        out = {n: np.full((2, b - a, 16), np.nan, np.float16) for n in full}
        got = r.read_into(out, tokens=tokens)
        assert got is out
        for n in full:
            assert np.array_equal(out[n], full[n][:, a:b])
    # a few layers, layer by layer, into views of one big preallocated buffer
    pool = np.zeros((3, 2, 2, 600, 16), np.float32)  # layer, K/V, heads, T, d
    seen = []
    for layer, k, _v in r.layers(tokens=(256, 512), layers=[0, 2], out=lambda i: (pool[i, 0, :, 256:512],
                                                                                   pool[i, 1, :, 256:512])):
        seen.append(layer)
        assert np.shares_memory(k, pool)
    assert seen == [0, 2] and not pool[1].any()
    assert np.array_equal(pool[2, 1, :, 256:512], full["layers.2.value"][:, 256:512].astype(np.float32))
    with pytest.raises(KvzError, match="has shape"):
        r.read_into({n: np.zeros((2, 5, 16), np.float16) for n in full}, tokens=(0, 10))


def test_read_into_memory_is_bounded_by_a_tile():
    """read_into decodes a tile of tokens through every layer at a time: decoding the last layer
    over 8 tiles needs about the working memory of one tile (the earlier layers'
    reconstructions are not held for the whole range), and the bits are those of read()."""
    import tracemalloc

    from alignpred.api.reader import TILE_TOKENS

    c = synthetic_cache(n_layers=4, heads=1, T=8 * TILE_TOKENS, d=64)
    bank = fit_bank([synthetic_cache(n_layers=4, heads=1, T=512, d=64, seed=5)], rank=None)
    blob = compress_bytes(c, budget=0.03, bank=bank)
    r = KvzReader(blob, bank=bank, threads=1)
    full = r.read()
    peaks = {}
    for n in (TILE_TOKENS, 8 * TILE_TOKENS):
        out = {f"layers.3.{k}": np.empty((1, n, 64), np.float16) for k in ("key", "value")}
        r.read_into(out, tokens=(0, n), layers=[3])  # warm (plans, kernels)
        tracemalloc.start()
        r.read_into(out, tokens=(0, n), layers=[3])
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        for name in out:
            assert np.array_equal(out[name], full[name][:, :n])
    # a range that starts and ends inside objects, all layers, tiled on one thread and split on two
    a, b = 100, 7 * TILE_TOKENS + 30
    for threads in (1, 2):
        rt = KvzReader(blob, bank=bank, threads=threads)
        out = {n: np.full((1, b - a, 64), np.nan, np.float16) for n in full}
        rt.read_into(out, tokens=(a, b))
        for n in full:
            assert np.array_equal(out[n], full[n][:, a:b]), (threads, n)
    raw_tile = 2 * TILE_TOKENS * 64 * 2  # one tile of layer 3's K+V as fp16
    assert peaks[8 * TILE_TOKENS] <= peaks[TILE_TOKENS] + raw_tile, peaks


def test_one_object_decodes_on_several_threads_to_the_same_bits():
    """A 256-token chunk is one object: with threads > 1 its symbols are decoded ahead on
    another thread (issue 19, point 3); every thread count, layer stream and sub-range gives
    the bits of one thread, and kvz's row split is never left set in the caller's loop."""
    from alignpred.threads import row_threads

    c = synthetic_cache(n_layers=4, heads=2, T=256, d=64)
    bank = fit_bank([synthetic_cache(n_layers=4, heads=2, T=512, d=64, seed=5)], rank=None)
    blob = compress_bytes(c, budget=0.03, bank=bank)
    full = KvzReader(blob, bank=bank, threads=1).read()
    for threads in (2, 3, 4):
        r = KvzReader(blob, bank=bank, threads=threads)
        got = r.read()
        for n in full:
            assert np.array_equal(got[n].view(np.uint16), full[n].view(np.uint16)), (threads, n)
        for name, arr in r.iter_layers(tokens=(10, 200), layers=[1, 3]):
            assert row_threads() == 1  # the split is set only while kvz decodes, not in the caller's loop
            assert np.array_equal(arr.view(np.uint16), full[name][:, 10:200].view(np.uint16)), (threads, name)


def test_torch_in_and_out(cb):
    torch = pytest.importorskip("torch")
    c, bank = cb
    kv = [(torch.from_numpy(c.tensors[f"layers.{i}.key"].astype(np.float32)).to(torch.bfloat16),
           torch.from_numpy(c.tensors[f"layers.{i}.value"].astype(np.float32)).to(torch.bfloat16)) for i in range(3)]
    cache = Cache.from_arrays(kv, c.metadata)
    assert cache.layout.dtype == "bfloat16"
    assert np.shares_memory(cache.tensors["layers.0.key"], kv[0][0].view(torch.int16).numpy())  # no copy
    r = KvzReader(compress_bytes(cache, budget=0.03, bank=bank), bank=bank)
    bufs = {i: (torch.zeros(2, 600, 16, dtype=torch.bfloat16), torch.zeros(2, 600, 16, dtype=torch.bfloat16))
            for i in range(3)}
    for _ in r.layers(out=lambda i: bufs[i]):
        pass
    want = r.read()["layers.1.value"]
    assert np.array_equal(bufs[1][1].view(torch.int16).numpy(), want.view(np.int16))


def test_session_reuses_plans(cb):
    c, bank = cb
    blobs = [compress_bytes(Cache(c.tensors, c.metadata, c.layout), budget=e, bank=bank) for e in (0.03, 0.05)]
    s = DecoderSession(banks=[bank])
    for blob in blobs * 3:
        KvzReader(blob, session=s).read(tokens=(0, 256))
    assert s.plans_built == 1


def test_session_keeps_a_bank_given_by_name_or_path(tmp_path, cb):
    """A bank passed by registry name or file path is loaded (and hashed) once per session, and a
    changed file at the same path is loaded again."""
    from alignpred.bank.registry import BankRegistry, resolve_bank

    reg = BankRegistry()
    a = resolve_bank("gemma-3-270m", session=reg)
    assert resolve_bank("gemma-3-270m", session=reg) is a
    assert resolve_bank(a.id, session=reg) is a
    c, bank = cb
    p = tmp_path / "b.h5"
    bank.save(p)
    b1 = resolve_bank(str(p), session=reg)
    assert resolve_bank(p, session=reg) is b1 and b1.id == bank.id
    other = fit_bank([synthetic_cache(n_layers=3, T=300, d=16, seed=9)], rank=None)
    other.save(p)
    assert resolve_bank(str(p), session=reg).id == other.id != bank.id


def test_no_overwrite_of_own_input(tmp_path, cb):
    c, bank = cb
    p = tmp_path / "c.safetensors"
    save_cache(p, c.tensors, c.metadata)
    before = p.read_bytes()
    with pytest.raises(OutputExistsError, match="is the input cache"):
        compress(load_cache(p), p, budget=0.03, bank=bank)
    assert p.read_bytes() == before


def test_python_missing_bank_error_speaks_python():
    c = Cache.from_arrays({f"layers.{i}.{k}": np.ones((1, 300, 256), np.float16)
                           for i in range(18) for k in ("key", "value")}, model="gemma-3-270m")
    with pytest.raises(BankMismatchError) as e:
        compress(c, None, budget=0.03)
    msg = str(e.value)
    assert "bank='gemma-3-270m'" in msg and "--bank" not in msg


def test_output_path_errors_name_the_users_path(tmp_path, cb):
    c, bank = cb
    out = tmp_path / "no" / "such" / "dir" / "x.kvz"
    with pytest.raises(KvzError) as e:
        compress(c, out, budget=0.03, bank=bank)
    assert str(out) in str(e.value) and ".tmp" not in str(e.value)


def test_rope_bank_against_unroped_cache_is_a_mismatch():
    c = synthetic_cache(n_layers=2, T=300, roped=True)
    bank = fit_bank([c], rank=None)
    assert bank.config["rope_undone"] is True
    plain = Cache(c.tensors, {}, Cache.from_arrays(c.tensors).layout)
    with pytest.raises(BankMismatchError, match="fitted on keys with RoPE undone"):
        compress(plain, None, budget=0.05, bank=bank)


def test_rotated_keys_without_metadata_warn():
    from alignpred.cache.rope import RopeTable

    rng = np.random.default_rng(0)
    T, d = 512, 32
    base = rng.standard_normal((1, T, d)).astype(np.float32) * 0.3 + 2.0  # large mean direction, as real keys
    roped = RopeTable.from_theta(1e4, d).apply(base, 0)
    t = {f"layers.{i}.{k}": (roped if k == "key" else base).astype(np.float16) for i in range(2) for k in ("key", "value")}
    c = Cache.from_arrays(t)
    bank = fit_bank([c], rank=None)
    with pytest.warns(KvzWarning, match="looks RoPE-rotated"):
        compress(c, None, budget=0.05, bank=bank)
    good = Cache.from_arrays(t, keys_roped=True, rope_theta=[1e4, 1e4])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        a = compress(good, None, budget=0.05, bank=fit_bank([good], rank=None))
    with pytest.warns(KvzWarning, match="looks RoPE-rotated"):
        plain_bytes = compress(c, None, budget=0.05, bank=bank).file_bytes
    assert a.file_bytes < plain_bytes


def test_pooled_cap(tmp_path):
    """A tensor with a small norm would take most of the pooled budget; the cap bounds it."""
    c = synthetic_cache(n_layers=3, T=400)
    c.tensors["layers.1.value"] = (c.tensors["layers.1.value"].astype(np.float32) * 0.02).astype(np.float16)
    c = Cache(c.tensors, {}, c.layout)
    bank = fit_bank([c], rank=None)
    eps = 0.03
    free = compress(c, None, budget=ErrorBudget(eps=eps, scope="pooled", tensor_cap=0), bank=bank)
    capped = compress(c, tmp_path / "c.kvz", budget=ErrorBudget(eps=eps, scope="pooled", tensor_cap=2.0), bank=bank)
    assert free.nrmse_max_tensor > 2 * eps  # the case the cap exists for
    assert capped.nrmse_max_tensor <= 2 * eps and capped.nrmse_pooled <= eps
    s = KvzReader(tmp_path / "c.kvz", bank=bank).summary()
    assert s["tensor_cap"] == 2.0 and s["version"] == "1.1"
    res = CliRunner().invoke(cli, ["inspect", str(tmp_path / "c.kvz")], env={"KVZ_BANK_PATH": ""})
    assert "tensor cap 2 x eps" in res.output


def test_sink_counts_absolute_positions(cb):
    c, bank = cb
    from alignpred import CodecConfig

    cfg = CodecConfig()
    assert cfg.sink_rows(0, 0) == 1 and cfg.sink_rows(0, 1000) == 0 and cfg.sink_rows(256, 0) == 0
    assert CodecConfig.from_json({"sink_tokens": 1, "sink_scale": 0.0625}).sink_rows(0, 1000) == 1  # 1.0 files
    mid = Cache(c.tensors, dict(c.metadata, position_offset="4096"),
                c.layout.replace(position_offset=4096))
    r = KvzReader(compress_bytes(mid, budget=0.03, bank=bank), bank=bank)
    assert r.header["codec"]["config"]["sink_origin"] == "absolute"
    out = r.read()
    assert max(nrmse(c.tensors[n], out[n]) for n in out) <= 0.03


# -- the command line never loses data ------------------------------------------------------------
def test_cli_refuses_to_overwrite(tmp_path, cb):
    c, bank = cb
    p = tmp_path / "X.safetensors"
    save_cache(p, c.tensors, c.metadata)
    bank.save(tmp_path / "b.h5")
    original = p.read_bytes()
    r = CliRunner()
    assert r.invoke(cli, ["compress", str(p), "--bank", str(tmp_path / "b.h5"), "-q"]).exit_code == 0
    res = r.invoke(cli, ["decompress", str(tmp_path / "X.kvz"), "--bank", str(tmp_path / "b.h5"), "-q"])
    assert res.exit_code != 0 and "exists; pass --force" in res.output and p.read_bytes() == original
    res = r.invoke(cli, ["compress", str(p), "-o", str(p), "--bank", str(tmp_path / "b.h5"), "-q", "--force"])
    assert res.exit_code != 0 and "also an input" in res.output and p.read_bytes() == original
    res = r.invoke(cli, ["compress", str(p), "--bank", str(tmp_path / "b.h5"), "-q"])  # X.kvz exists now
    assert res.exit_code != 0 and "--force" in res.output
    res = r.invoke(cli, ["calibrate", str(p), "-o", str(tmp_path / "b.h5")])
    assert res.exit_code != 0 and "exists" in res.output
    res = r.invoke(cli, ["decompress", str(tmp_path / "X.kvz"), "--bank", str(tmp_path / "b.h5"), "-q", "--force"])
    assert res.exit_code == 0 and p.read_bytes() != original  # replaced only when asked


def test_bank_registry_cli(tmp_path, cb, monkeypatch):
    c, bank = cb
    monkeypatch.setenv("KVZ_BANK_DIR", str(tmp_path / "banks"))
    bank.save(tmp_path / "b.h5")
    r = CliRunner()
    res = r.invoke(cli, ["bank", "add", str(tmp_path / "b.h5"), "--name", "toy", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["id"] == bank.id
    res = r.invoke(cli, ["bank", "list", "--json"])
    names = {b["name"]: b for b in json.loads(res.output)["banks"]}
    assert names["toy"]["id"] == bank.id and names["gemma-3-270m"]["origin"] == "bundled"
    res = r.invoke(cli, ["bank", "show", bank.id[:15]])
    assert res.exit_code == 0 and bank.id in res.output
    # a file whose bank is registered decodes without naming the bank
    blob = compress_bytes(c, budget=0.05, bank="toy")
    assert KvzReader(blob).read(tokens=(0, 10))
    res = r.invoke(cli, ["bank", "show", "nope"])
    assert res.exit_code != 0 and "no bank file or registered bank 'nope'" in res.output


def test_weighted_scope_puts_error_where_weights_are_small():
    c = synthetic_cache(n_layers=3, T=400)
    bank = fit_bank([synthetic_cache(n_layers=3, T=400, seed=5)], rank=None)
    names = c.layout.tensor_names()
    w = {n: (50.0 if n == "layers.1.key" else 1.0) for n in names}
    eps = 0.03
    info = compress(c, None, budget=ErrorBudget(eps=eps, scope="weighted", tensor_cap=0, weights=w), bank=bank)
    e = info.nrmse_tensor
    assert e["layers.1.key"] < min(v for k, v in e.items() if k != "layers.1.key")
    wsum = sum(w.values())
    assert (sum(w[n] * e[n] ** 2 for n in names) / wsum) ** 0.5 <= eps * (1 + 1e-9)
    assert abs(info.nrmse_weighted - (sum(w[n] * e[n] ** 2 for n in names) / wsum) ** 0.5) < 1e-9
    r = KvzReader(info.data, bank=bank)
    assert r.scope == "weighted" and r.header["codec"]["tensor_weights"][names.index("layers.1.key")] == 50.0
    kl = compress(c, None, budget=ErrorBudget(weights=w, target_kl=1e-3), bank=bank)
    assert kl.scope == "weighted" and kl.kl_predicted <= 1e-3 * (1 + 1e-9)
    with pytest.raises(KvzError, match="eps or target_kl"):
        compress(c, None, budget=ErrorBudget(eps=0.03, weights=w, target_kl=1e-3), bank=bank)
    with pytest.raises(KvzError, match="need tensor weights"):
        compress(c, None, budget=ErrorBudget(eps=0.03, scope="weighted"), bank=bank)


def test_compress_takes_a_budget_and_a_profile():
    """Issue 41: eight parameters; the keywords they replace are an error that spells the call as written now."""
    import inspect

    assert list(inspect.signature(compress).parameters) == ["cache", "out", "budget", "bank", "profile", "config",
                                                            "threads", "progress"]
    assert list(inspect.signature(compress_bytes).parameters) == ["cache", "budget", "bank", "profile", "config",
                                                                  "threads", "progress"]
    c = synthetic_cache(n_layers=1, heads=1, T=40, d=8)
    with pytest.raises(KvzError, match=r"compress\(\) no longer takes eps=: write budget=0\.03 "):
        compress(c, None, eps=0.03, bank="gemma-3-270m")
    with pytest.raises(KvzError, match=r"write budget=ErrorBudget\(eps=0\.03, scope='pooled'\), "
                                       r"profile=Profile\(embed_bank=True\)"):
        compress_bytes(c, eps=0.03, scope="pooled", embed_bank=True)
    with pytest.raises(KvzError, match="budget must be an ErrorBudget or a number"):
        compress_bytes(c, budget="0.03")
    with pytest.raises(KvzError, match="give the error budget"):
        compress_bytes(c)
    bank = fit_bank([c], rank=None)
    a = compress_bytes(c, budget=0.05, bank=bank)
    assert a == compress_bytes(c, budget=ErrorBudget.from_options(eps=0.05), bank=bank)
