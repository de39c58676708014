"""The loopback link proxy (benchmarks/link_proxy.py): rate accuracy, byte identity both ways, round trips,
a shared bucket across connections, latency, clean stops, the loopback-only rule, the CLI and a real
redis-server behind it. Real sockets and servers on 127.0.0.1 throughout."""
from __future__ import annotations

import doctest
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvz.benchmarks import link_proxy
from kvz.benchmarks.link_proxy import LinkProxy, parse_address, parse_rate
from kvz.integrations.kvstore.server import RedisServer, require_redis

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Server:
    """A threaded TCP server on 127.0.0.1: ``mode`` "echo" (sends back what it reads), "sink" (reads to
    EOF, then answers the byte count as ASCII) or "source" (sends ``nbytes`` zero bytes, then closes)."""

    def __init__(self, mode="echo", nbytes=0):
        self.mode, self.nbytes = mode, nbytes
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.address = self.sock.getsockname()[:2]
        self._stop = threading.Event()
        self._threads = []
        self._conns = []
        self._accept = threading.Thread(target=self._loop, name="test-server-accept")
        self._accept.start()

    def _loop(self):
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except TimeoutError:
                continue
            c.settimeout(None)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.append(c)
            t = threading.Thread(target=self._handle, args=(c,), name="test-server-conn")
            self._threads.append(t)
            t.start()

    def _handle(self, c):
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            if self.mode == "echo":
                while n := c.recv_into(buf):
                    c.sendall(view[:n])
            elif self.mode == "sink":
                total = 0
                while n := c.recv_into(buf):
                    total += n
                c.sendall(str(total).encode())
            else:
                left = self.nbytes
                while left:
                    k = min(left, len(buf))
                    c.sendall(view[:k])
                    left -= k
            c.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self):
        self._stop.set()
        self._accept.join(5)
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(5)
        for c in self._conns:
            c.close()
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def proxy_threads():
    return [t for t in threading.enumerate() if t.name.startswith("kvz-link-proxy")]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    assert proxy_threads() == [], "the proxy left threads running"


