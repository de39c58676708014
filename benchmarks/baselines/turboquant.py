"""TurboQuant-style vector quantisation of KV vectors (Zandieh, Daliri, Hadian, Mirrokni, arXiv 2504.19874).

Re-implemented from the paper's description (no code copied). One *vector* is one token of one head: ``d``
channels (``x[..., t, :]``).

TurboQuant_mse (names ``turboquant_mse_{r}``), per vector ``x``:

1. store ``||x||`` (fp16, 16 bits; fp32 for the whole tensor if a norm would overflow fp16) and work on ``x/||x||``;
2. rotate by a fixed random orthogonal matrix ``Pi`` (Haar: QR of a seeded Gaussian matrix with the sign fix;
   shared by encoder and decoder, generated from the seed, so not counted);
3. quantise every rotated coordinate with the **Lloyd-Max scalar quantiser of the exact coordinate marginal** of a
   uniformly random unit vector in R^d, density ``f(x) ~ (1 - x^2)^((d-3)/2)`` on [-1, 1] (the paper's Beta
   marginal; ~ N(0, 1/d) for large d). The codebook is derived once per (d, b) by Lloyd iterations with closed-form
   cell probabilities (regularised incomplete beta) and closed-form first moments, so it is exact, not fitted to
   data (:func:`lloyd_max_codebook`);
4. decode ``x^ = ||x||_fp16 * Pi^T c[idx]`` (no renormalisation, as in the paper).

Fractional rates (2.5, 3.5, ...): the paper's outlier treatment splits the channels into an outlier and a
non-outlier set and runs two *independent* TurboQuant instances (own norm, own rotation of the subset's dimension,
own codebook) with more bits on the outliers. Here, for a rate ``r = b + f``: the ``round(f * d)`` channels with the
largest energy in this tensor (per head) get ``b + 1`` bits, the others ``b`` bits; the channel set costs ``d`` bits
per head (counted). *Simplified*: the paper does not spell out how outlier channels are picked nor (for every rate)
how many; we pick the split that makes the nominal rate exactly ``r``.

TurboQuant_prod (names ``turboquant_prod_{r}``): TurboQuant_mse at ``r - 1`` bits, then the 1-bit QJL of the
residual ``e = x - x^_mse``: store ``sign(S e)`` (``d`` bits; ``S`` a seeded d x d iid N(0, 1) matrix, shared, not
counted) and ``gamma = ||e||`` (fp16, 16 bits). Decoder (the paper's estimator):
``x^ = x^_mse + sqrt(pi/2) / d * gamma * S^T sign(S e)``. It is unbiased for inner products (``E_S <y, x^> =
<y, x>``) but **not** an MSE-optimal reconstruction: QJL is designed for attention scores, and for the KL
benchmark we hand the model this estimator's dequantised vector (its MSE is higher than TurboQuant_mse at the same
rate). The residual is taken in the un-normalised domain (equivalent to the paper's unit-vector form up to the fp16
rounding of the norms).

bpv: ``sum(bits per coordinate) + 16 per stored norm (+16 for gamma) + d per head when channels are split``,
all divided by the number of values; codes are counted bit-packed.

Knobs: ``turboquant_mse_{r}`` / ``turboquant_prod_{r}`` are fixed-rate (``knob_kind = "none"``, the natural
setting); ``turboquant_mse`` / ``turboquant_prod`` search the rate over :data:`RATES` (discrete) for matched error.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from scipy.special import betaincc, gammaln, ndtri

from ._core import Encoded, TensorCodec

ROT_SEED = 0x7B51  # rotation seed (shared by encoder and decoder)
QJL_SEED = 0x0D1A  # QJL projection seed
NORM_BITS = 16
RATES = (8.0, 6.0, 5.0, 4.5, 4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0)  # increasing error
PROD_RATES = (8.0, 6.0, 5.0, 4.5, 4.0, 3.5, 3.0, 2.5, 2.0)
FP16_MAX = 65504.0


# --------------------------------------------------------------------------- codebook

def coord_pdf(x, d: int) -> np.ndarray:
    """Density of one coordinate of a uniformly random unit vector in R^d (d >= 2)."""
    x = np.asarray(x, dtype=np.float64)
    logc = gammaln(d / 2) - gammaln((d - 1) / 2) - 0.5 * math.log(math.pi)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.exp(logc) * np.power(np.clip(1 - x * x, 0, None), (d - 3) / 2)
    return np.where(np.abs(x) < 1, out, 0.0)


def _cell_stats(a: np.ndarray, c: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """(probability, first moment) of the marginal on cells [a, c] with 0 <= a < c <= 1 (closed form)."""
    h = (d - 1) / 2
    p = 0.5 * (betaincc(0.5, h, a * a) - betaincc(0.5, h, c * c))
    logc = gammaln(d / 2) - gammaln((d - 1) / 2) - 0.5 * math.log(math.pi)
    m = math.exp(logc) / (d - 1) * (np.power(1 - a * a, h) - np.power(1 - c * c, h))
    return p, m


def _lloyd_map(c: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """One Lloyd step on the positive half (c ascending in (0, 1)): new centroids and the Jacobian of the map.

    Thresholds t_i = (c_i + c_{i+1}) / 2 with t_0 = 0 (symmetry) and t_m = 1; the new centroid of cell i is its
    conditional mean g_i. dg_i/dt_i = f(t_i) (t_i - g_i) / P_i, dg_i/dt_{i-1} = f(t_{i-1}) (g_i - t_{i-1}) / P_i,
    so the Jacobian in c is tridiagonal.
    """
    m = len(c)
    t = np.concatenate([[0.0], (c[:-1] + c[1:]) / 2, [1.0]])
    p, mom = _cell_stats(t[:-1], t[1:], d)
    ok = p > 0
    g = np.where(ok, mom / np.where(ok, p, 1.0), c)
    ps = np.where(ok, p, np.inf)
    ft = coord_pdf(t, d)
    A = ft[:-1] * (g - t[:-1]) / ps  # wrt t_{i-1}
    B = ft[1:] * (t[1:] - g) / ps  # wrt t_i
    A[0] = 0.0  # t_0 = 0 is fixed by symmetry
    B[-1] = 0.0  # t_m = 1 is fixed
    J = np.zeros((m, m))
    i = np.arange(m)
    J[i, i] = (A + B) / 2
    J[i[1:], i[1:] - 1] = A[1:] / 2
    J[i[:-1], i[:-1] + 1] = B[:-1] / 2
    return g, J


@lru_cache(maxsize=64)
def lloyd_max_codebook(d: int, bits: int, tol: float = 1e-10, max_iter: int = 10_000) -> tuple[np.ndarray,
                                                                                                np.ndarray]:
    """MSE-optimal (Lloyd-Max) scalar quantiser for one coordinate of a random unit vector in R^d.

    Returns ``(centroids, thresholds)``: ``2^bits`` ascending centroids, symmetric about 0, and the ``2^bits - 1``
    decision thresholds (midpoints). Solves the Lloyd fixed point (centroid = conditional mean of its cell,
    thresholds = midpoints) on the positive half (threshold 0 by symmetry) from a companding start (point density
    ~ f^(1/3)): Newton steps on ``g(c) - c = 0`` with the exact tridiagonal Jacobian, falling back to a plain Lloyd
    step whenever a Newton step would leave (0, 1) or reorder the centroids. Converged when the centroid condition
    holds to ``tol / sqrt(d)`` (or, below that, when float64 noise stops further progress). Read-only arrays
    (cached).
    """
    if d < 2 or bits < 1:
        raise ValueError("need d >= 2 and bits >= 1")
    m = 1 << (bits - 1)
    sig = 1 / math.sqrt(d)
    u = 0.5 + 0.5 * (np.arange(m) + 0.5) / m
    c = np.sort(np.minimum(sig * math.sqrt(3) * ndtri(u), 1 - 1e-9))
    best, stall = np.inf, 0
    for _ in range(max_iter):
        g, J = _lloyd_map(c, d)
        r = g - c
        err = float(np.max(np.abs(r)))
        if err <= tol * sig:
            c = g
            break
        stall = stall + 1 if err > 0.5 * best else 0
        best = min(best, err)
        if stall >= 20 and err <= 1e3 * tol * sig:  # at the float64 noise floor
            c = g
            break
        try:
            step = np.linalg.solve(np.eye(m) - J, r)
            new = c + step
            if not (np.all(np.diff(new) > 0) and new[0] > 0 and new[-1] < 1 and np.all(np.isfinite(new))):
                new = g
        except np.linalg.LinAlgError:
            new = g
        c = new
    cent = np.concatenate([-c[::-1], c])
    thr = (cent[:-1] + cent[1:]) / 2
    cent.setflags(write=False)
    thr.setflags(write=False)
    return cent, thr


def codebook_mse(d: int, bits: int) -> float:
    """Per-coordinate MSE of :func:`lloyd_max_codebook` on the exact marginal (E x^2 = 1/d)."""
    cent, thr = lloyd_max_codebook(d, bits)
    m = len(cent) // 2
    t = np.concatenate([[0.0], thr[m:], [1.0]])
    p, mom = _cell_stats(t[:-1], t[1:], d)
    c = cent[m:]
    # E (x - c_i)^2 over the positive half, times 2: E x^2 - 2 sum(c_i mom_i) + sum(c_i^2 p_i)
    return float(1 / d - 2 * (2 * np.sum(c * mom) - np.sum(c * c * p)))


# --------------------------------------------------------------------------- shared random matrices

@lru_cache(maxsize=32)
def random_rotation(d: int, seed: int = ROT_SEED) -> np.ndarray:
    """Haar-random d x d orthogonal matrix, deterministic in (d, seed). Read-only (cached)."""
    rng = np.random.default_rng([seed, d, 1])
    q, r = np.linalg.qr(rng.standard_normal((d, d)))
    q = q * np.where(np.diag(r) < 0, -1.0, 1.0)[None, :]
    q.setflags(write=False)
    return q


@lru_cache(maxsize=32)
def qjl_matrix(d: int, seed: int = QJL_SEED) -> np.ndarray:
    """The QJL projection S: d x d iid N(0, 1), deterministic in (d, seed). Read-only (cached)."""
    s = np.random.default_rng([seed, d, 2]).standard_normal((d, d))
    s.setflags(write=False)
    return s


def qjl_encode(e: np.ndarray, S: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1-bit QJL of rows of ``e`` [N, d]: (sign bits of S e as bool [N, d], ||e|| [N])."""
    return (e @ S.T) >= 0, np.sqrt(np.einsum("nd,nd->n", e, e))


