"""kvz / AlignPred: error-bounded KV-cache compression and the .kvz container.

The public API (what a serving loader calls)::

    from alignpred import Cache, KvzReader, compress, compress_bytes, load_cache
    cache = load_cache("samples/gemma3-270m/english-prose.safetensors")   # or Cache.from_arrays(...)
    info = compress(cache, "out.kvz", eps=0.03, bank="gemma-3-270m")       # bank by registry name
    r = KvzReader("out.kvz")                                                # or KvzReader(bytes / mmap)
    tensors = r.read(tokens=(0, 128))
    for layer, k, v in r.layers(tokens=(0, 128), out=lambda i: (kbuf[i], vbuf[i])):  # into your buffers
        ...

Modules: :mod:`~alignpred.layout` / :mod:`~alignpred.metadata` (what a cache is),
:mod:`~alignpred.cachefile` (safetensors in/out), :mod:`~alignpred.bank` /
:mod:`~alignpred.banks` / :mod:`~alignpred.calibrate` (calibration banks and their registry),
:mod:`~alignpred.writer` / :mod:`~alignpred.reader` (the .kvz container), and the codec stages
(:mod:`~alignpred.frame`, :mod:`~alignpred.predictors`, :mod:`~alignpred.quantize`,
:mod:`~alignpred.entropy`, :mod:`~alignpred.encoder`, :mod:`~alignpred.decoder`).
"""
__version__ = "0.2.0"

from .bank import Bank  # noqa: E402
from .cachefile import Cache, load_cache, save_cache  # noqa: E402
from .calibrate import fit_bank  # noqa: E402
from .config import CodecConfig  # noqa: E402
from .errors import (BankMismatchError, ChecksumError, EncodeError, FormatError, KvzError, KvzWarning,  # noqa: E402
                     LayoutError, MetadataError, NonFiniteError, OutputExistsError, TruncatedError,
                     UnsupportedVersionError)
from .layout import CacheLayout  # noqa: E402
from .reader import DecoderSession, KvzReader  # noqa: E402
from .rope import RopeSpec, RopeTable  # noqa: E402
from .writer import CompressInfo, compress, compress_bytes  # noqa: E402

__all__ = ["Bank", "Cache", "CacheLayout", "load_cache", "save_cache", "fit_bank", "compress", "compress_bytes",
           "KvzReader", "DecoderSession", "CompressInfo", "CodecConfig", "RopeSpec", "RopeTable", "KvzError",
           "KvzWarning", "FormatError", "TruncatedError", "ChecksumError", "UnsupportedVersionError",
           "BankMismatchError", "LayoutError", "MetadataError", "NonFiniteError", "EncodeError",
           "OutputExistsError"]
