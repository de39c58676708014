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


# the cluster helper lives beside this one (file size); its names are importable from here too
from .cluster_server import RedisClusterServer, redis_cluster_fixture  # noqa: E402

__all__ = ["RedisServer", "RedisClusterServer", "ping", "redis_server_fixture", "redis_cluster_fixture",
           "redis_server_path", "require_redis"]
