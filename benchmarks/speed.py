"""Speed of kvz next to the coders a KV-cache store would otherwise use, in one run on real caches.

    python -m kvz.benchmarks.speed [--quick] [--json OUT.json] [--plot OUT.png] [--md OUT.md] [CACHES...]
    kvz bench --speed-only [--quick] --out OUT          (the same, into OUT/speed.{json,png,md})

What one run measures (defaults: ``data/eval/*.safetensors``, the 2,048-token held-out Gemma 3 270M
caches; ``--quick``: the first two, fewer repeats, a 4,096-token prefill):

1. **codecs, in process** - kvz encode (``compress``, tensor scope, eps 0.0267) and decode
   (``KvzReader.read()`` and ``read_into`` preallocated buffers) with 1 and all threads (kvz's own
   ``threads=``), next to SZ3 (pysz, per-tensor absolute bound found by the baseline framework so every
   tensor's NRMSE <= eps, like kvz's tensor scope), FP8 e4m3 (ml_dtypes, per-tensor scale), zstd
   (level 3; level 19 decode, its encode timed once) and LMCache 0.5.6's ``AsymK16V8Codec`` (K kept
   in bf16, V in FP8 e4m3 with a per-tensor scale; pure PyTorch, run on the CPU with torch held to
   one intra-op thread). Every decoder produces the cache's own bf16 arrays. The baselines' "all
   threads" runs split the tensors (LMCache: the layers) over a thread pool of that size. Methods are
   *interleaved* (every round runs each method once, in a rotated order) and each figure is the median
   of its rounds, with the CPU time of the process next to the wall time (under load the CPU time is
   the steadier figure for one thread).
2. **kvz 0.1 side by side** - the last 0.1 commit (``d9e1fc2``, a git worktree at ``--kvz01``,
   created if absent) and this tree, each in a fresh subprocess (``PYTHONPATH`` = that tree), warmed
   on a bundled sample, then timed on the same caches: encode/decode values/s and bpv of both.
3. **CLI** - ``kvz decompress X.kvz -o Y.safetensors --force -q`` wall time vs the in-process read,
   with the process start included and excluded (start = ``kvz --help``), interleaved.
4. **environment** - this tree's worker under the default environment and with
   ``OPENBLAS_NUM_THREADS=1`` / ``OMP_NUM_THREADS=1``, interleaved; a default run slower by more than
   ``--env-tolerance`` is flagged.
5. **break-even bandwidth** of every decoder: ``B* = (size_raw - size_c) / t_decode``, the link speed
   below which loading the compressed file and decoding it beats loading raw bf16.
6. **restore vs prefill** - a 16,384-token Gemma 3 270M cache is captured (the prefill, chunked as
   ``capture`` does, is timed), compressed, and restored with ``read_into`` (1 and all threads).
7. a cProfile of one single-thread decode, and bit-identity of decodes across thread counts and
   processes.

Results: JSON (rows, machine, load, command), a plot (Agg) and a Markdown summary.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import glob
import hashlib
import inspect
import io
import json
import math
import os
import pstats
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_DIR = os.path.join(ROOT, "data", "eval")
SAMPLES = os.path.join(ROOT, "samples", "gemma3-270m")
RESULTS = os.path.join(ROOT, "benchmarks", "results")
EPS = 0.0267
SCOPE = "tensor"
BANK = "gemma-3-270m"
KVZ01_COMMIT = "d9e1fc2"
KVZ01_DIR = "/tmp/kvz01"
SCHEMA = "kvz-speed/1"
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
CODECS = ("kvz", "sz3", "fp8_e4m3", "zstd-3", "zstd-19", "lmcache_k16v8")
BLAS1 = "OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1"
BATCH_FILES = 8   # `kvz decompress` of this many files in one call (the start-up paid once)
ENV_TOLERANCE = 0.05  # a default-environment run more than 5 % slower than the single-thread-BLAS one is flagged

# the two presets; every count can be overridden on the command line
PRESETS = {
    "quick": {"n_caches": 2, "proc_caches": 1, "rounds": 3, "enc_rounds": 2, "proc_rounds": 1, "env_rounds": 2,
              "rep_enc": 1, "rep_dec": 2, "cli_rounds": 2, "prefill_tokens": 4096, "restore_repeats": 3,
              "env_variants": (BLAS1,)},
    "full": {"n_caches": 0, "proc_caches": 0, "rounds": 5, "enc_rounds": 3, "proc_rounds": 2, "env_rounds": 3,
             "rep_enc": 2, "rep_dec": 3, "cli_rounds": 3, "prefill_tokens": 16384, "restore_repeats": 5,
             "env_variants": ("OPENBLAS_NUM_THREADS=1", "OMP_NUM_THREADS=1", BLAS1)},
}


# ============================================================================ small pieces

QUIET = False  # -q: no progress lines


def log(msg: str) -> None:
    if not QUIET:
        print(f"[speed] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def all_threads() -> int:
    from alignpred.threads import default_threads

    return default_threads()


def thread_counts(n_all: int | None = None) -> list[int]:
    """``[1, all]`` (just ``[1]`` on one core)."""
    n = all_threads() if n_all is None else n_all
    return sorted({1, max(1, int(n))})


def break_even(size_raw: float, size_c: float, t_decode: float) -> float | None:
    """Link speed (bytes/s) below which loading ``size_c`` bytes and decoding them in ``t_decode`` s
    beats loading ``size_raw`` bytes: ``size_c/B + t_decode < size_raw/B`` <=> ``B < (size_raw -
    size_c) / t_decode``. None when the compressed file is not smaller (never worth it); inf for a
    free decode."""
    if size_c >= size_raw:
        return None
    if t_decode <= 0:
        return math.inf
    return (size_raw - size_c) / t_decode


def median(xs) -> float:
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else math.nan


def arrays_digest(arrays: dict) -> str:
    """sha256 over the arrays' bytes in name order (names, shapes and dtypes included)."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(np.asarray(arrays[k]))
        h.update(f"{k}:{a.shape}:{a.dtype}".encode())
        h.update(a.view(np.uint8).reshape(-1).data)
    return h.hexdigest()


_POOLS: dict[int, ThreadPoolExecutor] = {}


def pmap(threads: int, fn: Callable, items) -> list:
    """``[fn(x) for x in items]``, on a pool of ``threads`` threads when ``threads > 1``."""
    items = list(items)
    if threads <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="speed-baseline")
    return list(pool.map(fn, items))


def machine() -> dict:
    from kvz.benchmarks.run import machine_info

    m = machine_info()
    m["all_threads"] = all_threads()
    m["env"] = {k: os.environ[k] for k in THREAD_VARS + ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
                if k in os.environ}
    try:
        from threadpoolctl import threadpool_info

        m["blas"] = [{k: i.get(k) for k in ("user_api", "internal_api", "num_threads", "version",
                                            "architecture")} for i in threadpool_info()]
    except Exception:
        pass
    for mod in ("torch", "ml_dtypes", "lmcache", "transformers"):
        try:
            m.setdefault("packages", {})[mod] = getattr(__import__(mod), "__version__", "?")
        except Exception:
            pass
    try:
        import alignpred

        m["kvz"] = alignpred.__version__
    except Exception:
        pass
    return m


def cpu_probe(seconds: float = 0.4) -> dict:
    """How much CPU this process gets with 1 and with all threads of GIL-free work (single-thread BLAS
    products): ``cpu/wall`` near 1 and near the thread count on an idle machine. On a shared or
    throttled machine the all-threads share shows whether thread-scaling figures mean anything."""
    from threadpoolctl import threadpool_limits

    a = np.random.default_rng(0).random((300, 300))
    out = {}
    with threadpool_limits(1):
        reps = 1
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds / 4:  # calibrate the work to about ``seconds`` per thread
            for _ in range(reps):
                a @ a
            reps *= 2
        reps = max(1, int(reps * seconds / max(time.perf_counter() - t0, 1e-3)))

        def work(_=None):
            for _ in range(reps):
                a @ a

        for n in thread_counts():
            c0, t0 = time.process_time(), time.perf_counter()
            pmap(n, work, range(n))
            w = time.perf_counter() - t0
            out[str(n)] = {"cpu_over_wall": (time.process_time() - c0) / w, "work_per_s": n * reps / w}
    ks = sorted(out, key=int)
    out["scaling"] = out[ks[-1]]["work_per_s"] / out[ks[0]]["work_per_s"]
    return out


# ============================================================================ interleaved timing

@dataclass
class Op:
    """One timed operation: ``fn()`` is called once per round it takes part in."""

    codec: str
    op: str  # encode | decode | decode_into
    threads: int
    fn: Callable[[], Any]
    rounds: int | None = None  # None: every round
    walls: list = field(default_factory=list)
    cpus: list = field(default_factory=list)


def run_interleaved(ops: list[Op], rounds: int, label: str = "") -> None:
    """Run every op once per round, the order rotated (and reversed every other round) so that a noisy
    stretch of a shared machine hits all methods alike; walls and CPU times are appended to each op."""
    n = len(ops)
    for r in range(rounds):
        order = ops[r % n:] + ops[:r % n] if n else []
        if r % 2:
            order = order[::-1]
        for op in order:
            if op.rounds is not None and r >= op.rounds:
                continue
            gc.collect()
            k0, c0, t0 = _children_cpu(), time.process_time(), time.perf_counter()
            op.fn()
            op.walls.append(time.perf_counter() - t0)
            op.cpus.append(time.process_time() - c0 + _children_cpu() - k0)  # + subprocesses waited for
        if label:
            log(f"{label}: round {r + 1}/{rounds} done (load {loadavg()})")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timing(walls, cpus) -> dict:
    return {"wall_s": median(walls), "cpu_s": median(cpus), "wall_runs": [round(x, 5) for x in walls],
            "cpu_runs": [round(x, 5) for x in cpus], "repeats": len(walls)}


# ============================================================================ codecs (in process)

