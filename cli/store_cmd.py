"""``kvz store stats URL`` and ``kvz store gc URL``: a store's figures and its garbage collection, for a
directory, a Redis node or a Redis Cluster (imports only click until a command runs)."""
from __future__ import annotations

import json
import os
import sys

import click

_URL_HELP = ("a directory (or file:///path), redis://[user:pw@]host:port/db, rediss://..., unix:///path, "
             "redis+cluster://host:port,host:port/ or rediss+cluster://...; credentials also from "
             "KVZ_REDIS_USERNAME / KVZ_REDIS_PASSWORD")


def _fail(msg: str):
    click.echo(f"Error: {msg}", err=True)
    sys.exit(1)


def _open(url: str, namespace: str | None, shards: int | None):
    """The backend of ``url``, checked: one error line and exit 1 when it cannot be used."""
    import warnings

    from kvz.integrations.kvstore import StoreError, open_url, scheme_of

    if scheme_of(url) == "directory":
        path = url[len("file://"):] if url.startswith("file://") else url
        if not os.path.isdir(os.path.expanduser(path)):
            _fail(f"no store directory at {path}")
    try:
        backend = open_url(url, namespace=namespace, shards=shards)
    except StoreError as e:
        _fail(str(e))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one error line below says it
        try:
            first = backend.check()
        except StoreError as e:
            backend.close()
            _fail(str(e))
    return backend, first


def _human_bytes(n) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@click.group("store")
def store():
    """Inspect and clean a kvz chunk store (directory, Redis, Redis Cluster)."""


@store.command("stats", help="Entries, bytes and the counters of every client of the store at URL: hits, misses, "
               "corrupt entries dropped, entries evicted (by the budget, and found gone: evicted by Redis' "
               "maxmemory, expired, lost with a node). URL: " + _URL_HELP + ". An unreachable store, a wrong "
               "password or an ACL refusal: one error line, exit status 1.")
@click.argument("url")
@click.option("--namespace", default=None, help="Redis namespace  [default: kvz, or the URL's ?namespace=]")
@click.option("--shards", type=click.IntRange(1, 1024), default=None,
              help="Shards of a Redis Cluster store (as its writers use)  [default: 16]")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def stats(url, namespace, shards, as_json):
    backend, st = _open(url, namespace, shards)
    backend.close()
    evicted = int(st.get("evicted") or 0) + int(st.get("lost") or 0)
    out = {k: st.get(k) for k in ("backend", "entries", "bytes", "puts", "hits", "misses", "corrupt", "foreign",
                                  "lost")}
    out["evicted"] = evicted
    out["evicted_by_budget"] = st.get("evicted")
    for k in ("url", "path", "namespace", "shards", "server"):
        if k in st:
            out[k] = st[k]
    if as_json:
        click.echo(json.dumps(out, indent=2, sort_keys=True))
        return
    where = st.get("url") or st.get("path")
    gets = (out["hits"] or 0) + (out["misses"] or 0)
    click.echo(f"{out['backend']} store {where}" + (f" (namespace {st['namespace']}, {st['shards']} shards)"
                                                    if "namespace" in st else ""))
    click.echo(f"  entries  {out['entries']}   bytes {out['bytes']} ({_human_bytes(out['bytes'])})")
    click.echo(f"  hits     {out['hits']}   misses {out['misses']}" +
               (f"   hit rate {out['hits'] / gets:.1%}" if gets else ""))
    click.echo(f"  corrupt  {out['corrupt']}   foreign {out['foreign']}   puts {out['puts']}")
    click.echo(f"  evicted  {evicted} (budget {out['evicted_by_budget']}, gone under the store {out['lost']})")
    srv = st.get("server")
    if srv:
        click.echo(f"  server   {srv.get('nodes')} node(s), {_human_bytes(srv.get('used_memory'))} used, "
                   f"evicted_keys {srv.get('evicted_keys')}, expired_keys {srv.get('expired_keys')}, "
                   f"maxmemory-policy {','.join(srv.get('maxmemory_policy') or [])}")


@store.command("gc", help="Remove the orphaned parts of the store at URL: Redis entries without bookkeeping and "
               "bookkeeping without entries (left by the server's own eviction or expiry), byte totals that "
               "drifted; a directory's temporary files of writers that died (older than a minute). URL: "
               + _URL_HELP + ".")
@click.argument("url")
@click.option("--namespace", default=None, help="Redis namespace  [default: kvz, or the URL's ?namespace=]")
@click.option("--shards", type=click.IntRange(1, 1024), default=None,
              help="Shards of a Redis Cluster store (as its writers use)  [default: 16]")
@click.option("--verify", is_flag=True, help="Also read every entry and drop those that fail their checksum.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def gc(url, namespace, shards, verify, as_json):
    from kvz.integrations.kvstore import StoreError

    backend, _ = _open(url, namespace, shards)
    try:
        res = backend.gc(verify=verify)
    except StoreError as e:
        _fail(str(e))
    finally:
        backend.close()
    if as_json:
        click.echo(json.dumps(res, indent=2, sort_keys=True))
        return
    click.echo(f"checked {res['checked']}: removed {res['orphans']} orphaned entries/files, {res['stale']} "
               f"stale bookkeeping records, {res['corrupt']} corrupt entries; byte totals corrected by "
               f"{res['total_fixed_bytes']}")
