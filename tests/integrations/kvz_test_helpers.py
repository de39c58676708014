"""Helpers for test modules here: the suite-wide helpers of tests/kvz_testing.py, and :func:`cluster_behind_proxies` (a Redis Cluster whose
every node is reached through a TCP proxy of its own)."""
import contextlib

from kvz_testing import sample_paths, synthetic_cache  # noqa: F401  (re-exported)


@contextlib.contextmanager
def cluster_behind_proxies(cluster, rate_bits_per_s=None):
    """Every node of ``cluster`` (a started :class:`~kvz.integrations.kvstore.RedisClusterServer` of the
    test's own) behind a :class:`~kvz.benchmarks.link_proxy.LinkProxy` of its own, which the node
    announces as its address (``cluster.announce_ports``): a cluster client that starts from the
    yielded URL follows CLUSTER SLOTS and redirects to the proxies, so every byte between it and a
    node crosses that node's proxy (a link of ``rate_bits_per_s``; ``None``: unthrottled) and
    ``proxies[i].stats()["bytes_down"]`` counts what node ``i`` sent. Yields ``(url, proxies)``, the
    proxies in the order of ``cluster.nodes``. Use ``replicas=0`` (a replica would replicate through
    its master's proxy). The cluster keeps announcing the proxies' ports afterwards: it is the
    test's own, to close."""
    from kvz.benchmarks.link_proxy import LinkProxy

    proxies = []
    try:
        for n in cluster.nodes:
            proxies.append(LinkProxy((cluster.host, n.port), rate_bits_per_s=rate_bits_per_s).start())
        cluster.announce_ports({i: p.address[1] for i, p in enumerate(proxies)})
        url = "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in (x.address for x in proxies[:cluster.n_masters]))
        yield url + "/", proxies
    finally:
        for p in proxies:
            try:
                p.stop()
            except RuntimeError:  # a connection thread still draining: the process ends it
                pass
