"""A second, minimal implementation of format_spec/kvz.md, written from the spec text only.

The container parse uses nothing but ``struct``, ``json`` and ``zlib``; the rANS decoder is pure
Python; the reconstruction of §8 uses numpy (and h5py/ml_dtypes for the bank file and bf16).
Everything is checked against the library and the golden vectors. The JSON Schema of the header
(format_spec/header.schema.json) is checked against the golden headers, a matrix of writer
configurations, and every header written by any test in this session after this module was
collected (the library's ``dump_header`` is wrapped at import to record them).
"""
import base64
import hashlib
import json
import os
import struct
import zlib

import numpy as np
import pytest

import alignpred.writer as _kf
from alignpred import CodecConfig, KvzReader, compress, fit_bank
from alignpred.format.container import parse_container
from conftest import synthetic_cache
from test_golden import VEC, expected, from_bits, within_tolerance
from test_golden import VECTORS as ALL_VECTORS

# the independent reader implements format 1.0 (float arithmetic); 1.1 vectors: see test_golden
VECTORS = {n: v for n, v in ALL_VECTORS.items() if v.get("format", "1.0") == "1.0"}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = json.load(open(os.path.join(ROOT, "format_spec", "header.schema.json")))

# -- record every header the library writes in this session --------------------------------------
RECORDED: list = []
_orig_dump = _kf.dump_header


def _recording_dump(h):
    b = _orig_dump(h)
    RECORDED.append(b)
    return b


_kf.dump_header = _recording_dump


# -- §3-§6 with struct/json/zlib only ------------------------------------------------------------
class SpecError(Exception):
    pass


def crc32(b) -> int:
    return zlib.crc32(b) & 0xFFFFFFFF


def _strict_json(b: bytes):
    def pairs(ps):
        d = dict(ps)
        if len(d) != len(ps):
            raise SpecError("duplicate key")
        return d

    def const(name):
        raise SpecError(f"{name} is not JSON")

    return json.loads(b.decode("utf-8"), object_pairs_hook=pairs, parse_constant=const)


