"""Entropy stage of format 1.2: does a compiled AVX2 decoder of ``lanes32`` reach 1 ns/symbol?

``benchmarks/native/lanes32_avx2.c`` is an independent C decoder of format_spec/kvz.md §7.3 (AVX2:
32 lanes as 4 x 8 x i32 with ``vpgatherdd``; AVX-512: 2 x 16 x i32; and a scalar C decoder). It
is not part of the package build: this benchmark compiles it with the system ``gcc`` (``-O3
-march=native -shared -fPIC``, and once more with ``-mno-avx512f`` for an AVX2-only build like a
Zen 3 core's) into a temporary folder and calls it through ctypes. Its tables are built from the
normative model data by the rule of §7.3 (the SHA-256 the spec gives is checked), not taken from
the library.

The symbols are the real residual symbols the codec writes (the objects of the sample caches, as
``benchmarks.studies.speed.entropy_decode.lanes`` extracts them through the public API). Every object is encoded
by the library (``lanes32``; also at 10- and 11-bit tables, measurement only) and every C decoder
must give exactly the library's symbols for every object. Then, in one process, one thread, the C
decoders and the library's numba decoders (vectorised and portable) are timed interleaved, each
timed call right after an untimed call of the same decoder (its tables warm, see
:func:`time_warm`); the time per object is the minimum over rounds (the machine is shared) with
the median recorded too, and the load average before and after.

    python -m benchmarks.studies.speed.entropy_decode --study native          # -> benchmarks/results/entropy_native.{json,md}
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile

from kvz.benchmarks.harness import (
    code_revision,
    loadavg,
    machine_info,
)
from kvz.benchmarks.harness.native import CFLAGS, NATIVE, NativeUnavailable
from kvz.benchmarks.harness.native import build as build_native
from kvz.benchmarks.speed.entropy_stage import time_decoders

SOURCE = os.path.join(NATIVE, "lanes32_avx2.c")
BUILDS = {"native": (), "avx2-only": ("-mno-avx512f",)}
ABLATIONS = {"no table gather": ("-DLANES32_ABLATE_TABLE",), "no word gather": ("-DLANES32_ABLATE_WORDS",),
             "no gathers": ("-DLANES32_ABLATE_TABLE", "-DLANES32_ABLATE_WORDS")}
G12_SHA256 = "6bcfd40c0169ec5e089c99bc1682ae82040a7d6aaec4ce8fca072a38702c7771"   # §7.3
PRECS = (12, 11, 10)
# the ERR_* codes of the C decoder: those of the library's lanes32 decoders, plus two of its own
ERRORS = {1: "payload shorter than its lane table (or of odd length)", 2: "lane word counts do not tile the payload",
          3: "initial lane state below 2**16", 4: "a lane's final state differs from 2**16",
          5: "a lane did not consume exactly its own words"}
ERR_MODEL, ERR_NO_ISA = 6, 7
_TABLES: dict = {}
PAIR_NOTE = "(64 lanes; words pre-padded)"
ENTRY = {"scalar": "lanes32_decode_scalar", "avx2": "lanes32_decode_avx2", "avx512": "lanes32_decode_avx512"}


def build(folder: str, extra=(), source: str = SOURCE) -> str:
    """Compile the C decoder (``extra``: more gcc flags) into ``folder``; the shared library's path."""
    return build_native(folder, extra, source=source)


def spec_tables(prec: int = 12):
    """The decode table of §7.3 (``g << 20 | (s - k) << 8 | t``, uint32 [M * 2**prec]) from the
    normative ``kvz-models-v1`` frequencies; at 12 bits the SHA-256 of ``g`` is checked."""
    from importlib import resources

    import numpy as np

    with resources.files("alignpred.entropy").joinpath("data", "models_v1.npz").open("rb") as f:
        freq = np.load(f)["freq"].astype(np.int64)
    total = 1 << prec
    g = np.maximum(1, (freq * total + (1 << 14)) >> 15)
    for row in g:
        while (s := int(row.sum())) != total:
            row[int(np.argmax(row))] += 1 if s < total else -1
    if prec == 12 and hashlib.sha256(g.astype("<u2").tobytes()).hexdigest() != G12_SHA256:
        raise RuntimeError("12-bit lanes32 tables differ from format_spec/kvz.md §7.3")
    cum = np.zeros_like(g)
    cum[:, 1:] = np.cumsum(g, axis=1)[:, :-1]
    M, T = g.shape
    tab = np.empty((M, total), np.uint32)
    for m in range(M):
        toks = np.repeat(np.arange(T), g[m])
        tab[m] = (g[m][toks] << 20) | ((np.arange(total) - cum[m][toks]) << 8) | toks
    return np.ascontiguousarray(tab.reshape(-1))


