"""Prediction: per block, the coding frame (centring, RoPE undone, optional GPA rotation) and the
predictors, chosen per channel.

A channel's *mode* is ``base | INTERP``: the base prediction is ``ZERO`` (the bank mean),
``MAP`` (the bank's linear map from already-decoded blocks at the same position: cross-layer
and K->V) or ``BLEND`` (the paper's aligned predictor ``lambda_v * mean of earlier aligned blocks
of the group``); with ``INTERP`` the base residual is further predicted by token interpolation
inside each object (even positions first, then odd positions from the mean of their
reconstructed even neighbours; the last odd position uses its left neighbour).

>>> import numpy as np
>>> w = np.array([[1.0], [2.0], [3.0], [5.0]], np.float32)
>>> q, wh = quantize_residual(w, np.full(4, 0.5, np.float32), np.array([True]), 256)
>>> q.ravel().tolist(), wh.ravel().tolist()
([2, 0, 6, 4], [1.0, 2.0, 3.0, 5.0])
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .errors import BankMismatchError, EncodeError

ZERO, MAP, BLEND = 0, 1, 2
INTERP = 4
MODE_NAMES = {ZERO: "zero", MAP: "map", BLEND: "blend"}


@dataclass(frozen=True)
class CodecConfig:
    """Every switch that changes the bitstream; written into the file header.

    ``align``: code blocks in their GPA-aligned frame. ``inter_map``: allow the linear-map
    predictor. ``blend``: allow the paper's lambda-blended aligned predictor. ``intra``: allow
    token interpolation. ``channel_choice``: choose the mode per channel (else one per block).
    ``rope_undo``: code keys with RoPE undone. ``sink_tokens``/``sink_scale``: the first
    ``sink_tokens`` positions of the cache (the attention sink, where errors in the keys cost the
    most downstream) are quantised with the step times ``sink_scale``; a header without these
    keys means 0 / 1.0 (off).
    """

    object_size: int = 256
    align: bool = False
    inter_map: bool = True
    blend: bool = False
    intra: bool = True
    channel_choice: bool = True
    rope_undo: bool = True
    lambdas: tuple = (0.5, 0.75)
    sink_tokens: int = 1
    sink_scale: float = 0.0625

    def __post_init__(self):
        if not (isinstance(self.sink_tokens, int) and self.sink_tokens >= 0
                and 0.0 < float(self.sink_scale) <= 1.0 and float(np.float32(self.sink_scale)) == float(self.sink_scale)):
            from .errors import KvzError

            raise KvzError("sink_tokens must be >= 0 and sink_scale a float32 in (0, 1]")

    def to_json(self) -> dict:
        d = asdict(self)
        d["lambdas"] = list(self.lambdas)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CodecConfig":
        d = dict(d)
        d["lambdas"] = tuple(d.get("lambdas", (0.5, 0.75)))
        d.setdefault("sink_tokens", 0)  # absent: files written before the sink option
        d.setdefault("sink_scale", 1.0)
        return cls(**d)

    def scale_sink(self, delta_rows: np.ndarray, start: int) -> None:
        """Multiply (in float32, in place) the steps of rows at cache positions < sink_tokens;
        ``delta_rows[0]`` is position ``start``."""
        k = min(len(delta_rows), self.sink_tokens - start)
        if k > 0:
            delta_rows[:k] *= np.float32(self.sink_scale)

    def candidate_modes(self, has_map: bool, has_blend: bool) -> list[int]:
        bases = [ZERO] + ([MAP] if self.inter_map and has_map else []) + ([BLEND] if self.blend and has_blend else [])
        return bases + ([b | INTERP for b in bases] if self.intra else [])


@dataclass
class BlockPlan:
    """Everything needed to predict one block, in its coding frame."""

    block: str
    mean: np.ndarray
    rot: np.ndarray | None
    map_sources: list
    map_u: np.ndarray | None = None
    map_vt: np.ndarray | None = None
    blend_refs: list | None = None
    blend_lambda: float = 0.0
    object_size: int = 256

    def base(self, mode: int, recon: dict, rows: slice | None = None):
        """Base prediction ``[n, d]`` for ``mode`` from reconstructed sources (coding frame)."""
        b = mode & 3
        if b == MAP:
            # Object by object, so every object's prediction comes from products of the same shape
            # whether the whole tensor or a token range is decoded (BLAS may round differently
            # for other shapes); per source, to avoid a concatenated copy.
            d_src = self.map_u.shape[0] // len(self.map_sources)
            src = [recon[s] if rows is None else recon[s][rows] for s in self.map_sources]
            n = src[0].shape[0]
            out = np.empty((n, self.mean.shape[0]), np.float32)
            u = self.map_u.astype(np.float32, copy=False)  # float16 banks: widened per call (exact)
            for a in range(0, n, self.object_size):
                y = None
                for k, x in enumerate(src):
                    t = x[a:a + self.object_size] @ u[k * d_src:(k + 1) * d_src]
                    y = t if y is None else y + t
                out[a:a + self.object_size] = y if self.map_vt is None else y @ self.map_vt
            return out
        if b == BLEND:
            refs = [recon[s] if rows is None else recon[s][rows] for s in self.blend_refs]
            return (self.blend_lambda / len(refs)) * sum(refs)
        return None

    def predict(self, modes: np.ndarray, recon: dict, n: int) -> np.ndarray:
        """Base prediction ``[n, d]`` with each channel's own mode (float32)."""
        bases = modes & 3
        kinds = np.unique(bases).tolist()
        if kinds == [ZERO]:
            return np.zeros((n, self.mean.shape[0]), np.float32)
        if len(kinds) == 1:
            return np.asarray(self.base(kinds[0], recon), np.float32)
        out = np.zeros((n, self.mean.shape[0]), np.float32)
        for bb in kinds:
            if bb != ZERO:
                out = np.where(bases == bb, self.base(bb, recon), out)
        return out.astype(np.float32, copy=False)


