"""A chunk store in a local directory: one file per entry, safe for many processes at once."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time

from . import record
from .base import BlobRanges, ChunkBackend
from .errors import CorruptEntryError, ForeignEntryError, StoreError, StoreUnavailableError, StoreWarning
from .record import Entry

try:  # POSIX advisory locks; elsewhere the store still works, without the eviction/drop lock
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

SUFFIX = ".kvc"
_TMP_PREFIX = ".tmp-"
_LOCK_NAME = ".lock"
_STALE_TMP_S = 3600.0
STATS_NAME = ".stats.json"


@contextlib.contextmanager
def warnings_suppressed():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
_UTIME_FD = os.utime in os.supports_fd


class DirectoryBackend(ChunkBackend):
    """A :class:`ChunkBackend` keeping each entry in its own file under ``path``.

    File name: ``sha256(utf-8 key).hexdigest() + ".kvc"`` (any key; lowercase hex is safe on every
    filesystem, case-insensitive ones included). The key is stored inside the file as well.

    Atomicity: a put writes a temporary file in the same directory, fsyncs it, sets its mtime,
    then ``os.replace``-s it onto the final name (and fsyncs the directory), so a reader sees the
    old entry or the new one, never a mix. A reader opens the file once and reads that inode to the
    end: if it is replaced or evicted meanwhile (POSIX keeps an unlinked inode alive) it still reads
    one whole version, and the checksum check turns anything else into a dropped entry and a miss.

    Recency: every put and every successful get sets the file's mtime to the current time (ns,
    made strictly increasing within a process), so LRU order is shared by all processes with no
    index to keep consistent. ``policy="importance"`` reads each entry's importance from its header.

    Budget: after its own put, a process takes an exclusive ``flock`` on ``path/.lock``, scans the
    directory and deletes the lowest-scoring entries until the sum of file sizes fits (never the
    entry it just wrote). Writers hold the same lock shared while they rename into place, and the
    evictor re-checks each victim's inode and mtime just before unlinking, so it never deletes an
    entry written or read after its scan (a get that touches the file a moment after that re-check
    has already read its data). Corrupt files are dropped under the exclusive lock, only if the
    name still holds the inode found corrupt.

    Known limits: each budgeted put scans the directory (O(entries)); the store may exceed the
    budget by the entries other processes are writing at the same moment; LRU order needs mtimes
    settable by the process (owner of the files) and is only as fine as the filesystem's timestamps
    (ns on ext4/xfs/tmpfs, 2 s on FAT); locks need POSIX ``flock`` (a local filesystem, not NFS).
    The counters in ``stats()`` are per object; ``entries``/``bytes`` come from a directory scan.

    Example:

    >>> import tempfile
    >>> from kvz.integrations.kvstore import DirectoryBackend
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with DirectoryBackend(d, budget_bytes=1 << 20) as store:
    ...         store.put("9f2c", b"kv bytes", meta={"tokens": 16})
    ...         store.get("9f2c"), store.get_entry("9f2c").meta, store.get("missing")
    ...         store.stats()["entries"], store.stats()["hits"]
    True
    (b'kv bytes', {'tokens': 16}, None)
    (1, 2)
    """

    kind = "directory"

    def __init__(self, path, budget_bytes: int | None = None, policy: str = "lru", *,
                 half_life_s: float = 3600.0, fsync: bool = True):
        super().__init__(budget_bytes, policy, half_life_s)
        try:
            self.path = os.path.abspath(os.fspath(path))
        except TypeError:
            raise StoreError(f"path must be a str or os.PathLike, got {type(path).__name__}") from None
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise StoreError(f"{self.path} exists and is not a directory")
        os.makedirs(self.path, exist_ok=True)
        self.fsync = bool(fsync)
        self._last_ns = 0
        self._imp_cache: dict[str, tuple[int, float]] = {}  # file name -> (inode, importance)
        self._key_cache: dict[str, str] = {}  # file name -> key (a name always holds the same key)

    # ---- helpers ------------------------------------------------------------------------------
    def _name(self, key: str) -> str:
        return hashlib.sha256(key.encode("utf-8")).hexdigest() + SUFFIX

    def entry_path(self, key: str) -> str:
        """The file that holds ``key``'s entry (whether or not it exists)."""
        record.key_bytes(key)
        return os.path.join(self.path, self._name(key))

    def _now_ns(self) -> int:
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        return self._last_ns

    @contextlib.contextmanager
    def _locked(self, exclusive: bool):
        """flock on path/.lock; a fresh open file per acquisition, so threads and forks exclude too."""
        if fcntl is None:  # pragma: no cover
            yield
            return
        fd = os.open(os.path.join(self.path, _LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _fsync_dir(self):
        if not self.fsync or not hasattr(os, "O_DIRECTORY"):
            return
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _scan(self) -> list[tuple[str, int, int, int]]:
        """(name, inode, size, mtime_ns) of every entry file; removes temp files of crashed writers."""
        out = []
        now = time.time()
        with os.scandir(self.path) as it:
            for de in it:
                try:
                    if de.name.endswith(SUFFIX) and not de.name.startswith("."):
                        st = de.stat(follow_symlinks=False)
                        out.append((de.name, st.st_ino, st.st_size, st.st_mtime_ns))
                    elif de.name.startswith(_TMP_PREFIX):
                        if now - de.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S:
                            os.unlink(de.path)
                except FileNotFoundError:
                    continue
        return out

    def _importance_of(self, name: str, ino: int) -> float:
        hit = self._imp_cache.get(name)
        if hit is not None and hit[0] == ino:
            return hit[1]
        try:
            with open(os.path.join(self.path, name), "rb") as f:
                _, _, _, imp = record.parse_head(f.read(record.HEADER_SIZE))
        except (OSError, CorruptEntryError):
            return 0.0  # unreadable or corrupt: first to go
        self._imp_cache[name] = (ino, imp)
        return imp

    # ---- backend operations ---------------------------------------------------------------------
    def _put(self, key: str, parts: list, size: int, importance: float) -> bool:
        final = os.path.join(self.path, self._name(key))
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.path)
            with open(fd, "wb") as f:
                for p in parts:
                    f.write(p)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
                t = self._now_ns()
                if _UTIME_FD:
                    os.utime(f.fileno(), ns=(t, t))
                ino = os.fstat(f.fileno()).st_ino
            if not _UTIME_FD:  # pragma: no cover
                os.utime(tmp, ns=(t, t))
            with self._locked(exclusive=False):
                os.replace(tmp, final)
            tmp = None
            self._fsync_dir()
            self._imp_cache[os.path.basename(final)] = (ino, importance)
        except OSError as e:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self._failed(f"put into {self.path}", e)
            return False
        if self.budget_bytes is not None:
            try:
                self._evict(protect=(os.path.basename(final), ino))
            except OSError as e:  # the entry is stored; only the budget could not be enforced now
                self._failed(f"eviction in {self.path}", e)
                return True
        self._succeeded()
        return True

    def _evict(self, protect: tuple[str, int]) -> None:
        assert self.budget_bytes is not None
        with self._locked(exclusive=True):
            files = self._scan()
            total = sum(f[2] for f in files)
            if total <= self.budget_bytes:
                return
            if self.policy == "lru":
                order = sorted(files, key=lambda f: (f[3], f[0]))
            else:
                def score(f):
                    base, rate = self._score_parts(f[2], self._importance_of(f[0], f[1]))
                    return (base + rate * f[3] * 1e-9, f[3], f[0])
                order = sorted(files, key=score)
            for name, ino, size, mtime in order:
                if total <= self.budget_bytes:
                    break
                if (name, ino) == protect:
                    continue
                path = os.path.join(self.path, name)
                try:
                    st = os.stat(path)
                    if st.st_ino != ino:  # replaced since the scan (cannot happen under the lock)
                        total += st.st_size - size
                        continue
                    if st.st_mtime_ns != mtime:  # read since the scan: in use, keep it
                        continue
                    os.unlink(path)
                except FileNotFoundError:  # deleted by someone else: it no longer counts
                    total -= size
                    continue
                total -= size
                self._counters["evictions"] += 1
                self._imp_cache.pop(name, None)

    def _get(self, key: str) -> Entry | None:
        path = os.path.join(self.path, self._name(key))
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            return None
        except OSError as e:
            self._failed(f"get from {self.path}", e)
            return None
        with f:
            try:
                entry = record.decode_from(f.read, os.fstat(f.fileno()).st_size, expect_key=key)
            except ForeignEntryError as e:
                self._foreign(key, e)
                return None
            except CorruptEntryError:
                self._drop_corrupt(path, os.fstat(f.fileno()))
                return None
            except OSError as e:
                self._failed(f"get from {self.path}", e)
                return None
            t = self._now_ns()
            with contextlib.suppress(OSError):  # LRU touch of the inode just read
                if _UTIME_FD:
                    os.utime(f.fileno(), ns=(t, t))
                else:  # pragma: no cover
                    os.utime(path, ns=(t, t))
        self._succeeded()
        return entry

    def open_blob(self, key: str) -> BlobRanges | None:
        """The entry's file, held open for ``pread`` (a later replacement of the entry does not
        change what this reader sees: the file it opened stays as it was)."""
        self._check_open()
        path = self.entry_path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._counters["misses"] += 1
            return None
        except OSError as e:
            self._failed(f"get from {self.path}", e)
            return None
        try:
            st = os.fstat(fd)
            prefix = os.pread(fd, record.HEADER_SIZE + record.MAX_KEY_BYTES + 4096, 0)
            klen, mlen, _, _ = record.parse_head(prefix)
            if record.HEADER_SIZE + klen + mlen > len(prefix):
                prefix = os.pread(fd, record.HEADER_SIZE + klen + mlen, 0)
            base, blen, meta, imp = record.parse_prefix(prefix, st.st_size, expect_key=key)
        except ForeignEntryError as e:
            os.close(fd)
            self._foreign(key, e)
            self._counters["misses"] += 1
            return None
        except CorruptEntryError:
            os.close(fd)
            self._drop_corrupt(path, st)
            self._counters["misses"] += 1
            return None
        except OSError as e:
            os.close(fd)
            self._failed(f"get from {self.path}", e)
            return None
        self._counters["hits"] += 1
        self._succeeded()
        return BlobRanges(key, blen, meta, imp, lambda off, n: os.pread(fd, n, base + off), lambda: os.close(fd))

    def _foreign(self, key: str, exc: BaseException) -> None:
        """A record of another store format: a miss and a warning; the file stays (its writer reads it)."""
        import warnings

        self._counters["foreign"] += 1
        warnings.warn(StoreWarning(f"DirectoryBackend {self.path}: entry {key[:40]!r} refused ({exc}): written by "
                                   f"another kvz store format; a miss"), stacklevel=4)

    def _drop_corrupt(self, path: str, st: os.stat_result) -> None:
        self._counters["corrupt_dropped"] += 1
        with contextlib.suppress(OSError), self._locked(exclusive=True):
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)

    def contains(self, key: str) -> bool:
        self._check_open()
        return os.path.isfile(self.entry_path(key))

    def delete(self, key: str) -> bool:
        self._check_open()
        try:
            os.unlink(self.entry_path(key))
        except FileNotFoundError:
            return False
        return True

    def _read_key(self, name: str) -> str | None:
        key = self._key_cache.get(name)
        if key is not None:
            return key
        try:
            with open(os.path.join(self.path, name), "rb") as f:
                head = f.read(record.HEADER_SIZE)
                klen, _, _, _ = record.parse_head(head)
                key = f.read(klen).decode("utf-8")
        except (OSError, CorruptEntryError, UnicodeDecodeError):
            return None
        if self._name(key) != name:
            return None
        self._key_cache[name] = key
        return key

    def keys(self) -> list[str]:
        self._check_open()
        try:
            names = [f[0] for f in self._scan()]
        except OSError as e:
            self._failed(f"listing {self.path}", e)
            return []
        live = set(names)
        for stale in [n for n in self._key_cache if n not in live]:
            del self._key_cache[stale]
        return [k for k in map(self._read_key, names) if k is not None]

    def clear(self) -> None:
        self._check_open()
        with self._locked(exclusive=True):
            for name, *_ in self._scan():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.path, name))
        self._imp_cache.clear()
        self._key_cache.clear()

    def _usage(self) -> dict:
        try:
            files = self._scan()
        except OSError as e:
            self._failed(f"stats of {self.path}", e)
            return {"entries": None, "bytes": None, "path": self.path}
        return {"entries": len(files), "bytes": sum(f[2] for f in files), "path": self.path}

    # ---- whole-store statistics and garbage collection ------------------------------------------
    _FLUSHED = {"hits": "hits", "misses": "misses", "puts": "puts", "corrupt_dropped": "corrupt",
                "foreign": "foreign", "evictions": "evicted"}

    def _flush_counters(self) -> dict:
        """Add this object's counters (since the last flush) to ``path/.stats.json`` (every process's
        counters, for ``kvz store stats``) and return the file's totals."""
        done = getattr(self, "_flushed", None) or dict.fromkeys(self._FLUSHED, 0)
        stats_path = os.path.join(self.path, STATS_NAME)
        if all(self._counters[k] == done[k] for k in self._FLUSHED):  # nothing new: read only
            try:
                with open(stats_path) as f:
                    return {k: int(v) for k, v in json.load(f).items() if isinstance(v, int)}
            except (OSError, ValueError):
                return {}
        with self._locked(exclusive=True):
            try:
                with open(stats_path) as f:
                    totals = {k: int(v) for k, v in json.load(f).items() if isinstance(v, int)}
            except (OSError, ValueError):
                totals = {}
            for mine, name in self._FLUSHED.items():
                totals[name] = totals.get(name, 0) + self._counters[mine] - done[mine]
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.path)
            try:
                with open(fd, "w") as f:
                    json.dump(totals, f)
                os.replace(tmp, stats_path)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        self._flushed = {k: self._counters[k] for k in self._FLUSHED}
        return totals

    def store_stats(self) -> dict:
        """Whole-store figures: ``entries``, ``bytes`` and the counters of every client that closed (or
        asked for these stats) since the store was created: ``puts, hits, misses, corrupt, foreign,
        evicted`` (``lost`` is always 0: files do not vanish under their bookkeeping here)."""
        self._check_open()
        try:
            totals = self._flush_counters()
            usage = self._usage()
        except OSError as e:
            return {"backend": self.kind, "path": self.path, "available": False, "reason": str(e)}
        out = {"backend": self.kind, "path": self.path, "available": True, **usage}
        for name in ("puts", "hits", "misses", "corrupt", "foreign", "evicted"):
            out[name] = totals.get(name, 0)
        out["lost"] = 0
        return out

    def check(self) -> dict:
        """The store's :meth:`store_stats`; raises :class:`StoreUnavailableError` when the folder cannot
        be read or written."""
        self._check_open()
        if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):
            raise StoreUnavailableError(f"DirectoryBackend {self.path}: not readable and writable by this user")
        out = self.store_stats()
        if not out.get("available"):
            raise StoreUnavailableError(f"DirectoryBackend {self.path}: {out.get('reason')}")
        return out

    def gc(self, verify: bool = False, min_age_s: float = 60.0) -> dict:
        """Remove orphaned parts: temporary files of writers that died before their rename (older than
        ``min_age_s``: younger ones may belong to a put in flight). ``verify``: also read every entry
        and drop those that fail their checksum (or sit under the wrong name)."""
        self._check_open()
        out = {"checked": 0, "orphans": 0, "stale": 0, "corrupt": 0, "total_fixed_bytes": 0}
        now = time.time()
        with os.scandir(self.path) as it:
            names = [(de.name, de.path) for de in it]
        for name, path in names:
            try:
                if name.startswith(_TMP_PREFIX):
                    if now - os.stat(path).st_mtime >= min_age_s:
                        os.unlink(path)
                        out["orphans"] += 1
                elif name.endswith(SUFFIX) and not name.startswith("."):
                    out["checked"] += 1
                    if not verify:
                        continue
                    key = self._read_key(name)
                    if key is None:
                        with self._locked(exclusive=True):
                            os.unlink(path)
                        out["corrupt"] += 1
                        continue
                    before = self._counters["corrupt_dropped"]
                    with warnings_suppressed():
                        self._get(key)
                    out["corrupt"] += self._counters["corrupt_dropped"] - before
            except FileNotFoundError:
                continue
        return out

    def close(self) -> None:
        if not self._closed:
            with contextlib.suppress(OSError):
                if any(self._counters[k] for k in self._FLUSHED):
                    self._flush_counters()
        super().close()

    def __repr__(self):
        return f"DirectoryBackend({self.path!r}, budget_bytes={self.budget_bytes}, policy={self.policy!r})"
