"""A loopback TCP proxy with a token-bucket bandwidth limit: a store "behind a 1 Gbit/s link".

The vLLM benchmark puts its Redis store behind :class:`LinkProxy` to model a remote KV store on a
1 Gbit/s or 10 Gbit/s network: every byte in either direction passes a token bucket of
``rate_bits_per_s``, one bucket per direction *per proxy* (shared by all its connections: the proxy
models one link, so two concurrent transfers share its rate), plus an optional one-way delay
``latency_s`` per direction.

>>> import socket, threading
>>> from kvz.benchmarks.link_proxy import LinkProxy
>>> srv = socket.create_server(("127.0.0.1", 0))          # a one-connection echo server
>>> def echo():
...     conn, _ = srv.accept()
...     with conn:
...         while data := conn.recv(65536):
...             conn.sendall(data)
>>> t = threading.Thread(target=echo)
>>> t.start()
>>> with LinkProxy(srv.getsockname(), rate_bits_per_s=100e6) as proxy:
...     with socket.create_connection(proxy.address) as s:
...         s.sendall(b"hello")
...         s.recv(64)
...     proxy.url_for("redis://127.0.0.1:%d/0" % srv.getsockname()[1]) == "redis://%s:%d/0" % proxy.address
b'hello'
True
>>> t.join(); srv.close()
>>> proxy.bytes_up, proxy.bytes_down
(5, 5)

From the shell (prints the listening address on the first line, then on exit one JSON line of
counters)::

    python -m kvz.benchmarks.link_proxy --target 127.0.0.1:6379 --rate 1g [--listen 127.0.0.1:0] [--duration S]
    python -m kvz.benchmarks.link_proxy --measure [--rate 10g]     # what this machine sustains

Design: two threads per connection (one per direction; with ``latency_s > 0`` four, a reader and a
delayed writer per direction), 1 MiB ``recv_into`` buffers, ``sendall``, ``TCP_NODELAY`` on both
sides, and a FIN in one direction is forwarded as a half-close. The bucket allows debt: a chunk
reserves its bytes and its sender sleeps until the link would have carried them, so the last byte
arrives when it would on the modelled link; reads are capped at the burst size. The default burst is
the larger of 64 KiB and 1 ms of rate. ``throttled_s_up`` / ``throttled_s_down`` sum the senders'
sleeps (over connections: several waiting at once add up).

Measured on the 2-core Xeon dev machine (``--measure``: one connection, 2 GiB, the Python load
generator and sink in the same process as the proxy and on the same two cores; load average 0.6-1.0
from other work): unthrottled 10.3-12.9 Gbit/s in a fresh process (repeated runs inside one process ranged
from 6.6 to 25 Gbit/s, the low ones on a busier machine), so 10 Gbit/s is near this machine's ceiling:
with the rate set to 10g it achieved 9.0-9.95 Gbit/s (0.5-11% slower than nominal). At 1 Gbit/s a
64 MB transfer took 1.004-1.007x its nominal 0.512 s; at 100 Mbit/s an 8 MB one 0.995-0.998x its
0.640 s (the 64 KiB burst is a head start). Check with ``--measure`` before trusting a 10 Gbit/s
figure on another or a busier machine.

Safety: the proxy only ever binds and connects to loopback addresses (127.0.0.0/8, ``::1`` or the
name ``localhost``, which is taken as 127.0.0.1 without a lookup); anything else is a ValueError.
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import socket
import sys
import threading
import time
from urllib.parse import urlsplit, urlunsplit

__all__ = ["LinkProxy", "TokenBucket", "parse_rate", "parse_address", "loopback_address", "measure_throughput"]

from .link_shaping import (  # noqa: F401 - parse_address, parse_rate: this module's names too
    _THREAD_PREFIX,
    BUFSIZE,
    MIN_BURST,
    TokenBucket,
    _Conn,
    _DelayLine,
    loopback_address,
    parse_address,
    parse_rate,
)


class LinkProxy:
    """Forward TCP connections from ``listen`` to ``target`` through a ``rate_bits_per_s`` link.

    ``rate_bits_per_s=None`` (or 0, or inf) forwards unthrottled. ``burst_bytes`` defaults to the larger
    of 64 KiB and 1 ms of rate. ``latency_s`` delays each direction by that much (one way). Use as a
    context manager or with :meth:`start` / :meth:`stop`; :attr:`address` is the ``(host, port)`` it
    listens on (``listen``'s port 0 picks a free one). Counters: :attr:`bytes_up` (client to target),
    :attr:`bytes_down`, :attr:`throttled_s_up`, :attr:`throttled_s_down`, :attr:`connections`; all of
    them in :meth:`stats`. Both addresses must be loopback (ValueError otherwise).
    """

    def __init__(self, target, rate_bits_per_s: float | None = 1e9, burst_bytes: int | None = None,
                 latency_s: float = 0.0, listen=("127.0.0.1", 0), *, bufsize: int = BUFSIZE):
        self.target = loopback_address(target, "target", allow_port_zero=False)
        self.listen = loopback_address(listen, "listen")
        self.rate_bits_per_s = parse_rate(rate_bits_per_s)
        if not latency_s >= 0 or math.isinf(latency_s):
            raise ValueError(f"latency_s must be a finite number >= 0, got {latency_s!r}")
        self.latency_s = float(latency_s)
        if bufsize < 1:
            raise ValueError("bufsize must be >= 1")
        self.bufsize = int(bufsize)
        if self.rate_bits_per_s is None:
            self.burst_bytes = None if burst_bytes is None else int(burst_bytes)
        else:
            default = max(MIN_BURST, int(self.rate_bits_per_s / 8 * 1e-3))
            self.burst_bytes = default if burst_bytes is None else int(burst_bytes)
            if self.burst_bytes < 1:
                raise ValueError("burst_bytes must be >= 1")
        self.bytes_up = 0
        self.bytes_down = 0
        self.throttled_s_up = 0.0
        self.throttled_s_down = 0.0
        self.connections = 0
        self.failed_connects = 0
        self._buckets: dict[str, TokenBucket | None] = {"up": None, "down": None}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: set[_Conn] = set()
        self._address: tuple[str, int] | None = None

    # ---- lifecycle

    @property
    def address(self) -> tuple[str, int]:
        if self._address is None:
            raise RuntimeError("LinkProxy has not been started")
        return self._address

    @property
    def running(self) -> bool:
        return self._accept_thread is not None and self._accept_thread.is_alive()

    def start(self) -> LinkProxy:
        if self._listener is not None:
            return self
        if self.rate_bits_per_s is not None:
            for d in ("up", "down"):
                self._buckets[d] = TokenBucket(self.rate_bits_per_s / 8, self.burst_bytes)
        self._stopping.clear()
        family = socket.AF_INET6 if ":" in self.listen[0] else socket.AF_INET
        ls = socket.socket(family, socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(self.listen)
            ls.listen(128)
            ls.settimeout(0.25)  # accept() wakes for stop() even where shutdown() does not wake it
        except BaseException:
            ls.close()
            raise
        self._listener = ls
        self._address = ls.getsockname()[:2]
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"{_THREAD_PREFIX}-accept",
                                               daemon=True)
        self._accept_thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listener and every open connection, and join all threads."""
        self._stopping.set()
        ls, self._listener = self._listener, None
        if ls is not None:
            try:
                ls.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
            self._accept_thread = None
        if ls is not None:
            ls.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.abort()
        deadline = time.monotonic() + timeout
        for c in conns:
            for t in c.threads:
                t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for c in conns for t in c.threads if t.is_alive()]
        for c in conns:
            self._close_conn(c)
        if alive:
            raise RuntimeError(f"LinkProxy.stop: threads still running after {timeout} s: {alive}")

    close = stop

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- helpers

    def url_for(self, url: str) -> str:
        """``url`` (``redis://[user:pw@]host:port/db``, any scheme) with its host and port replaced by the
        proxy's; the URL must point at the proxy's target (ValueError otherwise)."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
        try:
            same = loopback_address((host, port), "url") == self.target
        except ValueError:
            same = False
        if not same:
            raise ValueError(f"{url!r} does not point at the proxy's target {self.target[0]}:{self.target[1]}")
        h, p = self.address
        netloc = (f"[{h}]" if ":" in h else h) + f":{p}"
        if "@" in parts.netloc:
            netloc = parts.netloc.rsplit("@", 1)[0] + "@" + netloc
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    def stats(self) -> dict:
        with self._lock:
            return {"listen": f"{self._address[0]}:{self._address[1]}" if self._address else None,
                    "target": f"{self.target[0]}:{self.target[1]}", "rate_bits_per_s": self.rate_bits_per_s,
                    "burst_bytes": self.burst_bytes, "latency_s": self.latency_s,
                    "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                    "throttled_s_up": self.throttled_s_up, "throttled_s_down": self.throttled_s_down,
                    "connections": self.connections, "open_connections": len(self._conns),
                    "failed_connects": self.failed_connects}

    # ---- internals

    def _accept_loop(self) -> None:
        ls = self._listener
        while not self._stopping.is_set():
            try:
                client, _ = ls.accept()
            except TimeoutError:
                continue
            except OSError:
                break
            if self._stopping.is_set():
                client.close()
                break
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=5.0)
                upstream.settimeout(None)
            except OSError:
                with self._lock:
                    self.failed_connects += 1
                client.close()
                continue
            for s in (client, upstream):
                try:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            self._spawn(_Conn(client, upstream))

    def _spawn(self, conn: _Conn) -> None:
        client, upstream = conn.socks
        n = self.connections
        for direction, src, dst in (("up", client, upstream), ("down", upstream, client)):
            if self.latency_s > 0:
                limit = max(4 << 20, 2 * int((self.rate_bits_per_s or 1e10) / 8 * self.latency_s))
                line = _DelayLine(limit)
                conn.lines.append(line)
                conn.threads.append(threading.Thread(target=self._read_delayed, args=(conn, src, line, direction),
                                                     name=f"{_THREAD_PREFIX}-{n}-{direction}-read", daemon=True))
                conn.threads.append(threading.Thread(target=self._write_delayed, args=(conn, dst, line, direction),
                                                     name=f"{_THREAD_PREFIX}-{n}-{direction}-write", daemon=True))
            else:
                conn.threads.append(threading.Thread(target=self._pump, args=(conn, src, dst, direction),
                                                     name=f"{_THREAD_PREFIX}-{n}-{direction}", daemon=True))
        with self._lock:
            self.connections += 1
            self._conns.add(conn)
        if self._stopping.is_set():  # stop() may have taken its snapshot of _conns already
            with self._lock:
                self._conns.discard(conn)
            for s in conn.socks:
                s.close()
            return
        for t in conn.threads:
            t.start()

    def _wait_tokens(self, direction: str, n: int) -> bool:
        """Take n bytes from the direction's bucket, sleeping as needed; False if the proxy stopped meanwhile."""
        bucket = self._buckets[direction]
        if bucket is None:
            return True
        wait = bucket.reserve(n)
        if wait > 0:
            if self._stopping.wait(wait):
                return False
            with self._lock:
                if direction == "up":
                    self.throttled_s_up += wait
                else:
                    self.throttled_s_down += wait
        return True

    def _count(self, direction: str, n: int) -> None:
        with self._lock:
            if direction == "up":
                self.bytes_up += n
            else:
                self.bytes_down += n

    def _chunk(self) -> int:
        return self.bufsize if self.burst_bytes is None else max(1, min(self.bufsize, self.burst_bytes))

    def _pump(self, conn: _Conn, src: socket.socket, dst: socket.socket, direction: str) -> None:
        buf = bytearray(self._chunk())
        view = memoryview(buf)
        ok = True
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                if not self._wait_tokens(direction, n):
                    ok = False
                    break
                dst.sendall(view[:n])
                self._count(direction, n)
        except OSError:
            ok = False
        self._direction_done(conn, dst, ok)

    def _read_delayed(self, conn: _Conn, src: socket.socket, line: _DelayLine, direction: str) -> None:
        chunk = self._chunk()
        try:
            while True:
                data = src.recv(chunk)
                if not data:
                    line.put(None, 0)  # EOF travels down the line too
                    return
                if not self._wait_tokens(direction, len(data)):
                    break
                if not line.put((time.monotonic() + self.latency_s, data), len(data)):
                    break
        except OSError:
            pass
        conn.abort()

    def _write_delayed(self, conn: _Conn, dst: socket.socket, line: _DelayLine, direction: str) -> None:
        ok = True
        try:
            while True:
                item = line.get()
                if item is None:
                    ok = not line.closed
                    break
                due, data = item
                delay = due - time.monotonic()
                if delay > 0 and self._stopping.wait(delay):
                    ok = False
                    break
                dst.sendall(data)
                self._count(direction, len(data))
        except OSError:
            ok = False
        self._direction_done(conn, dst, ok)

    def _direction_done(self, conn: _Conn, dst: socket.socket, ok: bool) -> None:
        if ok:
            try:
                dst.shutdown(socket.SHUT_WR)  # forward the half-close
            except OSError:
                ok = False
        if not ok:
            conn.abort()
        with conn.lock:
            conn.open_dirs -= 1
            last = conn.open_dirs == 0
        if last:
            self._close_conn(conn)

    def _close_conn(self, conn: _Conn) -> None:
        for line in conn.lines:
            line.close()
        for s in conn.socks:
            try:
                s.close()
            except OSError:
                pass
        with self._lock:
            self._conns.discard(conn)


