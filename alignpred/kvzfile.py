"""Compress a cache into a .kvz file and read it back (whole, or a token range layer by layer).

>>> import numpy as np, tempfile, os
>>> from alignpred.cachefile import Cache
>>> from alignpred.layout import infer_layout
>>> rng = np.random.default_rng(0)
>>> t = {f"layers.{i}.{k}": rng.standard_normal((1, 300, 16)).astype(np.float16)
...      for i in range(2) for k in ("key", "value")}
>>> cache = Cache(t, {}, infer_layout(t))
>>> from alignpred.calibrate import fit_bank
>>> bank = fit_bank([cache], rank=None)
>>> p = os.path.join(tempfile.mkdtemp(), "c.kvz")
>>> info = compress(cache, p, eps=0.05, bank=bank)
>>> r = KvzReader(p, bank=bank)
>>> out = r.read()
>>> x, y = t["layers.1.value"].astype(np.float64), out["layers.1.value"].astype(np.float64)
>>> bool(np.linalg.norm(y - x) / np.linalg.norm(x) <= 0.05), out["layers.1.value"].dtype
(True, dtype('float16'))
"""
from __future__ import annotations

import base64
import math
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from . import __version__, entropy
from .bank import Bank
from .codec import OBJ_ZERO, SCOPES, Decoder, Encoder, TensorMeta
from .errors import BankMismatchError, ChecksumError, FormatError, KvzError, LayoutError
from .format.container import (ENTRY_SIZE, FOOTER_SIZE, MAJOR, MINOR, PREAMBLE_SIZE, Footer, IndexEntry, crc32,
                               dump_header, pack_preamble, parse_container)
from .io import atomic_write, map_file, release_pages
from .layout import CacheLayout
from .predict import CodecConfig

CODER = "rans4"  # default entropy coder; "constriction" is the reference alternative


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, np.uint8).tobytes()).decode()


def _unb64(s, n: int, what: str) -> np.ndarray:
    try:
        b = base64.b64decode(s, validate=True)
    except (ValueError, TypeError):
        raise FormatError(f"header field {what} is not base64") from None
    if len(b) != n:
        raise FormatError(f"header field {what} has {len(b)} bytes, expected {n}")
    return np.frombuffer(b, np.uint8)


@dataclass
class CompressInfo:
    """What :func:`compress` wrote: sizes, bits per value and achieved errors."""

    path: str
    n_values: int
    file_bytes: int
    bank_bytes: int
    nrmse_pooled: float
    nrmse_tensor: dict

    @property
    def bpv(self) -> float:
        return 8.0 * self.file_bytes / max(self.n_values, 1)

    @property
    def nrmse_max_tensor(self) -> float:
        return max(self.nrmse_tensor.values(), default=0.0)


def compress(cache, out_path, *, eps: float, bank: Bank | None = None, scope: str = "tensor",
             config: CodecConfig | None = None, embed_bank: bool = False, coder: str = CODER,
             progress=None) -> CompressInfo:
    """Compress ``cache`` (a :class:`~alignpred.cachefile.Cache`) into ``out_path`` atomically.

    ``bank`` is the calibration bank (auxiliary; referenced by id) — with ``embed_bank`` it is
    stored in the file and counted in bpv (``--self-calibrate``).
    """
    src = getattr(cache, "path", None)
    try:
        return _compress(cache, out_path, eps=eps, bank=bank, scope=scope, config=config, embed_bank=embed_bank,
                         coder=coder, progress=progress)
    except KvzError as e:
        if src and src not in str(e):
            raise type(e)(f"{src}: {e}") from None
        raise


