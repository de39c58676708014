"""Read .kvz files: from a path, bytes, a memoryview or an mmap; whole, or a token range of some
layers, into new arrays or into the caller's buffers, layer by layer.

>>> import numpy as np
>>> from alignpred import Cache, compress_bytes, fit_bank
>>> rng = np.random.default_rng(0)
>>> kv = [(rng.standard_normal((2, 300, 16)).astype(np.float16),) * 2 for _ in range(3)]
>>> cache = Cache.from_arrays(kv)
>>> bank = fit_bank([cache], rank=None)
>>> r = KvzReader(compress_bytes(cache, budget=0.05, bank=bank), bank=bank)
>>> k = np.zeros((2, 100, 16), np.float16); v = np.zeros_like(k)        # the caller's buffers
>>> for layer, key, value in r.layers(tokens=(200, 300), out=lambda i: (k, v)):
...     pass                                                            # (a forward pass would run here)
>>> bool(np.array_equal(v, r.read(tokens=(200, 300))["layers.2.value"]))
True
"""
from __future__ import annotations

import contextlib
import mmap
import os
import threading

import numpy as np

from alignpred import entropy
from alignpred.api.describe import slice_metadata, summarize
from alignpred.api.session import DEFAULT_SESSION, DecoderSession
from alignpred.bank.bank import Bank
from alignpred.bank.registry import resolve_bank
from alignpred.cache.arrays import as_numpy
from alignpred.cache.layout import CacheLayout, numpy_dtype
from alignpred.codec.config import CodecConfig
from alignpred.codec.decoder import Decoder
from alignpred.errors import BankMismatchError, ChecksumError, FormatError, KvzError, LayoutError, TruncatedError
from alignpred.format.container import FLAG_REFINE, crc32, parse_container
from alignpred.format.header import check_header, coder_prec, minor_for, tensor_metas
from alignpred.format.index import check_index
from alignpred.format.ranged import RangedSource, sparse_copy
from alignpred.io import map_file, release_pages
from alignpred.threads import blas_single_thread, default_threads, helper_pool, lockstep, stepwise
from alignpred.threads import pool as _pool

#: :meth:`KvzReader.read_into` decodes at most this many tokens (rounded up to whole objects)
#: through every layer at a time, which bounds its working memory.  A 2,048-token read_into of
#: Gemma 3 270M on the 2-core Xeon (medians of 7 interleaved runs), tile 256 / 1024 / 2048:
#: 141.7 / 105.4 / 102.1 ms on one thread, 100.7 / 56.0 / 56.8 on two; traced memory beyond
#: the caller's buffers 1.3 / 5.2 / 10.3 MiB on one thread (it grows with kv_heads x head_dim).
TILE_TOKENS = 1024


def _buffer(source):
    """``(memoryview, name for messages)`` of a path, bytes-like object, mmap or ranged source
    (for which the memoryview holds the header, index and footer only)."""
    if isinstance(source, RangedSource):
        return sparse_copy(source), getattr(source, "name", "<ranges>")
    if isinstance(source, (str, os.PathLike)):
        return map_file(source), os.fspath(source)
    if isinstance(source, mmap.mmap):
        return memoryview(source), "<mmap>"
    if isinstance(source, (bytes, bytearray, memoryview)):
        mv = memoryview(source)
        return (mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv), "<bytes>"
    if isinstance(source, np.ndarray):
        return np.ascontiguousarray(source).view(np.uint8).reshape(-1).data, "<array>"
    raise KvzError(f"cannot read a .kvz from a {type(source).__name__}: give a path, bytes, a memoryview or an mmap")


