"""Covariance-rotation coder in the style of OSCAR and AQUA-KV (a peer, not a reproduction of either).

What it does, per tensor name (``layers.{i}.key|value``) and KV head, everything fitted on the **calibration
caches only** (``calib=``; the cache being coded is read only for its names and shapes in :meth:`CovRot.prepare`):

1. **Frame.** Keys are coded in the frame chosen by ``frame``: ``"post"`` (default, as OSCAR: the cache as
   stored, i.e. post-RoPE) or ``"pre"`` (RoPE undone from the cache metadata with ``alignpred.cache.apply_rope``,
   re-applied at decode, as KVQuant does). Values have no RoPE.
2. **Weights (keys only).** The expected squared logit error of a key error ``dk`` is ``dk^T E[q q^T] dk``. The
   bank's attention statistics (:class:`alignpred.bank.AttentionStats` of ``gemma-3-270m``, measured on the same
   calibration texts) hold the queries' second moments per RoPE pair (pre-RoPE, after ``q_norm``, summed over the
   GQA group); phase-averaged, the query covariance is ``diag(w)`` with ``w = E|q_p|^2 / 2`` on both channels of
   pair ``p``, the same diagonal in the pre- and the post-RoPE frame (RoPE rotates inside a pair). Keys are
   whitened by ``sqrt(w)`` (floored at ``WEIGHT_FLOOR`` x its mean) before the PCA, so squared error in the
   rotated coefficients *is* the query-weighted error. Values are not weighted (plain covariance; OSCAR's
   score-weighted value covariance needs attention scores the bank does not store). Caches whose shape does not
   match the statistics (other models, synthetic data) are coded unweighted, and ``bank_info`` says so.
3. **Rotation.** The eigenbasis ``U`` of the (weighted) calibration covariance around the calibration mean ``mu``
   (:func:`._pca.fit_pca_bank`, the PCA KVTC uses, run on the whitened calibration keys): coefficients
   ``y = U^T sqrt(w) (x - mu)``.
4. **Bit allocation by variance.** Integer bits ``b_i`` in 0..``BMAX`` per coefficient, ``sum b_i = R * D`` for the
   natural rate ``R`` (2, 3, 4 bits), by greedy reverse water-filling with the MSE of the Gaussian-optimal
   uniform quantiser at each width; coefficients below the water level get 0 bits (reconstructed as the
   calibration mean). The variances are (``adapt="tensor"``, default) this tensor's RMS per coefficient,
   stored as fp16 (16 bits per coefficient and head, counted) so that the decoder repeats the allocation, or
   (``adapt="calib"``, fully offline as OSCAR) the calibration eigenvalues (nothing stored). On held-out
   caches the offline variances miss: values' NRMSE at 4 bits 0.17 against 0.10 adaptive (256 tokens of
   ``data/eval/japanese-manpage``), for 16/T bpv.
5. **Quantisation.** Per token ``t``: ``z_i = y_i / sigma_i`` (``sigma_i`` the scale of step 4), optionally one
   per-token scale ``s_t`` = RMS of ``z`` over the coded coefficients (fp16, 16 bits per token and head,
   counted), then a symmetric mid-rise uniform quantiser with ``2^b_i`` levels and step ``m_b * Delta_b``
   (``Delta_b`` Gaussian-optimal; ``m_b`` a clipping multiplier per tensor name and width, fitted on the
   calibration coefficients - the offline clip thresholds of OSCAR in this form). ``token_scale="auto"``
   (default): the encoder codes the tensor with and without the per-token scales and keeps the one with the
   smaller squared error in the (weighted) coefficients, one mode byte per tensor (counted); a per-token RMS
   can be inflated by one outlier coefficient (layer 1's keys: weighted error 0.078 with it, 0.023 without).
6. **Sink.** The first ``sink`` tokens (default 1) are stored at 16 bits (source dtype if 16-bit, else fp16), as
   OSCAR / KVQuant keep the attention sink in full precision. No recent-token window by default (``recent=0``):
   at the benchmark's 256-token contexts a 16-bit window would dominate the rate.

bpv counts every bit the decoder needs beyond the bank: ``b_i`` per coded coefficient per token, 16 bits of
scale per token and head when used, 16 bits per coefficient and head for the adaptive scales, one mode byte per
tensor, 16 bits per sink / recent value. The bank (mean, rotation, stds, bit allocation, clip
multipliers; float32) is a reusable calibration artefact like KVTC's PCA bank: excluded from bpv and reported as
``extra["bank_bits"]``.

**Reproduced from OSCAR** (Zhou et al., arXiv 2605.17757, from the paper's abstract and project page; no code
read or copied): offline calibration of an attention-aware covariance per layer and head and a fixed rotation
from its eigendecomposition; keys aligned with the query second moments; offline-fitted clipping; per-token
scaling; sink kept in 16-bit. **Not reproduced**: its full ``Q^T Q`` (only the phase-averaged diagonal is
available here), the score-weighted value covariance, the Hadamard mixing and bit-reversal permutation composed
with the eigenbasis (they equalise energy for a flat INT2 code; here bits are allocated by variance instead),
asymmetric per-token zero points, the BF16 recent window (``recent`` is available, off by default), its INT2
kernels. **From AQUA-KV** (Shutova et al., arXiv 2501.19392): only the idea of quantising what calibration cannot
predict (here: the residual after the calibration mean, in a decorrelated basis); its cross-layer and K->V
linear predictors and its HIGGS quantiser are **not** implemented.

Registered: ``covrot`` (post-RoPE keys, as OSCAR; discrete knob ``bits``, 3 by default, searched for matched
error; the rate-quality benchmark runs it at ``covrot@2`` / ``@3`` / ``@4``), ``covrot2`` / ``covrot3`` / ``covrot4`` at
fixed rates, and ``covrot_pre`` (keys pre-RoPE; query-weighted key error at 3 bits 0.029 against 0.044
post-RoPE on the cache above).
"""
from __future__ import annotations

