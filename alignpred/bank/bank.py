"""Calibration bank: per-block means, GPA rotations and linear prediction maps.

Blocks are named ``"K.{layer}.{head}"`` / ``"V.{layer}.{head}"``. A bank holds, per block,
``mean/<block>`` (``[d]``), optionally ``rot/<block>`` (``[d, d]`` orthogonal, stored fp16 and
re-orthonormalised on load) and ``map/<block>/U`` + ``map/<block>/Vt`` (a rank-``r`` map
``[d_in, r] @ [r, d]`` from the block's sources, listed in ``config["sources"]``).

Its *canonical bytes* (a JSON manifest then the raw little-endian arrays, sorted by name) are
what the content id (sha256) covers and what a ``.kvz`` file embeds for ``--self-calibrate``;
on disk a bank is an HDF5 file with one dataset per array and the manifest as an attribute.

>>> import numpy as np
>>> b = Bank(model="toy", signature={"num_layers": 1, "kv_heads": 1, "head_dim": 2},
...          config={"groups": [], "sources": {}}, arrays={"mean/K.0.0": np.zeros(2, np.float32)})
>>> Bank.from_bytes(b.to_bytes()).id == b.id
True
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from alignpred.cache.layout import block_name  # noqa: F401  (re-exported: banks name blocks)
from alignpred.errors import BankMismatchError, KvzError

MAGIC = b"KVZBANK1"
FORMAT = "kvz-bank"
VERSION = 1
_DTYPES = {"float16": np.float16, "float32": np.float32}
MAX_MANIFEST = 16 << 20




@dataclass(frozen=True, eq=False)
class Bank:
    """An immutable calibration bank (see module docstring)."""

    model: str
    signature: dict
    config: dict
    arrays: dict = field(repr=False)

    # -- canonical bytes and id ---------------------------------------------------------------
    def _canonical_parts(self):
        """The canonical bytes in pieces: magic, manifest length, manifest, then each array."""
        names = sorted(self.arrays)
        entries, blobs, off = [], [], 0
        for n in names:
            a = np.ascontiguousarray(self.arrays[n])
            if a.dtype.name not in _DTYPES:
                raise KvzError(f"bank array {n} has dtype {a.dtype}; banks store float16/float32")
            a = a.astype(a.dtype.newbyteorder("<"), copy=False)
            entries.append({"name": n, "dtype": a.dtype.name, "shape": list(a.shape), "offset": off,
                            "length": a.nbytes})
            blobs.append(a)
            off += a.nbytes
        manifest = {"format": FORMAT, "version": VERSION, "model": self.model, "signature": self.signature,
                    "config": self.config, "arrays": entries}
        mb = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        return [MAGIC + struct.pack("<Q", len(mb)) + mb] + [a.reshape(-1).view(np.uint8).data for a in blobs]

    def to_bytes(self) -> bytes:
        return b"".join(self._canonical_parts())

    @cached_property
    def id(self) -> str:
        """``sha256:<hex>`` of the canonical bytes (hashed piece by piece: no copy of the bank)."""
        h = hashlib.sha256()
        for part in self._canonical_parts():
            h.update(part)
        return "sha256:" + h.hexdigest()

    @classmethod
    def from_bytes(cls, buf) -> Bank:
        mv = memoryview(buf)
        if len(mv) < 16 or bytes(mv[:8]) != MAGIC:
            raise BankMismatchError("not a kvz bank (bad magic)")
        (mlen,) = struct.unpack_from("<Q", mv, 8)
        if mlen > MAX_MANIFEST or 16 + mlen > len(mv):
            raise BankMismatchError("bank manifest length out of range (truncated bank?)")
        try:
            man = json.loads(bytes(mv[16:16 + mlen]))
            if not isinstance(man, dict):
                raise BankMismatchError("malformed bank manifest: not a JSON object")
            if man.get("format") != FORMAT or man.get("version") != VERSION:
                raise BankMismatchError(f"unsupported bank format {man.get('format')!r} v{man.get('version')!r}")
            if not (isinstance(man["model"], str) and isinstance(man["signature"], dict)
                    and isinstance(man["config"], dict) and isinstance(man["arrays"], list)):
                raise BankMismatchError("malformed bank manifest: model, signature, config or arrays of the wrong type")
            data = mv[16 + mlen:]
            arrays = {}
            for e in man["arrays"]:
                if not isinstance(e, dict) or not isinstance(e["name"], str) or e["name"] in arrays:
                    raise BankMismatchError("malformed bank manifest: an array entry without a unique string name")
                dt = np.dtype(_DTYPES[e["dtype"]]).newbyteorder("<")
                shape = tuple(int(s) for s in e["shape"])
                a, n = int(e["offset"]), int(e["length"])
                if a < 0 or n != int(np.prod(shape, dtype=np.int64)) * dt.itemsize or a + n > len(data):
                    raise BankMismatchError(f"bank array {e['name']} out of range (truncated bank?)")
                arrays[e["name"]] = np.frombuffer(data[a:a + n], dtype=dt).reshape(shape)
            return cls(model=man["model"], signature=man["signature"], config=man["config"], arrays=arrays)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, KvzError):
                raise
            raise BankMismatchError(f"malformed bank manifest: {e}") from None

    # -- HDF5 files ---------------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the bank as HDF5 (atomically), with its content id as an attribute."""
        from alignpred.io import write_bank_file

        man = {"format": FORMAT, "version": VERSION, "model": self.model, "signature": self.signature,
               "config": self.config}
        write_bank_file(path, json.dumps(man, sort_keys=True), self.id,
                        {n: np.ascontiguousarray(a) for n, a in self.arrays.items()})

    @classmethod
    def load(cls, path) -> Bank:
        """Read an HDF5 bank and check its content id; BankMismatchError if it is not one."""
        from alignpred.io import read_bank_file

        path = os.fspath(path)
        man, stored, arrays = read_bank_file(path)
        try:
            man = json.loads(man)
        except ValueError:
            raise BankMismatchError(f"{path}: not a kvz bank (manifest is not JSON)") from None
        if not isinstance(man, dict) or man.get("format") != FORMAT or man.get("version") != VERSION:
            raise BankMismatchError(f"{path}: unsupported bank format")
        try:
            bank = cls(model=man["model"], signature=man["signature"], config=man["config"], arrays=arrays)
        except KeyError as e:
            raise BankMismatchError(f"{path}: bank manifest lacks {e}") from None
        if bank.id != stored:
            raise BankMismatchError(f"{path}: bank content does not match its id (corrupt bank file)")
        return bank

    # -- accessors ----------------------------------------------------------------------------
    def check_layout(self, layout) -> None:
        if self.signature != layout.signature():
            raise BankMismatchError(f"bank fits {self.signature} but the cache is {layout.signature()}; "
                                    "calibrate a bank for this model (kvz calibrate) or use --self-calibrate")

    def mean(self, block: str) -> np.ndarray:
        return np.asarray(self.arrays[f"mean/{block}"], np.float32)

    def rotation(self, block: str) -> np.ndarray | None:
        a = self.arrays.get(f"rot/{block}")
        if a is None:
            return None
        return _orthonormal(a)

    def sources(self, block: str) -> list[str]:
        return list(self.config.get("sources", {}).get(block, []))

    def map_factors(self, block: str):
        """``(U, Vt)`` of a low-rank map, ``(W, None)`` of a full one, or None."""
        w = self.arrays.get(f"map/{block}/W")
        if w is not None:  # in its stored dtype (float16 or float32): widen before use
            return np.asarray(w), None
        u = self.arrays.get(f"map/{block}/U")
        if u is None:
            return None
        return np.asarray(u, np.float32), np.asarray(self.arrays[f"map/{block}/Vt"], np.float32)

    def group_of(self, block: str) -> list[str]:
        for g in self.config.get("groups", []):
            if block in g:
                return list(g)
        return [block]

    @property
    def nbytes(self) -> int:
        return len(self.to_bytes())


_ORTHO_CACHE: dict = {}


def _orthonormal(a: np.ndarray) -> np.ndarray:
    key = (a.shape, hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest())
    r = _ORTHO_CACHE.get(key)
    if r is None:
        u, _, vt = np.linalg.svd(np.asarray(a, np.float64))
        r = (u @ vt).astype(np.float32)
        if len(_ORTHO_CACHE) > 512:
            _ORTHO_CACHE.clear()
        _ORTHO_CACHE[key] = r
    return r
