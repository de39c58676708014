"""Entropy stage: static probability models (:mod:`~alignpred.entropy.models`) apart from the
coders that use them (:mod:`~alignpred.entropy.rans`: the 4-lane rANS kernels; ``rans_ctx``: the
context-coded lossless tier; :mod:`~alignpred.entropy.coder`: the object-level API below;
:mod:`~alignpred.entropy.registry`: one :class:`Coder` record per coder a file may name).

>>> import numpy as np
>>> from alignpred import entropy
>>> q = np.array([[0, 1, -1, 2]], dtype=np.int32)
>>> ids = entropy.choose_models(q)
>>> np.array_equal(entropy.decode(entropy.encode(q, ids), ids, q.shape), q)
True
"""
from alignpred.entropy.coder import (
                                     CODER_IDS,
                                     CODERS,
                                     MODEL_SET_ID,
                                     N_MODELS,
                                     N_TOKENS,
                                     PREC,
                                     choose_models,
                                     decode,
                                     decode_ctx,
                                     decode_objects,
                                     encode,
                                     encode_ctx,
                                     estimate_bits,
                                     histogram,
                                     models_from_histogram,
)
from alignpred.entropy.lanes import LANES_PREC
from alignpred.entropy.lanes import decode as lanes_decode
from alignpred.entropy.lanes import encode as lanes_encode
from alignpred.entropy.lanes_simd import target_isa as lanes_isa
from alignpred.entropy.registry import Coder, coders
from alignpred.entropy.registry import get as get_coder

__all__ = ["MODEL_SET_ID", "PREC", "N_MODELS", "N_TOKENS", "CODERS", "CODER_IDS", "choose_models", "estimate_bits",
           "encode", "decode", "decode_objects", "encode_ctx", "decode_ctx", "histogram", "models_from_histogram",
           "LANES_PREC", "lanes_encode", "lanes_decode", "lanes_isa", "Coder", "coders", "get_coder"]