def build_plans(layout, bank, config: CodecConfig) -> dict[str, BlockPlan]:
    """Per-block prediction plans from the bank (maps moved into the coding frame)."""
    from .bank import block_name

    bank.check_layout(layout)
    plans = {}
    for i in range(layout.num_layers):
        for kind in ("K", "V"):
            for h in range(layout.kv_heads):
                b = block_name(kind, i, h)
                try:
                    mean = bank.mean(b)
                except KeyError:
                    raise BankMismatchError(f"bank has no mean for block {b}") from None
                rot = bank.rotation(b) if config.align else None
                if config.align and rot is None:
                    raise BankMismatchError("alignment requested but the bank has no rotations")
                plans[b] = BlockPlan(block=b, mean=mean, rot=rot, map_sources=bank.sources(b),
                                     object_size=config.object_size)
    for b, p in plans.items():
        f = bank.map_factors(b) if config.inter_map else None
        if f is not None and p.map_sources:
            u, vt = f
            if config.align:
                # refs arrive aligned (z_u = x_u A_u): undo each source rotation, then rotate into A_b.
                d = p.mean.shape[0]
                u = np.concatenate([plans[s].rot.T @ u[k * d:(k + 1) * d] for k, s in enumerate(p.map_sources)], axis=0)
                if vt is None:
                    u = u @ p.rot
                else:
                    vt = vt @ p.rot
            # A full map straight from the bank stays in its stored dtype (float16 halves the
            # memory of the bundled bank's maps); ``base`` widens it to float32, exactly.
            keep = vt is None and not config.align and u.dtype in (np.float16, np.float32) and u.flags.c_contiguous
            p.map_u = u if keep else np.ascontiguousarray(u, np.float32)
            p.map_vt = None if vt is None else np.ascontiguousarray(vt, np.float32)
        if config.blend:
            g = bank.group_of(b)
            k = g.index(b)
            if k > 0:
                p.blend_refs = g[:k]
                p.blend_lambda = float(config.lambdas[0] if k == 1 else config.lambdas[1])
    return plans


def quantize_residual(w: np.ndarray, delta_rows: np.ndarray, interp: np.ndarray, object_size: int):
    """Quantise the base residual ``w [n, d]`` (rows = positions from an object boundary, each
    row's step in ``delta_rows``); channels with ``interp`` use token interpolation.
    Returns ``(q int32 [n, d], reconstructed residual [n, d])``."""
    dr = delta_rows[:, None].astype(np.float32)
    q = np.rint(w.astype(np.float32) / dr)
    wh = q * dr
    if interp.any():
        cols = np.nonzero(interp)[0]
        wi = w[:, cols]
        qi = q[:, cols]
        whi = wh[:, cols]
        pred = interp_prediction(whi, object_size)
        odd = slice(1, None, 2)
        qo = np.rint((wi[odd] - pred) / dr[odd])
        qi[odd] = qo
        whi[odd] = pred + qo * dr[odd]
        q[:, cols] = qi
        wh[:, cols] = whi
    if q.size and float(np.max(np.abs(q))) >= 2.0 ** 30:
        raise EncodeError("quantisation step too small for the residuals (eps too small?)")
    return q.astype(np.int32), wh.astype(np.float32)


def interp_prediction(wh: np.ndarray, object_size: int) -> np.ndarray:
    """Prediction of the odd rows from the reconstructed even rows (within objects)."""
    n = wh.shape[0]
    left = wh[0:n - 1:2] if n > 1 else wh[:0]
    odd_t = np.arange(1, n, 2)
    right_t = odd_t + 1
    ok = (right_t < n) & (right_t % object_size != 0)
    right = wh[np.where(ok, right_t, odd_t - 1)]
    return np.where(ok[:, None], 0.5 * (left + right), left)


def dequantize_residual(q: np.ndarray, delta_rows: np.ndarray, interp: np.ndarray, object_size: int):
    """Decoder side of :func:`quantize_residual`."""
    dr = delta_rows[:, None].astype(np.float32)
    q = q.astype(np.float32)
    wh = q * dr
    if interp.any():
        cols = np.nonzero(interp)[0]
        whi = wh[:, cols]
        pred = interp_prediction(whi, object_size)
        whi[1::2] = pred + q[1::2][:, cols] * dr[1::2]
        wh[:, cols] = whi
    return wh.astype(np.float32)


def channel_entropy_bits(q: np.ndarray, block: int = 16) -> np.ndarray:
    """Empirical zeroth-order entropy, in bits, of each column of ``q [n, d]`` (float64 ``[d]``).
    The cost proxy used to choose a predictor per channel; computed ``block`` columns at a time
    so its temporaries stay small for long caches.

    >>> channel_entropy_bits(np.array([[0, 1], [0, 2], [0, 1], [0, 2]])).tolist()
    [0.0, 4.0]
    """
    n, d = q.shape
    per = np.zeros(d)
    if n == 0:
        return per
    for c0 in range(0, d, block):
        s = np.sort(q[:, c0:c0 + block], axis=0).T  # [b, n]
        start = np.ones(s.shape, dtype=bool)
        start[:, 1:] = s[:, 1:] != s[:, :-1]
        col, pos = np.nonzero(start)
        nxt = np.empty_like(pos)
        nxt[:-1] = pos[1:]
        last = np.ones(len(pos), dtype=bool)
        last[:-1] = col[1:] != col[:-1]
        nxt[last] = n
        run = (nxt - pos).astype(np.float64)
        np.add.at(per, col + c0, run * np.log2(run))
    return n * np.log2(n) - per
