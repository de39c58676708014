"""A second, minimal implementation of format_spec/kvz.md (format 1.1), written from the spec text only.

The container parse uses nothing but ``struct``, ``json`` and ``zlib``; the rANS decoder (per-channel
and per-symbol models, §7 and §7.2) is pure Python; the reconstruction of §8 uses numpy (and
h5py/ml_dtypes for the bank file and bf16): for ``arith: float`` files (format 1.0) float32 BLAS
products and the 1.0 RoPE tables, for ``arith: exact`` files (1.1) the exact map products of
§8.4.1 in numpy int64, the 1.1 RoPE tables with the spec's float64 cos/sin algorithm, the sink
origin of §8.5 and the refinement tier of §8.9. Everything is checked against the library and the
golden vectors: 1.0 vectors within §9's tolerance, 1.1 vectors bit for bit (both tiers). The JSON
Schema of the header (format_spec/header.schema.json) is checked against the golden headers, a
matrix of writer configurations, and every header written by any test in this session after this
module was collected (the library's ``dump_header`` is wrapped at import to record them).
"""
import base64
import bisect
import hashlib
import json
import math
import os
import struct
import zlib
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
from kvz_testing import synthetic_cache
from test_golden import VEC, VECTORS, expected, from_bits, within_tolerance

import alignpred.api.writer as _kf
from alignpred import CodecConfig, ErrorBudget, KvzReader, compress, fit_bank
from alignpred.codec import Profile
from alignpred.format.container import parse_container

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


FLAG_REFINE = 1  # §3 preamble flag bit 0
OBJ_ZERO, OBJ_REFINE = 1, 2  # §5 index entry flags


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


def _is_f32(v) -> bool:
    return math.isfinite(v) and float(np.float32(v)) == v


def spec_parse(raw: bytes) -> dict:
    if len(raw) < 16 + 56:
        raise SpecError("too short")
    magic, major, minor, flags = struct.unpack_from("<8sHHI", raw, 0)
    if magic != b"\x89KVZ\r\n\x1a\n" or major != 1 or flags & ~FLAG_REFINE:  # any 1.x minor (§11.3)
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
    refine = bool(flags & FLAG_REFINE)
    if refine and cfg.get("arith", "float") != "exact":
        raise SpecError("REFINE needs arith exact (§6.2)")
    if cfg.get("arith", "float") == "exact" and cfg["align"]:
        raise SpecError("arith exact with align (§6.2)")
    S, T, L = cfg["object_size"], lay["n_tokens"], lay["num_layers"]
    n_obj = -(-T // S)
    n_c = 2 * L * n_obj
    if len(index) != n_c * (2 if refine else 1):
        raise SpecError("index count")
    pos = 16
    for k, e in enumerate(index):
        tier, kk = divmod(k, n_c)
        ti, j = divmod(kk, n_obj)
        if (e["tensor"], e["token_start"], e["n_tokens"]) != (ti, j * S, min(S, T - j * S)) or e["offset"] != pos:
            raise SpecError("index order")
        if bool(e["flags"] & OBJ_ZERO) != (e["length"] == 0) or e["flags"] & ~OBJ_ZERO != (OBJ_REFINE if tier else 0):
            raise SpecError("flags")
        if tier:
            if e["delta"] != 0 or e["sq_err"] != 0:
                raise SpecError("refinement entry with a step or an error")
        elif not _is_f32(e["delta"]) or (not e["flags"] & OBJ_ZERO and not e["delta"] > 0):
            raise SpecError("delta")
        if not all(math.isfinite(e[x]) and e[x] >= 0 for x in ("sq_err", "sq_norm")):
            raise SpecError("statistics")
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
            "index": index, "n_obj": n_obj, "n_coarse": n_c, "refine": refine}


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
    assert ".".join(map(str, mine["version"])) == v.get("format", "1.0")
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
    coarse, refine = mine["index"][:mine["n_coarse"]], mine["index"][mine["n_coarse"]:]
    assert sum(e["flags"] & OBJ_ZERO for e in coarse) == facts["zero_objects"]
    assert len(refine) == facts.get("refine_objects", 0)
    assert mine["refine"] == bool(v["compress"].get("lossless"))


def test_crc_check_value():
    assert crc32(b"123456789") == 0xCBF43926


# -- §7 in pure Python ---------------------------------------------------------------------------
def spec_tables():
    path = os.path.join(ROOT, "alignpred", "entropy", "data", "models_v1.npz")
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


