"""The entropy stage's decode speed in ns/symbol, measured in the speed run on the real residual symbols
of a held-out cache, next to published figures of other single-thread static-model decoders.

The symbols and the timing come from this module (:func:`real_objects`: the cache
compressed at eps 0.0267 with the bundled bank, every object's payload decoded back to its symbols
through the public reader and entropy API; :func:`time_decoders`: the decoders interleaved call by call,
per object the minimum and the median over rounds, summed). Timed here: ``rans4`` (the coder kvz
writes by default, the one in the benchmark's files) and ``lanes32`` (vectorised and portable), and
``lanes32`` as the decoder calls it, one call per tensor (:func:`tensor_timing`)."""
from __future__ import annotations

import time

from ..harness import BANK_NAME, stem
from .config import EPS, PUBLISHED_ENTROPY, log
from .measures import ns_per_symbol


def real_objects(caches, log=print):
    """``[(q, model_ids)]``: the symbol arrays of every coded object of ``caches``."""
    import numpy as np

    from alignpred import KvzReader, compress_bytes, entropy, load_cache

    objs = []
    for path in caches:
        t = time.perf_counter()
        data = compress_bytes(load_cache(path), bank=BANK_NAME, budget=EPS)
        r = KvzReader(data)
        coder = r.header["codec"]["entropy"]["coder"]
        n_obj = r.n_objects_per_tensor
        for ti, meta in enumerate(r.metas):
            for j in range(n_obj):
                e = r.index[ti * n_obj + j]
                if e.length == 0:
                    continue
                ids = np.asarray(meta.models)
                q = entropy.decode(data[e.offset:e.offset + e.length], ids, (ids.size, e.n_tokens), coder)
                objs.append((q, ids))
        log(f"{stem(path)}: {len(data):,} bytes, {len(objs)} objects so far ({time.perf_counter() - t:.1f} s)")
    return objs