import math
from functools import cache

import numpy as np

from ._core import Encoded, TensorCodec
from ._pca import fit_pca_bank
from ._rope import key_rope, layer_index, rope_params

BMAX = 8
BIT_VALUES = (8, 7, 6, 5, 4, 3, 2, 1)  # increasing error
WEIGHT_FLOOR = 1e-3
VAR_FLOOR = 1e-10
CLIP_GRID = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)  # x the Gaussian step
SCALE_BITS = 16
DEFAULT_STATS = "gemma-3-270m"


# --------------------------------------------------------------------------- Gaussian-optimal uniform quantiser

def _cell_mse(a, b, c):
    """E[(X - c)^2; a < X <= b] for a unit Gaussian X (a, b may be infinite)."""
    from scipy.special import ndtr

    def phi(x):
        return 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)

    pa, pb = float(ndtr(a)), float(ndtr(b))
    xa = 0.0 if math.isinf(a) else a * phi(a)
    xb = 0.0 if math.isinf(b) else b * phi(b)
    return (pb - pa - xb + xa) - 2 * c * (phi(a) - phi(b)) + c * c * (pb - pa)


def _midrise_mse(step: float, b: int) -> float:
    n = 1 << b
    edges = [-math.inf] + [(k - n // 2) * step for k in range(1, n)] + [math.inf]
    return sum(_cell_mse(edges[k], edges[k + 1], (k - n // 2 + 0.5) * step) for k in range(n))


@cache
def gaussian_uniform(b: int) -> tuple[float, float]:
    """(optimal step, its MSE) of the ``2^b``-level symmetric mid-rise uniform quantiser of a unit Gaussian;
    ``b = 0``: (0, 1) (the mean)."""
    if b == 0:
        return 0.0, 1.0
    from scipy.optimize import minimize_scalar
    r = minimize_scalar(lambda s: _midrise_mse(s, b), bounds=(1e-4, 4.0), method="bounded",
                        options={"xatol": 1e-10})
    return float(r.x), float(r.fun)


def allocate_bits(var: np.ndarray, total: int, bmax: int = BMAX) -> np.ndarray:
    """Integer bits per component (``sum == total`` unless every component with variance is at ``bmax``), greedy reverse
    water-filling: each bit goes where it removes the most modelled distortion ``var_i * g(b_i)``."""
    var = np.maximum(np.asarray(var, np.float64), 0.0)
    var = np.where(var > VAR_FLOOR * var.max(initial=0.0), var, 0.0)  # numerically empty directions get no bits
    g = np.array([gaussian_uniform(b)[1] for b in range(bmax + 1)] + [0.0])
    b = np.zeros(var.shape, np.int64)
    for _ in range(int(min(total, bmax * var.size))):
        gain = var * (g[b] - g[b + 1])
        gain[b >= bmax] = -1.0
        i = int(np.argmax(gain))
        if gain[i] <= 0:
            break
        b[i] += 1
    return b


def quantise(z: np.ndarray, step: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Mid-rise codes in ``-2^(b-1) .. 2^(b-1) - 1`` (0 where ``b = 0``)."""
    half = np.where(bits > 0, 2.0 ** (bits - 1), 0.0)
    safe = np.where(step > 0, step, 1.0)
    return np.where(bits > 0, np.clip(np.floor(z / safe), -half, half - 1), 0.0)


def dequantise(q: np.ndarray, step: np.ndarray, bits: np.ndarray) -> np.ndarray:
    return np.where(bits > 0, (q + 0.5) * step, 0.0)


# --------------------------------------------------------------------------- codec

class CovRot(TensorCodec):
    knob_kind = "discrete"
    knob_name = "bits"
    knob_values = BIT_VALUES
    uses_calib = True

    def __init__(self, name: str = "covrot", bits: int | None = None, frame: str = "post", sink: int = 1,
                 recent: int = 0, stats=DEFAULT_STATS, weight_keys: bool = True, adapt: str = "tensor",
                 token_scale: bool | str = "auto"):
        if frame not in ("post", "pre"):
            raise ValueError("frame must be 'post' or 'pre'")
        if adapt not in ("calib", "tensor"):
            raise ValueError("adapt must be 'calib' or 'tensor'")
        self.adapt = adapt
        if token_scale not in (True, False, "auto"):
            raise ValueError("token_scale must be True, False or 'auto'")
        self.token_scale = token_scale
        self.name = name
        self.frame = frame
        self.sink = int(sink)
        self.recent = int(recent)
        self.stats_ref = stats
        self.weight_keys = weight_keys
        if bits is not None:
            self.knob_kind = "none"
        self.default_knob = 3 if bits is None else int(bits)

    # -- calibration (never reads the coded cache's values)
    def _stats(self):
        if not self.weight_keys or self.stats_ref is None:
            return None
        if not isinstance(self.stats_ref, str):
            return self.stats_ref
        from alignpred.bank import AttentionStats
        try:
            return AttentionStats.find(self.stats_ref)
        except Exception:  # no bank / sidecar here: unweighted, reported by bank_info
            return None

    def _key_weights(self, name, shape, stats):
        """Per-channel weights [H, D] for a key tensor, or None (unweighted)."""
        li = layer_index(name)
        if stats is None or li is None or not name.endswith("key"):
            return None
        H, D = int(np.prod(shape[:-2])) if len(shape) > 2 else 1, shape[-1]
        if li >= stats.num_layers or stats.kv_heads != H or stats.head_dim != D:
            return None
        w = stats.key_weights()[li]  # [H, D]
        return np.maximum(w, WEIGHT_FLOOR * w.mean(axis=-1, keepdims=True))

    def _body(self, name, x, rp, offset=None):
        """[..., T, D] -> float64 [H, T, D] in the coding frame (keys pre-RoPE when frame == 'pre')."""
        X = np.asarray(x, np.float32).reshape(-1, x.shape[-2], x.shape[-1])
        if self.frame == "pre" and name.endswith("key") and rp and rp.get("roped"):
            X = key_rope(X, name, rp, inverse=True, offset=offset)
        return X.astype(np.float64)

    def prepare(self, cache, calib):
        if not calib:
            raise ValueError(f"{self.name} needs calibration caches (calib=[...])")
        rp = rope_params(getattr(cache, "metadata", None)) if self.frame == "pre" else None
        stats = self._stats()
        names = list(cache)
        shapes = {k: tuple(cache[k].shape) for k in names}
        weights = {k: self._key_weights(k, shapes[k], stats) for k in names}
        # calibration tokens in the coding frame, sink excluded, keys whitened by sqrt(w)
        bodies = []
        for c in calib:
            crp = rope_params(getattr(c, "metadata", None)) if self.frame == "pre" else None
            b = {}
            for k in names:
                if k not in c:
                    continue
                Y = self._body(k, c[k], crp or rp, offset=(crp or {}).get("offset"))[:, self.sink:, :]
                b[k] = Y * np.sqrt(weights[k])[:, None, :] if weights[k] is not None else Y
            bodies.append(b)
        pca = fit_pca_bank(bodies, names)
        bank = {}
        for k in names:
            mu_w, U, lam = pca[k]
            a = np.sqrt(weights[k]) if weights[k] is not None else np.ones_like(mu_w)
            ys = [np.matmul(b[k] - mu_w[:, None, :], U) for b in bodies if k in b]
            bank[k] = {"mu": mu_w / a, "a": a, "U": U, "sigma": np.sqrt(np.maximum(lam, 1e-30)), "calib_y": ys}
        return {"bank": bank, "rope": rp, "weighted": {k: weights[k] is not None for k in names},
                "stats": getattr(stats, "model", None), "alloc": {}}

    def _plan(self, name, bits, ctx, ts=True):
        """Calibration plan at rate ``bits``: (bits per coefficient [H, D] by reverse water-filling on the
        calibration variances, {width: clip multiplier}) with the multipliers fitted on the calibration tokens."""
        key = (name, int(bits), bool(ts))
        if key in ctx["alloc"]:
            return ctx["alloc"][key]
        e = ctx["bank"][name]
        lam = e["sigma"] ** 2
        H, D = lam.shape
        B = np.stack([allocate_bits(lam[h], int(bits) * D) for h in range(H)])
        z = np.concatenate([y / e["sigma"][:, None, :] for y in e["calib_y"]], axis=1)  # [H, Tc, D]
        s = _token_scale(z, B) if ts else np.ones(z.shape[:-1])
        zs = z / s[..., None]
        mult = {}
        for b in range(1, BMAX + 1):
            m = B == b
            if not m.any():
                continue
            base = gaussian_uniform(b)[0]
            errs = []
            for c in CLIP_GRID:
                st = np.where(m, base * c, 0.0)
                r = dequantise(quantise(zs, st[:, None, :], B[:, None, :]), st[:, None, :], B[:, None, :]) - zs
                errs.append(float(np.sum(np.where(m[:, None, :], (r * s[..., None]) ** 2 * lam[:, None, :], 0.0))))
            mult[b] = float(CLIP_GRID[int(np.argmin(errs))])
        ctx["alloc"][key] = (B, mult)
        return B, mult

    def _layout(self, name, bits, ctx, sig=None, ts=True):
        """(bits [H, D], step in normalised units [H, D]): the calibration plan, or (``adapt="tensor"``) the
        allocation on this tensor's stored coefficient scales ``sig`` with the calibration clip multipliers."""
        B, mult = self._plan(name, bits, ctx, ts)
        if sig is not None:
            var = np.asarray(sig, np.float64) ** 2
            B = np.stack([allocate_bits(var[h], int(bits) * var.shape[-1]) for h in range(var.shape[0])])
        step = np.zeros(B.shape)
        for b in range(1, BMAX + 1):
            step = np.where(B == b, gaussian_uniform(b)[0] * mult.get(b, 1.0), step)
        return B, step

    def bank_info(self, ctx):
        tot = 0
        for e in ctx["bank"].values():
            tot += 32 * (e["U"].size + e["mu"].size + e["a"].size + e["sigma"].size)
        tot += sum(8 * B.size + 32 * len(mult) for B, mult in ctx["alloc"].values())
        w = ctx["weighted"]
        keys = [k for k in w if k.endswith("key")]
        return {"bank_bits": tot, "bank_excluded_from_bpv": True, "covrot_frame": self.frame,
                "covrot_adapt": self.adapt, "covrot_token_scale": self.token_scale,
                "covrot_key_weights": (f"query second moments of {ctx['stats']}" if keys and all(w[k] for k in keys)
                                       else "partial" if any(w[k] for k in keys) else "none (unweighted)")}

    # -- encode / decode
    def _split(self, T):
        s = min(self.sink, T)
        r = min(self.recent, T - s)
        return s, r

    def encode(self, name, x, bits, ctx):
        bits = int(round(self.default_knob if bits is None else bits))
        X = np.asarray(x)
        H = int(np.prod(X.shape[:-2])) if X.ndim > 2 else 1
        T, D = X.shape[-2], X.shape[-1]
        s, r = self._split(T)
        X3 = X.reshape(H, T, D)
        full = np.concatenate([X3[:, :s], X3[:, T - r:]], axis=1)
        full = full if full.dtype.itemsize == 2 else full.astype(np.float16)
        payload = {"full": full.copy(), "s": s, "r": r, "T": T, "H": H, "D": D, "bits": bits}
        nbits = 16 * full.size
        if T - s - r <= 0:
            payload["q"] = None
            return Encoded(nbits, payload, 0)
        e = ctx["bank"][name]
        rp = ctx.get("rope")
        Y = self._body(name, X3, rp)[:, s:T - r, :]
        y = np.matmul((Y - e["mu"][:, None, :]) * e["a"][:, None, :], e["U"])
        n_tok = T - s - r
        meta = 0
        if self.adapt == "tensor":  # this tensor's RMS per coefficient, fp16 (stored: the decoder allocates from it)
            sig = np.sqrt(np.mean(y * y, axis=1)).astype(np.float16)
            sig = np.where(sig.astype(np.float64) > 0, sig, np.float16(0))
            meta += 16 * sig.size
        else:
            sig = None
        sg = e["sigma"] if sig is None else np.where(sig > 0, sig.astype(np.float64), 1.0)
        z = y / sg[:, None, :]
        best = None
        for ts in ((True, False) if self.token_scale == "auto" else (self.token_scale,)):
            B, step = self._layout(name, bits, ctx, sig, ts)
            sc = _token_scale(z, B).astype(np.float16) if ts else None
            zn = z / sc.astype(np.float64)[..., None] if ts else z
            q = quantise(zn, step[:, None, :], B[:, None, :])
            zr = dequantise(q, step[:, None, :], B[:, None, :])
            zr = zr * sc.astype(np.float64)[..., None] if ts else zr
            err = float(np.sum(((zr - z) * sg[:, None, :]) ** 2))  # squared error in the (weighted) coefficients
            if best is None or err < best[0]:
                best = (err, ts, q, sc, B)
        _, ts, q, sc, B = best
        payload.update(q=q.astype(np.int16), scale=sc, sig=sig, ts=ts)
        code_bits = int(B.sum()) * n_tok
        meta += (SCALE_BITS * H * n_tok if ts else 0) + (8 if self.token_scale == "auto" else 0)  # + mode byte
        return Encoded(nbits + code_bits + meta, payload, meta)

    def decode(self, name, enc, shape, ctx):
        p = enc.payload
        H, T, D, s, r = p["H"], p["T"], p["D"], p["s"], p["r"]
        out = np.empty((H, T, D), np.float32)
        full = p["full"].astype(np.float32)
        out[:, :s] = full[:, :s]
        if r:
            out[:, T - r:] = full[:, s:]
        if p["q"] is not None:
            e = ctx["bank"][name]
            sig = p["sig"]
            B, step = self._layout(name, p["bits"], ctx, sig, p["ts"])
            sg = e["sigma"] if sig is None else np.where(sig > 0, sig.astype(np.float64), 1.0)
            z = dequantise(p["q"].astype(np.float64), step[:, None, :], B[:, None, :])
            if p["scale"] is not None:
                z = z * p["scale"].astype(np.float64)[..., None]
            y = z * sg[:, None, :]
            Y = np.matmul(y, np.swapaxes(e["U"], -1, -2)) / e["a"][:, None, :] + e["mu"][:, None, :]
            rp = ctx.get("rope")
            if self.frame == "pre" and name.endswith("key") and rp and rp.get("roped"):
                Y = key_rope(Y.astype(np.float32), name, rp, inverse=False, offset=rp["offset"] + s)
            out[:, s:T - r] = Y
        return out.reshape(shape)

    def discrete_hint(self, xs, eps, ctx):
        return (BIT_VALUES.index(4),)


def _token_scale(z: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Per-token RMS of the coded coefficients ``z`` [H, T, D] (``B`` [H, D] > 0), 1 where it is 0."""
    m = (B > 0)[:, None, :]
    n = np.maximum(m.sum(-1), 1)
    rms = np.sqrt(np.sum(np.where(m, z * z, 0.0), axis=-1) / n)
    return np.clip(np.where(rms > 0, rms, 1.0), 2.0 ** -14, 6.0e4)  # a normal, finite fp16


def baselines() -> dict[str, TensorCodec]:
    out: dict[str, TensorCodec] = {"covrot": CovRot()}
    for b in (2, 3, 4):
        out[f"covrot{b}"] = CovRot(f"covrot{b}", bits=b)
    out["covrot_pre"] = CovRot("covrot_pre", frame="pre")
    return out
