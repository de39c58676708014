"""What a cache is: its layout (the one block order), metadata, RoPE, and safetensors in/out.

* :mod:`~alignpred.cache.layout` — tensor/block names, :class:`CacheLayout`, dtype helpers;
* :mod:`~alignpred.cache.metadata` — the metadata fields, validated up front;
* :mod:`~alignpred.cache.rope` — exact, platform-independent RoPE tables (:class:`RopeSpec`);
* :mod:`~alignpred.cache.detect` — keys that look rotated when the metadata says otherwise;
* :mod:`~alignpred.cache.cachefile` — :class:`Cache`, safetensors parsing and writing;
* :mod:`~alignpred.cache.arrays` — numpy views of torch tensors without copies.
"""
from alignpred.cache.arrays import as_numpy
from alignpred.cache.cachefile import Cache, cache_bytes, load_cache, parse_safetensors, safetensors_header, save_cache
from alignpred.cache.detect import check_rope, check_rope_theta, frame_scores, looks_roped, rotation_ratio
from alignpred.cache.layout import (
                                    Block,
                                    CacheLayout,
                                    block_name,
                                    dtype_name,
                                    infer_layout,
                                    numpy_dtype,
                                    parse_name,
                                    tensor_name,
)
from alignpred.cache.metadata import layout_metadata, parse_metadata
from alignpred.cache.paged import gather as gather_paged
from alignpred.cache.paged import scatter as scatter_paged
from alignpred.cache.rope import RopeSpec, RopeTable, apply_rope, sincos_f32

__all__ = ["as_numpy", "Cache", "cache_bytes", "load_cache", "parse_safetensors", "safetensors_header", "save_cache",
           "check_rope", "check_rope_theta", "frame_scores", "looks_roped", "rotation_ratio", "Block",
           "CacheLayout", "block_name", "dtype_name", "infer_layout", "numpy_dtype", "parse_name",
           "tensor_name", "layout_metadata", "parse_metadata", "RopeSpec", "RopeTable", "apply_rope",
           "sincos_f32", "gather_paged", "scatter_paged"]
