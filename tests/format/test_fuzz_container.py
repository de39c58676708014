"""Fuzzing the .kvz reader: damaged, truncated and *re-checksummed* crafted files.

Every input must either decode or raise a :class:`alignpred.errors.KvzError` subclass: never an
IndexError/ValueError/TypeError from numpy or struct, never a crash or a hang. The crafted cases
fix the checksums (header, index, payload, embedded bank, footer) after mutating, so they get
past the CRCs and exercise the validation behind them.

:func:`rebuild` (also used by ``tests/fuzz/fuzz_kvz.py``) reassembles a consistent file from
parts; :func:`try_decode` is the oracle.
"""
import copy
import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvz_testing import synthetic_cache

from alignpred import CodecConfig, ErrorBudget, KvzError, KvzReader, compress, fit_bank
from alignpred.codec import Profile
from alignpred.format.container import (
    ENTRY,
    ENTRY_SIZE,
    FOOTER_SIZE,
    PREAMBLE_SIZE,
    Footer,
    IndexEntry,
    dump_header,
    parse_container,
)

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


def crc(b) -> int:
    return zlib.crc32(b) & 0xFFFFFFFF


# -- building files from parts -------------------------------------------------------------------
def split(raw: bytes):
    """``(preamble, payloads, bank_bytes, header dict, entries)`` of a valid file."""
    p = parse_container(raw)
    payloads = [raw[e.offset:e.offset + e.length] for e in p.index]
    emb = p.header["bank"].get("embedded")
    bank = raw[emb["offset"]:emb["offset"] + emb["length"]] if emb else b""
    return raw[:PREAMBLE_SIZE], payloads, bank, p.header, list(p.index)


def rebuild(preamble, payloads, bank, header, entries, *, fix_offsets=True, fix_crcs=True,
            header_bytes=None, index_bytes=None) -> bytes:
    """Assemble a file; with ``fix_*`` the offsets and checksums are made consistent with the
    parts so that only the semantic damage remains."""
    out = bytearray(preamble)
    ents = []
    for k, e in enumerate(entries):
        pl = payloads[k] if k < len(payloads) else b""
        if fix_offsets:
            e = IndexEntry(e.tensor, e.token_start, e.n_tokens, e.flags, len(out), len(pl), e.delta, e.sq_err,
                           e.sq_norm, crc(pl) if fix_crcs else e.crc)
        ents.append(e)
        out += pl
    for pl in payloads[len(entries):]:
        out += pl
    if bank and isinstance(header, dict) and isinstance(header.get("bank"), dict) and fix_offsets:
        header = dict(header)
        header["bank"] = dict(header["bank"], embedded={"offset": len(out), "length": len(bank), "crc32": crc(bank)})
    out += bank
    hb = header_bytes if header_bytes is not None else json.dumps(header, separators=(",", ":"),
                                                                 sort_keys=True).encode()
    ib = index_bytes if index_bytes is not None else b"".join(
        ENTRY.pack(e.tensor % 2**32, e.token_start % 2**32, e.n_tokens % 2**32, e.flags % 2**32, e.offset % 2**64,
                   e.length % 2**64, e.delta, e.sq_err, e.sq_norm, e.crc % 2**32) for e in ents)
    ho = len(out)
    out += hb
    out += ib
    out += Footer(ho, len(hb), ho + len(hb), len(ib), crc(hb), crc(ib)).pack()
    return bytes(out)