def recv_all(s, n):
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(min(1 << 20, n - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def upload(address, nbytes):
    """Send nbytes to a sink through address; returns (seconds, count the sink reported)."""
    payload = memoryview(bytearray(1 << 20))
    with socket.create_connection(address) as s:
        t0 = time.perf_counter()
        left = nbytes
        while left:
            k = min(left, len(payload))
            s.sendall(payload[:k])
            left -= k
        s.shutdown(socket.SHUT_WR)
        reply = recv_all(s, 64)
        return time.perf_counter() - t0, int(reply)


# --------------------------------------------------------------------------- rates

def test_parse_rate_and_address():
    assert parse_rate("1g") == 1e9
    assert parse_rate("10G") == 1e10
    assert parse_rate("100m") == 1e8
    assert parse_rate("512k") == 512e3
    assert parse_rate("2.5gbit") == 2.5e9
    assert parse_rate("1e9") == 1e9
    assert parse_rate("1000") == 1000.0
    assert parse_rate("inf") is None and parse_rate("0") is None and parse_rate(None) is None
    for bad in ("fast", "1t", "-1g", "1 gb/s/s"):
        with pytest.raises(ValueError):
            parse_rate(bad)
    assert parse_address("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("localhost:1") == ("localhost", 1)
    with pytest.raises(ValueError):
        parse_address("127.0.0.1")


def test_upload_at_100_mbit_takes_its_nominal_time():
    """8 MB at 100 Mbit/s is 0.64 s (a correctness band, not a benchmark)."""
    with Server("sink") as srv, LinkProxy(srv.address, rate_bits_per_s=100e6) as proxy:
        seconds, got = upload(proxy.address, 8_000_000)
    assert got == 8_000_000
    assert 0.32 <= seconds <= 1.28, seconds
    assert proxy.bytes_up == 8_000_000
    assert proxy.throttled_s_up > 0.3 and proxy.throttled_s_down == 0.0


def test_download_is_throttled_too():
    with Server("source", nbytes=4_000_000) as srv, LinkProxy(srv.address, rate_bits_per_s=100e6) as proxy:
        with socket.create_connection(proxy.address) as s:
            t0 = time.perf_counter()
            data = recv_all(s, 4_000_001)
            seconds = time.perf_counter() - t0
    assert len(data) == 4_000_000
    assert 0.16 <= seconds <= 0.64, seconds
    assert proxy.bytes_down == 4_000_000 and proxy.throttled_s_down > 0.1


def test_connections_share_the_link():
    """Two concurrent 4 MB uploads at 100 Mbit/s take 0.64 s together (one link), not 0.32 s."""
    with Server("sink") as srv, LinkProxy(srv.address, rate_bits_per_s=100e6) as proxy:
        results = []
        t0 = time.perf_counter()
        ts = [threading.Thread(target=lambda: results.append(upload(proxy.address, 4_000_000))) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        seconds = time.perf_counter() - t0
    assert [r[1] for r in results] == [4_000_000, 4_000_000]
    assert 0.5 <= seconds <= 1.28, seconds
    assert proxy.connections == 2 and proxy.bytes_up == 8_000_000


# --------------------------------------------------------------------------- data

@pytest.mark.parametrize("rate", [None, 10e9])
def test_bytes_identical_both_ways(rate):
    data = os.urandom(16 << 20)
    with Server("echo") as srv, LinkProxy(srv.address, rate_bits_per_s=rate) as proxy:
        with socket.create_connection(proxy.address) as s:
            sender = threading.Thread(target=lambda: (s.sendall(data), s.shutdown(socket.SHUT_WR)))
            sender.start()
            back = recv_all(s, len(data) + 1)  # +1: reads on to the forwarded EOF
            sender.join()
    assert back == data
    assert proxy.bytes_up == proxy.bytes_down == len(data)
    assert proxy.stats()["open_connections"] == 0


def test_many_small_round_trips():
    with Server("echo") as srv, LinkProxy(srv.address, rate_bits_per_s=1e9) as proxy:
        with socket.create_connection(proxy.address) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            for i in range(2000):
                msg = b"%06d" % i + b"x" * (i % 200)
                s.sendall(msg)
                assert recv_all(s, len(msg)) == msg
            seconds = time.perf_counter() - t0
        # and many short connections
        for i in range(50):
            with socket.create_connection(proxy.address) as s:
                s.sendall(b"ping%d" % i)
                assert recv_all(s, len(b"ping%d" % i)) == b"ping%d" % i
    assert seconds < 5.0, seconds  # TCP_NODELAY on both legs: no 40 ms delayed-ACK stalls
    assert proxy.connections == 51


def test_latency_delays_each_direction():
    data = os.urandom(2 << 20)
    with Server("echo") as srv, LinkProxy(srv.address, rate_bits_per_s=1e9, latency_s=0.02) as proxy:
        with socket.create_connection(proxy.address) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            for _ in range(5):
                s.sendall(b"rtt")
                assert recv_all(s, 3) == b"rtt"
            rtt = (time.perf_counter() - t0) / 5
            sender = threading.Thread(target=lambda: (s.sendall(data), s.shutdown(socket.SHUT_WR)))
            sender.start()
            back = recv_all(s, len(data) + 1)
            sender.join()
    assert 0.04 <= rtt <= 0.2, rtt
    assert back == data


# --------------------------------------------------------------------------- lifecycle and safety

def test_stop_with_open_connections_does_not_hang():
    with Server("echo") as srv:
        proxy = LinkProxy(srv.address, rate_bits_per_s=1e6).start()  # 1 Mbit/s: 1 MB would take 8 s
        idle = socket.create_connection(proxy.address)
        busy = socket.create_connection(proxy.address)
        busy.settimeout(10)
        feeder = threading.Thread(target=lambda: _send_quietly(busy, b"\0" * (1 << 20)))
        feeder.start()
        idle.sendall(b"hi")
        assert recv_all(idle, 2) == b"hi"
        time.sleep(0.2)
        t0 = time.perf_counter()
        proxy.stop()
        assert time.perf_counter() - t0 < 2.0
        assert not proxy.running
        idle.settimeout(5)
        assert idle.recv(10) == b""  # the proxy closed its side
        feeder.join(10)
        assert not feeder.is_alive()
        idle.close()
        busy.close()


def _send_quietly(s, data):
    try:
        s.sendall(data)
    except OSError:
        pass


def test_non_loopback_addresses_are_refused():
    for target in [("10.0.0.1", 6379), ("0.0.0.0", 6379), ("192.168.1.1", 80), ("8.8.8.8", 53),
                   ("example.com", 80), ("::", 80), ("::ffff:10.0.0.1", 80)]:
        with pytest.raises(ValueError, match="loopback"):
            LinkProxy(target)
    with pytest.raises(ValueError, match="loopback"):
        LinkProxy(("127.0.0.1", 6379), listen=("0.0.0.0", 0))
    with pytest.raises(ValueError):
        LinkProxy(("127.0.0.1", 0))  # a target needs a port
    assert LinkProxy(("localhost", 6379)).target == ("127.0.0.1", 6379)
    assert LinkProxy(("127.0.0.2", 6379)).target == ("127.0.0.2", 6379)


def test_url_for():
    with Server("echo") as srv, LinkProxy(srv.address) as proxy:
        host, port = proxy.address
        assert proxy.url_for(f"redis://127.0.0.1:{srv.address[1]}/3") == f"redis://{host}:{port}/3"
        assert proxy.url_for(f"redis://u:pw@localhost:{srv.address[1]}/0") == f"redis://u:pw@{host}:{port}/0"
        with pytest.raises(ValueError):
            proxy.url_for("redis://127.0.0.1:1/0")


def test_target_down_closes_the_client():
    port = socket.create_server(("127.0.0.1", 0))
    addr = port.getsockname()[:2]
    port.close()  # nothing listens there now
    with LinkProxy(addr) as proxy:
        with socket.create_connection(proxy.address) as s:
            s.settimeout(5)
            try:
                assert s.recv(10) == b""
            except ConnectionResetError:
                pass
    assert proxy.failed_connects == 1


def test_module_doctest():
    result = doctest.testmod(link_proxy)
    assert result.attempted > 0 and result.failed == 0


def test_cli_prints_address_and_stats():
    cli = [sys.executable, "-m", "kvz.benchmarks.link_proxy"]
    with Server("echo") as srv:
        p = subprocess.Popen(cli + ["--target", f"127.0.0.1:{srv.address[1]}", "--rate", "1g"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            host, port = p.stdout.readline().strip().rsplit(":", 1)
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"through the cli")
                assert recv_all(s, 15) == b"through the cli"
            p.terminate()  # SIGTERM: stops cleanly and prints the counters
            out, err = p.communicate(timeout=20)
        finally:
            if p.poll() is None:
                p.kill()
                p.communicate()
        assert p.returncode == 0, err
        stats = json.loads(out.strip().splitlines()[-1])
        assert stats["bytes_up"] == stats["bytes_down"] == 15 and stats["rate_bits_per_s"] == 1e9
        timed = subprocess.run(cli + ["--target", f"127.0.0.1:{srv.address[1]}", "--rate", "100m", "--duration",
                                      "0.1"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert timed.returncode == 0, timed.stderr
    assert timed.stdout.splitlines()[0].startswith("127.0.0.1:")
    assert json.loads(timed.stdout.splitlines()[-1])["connections"] == 0
    bad = subprocess.run(cli + ["--target", "10.1.2.3:6379"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "loopback" in bad.stderr


# --------------------------------------------------------------------------- a real redis-server behind it

def test_redis_set_get_through_the_proxy():
    require_redis()
    import redis

    value = os.urandom(4 << 20)
    with RedisServer() as srv, LinkProxy((srv.host, srv.port), rate_bits_per_s=1e9) as proxy:
        r = redis.Redis.from_url(proxy.url_for(srv.url))
        try:
            assert r.set("kvz:link-proxy", value)
            assert r.get("kvz:link-proxy") == value
        finally:
            r.close()
    assert proxy.bytes_up > len(value) and proxy.bytes_down > len(value)
