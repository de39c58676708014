"""Per-tensor-name PCA bases fitted on calibration caches (a reusable auxiliary bank, excluded from bpv)."""
from __future__ import annotations

import numpy as np


def fit_pca_bank(calib: list[dict[str, np.ndarray]], names) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For each name: (mean [H, D], basis [H, D, D] with columns = components by decreasing variance,
    variances [H, D]), from the calibration caches' tensors of the same name (tokens pooled)."""
    bank = {}
    for name in names:
        parts = [c[name] for c in calib if name in c]
        if not parts:
            raise KeyError(f"no calibration data for {name}")
        x = np.concatenate([p.astype(np.float64) for p in parts], axis=-2)  # [H, T, D]
        mu = x.mean(axis=-2)
        xc = x - mu[:, None, :]
        cov = np.matmul(np.swapaxes(xc, -1, -2), xc) / max(1, x.shape[-2] - 1)
        w, v = np.linalg.eigh(cov)
        order = np.argsort(w, axis=-1)[:, ::-1]
        w = np.take_along_axis(w, order, axis=-1)
        v = np.take_along_axis(v, order[:, None, :], axis=-1)
        bank[name] = (mu, v, np.maximum(w, 0.0))
    return bank


def bank_bits(bank, with_mean: bool) -> int:
    """Size of the bank if stored as float32 (reported, not counted in bpv)."""
    tot = 0
    for mu, v, _ in bank.values():
        tot += 32 * v.size + (32 * mu.size if with_mean else 0)
    return tot