def _compress(cache, out_path, *, eps, bank, scope, config, embed_bank, coder, progress) -> CompressInfo:
    config = config or CodecConfig()
    lay = cache.layout
    if lay.n_tokens == 0:
        raise LayoutError("the cache has no tokens (empty cache); nothing to compress: capture at least one token")
    if bank is None:
        raise BankMismatchError("compression needs a calibration bank (--bank) or --self-calibrate")
    if scope not in SCOPES:
        raise KvzError(f"unknown eps scope {scope!r}; use one of {', '.join(SCOPES)}")
    enc = Encoder(lay, bank, config, eps, scope, coder)
    bank_bytes = bank.to_bytes() if embed_bank else b""
    n_obj = enc.n_obj
    buf = getattr(cache, "buf", None)
    # The encoder emits objects chunk-major (all tensors of positions 0..2047, then the next
    # 2048, ...); the file holds them tensor-major. They wait in an anonymous spool file next to
    # the output (unlinked at once: nothing is left behind on a crash), not in memory.
    spool = tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(os.fspath(out_path))))
    try:
        where = np.zeros((2 * lay.num_layers * n_obj, 2), np.int64)  # spool offset, length
        obs: list = [None] * len(where)
        pos = 0
        try:
            for ob in enc.encode(cache.tensors, progress, release=lambda view: release_pages(buf)):
                k = ob.tensor * n_obj + ob.token_start // config.object_size
                spool.write(ob.payload)
                where[k] = pos, len(ob.payload)
                pos += len(ob.payload)
                ob.payload = b""
                obs[k] = ob
            spool.flush()
        except OSError as e:  # name the output: the spool file has no name of its own
            raise OSError(e.errno, f"{e.strerror} (temporary spool for the output)", os.fspath(out_path)) from None
        metas: list[TensorMeta] = enc.metas
        entries: list[IndexEntry] = []
        state = {"bytes": 0}

        def chunks():
            yield pack_preamble()
            off = PREAMBLE_SIZE
            for k, ob in enumerate(obs):
                payload = os.pread(spool.fileno(), int(where[k, 1]), int(where[k, 0])) if where[k, 1] else b""
                if len(payload) != where[k, 1]:
                    raise KvzError("the temporary spool file was truncated while compressing")
                entries.append(IndexEntry(ob.tensor, ob.token_start, ob.n_tokens, ob.flags, off, len(payload),
                                          ob.delta, ob.sq_err, ob.sq_norm, crc32(payload)))
                off += len(payload)
                yield payload
            bank_info = {"id": bank.id, "model": bank.model, "embedded": None}
            if embed_bank:
                bank_info["embedded"] = {"offset": off, "length": len(bank_bytes), "crc32": crc32(bank_bytes)}
                off += len(bank_bytes)
                yield bank_bytes
            header = {
                "format": "kvz", "version": [MAJOR, MINOR], "flags": 0, "created_by": f"kvz {__version__}",
                "layout": lay.to_json(),
                "codec": {"name": "alignpred", "config": config.to_json(), "eps": eps, "eps_scope": scope,
                          "entropy": {"coder": coder, "model_set": entropy.MODEL_SET_ID, "prec": entropy.PREC}},
                "bank": bank_info,
                "tensors": [{"name": m.name, "modes": _b64(m.modes), "models": _b64(m.models), "sq_err": m.sq_err,
                             "sq_norm": m.sq_norm} for m in metas],
                "source_metadata": {k: v for k, v in cache.metadata.items() if k != "token_ids"},
            }
            hb = dump_header(header)
            ib = b"".join(e.pack() for e in entries)
            ft = Footer(off, len(hb), off + len(hb), len(ib), crc32(hb), crc32(ib))
            yield hb
            yield ib
            yield ft.pack()
            state["bytes"] = off + len(hb) + len(ib) + FOOTER_SIZE

        atomic_write(out_path, chunks())
    finally:
        try:
            spool.close()  # unlinked already; a failed flush of its last bytes does not matter
        except OSError:
            pass
    tens = {m.name: math.sqrt(m.sq_err / m.sq_norm) if m.sq_norm > 0 else 0.0 for m in metas}
    tot_e = sum(m.sq_err for m in metas)
    tot_n = sum(m.sq_norm for m in metas)
    return CompressInfo(str(out_path), lay.n_values, state["bytes"], len(bank_bytes),
                        math.sqrt(tot_e / tot_n) if tot_n > 0 else 0.0, tens)


