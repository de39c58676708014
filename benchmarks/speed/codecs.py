"""The codecs the speed benchmark times, set up per cache: kvz (``compress`` / ``KvzReader``), the
baselines through their :class:`~kvz.benchmarks.baselines.TensorCodec` contract at fixed per-tensor
knobs, and LMCache's ``AsymK16V8Codec``. Each has ``encode(threads)``, ``decode(threads)``,
``nbytes()``, ``ops`` (the operations timed) and ``extra`` (what the results record about it)."""
from __future__ import annotations

import inspect
import os
import time
import warnings

import numpy as np

from ..harness import pmap
from .config import CODECS, EPS, SCOPE


class KvzCodec:
    """kvz: ``compress`` to memory, ``KvzReader(bytes, threads=).read()`` / ``read_into``; with a
    ``profile`` other than the default (``compress(profile=)``) it is named ``kvz-<profile>`` and
    times encode and decode only."""

    ops: tuple = ("encode", "decode", "decode_into")

    def __init__(self, cache, bank, eps: float = EPS, scope: str = SCOPE, profile: str = "default"):
        from alignpred import compress

        self.cache, self.bank, self.eps, self.scope, self.profile = cache, bank, eps, scope, profile
        self.name = "kvz" if profile == "default" else f"kvz-{profile}"
        if profile != "default":
            self.ops = ("encode", "decode")
        self._threads_kw = "threads" in inspect.signature(compress).parameters
        self.data: bytes | None = None
        self.bufs = {k: np.empty_like(np.asarray(v)) for k, v in cache.tensors.items()}
        self.extra: dict = {"eps": eps, "scope": scope, "encode_threads_param": self._threads_kw}
        if profile != "default":
            self.extra["profile"] = profile

    def encode(self, threads: int):
        from alignpred import ErrorBudget, compress

        kw = {"threads": threads} if self._threads_kw else {}
        if self.profile != "default":
            kw["profile"] = self.profile
        info = compress(self.cache, None, budget=ErrorBudget(eps=self.eps, scope=self.scope), bank=self.bank, **kw)
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

    def encode(self, threads: int):
        c = self.codec

        def one(item):
            i, kn, vn = item
            return c.to_bytes(c.encode(self.t[kn], self.t[vn], layer_id=i, head_axis=0))

        self.blobs = pmap(threads, one, self.layers)
        return self.blobs

    def decode(self, threads: int) -> dict:
        from alignpred.cache import as_numpy

        torch = self.torch
        c = self.codec
        shape = {n: x.shape for n, x in self.tensors.items()}

        def one(arg):
            (i, kn, vn), blob = arg
            k, v, _ = c.decode(c.from_bytes(blob), out_v_dtype=torch.bfloat16)
            return (kn, as_numpy(k).reshape(shape[kn])), (vn, as_numpy(v).reshape(shape[vn]))

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
        elif c.startswith("kvz-"):
            out.append(KvzCodec(cache, bank, eps, profile=c[4:]))
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
