"""Section 1: in-process encode/decode speed of every codec on every cache, interleaved rounds,
one row per (cache, codec, op, threads), the rows aggregated over the caches, and the break-even link
speed by core count (measured at 1 and 2 threads, projected linearly to 16 and 64 cores). Every timed
op starts on warm cores (``WARM_S`` of GIL-free work on all of them, untimed), and one probe says
what that takes out (:func:`idle_core_probe`)."""
from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from ..harness import Op, median, run_interleaved, thread_counts, timing, warm_cores
from .codecs import KvzCodec, lmcache_status, make_codecs
from .config import CODECS, EPS, IDLE_S, PROJECTED_CORES, WARM_S, log
from .measures import arrays_digest, break_even, projected_break_even


def codec_section(caches: list[tuple[str, Any]], bank, *, codecs=CODECS, threads: list[int] | None = None,
                  rounds: int = 3, enc_rounds: int = 2, eps: float = EPS, identity_threads=(1, 2, 4),
                  progress: bool = True) -> dict:
    """In-process encode/decode speed of every codec on every cache (interleaved, medians). Returns
    ``{"rows", "skipped", "identity"}``: one row per (cache, codec, op, threads)."""
    from kvz.benchmarks.baselines import error_stats

    threads = threads or thread_counts()
    rows: list[dict] = []
    skipped: dict = {}
    identity: dict = {}
    idle_core: dict | None = None
    torch_threads = None
    if "lmcache_k16v8" in codecs and lmcache_status()[0]:
        import torch

        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        for name, cache in caches:
            t0 = time.perf_counter()
            objs, sk = make_codecs(name, cache, bank, codecs, eps)
            skipped.update(sk)
            tensors = {k: np.asarray(v) for k, v in cache.tensors.items()}
            n = int(sum(x.size for x in tensors.values()))
            raw = int(sum(x.nbytes for x in tensors.values()))
            # set-up: one encode and decode each (warm-up, sizes, errors; zstd-19's encode timed here)
            quality, once = {}, {}
            for c in objs:
                c0, w0 = time.process_time(), time.perf_counter()
                c.encode(threads[-1])
                once[c.name] = (time.perf_counter() - w0, time.process_time() - c0)
                rec = c.decode(1)
                pooled, worst, _ = error_stats(tensors, rec)
                quality[c.name] = {"nrmse_pooled": pooled, "nrmse_max_tensor": worst, "bytes": c.nbytes()}
                if isinstance(c, KvzCodec):
                    identity[name if c.name == "kvz" else f"{name} ({c.name})"] = decode_identity(c, rec, identity_threads)
                del rec
            log(f"{name}: set-up {time.perf_counter() - t0:.1f} s; "
                + ", ".join(f"{k} {8 * q['bytes'] / n:.3f} bpv" for k, q in quality.items()))
            ops = []
            for c in objs:
                for op in c.ops:
                    for th in threads:
                        fn = getattr(c, op)
                        ops.append(Op(c.name, op, th, (lambda f=fn, t=th: f(t)),
                                      rounds=enc_rounds if op == "encode" else None))
            run_interleaved(ops, rounds, label=name if progress else "", log=log, warm_s=WARM_S)
            if idle_core is None and max(threads) > 1:
                idle_core = idle_core_probe(name, objs, max(threads))
            for op in ops:
                q = quality[op.codec]
                rows.append(make_row(name, op.codec, op.op, op.threads, n, raw, q, timing(op.walls, op.cpus)))
            for c in objs:  # encodes timed once (zstd-19)
                if "encode" not in c.ops:
                    w, cp = once[c.name]
                    rows.append(make_row(name, c.name, "encode", threads[-1], n, raw, quality[c.name],
                                         timing([w], [cp]), note="timed once (set-up)"))
            for c in objs:
                for r in rows:
                    if r["cache"] == name and r["codec"] == c.name and getattr(c, "extra", None):
                        r["extra"] = dict(c.extra)
            del objs
    finally:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
    return {"rows": rows, "skipped": skipped, "identity": identity, "idle_core": idle_core}


def idle_core_probe(cache: str, objs: list, threads: int, repeats: int = 5) -> dict | None:
    """What the warm-up (``WARM_S``) takes out of the timings: kvz's multi-threaded decode (the
    ``balanced`` profile when present) after ``IDLE_S`` with the cores idle, and after ``WARM_S``
    with them busy (medians of ``repeats``, alternating)."""
    ks = [c for c in objs if isinstance(c, KvzCodec)]
    if not ks:
        return None
    c = next((k for k in ks if k.name == "kvz-balanced"), ks[0])
    idle, warm = [], []
    for _ in range(repeats):
        for prep, ts in ((lambda: time.sleep(IDLE_S), idle), (lambda: warm_cores(WARM_S), warm)):
            prep()
            t0 = time.perf_counter()
            c.decode(threads)
            ts.append(time.perf_counter() - t0)
    return {"cache": cache, "codec": c.name, "threads": threads, "idle_s": IDLE_S, "warm_s": WARM_S,
            "after_idle_s": median(idle), "after_warm_s": median(warm), "idle_runs": idle, "warm_runs": warm}


