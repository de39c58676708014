"""A throw-away Redis Cluster on loopback (``RedisClusterServer``), for tests, CI and benchmarks; also
importable from :mod:`kvz.integrations.kvstore.server` beside ``RedisServer``."""
from __future__ import annotations

import socket
import time

from .server import RedisServer, require_redis

N_SLOTS = 16384


def _cluster_port(host: str, taken) -> int:
    """A free port P below 55536 whose cluster-bus port P + 10000 is free too (redis-server refuses a
    cluster node above 55535, and the ephemeral range goes higher)."""
    import random

    for _ in range(200):
        p = random.randrange(20000, 55535)
        if p in taken or p + 10000 in taken:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as a, \
                    socket.socket(socket.AF_INET, socket.SOCK_STREAM) as b:
                a.bind((host, p))
                b.bind((host, p + 10000))
        except OSError:
            continue
        return p
    raise RuntimeError("no free port pair for a Redis Cluster node")


class RedisClusterServer:
    """A throw-away Redis Cluster on 127.0.0.1: ``masters`` masters (slots split evenly) with
    ``replicas`` replicas each, every node a :class:`RedisServer` (``--cluster-enabled yes``, own
    folder, free port, no persistence), joined with CLUSTER MEET / ADDSLOTSRANGE / REPLICATE over
    redis-py (no ``redis-cli`` needed)::

        with RedisClusterServer(masters=3, replicas=1) as cl:
            store = RedisClusterBackend(cl.url)      # redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...
            cl.kill(cl.master_of_key(b"{kvz/00}")) # a crash; a replica takes over after node_timeout_ms
            cl.wait_ok()

    ``password`` sets ``requirepass``/``masterauth`` on every node (the default user); ``users``:
    ACL rules per extra user, e.g. ``{"kvz": "on >pw ~* +@all"}``. ``args``: more redis-server
    arguments for every node (``--maxmemory 2mb --maxmemory-policy allkeys-lru``).
    ``nodes``: the RedisServer of each node, masters first as created (roles change with failovers:
    :meth:`masters` asks the cluster). ``tls``: ``{"cert": ..., "key": ..., "ca": ...}`` file paths
    (needs a redis-server built with TLS): every node also listens with TLS on a port of its own, the
    cluster bus and replication use TLS, and :attr:`tls_url` is the ``rediss+cluster://`` URL (the
    plain ports stay for the helper's own admin connections).
    """

    def __init__(self, masters: int = 3, replicas: int = 1, *, host: str = "127.0.0.1", password: str | None = None,
                 users: dict | None = None, node_timeout_ms: int = 1000, args: tuple | list = (),
                 startup_timeout: float = 30.0, tls: dict | None = None):
        if masters < 1 or replicas < 0:
            raise ValueError("masters >= 1, replicas >= 0")
        self.n_masters, self.n_replicas = int(masters), int(replicas)
        self.host = host
        self.password = password
        self.users = dict(users or {})
        self.node_timeout_ms = int(node_timeout_ms)
        self.args = [str(a) for a in args]
        self.startup_timeout = float(startup_timeout)
        self.nodes: list[RedisServer] = []
        self.ids: list[str] = []
        self.tls = dict(tls) if tls else None
        self.tls_ports: list[int] = []
        self.announced: dict[int, int] = {}  # node index -> the port it announces (announce_ports)

    # ---- addresses -----------------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return [f"{self.host}:{n.port}" for n in self.nodes]

    @property
    def url(self) -> str:
        """``redis+cluster://host:port,host:port,...`` of the first nodes (no credentials in it)."""
        if not self.nodes:
            raise RuntimeError("RedisClusterServer has not been started")
        return "redis+cluster://" + ",".join(self.addresses[:self.n_masters]) + "/"

    @property
    def tls_url(self) -> str:
        """``rediss+cluster://host:tlsport,.../?ssl_ca_certs=CA`` (a cluster started with ``tls``)."""
        if not self.tls or not self.tls_ports:
            raise RuntimeError("RedisClusterServer was not started with tls")
        from urllib.parse import quote

        return ("rediss+cluster://" + ",".join(f"{self.host}:{p}" for p in self.tls_ports[:self.n_masters]) +
                "/?ssl_ca_certs=" + quote(self.tls["ca"]))

    def _taken(self) -> set:
        return {n.port for n in self.nodes} | set(self.tls_ports)

    def _tls_args(self) -> list[str]:
        if not self.tls:
            return []
        port = _cluster_port(self.host, self._taken())
        self.tls_ports.append(port)
        t = self.tls
        return ["--tls-port", str(port), "--tls-cert-file", t["cert"], "--tls-key-file", t["key"],
                "--tls-ca-cert-file", t["ca"], "--tls-cluster", "yes", "--tls-replication", "yes",
                "--tls-auth-clients", "no"]

    def _node_args(self) -> list[str]:
        a = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
             "--cluster-node-timeout", str(self.node_timeout_ms), "--cluster-require-full-coverage", "no",
             "--cluster-allow-reads-when-down", "no", "--repl-diskless-sync-delay", "0"]
        if self.password:
            a += ["--requirepass", self.password, "--masterauth", self.password]
        return a + self.args

    def client(self, i: int, timeout: float = 2.0):
        """A plain redis-py client of node ``i`` (as the default user)."""
        import redis

        return redis.Redis(self.host, int(self.nodes[i].port or 0), password=self.password, socket_timeout=timeout,
                           socket_connect_timeout=timeout)

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self) -> RedisClusterServer:
        if self.nodes:
            for n in self.nodes:
                n.start()
            self.wait_ok()
            return self
        total = self.n_masters * (1 + self.n_replicas)
        try:
            for _ in range(total):
                for attempt in range(5):  # a port taken by another process between the pick and the start
                    tls_args = self._tls_args()
                    node = RedisServer(_cluster_port(self.host, self._taken()), host=self.host,
                                       args=self._node_args() + tls_args)
                    try:
                        self.nodes.append(node.start())
                        break
                    except RuntimeError:
                        node.close()
                        if self.tls:
                            self.tls_ports.pop()
                        if attempt == 4:
                            raise
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def _create(self) -> None:
        clients = [self.client(i) for i in range(len(self.nodes))]
        try:
            for c in clients:
                for name, rules in self.users.items():
                    c.execute_command("ACL", "SETUSER", name, *str(rules).split())
            self.ids = [c.execute_command("CLUSTER", "MYID").decode() for c in clients]
            for i in range(self.n_masters):
                lo, hi = i * N_SLOTS // self.n_masters, (i + 1) * N_SLOTS // self.n_masters - 1
                clients[i].execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
            for i in range(1, len(self.nodes)):  # with tls-cluster the bus listens at the TLS port + 10000
                clients[0].execute_command("CLUSTER", "MEET", self.host,
                                           self.tls_ports[i] if self.tls else self.nodes[i].port)
            self._wait(lambda: all(len(self._known(c)) == len(self.nodes) for c in clients), "nodes to meet")
            for j in range(self.n_masters * self.n_replicas):
                replica = self.n_masters + j
                clients[replica].execute_command("CLUSTER", "REPLICATE", self.ids[j % self.n_masters])
            self.wait_ok()
        finally:
            for c in clients:
                c.close()

    @staticmethod
    def _known(c) -> list[str]:
        raw = c.execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return [line for line in text.splitlines() if line.strip() and "handshake" not in line]

    def _wait(self, cond, what: str, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        last: BaseException | None = None
        while time.monotonic() < deadline:
            try:
                if cond():
                    return
            except Exception as e:  # noqa: BLE001 - a node still starting
                last = e
            time.sleep(0.05)
        raise RuntimeError(f"Redis cluster: timed out waiting for {what}" + (f" ({last})" if last else ""))

    def cluster_ok(self) -> bool:
        """Every running node says ``cluster_state:ok``, all slots are served, and every running
        replica's link to its master is up."""
        running = [i for i, n in enumerate(self.nodes) if n.running]
        for i in running:
            c = self.client(i, timeout=0.5)
            try:
                info = c.execute_command("CLUSTER", "INFO")
                info = info.decode() if isinstance(info, bytes) else str(info)
                if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                    return False
                rep = c.info("replication")
                if rep.get("role") == "slave" and rep.get("master_link_status") != "up":
                    return False
            finally:
                c.close()
        return bool(running)

    def wait_ok(self, timeout: float | None = None) -> None:
        """Wait until :meth:`cluster_ok` and there are ``masters`` masters again (after a start, a
        failover or a restart: a master brought back first claims its old slots, then turns replica)."""
        self._wait(lambda: self.cluster_ok() and len(self.masters()) == self.n_masters, "cluster_state:ok", timeout)

    def masters(self) -> list[int]:
        """Indices of the nodes that are masters now (asked of the running nodes)."""
        out = []
        for i, n in enumerate(self.nodes):
            if not n.running:
                continue
            c = self.client(i, timeout=0.5)
            try:
                if c.info("replication").get("role") == "master":
                    out.append(i)
            except Exception:  # noqa: BLE001 - paused or dying node
                pass
            finally:
                c.close()
        return out

    def master_of_slot(self, slot: int) -> int:
        """Index of the running node that serves ``slot`` now."""
        for i in self.masters():
            c = self.client(i, timeout=0.5)
            try:
                for lo, hi, *_ in c.execute_command("CLUSTER", "SLOTS"):
                    if int(lo) <= slot <= int(hi):
                        port = int(_[0][1])
                        return next(j for j, n in enumerate(self.nodes)
                                    if self.announced.get(j, n.port) == port)
            finally:
                c.close()
        raise RuntimeError(f"no running node serves slot {slot}")

    def master_of_key(self, key: bytes | str) -> int:
        from redis.crc import key_slot

        return self.master_of_slot(key_slot(key.encode() if isinstance(key, str) else key))

    def announce_ports(self, ports: dict[int, int], timeout: float = 15.0) -> None:
        """Make node ``i`` announce port ``ports[i]`` to clients and peers (``cluster-announce-port``:
        what CLUSTER SLOTS / SHARDS and redirects name), e.g. a TCP proxy in front of it, so that a
        cluster client reaches every node through its proxy; waits until every running node's slot
        map names the announced ports. ``{i: node.port}`` undoes it. The cluster bus keeps its own port
        (node port + 10000). Replicas follow their master's announced address: give every node a
        proxy, or use ``replicas=0``."""
        for i, port in ports.items():
            c = self.client(i)
            try:
                c.execute_command("CONFIG", "SET", "cluster-announce-port", int(port))
            finally:
                c.close()
            self.announced[i] = int(port)

        def agreed() -> bool:
            want = {self.announced.get(j, n.port) for j, n in enumerate(self.nodes) if n.running}
            for i, n in enumerate(self.nodes):
                if not n.running:
                    continue
                c = self.client(i, timeout=0.5)
                try:
                    seen = {int(node[1]) for row in c.execute_command("CLUSTER", "SLOTS") for node in row[2:]}
                finally:
                    c.close()
                if not seen <= want:
                    return False
            return True

        self._wait(agreed, "the announced ports to reach every node", timeout)

    def migrate_slot(self, slot: int, dst: int, *, batch: int = 50, pause_s: float = 0.0) -> int:
        """Move ``slot`` to master ``dst`` as ``redis-cli --cluster reshard`` does (SETSLOT IMPORTING /
        MIGRATING, MIGRATE of its keys in batches, SETSLOT NODE on every master); returns the keys
        moved. ``pause_s`` between batches leaves the slot half-migrated for a while (clients get
        ASK redirects meanwhile)."""
        src = self.master_of_slot(slot)
        if src == dst:
            return 0
        cs, cd = self.client(src), self.client(dst)
        moved = 0
        try:
            src_id = cs.execute_command("CLUSTER", "MYID").decode()
            dst_id = cd.execute_command("CLUSTER", "MYID").decode()
            cd.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
            cs.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
            auth = ["AUTH", self.password] if self.password else []
            while True:
                keys = cs.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch)
                if not keys:
                    break
                cs.execute_command("MIGRATE", self.host, self.nodes[dst].port, "", 0, 5000, *auth, "KEYS", *keys)
                moved += len(keys)
                if pause_s:
                    time.sleep(pause_s)
            for i in self.masters():
                c = self.client(i)
                try:
                    c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
                finally:
                    c.close()
        finally:
            cs.close()
            cd.close()
        return moved

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (a crash). Its replica is promoted after ``node_timeout_ms`` (+ ~1 s)."""
        self.nodes[i].kill()

    def stop(self, i: int) -> None:
        self.nodes[i].stop()

    def restart(self, i: int) -> None:
        """Start node ``i`` again on its port with its nodes.conf (it rejoins, empty; a master that
        was replaced comes back as a replica of the node that took over)."""
        self.nodes[i].start()

    def pause(self, i: int) -> None:
        self.nodes[i].pause()

    def resume(self, i: int) -> None:
        self.nodes[i].resume()

    def close(self) -> None:
        for n in self.nodes:
            n.close()

    def __enter__(self) -> RedisClusterServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def redis_cluster_fixture(**kw):
    """Body of a pytest fixture: ``yield from redis_cluster_fixture()`` yields a started
    :class:`RedisClusterServer` (3 masters, 1 replica each unless ``kw`` says otherwise); skips or
    fails like :func:`redis_server_fixture`."""
    require_redis()
    kw.setdefault("masters", 3)
    kw.setdefault("replicas", 1)
    with RedisClusterServer(**kw) as cl:
        yield cl
