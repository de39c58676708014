"""Compiled kernels (numba), each next to the numpy reference it must equal bit for bit.

* :mod:`~alignpred.kernels.intmap` — exact integer map products (``map_predict``; ``reference_predict``);
* :mod:`~alignpred.kernels.fused` — the decoder's fused post-pass (``fused_post``; ``reference_post``);
* :mod:`~alignpred.kernels.quantize` — lattice quantisation and entropy estimates
  (reference: :mod:`~alignpred.kernels.quantize_ref`).

This layer imports nothing else of kvz but :mod:`alignpred.errors`.
"""
from alignpred.kernels.fused import fused_post, reference_post
from alignpred.kernels.intmap import (
                                      IntMap,
                                      channel_shifts,
                                      map_predict,
                                      pack_weights,
                                      prepare_weights,
                                      quantize_rows,
                                      quantize_weights,
                                      reference_predict,
)
from alignpred.kernels.quantize import candidate_bits, column_entropy_bits, dequant_add, quantize
from alignpred.kernels.quantize_ref import (
                                      channel_entropy_bits,
                                      dequantize_residual,
                                      interp_prediction,
                                      quantize_residual,
)

__all__ = ["IntMap", "channel_shifts", "map_predict", "pack_weights", "prepare_weights", "quantize_rows",
           "quantize_weights", "reference_predict", "fused_post", "reference_post", "candidate_bits",
           "column_entropy_bits", "dequant_add", "quantize", "channel_entropy_bits", "dequantize_residual",
           "interp_prediction", "quantize_residual"]