def qjl_decode(signs: np.ndarray, gamma: np.ndarray, S: np.ndarray) -> np.ndarray:
    """The paper's estimator sqrt(pi/2)/d * gamma * S^T sign: unbiased for <y, e> over the draw of S."""
    d = S.shape[1]
    z = np.where(signs, 1.0, -1.0)
    return (math.sqrt(math.pi / 2) / d) * gamma[:, None] * (z @ S)


# --------------------------------------------------------------------------- TurboQuant_mse on a matrix of vectors

def _norms16(n: np.ndarray) -> tuple[np.ndarray, int]:
    """Stored norms: fp16 (16 bits) unless one would overflow, then fp32 (32 bits)."""
    if n.size and float(n.max()) >= FP16_MAX:
        return n.astype(np.float32).astype(np.float64), 32
    return n.astype(np.float16).astype(np.float64), NORM_BITS


def mse_encode_group(v: np.ndarray, bits: int, seed: int = ROT_SEED) -> tuple[np.ndarray, np.ndarray, int]:
    """TurboQuant_mse of rows of ``v`` [N, k]: (codes uint8/uint16 [N, k], stored norms [N], bits per norm)."""
    n = np.sqrt(np.einsum("nk,nk->n", v, v))
    ns, nb = _norms16(n)
    k = v.shape[1]
    if k == 1:  # a 1-d "vector" is its own norm and sign
        return (v[:, 0] >= 0).astype(np.uint8)[:, None], ns, nb
    _, thr = lloyd_max_codebook(k, bits)
    safe = np.where(n > 0, n, 1.0)
    y = (v / safe[:, None]) @ random_rotation(k, seed).T
    codes = np.searchsorted(thr, y).astype(np.uint8 if bits <= 8 else np.uint16)
    return codes, ns, nb


