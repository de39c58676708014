"""kvz / AlignPred: error-bounded KV-cache compression and the .kvz container.

The public API::

    from alignpred import load_cache, save_cache, Bank, fit_bank, compress, KvzReader
    cache = load_cache("samples/gemma3-270m/english-prose.safetensors")
    bank = Bank.load("samples/gemma3-270m/bank.h5")
    info = compress(cache, "out.kvz", eps=0.03, bank=bank)     # info.bpv, info.nrmse_max_tensor
    tensors = KvzReader("out.kvz", bank=bank).read(tokens=(0, 128))
"""
__version__ = "0.1.0"

from .bank import Bank  # noqa: E402
from .cachefile import Cache, load_cache, save_cache  # noqa: E402
from .calibrate import fit_bank  # noqa: E402
from .errors import (BankMismatchError, ChecksumError, EncodeError, FormatError, KvzError, LayoutError,  # noqa: E402
                     NonFiniteError, TruncatedError, UnsupportedVersionError)
from .kvzfile import CompressInfo, KvzReader, compress  # noqa: E402
from .predict import CodecConfig  # noqa: E402

__all__ = ["Bank", "Cache", "load_cache", "save_cache", "fit_bank", "compress", "KvzReader", "CompressInfo",
           "CodecConfig", "KvzError", "FormatError", "TruncatedError", "ChecksumError", "UnsupportedVersionError",
           "BankMismatchError", "LayoutError", "NonFiniteError", "EncodeError"]