# --------------------------------------------------------------------------- measuring

def measure_throughput(rate_bits_per_s: float | None = None, nbytes: int = 512 << 20, *,
                       latency_s: float = 0.0) -> dict:
    """Push ``nbytes`` through a LinkProxy to a sink on loopback (all in this process) and time it.

    Returns ``{"rate_bits_per_s", "nbytes", "seconds", "achieved_bits_per_s", "nominal_seconds"}``; the
    time runs from the first byte sent to the sink's acknowledgement of the last one.
    """
    sink = socket.create_server(("127.0.0.1", 0))
    got = {}

    def serve():
        conn, _ = sink.accept()
        with conn:
            buf = bytearray(BUFSIZE)
            total = 0
            while n := conn.recv_into(buf):
                total += n
            got["n"] = total
            conn.sendall(b"k")

    t = threading.Thread(target=serve, name=f"{_THREAD_PREFIX}-measure-sink", daemon=True)
    t.start()
    payload = memoryview(bytearray(BUFSIZE))
    try:
        with LinkProxy(sink.getsockname()[:2], rate_bits_per_s=rate_bits_per_s, latency_s=latency_s) as proxy:
            with socket.create_connection(proxy.address) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t0 = time.perf_counter()
                left = nbytes
                while left > 0:
                    k = min(left, len(payload))
                    s.sendall(payload[:k])
                    left -= k
                s.shutdown(socket.SHUT_WR)
                ack = s.recv(1)
                seconds = time.perf_counter() - t0
    finally:
        t.join(10)
        sink.close()
    if ack != b"k" or got.get("n") != nbytes:
        raise RuntimeError(f"measure_throughput: the sink got {got.get('n')} of {nbytes} bytes")
    rate = parse_rate(rate_bits_per_s)
    return {"rate_bits_per_s": rate, "nbytes": nbytes, "seconds": seconds,
            "achieved_bits_per_s": nbytes * 8 / seconds,
            "nominal_seconds": None if rate is None else nbytes * 8 / rate}


