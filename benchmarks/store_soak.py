"""Soak test of the chunk store on a Redis Cluster: N writer and M reader processes for a fixed time
over a real 3-master cluster (1 replica each), one master SIGKILLed at half time and restarted once
its replica has taken over, reporting puts/s, gets/s, hit rate, misses by cause, wrong reads and
partial reads (must both be 0), failover time, and the orphaned parts and leaked bytes after gc.

Every blob names its key, writer and sequence number and carries the sha256 of its payload; a reader
regenerates the blob those name and compares it byte for byte, so a read is either a miss, exactly a
blob some writer put for that key, or counted as wrong (another key's, or bytes no writer wrote) or
partial (the right head, fewer or other bytes). Three reads in four are whole reads (``get``), one
in four a ranged read (``open_blob`` + ``read_range`` in 16 KiB pieces, as the vLLM connector
loads): a ranged read that fails midway raises StoreReadError (the connector recomputes: counted
``ranged_aborted``); one whose bytes changed under it (the entry replaced or evicted meanwhile) is
caught by the checksum the caller keeps (a .kvz's CRC-32s; here the sha256): ``ranged_caught``.

Misses are classified by what the reader's backend saw during that call: ``unavailable`` (the
shard's node could not be reached, or was resting after a failure), ``lost`` (the entry's
bookkeeping was there but the entry was not: lost with the killed master before replication, or
evicted by the server), ``absent`` (never written yet, or evicted by the store's byte budget).

After the run: ``gc`` (what ``kvz store gc`` runs) and a second ``gc`` that must find nothing, and a
check that every entry key has its bookkeeping and the byte totals equal the entries' sizes.

    python -m kvz.benchmarks.store_soak --writers 4 --readers 4 --seconds 300 \\
        --json benchmarks/results/store_soak.json --md benchmarks/results/store_soak.md
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import sys
import time
import traceback
import warnings

PIECE = 16 << 10


# ---- blobs ----------------------------------------------------------------------------------------
def make_blob(key: str, writer: int, seq: int, min_kb: int, max_kb: int) -> bytes:
    rng = random.Random(f"{key}|{writer}|{seq}")
    payload = rng.randbytes(rng.randint(min_kb << 10, max_kb << 10))
    return f"{key}|{writer}|{seq}|{hashlib.sha256(payload).hexdigest()}\n".encode() + payload


def classify(key: str, blob: bytes, min_kb: int, max_kb: int) -> str:
    """``ok``, ``wrong`` (another key's, or bytes no writer wrote) or ``partial`` (this key's head,
    other or fewer bytes after it)."""
    head, sep, payload = blob.partition(b"\n")
    try:
        k, w, seq, sha = head.decode().split("|")
        w_i, seq_i = int(w), int(seq)
    except (UnicodeDecodeError, ValueError):
        return "wrong"
    if k != key or not sep:
        return "wrong"
    want = make_blob(key, w_i, seq_i, min_kb, max_kb)
    if blob == want:
        return "ok"
    return "partial" if want.startswith(head + b"\n") else "wrong"


def key_name(i: int) -> str:
    return f"soak-{i:05d}"


# ---- worker processes -----------------------------------------------------------------------------
def _backend(cfg: dict):
    from kvz.integrations.kvstore import open_url

    return open_url(cfg["url"], namespace=cfg["namespace"], budget_bytes=cfg["budget_bytes"])


def _start_time(go, t0v) -> float:
    """Wait for every process (and the parent) to be ready, then for the start time the parent sets."""
    go.wait(300)
    while t0v.value == 0.0:
        time.sleep(0.01)
    while time.time() < t0v.value:
        time.sleep(0.005)
    return t0v.value


def writer_main(cfg: dict, wid: int, go, t0v, out) -> None:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = _backend(cfg)
            rng = random.Random(1000 + wid)
            t0 = _start_time(go, t0v)
            end = t0 + cfg["seconds"]
            res = {"puts": 0, "put_ok": 0, "put_refused": 0, "put_s": 0.0, "timeline": {}}
            seq = 0
            while time.time() < end:
                i = rng.randrange(cfg["keys"])
                key = key_name(i)
                blob = make_blob(key, wid, seq, cfg["min_kb"], cfg["max_kb"])
                t = time.perf_counter()
                ok = store.put(key, blob)
                res["put_s"] += time.perf_counter() - t
                seq += 1
                res["puts"] += 1
                res["put_ok" if ok else "put_refused"] += 1
                b = str(int((time.time() - t0) / cfg["bucket_s"]))
                tl = res["timeline"].setdefault(b, [0, 0])
                tl[0] += 1
                tl[1] += int(ok)
            res["stats"] = store.stats()
            store.close()
        res["warnings"] = [str(w.message)[:300] for w in caught]
        out.put(("writer", wid, res, None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put(("writer", wid, None, traceback.format_exc()))


def reader_main(cfg: dict, rid: int, go, t0v, out) -> None:
    try:
        from kvz.integrations.kvstore import StoreReadError

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = _backend(cfg)
            rng = random.Random(2000 + rid)
            t0 = _start_time(go, t0v)
            end = t0 + cfg["seconds"]
            res = {"gets": 0, "hits": 0, "get_s": 0.0, "wrong": 0, "partial": 0, "examples": [],
                   "misses": {"absent": 0, "lost": 0, "unavailable": 0}, "ranged_reads": 0,
                   "ranged_aborted": 0, "ranged_caught": 0, "timeline": {}, "bytes_read": 0}
            c = store._counters
            while time.time() < end:
                key = key_name(rng.randrange(cfg["keys"]))
                before = (c["errors"], c["lost"])
                ranged = rng.random() < 0.25
                t = time.perf_counter()
                blob = None
                caught_change = aborted = False
                if ranged:
                    res["ranged_reads"] += 1
                    src = store.open_blob(key)
                    if src is not None:
                        try:
                            parts = [bytes(src.read_range(off, min(PIECE, src.size - off)))
                                     for off in range(0, src.size, PIECE)]
                            blob = b"".join(parts)
                            # the caller's own checksum (a .kvz checks its CRC-32s): changed bytes are refused
                            if len(blob) != src.size or classify(key, blob, cfg["min_kb"], cfg["max_kb"]) != "ok":
                                caught_change = True
                                blob = None
                        except StoreReadError:
                            aborted = True
                            blob = None
                        finally:
                            src.close()
                else:
                    blob = store.get(key)
                res["get_s"] += time.perf_counter() - t
                res["gets"] += 1
                b = str(int((time.time() - t0) / cfg["bucket_s"]))
                tl = res["timeline"].setdefault(b, [0, 0])
                tl[0] += 1
                if caught_change:
                    res["ranged_caught"] += 1
                elif aborted:
                    res["ranged_aborted"] += 1
                elif blob is None:
                    if c["errors"] > before[0]:
                        res["misses"]["unavailable"] += 1
                    elif c["lost"] > before[1]:
                        res["misses"]["lost"] += 1
                    else:
                        res["misses"]["absent"] += 1
                else:
                    verdict = classify(key, blob, cfg["min_kb"], cfg["max_kb"])
                    if verdict == "ok":
                        res["hits"] += 1
                        tl[1] += 1
                        res["bytes_read"] += len(blob)
                    else:
                        res[verdict] += 1
                        if len(res["examples"]) < 5:
                            res["examples"].append(f"{verdict}: {key} -> {blob[:80]!r} ({len(blob)} bytes)")
            res["stats"] = store.stats()
            store.close()
        res["warnings"] = [str(w.message)[:300] for w in caught]
        out.put(("reader", rid, res, None))
    except BaseException:  # noqa: BLE001
        out.put(("reader", rid, None, traceback.format_exc()))


# ---- the run --------------------------------------------------------------------------------------
def consistency(store) -> dict:
    """Entry keys without bookkeeping, bookkeeping without entries, and bytes the totals count that no
    entry holds (or the reverse), over every shard."""
    c = store._get_client()
    entries: dict = {}
    for k in store._scan_entries(c):
        sm = store._member_of(bytes(k))
        if sm is not None:
            entries[sm] = int(c.strlen(k))
    indexed: dict = {}
    totals = 0
    for s in range(store.shards):
        ks = store._keys_of(s)
        for m, size in c.hgetall(ks[2]).items():
            indexed[(s, bytes(m))] = int(size)
        totals += int(c.get(ks[4]) or 0)
    orphans = [k for k in entries if k not in indexed]
    stale = [k for k in indexed if k not in entries]
    return {"entries": len(entries), "indexed": len(indexed), "orphaned_entries": len(orphans),
            "stale_bookkeeping": len(stale), "entry_bytes": sum(entries.values()),
            "indexed_bytes": sum(indexed.values()), "total_counters": totals,
            "leaked_bytes": abs(totals - sum(entries.values()))}


def run(args) -> dict:
    from kvz.integrations.kvstore import RedisClusterServer, open_url

    cl = None
    url = args.url
    if url is None:
        cl = RedisClusterServer(masters=3, replicas=1, node_timeout_ms=args.node_timeout_ms).start()
        url = cl.url
    namespace = args.namespace or f"soak{os.getpid()}"
    cfg = {"url": url, "namespace": namespace, "budget_bytes": int(args.budget_mb * (1 << 20)),
           "keys": args.keys, "min_kb": args.min_kb, "max_kb": args.max_kb, "seconds": args.seconds,
           "bucket_s": args.bucket_s}
    ctx = mp.get_context("spawn")
    go, out, t0v = ctx.Barrier(args.writers + args.readers + 1), ctx.Queue(), ctx.Value("d", 0.0)
    fault: dict = {}
    results = []
    try:
        procs = [ctx.Process(target=writer_main, args=(cfg, w, go, t0v, out)) for w in range(args.writers)]
        procs += [ctx.Process(target=reader_main, args=(cfg, r, go, t0v, out)) for r in range(args.readers)]
        for p in procs:
            p.start()
        go.wait(300)  # every process has imported kvz and opened its store
        t0 = time.time() + 0.5
        t0v.value = t0
        startup = 0.5
        if cl is not None and args.kill_at > 0:
            kill_at = t0 + args.kill_at * args.seconds
            while time.time() < kill_at:
                time.sleep(0.05)
            probe = open_url(url, namespace=namespace, budget_bytes=cfg["budget_bytes"])
            victim = cl.master_of_key(probe._tags[0].encode())
            probe.close()
            fault["killed_node"] = f"{cl.host}:{cl.nodes[victim].port}"
            fault["kill_at_s"] = round(time.time() - t0, 2)
            cl.kill(victim)
            t_kill = time.monotonic()
            cl.wait_ok(timeout=120)
            fault["failover_s"] = round(time.monotonic() - t_kill, 2)
            time.sleep(args.restart_after_s)
            cl.restart(victim)
            cl.wait_ok(timeout=120)
            fault["restart_at_s"] = round(time.time() - t0, 2)
            fault["rejoined_as"] = "master" if victim in cl.masters() else "replica"
        deadline = time.monotonic() + args.seconds + startup + 120
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                results.append(out.get(timeout=1))
            except Exception:  # noqa: BLE001 - queue.Empty
                if not any(p.is_alive() for p in procs) and out.empty():
                    break
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        # after the run: what `kvz store gc` does, twice, and the bookkeeping checked against the entries
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            store = open_url(url, namespace=namespace, budget_bytes=cfg["budget_bytes"])
            before_gc = consistency(store)
            gc1 = store.gc()
            gc2 = store.gc()
            after_gc = consistency(store)
            final = store.store_stats()
            store.close()
    finally:
        if cl is not None:
            cl.close()
    return summarize(args, cfg, fault, results, before_gc, gc1, gc2, after_gc, final)


def _merge_timelines(rows, idx: int) -> dict:
    out: dict = {}
    for r in rows:
        for b, v in r["timeline"].items():
            out.setdefault(int(b), [0, 0])
            out[int(b)][0] += v[0]
            out[int(b)][1] += v[1]
    return dict(sorted(out.items()))


def summarize(args, cfg, fault, results, before_gc, gc1, gc2, after_gc, final) -> dict:
    from kvz.benchmarks.harness import code_revision, command_line, loadavg, machine_info

    tracebacks = [tb for *_, tb in results if tb]
    writers = [r for role, _, r, tb in results if role == "writer" and not tb]
    readers = [r for role, _, r, tb in results if role == "reader" and not tb]
    secs = float(args.seconds)
    puts = sum(w["puts"] for w in writers)
    put_ok = sum(w["put_ok"] for w in writers)
    gets = sum(r["gets"] for r in readers)
    hits = sum(r["hits"] for r in readers)
    misses: dict = {}
    for r in readers:
        for k, v in r["misses"].items():
            misses[k] = misses.get(k, 0) + v
    misses["ranged_aborted"] = sum(r["ranged_aborted"] for r in readers)
    misses["ranged_caught_by_checksum"] = sum(r["ranged_caught"] for r in readers)
    wr, rd = _merge_timelines(writers, 0), _merge_timelines(readers, 0)
    windows = {}
    if fault.get("kill_at_s") is not None:
        k0 = fault["kill_at_s"]
        k1 = k0 + fault.get("failover_s", 0)
        spans = {"before the kill": (0, k0), "kill to failover": (k0, k1), "after failover": (k1, secs)}
        for name, (a, b) in spans.items():
            rows = [v for t, v in rd.items() if a <= (t + 0.5) * cfg["bucket_s"] < b]
            wrows = [v for t, v in wr.items() if a <= (t + 0.5) * cfg["bucket_s"] < b]
            n, h = sum(v[0] for v in rows), sum(v[1] for v in rows)
            pn, pok = sum(v[0] for v in wrows), sum(v[1] for v in wrows)
            dur = max(b - a, 1e-9)
            windows[name] = {"seconds": round(b - a, 2), "gets_per_s": round(n / dur, 1),
                             "hit_rate": round(h / n, 4) if n else None, "puts_per_s": round(pn / dur, 1),
                             "put_ok_rate": round(pok / pn, 4) if pn else None}
    warn_lines = [w for r in writers + readers for w in r["warnings"]]
    return {
        "benchmark": "store_soak",
        "command": command_line("store_soak"),
        "revision": code_revision(),
        "machine": machine_info(packages=("redis",)),
        "loadavg_end": loadavg(),
        "config": {"writers": args.writers, "readers": args.readers, "seconds": args.seconds,
                   "keys": args.keys, "blob_kb": [args.min_kb, args.max_kb], "budget_mb": args.budget_mb,
                   "cluster": "3 masters + 1 replica each (RedisClusterServer)" if args.url is None else "given URL",
                   "node_timeout_ms": args.node_timeout_ms, "kill_at": args.kill_at,
                   "restart_after_s": args.restart_after_s, "shards": 16, "ranged_read_share": 0.25},
        "processes_failed": len(tracebacks), "tracebacks": tracebacks[:2],
        "puts": puts, "puts_ok": put_ok, "puts_refused": puts - put_ok,
        "puts_per_s": round(puts / secs, 1), "put_ms_mean": round(1e3 * sum(w["put_s"] for w in writers) / max(puts, 1), 3),
        "gets": gets, "hits": hits, "gets_per_s": round(gets / secs, 1),
        "get_ms_mean": round(1e3 * sum(r["get_s"] for r in readers) / max(gets, 1), 3),
        "hit_rate": round(hits / gets, 4) if gets else None,
        "read_mb_per_s": round(sum(r["bytes_read"] for r in readers) / secs / 1e6, 2),
        "ranged_reads": sum(r["ranged_reads"] for r in readers),
        "misses_by_cause": misses,
        "wrong_reads": sum(r["wrong"] for r in readers), "partial_reads": sum(r["partial"] for r in readers),
        "examples": [e for r in readers for e in r["examples"]][:5],
        "fault": fault, "windows": windows,
        "warnings": {"count": len(warn_lines), "first": warn_lines[:3]},
        "store_before_gc": before_gc, "gc": gc1, "gc_again": gc2, "store_after_gc": after_gc,
        "orphaned_parts_after_gc": after_gc["orphaned_entries"] + after_gc["stale_bookkeeping"],
        "leaked_bytes_after_gc": after_gc["leaked_bytes"],
        "store_stats": final,
        "timeline": {"bucket_s": cfg["bucket_s"], "gets": {k: v for k, v in rd.items()},
                     "puts": {k: v for k, v in wr.items()}},
    }


def markdown(r: dict) -> str:
    c, f = r["config"], r["fault"]
    m = r["misses_by_cause"]
    lines = [
        "# Store soak: a Redis Cluster under writers, readers and a dead master",
        "",
        f"`{r['command']}` at {r['revision']}; {r['machine'].get('cpu')}, {r['machine'].get('usable_cores')} usable "
        f"cores (shared: load average {r['loadavg_end']} at the end), redis-py {r['machine'].get('packages', {}).get('redis')}.",
        "",
        f"{c['writers']} writer and {c['readers']} reader processes for {c['seconds']} s over {c['cluster']} on "
        f"loopback; {c['keys']} keys, blobs of {c['blob_kb'][0]}-{c['blob_kb'][1]} KiB, a store budget of "
        f"{c['budget_mb']} MiB over {c['shards']} shards; one read in four is ranged (16 KiB pieces).",
        "",
        "| | |",
        "|---|---|",
        f"| puts/s (ok / refused) | {r['puts_per_s']} ({r['puts_ok']} / {r['puts_refused']}), {r['put_ms_mean']} ms mean |",
        f"| gets/s | {r['gets_per_s']}, {r['get_ms_mean']} ms mean, {r['read_mb_per_s']} MB/s verified |",
        f"| hit rate | {r['hit_rate']:.1%} |" if r["hit_rate"] is not None else "| hit rate | - |",
        f"| misses: absent (not yet written / budget) | {m.get('absent', 0)} |",
        f"| misses: lost (entry gone under its bookkeeping) | {m.get('lost', 0)} |",
        f"| misses: store unavailable (dead or resting node) | {m.get('unavailable', 0)} |",
        f"| ranged reads aborted (StoreReadError) / caught by the checksum | {m.get('ranged_aborted', 0)} / "
        f"{m.get('ranged_caught_by_checksum', 0)} |",
        f"| **wrong reads** | **{r['wrong_reads']}** |",
        f"| **partial reads** | **{r['partial_reads']}** |",
        f"| failed processes | {r['processes_failed']} |",
        f"| orphaned parts before gc / after gc | {r['store_before_gc']['orphaned_entries'] + r['store_before_gc']['stale_bookkeeping']}"
        f" / **{r['orphaned_parts_after_gc']}** |",
        f"| leaked bytes before gc / after gc | {r['store_before_gc']['leaked_bytes']} / **{r['leaked_bytes_after_gc']}** |",
        f"| gc pass 1 / pass 2 | {r['gc']} / {r['gc_again']} |",
        f"| warnings (all processes) | {r['warnings']['count']} |",
    ]
    if f:
        lines += ["", f"Fault: master {f.get('killed_node')} SIGKILLed at {f.get('kill_at_s')} s; the cluster was "
                      f"`ok` again (a replica promoted) {f.get('failover_s')} s later; restarted at "
                      f"{f.get('restart_at_s')} s, it rejoined as {f.get('rejoined_as')}.", "",
                  "| window | s | gets/s | hit rate | puts/s | puts ok |", "|---|---|---|---|---|---|"]
        for name, w in r["windows"].items():
            hr = f"{w['hit_rate']:.1%}" if w["hit_rate"] is not None else "-"
            pk = f"{w['put_ok_rate']:.1%}" if w["put_ok_rate"] is not None else "-"
            lines.append(f"| {name} | {w['seconds']} | {w['gets_per_s']} | {hr} | {w['puts_per_s']} | {pk} |")
    if r["warnings"]["first"]:
        lines += ["", "First warnings: " + "; ".join(f"`{w[:160]}`" for w in r["warnings"]["first"][:2])]
    if r["examples"]:
        lines += ["", "Bad reads: " + "; ".join(r["examples"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from kvz.benchmarks.harness import parser, write_json, write_text

    ap = parser(__doc__, json="write the results as JSON here")
    ap.add_argument("--md", metavar="OUT", help="write the results as Markdown here")
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--keys", type=int, default=1500, help="key space the writers and readers pick from")
    ap.add_argument("--min-kb", type=int, default=8)
    ap.add_argument("--max-kb", type=int, default=48)
    ap.add_argument("--budget-mb", type=float, default=32.0, help="the store's byte budget (evictions)")
    ap.add_argument("--kill-at", type=float, default=0.5, help="fraction of the run at which a master is killed "
                    "(0: none)")
    ap.add_argument("--restart-after-s", type=float, default=5.0, help="seconds after the failover to restart it")
    ap.add_argument("--node-timeout-ms", type=int, default=2000, help="the cluster's cluster-node-timeout")
    ap.add_argument("--bucket-s", type=float, default=1.0, help="timeline resolution")
    ap.add_argument("--url", default=None, help="use this redis+cluster:// URL instead of starting a cluster "
                    "(no kill then)")
    ap.add_argument("--namespace", default=None)
    args = ap.parse_args(argv)
    res = run(args)
    if args.json:
        write_json(res, args.json)
    md = markdown(res)
    if args.md:
        write_text(args.md, md)
    print(md)
    ok = res["wrong_reads"] == 0 and res["partial_reads"] == 0 and res["orphaned_parts_after_gc"] == 0 and \
        res["processes_failed"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
