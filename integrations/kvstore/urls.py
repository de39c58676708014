"""One factory for every store URL: ``open_url(url, **kw)`` (the chunk store, vLLM, LMCache, SGLang, the CLI).

==============================================  ==============================================
``/path``, ``file:///path``                     :class:`~.directory.DirectoryBackend`
``redis://[user:pw@]host:port/db``              :class:`~.redis_backend.RedisBackend`
``rediss://…`` (TLS), ``unix:///path.sock``     :class:`~.redis_backend.RedisBackend`
``redis+cluster://[user:pw@]h:p,h:p/``          :class:`~.cluster.RedisClusterBackend`
``rediss+cluster://…`` (TLS)                    :class:`~.cluster.RedisClusterBackend`
==============================================  ==============================================

Query parameters of a Redis URL that kvz reads (and removes before redis-py sees the URL):
``namespace``, ``budget_bytes`` (or ``budget_gb``), ``policy``, ``ttl_s``, ``shards`` (cluster),
``socket_timeout``, ``connect_timeout``, ``reconnect_interval``, and for TLS ``ssl_ca_certs``,
``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs`` (``required``/``optional``/``none``). Keyword
arguments given to :func:`open_url` win over the URL's; ``None`` means "not given".

Credentials: ``user:password@`` in the URL or, where it has none, ``KVZ_REDIS_USERNAME`` and
``KVZ_REDIS_PASSWORD`` from the environment; TLS files also from ``KVZ_REDIS_CA_CERTS``,
``KVZ_REDIS_CERTFILE``, ``KVZ_REDIS_KEYFILE``. Backends show the URL with the password masked.
"""
from __future__ import annotations

import os
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from .errors import StoreError

REDIS_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_FLOAT = ("ttl_s", "socket_timeout", "connect_timeout", "reconnect_interval", "half_life_s")
_INT = ("budget_bytes", "shards")
_STR = ("namespace", "policy")
_SSL = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_SSL_ENV = {"ssl_ca_certs": "KVZ_REDIS_CA_CERTS", "ssl_certfile": "KVZ_REDIS_CERTFILE",
            "ssl_keyfile": "KVZ_REDIS_KEYFILE"}
# what each kind of backend takes (an adapter passes what it has: the rest is dropped)
_DIRECTORY_KW = ("budget_bytes", "policy", "half_life_s", "fsync")
_REDIS_KW = ("budget_bytes", "policy", "namespace", "half_life_s", "socket_timeout", "connect_timeout",
             "reconnect_interval", "ttl_s", "username", "password", "ssl_options")
_CLUSTER_KW = _REDIS_KW + ("shards",)


def scheme_of(url: str) -> str:
    """``directory``, ``redis`` or ``cluster``."""
    s = str(url).split("://", 1)[0].lower() if "://" in str(url) else ""
    if s in CLUSTER_SCHEMES:
        return "cluster"
    if s in REDIS_SCHEMES:
        return "redis"
    return "directory"


def gib_bytes(v) -> int | None:
    """A budget in GiB (a number or its string) as bytes; 0: None, no budget. ValueError if it is
    not a number >= 0."""
    gib = float(v)
    if not gib >= 0:  # negative or NaN
        raise ValueError(f"bad budget {v!r} GiB")
    return int(gib * (1 << 30)) if gib > 0 else None


def split_query(url: str) -> tuple[str, dict]:
    """``(url without kvz's query parameters, those parameters typed)``."""
    p = urlparse(url)
    keep: list = []
    ours: dict = {}
    for k, v in parse_qsl(p.query, keep_blank_values=True):
        try:
            if k in _FLOAT:
                ours[k] = float(v)
            elif k in _INT:
                ours[k] = int(v)
            elif k == "budget_gb":
                ours["budget_bytes"] = gib_bytes(v)
            elif k in _STR:
                ours[k] = v
            elif k in _SSL:
                ours.setdefault("ssl_options", {})[k] = v
            else:
                keep.append((k, v))
        except ValueError:
            raise StoreError(f"bad value {v!r} of {k} in the store URL") from None
    return urlunparse(p._replace(query=urlencode(keep))), ours


def _ssl_from_env(opts: dict) -> dict:
    out = dict(opts)
    for k, env in _SSL_ENV.items():
        if k not in out and os.environ.get(env):
            out[k] = os.environ[env]
    return out


def open_url(url, *, budget_gb=None, **kw):
    """The backend a store URL names (see the module docstring); ``kw``: backend arguments
    (``budget_bytes``, ``namespace``, ``ttl_s``, ``policy``, ``shards`` …), those a backend does not
    take are ignored (a directory has no namespace). ``budget_gb`` (a number or its string, as engine
    configurations give it) is ``budget_bytes`` in GiB, where ``budget_bytes`` is not given (0 or
empty: no budget, as the engines' ``max_size_gb`` settings always meant). A
    directory is created if missing. Nothing is contacted here: a Redis store that is down answers
    misses (and warns) when used; ``backend.check()`` raises instead.

    The one factory of stores: the vLLM connector, LMCache's plugins, SGLang's HiCache backend, the
    chunk store and ``kvz store`` all call it.

    >>> import tempfile
    >>> from kvz.integrations.kvstore import open_url
    >>> store = open_url(tempfile.mkdtemp(), budget_gb="0.5")
    >>> type(store).__name__, store.budget_bytes
    ('DirectoryBackend', 536870912)
    """
    from .cluster import RedisClusterBackend
    from .directory import DirectoryBackend
    from .redis_backend import RedisBackend

    if url is None or str(url) == "":
        raise StoreError("no store URL: give a directory, redis://host:port/db or redis+cluster://host:port,...")
    url = os.fspath(url) if not isinstance(url, str) else url
    given = {k: v for k, v in kw.items() if v is not None}
    if budget_gb not in (None, "") and "budget_bytes" not in given:
        try:
            given["budget_bytes"] = gib_bytes(budget_gb)
        except (TypeError, ValueError):
            raise StoreError(f"bad store budget {budget_gb!r} GiB: need a number >= 0 (0: no budget)") from None
    kind = scheme_of(url)
    if kind == "directory":
        path = url[len("file://"):] if url.startswith("file://") else url
        return DirectoryBackend(os.path.expanduser(path), **{k: v for k, v in given.items() if k in _DIRECTORY_KW})
    clean, ours = split_query(url)
    ssl = {**ours.pop("ssl_options", {}), **given.pop("ssl_options", {})}
    if urlparse(clean).scheme in ("rediss", "rediss+cluster"):
        ssl = _ssl_from_env(ssl)
    if "ssl_cert_reqs" in ssl and str(ssl["ssl_cert_reqs"]).lower() in ("none", "optional", "required"):
        ssl["ssl_cert_reqs"] = str(ssl["ssl_cert_reqs"]).lower()
    args = {**ours, **given}
    if ssl:
        args["ssl_options"] = ssl
    if kind == "cluster":
        return RedisClusterBackend(clean, **{k: v for k, v in args.items() if k in _CLUSTER_KW})
    return RedisBackend(clean, **{k: v for k, v in args.items() if k in _REDIS_KW})
