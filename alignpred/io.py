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
# Start-up time: ``import h5py`` costs more than reading a bank (0.07-0.3 s measured here; kvz
# decompress pays it once per process). Banks are read without h5py when the file is in the subset
# h5py writes with its defaults (superblock 0/1, symbol-table groups, version-1 object headers,
# contiguous or compact little-endian IEEE float16/float32 datasets without filters, UTF-8
# variable-length string attributes); anything else -- and any doubt -- reads through h5py as before.
# A wrong parse cannot go unnoticed: a bank's arrays must hash to the content id it stores.
class _NotLite(Exception):
    """The file is outside the subset :func:`_h5_lite` reads (h5py reads it)."""


_F16 = (2, 15, 0, 16, 10, 5, 0, 10, 15)  # size, sign bit, bit offset, precision, exponent/mantissa layout, bias
_F32 = (4, 31, 0, 32, 23, 8, 0, 23, 127)


def _h5_lite(buf, arrays: bool = True) -> tuple[dict, dict]:
    """``({attribute: str} of the root group, {path: array} of every dataset, in h5py's visit
    order)`` of an HDF5 file in bytes (a writable buffer gives writable arrays, as h5py's);
    :class:`_NotLite` if the file is not in the subset described above."""
    import struct

    import numpy as np

    mv = memoryview(buf)
    n = len(mv)

    def u(fmt, off):
        if off < 0 or off + struct.calcsize(fmt) > n:
            raise _NotLite("out of range")
        return struct.unpack_from("<" + fmt, mv, off)

    if bytes(mv[:8]) != b"\x89HDF\r\n\x1a\n" or u("B", 8)[0] not in (0, 1) or u("BB", 13) != (8, 8):
        raise _NotLite("superblock")
    root = 24 + 4 * u("B", 8)[0]  # version 1 has the indexed-storage K and 2 reserved bytes more
    base, _, eof = u("QQQ", root)
    if base + eof > n:
        raise _NotLite("truncated file")  # (h5py's error)
    root += 32

    def messages(addr):
        ver, count, _, size = u("BxHII", base + addr)
        if ver != 1:
            raise _NotLite("object header version")
        out: list[tuple[int, int, int]] = []
        blocks = [(base + addr + 16, size)]
        while blocks and len(out) < count:
            p, size = blocks.pop(0)
            end = p + size
            while p + 8 <= end and len(out) < count:
                t, sz, flags = u("HHB", p)
                if flags & 0x02 or p + 8 + sz > end:
                    raise _NotLite("shared or torn message")
                if t == 0x10:
                    a, length = u("QQ", p + 8)
                    blocks.append((base + a, length))
                out.append((t, p + 8, sz))
                p += 8 + sz
        return out

    def vlen_str(p):  # u32 length, global heap id (collection address, object index)
        length, coll, idx = u("IQI", p)
        if bytes(mv[base + coll:base + coll + 4]) != b"GCOL":
            raise _NotLite("global heap")
        q, end = base + coll + 16, base + coll + u("Q", base + coll + 8)[0]
        while q + 16 <= end:
            i, _, _, sz = u("HHIQ", q)
            if i == idx and sz >= length:
                return bytes(mv[q + 16:q + 16 + length]).decode("utf-8")
            if i == 0:
                break
            q += 16 + (sz + 7) // 8 * 8
        raise _NotLite("global heap object")

    def attrs_of(msgs) -> dict:
        out = {}
        for t, p, _ in msgs:
            if t != 0x0C:
                continue
            ver, nl, dl, sl = u("BxHHH", p)
            if ver != 1:
                raise _NotLite("attribute version")
            name = bytes(mv[p + 8:p + 8 + nl]).rstrip(b"\0").decode("utf-8")
            dt = p + 8 + (nl + 7) // 8 * 8
            sp = dt + (dl + 7) // 8 * 8
            cls, bits = u("BB", dt)[0] & 0x0F, u("BBB", dt + 1)
            if cls != 9 or bits[0] & 0x0F != 1 or bits[1] & 0x0F != 1 or u("BB", sp) != (1, 0):
                raise _NotLite("attribute type")  # only scalar UTF-8 variable-length strings
            out[name] = vlen_str(sp + (sl + 7) // 8 * 8)
        return out

    def dataset(msgs):
        shape = dtype = data = None
        for t, p, _ in msgs:
            if t == 0x01:
                ver, rank, flags = u("BBB", p)
                if ver == 1:
                    dims = p + 8
                elif ver == 2 and u("B", p + 3)[0] == 1:
                    dims = p + 4
                else:
                    raise _NotLite("dataspace")
                if rank == 0 or flags & 0x02:
                    raise _NotLite("scalar or permuted dataspace")
                shape = u("Q" * rank, dims)
            elif t == 0x03:
                b0, b1, sign, _, size = u("BBBBI", p)
                if b0 & 0x0F != 1 or b1 & 0x7F != 0x20 or (size, sign) + u("HHBBBBI", p + 8) not in (_F16, _F32):
                    raise _NotLite("datatype")  # little-endian IEEE binary16/binary32 only
                dtype = np.dtype("<f2" if size == 2 else "<f4")
            elif t == 0x08:
                ver, cls = u("BB", p)
                if ver != 3 or cls not in (0, 1):
                    raise _NotLite("layout")
                data = (p + 4, u("H", p + 2)[0]) if cls == 0 else (lambda a, s: (base + a, s))(*u("QQ", p + 2))
            elif t in (0x07, 0x0B, 0x02, 0x06, 0x11):
                raise _NotLite("filters, external storage or links in a dataset")
        if shape is None or dtype is None or data is None:
            raise _NotLite("incomplete dataset")
        count = int(np.prod(shape, dtype=np.int64))
        off, size = data
        if not count and not size:  # an empty dataset has no data address
            return np.zeros(shape, dtype)
        if size != count * dtype.itemsize or off + size > n or off % dtype.itemsize:
            raise _NotLite("data out of range")
        return np.frombuffer(mv, dtype, count, off).reshape(shape)

    def children(btree, heap):
        if bytes(mv[base + heap:base + heap + 4]) != b"HEAP":
            raise _NotLite("local heap")
        names = base + u("Q", base + heap + 24)[0]
        out, todo = [], [btree]
        while todo:
            a = base + todo.pop()
            if bytes(mv[a:a + 4]) != b"TREE" or u("B", a + 4)[0] != 0:
                raise _NotLite("group B-tree")
            level, used = u("BH", a + 5)
            kids = [u("Q", a + 24 + 8 + 16 * i)[0] for i in range(used)]
            if level:
                todo += kids
                continue
            for s in kids:
                s += base
                if bytes(mv[s:s + 4]) != b"SNOD":
                    raise _NotLite("symbol table node")
                for i in range(u("H", s + 6)[0]):
                    e = s + 8 + 40 * i
                    name_off, obj, cache = u("QQI", e)
                    if cache == 2:
                        raise _NotLite("soft link")
                    end = bytes(mv[names + name_off:names + name_off + 1024]).find(b"\0")
                    if end < 0:
                        raise _NotLite("link name")
                    out.append((bytes(mv[names + name_off:names + name_off + end]), obj))
        return sorted(out)

    root_msgs = messages(u("Q", root + 8)[0])
    attrs = attrs_of(root_msgs)
    found: dict = {}
    if arrays:
        seen = set()

        def visit(msgs, prefix):
            tables = [p for t, p, _ in msgs if t == 0x11]
            if not tables:
                raise _NotLite("a group without a symbol table")
            for name, obj in children(*u("QQ", tables[0])):
                if obj in seen:
                    raise _NotLite("an object linked twice")
                seen.add(obj)
                path = prefix + name.decode("utf-8")
                msgs = messages(obj)
                if any(t == 0x11 for t, _, _ in msgs):
                    visit(msgs, path + "/")
                else:
                    found[path] = dataset(msgs)

        visit(root_msgs, "")
    return attrs, found


def _read_lite(path, arrays: bool):
    """:func:`_h5_lite` of a file, or None where it is outside the subset (or unreadable: h5py
    then reports it, as before)."""
    import struct

    buf: bytearray | memoryview
    try:
        if arrays:  # one read into a writable buffer: the arrays are views of it
            with open(path, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(buf) != len(buf):
                    return None
        else:
            buf = map_file(path)
        attrs, found = _h5_lite(buf, arrays)
        return str(attrs["kvz_bank"]), str(attrs["content_id"]), found
    except (_NotLite, KvzError, OSError, KeyError, ValueError, IndexError, OverflowError, struct.error):
        return None


def _read_h5py(path, arrays: bool):
    import h5py

    try:
        with h5py.File(path, "r") as f:
            man, cid = str(f.attrs["kvz_bank"]), str(f.attrs["content_id"])
            found: dict = {}
            if arrays:
                f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset)
                             else None)
            return man, cid, found
    except FileNotFoundError:
        raise KvzError(f"{path}: no such file") from None
    except (OSError, KeyError, ValueError) as e:
        from alignpred.errors import BankMismatchError

        raise BankMismatchError(f"{path}: not a kvz bank ({e})") from None


def read_bank_attrs(path) -> tuple[str, str]:
    """``(manifest JSON, stored content id)`` of an HDF5 bank, without reading its arrays."""
    path = os.fspath(path)
    man, cid, _ = _read_lite(path, arrays=False) or _read_h5py(path, arrays=False)
    return man, cid


def read_bank_file(path) -> tuple[str, str, dict]:
    """``(manifest JSON, stored content id, {name: array})`` of an HDF5 bank."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise KvzError(f"{path}: no such file")
    return _read_lite(path, arrays=True) or _read_h5py(path, arrays=True)


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