class KvzCodec:
    """kvz: ``compress`` to memory, ``KvzReader(bytes, threads=).read()`` / ``read_into``."""

    name = "kvz"
    ops = ("encode", "decode", "decode_into")

    def __init__(self, cache, bank, eps: float = EPS, scope: str = SCOPE):
        from alignpred import compress

        self.cache, self.bank, self.eps, self.scope = cache, bank, eps, scope
        self._threads_kw = "threads" in inspect.signature(compress).parameters
        self.data: bytes | None = None
        self.bufs = {k: np.empty_like(np.asarray(v)) for k, v in cache.tensors.items()}
        self.extra: dict = {"eps": eps, "scope": scope, "encode_threads_param": self._threads_kw}

    def encode(self, threads: int):
        from alignpred import compress

        kw = {"threads": threads} if self._threads_kw else {}
        info = compress(self.cache, None, eps=self.eps, bank=self.bank, scope=self.scope, **kw)
        self.data = info.data
        return info

    def reader(self, threads: int):
        from alignpred import KvzReader

        return KvzReader(self.data, bank=self.bank, threads=threads)

    def decode(self, threads: int) -> dict:
        return self.reader(threads).read()

    def decode_into(self, threads: int) -> dict:
        return self.reader(threads).read_into(self.bufs)

    def nbytes(self) -> int:
        return len(self.data or b"")


class BaselineCodec:
    """A :class:`~kvz.benchmarks.baselines.TensorCodec` at fixed per-tensor knobs; every decode is cast
    back to the source dtype (as the baseline framework times it)."""

    ops = ("encode", "decode")

    def __init__(self, name: str, codec, tensors: dict, knobs: dict | None = None, ctx: dict | None = None):
        self.name, self.codec, self.tensors = name, codec, tensors
        self.knobs = knobs or {k: None for k in tensors}
        self.ctx = ctx if ctx is not None else codec.prepare(tensors, None)
        self.encs: dict = {}
        self.extra: dict = {}

    def encode(self, threads: int):
        names = list(self.tensors)
        encs = pmap(threads, lambda k: self.codec.encode(k, self.tensors[k], self.knobs[k], self.ctx), names)
        self.encs = dict(zip(names, encs))
        return self.encs

    def decode(self, threads: int) -> dict:
        from kvz.benchmarks.baselines import cast_back

        names = list(self.tensors)

        def one(k):
            x = self.tensors[k]
            return cast_back(self.codec.decode(k, self.encs[k], x.shape, self.ctx), x.dtype)

        return dict(zip(names, pmap(threads, one, names)))

    def nbytes(self) -> int:
        return sum(e.bits for e in self.encs.values()) // 8


class LMCacheCodec:
    """LMCache 0.5.6's ``AsymK16V8Codec`` (``lmcache.v1.kv_codec``): one blob per layer (K bf16 bytes,
    V FP8 e4m3 bytes, the per-tensor V scale and LMCache's header), ``to_bytes`` / ``from_bytes`` +
    ``decode(out_v_dtype=bfloat16)`` included in the times; torch is held to one intra-op thread
    (the "all threads" runs split the layers over a pool)."""

    name = "lmcache_k16v8"
    ops = ("encode", "decode")

    def __init__(self, tensors: dict):
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
        warnings.filterwarnings("ignore", message="The given (buffer|NumPy array) is not writable")
        import torch
        from lmcache.v1.kv_codec import AsymK16V8Codec, ScaleScope

        self.torch = torch
        self.codec = AsymK16V8Codec(scale_scope=ScaleScope.PER_TENSOR)
        self.tensors = tensors
        layers = sorted({int(k.split(".")[1]) for k in tensors})
        self.layers = [(i, f"layers.{i}.key", f"layers.{i}.value") for i in layers]
        self.t = {k: self._to_torch(v) for k, v in tensors.items()}
        self.blobs: list = []
        import lmcache

        self.extra = {"lmcache": getattr(lmcache, "__version__", "?"), "scale_scope": "PER_TENSOR",
                      "unit": "one (K, V) blob per layer"}

    def _to_torch(self, x: np.ndarray):
        torch = self.torch
        x = np.ascontiguousarray(x)
        if x.dtype.name == "bfloat16":
            return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(x)

    def _to_numpy(self, t, like: np.ndarray) -> np.ndarray:
        torch = self.torch
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(like.dtype).reshape(like.shape)
        return t.numpy().reshape(like.shape)

    def encode(self, threads: int):
        c = self.codec

        def one(item):
            i, kn, vn = item
            return c.to_bytes(c.encode(self.t[kn], self.t[vn], layer_id=i, head_axis=0))

        self.blobs = pmap(threads, one, self.layers)
        return self.blobs

    def decode(self, threads: int) -> dict:
        torch = self.torch
        c = self.codec

        def one(arg):
            (i, kn, vn), blob = arg
            k, v, _ = c.decode(c.from_bytes(blob), out_v_dtype=torch.bfloat16)
            return (kn, self._to_numpy(k, self.tensors[kn])), (vn, self._to_numpy(v, self.tensors[vn]))

        out = {}
        for (kn, k), (vn, v) in pmap(threads, one, list(zip(self.layers, self.blobs))):
            out[kn], out[vn] = k, v
        return out

    def nbytes(self) -> int:
        return sum(len(b) for b in self.blobs)


def lmcache_status() -> tuple[bool, str]:
    """Whether LMCache's codec imports here, and how (or why not)."""
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import lmcache
            from lmcache.v1.kv_codec import AsymK16V8Codec  # noqa: F401
            from lmcache.v1.protocol import DTYPE_TO_INT  # noqa: F401  (the header needs it)
        return True, f"lmcache {getattr(lmcache, '__version__', '?')}: lmcache.v1.kv_codec.AsymK16V8Codec on the CPU"
    except Exception as e:  # report exactly why
        return False, (f"{type(e).__name__}: {e} (install: pip install lmcache==0.5.6 --no-deps, then cachetools "
                       "prometheus_client psutil aiohttp multidict yarl propcache aiohappyeyeballs aiosignal "
                       "frozenlist --no-deps)")


def make_codecs(name: str, cache, bank, wanted, eps: float = EPS) -> tuple[list, dict]:
    """The codec objects for one cache (set up, not timed) and notes on those skipped."""
    import kvz.benchmarks.baselines as B
    from kvz.benchmarks.baselines.lossless import Zstd

    tensors = {k: np.asarray(v) for k, v in cache.tensors.items()}
    out, skipped = [], {}
    avail = set(B.available())
    for c in wanted:
        if c == "kvz":
            out.append(KvzCodec(cache, bank, eps))
        elif c == "sz3":
            if "sz3" not in avail:
                skipped[c] = "pysz does not import"
                continue
            t0 = time.perf_counter()
            res = B.BASELINES["sz3"].run(tensors, eps, SCOPE)  # per-tensor bound search: every tensor <= eps
            codec = BaselineCodec("sz3", B.BASELINES["sz3"], tensors, res.extra["knobs"])
            codec.extra = {"knob": "abs_error_bound per tensor", "search_s": time.perf_counter() - t0,
                           "search_evals": res.extra.get("search_evals"), "meets_target": res.extra["meets_target"]}
            out.append(codec)
        elif c == "fp8_e4m3":
            out.append(BaselineCodec(c, B.BASELINES["fp8_e4m3"], tensors))
        elif c in ("zstd-3", "zstd-19"):
            if "zstd" not in avail:
                skipped[c] = "zstandard does not import"
                continue
            lvl = int(c.split("-")[1])
            codec = BaselineCodec(c, Zstd(c, level=lvl), tensors)
            if lvl >= 10:  # slow encode: timed once, in set-up, and not repeated
                codec.ops = ("decode",)
                codec.extra = {"encode_timed_once": True}
            out.append(codec)
        elif c == "lmcache_k16v8":
            ok, why = lmcache_status()
            if not ok:
                skipped[c] = why
                continue
            out.append(LMCacheCodec(tensors))
        else:
            raise ValueError(f"unknown codec {c!r} (have {', '.join(CODECS)})")
    return out, skipped


def codec_section(caches: list[tuple[str, Any]], bank, *, codecs=CODECS, threads: list[int] | None = None,
                  rounds: int = 3, enc_rounds: int = 2, eps: float = EPS, identity_threads=(1, 2, 4),
                  progress: bool = True) -> dict:
    """In-process encode/decode speed of every codec on every cache (interleaved, medians). Returns
    ``{"rows", "skipped", "identity"}``: one row per (cache, codec, op, threads)."""
    from kvz.benchmarks.baselines import error_stats

    threads = threads or thread_counts()
    rows: list[dict] = []
    skipped: dict = {}
    identity: dict = {}
    torch_threads = None
    if "lmcache_k16v8" in codecs and lmcache_status()[0]:
        import torch

        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        for name, cache in caches:
            t0 = time.perf_counter()
            objs, sk = make_codecs(name, cache, bank, codecs, eps)
            skipped.update(sk)
            tensors = {k: np.asarray(v) for k, v in cache.tensors.items()}
            n = int(sum(x.size for x in tensors.values()))
            raw = int(sum(x.nbytes for x in tensors.values()))
            # set-up: one encode and decode each (warm-up, sizes, errors; zstd-19's encode timed here)
            quality, once = {}, {}
            for c in objs:
                c0, w0 = time.process_time(), time.perf_counter()
                c.encode(threads[-1])
                once[c.name] = (time.perf_counter() - w0, time.process_time() - c0)
                rec = c.decode(1)
                pooled, worst, _ = error_stats(tensors, rec)
                quality[c.name] = {"nrmse_pooled": pooled, "nrmse_max_tensor": worst, "bytes": c.nbytes()}
                if isinstance(c, KvzCodec):
                    identity[name] = decode_identity(c, rec, identity_threads)
                del rec
            log(f"{name}: set-up {time.perf_counter() - t0:.1f} s; "
                + ", ".join(f"{k} {8 * q['bytes'] / n:.3f} bpv" for k, q in quality.items()))
            ops = []
            for c in objs:
                for op in c.ops:
                    for th in threads:
                        fn = getattr(c, op)
                        ops.append(Op(c.name, op, th, (lambda f=fn, t=th: f(t)),
                                      rounds=enc_rounds if op == "encode" else None))
            run_interleaved(ops, rounds, label=name if progress else "")
            for op in ops:
                q = quality[op.codec]
                rows.append(make_row(name, op.codec, op.op, op.threads, n, raw, q, timing(op.walls, op.cpus)))
            for c in objs:  # encodes timed once (zstd-19)
                if "encode" not in c.ops:
                    w, cp = once[c.name]
                    rows.append(make_row(name, c.name, "encode", threads[-1], n, raw, quality[c.name],
                                         timing([w], [cp]), note="timed once (set-up)"))
            for c in objs:
                for r in rows:
                    if r["cache"] == name and r["codec"] == c.name and getattr(c, "extra", None):
                        r["extra"] = dict(c.extra)
            del objs
    finally:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
    return {"rows": rows, "skipped": skipped, "identity": identity}