def _rans_symbols(payload: bytes, model_of, N: int, tables) -> list:
    """§7 decoding of ``N`` symbols; symbol ``i`` uses model ``model_of(i)``."""
    f, c = tables
    if len(payload) % 4 or len(payload) < 32 or N > 2048 * (len(payload) + 32):
        raise SpecError("length")
    W = len(payload) // 4
    words = struct.unpack(f"<{W}I", payload)
    x = [words[2 * k] | (words[2 * k + 1] << 32) for k in range(4)]
    if min(x) < 1 << 32:
        raise SpecError("state")
    pos = 8
    toks = []
    mask = (1 << 15) - 1
    for i in range(N):
        lane, m = i % 4, model_of(i)
        if not 0 <= m < 240:
            raise SpecError("model id")
        s = x[lane] & mask
        fm, cm = f[m], c[m]
        t = bisect.bisect_right(cm, s) - 1  # c[m, t] <= s < c[m, t] + f[m, t]
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


def spec_rans_decode(payload: bytes, models, C: int, n: int, tables) -> list:
    """§7: a coarse object, model per channel."""
    return _rans_symbols(payload, lambda i: models[i // n], C * n, tables)


def spec_rans_decode_ctx(payload: bytes, ids, tables) -> list:
    """§7.2: a model per symbol."""
    return _rans_symbols(payload, lambda i: ids[i], len(ids), tables)


def spec_lanes_tables(tables):
    """§7.3 tables: 12-bit frequencies ``g`` from the 15-bit ``f`` (and their prefix sums ``k``)."""
    f, _ = tables
    g = []
    for row in f:
        r = [max(1, (F * (1 << 12) + (1 << 14)) >> 15) for F in row]
        while sum(r) > 1 << 12:
            r[max(range(len(r)), key=lambda t: (r[t], -t))] -= 1
        while sum(r) < 1 << 12:
            r[max(range(len(r)), key=lambda t: (r[t], -t))] += 1
        g.append(r)
    assert hashlib.sha256(np.array(g, "<u2").tobytes()).hexdigest() == \
        "6bcfd40c0169ec5e089c99bc1682ae82040a7d6aaec4ce8fca072a38702c7771"
    return g, [[sum(row[:t]) for t in range(128)] for row in g]


def spec_lanes32_decode(payload: bytes, models, C: int, n: int, ltables) -> list:
    """§7.3: a coarse object coded with 32 lock-step lanes, model per channel."""
    g, k = ltables
    N = C * n
    per_lane = -(-N // 32)
    Hw = 128 if per_lane > 21845 else 96
    if len(payload) % 2 or len(payload) < 2 * Hw or N > 2048 * len(payload):
        raise SpecError("length")
    W = len(payload) // 2
    w = struct.unpack(f"<{W}H", payload)
    x = [w[2 * lane] | (w[2 * lane + 1] << 16) for lane in range(32)]
    if min(x) < 1 << 16:
        raise SpecError("state")
    counts = list(w[64:96]) if Hw == 96 else [w[64 + 2 * lane] | (w[65 + 2 * lane] << 16) for lane in range(32)]
    if Hw + sum(counts) != W:
        raise SpecError("lane table does not tile the payload")
    start = [Hw + sum(counts[:lane]) for lane in range(32)]
    pos = list(start)

    def renorm(lane, v):
        if v < 1 << 16:
            if pos[lane] >= start[lane] + counts[lane]:
                raise SpecError("a lane read beyond its stream")
            v = (v << 16) | w[pos[lane]]
            pos[lane] += 1
        return v

    out = []
    for i in range(N):
        lane, m = i % 32, models[i // n]
        if not 0 <= m < 240:
            raise SpecError("model id")
        v = x[lane]
        sl = v & 0xFFF
        t = bisect.bisect_right(k[m], sl) - 1
        v = renorm(lane, g[m][t] * (v >> 12) + sl - k[m][t])
        base, nb = _token_base_nbits(t)
        r = 0
        if nb:
            b1 = min(nb, 16)
            r, v = v & ((1 << b1) - 1), renorm(lane, v >> b1)
            if nb > 16:
                r |= (v & ((1 << (nb - 16)) - 1)) << 16
                v = renorm(lane, v >> (nb - 16))
        x[lane] = v
        u = base | (r << 1)
        out.append(u >> 1 if not u & 1 else -((u + 1) >> 1))
    if any(v != 1 << 16 for v in x) or pos != [a + c for a, c in zip(start, counts)]:
        raise SpecError("final state or lane words")
    return out


def spec_coarse_decoder(header: dict, tables):
    """The coarse-object decoder the header's coder names (§7 or §7.3)."""
    coder = header["codec"].get("entropy", {}).get("coder", "rans4")
    if coder == "lanes32":
        lt = spec_lanes_tables(tables)
        return lambda payload, models, C, n: spec_lanes32_decode(payload, models, C, n, lt)
    if coder == "rans4":
        return lambda payload, models, C, n: spec_rans_decode(payload, models, C, n, tables)
    raise SpecError(f"coder {coder!r} has no spec decoder here")


# -- §8.9 ordinals and contexts --------------------------------------------------------------------
def _bits_of(a: np.ndarray) -> tuple:
    B = 8 * a.dtype.itemsize
    return np.ascontiguousarray(a).view(np.uint16 if B == 16 else np.uint32).astype(np.int64), B


def spec_ord(a: np.ndarray) -> np.ndarray:
    u, B = _bits_of(a)
    mag = u & ((1 << (B - 1)) - 1)
    return np.where(u >> (B - 1) != 0, -mag - 1, mag)


def spec_unord(o: np.ndarray, dtype) -> np.ndarray:
    B = 8 * np.dtype(dtype).itemsize
    if o.size and (o.min() < -(1 << (B - 1)) or o.max() > (1 << (B - 1)) - 1):
        raise SpecError("refinement outside the dtype's values")
    u = np.where(o >= 0, o, (-o - 1) | (1 << (B - 1)))
    return u.astype(np.uint16 if B == 16 else np.uint32).view(dtype)


def spec_context(a: np.ndarray) -> np.ndarray:
    u, B = _bits_of(a)
    if a.dtype == np.float16:
        return (u >> 10) & 0x1F
    return (u >> 7) & 0xFF if B == 16 else (u >> 23) & 0xFF


def _refine_ids(coarse_hnd: np.ndarray, refine_models: bytes) -> list:
    """Model id of every refinement symbol of one object, symbol order ch*n + t (§8.9)."""
    H, n, d = coarse_hnd.shape
    ctx = spec_context(coarse_hnd).transpose(0, 2, 1).reshape(H * d * n)  # [h, c, t] = channel-major
    return [refine_models[int(x)] for x in ctx]


SPEC_CODERS = ("rans4", "lanes32")  # the coders this reader implements (not constriction's)
RANS4 = [n for n in sorted(VECTORS) if VECTORS[n]["compress"].get("coder", "rans4") in SPEC_CODERS]


@pytest.mark.parametrize("name", [n for n in RANS4 if "synth" in n])
def test_spec_rans_decoder(name):
    """Coarse symbols (§7 or §7.3) and refinement symbols (§7.2, contexts from the stored coarse tier)."""
    v = VECTORS[name]
    raw = open(os.path.join(VEC, v["files"]["kvz"]), "rb").read()
    p = spec_parse(raw)
    exp = expected(v)
    tables = spec_tables()
    coarse_decode = spec_coarse_decoder(p["header"], tables)
    lay = p["header"]["layout"]
    C, S = lay["kv_heads"] * lay["head_dim"], p["header"]["codec"]["config"]["object_size"]
    n_refined = 0
    for k, e in enumerate(p["index"]):
        tier, kk = divmod(k, p["n_coarse"])
        ti, j = divmod(kk, p["n_obj"])
        n = e["n_tokens"]
        t = p["header"]["tensors"][ti]
        if tier:
            want = exp[f"r.{ti}.{j}"]
            if e["length"] == 0:
                assert not want.any()
                continue
            coarse = from_bits(exp[f"coarse.{t['name']}"], v["dtype"])
            coarse = coarse[0] if lay["batch_dim"] else coarse
            ids = _refine_ids(coarse[:, j * S:j * S + n], base64.b64decode(t["refine_models"]))
            r = spec_rans_decode_ctx(raw[e["offset"]:e["offset"] + e["length"]], ids, tables)
            assert np.array_equal(np.array(r, np.int32).reshape(C, n), want)
            n_refined += 1
            continue
        if e["length"] == 0:
            continue
        q = coarse_decode(raw[e["offset"]:e["offset"] + e["length"]], base64.b64decode(t["models"]), C, n)
        assert np.array_equal(np.array(q, np.int32).reshape(C, n), exp[f"q.{ti}.{j}"])
    assert n_refined == sum(1 for e in p["index"][p["n_coarse"]:] if e["length"])


# -- §10 bank ------------------------------------------------------------------------------------
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


# -- §8.3.1 the 1.0 RoPE tables ------------------------------------------------------------------
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


# -- §8.3.2 the 1.1 RoPE tables ------------------------------------------------------------------
F32 = np.float32
INVPIO2 = float.fromhex("0x1.45f306dc9c883p-1")
SHIFT = float.fromhex("0x1.8p52")
P0, P1, P2, P3 = (float.fromhex(h) for h in ("0x1.921fb54p+0", "0x1.10b461p-30", "0x1.a62633p-58",
                                             "0x1.45c06e0e68948p-86"))
S1, S2, S3, S4, S5, S6 = (-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
                          2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10)
C1, C2, C3, C4, C5, C6 = (4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
                          -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11)
A_MAX = float((2 ** 26 - 1) * 0.5) * math.pi


def spec_sincos(a32: np.ndarray):
    """cos, sin (float32) of float32 angles by §8.3.2 (numpy float64 ufuncs: one rounding each)."""
    a32 = np.asarray(a32, F32)
    if a32.size and not float(np.abs(a32).max()) < A_MAX:  # also catches inf (no NaN can occur)
        raise SpecError("RoPE angle beyond A_MAX")
    x = a32.astype(np.float64)
    kq = (x * INVPIO2 + SHIFT) - SHIFT
    y = x - kq * P0
    y = y - kq * P1
    y = y - kq * P2
    y = y - kq * P3
    z = y * y
    s = y + (z * y) * (S1 + z * (S2 + z * (S3 + z * (S4 + z * (S5 + z * S6)))))
    hz = 0.5 * z
    w = 1.0 - hz
    c = w + (((1.0 - w) - hz) + z * (z * (C1 + z * (C2 + z * (C3 + z * (C4 + z * (C5 + z * C6)))))))
    q = np.mod(kq, 4.0).astype(np.int64)
    sin = np.choose(q, [s, c, -s, -c])
    cos = np.choose(q, [c, -s, -c, s])
    return cos.astype(F32), sin.astype(F32)


def _nearest_f32(v: Decimal) -> F32:
    """The float32 nearest to a (high-precision) decimal value."""
    exact = Fraction(v)
    a = F32(float(v))
    cands = [np.nextafter(a, F32(-np.inf)), a, np.nextafter(a, F32(np.inf))]
    return min(cands, key=lambda cnd: abs(Fraction(float(cnd)) - exact))


def spec_default_inv_freq(theta: float, d: int) -> np.ndarray:
    """§8.3.2 default table: inv_freq[k] = float32(1 / rn32(theta32 ^ e_k))."""
    if not 1 < theta < 3e38:
        raise SpecError("theta out of range")
    th = Decimal(float(F32(theta)))
    out = []
    with localcontext() as ctx:
        ctx.prec = 60
        ln_th = th.ln()
        for k in range(d // 2):
            e = F32(F32(2 * k) / F32(d))
            pw = _nearest_f32((Decimal(float(e)) * ln_th).exp())
            out.append(F32(1.0) / pw)
    return np.array(out, F32)


def _inv_freq_of(table: dict) -> np.ndarray:
    v = table["inv_freq"]
    if isinstance(v, str):
        b = base64.b64decode(v, validate=True)
        if not b or len(b) % 4 or len(b) > 1 << 20:
            raise SpecError("inv_freq length")
        a = np.frombuffer(b, "<f4").astype(F32)
    else:
        if not v or not all(type(x) in (int, float) and _is_f32(float(x)) for x in v):
            raise SpecError("inv_freq values")
        a = np.array(v, F32)
    if not (np.isfinite(a).all() and (a >= 0).all()):
        raise SpecError("inv_freq values")
    return a


def spec_rope11(lay: dict) -> list:
    """Per layer: None (no RoPE) or ``(inv_freq float32 [r/2], alpha float32, pairing)``."""
    rope = lay.get("rope")
    L, d = lay["num_layers"], lay["head_dim"]
    if rope is None:
        return [(spec_default_inv_freq(th, d), F32(1.0), lay["rope_pairing"]) for th in lay["rope_theta"]]
    tables = []
    for t in rope["tables"]:
        inv = _inv_freq_of(t)
        alpha = t.get("attention_scaling", 1.0)
        if 2 * len(inv) > d or not (_is_f32(float(alpha)) and alpha > 0) or t.get("pairing", "half") not in (
                "half", "interleaved"):
            raise SpecError("rope table")
        tables.append((inv, F32(alpha), t.get("pairing", "half")))
    lt = rope["layer_table"]
    if len(lt) != L or not all(type(i) is int and -1 <= i < len(tables) for i in lt):
        raise SpecError("rope layer_table")
    return [None if i < 0 else tables[i] for i in lt]


def spec_rotate11(x: np.ndarray, positions: np.ndarray, table) -> np.ndarray:
    """Forward RoPE of float32 rows ``x [n, d]`` at absolute ``positions`` with a 1.1 table."""
    inv, alpha, pairing = table
    ang = positions.astype(F32)[:, None] * inv[None, :]  # float32(float32(p) * inv_freq[k])
    cos, sin = spec_sincos(ang)
    cos, sin = cos * alpha, sin * alpha
    r = 2 * len(inv)
    out = x.copy()
    if pairing == "half":
        i1, i2 = np.arange(r // 2), np.arange(r // 2) + r // 2
    else:
        i1, i2 = np.arange(0, r, 2), np.arange(1, r, 2)
    x1, x2 = x[:, i1], x[:, i2]
    out[:, i1] = x1 * cos - x2 * sin
    out[:, i2] = x2 * cos + x1 * sin
    return out


# -- §8.4.1 exact map products -------------------------------------------------------------------
def _E(v: np.ndarray) -> np.ndarray:
    """frexp exponent: 2**(E-1) <= v < 2**E, E(0) = 0."""
    return np.frexp(v)[1].astype(np.int64)


def spec_exact_weights(A: np.ndarray, m: int) -> list:
    """Per source: (shift [k], w_exp [n_out], wq int64 [k, n_out])."""
    A = np.asarray(A).astype(np.float64)
    k = A.shape[0] // m
    assert k * m == A.shape[0]
    out = []
    for s in range(m):
        As = A[s * k:(s + 1) * k]
        M = np.abs(As).max(axis=1)
        nz = M > 0
        Es = np.sort(_E(M[nz]))
        med = int(Es[(len(Es) - 1) // 2]) if len(Es) else 0
        shift = np.where(nz, np.clip(med - _E(M), -24, 24), 0)
        Ap = np.ldexp(As, shift[:, None])
        w_exp = _E(np.abs(Ap).max(axis=0)) - 12
        wq = np.clip(np.rint(np.ldexp(Ap, -w_exp[None, :])), -4095, 4095).astype(np.int64)
        out.append((shift, w_exp, wq))
    return out


def spec_exact_map(weights: list, xs: list) -> np.ndarray:
    """``map(A, m; X_1..X_m)``: float32 ``[n, n_out]``."""
    y = None
    for (shift, w_exp, wq), X in zip(weights, xs):
        xp = np.ldexp(np.asarray(X, F32).astype(np.float64), -shift[None, :])
        finite = np.isfinite(xp).all(axis=1)
        x_exp = np.where(finite, _E(np.where(np.isfinite(xp), np.abs(xp), 0).max(axis=1)), 0) - 13
        v = np.ldexp(xp, -x_exp[:, None])
        xq = np.clip(np.rint(np.nan_to_num(v, nan=8191.0, posinf=8191.0, neginf=-8191.0)), -8191, 8191)
        acc = xq.astype(np.int64) @ wq  # exact integers
        term = acc.astype(np.float64) * np.ldexp(1.0, x_exp[:, None] + w_exp[None, :])
        y = (0.0 + term) if y is None else y + term
    return y.astype(F32)


# -- §8 reconstruction, §8.9 refinement ------------------------------------------------------------
def spec_decode(raw: bytes, bank) -> tuple:
    """Full decode following §8 (all objects). Returns ``(coarse tier, exact tier or None)``."""
    import ml_dtypes

    p = spec_parse(raw)
    h = p["header"]
    lay, cfg = h["layout"], h["codec"]["config"]
    L, H, d, T, S = lay["num_layers"], lay["kv_heads"], lay["head_dim"], lay["n_tokens"], cfg["object_size"]
    exact = cfg.get("arith", "float") == "exact"
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
    coarse_decode = spec_coarse_decoder(h, tables)
    rope = lay["keys_roped"] and cfg["rope_undo"]
    tables11 = spec_rope11(lay) if rope and (exact or "rope" in lay) else None  # §8.3: which tables
    positions = np.arange(T) + lay["position_offset"]
    # §8.5 sink rows: origin 0 (file) or position_offset (absolute)
    origin = lay["position_offset"] if cfg.get("sink_origin", "file") == "absolute" else 0
    n_sink = max(0, min(T, cfg.get("sink_tokens", 0) - origin))
    rec, out, refined = {}, {}, {}
    n_c = p["n_coarse"]
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
                if e["flags"] & OBJ_ZERO:
                    qs.append(np.zeros((H * d, n), np.int32))
                else:
                    q = coarse_decode(raw[e["offset"]:e["offset"] + e["length"]], models, H * d, n)
                    qs.append(np.array(q, np.int32).reshape(H * d, n))
                deltas.append(np.full(n, np.float32(e["delta"]), np.float32))
                zero.append(np.full(n, bool(e["flags"] & OBJ_ZERO)))
            dr = np.concatenate(deltas)
            dr[:n_sink] *= np.float32(cfg.get("sink_scale", 1.0))  # spec 8.5: sink rows' step
            if cfg.get("stale_window", 0) and "sliding" in str(lay.get("layer_types", [""] * L)[i]):
                # spec 8.5 (1.3): rows no query after the file's end attends, after the sink's factor
                dr[:max(0, T - (cfg["stale_window"] - 1))] *= np.float32(cfg["stale_scale"])
            if cfg.get("row_steps"):  # spec 8.5 (1.3): the position's own factor, code / 32, last
                rc = np.frombuffer(zlib.decompress(base64.b64decode(t["row_codes"])), np.uint8)
                dr *= rc.astype(np.float32) / np.float32(32)
            Q, dr, zr = np.concatenate(qs, axis=1).T, dr[:, None], np.concatenate(zero)
            codes = (np.frombuffer(base64.b64decode(t["step_codes"]), np.uint8).reshape(H, d)
                     if cfg.get("channel_steps") else None)
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
                    if exact:  # §8.4.1
                        xs = [rec[s] for s in src]
                        if W is not None:
                            Y = spec_exact_map(spec_exact_weights(W, len(src)), xs)
                        else:
                            Y1 = spec_exact_map(spec_exact_weights(U, len(src)), xs)
                            Y = spec_exact_map(spec_exact_weights(V, 1), [Y1])
                    else:
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
                    Y = np.float32(lam / k) * sum(rec[s] for s in g[:k])
                    P = np.where((m & 3) == 2, Y, P)
                Qh = Q[:, hh * d:(hh + 1) * d].astype(np.float32)
                drh = dr  # spec 8.5 (1.3): the step of (r, c) is float32(delta_r * code / 32)
                if codes is not None:
                    drh = dr * (codes[hh].astype(np.float32) / np.float32(32))[None, :]
                w = Qh * drh
                interp = (m & 4) != 0
                for r in range(1, T, 2):
                    right_ok = r + 1 < T and (r + 1) % S != 0
                    pred = np.float32(0.5) * (w[r - 1] + w[r + 1]) if right_ok else w[r - 1]
                    w[r, interp] = (pred + Qh[r] * drh[r])[interp]
                rb = P + w
                if exact:
                    rb[zr] = np.float32(0.0) - mu
                else:
                    rb[zr] = (-mu) @ Rb if cfg["align"] else -mu
                rec[b] = rb
                x = rb @ Rb.T if cfg["align"] else rb
                x = x + mu
                if kind == "K" and rope:
                    if tables11 is None:
                        x = _rope(x, positions, lay["rope_theta"][i], lay["rope_pairing"], False)
                    elif tables11[i] is not None:
                        x = spec_rotate11(x, positions, tables11[i])
                x = np.clip(x, -fmax, fmax).astype(out_dt)
                x[zr] = 0
                res[hh] = x
            out[f"layers.{i}.{tname}"] = res[None] if lay["batch_dim"] else res
            if p["refine"]:  # §8.9: the exact tier of this tensor
                ex = res.copy()
                rmodels = base64.b64decode(t["refine_models"])
                n_ctx = 32 if out_dt == np.float16 else 256
                assert len(rmodels) == n_ctx
                for j in range(p["n_obj"]):
                    e = p["index"][n_c + ti * p["n_obj"] + j]
                    if e["flags"] & OBJ_ZERO:
                        continue
                    n = e["n_tokens"]
                    coarse = res[:, j * S:j * S + n]
                    rs = spec_rans_decode_ctx(raw[e["offset"]:e["offset"] + e["length"]],
                                              _refine_ids(coarse, rmodels), tables)
                    rs = np.array(rs, np.int64).reshape(H, d, n).transpose(0, 2, 1)
                    ex[:, j * S:j * S + n] = spec_unord(spec_ord(coarse) + rs, out_dt)
                refined[f"layers.{i}.{tname}"] = ex[None] if lay["batch_dim"] else ex
    return out, (refined if p["refine"] else None)


def _bank_for(v, raw):
    if "bank" in v["files"]:
        return spec_bank_from_h5(os.path.join(VEC, v["files"]["bank"]))
    emb = spec_parse(raw)["header"]["bank"]["embedded"]
    return spec_bank_from_canonical(raw[emb["offset"]:emb["offset"] + emb["length"]])


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("name", RANS4)
def test_spec_decoder_reproduces_vectors(name):
    """1.0 vectors (float arithmetic): within §9's tolerance; 1.1 vectors (exact arithmetic): bit
    for bit, the coarse tier and (lossless vectors) the exact tier, which is the input."""
    v = VECTORS[name]
    raw = open(os.path.join(VEC, v["files"]["kvz"]), "rb").read()
    exp = expected(v)
    coarse, exact = spec_decode(raw, _bank_for(v, raw))
    if v["compress"]["config"].get("arith", "float") != "exact":
        assert exact is None
        for name_, got in coarse.items():
            want = from_bits(exp[f"dec.{name_}"], v["dtype"])
            ok = within_tolerance(got, want)
            assert ok.all(), f"{name_}: {int((~ok).sum())} values outside tolerance"
        return
    lossless = bool(v["compress"].get("lossless"))
    assert (exact is not None) == lossless
    for name_, got in coarse.items():
        want = from_bits(exp[f"{'coarse' if lossless else 'dec'}.{name_}"], v["dtype"])
        n_diff = int((got.view(np.uint8) != want.view(np.uint8)).sum()) if got.shape == want.shape else -1
        assert _same_bits(got, want), f"{name_}: coarse tier differs in {n_diff} bytes"
    if lossless:
        from alignpred import load_cache

        inp = load_cache(os.path.join(VEC, v["files"]["input"]))
        for name_, got in exact.items():
            assert _same_bits(got, from_bits(exp[f"dec.{name_}"], v["dtype"])), f"{name_}: exact tier differs"
            assert _same_bits(got, np.asarray(inp.tensors[name_])), f"{name_}: exact tier is not the input"


# -- the 1.1 arithmetic of the spec against the library, beyond the vectors -----------------------
def test_spec_sincos_matches_library():
    from alignpred.cache.rope import sincos_f32

    rng = np.random.default_rng(0)
    a = np.concatenate([rng.uniform(0, 2 ** 20 * np.pi, 20000), rng.uniform(0, 8, 20000),
                        np.arange(0, 131072, 37)[:, None].astype(np.float32).ravel() * np.float32(0.7),
                        np.float32(np.arange(1, 5000) * (np.pi / 4)), [0.0, A_MAX * 0.999]]).astype(F32)
    c1, s1 = spec_sincos(a)
    c2, s2 = sincos_f32(a)
    assert _same_bits(c1, c2) and _same_bits(s1, s2)
    # the limit of §8.3.2: the largest float32 below A_MAX is accepted, the next one refused (both)
    lo = np.nextafter(F32(A_MAX), F32(0)) if float(F32(A_MAX)) >= A_MAX else F32(A_MAX)
    hi = np.nextafter(lo, F32(np.inf))
    spec_sincos(np.array([lo]))
    sincos_f32(np.array([lo]))
    with pytest.raises(SpecError):
        spec_sincos(np.array([hi]))
    from alignpred.errors import LayoutError

    with pytest.raises(LayoutError):
        sincos_f32(np.array([hi]))


@pytest.mark.parametrize("theta,d", [(1e4, 16), (1e4, 256), (1e6, 128), (5e5, 64), (10000.5, 12), (1.5, 8)])
def test_spec_default_inv_freq_matches_library(theta, d):
    from alignpred.cache.rope import RopeTable

    assert _same_bits(spec_default_inv_freq(theta, d), np.array(RopeTable.from_theta(theta, d).inv_freq, F32))


def test_spec_exact_map_matches_library():
    from alignpred.kernels.intmap import IntMap

    rng = np.random.default_rng(1)
    for trial in range(6):
        m, k, n_out, n = (1, 2, 3)[trial % 3], (16, 24, 7)[trial % 3], (16, 8, 5)[trial % 3], 37
        A = (rng.standard_normal((m * k, n_out)) * np.exp2(rng.integers(-30, 10, (m * k, 1)))).astype(np.float16)
        A[0] = 0  # an all-zero row
        if trial % 2:
            A[:, 0] = 0  # an all-zero column
        xs = [(rng.standard_normal((n, k)) * np.exp2(rng.integers(-20, 20, (n, 1)))).astype(F32) for _ in range(m)]
        xs[0][3] = 0  # an all-zero row
        xs[0][5, 1] = 8191.5 * 2.0 ** -12  # a tie
        if trial >= 3:  # float32 factors, and rows holding inf/NaN (defined by §8.4.1 too)
            A = A.astype(F32) * F32(1.0 + 2.0 ** -20)
            xs[-1][7, 2], xs[-1][8, 0], xs[-1][9, 1] = np.inf, np.nan, -np.inf
        with np.errstate(invalid="ignore", over="ignore"):
            want = IntMap(A, m).predict(xs)
            assert _same_bits(spec_exact_map(spec_exact_weights(A, m), xs), want)


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
        from alignpred.cache.cachefile import Cache
        from alignpred.cache.layout import infer_layout

        t = {k: v[None] for k, v in c.tensors.items()}
        c = Cache(t, c.metadata, infer_layout(t, c.metadata))
    bank = fit_bank([c], rank=None, rotations=True)
    p = tmp_path / "s.kvz"
    compress(c, p, budget=ErrorBudget(eps=0.05, scope=kw.get("scope", "tensor")), bank=bank,
             profile=Profile(embed_bank=kw.get("embed", False)), config=kw.get("config"))
    _validator().validate(spec_parse(p.read_bytes())["header"])
    KvzReader(p, bank=bank).read()


def test_recorded_headers_match_schema():
    """Every header written so far in this session (this module wraps the writer at import)."""
    val = _validator()
    assert RECORDED, "no header was recorded (dump_header wrapper not active?)"
    for hb in RECORDED:
        val.validate(json.loads(hb))


def test_spec_lanes32_and_library_agree_on_damaged_payloads():
    """§7.3's validity rule: the spec decoder and the library accept or reject the same damaged
    lanes32 payloads, and decode the accepted ones to the same symbols."""
    from alignpred import entropy
    from alignpred.errors import FormatError

    name = next(n for n in sorted(VECTORS) if VECTORS[n]["compress"].get("coder") == "lanes32")
    v = VECTORS[name]
    raw = open(os.path.join(VEC, v["files"]["kvz"]), "rb").read()
    p = spec_parse(raw)
    lt = spec_lanes_tables(spec_tables())
    lay = p["header"]["layout"]
    C = lay["kv_heads"] * lay["head_dim"]
    e = next(e for e in p["index"][:p["n_coarse"]] if e["length"])
    t = p["header"]["tensors"][divmod(p["index"].index(e), p["n_obj"])[0]]
    models = base64.b64decode(t["models"])
    good = raw[e["offset"]:e["offset"] + e["length"]]
    rng = np.random.default_rng(7)
    cases = [good[:-2], good + b"\0\0", good[:-1]]
    for _ in range(24):
        b = bytearray(good)
        b[int(rng.integers(0, len(b)))] ^= 1 << int(rng.integers(0, 8))
        cases.append(bytes(b))
    rejected = 0
    for c in cases:
        try:
            want = spec_lanes32_decode(c, models, C, e["n_tokens"], lt)
        except SpecError:
            want = None
        try:
            got = entropy.decode(c, np.frombuffer(models, np.uint8), (C, e["n_tokens"]), coder="lanes32")
        except FormatError:
            got = None
        assert (want is None) == (got is None)
        if want is not None:
            assert np.array_equal(np.array(want, np.int32).reshape(C, e["n_tokens"]), got)
        rejected += want is None
    assert rejected >= 3  # the length cases at least