def padded(buf):
    """The payload as uint16 words plus two zero pad words, and its word count ``W``."""
    import numpy as np

    raw = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    from alignpred.errors import FormatError

    if raw.size % 2:
        raise FormatError(f"lanes32 payload invalid: {ERRORS[1]}")
    w = np.zeros(raw.size // 2 + 2, np.uint16)
    w[:raw.size // 2] = raw[:raw.size // 2 * 2].view("<u2")
    return w, raw.size // 2


def _raise_for(err: int) -> None:
    """The library's error for a native decoder's return code (0: none)."""
    from alignpred.errors import FormatError

    if err in ERRORS:
        raise FormatError(f"lanes32 payload invalid: {ERRORS[err]}")
    if err == ERR_MODEL:
        raise ValueError("model id outside the model set")
    if err:
        raise RuntimeError(f"native lanes32 decoder: error {err}")


class Native:
    """The compiled decoders of one shared library."""

    def __init__(self, so: str):
        self.lib = ctypes.CDLL(so)
        self.lib.lanes32_isa.restype = ctypes.c_int
        isa = self.lib.lanes32_isa()
        self.paths = ["scalar"] + (["avx2"] if isa & 1 else []) + (["avx512"] if isa & 2 else [])
        P, I64 = ctypes.c_void_p, ctypes.c_int64
        self.fns = {}
        for p in self.paths:
            fn = getattr(self.lib, ENTRY[p])
            fn.restype = ctypes.c_int
            fn.argtypes = [P, I64, I64, P, I64, I64, P, I64, ctypes.c_int32, P]
            self.fns[p] = fn
        for p in self.paths[1:]:
            fn = getattr(self.lib, f"lanes32_decode2_{p}")
            fn.restype = ctypes.c_int
            fn.argtypes = [P, I64, P, I64, I64, P, I64, I64, P, I64, ctypes.c_int32, P, P]
            self.fns[f"{p} pair"] = fn
        self.tabs = _TABLES   # one copy shared by every build (tables are 16 KiB per model at 12 bits)
        self.lib.lanes32_probe_gather.restype = ctypes.c_double
        self.lib.lanes32_probe_gather.argtypes = [ctypes.c_int, ctypes.c_int64]

    def gather_ns(self, repeats: int = 30, n: int = 100_000) -> dict:
        """ns per ``vpgatherdd`` (8 x 32-bit ymm, 16 x 32-bit zmm) from an L1 table, the minimum
        over ``repeats`` probes, and the floor each vector decoder's two gathers per symbol group set."""
        out = {}
        for which, name, width in ((0, "ymm", 8), (1, "zmm", 16)):
            t = min(self.lib.lanes32_probe_gather(which, n) for _ in range(repeats))
            if t > 0:
                out[name] = {"ns_per_gather": 1e9 * t, "floor_ns_per_symbol": 2e9 * t / width}
        return out

    def table(self, prec: int):
        if prec not in self.tabs:
            self.tabs[prec] = spec_tables(prec)
        return self.tabs[prec]

    def decode_words(self, w, W: int, ids, shape, out, path: str = "avx2", prec: int = 12):
        """Decode padded words ``w`` (``W`` real words) into ``out`` (C-contiguous int32 ``shape``);
        :class:`~alignpred.errors.FormatError` on an invalid payload, as the library's decoder."""
        C, N = shape
        if not 7 <= prec <= 12:
            raise ValueError("the lanes32 decoder needs 7 <= prec <= 12")
        if w.dtype.itemsize != 2 or w.size < W + 2 or not w.flags.c_contiguous:
            raise ValueError("words must be contiguous uint16 with two pad words")
        if out.shape != (C, N) or out.dtype.itemsize != 4 or not out.flags.c_contiguous:
            raise ValueError(f"out must be C-contiguous int32 {(C, N)}")
        if ids.dtype.itemsize != 8 or ids.size != C or not ids.flags.c_contiguous:
            raise ValueError("ids must be contiguous int64 [C]")
        tab = self.table(prec)
        n = C * N
        hw = 2 * 32 + 32 * (2 if (n + 31) // 32 > 21845 else 1)
        err = self.fns[path](w.ctypes.data, W, hw, ids.ctypes.data, C, N, tab.ctypes.data, tab.size >> prec, prec,
                             out.ctypes.data)
        _raise_for(err)
        return out

    def decode_pair_words(self, wa, Wa: int, wb, Wb: int, ids, shape, oa, ob, path: str = "avx2", prec: int = 12):
        """Two objects of one shape (``N % 32 == 0``) and model list decoded together (64 lanes in
        flight); words, ids and outputs as :meth:`decode_words`.  The first object's error, else the
        second's, is raised."""
        C, N = shape
        if N % 32 or not 7 <= prec <= 12:
            raise ValueError("pairs need N % 32 == 0 and 7 <= prec <= 12")
        for w, W in ((wa, Wa), (wb, Wb)):
            if w.dtype.itemsize != 2 or w.size < W + 2 or not w.flags.c_contiguous:
                raise ValueError("words must be contiguous uint16 with two pad words")
        for o in (oa, ob):
            if o.shape != (C, N) or o.dtype.itemsize != 4 or not o.flags.c_contiguous:
                raise ValueError(f"out must be C-contiguous int32 {(C, N)}")
        if ids.dtype.itemsize != 8 or ids.size != C or not ids.flags.c_contiguous:
            raise ValueError("ids must be contiguous int64 [C]")
        tab = self.table(prec)
        hw = 2 * 32 + 32 * (2 if (C * N + 31) // 32 > 21845 else 1)
        err = self.fns[f"{path} pair"](wa.ctypes.data, Wa, wb.ctypes.data, Wb, hw, ids.ctypes.data, C, N,
                                       tab.ctypes.data, tab.size >> prec, prec, oa.ctypes.data, ob.ctypes.data)
        _raise_for(err)
        return oa, ob

    def decode(self, buf, ids, shape, out=None, path: str = "avx2", prec: int = 12):
        """Decode payload bytes like ``alignpred.entropy.lanes_decode`` (the words padded per call)."""
        import numpy as np

        w, W = padded(buf)
        if out is None:
            out = np.empty(shape, np.int32)
        return self.decode_words(w, W, np.ascontiguousarray(ids, np.int64), shape, out, path, prec)


def time_warm(objs, decoders: dict, rounds: int) -> dict:
    """ns/symbol of each decoder like :func:`kvz.benchmarks.speed.entropy_stage.time_decoders` (decoders interleaved, per-object
    minimum and median over rounds, summed), but every timed call directly follows an untimed call
    of the same decoder on the same object: each decoder has its own tables and words warm in the
    caches, as when it decodes the objects of one tensor in a row (call-by-call interleaving alone
    makes every decoder fetch its tables again, which at 12 bits -- 16 KiB per model, 3.75 MiB for
    the set -- measured the caches, not the decoders)."""
    return time_decoders(objs, decoders, rounds, warm_each=True)


def compare(objs, natives: dict) -> dict:
    """Encode every object with the library at each precision; whether every C decoder gives the
    library's symbols (and the library its input) on every object.  ``(payloads, same)``."""
    import numpy as np

    from alignpred import entropy

    bufs, same = {}, {}
    for p in PRECS:
        for k, (q, ids) in enumerate(objs):
            b = entropy.lanes_encode(q, ids, prec=p)
            bufs[p, k] = b
            ref = entropy.lanes_decode(b, ids, q.shape, prec=p)
            ok = np.array_equal(ref, q)
            for bname, nat in natives.items():
                for path in nat.paths:
                    got = nat.decode(b, ids, q.shape, path=path, prec=p)
                    key = f"{p}-bit {bname} {path}"
                    same[key] = same.get(key, True) and ok and np.array_equal(got, ref)
                    if path != "scalar" and q.shape[1] % 32 == 0:
                        w, W = padded(b)
                        pair = nat.decode_pair_words(w, W, w.copy(), W, np.ascontiguousarray(ids, np.int64), q.shape,
                                                     np.empty_like(q), np.empty_like(q), path, p)
                        key = f"{p}-bit {bname} {path} pair"
                        same[key] = same.get(key, True) and all(np.array_equal(o, ref) for o in pair)
    return bufs, same


def markdown(res: dict) -> str:
    lines = ["# Entropy stage of format 1.2: a compiled AVX2 `lanes32` decoder against numba", "",
             f"`{res['command']}` — {res['machine']['cpu']} ({res['isa_flags']}), gcc `{res['gcc']}`, load "
             f"{res['loadavg_before']} before / {res['loadavg_after']} after; {res['symbols']:,} real residual symbols "
             f"({res['objects']} objects of the sample caches, eps 0.0267; {res['timed_objects']} of them timed, "
             f"{res['rounds']} calls each, one thread).", "",
             "## Decode, one thread (ns/symbol; min over rounds, median in brackets)", "",
             "Each timed call follows an untimed call of the same decoder on the same object (its tables "
             "warm, as when decoding a tensor's objects in a row); the decoders are interleaved.", "",
             "| decoder | " + " | ".join(f"{p}-bit tables" for p in PRECS) + " |",
             "|---|" + "---|" * len(PRECS)]
    for name in res["decoders"]:
        cells = []
        for p in PRECS:
            v = res["timing"][str(p)].get(name)
            cells.append(f"{v['ns_per_symbol_min']:.2f} ({v['ns_per_symbol_median']:.2f})" if v else "—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    best = min(v["ns_per_symbol_min"] for k, v in res["timing"]["12"].items() if k.startswith("C ") and "ablation" not in k)
    lines += ["", f"Fastest C decoder at the format's 12-bit tables: {best:.2f} ns/symbol "
              f"({'meets' if best <= 1.0 else 'misses'} the 1 ns/symbol target).", "",
              "Every step of 8 (16) lanes needs two gathers: one from the decode table, whose latency is on each "
              "lane's state chain (slot, gather, multiply-add, renormalisation, next slot), and one for the lanes' "
              "next words (per-lane streams), which depends only on the positions. Gather throughput measured here "
              "(8 independent gathers from a 16 KiB table in L1, minimum over probes before and after the "
              "timing): " +
              "; ".join(f"{k} `vpgatherdd` {v['ns_per_gather']:.2f} ns, i.e. a floor of {v['floor_ns_per_symbol']:.2f} "
                        f"ns/symbol from the two gathers' throughput alone" for k, v in res["gather_probe"].items()) +
              ".", "",
              "Ablations (12-bit, timing only, wrong symbols): the AVX2 kernel with its table gather, its word "
              "gather or both replaced by register arithmetic of the same shape; the difference to `C avx2, words "
              "pre-padded` is what each gather costs in the kernel.", "",
              "C rows pad the payload words per call, as the library's decoders do, except the rows marked "
              "`words pre-padded` (the kernel and the ctypes call alone). `two objects together`: the decoder "
              "advances two objects of one shape and model list (here each timed object's payload twice, "
              "from two copies) in one loop, 64 lanes in flight; time per symbol of both.", "",
              "Published single-thread figures (for scale, other machines): " +
              "; ".join(f"{k} {v} ns" for k, v in res["published_ns_per_symbol"].items()) + ".", "",
              f"Every C decoder decodes the library's symbols on every object at every precision: {res['same_symbols']}.",
              ""]
    return "\n".join(lines)


def run(args) -> dict:
    """The C-decoder study (``args``: caches, quick, rounds (default 200), objects (default 24)); exits
    when no gcc builds the decoder."""
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(k, "1")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            natives = {b: Native(build(tmp, extra)) for b, extra in BUILDS.items()}
            ablated = {b: Native(build(tmp, extra)) for b, extra in ABLATIONS.items()}
        except NativeUnavailable as e:
            sys.exit(f"entropy_decode --study native: {e}")
        gcc = subprocess.run(["gcc", "-dumpfullversion"], capture_output=True, text=True).stdout.strip()
        return _run(args, natives, gcc, ablated)


def _run(args, natives, gcc, ablated) -> dict:
    import numpy as np

    from alignpred import entropy
    from kvz.benchmarks.harness import sample_caches
    from kvz.benchmarks.speed.entropy_stage import real_objects

    from .lanes import PUBLISHED

    load0 = loadavg()
    caches = args.caches or sample_caches()
    objs = real_objects(caches[:1] if args.quick else caches)
    rounds = 20 if args.quick else (args.rounds or 200)
    n_timed = 24 if args.objects is None else args.objects
    bufs, same = compare(objs, natives)
    print("same symbols:", same)
    idx = list(range(len(objs)))
    if 0 < n_timed < len(objs):
        idx = [round(k * (len(objs) - 1) / max(1, n_timed - 1)) for k in range(n_timed)]
    timed = [objs[k] for k in idx]
    slot = {id(objs[k][0]): k for k in idx}
    nat = natives["native"]
    words = {(p, k): padded(bufs[p, k]) for p in PRECS for k in idx}
    gathers = [nat.gather_ns()]
    names = []
    timing = {}
    for p in PRECS:
        def lib(path, p=p):
            return lambda q, ids, out: entropy.lanes_decode(bufs[p, slot[id(q)]], ids, q.shape, out=out, path=path,
                                                            prec=p)

        def c(n, path, p=p):
            return lambda q, ids, out: n.decode(bufs[p, slot[id(q)]], ids, q.shape, out=out, path=path, prec=p)

        ids64 = {id(q): np.ascontiguousarray(ids, np.int64) for q, ids in timed}
        decs = {}
        for path in nat.paths[::-1]:
            decs[f"C {path}"] = c(nat, path)
        decs["C avx2, words pre-padded"] = (
            lambda q, ids, out, p=p: nat.decode_words(*words[p, slot[id(q)]], ids64[id(q)], q.shape, out, "avx2", p))
        decs["C avx2, AVX2-only build (-mno-avx512f)"] = c(natives["avx2-only"], "avx2")
        if all(q.shape[1] % 32 == 0 for q, _ in timed):
            second = {k: w.copy() for k, (w, _) in words.items()}
            for path in nat.paths[:0:-1]:
                decs[f"C {path}, two objects together {PAIR_NOTE}"] = (
                    lambda q, ids, out, p=p, path=path: nat.decode_pair_words(
                        *words[p, slot[id(q)]], second[p, slot[id(q)]], words[p, slot[id(q)]][1], ids64[id(q)],
                        q.shape, out, np.empty_like(out), path, p))
        if p == 12:
            for aname, an in ablated.items():   # timing only: these decode wrong symbols (errors ignored)
                decs[f"C avx2 ablation: {aname} (words pre-padded; wrong symbols)"] = (
                    lambda q, ids, out, an=an: an.fns["avx2"](words[12, slot[id(q)]][0].ctypes.data,
                                                              words[12, slot[id(q)]][1], 96 if q.size <= 32 * 21845
                                                              else 128, ids64[id(q)].ctypes.data, q.shape[0],
                                                              q.shape[1], an.table(12).ctypes.data, 240, 12,
                                                              out.ctypes.data))
        decs["numba vectorised"] = lib("simd")
        if p == 12:
            decs["numba portable"] = lib("portable")
        timing[str(p)] = time_warm(timed, decs, rounds)
        for k, v in timing[str(p)].items():
            if PAIR_NOTE in k:   # two objects' symbols per call
                timing[str(p)][k] = {m: t / 2 for m, t in v.items()}
        names += [k for k in decs if k not in names]
        print(p, timing[str(p)])
    gathers.append(nat.gather_ns())
    gather = {k: min((g[k] for g in gathers if k in g), key=lambda v: v["ns_per_gather"]) for k in gathers[0]}
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f in ("avx2", "avx512f", "avx512vl")}) \
        if os.path.exists("/proc/cpuinfo") else []
    res = {"command": args.command, "revision": code_revision(), "machine": machine_info(),
           "isa_flags": " ".join(flags), "gcc": gcc, "cflags": list(CFLAGS), "builds": {k: list(v) for k, v in BUILDS.items()},
           "numba_isa": entropy.lanes_isa(), "loadavg_before": load0, "loadavg_after": loadavg(),
           "objects": len(objs), "timed_objects": len(timed), "rounds": rounds,
           "symbols": int(sum(q.size for q, _ in objs)), "timed_symbols": int(sum(q.size for q, _ in timed)),
           "decoders": names, "timing": timing, "gather_probe": gather, "same_symbols_by_decoder": same,
           "same_symbols": bool(all(same.values())), "published_ns_per_symbol": PUBLISHED}
    if not res["same_symbols"]:
        print("entropy_decode --study native: a C decoder disagrees with the library", file=sys.stderr)
    return res