class KvzReader:
    """Random-access reader of a .kvz file. Everything but the payloads is verified on open;
    payload checksums are verified as objects are decoded.

    ``source``: a path, ``bytes``/``bytearray``/``memoryview``, ``mmap``, or a
    :class:`~alignpred.format.ranged.RangedSource` (only the tail is read on open, each payload
    when it is decoded: random access to a file held elsewhere, e.g. a store entry). ``bank``: a
    :class:`Bank`, a path, a registry id or name, or None (the embedded bank, or the registry's
    bank with the file's id). ``session``: a :class:`DecoderSession` (default: a shared one).
    ``threads``: decode object ranges in parallel on this many threads (default: the cores
    this process may use); ``split``: cut a range into ``threads x split`` parts, which the
    threads take as they come free (default 1: one part per thread), so that a thread slowed by
    other work on its core (an idle-priority helper on an engine's core,
    :func:`alignpred.threads.place_threads`) holds back one small part, not a share. The decoded
    bits depend on neither.
    """

    def __init__(self, source, bank=None, session: DecoderSession | None = None, threads: int | None = None,
                 split: int = 1):
        self._buf, self.path = _buffer(source)
        self._ranged = source if isinstance(source, RangedSource) else None
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
        except (FormatError, LayoutError) as e:
            raise FormatError(f"{self.path}: {e}") from None
        self._bank_arg = bank
        self._decoder: Decoder | None = None
        self.session = session or DEFAULT_SESSION
        self.threads = default_threads() if threads is None else max(1, int(threads))
        self.split = max(1, int(split))
        self.objects_decoded = 0
        self._count_lock = threading.Lock()

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
            self.tensor_cap = float(codec.get("tensor_cap", 0.0))
            self.tiers = ("coarse", "exact") if h.get("flags", 0) & FLAG_REFINE else ("coarse",)
            ent = codec["entropy"]
            self.bank_id = str(h["bank"]["id"])
        except (KeyError, TypeError, ValueError, LayoutError, KvzError) as e:
            raise FormatError(f"malformed header ({type(e).__name__}: {e})") from None
        if codec.get("name") != "alignpred":
            raise FormatError(f"unknown codec {codec.get('name')!r}")
        if (ent.get("coder") not in entropy.CODERS or ent.get("model_set") != entropy.MODEL_SET_ID
                or ent.get("prec") != coder_prec(ent.get("coder"))):
            raise FormatError(f"unsupported entropy coder {ent!r}")
        if self.version[1] < minor_for(self.layout, self.config, self.scope, self.tiers, ent["coder"]):
            raise FormatError(f"the header uses features of a newer minor version than the file's {self.version}")
        lay = self.layout
        S = self.config.object_size
        from alignpred.codec.frame import check_rope_range

        check_rope_range(lay, self.config)
        self.metas = tensor_metas(h, lay)
        n_obj = check_index(self.index, lay, S, len(self.metas), len(self.tiers), self.header['bank'],
                            self._footer.header_offset)
        self.n_objects_per_tensor = n_obj

    # -- bank ------------------------------------------------------------------------------------
    def _resolve_bank(self) -> Bank:
        emb = self.header["bank"].get("embedded")
        if emb:
            a, n = int(emb["offset"]), int(emb["length"])
            raw = self._bytes(a, n)
            if crc32(raw) != int(emb["crc32"]):
                raise ChecksumError(f"{self.path}: embedded bank checksum mismatch")
            try:
                bank = Bank.from_bytes(raw)
            except KvzError as e:
                raise BankMismatchError(f"{self.path}: embedded bank is invalid: {e}") from None
            except (AttributeError, TypeError, ValueError, KeyError, IndexError, OverflowError) as e:
                raise BankMismatchError(f"{self.path}: embedded bank is malformed ({type(e).__name__})") from None
        elif self._bank_arg is None:
            bank = self.session.bank(self.bank_id, self.layout, f"{self.path} ")
        else:
            bank = resolve_bank(self._bank_arg, self.layout, session=self.session.banks)
        if bank.id != self.bank_id:
            raise BankMismatchError(f"{self.path} needs bank {self.bank_id[:19]}… but got {bank.id[:19]}…; "
                                    "use the bank the file was compressed with")
        return bank

    @property
    def source_metadata(self) -> dict:
        """The metadata of the cache the file was written from (strings, as in a safetensors
        header: ``keys_roped``, ``rope``, ``layer_types``, ``position_offset``, the model's own
        fields; token ids are not kept), a copy."""
        return dict(self.header.get("source_metadata", {}))

    @property
    def decoder(self) -> Decoder:
        if self._decoder is None:
            bank = self._resolve_bank()
            try:
                dec = self.session.decoder(self.layout, bank, self.config, self.header["codec"]["entropy"]["coder"])
            except BankMismatchError as e:
                raise BankMismatchError(f"{self.path}: {e}") from None
            try:
                dec.check(self.metas)
            except FormatError as e:
                raise FormatError(f"{self.path}: {e}") from None
            self._decoder = dec
        return self._decoder

    # -- reading ---------------------------------------------------------------------------------
    def _bytes(self, offset: int, length: int):
        """``length`` bytes of the file at ``offset`` (from the ranged source when there is one)."""
        if self._ranged is None:
            return self._buf[offset:offset + length]
        b = memoryview(self._ranged.read_range(offset, length)).cast("B")
        if len(b) != length:
            raise TruncatedError(f"{self.path}: {len(b)} of {length} bytes at offset {offset} (truncated source)")
        return b

    def payload_spans(self, layer: int, tokens: tuple[int, int] | None = None, tier=None) -> list[tuple[int, int]]:
        """``[(offset, length)]``: the bytes a decode of layer ``layer`` over ``tokens`` reads, one
        contiguous span per tensor and tier (a tensor's objects lie together, in index order, kvz.md
        §5), so that a source can fetch a layer with a few ranged reads ahead of its decode.
        ``tier`` as in :meth:`iter_layers` (None: the best the file has, its refinement too)."""
        a, b, _ = self.selection(tokens, [int(layer)])
        j0, j1 = a // self.config.object_size, -(-b // self.config.object_size)
        n_obj = self.n_objects_per_tensor
        tiers = (0, 1) if self._tier(tier) else (0,)
        out = []
        for t in tiers:
            for ti, m in enumerate(self.metas):
                if int(m.name.split(".")[1]) != int(layer):
                    continue
                ents = self.index[(t * len(self.metas) + ti) * n_obj + j0:(t * len(self.metas) + ti) * n_obj + j1]
                lo = ents[0].offset
                out.append((lo, ents[-1].offset + ents[-1].length - lo))
        return out

    def _fetch(self, ti: int, j: int, tier: int = 0):
        n_obj = self.n_objects_per_tensor
        e = self.index[(tier * len(self.metas) + ti) * n_obj + j]
        payload = self._bytes(e.offset, e.length)
        if crc32(payload) != e.crc:
            raise ChecksumError(f"{self.path}: checksum mismatch in {self.metas[ti].name} tokens "
                                f"{e.token_start}..{e.token_start + e.n_tokens}{' (refinement)' if tier else ''}")
        with self._count_lock:
            self.objects_decoded += 1
        return e, payload

    def _refine_fetch(self, ti: int, j: int):
        return self._fetch(ti, j, 1)

    def _tier(self, tier) -> bool:
        """Whether to decode the refinement tier for ``tier`` (None: the best the file has)."""
        if tier is None:
            return "exact" in self.tiers
        if tier not in self.tiers:
            raise KvzError(f"{self.path} has tiers {', '.join(self.tiers)}, not {tier!r}")
        return tier == "exact"

    def verify(self, entries=None, bank: bool | None = None) -> int:
        """Check payload checksums without decoding (all index entries, or the given entry
        indices) and, with ``bank`` (default: when checking all entries), the embedded bank's;
        raises ChecksumError. Returns the bytes checked. Together with the checks on open, this
        covers every byte of the file."""
        n_obj = self.n_objects_per_tensor
        ks = range(len(self.index)) if entries is None else entries
        total = 0
        for k in ks:
            e = self.index[int(k)]
            payload = self._bytes(e.offset, e.length)
            if crc32(payload) != e.crc:
                ti = int(k) // n_obj
                raise ChecksumError(f"{self.path}: checksum mismatch in {self.metas[ti].name} tokens "
                                    f"{e.token_start}..{e.token_start + e.n_tokens}")
            total += len(payload)
        emb = self.header["bank"].get("embedded")
        if emb and (entries is None if bank is None else bank):
            raw = self._bytes(int(emb["offset"]), int(emb["length"]))
            if crc32(raw) != emb["crc32"]:
                raise ChecksumError(f"{self.path}: embedded bank checksum mismatch")
            total += len(raw)
        return total

    def selection(self, tokens=None, layers=None) -> tuple[int, int, list[int]]:
        """``(a, b, layers)``: the token range and the sorted layer indices that ``tokens`` and
        ``layers`` (as :meth:`read` takes them: ``None`` for all, ``(a, b)``, a count or indices)
        select, checked against this file (:class:`~alignpred.errors.KvzError` if out of range).

        >>> import numpy as np
        >>> from alignpred import Cache, KvzReader, compress_bytes, fit_bank
        >>> c = Cache.from_arrays([(np.random.default_rng(0).standard_normal((2, 64, 16)).astype(np.float16),) * 2] * 3)
        >>> KvzReader(compress_bytes(c, budget=0.1, bank=(b := fit_bank([c], rank=None))), bank=b).selection((8, 40), 2)
        (8, 40, [0, 1])"""
        lay = self.layout
        a, b = (0, lay.n_tokens) if tokens is None else (int(tokens[0]), int(tokens[1]))
        if not (0 <= a < b <= lay.n_tokens):
            raise KvzError(f"token range {a}..{b}: need 0 <= a < b <= {lay.n_tokens}")
        if layers is None:
            sel = list(range(lay.num_layers))
        elif isinstance(layers, (int, np.integer)):
            if not (1 <= int(layers) <= lay.num_layers):
                raise KvzError(f"layers must be in 1..{lay.num_layers}")
            sel = list(range(int(layers)))
        else:
            sel = sorted({int(i) for i in layers})
            if not sel or sel[0] < 0 or sel[-1] >= lay.num_layers:
                raise KvzError(f"layer indices must be in 0..{lay.num_layers - 1}")
        return a, b, sel

    def _out_view(self, out, ti: int, name: str, n: int):
        """The caller's buffer for tensor ``ti`` as ``[kv_heads, n, d]`` (checked)."""
        lay = self.layout
        buf = out(name) if callable(out) else out.get(name) if isinstance(out, dict) else None
        if buf is None:
            raise KvzError(f"no output buffer for {name}")
        arr = as_numpy(buf, writable=True)
        if arr.ndim == 4 and arr.shape[0] == 1:
            arr = arr[0]
        want = (lay.kv_heads, n, lay.head_dim)
        if arr.shape != want:
            raise KvzError(f"output buffer for {name} has shape {tuple(arr.shape)}, expected {want} "
                           f"(or {(1,) + want})")
        if not np.issubdtype(arr.dtype, np.floating) and arr.dtype != numpy_dtype("bfloat16"):
            raise KvzError(f"output buffer for {name} has dtype {arr.dtype}; give a floating-point buffer")
        return arr

    def _decode(self, a: int, b: int, sel: list, out=None, tier=None, tiled: bool = False, whole: bool = False):
        """Yield ``(ti, name, array [kv_heads, b-a, d])`` for the tensors of layers ``sel``.

        With ``threads > 1`` the objects of the range are split into contiguous groups decoded
        in parallel (objects at different positions are independent; the kernels release the
        GIL); each group writes its rows of the same output arrays, tensor by tensor in step.
        ``tiled``: each group decodes its objects ``TILE_TOKENS`` at a time through every layer
        before yielding, so the working set (the earlier layers' reconstructions that later
        layers are predicted from) is bounded by the tile, not the range; tensors are then
        yielded only once all are decoded (what :meth:`read_into` wants, not a layer-by-layer
        stream). ``whole``: the caller takes every tensor before using any (:meth:`read`), so the
        groups run to their ends without waiting for each other tensor by tensor. The decoded
        bits do not depend on the split (kvz.md §9)."""
        lay = self.layout
        S = self.config.object_size
        j0, j1 = a // S, -(-b // S)
        n_rows = min(lay.n_tokens, j1 * S) - j0 * S
        cut = slice(a - j0 * S, b - j0 * S)
        direct = out is not None and cut.start == 0 and cut.stop == n_rows  # straight into the caller's buffer
        dec = self.decoder
        rf = self._refine_fetch if self._tier(tier) else None
        k = max(1, min(self.threads * (self.split if self.threads > 1 else 1), j1 - j0))
        edges = [j0 + (j1 - j0) * i // k for i in range(k + 1)]
        groups = [(edges[i], edges[i + 1]) for i in range(k) if edges[i + 1] > edges[i]]
        dests: dict = {}
        lock = threading.Lock()
        shape = (lay.kv_heads, n_rows, lay.head_dim)
        # read(): every tensor in one allocation (numpy asks for huge pages for a large array; each
        # 4 KiB page of separate arrays costs a fault on first touch: a 2,048-token read of Gemma 3
        # 270M on one thread of a 2-core Xeon, interleaved runs, 116-121 -> 103-107 ms)
        keep = set(sel) if whole and out is None else set()
        slots = {ti: i for i, ti in enumerate(ti for ti, (layer, _) in enumerate(lay.tensors()) if layer in keep)}
        block = np.empty((len(slots),) + shape, numpy_dtype(lay.dtype)) if slots else None

        def dest(ti):
            with lock:
                if ti not in dests:
                    dests[ti] = self._out_view(out, ti, self.metas[ti].name, b - a) if direct else \
                        block[slots[ti]] if block is not None else np.empty(shape, numpy_dtype(lay.dtype))
                return dests[ti]

        def target(g0, g1):
            return lambda ti: dest(ti)[:, (g0 - j0) * S:min(lay.n_tokens, g1 * S) - j0 * S]

        tile = max(1, TILE_TOKENS // S) if tiled else 0
        # one object range on several threads: its symbols are decoded ahead on another thread (one
        # 256-token object of Gemma 3 270M on a 2-core Xeon: 22.4 ms on one thread, 18.5-19.2 so on
        # two; the rows' map products split over the threads, split_rows, took 26.1)
        ahead = helper_pool() if len(groups) == 1 and self.threads > 1 else None

        def group(g0, g1):
            if not tile or g1 - g0 <= tile:
                yield from dec.decode_range(self.metas, self._fetch, g0, g1, sel, out=target(g0, g1), refine_fetch=rf,
                                            ahead=ahead)
                return
            done: list = []
            for t0 in range(g0, g1, tile):
                t1 = min(g1, t0 + tile)
                done = [(ti, name, None) for ti, name, _ in
                        dec.decode_range(self.metas, self._fetch, t0, t1, sel, out=target(t0, t1), refine_fetch=rf)]
            yield from done  # the arrays are the shared destinations (dests), complete now

        gens = [group(g0, g1) for g0, g1 in groups]
        blas = blas_single_thread if self.config.arith == "float" else contextlib.nullcontext
        try:
            if len(gens) == 1:
                steps = ([r] for r in gens[0])
            else:
                pool = _pool(self.threads)  # one pool per thread count (placed threads stay placed)
                steps = lockstep(pool, gens, whole or bool(tile))
            for results in stepwise(blas, steps):
                ti, name, _ = results[0]
                arr = dests.pop(ti)
                if not direct:
                    arr = arr[:, cut]
                    if out is not None:
                        dst = self._out_view(out, ti, name, b - a)
                        dst[...] = arr
                        arr = dst
                yield ti, name, arr
        except FormatError as e:
            if self.path in str(e):
                raise
            raise type(e)(f"{self.path}: {e}") from None

    def iter_layers(self, tokens: tuple[int, int] | None = None, layers=None, out=None, tier=None):
        """Yield ``(name, array)`` tensor by tensor (layer by layer, key then value) for a token
        range ``[a, b)`` of ``layers`` (the first N layers for an int, or an iterable of layer
        indices); only the objects covering the range are read. With ``out`` (a dict name ->
        buffer, or a callable name -> buffer; numpy arrays or CPU torch tensors shaped
        ``[kv_heads, b-a, d]``) values are written into the caller's buffers, which are yielded.
        ``tier``: ``"coarse"`` (the lossy tier alone) or ``"exact"`` (refined to the original bits;
        only in files written with ``lossless``); default: the best the file has (:attr:`tiers`)."""
        return self._named(tokens, layers, out, tier, whole=False)

    def _named(self, tokens, layers, out, tier, whole: bool):
        lay = self.layout
        a, b, sel = self.selection(tokens, layers)
        for _, name, arr in self._decode(a, b, sel, out, tier, whole=whole):
            if out is None and lay.batch_dim:
                arr = arr[None]
            yield name, arr

    def layers(self, tokens=None, layers=None, out=None, tier=None):
        """Yield ``(layer, key, value)`` layer by layer, in step with a forward pass. ``out``: a
        callable ``layer -> (key_buffer, value_buffer)`` or a dict of buffers by tensor name."""
        pending: dict = {}
        target = out
        if callable(out):
            bufs: dict = {}

            def by_name(name):
                i, kind = int(name.split(".")[1]), name.split(".")[2]
                if i not in bufs:
                    bufs[i] = out(i)
                return bufs[i][0 if kind == "key" else 1]

            target = by_name
        for name, arr in self.iter_layers(tokens, layers, target, tier):
            i = int(name.split(".")[1])
            pending[name.split(".")[2]] = arr
            if len(pending) == 2:
                yield i, pending["key"], pending["value"]
                pending = {}

    def read(self, tokens=None, layers=None, tier=None) -> dict:
        """Decode into ``{name: array}`` (the source's names, shapes and dtype).  The arrays are
        views into one allocation made for the whole read (faster than one allocation per
        tensor), so that memory is freed when the last of them is.  To keep only some tensors
        for long, copy them, or use :meth:`iter_layers` / :meth:`read_into`."""
        return dict(self._named(tokens, layers, None, tier, whole=True))

    def read_into(self, out, tokens=None, layers=None, tier=None):
        """Decode into the caller's buffers (see :meth:`iter_layers`); returns ``out``. Memory
        beyond the buffers stays bounded however long the range: tokens are decoded a tile
        (``TILE_TOKENS``) at a time through every layer."""
        a, b, sel = self.selection(tokens, layers)
        for _ in self._decode(a, b, sel, out, tier, tiled=True):
            pass
        return out

    def read_paged(self, k_pools, v_pools, block_table, tokens=None, layers=None, tier=None):
        """Decode into paged KV (see :mod:`alignpred.cache.paged`): layer ``i``'s positions go to
        ``k_pools[i]`` / ``v_pools[i]`` at the blocks of ``block_table``, which covers the sequence
        from position 0 (the file's token ``t`` is position ``position_offset + t``)."""
        from alignpred.cache.paged import scatter

        a, b, _ = self.selection(tokens, layers)
        at = self.layout.position_offset + a
        for i, k, v in self.layers((a, b), layers, tier=tier):
            scatter(k[0] if k.ndim == 4 else k, k_pools[i], block_table, at)
            scatter(v[0] if v.ndim == 4 else v, v_pools[i], block_table, at)

    def decompress_to(self, path, tokens=None, layers=None, chunk_objects: int = 8, progress=None,
                      tier=None) -> int:
        """Decode into a safetensors file (atomically) in bounded memory: object range by object
        range through every layer, each slice written at its place in the output, so only
        ``chunk_objects`` × 256 positions of the cache are in memory at a time. Returns the bytes
        written. ``progress(n)`` is called with the number of positions finished."""
        from alignpred.cache.cachefile import safetensors_header
        from alignpred.io import atomic_file

        lay = self.layout
        a, b, sel = self.selection(tokens, layers)
        S = self.config.object_size
        n_tok = b - a
        shape = lay.with_tokens(n_tok).tensor_shape()
        dt = numpy_dtype(lay.dtype)
        names = [n for n in lay.tensor_names() if int(n.split(".")[1]) in set(sel)]
        head = safetensors_header([(n, shape, dt) for n in names], self._slice_metadata(a, sel))
        t_bytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        row_bytes = lay.head_dim * dt.itemsize
        step = max(1, int(chunk_objects)) * S
        slot = {n: k for k, n in enumerate(names)}
        with atomic_file(path) as f:
            f.write(head)
            f.truncate(len(head) + t_bytes * len(names))
            for c0 in range((a // S) * S, b, step):
                lo, hi = max(a, c0), min(b, c0 + step)
                for _, name, arr in self._decode(lo, hi, sel, tier=tier):
                    for h in range(lay.kv_heads):
                        f.seek(len(head) + slot[name] * t_bytes + (h * n_tok + lo - a) * row_bytes)
                        f.write(np.ascontiguousarray(arr[h]).reshape(-1).view(np.uint8).data)  # no copy
                release_pages(self._buf)
                if progress:
                    progress(hi - lo)
        return len(head) + t_bytes * len(names)

    def _slice_metadata(self, start: int, sel: list) -> dict:
        return slice_metadata(self, start, sel)

    # -- summary ---------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Sizes and errors of the file, per tensor and pooled (what ``kvz inspect`` prints)."""
        return summarize(self)
