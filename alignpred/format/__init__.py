"""The ``.kvz`` container: pure bytes <-> records (:mod:`~alignpred.format.container`), the header
model (:mod:`~alignpred.format.header`), index checks (:mod:`~alignpred.format.index`), and the
writer, reader and decoder session on top (format_spec/kvz.md is the normative text)."""
from alignpred.format.container import (
                                        ENTRY_SIZE,
                                        FLAG_REFINE,
                                        FOOTER_SIZE,
                                        MAJOR,
                                        PREAMBLE_SIZE,
                                        Footer,
                                        IndexEntry,
                                        crc32,
                                        parse_container,
                                        parse_header,
                                        parse_index,
                                        parse_preamble,
)
from alignpred.format.ranged import BytesRanges, RangedSource
from alignpred.format.reader import TILE_TOKENS, KvzReader
from alignpred.format.session import DEFAULT_SESSION, DecoderSession
from alignpred.format.warmup import CompileWatch
from alignpred.format.writer import CompressInfo, compress, compress_bytes

__all__ = ["ENTRY_SIZE", "FLAG_REFINE", "FOOTER_SIZE", "MAJOR", "PREAMBLE_SIZE", "Footer", "IndexEntry", "crc32",
           "parse_container", "parse_header", "parse_index", "parse_preamble", "BytesRanges", "RangedSource",
           "TILE_TOKENS", "KvzReader", "DEFAULT_SESSION", "DecoderSession", "CompressInfo", "compress",
           "compress_bytes", "CompileWatch"]