def time_decoders(objs, decoders: dict, rounds: int, *, warm_each: bool = False) -> dict:
    """ns/symbol of each decoder: the sum over objects of the per-object minimum (and median) over
    ``rounds`` calls, the decoders interleaved call by call; ``warm_each``: every timed call right after
    an untimed one of the same decoder (its tables warm), else one untimed call per object first."""
    n = sum(q.size for q, _ in objs)
    acc = {k: [0.0, 0.0] for k in decoders}
    for q, ids in objs:
        out = q.copy()
        ts = {k: [] for k in decoders}
        for fn in decoders.values():
            fn(q, ids, out)   # warm (compiles on the first object)
        for _ in range(rounds):
            for name, fn in decoders.items():
                if warm_each:
                    fn(q, ids, out)
                t = time.perf_counter()
                fn(q, ids, out)
                ts[name].append(time.perf_counter() - t)
        for name, v in ts.items():
            v.sort()
            acc[name][0] += v[0]
            acc[name][1] += v[len(v) // 2]
    return {k: {"ns_per_symbol_min": 1e9 * v[0] / n, "ns_per_symbol_median": 1e9 * v[1] / n} for k, v in acc.items()}


def lanes_decoders(objs, with_precisions: bool = False):
    """The lanes32 decoders of this process (payloads encoded once) and whether they decode ``objs``."""
    import numpy as np

    from alignpred import entropy

    bufs = {id(q): entropy.encode(q, ids, coder="lanes32") for q, ids in objs}

    def dec(path):
        return lambda q, ids, out: entropy.lanes_decode(bufs[id(q)], ids, q.shape, out=out, path=path)

    decs = {"lanes32 vectorised": dec("simd"), "lanes32 portable": dec("portable")}
    if with_precisions:   # the same decoder on 10- and 11-bit tables (4 and 8 KiB per model)
        for p in (10, 11):
            pb = {id(q): entropy.lanes_encode(q, ids, prec=p) for q, ids in objs}
            decs[f"lanes32 vectorised, {p}-bit tables"] = (
                lambda q, ids, out, pb=pb, p=p: entropy.lanes_decode(pb[id(q)], ids, q.shape, out=out, prec=p))
    ok = all(np.array_equal(entropy.lanes_decode(bufs[id(q)], ids, q.shape, path=p), q)
             for q, ids in objs for p in ("simd", "portable"))
    return decs, ok


def published_entropy(table=PUBLISHED_ENTROPY) -> list[dict]:
    """The published figures (8-bit symbols) as ns/symbol; ``measured_here`` is False for all."""
    return [{"decoder": d, "source": src, "gib_per_s": g, "ns_per_symbol": ns_per_symbol(g), "measured_here": False}
            for d, src, g in table]


def spaced(objs: list, k: int) -> list:
    """``k`` of ``objs`` evenly spaced (first and last included); all of them for ``k <= 0`` or ``k >= len``."""
    if k <= 0 or k >= len(objs):
        return list(objs)
    if k == 1:
        return [objs[len(objs) // 2]]
    return [objs[round(i * (len(objs) - 1) / (k - 1))] for i in range(k)]


def entropy_timing(objs: list, rounds: int) -> dict:
    """ns/symbol of the rans4 and lanes32 decoders on ``objs`` (``[(q, model_ids)]``), with whether
    every decoder gives back the symbols."""
    import numpy as np

    from alignpred import entropy

    r4 = {id(q): entropy.encode(q, ids) for q, ids in objs}

    def rans4(q, ids, out):
        entropy.decode(r4[id(q)], ids, q.shape, out=out)

    decs, lanes_ok = lanes_decoders(objs)
    ok = lanes_ok and all(np.array_equal(entropy.decode(r4[id(q)], ids, q.shape), q) for q, ids in objs)
    n = int(sum(q.size for q, _ in objs))
    return {"symbols": n, "timed_objects": len(objs), "rounds": rounds, "isa": entropy.lanes_isa(),
            "rans4_bits_per_symbol": 8 * sum(len(b) for b in r4.values()) / n, "same_symbols": bool(ok),
            "timing": time_decoders(objs, {"rans4": rans4, **decs}, rounds)}


def tensors_of(objs: list) -> list:
    """``objs`` (``[(q, model_ids)]`` in file order) grouped by tensor: consecutive objects sharing one
    model-id array (:func:`real_objects` passes each tensor's own)."""
    out: list = []
    for q, ids in objs:
        if out and out[-1][1] is ids:
            out[-1][0].append(q)
        else:
            out.append(([q], ids))
    return out


def tensor_timing(objs: list, rounds: int, n_tensors: int = 4) -> dict:
    """The lanes32 entropy stage as the decoder runs it: one :func:`alignpred.entropy.decode_objects`
    call per tensor (its objects in lock-step groups), next to one ``lanes_decode`` per object of the
    same tensors, interleaved round by round; ns/symbol of the summed per-tensor minimum and median."""
    import numpy as np

    from alignpred import entropy

    ts = spaced(tensors_of(objs), n_tensors)
    acc = {"per object": [0.0, 0.0], "per tensor": [0.0, 0.0]}
    n, ok = 0, True
    for qs, ids in ts:
        bufs = [entropy.encode(q, ids, coder="lanes32") for q in qs]
        widths = [q.shape[1] for q in qs]
        want = np.concatenate(qs, axis=1)
        out = np.empty_like(want)
        n += want.size

        def per_tensor():
            entropy.decode_objects(bufs, ids, want.shape[0], widths, "lanes32", out)

        def per_object():
            c0 = 0
            for b, w in zip(bufs, widths):
                entropy.lanes_decode(b, ids, (want.shape[0], w), out=out[:, c0:c0 + w])
                c0 += w

        per_tensor()
        ok = ok and bool(np.array_equal(out, want))
        per_object()
        ok = ok and bool(np.array_equal(out, want))
        runs: dict = {k: [] for k in acc}
        for _ in range(rounds):
            for k, fn in (("per object", per_object), ("per tensor", per_tensor)):
                t = time.perf_counter()
                fn()
                runs[k].append(time.perf_counter() - t)
        for k, v in runs.items():
            v.sort()
            acc[k][0] += v[0]
            acc[k][1] += v[len(v) // 2]
    return {"tensors": len(ts), "symbols": n, "same_symbols": ok,
            "timing": {k: {"ns_per_symbol_min": 1e9 * v[0] / n, "ns_per_symbol_median": 1e9 * v[1] / n}
                       for k, v in acc.items()}}


def entropy_section(cache_path: str, *, objects: int = 0, rounds: int = 5) -> dict:
    """The entropy stage on one held-out cache: ``objects`` of its coded objects (evenly spaced; 0 = all)
    timed ``rounds`` calls each, and the published figures."""

    t0 = time.perf_counter()
    objs = real_objects([cache_path], log=log)
    res = entropy_timing(spaced(objs, objects), rounds)
    res["lanes32_per_tensor"] = tensor_timing(objs, rounds, max(1, (objects or len(objs)) // 8))
    res.update({"cache": stem(cache_path), "objects": len(objs), "published": published_entropy(),
                "section_s": time.perf_counter() - t0})
    log(f"entropy stage: rans4 {res['timing']['rans4']['ns_per_symbol_min']:.2f} ns/symbol "
        f"({res['symbols']:,} symbols, {res['section_s']:.1f} s)")
    return res