class KvzReader:
    """Random-access reader of a .kvz file. Everything but the payloads is verified on open.

    ``bank``: a :class:`Bank`, a path to one, or None (embedded bank, or a bundled bank whose id
    matches). Payload checksums are verified as objects are decoded.
    """

    def __init__(self, path, bank=None):
        self.path = os.fspath(path)
        self._buf = map_file(self.path)
        try:
            parsed = parse_container(self._buf)
        except FormatError as e:
            raise type(e)(f"{self.path}: {e}") from None
        self.header = parsed.header
        self.index = parsed.index
        self._footer = parsed.footer
        self.version = parsed.version
        try:
            self._validate()
        except FormatError as e:
            raise type(e)(f"{self.path}: {e}") from None
        self._bank_arg = bank
        self._decoder = None

    # -- validation ------------------------------------------------------------------------------
    def _validate(self) -> None:
        h = self.header
        check_header(h)
        try:
            self.layout = CacheLayout.from_json(h["layout"])
            codec = h["codec"]
            self.config = CodecConfig.from_json(codec["config"])
            self.eps = float(codec["eps"])
            self.scope = str(codec["eps_scope"])
            ent = codec["entropy"]
            tensors = h["tensors"]
            bank = h["bank"]
            self.bank_id = str(bank["id"])
        except (KeyError, TypeError, ValueError, LayoutError) as e:
            raise FormatError(f"malformed header ({type(e).__name__}: {e})") from None
        if codec.get("name") != "alignpred":
            raise FormatError(f"unknown codec {codec.get('name')!r}")
        if ent.get("coder") not in entropy.CODERS or ent.get("model_set") != entropy.MODEL_SET_ID or ent.get("prec") != entropy.PREC:
            raise FormatError(f"unsupported entropy coder {ent!r}")
        lay = self.layout
        S = self.config.object_size
        if S < 2 or S % 2 or S > 1 << 16:
            raise FormatError(f"invalid object size {S}")
        if not isinstance(tensors, list) or len(tensors) != 2 * lay.num_layers:
            raise FormatError("header tensor list does not match the layout")
        n_obj = -(-lay.n_tokens // S)
        if len(self.index) != n_obj * len(tensors):
            raise FormatError(f"index holds {len(self.index)} objects, layout needs {n_obj * len(tensors)}")
        C = lay.kv_heads * lay.head_dim
        self.metas = []
        for ti, (t, name) in enumerate(zip(tensors, lay.tensor_names())):
            if not isinstance(t, dict) or t.get("name") != name:
                raise FormatError(f"header tensor {ti} should be {name}")
            modes = _unb64(t.get("modes"), C, f"{name}.modes").reshape(lay.kv_heads, lay.head_dim)
            models = _unb64(t.get("models"), C, f"{name}.models")
            self.metas.append(TensorMeta(name, modes, models, float(t.get("sq_err", 0.0)),
                                         float(t.get("sq_norm", 0.0))))
        prev_end = PREAMBLE_SIZE
        for k, e in enumerate(self.index):
            ti, j = divmod(k, n_obj)
            want_n = min(S, lay.n_tokens - j * S)
            if e.tensor != ti or e.token_start != j * S or e.n_tokens != want_n:
                raise FormatError(f"index entry {k} does not follow the layout order")
            if e.flags & ~OBJ_ZERO or bool(e.flags & OBJ_ZERO) != (e.length == 0):
                raise FormatError(f"index entry {k} has invalid flags")
            if not _f32(e.delta) or (not (e.flags & OBJ_ZERO) and not e.delta > 0):
                raise FormatError(f"index entry {k} has an invalid quantisation step")
            if not (_nonneg(e.sq_err) and _nonneg(e.sq_norm)):
                raise FormatError(f"index entry {k} has invalid error statistics")
            if e.offset != prev_end:
                raise FormatError(f"index entry {k}: payloads must be contiguous")
            prev_end = e.offset + e.length
        emb = self.header["bank"].get("embedded")
        end = prev_end + (int(emb["length"]) if emb else 0)
        if emb and int(emb["offset"]) != prev_end:
            raise FormatError("embedded bank offset is inconsistent")
        if end != self._footer.header_offset:
            raise FormatError("payloads do not end where the header starts")
        self.n_objects_per_tensor = n_obj

    # -- bank ------------------------------------------------------------------------------------
    def _resolve_bank(self) -> Bank:
        emb = self.header["bank"].get("embedded")
        if emb:
            a, n = int(emb["offset"]), int(emb["length"])
            raw = self._buf[a:a + n]
            if crc32(raw) != int(emb["crc32"]):
                raise ChecksumError(f"{self.path}: embedded bank checksum mismatch")
            try:
                bank = Bank.from_bytes(raw)
            except KvzError as e:
                raise BankMismatchError(f"{self.path}: embedded bank is invalid: {e}") from None
            except (AttributeError, TypeError, ValueError, KeyError, IndexError, OverflowError) as e:
                raise BankMismatchError(f"{self.path}: embedded bank is malformed ({type(e).__name__})") from None
        else:
            arg = self._bank_arg
            if arg is None:
                arg = find_bundled_bank(self.bank_id)
                if arg is None:
                    raise BankMismatchError(f"{self.path} was written with bank {self.bank_id[:19]}…; "
                                            "pass it with --bank")
            bank = arg if isinstance(arg, Bank) else Bank.load(arg)
        if bank.id != self.bank_id:
            raise BankMismatchError(f"{self.path} needs bank {self.bank_id[:19]}… but got {bank.id[:19]}…; "
                                    "use the bank the file was compressed with")
        try:
            check_bank(bank, self.layout, self.config)
        except BankMismatchError as e:
            raise BankMismatchError(f"{self.path}: {e}") from None
        return bank

    @property
    def decoder(self) -> Decoder:
        if self._decoder is None:
            dec = Decoder(self.layout, self._resolve_bank(), self.config, self.header["codec"]["entropy"]["coder"])
            try:
                dec.check(self.metas)
            except FormatError as e:
                raise FormatError(f"{self.path}: {e}") from None
            self._decoder = dec
        return self._decoder

    # -- reading ---------------------------------------------------------------------------------
    def _fetch(self, ti: int, j: int):
        e = self.index[ti * self.n_objects_per_tensor + j]
        payload = self._buf[e.offset:e.offset + e.length]
        if crc32(payload) != e.crc:
            raise ChecksumError(f"{self.path}: checksum mismatch in {self.metas[ti].name} tokens "
                                f"{e.token_start}..{e.token_start + e.n_tokens}")
        return e, payload

    def verify(self, entries=None, bank: bool | None = None) -> int:
        """Check payload checksums without decoding (all index entries, or the given entry
        indices) and, with ``bank`` (default: when checking all entries), the embedded bank's;
        raises ChecksumError. Returns the bytes checked. Together with the checks on open, this
        covers every byte of the file."""
        n_obj = self.n_objects_per_tensor
        ks = range(len(self.index)) if entries is None else entries
        total = 0
        for k in ks:
            ti, j = divmod(int(k), n_obj)
            total += len(self._fetch(ti, j)[1])
        emb = self.header["bank"].get("embedded")
        if emb and (entries is None if bank is None else bank):
            raw = self._buf[emb["offset"]:emb["offset"] + emb["length"]]
            if crc32(raw) != emb["crc32"]:
                raise ChecksumError(f"{self.path}: embedded bank checksum mismatch")
            total += len(raw)
        return total

    def iter_layers(self, tokens: tuple[int, int] | None = None, layers: int | None = None):
        """Yield ``(name, array)`` layer by layer (key then value) for a token range ``[a, b)``;
        only the objects covering the range are read."""
        lay = self.layout
        a, b = (0, lay.n_tokens) if tokens is None else (int(tokens[0]), int(tokens[1]))
        if not (0 <= a < b <= lay.n_tokens):
            raise KvzError(f"token range {a}..{b} is outside 0..{lay.n_tokens}")
        n_layers = lay.num_layers if layers is None else int(layers)
        if not (1 <= n_layers <= lay.num_layers):
            raise KvzError(f"layers must be in 1..{lay.num_layers}")
        S = self.config.object_size
        j0, j1 = a // S, -(-b // S)
        try:
            for name, arr in self.decoder.decode_range(self.metas, self._fetch, j0, j1, n_layers):
                arr = arr[:, a - j0 * S:b - j0 * S]
                yield name, (arr[None] if lay.batch_dim else arr)
        except FormatError as e:
            if self.path in str(e):
                raise
            raise type(e)(f"{self.path}: {e}") from None

    def read(self, tokens=None, layers=None) -> dict:
        """Decode into ``{name: array}`` (the source's names, shapes and dtype)."""
        return dict(self.iter_layers(tokens, layers))

    def decompress_to(self, path, tokens=None, layers=None, chunk_objects: int = 1, progress=None) -> int:
        """Decode into a safetensors file (atomically) in bounded memory: object range by object
        range through every layer, each slice written at its place in the output, so only
        ``chunk_objects`` × 256 positions of the cache are in memory at a time. Returns the bytes
        written. ``progress(n)`` is called with the number of positions finished."""
        from .cachefile import safetensors_header
        from .io import atomic_file
        from .layout import numpy_dtype

        lay = self.layout
        a, b = (0, lay.n_tokens) if tokens is None else (int(tokens[0]), int(tokens[1]))
        n_layers = lay.num_layers if layers is None else int(layers)
        S = self.config.object_size
        n_tok = b - a
        shape = lay.with_tokens(n_tok).tensor_shape()
        dt = numpy_dtype(lay.dtype)
        names = lay.tensor_names()[:2 * n_layers]
        head = safetensors_header([(n, shape, dt) for n in names], self._slice_metadata(a, n_layers))
        t_bytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        row_bytes = lay.head_dim * dt.itemsize
        step = max(1, int(chunk_objects)) * S
        with atomic_file(path) as f:
            f.write(head)
            f.truncate(len(head) + t_bytes * len(names))
            for c0 in range((a // S) * S, b, step):
                lo, hi = max(a, c0), min(b, c0 + step)
                for ti, (name, arr) in enumerate(self.iter_layers((lo, hi), n_layers)):
                    arr = arr[0] if lay.batch_dim else arr
                    for h in range(lay.kv_heads):
                        f.seek(len(head) + ti * t_bytes + (h * n_tok + lo - a) * row_bytes)
                        f.write(np.ascontiguousarray(arr[h]).tobytes())
                self._release_pages()
                if progress:
                    progress(hi - lo)
        return len(head) + t_bytes * len(names)

    def _release_pages(self) -> None:
        """Streaming a large file should not grow RSS with the mapped pages already read."""
        release_pages(self._buf)

    def _slice_metadata(self, start: int, n_layers: int) -> dict:
        """The source metadata, adjusted for a decoded subset: per-layer lists cut to the layers
        kept, and the RoPE position offset moved to the first token kept."""
        import json

        meta = dict(self.header.get("source_metadata", {}))
        for key in ("layer_types", "rope_theta"):
            if key in meta:
                try:
                    meta[key] = json.dumps(json.loads(meta[key])[:n_layers])
                except (ValueError, TypeError):
                    del meta[key]
        if start:
            meta["position_offset"] = str(self.layout.position_offset + start)
        return meta

    # -- summary ---------------------------------------------------------------------------------
    def summary(self) -> dict:
        lay = self.layout
        size = len(self._buf)
        per = {}
        for ti, m in enumerate(self.metas):
            ents = self.index[ti * self.n_objects_per_tensor:(ti + 1) * self.n_objects_per_tensor]
            nbytes = sum(e.length for e in ents) + ENTRY_SIZE * len(ents)
            n_vals = lay.kv_heads * lay.n_tokens * lay.head_dim
            per[m.name] = {"nrmse": math.sqrt(m.sq_err / m.sq_norm) if m.sq_norm > 0 else 0.0,
                           "bpv_payload": 8.0 * nbytes / n_vals,
                           "max_object_nrmse": max((math.sqrt(e.sq_err / e.sq_norm) if e.sq_norm > 0 else 0.0)
                                                   for e in ents)}
        tot_e = sum(m.sq_err for m in self.metas)
        tot_n = sum(m.sq_norm for m in self.metas)
        emb = self.header["bank"].get("embedded")
        return {"file": self.path, "version": ".".join(map(str, self.version)), "layout": lay.to_json(),
                "eps": self.eps, "eps_scope": self.scope, "config": self.config.to_json(),
                "bank_id": self.bank_id, "bank_embedded": bool(emb),
                "bank_bytes": int(emb["length"]) if emb else 0,
                "file_bytes": size, "n_values": lay.n_values, "bpv": 8.0 * size / lay.n_values,
                "nrmse_pooled": math.sqrt(tot_e / tot_n) if tot_n > 0 else 0.0,
                "nrmse_max_tensor": max(v["nrmse"] for v in per.values()), "tensors": per}


# -- header validation (every key the reader uses, with its JSON type and range) ---------------
MAX_LAYERS = 1 << 12
MAX_CHANNELS = 1 << 16      # kv_heads * head_dim
MAX_TOKENS = 1 << 40
_LAYOUT_TYPES = {"num_layers": "int", "kv_heads": "int", "head_dim": "int", "n_tokens": "int", "dtype": "str",
                 "batch_dim": "bool", "model": "str", "layer_types": "list", "rope_theta": "list",
                 "rope_pairing": "str", "keys_roped": "bool", "position_offset": "int", "extra": "dict"}
_CONFIG_TYPES = {"object_size": "int", "align": "bool", "inter_map": "bool", "blend": "bool", "intra": "bool",
                 "channel_choice": "bool", "rope_undo": "bool", "lambdas": "list", "sink_tokens": "int",
                 "sink_scale": "float"}
_PY = {"int": int, "str": str, "bool": bool, "list": list, "dict": dict, "float": float}


def _f32(v) -> bool:
    """A finite number exactly representable as float32."""
    return isinstance(v, float) and math.isfinite(v) and float(np.float32(v)) == v


def _nonneg(v) -> bool:
    return type(v) in (int, float) and math.isfinite(v) and v >= 0


def _typed(d, types: dict, where: str, required=()) -> None:
    if not isinstance(d, dict):
        raise FormatError(f"header field {where} must be an object")
    for k in required:
        if k not in d:
            raise FormatError(f"header field {where}.{k} is missing")
    for k, t in types.items():
        if k in d and type(d[k]) is not _PY[t]:
            raise FormatError(f"header field {where}.{k} must be a JSON {t}")


def check_header(h: dict) -> None:
    """Type and range checks of every header key the decoder relies on (FormatError)."""
    for k in ("layout", "codec", "bank", "tensors"):
        if k not in h:
            raise FormatError(f"header field {k} is missing")
    lay = h["layout"]
    _typed(lay, _LAYOUT_TYPES, "layout", ("num_layers", "kv_heads", "head_dim", "n_tokens", "dtype"))
    if not (1 <= lay["num_layers"] <= MAX_LAYERS and lay["kv_heads"] >= 1 and lay["head_dim"] >= 1
            and lay["kv_heads"] * lay["head_dim"] <= MAX_CHANNELS and 1 <= lay["n_tokens"] <= MAX_TOKENS):
        raise FormatError("layout sizes out of range")
    if not all(isinstance(x, str) for x in lay.get("layer_types", [])):
        raise FormatError("layout.layer_types must be strings")
    if not all(type(x) in (int, float) and math.isfinite(x) and x > 0 for x in lay.get("rope_theta", [])):
        raise FormatError("layout.rope_theta must be positive numbers")
    if not 0 <= lay.get("position_offset", 0) <= MAX_TOKENS:
        raise FormatError("layout.position_offset out of range")
    codec = h["codec"]
    _typed(codec, {"name": "str", "eps_scope": "str", "config": "dict", "entropy": "dict"}, "codec",
           ("name", "config", "eps", "eps_scope", "entropy"))
    if not (type(codec["eps"]) in (int, float) and 0 < codec["eps"] < 1):
        raise FormatError("codec.eps must be a number in (0, 1)")
    if codec["eps_scope"] not in SCOPES:
        raise FormatError(f"unknown eps scope {codec['eps_scope']!r}")
    cfg = codec["config"]
    _typed(cfg, _CONFIG_TYPES, "codec.config")
    lam = cfg.get("lambdas", [0.5, 0.75])
    if len(lam) != 2 or not all(type(x) in (int, float) and math.isfinite(x) for x in lam):
        raise FormatError("codec.config.lambdas must be two numbers")
    if not (0 <= cfg.get("sink_tokens", 0) <= MAX_TOKENS and _f32(cfg.get("sink_scale", 1.0))
            and 0 < cfg.get("sink_scale", 1.0) <= 1):
        raise FormatError("codec.config.sink_tokens/sink_scale out of range")
    bank = h["bank"]
    _typed(bank, {"id": "str", "model": "str"}, "bank", ("id",))
    emb = bank.get("embedded")
    if emb is not None:
        _typed(emb, {"offset": "int", "length": "int", "crc32": "int"}, "bank.embedded", ("offset", "length", "crc32"))
        if emb["length"] < 0 or not 0 <= emb["crc32"] < 1 << 32:
            raise FormatError("bank.embedded out of range")
    if not isinstance(h["tensors"], list):
        raise FormatError("header field tensors must be a list")
    for t in h["tensors"]:
        _typed(t, {"name": "str", "modes": "str", "models": "str"}, "tensors[]", ("name", "modes", "models"))
        if not (_nonneg(t.get("sq_err", 0.0)) and _nonneg(t.get("sq_norm", 0.0))):
            raise FormatError(f"header tensor {t['name']!r} has invalid error statistics")
    if not isinstance(h.get("source_metadata", {}), dict):
        raise FormatError("header field source_metadata must be an object")


def check_bank(bank: Bank, layout: CacheLayout, config: CodecConfig) -> None:
    """The bank has every array the decoder will use, with the right shapes, finite values, and
    prediction sources that are decoded before the block they predict (BankMismatchError)."""
    from .bank import block_name

    d = layout.head_dim
    order = [block_name(k, i, h) for i in range(layout.num_layers) for k in ("K", "V") for h in range(layout.kv_heads)]
    pos = {b: k for k, b in enumerate(order)}
    cfgd = bank.config
    if not isinstance(cfgd, dict) or not isinstance(cfgd.get("sources", {}), dict) \
            or not isinstance(cfgd.get("groups", []), list) \
            or not all(isinstance(g, list) and all(isinstance(s, str) for s in g) for g in cfgd.get("groups", [])):
        raise BankMismatchError("bank config is malformed")
    for a in bank.arrays.values():
        if not np.isfinite(np.asarray(a, np.float32)).all():
            raise BankMismatchError("bank holds non-finite values")
    for b in order:
        m = bank.arrays.get(f"mean/{b}")
        if m is None or tuple(m.shape) != (d,):
            raise BankMismatchError(f"bank mean of {b} is missing or has the wrong shape")
        if config.align:
            r = bank.arrays.get(f"rot/{b}")
            if r is None or tuple(r.shape) != (d, d):
                raise BankMismatchError(f"bank rotation of {b} is missing or has the wrong shape")
        src = cfgd.get("sources", {}).get(b, [])
        if not isinstance(src, list) or not all(isinstance(s, str) and pos.get(s, len(order)) < pos[b] for s in src):
            raise BankMismatchError(f"bank sources of {b} are not blocks decoded before it")
        if config.inter_map and src:
            w, u, vt = (bank.arrays.get(f"map/{b}/{n}") for n in ("W", "U", "Vt"))
            din = d * len(src)
            if w is not None:
                ok = tuple(w.shape) == (din, d)
            elif u is not None:
                ok = vt is not None and u.ndim == 2 and u.shape[0] == din and tuple(vt.shape) == (u.shape[1], d)
            else:
                ok = True
            if not ok:
                raise BankMismatchError(f"bank map of {b} has the wrong shape")
        if config.blend:
            for g in cfgd.get("groups", []):
                if b in g:
                    if not all(isinstance(s, str) and pos.get(s, len(order)) < pos[b] for s in g[:g.index(b)]):
                        raise BankMismatchError(f"bank group of {b} is not in decode order")
                    break


def find_bundled_bank(bank_id: str):
    """Path of a bank with this id among ``$KVZ_BANK_PATH`` (os.pathsep-separated) and the
    bundled samples, or None."""
    import glob

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = [d for d in os.environ.get("KVZ_BANK_PATH", "").split(os.pathsep) if d]
    dirs.append(os.path.join(here, "samples"))
    for d in dirs:
        for p in sorted(glob.glob(os.path.join(d, "**", "*.h5"), recursive=True)):
            try:
                if bank_id_of(p) == bank_id:
                    return p
            except KvzError:
                continue
    return None


def bank_id_of(path) -> str:
    """The stored content id of an HDF5 bank (cheap; not verified)."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return str(f.attrs["content_id"])
    except (OSError, KeyError):
        raise KvzError(f"{path}: not a kvz bank") from None
