"""The ``.kvz`` container, and nothing above it: pure bytes <-> records (preamble, header JSON,
index, footer: :mod:`~alignpred.format.container`), the header model
(:mod:`~alignpred.format.header`), index checks (:mod:`~alignpred.format.index`) and byte-range
sources (:mod:`~alignpred.format.ranged`). format_spec/kvz.md is the normative text.

The byte-range sources live here, not in :mod:`alignpred.api`: a :class:`RangedSource` is how the
container's bytes are reached (``size`` + ``read_range``), and :func:`~alignpred.format.ranged.sparse_copy`
knows only the container's layout (preamble, footer, where the header and index lie); a store
implements it without touching the codec. What compresses, reads and decodes (:func:`compress`,
:class:`KvzReader`, sessions, warm-up) is the layer above, :mod:`alignpred.api`; nothing here
imports it.
"""
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

__all__ = ["ENTRY_SIZE", "FLAG_REFINE", "FOOTER_SIZE", "MAJOR", "PREAMBLE_SIZE", "Footer", "IndexEntry", "crc32",
           "parse_container", "parse_header", "parse_index", "parse_preamble", "BytesRanges", "RangedSource"]
