"""Checks that catch silent loss of compression before any work is done.

* A bank fitted with RoPE undone on keys, used on a cache whose metadata says its keys carry no
  RoPE, is a mismatch (:class:`BankMismatchError`): the keys would be coded in the wrong frame.
* Keys that *look* rotated although the metadata says ``keys_roped: false`` raise a
  :class:`KvzWarning`: RoPE turns the fastest channel pair by one radian per token (its inverse
  frequency is 1 whatever the base), so the pair's mean over tokens vanishes unless the rotation
  is taken out; if demodulating it by 1 rad/token concentrates far more energy in the mean than
  leaving it alone, the keys carry RoPE. Measured on Gemma 3 270M keys: ratio 10^2..10^4 with
  RoPE, < 1 with it undone.
"""
from __future__ import annotations

import warnings

import numpy as np

from alignpred.cache.layout import tensor_name
from alignpred.errors import BankMismatchError, KvzWarning

RATIO = 20.0  # demodulated / plain mean energy of the fastest pair above which keys look rotated
FRACTION = 0.05  # ... and the demodulated mean must hold this much of the pair's energy (noise: ~1/T)
MIN_TOKENS = 64
SAMPLE_TOKENS = 2048


def rotation_ratio(k: np.ndarray, pairing: str = "half") -> tuple[float, float]:
    """For key rows ``k [T, d]``: ``(ratio, fraction)`` — the energy of the mean of the fastest
    RoPE pair demodulated at 1 rad/token over the energy of its plain mean, and the demodulated
    mean's share of the pair's energy (Gemma 3 keys with RoPE: 0.15–0.66; noise: about 1/T)."""
    k = np.asarray(k, np.float64)
    T, d = k.shape
    a, b = (k[:, 0], k[:, d // 2]) if pairing == "half" else (k[:, 0], k[:, 1])
    z = a + 1j * b
    t = np.arange(T)
    energy = float(np.mean(abs(z) ** 2))
    if not energy > 0:
        return 0.0, 0.0
    plain = abs(z.mean()) ** 2
    demod = abs((z * np.exp(-1j * t)).mean()) ** 2
    return float(demod / max(plain, 1e-12 * energy)), float(demod / energy)


def looks_roped(tensors: dict, layout, layers: int = 3) -> tuple[bool, str, float]:
    """Whether the keys of the first ``layers`` layers look RoPE-rotated: ``(verdict, tensor
    name, best ratio)``."""
    if layout.head_dim % 2 or layout.n_tokens < MIN_TOKENS:
        return False, "", 0.0
    best = (0.0, "")
    for i in range(min(layers, layout.num_layers)):
        arr = tensors[tensor_name(i, "K")]
        arr = arr[0] if layout.batch_dim else arr
        for h in range(min(layout.kv_heads, 2)):
            k = np.asarray(arr[h, :SAMPLE_TOKENS], np.float32)
            for pairing in ("half", "interleaved"):
                r, frac = rotation_ratio(k, pairing)
                if frac > max(FRACTION, 10.0 / len(k)):
                    best = max(best, (r, tensor_name(i, "K")))
    return best[0] > RATIO, best[1], best[0]


def check_rope(layout, bank, tensors) -> None:
    """Refuse a RoPE-undo bank for keys said to carry no RoPE; warn on keys that look rotated."""
    if layout.keys_roped:
        return
    roped, name, ratio = looks_roped(tensors, layout)
    if bank.config.get("rope_undone") is True:
        hint = f" ({name} does look RoPE-rotated)" if roped else ""
        raise BankMismatchError("the bank was fitted on keys with RoPE undone, but the cache's metadata says its "
                                f"keys carry no RoPE{hint}: if they do (keys from a transformers cache always "
                                "do), add keys_roped=true and rope_theta (or rope) to the metadata; otherwise "
                                "fit a bank on caches like this one (kvz calibrate)")
    if roped:
        warnings.warn(f"{name} looks RoPE-rotated (demodulation ratio {ratio:.0f}) but the metadata says "
                      "keys_roped=false: keys will compress about 1 bit/value worse. Add keys_roped=true and "
                      "rope_theta (or rope) to the metadata (kvz capture records them)", KvzWarning, stacklevel=3)
