"""atheris (libFuzzer) target for the .kvz reader. Not part of the pytest run.

The input's first byte picks a mode; the rest is a file image:

* mode even: the bytes are decoded as they are (checksums will usually reject them);
* mode odd: the checksums are *repaired* first (footer, header, index and every in-range
  payload CRC, as far as the footer's offsets allow), so that mutations get past the CRCs
  and reach the header validation, the bank parser and the entropy decoder.

Every input must decode or raise :class:`alignpred.errors.KvzError`; anything else is a
finding. Seeds are three small valid files (external bank, embedded bank, constriction coder),
written on start.

Run (from the repository root)::

    python tests/fuzz/fuzz_kvz.py -atheris_runs=1000000 /tmp/kvz-fuzz-corpus
    python tests/fuzz/fuzz_kvz.py -max_total_time=3600 /tmp/kvz-fuzz-corpus
"""
import os
import struct
import sys
import zlib

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (conftest helpers)

import numpy as np  # noqa: E402
from kvz_testing import synthetic_cache  # noqa: E402

import alignpred.api.reader as kf  # noqa: E402
from alignpred import CodecConfig, ErrorBudget, KvzError, KvzReader, compress, fit_bank  # noqa: E402
from alignpred.codec import Profile  # noqa: E402
from alignpred.format import container  # noqa: E402

_MEM = {}
kf.map_file = lambda path: memoryview(_MEM[path])
PATH = "<fuzz>.kvz"


def _seeds(corpus: str):
    import tempfile

    c = synthetic_cache(n_layers=2, heads=1, T=40, d=16)
    bank = fit_bank([c], rank=4, rotations=False)
    c2 = synthetic_cache(n_layers=2, heads=2, T=20, d=8, seed=3, roped=True)
    bank2 = fit_bank([c2], rank=None, rotations=True)
    d = tempfile.mkdtemp()
    compress(c, os.path.join(d, "a"), budget=0.05, bank=bank, config=CodecConfig(object_size=16))
    compress(c2, os.path.join(d, "b"), budget=ErrorBudget(eps=0.1, scope="object"), bank=bank2,
             profile=Profile(embed_bank=True), config=CodecConfig(object_size=8, align=True, blend=True))
    compress(c, os.path.join(d, "c"), budget=0.05, bank=bank, profile=Profile(coder="constriction"),
             config=CodecConfig(object_size=16))
    os.makedirs(corpus, exist_ok=True)
    for n in "abc":
        raw = open(os.path.join(d, n), "rb").read()
        for mode in (0, 1):
            with open(os.path.join(corpus, f"seed_{n}{mode}"), "wb") as f:
                f.write(bytes([mode]) + raw)
    return bank


def crc(b) -> int:
    return zlib.crc32(b) & 0xFFFFFFFF


def repair(b: bytearray) -> bytes:
    F = container.FOOTER_SIZE
    if len(b) < container.PREAMBLE_SIZE + F:
        return bytes(b)
    fo = len(b) - F
    ho, hl, io, il = struct.unpack_from("<QQQQ", b, fo)
    if ho + hl <= fo and io + il <= fo:
        if io + il == fo:
            idx = b[io:io + il]
            for k in range(0, len(idx) - len(idx) % 64, 64):
                off, ln = struct.unpack_from("<QQ", idx, k + 16)
                if off + ln <= len(b):
                    struct.pack_into("<I", idx, k + 56, crc(b[off:off + ln]))
            b[io:io + il] = idx
        struct.pack_into("<II", b, fo + 32, crc(b[ho:ho + hl]), crc(b[io:io + il]))
    struct.pack_into("<I", b, fo + 40, crc(b[fo:fo + 40]))
    return bytes(b)


BANK = None


def _instrument():
    """Coverage instrumentation of the reader's pure-Python modules only (instrument_all would
    take minutes and would touch numba kernels)."""
    import inspect
    import json.decoder

    import alignpred.bank.bank
    import alignpred.cache.layout
    import alignpred.cache.metadata
    import alignpred.codec.decoder
    import alignpred.codec.plan
    import alignpred.entropy
    import alignpred.format.header
    import alignpred.kernels.quantize_ref

    n = 0
    for mod in (kf, container, alignpred.bank.bank, alignpred.codec.decoder, alignpred.entropy, alignpred.format.header,
                alignpred.cache.layout, alignpred.cache.metadata, alignpred.codec.plan, alignpred.kernels.quantize_ref, json.decoder):
        for obj in list(vars(mod).values()):
            members = vars(obj).values() if inspect.isclass(obj) and obj.__module__ == mod.__name__ else [obj]
            for f in members:
                f = getattr(f, "__func__", f)
                if inspect.isfunction(f) and f.__module__ == mod.__name__:
                    atheris.instrument_func(f)
                    n += 1
    print(f"instrumented {n} functions", file=sys.stderr)


def TestOneInput(data: bytes):
    if not data:
        return
    raw = repair(bytearray(data[1:])) if data[0] & 1 else data[1:]
    _MEM[PATH] = raw
    try:
        r = KvzReader(PATH, bank=BANK)
        r.summary()
        r.read()
    except KvzError:
        pass


def main():
    global BANK
    import tempfile
    corpus = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if corpus is None:
        corpus = os.path.join(tempfile.gettempdir(), "kvz-fuzz-corpus")
        sys.argv.append(corpus)
    BANK = _seeds(corpus)
    np.seterr(all="ignore")
    # numba kernels are compiled by now (the seeds were encoded and are decoded here), so
    # instrumenting every Python function's bytecode does not disturb them.
    for name in sorted(os.listdir(corpus))[:4]:
        TestOneInput(open(os.path.join(corpus, name), "rb").read())
    _instrument()
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
