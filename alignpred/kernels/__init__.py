"""Compiled kernels (numba), each next to the numpy reference it must equal bit for bit.

* :mod:`~alignpred.kernels.intmap` — exact integer map products (``map_predict``; ``reference_predict``),
  on Intel AMX tiles where the CPU has them (:mod:`~alignpred.kernels.intmap_amx`, the same bits;
  ``KVZ_AMX=0`` turns it off);
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
from alignpred.kernels.intmap_amx import amx_enabled
from alignpred.kernels.intmap_block import BW, BX, COL_BLK, K_CHUNK, R_BLK, WQ_MAX, XQ_MAX
from alignpred.kernels.intmap_block import _map_predict as map_predict_kernel
from alignpred.kernels.quantize import candidate_bits, column_entropy_bits, dequant_add, quantize
from alignpred.kernels.quantize_ref import (
                                      channel_entropy_bits,
                                      dequantize_residual,
                                      interp_prediction,
                                      quantize_residual,
)

#: the integer map kernel's register blocking (rows x 16-column vectors) and int32 chunk length
INTMAP_TILING = {"BX": BX, "BW": BW, "XQ_MAX": XQ_MAX, "WQ_MAX": WQ_MAX, "K_CHUNK": K_CHUNK,
                 "block": [R_BLK, COL_BLK]}

__all__ = ["amx_enabled", "amx_mix", "map_predict_kernel", "INTMAP_TILING", "IntMap", "channel_shifts", "map_predict",
           "pack_weights", "prepare_weights", "quantize_rows", "quantize_weights", "reference_predict", "fused_post",
           "reference_post", "candidate_bits", "column_entropy_bits", "dequant_add", "quantize",
           "channel_entropy_bits", "dequantize_residual", "interp_prediction", "quantize_residual"]


def __getattr__(name: str):
    """``amx_mix`` (:mod:`~alignpred.kernels.amx_probe`, a timing probe) is imported on first use:
    every kvz process imports this package, and the probe's kernels cost ~1.3 ms to define."""
    if name == "amx_mix":
        from alignpred.kernels.amx_probe import amx_mix

        return amx_mix
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