def mse_decode_group(codes: np.ndarray, norms: np.ndarray, bits: int, seed: int = ROT_SEED) -> np.ndarray:
    k = codes.shape[1]
    if k == 1:
        return np.where(codes[:, :1] > 0, 1.0, -1.0) * norms[:, None]
    cent, _ = lloyd_max_codebook(k, bits)
    return norms[:, None] * (cent[codes] @ random_rotation(k, seed))


def _split(rate: float, d: int) -> tuple[int, int]:
    """(base bits b, number of channels at b + 1) for a nominal rate."""
    b = int(math.floor(rate + 1e-9))
    n_hi = int(round((rate - b) * d))
    if n_hi >= d:
        return b + 1, 0
    return b, n_hi


def mse_encode(X: np.ndarray, rate: float, seed: int = ROT_SEED) -> tuple[dict, int, int]:
    """TurboQuant_mse of one head's vectors ``X`` [N, d] at a (possibly fractional) rate.

    Returns (payload, total bits, metadata bits). Metadata = norms + the outlier channel set.
    """
    N, d = X.shape
    b, n_hi = _split(rate, d)
    groups = []
    meta = 0
    if n_hi:
        energy = np.einsum("nd,nd->d", X, X)
        hi = np.zeros(d, bool)
        hi[np.argsort(-energy, kind="stable")[:n_hi]] = True
        meta += d  # the channel set, one bit per channel
        parts = [(np.flatnonzero(hi), b + 1), (np.flatnonzero(~hi), b)]
    else:
        hi = None
        parts = [(np.arange(d), b)]
    bits = 0
    for idx, gb in parts:
        if gb <= 0 or len(idx) == 0:
            groups.append((idx, gb, None, None))
            continue
        codes, ns, nb = mse_encode_group(X[:, idx], gb, seed)
        groups.append((idx, gb, codes, ns))
        bits += gb * codes.size + nb * N
        meta += nb * N
    return {"groups": groups, "d": d}, bits + (d if n_hi else 0), meta


