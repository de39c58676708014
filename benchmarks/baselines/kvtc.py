"""KVTC-style transform coder: calibration PCA, rate-distortion bit allocation, uniform quantization, entropy coding.

Per tensor name, a PCA basis and mean are fitted on the calibration caches (a reusable bank: excluded from bpv,
reported as ``extra["bank_bits"]``, float32). A tensor X [H, T, D] is projected, Y = (X - mu) V, and every
component (h, i) gets a bit width b in 0..16: b = 0 drops it (reconstructed as the calibration mean), b >= 1 is
min/max uniform quantization with 2^b - 1 steps (fp16 zero rounded down and fp16 step rounded up, so nothing
clips). The allocation minimises D_i(b) + lambda * (T b + 32 [b > 0]) per component, the Lagrangian form of the
DP/greedy allocation under a distortion target; D_i(b) is measured exactly for b <= 8 and modelled
(T step^2 / 12) above. The knob is lambda (the slope of the distortion target); it is searched per tensor
(``alloc="tensor"``) or globally (``alloc="pooled"``, the equal-slope optimum across the whole cache).

Entropy coding, whichever is smaller per tensor (one flag byte): (a) rANS (``constriction``, a core kvz dependency)
with a discretised-Gaussian model per kept component (a categorical table over its 2^b codes; per-symbol quantized
Gaussian above 12 bits), its mean and std stored as fp16 (32 bits per kept component),
or (b) zstd level 9 over the codes laid out component-major (uint8 for b <= 8, uint16 above). On KV-like data (a)
is ~5 % smaller. Stored per tensor besides: one byte per component for b, fp16 zero + fp16 step per kept one.
"""
from __future__ import annotations

import numpy as np

from ._core import Encoded, TensorCodec
from ._pca import bank_bits, fit_pca_bank

BMAX = 16
EXACT_B = 8
ZSTD_LEVEL = 9
META_PER_KEPT = 32
META_PER_COMP = 8


try:
    import constriction  # noqa: F401  (a core kvz dependency)
    _HAVE_CONSTRICTION = True
except ImportError:  # pragma: no cover
    _HAVE_CONSTRICTION = False


def _zstd_encode(qk, b_k):
    import zstandard
    small = qk[b_k <= 8].astype(np.uint8).tobytes()
    big = qk[b_k > 8].astype("<u2").tobytes()
    return "zstd", zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(small + big), 0, None


def _zstd_decode(blob, side, b_k, T):
    import zstandard
    raw = zstandard.ZstdDecompressor().decompress(blob)
    n_small = int((b_k <= 8).sum())
    qk = np.empty((len(b_k), T))
    qk[b_k <= 8] = np.frombuffer(raw, np.uint8, count=n_small * T).reshape(n_small, T)
    qk[b_k > 8] = np.frombuffer(raw, "<u2", offset=n_small * T).reshape(-1, T)
    return qk


CAT_MAX_B = 12  # up to this width a per-component categorical table (fast decode); wider: per-symbol Gaussian


def _gauss_tables(mu, sd, b_k):
    """Per kept component, the discretised Gaussian over 0..2^b-1 as a constriction Categorical model."""
    import constriction
    from scipy.special import ndtr
    models = []
    for m, s, b in zip(mu.astype(np.float64), sd.astype(np.float64), b_k):
        edges = np.arange((1 << int(b)) + 1) - 0.5
        p = np.diff(ndtr((edges - m) / s)) + 1e-9
        models.append(constriction.stream.model.Categorical(p / p.sum(), perfect=False))
    return models


def _ans_encode(qk, b_k):
    """rANS (constriction) with a quantized Gaussian per component; mean and std stored as fp16 (32 bits per comp)."""
    import constriction
    T = qk.shape[1]
    mu = qk.mean(1).astype(np.float16)
    sd = np.maximum(qk.std(1), 0.3).astype(np.float16)
    coder = constriction.stream.stack.AnsCoder()
    q32 = qk.astype(np.int32)
    if int(b_k.max()) <= CAT_MAX_B:
        models = _gauss_tables(mu, sd, b_k)
        for i in reversed(range(len(b_k))):
            coder.encode_reverse(q32[i], models[i])
    else:
        model = constriction.stream.model.QuantizedGaussian(0, int(2 ** int(b_k.max()) - 1))
        coder.encode_reverse(q32.ravel(), model, np.repeat(mu.astype(np.float64), T),
                             np.repeat(sd.astype(np.float64), T))
    return "ans", coder.get_compressed().astype("<u4").tobytes(), 32 * len(b_k), (mu, sd)


def _ans_decode(raw, side, b_k, T):
    import constriction
    mu, sd = side
    coder = constriction.stream.stack.AnsCoder(np.frombuffer(raw, "<u4").copy())
    if int(b_k.max()) <= CAT_MAX_B:
        models = _gauss_tables(mu, sd, b_k)
        return np.stack([coder.decode(m, T) for m in models]).astype(np.float64)
    model = constriction.stream.model.QuantizedGaussian(0, int(2 ** int(b_k.max()) - 1))
    q = coder.decode(model, np.repeat(mu.astype(np.float64), T), np.repeat(sd.astype(np.float64), T))
    return q.reshape(len(b_k), T).astype(np.float64)


def _f16_down(v):
    h = v.astype(np.float16)
    return np.where(h.astype(np.float64) > v, np.nextafter(h, np.float16(-np.inf)), h)