# --------------------------------------------------------------------------- CLI

def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvz.benchmarks.link_proxy", description=__doc__.split("\n")[0])
    p.add_argument("--target", help="host:port to forward to (loopback only), e.g. 127.0.0.1:6379")
    p.add_argument("--rate", default="1g", help="link rate in bits/s, suffixes k/m/g (decimal); 'inf' for none "
                                                "(default 1g)")
    p.add_argument("--listen", default="127.0.0.1:0", help="host:port to listen on (loopback only; default "
                                                          "127.0.0.1:0, a free port)")
    p.add_argument("--burst", type=int, default=None, help="bucket size in bytes (default max(64 KiB, 1 ms of rate))")
    p.add_argument("--latency", type=float, default=0.0, help="one-way delay per direction, seconds (default 0)")
    p.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: run until "
                                                               "interrupted)")
    p.add_argument("--measure", action="store_true", help="instead: time a transfer through the proxy to an "
                                                          "in-process sink and print the achieved rate")
    p.add_argument("--bytes", type=int, default=512 << 20, help="--measure: bytes to send (default 512 MiB)")
    a = p.parse_args(argv)
    try:
        rate = parse_rate(a.rate)
        if a.measure:
            r = measure_throughput(rate, a.bytes, latency_s=a.latency)
            print(json.dumps(r), flush=True)
            return 0
        if not a.target:
            p.error("--target is required (or --measure)")
        proxy = LinkProxy(parse_address(a.target), rate, a.burst, a.latency, parse_address(a.listen))
    except ValueError as e:
        p.error(str(e))
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    with proxy:
        host, port = proxy.address
        print(f"[{host}]:{port}" if ":" in host else f"{host}:{port}", flush=True)
        done.wait(a.duration)
    print(json.dumps(proxy.stats()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
