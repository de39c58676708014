"""The parts of :mod:`kvz.benchmarks.link_proxy` below the proxy: loopback-only addresses, link rates
(``"1g"``, ``"10 Gbit/s"``), the token bucket that meters a direction, the delay line of a one-way
latency and one proxied connection."""
from __future__ import annotations

import collections
import ipaddress
import math
import re
import socket
import threading
import time

BUFSIZE = 1 << 20
MIN_BURST = 64 << 10
_THREAD_PREFIX = "kvz-link-proxy"


# --------------------------------------------------------------------------- addresses and rates

def loopback_address(addr, what: str = "address", *, allow_port_zero: bool = True) -> tuple[str, int]:
    """``(host, port)`` checked to be a loopback IP literal (or ``localhost`` -> 127.0.0.1); ValueError else."""
    try:
        host, port = addr[0], addr[1]
    except (TypeError, IndexError, KeyError):
        raise ValueError(f"{what} must be a (host, port) pair, got {addr!r}") from None
    host = str(host).strip("[]")
    if host.lower() == "localhost":
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{what} host {host!r} is not a loopback IP address: the link proxy only binds and "
                         f"connects to 127.0.0.0/8, ::1 or 'localhost' (no name lookups)") from None
    if not ip.is_loopback:
        raise ValueError(f"{what} host {host!r} is not a loopback address: the link proxy only binds and "
                         f"connects to 127.0.0.0/8, ::1 or 'localhost'")
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise ValueError(f"{what} port {port!r} is not an integer") from None
    if not (0 if allow_port_zero else 1) <= port <= 65535:
        raise ValueError(f"{what} port {port} is out of range")
    return host, port


def parse_address(text: str) -> tuple[str, int]:
    """``"127.0.0.1:6379"``, ``"localhost:6379"`` or ``"[::1]:6379"`` -> ``(host, port)`` (not yet checked)."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", text.strip())
    if not m:
        raise ValueError(f"address {text!r} is not host:port (or [v6]:port)")
    host = m.group(1) or m.group(3)
    return host, int(m.group(2) or m.group(4))


_RATE_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(text) -> float | None:
    """A rate in bits/s: ``"1g"`` -> 1e9, ``"100m"``, ``"512k"``, ``"2.5G"``, ``"1e9"``; the suffixes are
    decimal (SI, as link speeds are) and may be followed by ``bit``/``bps``/``b``. ``"inf"``, ``"none"``
    or ``"0"`` mean no limit (None)."""
    if text is None:
        return None
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = str(text).strip().lower()
        if s in ("inf", "none", "unlimited", "off"):
            return None
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmg]?)(?:bit/s|bit|bps|b)?", s)
        if not m:
            raise ValueError(f"rate {text!r} is not a number with an optional k/m/g suffix (bits/s)")
        value = float(m.group(1)) * _RATE_SUFFIX[m.group(2)]
    if math.isnan(value) or value < 0:
        raise ValueError(f"rate {text!r} must be positive")
    if value == 0 or math.isinf(value):
        return None
    return value


# --------------------------------------------------------------------------- token bucket

class TokenBucket:
    """A token bucket in bytes, ``rate`` bytes/s, holding at most ``burst`` bytes; thread-safe.

    :meth:`reserve` takes ``n`` bytes at once, going into debt if there are fewer tokens, and returns how
    long the caller must wait before sending them (0 when they were there), so concurrent senders queue
    in the order they reserved.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float):
        if not rate_bytes_per_s > 0 or not burst_bytes > 0:
            raise ValueError("rate and burst must be positive")
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst_bytes)
        self._tokens = self.burst
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            self._tokens -= n
            return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class _DelayLine:
    """FIFO of (due time, bytes) between a direction's reader and writer, bounded in bytes."""

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self._q: collections.deque = collections.deque()
        self._bytes = 0
        self._cond = threading.Condition()
        self.closed = False

    def put(self, item, n: int) -> bool:
        with self._cond:
            while self._bytes + n > self.limit and self._q and not self.closed:
                self._cond.wait()
            if self.closed:
                return False
            self._q.append((item, n))
            self._bytes += n
            self._cond.notify_all()
            return True

    def get(self):
        with self._cond:
            while not self._q and not self.closed:
                self._cond.wait()
            if self.closed:
                return None
            item, n = self._q.popleft()
            self._bytes -= n
            self._cond.notify_all()
            return item

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


# --------------------------------------------------------------------------- the proxy

class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.socks = (client, upstream)
        self.lines: list[_DelayLine] = []
        self.threads: list[threading.Thread] = []
        self.open_dirs = 2
        self.lock = threading.Lock()
        self.aborted = False

    def abort(self) -> None:
        """Tear both directions down (an error on one side, or the proxy stopping)."""
        with self.lock:
            self.aborted = True
        for line in self.lines:
            line.close()
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
