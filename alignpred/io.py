"""File I/O: the only module that opens files. Atomic writes and read-only memory maps.

Writes go to a temporary file in the destination's directory, are fsynced, then renamed over
the destination, so a reader sees the old file or the new one, never a torn one; on any error
(disk full included) the temporary file is removed and the old file is left untouched.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> p = os.path.join(d, "x.bin")
>>> atomic_write(p, [b"hello ", b"world"])
11
>>> open(p, "rb").read()
b'hello world'
"""
from __future__ import annotations

import mmap
import os
import tempfile
from typing import Iterable

from .errors import KvzError


def atomic_write(path, chunks: Iterable[bytes]) -> int:
    """Write the byte chunks to ``path`` atomically; returns the number of bytes written."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    n = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
                n += len(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise KvzError(f"cannot write {path}: {e.strerror or e}") from e
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return n


def map_file(path) -> memoryview:
    """A read-only memoryview over the file (memory-mapped; empty files give b'')."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except FileNotFoundError:
        raise KvzError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise KvzError(f"{path}: is a directory") from None
    except PermissionError:
        raise KvzError(f"{path}: permission denied") from None