def decode_identity(c: KvzCodec, first: dict, threads=(1, 2, 4)) -> dict:
    """Digests of kvz decodes with several thread counts and through ``read_into`` (untimed)."""
    d = {"read_t1": arrays_digest(first)}
    for th in threads:
        if th != 1:
            d[f"read_t{th}"] = arrays_digest(c.decode(th))
    d["read_into_t1"] = arrays_digest(c.decode_into(1))
    d["identical"] = len(set(d.values())) == 1
    return d


def make_row(cache: str, codec: str, op: str, threads: int, n: int, raw: int, q: dict, t: dict,
             note: str | None = None) -> dict:
    row = {"cache": cache, "codec": codec, "op": op, "threads": threads, "n_values": n, "raw_bytes": raw,
           "bytes": q["bytes"], "bpv": 8.0 * q["bytes"] / n, "nrmse_pooled": q["nrmse_pooled"],
           "nrmse_max_tensor": q["nrmse_max_tensor"], **t}
    row["vps"] = n / row["wall_s"] if row["wall_s"] > 0 else math.inf
    row["vps_cpu"] = n / row["cpu_s"] if row["cpu_s"] > 0 else math.inf
    if op.startswith("decode"):
        b = break_even(raw, q["bytes"], row["wall_s"])
        row["break_even_Bps"] = b
        b = break_even(raw, q["bytes"], row["cpu_s"] / max(threads, 1)) if threads == 1 else None
        row["break_even_Bps_cpu"] = b
    if note:
        row["note"] = note
    return row


def aggregate(rows: list[dict]) -> list[dict]:
    """One row per (codec, op, threads) over all caches: values, bytes and median times add up."""
    groups: dict = {}
    for r in rows:
        if r["cache"] == "all":
            continue
        groups.setdefault((r["codec"], r["op"], r["threads"]), []).append(r)
    out = []
    for (codec, op, th), rs in groups.items():
        n = sum(r["n_values"] for r in rs)
        raw = sum(r["raw_bytes"] for r in rs)
        nb = sum(r["bytes"] for r in rs)
        wall = sum(r["wall_s"] for r in rs)
        cpu = sum(r["cpu_s"] for r in rs)
        row = {"cache": "all", "codec": codec, "op": op, "threads": th, "n_values": n, "raw_bytes": raw,
               "bytes": nb, "bpv": 8.0 * nb / n, "n_caches": len(rs),
               "nrmse_pooled": max(r["nrmse_pooled"] for r in rs),
               "nrmse_max_tensor": max(r["nrmse_max_tensor"] for r in rs),
               "wall_s": wall, "cpu_s": cpu, "repeats": min(r["repeats"] for r in rs),
               "vps": n / wall if wall > 0 else math.inf, "vps_cpu": n / cpu if cpu > 0 else math.inf}
        if op.startswith("decode"):
            row["break_even_Bps"] = break_even(raw, nb, wall)
            row["break_even_Bps_cpu"] = break_even(raw, nb, cpu) if th == 1 else None
        out.append(row)
    return out


# ============================================================================ subprocess workers

WORKER = r'''
import hashlib, inspect, json, os, sys, tempfile, time
a = json.loads(sys.argv[1])
t0 = time.perf_counter()
import numpy as np
import alignpred
from alignpred import Bank, KvzReader, compress, load_cache
import_s = time.perf_counter() - t0
bank = Bank.load(a["bank"])
cs, rs = inspect.signature(compress).parameters, inspect.signature(KvzReader).parameters

def enc(cache, path, th):
    if os.path.exists(path):
        os.remove(path)
    kw = {"threads": th} if ("threads" in cs and th) else {}
    return compress(cache, path, eps=a["eps"], bank=bank, scope=a["scope"], **kw)

def dec(path, th):
    kw = {"threads": th} if ("threads" in rs and th) else {}
    return KvzReader(path, bank=bank, **kw).read()

def digest(d):
    h = hashlib.sha256()
    for k in sorted(d):
        x = np.ascontiguousarray(np.asarray(d[k]))
        h.update(f"{k}:{x.shape}:{x.dtype}".encode())
        h.update(x.view(np.uint8).reshape(-1).data)
    return h.hexdigest()

tmp = tempfile.mkdtemp(prefix="kvz-speed-")
path = os.path.join(tmp, "x.kvz")
t0 = time.perf_counter()
w = load_cache(a["warm"])
enc(w, path, None)
dec(path, None)
warm_s = time.perf_counter() - t0
cache = load_cache(a["cache"])
n = cache.layout.n_values
out = {"version": alignpred.__version__, "module": alignpred.__file__, "import_s": import_s, "warm_s": warm_s,
       "n_values": n, "threads_param": {"compress": "threads" in cs, "reader": "threads" in rs},
       "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "PYTHONPATH")},
       "encode": {}, "decode": {}, "digest": {}}
for th in a["threads"]:
    walls, cpus = [], []
    for _ in range(a["rep_enc"]):
        c0, t0 = time.process_time(), time.perf_counter()
        info = enc(cache, path, th)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    out["encode"][str(th)] = {"wall": walls, "cpu": cpus}
out["file_bytes"] = os.path.getsize(path)
out["bpv"] = 8.0 * out["file_bytes"] / n
for th in a["threads"]:
    walls, cpus = [], []
    for _ in range(a["rep_dec"]):
        c0, t0 = time.process_time(), time.perf_counter()
        d = dec(path, th)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    out["decode"][str(th)] = {"wall": walls, "cpu": cpus}
    out["digest"][str(th)] = digest(d)
worst = 0.0
for k, x in cache.tensors.items():
    x = np.asarray(x, np.float64)
    e = float(np.sum((np.asarray(d[k], np.float64) - x) ** 2))
    nn = float(np.sum(x * x))
    worst = max(worst, (e / nn) ** 0.5 if nn else 0.0)
out["nrmse_max_tensor"] = worst
os.remove(path)
os.rmdir(tmp)
print("KVZ-SPEED-RESULT " + json.dumps(out))
'''


COLD = r'''
import json, sys, time
t0 = time.perf_counter()
a = json.loads(sys.argv[1])
import kvz.cli.main as m  # (what `kvz` imports)
from alignpred import KvzReader
t1 = time.perf_counter()
m._skip_numba_blas_probe()  # as `kvz` does first
from alignpred.kernels.intmap import quantize_rows
import numpy as np
quantize_rows(np.ones((1, 2), np.float32))  # numba's one-time set-up (first kernel load in a process)
tn = time.perf_counter()
r = KvzReader(a["src"])
t2 = time.perf_counter()
r.decoder
t3 = time.perf_counter()
r.decompress_to(a["dst"])
t4 = time.perf_counter()
r.decompress_to(a["dst"])
t5 = time.perf_counter()
print("KVZ-SPEED-RESULT " + json.dumps({"import_s": t1 - t0, "numba_setup_s": tn - t1, "open_s": t2 - tn,
                                        "bank_and_plans_s": t3 - t2, "first_decompress_s": t4 - t3,
                                        "second_decompress_s": t5 - t4}))
'''


