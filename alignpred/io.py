"""File I/O: the only module that opens files. Atomic writes and read-only memory maps.

Writes go to a temporary file ``.<name>.<random>.tmp`` in the destination's directory, are
fsynced, then renamed over the destination, so a reader sees the old file or the new one, never
a torn one; on any error (disk full included) the temporary file is removed and the old file is
left untouched. A writer that is killed (SIGKILL, power loss) cannot clean up and leaves its
temporary file; the writer holds an exclusive ``flock`` on it while writing, and the next write
to the same destination removes temporary files that no live writer holds (stale ones).
The new file gets the mode of the file it replaces, or ``0666 & ~umask``.

>>> import tempfile, os
>>> d = tempfile.mkdtemp()
>>> p = os.path.join(d, "x.bin")
>>> atomic_write(p, [b"hello ", b"world"])
11
>>> open(p, "rb").read()
b'hello world'
"""
from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
from collections.abc import Iterable

from alignpred.errors import KvzError


def _lock(fd) -> bool:
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except (ImportError, OSError):
        return False


def _mode_for(path) -> int:
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def remove_stale_temps(path, min_age: float = 2.0) -> list[str]:
    """Remove ``.<name>.*.tmp`` files next to ``path`` left by killed writers: older than
    ``min_age`` seconds and not locked by a live writer. Returns the removed paths."""
    import glob
    import time

    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path)) or "."
    removed = []
    pattern = os.path.join(glob.escape(d), "." + glob.escape(os.path.basename(path)) + ".*.tmp")
    for tmp in glob.glob(pattern):
        try:
            if time.time() - os.lstat(tmp).st_mtime < min_age:
                continue
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            if _lock(fd):
                os.unlink(tmp)
                removed.append(tmp)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def write_error(path, e: OSError, what: str = "") -> KvzError:
    """The one wording of a failed write: the user's path, the system's reason, and for a full
    disk what to do. ``what`` says which file of the job failed (e.g. the temporary spool)."""
    import errno

    hint = ("; free some space or write elsewhere (-o)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "")
    return KvzError(f"cannot write {path}: {e.strerror or e}{what}{hint}")


@contextlib.contextmanager
def atomic_file(path):
    """Context manager yielding a binary file (seekable) that replaces ``path`` atomically when
    the block ends without error; on any error the temporary file is removed.

    >>> import tempfile, os
    >>> p = os.path.join(tempfile.mkdtemp(), "y.bin")
    >>> with atomic_file(p) as f:
    ...     _ = f.truncate(4); _ = f.seek(2); _ = f.write(b"ab")
    >>> open(p, "rb").read()
    b'\\x00\\x00ab'
    """
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path)) or "."
    remove_stale_temps(path)
    mode = _mode_for(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    except OSError as e:  # name the user's path, not the temporary one
        raise write_error(path, e) from None
    try:
        # the lock marks the temp file as live; it is held until the file has been renamed
        with os.fdopen(fd, "w+b") as f:
            _lock(f.fileno())
            os.fchmod(f.fileno(), mode)
            yield f
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException as e:
        try:
            if os.path.exists(tmp):
                os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise write_error(path, e) from e
        raise
    try:
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


SPOOL_NOTE = (" (the temporary spool next to the output: compressing needs about twice the output's size free, "
              "the spool and the file)")


def atomic_write(path, chunks: Iterable[bytes]) -> int:
    """Write the byte chunks to ``path`` atomically; returns the number of bytes written."""
    n = 0
    with atomic_file(path) as f:
        for c in chunks:
            f.write(c)
            n += len(c)
    return n


def release_pages(buf) -> None:
    """Drop the pages of a mapped file (from :func:`map_file`) from this process's resident set;
    they stay in the page cache and are faulted back in if read again. No-op for other buffers.
    Cheap when few pages are resident (microseconds), so streaming code calls it often."""
    mm = getattr(buf, "obj", None)
    if isinstance(mm, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):
            pass


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


# -- calibration banks (HDF5) ------------------------------------------------------------------
def read_bank_attrs(path) -> tuple[str, str]:
    """``(manifest JSON, stored content id)`` of an HDF5 bank, without reading its arrays."""
    import h5py

    path = os.fspath(path)
    try:
        with h5py.File(path, "r") as f:
            return str(f.attrs["kvz_bank"]), str(f.attrs["content_id"])
    except FileNotFoundError:
        raise KvzError(f"{path}: no such file") from None
    except (OSError, KeyError, ValueError) as e:
        from alignpred.errors import BankMismatchError

        raise BankMismatchError(f"{path}: not a kvz bank ({e})") from None


def read_bank_file(path) -> tuple[str, str, dict]:
    """``(manifest JSON, stored content id, {name: array})`` of an HDF5 bank."""
    import h5py

    path = os.fspath(path)
    if not os.path.exists(path):
        raise KvzError(f"{path}: no such file")
    try:
        with h5py.File(path, "r") as f:
            man, cid = str(f.attrs["kvz_bank"]), str(f.attrs["content_id"])
            arrays = {}

            def visit(name, obj):
                if isinstance(obj, h5py.Dataset):
                    arrays[name] = obj[()]

            f.visititems(visit)
    except (OSError, KeyError, ValueError) as e:
        from alignpred.errors import BankMismatchError

        raise BankMismatchError(f"{path}: not a kvz bank ({e})") from None
    return man, cid, arrays


def write_bank_file(path, manifest: str, content_id: str, arrays: dict) -> None:
    """Write an HDF5 bank atomically (temporary file in the same folder, fsync, rename)."""
    import h5py

    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".bank.", suffix=".h5", dir=d)
    except OSError as e:
        raise KvzError(f"cannot write bank {path}: {e.strerror or e}") from None
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["kvz_bank"] = manifest
            f.attrs["content_id"] = content_id
            for n in sorted(arrays):
                f.create_dataset(n, data=arrays[n])
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp, _mode_for(path))
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise KvzError(f"cannot write bank {path}: {e.strerror or e}") from e
        raise


def spool_file(near=None):
    """An anonymous temporary file in the folder of ``near`` (unlinked at once: nothing is left
    behind on a crash), for data that must wait before it is written in another order; without
    ``near``, memory up to 256 MiB, then the system's temporary folder."""
    if near is None:
        return tempfile.SpooledTemporaryFile(max_size=256 << 20)
    d = os.path.dirname(os.path.abspath(os.fspath(near))) or "."
    try:
        return tempfile.TemporaryFile(dir=d)
    except OSError as e:
        raise write_error(os.fspath(near), e, SPOOL_NOTE) from None


def ensure_dir(path) -> str:
    """Create a folder (and its parents) if needed; returns it."""
    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise KvzError(f"cannot create {path}: {e.strerror or e}") from None
    return path


def same_file(a, b) -> bool:
    """Whether two paths name the same existing file."""
    try:
        return os.path.samefile(os.fspath(a), os.fspath(b))
    except OSError:
        return False


def read_npz(path) -> dict:
    """The arrays of a NumPy ``.npz`` file (no pickles), read at once."""
    import numpy as np

    with np.load(os.fspath(path), allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def read_json(path):
    """A JSON file's value, or None if it cannot be read or parsed."""
    import json

    try:
        with open(os.fspath(path), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
