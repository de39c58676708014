"""Start a throw-away ``redis-server`` on loopback, for tests and CI.

    with RedisServer() as srv:           # free port, temporary --dir, no persistence
        store = RedisBackend(srv.url)
        srv.stop(); srv.start()          # a restart on the same port

In a pytest file::

    @pytest.fixture(scope="module")
    def redis_server():
        yield from redis_server_fixture()

``redis_server_fixture`` skips the test when ``redis-server`` (or the ``redis`` package) is missing,
and fails it instead when the environment variable ``KVZ_REQUIRE_REDIS=1`` is set (CI).
Uses only the standard library (PING goes over a plain socket).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref

REQUIRE_ENV = "KVZ_REQUIRE_REDIS"


def redis_server_path() -> str | None:
    """Path of the ``redis-server`` executable on PATH, or None."""
    return shutil.which("redis-server")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def ping(host: str, port: int, timeout: float = 0.5) -> bool:
    """True if a Redis server answers PING at host:port (one that asks for a password answers too)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


def _stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.send_signal(signal.SIGCONT)  # a paused (SIGSTOP) server only sees the SIGTERM once continued
    except OSError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _cleanup(state: dict) -> None:
    _stop_process(state.get("proc"))
    state["proc"] = None
    if state.get("dir"):
        shutil.rmtree(state["dir"], ignore_errors=True)
        state["dir"] = None


class RedisServer:
    """A ``redis-server`` child process on 127.0.0.1, no persistence, data dir in a temporary folder.

    ``start()`` picks a free port the first time (retrying if another process takes it first) and
    waits until the server answers PING; ``stop()`` terminates it (the port is kept, so ``start()``
    again restarts it on the same port, empty); ``close()`` also removes the temporary folder.
    The process is also stopped when the object is garbage-collected or the interpreter exits.
    """

    def __init__(self, port: int | None = None, *, host: str = "127.0.0.1", executable: str | None = None,
                 startup_timeout: float = 10.0, args: tuple | list = ()):
        self.host = host
        self.args = [str(a) for a in args]  # extra redis-server arguments (``--maxmemory``, ``--requirepass`` …)
        self.port = port
        self._fixed_port = port is not None
        self.executable = executable or redis_server_path()
        self.startup_timeout = startup_timeout
        self._state: dict = {"proc": None, "dir": None}
        self._finalizer = weakref.finalize(self, _cleanup, self._state)

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("RedisServer has not been started")
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        proc = self._state["proc"]
        return proc is not None and proc.poll() is None

    @property
    def dir(self) -> str | None:
        return self._state["dir"]

    def start(self) -> RedisServer:
        if self.running:
            return self
        if not self.executable:
            raise RuntimeError("redis-server is not on PATH (Debian: apt-get install -y redis-server)")
        if self._state["dir"] is None:
            self._state["dir"] = tempfile.mkdtemp(prefix="kvz-redis-")
        attempts = 1 if self._fixed_port else 5
        last = ""
        for _ in range(attempts):
            if not self._fixed_port and (self.port is None or last):
                self.port = _free_port(self.host)
            last = self._launch()
            if not last:
                self._fixed_port = True  # restarts reuse this port
                return self
        raise RuntimeError(f"redis-server did not start on {self.host}:{self.port}: {last}")

    def _launch(self) -> str:
        """Start the process and wait for PING; '' on success, else the reason (log tail)."""
        d = self._state["dir"]
        assert self.executable is not None and self.port is not None
        log_path = os.path.join(d, "redis.log")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [self.executable, "--port", str(self.port), "--bind", self.host, "--save", "",
                 "--appendonly", "no", "--dir", d, "--daemonize", "no", *self.args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=d)
        self._state["proc"] = proc
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if ping(self.host, self.port):
                return ""
            time.sleep(0.02)
        _stop_process(proc)
        self._state["proc"] = None
        with open(log_path, "rb") as f:
            tail = f.read()[-800:].decode("utf-8", "replace")
        return f"exit code {proc.returncode}; log: {tail.strip()}"

    def stop(self) -> None:
        """Terminate the server (SIGTERM; it saves nothing). The port and folder are kept for start()."""
        _stop_process(self._state["proc"])
        self._state["proc"] = None

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown of any kind). ``start()`` brings it back on the port."""
        proc = self._state["proc"]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        self._state["proc"] = None

    def pause(self) -> None:
        """SIGSTOP: the process stops answering but keeps its sockets (a node cut off by the network)."""
        proc = self._state["proc"]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        proc = self._state["proc"]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)

    def restart(self) -> RedisServer:
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its temporary folder."""
        self._finalizer()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def require_redis() -> None:
    """In a test: skip when redis-server or the redis package is missing; fail if KVZ_REQUIRE_REDIS=1."""
    import pytest

    missing = []
    if not redis_server_path():
        missing.append("redis-server not on PATH (apt-get install -y redis-server)")
    try:
        import redis  # noqa: F401
    except ImportError:
        missing.append("redis package not installed (pip install 'kvz[store]')")
    if missing:
        reason = "; ".join(missing)
        if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
            pytest.fail(f"{REQUIRE_ENV} is set but {reason}", pytrace=False)
        pytest.skip(reason)


def redis_server_fixture():
    """Body of a pytest fixture: ``yield from redis_server_fixture()`` yields a started RedisServer."""
    require_redis()
    with RedisServer() as srv:
        yield srv


# ---- Redis Cluster ---------------------------------------------------------------------------------
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
                        return next(j for j, n in enumerate(self.nodes) if n.port == port)
            finally:
                c.close()
        raise RuntimeError(f"no running node serves slot {slot}")

    def master_of_key(self, key: bytes | str) -> int:
        from redis.crc import key_slot

        return self.master_of_slot(key_slot(key.encode() if isinstance(key, str) else key))

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
