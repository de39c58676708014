"""The entropy stage on the device: every payload of a range -> the symbols ``q [tensors, C, rows]``
(int32, channel-major, as :meth:`alignpred.codec.decoder.Decoder._symbols` makes them) in one
kernel launch per coder, with the CPU decoder's checks, errors and error order.

The host reads the payloads (each one's CRC checked by the reader, as on the CPU path), checks
what the CPU checks before its kernel (lengths, shapes), packs the payloads into one buffer and
launches; the kernels return one ``ERR_*`` code per object, and the first failure in the CPU's
order (tensor by tensor; within a tensor its fetch and length checks, then per run of coded
objects the coder's checks and kernel) is raised as the CPU raises it (:class:`~alignpred.errors.
FormatError` / :class:`~alignpred.errors.ChecksumError` with the same message). ``constriction``
payloads (a reference coder, 5-10x slower than ``rans4`` on the CPU) are decoded on the host and
copied up.
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from alignpred import entropy
from alignpred.codec.chain import OBJ_ZERO
from alignpred.entropy import coder as _coder
from alignpred.entropy import lanes as _lanes
from alignpred.entropy import rans as _rans
from alignpred.errors import FormatError
from alignpred.gpu import kernels as K


@functools.lru_cache(maxsize=1)
def _tables(device: str):
    """Device copies of the decoders' tables: rans4 (slot -> token, packed, base, nbits) and
    lanes32 (``dtab``)."""
    t = _coder._load_tables()
    _, dtab = _lanes.tables()
    tok = torch.from_numpy(np.ascontiguousarray(t.slot2tok, np.uint8).reshape(-1).copy()).to(device)
    packed = torch.from_numpy(np.asarray(t.packed, np.int64).reshape(-1).copy()).to(device)
    base = torch.from_numpy(np.asarray(t.base, np.int64).copy()).to(device)
    nbits = torch.from_numpy(np.asarray(t.nbits, np.int64).copy()).to(device)
    d32 = torch.from_numpy(np.asarray(dtab, np.uint32).view(np.int32).copy()).to(device)   # the uint32 bits
    return tok, packed, base, nbits, d32


def _pow2_at_least(v: int, lo: int = 1) -> int:
    p = lo
    while p < v:
        p *= 2
    return p


class _Obj:
    __slots__ = ("ti", "j", "raw", "n", "col", "err", "launch")

    def __init__(self, ti, j, raw, n, col):
        self.ti, self.j, self.raw, self.n, self.col = ti, j, raw, n, col
        self.err: Exception | None = None   # a host-side error (raised in the CPU's order)
        self.launch = -1                    # index in the kernel launch, or -1


def symbols(reader, n_tensors: int, j0: int, j1: int, n_rows: int, device: str | None = None):
    """``(q, deltas, zero)``: the symbols of objects ``j0..j1-1`` of tensors ``0..n_tensors-1`` of
    ``reader`` on the device (int32 ``[n_tensors, C, n_rows]``), the objects' steps (float32
    ``[n_tensors, j1-j0]``) and zero flags (bool, same shape), on the host. Raises the error the
    CPU decoder would raise first."""
    dev = K.DEVICE if device is None else device
    lay = reader.layout
    S = reader.config.object_size
    C = lay.kv_heads * lay.head_dim
    coder = reader.header["codec"]["entropy"]["coder"]
    deltas = np.zeros((n_tensors, j1 - j0), np.float32)
    zero = np.zeros((n_tensors, j1 - j0), bool)
    q = torch.zeros((n_tensors, C, n_rows), dtype=torch.int32, device=dev)
    pre: list = [None] * n_tensors          # a tensor's first fetch/length error
    runs: list = [[] for _ in range(n_tensors)]
    for ti in range(n_tensors):
        meta = reader.metas[ti]
        cur: list = []
        for j in range(j0, j1):
            try:
                entry, payload = reader._fetch(ti, j)
                if entry.n_tokens != min(S, lay.n_tokens - j * S):
                    raise FormatError(f"{meta.name}: object {j} has the wrong length")
            except FormatError as e:
                pre[ti] = e
                break
            deltas[ti, j - j0] = entry.delta
            if entry.flags & OBJ_ZERO:
                zero[ti, j - j0] = True
                if cur:
                    runs[ti].append(cur)
                cur = []
                continue
            cur.append(_Obj(ti, j, _coder._payload_words(payload), entry.n_tokens, j * S - j0 * S))
        if cur:
            runs[ti].append(cur)
    launch: list = []
    for ti in range(n_tensors):
        for run in runs[ti]:
            _host_checks(run, C, coder)
            for o in run:
                if o.err is None and C * o.n > 0 and coder != "constriction":
                    o.launch = len(launch)
                    launch.append(o)
    errs = _launch(launch, reader, C, n_rows, coder, q, dev) if launch else np.zeros(0, np.int32)
    for ti in range(n_tensors):
        if pre[ti] is not None:
            raise pre[ti]
        ids = reader.metas[ti].models
        for run in runs[ti]:
            if coder == "lanes32":   # the coder's checks of every object of the run come first
                for o in run:
                    if o.err is not None:
                        raise o.err
            for o in run:
                if o.err is not None:
                    raise o.err
                if coder == "constriction" and C * o.n > 0:
                    sym = entropy.decode(o.raw, ids, (C, o.n), coder="constriction")
                    q[ti, :, o.col:o.col + o.n] = torch.from_numpy(np.ascontiguousarray(sym)).to(dev)
                elif o.launch >= 0 and errs[o.launch] != 0:
                    code = int(errs[o.launch])
                    text = _lanes.ERROR_TEXT[code] if coder == "lanes32" else _rans.ERROR_TEXT[code]
                    raise FormatError(f"{coder} payload invalid: {text}")
    return q, deltas, zero


def _host_checks(run: list, C: int, coder: str) -> None:
    """The checks :func:`alignpred.entropy.coder.decode` / ``decode_objects`` make before their
    kernels, with their messages; each object's first failure is kept in ``o.err``. For lanes32
    the odd-length check comes after the others of the whole run, as in ``lanes.decode_objects``."""
    for o in run:
        try:
            if C < 0 or o.n < 0 or C * o.n >= _coder._MAX_SYMBOLS:
                raise FormatError(f"bad shape {(C, o.n)!r}")
            _coder._checked_payload(o.raw, C, o.n, (C, o.n))
            if C * o.n == 0:
                if o.raw.size:
                    raise FormatError("non-empty payload for an empty object")
                continue
            if coder == "rans4" and (o.raw.size % 4 or o.raw.size < _rans.STATE_BYTES):
                raise FormatError(f"rans4 payload length {o.raw.size} is invalid")
        except FormatError as e:
            o.err = e
    if coder == "lanes32" and all(o.err is None for o in run):
        for o in run:
            if C * o.n > 0 and o.raw.size % 2:
                o.err = FormatError(f"lanes32 payload invalid: {_lanes.ERROR_TEXT[_lanes.ERR_SHORT]}")
                break


def _launch(objs: list, reader, C: int, n_rows: int, coder: str, q, dev: str) -> np.ndarray:
    """One kernel launch over ``objs``; returns their ``ERR_*`` codes (host)."""
    n_obj = len(objs)
    ids_all = np.stack([np.asarray(m.models, np.int32) for m in reader.metas]).reshape(-1)
    lanes = coder == "lanes32"
    unit = 2 if lanes else 4
    pad = 2 if lanes else 0
    W = np.array([o.raw.size // unit for o in objs], np.int64)
    off = np.zeros(n_obj, np.int64)
    off[1:] = np.cumsum(W + pad)[:-1]
    words = np.zeros(int((W + pad).sum()), np.int32 if lanes else np.int64)
    for o, a, w in zip(objs, off, W):
        words[a:a + w] = o.raw[:w * unit].view("<u2" if lanes else "<u4")
    N = np.array([C * o.n for o in objs], np.int64)
    n = np.array([o.n for o in objs], np.int64)
    ids_off = np.array([o.ti * C for o in objs], np.int64)
    out_off = np.array([o.ti * C * n_rows + o.col for o in objs], np.int64)

    def up(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    err = torch.zeros(n_obj, dtype=torch.int32, device=dev)
    tok, packed, base, nbits, dtab = _tables(dev)
    ids_d = up(ids_all)
    if lanes:
        hw = np.array([_lanes.header_words(int(v)) for v in N], np.int64)
        OB = 4 if K.DEVICE_TILES else _pow2_at_least(n_obj)
        n_iter = int(((N + 31) // 32).max())
        K.lanes32_kernel[(triton_cdiv(n_obj, OB),)](up(words), up(off), up(W), up(hw), up(N), up(n), up(ids_off),
                                                   up(out_off), ids_d, dtab, q, err, n_obj, n_rows, n_iter, OB=OB)
    else:
        OB = 32 if K.DEVICE_TILES else _pow2_at_least(n_obj)
        n_iter = int((N.max() + 3) // 4)
        K.rans4_kernel[(triton_cdiv(n_obj, OB),)](up(words), up(off), up(W), up(N), up(n), up(ids_off), up(out_off),
                                                 ids_d, tok, packed, base, nbits, q, err, n_obj, n_rows, n_iter, OB=OB)
    return err.cpu().numpy()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