def _f16_up(v):
    h = v.astype(np.float16)
    return np.where(h.astype(np.float64) < v, np.nextafter(h, np.float16(np.inf)), h)


def _qparams(mn, mx, b):
    """fp16 zero and step covering [mn, mx] with 2^b - 1 steps (broadcasting over b)."""
    levels = np.maximum((2.0 ** b) - 1, 1.0)
    z = _f16_down(mn)
    s = _f16_up(np.maximum(mx - z.astype(np.float64), 0.0) / levels)
    return z, s


def _quant(y, z, s, b):
    s64 = s.astype(np.float64)
    safe = np.where(s64 > 0, s64, 1.0)
    q = np.clip(np.rint((y - z.astype(np.float64)) / safe), 0, (2.0 ** b) - 1)
    return q


class KVTC(TensorCodec):
    knob_kind = "continuous"
    knob_name = "lambda"
    uses_calib = True

    def __init__(self, name: str = "kvtc"):
        self.name = name

    def prepare(self, cache, calib):
        return {"bank": fit_pca_bank(calib, list(cache)), "an": {}}

    def bank_info(self, ctx):
        return {"bank_bits": bank_bits(ctx["bank"], with_mean=True), "bank_excluded_from_bpv": True}

    # -- analysis (cached per tensor for the search)
    def _analyse(self, name, x, ctx):
        key = (name, id(x))
        an = ctx["an"].get(key)
        if an is not None:
            return an
        mu, v, _ = ctx["bank"][name]
        y = np.matmul(x.astype(np.float64) - mu[:, None, :], v)  # [H, T, D]
        yc = np.swapaxes(y, -1, -2)  # [H, D, T] component-major
        T = yc.shape[-1]
        mn, mx = yc.min(-1), yc.max(-1)
        Dt = np.empty(mn.shape + (BMAX + 1,))
        Dt[..., 0] = np.einsum("hdt,hdt->hd", yc, yc)
        for b in range(1, BMAX + 1):
            z, s = _qparams(mn, mx, b)
            if b <= EXACT_B:
                q = _quant(yc, z[..., None], s[..., None], b)
                r = q * s.astype(np.float64)[..., None] + z.astype(np.float64)[..., None] - yc
                Dt[..., b] = np.einsum("hdt,hdt->hd", r, r)
            else:
                Dt[..., b] = T * s.astype(np.float64) ** 2 / 12.0
        an = {"yc": yc, "mn": mn, "mx": mx, "D": Dt, "T": T}
        if len(ctx["an"]) >= 128:
            ctx["an"].clear()
        ctx["an"][key] = an
        return an

    def _alloc(self, an, lam):
        bs = np.arange(BMAX + 1)
        cost = an["T"] * bs + META_PER_KEPT * (bs > 0)
        return np.argmin(an["D"] + lam * cost, axis=-1)  # [H, D]

    def _codes(self, an, bsel):
        z, s = _qparams(an["mn"], an["mx"], bsel.astype(np.float64))
        q = _quant(an["yc"], z[..., None], s[..., None], bsel[..., None].astype(np.float64))
        return q, z, s

    def _recon(self, name, q, z, s, bsel, ctx):
        mu, v, _ = ctx["bank"][name]
        yc = q * s.astype(np.float64)[..., None] + z.astype(np.float64)[..., None]
        yc = np.where(bsel[..., None] > 0, yc, 0.0)
        return np.matmul(np.swapaxes(yc, -1, -2), np.swapaxes(v, -1, -2)) + mu[:, None, :]

    def trial(self, name, x, lam, ctx):
        an = self._analyse(name, x, ctx)
        bsel = self._alloc(an, lam)
        q, z, s = self._codes(an, bsel)
        return self._recon(name, q, z, s, bsel, ctx)

    def encode(self, name, x, lam, ctx):
        an = self._analyse(name, x, ctx)
        bsel = self._alloc(an, lam)
        q, z, s = self._codes(an, bsel)
        keep = bsel > 0
        qk = q[keep]  # [n_kept, T]
        b_k = bsel[keep]
        streams = [_zstd_encode(qk, b_k)]
        if _HAVE_CONSTRICTION and qk.size:
            streams.append(_ans_encode(qk, b_k))
        kind, blob, side_bits, side = min(streams, key=lambda t: len(t[1]) * 8 + t[2])
        meta = 8 + META_PER_COMP * bsel.size + META_PER_KEPT * int(keep.sum()) + side_bits
        return Encoded(8 * len(blob) + meta, (kind, blob, side, bsel.astype(np.uint8), z[keep], s[keep], an["T"]),
                       meta)

    def decode(self, name, enc, shape, ctx):
        kind, blob, side, bsel, zk, sk, T = enc.payload
        keep = bsel > 0
        b_k = bsel[keep]
        qk = (_zstd_decode if kind == "zstd" else _ans_decode)(blob, side, b_k, T)
        q = np.zeros(bsel.shape + (T,))
        q[keep] = qk
        z = np.zeros(bsel.shape, np.float16)
        s = np.zeros(bsel.shape, np.float16)
        z[keep], s[keep] = zk, sk
        return self._recon(name, q, z, s, bsel, ctx).reshape(shape)

    def knob_guess(self, xs, eps, ctx):
        ss = sum(float(np.sum(np.square(x.astype(np.float64)))) for x in xs)
        n = sum(x.size for x in xs)
        return 2 * np.log(2) * eps ** 2 * ss / max(n, 1) or 1e-30


def baselines():
    return {"kvtc": KVTC()}
