"""The versioned family of static token models used by the entropy coder (``kvz-models-v1``).

Each model is a table of integer token frequencies ``freq[m, t]`` (``t < 128``, see
:mod:`alignpred.entropy.rans` for the token mapping) that sum to exactly ``2**PREC`` with every token
``>= 1``, so every int32 value can be coded with every model.  The tables are generated once by::

    python -m alignpred.entropy.models --regenerate

and committed as ``alignpred/entropy/data/models_v1.npz`` (plain arrays, no pickle).  At load time the
sha256 of the canonical bytes (header string + ``freq`` as ``<u2`` + ``cost_fx`` as ``<u4``) is
checked against :data:`TABLES_SHA256`; a mismatch is a hard error, because the bitstream is only
decodable with bit-identical tables.

The family is chosen by greedy facility location over a pool of candidate distributions:
quantised (round-to-nearest) Gaussian, generalised Gaussian (beta 1.5, 0.7), Laplace,
Student-t (nu 3, 1.5) over scales 0.02 .. 2**18, biased versions (loc != 0) at small scales,
zero-inflated mixtures (peaky) and asymmetric Laplace (skewed).

>>> t = load()
>>> t.freq.shape == (n_models(), N_TOKENS), int(t.freq.sum(axis=1).min()) == 1 << PREC
(True, True)
>>> MODEL_SET_ID
'kvz-models-v1'
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import heapq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from alignpred.entropy.rans import COARSE_SHIFT, K_DIRECT, N_TOKENS, PREC, token_tables

MODEL_SET_ID = "kvz-models-v1"
TABLE_PATH = Path(__file__).resolve().parent / "data" / "models_v1.npz"
# sha256 of canonical_bytes(freq, cost_fx); printed by --regenerate.
TABLES_SHA256 = "87dd0e5d13a21694f399c7653772caf47cd63458ff76cf134bac529412a9811b"
N_MODELS_TARGET = 240
COST_FX_BITS = 16   # cost_fx is in units of 2**-16 bit


@dataclass(frozen=True)
class Tables:
    """Loaded model tables plus the derived coder lookup tables (read-only arrays)."""

    freq: np.ndarray      # uint32 [M, T]
    cum: np.ndarray       # uint32 [M, T]   exclusive prefix sums
    packed: np.ndarray    # uint32 [M, T]   freq << 16 | cum
    slot2tok: np.ndarray  # uint8  [M, 2**PREC]  token of each slot
    coarse: np.ndarray    # uint8  [M, 2**(PREC - COARSE_SHIFT)]  slot2tok[:, ::2**COARSE_SHIFT]
    cumhi: np.ndarray     # uint16 [M, T]   cum + freq
    cost_fx: np.ndarray   # uint32 [M, T]   round((PREC - log2 freq) * 2**16)
    base: np.ndarray      # uint64 [T]      u = base | raw << 1
    nbits: np.ndarray     # uint64 [T]      raw bits per token
    kind: np.ndarray      # str [M]         family member description (informative)
    params: np.ndarray    # float64 [M, 4]  (scale, loc, weight, shape) (informative)


def canonical_bytes(freq: np.ndarray, cost_fx: np.ndarray) -> bytes:
    """The bytes covered by :data:`TABLES_SHA256`."""
    m, t = freq.shape
    head = f"{MODEL_SET_ID}|PREC={PREC}|K={K_DIRECT}|T={t}|M={m}|".encode()
    return head + np.ascontiguousarray(freq, dtype="<u2").tobytes() + \
        np.ascontiguousarray(cost_fx, dtype="<u4").tobytes()


def _validate(freq: np.ndarray) -> None:
    if freq.ndim != 2 or freq.shape[1] != N_TOKENS or not 1 <= freq.shape[0] <= 256:
        raise RuntimeError(f"model table has bad shape {freq.shape}")
    if int(freq.min()) < 1 or np.any(freq.sum(axis=1, dtype=np.int64) != (1 << PREC)):
        raise RuntimeError("model table frequencies must be >= 1 and sum to 2**PREC")


@functools.lru_cache(maxsize=1)
def load() -> Tables:
    """Load, verify (sha256) and expand the committed tables; cached."""
    from alignpred.io import read_npz

    z = read_npz(TABLE_PATH)
    freq = z["freq"].astype(np.uint32)
    cost_fx = z["cost_fx"].astype(np.uint32)
    kind = z["kind"].copy()
    params = z["params"].astype(np.float64)
    prec = int(z["prec"])
    set_id = str(z["set_id"])
    digest = hashlib.sha256(canonical_bytes(freq, cost_fx)).hexdigest()
    if digest != TABLES_SHA256 or prec != PREC or set_id != MODEL_SET_ID:
        raise RuntimeError(
            f"entropy model tables {TABLE_PATH.name} do not match {MODEL_SET_ID} "
            f"(sha256 {digest}); the file is corrupt or from another version")
    _validate(freq)
    cum = np.zeros_like(freq)
    cum[:, 1:] = np.cumsum(freq, axis=1, dtype=np.uint32)[:, :-1]
    packed = (freq << np.uint32(16)) | cum
    tok_ids = np.arange(N_TOKENS, dtype=np.uint8)
    # every row's frequencies sum to 2**PREC (checked by _validate): one repeat over the flat table
    slot2tok = np.repeat(np.tile(tok_ids, len(freq)), freq.ravel()).reshape(len(freq), -1)
    coarse = np.ascontiguousarray(slot2tok[:, ::1 << COARSE_SHIFT])
    cumhi = (cum + freq).astype(np.uint16 if PREC < 16 else np.uint32)
    base, nbits = token_tables()
    arrays = (freq, cum, packed, slot2tok, coarse, cumhi, cost_fx, base, nbits, kind, params)
    for a in arrays:
        a.setflags(write=False)
    return Tables(*arrays)


def n_models() -> int:
    """Number of models in the committed family."""
    return int(load().freq.shape[0])


# ----------------------------------------------------------------------------------------
# Generation (only run by --regenerate; not needed at run time)
# ----------------------------------------------------------------------------------------

def token_intervals() -> tuple[np.ndarray, np.ndarray]:
    """Inclusive value interval [lo, hi] (int64) covered by each token."""
    base, nbits = token_tables()
    lo = np.empty(N_TOKENS, np.int64)
    hi = np.empty(N_TOKENS, np.int64)
    for t in range(N_TOKENS):
        b = int(base[t])
        span = (1 << int(nbits[t])) - 1
        u_lo, u_hi = b, b + 2 * span
        if b & 1:   # negative: v = -(u+1)/2
            lo[t], hi[t] = -((u_hi + 1) // 2), -((u_lo + 1) // 2)
        else:
            lo[t], hi[t] = u_lo // 2, u_hi // 2
    return lo, hi


def _mass(dist, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """P(round(X) in [lo, hi]) for a frozen scipy distribution, tail-accurate."""
    a = lo - 0.5
    b = hi + 0.5
    med = float(dist.median())
    pos = a >= med
    out = np.where(pos, dist.sf(a) - dist.sf(b), dist.cdf(b) - dist.cdf(a))
    return np.maximum(out, 0.0)


def _token_probs(spec: tuple) -> np.ndarray:
    """Token distribution of one candidate: (kind, scale, loc, weight, shape)."""
    from scipy import stats

    kind, scale, loc, weight, shape = spec
    lo, hi = token_intervals()
    if kind == "gauss":
        d = stats.norm(loc=loc, scale=scale)
    elif kind == "laplace":
        d = stats.laplace(loc=loc, scale=scale)
    elif kind == "gennorm":
        d = stats.gennorm(shape, loc=loc, scale=scale)
    elif kind == "t":
        d = stats.t(shape, loc=loc, scale=scale)
    elif kind == "alaplace":
        d = stats.laplace_asymmetric(shape, loc=loc, scale=scale)
    else:
        raise ValueError(kind)
    p = _mass(d, lo, hi)
    p = p / p.sum()
    if weight > 0:  # zero-inflated: weight * delta_0 + (1 - weight) * d
        p = (1 - weight) * p
        p[0] += weight
    return p


def quantize_probs(p: np.ndarray, total: int = 1 << PREC) -> np.ndarray:
    """Integer frequencies >= 1 summing to ``total`` that minimise the cross entropy
    sum p * -log2(f / total) (greedy exchange; deterministic tie-break by token index).

    >>> quantize_probs(np.array([0.5, 0.25, 0.25, 0.0]), 16).tolist()
    [7, 4, 4, 1]
    """
    p = np.asarray(p, np.float64)
    f = np.maximum(1, np.floor(p * total)).astype(np.int64)
    # gain of adding one to f[t]: p log((f+1)/f); loss of removing one: p log(f/(f-1))
    diff = total - int(f.sum())
    if diff > 0:
        heap = [(-(p[t] * np.log1p(1.0 / f[t])), t) for t in range(len(p))]
        heapq.heapify(heap)
        for _ in range(diff):
            _, t = heapq.heappop(heap)
            f[t] += 1
            heapq.heappush(heap, (-(p[t] * np.log1p(1.0 / f[t])), t))
    elif diff < 0:
        heap = [((p[t] * -np.log1p(-1.0 / f[t])) if f[t] > 1 else np.inf, t)
                for t in range(len(p))]
        heapq.heapify(heap)
        for _ in range(-diff):
            _, t = heapq.heappop(heap)
            f[t] -= 1
            heapq.heappush(heap, ((p[t] * -np.log1p(-1.0 / f[t])) if f[t] > 1 else np.inf, t))
    assert f.sum() == total and f.min() >= 1
    return f


def candidate_pool() -> list[tuple]:
    """All candidate distributions the family is selected from."""
    pool: list[tuple] = []
    scales = 2.0 ** np.arange(np.log2(0.02), 18.0 + 1e-9, 0.125)
    for kind, shape in (("gauss", 0.0), ("gennorm", 1.5), ("laplace", 0.0),
                        ("gennorm", 0.7), ("t", 3.0), ("t", 1.5)):
        for s in scales:
            pool.append((kind, float(s), 0.0, 0.0, shape))
    # biased (loc != 0) at small/medium scales
    for kind, shape in (("gauss", 0.0), ("laplace", 0.0)):
        for s in 2.0 ** np.arange(-3.0, 3.01, 0.25):
            for loc in (-0.5, -0.35, -0.2, -0.1, 0.1, 0.2, 0.35, 0.5):
                pool.append((kind, float(s), loc, 0.0, shape))
    # peaky: zero-inflated Laplace / t3
    for kind, shape in (("laplace", 0.0), ("t", 3.0)):
        for s in 2.0 ** np.arange(0.0, 12.01, 0.5):
            for w in (0.3, 0.5, 0.7, 0.85, 0.95):
                pool.append((kind, float(s), 0.0, w, shape))
    # skewed: asymmetric Laplace
    for s in 2.0 ** np.arange(-2.0, 10.01, 0.5):
        for kappa in (0.5, 0.7, 1.0 / 0.7, 2.0):
            pool.append(("alaplace", float(s), 0.0, 0.0, kappa))
    return pool


def select_family(pool: list[tuple], n_models: int, verbose: bool = True):
    """Greedy facility location: pick tables minimising the summed relative overhead."""
    P = np.array([_token_probs(s) for s in pool])                       # [K, T]
    F = np.array([quantize_probs(p) for p in P])                         # [K, T]
    _, nbits = token_tables()
    Q = np.log2(F / float(1 << PREC))                                    # [K, T]
    with np.errstate(divide="ignore", invalid="ignore"):
        h_tok = -np.nansum(np.where(P > 0, P * np.log2(P), 0.0), axis=1)
    h_tot = h_tok + P @ nbits.astype(np.float64)
    xent = -(P @ Q.T)                                                    # [K(data), K(table)]
    over = xent - h_tok[:, None]
    # the coder goal: overhead <= max(1.5% of entropy, 0.02 bit); aim well below
    norm = np.maximum(0.005 * h_tot, 0.004)[:, None]
    cost = over / norm
    chosen: list[int] = []
    best = np.full(len(pool), np.inf)
    cap = 50.0
    for _ in range(n_models):
        cand = np.minimum(np.minimum(best[:, None], cost), cap).sum(axis=0)
        j = int(np.argmin(cand))
        chosen.append(j)
        best = np.minimum(best, cost[:, j])
    chosen_sorted = sorted(chosen, key=lambda j: (pool[j][0], pool[j][4], pool[j][3],
                                                  pool[j][2], pool[j][1]))
    if verbose:
        worst = np.argsort(-best)[:8]
        print(f"selected {len(chosen)} of {len(pool)}; worst normalised overheads:")
        for k in worst:
            print(f"  {pool[k]}  overhead {over[k, chosen][np.argmin(cost[k, chosen])]:.4f} bit"
                  f"  H={h_tot[k]:.3f}  rel={best[k]:.2f}")
    return [pool[j] for j in chosen_sorted], F[chosen_sorted]


def regenerate(path: Path = TABLE_PATH, n_models: int = N_MODELS_TARGET) -> str:
    """Rebuild the family and write the npz; returns the sha256 to paste into TABLES_SHA256."""
    with np.errstate(all="ignore"):
        specs, freq = select_family(candidate_pool(), n_models)
    # model 0 is always the "everything is zero" table (cheapest possible zeros)
    zero = np.ones(N_TOKENS, np.int64)
    zero[0] = (1 << PREC) - (N_TOKENS - 1)
    keep = [k for k in range(len(specs)) if not np.array_equal(freq[k], zero)][:n_models - 1]
    specs = [("zero", 0.0, 0.0, 1.0, 0.0)] + [specs[k] for k in keep]
    freq = np.vstack([zero[None], freq[keep]])
    freq = freq.astype(np.uint16)
    cost_fx = np.rint((PREC - np.log2(freq.astype(np.float64))) * (1 << COST_FX_BITS))
    cost_fx = cost_fx.astype(np.uint32)
    _validate(freq.astype(np.uint32))
    kind = np.array([f"{s[0]}" for s in specs], dtype="<U16")
    params = np.array([[s[1], s[2], s[3], s[4]] for s in specs], dtype=np.float64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, freq=freq, cost_fx=cost_fx, kind=kind, params=params,
                        prec=np.array(PREC, np.int64), set_id=np.array(MODEL_SET_ID))
    return hashlib.sha256(canonical_bytes(freq, cost_fx)).hexdigest()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regenerate", action="store_true", help="rebuild models_v1.npz")
    ap.add_argument("--n-models", type=int, default=N_MODELS_TARGET)
    args = ap.parse_args(argv)
    if args.regenerate:
        digest = regenerate(n_models=args.n_models)
        print(f"wrote {TABLE_PATH.name} ({TABLE_PATH.stat().st_size} bytes)")
        print(f'TABLES_SHA256 = "{digest}"')
    else:
        t = load()
        print(f"{MODEL_SET_ID}: {t.freq.shape[0]} models, PREC={PREC}, sha256 ok")


if __name__ == "__main__":
    main()
