"""What a user of kvz calls, above the container (:mod:`alignpred.format`): :func:`compress` and
:func:`compress_bytes` (:mod:`~alignpred.api.writer`: a cache, an error budget and a bank in, a
``.kvz`` out), :class:`KvzReader` (:mod:`~alignpred.api.reader`: whole files or token ranges,
into new arrays or the caller's buffers), :class:`DecoderSession` (:mod:`~alignpred.api.session`:
decoders kept per bank across readers), :class:`CompileWatch` and the warm-up
(:mod:`~alignpred.api.warmup`: numba's compiles done before the first request; the function is
public as ``alignpred.warmup``, not re-exported here, where it would hide its module), and the
summaries ``kvz inspect`` prints (:mod:`~alignpred.api.describe`).

This layer joins the codec (:mod:`alignpred.codec`) to the container's records; the container
itself never imports it. The same names are public at the top, ``from alignpred import compress``,
which is the spelling to prefer.

>>> import numpy as np
>>> from alignpred.api import KvzReader, compress_bytes
>>> from alignpred import Cache, fit_bank
>>> rng = np.random.default_rng(0)
>>> cache = Cache.from_arrays([(rng.standard_normal((1, 200, 16)).astype(np.float16),) * 2])
>>> bank = fit_bank([cache], rank=None)
>>> KvzReader(compress_bytes(cache, budget=0.05, bank=bank), bank=bank).read()["layers.0.key"].shape
(1, 200, 16)
"""
from alignpred.api.reader import TILE_TOKENS, KvzReader
from alignpred.api.session import DEFAULT_SESSION, DecoderSession
from alignpred.api.warmup import CompileWatch
from alignpred.api.writer import CompressInfo, compress, compress_bytes

__all__ = ["TILE_TOKENS", "KvzReader", "DEFAULT_SESSION", "DecoderSession", "CompressInfo", "compress",
           "compress_bytes", "CompileWatch"]