def clean_env(extra: dict | None = None, pythonpath: str | None = None) -> dict:
    """The default environment (the thread variables of this process removed, so a parent that pinned
    them does not leak into the "default" runs) plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS and k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.update(extra or {})
    return env


def parse_env(spec: str) -> dict:
    return dict(kv.split("=", 1) for kv in spec.split())


def run_worker(tree: str, cache: str, bank: str, warm: str, threads: list, env_extra: dict | None, rep_enc: int,
               rep_dec: int, eps: float = EPS, timeout: float = 1800) -> dict:
    """One measurement in a fresh interpreter importing ``alignpred`` from ``tree``."""
    args = {"cache": os.path.abspath(cache), "bank": os.path.abspath(bank), "warm": os.path.abspath(warm),
            "threads": threads, "rep_enc": rep_enc, "rep_dec": rep_dec, "eps": eps, "scope": SCOPE}
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvz-speed-cwd-") as cwd:  # never the repository: it would shadow
        p = subprocess.run([sys.executable, "-c", WORKER, json.dumps(args)], capture_output=True, text=True,
                           env=clean_env(env_extra, tree), cwd=cwd, timeout=timeout)
    wall = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((x for x in p.stdout.splitlines() if x.startswith("KVZ-SPEED-RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"worker ({tree}, env {env_extra}) failed with status {p.returncode}: "
                           f"{(p.stderr or p.stdout)[-2000:]}")
    res = json.loads(line.split(" ", 1)[1])
    res["process_wall_s"] = wall
    res["process_cpu_s"] = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
    return res


def ensure_kvz01(path: str = KVZ01_DIR, commit: str = KVZ01_COMMIT) -> tuple[bool, str]:
    """The kvz 0.1 tree at ``path`` (a detached git worktree of ``commit``, added if absent)."""
    if os.path.isfile(os.path.join(path, "alignpred", "__init__.py")):
        return True, f"{path} (existing)"
    try:
        p = subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, commit], capture_output=True,
                           text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"git worktree add failed: {e}"
    if p.returncode != 0:
        return False, f"git worktree add {path} {commit} failed: {p.stderr.strip()[-500:]}"
    return True, f"{path} (git worktree add --detach {path} {commit})"


def version_env_section(cache_paths: list[str], *, bank_path: str, kvz01: str | None, threads: list[int],
                        proc_rounds: int, env_rounds: int, env_variants, rep_enc: int, rep_dec: int,
                        env_caches: int = 1, progress: bool = True) -> dict:
    """kvz 0.1 vs this tree (default environment), and this tree under the thread-variable variants,
    each a fresh worker process; jobs interleaved round by round."""
    cur_warm = os.path.join(SAMPLES, "english-prose.safetensors")
    jobs: list[tuple[int, int, str, str | None]] = []  # (round, cache index, label, env spec)
    for r in range(max(proc_rounds, env_rounds)):
        for ci in range(len(cache_paths)):
            js = []
            if r < proc_rounds:
                if kvz01:
                    js += [(r, ci, "kvz 0.1", None), (r, ci, "kvz 0.1", BLAS1)]
                js.append((r, ci, "kvz 0.2", None))
            if r < env_rounds and ci < env_caches:
                if not (r < proc_rounds):
                    js.append((r, ci, "kvz 0.2", None))
                js += [(r, ci, "kvz 0.2", spec) for spec in env_variants]
            k = (r + ci) % max(len(js), 1)
            js = js[k:] + js[:k]
            jobs += js[::-1] if r % 2 else js
    runs = []
    for i, (r, ci, label, spec) in enumerate(jobs):
        old = label == "kvz 0.1"
        tree = kvz01 if old else ROOT
        warm = os.path.join(kvz01, "samples", "gemma3-270m", "english-prose.safetensors") if old else cur_warm
        bank = os.path.join(kvz01, "samples", "gemma3-270m", "bank.h5") if old else bank_path
        res = run_worker(tree, cache_paths[ci], bank, warm, [None] if old else threads,
                         parse_env(spec) if spec else None, rep_enc, rep_dec)
        res.update(round=r, cache=os.path.splitext(os.path.basename(cache_paths[ci]))[0], label=label,
                   env=spec or "default", loadavg=loadavg())
        runs.append(res)
        if progress:
            nv = res["n_values"]
            e = ", ".join(f"enc t={t} {nv / median(v['wall']) / 1e6:.2f}" for t, v in res["encode"].items())
            d = ", ".join(f"dec t={t} {nv / median(v['wall']) / 1e6:.2f}" for t, v in res["decode"].items())
            log(f"worker {i + 1}/{len(jobs)} {label} [{spec or 'default'}] {res['cache']}: {e}; {d} Mv/s "
                f"(bpv {res['bpv']:.4f}, load {loadavg()})")
    return {"runs": runs, "summary": summarize_versions(runs), "env": summarize_env(runs)}


def _worker_stat(runs: list[dict], kind: str, th: str, what: str = "wall") -> tuple[float, int]:
    """Total over caches of the per-cache medians (over rounds and repeats), and the values."""
    per: dict = {}
    for r in runs:
        if th in r[kind]:
            per.setdefault(r["cache"], {"n": r["n_values"], "x": []})["x"] += r[kind][th][what]
    return sum(median(p["x"]) for p in per.values()), sum(p["n"] for p in per.values())


def summarize_versions(runs: list[dict]) -> dict:
    """kvz 0.1 vs this tree on the caches both ran: values/s (totals over caches of per-cache medians)
    and bpv. 0.1 ran under the default environment and with single-thread BLAS (``blas1``); the
    speed-ups (``*_speedup_t{threads}``) are taken against the better of the two 0.1 figures, the
    conservative reading of "today's speed"; ``*_speedup_vs_default_t*`` against its default run."""
    new = [r for r in runs if r["label"] == "kvz 0.2" and r["env"] == "default"]
    old_all = [r for r in runs if r["label"] == "kvz 0.1"]
    if not new:
        return {}
    out: dict = {"caches": sorted({r["cache"] for r in new})}
    if old_all:
        both = sorted({r["cache"] for r in old_all} & {r["cache"] for r in new})
        new = [r for r in new if r["cache"] in both]
        old_all = [r for r in old_all if r["cache"] in both]
        out["caches"] = both
    olds = {}
    for r in old_all:
        olds.setdefault("0.1" if r["env"] == "default" else "0.1_blas1", []).append(r)
    out["kvz01_envs"] = {tag: sorted({r["env"] for r in rs}) for tag, rs in olds.items()}
    bpv: dict = {}
    for r in old_all + new:
        tag = r["label"] + ("" if r["env"] == "default" else " [blas1]")
        bpv.setdefault(r["cache"], {})[tag] = r["bpv"]
    out["bpv"] = bpv
    if old_all:
        out["bpv_diff_max"] = max(abs(v["kvz 0.2"] - x) for v in bpv.values() for k, x in v.items()
                                  if k.startswith("kvz 0.1"))
    for kind in ("encode", "decode"):
        for what in ("wall", "cpu"):
            for tag, rs in olds.items():
                t_old, n_old = _worker_stat(rs, kind, "None", what)
                out[f"{kind}_{what}_vps_{tag}"] = n_old / t_old
            best = max((out[f"{kind}_{what}_vps_{tag}"] for tag in olds), default=None)
            if best is not None:
                out[f"{kind}_{what}_vps_0.1_best"] = best
            for th in sorted({t for r in new for t in r[kind]}, key=int):
                t_new, n_new = _worker_stat(new, kind, th, what)
                v = out[f"{kind}_{what}_vps_0.2_t{th}"] = n_new / t_new
                if best is not None:
                    out[f"{kind}_{what}_speedup_t{th}"] = v / best
                if "0.1" in olds:
                    out[f"{kind}_{what}_speedup_vs_default_t{th}"] = v / out[f"{kind}_{what}_vps_0.1"]
    digests: dict = {}
    for r in new:
        for d in r["digest"].values():
            digests.setdefault(r["cache"], set()).add(d)
    out["decode_identical_across_processes_and_threads"] = all(len(s) == 1 for s in digests.values())
    out["digests"] = {k: sorted(v) for k, v in digests.items()}
    return out


def _separated(d: list[dict], x: list[dict], kind: str, th: str, what: str) -> bool:
    """Whether on every cache each default sample is slower than every variant sample."""
    caches = {r["cache"] for r in x}
    for c in caches:
        ds = [t for r in d if r["cache"] == c and th in r[kind] for t in r[kind][th][what]]
        xs = [t for r in x if r["cache"] == c and th in r[kind] for t in r[kind][th][what]]
        if not ds or not xs or min(ds) <= max(xs):
            return False
    return bool(caches)


def summarize_env(runs: list[dict]) -> dict:
    """Per env variant and (op, threads): the default's median time over the variant's, on the caches
    both ran. A run is flagged when the default is slower by more than the tolerance in wall *and* CPU
    time with every default sample slower than every variant sample: a library pool fighting kvz's
    threads costs both (spinning threads) and shows in every sample, while a difference within the
    samples' spread, or in wall time alone, is the shared machine's noise (listed under ``noise``)."""
    cur = [r for r in runs if r["label"] == "kvz 0.2"]
    variants = sorted({r["env"] for r in cur} - {"default"})
    out: dict = {"tolerance": ENV_TOLERANCE, "variants": {}, "flags": [], "noise": []}
    for v in variants:
        caches = {r["cache"] for r in cur if r["env"] == v}
        d = [r for r in cur if r["env"] == "default" and r["cache"] in caches]
        x = [r for r in cur if r["env"] == v]
        res = {}
        for kind in ("encode", "decode"):
            for th in sorted({t for r in x for t in r[kind]}, key=int):
                for what in ("wall", "cpu"):
                    td, _ = _worker_stat(d, kind, th, what)
                    tv, _ = _worker_stat(x, kind, th, what)
                    ratio = td / tv if tv > 0 else math.nan
                    res[f"{kind}_t{th}_{what}"] = {"default_s": td, "variant_s": tv, "default_over_variant": ratio,
                                                   "separated": _separated(d, x, kind, th, what)}
                w, c = res[f"{kind}_t{th}_wall"], res[f"{kind}_t{th}_cpu"]
                slower = w["default_over_variant"] > 1 + ENV_TOLERANCE
                msg = (f"{kind} threads={th}: default {w['default_s']:.3f} s vs {v} {w['variant_s']:.3f} s "
                       f"({(w['default_over_variant'] - 1) * 100:.0f}% slower; CPU "
                       f"{(c['default_over_variant'] - 1) * 100:+.0f}%)")
                if slower and c["default_over_variant"] > 1 + ENV_TOLERANCE and w["separated"] and c["separated"]:
                    out["flags"].append(msg)
                elif slower:
                    out["noise"].append(msg + " - within the samples' spread or in wall time only")
        out["variants"][v] = {"caches": sorted(caches), "rounds": len({r['round'] for r in x}), **res}
    return out


# ============================================================================ CLI vs in process

def kvz_command() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "kvz")
    if os.path.isfile(exe) and os.access(exe, os.X_OK):
        return [exe]
    return [sys.executable, "-c", "import sys; from kvz.cli.main import main; sys.argv[0] = 'kvz'; main()"]


def cli_section(cache, bank, *, rounds: int = 3, eps: float = EPS, progress: bool = True) -> dict:
    """``kvz decompress`` (a fresh process, default threads) vs the in-process read of the same file,
    interleaved; process start measured as ``kvz --help`` (interpreter + kvz's imports)."""
    from alignpred import KvzReader, compress

    tmp = tempfile.mkdtemp(prefix="kvz-speed-cli-")
    src = os.path.join(tmp, "cache.kvz")
    dst = os.path.join(tmp, "out.safetensors")
    info = compress(cache, src, eps=eps, bank=bank, scope=SCOPE)
    n = cache.layout.n_values
    cmd = kvz_command()
    env = clean_env(pythonpath=os.environ.get("PYTHONPATH"))

    def sub(args):
        def fn():
            p = subprocess.run(cmd + args, capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd + args)} failed: {p.stderr[-1000:]}")
        return fn

    bufs = {k: np.empty_like(np.asarray(v)) for k, v in cache.tensors.items()}
    phases: list[dict] = []

    def cold():
        p = subprocess.run([sys.executable, "-c", COLD, json.dumps({"src": src, "dst": dst + ".cold"})],
                           capture_output=True, text=True, env=env, cwd=tmp, timeout=600)
        line = next((x for x in p.stdout.splitlines() if x.startswith("KVZ-SPEED-RESULT ")), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"cold-start breakdown failed: {p.stderr[-1000:]}")
        phases.append(json.loads(line.split(" ", 1)[1]))

    batch_dir = os.path.join(tmp, "batch")
    os.mkdir(batch_dir)
    batch = []
    for i in range(BATCH_FILES):  # copies of one file: a batch of equal work
        batch.append(os.path.join(tmp, f"cache{i}.kvz"))
        shutil.copyfile(src, batch[-1])
    KvzReader(src, bank=bank).read()  # warm
    sub(["decompress", src, "-o", dst, "--force", "-q"])()  # warm (numba cache, page cache)
    ops = [Op("kvz decompress (CLI)", "decode", 0, sub(["decompress", src, "-o", dst, "--force", "-q"])),
           Op(f"kvz decompress, {BATCH_FILES} files in one call", "decode", 0,
              sub(["decompress", *batch, "-o", batch_dir, "--force", "-q"])),
           Op("kvz --help (process start)", "start", 0, sub(["--help"])),
           Op("python -c pass (interpreter)", "start", 0, lambda: subprocess.run([sys.executable, "-c", "pass"],
                                                                              env=env, cwd=tmp, check=True)),
           Op("cold-start breakdown (python -c ...)", "decode", 0, cold),
           Op("in-process read()", "decode", all_threads(), lambda: KvzReader(src, bank=bank).read()),
           Op("in-process read_into()", "decode", all_threads(), lambda: KvzReader(src, bank=bank).read_into(bufs)),
           Op("in-process decompress_to()", "decode", all_threads(),
              lambda: KvzReader(src, bank=bank).decompress_to(dst))]
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_interleaved(ops, rounds, label="cli" if progress else "")
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = {o.codec: median(o.walls) for o in ops}
    cli, start, inproc = t["kvz decompress (CLI)"], t["kvz --help (process start)"], t["in-process read()"]
    res = {"file_bytes": info.file_bytes, "n_values": n, "command": " ".join(shlex.quote(x) for x in
                                                                          ["kvz", "decompress", "X.kvz", "-o",
                                                                           "Y.safetensors", "--force", "-q"]),
           "executable": cmd[0], "rounds": rounds,
           "times": {o.codec: timing(o.walls, o.cpus) for o in ops},
           "children_cpu_s": (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime),
           "cli_vps": n / cli, "cli_vps_excl_start": n / max(cli - start, 1e-9), "inproc_read_vps": n / inproc,
           "inproc_read_into_vps": n / t["in-process read_into()"],
           "inproc_decompress_to_vps": n / t["in-process decompress_to()"]}
    res["cold_start_phases"] = {k: median([p[k] for p in phases]) for k in phases[0]} if phases else {}
    res["ratio_incl_start"] = res["cli_vps"] / res["inproc_read_vps"]
    res["ratio_excl_start"] = res["cli_vps_excl_start"] / res["inproc_read_vps"]
    res["batch_files"] = BATCH_FILES
    res["cli_batch_vps"] = BATCH_FILES * n / t[f"kvz decompress, {BATCH_FILES} files in one call"]
    res["ratio_batch"] = res["cli_batch_vps"] / res["inproc_read_vps"]
    shutil.rmtree(tmp, ignore_errors=True)
    return res