def mse_decode(payload: dict, N: int, seed: int = ROT_SEED) -> np.ndarray:
    out = np.zeros((N, payload["d"]))
    for idx, gb, codes, ns in payload["groups"]:
        if codes is not None:
            out[:, idx] = mse_decode_group(codes, ns, gb, seed)
    return out


# --------------------------------------------------------------------------- codecs

def _heads(x: np.ndarray) -> np.ndarray:
    """[..., T, d] -> [H, T, d] float64 (leading dims flattened into heads)."""
    return np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-2], x.shape[-1])


class TurboQuant(TensorCodec):
    """TurboQuant_mse (``prod=False``) or TurboQuant_prod (``prod=True``) at a nominal rate (bits per coordinate).

    ``rate=None`` makes the rate the (discrete) search knob; otherwise the codec is fixed-rate.
    """

    def __init__(self, name: str, rate: float | None, prod: bool = False, default_rate: float = 3.5,
                 seed: int = ROT_SEED, qjl_seed: int = QJL_SEED):
        self.name = name
        self.prod = prod
        self.seed = seed
        self.qjl_seed = qjl_seed
        if rate is None:
            self.knob_kind = "discrete"
            self.knob_name = "rate"
            self.knob_values = PROD_RATES if prod else RATES
            self.default_knob = float(default_rate)
        else:
            self.knob_kind = "none"
            self.default_knob = float(rate)
        if prod and (rate is not None and rate < 1):
            raise ValueError("TurboQuant_prod needs rate >= 1 (rate - 1 bits MSE + 1 bit QJL)")

    def encode(self, name, x, rate, ctx):
        rate = float(self.default_knob if rate is None else rate)
        X = _heads(x)
        H, T, d = X.shape
        heads = []
        bits = meta = 0
        for h in range(H):
            if self.prod:
                p_mse, b1, m1 = mse_encode(X[h], rate - 1.0, self.seed) if rate > 1 else (None, 0, 0)
                xm = mse_decode(p_mse, T, self.seed) if p_mse is not None else np.zeros((T, d))
                signs, gamma = qjl_encode(X[h] - xm, qjl_matrix(d, self.qjl_seed))
                g16, gb = _norms16(gamma)
                heads.append((p_mse, signs, g16))
                bits += b1 + signs.size + gb * T
                meta += m1 + gb * T
            else:
                p, b1, m1 = mse_encode(X[h], rate, self.seed)
                heads.append(p)
                bits += b1
                meta += m1
        return Encoded(int(bits), (heads, T, d), int(meta))

    def decode(self, name, enc, shape, ctx):
        heads, T, d = enc.payload
        out = np.empty((len(heads), T, d))
        for h, p in enumerate(heads):
            if self.prod:
                p_mse, signs, g16 = p
                xm = mse_decode(p_mse, T, self.seed) if p_mse is not None else 0.0
                out[h] = xm + qjl_decode(signs, g16, qjl_matrix(d, self.qjl_seed))
            else:
                out[h] = mse_decode(p, T, self.seed)
        return out.reshape(shape).astype(np.float32)


def _rate_tag(r: float) -> str:
    return f"{r:g}".replace(".", "p")


def baselines() -> dict[str, TensorCodec]:
    out: dict[str, TensorCodec] = {}
    for r in (2.0, 2.5, 3.0, 3.5, 4.0):
        n = f"turboquant_mse_{_rate_tag(r)}"
        out[n] = TurboQuant(n, r)
    for r in (2.0, 2.5, 3.0, 3.5, 4.0):
        n = f"turboquant_prod_{_rate_tag(r)}"
        out[n] = TurboQuant(n, r, prod=True)
    out["turboquant_mse"] = TurboQuant("turboquant_mse", None)
    out["turboquant_prod"] = TurboQuant("turboquant_prod", None, prod=True)
    return out
