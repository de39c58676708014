"""``MAP``: the bank's linear map from already-decoded blocks at the same positions (keys from
the previous layer's K and V, values from the previous layer's V and this and the previous
layer's K; fitted by ridge regression on calibration caches, RoPE undone).

The product runs object by object (``object_size`` rows), so every object's prediction comes
from products of the same shape whichever range is decoded. With ``arith = "float"`` (format
1.0) it is a float32 BLAS product (its rounding may differ between machines and thread counts);
with ``arith = "exact"`` (format 1.1) it is exact integer arithmetic (:mod:`alignpred.kernels.intmap`)
and the same everywhere.
"""
from __future__ import annotations

import numpy as np

from alignpred.codec.predictors.base import Predictor

MAP = 1


class LinearMap(Predictor):
    id = MAP
    name = "map"

    def enabled(self, config) -> bool:
        return config.inter_map

    def attach(self, plans, bank, config):
        for b, p in plans.items():
            srcs = bank.sources(b)
            f = bank.map_factors(b)
            if f is None or not srcs:
                continue
            u, vt = f
            if config.align:
                # refs arrive aligned (z_u = x_u A_u): undo each source rotation, then rotate into A_b.
                d = p.mean.shape[0]
                u = np.concatenate([plans[s].rot.T @ u[k * d:(k + 1) * d] for k, s in enumerate(srcs)], axis=0)
                if vt is None:
                    u = u @ p.rot
                else:
                    vt = vt @ p.rot
            if config.arith == "exact":  # integer products, the same bits everywhere (kvz.md §8.4.1)
                from alignpred.kernels.intmap import IntMap

                first = IntMap(u, len(srcs))
                second = None if vt is None else IntMap(vt, 1)
                p.data[self.name] = (tuple(srcs), first, second)
                p.sources.update(srcs)
                continue
            # A full map straight from the bank stays in its stored dtype (float16 halves the
            # memory of the bundled bank's maps); ``base`` widens it to float32, exactly.
            keep = vt is None and not config.align and u.dtype in (np.float16, np.float32) and u.flags.c_contiguous
            u = u if keep else np.ascontiguousarray(u, np.float32)
            vt = None if vt is None else np.ascontiguousarray(vt, np.float32)
            p.data[self.name] = (tuple(srcs), u, vt)
            p.sources.update(srcs)

    def base(self, plan, recon, out=None):
        srcs, u, vt = plan.data[self.name]
        if not isinstance(u, np.ndarray):  # exact: rows are independent (per-row scales), one call
            if vt is None:
                return u.predict([recon[s] for s in srcs], out=out)
            return vt.predict([u.predict([recon[s] for s in srcs])], out=out)
        S = plan.object_size
        d_src = u.shape[0] // len(srcs)
        xs = [recon[s] for s in srcs]
        n = xs[0].shape[0]
        if out is None:
            out = np.empty((n, plan.mean.shape[0]), np.float32)
        uu = u.astype(np.float32, copy=False)  # float16 banks: widened per call (exact)
        for a in range(0, n, S):
            y = None
            for k, x in enumerate(xs):  # per source: no concatenated copy
                t = x[a:a + S] @ uu[k * d_src:(k + 1) * d_src]
                y = t if y is None else y + t
            out[a:a + S] = y if vt is None else y @ vt
        return out