# ============================================================================ restore vs prefill

def long_text() -> tuple[str, list[str]]:
    """Every bundled text (samples/texts/**, calibration texts), concatenated in a fixed order."""
    files = sorted(glob.glob(os.path.join(ROOT, "samples", "texts", "**", "*.txt"), recursive=True))
    files += sorted(glob.glob(os.path.join(SAMPLES, "calib_texts", "*.txt")))
    parts = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            parts.append(fh.read())
    return "\n\n".join(parts), [os.path.relpath(f, ROOT) for f in files]


def restore_section(tokens: int, bank, *, repeats: int = 3, eps: float = EPS, progress: bool = True,
                    keep: str | None = None) -> dict:
    """Capture a ``tokens``-token Gemma 3 270M cache (timing the prefill), compress it, and time its
    restore (``read_into`` preallocated buffers, 1 and all threads, interleaved)."""
    import torch

    from alignpred import KvzReader, compress, load_cache
    from kvz.integrations.hf.gemma import capture, load_gemma, tokenize

    t0 = time.perf_counter()
    model, tok = load_gemma()
    load_s = time.perf_counter() - t0
    text, files = long_text()
    n_text = len(tokenize(tok, text))
    repeats_text = 1
    while n_text * repeats_text < tokens:
        repeats_text += 1
    text = "\n\n".join([text] * repeats_text)
    tmp = tempfile.mkdtemp(prefix="kvz-speed-restore-")
    path = keep or os.path.join(tmp, f"prefill-{tokens}.safetensors")
    capture(text, 64, os.path.join(tmp, "warm.safetensors"), model=model, tokenizer=tok, progress=False)  # warm
    os.remove(os.path.join(tmp, "warm.safetensors"))
    log(f"prefill of {tokens} tokens (torch {torch.get_num_threads()} threads; load {loadavg()}) ...")
    c0 = time.process_time()
    s = capture(text, tokens, path, model=model, tokenizer=tok, progress=progress)
    prefill_cpu = time.process_time() - c0
    prefill = float(s["seconds"])
    log(f"prefill {prefill:.1f} s ({tokens / prefill:.0f} tokens/s)")
    del model
    gc.collect()
    cache = load_cache(path)
    n = cache.layout.n_values
    nth = all_threads()
    c0, t0 = time.process_time(), time.perf_counter()
    info = compress(cache, None, eps=eps, bank=bank, scope=SCOPE,
                    **({"threads": nth} if "threads" in inspect.signature(compress).parameters else {}))
    enc_s, enc_cpu = time.perf_counter() - t0, time.process_time() - c0
    data = info.data
    bufs = {k: np.empty_like(np.asarray(v)) for k, v in cache.tensors.items()}
    KvzReader(data, bank=bank).read_into(bufs)  # warm
    ops = [Op("kvz read_into", "restore", th, (lambda t=th: KvzReader(data, bank=bank, threads=t).read_into(bufs)))
           for th in thread_counts()]
    run_interleaved(ops, repeats, label="restore" if progress else "")
    res = {"tokens": tokens, "model": cache.layout.model, "n_values": n, "raw_bytes": 2 * n,
           "text_files": files, "text_repeats": repeats_text, "text_tokens": n_text, "model_load_s": load_s,
           "prefill_s": prefill, "prefill_cpu_s": prefill_cpu, "prefill_chunk": s.get("chunk"),
           "torch_threads": torch.get_num_threads(), "prefill_tokens_per_s": tokens / prefill,
           "file_bytes": len(data), "bpv": 8.0 * len(data) / n, "encode_s": enc_s, "encode_cpu_s": enc_cpu,
           "encode_threads": nth, "restore": {}}
    for o in ops:
        t = timing(o.walls, o.cpus)
        t["vps"] = n / t["wall_s"]
        t["fraction_of_prefill"] = t["wall_s"] / prefill
        t["fraction_of_prefill_cpu"] = t["cpu_s"] / prefill_cpu
        res["restore"][str(o.threads)] = t
    if not keep:
        os.remove(path)
    os.rmdir(tmp) if not os.listdir(tmp) else None
    return res


# ============================================================================ profile