def decode_identity(c: KvzCodec, first: dict, threads=(1, 2, 4)) -> dict:
    """Digests of kvz decodes with several thread counts and through ``read_into`` (untimed)."""
    d = {"read_t1": arrays_digest(first)}
    for th in threads:
        if th != 1:
            d[f"read_t{th}"] = arrays_digest(c.decode(th))
    d["read_into_t1"] = arrays_digest(c.decode_into(1))
    d["identical"] = len(set(d.values())) == 1
    return d


def make_row(cache: str, codec: str, op: str, threads: int, n: int, raw: int, q: dict, t: dict,
             note: str | None = None) -> dict:
    row = {"cache": cache, "codec": codec, "op": op, "threads": threads, "n_values": n, "raw_bytes": raw,
           "bytes": q["bytes"], "bpv": 8.0 * q["bytes"] / n, "nrmse_pooled": q["nrmse_pooled"],
           "nrmse_max_tensor": q["nrmse_max_tensor"], **t}
    row["vps"] = n / row["wall_s"] if row["wall_s"] > 0 else math.inf
    row["vps_cpu"] = n / row["cpu_s"] if row["cpu_s"] > 0 else math.inf
    if op.startswith("decode"):
        b = break_even(raw, q["bytes"], row["wall_s"])
        row["break_even_Bps"] = b
        b = break_even(raw, q["bytes"], row["cpu_s"] / max(threads, 1)) if threads == 1 else None
        row["break_even_Bps_cpu"] = b
        if threads == 1:  # projected, not measured: the 1-thread wall time / cores
            row.update(projected_break_even(raw, q["bytes"], row["wall_s"]))
    if note:
        row["note"] = note
    return row


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (codec, op, threads) over all caches: values, bytes and median times add up."""
    groups: dict = {}
    for r in rows:
        if r["cache"] == "all":
            continue
        groups.setdefault((r["codec"], r["op"], r["threads"]), []).append(r)
    out = []
    for (codec, op, th), rs in groups.items():
        n = sum(r["n_values"] for r in rs)
        raw = sum(r["raw_bytes"] for r in rs)
        nb = sum(r["bytes"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        cpu = sum(r["cpu_s"] for r in rs)
        row = {"cache": "all", "codec": codec, "op": op, "threads": th, "n_values": n, "raw_bytes": raw,
               "bytes": nb, "bpv": 8.0 * nb / n, "n_caches": len(rs),
               "nrmse_pooled": max(r["nrmse_pooled"] for r in rs),
               "nrmse_max_tensor": max(r["nrmse_max_tensor"] for r in rs),
               "wall_s": wall, "cpu_s": cpu, "repeats": min(r["repeats"] for r in rs),
               "vps": n / wall if wall > 0 else math.inf, "vps_cpu": n / cpu if cpu > 0 else math.inf}
        if op.startswith("decode"):
            row["break_even_Bps"] = break_even(raw, nb, wall)
            row["break_even_Bps_cpu"] = break_even(raw, nb, cpu) if th == 1 else None
            if th == 1:
                row.update(projected_break_even(raw, nb, wall))
        out.append(row)
    return out


def by_cores(agg: list[dict], measured=(1, 2), cores=PROJECTED_CORES) -> list[dict]:
    """The break-even link speed of every decoder by core count, from the aggregate rows: measured
    (wall) at the ``measured`` thread counts (None where not run), and projected to ``cores`` by
    linear scaling of the 1-thread decode time (``projected`` in the keys: assumed, not measured)."""
    out = []
    for r1 in agg:
        if r1["cache"] != "all" or not r1["op"].startswith("decode") or r1["threads"] != 1:
            continue
        row = {"codec": r1["codec"], "op": r1["op"], "bpv": r1["bpv"], "raw_bytes": r1["raw_bytes"],
               "bytes": r1["bytes"], "n_values": r1["n_values"]}
        for th in measured:
            rt = next((r for r in agg if r["cache"] == "all" and r["codec"] == r1["codec"] and r["op"] == r1["op"]
                       and r["threads"] == th), None)
            row[f"decode_s_t{th}"] = rt["wall_s"] if rt else None
            row[f"break_even_Bps_t{th}"] = rt["break_even_Bps"] if rt else None
        row.update(projected_break_even(r1["raw_bytes"], r1["bytes"], r1["wall_s"], cores))
        out.append(row)
    return out