def try_decode(path, bank=None) -> str:
    """Open, summarise and decode ``path`` fully and a token range; returns 'ok' or the error
    class name. Anything but a KvzError propagates (and fails the test)."""
    try:
        r = KvzReader(path, bank=bank)
        r.summary()
        r.read()
        n = r.layout.n_tokens
        r.read(tokens=(n // 3, max(n // 3 + 1, n - 1)), layers=1)
        return "ok"
    except KvzError as e:
        assert str(e), "empty error message"
        return type(e).__name__


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A file with an external bank (3 objects per tensor, with a tail) and one with an
    embedded bank, 2 heads, interleaved RoPE'd keys."""
    d = tmp_path_factory.mktemp("fuzz")
    c = synthetic_cache(n_layers=2, heads=1, T=40, d=16)
    bank = fit_bank([c], rank=4, rotations=False)
    p1 = d / "ext.kvz"
    compress(c, p1, budget=0.05, bank=bank, config=CodecConfig(object_size=16))
    c2 = synthetic_cache(n_layers=2, heads=2, T=20, d=8, seed=3, roped=True)
    bank2 = fit_bank([c2], rank=None, rotations=True)
    p2 = d / "emb.kvz"
    compress(c2, p2, budget=ErrorBudget(eps=0.1, scope="object"), bank=bank2, profile=Profile(embed_bank=True),
             config=CodecConfig(object_size=8, align=True, blend=True))
    p3 = d / "con.kvz"
    compress(c, p3, budget=0.05, bank=bank, profile=Profile(coder="constriction"), config=CodecConfig(object_size=16))
    return {"ext": (p1.read_bytes(), bank), "emb": (p2.read_bytes(), None), "con": (p3.read_bytes(), bank)}


class MemFiles:
    """Files held in memory: the reader's ``map_file`` is patched to serve them (no disk I/O,
    so exhaustive sweeps stay fast)."""

    def __init__(self):
        self.data = {}

    def map_file(self, path):
        return memoryview(self.data[str(path)])


@pytest.fixture
def work(monkeypatch, tmp_path):
    import alignpred.api.reader as kf

    mem = MemFiles()
    monkeypatch.setattr(kf, "map_file", mem.map_file)
    mem.path = str(tmp_path / "f.kvz")
    return mem


def _check(work, data: bytes, bank):
    work.data[work.path] = data
    return try_decode(work.path, bank)


def test_fixtures_decode(files, work):
    for raw, bank in files.values():
        assert _check(work, raw, bank) == "ok"
        parts = split(raw)
        assert rebuild(*parts) == raw or _check(work, rebuild(*parts), bank) == "ok"


# -- truncation and flips (exhaustive) -----------------------------------------------------------
@pytest.mark.parametrize("which", ["ext", "emb", "con"])
def test_truncate_at_every_offset(files, work, which):
    raw, bank = files[which]
    for n in range(len(raw)):
        assert _check(work, raw[:n], bank) != "ok", n


@pytest.mark.slow  # every byte of two files damaged and decoded; test_container's byte-flip test stays fast
@pytest.mark.parametrize("which", ["ext", "emb"])
def test_every_byte_damaged(files, work, which):
    """Each byte XORed with a random non-zero mask (single-bit flips for a third of them):
    always detected, since the CRCs cover every byte of the file."""
    raw, bank = files[which]
    rng = np.random.default_rng(7)
    for i in range(len(raw)):
        mask = 1 << int(rng.integers(8)) if i % 3 == 0 else int(rng.integers(1, 256))
        b = bytearray(raw)
        b[i] ^= mask
        assert _check(work, bytes(b), bank) != "ok", f"damage at byte {i} went undetected"


def test_extended_and_prefixed(files, work):
    raw, bank = files["ext"]
    for data in (raw + b"\0", raw + raw, b"\0" + raw, raw[:-FOOTER_SIZE] + b"\0" * 8 + raw[-FOOTER_SIZE:]):
        assert _check(work, data, bank) != "ok"


# -- re-checksummed header mutations -------------------------------------------------------------
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_value = st.recursive(json_leaf, lambda ch: st.one_of(st.lists(ch, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), ch, max_size=4)),
                          max_leaves=12)
# numbers that tend to sit on range boundaries
edge_ints = st.sampled_from([0, 1, -1, 2, 7, 8, 16, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32, 2**63, 2**64, -2**63])


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:6]):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, op, value):
    if not path:
        return value if op == "replace" else obj
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    k = path[-1]
    if op == "delete":
        if isinstance(parent, dict):
            del parent[k]
        else:
            parent.pop(k)
    elif op == "insert" and isinstance(parent, list):
        parent.insert(k, value)
    else:
        parent[k] = value
    return obj


@st.composite
def header_mutation(draw, header):
    h = copy.deepcopy(header)
    for _ in range(draw(st.integers(1, 3))):
        paths = list(_paths(h))
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "delete", "insert"]))
        value = draw(st.one_of(json_value, edge_ints))
        if path == () and op != "replace":
            continue
        h = _set(h, path, op, value)
    return h


@pytest.mark.parametrize("which", ["ext", "emb"])
def test_header_mutations(files, work, which):
    raw, bank = files[which]
    pre, payloads, bankb, header, entries = split(raw)

    @FUZZ
    @given(header_mutation(header))
    def run(h):
        _check(work, rebuild(pre, payloads, bankb, h, entries), bank)

    run()