def profile_decode(codec: KvzCodec, top: int = 15) -> dict:
    """cProfile of one single-thread ``read()``: the functions with the most own time."""
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    codec.decode(1)
    pr.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(pr, stream=io.StringIO())
    total = st.total_tt  # type: ignore[attr-defined]
    entries = []
    for (fname, line, func), (_, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        short = os.path.relpath(fname, ROOT) if fname.startswith(ROOT) else os.path.basename(fname)
        entries.append({"function": f"{short}:{line}({func})", "calls": nc, "own_s": tt, "cum_s": ct,
                        "own_share": tt / total if total else 0.0})
    entries.sort(key=lambda e: -e["own_s"])
    cum = sorted(entries, key=lambda e: -e["cum_s"])
    return {"wall_s_profiled": wall, "total_own_s": total, "top_own": entries[:top],
            "top_cumulative": [e for e in cum if "alignpred" in e["function"]][:top]}


def bound_section(codec: KvzCodec, reps: int = 5) -> dict:
    """How fast a one-thread decode can be with exact map products on this core.

    In one single-thread ``read()`` the integer map products (``alignpred.kernels.intmap._map_predict``)
    are timed and their multiply-adds counted (``sources x d_in x d_out`` per row, padding
    included); next to them, in the same process, torch's bf16 GEMM on the same shapes (oneDNN,
    one thread; ``vdpbf16ps``/AMX where the CPU has them) as a reference for the core's
    dot-product peak. The bound: the read's values / (its multiply-adds / peak rate) is the
    values/s a decode would reach if everything but the map products were free."""
    from alignpred.kernels import intmap

    calls: list = []
    orig = intmap._map_predict

    def timed(xq, x_exp, wp, w_exp, out):
        t0 = time.perf_counter()
        orig(xq, x_exp, wp, w_exp, out)
        calls.append((xq.shape[0] * xq.shape[2] * xq.shape[1] * out.shape[1], time.perf_counter() - t0,
                      (xq.shape[0], xq.shape[1], xq.shape[2], out.shape[1])))

    walls = []
    for _ in range(reps):
        calls.clear()
        intmap._map_predict = timed
        try:
            t0 = time.perf_counter()
            arrays = codec.decode(1)
            walls.append((time.perf_counter() - t0, sum(c[1] for c in calls)))
        finally:
            intmap._map_predict = orig
    n_values = sum(np.asarray(a).size for a in arrays.values())
    macs = sum(c[0] for c in calls)
    wall, t_maps = sorted(walls)[len(walls) // 2]
    out = {"values": n_values, "macs": macs, "macs_per_value": macs / n_values, "read_s": wall,
           "map_products_s": t_maps, "kernel_gmacs": macs / t_maps / 1e9, "map_share": t_maps / wall,
           "rest_s": wall - t_maps, "rest_ns_per_value": (wall - t_maps) / n_values * 1e9,
           "shapes": sorted({c[2] for c in calls})}
    try:
        import torch
    except ImportError:
        out["bf16_reference"] = None
        return out
    nt = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = 0.0
        for S, n, K2, m in out["shapes"]:
            a = torch.randn(n, S * K2).to(torch.bfloat16)
            b = torch.randn(S * K2, m).to(torch.bfloat16)
            a @ b
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                for _ in range(5):
                    a @ b
                ts.append((time.perf_counter() - t0) / 5)
            best = max(best, n * S * K2 * m / min(ts) / 1e9)
    finally:
        torch.set_num_threads(nt)
    out["bf16_reference"] = {"gmacs": best, "torch": torch.__version__}
    peak = max(best, out["kernel_gmacs"])
    out["peak_gmacs"] = peak
    out["map_floor_s"] = macs / (peak * 1e9)
    out["max_vps_maps_only"] = n_values / out["map_floor_s"]
    return out


# ============================================================================ acceptance

def _agg(rows, codec, op, th):
    for r in rows:
        if r["cache"] == "all" and r["codec"] == codec and r["op"] == op and r["threads"] == th:
            return r
    return None


def acceptance(res: dict) -> list[dict]:
    """The issue's acceptance points, each with its measured value and whether it is met."""
    rows = res.get("aggregate", [])
    n_all = res["machine"]["all_threads"]
    out = []

    def add(point, met, value, detail, met_cpu=None):
        """``met``: by wall time (the acceptance's values/s); ``met_cpu``: the same test on CPU times,
        the steadier reading of a single-thread comparison on a loaded machine."""
        out.append({"point": point, "met": bool(met), "value": value, "detail": detail, "met_cpu": met_cpu})

    sz1 = _agg(rows, "sz3", "decode", 1)
    k1, kn = _agg(rows, "kvz", "decode", 1), _agg(rows, "kvz", "decode", n_all)
    if sz1 and k1:
        r, rc = k1["vps"] / sz1["vps"], k1["vps_cpu"] / sz1["vps_cpu"]
        add("decode 1 thread >= 0.6x SZ3 1 thread", r >= 0.6, r,
            f"kvz {k1['vps'] / 1e6:.1f} vs SZ3 {sz1['vps'] / 1e6:.1f} Mv/s wall ({r:.2f}x); by CPU time {rc:.2f}x "
            f"(kvz {k1['vps_cpu'] / 1e6:.1f} vs SZ3 {sz1['vps_cpu'] / 1e6:.1f} Mv/s per CPU-second)", rc >= 0.6)
    if sz1 and kn and n_all > 1:
        r = kn["vps"] / sz1["vps"]
        szn = _agg(rows, "sz3", "decode", n_all)
        extra = f"; vs SZ3 on {n_all} threads {kn['vps'] / szn['vps']:.2f}x" if szn else ""
        add(f"decode {n_all} threads >= 1.0x SZ3 1 thread", r >= 1.0, r,
            f"kvz {kn['vps'] / 1e6:.1f} vs SZ3 {sz1['vps'] / 1e6:.1f} Mv/s wall ({r:.2f}x){extra}")
    cli = res.get("cli")
    if cli:
        tc = cli["times"]
        rcpu = tc["in-process read()"]["cpu_s"] / max(tc["kvz decompress (CLI)"]["cpu_s"], 1e-9)
        add("CLI kvz decompress >= 50% of in-process (2,048 tokens)", cli["ratio_incl_start"] >= 0.5,
            cli["ratio_incl_start"], f"process start included {cli['ratio_incl_start']:.2f}, excluded "
            f"{cli['ratio_excl_start']:.2f} (CLI {cli['cli_vps'] / 1e6:.1f}, in-process read "
            f"{cli['inproc_read_vps'] / 1e6:.1f} Mv/s); by CPU time {rcpu:.2f}" +
            (f"; {cli['batch_files']} files in one call: {cli['ratio_batch']:.2f}" if "ratio_batch" in cli else "") +
            (f"; against in-process decompress_to (the same job: decode and write the file) "
             f"{cli['cli_vps'] / cli['inproc_decompress_to_vps']:.2f}"
             + (f", {cli['batch_files']} files {cli['cli_batch_vps'] / cli['inproc_decompress_to_vps']:.2f}"
                if "cli_batch_vps" in cli else "") if cli.get("inproc_decompress_to_vps") else ""),
            rcpu >= 0.5)
    env = (res.get("processes") or {}).get("env")
    if env and env.get("variants"):
        def worst(what):
            return max(v["default_over_variant"] for var in env["variants"].values() for k, v in var.items()
                       if isinstance(v, dict) and k.endswith("_" + what))

        add("no run slower with the default environment than with OPENBLAS_NUM_THREADS=1", not env["flags"],
            worst("wall"), f"worst default/variant ratio: wall {worst('wall'):.3f}, CPU {worst('cpu'):.3f}" +
            (" - " + "; ".join(env["flags"]) if env["flags"] else
             f" (flag: > {ENV_TOLERANCE:.0%} in wall and CPU, outside the samples' spread"
             + (f"; {len(env['noise'])} noise-level difference(s)" if env.get("noise") else "") + ")"))
    vs = (res.get("processes") or {}).get("summary") or {}
    if "encode_wall_speedup_t1" in vs:
        dbpv = vs.get("bpv_diff_max", math.nan)
        sp1 = vs["encode_wall_speedup_t1"]
        spn = vs.get(f"encode_wall_speedup_t{n_all}", sp1)
        best = max(sp1, spn)
        dflt = vs.get(f"encode_wall_speedup_vs_default_t{n_all}", math.nan)
        spc = vs.get("encode_cpu_speedup_t1", math.nan)
        add("encode >= 2x kvz 0.1 at unchanged bpv (+-0.01)", best >= 2.0 and dbpv <= 0.01, best,
            f"vs 0.1 at its best (default env or 1-thread BLAS): 1 thread {sp1:.2f}x (CPU "
            f"{vs.get('encode_cpu_speedup_t1', math.nan):.2f}x), {n_all} threads {spn:.2f}x; vs 0.1 in the default "
            f"environment {dflt:.2f}x; max |bpv 0.2 - 0.1| {dbpv:.4f}", spc >= 2.0 and dbpv <= 0.01)
    rs = res.get("restore")
    if rs and rs.get("restore"):
        fr = {k: v["fraction_of_prefill"] for k, v in rs["restore"].items()}
        best = min(fr.values())
        add(f"restore of a {rs['tokens']}-token cache <= 5% of its prefill", best <= 0.05, best,
            ", ".join(f"{k} thread(s) {v * 100:.2f}%" for k, v in fr.items()) +
            f" of a {rs['prefill_s']:.1f} s prefill" + ("" if rs["tokens"] >= 16384 else
                                                        " (quick mode: not the 16K-token point)"))
    ident = res.get("identity") or {}
    if ident:
        ok = all(v.get("identical") for v in ident.values()) and vs.get(
            "decode_identical_across_processes_and_threads", True)
        add("decode bit-identical across threads (1/2/4) and processes", ok, None,
            f"{len(ident)} caches, in process and in the worker processes")
    return out


# ============================================================================ output

def _mv(x):
    return "-" if x is None or not math.isfinite(x) else f"{x / 1e6:.1f}"


def _bw(b):
    if b is None:
        return "never"
    if not math.isfinite(b):
        return "any"
    return f"{b * 8 / 1e9:.2f} Gbit/s"


def write_json(res: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(res, f, indent=1, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.bool_):
        return bool(o)
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(type(o))


def write_plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    rows = res.get("aggregate", [])
    n_all = res["machine"]["all_threads"]
    ths = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    for ax, ops, title in ((axes[0], ("decode", "decode_into"), "decode"), (axes[1], ("encode",), "encode")):
        labels = []
        for r in rows:
            if r["op"] in ops:
                lab = r["codec"] + (" read_into" if r["op"] == "decode_into" else "")
                if lab not in labels:
                    labels.append(lab)
        y = np.arange(len(labels))
        h = 0.8 / max(len(ths), 1)
        for i, th in enumerate(ths):
            vals = []
            for lab in labels:
                codec, op = (lab.split(" ")[0], "decode_into") if lab.endswith("read_into") else (lab, ops[0])
                r = _agg(rows, codec, op, th)
                vals.append(r["vps"] / 1e6 if r else np.nan)
            ax.barh(y + i * h, vals, h, label=f"{th} thread{'s' if th > 1 else ''}")
            for yy, v in zip(y + i * h, vals):
                if np.isfinite(v):
                    ax.text(v, yy, f" {v:.0f}", va="center", fontsize=7)
        ax.set_yticks(y + h * (len(ths) - 1) / 2)
        ax.set_yticklabels(labels)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("million values / s (wall, median)")
        ax.set_title(f"{title} ({res['n_caches']} caches x {res.get('tokens', '?')} tokens)")
        ax.legend(fontsize=8)
        ax.invert_yaxis()
    ax = axes[2]
    bes = [(r["codec"] + (" read_into" if r["op"] == "decode_into" else ""), r["break_even_Bps"], r["bpv"])
           for r in rows if r["op"].startswith("decode") and r["threads"] == n_all]
    bes = [(lab, b * 8 / 1e9, bpv) for lab, b, bpv in bes if b is not None and math.isfinite(b)]
    if bes:
        y = np.arange(len(bes))
        ax.barh(y, [b for _, b, _ in bes], color="tab:green")
        ax.set_yticks(y)
        ax.set_yticklabels([f"{lab} ({bpv:.2f} bpv)" for lab, _, bpv in bes])
        for yy, (_, b, _) in zip(y, bes):
            ax.text(b, yy, f" {b:.2f}", va="center", fontsize=7)
        ax.invert_yaxis()
    ax.set_xlabel("Gbit/s (load + decode beats raw bf16 below this)")
    ax.set_title(f"break-even link speed ({n_all} threads)")
    m = res["machine"]
    fig.suptitle(f"kvz speed - {m.get('cpu', '?')}, {m.get('usable_cores', '?')} cores, load avg "
                 f"{res.get('loadavg_start')} -> {res.get('loadavg_end')}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res: dict) -> str:
    m = res["machine"]
    n_all = m["all_threads"]
    L = [f"# kvz speed ({'quick' if res['quick'] else 'full'})", "",
         f"`{res['command']}` - {res['created']}, code {res.get('code_rev')}, {m.get('cpu')}, "
         f"{m.get('usable_cores')} usable cores; load average {res.get('loadavg_start')} at the start, "
         f"{res.get('loadavg_end')} at the end; {res['wall_s'] / 60:.1f} min wall."]
    for k in ("cpu_probe_start", "cpu_probe_end"):
        p = res.get(k)
        if p and "scaling" in p:
            L.append(f"CPU probe ({k[10:]}): 1 thread got {p['1']['cpu_over_wall']:.2f} CPU-s per s; {n_all} threads of "
                     f"GIL-free work ran {p['scaling']:.2f}x as fast as 1.")
    L.append("")
    L += ["## Acceptance", "", "| point | met | measured |", "| --- | --- | --- |"]
    for a in res.get("acceptance", []):
        cpu = a.get("met_cpu")
        note = "" if cpu is None or cpu == a["met"] else f" (by CPU time: {'yes' if cpu else 'no'})"
        L.append(f"| {a['point']} | {'yes' if a['met'] else 'NO'}{note} | {a['detail']} |")
    rows = res.get("aggregate", [])
    if rows:
        L += ["", f"## Codecs in process ({res['n_caches']} caches, {res.get('tokens')} tokens each; medians of "
              f"{res['settings']['rounds']} interleaved rounds, encode {res['settings']['enc_rounds']})", "",
              "Mv/s = million values per second by wall time; (cpu) = by the process's CPU time. Break-even: the "
              f"link speed below which loading + decoding beats loading raw bf16 ({n_all} threads, wall).", "",
              "| codec | op | bpv | worst tensor NRMSE | 1 thread Mv/s | 1 thread Mv/s (cpu) | "
              f"{n_all} threads Mv/s | {n_all} threads Mv/s (cpu) | break-even ({n_all} threads) | "
              "break-even (1 thread, by CPU time) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        keys = []
        for r in rows:
            if (r["codec"], r["op"]) not in keys:
                keys.append((r["codec"], r["op"]))
        for codec, op in keys:
            r1, rn = _agg(rows, codec, op, 1), _agg(rows, codec, op, n_all)
            any_r = r1 or rn
            be = _bw((rn or r1).get("break_even_Bps")) if op.startswith("decode") else ""
            be1 = _bw(r1.get("break_even_Bps_cpu")) if op.startswith("decode") and r1 else ""
            L.append(f"| {codec} | {op} | {any_r['bpv']:.3f} | {any_r['nrmse_max_tensor']:.4f} | "
                     f"{_mv(r1 and r1['vps'])} | {_mv(r1 and r1['vps_cpu'])} | "
                     f"{_mv(rn and rn['vps']) if n_all > 1 else '-'} | "
                     f"{_mv(rn and rn['vps_cpu']) if n_all > 1 else '-'} | {be} | {be1} |")
        if res.get("skipped"):
            L += [""] + [f"- skipped {k}: {v}" for k, v in res["skipped"].items()]
    vs = (res.get("processes") or {}).get("summary") or {}
    if vs:
        L += ["", "## kvz 0.1 vs 0.2 (fresh processes, same caches, tensor scope, eps 0.0267)", "",
              "0.1 ran in the default environment and with single-thread BLAS (`" + BLAS1 + "`); the speed-ups are "
              "against the better 0.1 figure.", "",
              "| | 0.1 (default env) | 0.1 (1-thread BLAS) | 0.2, 1 thread | " + f"0.2, {n_all} threads |",
              "| --- | --- | --- | --- | --- |"]
        for kind in ("encode", "decode"):
            for what in ("wall", "cpu"):
                L.append(f"| {kind} Mv/s ({what}) | {_mv(vs.get(f'{kind}_{what}_vps_0.1'))} | "
                         f"{_mv(vs.get(f'{kind}_{what}_vps_0.1_blas1'))} | "
                         f"{_mv(vs.get(f'{kind}_{what}_vps_0.2_t1'))} | "
                         f"{_mv(vs.get(f'{kind}_{what}_vps_0.2_t{n_all}'))} |")
        for kind in ("encode", "decode"):
            for what in ("wall", "cpu"):
                L.append(f"| {kind} speed-up ({what}) | | | {vs.get(f'{kind}_{what}_speedup_t1', math.nan):.2f}x | "
                         f"{vs.get(f'{kind}_{what}_speedup_t{n_all}', math.nan):.2f}x |")
        if "bpv" in vs:
            L += ["", "bpv per cache: " + "; ".join(
                f"{c}: " + ", ".join(f"{k} {x:.4f}" for k, x in sorted(v.items())) for c, v in vs["bpv"].items())]
    env = (res.get("processes") or {}).get("env") or {}
    if env.get("variants"):
        L += ["", "## Default environment vs thread variables (this tree, fresh processes)", "",
              "Medians over rounds x repeats; a run is flagged when the default is slower by more than "
              f"{ENV_TOLERANCE:.0%} in wall *and* CPU time.", "",
              "| variant | run | default s | variant s | default / variant (wall) | default / variant (cpu) |",
              "| --- | --- | --- | --- | --- | --- |"]
        for v, d in env["variants"].items():
            for k, x in d.items():
                if isinstance(x, dict) and k.endswith("_wall"):
                    c = d.get(k[:-5] + "_cpu", {})
                    L.append(f"| {v} ({d['rounds']} rounds) | {k[:-5]} | {x['default_s']:.3f} | {x['variant_s']:.3f} | "
                             f"{x['default_over_variant']:.3f} | {c.get('default_over_variant', math.nan):.3f} |")
        L += ["", "Flags: " + ("; ".join(env["flags"]) if env["flags"] else "none")]
        if env.get("noise"):
            L += ["", "Not flagged (noise): " + "; ".join(env["noise"])]
    cli = res.get("cli")
    if cli:
        L += ["", "## CLI vs in process (one 2,048-token cache)", "", "| run | wall s | cpu s |", "| --- | --- | --- |"]
        for k, t in cli["times"].items():
            L.append(f"| {k} | {t['wall_s']:.3f} | {t['cpu_s']:.3f} |")
        L += ["", f"CLI {cli['cli_vps'] / 1e6:.1f} Mv/s with the process start, "
              f"{cli['cli_vps_excl_start'] / 1e6:.1f} without; in-process read {cli['inproc_read_vps'] / 1e6:.1f} "
              f"Mv/s: ratio {cli['ratio_incl_start']:.2f} / {cli['ratio_excl_start']:.2f}. (CPU of the "
              f"subprocesses: {cli['children_cpu_s']:.1f} s in all.)"]
        if "ratio_batch" in cli:
            L += ["", f"`kvz decompress` of {cli['batch_files']} such files in one call: "
                  f"{cli['cli_batch_vps'] / 1e6:.1f} Mv/s, {cli['ratio_batch']:.2f}x of in-process read() and "
                  f"{cli['cli_batch_vps'] / cli['inproc_decompress_to_vps']:.2f}x of in-process decompress_to() "
                  f"(which also writes the file; one file: {cli['cli_vps'] / cli['inproc_decompress_to_vps']:.2f}x)."]
        ph = cli.get("cold_start_phases") or {}
        if ph:
            L += ["", "Where a fresh process spends its time (medians): " + ", ".join(
                f"{k[:-2].replace('_', ' ')} {v:.3f} s" for k, v in ph.items()) +
                " (the first decompress includes loading the compiled kernels; the second is warm)."]
    rs = res.get("restore")
    if rs:
        L += ["", f"## Restore vs prefill ({rs['tokens']} tokens, {rs['model']})", "",
              f"Prefill {rs['prefill_s']:.1f} s wall ({rs['prefill_tokens_per_s']:.0f} tokens/s, torch "
              f"{rs['torch_threads']} threads, chunk {rs['prefill_chunk']}); compressed to {rs['bpv']:.3f} bpv in "
              f"{rs['encode_s']:.1f} s ({rs['encode_threads']} threads).", "",
              "| threads | restore s | restore / prefill | Mv/s |", "| --- | --- | --- | --- |"]
        for th, t in rs["restore"].items():
            L.append(f"| {th} | {t['wall_s']:.3f} | {t['fraction_of_prefill'] * 100:.2f}% | {t['vps'] / 1e6:.1f} |")
    bd = res.get("bound")
    if bd:
        sz1 = _agg(res.get("aggregate", []), "sz3", "decode", 1)
        L += ["", f"## How fast one thread can decode with exact map products ({bd['cache']})", "",
              f"One single-thread read(): {bd['values'] / 1e6:.1f} M values in {bd['read_s']:.3f} s; the integer map "
              f"products do {bd['macs'] / 1e9:.2f} G multiply-adds ({bd['macs_per_value']:.0f} per decoded value) in "
              f"{bd['map_products_s']:.3f} s ({bd['kernel_gmacs']:.1f} GMAC/s, {bd['map_share']:.0%} of the read); "
              f"everything else takes {bd['rest_s']:.3f} s ({bd['rest_ns_per_value']:.2f} ns per value)."]
        ref = bd.get("bf16_reference")
        if ref:
            L += ["", f"torch {ref['torch']} bf16 GEMM on the same shapes, one thread: {ref['gmacs']:.1f} GMAC/s. At "
                  f"the faster of the two ({bd['peak_gmacs']:.1f} GMAC/s) the map products alone need "
                  f"{bd['map_floor_s']:.3f} s: a decode could reach at most {bd['max_vps_maps_only'] / 1e6:.1f} M "
                  "values/s if everything else were free" +
                  (f" = {bd['max_vps_maps_only'] / sz1['vps']:.2f}x SZ3's single-thread decode in this run "
                   f"({sz1['vps'] / 1e6:.1f} M values/s); 0.6x SZ3 leaves "
                   f"{(bd['values'] / (0.6 * sz1['vps']) - bd['map_floor_s']) / bd['values'] * 1e9:.2f} ns per value "
                   f"for the rest (measured {bd['rest_ns_per_value']:.2f})" if sz1 else "") + "."]
    pf = res.get("profile")
    if pf:
        L += ["", f"## Profile of one single-thread decode ({pf['wall_s_profiled']:.2f} s under cProfile)", "",
              "| function | calls | own s | share |", "| --- | --- | --- | --- |"]
        for e in pf["top_own"][:12]:
            L.append(f"| `{e['function']}` | {e['calls']} | {e['own_s']:.3f} | {e['own_share'] * 100:.1f}% |")
    if res.get("notes"):
        L += ["", "## Notes", ""] + [f"- {x}" for x in res["notes"]]
    return "\n".join(L) + "\n"


# ============================================================================ the run

def default_caches() -> list[str]:
    return sorted(glob.glob(os.path.join(EVAL_DIR, "*.safetensors")))


def run(preset: str = "full", caches: list[str] | None = None, *, bank: str = BANK, codecs=CODECS,
        sections=("codecs", "processes", "cli", "restore", "profile", "bound"), kvz01: str = KVZ01_DIR,
        overrides: dict | None = None, json_out: str | None = None, plot_out: str | None = None,
        md_out: str | None = None, command: str | None = None, progress: bool = True) -> dict:
    """The whole benchmark; returns the results (and writes what was asked)."""
    from alignpred import load_cache
    from alignpred.bank.registry import find as find_bank
    from kvz.benchmarks.run import code_revision, display_path

    cfg = {**PRESETS[preset], **(overrides or {})}
    t_start, c_start = time.perf_counter(), time.process_time()
    paths = list(caches or default_caches())
    if not paths:
        raise FileNotFoundError("no caches: make data/eval/*.safetensors with `python samples/make_samples.py "
                                "--what eval`, or pass cache paths")
    if cfg["n_caches"]:
        paths = paths[:cfg["n_caches"]]
    kbank = find_bank(bank)
    bank_path = _bank_file(bank)
    loaded = [(os.path.splitext(os.path.basename(p))[0], load_cache(p)) for p in paths]
    res: dict = {"schema": SCHEMA, "command": command or "python -m kvz.benchmarks.speed" +
                 (" --quick" if preset == "quick" else ""), "quick": preset == "quick",
                 "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "code_rev": code_revision(),
                 "machine": machine(), "loadavg_start": loadavg(), "settings": {**cfg, "eps": EPS, "scope": SCOPE,
                                                                                 "bank": bank, "codecs": list(codecs),
                                                                                 "sections": list(sections)},
                 "caches": [{"name": n, "path": display_path(p), "n_tokens": c.layout.n_tokens,
                             "n_values": c.layout.n_values, "dtype": c.layout.dtype}
                            for (n, c), p in zip(loaded, paths)],
                 "n_caches": len(loaded), "tokens": loaded[0][1].layout.n_tokens, "notes": []}
    ok, why = lmcache_status()
    res["lmcache"] = {"available": ok, "detail": why}
    n_all = res["machine"]["all_threads"]
    threads = thread_counts(n_all)
    _warm_kvz(kbank)
    res["cpu_probe_start"] = cpu_probe()
    log(f"CPU probe: {res['cpu_probe_start']}")

    def save(final: bool = False):
        if final:
            res["cpu_probe_end"] = cpu_probe()
            pr = [res.get("cpu_probe_start", {}), res["cpu_probe_end"]]
            sc = [p["scaling"] for p in pr if "scaling" in p]
            if n_all > 1 and sc and min(sc) < 0.75 * n_all:
                res["notes"].append(
                    f"{n_all} threads of GIL-free work ran only {min(sc):.2f}x as fast as 1 thread during this run "
                    f"(CPU probe; 1 thread got {pr[0].get('1', {}).get('cpu_over_wall', math.nan):.2f} CPU-s per "
                    "second): the machine was shared or throttled, so the multi-thread figures here do not show "
                    "kvz's scaling; the CPU-time columns approximate an idle core")
        res["loadavg_end"] = loadavg()
        res["wall_s"] = time.perf_counter() - t_start
        res["cpu_s"] = time.process_time() - c_start
        res["acceptance"] = acceptance(res)
        if json_out:
            write_json(res, json_out)
        if md_out:
            with open(md_out, "w", encoding="utf-8") as f:
                f.write(markdown(res))

    if "codecs" in sections:
        log(f"codecs on {len(loaded)} caches, threads {threads}, {cfg['rounds']} rounds (load {loadavg()})")
        cs = codec_section(loaded, kbank, codecs=codecs, threads=threads, rounds=cfg["rounds"],
                           enc_rounds=cfg["enc_rounds"], progress=progress)
        res["rows"], res["skipped"], res["identity"] = cs["rows"], cs["skipped"], cs["identity"]
        res["aggregate"] = aggregate(cs["rows"])
        save()
    if "profile" in sections and "kvz" in codecs:
        c = KvzCodec(loaded[0][1], kbank)
        c.encode(n_all)
        c.decode(1)
        res["profile"] = profile_decode(c)
        res["profile"]["cache"] = loaded[0][0]
        del c
        save()
    if "bound" in sections and "kvz" in codecs:
        log("one-thread bound of exact map products ...")
        c = KvzCodec(loaded[0][1], kbank)
        c.encode(n_all)
        res["bound"] = bound_section(c)
        res["bound"]["cache"] = loaded[0][0]
        del c
        save()
    if "processes" in sections:
        ok01, where = ensure_kvz01(kvz01)
        res["kvz01"] = {"available": ok01, "detail": where, "commit": KVZ01_COMMIT}
        if not ok01:
            res["notes"].append(f"kvz 0.1 not measured: {where}")
        log(f"fresh-process workers (kvz 0.1: {where}) ...")
        res["processes"] = version_env_section(
            paths[:cfg["proc_caches"]] if cfg["proc_caches"] else paths, bank_path=bank_path,
            kvz01=kvz01 if ok01 else None, threads=threads,
            proc_rounds=cfg["proc_rounds"], env_rounds=cfg["env_rounds"], env_variants=cfg["env_variants"],
            rep_enc=cfg["rep_enc"], rep_dec=cfg["rep_dec"], progress=progress)
        save()
    if "cli" in sections:
        log("CLI vs in process ...")
        res["cli"] = cli_section(loaded[0][1], kbank, rounds=cfg["cli_rounds"], progress=progress)
        res["cli"]["cache"] = loaded[0][0]
        save()
    del loaded
    gc.collect()
    if "restore" in sections:
        try:
            res["restore"] = restore_section(cfg["prefill_tokens"], kbank, repeats=cfg["restore_repeats"],
                                             progress=progress)
        except (ImportError, FileNotFoundError, RuntimeError, OSError) as e:
            res["notes"].append(f"restore vs prefill not measured: {type(e).__name__}: {e}")
            log(res["notes"][-1])
        save()
    if not ok and "lmcache_k16v8" in codecs:
        res["notes"].append(f"LMCache not measured: {why}")
    res["notes"].append("baselines' 'all threads' = their tensors (LMCache: layers) split over a thread pool; kvz's = "
                        "its own threads= (object ranges); SZ3 at a per-tensor absolute bound giving NRMSE <= eps per "
                        "tensor (the knob search is set-up, not encode time); zstd-19 encode timed once")
    save(final=True)
    if plot_out and res.get("aggregate"):
        write_plot(res, plot_out)
    return res


def _bank_file(bank: str) -> str:
    """A file holding the bank (the worker processes load it by path)."""
    from alignpred.bank.registry import lookup

    if os.path.isfile(bank):
        return bank
    e = lookup(bank)
    for attr in ("path", "file", "location"):
        p = getattr(e, attr, None) if e is not None else None
        if p and os.path.isfile(str(p)):
            return str(p)
    from kvz.benchmarks.run import BUNDLED_BANK

    return BUNDLED_BANK


def _warm_kvz(bank) -> None:
    """JIT-compile/load kvz's kernels and plans outside the timed runs (a 448-token sample)."""
    from alignpred import KvzReader, compress, load_cache

    p = os.path.join(SAMPLES, "english-prose.safetensors")
    if not os.path.exists(p):
        return
    c = load_cache(p)
    for th in thread_counts():
        kw = {"threads": th} if "threads" in inspect.signature(compress).parameters else {}
        data = compress(c, None, eps=EPS, bank=bank, scope=SCOPE, **kw).data
        KvzReader(data, bank=bank, threads=th).read()


def render(json_path: str, plot_out: str | None = None, md_out: str | None = None) -> dict:
    """Recompute the summaries and the acceptance from a results JSON's raw rows and runs, and rewrite
    it with its Markdown and plot (after a change to how results are summarised; nothing is re-timed)."""
    with open(json_path) as f:
        res = json.load(f)
    if res.get("rows"):
        res["aggregate"] = aggregate(res["rows"])
    pr = res.get("processes")
    if pr and pr.get("runs"):
        pr["summary"], pr["env"] = summarize_versions(pr["runs"]), summarize_env(pr["runs"])
    res["acceptance"] = acceptance(res)
    write_json(res, json_path)
    stem = os.path.splitext(json_path)[0]
    with open(md_out or stem + ".md", "w", encoding="utf-8") as f:
        f.write(markdown(res))
    if res.get("aggregate"):
        write_plot(res, plot_out or stem + ".png")
    return res


def print_acceptance(res: dict) -> None:
    for x in res.get("acceptance", []):
        cpu = "" if x.get("met_cpu") in (None, x["met"]) else f" [by CPU time: {'met' if x['met_cpu'] else 'not met'}]"
        print(f"{'met' if x['met'] else 'NOT MET':>8}  {x['point']}: {x['detail']}{cpu}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("caches", nargs="*", help="2,048-token caches (default: data/eval/*.safetensors)")
    ap.add_argument("--quick", action="store_true", help="two caches, fewer repeats, a 4,096-token prefill")
    ap.add_argument("--json", default=None, help="results JSON (default: benchmarks/results/speed[-quick].json)")
    ap.add_argument("--plot", default=None, help="plot PNG (default: next to the JSON)")
    ap.add_argument("--md", default=None, help="Markdown summary (default: next to the JSON)")
    ap.add_argument("--bank", default=BANK)
    ap.add_argument("--codecs", default=",".join(CODECS), help=f"subset of {','.join(CODECS)}")
    ap.add_argument("--sections", default="codecs,profile,bound,processes,cli,restore")
    ap.add_argument("--kvz01", default=KVZ01_DIR, help=f"kvz 0.1 tree (a worktree of {KVZ01_COMMIT}; made if absent)")
    ap.add_argument("--prefill-tokens", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--n-caches", type=int)
    ap.add_argument("-q", "--quiet", action="store_true")
    ap.add_argument("--command", help=argparse.SUPPRESS)  # the command line to record (kvz bench --speed)
    ap.add_argument("--render", metavar="JSON", help="only re-summarise an existing results JSON (and its .md, .png)")
    a = ap.parse_args(argv)
    global QUIET
    QUIET = a.quiet
    if a.render:
        res = render(a.render, a.plot, a.md)
        print_acceptance(res)
        return res
    preset = "quick" if a.quick else "full"
    ov = {k: v for k, v in (("prefill_tokens", a.prefill_tokens), ("rounds", a.rounds), ("n_caches", a.n_caches))
          if v is not None}
    base = os.path.join(RESULTS, "speed-quick" if a.quick else "speed")
    js = a.json or base + ".json"
    stem = os.path.splitext(js)[0]
    cmd = "python -m kvz.benchmarks.speed " + " ".join(shlex.quote(x) for x in (argv if argv is not None
                                                                                 else sys.argv[1:]))
    res = run(preset, a.caches or None, bank=a.bank, codecs=[c for c in a.codecs.split(",") if c],
              sections=[s for s in a.sections.split(",") if s], kvz01=a.kvz01, overrides=ov, json_out=js,
              plot_out=a.plot or stem + ".png", md_out=a.md or stem + ".md", command=a.command or cmd.strip(),
              progress=not a.quiet)
    print_acceptance(res)
    print(f"wrote {js}")
    return res


if __name__ == "__main__":
    main()