def spec_parse(raw: bytes) -> dict:
    if len(raw) < 16 + 56:
        raise SpecError("too short")
    magic, major, minor, flags = struct.unpack_from("<8sHHI", raw, 0)
    if magic != b"\x89KVZ\r\n\x1a\n" or major != 1 or flags != 0:
        raise SpecError("preamble")
    fo = len(raw) - 56
    ho, hl, io, il, hc, ic, fc, reserved, end = struct.unpack_from("<QQQQIIII8s", raw, fo)
    if end != b"KVZ-END\x00" or reserved != 0 or crc32(raw[fo:fo + 40]) != fc:
        raise SpecError("footer")
    if not (ho >= 16 and hl <= 1 << 26 and ho + hl == io and io + il == fo and il % 64 == 0):
        raise SpecError("footer offsets")
    hb, ib = raw[ho:ho + hl], raw[io:io + il]
    if crc32(hb) != hc or crc32(ib) != ic:
        raise SpecError("crc")
    header = _strict_json(hb)
    if header.get("format") != "kvz" or header.get("version") != [major, minor] or header.get("flags") != flags:
        raise SpecError("header")
    names = ("tensor", "token_start", "n_tokens", "flags", "offset", "length", "delta", "sq_err", "sq_norm", "crc")
    index = []
    for k in range(0, il, 64):
        vals = struct.unpack_from("<IIIIQQdddI", ib, k)
        if ib[k + 60:k + 64] != b"\0\0\0\0":
            raise SpecError("padding")
        index.append(dict(zip(names, vals)))
    lay, cfg = header["layout"], header["codec"]["config"]
    S, T, L = cfg["object_size"], lay["n_tokens"], lay["num_layers"]
    n_obj = -(-T // S)
    if len(index) != 2 * L * n_obj:
        raise SpecError("index count")
    pos = 16
    for k, e in enumerate(index):
        ti, j = divmod(k, n_obj)
        if (e["tensor"], e["token_start"], e["n_tokens"]) != (ti, j * S, min(S, T - j * S)) or e["offset"] != pos:
            raise SpecError("index order")
        if (e["flags"] & 1) != (e["length"] == 0) or e["flags"] & ~1:
            raise SpecError("flags")
        if crc32(raw[e["offset"]:e["offset"] + e["length"]]) != e["crc"]:
            raise SpecError("payload crc")
        pos += e["length"]
    emb = header["bank"]["embedded"]
    if emb:
        if emb["offset"] != pos or crc32(raw[pos:pos + emb["length"]]) != emb["crc32"]:
            raise SpecError("bank")
        pos += emb["length"]
    if pos != ho:
        raise SpecError("gap before header")
    return {"version": (major, minor), "flags": flags, "footer": (ho, hl, io, il, hc, ic), "header": header,
            "index": index, "n_obj": n_obj}


@pytest.fixture(params=sorted(VECTORS), scope="module")
def vec(request):
    v = VECTORS[request.param]
    with open(os.path.join(VEC, v["files"]["kvz"]), "rb") as f:
        return v, f.read()


def test_spec_parse_agrees_with_library(vec):
    v, raw = vec
    mine = spec_parse(raw)
    lib = parse_container(raw)
    assert mine["version"] == lib.version and mine["header"] == lib.header
    f = lib.footer
    assert mine["footer"] == (f.header_offset, f.header_length, f.index_offset, f.index_length, f.header_crc,
                              f.index_crc)
    assert [tuple(e.values()) for e in mine["index"]] == [
        (e.tensor, e.token_start, e.n_tokens, e.flags, e.offset, e.length, e.delta, e.sq_err, e.sq_norm, e.crc)
        for e in lib.index]
    facts = v["facts"]
    assert (f.header_offset, f.header_length, f.index_offset, len(lib.index), mine["n_obj"]) == (
        facts["header_offset"], facts["header_length"], facts["index_offset"], facts["n_entries"],
        facts["objects_per_tensor"])
    assert sum(e["flags"] & 1 for e in mine["index"]) == facts["zero_objects"]


def test_crc_check_value():
    assert crc32(b"123456789") == 0xCBF43926


# -- §7 in pure Python ---------------------------------------------------------------------------
def spec_tables():
    path = os.path.join(ROOT, "alignpred", "tables", "models_v1.npz")
    with np.load(path, allow_pickle=False) as z:
        freq, cost = z["freq"], z["cost_fx"]
    canon = b"kvz-models-v1|PREC=15|K=4|T=128|M=240|" + freq.astype("<u2").tobytes() + cost.astype("<u4").tobytes()
    assert hashlib.sha256(canon).hexdigest() == "87dd0e5d13a21694f399c7653772caf47cd63458ff76cf134bac529412a9811b"
    f = [[int(x) for x in row] for row in freq]
    c = [[sum(row[:t]) for t in range(128)] for row in f]
    return f, c


def _token_base_nbits(t):
    if t < 16:
        return t, 0
    e = 4 + (t - 16) // 4
    M, s = ((t - 16) >> 1) & 1, (t - 16) & 1
    return (1 << e) | (M << (e - 1)) | s, e - 2


def spec_rans_decode(payload: bytes, models, C: int, n: int, tables) -> list:
    f, c = tables
    if len(payload) % 4 or len(payload) < 32:
        raise SpecError("length")
    W = len(payload) // 4
    words = struct.unpack(f"<{W}I", payload)
    x = [words[2 * k] | (words[2 * k + 1] << 32) for k in range(4)]
    if min(x) < 1 << 32:
        raise SpecError("state")
    pos = 8
    toks = []
    mask = (1 << 15) - 1
    for i in range(C * n):
        lane, m = i % 4, models[i // n]
        s = x[lane] & mask
        fm, cm = f[m], c[m]
        t = 0
        while not cm[t] <= s < cm[t] + fm[t]:
            t += 1
        xx = fm[t] * (x[lane] >> 15) + s - cm[t]
        if xx < 1 << 32:
            if pos >= W:
                raise SpecError("eof")
            xx = (xx << 32) | words[pos]
            pos += 1
        x[lane] = xx
        toks.append(t)
    if any(v != 1 << 32 for v in x):
        raise SpecError("final state")
    total_raw = sum(_token_base_nbits(t)[1] for t in toks)
    n_raw = -(-total_raw // 32)
    if pos + n_raw != W:
        raise SpecError("regions do not tile the payload")
    raw_words = [words[W - 1 - j] for j in range(n_raw)]
    bits = 0
    for j, w in enumerate(raw_words):
        bits |= w << (32 * j)
    out, bp = [], 0
    for t in toks:
        base, nb = _token_base_nbits(t)
        r = (bits >> bp) & ((1 << nb) - 1)
        bp += nb
        u = base | (r << 1)
        out.append(u >> 1 if not u & 1 else -((u + 1) >> 1))
    if bits >> bp:
        raise SpecError("padding bits")
    return out


RANS4 = [n for n in sorted(VECTORS) if VECTORS[n]["compress"].get("coder", "rans4") == "rans4"]


@pytest.mark.parametrize("name", [n for n in RANS4 if n.startswith("synth")])
def test_spec_rans_decoder(name):
    v = VECTORS[name]
    raw = open(os.path.join(VEC, v["files"]["kvz"]), "rb").read()
    p = spec_parse(raw)
    exp = expected(v)
    tables = spec_tables()
    C = p["header"]["layout"]["kv_heads"] * p["header"]["layout"]["head_dim"]
    for k, e in enumerate(p["index"]):
        ti, j = divmod(k, p["n_obj"])
        if e["length"] == 0:
            continue
        models = base64.b64decode(p["header"]["tensors"][ti]["models"])
        q = spec_rans_decode(raw[e["offset"]:e["offset"] + e["length"]], models, C, e["n_tokens"], tables)
        assert np.array_equal(np.array(q, np.int32).reshape(C, e["n_tokens"]), exp[f"q.{ti}.{j}"])


# -- §10 bank and §8 reconstruction ---------------------------------------------------------------
def spec_bank_from_canonical(b: bytes):
    assert b[:8] == b"KVZBANK1"
    (ml,) = struct.unpack_from("<Q", b, 8)
    man = _strict_json(b[16:16 + ml])
    data = b[16 + ml:]
    arrays = {}
    for e in man["arrays"]:
        dt = np.dtype(e["dtype"]).newbyteorder("<")
        arrays[e["name"]] = np.frombuffer(data[e["offset"]:e["offset"] + e["length"]], dt).reshape(e["shape"])
    return man, arrays, "sha256:" + hashlib.sha256(b).hexdigest()


def spec_bank_from_h5(path):
    import h5py

    with h5py.File(path, "r") as f:
        man = json.loads(f.attrs["kvz_bank"])
        stored = str(f.attrs["content_id"])
        arrays = {}
        f.visititems(lambda n, o: arrays.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
    entries, blobs, off = [], [], 0
    for n in sorted(arrays):
        a = np.ascontiguousarray(arrays[n])
        raw = a.astype(a.dtype.newbyteorder("<")).tobytes()
        entries.append({"name": n, "dtype": a.dtype.name, "shape": list(a.shape), "offset": off, "length": len(raw)})
        blobs.append(raw)
        off += len(raw)
    man = dict(man, arrays=entries)
    mb = json.dumps(man, sort_keys=True, separators=(",", ":")).encode()
    canon = b"KVZBANK1" + struct.pack("<Q", len(mb)) + mb + b"".join(blobs)
    man2, arrays2, cid = spec_bank_from_canonical(canon)
    assert cid == stored
    return man2, arrays2, cid


def _rope(x, pos, theta, pairing, inverse):
    d = x.shape[1]
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = pos.astype(np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    if inverse:
        sin = -sin
    if pairing == "half":
        x1, x2 = x[:, :d // 2], x[:, d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=1)
    out = np.empty_like(x)
    x1, x2 = x[:, 0::2], x[:, 1::2]
    out[:, 0::2] = x1 * cos - x2 * sin
    out[:, 1::2] = x2 * cos + x1 * sin
    return out


def spec_decode(raw: bytes, bank) -> dict:
    """Full decode following §8 (all objects)."""
    import ml_dtypes

    p = spec_parse(raw)
    h = p["header"]
    lay, cfg = h["layout"], h["codec"]["config"]
    L, H, d, T, S = lay["num_layers"], lay["kv_heads"], lay["head_dim"], lay["n_tokens"], cfg["object_size"]
    man, arr, cid = bank
    assert cid == h["bank"]["id"]
    sources, groups = man["config"].get("sources", {}), man["config"].get("groups", [])
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731

    def R(b):
        u, _, vt = np.linalg.svd(np.asarray(arr[f"rot/{b}"], np.float64))
        return (u @ vt).astype(np.float32)

    out_dt = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
              "float32": np.dtype(np.float32)}[lay["dtype"]]
    fmax = float(ml_dtypes.finfo(out_dt).max)
    tables = spec_tables()
    rope = lay["keys_roped"] and cfg["rope_undo"]
    positions = np.arange(T) + lay["position_offset"]
    rec, out = {}, {}
    for i in range(L):
        for kind, tname in (("K", "key"), ("V", "value")):
            ti = 2 * i + (kind == "V")
            t = h["tensors"][ti]
            modes = np.frombuffer(base64.b64decode(t["modes"]), np.uint8).reshape(H, d)
            models = base64.b64decode(t["models"])
            qs, deltas, zero = [], [], []
            for j in range(p["n_obj"]):
                e = p["index"][ti * p["n_obj"] + j]
                n = e["n_tokens"]
                if e["flags"] & 1:
                    qs.append(np.zeros((H * d, n), np.int32))
                else:
                    q = spec_rans_decode(raw[e["offset"]:e["offset"] + e["length"]], models, H * d, n, tables)
                    qs.append(np.array(q, np.int32).reshape(H * d, n))
                deltas.append(np.full(n, np.float32(e["delta"]), np.float32))
                zero.append(np.full(n, bool(e["flags"] & 1)))
            dr = np.concatenate(deltas)
            sink = min(T, h["codec"]["config"].get("sink_tokens", 0))  # spec 8.5: sink rows' step
            dr[:sink] *= np.float32(h["codec"]["config"].get("sink_scale", 1.0))
            Q, dr, zr = np.concatenate(qs, axis=1).T, dr[:, None], np.concatenate(zero)
            res = np.empty((H, T, d), out_dt)
            for hh in range(H):
                b = f"{kind}.{i}.{hh}"
                mu = f32(arr[f"mean/{b}"])
                Rb = R(b) if cfg["align"] else None
                m = modes[hh]
                P = np.zeros((T, d), np.float32)
                src = sources.get(b, [])
                if np.any((m & 3) == 1):
                    W, U, V = (arr.get(f"map/{b}/{x}") for x in ("W", "U", "Vt"))
                    U = f32(W if W is not None else U)
                    V = None if W is not None else f32(V)
                    if cfg["align"]:
                        U = np.concatenate([R(s).T @ U[k * d:(k + 1) * d] for k, s in enumerate(src)], axis=0)
                        if V is None:
                            U = U @ Rb
                        else:
                            V = V @ Rb
                    Y = np.empty((T, d), np.float32)
                    for a in range(0, T, S):  # object by object, sources summed in order (§8.4)
                        y = sum(rec[s][a:a + S] @ U[k * d:(k + 1) * d] for k, s in enumerate(src))
                        Y[a:a + S] = y if V is None else y @ V
                    P = np.where((m & 3) == 1, Y, P)
                if np.any((m & 3) == 2):
                    g = next((g for g in groups if b in g), [b])
                    k = g.index(b)
                    lam = cfg["lambdas"][0] if k == 1 else cfg["lambdas"][1]
                    Y = (lam / k) * sum(rec[s] for s in g[:k])
                    P = np.where((m & 3) == 2, Y, P)
                Qh = Q[:, hh * d:(hh + 1) * d].astype(np.float32)
                w = Qh * dr
                interp = (m & 4) != 0
                for r in range(1, T, 2):
                    right_ok = r + 1 < T and (r + 1) % S != 0
                    pred = 0.5 * (w[r - 1] + w[r + 1]) if right_ok else w[r - 1]
                    w[r, interp] = (pred + Qh[r] * dr[r])[interp]
                rb = P + w
                rb[zr] = (-mu) @ Rb if cfg["align"] else -mu
                rec[b] = rb
                x = rb @ Rb.T if cfg["align"] else rb
                x = x + mu
                if kind == "K" and rope:
                    x = _rope(x, positions, lay["rope_theta"][i], lay["rope_pairing"], False)
                x = np.clip(x, -fmax, fmax).astype(out_dt)
                x[zr] = 0
                res[hh] = x
            out[f"layers.{i}.{tname}"] = res[None] if lay["batch_dim"] else res
    return out


@pytest.mark.parametrize("name", RANS4)
def test_spec_decoder_reproduces_vectors(name):
    v = VECTORS[name]
    raw = open(os.path.join(VEC, v["files"]["kvz"]), "rb").read()
    if "bank" in v["files"]:
        bank = spec_bank_from_h5(os.path.join(VEC, v["files"]["bank"]))
    else:
        emb = spec_parse(raw)["header"]["bank"]["embedded"]
        bank = spec_bank_from_canonical(raw[emb["offset"]:emb["offset"] + emb["length"]])
    exp = expected(v)
    for name_, got in spec_decode(raw, bank).items():
        want = from_bits(exp[f"dec.{name_}"], v["dtype"])
        ok = within_tolerance(got, want)
        assert ok.all(), f"{name_}: {int((~ok).sum())} values outside tolerance"


# -- header JSON Schema ----------------------------------------------------------------------------
def _validator():
    jsonschema = pytest.importorskip("jsonschema")
    cls = jsonschema.validators.validator_for(SCHEMA)
    cls.check_schema(SCHEMA)
    return cls(SCHEMA)


def test_golden_headers_match_schema(vec):
    _validator().validate(spec_parse(vec[1])["header"])


@pytest.mark.parametrize("kw", [
    dict(scope="object"), dict(scope="pooled", embed=True), dict(dtype=np.float32, batch=True),
    dict(roped=True, config=CodecConfig(align=True, blend=True, object_size=16)),
    dict(config=CodecConfig(inter_map=False, intra=False, channel_choice=False, rope_undo=False)),
])
def test_written_headers_match_schema(kw, tmp_path):
    c = synthetic_cache(n_layers=2, heads=2, T=40, d=8, dtype=kw.get("dtype", np.float16), roped=kw.get("roped", False))
    if kw.get("batch"):
        from alignpred.cachefile import Cache
        from alignpred.layout import infer_layout

        t = {k: v[None] for k, v in c.tensors.items()}
        c = Cache(t, c.metadata, infer_layout(t, c.metadata))
    bank = fit_bank([c], rank=None, rotations=True)
    p = tmp_path / "s.kvz"
    compress(c, p, eps=0.05, bank=bank, scope=kw.get("scope", "tensor"), config=kw.get("config"),
             embed_bank=kw.get("embed", False))
    _validator().validate(spec_parse(p.read_bytes())["header"])
    KvzReader(p, bank=bank).read()


def test_recorded_headers_match_schema():
    """Every header written so far in this session (this module wraps the writer at import)."""
    val = _validator()
    assert RECORDED, "no header was recorded (dump_header wrapper not active?)"
    for hb in RECORDED:
        val.validate(json.loads(hb))