@FUZZ
@given(st.binary(max_size=300) | json_value.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_header_bytes(files, work, hb):
    raw, bank = files["ext"]
    pre, payloads, bankb, header, entries = split(raw)
    _check(work, rebuild(pre, payloads, bankb, header, entries, header_bytes=hb), bank)


def test_header_json_strictness(files, work):
    raw, bank = files["ext"]
    pre, payloads, bankb, header, entries = split(raw)
    good = dump_header(header)
    for hb in (good.replace(b'"eps":', b'"eps":NaN,"x":', 1), good[:-1] + b',"format":"kvz"}',
               b"\xef\xbb\xbf" + good, good.replace(b'"flags":0', b'"flags":false')):
        assert _check(work, rebuild(pre, payloads, bankb, header, entries, header_bytes=hb), bank) == "FormatError"


# -- re-checksummed index mutations --------------------------------------------------------------
u32 = st.one_of(edge_ints.map(lambda v: v % 2**32), st.integers(0, 2**32 - 1))
u64 = st.one_of(edge_ints.map(lambda v: v % 2**64), st.integers(0, 2**64 - 1))
f64 = st.one_of(st.floats(), st.sampled_from([0.0, -0.0, 1e-45, 1e-300, 3.4e38, 1e39, float("nan"), float("inf")]))
FIELDS = {"tensor": u32, "token_start": u32, "n_tokens": u32, "flags": u32, "offset": u64, "length": u64,
          "delta": f64, "sq_err": f64, "sq_norm": f64, "crc": u32}


@st.composite
def index_mutation(draw, entries):
    ents = list(entries)
    for _ in range(draw(st.integers(1, 3))):
        k = draw(st.integers(0, len(ents) - 1))
        op = draw(st.sampled_from(["field", "field", "field", "swap", "drop", "dup"]))
        if op == "field":
            f = draw(st.sampled_from(sorted(FIELDS)))
            d = {n: getattr(ents[k], n) for n in FIELDS}
            d[f] = draw(FIELDS[f])
            ents[k] = IndexEntry(**d)
        elif op == "swap":
            j = draw(st.integers(0, len(ents) - 1))
            ents[k], ents[j] = ents[j], ents[k]
        elif op == "drop" and len(ents) > 1:
            ents.pop(k)
        elif op == "dup":
            ents.insert(k, ents[k])
    fix = draw(st.sampled_from(["all", "crc_only", "none"]))
    return ents, fix


@pytest.mark.parametrize("which", ["ext", "emb"])
def test_index_mutations(files, work, which):
    raw, bank = files[which]
    pre, payloads, bankb, header, entries = split(raw)

    @FUZZ
    @given(index_mutation(entries))
    def run(m):
        ents, fix = m
        if fix == "all":
            data = rebuild(pre, payloads, bankb, header, ents)
        else:
            if fix == "crc_only":  # keep the mutated offsets/lengths, fix the payload CRCs where in range
                ents = [IndexEntry(**{**{n: getattr(e, n) for n in FIELDS},
                                      "crc": crc(raw[e.offset:e.offset + e.length])})
                        if e.offset + e.length <= len(raw) else e for e in ents]
            body = pre + b"".join(payloads) + bankb
            data = rebuild(body, [], b"", header, ents, fix_offsets=False)
        _check(work, data, bank)

    run()


@FUZZ
@given(st.binary(max_size=4 * ENTRY_SIZE))
def test_arbitrary_index_bytes(files, work, ib):
    raw, bank = files["ext"]
    pre, payloads, bankb, header, entries = split(raw)
    _check(work, rebuild(pre, payloads, bankb, header, entries, index_bytes=ib), bank)


# -- re-checksummed payload and embedded-bank mutations ------------------------------------------
@pytest.mark.parametrize("which", ["ext", "emb", "con"])
def test_payload_mutations(files, work, which):
    """Damaged payloads whose CRC was recomputed reach the entropy decoder: it must reject them
    (or decode to some values) without crashing."""
    raw, bank = files[which]
    pre, payloads, bankb, header, entries = split(raw)
    live = [k for k, p in enumerate(payloads) if p]

    @FUZZ
    @given(st.sampled_from(live), st.sampled_from(["flip", "cut", "extend", "random", "zero"]), st.data())
    def run(k, op, data):
        p = bytearray(payloads[k])
        if op == "flip":
            i = data.draw(st.integers(0, len(p) - 1))
            p[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            p = p[:data.draw(st.integers(0, len(p) - 1))]
        elif op == "extend":
            p += data.draw(st.binary(min_size=1, max_size=12))
        elif op == "random":
            p = bytearray(data.draw(st.binary(max_size=2 * len(p))))
        else:
            p = bytearray(len(p))
        pls = list(payloads)
        pls[k] = bytes(p)
        ents = list(entries)
        if not p:  # an empty payload must be flagged as a zero object to pass the index checks
            e = ents[k]
            ents[k] = IndexEntry(e.tensor, e.token_start, e.n_tokens, 1, e.offset, 0, e.delta, e.sq_err, e.sq_norm, 0)
        _check(work, rebuild(pre, pls, bankb, header, ents), bank)

    run()


def test_embedded_bank_mutations(files, work):
    raw, _ = files["emb"]
    pre, payloads, bankb, header, entries = split(raw)
    (mlen,) = struct.unpack_from("<Q", bankb, 8)
    man = json.loads(bankb[16:16 + mlen])

    @FUZZ
    @given(st.sampled_from(["bytes", "manifest"]), st.data())
    def run(op, data):
        if op == "bytes":
            b = bytearray(bankb)
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= data.draw(st.integers(1, 255))
            b = bytes(b)
        else:
            m = data.draw(header_mutation(man))
            mb = json.dumps(m, sort_keys=True, separators=(",", ":")).encode()
            b = bankb[:8] + struct.pack("<Q", len(mb)) + mb + bankb[16 + mlen:]
        # the header names the bank by content id: make it match so the bank gets parsed
        import hashlib
        h = dict(header, bank=dict(header["bank"], id="sha256:" + hashlib.sha256(b).hexdigest()))
        _check(work, rebuild(pre, payloads, b, h, entries), None)

    run()


@pytest.mark.parametrize("bad", [0, None, "dup"])
def test_embedded_bank_array_names_must_be_unique_strings(files, work, bad):
    """Found by the fuzzer in CI: an array named 0 reached ``sorted`` inside the bank id (a
    TypeError); now a malformed-manifest error, like a duplicate name."""
    import hashlib

    raw, _ = files["emb"]
    pre, payloads, bankb, header, entries = split(raw)
    (mlen,) = struct.unpack_from("<Q", bankb, 8)
    man = json.loads(bankb[16:16 + mlen])
    man["arrays"][0]["name"] = man["arrays"][1]["name"] if bad == "dup" else bad
    mb = json.dumps(man, sort_keys=True, separators=(",", ":")).encode()
    b = bankb[:8] + struct.pack("<Q", len(mb)) + mb + bankb[16 + mlen:]
    h = dict(header, bank=dict(header["bank"], id="sha256:" + hashlib.sha256(b).hexdigest()))
    assert _check(work, rebuild(pre, payloads, b, h, entries), None) != "ok"


# -- the corruption sweep script (benchmarks/studies/robustness/corruption_sweep.py) on a small file ---------------
def test_corruption_sweep_detects_everything(files):
    from benchmarks.studies.robustness.corruption_sweep import sweep

    for which, stride in (("emb", 11), ("ext", 5)):
        raw, bank = files[which]
        res = sweep(raw, bank, stride=stride, masks=(None, 0x01), decode_samples=3)
        assert res["total"]["tried"] > 0 and res["total"]["rate"] == 1.0, res
        assert res["decode_path"]["detected"] == res["decode_path"]["tried"] == 3
        if which == "emb":
            assert res["bank"]["tried"] > 0


def test_verify_covers_payloads(files, work):
    raw, bank = files["ext"]
    work.data[work.path] = raw
    r = KvzReader(work.path, bank=bank)
    assert r.verify() == sum(e.length for e in r.index)


def test_coder_swapped(files, work):
    """A header that names the other entropy coder (checksums repaired): payloads of one coder
    fed to the other decoder must be rejected cleanly."""
    for which, other in (("ext", "constriction"), ("con", "rans4")):
        raw, bank = files[which]
        pre, payloads, bankb, header, entries = split(raw)
        h = copy.deepcopy(header)
        h["codec"]["entropy"]["coder"] = other
        assert _check(work, rebuild(pre, payloads, bankb, h, entries), bank) == "FormatError"
