"""SZ3 (PyPI ``pysz``) with an absolute error bound per tensor as the knob.

Each [kv_heads, T, head_dim] tensor is coded as one float32 array (2-D [T, head_dim] when kv_heads == 1), with the
interpolation+Lorenzo predictor (SZ3's default, ``sz3``) or the Lorenzo/regression predictor (``sz3_lorenzo``).
The stored size is the whole SZ3 stream (its header and config included).

``sz3_aligned``: before SZ3, each tensor is rotated by the PCA basis of the calibration caches' tensor of the same
name (Y = X V, orthogonal, so the Frobenius error is unchanged up to the final cast), and rotated back after. The
bases are a reusable bank: excluded from bpv, reported as ``extra["bank_bits"]`` (float32).
"""
from __future__ import annotations

import math
import time

import numpy as np

from ._core import Encoded, TensorCodec
from ._pca import bank_bits, fit_pca_bank


def _sz():
    from pysz import sz, szAlgorithm, szConfig, szErrorBoundMode
    return sz, szAlgorithm, szConfig, szErrorBoundMode


def _squeeze(x: np.ndarray) -> np.ndarray:
    return x[0] if x.ndim == 3 and x.shape[0] == 1 else x


class SZ3(TensorCodec):
    knob_kind = "continuous"
    knob_name = "abs_error_bound"

    def __init__(self, name: str = "sz3", algo: str = "INTERP_LORENZO", aligned: bool = False):
        self.name = name
        self.algo = algo
        self.aligned = aligned
        self.uses_calib = aligned

    def prepare(self, cache, calib):
        if self.aligned:
            return {"bank": fit_pca_bank(calib, list(cache)), "rot": {}}
        return {}

    def bank_info(self, ctx):
        if self.aligned:
            return {"bank_bits": bank_bits(ctx["bank"], with_mean=False), "bank_excluded_from_bpv": True}
        return {}

    def _fwd(self, name, x, ctx):
        x = x.astype(np.float32)
        if self.aligned:
            v = ctx["bank"][name][1].astype(np.float32)  # [H, D, D]
            x = np.matmul(x, v)
        return np.ascontiguousarray(_squeeze(x), dtype=np.float32)

    def _inv(self, name, y, shape, ctx):
        y = y.reshape(shape)
        if self.aligned:
            v = ctx["bank"][name][1].astype(np.float32)
            y = np.matmul(y, np.swapaxes(v, -1, -2))
        return y

    def encode(self, name, x, eb, ctx):
        sz, szAlgorithm, szConfig, szErrorBoundMode = _sz()
        if self.aligned:  # the rotation is deterministic: computed once per tensor, its time added to every encode
            key = (name, id(x))
            pre_s = 0.0
            if key in ctx["rot"]:
                y, pre_s = ctx["rot"][key]
            else:
                t0 = time.perf_counter()
                y = self._fwd(name, x, ctx)
                ctx["rot"] = {key: (y, time.perf_counter() - t0)}
        else:
            y, pre_s = self._fwd(name, x, ctx), 0.0
        conf = szConfig()
        conf.errorBoundMode = szErrorBoundMode.ABS
        conf.absErrorBound = float(eb)
        conf.cmprAlgo = getattr(szAlgorithm, self.algo)
        buf, _ = sz.compress(y, conf)
        buf = buf.copy()
        return Encoded(8 * buf.nbytes, (buf, y.shape), 0, pre_s)

    def decode(self, name, enc, shape, ctx):
        sz = _sz()[0]
        buf, yshape = enc.payload
        y, _ = sz.decompress(buf, np.float32, yshape)
        return self._inv(name, y, shape, ctx)

    def knob_guess(self, xs, eps, ctx):
        ss = sum(float(np.sum(np.square(x.astype(np.float64)))) for x in xs)
        n = sum(x.size for x in xs)
        rms = math.sqrt(ss / max(n, 1)) or 1e-30
        return math.sqrt(3.0) * eps * rms


def baselines():
    return {
        "sz3": SZ3("sz3", "INTERP_LORENZO"),
        "sz3_lorenzo": SZ3("sz3_lorenzo", "LORENZO_REG"),
        "sz3_aligned": SZ3("sz3_aligned", "INTERP_LORENZO", aligned=True),
    }
